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
 * it differ from the previous step's c1 (chist may be NULL otherwise). With both LayerNorms the
 * time loops keep no gates (keep = 2): the backward recomputes each row's from xp, rhat, c0 and
 * c1 with the forward's own functions (lstm_norm_pre, lstm_activate, lstm_out_gate). The backward
 * that ends a graph writes its gradients over saved rows it has read (dpre over the gates or xp,
 * dr over rhat).
 * hd_next is the next step's block of the same packed layout, so only its first n_next rows
 * (the sequences still running at the next step) are written.
 *
 * Entry points: lstm_step_forward / lstm_step_backward run one step (the caller runs the recurrent
 * product between steps: the Python loop with a projection or bf16 products, the C++ no-grad
 * operator); lstm_forward_loop / lstm_backward_loop run a whole layer's time loop in one call and
 * one OpenMP region, with the recurrent product of each step on gemm.h's kernel (each thread owns
 * a fixed share of the weight's column panels, packed once per call), two barriers per step (three
 * in the backward) and no return to the caller in between; no barrier where the threads divide the
 * directions (each runs its own), nor where a small weight lets each thread multiply its own batch
 * rows by all of it (gemm.h fl_by_rows; the parameter sums then per thread, added at the end).
 * Both run the same per-row functions.
 *
 * float uses fastmath.h's vectorisable exp; double uses libm. Built with -fno-trapping-math
 * -fno-signed-zeros (see __init__.py) so that the clamps and selects vectorise; NaN propagates
 * (every clamp is written `v < lo ? lo : v`, which keeps a NaN v).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "gemm_bf16.h"

#define DEFINE_LSTM(T, SUFFIX, EXP, TANH, SQRT)                                                        \
static inline T sig_##SUFFIX(T v) { return 1 / (1 + EXP(-v)); }                                      \
                                                                                                     \
/* one step's arguments; the per-row buffers point at (d = 0, the step's first packed row); the      \
 * buffers kept for the backward (gates, c1, chist, the statistics) have ss rows per direction (ds,  \
 * or B where a no-grad loop reuses one step's worth); r has rs rows per direction */                \
typedef struct {                                                                                     \
    int64_t D, B, n, n_next, H, ds, ss, rs;                                                          \
    const T* xp; T* xstat; const T* gx; const T* bias;                                               \
    const T* r; T* c; T* h; const T* rmask;                                                          \
    T* y; T* gates; T* c1; T* chist; T* hd_next;                                                     \
    T* rhat; T* rrstd; T* cstat;                                                                     \
    const T* gh; const T* gc; const T* bc; const T* peep; T clip; T eps;                             \
    const T* zc; const T* zh; T zc_const; T zh_const;                                                \
    int low; /* round hd_next to bfloat16 (fl_next_input) */                                         \
    T* grow; /* where non-NULL, the row's gates go into this one row of work space, not kept */      \
} lstm_fwd_##SUFFIX;                                                                                 \
                                                                                                     \
/* The gates from their inputs, shared by the forward and the backward's recomputation (where the    \
 * forward kept no gates), so that both compute the same values: with both LayerNorms the            \
 * pre-activations gh * rhat + (gx * x-hat + bias) (bias may be NULL); then the peepholes of i and   \
 * f (on c0), i, f = sig, g = tanh; the output gate, its peephole on c1 and sig, once c1 is known. */ \
static inline __attribute__((always_inline)) void lstm_norm_pre_##SUFFIX(                            \
    int64_t G, const T* restrict ghd, const T* restrict rh, const T* restrict gxd,                   \
    const T* restrict xr, T mx, T rx, const T* restrict bd, T* restrict gr)                          \
{                                                                                                    \
    if (bd) {                                                                                        \
        _Pragma("omp simd")                                                                          \
        for (int64_t k = 0; k < G; k++) gr[k] = ghd[k] * rh[k] + (gxd[k] * ((xr[k] - mx) * rx) + bd[k]); \
    } else {                                                                                         \
        _Pragma("omp simd")                                                                          \
        for (int64_t k = 0; k < G; k++) gr[k] = ghd[k] * rh[k] + gxd[k] * ((xr[k] - mx) * rx);       \
    }                                                                                                \
}                                                                                                    \
static inline __attribute__((always_inline)) void lstm_activate_##SUFFIX(                            \
    int64_t H, const T* restrict pi, const T* restrict c0r, T* restrict gr)                          \
{                                                                                                    \
    if (pi) for (int64_t k = 0; k < H; k++) { gr[k] += pi[k] * c0r[k]; gr[H + k] += pi[H + k] * c0r[k]; } \
    for (int64_t k = 0; k < 2 * H; k++) gr[k] = sig_##SUFFIX(gr[k]); /* two loops: one exp each */   \
    for (int64_t k = 2 * H; k < 3 * H; k++) gr[k] = TANH(gr[k]);                                     \
}                                                                                                    \
static inline __attribute__((always_inline)) void lstm_out_gate_##SUFFIX(                            \
    int64_t H, const T* restrict pi, const T* restrict c1r, T* restrict gr)                          \
{                                                                                                    \
    if (pi) for (int64_t k = 0; k < H; k++) gr[3 * H + k] += pi[2 * H + k] * c1r[k];                 \
    for (int64_t k = 0; k < H; k++) gr[3 * H + k] = sig_##SUFFIX(gr[3 * H + k]);                     \
}                                                                                                    \
                                                                                                     \
/* row task = d * n + b of one step. Every loop is written so that it vectorises: the options are    \
 * decided outside the loops (a select that reads a possibly-NULL mask keeps a loop scalar). */     \
