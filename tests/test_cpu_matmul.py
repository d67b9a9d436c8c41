"""The C++ CPU matmul (backends.cpu.kernels.matmul_cpu) on each BLAS (runtime.cpu_blas: OpenBLAS, oneMKL where the
`mkl` wheel is installed, oneDNN where the `onednn-cpu-gomp` wheel is) and its use in backends.cpu.xla_cpu.project
with the xla_cpu backend's C++ kernels on (runtime.cpu_kernels 'on' / 'auto'): the weight gradients, and under
runtime.cpu_matmul 'all' the forward and input-gradient products too.

Tolerances: float32 against a float64 product, 1e-5 relative to the largest entry; model gradients
against the XLA path, 1e-5 (only the summation order differs). bfloat16 (MKL's or oneDNN's bf16 gemm): the float32
output against the float64 product of the same bfloat16 values, 1e-5; the bfloat16 output is that one
rounded (bit-equal); projections and a bf16 model against XLA's bfloat16 path, 2e-2 of the largest entry
(a few bfloat16 roundings of 2^-8 apart). Skipped only without a C++ compiler; the MKL and oneDNN cases
skip where their wheel is not installed (`pip install -e ".[mkl,onednn]"`; scripts/test.sh has both).
"""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_kernel import BF16_BLAS, pytestmark  # noqa: F401  (pytestmark: skip without a C++ compiler)
from test_long_context import _assert_same, _cfg, _init, _logits_and_grads, _runtime_cfg, _tokens

from tformer_jax import backends
from tformer_jax.backends.cpu import kernels as cpu_kernel
from tformer_jax.backends.cpu.kernels import matmul_cpu
from tformer_jax.backends.cpu.xla_cpu import project
from tformer_jax.config import ConfigError, default_config, validate_runtime
from tformer_jax.nn import Transformer

MKL = cpu_kernel.blas_available("mkl")
ONEDNN = cpu_kernel.blas_available("onednn")
ONEDNN_BF16 = cpu_kernel.build.bf16_blas_available("onednn")   # its bfloat16 gemm runs here (AVX-512)
LOADS = {"openblas": (True, ""), "mkl": MKL, "onednn": ONEDNN}
BLAS = [pytest.param(name, marks=pytest.mark.skipif(not ok, reason=f"no {name}: {why}"))
        for name, (ok, why) in LOADS.items()]


@contextlib.contextmanager
def blas(name):
  """The kernels on `name`'s sgemm inside, the BLAS in use before restored after (a process-wide setting, read
  when a kernel runs: dispatch is async, so what is computed inside must be waited for inside; a bf16 kernel
  still running after the switch to OpenBLAS would find no bf16 gemm)."""
  before = cpu_kernel.blas_in_use()
  cpu_kernel.load(blas=name)
  try:
    yield
  finally:
    cpu_kernel.load(blas=before)


SHAPES = [(37, 53, 19), (5, 300, 200), (200, 64, 3), (1, 1, 1), (16, 0, 8), (512, 96, 384)]


