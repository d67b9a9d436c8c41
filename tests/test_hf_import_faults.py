"""Fault injection on the Hugging Face importer: real HF directories (config.json + model.safetensors,
written by save_hf, which transformers loads: tests/test_hf_export.py) corrupted on disk, then read by
`load_hf` and by `scripts/convert.py --from-hf` as a user runs it.

Every defect is one HFConfigError / HFWeightsError line naming the file and the field or tensor,
raised before a model is built or a size taken from the files is allocated; convert.py prints it as
`error: ...` and exits 2, without a traceback. A .bin holding a pickled object is refused with our
message (never torch's advice to pass weights_only=False) and its code never runs."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from tformer_jax.interop import hf as hfi
from tformer_jax.interop.hf import HFConfigError, HFWeightsError, load_hf, save_hf
from tformer_jax.nn import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 61
GPT2 = dict(model_type="gpt2", vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4)
MIXTRAL = dict(model_type="mixtral", vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64)
WPE = "transformer.wpe.weight"
WTE = "transformer.wte.weight"


def _hf_dir(hf_cfg: dict, path: pathlib.Path) -> pathlib.Path:
  cfg = hfi.model_config_from_hf(hf_cfg)
  model = Transformer(cfg)
  params = model.init(jax.random.PRNGKey(0), np.zeros((1, 1), np.int32))["params"]
  return save_hf(model, params, path, hf_cfg["model_type"])


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> pathlib.Path:
  return _hf_dir(GPT2, tmp_path_factory.mktemp("hf") / "gpt2")


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> pathlib.Path:
  return _hf_dir(MIXTRAL, tmp_path_factory.mktemp("hf") / "mixtral")


def clone(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  return dst


def read_st(d: pathlib.Path) -> tuple[dict, bytes]:
  """(header dict, data section) of d/model.safetensors."""
  raw = (d / "model.safetensors").read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(d: pathlib.Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
  """d/model.safetensors with `header` (a dict, or raw bytes) before `data`; `length` overrides the
  8-byte header length."""
  hb = header if isinstance(header, bytes) else json.dumps(header).encode()
  (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hb) if length is None else length) + hb + data)


def edit_header(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
  d = clone(src, dst)
  header, data = read_st(d)
  edit(header)
  write_st(d, header, data)
  return d


def edit_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
  d = clone(src, dst)
  cfg = json.loads((d / "config.json").read_text())
  cfg.update(changes)
  (d / "config.json").write_text(json.dumps(cfg))
  return d


def refused(d: pathlib.Path, error: type[Exception], *fragments: str) -> str:
  """load_hf(d) raises `error` in one line naming every fragment; returns the message."""
  with pytest.raises(error) as e:
    load_hf(d)
  msg = str(e.value)
  assert type(e.value) is error, repr(e.value)
  assert "\n" not in msg, msg
  for f in fragments:
    assert f in msg, (f, msg)
  return msg


def test_the_intact_directory_loads(gpt2_dir):
  model, params = load_hf(gpt2_dir)
  assert (model.cfg.num_layers, model.cfg.vocab_size) == (2, V)
  assert params["embed"].shape == (V, 32)


# ---------------------------------------------------------------------------------------------
# The safetensors file

def test_header_length_2_to_the_40(gpt2_dir, tmp_path):
  """Was a bare MemoryError (f.read(2**40))."""
  d = clone(gpt2_dir, tmp_path / "d")
  raw = (d / "model.safetensors").read_bytes()
  (d / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 40) + raw[8:])
  refused(d, HFWeightsError, str(d / "model.safetensors"), "header length 1099511627776 is impossible",
          "the file has")


def test_header_length_beyond_the_format_cap(gpt2_dir, tmp_path):
  """A header length inside a (sparse) file but above safetensors' own 100 MB limit is not read."""
  d = clone(gpt2_dir, tmp_path / "d")
  f = d / "model.safetensors"
  with open(f, "r+b") as fh:
    fh.write(struct.pack("<Q", 200_000_000))
    fh.truncate(300_000_000)
  refused(d, HFWeightsError, str(f), "header length 200000000 is impossible", "at most 100000000")


