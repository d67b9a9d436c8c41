"""The backend boundary (tformer_jax/backends): the model computes the same function on every backend.

- Forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) through `model.apply` works with the
  library default (the reference backend), checked against reverse mode / finite differences.
- Logits and every parameter gradient of the xla_cpu backend (custom VJPs, barrier, C++ kernels on
  and off) equal the reference backend's: float32, 1e-5 relative to each array's largest entry.
- One visibility rule: every attention implementation, given the same `ops.masks.Visibility`, equals
  softmax attention under a mask built independently from the `ops.masks` builders (1e-5).
- `resolve_runtime` logs one line; the layering holds (every unit in LAYERS, ops < config < backends < nn <
  services < train < analysis < cli_common < serve/eval < tools < cli; imports only downward, no tool imports
  another) and `nn/` holds no speed machinery.
- The CPU speed machinery (backends/cpu: xla_cpu, the C++ kernels, the host allocator) is one package that
  nothing outside backends/ imports (they use the names `tformer_jax.backends` re-exports; the host's import
  no jax); `pip install .` pulls no BLAS (OpenBLAS is the cpu extra); without it a CPU run keeps XLA's ops,
  says in its one log line which extra would speed it up, and compiles nothing.
"""
import ast
import logging
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends
from tformer_jax.backends.cpu import kernels as cpu_kernel
from tformer_jax.config import ModelConfig, default_config, validate_model
from tformer_jax.nn import Transformer
from tformer_jax.ops import attention as attn_ops, masks

PKG = pathlib.Path(__file__).resolve().parents[1] / "tformer_jax"
TOL = 1e-5
KERNELS = cpu_kernel.available()[0]


def _cfg(**kw) -> ModelConfig:
  base = dict(vocab_size=53, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=32,
              position="rope", norm="rmsnorm", activation="swiglu")
  base.update(kw)
  m = ModelConfig(**base)
  validate_model(m)
  return m


def _setup(m: ModelConfig, length: int = 13):
  model = Transformer(m)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, length), 0, m.vocab_size)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tokens)["params"])
  return model, params, tokens


# -- forward mode ---------------------------------------------------------------------------------

def test_forward_mode_autodiff_through_apply():
  model, params, tokens = _setup(_cfg(norm="layernorm", activation="gelu", position="learned",
                                      qkv_bias=True, num_layers=1))
  assert backends.current().name == "reference"   # no `use` block: the library default

  def loss(p):
    return jnp.mean(jnp.tanh(model.apply({"params": p}, tokens)))

  # Each transform under jit: the same traced program, compiled once instead of op by op.
  direction = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(x.size), x.shape), params)
  _, jvp = jax.jit(lambda p, d: jax.jvp(loss, (p,), (d,)))(params, direction)
  vjp = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(jax.jit(jax.grad(loss))(params)),
                                          jax.tree.leaves(direction)))
  np.testing.assert_allclose(float(jvp), float(vjp), rtol=1e-4)

  def linearized(p, d):
    y, lin = jax.linearize(loss, p)
    return y, lin(d)

  y, lin_d = jax.jit(linearized)(params, direction)
  np.testing.assert_allclose(float(lin_d), float(jvp), rtol=1e-5)
  np.testing.assert_allclose(float(y), float(jax.jit(loss)(params)), rtol=1e-6)

  # jacfwd of the logits w.r.t. the embedding table of a tiny model, against reverse mode
  emb = params["embed"]

  def logits_of(e):
    return model.apply({"params": {**params, "embed": e}}, tokens[:1, :4])[0, -1, :5]

  np.testing.assert_allclose(np.asarray(jax.jit(jax.jacfwd(logits_of))(emb)),
                             np.asarray(jax.jit(jax.jacrev(logits_of))(emb)), rtol=1e-5, atol=1e-6)


# -- reference == xla_cpu ---------------------------------------------------------------------------