static void lstm_forward_row_##SUFFIX(const lstm_fwd_##SUFFIX* a, int64_t task)                     \
{                                                                                                    \
    const int64_t H = a->H, G = 4 * H, n = a->n;                                                     \
    const int64_t d = task / n, b = task % n, row = d * a->ds + b, srow = d * a->B + b;             \
    const int64_t v = d * a->ss + b; /* the row of the saved buffers (gates, c1, statistics) */       \
    const T* xr = a->xp + row * G; /* may be gr: the projection turned into the gates in place */    \
    const T* restrict rr = a->r + (d * a->rs + b) * G;                                               \
    T* restrict gr = a->grow ? a->grow : a->gates + v * G;                                           \
    T* restrict cr = a->c + srow * H; /* c0 until the zoneout pass overwrites it with the new state */ \
    T* restrict hr = a->h + srow * H; T* restrict yr = a->y + row * H;                               \
    T* restrict c1r = a->c1 + v * H;                                                               \
    const T* restrict pi = a->peep ? a->peep + d * 3 * H : 0;                                        \
    if (a->chist) memcpy(a->chist + v * H, cr, sizeof(T) * H);                                     \
    if (a->xstat) fl_row_stats_##SUFFIX(xr, G, a->eps, a->xstat + 2 * v);                          \
    /* gates = LNh(r) (or r) + the input part (LNx(xp) + bias, or xp), in one pass over the row that \
     * also writes LNh's normalised r (rhat; omp simd: GCC otherwise keeps these loops scalar) */    \
    const T* xs = a->xstat ? a->xstat + 2 * v : 0; const T mx = xs ? xs[0] : 0, rx = xs ? xs[1] : 0; \
    const T* restrict gxd = xs ? a->gx + d * G : 0; const T* restrict bd = a->bias ? a->bias + d * G : 0; \
    if (a->gh) {                                                                                     \
        T st[2]; fl_row_stats_##SUFFIX(rr, G, a->eps, st);                                           \
        const T mr = st[0], sr = st[1]; a->rrstd[v] = sr;                                            \
        T* restrict rh = a->rhat + v * G; const T* restrict ghd = a->gh + d * G;                     \
        if (xs) { /* rhat, then the gates from it as the backward recomputes them */                 \
            _Pragma("omp simd")                                                                      \
            for (int64_t k = 0; k < G; k++) rh[k] = (rr[k] - mr) * sr;                               \
            lstm_norm_pre_##SUFFIX(G, ghd, rh, gxd, xr, mx, rx, bd, gr);                             \
        } else {                                                                                     \
            _Pragma("omp simd")                                                                      \
            for (int64_t k = 0; k < G; k++) {                                                        \
                const T hat = (rr[k] - mr) * sr; rh[k] = hat; gr[k] = ghd[k] * hat + xr[k];          \
            }                                                                                        \
        }                                                                                            \
    } else if (xs && bd) {                                                                           \
        for (int64_t k = 0; k < G; k++) gr[k] = rr[k] + (gxd[k] * ((xr[k] - mx) * rx) + bd[k]);      \
    } else if (xs) {                                                                                 \
        for (int64_t k = 0; k < G; k++) gr[k] = rr[k] + gxd[k] * ((xr[k] - mx) * rx);                \
    } else {                                                                                         \
        for (int64_t k = 0; k < G; k++) gr[k] = rr[k] + xr[k];                                       \
    }                                                                                                \
    lstm_activate_##SUFFIX(H, pi, cr, gr);                                                           \
    for (int64_t k = 0; k < H; k++) c1r[k] = gr[H + k] * cr[k] + gr[k] * gr[2 * H + k];              \
    const T clip = a->clip;                                                                          \
    if (clip > 0)                                                                                    \
        for (int64_t k = 0; k < H; k++) c1r[k] = c1r[k] > clip ? clip : (c1r[k] < -clip ? -clip : c1r[k]); \
    lstm_out_gate_##SUFFIX(H, pi, c1r, gr);                                                          \
    if (a->gc) { /* h1 = o * tanh(LNc(c1)), into y first */                                          \
        T* cs = a->cstat + 2 * v; fl_row_stats_##SUFFIX(c1r, H, a->eps, cs);                       \
        const T mc = cs[0], rc = cs[1];                                                              \
        const T* restrict gcd = a->gc + d * H; const T* restrict bcd = a->bc + d * H;                \
        for (int64_t k = 0; k < H; k++) yr[k] = gr[3 * H + k] * TANH(gcd[k] * ((c1r[k] - mc) * rc) + bcd[k]); \
    } else {                                                                                         \
        for (int64_t k = 0; k < H; k++) yr[k] = gr[3 * H + k] * TANH(c1r[k]);                        \
    }                                                                                                \
    const T* restrict zcr = a->zc ? a->zc + row * H : 0;                                             \
    const T* restrict zhr = a->zh ? a->zh + row * H : 0;                                             \
    const T zc = a->zc_const, zh = a->zh_const;                                                      \
    /* zoneout: c = zc*c0 + (1-zc)*c1, h = zh*h0 + (1-zh)*h1; without it c = c1, h = h1 */           \
    if (zcr) for (int64_t k = 0; k < H; k++) cr[k] = zcr[k] * cr[k] + (1 - zcr[k]) * c1r[k];        \
    else if (zc != 0) for (int64_t k = 0; k < H; k++) cr[k] = zc * cr[k] + (1 - zc) * c1r[k];       \
    else memcpy(cr, c1r, sizeof(T) * H);                                                             \
    if (zhr) for (int64_t k = 0; k < H; k++) { hr[k] = zhr[k] * hr[k] + (1 - zhr[k]) * yr[k]; yr[k] = hr[k]; } \
    else if (zh != 0) for (int64_t k = 0; k < H; k++) { hr[k] = zh * hr[k] + (1 - zh) * yr[k]; yr[k] = hr[k]; } \
    else memcpy(hr, yr, sizeof(T) * H);                                                              \
    if (a->hd_next && b < a->n_next)                                                                 \
        fl_next_input_##SUFFIX(a->hd_next + row * H, hr, a->rmask ? a->rmask + srow * H : 0, H,      \
                               a->low);                                                              \
}                                                                                                    \
                                                                                                     \