def test_file_shorter_than_the_length_field(gpt2_dir, tmp_path):
  d = clone(gpt2_dir, tmp_path / "d")
  (d / "model.safetensors").write_bytes(b"\x01\x02")
  refused(d, HFWeightsError, str(d / "model.safetensors"), "not a safetensors file")


def test_negative_offsets(gpt2_dir, tmp_path):
  """Was a reshape ValueError (a negative slice start)."""
  def edit(h):
    begin, end = h[WPE]["data_offsets"]
    h[WPE]["data_offsets"] = [-8, end - begin - 8]
  d = edit_header(gpt2_dir, tmp_path / "d", edit)
  refused(d, HFWeightsError, str(d / "model.safetensors"), f"tensor {WPE}", "data_offsets [-8,",
          "not a pair of non-negative integers")


def test_offsets_past_the_end(gpt2_dir, tmp_path):
  d = clone(gpt2_dir, tmp_path / "d")
  header, data = read_st(d)
  begin, end = header[WPE]["data_offsets"]
  header[WPE]["data_offsets"] = [len(data), len(data) + end - begin]
  write_st(d, header, data)
  refused(d, HFWeightsError, str(d / "model.safetensors"), f"tensor {WPE}", "past the end of the data section",
          f"({len(data)} bytes")


def test_reversed_offsets(gpt2_dir, tmp_path):
  def edit(h):
    h[WPE]["data_offsets"] = h[WPE]["data_offsets"][::-1]
  d = edit_header(gpt2_dir, tmp_path / "d", edit)
  refused(d, HFWeightsError, f"tensor {WPE}", "the end is before the beginning")


def test_byte_count_does_not_fit_the_shape(gpt2_dir, tmp_path):
  def edit(h):
    begin, end = h[WPE]["data_offsets"]
    h[WPE]["data_offsets"] = [begin, end - 4]
  d = edit_header(gpt2_dir, tmp_path / "d", edit)
  refused(d, HFWeightsError, str(d / "model.safetensors"), f"tensor {WPE}", "(4092 bytes)",
          "shape (32, 32) of F32 takes 4096 bytes")


def test_bad_shapes(gpt2_dir, tmp_path):
  def negative(h):
    h[WPE]["shape"] = [-32, -32]
  refused(edit_header(gpt2_dir, tmp_path / "neg", negative), HFWeightsError, f"tensor {WPE} has shape [-32, -32]",
          "not a list of non-negative integers")

  def text(h):
    h[WPE]["shape"] = "32x32"
  refused(edit_header(gpt2_dir, tmp_path / "str", text), HFWeightsError, f"tensor {WPE} has shape '32x32'")


def test_unknown_dtype(gpt2_dir, tmp_path):
  def edit(h):
    h[WPE]["dtype"] = "Q7"
  d = edit_header(gpt2_dir, tmp_path / "d", edit)
  refused(d, HFWeightsError, str(d / "model.safetensors"), f"tensor {WPE} has unknown dtype 'Q7'", "F32")


def test_overlapping_tensors(gpt2_dir, tmp_path):
  """The tensor stored last moved onto the bytes of the one stored first (same byte count, in bounds)."""
  d = clone(gpt2_dir, tmp_path / "d")
  header, data = read_st(d)
  entries = {k: v for k, v in header.items() if k != "__metadata__"}
  first = min(entries, key=lambda k: entries[k]["data_offsets"][0])
  last = max(entries, key=lambda k: entries[k]["data_offsets"][0])
  begin, end = header[last]["data_offsets"]
  header[last]["data_offsets"] = [0, end - begin]
  write_st(d, header, data)
  msg = refused(d, HFWeightsError, str(d / "model.safetensors"), "overlap")
  assert first in msg and last in msg, msg


def test_stray_bytes(gpt2_dir, tmp_path):
  d = clone(gpt2_dir, tmp_path / "tail")
  header, data = read_st(d)
  write_st(d, header, data + b"\0" * 8)
  refused(d, HFWeightsError, "8 byte(s) after the last tensor belong to no tensor")

  d = clone(gpt2_dir, tmp_path / "gap")
  header, data = read_st(d)
  for v in header.values():
    if "data_offsets" in v:
      v["data_offsets"] = [o + 16 for o in v["data_offsets"]]
  write_st(d, header, b"\0" * 16 + data)
  refused(d, HFWeightsError, "bytes 0..16 of the data section belong to no tensor")


