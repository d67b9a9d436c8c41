// SwiGLU's gated activation, y = silu(g) * u, and its gradient as XLA FFI custom calls, float32 or bfloat16
// (computed in float32, each output rounded once).
//
// Why it exists: XLA:CPU runs the (tokens x ffn) activation and its backward as several elementwise
// fusions, each a pass over memory with bfloat16 <-> float32 converts; here each direction is one pass,
// split over XLA's intra-op threads (measured: SmolLM2-135M LoRA in bf16, the three fusions of the
// backward and the forward's took ~0.45 s of a 3.9 s step; docs/runtime.md).
#include <cstdint>

#include "common.h"

namespace {

namespace ffi = xla::ffi;
using tfj::Buf;
using tfj::Data;
using tfj::FastExp;
using tfj::Load;
using tfj::Res;

constexpr int64_t kBlock = 16384;   // elements per task

inline float Out(float x, float*) { return x; }
inline uint16_t Out(float x, uint16_t*) { return tfj::ToBf16(x); }

// sigmoid(g) from exp(-|g|) <= 1 (no overflow for any g)
#pragma omp declare simd
inline float Sigmoid(float g) {
  const float e = FastExp(-std::fabs(g));
  const float r = 1.0f / (1.0f + e);
  return g >= 0.0f ? r : e * r;
}

template <typename T>
void Forward(ffi::ThreadPool& pool, int64_t n, const T* g, const T* u, T* y) {
  tfj::ParallelFor(pool, (n + kBlock - 1) / kBlock, [&](int64_t t) {
    const int64_t i0 = t * kBlock, i1 = std::min(n, i0 + kBlock);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = Load(g[i]);
      y[i] = Out(gi * Sigmoid(gi) * Load(u[i]), y);
    }
  });
}

// dg = dy * u * s * (1 + g (1 - s)), du = dy * g * s, with s = sigmoid(g)
template <typename T>
void Backward(ffi::ThreadPool& pool, int64_t n, const T* g, const T* u, const T* dy, T* dg, T* du) {
  tfj::ParallelFor(pool, (n + kBlock - 1) / kBlock, [&](int64_t t) {
    const int64_t i0 = t * kBlock, i1 = std::min(n, i0 + kBlock);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const float gi = Load(g[i]), s = Sigmoid(gi), d = Load(dy[i]);
      du[i] = Out(d * gi * s, du);
      dg[i] = Out(d * Load(u[i]) * s * (1.0f + gi * (1.0f - s)), dg);
    }
  });
}

ffi::Error SameSize(int64_t a, int64_t b) {
  return a == b ? ffi::Error::Success()
                : ffi::Error(ffi::ErrorCode::kInvalidArgument, "tformer_jax cpu swiglu: operands differ in size");
}

template <typename T>
ffi::Error SwigluFwd(ffi::ThreadPool pool, Buf<T> g, Buf<T> u, Res<T> y) {
  if (auto e = SameSize(g.element_count(), u.element_count()); e.failure()) return e;
  Forward<T>(pool, g.element_count(), Data<const T>(g), Data<const T>(u), Data<T>(*y));
  return ffi::Error::Success();
}

template <typename T>
ffi::Error SwigluBwd(ffi::ThreadPool pool, Buf<T> g, Buf<T> u, Buf<T> dy, Res<T> dg, Res<T> du) {
  if (auto e = SameSize(g.element_count(), u.element_count()); e.failure()) return e;
  if (auto e = SameSize(g.element_count(), dy.element_count()); e.failure()) return e;
  Backward<T>(pool, g.element_count(), Data<const T>(g), Data<const T>(u), Data<const T>(dy), Data<T>(*dg),
              Data<T>(*du));
  return ffi::Error::Success();
}

template <typename T>
auto FwdBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().template Arg<Buf<T>>().template Arg<Buf<T>>().template Ret<Buf<T>>();
}

template <typename T>
auto BwdBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Arg<Buf<T>>()
      .template Ret<Buf<T>>()
      .template Ret<Buf<T>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjSwigluFwd, SwigluFwd<float>, FwdBinding<float>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjSwigluBwd, SwigluBwd<float>, BwdBinding<float>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjSwigluFwdBf16, SwigluFwd<uint16_t>, FwdBinding<uint16_t>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjSwigluBwdBf16, SwigluBwd<uint16_t>, BwdBinding<uint16_t>());
