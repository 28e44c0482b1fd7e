/* Fused pointwise GRU step (forward and backward) for the recurrent engine.
 *
 * Layout and legend as lstm.c (packed rows, direction stride ds, active prefix n), with
 * G = 3H pre-activations in torch's gate order r, z, n. The input part xp holds W_ih x; the
 * recurrent product r = W_hh (h * rmask) of the step is a contiguous [D, n, G] tensor.
 *
 * Forward, one row (torch.nn.GRU; LayerNorm as haste's LayerNormGRU, Ba et al. 2016; zoneout
 * Krueger et al. 2016):
 *   x  = LNx(xp) = gx * (xp - mean) * rstd + b_ih   (if xstat != NULL, else x = xp, b_ih included)
 *   a  = LNh(r)  = gh * (r - mean(r)) * rstd(r)      (if gh != NULL, else a = r)
 *   hb = a + b_hh                                    (b_hh may be NULL)
 *   rg = sig(x_r + hb_r)   zg = sig(x_z + hb_z)   ng = tanh(x_n + rg * hb_n)
 *   h1 = (1 - zg) * ng + zg * h0
 *   h  = zh * h0 + (1 - zh) * h1;  y = h;  hd_next = h * rmask (first n_next rows)
 * Saved for the backward: gates (rg, zg, ng), hbn = hb_n, h0 (hist), rhat/rrstd, xstat (mean,
 * rstd of xp; x-hat is recomputed from xp).
 *
 * float uses fastmath.h's vectorisable exp; double uses libm.
 */
#include <string.h>

#include "fastmath.h"

#define DEFINE_GRU(T, SUFFIX, EXP, TANH, SQRT)                                                         \
static inline T gsig_##SUFFIX(T v) { return 1 / (1 + EXP(-v)); }                                     \
                                                                                                     \
