"""Ahead-of-time compilation of the real train step for TPU topologies on this CPU (tformer_jax/aot/).

Needs libtpu (the `tpu-aot` extra, installed by scripts/test.sh); without it every test here skips with
the reason. One tiny Llama-style config (MHA 4 x 128, d_model 512 so every FSDP shard is a whole TPU
tile, 2 scanned layers, float32) is compiled for v5e:2x2 (4 chips) sharded and unsharded, for 2 slices
of it, and a large one that does not fit; each compile takes seconds. The roofline's arithmetic is
tests/test_roofline.py's; here its figures on a real compiled step.
"""
import contextlib
import io
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest

from tformer_jax import aot, cli_common
from tformer_jax.cli import aot as aot_cli
from tformer_jax.parallel import mesh as mesh_lib

OK, WHY = aot.libtpu_available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)

V, D, L, H, FF, SEQ, BATCH = 512, 512, 2, 4, 1024, 128, 8
TINY = ["--config=configs/llama_tiny.py", f"--config.model.vocab_size={V}", f"--config.model.d_model={D}",
        f"--config.model.num_layers={L}", f"--config.model.num_heads={H}", f"--config.model.num_kv_heads={H}",
        f"--config.model.d_ff={FF}", f"--config.model.max_len={SEQ}", "--config.model.scan_layers=true",
        f"--config.data.seq_len={SEQ}", f"--config.data.batch_size={BATCH}", "--config.train.steps=10",
        "--config.optim.warmup_steps=1"]
FSDP = ["--config.mesh.shape=(1,-1,1)", "--config.mesh.rules=fsdp"]
GiB = 1024 ** 3
# parameters by hand: every weight has an 'embed' axis (split by fsdp) except the RMSNorm scales
# (logical axis 'norm': always replicated)
NORMS = (2 * L + 1) * D
WEIGHTS = V * D + D * V + L * (4 * D * D + 3 * D * FF)


