/* Shared helpers of the recurrent step kernels (lstm.c, gru.c).
 *
 * fl_exp_f32: a vectorisable float exp for the sigmoid and tanh (Cody-Waite reduction + degree-6
 * polynomial, rel. error ~2e-7 on [-87, 88]), saturated outside: 0 below -87 (e^x < 1.7e-38,
 * subnormal) and for -inf, inf above 88 and for +inf (e^88 = 1.7e38), NaN stays NaN. So the
 * sigmoid and tanh reach exactly 0 and +-1 as torch's do (and 0 * inf is NaN, as torch's): a
 * clamp of the input to [-87, 88] left the sigmoid a floor of 5.9e-39, which a huge operand turned
 * into a number. fl_tanh_f32 from it (a series near 0, where the exp form loses its relative
 * accuracy).
 * FL_DEFINE_LAYER_NORM(T, SUFFIX, SQRT): per-row LayerNorm without affine (Ba et al. 2016),
 *   fl_layer_norm_SUFFIX(v, len, eps, hat, &rstd): hat = (v - mean) * rstd,
 *   fl_layer_norm_backward_SUFFIX(dhat, hat, rstd, len, dv): dv = rstd * (dhat - mean(dhat)
 *   - hat * mean(dhat * hat)); dv may alias dhat.
 *   Rows whose normalised values are recomputed instead of saved keep stat = (mean, rstd):
 *   fl_row_stats_SUFFIX(v, len, eps, stat),
 *   fl_affine_norm_SUFFIX(v, stat, gain, bias, len, out): out = gain * (v - mean) * rstd + bias
 *   (bias may be NULL; out may alias v),
 *   fl_layer_norm_backward_stat_SUFFIX(dhat, v, stat, len, dv): the backward above with hat
 *   recomputed from v (dv may alias dhat or v),
 *   fl_accumulate_norm_SUFFIX(acc_g, acc_b, d, v, stat, k0, k1): acc_g[k] += d[k] * hat[k] and
 *   acc_b[k] += d[k] (acc_b may be NULL) for k in [k0, k1): the gain and bias gradients of a row.
 *   fl_input_norm_backward_row_SUFFIX(dp, xp, xstat, gx_d, G, out): the step kernels' input
 *   LayerNorm, one row: out = d LN(xp; gx_d) / d xp applied to dp (dp scaled by the gain in place;
 *   out may be dp, or xp itself).
 *   Their row sums: fl_sum_SUFFIX(v, len), fl_sum_sq_SUFFIX(v, len, mean, &s1) (of (v - mean)^2, and
 *   of v - mean into s1),
 *   fl_sum_dot_SUFFIX(d, v, len, mean, rstd, &m1, &m2), on vectors of the variant's width in
 *   independent accumulators.
 */
#ifndef FASTLAYERS_FASTMATH_H
#define FASTLAYERS_FASTMATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h" /* fl_round_bf16_SUFFIX */

static inline float fl_exp_f32(float x) {
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
    /* 2^nf with no float-to-int cast: nf + 1.5 * 2^23 holds nf (|nf| <= 127 on [-87, 88]) in its
     * low mantissa bits, and unsigned arithmetic takes them to the exponent. Exact for every x in
     * [-87, 88]; outside, the bits are some scale and the selects below give the result (as the
     * clamps of the input did, at the same cost). A NaN's bits give some scale, and p, NaN, keeps
     * the result NaN (a cast of NaN, then a shift of the negative integer it gives on x86, are
     * undefined behaviour in C: UBSan's shift-base) */
    union { float f; uint32_t u; } m = { nf + 12582912.0f }, e;
    e.u = (m.u - 0x4B400000u + 127u) << 23;
    const float y = x < -87.0f ? 0.0f : p * e.f;
    return x > 88.0f ? INFINITY : y;
}
/* tanh: 2 / (1 + e^{-2x}) - 1, whose difference cancels near 0 (an error of about one ulp of 1, huge
 * against a small tanh); there (|x| < 0.25) the odd Taylor series to x^11, truncated below 2e-10
 * relative. Both computed and one selected: no branch in the vectorised loops. */
static inline float fl_tanh_f32(float x) {
    const float far = 2.0f / (1.0f + fl_exp_f32(-2.0f * x)) - 1.0f;
    const float x2 = x * x;
    float p = -1382.0f / 155925.0f;
    p = p * x2 + 62.0f / 2835.0f;
    p = p * x2 - 17.0f / 315.0f;
    p = p * x2 + 2.0f / 15.0f;
    p = p * x2 - 1.0f / 3.0f;
    const float near = x + x * x2 * p;
    return fabsf(x) < 0.25f ? near : far;
}

/* The row reductions' vectors: the variant's widest (setup.py's flags) */
#if defined(__AVX512F__)
#define FL_RBYTES 64
#elif defined(__AVX__)
#define FL_RBYTES 32
#else
#define FL_RBYTES 16
#endif

