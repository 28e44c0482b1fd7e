/* Fused pointwise LSTM step (forward and backward) for the recurrent engine.
 *
 * Legend: D directions, B batch (sorted longest first), n active rows (the prefix b < n of every
 * direction runs this step; the state rows b >= n are frozen and not touched), H hidden size,
 * G = 4H pre-activations in torch's gate order i, f, g, o.
 * Step buffers are the packed rows of one step in [D, N, X] tensors (N = total valid rows of a
 * direction, the rows of step t follow those of step t-1, as in a PackedSequence): the caller
 * passes the address of (d=0, first row of the step) and the row stride between directions
 * `ds` (= N); row (d, b) of the step is at (d*ds + b)*X. The recurrent product r of the step is
 * a contiguous [D, n, G] tensor. State h, c and the recurrent-dropout mask are [D, B, X].
 * Per-row LayerNorm statistics are [D, N] (rrstd) or [D, N, 2] (mean, rstd: xstat, cstat).
 * Forward, one row (Ba et al. 2016 layer norm as in haste's LayerNormLSTM; Gers & Schmidhuber
 * 2000 diagonal peepholes; Krueger et al. 2016 zoneout):
 *   x   = LNx(xp) = gx * (xp - mean) * rstd + bias   (if xstat != NULL, else x = xp, bias included)
 *   a   = LNh(r)  = gh * (r - mean(r)) * rstd(r)      (if gh != NULL, else a = r)
 *   pre = x + a
 *   i = sig(pre_i + pi*c0)   f = sig(pre_f + pf*c0)   g = tanh(pre_g)
 *   cr  = f*c0 + i*g;  c1 = clip(cr, -clip, clip)  (clip > 0)
 *   o = sig(pre_o + po*c1)
 *   n   = LNc(c1) = gc * (c1 - mean) * rstd + bc     (if gc != NULL, else n = c1)
 *   h1 = o*tanh(n)
 *   c = zc*c0 + (1-zc)*c1;  h = zh*h0 + (1-zh)*h1        (zoneout; zc/zh masks or constants)
 *   y = h;  hd_next = h * rmask (the next step's recurrent input)
 * Saved for the backward: gates (i, f, g, o), c1, rhat/rrstd, the statistics xstat and cstat
 * (x-hat, n and tanh(n) are recomputed from xp and c1), and c0 in chist only when zoneout makes
 * it differ from the previous step's c1 (chist may be NULL otherwise).
 * hd_next is the next step's block of the same packed layout, so only its first n_next rows
 * (the sequences still running at the next step) are written.
 *
 * float uses fastmath.h's vectorisable exp; double uses libm. Built with -fno-trapping-math
 * -fno-signed-zeros (see __init__.py) so that the clamps and selects vectorise; NaN propagates
 * (every clamp is written `v < lo ? lo : v`, which keeps a NaN v).
 */
#include <string.h>

#include "fastmath.h"

#define DEFINE_LSTM(T, SUFFIX, EXP, TANH, SQRT)                                                        \
static inline T sig_##SUFFIX(T v) { return 1 / (1 + EXP(-v)); }                                      \
                                                                                                     \