@pytest.mark.parametrize("name", BLAS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_float64_product(m, k, n, ta, tb, name):
  r = np.random.default_rng(m * 7 + n)
  a = r.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
  b = r.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
  ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
  with blas(name):
    got = np.asarray(jax.jit(lambda a, b: matmul_cpu(a, b, transpose_a=ta, transpose_b=tb))(a, b))
    assert cpu_kernel.blas_in_use() == name
  assert got.shape == (m, n)
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


def test_a_compiled_call_follows_the_blas_switch():
  """The BLAS is read when the kernel runs: one compiled executable gives the product on each, and a
  different summation order (the libraries' blockings differ) where several load."""
  r = np.random.default_rng(3)
  a, b = r.standard_normal((256, 2000)).astype(np.float32), r.standard_normal((2000, 130)).astype(np.float32)
  f = jax.jit(matmul_cpu)
  ref = a.astype(np.float64) @ b.astype(np.float64)
  got = {}
  for name in (name for name, (ok, _) in LOADS.items() if ok):
    with blas(name):
      got[name] = np.asarray(f(a, b))
    np.testing.assert_allclose(got[name], ref, rtol=0, atol=1e-5 * np.abs(ref).max())
  for name in set(got) - {"openblas"}:
    assert not np.array_equal(got["openblas"], got[name]), name   # two libraries really ran


def test_gradient_matches_xla_dot():
  r = np.random.default_rng(0)
  a, b = r.standard_normal((33, 20)).astype(np.float32), r.standard_normal((17, 20)).astype(np.float32)
  loss = lambda mm: lambda a, b: jnp.sum(jnp.sin(mm(a, b)))  # noqa: E731
  got = jax.grad(loss(lambda a, b: matmul_cpu(a, b, transpose_a=True, transpose_b=True)),
                 argnums=(0, 1))(a.T, b)
  want = jax.grad(loss(lambda a, b: a.T @ b.T), argnums=(0, 1))(a.T, b)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a_shape,b_shape,dtype,kw,match", [
    ((4,), (4, 2), jnp.float32, {}, "2-D"),
    ((3, 4), (4, 2), jnp.float16, {}, "two float32 or two bfloat16"),
    ((3, 4), (4, 2), jnp.float32, dict(out_dtype=jnp.bfloat16), "out_dtype"),
    ((3, 4), (5, 2), jnp.float32, {}, r"contracting dimensions differ \(4 vs 5\)"),
    ((3, 4), (4, 2), jnp.float32, dict(transpose_a=True), r"contracting dimensions differ \(3 vs 4\)"),
])
def test_bad_arguments_are_clear_errors(a_shape, b_shape, dtype, kw, match):
  with pytest.raises(ValueError, match=match):
    matmul_cpu(jnp.ones(a_shape, dtype), jnp.ones(b_shape, dtype), **kw)


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("bld,dhk->blhk", (2, 9, 20), (20, 4, 5)),
    ("blhk,hkd->bld", (2, 9, 4, 5), (4, 5, 20)),
    ("bld,df->blf", (3, 7, 20), (20, 40)),
])
def test_project_weight_grad_kernel_equals_xla(spec, x_shape, w_shape):
  r = np.random.default_rng(1)
  x, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in (x_shape, w_shape))

  def grads(cpu_kernels, x, w):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(project(spec, x, w, cpu_kernels))),
                            argnums=(0, 1)))(x, w)

  hlo = jax.jit(jax.grad(lambda w: jnp.sum(project(spec, x, w, True)))).lower(w).as_text()
  assert "tfj_matmul" in hlo   # the kernel really computes dw here
  for g, want in zip(grads(True, x, w), grads(False, x, w)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)
  # and both are the gradients of plain einsum autodiff (the reference backend's dense)
  plain = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(jnp.einsum(spec, x, w))), argnums=(0, 1)))
  for g, want in zip(grads(True, x, w), plain(x, w)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)
  # half precision is not the kernel's: the same call falls back to XLA's dot
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  for g, want in zip(grads(True, xb, wb), grads(False, xb, wb)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("bld,dhk->blhk", (2, 9, 20), (20, 4, 5)),
    ("blhk,hkd->bld", (2, 9, 4, 5), (4, 5, 20)),
    ("bld,df->blf", (3, 7, 20), (20, 40)),
])
@pytest.mark.parametrize("name", BLAS)
def test_project_all_products_on_the_kernel(spec, x_shape, w_shape, name):
  """runtime.cpu_matmul 'all': the forward y = x w and dx = dy w^T run on the kernel too (three calls in
  the gradient's HLO, one in the forward's), with einsum's values and autodiff's gradients."""
  r = np.random.default_rng(2)
  x, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in (x_shape, w_shape))
  fwd = jax.jit(lambda x, w: project(spec, x, w, True, True))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(project(spec, x, w, True, True))), argnums=(0, 1)))
  assert fwd.lower(x, w).as_text().count("tfj_matmul") == 1
  assert grad.lower(x, w).as_text().count("tfj_matmul") == 3
  plain = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(jnp.einsum(spec, x, w))), argnums=(0, 1)))
  with blas(name):
    np.testing.assert_allclose(np.asarray(fwd(x, w)), np.asarray(jnp.einsum(spec, x, w)), atol=1e-5, rtol=1e-5)
    for g, want in zip(grad(x, w), plain(x, w)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)
  # blas_all without the kernels is XLA's path: no custom call at all
  assert "tfj_matmul" not in jax.jit(jax.grad(lambda w: jnp.sum(project(spec, x, w, False, True)))).lower(w).as_text()


