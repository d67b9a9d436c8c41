// A matmul as XLA FFI custom calls: C (m x n, float32) = op(A) @ op(B), row-major, op = optional
// transpose; A and B float32 (`tfj_matmul`, the BLAS's sgemm) or bfloat16 (`tfj_matmul_bf16`,
// oneMKL's cblas_gemm_bf16bf16f32: float32 accumulation, AMX/AVX512-BF16 where the CPU has them).
// The output is cut into one block of rows (or of columns, when n > m) per thread of XLA's
// intra-op pool and each block is one single-threaded gemm.
//
// Why it exists: for weight gradients, dW = X^T dY with X (T x d_in) and dY (T x d_out) contracted
// over the T = batch * length rows, XLA:CPU's Eigen contraction packs the transposed operand slowly
// and runs the model's shapes at 160-190 GFLOP/s on 2 cores where this call runs 190-205 (the
// forward and input-gradient products are already at the machine's matmul rate in XLA). In
// bfloat16 the gap is wider: XLA's dW product runs at ~210 GFLOP/s, MKL's at ~1,800 (2 cores with AMX).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace tfj {
Sgemm g_sgemm = nullptr;
GemmBf16 g_gemm_bf16 = nullptr;
PackGetSizeBf16 g_pack_get_size_bf16 = nullptr;
PackBf16 g_pack_bf16 = nullptr;
ComputeBf16 g_compute_bf16 = nullptr;
}  // namespace tfj

namespace {

namespace ffi = xla::ffi;

// gemm(ta, tb, m, n, k, a, lda, b, ldb, c, ldc) on one block; T the operands' element type.
template <typename T, typename G>
ffi::Error MatmulBlocks(ffi::ThreadPool& pool, const T* ap, ffi::Span<const int64_t> ad, const T* bp,
                        ffi::Span<const int64_t> bd, float* cp, ffi::Span<const int64_t> cd,
                        bool transpose_a, bool transpose_b, const G& gemm) {
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tformer_jax cpu matmul: 2-D operands only");
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? bd[0] : bd[1], kb = transpose_b ? bd[1] : bd[0];
  if (k != kb || cd[0] != m || cd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu matmul: contracting or output dimensions disagree");
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
      gemm(transpose_a, transpose_b, len, n, k, transpose_a ? ap + i0 : ap + i0 * lda, lda, bp, ldb,
           cp + i0 * n, n);
    else
      gemm(transpose_a, transpose_b, m, len, k, ap, lda, transpose_b ? bp + i0 * ldb : bp + i0, ldb,
           cp + i0, n);
  });
  return ffi::Error::Success();
}

