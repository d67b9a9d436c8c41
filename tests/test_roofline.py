"""The roofline arithmetic of tformer_jax/aot/roofline.py on hand-made HLO, with exact expected times.

A machine of round figures (1 TFLOP/s, 100 GB/s HBM, 10 GB/s a link one way, 1 GB/s DCN) and a mesh
(data 2, fsdp 4) laid on a 2 x 4 torus (fsdp along the 4-long dimension, which has wraparound links):
a matmul's compute and HBM time, an all-gather / all-reduce / reduce-scatter over a known axis, a
collective-permute ring, a group across two slices (DCN), and the replica-group forms XLA prints. The
TPU-topology compile is tests/test_aot.py's (its fsdp case checks the same figures on a real step).
"""
import jax
import jax.numpy as jnp
import pytest

from tformer_jax.analysis import hlo
from tformer_jax.aot import roofline

PEAK, HBM, LINK, DCN = 1e12, 1e11, 1e10, 1e9
# device i of the program = mesh position (data, fsdp) = divmod(i, 4) = torus coordinates (x, y)
COORDS = [(d, f) for d in range(2) for f in range(4)]


def machine(slices=(0,) * 8) -> roofline.Machine:
  return roofline.Machine(name="test", peak_flops=PEAK, hbm_bytes_per_s=HBM, link_bytes_per_s=LINK,
                          dcn_bytes_per_s=DCN, wrap_multiple=4, coords=COORDS, slices=list(slices),
                          mesh_shape=(2, 4), mesh_axes=("data", "fsdp"))


def module(*body: str, params: str = "") -> str:
  return "\n".join(["HloModule test", "", f"ENTRY %main ({params}) -> f32[] {{", *body, "}"])


MATMUL = module("  %a = f32[128,256]{1,0} parameter(0)", "  %b = f32[256,512]{1,0} parameter(1)",
                "  ROOT %dot.1 = f32[128,512]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}")


def test_a_matmul_compute_and_hbm_time():
  r = roofline.predict(MATMUL, machine(), model_flops=2 * 128 * 256 * 512, tokens=128)
  flops = 2 * 128 * 256 * 512                                    # 33,554,432
  nbytes = 4 * (128 * 256 + 256 * 512 + 128 * 512)               # operands read, output written: 917,504
  assert (r["flops"], r["hbm_bytes"]) == (flops, nbytes)
  assert r["compute_s"] == pytest.approx(flops / PEAK, rel=1e-12)     # 33.554432 us
  assert r["hbm_s"] == pytest.approx(nbytes / HBM, rel=1e-12)         # 9.17504 us
  assert r["step_s_perfect_overlap"] == pytest.approx(flops / PEAK, rel=1e-12)   # compute-bound op
  assert r["step_s_no_overlap"] == pytest.approx(flops / PEAK + nbytes / HBM, rel=1e-12)
  assert r["bound"] == "compute" and r["collectives_s"] == 0
  assert r["mfu_perfect_overlap"] == pytest.approx(1.0) and r["tokens_per_s_per_chip_perfect_overlap"] == \
      pytest.approx(128 / (flops / PEAK))


def test_an_elementwise_op_is_hbm_bound():
  text = module("  %a = f32[1024,1024]{1,0} parameter(0)",
                "  ROOT %add.1 = f32[1024,1024]{1,0} add(%a, %a)")
  r = roofline.predict(text, machine(), model_flops=0, tokens=1)
  assert r["hbm_bytes"] == 3 * 4 * 2 ** 20 and r["flops"] == 0       # two operand reads, one write
  assert r["step_s_perfect_overlap"] == pytest.approx(3 * 4 * 2 ** 20 / HBM) and r["bound"] == "HBM"


def collective(op: str, out: str, operand: str, groups: str) -> str:
  return module(f"  %p = {operand}{{1,0}} parameter(0)",
                f"  ROOT %c.1 = {out}{{1,0}} {op}(%p), channel_id=1, {groups}, dimensions={{0}}, "
                "use_global_device_ids=true")


FSDP_GROUPS = "replica_groups={{0,1,2,3},{4,5,6,7}}"
DATA_GROUPS = "replica_groups={{0,4},{1,5},{2,6},{3,7}}"
MIB = 2 ** 20