@pytest.mark.parametrize("matmul", ["weight_grads", "all"])
def test_model_gradients_equal_with_the_kernel(matmul):
  """A GQA/SwiGLU model and a GELU one with biases: logits and every parameter gradient match with
  the xla_cpu backend's kernels on (dw, or every projection product) and off (reference attention: only
  the matmul kernel differs)."""
  on = backends.XlaCpuBackend(attention_impl="reference", cpu_kernels=True, cpu_matmul=matmul)
  off = backends.XlaCpuBackend(attention_impl="reference", cpu_kernels=False)
  for kw in (dict(), dict(activation="gelu", mlp_bias=True, qkv_bias=True, position="learned")):
    ref = _cfg(**kw)
    params, tokens = _init(ref), _tokens(2)
    model = Transformer(ref)

    def loss(p, model=model, tokens=tokens):
      return jnp.sum(model.apply({"params": p}, tokens))

    with backends.use(on):
      hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
      fwd = jax.jit(loss).lower(params).as_text()
    assert "tfj_matmul" in hlo and ("tfj_matmul" in fwd) == (matmul == "all")
    _assert_same(_logits_and_grads(ref, params, tokens, backend=on),
                 _logits_and_grads(ref, params, tokens, backend=off))


def test_auto_blas_and_matmul():
  """runtime.cpu_blas 'auto': MKL on an Intel CPU where the wheel loads; else, for bfloat16 compute, oneDNN
  where its wheel loads; else OpenBLAS; explicit choices kept. runtime.cpu_matmul 'auto': every projection
  product on MKL or oneDNN, except under the remat policies that keep dots by primitive (the custom call is
  not one), and only the weight gradients on OpenBLAS."""
  from tformer_jax.backends.runtime import cpu_vendor  # noqa: PLC0415
  before = cpu_kernel.blas_in_use()

  def resolve(remat="none", precision="float32", **runtime):
    c = _runtime_cfg(_cfg(), precision, **runtime)
    c.model.remat = remat
    return backends.resolve_runtime(c, platform="cpu", quiet=True).backend

  try:
    intel_mkl = cpu_vendor() == "GenuineIntel" and MKL[0]
    want = "mkl" if intel_mkl else "openblas"
    b = resolve()
    assert (b.cpu_blas, cpu_kernel.blas_in_use()) == (want, want)
    assert b.cpu_matmul == ("all" if want == "mkl" else "weight_grads")
    want = "mkl" if intel_mkl else "onednn" if ONEDNN_BF16[0] else "openblas"
    b = resolve(precision="bf16")
    assert (b.cpu_blas, cpu_kernel.blas_in_use(), b.cpu_kernels) == (want, want, want != "openblas")
    if b.cpu_kernels:
      assert b.cpu_matmul == "all"
    b = resolve(cpu_blas="openblas")
    assert (b.cpu_blas, b.cpu_matmul, cpu_kernel.blas_in_use()) == ("openblas", "weight_grads", "openblas")
    assert resolve(cpu_blas="openblas", cpu_matmul="all").cpu_matmul == "all"
    for name in (name for name in cpu_kernel.build.BF16_BLAS if LOADS[name][0]):
      for remat, matmul in (("none", "all"), ("full", "all"), ("save_qkvo", "all"), ("dots", "weight_grads"),
                            ("dots_no_batch", "weight_grads")):
        b = resolve(remat, cpu_blas=name)
        assert (b.cpu_blas, b.cpu_matmul, cpu_kernel.blas_in_use()) == (name, matmul, name), remat
      assert resolve("dots", cpu_blas=name, cpu_matmul="all").cpu_matmul == "all"
  finally:
    cpu_kernel.load(blas=before)


