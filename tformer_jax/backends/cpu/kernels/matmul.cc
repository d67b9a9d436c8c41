// A matmul as XLA FFI custom calls: C (m x n, float32) = op(A) @ op(B), row-major, op = optional
// transpose; A and B float32 (`tfj_matmul`, the BLAS's sgemm) or bfloat16 (`tfj_matmul_bf16`,
// oneMKL's cblas_gemm_bf16bf16f32 or oneDNN's dnnl_gemm_bf16bf16f32: float32 accumulation,
// AMX/AVX512-BF16 where the CPU has them).
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
#include <type_traits>
#include <vector>

#include "common.h"

namespace tfj {
Sgemm g_sgemm = nullptr;
GemmBf16 g_gemm_bf16 = nullptr;
}  // namespace tfj

// oneDNN's gemm API (dnnl_sgemm, dnnl_gemm_bf16bf16f32: row-major, 'N'/'T', 64-bit sizes) behind the CBLAS
// signatures above. The `onednn` wheels run it on OpenMP (libgomp): each call is held to one OpenMP thread, as
// the other BLASes are forced single-threaded, so that the kernels' one-block-per-thread split holds. The
// setting is per thread and is put back after the call: XLA may run a kernel on the caller's own thread (the
// Python thread), whose OpenMP setting other libraries read (torch.set_num_threads sets it; a process with
// torch shares its libgomp, by soname).
namespace {
template <typename T>
using DnnlGemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const T*, int64_t, const T*, int64_t, float,
                         float*, int64_t);
DnnlGemm<float> g_dnnl_sgemm = nullptr;
DnnlGemm<uint16_t> g_dnnl_gemm_bf16 = nullptr;
void (*g_omp_set_num_threads)(int) = nullptr;
int (*g_omp_get_max_threads)() = nullptr;

template <typename T, DnnlGemm<T>* fn>
void DnnlAsCblas(int, int ta, int tb, int m, int n, int k, float alpha, const T* a, int lda, const T* b, int ldb,
                 float beta, float* c, int ldc) {
  const int before = g_omp_get_max_threads();
  g_omp_set_num_threads(1);
  (*fn)(ta == tfj::kTrans ? 'T' : 'N', tb == tfj::kTrans ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  g_omp_set_num_threads(before);
}

namespace ffi = xla::ffi;

// gemm(ta, tb, m, n, k, a, lda, b, ldb, c, ldc) (C float32) on one block per thread; T the operands' element
// type, C float32, or bfloat16 (uint16_t): then each block's product goes to a float32 buffer of the thread
// and is rounded into C from there, so XLA needs no convert pass over a float32 C (that pass cost more than
// the product: 2048 x 576 x 1536 at 1,700 GFLOP/s alone, 520 with it). Measured against panels of 256 rows
// in cache with the shared operand packed once (MKL's gemm_bf16bf16f32_pack): one block per thread ran the
// model's products 1.0-2.6x faster (2026-12-04).
template <typename T, typename C, typename G>
ffi::Error MatmulBlocks(ffi::ThreadPool& pool, const T* ap, ffi::Span<const int64_t> ad, const T* bp,
                        ffi::Span<const int64_t> bd, C* cp, ffi::Span<const int64_t> cd,
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
    std::fill(cp, cp + m * n, C{0});
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
    const int64_t rows = by_rows ? len : m, cols = by_rows ? n : len;
    C* out = by_rows ? cp + i0 * n : cp + i0;
    float* c32;
    int64_t ldc;
    thread_local std::vector<float> buffer;
    if constexpr (std::is_same_v<C, float>) {
      c32 = out;
      ldc = n;
    } else {
      buffer.resize(size_t(rows * cols));
      c32 = buffer.data();
      ldc = cols;
    }
    if (by_rows)
      gemm(transpose_a, transpose_b, len, n, k, transpose_a ? ap + i0 : ap + i0 * lda, lda, bp, ldb, c32, ldc);
    else
      gemm(transpose_a, transpose_b, m, len, k, ap, lda, transpose_b ? bp + i0 * ldb : bp + i0, ldb, c32, ldc);
    if constexpr (!std::is_same_v<C, float>)
      for (int64_t r = 0; r < rows; ++r) tfj::Store(out + r * n, c32 + r * cols, cols);
  });
  return ffi::Error::Success();
}

void GemmBf16Block(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                   const uint16_t* b, int64_t ldb, float* c, int64_t ldc) {
  tfj::GemmT(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_sgemm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: sgemm not set (load through backends.cpu.kernels)");
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
                      "tformer_jax cpu matmul: no bfloat16 gemm in the BLAS in use (oneMKL has one; oneDNN on AVX-512)");
  const auto* ap = reinterpret_cast<const uint16_t*>(a.untyped_data());
  const auto* bp = reinterpret_cast<const uint16_t*>(b.untyped_data());
  return MatmulBlocks(pool, ap, a.dimensions(), bp, b.dimensions(), c->typed_data(), c->dimensions(),
                      transpose_a, transpose_b, GemmBf16Block);
}

ffi::Error MatmulBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                            ffi::ResultBuffer<ffi::BF16> c, bool transpose_a, bool transpose_b) {
  if (tfj::g_gemm_bf16 == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu matmul: no bfloat16 gemm in the BLAS in use (oneMKL has one; oneDNN on AVX-512)");
  const auto* ap = reinterpret_cast<const uint16_t*>(a.untyped_data());
  const auto* bp = reinterpret_cast<const uint16_t*>(b.untyped_data());
  auto* cp = reinterpret_cast<uint16_t*>(c->untyped_data());
  return MatmulBlocks(pool, ap, a.dimensions(), bp, b.dimensions(), cp, c->dimensions(), transpose_a, transpose_b,
                      GemmBf16Block);
}

}  // namespace

extern "C" void tfj_set_sgemm(void* fn) { tfj::g_sgemm = reinterpret_cast<tfj::Sgemm>(fn); }
extern "C" void tfj_set_gemm_bf16(void* fn) { tfj::g_gemm_bf16 = reinterpret_cast<tfj::GemmBf16>(fn); }
// oneDNN for both gemms: its dnnl_sgemm, dnnl_gemm_bf16bf16f32 and its OpenMP runtime's omp_set_num_threads and
// omp_get_max_threads.
extern "C" void tfj_set_dnnl(void* sgemm, void* gemm_bf16, void* omp_set_num_threads, void* omp_get_max_threads) {
  g_dnnl_sgemm = reinterpret_cast<DnnlGemm<float>>(sgemm);
  g_dnnl_gemm_bf16 = reinterpret_cast<DnnlGemm<uint16_t>>(gemm_bf16);
  g_omp_set_num_threads = reinterpret_cast<void (*)(int)>(omp_set_num_threads);
  g_omp_get_max_threads = reinterpret_cast<int (*)()>(omp_get_max_threads);
  tfj::g_sgemm = DnnlAsCblas<float, &g_dnnl_sgemm>;
  // none where oneDNN's bfloat16 gemm does not run on this CPU: the kernels then answer an error, not a crash
  tfj::g_gemm_bf16 = gemm_bf16 != nullptr ? DnnlAsCblas<uint16_t, &g_dnnl_gemm_bf16> : nullptr;
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
