// Shared by the CPU kernels: the BLAS's sgemm (set from Python) and a parallel-for on XLA's
// intra-op thread pool. Every kernel runs single-threaded sgemm calls as tasks on that pool, so
// that no second set of BLAS threads competes with XLA's own.
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace tfj {

namespace ffi = xla::ffi;

// CBLAS sgemm with 32-bit integers (scipy-openblas32's scipy_cblas_sgemm, oneMKL's cblas_sgemm, or oneDNN's
// dnnl_sgemm behind that signature: matmul.cc), set from Python.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);
extern Sgemm g_sgemm;  // defined in matmul.cc
// CBLAS bfloat16 x bfloat16 -> float32 gemm (oneMKL's cblas_gemm_bf16bf16f32, or oneDNN's
// dnnl_gemm_bf16bf16f32 behind that signature; bf16 as its raw 16 bits), set from Python when the BLAS in use
// has one, else null.
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int,
                          float, float*, int);
extern GemmBf16 g_gemm_bf16;  // defined in matmul.cc
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// The kernels' element types as FFI buffers: T float (F32) or uint16_t (BF16, its raw 16 bits).
template <typename T> struct Dt;
template <> struct Dt<float> { static constexpr ffi::DataType kType = ffi::F32; };
template <> struct Dt<uint16_t> { static constexpr ffi::DataType kType = ffi::BF16; };
template <typename T> using Buf = ffi::Buffer<Dt<T>::kType>;
template <typename T> using Res = ffi::ResultBuffer<Dt<T>::kType>;
template <typename T, typename B> T* Data(B& b) { return reinterpret_cast<T*>(b.untyped_data()); }

inline void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  g_sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(m), int(n), int(k), alpha,
          a, int(lda), b, int(ldb), beta, c, int(ldc));
}

// float32 -> bfloat16 (its raw 16 bits), rounding to nearest even (NaN stays a quiet NaN), as XLA's
// convert rounds; and back.
inline uint16_t ToBf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t((u >> 16) | 0x40u) : uint16_t(r);
}
inline float FromBf16(uint16_t x) { return __builtin_bit_cast(float, uint32_t{x} << 16); }

// C (float32) = alpha op(A) op(B) + beta C for float32 operands (the sgemm) or bfloat16 ones (the bf16 gemm).
inline void GemmT(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
                  int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  g_gemm_bf16(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(m), int(n), int(k), alpha,
              a, int(lda), b, int(ldb), beta, c, int(ldc));
}
inline void GemmT(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  Gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline float Load(float x) { return x; }
inline float Load(uint16_t x) { return FromBf16(x); }
inline void Store(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
inline void Store(uint16_t* dst, const float* src, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = ToBf16(src[j]);
}

// exp(x) (the softmax's x <= 0 after the max is subtracted; any x <= 88); Cephes' expf polynomial, relative
// error below 2e-7, branch-free so that the `omp simd` loops calling it vectorise (-fopenmp-simd:
// the pragmas only allow reordering the reductions; no OpenMP runtime). x < -87 gives 0.
#pragma omp declare simd
inline float FastExp(float x) {
  const float xc = std::max(x, -87.0f);
  // n = round(xc / ln 2) by the 1.5 * 2^23 trick: std::floor would keep GCC from vectorising
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

// Runs f(0..n-1) on the calling thread plus up to (pool threads - 1) helpers. A helper that starts
// after the work is gone finds nothing to claim and never touches f, so returning early is safe.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& f) {
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto run = [st, n, &f]() {
    int64_t mine = 0;
    for (int64_t i; (i = st->next.fetch_add(1)) < n; ++mine) f(i);
    if (mine) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->done += mine;
      if (st->done == n) st->cv.notify_all();
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done == n; });
}

}  // namespace tfj