def test_auto_uses_the_kernels_only_on_one_device_in_float32_or_bf16_with_a_bf16_gemm():
  """runtime.cpu_kernels 'auto' (backends.resolve_runtime): on for float32 on one CPU device, and for
  bfloat16 compute over float32 parameters (model.dtype or train.precision 'bf16') where the BLAS 'auto'
  picks for it has a bfloat16 gemm (MKL on Intel, else oneDNN, where installed);
  off in float16, with half-precision parameters and under a multi-device mesh (a custom call is not
  partitioned: sharded runs keep XLA's ops)."""
  auto = _cfg(position="alibi", num_kv_heads=0)

  def resolve(m, precision="float32", mesh_devices=1, **runtime):
    return backends.resolve_runtime(_runtime_cfg(m, precision, **runtime), mesh_devices=mesh_devices,
                                    platform="cpu", quiet=True).backend

  before = cpu_kernel.blas_in_use()
  b = resolve(auto)
  assert type(b) is backends.XlaCpuBackend and b.cpu_kernels and b.attention_impl == "chunked"
  # bfloat16 compute over float32 parameters: on where the BLAS has a bfloat16 gemm (MKL, oneDNN), else off
  from tformer_jax.backends.runtime import cpu_vendor  # noqa: PLC0415
  bf16_on = (cpu_vendor() == "GenuineIntel" and MKL[0]) or ONEDNN_BF16[0]
  assert resolve(dataclasses.replace(auto, dtype="bfloat16")).cpu_kernels == bf16_on
  assert resolve(auto, precision="bf16").cpu_kernels == bf16_on
  assert not resolve(auto, precision="bf16", cpu_blas="openblas").cpu_kernels
  assert not resolve(dataclasses.replace(auto, param_dtype="bfloat16")).cpu_kernels
  assert not resolve(auto, precision="fp16").cpu_kernels
  cpu_kernel.load(blas=before)
  assert not resolve(auto, cpu_kernels="off").cpu_kernels
  two = resolve(auto, mesh_devices=2)
  assert not two.cpu_kernels and two.attention_impl == "chunked"
  assert resolve(auto, mesh_devices=1).cpu_kernels
  assert resolve(auto, cpu_kernels="on").cpu_kernels
  assert type(resolve(auto, backend="reference")) is backends.Backend   # no kernels there
  gpu = backends.resolve_runtime(_runtime_cfg(auto), platform="gpu", quiet=True).backend
  assert type(gpu) is backends.Backend and gpu.attention_impl == "xla"


@pytest.mark.parametrize("kw,model_kw,match", [
    (dict(cpu_kernels="on"), dict(dtype="float16"), "runtime.cpu_kernels"),
    (dict(cpu_kernels="on"), dict(param_dtype="bfloat16"), "runtime.cpu_kernels"),
    (dict(cpu_kernels="fast"), {}, "runtime.cpu_kernels"),
    (dict(cpu_kernels="on", backend="reference"), {}, "runtime.cpu_kernels"),
    (dict(cpu_blas="accelerate"), {}, "runtime.cpu_blas"),
    (dict(cpu_matmul="forward"), {}, "runtime.cpu_matmul"),
])
def test_config_rejects(kw, model_kw, match):
  r = default_config().runtime
  r.update(kw)
  with pytest.raises(ConfigError, match=match):
    validate_runtime(r, dataclasses.replace(_cfg(), **model_kw))