void lstm_step_forward_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t n, int64_t n_next, int64_t H, int64_t ds,                          \
    const T* xp, T* xstat, const T* gx, const T* bias,                                               \
    const T* r, T* c, T* h, const T* rmask,                                                          \
    T* y, T* gates, T* c1_out, T* chist, T* hd_next,                                                 \
    T* rhat, T* rrstd, T* cstat,                                                                     \
    const T* gh, const T* gc, const T* bc, const T* peep, T clip, T eps,                             \
    const T* zc, const T* zh, T zc_const, T zh_const, int nthreads)                                  \
{                                                                                                    \
    const int64_t G = 4 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, b = task % n, row = d * ds + b, srow = d * B + b;               \
        const T* restrict xr = xp + row * G;                                                         \
        const T* restrict rr = r + (d * n + b) * G;                                                  \
        T* restrict gr = gates + row * G;                                                            \
        T* cr = c + srow * H; /* c0 until the last loop overwrites it with the new state */         \
        T* restrict hr = h + srow * H; T* restrict yr = y + row * H;                                 \
        T* restrict c1r = c1_out + row * H;                                                          \
        const T* restrict pi = peep ? peep + d * 3 * H : 0;                                          \
        if (chist) memcpy(chist + row * H, cr, sizeof(T) * H);                                       \
        if (xstat) fl_row_stats_##SUFFIX(xr, G, eps, xstat + 2 * row);                               \
        if (gh) { /* gates = LNh(r), then + the input part */                                        \
            fl_layer_norm_##SUFFIX(rr, G, eps, rhat + row * G, rrstd + row);                         \
            const T* ghd = gh + d * G; const T* rh = rhat + row * G;                                 \
            for (int64_t k = 0; k < G; k++) gr[k] = ghd[k] * rh[k];                                  \
        } else {                                                                                     \
            memcpy(gr, rr, sizeof(T) * G);                                                           \
        }                                                                                            \
        if (xstat) {                                                                                 \
            const T* xs = xstat + 2 * row; const T mx = xs[0], rx = xs[1];                           \
            const T* gxd = gx + d * G; const T* bd = bias ? bias + d * G : 0;                        \
            if (bd) for (int64_t k = 0; k < G; k++) gr[k] += gxd[k] * ((xr[k] - mx) * rx) + bd[k];  \
            else for (int64_t k = 0; k < G; k++) gr[k] += gxd[k] * ((xr[k] - mx) * rx);              \
        } else {                                                                                     \
            for (int64_t k = 0; k < G; k++) gr[k] += xr[k];                                          \
        }                                                                                            \
        if (pi) for (int64_t k = 0; k < H; k++) { gr[k] += pi[k] * cr[k]; gr[H + k] += pi[H + k] * cr[k]; } \
        for (int64_t k = 0; k < 2 * H; k++) gr[k] = sig_##SUFFIX(gr[k]); /* two loops: one exp each */ \
        for (int64_t k = 2 * H; k < 3 * H; k++) gr[k] = TANH(gr[k]);                               \
        for (int64_t k = 0; k < H; k++) c1r[k] = gr[H + k] * cr[k] + gr[k] * gr[2 * H + k];         \
        if (clip > 0)                                                                                \
            for (int64_t k = 0; k < H; k++) c1r[k] = c1r[k] > clip ? clip : (c1r[k] < -clip ? -clip : c1r[k]); \
        if (pi) for (int64_t k = 0; k < H; k++) gr[3 * H + k] += pi[2 * H + k] * c1r[k];             \
        for (int64_t k = 0; k < H; k++) gr[3 * H + k] = sig_##SUFFIX(gr[3 * H + k]);                 \
        const T* zcr = zc ? zc + row * H : 0; const T* zhr = zh ? zh + row * H : 0;                  \
        T mc = 0, rc = 1; const T* gcd = 0; const T* bcd = 0;                                        \
        if (gc) {                                                                                    \
            T* cs = cstat + 2 * row; fl_row_stats_##SUFFIX(c1r, H, eps, cs);                         \
            mc = cs[0]; rc = cs[1]; gcd = gc + d * H; bcd = bc + d * H;                              \
        }                                                                                            \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zck = zcr ? zcr[k] : zc_const, zhk = zhr ? zhr[k] : zh_const;                    \
            const T nk = gcd ? gcd[k] * ((c1r[k] - mc) * rc) + bcd[k] : c1r[k];                      \
            const T h1 = gr[3 * H + k] * TANH(nk);                                                   \
            cr[k] = zck * cr[k] + (1 - zck) * c1r[k];                                                \
            hr[k] = zhk * hr[k] + (1 - zhk) * h1;                                                    \
            yr[k] = hr[k];                                                                           \
        }                                                                                            \
        if (hd_next && b < n_next)                                                                   \
            fl_next_input_##SUFFIX(hd_next + row * H, hr, rmask ? rmask + srow * H : 0, H);          \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* Backward of one step. In: dy (grad of y), dh/dc (grad of the state after this step, [D,B,H];     \
 * overwritten in place with the grad of the state before it, except the recurrent GEMM part,       \
 * which the caller adds); chist: c before the step, row (d, b) at chist + (d*cds + b)*H (the       \
 * saved copy, the previous step's c1 block, or c_0). Out, on the step's n packed rows: dpre (grad  \
 * of xp: through LNx when xstat != NULL), dr (grad of r; may alias dpre when gh == NULL and xstat  \
 * == NULL); dn_scratch [D,B,H] (work space for LNc). Parameter gradients are accumulated (+=) over  \
 * the active rows into acc_gx / acc_b / acc_gh [D,G], acc_gc / acc_bc [D,H], acc_peep [D,3H]       \
 * (each may be NULL). */                                                                           \
void lstm_step_backward_##SUFFIX(                                                                    \
    int64_t D, int64_t B, int64_t n, int64_t H, int64_t ds,                                          \
    const T* dy, T* dh, T* dc, const T* chist, int64_t cds,                                          \
    const T* xp, const T* xstat, const T* gx,                                                        \
    const T* gates, const T* c1_in, const T* rhat, const T* rrstd, const T* cstat,                   \
    const T* gh, const T* gc, const T* bc, const T* peep, T clip,                                    \
    const T* zc, const T* zh, T zc_const, T zh_const,                                                \
    T* dpre, T* dr, T* dn_scratch,                                                                   \
    T* acc_gx, T* acc_b, T* acc_gh, T* acc_gc, T* acc_bc, T* acc_peep, int nthreads)                 \
{                                                                                                    \
    const int64_t G = 4 * H;                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        const int64_t d = task / n, b = task % n, row = d * ds + b, srow = d * B + b;               \
        T* dp = dpre + row * G;                                                                      \
        const T* gr = gates + row * G;                                                               \
        const T* c1r = c1_in + row * H; const T* c0r = chist + (d * cds + b) * H;                    \
        T* dhr = dh + srow * H; T* dcr = dc + srow * H; const T* dyr = dy + row * H;                 \
        const T* pi = peep ? peep + d * 3 * H : 0;                                                   \
        T* dn = dn_scratch + srow * H;                                                               \
        const T* zcr = zc ? zc + row * H : 0; const T* zhr = zh ? zh + row * H : 0;                  \
        T mc = 0, rc = 1; const T* gcd = 0; const T* bcd = 0;                                        \
        if (gc) { mc = cstat[2 * row]; rc = cstat[2 * row + 1]; gcd = gc + d * H; bcd = bc + d * H; } \
        for (int64_t k = 0; k < H; k++) { /* through h = zh*h0 + (1-zh)*o*tanh(n) */                 \
            const T zhk = zhr ? zhr[k] : zh_const;                                                   \
            const T dhout = dyr[k] + dhr[k];                                                         \
            const T dh1 = (1 - zhk) * dhout;                                                         \
            const T o = gr[3 * H + k];                                                               \
            const T th = TANH(gcd ? gcd[k] * ((c1r[k] - mc) * rc) + bcd[k] : c1r[k]);                \
            dp[3 * H + k] = dh1 * th * o * (1 - o);                                                  \
            dn[k] = dh1 * o * (1 - th * th);                                                         \
            dhr[k] = zhk * dhout;                                                                    \
        }                                                                                            \
        T* dc1 = dp; /* dp[0..H) holds d c1 until the gate pass */                                   \
        if (gc) {                                                                                    \
            T* dhat = dp + H;                                                                        \
            for (int64_t k = 0; k < H; k++) dhat[k] = dn[k] * gcd[k];                                \
            fl_layer_norm_backward_stat_##SUFFIX(dhat, c1r, cstat + 2 * row, H, dc1);                \
        } else {                                                                                     \
            memcpy(dc1, dn, sizeof(T) * H);                                                          \
        }                                                                                            \
        for (int64_t k = 0; k < H; k++) {                                                            \
            const T zck = zcr ? zcr[k] : zc_const;                                                   \
            const T i = gr[k], f = gr[H + k], g = gr[2 * H + k], c0k = c0r[k];                       \
            T dc1k = dc1[k] + (1 - zck) * dcr[k];                                                    \
            if (pi) dc1k += dp[3 * H + k] * pi[2 * H + k];                                           \
            if (clip > 0) { const T v = f * c0k + i * g; if (v > clip || v < -clip) dc1k = 0; }      \
            const T di = dc1k * g * i * (1 - i);                                                     \
            const T df = dc1k * c0k * f * (1 - f);                                                   \
            const T dg = dc1k * i * (1 - g * g);                                                     \
            T dc0 = dc1k * f + zck * dcr[k];                                                         \
            if (pi) dc0 += di * pi[k] + df * pi[H + k];                                              \
            dcr[k] = dc0;                                                                            \
            dp[k] = di; dp[H + k] = df; dp[2 * H + k] = dg;                                          \
        }                                                                                            \
        if (gh) {                                                                                    \
            const T* ghd = gh + d * G; T* drr = dr + row * G;                                        \
            for (int64_t k = 0; k < G; k++) drr[k] = dp[k] * ghd[k];                                 \
            fl_layer_norm_backward_##SUFFIX(drr, rhat + row * G, rrstd[row], G, drr);                \
        } else if (dr != dpre) {                                                                     \
            memcpy(dr + row * G, dp, sizeof(T) * G);                                                 \
        }                                                                                            \
    }                                                                                                \
    if (acc_gx || acc_b || acc_gh || acc_gc || acc_peep) {                                           \
    /* parameter-gradient sums over the active rows; each thread owns a block of columns */          \
    const int64_t chunk = 64, nchunks = (G + chunk - 1) / chunk;                                     \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * nchunks; task++) {                                             \
        const int64_t d = task / nchunks, k0 = (task % nchunks) * chunk;                             \
        const int64_t k1 = k0 + chunk < G ? k0 + chunk : G;                                          \
        const int64_t h0 = k0 < H ? k0 : H, h1 = k1 < H ? k1 : H; /* H-sized sums on k < H */        \
        for (int64_t b = 0; b < n; b++) {                                                            \
            const int64_t row = d * ds + b, srow = d * B + b;                                        \
            const T* dp = dpre + row * G;                                                            \
            if (acc_gx || acc_b)                                                                     \
                fl_accumulate_norm_##SUFFIX(acc_gx + d * G, acc_b ? acc_b + d * G : 0, dp, xp + row * G, \
                                            xstat + 2 * row, k0, k1);                                \
            if (acc_gh) { const T* rh = rhat + row * G; T* a = acc_gh + d * G;                       \
                for (int64_t k = k0; k < k1; k++) a[k] += dp[k] * rh[k]; }                           \
            if (acc_gc && h0 < h1)                                                                   \
                fl_accumulate_norm_##SUFFIX(acc_gc + d * H, acc_bc + d * H, dn_scratch + srow * H,   \
                                            c1_in + row * H, cstat + 2 * row, h0, h1);               \
            if (acc_peep && h0 < h1) { const T* c0r = chist + (d * cds + b) * H;                     \
                const T* c1r = c1_in + row * H; T* ap = acc_peep + d * 3 * H;                        \
                for (int64_t k = h0; k < h1; k++) {                                                  \
                    ap[k] += dp[k] * c0r[k]; ap[H + k] += dp[H + k] * c0r[k];                        \
                    ap[2 * H + k] += dp[3 * H + k] * c1r[k]; } }                                     \
        }                                                                                            \
    }                                                                                                \
    }                                                                                                \
    if (xstat) /* through x = LNx(xp): dpre becomes the grad of xp, in place */                  \
        fl_input_norm_backward_##SUFFIX(D, n, ds, G, dpre, xp, xstat, gx, nthreads);                 \
}

DEFINE_LSTM(float, f32, fl_exp_f32, fl_tanh_f32, sqrtf)
DEFINE_LSTM(double, f64, exp, tanh, sqrt)
