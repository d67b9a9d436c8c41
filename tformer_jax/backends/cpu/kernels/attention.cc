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
// key-range rule); this file only walks it. float32, or bfloat16 (`*_bf16` targets, on the BLAS's bfloat16
// gemm: oneMKL, oneDNN): the products accumulate in float32, the softmax and its gradient run in float32, and
// what a bfloat16 run stores (probabilities, outputs) is rounded to bfloat16 as XLA's bfloat16 path rounds it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using tfj::Buf;
using tfj::Data;
using tfj::FastExp;
using tfj::GemmT;
using tfj::Load;
using tfj::ParallelFor;
using tfj::Res;
using tfj::Store;
namespace ffi = xla::ffi;

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

Geometry GetGeometry(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                     ffi::Buffer<ffi::S32>& chunks, std::vector<int64_t>& offsets) {
  Geometry geo{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], qd[2] / kd[2], chunks.dimensions()[0], 0};
  const int32_t* c = chunks.typed_data();
  offsets.resize(geo.n_chunks);
  for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {  // packed probabilities: chunk after chunk
    offsets[ci] = geo.packed;
    geo.packed += int64_t{c[4 * ci + 1] - c[4 * ci]} * (c[4 * ci + 3] - c[4 * ci + 2]);
  }
  return geo;
}