def test_resolve_rejects_what_this_platform_cannot_run():
  with pytest.raises(ConfigError, match="runtime.cpu_kernels"):   # 'on' with no xla_cpu backend
    backends.resolve_runtime(_runtime_cfg(_cfg(), backend="reference", cpu_kernels="on"),
                             platform="cpu", quiet=True)
  with pytest.raises(ConfigError, match="runtime.backend"):       # xla_cpu off the CPU platform
    backends.resolve_runtime(_runtime_cfg(_cfg(), backend="xla_cpu"), platform="gpu", quiet=True)


@pytest.mark.parametrize("name,wheel", [("mkl", "mkl"), ("onednn", "onednn-cpu-gomp")])
def test_a_missing_blas_is_a_clear_error(monkeypatch, tmp_path, name, wheel):
  """Where the library is not installed, asking for MKL or oneDNN names the wheel to install (resolve_runtime
  turns it into `runtime.cpu_blas: 'mkl' is unavailable: ...`)."""
  from tformer_jax.backends.cpu.kernels import build  # noqa: PLC0415
  monkeypatch.setattr("sys.prefix", str(tmp_path))
  monkeypatch.setattr("sysconfig.get_config_var", lambda name: str(tmp_path))
  with pytest.raises(cpu_kernel.KernelUnavailable, match=rf"runtime.cpu_blas '{name}'.*pip install {wheel}`"):
    getattr(build, f"_{name}")()


def test_narrow_weights_keep_xlas_dot():
  """A weight with a side under MIN_KERNEL_SIDE (a LoRA adapter: 'bld,dr->blr' at rank 8, and its B) stays
  on XLA's dot even under 'all', with the hand-written VJP's values; a side at the limit goes to the kernel."""
  from tformer_jax.backends.cpu.xla_cpu import MIN_KERNEL_SIDE  # noqa: PLC0415
  r = np.random.default_rng(4)
  x = jnp.asarray(r.standard_normal((2, 9, 32)), jnp.float32)
  for spec, w_shape, on_kernel in (("bld,dr->blr", (32, 8), False), ("blr,rd->bld", (8, 32), False),
                                   ("bld,dr->blr", (32, MIN_KERNEL_SIDE), True)):
    xi = x if spec.startswith("bld") else x[..., :w_shape[0]]
    w = jnp.asarray(r.standard_normal(w_shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda x, w, spec=spec: jnp.sum(jnp.tanh(project(spec, x, w, True, True))),
                            argnums=(0, 1)))
    assert ("tfj_matmul" in grad.lower(xi, w).as_text()) == on_kernel, spec
    plain = jax.jit(jax.grad(lambda x, w, spec=spec: jnp.sum(jnp.tanh(jnp.einsum(spec, x, w))), argnums=(0, 1)))
    for g, want in zip(grad(xi, w), plain(xi, w)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BF16_BLAS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_bf16_matches_float64_product(m, k, n, ta, tb, name):
  """bfloat16 operands on MKL's or oneDNN's gemm_bf16bf16f32: the float32 output is the exact products summed in
  float32; the bfloat16 output (rounded in the kernel from its float32 block) is that output rounded to nearest
  even."""
  r = np.random.default_rng(m * 5 + n)
  a = jnp.asarray(r.standard_normal((k, m) if ta else (m, k)), jnp.bfloat16)
  b = jnp.asarray(r.standard_normal((n, k) if tb else (k, n)), jnp.bfloat16)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
  with blas(name):
    f32 = jax.jit(lambda a, b: matmul_cpu(a, b, transpose_a=ta, transpose_b=tb))(a, b)
    bf = jax.jit(lambda a, b: matmul_cpu(a, b, transpose_a=ta, transpose_b=tb, out_dtype=jnp.bfloat16))(a, b)
    f32, bf = jax.block_until_ready((f32, bf))
  assert (f32.dtype, bf.dtype, f32.shape) == (jnp.float32, jnp.bfloat16, (m, n))
  np.testing.assert_allclose(np.asarray(f32), ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))
  np.testing.assert_array_equal(np.asarray(bf, np.float32), np.asarray(f32.astype(jnp.bfloat16), np.float32))