@pytest.mark.parametrize("groups, over, bandwidth, n", [
    (FSDP_GROUPS, "fsdp (ICI)", 2 * LINK, 4),              # the 4-long torus dimension: a bidirectional ring
    ("replica_groups=[2,4]<=[8]", "fsdp (ICI)", 2 * LINK, 4),             # the same groups as an iota
    (DATA_GROUPS, "data (ICI)", LINK, 2),                  # 2 long: no wraparound, one link
    ("replica_groups=[4,2]<=[2,4]T(1,0)", "data (ICI)", LINK, 2),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}", "fsdp (ICI)", 2 * LINK, 4),
    ("replica_groups={}", "data,fsdp (ICI)", 3 * LINK, 8),   # both dimensions' links
])
def test_an_all_gather_over_a_known_axis(groups, over, bandwidth, n):
  text = collective("all-gather", "f32[1024,256]", "f32[256,256]", groups)
  r = roofline.predict(text, machine(), model_flops=0, tokens=1)
  (c,) = r["collectives"]
  assert (c["kind"], c["over"], c["count"], c["bytes"]) == ("all-gather", over, 1, MIB)   # the gathered output
  assert c["seconds"] == pytest.approx(MIB * (n - 1) / n / bandwidth, rel=1e-12)    # fsdp: 39.3216 us
  assert r["step_s_perfect_overlap"] == r["collectives_s"] == c["seconds"] and r["bound"] == "collectives"


def test_all_reduce_reduce_scatter_all_to_all_and_permute_formulas():
  m = machine()
  ar = roofline.predict(collective("all-reduce", "f32[1024,256]", "f32[1024,256]", FSDP_GROUPS), m, 0, 1)
  assert ar["collectives_s"] == pytest.approx(2 * MIB * 3 / 4 / (2 * LINK), rel=1e-12)
  rs = roofline.predict(collective("reduce-scatter", "f32[256,256]", "f32[1024,256]", FSDP_GROUPS), m, 0, 1)
  assert rs["collectives"][0]["bytes"] == MIB                       # counted on its input
  assert rs["collectives_s"] == pytest.approx(MIB * 3 / 4 / (2 * LINK), rel=1e-12)
  a2a = roofline.predict(collective("all-to-all", "f32[1024,256]", "f32[1024,256]", "replica_groups={}"), m, 0, 1)
  # over the 2 x 4 torus: 2/4 + 4/4 hops on average over 3 links a device, and the 4-long ring's bisection
  # (4/4 over its 2 links) give the same 0.5 MiB / LINK; one ring's N/4 over the 8 would say 0.67
  assert a2a["collectives_s"] == pytest.approx(MIB * 0.5 / LINK, rel=1e-12)
  fsdp = roofline.predict(collective("all-to-all", "f32[1024,256]", "f32[1024,256]", FSDP_GROUPS), m, 0, 1)
  assert fsdp["collectives_s"] == pytest.approx(MIB * 4 / 4 / (2 * LINK), rel=1e-12)   # one ring: N/4 hops
  ring = ("source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}")
  cp = roofline.predict(collective("collective-permute", "f32[1024,256]", "f32[1024,256]", ring), m, 0, 1)
  assert cp["collectives"][0]["over"] == "fsdp (ICI)" and cp["collectives_s"] == pytest.approx(MIB / LINK)


def test_a_group_across_slices_runs_over_dcn():
  """Two slices of 4 (data = the slice): the data all-reduce leaves the slice; fsdp stays on ICI."""
  m = machine(slices=(0, 0, 0, 0, 1, 1, 1, 1))
  r = roofline.predict(collective("all-reduce", "f32[1024,256]", "f32[1024,256]", DATA_GROUPS), m, 0, 1)
  assert r["collectives"][0]["over"] == "data (DCN)"
  assert r["collectives_s"] == pytest.approx(2 * MIB / 2 / DCN, rel=1e-12)
  r = roofline.predict(collective("all-reduce", "f32[1024,256]", "f32[1024,256]", FSDP_GROUPS), m, 0, 1)
  assert r["collectives"][0]["over"] == "fsdp (ICI)"
  # XLA:TPU's multi-slice program keeps its groups within a slice: the gradients' DCN all-reduce is modeled
  r = roofline.predict(MATMUL, m, 0, 1, slice_gradients=(2, MIB))
  assert [(c["kind"], c["over"]) for c in r["collectives"]] == [("all-reduce", "data (DCN, modeled)")]
  assert r["collectives_s"] == pytest.approx(2 * MIB / 2 / DCN, rel=1e-12)