def run_aot(*flags: str) -> tuple[int, dict | None, str, str]:
  """tformer-aot in this process, as a fresh process would run it (default matmul precision, not the
  'highest' of conftest): (exit status, the last line's JSON, stdout, stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), jax.default_matmul_precision("default"):
    status = cli_common.run_main(aot_cli.main, [*TINY, *flags])
  lines = out.getvalue().strip().splitlines()
  last = json.loads(lines[-1]) if status in (0, 3) else None
  return status, last, out.getvalue(), err.getvalue()


def entry_parameters(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, per-device shape) of each argument of the compiled program's entry computation."""
  entry = hlo[hlo.index("\nENTRY "):]
  entry = entry[: entry.index("\n}")]
  return [(t, tuple(int(d) for d in dims.split(",") if d))
          for t, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* parameter\(", entry)]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
  hlo = tmp_path_factory.mktemp("aot") / "step.hlo"
  status, report, out, _ = run_aot("--topology=v5e:2x2", *FSDP, f"--hlo={hlo}")
  return status, report, out, hlo.read_text()


def test_fsdp_step_fits_and_its_arguments_are_the_sharded_state(fsdp):
  status, r, out, hlo = fsdp
  assert status == 0 and r["fits"] is True, out
  assert (r["topology"], r["devices"], r["device_kind"], r["mesh"]) == (
      "v5e:2x2", 4, "TPU v5 lite", {"data": 1, "fsdp": 4, "tensor": 1})
  assert r["hbm_bytes"] == 16 * GiB and 0 < r["per_device_bytes"] <= r["hbm_bytes"]
  params = 4 * (WEIGHTS // 4 + NORMS)                                    # float32, fsdp = 4
  assert r["state_bytes"]["params"] == params
  assert 0 <= r["state_bytes"]["opt_state"] - 2 * params <= 64           # AdamW mu + nu (+ step counts)
  assert r["batch_bytes"] == 2 * (BATCH // 4) * SEQ * 4                   # inputs + targets, int32
  # XLA's per-device arguments are exactly those shards: the same bytes once TPU's tiling pads each
  # scalar or short vector (< 128 elements) to a 128-element tile; every other shard is whole tiles
  args = entry_parameters(hlo)
  small = [(t, s) for t, s in args if math.prod(s) < 128]
  padding = sum((128 - math.prod(s)) * 4 for t, s in small)
  state = sum(r["state_bytes"].values())
  assert r["memory"]["argument"] == state + r["batch_bytes"] + padding
  assert ("f32", (L, D // 4, H, D // H)) in args and ("f32", (D // 4, V)) in args    # wq, head shards
  assert r["memory"]["alias"] >= state                                   # the donated state is reused
  # FSDP: parameters gathered for the matmuls, gradients reduce-scattered back (XLA:TPU may run either
  # as a ring of collective-permutes inside a collective matmul)
  c = r["collectives"]
  assert c["all-gather"]["count"] + c["collective-permute"]["count"] > 0
  assert c["reduce-scatter"]["count"] + c["collective-permute"]["count"] > 0
  # the HLO's dots and convolutions, the scanned loop counted twice, against the formula (no remat here);
  # XLA's own cost analysis counts the loop body once: one layer's share less
  assert r["flops_hlo_per_device"] == pytest.approx(r["flops_formula_per_device"], rel=0.02)
  assert r["flops_ratio"] == pytest.approx(1.0, rel=0.02) and not r["replicated_work"]
  assert r["flops_xla_per_device"] < 0.7 * r["flops_hlo_per_device"]
  assert "fits: yes" in out and "collectives per step per device" in out and "WARNING" not in out
  # tformer-estimate's per-device figure beside the peak (a tiny program: XLA's fixed reservations dominate)
  assert 0 < r["estimate_bytes"] < r["per_device_bytes"] and "tformer-estimate" in out
  assert r["estimate_ratio"] == pytest.approx(r["estimate_bytes"] / r["per_device_bytes"])


def test_fsdp_step_roofline(fsdp):
  """The roofline of the same compile (aot/roofline.py): compute = the HLO FLOPs / a v5e's 197 TFLOP/s,
  HBM = bytes / 819 GB/s, the FSDP collectives over the fsdp axis on ICI; the step between the two
  assumptions, and MFU = the formula's FLOPs / step / peak."""
  _, r, out, _ = fsdp
  rf = r["roofline"]
  assert rf["machine"] == "v5e" and rf["peak_flops"] == 197e12 and rf["hbm_bytes_per_s"] == 819e9
  assert rf["flops"] == pytest.approx(r["flops_hlo_per_device"], rel=1e-9)
  assert rf["compute_s"] == pytest.approx(rf["flops"] / 197e12, rel=1e-12)
  assert rf["hbm_s"] == pytest.approx(rf["hbm_bytes"] / 819e9, rel=1e-12) and rf["hbm_bytes"] > r["memory"]["argument"]
  assert {c["over"] for c in rf["collectives"]} <= {"fsdp (ICI)", "- (ICI)"} and rf["collectives_s"] > 0
  lo, hi = r["predicted_step_s_perfect_overlap"], r["predicted_step_s_no_overlap"]
  assert max(rf["compute_s"], rf["hbm_s"], rf["collectives_s"]) <= lo <= hi == pytest.approx(
      rf["compute_s"] + rf["hbm_s"] + rf["collectives_s"])
  assert r["predicted_mfu_perfect_overlap"] == pytest.approx(r["flops_formula_per_device"] / lo / 197e12)
  assert r["predicted_bound"] in ("compute", "HBM", "collectives")
  assert "roofline per step per device" in out and "step, perfect overlap (max)" in out


def test_no_collectives_when_the_mesh_shards_nothing(fsdp):
  """Mesh (1, 1, 4) with rules 'dp': the 'tensor' axis shards no parameter and the batch axes have size
  1, so the 4 devices each run the whole step: no collective at all (the FSDP step above has them). XLA
  attention: the splash kernel runs in a shard_map, whose backward psums over the replicated axis."""
  status, r, out, _ = run_aot("--topology=v5e:2x2", "--config.mesh.shape=(1,1,4)", "--config.mesh.rules=dp",
                              "--config.data.batch_size=2",      # a smaller replicated program compiles faster
                              "--config.runtime.attention=xla")
  assert status == 0 and r["fits"], out
  assert all(c["count"] == 0 and c["bytes"] == 0 for c in r["collectives"].values()), r["collectives"]
  assert sum(c["count"] for c in fsdp[1]["collectives"].values()) > 0
  assert r["state_bytes"]["params"] == 4 * (WEIGHTS + NORMS)             # all replicated
  # each device runs the whole step: 4x its share of the formula, which the tool flags in one line
  assert r["flops_ratio"] == pytest.approx(4.0, rel=0.02) and r["replicated_work"]
  assert len([line for line in out.splitlines() if line.startswith("WARNING: per-device HLO FLOPs")]) == 1


def test_two_slices_hybrid_mesh(tmp_path):
  """2 x v5e:2x2 over DCN: the 'data' axis spans the slices, fsdp stays within one; gradients are
  reduced across the slices."""
  devices = aot.topology_devices("v5e:2x2", num_slices=2)
  cfg = cli_common.load_config("configs/llama_tiny.py", {"mesh.shape": "(2,4,1)"})
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=devices)
  assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
  status, r, out, _ = run_aot("--topology=v5e:2x2", "--num_slices=2", "--config.mesh.shape=(2,4,1)",
                              "--config.mesh.rules=fsdp", f"--json={tmp_path / 'r.json'}")
  assert status == 0 and r["fits"] and r["devices"] == 8 and r["num_slices"] == 2, out
  assert r["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  assert sum(c["count"] for c in r["collectives"].values()) > 0
  # the gradient reduction over 'data' leaves the slice: not in the slice's HLO; the roofline models it on DCN
  assert any("data" in c["over"] and "DCN" in c["over"] for c in r["roofline"]["collectives"]), r["roofline"]
  assert json.loads((tmp_path / "r.json").read_text())["per_device_bytes"] == r["per_device_bytes"]


def test_too_large_exits_3_with_xla_figures():
  """A 2.1B-parameter float32 model replicated on every v5e chip (16 bytes a parameter with AdamW):
  XLA:TPU refuses the program; the tool reports what it needed and exits 3."""
  status, r, out, _ = run_aot("--topology=v5e:2x2", "--config.mesh.rules=dp", "--config.model.d_model=4096",
                              "--config.model.num_layers=12", "--config.model.num_heads=32",
                              "--config.model.num_kv_heads=8", "--config.model.d_ff=11008")
  assert status == aot.EXIT_NO_FIT and r["fits"] is False, out
  assert r["per_device_bytes"] > r["hbm_bytes"] > 0 and sum(r["state_bytes"].values()) > r["hbm_bytes"]
  assert "fits: NO" in out


@pytest.mark.parametrize("flags, message", [
    (("--topology=v9:2x2",), "error: --topology: 'v9:2x2':"),
    (("--topology=v5e",), "error: --topology: expected GENERATION:SHAPE"),
    (("--topology=v5e:2x2", "--config.mesh.shape=(1,8,1)"), "error: mesh.shape: (1, 8, 1) needs 8 devices"),
    (("--topology=v5e:2x2", "--num_slices=2", *FSDP), "error: mesh.shape: (1, 8, 1) over 2 TPU slices"),
    (("--topology=v5e:2x2", "--config.mesh.parallelism=pmap"), "error: mesh.parallelism:"),
])
def test_config_and_topology_errors_are_one_line_status_2(flags, message):
  status, _, out, err = run_aot(*flags)
  assert status == aot.EXIT_CONFIG and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def _compiled_hlo(f, *shapes) -> str:
  """The optimized HLO of `f` compiled by XLA:TPU for one v5e chip (abstract inputs; default matmul
  precision, as a fresh process has it: Mosaic refuses conftest's 'highest' for bf16 operands)."""
  device = aot.topology_devices("v5e:2x2")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in shapes]
  with jax.default_matmul_precision("default"):
    return jax.jit(f).lower(*args).compile().as_text()


def test_kernel_flops_are_counted_from_their_operand_shapes():
  """The TPU kernels are custom calls, not dots: megablox gmm forward and backward (gmm for dx, tgmm for
  dw), jax.lax.ragged_dot and splash attention forward and backward (dq and dkv kernels) are counted at
  their analytic FLOPs, nothing else is a matmul here."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
    splash_attention_mask as masks,
  )
  m, k, n, groups = 512, 256, 384, 4
  x, w, sizes = ((m, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16), ((groups,), jnp.int32)

  def gmm_grads(x, w, g):
    loss = lambda x, w: gmm(x, w, g).astype(jnp.float32).sum()                    # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)
  parts = aot.hlo_flops(_compiled_hlo(gmm_grads, x, w, sizes))
  assert parts["gmm"] == 3 * 2 * m * k * n and parts["total"] == parts["gmm"] and not parts["uncounted"]
  parts = aot.hlo_flops(_compiled_hlo(lambda x, w, g: jax.lax.ragged_dot(x, w, g), x, w, sizes))
  assert parts["ragged_dot"] == 2 * m * k * n == parts["total"]

  heads, seq, hd = 4, 1024, 128
  kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((seq, seq))] * heads),
                                  head_shards=1, q_seq_shards=1)

  def attention_grads(q, k, v):
    loss = lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum()             # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  qkv = ((heads, seq, hd), jnp.bfloat16)
  parts = aot.hlo_flops(_compiled_hlo(attention_grads, qkv, qkv, qkv))
  # the formula's attention term for one layer, fwd + bwd: 12 * heads * hd * seq (keys) * seq (queries)
  assert parts["splash_attention"] == 12 * heads * hd * seq * seq
  assert parts["total"] == parts["splash_attention"] and not parts["uncounted"]



def test_a_sliding_window_kernel_counts_the_tiles_its_mask_visits():
  """backends/splash.py names a windowed kernel's calls by the tiles its mask visits, and the HLO count takes
  that share of the square: window 256 over 1024 keys in 128 x 128 tiles visits 21 of 64 (the diagonal and two
  tiles back per query block); the causal kernel's square stays whole (the formula's convention)."""
  from tformer_jax.backends import splash as splash_lib
  from tformer_jax.ops.masks import Visibility
  b, seq, heads, hd = 1, 1024, 2, 128

  def grads(window):
    def loss(q, k, v):
      out = splash_lib.splash_attention(q, k, v, Visibility(causal=True, window=window), scale=None, block_q=128,
                                        block_kv=128, interpret=False)
      return out.astype(jnp.float32).sum()
    return lambda q, k, v: jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  qkv = ((b, seq, heads, hd), jnp.bfloat16)
  square = 12 * b * heads * hd * seq * seq
  assert aot.hlo_flops(_compiled_hlo(grads(0), qkv, qkv, qkv))["splash_attention"] == square
  assert aot.hlo_flops(_compiled_hlo(grads(256), qkv, qkv, qkv))["splash_attention"] == square * 21 / 64

DYNAMIC_LOOP_HLO = """
%body (p: (s32[], f32[8,16], s32[])) -> (s32[], f32[8,16], s32[]) {
  %p = (s32[], f32[8,16], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16] get-tuple-element(%p), index=1
  %n = s32[] get-tuple-element(%p), index=2
  %y = f32[8,16] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16], s32[]) tuple(%j, %y, %n)
}

%cond (p: (s32[], f32[8,16], s32[])) -> pred[] {
  %p = (s32[], f32[8,16], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=2
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,16], n: s32[]) -> f32[8,16] {
  %x = f32[8,16] parameter(0)
  %n = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16], s32[]) tuple(%zero, %x, %n)
  %w = (s32[], f32[8,16], s32[]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16] get-tuple-element(%w), index=1
}
"""


def test_a_loop_with_a_run_time_trip_count_is_reported():
  """A loop bounded by a run-time value (blockwise attention's causal loop over the visible key blocks)
  runs its dot an unknown number of times: counted once, and reported."""
  parts = aot.hlo_flops(DYNAMIC_LOOP_HLO)
  assert parts["dot"] == 2 * (8 * 16) * 16 and parts["dynamic_loops"] == 1       # output elements x contracted
  static = DYNAMIC_LOOP_HLO.replace("compare(%i, %n)", "compare(%i, %four)").replace(
      "  ROOT %lt", "  %four = s32[] constant(4)\n  ROOT %lt")
  parts = aot.hlo_flops(static)
  assert parts["dot"] == 4 * 2 * (8 * 16) * 16 and parts["dynamic_loops"] == 0