/* the input rows a forward row reads, of row (d, b) of the step `shift` packed rows from a's,       \
 * prefetched (gemm.h fl_row_after) */                                                               \
static inline __attribute__((always_inline)) void lstm_forward_prefetch_##SUFFIX(                    \
    const lstm_fwd_##SUFFIX* a, int64_t shift, int64_t d, int64_t b)                                 \
{                                                                                                    \
    const int64_t H = a->H, row = shift + d * a->ds + b;                                             \
    fl_prefetch(a->xp + row * 4 * H, 4 * H * sizeof(T));                                             \
    if (a->zc) fl_prefetch(a->zc + row * H, H * sizeof(T));                                          \
    if (a->zh) fl_prefetch(a->zh + row * H, H * sizeof(T));                                          \
}                                                                                                    \
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
    const lstm_fwd_##SUFFIX a = {D, B, n, n_next, H, ds, ds, n, xp, xstat, gx, bias, r, c, h, rmask, \
                                 y, gates, c1_out, chist, hd_next, rhat, rrstd, cstat, gh, gc, bc,   \
                                 peep, clip, eps, zc, zh, zc_const, zh_const, 0, 0};                 \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) lstm_forward_row_##SUFFIX(&a, task);                \
}                                                                                                    \
                                                                                                     \
/* Backward of one step. In: dy (grad of y), dh/dc (grad of the state after this step, [D,B,H];     \
 * overwritten in place with the grad of the state before it, except the recurrent GEMM part,       \
 * which the caller adds); chist: c before the step, row (d, b) at chist + (d*cds + b)*H (the       \
 * saved copy, the previous step's c1 block, or c_0). Out, on the step's n packed rows: dpre (grad  \
 * of xp: through LNx when xstat != NULL), dr (grad of r; may alias dpre when gh == NULL and xstat  \
 * == NULL); dn_scratch [D,B,H] (work space for LNc). Parameter gradients are accumulated (+=) over  \
 * the active rows into acc_gx / acc_b / acc_gh [D,G], acc_gc / acc_bc [D,H], acc_peep [D,3H]       \
 * (each may be NULL). Three passes over the step, each split between the threads: the rows         \
 * (lstm_backward_row), the parameter sums by column blocks (lstm_backward_sums), the input          \
 * LayerNorm's backward by rows. */                                                                 \
typedef struct {                                                                                     \
    int64_t D, B, n, H, ds, cds;                                                                     \
    const T* dy; T* dh; T* dc; const T* chist;                                                       \
    const T* xp; const T* xstat; const T* gx;                                                        \
    const T* gates; const T* c1; const T* rhat; const T* rrstd; const T* cstat;                      \
    const T* gh; const T* gc; const T* bc; const T* peep; T clip;                                    \
    const T* zc; const T* zh; T zc_const; T zh_const;                                                \
    T* dpre; T* dr; T* dn;                                                                           \
    T* acc_gx; T* acc_b; T* acc_gh; T* acc_gc; T* acc_bc; T* acc_peep;                               \
    int low; /* dr rounded to bfloat16 after the row (dr its own buffer) */                          \
    T* gs; /* G values of this thread's work space where dpre aliases gates or dr rhat, or the       \
            * gates are recomputed, else NULL */                                                     \
    const T* bias; /* the recomputation's bias (gates == NULL), else unused */                       \
    T* dz; /* the gate gradients: NULL, in dpre's rows; else one step's, (D, B, G), reused */        \
} lstm_bwd_##SUFFIX;                                                                                 \
                                                                                                     \
/* a row's gate gradients: dpre's row (then the input LayerNorm's backward turns them into dpre in   \
 * place) or the step's own row of dz */                                                             \
static inline T* lstm_dz_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t d, int64_t b)                  \
{                                                                                                    \
    return a->dz ? a->dz + (d * a->B + b) * 4 * a->H : a->dpre + (d * a->ds + b) * 4 * a->H;         \
}                                                                                                    \
                                                                                                     \
