/* Shared helpers of the recurrent step kernels (lstm.c, gru.c).
 *
 * fl_exp_f32: a vectorisable float exp (Cody-Waite reduction + degree-6 polynomial, rel. error
 * ~2e-7); inputs are clamped to [-87, 88] (so +-inf give finite limits, as expf's 0 and its
 * largest values do through the sigmoid and tanh), and NaN stays NaN. fl_tanh_f32 from it.
 * FL_DEFINE_LAYER_NORM(T, SUFFIX, SQRT): per-row LayerNorm without affine (Ba et al. 2016),
 *   fl_layer_norm_SUFFIX(v, len, eps, hat, &rstd): hat = (v - mean) * rstd,
 *   fl_layer_norm_backward_SUFFIX(dhat, hat, rstd, len, dv): dv = rstd * (dhat - mean(dhat)
 *   - hat * mean(dhat * hat)); dv may alias dhat.
 */
#ifndef FASTLAYERS_FASTMATH_H
#define FASTLAYERS_FASTMATH_H
#include <math.h>
#include <stdint.h>

static inline float fl_exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const float nf = rintf(t); /* NaN stays NaN (vroundps); a cast would need -ffinite-math-only to vectorise */
    const float r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)nf + 127) << 23;
    return p * u.f;
}
static inline float fl_tanh_f32(float x) { return 2.0f / (1.0f + fl_exp_f32(-2.0f * x)) - 1.0f; }

#define FL_DEFINE_LAYER_NORM(T, SUFFIX, SQRT)                                                        \
static void fl_layer_norm_##SUFFIX(const T* v, int64_t len, T eps, T* hat, T* rstd_out) {            \
    T mean = 0, var = 0;                                                                             \
    for (int64_t k = 0; k < len; k++) mean += v[k];                                                  \
    mean /= len;                                                                                     \
    for (int64_t k = 0; k < len; k++) { T dv = v[k] - mean; var += dv * dv; }                       \
    T rstd = 1 / SQRT(var / len + eps);                                                             \
    for (int64_t k = 0; k < len; k++) hat[k] = (v[k] - mean) * rstd;                                 \
    *rstd_out = rstd;                                                                                \
}                                                                                                    \
static void fl_layer_norm_backward_##SUFFIX(const T* dhat, const T* hat, T rstd, int64_t len, T* dv) { \
    T m1 = 0, m2 = 0;                                                                                \
    for (int64_t k = 0; k < len; k++) { m1 += dhat[k]; m2 += dhat[k] * hat[k]; }                     \
    m1 /= len; m2 /= len;                                                                            \
    for (int64_t k = 0; k < len; k++) dv[k] = rstd * (dhat[k] - m1 - hat[k] * m2);                   \
}                                                                                                    \
static inline void fl_next_input_##SUFFIX(T* hn, const T* h, const T* mask, int64_t len) {          \
    if (mask) for (int64_t k = 0; k < len; k++) hn[k] = h[k] * mask[k];                              \
    else memcpy(hn, h, sizeof(T) * len);                                                             \
}
FL_DEFINE_LAYER_NORM(float, f32, sqrtf)
FL_DEFINE_LAYER_NORM(double, f64, sqrt)
#endif
