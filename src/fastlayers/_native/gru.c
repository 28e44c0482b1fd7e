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
 * Saved for the backward: gates (rg, zg, ng), hbn = hb_n, h0 (hist), rhat/rrstd, xstat (mean,       \
 * rstd of xp; x-hat is recomputed from xp). With both LayerNorms the time loops keep neither gates  \
 * nor hbn (keep = 2): the backward recomputes them from xp and rhat with the forward's own functions \
 * (gru_norm_gates, gru_new_gate). The backward that ends a graph writes its gradients over saved    \
 * rows it has read (dpre over the gates or xp, dr over rhat).                                       \
 *
 * Entry points as lstm.c's: gru_step_forward / gru_step_backward run one step (the caller runs the
 * recurrent product between steps), gru_forward_loop / gru_backward_loop a layer's whole time loop
 * in one call and one OpenMP region (the step products on gemm.h's kernel); both run the same
 * per-row functions, whose loops all vectorise.
 *
 * float uses fastmath.h's vectorisable exp; double uses libm.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "gemm_bf16.h"

#define DEFINE_GRU(T, SUFFIX, EXP, TANH, SQRT)                                                         \
static inline T gsig_##SUFFIX(T v) { return 1 / (1 + EXP(-v)); }                                     \
                                                                                                     \
/* one step's arguments; the per-row buffers point at (d = 0, the step's first packed row); the      \
 * buffers kept for the backward have ss rows per direction, r rs rows (as lstm.c's) */              \
typedef struct {                                                                                     \
    int64_t D, B, n, n_next, H, ds, ss, rs;                                                          \
    const T* xp; T* xstat; const T* gx; const T* b_ih;                                               \
    const T* r; T* h; const T* rmask; const T* b_hh;                                                 \
    T* y; T* gates; T* hbn; T* hist; T* hd_next; T* rhat; T* rrstd;                                  \
    const T* gh; T eps; const T* zh; T zh_const;                                                     \
    int low; /* round hd_next to bfloat16 (fl_next_input) */                                         \
    T* grow; /* where non-NULL, the row's gates and hbn (G + H values) go into this work space */    \
} gru_fwd_##SUFFIX;                                                                                  \
                                                                                                     \
/* The gates from their inputs, shared by the forward and the backward's recomputation (where the    \
 * forward kept none): with the input part x already in gr, from LNh's rhat: r, z = sig(x + gh *     \
 * rhat + b_hh), hbn = gh * rhat_n + b_hn (b_hh may be NULL); then n = tanh(x_n + r * hbn). */       \
static inline __attribute__((always_inline)) void gru_norm_gates_##SUFFIX(                           \
    int64_t H, const T* restrict ghd, const T* restrict rh, const T* restrict bh, T* restrict gr,    \
    T* restrict hbr)                                                                                 \
{                                                                                                    \
    if (bh) {                                                                                        \
        for (int64_t k = 0; k < H; k++) hbr[k] = ghd[2 * H + k] * rh[2 * H + k] + bh[2 * H + k];     \
        for (int64_t k = 0; k < 2 * H; k++) gr[k] = gsig_##SUFFIX(gr[k] + (ghd[k] * rh[k] + bh[k])); \
    } else {                                                                                         \
        for (int64_t k = 0; k < H; k++) hbr[k] = ghd[2 * H + k] * rh[2 * H + k];                     \
        for (int64_t k = 0; k < 2 * H; k++) gr[k] = gsig_##SUFFIX(gr[k] + ghd[k] * rh[k]);           \
    }                                                                                                \
}                                                                                                    \
static inline __attribute__((always_inline)) void gru_new_gate_##SUFFIX(                             \
    int64_t H, const T* restrict hbr, T* restrict gr)                                                \
{                                                                                                    \
    for (int64_t k = 0; k < H; k++) gr[2 * H + k] = TANH(gr[2 * H + k] + gr[k] * hbr[k]);            \
}                                                                                                    \
                                                                                                     \