static void lstm_backward_row_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t task)                    \
{                                                                                                    \
    const int64_t H = a->H, G = 4 * H, n = a->n;                                                     \
    const int64_t d = task / n, b = task % n, row = d * a->ds + b, srow = d * a->B + b;             \
    T* restrict dp = lstm_dz_##SUFFIX(a, d, b);                                                      \
    const T* restrict c1r = a->c1 + row * H; const T* restrict c0r = a->chist + (d * a->cds + b) * H; \
    const T* restrict pi = a->peep ? a->peep + d * 3 * H : 0;                                        \
    /* the row's gates: recomputed where the forward kept none (both LayerNorms: from xp, rhat, c0,  \
     * c1, as the forward computed them); read from a copy where dpre is written over them           \
     * (lstm_backward_loop, the graph's last backward) */                                            \
    const T* gsrc;                                                                                   \
    if (!a->gates) {                                                                                 \
        const T* xs = a->xstat + 2 * row;                                                            \
        lstm_norm_pre_##SUFFIX(G, a->gh + d * G, a->rhat + row * G, a->gx + d * G, a->xp + row * G, xs[0], \
                               xs[1], a->bias ? a->bias + d * G : 0, a->gs);                         \
        lstm_activate_##SUFFIX(H, pi, c0r, a->gs);                                                   \
        lstm_out_gate_##SUFFIX(H, pi, c1r, a->gs);                                                   \
        gsrc = a->gs;                                                                                \
    } else if (a->dpre == a->gates) {                                                                \
        memcpy(a->gs, a->gates + row * G, sizeof(T) * G); gsrc = a->gs;                              \
    } else {                                                                                         \
        gsrc = a->gates + row * G;                                                                   \
    }                                                                                                \
    const T* restrict gr = gsrc;                                                                     \
    T* restrict dhr = a->dh + srow * H; T* restrict dcr = a->dc + srow * H;                          \
    const T* restrict dyr = a->dy + row * H;                                                         \
    T* restrict dn = a->dn + srow * H;                                                               \
    const T* restrict zcr = a->zc ? a->zc + row * H : 0;                                             \
    const T* restrict zhr = a->zh ? a->zh + row * H : 0;                                             \
    const T zc = a->zc_const, zh = a->zh_const;                                                      \
    const T* restrict gcd = a->gc ? a->gc + d * H : 0;                                               \
    /* through h = zh*h0 + (1-zh)*o*tanh(n): tanh(n) first into dn, d h1 into dp[2H, 3H) (free      \
     * until the gate pass) */                                                                       \
    if (gcd) {                                                                                       \
        const T mc = a->cstat[2 * row], rc = a->cstat[2 * row + 1];                                  \
        const T* restrict bcd = a->bc + d * H;                                                       \
        for (int64_t k = 0; k < H; k++) dn[k] = TANH(gcd[k] * ((c1r[k] - mc) * rc) + bcd[k]);       \
    } else {                                                                                         \
        for (int64_t k = 0; k < H; k++) dn[k] = TANH(c1r[k]);                                        \
    }                                                                                                \
    T* restrict dh1 = dp + 2 * H;                                                                    \
    if (zhr) for (int64_t k = 0; k < H; k++) {                                                       \
        const T dhout = dyr[k] + dhr[k]; dh1[k] = (1 - zhr[k]) * dhout; dhr[k] = zhr[k] * dhout; }   \
    else for (int64_t k = 0; k < H; k++) {                                                           \
        const T dhout = dyr[k] + dhr[k]; dh1[k] = (1 - zh) * dhout; dhr[k] = zh * dhout; }           \
    for (int64_t k = 0; k < H; k++) {                                                                \
        const T o = gr[3 * H + k], th = dn[k];                                                       \
        dp[3 * H + k] = dh1[k] * th * o * (1 - o);                                                   \
        dn[k] = dh1[k] * o * (1 - th * th);                                                          \
    }                                                                                                \
    T* restrict dc1 = dp; /* dp[0..H) holds d c1 until the gate pass */                              \
    if (gcd) {                                                                                       \
        T* dhat = dp + H;                                                                            \
        for (int64_t k = 0; k < H; k++) dhat[k] = dn[k] * gcd[k];                                    \
        fl_layer_norm_backward_stat_##SUFFIX(dhat, c1r, a->cstat + 2 * row, H, dc1);                 \
    } else {                                                                                         \
        memcpy(dc1, dn, sizeof(T) * H);                                                              \
    }                                                                                                \
    /* c = zc*c0 + (1-zc)*c1: d c1 += (1-zc) dc; the carried part zc*dc stays in dc, to which the   \
     * gate pass adds d c1 * f (and the peepholes theirs) */                                         \
    if (zcr) for (int64_t k = 0; k < H; k++) { const T dck = dcr[k]; dc1[k] += (1 - zcr[k]) * dck; dcr[k] = zcr[k] * dck; } \
    else for (int64_t k = 0; k < H; k++) { const T dck = dcr[k]; dc1[k] += (1 - zc) * dck; dcr[k] = zc * dck; } \
    if (pi) for (int64_t k = 0; k < H; k++) dc1[k] += dp[3 * H + k] * pi[2 * H + k];                 \
    const T clip = a->clip;                                                                          \
    if (clip > 0) for (int64_t k = 0; k < H; k++) {                                                  \
        const T v = gr[H + k] * c0r[k] + gr[k] * gr[2 * H + k];                                      \
        dc1[k] = v > clip || v < -clip ? 0 : dc1[k]; }                                               \
    /* ivdep: GCC does not use the block-scope restricts and needs more run-time alias checks than   \
     * it allows (--param vect-max-version-for-alias-checks) to vectorise this loop; its iterations  \
     * are independent (dp's quarters and dc are disjoint, dc1 is dp's first quarter) */             \
    _Pragma("GCC ivdep")                                                                             \
    for (int64_t k = 0; k < H; k++) {                                                                \
        const T i = gr[k], f = gr[H + k], g = gr[2 * H + k], dc1k = dc1[k];                          \
        const T di = dc1k * g * i * (1 - i);                                                         \
        const T df = dc1k * c0r[k] * f * (1 - f);                                                    \
        const T dg = dc1k * i * (1 - g * g);                                                         \
        dcr[k] += dc1k * f;                                                                          \
        dp[k] = di; dp[H + k] = df; dp[2 * H + k] = dg;                                              \
    }                                                                                                \
    if (pi) for (int64_t k = 0; k < H; k++) dcr[k] += dp[k] * pi[k] + dp[H + k] * pi[H + k];         \
}                                                                                                    \
/* whether dr is more than dpre's gate gradients (lstm_backward_dr has work) */                      \
static inline int lstm_has_dr_##SUFFIX(const lstm_bwd_##SUFFIX* a)                                   \
{                                                                                                    \
    return a->gh || a->dr != a->dpre;                                                                \
}                                                                                                    \
/* one row's dr from its gate gradients (dpre before the input LayerNorm's backward): through        \
 * LNh, or a copy; after the row's parameter sums, which read rhat, since dr may be written over     \
 * it (then the gains' product goes through the work space gs) */                                    \
