/* Fused pointwise LSTM step (forward and backward) for the recurrent engine.
 *
 * Legend: D directions, B batch (rows of one direction, sorted longest first), n active rows
 * (the prefix b < n of every direction runs this step; the others are frozen and not touched),
 * H hidden size, G = 4H gate pre-activations in torch's order i, f, g, o.
 * Per-step tensors are contiguous [D, B, X]; row (d, b) starts at (d*B + b)*X.
 *
 * Forward, one row (Ba et al. 2016 layer norm as in haste's LayerNormLSTM; Gers & Schmidhuber
 * 2000 diagonal peepholes; Krueger et al. 2016 zoneout):
 *   a   = LNh(r)       = gh * (r - mean(r)) * rstd(r)        (if gh != NULL, else a = r)
 *   pre = xp + a                                           (xp: input part incl. bias)
 *   i = sig(pre_i + pi*c0)   f = sig(pre_f + pf*c0)   g = tanh(pre_g)
 *   cr  = f*c0 + i*g;  c1 = clip(cr, -clip, clip)  (clip > 0)
 *   o = sig(pre_o + po*c1)
 *   n   = LNc(c1) = gc * (c1 - mean) * rstd + bc           (if gc != NULL, else n = c1)
 *   th = tanh(n);  h1 = o*th
 *   c = zc*c0 + (1-zc)*c1;  h = zh*h0 + (1-zh)*h1        (zoneout; zc/zh masks or constants)
 *   y = h
 * Writes c, h into the state (in place), y, and what the backward needs:
 *   gates [D,B,G] = (i, f, g, o); c1 [D,B,H]; th [D,B,H];
 *   rhat [D,B,G], rrstd [D,B] (LNh); chat [D,B,H], crstd [D,B] (LNc).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DEFINE_LSTM(T, SUFFIX, EXP, TANH, SQRT)                                                        \
static inline T sig_##SUFFIX(T v) { return 1 / (1 + EXP(-v)); }                                      \
static void layer_norm_##SUFFIX(const T* v, int64_t len, T eps, T* hat, T* rstd_out) {               \
    T mean = 0, var = 0;                                                                             \
    for (int64_t k = 0; k < len; k++) mean += v[k];                                                  \
    mean /= len;                                                                                     \
    for (int64_t k = 0; k < len; k++) { T dv = v[k] - mean; var += dv * dv; }                       \
    T rstd = 1 / SQRT(var / len + eps);                                                             \
    for (int64_t k = 0; k < len; k++) hat[k] = (v[k] - mean) * rstd;                                 \
    *rstd_out = rstd;                                                                                \
}                                                                                                    \
                                                                                                     \
/* LayerNorm backward for one row: dv = rstd * (dhat - mean(dhat) - hat * mean(dhat * hat)) */       \
static void layer_norm_backward_##SUFFIX(const T* dhat, const T* hat, T rstd, int64_t len, T* dv) {  \
    T m1 = 0, m2 = 0;                                                                                \
    for (int64_t k = 0; k < len; k++) { m1 += dhat[k]; m2 += dhat[k] * hat[k]; }                     \
    m1 /= len; m2 /= len;                                                                            \
    for (int64_t k = 0; k < len; k++) dv[k] = rstd * (dhat[k] - m1 - hat[k] * m2);                   \
}                                                                                                    \
                                                                                                     \
