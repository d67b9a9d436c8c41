// A float32 matmul as an XLA FFI custom call: C (m x n) = op(A) @ op(B), row-major, op = optional
// transpose. The output is cut into one block of rows (or of columns, when n > m) per thread of
// XLA's intra-op pool and each block is one single-threaded OpenBLAS sgemm.
//
// Why it exists: for weight gradients, dW = X^T dY with X (T x d_in) and dY (T x d_out) contracted
// over the T = batch * length rows, XLA:CPU's Eigen contraction packs the transposed operand slowly
// and runs the model's shapes at 160-190 GFLOP/s on 2 cores where this call runs 190-205 (the
// forward and input-gradient products are already at the machine's matmul rate in XLA).
#include <algorithm>
#include <cstdint>

#include "common.h"

namespace tfj {
Sgemm g_sgemm = nullptr;
}  // namespace tfj

namespace {

namespace ffi = xla::ffi;

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_sgemm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: sgemm not set (load through ops.cpu_kernel)");
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tformer_jax cpu matmul: 2-D operands only");
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? bd[0] : bd[1], kb = transpose_b ? bd[1] : bd[0];
  if (k != kb || cd[0] != m || cd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu matmul: contracting or output dimensions disagree");
  const float *ap = a.typed_data(), *bp = b.typed_data();
  float* cp = c->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(cp, cp + m * n, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t lda = ad[1], ldb = bd[1];
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  // blocks of a multiple of 16 rows/columns (whole SIMD panels), one per thread
  const int64_t step = ((extent + threads - 1) / threads + 15) / 16 * 16;
  tfj::ParallelFor(pool, (extent + step - 1) / step, [&](int64_t t) {
    const int64_t i0 = t * step, len = std::min(step, extent - i0);
    if (by_rows)
      tfj::Gemm(transpose_a, transpose_b, len, n, k, 1.0f, transpose_a ? ap + i0 : ap + i0 * lda,
                lda, bp, ldb, 0.0f, cp + i0 * n, n);
    else
      tfj::Gemm(transpose_a, transpose_b, m, len, k, 1.0f, ap, lda,
                transpose_b ? bp + i0 * ldb : bp + i0, ldb, 0.0f, cp + i0, n);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" void tfj_set_sgemm(void* fn) { tfj::g_sgemm = reinterpret_cast<tfj::Sgemm>(fn); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