static void lstm_backward_dr_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t task)                      \
{                                                                                                    \
    const int64_t G = 4 * a->H, d = task / a->n, row = d * a->ds + task % a->n;                      \
    fl_recurrent_grad_##SUFFIX(lstm_dz_##SUFFIX(a, d, task % a->n), a->gh ? a->gh + d * G : 0,       \
                               a->gh ? a->rhat + row * G : 0, a->gh ? a->rrstd[row] : 0, G,          \
                               a->dr + row * G, a->gs, a->low && a->dr != a->dpre);                  \
}                                                                                                    \
                                                                                                     \
enum { LSTM_SUM_CHUNK_##SUFFIX = 64 };                                                               \
static inline int lstm_has_sums_##SUFFIX(const lstm_bwd_##SUFFIX* a)                                 \
{                                                                                                    \
    return a->acc_gx || a->acc_b || a->acc_gh || a->acc_gc || a->acc_peep;                           \
}                                                                                                    \
/* one row's share of the parameter-gradient sums, columns [k0, k1) of the 4H-wide ones (the H-wide  \
 * ones on k < H), into a's accumulators */                                                          \
static inline void lstm_sum_row_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t d, int64_t b,           \
                                         int64_t k0, int64_t k1)                                     \
{                                                                                                    \
    const int64_t H = a->H, G = 4 * H, h0 = k0 < H ? k0 : H, h1 = k1 < H ? k1 : H;                   \
    const int64_t row = d * a->ds + b, srow = d * a->B + b;                                          \
    const T* dp = lstm_dz_##SUFFIX(a, d, b);                                                         \
    if (a->acc_gx || a->acc_b)                                                                       \
        fl_accumulate_norm_##SUFFIX(a->acc_gx + d * G, a->acc_b ? a->acc_b + d * G : 0, dp,          \
                                    a->xp + row * G, a->xstat + 2 * row, k0, k1);                    \
    if (a->acc_gh) { const T* rh = a->rhat + row * G; T* acc = a->acc_gh + d * G;                    \
        for (int64_t k = k0; k < k1; k++) acc[k] += dp[k] * rh[k]; }                                 \
    if (a->acc_gc && h0 < h1)                                                                        \
        fl_accumulate_norm_##SUFFIX(a->acc_gc + d * H, a->acc_bc + d * H, a->dn + srow * H,          \
                                    a->c1 + row * H, a->cstat + 2 * row, h0, h1);                    \
    if (a->acc_peep && h0 < h1) { const T* c0r = a->chist + (d * a->cds + b) * H;                    \
        const T* c1r = a->c1 + row * H; T* ap = a->acc_peep + d * 3 * H;                             \
        _Pragma("GCC ivdep") /* (as the gate pass's loop: ap's thirds are disjoint) */               \
        for (int64_t k = h0; k < h1; k++) {                                                          \
            ap[k] += dp[k] * c0r[k]; ap[H + k] += dp[H + k] * c0r[k];                                \
            ap[2 * H + k] += dp[3 * H + k] * c1r[k]; } }                                             \
}                                                                                                    \
/* parameter-gradient sums over the step's rows; task = d * chunks + column block (a task owns its   \
 * columns of the accumulators) */                                                                   \
