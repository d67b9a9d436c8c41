"""Host memory of a CPU run: no PyTorch behind the TensorBoard writer, free pages handed back, and
tformer-estimate's host-RSS terms (the LoRA optimizer state included)."""
import subprocess
import sys

from tformer_jax.analysis import estimate as est_lib
from tformer_jax.backends.cpu import host_alloc
from tformer_jax.cli_common import load_named_config

from train_utils import tiny_config

MiB = 1 << 20


def test_tensorboard_writer_does_not_import_torch(tmp_path):
  code = ("import sys; from tformer_jax.train.metrics import MetricWriter\n"
          f"w = MetricWriter({str(tmp_path)!r}, enabled=True, loggers=('jsonl', 'tensorboard'))\n"
          "w.write(1, {'loss': 1.0}); w.close()\n"
          "print('torch' in sys.modules); import torch; print(torch.__name__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["False", "torch"]          # torch stays importable afterwards
  assert list((tmp_path / "tb").iterdir())


def test_release_free_memory_reaches_the_allocator():
  assert host_alloc.release_free_memory() in ("MallocExtension_ReleaseFreeMemory", "malloc_trim")


def test_host_rss_terms():
  cfg = tiny_config(steps=10)
  est = est_lib.estimate_config(cfg, platform="cpu")
  h = est_lib.host_rss(est, cfg)
  state = est.bytes["params"] + est.bytes["optimizer"] + est.bytes["batch"]
  assert h["state"] == state and h["step_temp"] == est_lib.TEMP_COPIES * (est.total - state)
  assert h["peak"] == h["runtime"] + state + max(h["step_temp"], h["checkpoint"], h["init_from"])
  assert "peak" in est_lib.format_host(h)


def test_lora_estimate_counts_the_adapters_only():
  cfg = load_named_config("finetune_hf")
  cfg.data.batch_size, cfg.data.seq_len = 2, 64
  full = est_lib.estimate_config(cfg, platform="cpu")
  cfg.train.init_from, cfg.train.lora.rank = "hf:unused", 8
  lora = est_lib.estimate_config(cfg, platform="cpu")
  adapters, _ = est_lib.lora_shapes(est_lib.setup_lib.resolve_model_config(cfg, check_paths=False),
                                    (("q", "k", "v", "o"), 8))
  # 4 layers of d_model 256, 8/2 heads of 32: 4 x 8 x (2 x 512 + 2 x 320) = 53,248 adapter parameters
  assert adapters == 53_248
  assert abs(lora.bytes["optimizer"] - 2 * 4 * adapters) < 64              # AdamW: mu, nu (+ a count)
  assert lora.bytes["params"] == full.bytes["params"] + 4 * adapters