// bfloat16 A and B, C in bfloat16: each product goes through a float32 panel that fits in cache (kPanel rows,
// or columns when n > m) and is rounded into C from there, so no float32 C is written to memory (XLA's
// separate convert pass over it cost more than the product: 2048 x 576 x 1536 at 1,700 GFLOP/s alone, 520
// with the convert). The operand every panel shares (B for row panels, A for column panels) is packed once
// into MKL's internal layout (gemm_bf16bf16f32_pack): panels of a plain gemm would each re-pack it.
ffi::Error MatmulBf16Panels(ffi::ThreadPool& pool, const uint16_t* ap, ffi::Span<const int64_t> ad,
                            const uint16_t* bp, ffi::Span<const int64_t> bd, uint16_t* cp,
                            ffi::Span<const int64_t> cd, bool transpose_a, bool transpose_b) {
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tformer_jax cpu matmul: 2-D operands only");
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? bd[0] : bd[1], kb = transpose_b ? bd[1] : bd[0];
  if (k != kb || cd[0] != m || cd[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu matmul: contracting or output dimensions disagree");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(cp, cp + m * n, uint16_t{0});
    return ffi::Error::Success();
  }
  constexpr int64_t kPanel = 256;
  const int64_t lda = ad[1], ldb = bd[1];
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  const int ta = transpose_a ? tfj::kTrans : tfj::kNoTrans, tb = transpose_b ? tfj::kTrans : tfj::kNoTrans;
  const int pm = int(std::min(kPanel, m)), pn = int(std::min(kPanel, n));
  // the shared operand, packed once (sizes in bytes)
  const size_t bytes = by_rows ? tfj::g_pack_get_size_bf16(tfj::kBMatrix, pm, int(n), int(k))
                               : tfj::g_pack_get_size_bf16(tfj::kAMatrix, int(m), pn, int(k));
  std::vector<uint16_t> packed(bytes / sizeof(uint16_t) + 1);
  if (by_rows)
    tfj::g_pack_bf16(tfj::kRowMajor, tfj::kBMatrix, tb, pm, int(n), int(k), bp, int(ldb), packed.data());
  else
    tfj::g_pack_bf16(tfj::kRowMajor, tfj::kAMatrix, ta, int(m), pn, int(k), ap, int(lda), packed.data());
  tfj::ParallelFor(pool, (extent + kPanel - 1) / kPanel, [&](int64_t t) {
    const int64_t i0 = t * kPanel, len = std::min(kPanel, extent - i0);
    const int64_t rows = by_rows ? len : m, cols = by_rows ? n : len;
    thread_local std::vector<float> panel;
    panel.resize(size_t(rows * cols));
    if (by_rows)
      tfj::g_compute_bf16(tfj::kRowMajor, ta, tfj::kPacked, int(len), int(n), int(k), 1.0f,
                          transpose_a ? ap + i0 : ap + i0 * lda, int(lda), packed.data(), int(ldb), 0.0f,
                          panel.data(), int(cols));
    else
      tfj::g_compute_bf16(tfj::kRowMajor, tfj::kPacked, tb, int(m), int(len), int(k), 1.0f, packed.data(),
                          int(lda), transpose_b ? bp + i0 * ldb : bp + i0, int(ldb), 0.0f, panel.data(),
                          int(cols));
    uint16_t* out = by_rows ? cp + i0 * n : cp + i0;
    for (int64_t r = 0; r < rows; ++r) tfj::Store(out + r * n, panel.data() + r * cols, cols);
  });
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_sgemm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: sgemm not set (load through ops.cpu_kernel)");
  return MatmulBlocks(pool, a.typed_data(), a.dimensions(), b.typed_data(), b.dimensions(),
                      c->typed_data(), c->dimensions(), transpose_a, transpose_b,
                      [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, float* c, int64_t ldc) {
                        tfj::Gemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
                      });
}

ffi::Error MatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                      ffi::ResultBuffer<ffi::F32> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_gemm_bf16 == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: no bfloat16 gemm in the BLAS in use (oneMKL has one)");
  const auto* ap = reinterpret_cast<const uint16_t*>(a.untyped_data());
  const auto* bp = reinterpret_cast<const uint16_t*>(b.untyped_data());
  return MatmulBlocks(pool, ap, a.dimensions(), bp, b.dimensions(), c->typed_data(), c->dimensions(),
                      transpose_a, transpose_b,
                      [](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                         const uint16_t* b, int64_t ldb, float* c, int64_t ldc) {
                        tfj::g_gemm_bf16(tfj::kRowMajor, ta ? tfj::kTrans : tfj::kNoTrans,
                                         tb ? tfj::kTrans : tfj::kNoTrans, int(m), int(n), int(k), 1.0f,
                                         a, int(lda), b, int(ldb), 0.0f, c, int(ldc));
                      });
}

ffi::Error MatmulBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                            ffi::ResultBuffer<ffi::BF16> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_gemm_bf16 == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: no bfloat16 gemm in the BLAS in use (oneMKL has one)");
  const auto* ap = reinterpret_cast<const uint16_t*>(a.untyped_data());
  const auto* bp = reinterpret_cast<const uint16_t*>(b.untyped_data());
  auto* cp = reinterpret_cast<uint16_t*>(c->untyped_data());
  return MatmulBf16Panels(pool, ap, a.dimensions(), bp, b.dimensions(), cp, c->dimensions(), transpose_a,
                          transpose_b);
}

}  // namespace

extern "C" void tfj_set_sgemm(void* fn) { tfj::g_sgemm = reinterpret_cast<tfj::Sgemm>(fn); }
extern "C" void tfj_set_gemm_bf16(void* gemm, void* pack_get_size, void* pack, void* compute) {
  tfj::g_gemm_bf16 = reinterpret_cast<tfj::GemmBf16>(gemm);
  tfj::g_pack_get_size_bf16 = reinterpret_cast<tfj::PackGetSizeBf16>(pack_get_size);
  tfj::g_pack_bf16 = reinterpret_cast<tfj::PackBf16>(pack);
  tfj::g_compute_bf16 = reinterpret_cast<tfj::ComputeBf16>(compute);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjMatmulBf16, MatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjMatmulBf16ToBf16, MatmulBf16ToBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