template <typename T>
ffi::Error Check(const Geometry& geo, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                 ffi::Span<const int64_t> vd) {
  if (tfj::g_sgemm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu attention: sgemm not set (load through backends.cpu.kernels)");
  if (!std::is_same_v<T, float> && tfj::g_gemm_bf16 == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tformer_jax cpu attention: no bfloat16 gemm in the BLAS in use (oneMKL and oneDNN have one)");
  if (qd.size() != 4 || kd.size() != 4 || geo.kh == 0 || geo.h % geo.kh || kd[3] != geo.d ||
      kd[0] != geo.b || vd.size() != 4 || vd[1] != geo.s || vd[2] != geo.kh || vd[3] != geo.d)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu attention: expected q (B,L,H,D), k and v (B,S,K,D), K | H");
  return ffi::Error::Success();
}

// T: float, or uint16_t for bfloat16 (its raw bits). In float32 the scores are computed in place in the
// packed probabilities and the output is written directly; in bfloat16 both go through float32 buffers.
template <typename T>
void Forward(ffi::ThreadPool& pool, const Geometry& geo, const Rules& rules, const std::vector<int64_t>& offsets,
             const int32_t* c, float scale, const T* qp, const T* kp, const T* vp, T* op, T* pp) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t ldq = geo.ldq(), ldk = geo.ldk();
  ParallelFor(pool, geo.b * geo.h, [&](int64_t task) {
    const int64_t bi = task / geo.h, hi = task % geo.h, ki = hi / geo.g;
    const T* qh = qp + bi * geo.l * ldq + hi * geo.d;
    const T* kh = kp + bi * geo.s * ldk + ki * geo.d;
    const T* vh = vp + bi * geo.s * ldk + ki * geo.d;
    T* oh = op + bi * geo.l * ldq + hi * geo.d;
    T* ph = pp + task * geo.packed;
    std::vector<float> scores, out;
    for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {
      const int64_t r0 = c[4 * ci], r1 = c[4 * ci + 1], lo = c[4 * ci + 2], hi_k = c[4 * ci + 3];
      const int64_t rows = r1 - r0, w = hi_k - lo;
      if (w == 0) {
        for (int64_t i = r0; i < r1; ++i) std::fill(oh + i * ldq, oh + i * ldq + geo.d, T{0});
        continue;
      }
      T* p = ph + offsets[ci];
      float* s;
      if constexpr (f32) {
        s = p;
      } else {
        scores.resize(rows * w);
        s = scores.data();
      }
      GemmT(false, true, rows, w, geo.d, scale, qh + r0 * ldq, ldq, kh + lo * ldk, ldk, 0.0f, s, w);
      SoftmaxChunk(rules, geo, bi, hi, r0, rows, lo, w, s);
      if constexpr (f32) {
        GemmT(false, false, rows, geo.d, w, 1.0f, p, w, vh + lo * ldk, ldk, 0.0f, oh + r0 * ldq, ldq);
      } else {
        Store(p, s, rows * w);
        out.resize(rows * geo.d);
        GemmT(false, false, rows, geo.d, w, 1.0f, p, w, vh + lo * ldk, ldk, 0.0f, out.data(), geo.d);
        for (int64_t i = 0; i < rows; ++i) Store(oh + (r0 + i) * ldq, out.data() + i * geo.d, geo.d);
      }
    }
  });
}

// One task per (batch, kv head): the G query heads of a group accumulate into the same dK, dV (in place
// in float32; in float32 buffers, rounded once at the end, in bfloat16).
template <typename T>
void Backward(ffi::ThreadPool& pool, const Geometry& geo, const std::vector<int64_t>& offsets, const int32_t* c,
              float scale, const T* qp, const T* kp, const T* vp, const T* op, const T* pp, const T* dop,
              T* dqp, T* dkp, T* dvp) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t ldq = geo.ldq(), ldk = geo.ldk();
  int64_t max_cells = 0;
  for (int64_t ci = 0; ci < geo.n_chunks; ++ci)
    max_cells = std::max(max_cells, int64_t{c[4 * ci + 1] - c[4 * ci]} * (c[4 * ci + 3] - c[4 * ci + 2]));
  ParallelFor(pool, geo.b * geo.kh, [&](int64_t task) {
    const int64_t bi = task / geo.kh, ki = task % geo.kh;
    const T* kh = kp + bi * geo.s * ldk + ki * geo.d;
    const T* vh = vp + bi * geo.s * ldk + ki * geo.d;
    std::vector<float> acc(f32 ? 0 : 2 * geo.s * geo.d, 0.0f), dq_rows;
    std::vector<T> ds_t(f32 ? 0 : std::max<int64_t>(max_cells, 1));
    float *dkh, *dvh;
    int64_t ld_acc;
    if constexpr (f32) {
      dkh = dkp + bi * geo.s * ldk + ki * geo.d;
      dvh = dvp + bi * geo.s * ldk + ki * geo.d;
      ld_acc = ldk;
      for (int64_t j = 0; j < geo.s; ++j) {
        std::fill(dkh + j * ldk, dkh + j * ldk + geo.d, 0.0f);
        std::fill(dvh + j * ldk, dvh + j * ldk + geo.d, 0.0f);
      }
    } else {
      dkh = acc.data();
      dvh = acc.data() + geo.s * geo.d;
      ld_acc = geo.d;
    }
    std::vector<float> ds(std::max<int64_t>(max_cells, 1)), delta(geo.l);
    for (int64_t gi = 0; gi < geo.g; ++gi) {
      const int64_t hi = ki * geo.g + gi;
      const T* qh = qp + bi * geo.l * ldq + hi * geo.d;
      const T* oh = op + bi * geo.l * ldq + hi * geo.d;
      const T* doh = dop + bi * geo.l * ldq + hi * geo.d;
      T* dqh = dqp + bi * geo.l * ldq + hi * geo.d;
      const T* ph = pp + (bi * geo.h + hi) * geo.packed;
      for (int64_t i = 0; i < geo.l; ++i) {  // delta = rowsum(dO * O), FlashAttention-2
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t x = 0; x < geo.d; ++x) a += Load(doh[i * ldq + x]) * Load(oh[i * ldq + x]);
        delta[i] = a;
      }
      for (int64_t ci = 0; ci < geo.n_chunks; ++ci) {
        const int64_t r0 = c[4 * ci], r1 = c[4 * ci + 1], lo = c[4 * ci + 2], hi_k = c[4 * ci + 3];
        const int64_t rows = r1 - r0, w = hi_k - lo;
        if (w == 0) {
          for (int64_t i = r0; i < r1; ++i) std::fill(dqh + i * ldq, dqh + i * ldq + geo.d, T{0});
          continue;
        }
        const T* p = ph + offsets[ci];
        float* s = ds.data();
        GemmT(true, false, w, geo.d, rows, 1.0f, p, w, doh + r0 * ldq, ldq, 1.0f, dvh + lo * ld_acc, ld_acc);
        GemmT(false, true, rows, w, geo.d, 1.0f, doh + r0 * ldq, ldq, vh + lo * ldk, ldk, 0.0f, s, w);
        for (int64_t i = 0; i < rows; ++i) {
          const float di = delta[r0 + i];
          float* srow = s + i * w;
          const T* prow = p + i * w;
          for (int64_t j = 0; j < w; ++j) srow[j] = Load(prow[j]) * (srow[j] - di);
        }
        if constexpr (f32) {
          GemmT(false, false, rows, geo.d, w, scale, s, w, kh + lo * ldk, ldk, 0.0f, dqh + r0 * ldq, ldq);
          GemmT(true, false, w, geo.d, rows, scale, s, w, qh + r0 * ldq, ldq, 1.0f, dkh + lo * ld_acc, ld_acc);
        } else {
          Store(ds_t.data(), s, rows * w);
          dq_rows.resize(rows * geo.d);
          GemmT(false, false, rows, geo.d, w, scale, ds_t.data(), w, kh + lo * ldk, ldk, 0.0f, dq_rows.data(),
                geo.d);
          for (int64_t i = 0; i < rows; ++i) Store(dqh + (r0 + i) * ldq, dq_rows.data() + i * geo.d, geo.d);
          GemmT(true, false, w, geo.d, rows, scale, ds_t.data(), w, qh + r0 * ldq, ldq, 1.0f, dkh + lo * ld_acc,
                ld_acc);
        }
      }
    }
    if constexpr (!f32) {
      for (int64_t j = 0; j < geo.s; ++j) {
        Store(dkp + (bi * geo.s + j) * ldk + ki * geo.d, dkh + j * geo.d, geo.d);
        Store(dvp + (bi * geo.s + j) * ldk + ki * geo.d, dvh + j * geo.d, geo.d);
      }
    }
  });
}

