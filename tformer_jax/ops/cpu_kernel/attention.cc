// Chunked exact attention for the CPU as XLA FFI custom calls (forward and backward).
//
// Same algorithm as tformer_jax/ops/chunked_attention.py: queries are cut into static chunks, each
// chunk multiplies only against the key range [lo, hi) it can see, the forward keeps the softmax
// probabilities (packed, chunk by chunk) and the backward runs the four matmuls of the dense backward
// on those ranges. What the XLA version cannot do and this one does:
//   * every (batch, head) pair is one task, the tasks run in parallel on XLA's intra-op thread pool,
//     and every matmul inside a task is a single-threaded OpenBLAS sgemm (XLA:CPU instead splits each
//     small per-head matmul over all threads and pays the synchronisation 48 times per product);
//   * the (B, L, H, D) activations are read in place through sgemm's leading dimension (H * D), so
//     no head-major transposes are materialised;
//   * mask, ALiBi bias and softmax run on the probabilities while they are in cache.
// The chunk table (row0, row1, lo, hi) comes from Python (ops/chunked_attention.py owns the
// key-range rule); this file only walks it. float32 only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using tfj::Gemm;
using tfj::ParallelFor;
namespace ffi = xla::ffi;

// exp(x) for the softmax (x <= 0 after the max is subtracted); Cephes' expf polynomial, relative
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

struct Geometry {
  int64_t b, l, h, d, s, kh, g, n_chunks, packed;
  int64_t ldq() const { return h * d; }
  int64_t ldk() const { return kh * d; }
};

struct Rules {
  bool causal;
  int64_t window, q_offset;
  float scale;
  const float* slopes;   // (H,) or null
  const int32_t* valid;  // (B, S) or null
};

// Softmax in place over one chunk's scores (rows x w, keys lo..lo+w) of batch bi, head hi.
void SoftmaxChunk(const Rules& r, const Geometry& geo, int64_t bi, int64_t hi, int64_t row0,
                  int64_t rows, int64_t lo, int64_t w, float* p) {
  const float slope = r.slopes ? r.slopes[hi] : 0.0f;
  const int32_t* valid = r.valid ? r.valid + bi * geo.s + lo : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = p + i * w;
    const int64_t pos = r.q_offset + row0 + i;
    // The visible interval of this row (absolute key indices): ops/masks.py `band`, the one rule
    // every attention implementation follows, for the same (causal, window, q_offset).
    int64_t jlo = lo, jhi = lo + w;
    if (r.causal) {
      jhi = std::min(jhi, pos + 1);
      if (r.window > 0) jlo = std::max(jlo, pos - r.window + 1);
    } else if (r.window > 0) {
      jlo = std::max(jlo, pos - r.window + 1);
      jhi = std::min(jhi, pos + r.window);
    }
    const int64_t a = jlo - lo, e = jhi - lo;
    if (a >= e) {
      std::fill(row, row + w, 0.0f);
      continue;
    }
    if (r.slopes) {
      for (int64_t j = a; j < e; ++j) {
        const float dist = static_cast<float>(pos - (lo + j));
        row[j] -= slope * (r.causal ? dist : std::fabs(dist));
      }
    }
    if (valid) {
      for (int64_t j = a; j < e; ++j) row[j] = valid[j] ? row[j] : -INFINITY;
    }
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = a; j < e; ++j) mx = row[j] > mx ? row[j] : mx;
    if (mx == -INFINITY) {  // every visible key is padding
      std::fill(row, row + w, 0.0f);
      continue;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = a; j < e; ++j) {
      const float v = FastExp(row[j] - mx);
      row[j] = v;
      sum += v;
    }
    const float inv = 1.0f / sum;
    for (int64_t j = a; j < e; ++j) row[j] *= inv;
    std::fill(row, row + a, 0.0f);
    std::fill(row + e, row + w, 0.0f);
  }
}

Geometry GetGeometry(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                     ffi::Buffer<ffi::S32>& chunks, std::vector<int64_t>& offsets) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  Geometry geo{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], qd[2] / kd[2], chunks.dimensions()[0], 0};
  const int32_t* c = chunks.typed_data();
  offsets.resize(geo.n_chunks);
  for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {  // packed probabilities: chunk after chunk
    offsets[ci] = geo.packed;
    geo.packed += int64_t{c[4 * ci + 1] - c[4 * ci]} * (c[4 * ci + 3] - c[4 * ci + 2]);
  }
  return geo;
}

ffi::Error Check(const Geometry& geo, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                 ffi::Buffer<ffi::F32>& v) {
  if (tfj::g_sgemm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu attention: sgemm not set (load through ops.cpu_kernel)");
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || geo.kh == 0 || geo.h % geo.kh ||
      k.dimensions()[3] != geo.d || k.dimensions()[0] != geo.b ||
      v.dimensions().size() != 4 || v.dimensions()[1] != geo.s || v.dimensions()[2] != geo.kh ||
      v.dimensions()[3] != geo.d)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu attention: expected q (B,L,H,D), k and v (B,S,K,D), K | H");
  return ffi::Error::Success();
}