/* the state update; `masked` is a constant after inlining, so each call's loop vectorises */       \
static inline __attribute__((always_inline)) void gru_update_##SUFFIX(                              \
    int64_t H, const T* restrict gr, const T* restrict h0r, T* restrict hr, T* restrict yr,         \
    const T* restrict zhr, T zh_const, const int masked)                                             \
{                                                                                                    \
    for (int64_t k = 0; k < H; k++) {                                                                \
        const T zhk = masked ? zhr[k] : zh_const, zg = gr[H + k];                                    \
        const T h1 = (1 - zg) * gr[2 * H + k] + zg * h0r[k];                                         \
        hr[k] = zhk * h0r[k] + (1 - zhk) * h1;                                                       \
        yr[k] = hr[k];                                                                               \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
static void gru_forward_row_##SUFFIX(const gru_fwd_##SUFFIX* a, int64_t task)                       \
{                                                                                                    \
    const int64_t H = a->H, G = 3 * H, n = a->n;                                                     \
    const int64_t d = task / n, b = task % n, row = d * a->ds + b, srow = d * a->B + b;             \
    const int64_t v = d * a->ss + b; /* the row of the saved buffers (gates, hbn, hist, statistics) */ \
    const T* xr = a->xp + row * G; /* may be gr: the projection turned into the gates in place */    \
    const T* restrict rr = a->r + (d * a->rs + b) * G;                                               \
    T* restrict gr = a->grow ? a->grow : a->gates + v * G;                                           \
    T* restrict hbr = a->grow ? a->grow + G : a->hbn + v * H;                                        \
    T* restrict hr = a->h + srow * H; T* restrict yr = a->y + row * H;                               \
    T* restrict h0r = a->hist + v * H;                                                             \
    const T* restrict bh = a->b_hh ? a->b_hh + d * G : 0;                                            \
    memcpy(h0r, hr, sizeof(T) * H);                                                                  \
    if (a->xstat) { /* gates = x, the input part */                                                  \
        fl_row_stats_##SUFFIX(xr, G, a->eps, a->xstat + 2 * v);                                    \
        fl_affine_norm_##SUFFIX(xr, a->xstat + 2 * v, a->gx + d * G, a->b_ih ? a->b_ih + d * G : 0, G, gr); \
    } else if (gr != xr) {                                                                           \
        memcpy(gr, xr, sizeof(T) * G);                                                               \
    }                                                                                                \
    /* hb = LNh(r) (or r) + b_hh: its n part into hbn; r and z: gates += hb, then the sigmoid */     \
    if (a->gh) {                                                                                     \
        fl_layer_norm_##SUFFIX(rr, G, a->eps, a->rhat + v * G, a->rrstd + v);                        \
        gru_norm_gates_##SUFFIX(H, a->gh + d * G, a->rhat + v * G, bh, gr, hbr);                     \
    } else if (bh) {                                                                                 \
        for (int64_t k = 0; k < H; k++) hbr[k] = rr[2 * H + k] + bh[2 * H + k];                      \
        for (int64_t k = 0; k < 2 * H; k++) gr[k] = gsig_##SUFFIX(gr[k] + (rr[k] + bh[k]));          \
    } else {                                                                                         \
        for (int64_t k = 0; k < H; k++) hbr[k] = rr[2 * H + k];                                      \
        for (int64_t k = 0; k < 2 * H; k++) gr[k] = gsig_##SUFFIX(gr[k] + rr[k]);                    \
    }                                                                                                \
    gru_new_gate_##SUFFIX(H, hbr, gr);                                                               \
    if (a->zh) gru_update_##SUFFIX(H, gr, h0r, hr, yr, a->zh + row * H, 0, 1);                       \
    else gru_update_##SUFFIX(H, gr, h0r, hr, yr, 0, a->zh_const, 0);                                 \
    if (a->hd_next && b < a->n_next)                                                                 \
        fl_next_input_##SUFFIX(a->hd_next + row * H, hr, a->rmask ? a->rmask + srow * H : 0, H,      \
                               a->low);                                                              \
}                                                                                                    \
                                                                                                     \
/* the input rows a forward row reads, of row (d, b) of the step `shift` packed rows from a's,       \
 * prefetched (as lstm.c's) */                                                                       \
static inline __attribute__((always_inline)) void gru_forward_prefetch_##SUFFIX(                     \
    const gru_fwd_##SUFFIX* a, int64_t shift, int64_t d, int64_t b)                                  \
{                                                                                                    \
    const int64_t H = a->H, row = shift + d * a->ds + b;                                             \
    fl_prefetch(a->xp + row * 3 * H, 3 * H * sizeof(T));                                             \
    if (a->zh) fl_prefetch(a->zh + row * H, H * sizeof(T));                                          \
}                                                                                                    \
                                                                                                     \
void gru_step_forward_##SUFFIX(                                                                      \
    int64_t D, int64_t B, int64_t n, int64_t n_next, int64_t H, int64_t ds,                          \
    const T* xp, T* xstat, const T* gx, const T* b_ih,                                               \
    const T* r, T* h, const T* rmask, const T* b_hh,                                                 \
    T* y, T* gates, T* hbn, T* hist, T* hd_next, T* rhat, T* rrstd,                                  \
    const T* gh, T eps, const T* zh, T zh_const, int nthreads)                                       \
{                                                                                                    \
    const gru_fwd_##SUFFIX a = {D, B, n, n_next, H, ds, ds, n, xp, xstat, gx, b_ih, r, h, rmask,     \
                                b_hh, y, gates, hbn, hist, hd_next, rhat, rrstd, gh, eps, zh,        \
                                zh_const, 0, 0};                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                               \
    for (int64_t task = 0; task < D * n; task++) gru_forward_row_##SUFFIX(&a, task);                 \
}                                                                                                    \
                                                                                                     \