def test_header_not_a_json_object(gpt2_dir, tmp_path):
  d = clone(gpt2_dir, tmp_path / "list")
  _, data = read_st(d)
  write_st(d, b"[1, 2]", data)
  refused(d, HFWeightsError, str(d / "model.safetensors"), "header is an array")

  d = clone(gpt2_dir, tmp_path / "dup")
  header, data = read_st(d)
  raw = json.dumps(header).encode()
  twice = raw[:-1] + b", " + json.dumps({WPE: header[WPE]}).encode()[1:]
  write_st(d, twice, data)
  refused(d, HFWeightsError, "unreadable safetensors header", f"'{WPE}' appears twice")

  d = clone(gpt2_dir, tmp_path / "binary")
  write_st(d, b"\xff\xfe{}", data)
  refused(d, HFWeightsError, "unreadable safetensors header")


# ---------------------------------------------------------------------------------------------
# config.json

def test_config_not_json(gpt2_dir, tmp_path):
  """Was a JSONDecodeError without the path."""
  d = clone(gpt2_dir, tmp_path / "d")
  (d / "config.json").write_text('{"model_type": "gpt2",')
  refused(d, HFConfigError, str(d / "config.json"), "not valid JSON", "line 1")


def test_config_not_an_object(gpt2_dir, tmp_path):
  """Was an AttributeError ('list' object has no attribute 'get')."""
  d = clone(gpt2_dir, tmp_path / "d")
  (d / "config.json").write_text("[1, 2]")
  refused(d, HFConfigError, str(d / "config.json"), "expected a JSON object, found an array")
  (d / "config.json").write_bytes(b'{"model_type": "\xff"}')
  refused(d, HFConfigError, str(d / "config.json"), "not UTF-8")


def test_config_values_of_the_wrong_type(gpt2_dir, tmp_path):
  refused(edit_config(gpt2_dir, tmp_path / "str", n_layer="two"), HFConfigError, "config.json", "n_layer='two'",
          "not an integer")
  refused(edit_config(gpt2_dir, tmp_path / "neg", n_layer=-3), HFConfigError, "n_layer=-3")
  refused(edit_config(gpt2_dir, tmp_path / "frac", n_embd=32.5), HFConfigError, "n_embd=32.5")
  refused(edit_config(gpt2_dir, tmp_path / "eps", layer_norm_epsilon="small"), HFConfigError,
          "layer_norm_epsilon='small'", "not a finite number")
  refused(edit_config(gpt2_dir, tmp_path / "tie", tie_word_embeddings="yes"), HFConfigError,
          "tie_word_embeddings='yes'")
  refused(edit_config(gpt2_dir, tmp_path / "type", model_type=["gpt2"]), HFConfigError, "config.json",
          "unknown model family")


def test_ten_million_layers_answers_at_once(gpt2_dir, tmp_path):
  """Was no answer within 120 s (the model was built before the weights were compared)."""
  d = edit_config(gpt2_dir, tmp_path / "d", n_layer=10 ** 7)
  t = time.perf_counter()
  refused(d, HFWeightsError, str(d / "config.json"), "n_layer=10000000", "hold 2 layer(s) (numbered 0-1)")
  assert time.perf_counter() - t < 0.5


def test_fewer_layers_in_config_than_in_the_files(gpt2_dir, tmp_path):
  refused(edit_config(gpt2_dir, tmp_path / "d", n_layer=1), HFWeightsError, "n_layer=1", "hold 2 layer(s)")


def test_sizes_must_match_the_tensors(gpt2_dir, tmp_path):
  """vocab, hidden and position sizes against the headers, before any model is built (a vocabulary of
  10^12 would not even trace)."""
  t = time.perf_counter()
  refused(edit_config(gpt2_dir, tmp_path / "vocab", vocab_size=10 ** 12), HFWeightsError, "config.json",
          f"tensor {WTE} has shape ({V}, 32), expected (1000000000000, 32) from vocab_size=1000000000000",
          "(in model.safetensors)")
  assert time.perf_counter() - t < 0.5
  msg = refused(edit_config(gpt2_dir, tmp_path / "embd", n_embd=64), HFWeightsError, "from n_embd=64")
  assert "expected (61, 64)" in msg, msg
  refused(edit_config(gpt2_dir, tmp_path / "pos", n_positions=128), HFWeightsError,
          f"tensor {WPE} has shape (32, 32), expected (128, 32) from n_positions=128")
  refused(edit_config(gpt2_dir, tmp_path / "ff", n_inner=100), HFWeightsError, "from n_inner=100")