static void lstm_backward_sums_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t task)                    \
{                                                                                                    \
    const int64_t G = 4 * a->H;                                                                      \
    const int64_t nchunks = (G + LSTM_SUM_CHUNK_##SUFFIX - 1) / LSTM_SUM_CHUNK_##SUFFIX;             \
    const int64_t d = task / nchunks, k0 = (task % nchunks) * LSTM_SUM_CHUNK_##SUFFIX;               \
    const int64_t k1 = k0 + LSTM_SUM_CHUNK_##SUFFIX < G ? k0 + LSTM_SUM_CHUNK_##SUFFIX : G;          \
    for (int64_t b = 0; b < a->n; b++) lstm_sum_row_##SUFFIX(a, d, b, k0, k1);                       \
}                                                                                                    \
                                                                                                     \
/* through x = LNx(xp): dpre's row from the gate gradients (in place where they are in it; dpre may  \
 * be xp, each value read before it is written) */                                                   \
static void lstm_backward_input_norm_##SUFFIX(const lstm_bwd_##SUFFIX* a, int64_t task)              \
{                                                                                                    \
    const int64_t G = 4 * a->H, d = task / a->n, row = d * a->ds + task % a->n;                      \
    fl_input_norm_backward_row_##SUFFIX(lstm_dz_##SUFFIX(a, d, task % a->n), a->xp + row * G, a->xstat + 2 * row, \
                                        a->gx + d * G, G, a->dpre + row * G);                        \
}                                                                                                    \
/* as lstm_forward_prefetch: the saved rows a backward row reads */                                  \
static inline __attribute__((always_inline)) void lstm_backward_prefetch_##SUFFIX(                   \
    const lstm_bwd_##SUFFIX* a, int64_t shift, int64_t d, int64_t b)                                 \
{                                                                                                    \
    const int64_t H = a->H, G = 4 * H, row = shift + d * a->ds + b;                                  \
    const int64_t g = G * sizeof(T), h = H * sizeof(T);                                              \
    if (a->gates) fl_prefetch(a->gates + row * G, g);                                                \
    fl_prefetch(a->c1 + row * H, h);                                                                 \
    fl_prefetch(a->dy + row * H, h);                                                                 \
    if (a->rhat) fl_prefetch(a->rhat + row * G, g);                                                  \
    if (a->xstat) fl_prefetch(a->xp + row * G, g);                                                   \
    if (a->zc) fl_prefetch(a->zc + row * H, h);                                                      \
    if (a->zh) fl_prefetch(a->zh + row * H, h);                                                      \
}                                                                                                    \
                                                                                                     \
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
    const lstm_bwd_##SUFFIX a = {D, B, n, H, ds, cds, dy, dh, dc, chist, xp, xstat, gx, gates, c1_in, \
                                 rhat, rrstd, cstat, gh, gc, bc, peep, clip, zc, zh, zc_const,       \
                                 zh_const, dpre, dr, dn_scratch, acc_gx, acc_b, acc_gh, acc_gc,       \
                                 acc_bc, acc_peep, 0, 0, 0, 0};                                      \
    const int64_t nchunks = (4 * H + LSTM_SUM_CHUNK_##SUFFIX - 1) / LSTM_SUM_CHUNK_##SUFFIX;          \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        lstm_backward_row_##SUFFIX(&a, task);                                                        \
        if (lstm_has_dr_##SUFFIX(&a)) lstm_backward_dr_##SUFFIX(&a, task);                           \
    }                                                                                                \
    if (lstm_has_sums_##SUFFIX(&a)) {                                                                \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                          \
        for (int64_t task = 0; task < D * nchunks; task++) lstm_backward_sums_##SUFFIX(&a, task);    \
    }                                                                                                \
    if (xstat) { /* through x = LNx(xp): dpre becomes the grad of xp, in place */                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                          \
        for (int64_t task = 0; task < D * n; task++) lstm_backward_input_norm_##SUFFIX(&a, task);    \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* The whole forward time loop of a layer without a projection, in one call: per step t (n =        \
 * active[t] rows, starting at packed row o), r[d] = hd[d, o:o+n] @ w[d]^T (gemm.h, each thread its \
 * panels of w^T, packed into wp once), then the step's rows, which write the next step's recurrent \
 * input hd[:, o+n : o+n+n_next]. The caller fills hd's first active[0] rows (h0 * rmask). w       \
 * (D, G, H) contiguous (W_hh as it is); wp work space of D * H * round_up(G, 32) values; r of      \
 * D * active[0] * G; the other buffers as lstm_step_forward's, at packed row 0. keep = 0 (no        \
 * backward follows): gates, c1, chist and the statistics hold one step, (D, B, X), reused; keep = 2 \
 * (both LayerNorms): all kept but the gates, which the backward recomputes (gates: work space of    \
 * nthreads * G values, a row each). low = 1                                                         \
 * (float32 only): the recurrent input hd written rounded to bfloat16 (fl_next_input), so that with  \
 * a bf16-rounded w the step products are those of bf16 operands with float32 sums (the caller       \
 * rounds hd's first rows); low = 2: the same, the products in bf16 on the CPU's dot-product        \
 * instructions where it has them (gemm_bf16.h; wp then holds the bf16 panels). */                   \
void lstm_forward_loop_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t steps, const int64_t* active, int64_t H, int64_t ds,              \
    const T* w, T* wp, T* r,                                                                         \
    const T* xp, T* xstat, const T* gx, const T* bias, T* c, T* h, const T* rmask,                   \
    T* y, T* gates, T* c1, T* chist, T* hd, T* rhat, T* rrstd, T* cstat,                             \
    const T* gh, const T* gc, const T* bc, const T* peep, T clip, T eps,                             \
    const T* zc, const T* zh, T zc_const, T zh_const, int keep, int low, int nthreads)               \
{                                                                                                    \
    const int64_t G = 4 * H, np = fl_gemm_panels_##SUFFIX(G), so = keep ? 1 : 0, sg = keep == 1 ? 1 : 0; \
    /* low = 2: the step products in bf16 where the CPU has them (gemm_bf16.h) */                    \
    uint16_t* const scratch = fl_bf16_scratch(fl_bf16_ok_##SUFFIX(low), nthreads, D * B, H);         \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        /* nt dividing D: each thread owns whole directions in every pass below (fl_share of D       \
         * equal parts), so it reads only rows it wrote itself: no barrier between the passes. Else, \
         * for a small weight, the split by rows (fl_by_rows): each thread its rows, no barrier */   \
        const int sync = D % nt != 0;                                                                \
        int64_t p0, p1, t0, t1;                                                                      \
        const int by_rows = fl_step_pack_##SUFFIX(scratch != 0, 1, tid, nt, D, B, H, G, w, 1, wp,    \
                                                  &p0, &p1);                                         \
        uint16_t* const ab = fl_bf16_mine(scratch, tid, D * B, H);                                   \
        int64_t o = 0;                                                                               \
        for (int64_t t = 0; t < steps; t++) {                                                        \
            const int64_t n = active[t], n_next = t + 1 < steps ? active[t + 1] : 0;                 \
            int64_t lo, hi;                                                                          \
            fl_own_rows(B, tid, nt, n, &lo, &hi);                                                    \
            fl_step_product_##SUFFIX(ab, by_rows, sync, lo, hi, p0, p1, D, np, n, H, G, hd + o * H,  \
                                     ds, wp, r, active[0]);                                          \
            const int64_t sv = so * o; /* the saved buffers' first row of this step (0: reused) */   \
            const lstm_fwd_##SUFFIX a = {D, B, n, n_next, H, ds, keep ? ds : B, active[0],           \
                xp + o * G,                                                                          \
                xstat ? xstat + 2 * sv : 0, gx, bias, r, c, h, rmask, y + o * H, gates + sg * sv * G, \
                c1 + sv * H, chist ? chist + sv * H : 0, n_next ? hd + (o + n) * H : 0,              \
                rhat ? rhat + sv * G : 0, rrstd ? rrstd + sv : 0, cstat ? cstat + 2 * sv : 0, gh,    \
                gc, bc, peep, clip, eps, zc ? zc + o * H : 0, zh ? zh + o * H : 0, zc_const,         \
                zh_const, low, keep == 2 ? gates + tid * G : 0};                                     \
            if (by_rows || !sync) { /* this thread's rows, fl_row_block */                           \
                int64_t d0, d1, b0, b1, pd, pb, sh;                                                  \
                fl_row_block(by_rows, D, tid, nt, n, lo, hi, &d0, &d1, &b0, &b1);                    \
                for (int64_t d = d0; d < d1; d++)                                                    \
                    for (int64_t b = b0; b < b1; b++) {                                              \
                        if (fl_row_after(by_rows, D, B, tid, nt, d, b, d1, b0, b1, n_next, n,        \
                                         &pd, &pb, &sh)) /* the row it runs next */                  \
                            lstm_forward_prefetch_##SUFFIX(&a, sh, pd, pb);                          \
                        lstm_forward_row_##SUFFIX(&a, d * n + b);                                    \
                    }                                                                                \
            } else {                                                                                 \
                fl_share(D * n, tid, nt, &t0, &t1);                                                  \
                for (int64_t task = t0; task < t1; task++) lstm_forward_row_##SUFFIX(&a, task);      \
                _Pragma("omp barrier")                                                               \
            }                                                                                        \
            o += n;                                                                                  \
        }                                                                                            \
    }                                                                                                \
    free(scratch);                                                                                   \
}                                                                                                    \
                                                                                                     \