/* Backward of one step. In: dy, dh (grad of the state after this step, [D,B,H]; overwritten with   \
 * the grad of the state before it, except the recurrent GEMM part, which the caller adds).         \
 * Out on the step's n packed rows: dpre (grad of xp: through LNx when xstat != NULL), dhb (grad of \
 * hb = a + b_hh), dr (grad of the recurrent product r; aliases dhb when gh == NULL). Accumulated   \
 * (+=) over the rows: acc_gx / acc_b [D,G] (input LayerNorm gain / b_ih; acc_b needs acc_gx),      \
 * acc_gh [D,G] += dhb * rhat (each may be NULL). Three passes, as lstm.c's. */                     \
typedef struct {                                                                                     \
    int64_t D, B, n, H, ds;                                                                          \
    const T* dy; T* dh; const T* hist; const T* gates; const T* hbn;                                 \
    const T* xp; const T* xstat; const T* gx;                                                        \
    const T* rhat; const T* rrstd; const T* gh; const T* zh; T zh_const;                             \
    T* dpre; T* dhb; T* dr; T* acc_gx; T* acc_b; T* acc_gh;                                          \
    int low; /* dr rounded to bfloat16 after the row (dr its own buffer: copied from dhb) */         \
    T* gs; /* G + H values of this thread's work space where dpre aliases gates or dr rhat, or the   \
            * gates are recomputed, else NULL */                                                     \
    const T* b_ih; const T* b_hh; /* the recomputation's biases (gates == NULL), else unused */      \
    T* dz; /* dpre's values before the input LayerNorm's backward: NULL, in dpre's rows; else one    \
            * step's, (D, B, G), reused */                                                           \
    T* acc_bhh; /* [D,G] += dhb over the rows (b_hh's gradient, where dhb holds one step), or NULL */ \
    int dbs; /* dhb holds one step's rows, (D, B, G), reused (with LNh: dr is not dhb) */            \
} gru_bwd_##SUFFIX;                                                                                  \
                                                                                                     \
/* a row's dhb: in dhb's packed rows, or the step's own row (dbs) */                                 \
static inline T* gru_db_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t d, int64_t b)                    \
{                                                                                                    \
    return a->dhb + (a->dbs ? d * a->B + b : d * a->ds + b) * 3 * a->H;                              \
}                                                                                                    \
static inline int gru_has_sums_##SUFFIX(const gru_bwd_##SUFFIX* a)                                   \
{                                                                                                    \
    return a->acc_gx || a->acc_gh || a->acc_bhh;                                                     \
}                                                                                                    \
                                                                                                     \
/* a row's gradients of the input part (before the input LayerNorm's backward): dpre's row or the    \
 * step's own row of dz */                                                                           \