def test_experts_must_match_the_tensors(mixtral_dir, tmp_path):
  t = time.perf_counter()
  refused(edit_config(mixtral_dir, tmp_path / "many", num_local_experts=10 ** 7), HFWeightsError, "config.json",
          "num_local_experts=10000000", "hold 4 expert(s) (numbered 0-3)")
  assert time.perf_counter() - t < 0.5
  assert load_hf(mixtral_dir)[0].cfg.moe.num_experts == 4

  # Without the expert tensors the router still gives their number: the import names the missing ones.
  weights = {k: np.array(v) for k, v in hfi.read_safetensors(mixtral_dir / "model.safetensors").items()}
  d = clone(mixtral_dir, tmp_path / "no_experts")
  save_file({k: v for k, v in weights.items() if ".experts." not in k}, str(d / "model.safetensors"))
  refused(d, HFWeightsError, "missing tensor(s): model.layers.0.block_sparse_moe.experts.0.w1.weight")
  # Without the router too, nothing confirms num_local_experts (10^7 would be 10^7 names per layer).
  d = clone(mixtral_dir, tmp_path / "no_moe")
  save_file({k: v for k, v in weights.items() if ".block_sparse_moe." not in k}, str(d / "model.safetensors"))
  refused(d, HFWeightsError, "num_local_experts=4", "no expert tensors",
          "model.layers.0.block_sparse_moe.experts.0.w1.weight")


def test_sharded_index_faults(gpt2_dir, tmp_path):
  model, params = load_hf(gpt2_dir)
  sharded = save_hf(model, params, tmp_path / "sharded", max_shard_bytes=20_000)
  index = sharded / "model.safetensors.index.json"
  good = json.loads(index.read_text())

  d = clone(sharded, tmp_path / "escape")
  first = next(iter(good["weight_map"]))
  (d / index.name).write_text(json.dumps({"weight_map": {**good["weight_map"], first: "../sharded/x.safetensors"}}))
  refused(d, HFWeightsError, str(d / index.name), "'../sharded/x.safetensors'", "not a file name")

  d = clone(sharded, tmp_path / "gone")
  (d / index.name).write_text(json.dumps({"weight_map": {**good["weight_map"], first: "model-9.safetensors"}}))
  refused(d, HFWeightsError, str(d / index.name), "model-9.safetensors, which is not a file")

  d = clone(sharded, tmp_path / "notjson")
  (d / index.name).write_text("{")
  refused(d, HFWeightsError, str(d / index.name), "not valid JSON")

  d = clone(sharded, tmp_path / "nomap")
  (d / index.name).write_text(json.dumps({"weight_map": ["a"]}))
  refused(d, HFWeightsError, "'weight_map' is not an object")


def test_table_layouts_give_the_model_shapes():
  """Every family rule has layouts, and the shapes they imply from config.json are our model's."""
  from tformer_jax.interop.families import FAMILIES, OneOf
  for fam in FAMILIES.values():
    for item in fam.rules:
      for opt in (item.options if isinstance(item, OneOf) else ((item,),)):
        assert all(r.hf_axes and r.ours_axes for r in opt), (fam.model_type, opt)
  cfg = hfi.model_config_from_hf({**GPT2, "n_inner": 48, "tie_word_embeddings": False})
  cfg = dataclasses.replace(cfg, scan_layers=False)
  want = hfi.expected_shapes(cfg)
  sizes = hfi._sizes(cfg)
  for rule in FAMILIES["gpt2"].rules:
    for t in rule.targets:
      assert hfi.axes.shape_of(rule.ours_axes, sizes) == want[t.replace("{i}", "0")], rule


# ---------------------------------------------------------------------------------------------
# .bin checkpoints (torch.load, weights_only=True)