def _logits_and_grads(model, params, tokens, backend):
  w = jax.random.normal(jax.random.PRNGKey(7), tokens.shape + (model.cfg.vocab_size,))

  def f(p):
    logits = model.apply({"params": p}, tokens)
    return jnp.sum(logits * w), logits

  with backends.use(backend):
    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return np.asarray(logits), jax.device_get(grads)


def _assert_close(got, want):
  np.testing.assert_allclose(got[0], want[0], rtol=TOL, atol=TOL)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(want[1])):
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * scale, err_msg=jax.tree_util.keystr(path))


ARCHS = {
    "gpt2": dict(norm="layernorm", activation="gelu_tanh", position="learned", qkv_bias=True,
                 out_bias=True, mlp_bias=True, num_kv_heads=0),
    "llama_gqa": {},
    "alibi_window": dict(position="alibi", window=5, num_kv_heads=1),
    "postln_scanned": dict(norm="layernorm", norm_position="post", scan_layers=True, remat="full"),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("kernels", [False, True], ids=["xla_ops", "cpu_kernels"])
def test_xla_cpu_backend_equals_reference(arch, kernels):
  if kernels and not KERNELS:
    pytest.skip(f"C++ kernels unavailable: {cpu_kernel.available()[1]}")
  model, params, tokens = _setup(_cfg(**ARCHS[arch]))
  want = _logits_and_grads(model, params, tokens, backends.Backend())
  fast = backends.XlaCpuBackend(attention_impl="chunked", block_q=4, cpu_kernels=kernels)
  _assert_close(_logits_and_grads(model, params, tokens, fast), want)


def test_xla_cpu_backend_really_runs_its_machinery():
  if not KERNELS:
    pytest.skip("C++ kernels unavailable")
  model, params, tokens = _setup(_cfg())
  f = lambda p: jnp.sum(model.apply({"params": p}, tokens))  # noqa: E731
  with backends.use(backends.XlaCpuBackend(attention_impl="chunked", block_q=4)):
    hlo = jax.jit(jax.grad(f)).lower(params).as_text()
  assert "tfj_matmul" in hlo and "tfj_chunked_attention" in hlo and "while" in hlo
  hlo_ref = jax.jit(jax.grad(f)).lower(params).as_text()   # outside: the reference backend
  assert "tfj_" not in hlo_ref and "while" not in hlo_ref


# -- one visibility rule ----------------------------------------------------------------------------

def _qkv(l: int, s: int, h: int = 4, kh: int = 2, d: int = 8):
  ks = jax.random.split(jax.random.PRNGKey(11), 3)
  return (jax.random.normal(ks[0], (2, l, h, d)), jax.random.normal(ks[1], (2, s, kh, d)),
          jax.random.normal(ks[2], (2, s, kh, d)))


VALID = jnp.asarray([[True] * 12, [False] * 3 + [True] * 9])
CASES = {  # name: (Visibility, the same rule spelled with the ops.masks builders), L = S = 12
    "causal": (masks.Visibility(), masks.causal_mask(12)),
    "window": (masks.Visibility(window=4), masks.sliding_window_mask(12, window=4)),
    "bidirectional_window": (masks.Visibility(causal=False, window=3),
                             masks.local_window_mask(12, window=3)),
    "padded_causal": (masks.Visibility(kv_valid_BxS=VALID),
                      masks.combine_masks(masks.causal_mask(12), masks.padding_mask(VALID))),
    "segments": (masks.Visibility(q_segment_ids_BxL=jnp.asarray([[1] * 5 + [2] * 7] * 2),
                                  kv_segment_ids_BxS=jnp.asarray([[1] * 5 + [2] * 7] * 2)),
                 masks.combine_masks(masks.causal_mask(12),
                                     masks.segment_mask(jnp.asarray([[1] * 5 + [2] * 7] * 2)))),
}
IMPLS = [backends.Backend(attention_impl=a, block_q=4, block_k=4)
         for a in ("reference", "chunked", "blockwise", "xla")]
IMPLS += [backends.XlaCpuBackend(attention_impl="chunked", block_q=4, cpu_kernels=True)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", IMPLS, ids=lambda b: f"{b.name}-{b.attention_impl}")
def test_every_implementation_follows_the_visibility(case, backend):
  if backend.name == "xla_cpu" and not KERNELS:
    pytest.skip("C++ kernels unavailable")
  vis, mask = CASES[case]
  q, k, v = _qkv(12, 12)
  with backends.use(backend):
    got, _ = backends.current().attention(q, k, v, vis)
  want = attn_ops.dot_product_attention(q, k, v, mask=mask)
  rows = np.asarray(jnp.any(mask, axis=-1))[:, 0, :, None, None] if mask.shape[0] > 1 else True
  np.testing.assert_allclose(np.where(rows, np.asarray(got), 0), np.where(rows, np.asarray(want), 0),
                             rtol=TOL, atol=TOL)
  np.testing.assert_array_equal(np.asarray(vis.mask(12, 12)), np.asarray(jnp.broadcast_to(
      mask, vis.mask(12, 12).shape)))


def test_visibility_with_global_tokens_and_offset():
  vis = masks.Visibility(window=3, num_global=2)
  want = masks.combine_masks(masks.causal_mask(10),
                             masks.local_window_mask(10, window=3) | masks.global_token_mask(10, num_global=2))
  np.testing.assert_array_equal(np.asarray(vis.mask(10, 10)), np.asarray(want))
  # a decode step: query 0 of the call sits at cache slot 6
  step = masks.Visibility(window=3, q_offset=6).mask(1, 10)
  np.testing.assert_array_equal(np.asarray(step[0, 0, 0]), (np.arange(10) >= 4) & (np.arange(10) <= 6))


# -- runtime resolution and structure -----------------------------------------------------------------

def test_resolve_runtime_logs_one_line(caplog):
  cfg = default_config()
  with caplog.at_level(logging.INFO, logger="tformer_jax"):
    rt = backends.resolve_runtime(cfg)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("runtime:")]
  assert len(lines) == 1 and rt.backend.name in lines[0] and rt.allocator in lines[0]
  assert rt.as_dict()["attention"] == rt.backend.attention_impl
  quiet = backends.resolve_runtime(cfg, platform="gpu", quiet=True)
  assert (quiet.backend.name, quiet.backend.attention_impl) == ("reference", "xla")
  # the line is short and points at runtime.json, which keeps every reason (the rule, no figures)
  moe = default_config()
  moe.model.moe.num_experts, moe.train.precision = 4, "bf16"
  for c, platform in ((cfg, None), (cfg, "gpu"), (cfg, "tpu"), (moe, None), (moe, "tpu")):
    r = backends.resolve_runtime(c, platform=platform, quiet=True)
    line = r.summary()
    assert "\n" not in line and len(line) <= 160 and line.endswith("why: runtime.json"), line
    assert r.backend.attention_impl in line and r.as_dict()["reasons"] == list(r.reasons) and r.reasons
    assert not [x for x in r.reasons if re.search(r"\d(\.\d+)?x\b|\d%|tokens/s|GFLOP|ms/token", x)], r.reasons


def _imports(path: pathlib.Path) -> set[str]:
  """The tformer_jax subpackages/modules a file imports (first component after tformer_jax.)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      mods = ([f"tformer_jax.{a.name}" for a in node.names] if node.module == "tformer_jax"
              else [node.module])
    elif isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    else:
      continue
    out |= {m.split(".")[1] for m in mods if m.startswith("tformer_jax.")}
  return out


# The layers of ../shared/ARCHITECTURE.md, lowest first: a unit (a subpackage or a top-level module) imports
# only from its own layer or a lower one. Every unit has a place here (a new one fails until it is given one).
LAYERS = (
    ("ops",),
    ("config",),
    ("backends",),
    ("nn",),
    ("data", "parallel", "checkpoint", "decode", "model_loading", "interop"),           # services
    ("train",),
    ("analysis",),                                # what the tools share: FLOP formula, HLO reader, estimator
    ("cli_common",),                              # the commands' flags, loaders and errors (tools use them too)
    ("serve", "eval"),                            # the server and the harness adapters (bench, ablate use them)
    ("bench", "diagnostics", "doctor", "aot", "experiments"),                      # the tools on top
    ("cli",),
)
LAYER = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# Within its layer, what a unit may import besides itself (the rest of its layer otherwise): no tool imports
# another tool; what two of them share belongs in analysis/ (or lower).
SAME_LAYER = {"ops": set(), "config": set(), "parallel": set(), "serve": set(), "eval": set(),
              **{tool: set() for tool in LAYERS[-2]}}


def _unit(path: pathlib.Path) -> str:
  """The unit a file belongs to, read as a file: its package, `__main__.py` included (a `python -m` entry of
  a tool imports its own package, never the command lines above it)."""
  return path.relative_to(PKG).with_suffix("").parts[0]


def test_imports_run_downward():
  units = {path.relative_to(PKG).with_suffix("").parts[0] for path in PKG.rglob("*.py")} - {"__init__"}
  assert units <= set(LAYER), f"units without a layer in LAYERS: {sorted(units - set(LAYER))}"
  for path in PKG.rglob("*.py"):
    unit = _unit(path)
    own = path.relative_to(PKG).parts[0].removesuffix(".py")
    for imported in _imports(path) - {unit, own}:
      where = f"{path.relative_to(PKG)} imports tformer_jax.{imported}"
      assert LAYER[imported] <= LAYER[unit], f"{where}: layer {LAYER[imported]} above its own {LAYER[unit]}"
      if LAYER[imported] == LAYER[unit] and unit in SAME_LAYER:
        assert imported in SAME_LAYER[unit], f"{where}: {unit} imports nothing of its own layer"


def test_the_layer_table_catches_an_upward_import(tmp_path, monkeypatch):
  """The check above fails on the import this table was made for (train/loop.py importing eval)."""
  fake = tmp_path / "tformer_jax"
  (fake / "train").mkdir(parents=True)
  (fake / "eval").mkdir()
  (fake / "train" / "loop.py").write_text("from tformer_jax.eval.in_training import HarnessEval\n")
  (fake / "eval" / "in_training.py").write_text("from tformer_jax.train import loop\n")
  monkeypatch.setitem(globals(), "PKG", fake)
  with pytest.raises(AssertionError, match="train/loop.py imports tformer_jax.eval: layer 8 above its own 5"):
    test_imports_run_downward()


def _imports_cpu_package(path: pathlib.Path) -> bool:
  """Whether a file imports tformer_jax.backends.cpu (or anything in it)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      mods = [f"{node.module}.{a.name}" for a in node.names] if node.module == "tformer_jax.backends" else [node.module]
    elif isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    else:
      continue
    if any(m == "tformer_jax.backends.cpu" or m.startswith("tformer_jax.backends.cpu.") for m in mods):
      return True
  return False


def test_cpu_machinery_is_one_package_behind_the_backend_door():
  """Only backends/ imports backends/cpu (the rest uses `backends.<name>`); ops/ keeps no kernels; every name
  the door lists resolves to its module's; the host's names import no jax."""
  assert not (PKG / "ops" / "cpu_kernel" / "__init__.py").exists() and not (PKG / "host_alloc.py").exists()
  assert {"xla_cpu.py", "host_alloc.py", "kernels"} <= {p.name for p in (PKG / "backends" / "cpu").iterdir()}
  assert _imports_cpu_package(PKG / "backends" / "runtime.py")    # the check finds the import it is for
  outside = [p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "backends"]
  assert not [str(p.relative_to(PKG)) for p in outside if _imports_cpu_package(p)]
  for name in backends.__all__:
    assert getattr(backends, name) is not None, name
  code = ("import sys; from tformer_jax import backends; backends.maybe_reexec, backends.idle_libtpu; "
          "assert 'jax' not in sys.modules, 'jax imported'")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_without_the_cpu_extra_a_cpu_run_names_it(tmp_path):
  """`pip install .` pulls no BLAS; without the cpu extra (scipy-openblas32 blocked from import in a fresh
  process) the kernels are unavailable with the extra named, nothing is compiled, 'auto' runs the xla_cpu
  backend on XLA's ops with the extra in its one log line and its reasons, and 'on' is one ConfigError."""
  tomllib = pytest.importorskip("tomllib")   # Python 3.11+
  project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]
  assert not [d for d in project["dependencies"] if re.match(r"(scipy-openblas|mkl|onednn)", d)]
  assert any(d.startswith("scipy-openblas32") for d in project["optional-dependencies"]["cpu"])
  code = """if True:
    import logging, sys
    sys.modules["scipy_openblas32"] = None   # the wheel of the cpu extra, not installed
    from tformer_jax import backends
    from tformer_jax.backends.cpu import kernels
    from tformer_jax.config import ConfigError, default_config
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    print("available:", kernels.available())
    cfg = default_config()
    rt = backends.resolve_runtime(cfg, platform="cpu")
    print("kernels:", rt.backend.name, rt.backend.cpu_kernels)
    print("reasons:", rt.as_dict()["reasons"])
    cfg.runtime.cpu_kernels = "on"
    try:
      backends.resolve_runtime(cfg, platform="cpu", quiet=True)
    except ConfigError as e:
      print("on:", str(e).replace(chr(10), "<newline>"))
  """
  env = {**os.environ, "TFORMER_JAX_KERNEL_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
  extra = "pip install 'tformer_jax[cpu]'"
  assert out["available:"].startswith("(False, ") and extra in out["available:"], out
  assert out["kernels:"] == "xla_cpu False", out
  assert f"C++ kernels off: the C++ CPU kernels need the cpu extra: {extra}" in out["reasons:"], out
  [line] = [x for x in proc.stdout.splitlines() if x.startswith("runtime:")]
  assert f"faster: {extra}" in line and "C++ kernels off" in line and len(line) <= 160, line
  assert out["on:"].startswith("runtime.cpu_kernels: 'on' but the C++ kernels are unavailable") and extra in out["on:"]
  assert "<newline>" not in out["on:"] and not list(tmp_path.iterdir())   # one line; nothing compiled


TOOLS = set(LAYERS[-2] + LAYERS[-1])   # used by nothing but the command lines


def test_serve_sits_above_decode():
  """The server uses decode; no service below reaches up into it (only the tools and cli may)."""
  for path in PKG.rglob("*.py"):
    unit = path.relative_to(PKG).parts[0]
    if unit not in TOOLS and unit != "serve":
      assert "serve" not in _imports(path), f"{path.relative_to(PKG)} imports tformer_jax.serve"
  assert "decode" in _imports(PKG / "serve" / "engine.py")


def test_eval_sits_above_decode():
  """The harness model class (tformer_jax/eval) uses decode and the loaders, never train; only the tools and
  cli import it (train.eval_tasks' evaluator is a hook tformer-train passes down to the loop)."""
  for path in PKG.rglob("*.py"):
    unit = path.relative_to(PKG).parts[0]
    if unit not in TOOLS and unit != "eval":
      assert "eval" not in _imports(path), f"{path.relative_to(PKG)} imports tformer_jax.eval"
  for path in (PKG / "eval").rglob("*.py"):
    assert "train" not in _imports(path), f"{path.relative_to(PKG)} imports tformer_jax.train"
  assert {"decode", "model_loading"} <= _imports(PKG / "eval" / "harness.py")


def test_nn_holds_no_speed_machinery():
  for path in (PKG / "nn").glob("*.py"):
    text = path.read_text()
    for word in ("cpu_kernel", "barrier", "host_alloc", "tcmalloc", "custom_vjp", '"auto"', "'auto'",
                 "default_backend"):
      assert word not in text, f"nn/{path.name} mentions {word}"