#define FL_DEFINE_LAYER_NORM(T, SUFFIX, SQRT)                                                        \
/* Row sums on vectors of the variant's width in independent accumulators, then one horizontal sum   \
 * (one accumulator waits on its add's latency every vector, and the rows are short: G = 1024 floats \
 * are 64 AVX-512 vectors); the order of the additions is fixed for a variant and a length. */       \
typedef T fl_rv_##SUFFIX __attribute__((vector_size(FL_RBYTES), aligned(sizeof(T)), may_alias));     \
enum { FL_RL_##SUFFIX = FL_RBYTES / (int)sizeof(T) };                                                \
static inline T fl_hsum_##SUFFIX(fl_rv_##SUFFIX a) {                                                 \
    T s = 0;                                                                                         \
    for (int i = 0; i < FL_RL_##SUFFIX; i++) s += a[i];                                              \
    return s;                                                                                        \
}                                                                                                    \
/* the sum of v[k] */                                                                                \
static inline T fl_sum_##SUFFIX(const T* v, int64_t len) {                                           \
    typedef fl_rv_##SUFFIX V; const int64_t L = FL_RL_##SUFFIX;                                      \
    V a0 = {0}, a1 = {0};                                                                            \
    int64_t k = 0;                                                                                   \
    for (; k + 2 * L <= len; k += 2 * L) { a0 += *(const V*)(v + k); a1 += *(const V*)(v + k + L); } \
    T s = fl_hsum_##SUFFIX(a0 + a1);                                                                 \
    for (; k < len; k++) s += v[k];                                                                  \
    return s;                                                                                        \
}                                                                                                    \
/* the sums of d[k] = v[k] - mean and of d[k]^2 (*s1, returned) */                                  \
static inline T fl_sum_sq_##SUFFIX(const T* v, int64_t len, T mean, T* s1) {                         \
    typedef fl_rv_##SUFFIX V; const int64_t L = FL_RL_##SUFFIX;                                      \
    V q0 = {0}, q1 = {0}, p0 = {0}, p1 = {0};                                                        \
    int64_t k = 0;                                                                                   \
    for (; k + 2 * L <= len; k += 2 * L) {                                                           \
        const V d0 = *(const V*)(v + k) - mean, d1 = *(const V*)(v + k + L) - mean;                  \
        q0 += d0 * d0; q1 += d1 * d1; p0 += d0; p1 += d1;                                            \
    }                                                                                                \
    T s = fl_hsum_##SUFFIX(q0 + q1), t = fl_hsum_##SUFFIX(p0 + p1);                                  \
    for (; k < len; k++) { const T d = v[k] - mean; s += d * d; t += d; }                            \
    *s1 = t;                                                                                         \
    return s;                                                                                        \
}                                                                                                    \
/* m1 = the sum of d[k], m2 = the sum of d[k] * (v[k] - mean) * rstd (mean 0, rstd 1: v normalised) */\
static inline void fl_sum_dot_##SUFFIX(const T* d, const T* v, int64_t len, T mean, T rstd, T* m1, T* m2) {\
    typedef fl_rv_##SUFFIX V; const int64_t L = FL_RL_##SUFFIX;                                      \
    V a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};                                                        \
    int64_t k = 0;                                                                                   \
    for (; k + 2 * L <= len; k += 2 * L) {                                                           \
        const V d0 = *(const V*)(d + k), d1 = *(const V*)(d + k + L);                                \
        a0 += d0; a1 += d1;                                                                          \
        b0 += d0 * ((*(const V*)(v + k) - mean) * rstd); b1 += d1 * ((*(const V*)(v + k + L) - mean) * rstd);\
    }                                                                                                \
    T s = fl_hsum_##SUFFIX(a0 + a1), s2 = fl_hsum_##SUFFIX(b0 + b1);                                 \
    for (; k < len; k++) { s += d[k]; s2 += d[k] * ((v[k] - mean) * rstd); }                         \
    *m1 = s; *m2 = s2;                                                                               \
}                                                                                                    \
/* The corrected two-pass mean and variance (Chan, Golub and LeVeque 1983): the first pass's mean m,  \
 * then s1 = sum(v - m), s2 = sum((v - m)^2): mean m + s1 / len, variance (s2 - s1^2 / len) / len.   \
 * The correction also makes a constant row's mean its value (v - m is exact there), so its        \
 * LayerNorm is exactly 0 as torch's is (a cell row clipped whole: sum / len alone left a residue    \
 * that the next LayerNorm, rstd 1 / sqrt(eps) on a near-constant row, multiplied by ~300). */       \