/* The whole backward time loop of a layer without a projection, in one call: per step, from the    \
 * last, the three passes of lstm_step_backward, then the recurrent product's gradient             \
 * dh[d, :n] += (dr[d, o:o+n] @ w[d]) (* rmask) (gemm.h, each thread its panels of w, packed into   \
 * wp once). w (D, G, H) contiguous (W_hh); wp of D * G * round_up(H, 32) values; g of              \
 * D * active[0] * H (used with rmask). The cell state before each step: chist where saved, else   \
 * the previous step's c1, else c0 (D, B, H). The other buffers as lstm_step_backward's, at packed  \
 * row 0 (dy, dpre, dr, the saved ones). dpre may be gates and dr rhat (the saved buffers written    \
 * over, where the graph dies with this backward); gates NULL (the forward's keep = 2): each row's   \
 * recomputed (bias is then the forward's), the gate gradients in dz (D * B * G values, a step's)    \
 * and dpre may be xp. gs: nthreads * G values of work space where any of these holds (else it may   \
 * be NULL). */                                                                                      \
void lstm_backward_loop_##SUFFIX(                                                                    \
    int64_t D, int64_t B, int64_t steps, const int64_t* active, int64_t H, int64_t ds,              \
    const T* w, T* wp, T* g, const T* rmask,                                                         \
    const T* dy, T* dh, T* dc, const T* chist, const T* c0,                                          \
    const T* xp, const T* xstat, const T* gx, const T* bias,                                         \
    const T* gates, const T* c1, const T* rhat, const T* rrstd, const T* cstat,                      \
    const T* gh, const T* gc, const T* bc, const T* peep, T clip,                                    \
    const T* zc, const T* zh, T zc_const, T zh_const,                                                \
    T* dpre, T* dr, T* dn_scratch, T* gs, T* dz,                                                     \
    T* acc_gx, T* acc_b, T* acc_gh, T* acc_gc, T* acc_bc, T* acc_peep, int low, int nthreads)        \
{                                                                                                    \
    const int64_t G = 4 * H, np = fl_gemm_panels_##SUFFIX(H);                                        \
    const int64_t nchunks = (G + LSTM_SUM_CHUNK_##SUFFIX - 1) / LSTM_SUM_CHUNK_##SUFFIX;             \
    /* the split by rows sums each thread's rows into its own partial accumulators (thread t's at    \
     * parts + t * L: acc_gx, acc_b, acc_gh, acc_gc, acc_bc, acc_peep end to end), added up after    \
     * the loop; without that memory, the split by panels */                                         \
    T* const acc[6] = {acc_gx, acc_b, acc_gh, acc_gc, acc_bc, acc_peep};                             \
    const int64_t len[6] = {D * G, D * G, D * G, D * H, D * H, D * 3 * H}, L = D * (3 * G + 5 * H);  \
    T* parts = nthreads > 1 ? (T*)calloc(nthreads * L, sizeof(T)) : 0;                               \
    uint16_t* const scratch = fl_bf16_scratch(fl_bf16_ok_##SUFFIX(low), nthreads, D * B, G);         \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        /* as lstm_forward_loop: no barrier where nt divides D or with the split by rows */          \
        const int sync = D % nt != 0;                                                                \
        int64_t p0, p1, t0, t1;                                                                      \
        const int by_rows = fl_step_pack_##SUFFIX(scratch != 0, parts && nt <= nthreads, tid, nt, D, \
                                                  B, G, H, w, 0, wp, &p0, &p1);                      \
        uint16_t* const ab = fl_bf16_mine(scratch, tid, D * B, G);                                   \
        T* mine[6]; /* the accumulators this thread adds to */                                       \
        fl_partials_mine_##SUFFIX(by_rows ? parts + tid * L : 0, acc, len, 6, mine);                 \
        int64_t o = ds;                                                                              \
        for (int64_t t = steps - 1; t >= 0; t--) {                                                   \
            const int64_t n = active[t];                                                             \
            o -= n;                                                                                  \
            const T* c_before = chist ? chist + o * H : t > 0 ? c1 + (o - active[t - 1]) * H : c0;   \
            const lstm_bwd_##SUFFIX a = {D, B, n, H, ds, chist || t > 0 ? ds : B, dy + o * H, dh,    \
                dc, c_before, xp ? xp + o * G : 0, xstat ? xstat + 2 * o : 0, gx, gates ? gates + o * G : 0, \
                c1 + o * H, rhat ? rhat + o * G : 0, rrstd ? rrstd + o : 0,                          \
                cstat ? cstat + 2 * o : 0, gh, gc, bc, peep, clip, zc ? zc + o * H : 0,              \
                zh ? zh + o * H : 0, zc_const, zh_const, dpre + o * G, dr + o * G, dn_scratch,       \
                mine[0], mine[1], mine[2], mine[3], mine[4], mine[5], low, gs ? gs + tid * G : 0,    \
                bias, dz};                                                                           \
            const int sums = lstm_has_sums_##SUFFIX(&a), drs = lstm_has_dr_##SUFFIX(&a);             \
            int64_t lo, hi;                                                                          \
            fl_own_rows(B, tid, nt, n, &lo, &hi);                                                    \
            if (by_rows || !sync) {                                                                  \
                /* the passes row by row, on this thread's rows (by_rows) or on its whole directions \
                 * (nt divides D: their accumulators are its own), each row's sums, dr and input     \
                 * LayerNorm while its buffers are in L1 */                                          \
                int64_t d0, d1, b0, b1, pd, pb, sh;                                                  \
                fl_row_block(by_rows, D, tid, nt, n, lo, hi, &d0, &d1, &b0, &b1);                    \
                const int64_t nn = t > 0 ? active[t - 1] : 0; /* the next step's rows (t - 1) */     \
                for (int64_t d = d0; d < d1; d++)                                                    \
                    for (int64_t b = b0; b < b1; b++) {                                              \
                        if (fl_row_after(by_rows, D, B, tid, nt, d, b, d1, b0, b1, nn, -nn,          \
                                         &pd, &pb, &sh)) /* the row it runs next */                  \
                            lstm_backward_prefetch_##SUFFIX(&a, sh, pd, pb);                         \
                        lstm_backward_row_##SUFFIX(&a, d * n + b);                                   \
                        if (sums) lstm_sum_row_##SUFFIX(&a, d, b, 0, G);                             \
                        if (drs) lstm_backward_dr_##SUFFIX(&a, d * n + b);                           \
                        if (xstat) lstm_backward_input_norm_##SUFFIX(&a, d * n + b);                 \
                    }                                                                                \
            } else { /* the passes split between the threads, a barrier after each */                \
                fl_share(D * n, tid, nt, &t0, &t1);                                                  \
                for (int64_t task = t0; task < t1; task++) lstm_backward_row_##SUFFIX(&a, task);     \
                _Pragma("omp barrier")                                                               \
                if (sums) {                                                                          \
                    fl_share(D * nchunks, tid, nt, &t0, &t1);                                        \
                    for (int64_t task = t0; task < t1; task++)                                       \
                        lstm_backward_sums_##SUFFIX(&a, task);                                       \
                    _Pragma("omp barrier")                                                           \
                }                                                                                    \
                if (drs || xstat) { /* dr after the sums (it may be written over rhat), then the     \
                                     * input LayerNorm's (on dpre); the product reads dr */          \
                    fl_share(D * n, tid, nt, &t0, &t1);                                              \
                    for (int64_t task = t0; task < t1; task++) {                                     \
                        if (drs) lstm_backward_dr_##SUFFIX(&a, task);                                \
                        if (xstat) lstm_backward_input_norm_##SUFFIX(&a, task);                      \
                    }                                                                                \
                    _Pragma("omp barrier")                                                           \
                }                                                                                    \
            }                                                                                        \
            fl_step_product_add_##SUFFIX(ab, by_rows, sync, lo, hi, p0, p1, D, np, n, G, H, a.dr,    \
                                         ds, wp, dh, B, rmask, g, active[0]);                        \
        }                                                                                            \
        if (by_rows) {                                                                               \
            _Pragma("omp barrier")                                                                   \
            fl_partials_reduce_##SUFFIX(parts, L, tid, nt, acc, len, 6);                             \
        }                                                                                            \
    }                                                                                                \
    free(parts);                                                                                     \
    free(scratch);                                                                                   \
}

DEFINE_LSTM(float, f32, fl_exp_f32, fl_tanh_f32, sqrtf)
DEFINE_LSTM(double, f64, exp, tanh, sqrt)