void gru_step_forward_##SUFFIX(                                                                      \
    int64_t D, int64_t B, int64_t n, int64_t n_next, int64_t H, int64_t ds,                          \
    const T* xp, T* xstat, const T* gx, const T* b_ih,                                               \
    const T* r, T* h, const T* rmask, const T* b_hh,                                                 \
    T* y, T* gates, T* hbn, T* hist, T* hd_next, T* rhat, T* rrstd,                                  \
    const T* gh, T eps, const T* zh, T zh_const, int nthreads)                                       \
{                                                                                                    \
    const int64_t G = 3 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, b = task % n, row = d * ds + b, srow = d * B + b;               \
        const T* restrict xr = xp + row * G;                                                         \
        const T* restrict rr = r + (d * n + b) * G;                                                  \
        T* restrict gr = gates + row * G; T* restrict hbr = hbn + row * H;                           \
        T* restrict hr = h + srow * H; T* restrict yr = y + row * H; T* restrict h0r = hist + row * H; \
        const T* bh = b_hh ? b_hh + d * G : 0;                                                       \
        memcpy(h0r, hr, sizeof(T) * H);                                                              \
        if (xstat) { /* gates = x, the input part */                                                 \
            fl_row_stats_##SUFFIX(xr, G, eps, xstat + 2 * row);                                      \
            fl_affine_norm_##SUFFIX(xr, xstat + 2 * row, gx + d * G, b_ih ? b_ih + d * G : 0, G, gr); \
        } else {                                                                                     \
            memcpy(gr, xr, sizeof(T) * G);                                                           \
        }                                                                                            \
        const T* ghd = gh ? gh + d * G : 0; const T* rh = gh ? rhat + row * G : 0;                   \
        if (gh) fl_layer_norm_##SUFFIX(rr, G, eps, rhat + row * G, rrstd + row);                     \
        for (int64_t k = 0; k < H; k++) /* hb_n */                                                   \
            hbr[k] = (ghd ? ghd[2 * H + k] * rh[2 * H + k] : rr[2 * H + k]) + (bh ? bh[2 * H + k] : 0); \
        for (int64_t k = 0; k < 2 * H; k++)                                                          \
            gr[k] = gsig_##SUFFIX(gr[k] + ((ghd ? ghd[k] * rh[k] : rr[k]) + (bh ? bh[k] : 0)));       \
        for (int64_t k = 0; k < H; k++) gr[2 * H + k] = TANH(gr[2 * H + k] + gr[k] * hbr[k]);        \
        const T* zhr = zh ? zh + row * H : 0;                                                        \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zhk = zhr ? zhr[k] : zh_const, zg = gr[H + k];                                   \
            const T h1 = (1 - zg) * gr[2 * H + k] + zg * h0r[k];                                     \
            hr[k] = zhk * h0r[k] + (1 - zhk) * h1;                                                   \
            yr[k] = hr[k];                                                                           \
        }                                                                                            \
        if (hd_next && b < n_next)                                                                   \
            fl_next_input_##SUFFIX(hd_next + row * H, hr, rmask ? rmask + srow * H : 0, H);          \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* Backward of one step. In: dy, dh (grad of the state after this step, [D,B,H]; overwritten with   \
 * the grad of the state before it, except the recurrent GEMM part, which the caller adds).         \
 * Out on the step's n packed rows: dpre (grad of xp: through LNx when xstat != NULL), dhb (grad of \
 * hb = a + b_hh), dr (grad of the recurrent product r; aliases dhb when gh == NULL). Accumulated   \
 * (+=) over the rows: acc_gx / acc_b [D,G] (input LayerNorm gain / b_ih; acc_b needs acc_gx),      \
 * acc_gh [D,G] += dhb * rhat (each may be NULL). */                                                \
void gru_step_backward_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t n, int64_t H, int64_t ds,                                          \
    const T* dy, T* dh, const T* hist, const T* gates, const T* hbn,                                 \
    const T* xp, const T* xstat, const T* gx,                                                        \
    const T* rhat, const T* rrstd, const T* gh, const T* zh, T zh_const,                             \
    T* dpre, T* dhb, T* dr, T* acc_gx, T* acc_b, T* acc_gh, int nthreads)                            \
{                                                                                                    \
    const int64_t G = 3 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, b = task % n, row = d * ds + b, srow = d * B + b;               \
        const T* gr = gates + row * G; const T* hbr = hbn + row * H; const T* h0r = hist + row * H;  \
        const T* dyr = dy + row * H; T* dhr = dh + srow * H;                                         \
        T* dp = dpre + row * G; T* db = dhb + row * G;                                               \
        const T* zhr = zh ? zh + row * H : 0;                                                        \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zhk = zhr ? zhr[k] : zh_const;                                                   \
            const T dhout = dyr[k] + dhr[k], dh1 = (1 - zhk) * dhout;                                \
            const T rg = gr[k], zg = gr[H + k], ng = gr[2 * H + k];                                  \
            const T dn = dh1 * (1 - zg) * (1 - ng * ng);                                             \
            const T dz = dh1 * (h0r[k] - ng) * zg * (1 - zg);                                        \
            const T drg = dn * hbr[k] * rg * (1 - rg);                                               \
            dp[k] = drg; dp[H + k] = dz; dp[2 * H + k] = dn;                                         \
            db[k] = drg; db[H + k] = dz; db[2 * H + k] = dn * rg;                                    \
            dhr[k] = zhk * dhout + dh1 * zg;                                                         \
        }                                                                                            \
        if (gh) {                                                                                    \
            const T* ghd = gh + d * G; const T* rh = rhat + row * G; T* drr = dr + row * G;          \
            for (int64_t k = 0; k < G; k++) drr[k] = db[k] * ghd[k];                                 \
            fl_layer_norm_backward_##SUFFIX(drr, rh, rrstd[row], G, drr);                            \
        }                                                                                            \
    }                                                                                                \
    if (acc_gx || acc_gh) {                                                                          \
    const int64_t chunk = 64, nchunks = (G + chunk - 1) / chunk;                                     \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * nchunks; task++) {                                             \
        const int64_t d = task / nchunks, k0 = (task % nchunks) * chunk;                             \
        const int64_t k1 = k0 + chunk < G ? k0 + chunk : G;                                          \
        for (int64_t b = 0; b < n; b++) {                                                            \
            const int64_t row = d * ds + b;                                                          \
            if (acc_gx)                                                                              \
                fl_accumulate_norm_##SUFFIX(acc_gx + d * G, acc_b ? acc_b + d * G : 0, dpre + row * G, \
                                            xp + row * G, xstat + 2 * row, k0, k1);                  \
            if (acc_gh) { const T* db = dhb + row * G; const T* rh = rhat + row * G; T* a = acc_gh + d * G; \
                for (int64_t k = k0; k < k1; k++) a[k] += db[k] * rh[k]; }                           \
        }                                                                                            \
    }                                                                                                \
    }                                                                                                \
    if (xstat) /* through x = LNx(xp): dpre becomes the grad of xp, in place */                  \
        fl_input_norm_backward_##SUFFIX(D, n, ds, G, dpre, xp, xstat, gx, nthreads);                 \
}

DEFINE_GRU(float, f32, fl_exp_f32, fl_tanh_f32, sqrtf)
DEFINE_GRU(double, f64, exp, tanh, sqrt)