static inline void fl_row_stats_##SUFFIX(const T* v, int64_t len, T eps, T* stat) {                  \
    const T m = fl_sum_##SUFFIX(v, len) / len;                                                       \
    T s1; const T s2 = fl_sum_sq_##SUFFIX(v, len, m, &s1);                                           \
    T var = (s2 - s1 * s1 / len) / len;                                                              \
    var = var < 0 ? 0 : var; /* (rounding below 0: 0; a NaN from an overflowed sum stays NaN) */     \
    stat[0] = m + s1 / len; stat[1] = 1 / SQRT(var + eps);                                           \
}                                                                                                    \
static inline void fl_layer_norm_##SUFFIX(const T* v, int64_t len, T eps, T* hat, T* rstd_out) {     \
    T stat[2]; fl_row_stats_##SUFFIX(v, len, eps, stat);                                             \
    const T mean = stat[0], rstd = stat[1];                                                          \
    for (int64_t k = 0; k < len; k++) hat[k] = (v[k] - mean) * rstd;                                 \
    *rstd_out = rstd;                                                                                \
}                                                                                                    \
static void fl_layer_norm_backward_##SUFFIX(const T* dhat, const T* hat, T rstd, int64_t len, T* dv) { \
    T m1, m2; fl_sum_dot_##SUFFIX(dhat, hat, len, 0, 1, &m1, &m2);                                   \
    m1 /= len; m2 /= len;                                                                            \
    for (int64_t k = 0; k < len; k++) dv[k] = rstd * (dhat[k] - m1 - hat[k] * m2);                   \
}                                                                                                    \
static inline void fl_affine_norm_##SUFFIX(const T* v, const T* stat, const T* gain, const T* bias,  \
                                           int64_t len, T* out) {                                    \
    const T mean = stat[0], rstd = stat[1];                                                          \
    if (bias) for (int64_t k = 0; k < len; k++) out[k] = gain[k] * ((v[k] - mean) * rstd) + bias[k]; \
    else for (int64_t k = 0; k < len; k++) out[k] = gain[k] * ((v[k] - mean) * rstd);                \
}                                                                                                    \
static void fl_layer_norm_backward_stat_##SUFFIX(const T* dhat, const T* v, const T* stat, int64_t len, \
                                                 T* dv) {                                            \
    const T mean = stat[0], rstd = stat[1];                                                          \
    T m1, m2; fl_sum_dot_##SUFFIX(dhat, v, len, mean, rstd, &m1, &m2);                               \
    m1 /= len; m2 /= len;                                                                            \
    for (int64_t k = 0; k < len; k++) dv[k] = rstd * (dhat[k] - m1 - ((v[k] - mean) * rstd) * m2);  \
}                                                                                                    \
static inline void fl_accumulate_norm_##SUFFIX(T* acc_g, T* acc_b, const T* d, const T* v,          \
                                               const T* stat, int64_t k0, int64_t k1) {              \
    const T mean = stat[0], rstd = stat[1];                                                          \
    for (int64_t k = k0; k < k1; k++) acc_g[k] += d[k] * ((v[k] - mean) * rstd);                     \
    if (acc_b) for (int64_t k = k0; k < k1; k++) acc_b[k] += d[k];                                   \
}                                                                                                    \
static inline void fl_input_norm_backward_row_##SUFFIX(T* dp, const T* xp, const T* xstat, const T* gxd, \
                                                      int64_t G, T* out) {                           \
    for (int64_t k = 0; k < G; k++) dp[k] *= gxd[k];                                                 \
    fl_layer_norm_backward_stat_##SUFFIX(dp, xp, xstat, G, out);                                     \
}                                                                                                    \
/* the next step's recurrent input hn = h (* mask); with `low`, each value rounded to the nearest    \
 * bfloat16 (ties to even; float32 loops only): the mixed-precision rule's bf16 GEMM operand, held   \
 * in float32, whose products with a bf16-rounded weight are exact and summed in float32 */          \
static inline void fl_next_input_##SUFFIX(T* hn, const T* h, const T* mask, int64_t len, int low) {  \
    if (mask) for (int64_t k = 0; k < len; k++) hn[k] = h[k] * mask[k];                              \
    else memcpy(hn, h, sizeof(T) * len);                                                             \
    if (low) fl_round_bf16_##SUFFIX(hn, len);                                                        \
}                                                                                                    \
/* the recurrent product's gradient of a row from the gradient g of its LayerNorm's output: with     \
 * the gain, LNh's backward of g * gain (dr may be hat itself: the product then goes through the     \
 * work space gs, len values); else a copy of g (none where dr is g); with `round`, rounded to       \
 * bfloat16 (the C loops' bf16 step products) */                                                     \
static inline void fl_recurrent_grad_##SUFFIX(const T* g, const T* gain, const T* hat, T rstd, int64_t len, \
                                              T* dr, T* gs, int round) {                             \
    if (gain) {                                                                                      \
        T* in = dr == hat ? gs : dr;                                                                 \
        for (int64_t k = 0; k < len; k++) in[k] = g[k] * gain[k];                                    \
        fl_layer_norm_backward_##SUFFIX(in, hat, rstd, len, dr);                                     \
    } else if (dr != g) {                                                                            \
        memcpy(dr, g, sizeof(T) * len);                                                              \
    }                                                                                                \
    if (round) fl_round_bf16_##SUFFIX(dr, len);                                                      \
}
FL_DEFINE_LAYER_NORM(float, f32, sqrtf)
FL_DEFINE_LAYER_NORM(double, f64, sqrt)
#endif