static inline T* gru_dz_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t d, int64_t b)                    \
{                                                                                                    \
    return a->dz ? a->dz + (d * a->B + b) * 3 * a->H : a->dpre + (d * a->ds + b) * 3 * a->H;         \
}                                                                                                    \
                                                                                                     \
static inline __attribute__((always_inline)) void gru_back_##SUFFIX(                                \
    int64_t H, const T* restrict gr, const T* restrict hbr, const T* restrict h0r,                   \
    const T* restrict dyr, T* restrict dhr, T* restrict dp, T* restrict db, const T* restrict zhr,   \
    T zh_const, const int masked)                                                                    \
{                                                                                                    \
    for (int64_t k = 0; k < H; k++) {                                                                \
        const T zhk = masked ? zhr[k] : zh_const;                                                    \
        const T dhout = dyr[k] + dhr[k], dh1 = (1 - zhk) * dhout;                                    \
        const T rg = gr[k], zg = gr[H + k], ng = gr[2 * H + k];                                      \
        const T dn = dh1 * (1 - zg) * (1 - ng * ng);                                                 \
        const T dz = dh1 * (h0r[k] - ng) * zg * (1 - zg);                                            \
        const T drg = dn * hbr[k] * rg * (1 - rg);                                                   \
        dp[k] = drg; dp[H + k] = dz; dp[2 * H + k] = dn;                                             \
        db[k] = drg; db[H + k] = dz; db[2 * H + k] = dn * rg;                                        \
        dhr[k] = zhk * dhout + dh1 * zg;                                                             \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
static void gru_backward_row_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t task)                      \
{                                                                                                    \
    const int64_t H = a->H, G = 3 * H, n = a->n;                                                     \
    const int64_t d = task / n, b = task % n, row = d * a->ds + b, srow = d * a->B + b;             \
    const T* h0r = a->hist + row * H;                                                                \
    const T* dyr = a->dy + row * H; T* dhr = a->dh + srow * H;                                       \
    T* dp = gru_dz_##SUFFIX(a, d, b); T* db = gru_db_##SUFFIX(a, d, b);                              \
    /* the row's gates and hbn: recomputed where the forward kept none (both LayerNorms: from xp and \
     * rhat, as the forward computed them); read from a copy where dpre is written over them         \
     * (gru_backward_loop, the graph's last backward) */                                             \
    const T* gr; const T* hbr;                                                                       \
    if (!a->gates) {                                                                                 \
        T* gw = a->gs;                                                                               \
        fl_affine_norm_##SUFFIX(a->xp + row * G, a->xstat + 2 * row, a->gx + d * G,                  \
                                a->b_ih ? a->b_ih + d * G : 0, G, gw);                               \
        gru_norm_gates_##SUFFIX(H, a->gh + d * G, a->rhat + row * G, a->b_hh ? a->b_hh + d * G : 0, gw, \
                                gw + G);                                                             \
        gru_new_gate_##SUFFIX(H, gw + G, gw);                                                        \
        gr = gw; hbr = gw + G;                                                                       \
    } else if (a->dpre == a->gates) {                                                                \
        memcpy(a->gs, a->gates + row * G, sizeof(T) * G); gr = a->gs; hbr = a->hbn + row * H;        \
    } else {                                                                                         \
        gr = a->gates + row * G; hbr = a->hbn + row * H;                                             \
    }                                                                                                \
    if (a->zh) gru_back_##SUFFIX(H, gr, hbr, h0r, dyr, dhr, dp, db, a->zh + row * H, 0, 1);          \
    else gru_back_##SUFFIX(H, gr, hbr, h0r, dyr, dhr, dp, db, 0, a->zh_const, 0);                    \
}                                                                                                    \
/* whether dr is more than dhb (gru_backward_dr has work) */                                         \
static inline int gru_has_dr_##SUFFIX(const gru_bwd_##SUFFIX* a)                                     \
{                                                                                                    \
    return a->gh || a->dr != a->dhb;                                                                 \
}                                                                                                    \
/* one row's dr from its dhb: through LNh, or a copy; after the row's parameter sums, which read     \
 * rhat, since dr may be written over it (then the gains' product goes through the work space gs) */ \