class _Payload:
  """Unpickling this would create a file: it must never happen."""

  def __init__(self, marker: pathlib.Path):
    self.marker = marker

  def __reduce__(self):
    return (os.makedirs, (str(self.marker),))


def _bin_dir(gpt2_dir: pathlib.Path, d: pathlib.Path, extra: dict) -> pathlib.Path:
  torch = pytest.importorskip("torch")
  d.mkdir()
  shutil.copyfile(gpt2_dir / "config.json", d / "config.json")
  sd = {k: torch.from_numpy(np.array(v)) for k, v in hfi.read_safetensors(gpt2_dir / "model.safetensors").items()}
  torch.save({**sd, **extra}, d / "pytorch_model.bin")
  return d


@pytest.mark.reference
def test_bin_with_a_pickled_object_is_refused_with_our_message(gpt2_dir, tmp_path):
  marker = tmp_path / "code_ran"
  d = _bin_dir(gpt2_dir, tmp_path / "d", {"payload": _Payload(marker)})
  msg = refused(d, HFWeightsError, str(d / "pytorch_model.bin"), "non-tensor Python objects",
                "will not be unpickled", "safetensors")
  assert "weights_only" not in msg and "Weights only" not in msg, msg
  assert not marker.exists()


@pytest.mark.reference
def test_bin_faults(gpt2_dir, tmp_path):
  d = _bin_dir(gpt2_dir, tmp_path / "step", {"step": 3})
  refused(d, HFWeightsError, str(d / "pytorch_model.bin"), "'step'", "not tensors")
  d = _bin_dir(gpt2_dir, tmp_path / "junk", {})
  (d / "pytorch_model.bin").write_bytes(b"not a checkpoint" * 4)
  msg = refused(d, HFWeightsError, str(d / "pytorch_model.bin"), "the safe loader refuses", "will not be unpickled")
  assert "weights_only" not in msg, msg
  (d / "pytorch_model.bin").write_bytes(b"")
  refused(d, HFWeightsError, str(d / "pytorch_model.bin"), "not a readable PyTorch checkpoint (EOFError")
  d = _bin_dir(gpt2_dir, tmp_path / "ok", {})
  assert load_hf(d)[0].cfg.num_layers == 2


# ---------------------------------------------------------------------------------------------
# scripts/convert.py --from-hf, as a user runs it

def convert(src: pathlib.Path, work: pathlib.Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), "--from-hf", str(src),
                         "--to", str(work)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  err = r.stderr
  assert "Traceback" not in err, err
  lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
  assert len(lines) == 1, err
  for f in fragments:
    assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def faulty_dirs(gpt2_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
  root = tmp_path_factory.mktemp("faulty")
  out = {"layers": edit_config(gpt2_dir, root / "layers", n_layer=10 ** 7)}
  d = clone(gpt2_dir, root / "hlen")
  raw = (d / "model.safetensors").read_bytes()
  (d / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 40) + raw[8:])
  out["hlen"] = d
  d = clone(gpt2_dir, root / "json")
  (d / "config.json").write_text("{not json")
  out["json"] = d
  return out


@pytest.mark.parametrize("fault, fragments", [
    ("hlen", ("model.safetensors", "header length 1099511627776")),
    ("layers", ("config.json", "n_layer=10000000")),
    ("json", ("config.json", "not valid JSON")),
])
def test_convert_reports_one_line(faulty_dirs, tmp_path, fault, fragments):
  pytest.importorskip("tformer_jax.checkpoint")
  r = convert(faulty_dirs[fault], tmp_path / "work")
  assert_one_line_error(r, str(faulty_dirs[fault]), *fragments)
  assert not (tmp_path / "work").exists()


@pytest.mark.reference
def test_convert_refuses_a_pickled_object(gpt2_dir, tmp_path):
  pytest.importorskip("tformer_jax.checkpoint")
  marker = tmp_path / "code_ran"
  d = _bin_dir(gpt2_dir, tmp_path / "d", {"payload": _Payload(marker)})
  r = convert(d, tmp_path / "work")
  assert_one_line_error(r, "pytorch_model.bin", "will not be unpickled")
  assert "weights_only" not in r.stderr
  assert not marker.exists()