void lstm_step_forward_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t n, int64_t H,                                                      \
    const T* xp, const T* r, int64_t rB, T* c, T* h, T* y,                                           \
    const T* gh, const T* gc, const T* bc, const T* peep, T clip, T eps,                             \
    const T* zc, const T* zh, T zc_const, T zh_const,                                                \
    T* gates, T* c1_out, T* th_out, T* rhat, T* rrstd, T* chat, T* crstd, int nthreads)             \
{                                                                                                    \
    const int64_t G = 4 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, row = d * B + task % n;                                          \
        const T* xr = xp + row * G;                                                                  \
        const T* rr = r + (d * rB + task % n) * G;                                                   \
        T* gr = gates + row * G;                                                                     \
        T* cr = c + row * H; T* hr = h + row * H; T* yr = y + row * H;                               \
        T* c1r = c1_out + row * H; T* thr = th_out + row * H;                                        \
        const T* pi = peep ? peep + d * 3 * H : 0;                                                   \
        /* pre-activations into gates[] */                                                           \
        if (gh) {                                                                                    \
            T* rh = rhat + row * G;                                                                  \
            layer_norm_##SUFFIX(rr, G, eps, rh, rrstd + row);                                        \
            const T* ghd = gh + d * G;                                                               \
            for (int64_t k = 0; k < G; k++) gr[k] = xr[k] + ghd[k] * rh[k];                          \
        } else {                                                                                     \
            for (int64_t k = 0; k < G; k++) gr[k] = xr[k] + rr[k];                                   \
        }                                                                                            \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T c0 = cr[k];                                                                      \
            T pi_ = gr[k], pf_ = gr[H + k];                                                          \
            if (pi) { pi_ += pi[k] * c0; pf_ += pi[H + k] * c0; }                                    \
            const T ig = sig_##SUFFIX(pi_), fg = sig_##SUFFIX(pf_), gg = TANH(gr[2 * H + k]);                          \
            T c1 = fg * c0 + ig * gg;                                                                \
            if (clip > 0) c1 = c1 > clip ? clip : (c1 < -clip ? -clip : c1);                         \
            T po_ = gr[3 * H + k];                                                                   \
            if (pi) po_ += pi[2 * H + k] * c1;                                                       \
            gr[k] = ig; gr[H + k] = fg; gr[2 * H + k] = gg; gr[3 * H + k] = sig_##SUFFIX(po_);                \
            c1r[k] = c1;                                                                             \
        }                                                                                            \
        const T* nsrc = c1r;                                                                         \
        if (gc) {                                                                                    \
            T* ch = chat + row * H;                                                                  \
            layer_norm_##SUFFIX(c1r, H, eps, ch, crstd + row);                                       \
            const T* gcd = gc + d * H; const T* bcd = bc + d * H;                                    \
            for (int64_t k = 0; k < H; k++) thr[k] = gcd[k] * ch[k] + bcd[k];                        \
            nsrc = thr;                                                                              \
        }                                                                                            \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T th = TANH(nsrc[k]);                                                              \
            const T h1 = gr[3 * H + k] * th;                                                         \
            const T zck = zc ? zc[row * H + k] : zc_const, zhk = zh ? zh[row * H + k] : zh_const;    \
            thr[k] = th;                                                                             \
            cr[k] = zck * cr[k] + (1 - zck) * c1r[k];                                                \
            hr[k] = zhk * hr[k] + (1 - zhk) * h1;                                                    \
            yr[k] = hr[k];                                                                           \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* Backward of one step for the active rows. In: dy (grad of y), dh/dc (grad of the state after    \
 * this step; overwritten in place with the grad of the state before it, except the recurrent GEMM \
 * part, which the caller adds), c0 (state before the step). Out: dpre [D,B,G] (= grad of xp),      \
 * dr [D,B,G] (grad of r; may alias dpre when gh == NULL), dn [D,B,H] (grad of LNc's output, for   \
 * gc/bc; may be NULL when gc == NULL). */                                                          \
void lstm_step_backward_##SUFFIX(                                                                    \
    int64_t D, int64_t B, int64_t n, int64_t H,                                                      \
    const T* dy, T* dh, T* dc, const T* c0,                                                          \
    const T* gates, const T* c1_in, const T* th_in, const T* rhat, const T* rrstd,                   \
    const T* chat, const T* crstd,                                                                   \
    const T* gh, const T* gc, const T* peep, T clip,                                                 \
    const T* zc, const T* zh, T zc_const, T zh_const,                                                \
    T* dpre, T* dr, T* dn_out, int nthreads)                                                         \
{                                                                                                    \
    const int64_t G = 4 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, row = d * B + task % n;                                          \
        const T* gr = gates + row * G;                                                               \
        const T* c1r = c1_in + row * H; const T* thr = th_in + row * H; const T* c0r = c0 + row * H; \
        T* dhr = dh + row * H; T* dcr = dc + row * H; const T* dyr = dy + row * H;                   \
        T* dp = dpre + row * G;                                                                      \
        const T* pi = peep ? peep + d * 3 * H : 0;                                                   \
        T* dn = dn_out ? dn_out + row * H : 0;                                                       \
        /* pass 1: through h1 = o * tanh(n); dn into dp[2H..3H) scratch if no buffer */              \
        T* dnr = dn ? dn : dp + 2 * H; /* scratch: overwritten below */                             \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zhk = zh ? zh[row * H + k] : zh_const;                                           \
            const T dhout = dyr[k] + dhr[k];                                                         \
            const T dh1 = (1 - zhk) * dhout;                                                         \
            const T o = gr[3 * H + k], th = thr[k];                                                  \
            dp[3 * H + k] = dh1 * th * o * (1 - o);   /* d pre_o */                                  \
            dnr[k] = dh1 * o * (1 - th * th);                                                        \
            dhr[k] = zhk * dhout;                     /* zoneout part of dh0 */                      \
        }                                                                                            \
        /* through LNc: dc1 = LN backward of gc * dn; use dp[H..2H) as scratch for dhat */           \
        T* dc1 = dp + 0; /* scratch: dp[0..H) holds dc1 until the gates pass */                      \
        if (gc) {                                                                                    \
            const T* gcd = gc + d * H; const T* ch = chat + row * H;                                 \
            T* dhat = dp + H;                                                                        \
            for (int64_t k = 0; k < H; k++) dhat[k] = dnr[k] * gcd[k];                               \
            layer_norm_backward_##SUFFIX(dhat, ch, crstd[row], H, dc1);                              \
        } else {                                                                                     \
            for (int64_t k = 0; k < H; k++) dc1[k] = dnr[k];                                         \
        }                                                                                            \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zck = zc ? zc[row * H + k] : zc_const;                                           \
            const T i = gr[k], f = gr[H + k], g = gr[2 * H + k];                                     \
            const T c0k = c0r[k];                                                                    \
            T dc1k = dc1[k] + (1 - zck) * dcr[k];                                                    \
            if (pi) dc1k += dp[3 * H + k] * pi[2 * H + k];                                           \
            if (clip > 0) { const T cr = f * c0k + i * g; if (cr > clip || cr < -clip) dc1k = 0; }   \
            const T di = dc1k * g * i * (1 - i);                                                     \
            const T df = dc1k * c0k * f * (1 - f);                                                   \
            const T dg = dc1k * i * (1 - g * g);                                                     \
            T dc0 = dc1k * f + zck * dcr[k];                                                         \
            if (pi) dc0 += di * pi[k] + df * pi[H + k];                                              \
            dcr[k] = dc0;                                                                            \
            dp[k] = di; dp[H + k] = df; dp[2 * H + k] = dg;                                          \
        }                                                                                            \
        if (gh) {                                                                                    \
            const T* ghd = gh + d * G; const T* rh = rhat + row * G;                                 \
            T* drr = dr + row * G;                                                                   \
            for (int64_t k = 0; k < G; k++) drr[k] = dp[k] * ghd[k];                                 \
            layer_norm_backward_##SUFFIX(drr, rh, rrstd[row], G, drr);                               \
        } else if (dr != dpre) {                                                                     \
            memcpy(dr + row * G, dp, sizeof(T) * G);                                                 \
        }                                                                                            \
    }                                                                                                \
}

DEFINE_LSTM(float, f32, expf, tanhf, sqrtf)
DEFINE_LSTM(double, f64, exp, tanh, sqrt)