static void gru_backward_dr_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t task)                        \
{                                                                                                    \
    const int64_t G = 3 * a->H, d = task / a->n, row = d * a->ds + task % a->n;                      \
    fl_recurrent_grad_##SUFFIX(gru_db_##SUFFIX(a, d, task % a->n), a->gh ? a->gh + d * G : 0,        \
                               a->gh ? a->rhat + row * G : 0,                                        \
                               a->gh ? a->rrstd[row] : 0, G, a->dr + row * G, a->gs,                 \
                               a->low && a->dr != a->dhb);                                           \
}                                                                                                    \
                                                                                                     \
enum { GRU_SUM_CHUNK_##SUFFIX = 64 };                                                                \
/* one row's share of the parameter-gradient sums, columns [k0, k1), into a's accumulators */        \
static inline void gru_sum_row_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t d, int64_t b, int64_t k0, \
                                        int64_t k1)                                                  \
{                                                                                                    \
    const int64_t G = 3 * a->H, row = d * a->ds + b;                                                 \
    if (a->acc_gx)                                                                                   \
        fl_accumulate_norm_##SUFFIX(a->acc_gx + d * G, a->acc_b ? a->acc_b + d * G : 0,              \
                                    gru_dz_##SUFFIX(a, d, b), a->xp + row * G, a->xstat + 2 * row, k0, k1); \
    if (a->acc_gh) { const T* db = gru_db_##SUFFIX(a, d, b); const T* rh = a->rhat + row * G;        \
        T* acc = a->acc_gh + d * G;                                                                  \
        for (int64_t k = k0; k < k1; k++) acc[k] += db[k] * rh[k]; }                                 \
    if (a->acc_bhh) { const T* db = gru_db_##SUFFIX(a, d, b); T* acc = a->acc_bhh + d * G;           \
        for (int64_t k = k0; k < k1; k++) acc[k] += db[k]; }                                         \
}                                                                                                    \
static void gru_backward_sums_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t task)                      \
{                                                                                                    \
    const int64_t G = 3 * a->H, nchunks = (G + GRU_SUM_CHUNK_##SUFFIX - 1) / GRU_SUM_CHUNK_##SUFFIX; \
    const int64_t d = task / nchunks, k0 = (task % nchunks) * GRU_SUM_CHUNK_##SUFFIX;                \
    const int64_t k1 = k0 + GRU_SUM_CHUNK_##SUFFIX < G ? k0 + GRU_SUM_CHUNK_##SUFFIX : G;            \
    for (int64_t b = 0; b < a->n; b++) gru_sum_row_##SUFFIX(a, d, b, k0, k1);                        \
}                                                                                                    \
                                                                                                     \
/* through x = LNx(xp): dpre's row from dz (in place where dz is dpre's row; dpre may be xp, each    \
 * value read before it is written) */                                                               \
static void gru_backward_input_norm_##SUFFIX(const gru_bwd_##SUFFIX* a, int64_t task)                \
{                                                                                                    \
    const int64_t G = 3 * a->H, d = task / a->n, row = d * a->ds + task % a->n;                      \
    fl_input_norm_backward_row_##SUFFIX(gru_dz_##SUFFIX(a, d, task % a->n), a->xp + row * G, a->xstat + 2 * row, \
                                        a->gx + d * G, G, a->dpre + row * G);                        \
}                                                                                                    \
/* as gru_forward_prefetch: the saved rows a backward row reads */                                   \
static inline __attribute__((always_inline)) void gru_backward_prefetch_##SUFFIX(                    \
    const gru_bwd_##SUFFIX* a, int64_t shift, int64_t d, int64_t b)                                  \
{                                                                                                    \
    const int64_t H = a->H, G = 3 * H, row = shift + d * a->ds + b;                                  \
    const int64_t g = G * sizeof(T), h = H * sizeof(T);                                              \
    if (a->gates) { fl_prefetch(a->gates + row * G, g); fl_prefetch(a->hbn + row * H, h); }          \
    fl_prefetch(a->hist + row * H, h); fl_prefetch(a->dy + row * H, h);                              \
    if (a->rhat) fl_prefetch(a->rhat + row * G, g);                                                  \
    if (a->xstat) fl_prefetch(a->xp + row * G, g);                                                   \
    if (a->zh) fl_prefetch(a->zh + row * H, h);                                                      \
}                                                                                                    \
                                                                                                     \