template <typename T>
ffi::Error AttnFwd(ffi::ThreadPool pool, Buf<T> q, Buf<T> k, Buf<T> v, ffi::Buffer<ffi::F32> slopes,
                   ffi::Buffer<ffi::S32> valid, ffi::Buffer<ffi::S32> chunks, Res<T> o, Res<T> probs,
                   int64_t causal, int64_t window, int64_t q_offset, float scale, int64_t use_alibi,
                   int64_t use_valid) {
  std::vector<int64_t> offsets;
  const Geometry geo = GetGeometry(q.dimensions(), k.dimensions(), chunks, offsets);
  if (ffi::Error err = Check<T>(geo, q.dimensions(), k.dimensions(), v.dimensions()); err.failure()) return err;
  const Rules rules{causal != 0, window, q_offset, scale,
                    use_alibi ? slopes.typed_data() : nullptr,
                    use_valid ? valid.typed_data() : nullptr};
  Forward<T>(pool, geo, rules, offsets, chunks.typed_data(), scale, Data<const T>(q), Data<const T>(k),
             Data<const T>(v), Data<T>(*o), Data<T>(*probs));
  return ffi::Error::Success();
}

template <typename T>
ffi::Error AttnBwd(ffi::ThreadPool pool, Buf<T> q, Buf<T> k, Buf<T> v, Buf<T> o, Buf<T> probs, Buf<T> d_o,
                   ffi::Buffer<ffi::S32> chunks, Res<T> dq, Res<T> dk, Res<T> dv, float scale) {
  std::vector<int64_t> offsets;
  const Geometry geo = GetGeometry(q.dimensions(), k.dimensions(), chunks, offsets);
  if (ffi::Error err = Check<T>(geo, q.dimensions(), k.dimensions(), v.dimensions()); err.failure()) return err;
  Backward<T>(pool, geo, offsets, chunks.typed_data(), scale, Data<const T>(q), Data<const T>(k),
              Data<const T>(v), Data<const T>(o), Data<const T>(probs), Data<const T>(d_o), Data<T>(*dq),
              Data<T>(*dk), Data<T>(*dv));
  return ffi::Error::Success();
}

template <typename T>
auto FwdBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<Buf<T>>()
      .template Ret<Buf<T>>()
      .template Attr<int64_t>("causal")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("q_offset")
      .template Attr<float>("scale")
      .template Attr<int64_t>("use_alibi")
      .template Attr<int64_t>("use_valid");
}

template <typename T>
auto BwdBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<Buf<T>>()
      .template Ret<Buf<T>>()
      .template Ret<Buf<T>>()
      .template Attr<float>("scale");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionFwd, AttnFwd<float>, FwdBinding<float>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionBwd, AttnBwd<float>, BwdBinding<float>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionFwdBf16, AttnFwd<uint16_t>, FwdBinding<uint16_t>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjChunkedAttentionBwdBf16, AttnBwd<uint16_t>, BwdBinding<uint16_t>());
