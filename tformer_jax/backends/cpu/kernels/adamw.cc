// One AdamW step on one parameter array as an XLA FFI custom call: reads p, g, mu, nu once and writes
// the update (-lr * adam direction, into g's buffer), mu and nu in place (the outputs alias the
// inputs), blocks of 32K elements spread over XLA's pool. The same arithmetic, in the same order, as
// optax.chain(clip_by_global_norm, adamw)'s update; the global-norm clip arrives as a factor on g.
// XLA:CPU instead runs three loop fusions per array (each re-reading its inputs) plus copies of the
// old moments that the update still reads after they were overwritten in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

namespace ffi = xla::ffi;

// scalars: lr, b1, b2, 1 - b1, 1 - b2, eps, weight decay (0 where the decay mask is off), 1 - b1^t,
// 1 - b2^t, gradient factor (the clip), finite (0 = skip the step: update 0, moments kept). 1 - b1 comes
// from Python (rounded from double, as optax's `(1 - decay) * g`), not computed here in float.
constexpr int kScalars = 11;

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> g,
                 ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> scalars,
                 ffi::ResultBuffer<ffi::F32> u_out, ffi::ResultBuffer<ffi::F32> mu_out,
                 ffi::ResultBuffer<ffi::F32> nu_out) {
  const int64_t n = p.element_count();
  if (g.element_count() != n || mu.element_count() != n || nu.element_count() != n ||
      scalars.element_count() != kScalars)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "tformer_jax cpu adamw: p, g, mu, nu must have one size; 11 scalars");
  const float* s = scalars.typed_data();
  const float neg_lr = -s[0], b1 = s[1], b2 = s[2], c1 = s[3], c2 = s[4], eps = s[5], wd = s[6],
              bc1 = s[7], bc2 = s[8], gs = s[9];
  const float *pp = p.typed_data(), *gp = g.typed_data(), *mp = mu.typed_data(),
              *vp = nu.typed_data();
  float *uq = u_out->typed_data(), *mq = mu_out->typed_data(), *vq = nu_out->typed_data();
  if (s[10] == 0.0f) {  // non-finite step: a zero update, the moments kept (no-op when aliased)
    std::fill(uq, uq + n, 0.0f);
    if (mq != mp) std::memcpy(mq, mp, n * sizeof(float));
    if (vq != vp) std::memcpy(vq, vp, n * sizeof(float));
    return ffi::Error::Success();
  }
  constexpr int64_t kBlock = 1 << 15;
  auto run = [&](int64_t bi) {
    const int64_t lo = bi * kBlock, hi = std::min(n, lo + kBlock);
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = gp[i] * gs;
      const float m = c1 * gi + b1 * mp[i];
      const float v = c2 * (gi * gi) + b2 * vp[i];
      const float u = (m / bc1) / (std::sqrt(v / bc2) + eps) + wd * pp[i];
      uq[i] = neg_lr * u;
      mq[i] = m;
      vq[i] = v;
    }
  };
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks == 1) run(0); else tfj::ParallelFor(pool, blocks, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TfjAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