def test_bf16_without_a_bf16_gemm_is_a_clear_error():
  a = jnp.ones((4, 3), jnp.bfloat16)
  with blas("openblas"), pytest.raises(ValueError, match="bfloat16 gemm"):
    matmul_cpu(a, a, transpose_b=True)


@pytest.mark.skipif(not any(ok for ok, _ in (MKL, ONEDNN_BF16)), reason="no BLAS with a bfloat16 gemm here")
def test_a_compiled_bf16_call_on_a_blas_without_its_gemm_is_an_error_not_a_crash():
  """The check at trace time does not see a later BLAS switch: a bf16 executable compiled on MKL (or oneDNN on
  AVX-512) and run on OpenBLAS, or on oneDNN where its bf16 gemm does not run (no AVX-512), must fail with the
  kernel's message (a null gemm called once crashed benchmarks/finetune_vs_peft.py's worker)."""
  first = "mkl" if MKL[0] else "onednn"
  a = jnp.ones((32, 16), jnp.bfloat16)
  f = jax.jit(matmul_cpu)
  with blas(first):
    jax.block_until_ready(f(a, a.T))
  without = ["openblas"] + (["onednn"] if ONEDNN[0] and not ONEDNN_BF16[0] else [])
  for name in without:
    with blas(name), pytest.raises(Exception, match="no bfloat16 gemm in the BLAS in use"):
      jax.block_until_ready(f(a, a.T))


def _close(got, want, tol=2e-2):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("name", BF16_BLAS)
@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("bld,dhk->blhk", (2, 9, 20), (20, 4, 5)),
    ("bld,df->blf", (3, 7, 20), (20, 40)),
])
def test_project_bf16_on_the_kernel(spec, x_shape, w_shape, name):
  """bfloat16 x and w with bf16=True (the backend on MKL or oneDNN): y, dx and dw all on the bfloat16 kernel (three
  calls in the gradient's HLO), bfloat16 results, the values of XLA's bfloat16 einsum and its autodiff."""
  r = np.random.default_rng(5)
  x, w = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in (x_shape, w_shape))
  f = lambda x, w: jnp.sum(jnp.tanh(project(spec, x, w, True, True, bf16=True).astype(jnp.float32)))  # noqa: E731
  grad = jax.jit(jax.grad(f, argnums=(0, 1)))
  plain = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(jnp.einsum(spec, x, w).astype(jnp.float32))),
                           argnums=(0, 1)))
  with blas(name):   # (the kernel checks for the bfloat16 gemm when traced)
    assert grad.lower(x, w).as_text().count("tfj_matmul_bf16_bf16") == 3
    y = jax.jit(lambda x, w: project(spec, x, w, True, True, bf16=True))(x, w)
    assert y.dtype == jnp.bfloat16
    _close(y, jnp.einsum(spec, x, w))
    for g, want in zip(grad(x, w), plain(x, w)):
      assert g.dtype == jnp.bfloat16
      _close(g, want)
  # without bf16 (a BLAS with no bfloat16 gemm) the same call stays on XLA's dot
  assert "tfj_matmul" not in jax.jit(jax.grad(lambda x, w: jnp.sum(
      project(spec, x, w, True, True).astype(jnp.float32)), argnums=(0, 1))).lower(x, w).as_text()