SCANNED = """HloModule scanned

%fused_slice (param_0: f32[8,256,256], param_1: s32[]) -> f32[1,256,256] {
  %param_0 = f32[8,256,256]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,256,256]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,256,256}
}

%body (p: (s32[], f32[8,256,256], f32[256,256])) -> (s32[], f32[8,256,256], f32[256,256]) {
  %p = (s32[], f32[8,256,256]{2,1,0}, f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[8,256,256]{2,1,0} get-tuple-element(%p), index=1
  %x = f32[256,256]{1,0} get-tuple-element(%p), index=2
  %layer = f32[1,256,256]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,256,256]{2,1,0}, f32[256,256]{1,0}) tuple(%next, %w, %x)
}

%cond (p: (s32[], f32[8,256,256], f32[256,256])) -> pred[] {
  %p = (s32[], f32[8,256,256]{2,1,0}, f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: f32[8,256,256], x: f32[256,256]) -> (s32[], f32[8,256,256], f32[256,256]) {
  %w = f32[8,256,256]{2,1,0} parameter(0)
  %x = f32[256,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,256,256]{2,1,0}, f32[256,256]{1,0}) tuple(%zero, %w, %x)
  ROOT %loop = (s32[], f32[8,256,256]{2,1,0}, f32[256,256]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_scanned_layer_reads_its_slice_of_the_stacked_weights_each_trip():
  costs = {c["name"]: c for c in hlo.hlo_op_costs(SCANNED)}
  layer = costs["layer"]
  # 8 trips; each reads one layer's slice (not the whole stack) and writes it, plus the s32 index
  assert layer["times"] == 8 and layer["bytes"] == 256 * 256 * 4 + 4 + 256 * 256 * 4
  assert costs["next"]["times"] == 8 and "loop" not in costs and "init" not in costs


def test_replica_group_forms():
  assert hlo.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert hlo.replica_groups("replica_groups=mesh['a'=4,'b'=16], device_ids=([16,4]T(1,0)) {'a'}, x",
                            64)[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo.replica_groups("replica_groups={}, to_apply=%sum", 4) == [[0, 1, 2, 3]]
  assert hlo.replica_groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]


def test_a_compiled_cpu_matmul_is_counted_like_the_hand_made_one():
  """XLA:CPU's own HLO of a jitted matmul: the same FLOPs and at least the operands' and output's bytes."""
  a, b = jnp.ones((128, 256)), jnp.ones((256, 512))
  text = jax.jit(lambda x, y: x @ y).lower(a, b).compile().as_text()
  r = roofline.predict(text, roofline.Machine(name="cpu", peak_flops=PEAK, hbm_bytes_per_s=HBM), 0, 1)
  assert r["flops"] == 2 * 128 * 256 * 512
  assert r["hbm_bytes"] >= 4 * (128 * 256 + 256 * 512 + 128 * 512)
  assert r["compute_s"] == pytest.approx(r["flops"] / PEAK, rel=1e-12)


def test_library_matmul_calls_are_counted():
  """This project's XLA:CPU matmul kernel (dW = X^T dY) and an XLA:GPU cuBLAS GEMM: 2 x output x contracted."""
  cpu = module("  %x = f32[4096,688]{1,0} parameter(0)", "  %dy = f32[4096,256]{1,0} parameter(1)",
               '  ROOT %dw = f32[688,256]{1,0} custom-call(%x, %dy), custom_call_target="tfj_matmul", '
               "operand_layout_constraints={f32[4096,688]{1,0}, f32[4096,256]{1,0}}, "
               "api_version=API_VERSION_TYPED_FFI, backend_config={transpose_a = true, transpose_b = false}")
  assert hlo.hlo_flops(cpu)["dot"] == 2 * 688 * 256 * 4096
  gpu = module("  %a = bf16[128,256]{1,0} parameter(0)", "  %b = bf16[256,512]{1,0} parameter(1)",
               '  ROOT %g = (bf16[128,512]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
               'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
               '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
  r = roofline.predict(gpu, machine(), 0, 1)
  assert r["flops"] == 2 * 128 * 512 * 256 and r["hbm_bytes"] == 2 * (128 * 256 + 256 * 512 + 128 * 512)


NESTED = """HloModule nested

%inner (p0: f32[8,256,256], p1: s32[]) -> f32[1,256,256] {
  %p0 = f32[8,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,256}
}

%outer (q0: f32[8,256,256], q1: s32[], q2: f32[256,256]) -> f32[256,256] {
  %q0 = f32[8,256,256]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[256,256]{1,0} parameter(2)
  %w = f32[1,256,256]{2,1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner
  %wb = f32[256,256]{1,0} bitcast(%w)
  ROOT %d = f32[256,256]{1,0} dot(%q2, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: f32[8,256,256], i: s32[], x: f32[256,256]) -> f32[256,256] {
  %w = f32[8,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[256,256]{1,0} parameter(2)
  ROOT %y = f32[256,256]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%outer
}
"""


def test_a_fusion_that_slices_through_a_nested_fusion_reads_the_slice():
  """XLA:TPU's scanned-layer matmuls take the whole stacked array and slice it in a nested fusion: the op reads
  one layer (256 KiB), not the stack (2 MiB); its FLOPs are the dot's."""
  (y,) = hlo.hlo_op_costs(NESTED)
  layer = 256 * 256 * 4
  assert y["bytes"] == layer + 4 + layer + layer            # the slice, the index, x; the output written
  assert y["flops"] == 2 * 256 * 256 * 256