void gru_step_backward_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t n, int64_t H, int64_t ds,                                          \
    const T* dy, T* dh, const T* hist, const T* gates, const T* hbn,                                 \
    const T* xp, const T* xstat, const T* gx,                                                        \
    const T* rhat, const T* rrstd, const T* gh, const T* zh, T zh_const,                             \
    T* dpre, T* dhb, T* dr, T* acc_gx, T* acc_b, T* acc_gh, int nthreads)                            \
{                                                                                                    \
    const gru_bwd_##SUFFIX a = {D, B, n, H, ds, dy, dh, hist, gates, hbn, xp, xstat, gx, rhat, rrstd, \
                                gh, zh, zh_const, dpre, dhb, dr, acc_gx, acc_b, acc_gh, 0, 0, 0, 0, 0, 0, 0}; \
    const int64_t nchunks = (3 * H + GRU_SUM_CHUNK_##SUFFIX - 1) / GRU_SUM_CHUNK_##SUFFIX;            \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t task = 0; task < D * n; task++) {                                                   \
        gru_backward_row_##SUFFIX(&a, task);                                                         \
        if (gru_has_dr_##SUFFIX(&a)) gru_backward_dr_##SUFFIX(&a, task);                             \
    }                                                                                                \
    if (gru_has_sums_##SUFFIX(&a)) {                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
        for (int64_t task = 0; task < D * nchunks; task++) gru_backward_sums_##SUFFIX(&a, task);     \
    }                                                                                                \
    if (xstat) { /* through x = LNx(xp): dpre becomes the grad of xp, in place */                    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                          \
        for (int64_t task = 0; task < D * n; task++) gru_backward_input_norm_##SUFFIX(&a, task);     \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* The whole forward time loop of a layer, as lstm_forward_loop: w (D, G, H) contiguous (W_hh as  \
 * it is), wp of D * H * round_up(G, 32) values, r of D * active[0] * G; the caller fills hd's       \
 * first active[0] rows (h0 * rmask); the other buffers as gru_step_forward's, at packed row 0;     \
 * keep = 0: gates, hbn, hist and the statistics hold one step, (D, B, X), reused; keep = 2 (both    \
 * LayerNorms): all kept but the gates and hbn, which the backward recomputes (gates: work space of  \
 * nthreads * (G + H) values, hbn unused); low as lstm_forward_loop's. */                            \
void gru_forward_loop_##SUFFIX(                                                                      \
    int64_t D, int64_t B, int64_t steps, const int64_t* active, int64_t H, int64_t ds,              \
    const T* w, T* wp, T* r,                                                                         \
    const T* xp, T* xstat, const T* gx, const T* b_ih, T* h, const T* rmask, const T* b_hh,          \
    T* y, T* gates, T* hbn, T* hist, T* hd, T* rhat, T* rrstd,                                       \
    const T* gh, T eps, const T* zh, T zh_const, int keep, int low, int nthreads)                    \
{                                                                                                    \
    const int64_t G = 3 * H, np = fl_gemm_panels_##SUFFIX(G), so = keep ? 1 : 0, sg = keep == 1 ? 1 : 0; \
    /* low = 2: the step products in bf16 where the CPU has them (gemm_bf16.h) */                    \
    uint16_t* const scratch = fl_bf16_scratch(fl_bf16_ok_##SUFFIX(low), nthreads, D * B, H);         \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        /* as lstm_forward_loop: no barrier where nt divides D or with the split by rows */          \
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
            const gru_fwd_##SUFFIX a = {D, B, n, n_next, H, ds, keep ? ds : B, active[0],            \
                xp + o * G,                                                                          \
                xstat ? xstat + 2 * sv : 0, gx, b_ih, r, h, rmask, b_hh, y + o * H,                  \
                gates + sg * sv * G, hbn + sg * sv * H, hist + sv * H, n_next ? hd + (o + n) * H : 0, \
                rhat ? rhat + sv * G : 0, rrstd ? rrstd + sv : 0, gh, eps, zh ? zh + o * H : 0,      \
                zh_const, low, keep == 2 ? gates + tid * (G + H) : 0};                               \
            if (by_rows || !sync) { /* this thread's rows, fl_row_block */                           \
                int64_t d0, d1, b0, b1, pd, pb, sh;                                                  \
                fl_row_block(by_rows, D, tid, nt, n, lo, hi, &d0, &d1, &b0, &b1);                    \
                for (int64_t d = d0; d < d1; d++)                                                    \
                    for (int64_t b = b0; b < b1; b++) {                                              \
                        if (fl_row_after(by_rows, D, B, tid, nt, d, b, d1, b0, b1, n_next, n,        \
                                         &pd, &pb, &sh)) /* the row it runs next */                  \
                            gru_forward_prefetch_##SUFFIX(&a, sh, pd, pb);                           \
                        gru_forward_row_##SUFFIX(&a, d * n + b);                                     \
                    }                                                                                \
            } else {                                                                                 \
                fl_share(D * n, tid, nt, &t0, &t1);                                                  \
                for (int64_t task = t0; task < t1; task++) gru_forward_row_##SUFFIX(&a, task);       \
                _Pragma("omp barrier")                                                               \
            }                                                                                        \
            o += n;                                                                                  \
        }                                                                                            \
    }                                                                                                \
    free(scratch);                                                                                   \
}                                                                                                    \
                                                                                                     \