@pytest.mark.parametrize("name", BF16_BLAS)
def test_bf16_model_on_the_kernels_equals_xlas_bf16(name):
  """A GQA/SwiGLU model computing in bfloat16 over float32 parameters: logits and every parameter gradient with
  the backend's kernels on MKL or oneDNN (projections on the bfloat16 gemm) and off, within bfloat16's
  tolerance."""
  ref = _cfg(dtype="bfloat16")
  params, tokens = _init(_cfg()), _tokens(2)
  model = Transformer(ref)

  def run(backend):
    with backends.use(backend):
      loss = lambda p: jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)  # noqa: E731
      return jax.jit(jax.value_and_grad(loss))(params), jax.jit(jax.grad(loss)).lower(params).as_text()

  with blas(name):
    (l_on, g_on), hlo = run(backends.XlaCpuBackend(attention_impl="reference", cpu_kernels=True, cpu_matmul="all",
                                                   cpu_blas=name))
    (l_off, g_off), _ = run(backends.XlaCpuBackend(attention_impl="reference", cpu_kernels=False))
    l_on, g_on = jax.block_until_ready((l_on, g_on))
  assert "tfj_matmul_bf16_bf16" in hlo
  _close(l_on, l_off)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_on), jax.tree.leaves(g_off)):
    assert a.dtype == jnp.float32, path
    _close(a, b, 5e-2)


@pytest.mark.parametrize("name", BF16_BLAS)
def test_bf16_loss_products_on_the_kernel(name):
  """The backend's loss_matmul: on MKL or oneDNN, nll_sum's bfloat16 weight-gradient product runs on the kernel
  and its other two on XLA's dot with float32 results, with the values of XLA's path; float32 products (and a
  backend on OpenBLAS) keep XLA's dot."""
  from tformer_jax.ops import losses  # noqa: PLC0415
  r = np.random.default_rng(6)
  h = jnp.asarray(r.standard_normal((2, 19, 24)), jnp.bfloat16)
  w = jnp.asarray(0.5 * r.standard_normal((24, 70)), jnp.bfloat16)
  t = jnp.asarray(r.integers(0, 70, (2, 19)))
  on = backends.XlaCpuBackend(cpu_kernels=True, cpu_matmul="all", cpu_blas=name)
  assert backends.XlaCpuBackend(cpu_kernels=True, cpu_blas="openblas").loss_matmul() is None
  f = lambda mm: jax.jit(jax.value_and_grad(lambda h, w: losses.nll_sum(h, w, t, chunk=10, matmul=mm),  # noqa: E731
                                            (0, 1)))
  with blas(name):
    assert f(on.loss_matmul()).lower(h, w).as_text().count("tfj_matmul_bf16") == 1
    (val, grads), (want, want_grads) = jax.block_until_ready((f(on.loss_matmul())(h, w), f(None)(h, w)))
    assert "tfj_matmul" not in f(on.loss_matmul()).lower(h.astype(jnp.float32), w.astype(jnp.float32)).as_text()
  np.testing.assert_allclose(float(val), float(want), rtol=1e-5)
  for g, ref in zip(grads, want_grads):
    _close(g, ref, 1e-2)


@pytest.mark.skipif(not ONEDNN_BF16[0], reason=f"no onednn bfloat16 gemm: {ONEDNN_BF16[1]}")
def test_onednn_leaves_the_callers_openmp_threads_as_they_were():
  """oneDNN's gemms run on OpenMP; the kernel holds each call to one OpenMP thread and puts the calling thread's
  setting back after it. XLA:CPU runs a small product on the Python thread itself, whose setting a library
  sharing the process's libgomp (torch: torch.set_num_threads) reads: left at 1, torch's next matmul ran on one
  thread (its bf16 rate halved, measured)."""
  import ctypes  # noqa: PLC0415
  omp = ctypes.CDLL("libgomp.so.1")   # the runtime libdnnl links (by soname)
  before = omp.omp_get_max_threads()
  omp.omp_set_num_threads(3)
  try:
    a = jnp.asarray(np.random.default_rng(7).standard_normal((64, 48)), jnp.bfloat16)
    with blas("onednn"):
      for dtype in (jnp.bfloat16, jnp.float32):
        got = jax.jit(lambda a: matmul_cpu(a, a, transpose_b=True))(a.astype(dtype))
        _close(got, jnp.dot(a.astype(jnp.float32), a.astype(jnp.float32).T), 1e-5)
        assert omp.omp_get_max_threads() == 3, dtype
  finally:
    omp.omp_set_num_threads(before)