ffi::Error AttnFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> slopes,
                   ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::S32> chunks,
                   ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> probs, int64_t causal,
                   int64_t window, int64_t q_offset, float scale, int64_t use_alibi,
                   int64_t use_valid) {
  std::vector<int64_t> offsets;
  const Geometry geo = GetGeometry(q, k, chunks, offsets);
  if (ffi::Error err = Check(geo, q, k, v); err.failure()) return err;
  const Rules rules{causal != 0, window, q_offset, scale,
                    use_alibi ? slopes.typed_data() : nullptr,
                    use_valid ? valid.typed_data() : nullptr};
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *pp = probs->typed_data();
  const int32_t* c = chunks.typed_data();
  const int64_t ldq = geo.ldq(), ldk = geo.ldk();
  ParallelFor(pool, geo.b * geo.h, [&](int64_t task) {
    const int64_t bi = task / geo.h, hi = task % geo.h, ki = hi / geo.g;
    const float* qh = qp + bi * geo.l * ldq + hi * geo.d;
    const float* kh = kp + bi * geo.s * ldk + ki * geo.d;
    const float* vh = vp + bi * geo.s * ldk + ki * geo.d;
    float* oh = op + bi * geo.l * ldq + hi * geo.d;
    float* ph = pp + task * geo.packed;
    for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {
      const int64_t r0 = c[4 * ci], r1 = c[4 * ci + 1], lo = c[4 * ci + 2], hi_k = c[4 * ci + 3];
      const int64_t rows = r1 - r0, w = hi_k - lo;
      if (w == 0) {
        for (int64_t i = r0; i < r1; ++i) std::fill(oh + i * ldq, oh + i * ldq + geo.d, 0.0f);
        continue;
      }
      float* p = ph + offsets[ci];
      Gemm(false, true, rows, w, geo.d, scale, qh + r0 * ldq, ldq, kh + lo * ldk, ldk, 0.0f, p, w);
      SoftmaxChunk(rules, geo, bi, hi, r0, rows, lo, w, p);
      Gemm(false, false, rows, geo.d, w, 1.0f, p, w, vh + lo * ldk, ldk, 0.0f, oh + r0 * ldq, ldq);
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttnBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> probs,
                   ffi::Buffer<ffi::F32> d_o, ffi::Buffer<ffi::S32> chunks,
                   ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                   ffi::ResultBuffer<ffi::F32> dv, float scale) {
  std::vector<int64_t> offsets;
  const Geometry geo = GetGeometry(q, k, chunks, offsets);
  if (ffi::Error err = Check(geo, q, k, v); err.failure()) return err;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *op = o.typed_data(), *pp = probs.typed_data(), *dop = d_o.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int32_t* c = chunks.typed_data();
  const int64_t ldq = geo.ldq(), ldk = geo.ldk();
  int64_t max_cells = 0;
  for (int64_t ci = 0; ci < geo.n_chunks; ++ci)
    max_cells = std::max(max_cells, int64_t{c[4 * ci + 1] - c[4 * ci]} * (c[4 * ci + 3] - c[4 * ci + 2]));
  // one task per (batch, kv head): the G query heads of a group accumulate into the same dK, dV
  ParallelFor(pool, geo.b * geo.kh, [&](int64_t task) {
    const int64_t bi = task / geo.kh, ki = task % geo.kh;
    const float* kh = kp + bi * geo.s * ldk + ki * geo.d;
    const float* vh = vp + bi * geo.s * ldk + ki * geo.d;
    float* dkh = dkp + bi * geo.s * ldk + ki * geo.d;
    float* dvh = dvp + bi * geo.s * ldk + ki * geo.d;
    for (int64_t j = 0; j < geo.s; ++j) {
      std::fill(dkh + j * ldk, dkh + j * ldk + geo.d, 0.0f);
      std::fill(dvh + j * ldk, dvh + j * ldk + geo.d, 0.0f);
    }
    std::vector<float> ds(std::max<int64_t>(max_cells, 1)), delta(geo.l);
    for (int64_t gi = 0; gi < geo.g; ++gi) {
      const int64_t hi = ki * geo.g + gi;
      const float* qh = qp + bi * geo.l * ldq + hi * geo.d;
      const float* oh = op + bi * geo.l * ldq + hi * geo.d;
      const float* doh = dop + bi * geo.l * ldq + hi * geo.d;
      float* dqh = dqp + bi * geo.l * ldq + hi * geo.d;
      const float* ph = pp + (bi * geo.h + hi) * geo.packed;
      for (int64_t i = 0; i < geo.l; ++i) {  // delta = rowsum(dO * O), FlashAttention-2
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t x = 0; x < geo.d; ++x) acc += doh[i * ldq + x] * oh[i * ldq + x];
        delta[i] = acc;
      }
      for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {
        const int64_t r0 = c[4 * ci], r1 = c[4 * ci + 1], lo = c[4 * ci + 2], hi_k = c[4 * ci + 3];
        const int64_t rows = r1 - r0, w = hi_k - lo;
        if (w == 0) {
          for (int64_t i = r0; i < r1; ++i) std::fill(dqh + i * ldq, dqh + i * ldq + geo.d, 0.0f);
          continue;
        }
        const float* p = ph + offsets[ci];
        float* s = ds.data();
        Gemm(true, false, w, geo.d, rows, 1.0f, p, w, doh + r0 * ldq, ldq, 1.0f, dvh + lo * ldk, ldk);
        Gemm(false, true, rows, w, geo.d, 1.0f, doh + r0 * ldq, ldq, vh + lo * ldk, ldk, 0.0f, s, w);
        for (int64_t i = 0; i < rows; ++i) {
          const float di = delta[r0 + i];
          float* srow = s + i * w;
          const float* prow = p + i * w;
          for (int64_t j = 0; j < w; ++j) srow[j] = prow[j] * (srow[j] - di);
        }
        Gemm(false, false, rows, geo.d, w, scale, s, w, kh + lo * ldk, ldk, 0.0f, dqh + r0 * ldq, ldq);
        Gemm(true, false, w, geo.d, rows, scale, s, w, qh + r0 * ldq, ldq, 1.0f, dkh + lo * ldk, ldk);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionFwd, AttnFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("q_offset")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("use_alibi")
                                  .Attr<int64_t>("use_valid"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionBwd, AttnBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