/* The whole backward time loop of a layer, as lstm_backward_loop: per step, from the last, the     \
 * three passes of gru_step_backward, then dh[d, :n] += (dr[d, o:o+n] @ w[d]) (* rmask); w (D, G, H) \
 * contiguous (W_hh), wp of D * G * round_up(H, 32) values, g of D * active[0] * H (used with       \
 * rmask); the other buffers as gru_step_backward's, at packed row 0. dpre may be gates and dr       \
 * rhat (the saved buffers written over, where the graph dies with this backward); gates and hbn     \
 * NULL (the forward's keep = 2): each row's recomputed (b_ih, b_hh then the forward's), dz holds    \
 * a step's input-part gradients (D * B * G values) and dpre may be xp. gs: nthreads * (G + H)       \
 * values of work space where any of these holds (else it may be NULL). dbs (with gh): dhb holds     \
 * one step's rows (D * B * G values) and acc_bhh [D,G] (may be NULL) receives b_hh's gradient. */   \
void gru_backward_loop_##SUFFIX(                                                                     \
    int64_t D, int64_t B, int64_t steps, const int64_t* active, int64_t H, int64_t ds,              \
    const T* w, T* wp, T* g, const T* rmask,                                                         \
    const T* dy, T* dh, const T* hist, const T* gates, const T* hbn,                                 \
    const T* xp, const T* xstat, const T* gx, const T* b_ih, const T* b_hh,                          \
    const T* rhat, const T* rrstd, const T* gh, const T* zh, T zh_const,                             \
    T* dpre, T* dhb, T* dr, T* gs, T* dz, T* acc_gx, T* acc_b, T* acc_gh, T* acc_bhh, int dbs, int low, \
    int nthreads)                                                                                    \
{                                                                                                    \
    const int64_t G = 3 * H, np = fl_gemm_panels_##SUFFIX(H);                                        \
    const int64_t nchunks = (G + GRU_SUM_CHUNK_##SUFFIX - 1) / GRU_SUM_CHUNK_##SUFFIX;               \
    /* the split by rows' partial sums, as lstm_backward_loop's (acc_gx, acc_b, acc_gh, acc_bhh) */  \
    T* const acc[4] = {acc_gx, acc_b, acc_gh, acc_bhh};                                              \
    const int64_t len[4] = {D * G, D * G, D * G, D * G}, L = 4 * D * G;                              \
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
        T* mine[4]; /* the accumulators this thread adds to */                                       \
        fl_partials_mine_##SUFFIX(by_rows ? parts + tid * L : 0, acc, len, 4, mine);                 \
        int64_t o = ds;                                                                              \
        for (int64_t t = steps - 1; t >= 0; t--) {                                                   \
            const int64_t n = active[t];                                                             \
            o -= n;                                                                                  \
            const gru_bwd_##SUFFIX a = {D, B, n, H, ds, dy + o * H, dh, hist + o * H,                \
                gates ? gates + o * G : 0, gates ? hbn + o * H : 0, xp ? xp + o * G : 0,             \
                xstat ? xstat + 2 * o : 0, gx,                                                       \
                rhat ? rhat + o * G : 0, rrstd ? rrstd + o : 0, gh, zh ? zh + o * H : 0, zh_const,   \
                dpre + o * G, dbs ? dhb : dhb + o * G, dr + o * G, mine[0], mine[1], mine[2], low,   \
                gs ? gs + tid * (G + H) : 0, b_ih, b_hh, dz, mine[3], dbs};                          \
            const int sums = gru_has_sums_##SUFFIX(&a);                                              \
            const int drs = gru_has_dr_##SUFFIX(&a);                                                 \
            int64_t lo, hi;                                                                          \
            fl_own_rows(B, tid, nt, n, &lo, &hi);                                                    \
            if (by_rows || !sync) { /* as lstm_backward_loop: the passes row by row, dr after the sums */ \
                int64_t d0, d1, b0, b1, pd, pb, sh;                                                  \
                fl_row_block(by_rows, D, tid, nt, n, lo, hi, &d0, &d1, &b0, &b1);                    \
                const int64_t nn = t > 0 ? active[t - 1] : 0; /* the next step's rows (t - 1) */     \
                for (int64_t d = d0; d < d1; d++)                                                    \
                    for (int64_t b = b0; b < b1; b++) {                                              \
                        if (fl_row_after(by_rows, D, B, tid, nt, d, b, d1, b0, b1, nn, -nn,          \
                                         &pd, &pb, &sh)) /* the row it runs next */                  \
                            gru_backward_prefetch_##SUFFIX(&a, sh, pd, pb);                          \
                        gru_backward_row_##SUFFIX(&a, d * n + b);                                    \
                        if (sums) gru_sum_row_##SUFFIX(&a, d, b, 0, G);                              \
                        if (drs) gru_backward_dr_##SUFFIX(&a, d * n + b);                            \
                        if (xstat) gru_backward_input_norm_##SUFFIX(&a, d * n + b);                  \
                    }                                                                                \
            } else {                                                                                 \
                fl_share(D * n, tid, nt, &t0, &t1);                                                  \
                for (int64_t task = t0; task < t1; task++) gru_backward_row_##SUFFIX(&a, task);      \
                _Pragma("omp barrier")                                                               \
                if (sums) {                                                                          \
                    fl_share(D * nchunks, tid, nt, &t0, &t1);                                        \
                    for (int64_t task = t0; task < t1; task++) gru_backward_sums_##SUFFIX(&a, task); \
                    _Pragma("omp barrier")                                                           \
                }                                                                                    \
                if (drs || xstat) { /* dr after the sums (it may be written over rhat), then the     \
                                     * input LayerNorm's (on dpre); the product reads dr */          \
                    fl_share(D * n, tid, nt, &t0, &t1);                                              \
                    for (int64_t task = t0; task < t1; task++) {                                     \
                        if (drs) gru_backward_dr_##SUFFIX(&a, task);                                 \
                        if (xstat) gru_backward_input_norm_##SUFFIX(&a, task);                       \
                    }                                                                                \
                    _Pragma("omp barrier")                                                           \
                }                                                                                    \
            }                                                                                        \
            fl_step_product_add_##SUFFIX(ab, by_rows, sync, lo, hi, p0, p1, D, np, n, G, H, a.dr,    \
                                         ds, wp, dh, B, rmask, g, active[0]);                        \
        }                                                                                            \
        if (by_rows) {                                                                               \
            _Pragma("omp barrier")                                                                   \
            fl_partials_reduce_##SUFFIX(parts, L, tid, nt, acc, len, 4);                             \
        }                                                                                            \
    }                                                                                                \
    free(parts);                                                                                     \
    free(scratch);                                                                                   \
}

DEFINE_GRU(float, f32, fl_exp_f32, fl_tanh_f32, sqrtf)
DEFINE_GRU(double, f64, exp, tanh, sqrt)
