/* Small dense products for the recurrent step loops (lstm.c, gru.c): C = A @ B on a few rows.
 *
 * Why our own: the per-step recurrent product has few rows (the batch, 8-128); torch's BLAS call
 * for it is about as fast as this kernel, but it is one call into torch per step, which keeps
 * the time loop in Python (or C++ dispatch) with the second core idle between calls. With this
 * kernel the whole loop runs in one C call and one OpenMP region (lstm.c).
 *
 * B (K x N, the step's weight) is packed once per call into column panels: panel p holds columns
 * [p*W, p*W + W) as K rows of W contiguous values (W = two vectors; the last panel zero-padded),
 * so the micro-kernel streams it front to back (a row-major B read W columns at a time jumps a
 * whole row between loads, out of reach of the prefetcher once N*sizeof(T) > 4 KiB).
 *
 * fl_gemm_panels_SUFFIX(N): the number of panels;
 * fl_gemm_pack_SUFFIX(K, N, B, ldb, rows, trans, Bp, p0, p1): packs panels [p0, p1) of B (K x N,
 *   row stride ldb; with rows, K indices: row k of B is row rows[k] there; trans: B given as its
 *   N x K transpose, row stride ldb) into Bp (panels * K * W values);
 * fl_gemm_SUFFIX(m, p0, p1, K, N, A, lda, Bp, C, ldc): C[i, j] = sum_k A[i, k] * B[k, j] for
 *   i < m and the columns j < N of panels [p0, p1); A is m x K (row stride lda), C has row
 *   stride ldc and is overwritten (accumulate = 0) or added to (accumulate = 1). Single-threaded: the loops give each thread its panels
 *   (fl_gemm_share).
 * The micro-kernel keeps an R x 2 block of vectors of C in registers, broadcasting one A value
 * per row and loading two B vectors per k (6 x 16 floats with AVX2, 8 x 32 with AVX-512: the
 * vector width follows the variant's target flags, setup.py); m rows run in balanced blocks of
 * at most R (8 rows as 4 + 4: a block of few rows loads B as often for less work); each tile
 * runs all of k with its C block in registers (k in blocks only past a panel slice of 256 KiB:
 * 2048 values of k with AVX-512). Blocks of 16 KiB that stay in L1 while the row blocks reuse
 * them were slower: C reloaded per block cost more than the panel streamed from L2 (the seed's
 * projection 193-195 against 215-218 GFLOP/s on 2 threads of a Zen 4, bench_large_products.py;
 * BENCHMARKS.md, issue 62's fifth Zen 4 section).
 */
#ifndef FASTLAYERS_GEMM_H
#define FASTLAYERS_GEMM_H
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__AVX512F__)
#define FL_VBYTES 64
#define FL_GEMM_R 8
#else
#define FL_VBYTES 32
#define FL_GEMM_R 6
#endif
#define FL_GEMM_KC (262144 / (2 * FL_VBYTES)) /* k per block: a panel slice of 256 KiB */
/* The step loops split a step by rows instead of by panels and rows (two or three barriers per
 * step) where the threads do not divide the directions, every thread has rows and the packed
 * recurrent weight (every thread reads all of it each step) fits a core's L2 (this CPU's, from
 * sysconf; 256 KiB where it does not say): BENCHMARKS.md, issue 62's third Zen 4 section. */
static inline int64_t fl_rows_weight_bytes(void)
{
    static int64_t bytes = 0;
    if (!bytes) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = l2 > 0 ? l2 : 256 * 1024;
    }
    return bytes;
}
static inline int fl_by_rows(int64_t D, int64_t B, int nt, int64_t packed_bytes)
{
    return nt > 1 && D % nt != 0 && B >= nt && packed_bytes <= fl_rows_weight_bytes();
}
/* The step loops' split by rows (fl_by_rows): thread tid of nt owns the batch slots [lo, hi) =
 * [B*tid/nt, B*(tid+1)/nt) for the whole loop (contiguous: the per-row statistics of two threads
 * share a cache line only at the edge); at a step of n active rows it runs [lo, min(hi, n)). */
static inline void fl_own_rows(int64_t B, int tid, int nt, int64_t n, int64_t* lo, int64_t* hi)
{
    *lo = B * tid / nt;
    *hi = B * (tid + 1) / nt < n ? B * (tid + 1) / nt : n;
    if (*hi < *lo) *hi = *lo;
}

#define FL_DEFINE_GEMM(T, SUFFIX)                                                                    \
typedef T fl_vec_##SUFFIX __attribute__((vector_size(FL_VBYTES), aligned(sizeof(T)), may_alias));   \
enum { FL_W_##SUFFIX = 2 * FL_VBYTES / (int)sizeof(T) };                                             \
                                                                                                     \
static inline int64_t fl_gemm_panels_##SUFFIX(int64_t N) { return (N + FL_W_##SUFFIX - 1) / FL_W_##SUFFIX; } \
                                                                                                     \
static void fl_gemm_pack_##SUFFIX(int64_t K, int64_t N, const T* B, int64_t ldb,                   \
                                  const int64_t* rows, int trans, T* Bp, int64_t p0, int64_t p1)     \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX;                                                                 \
    for (int64_t p = p0; p < p1; p++) {                                                              \
        const int64_t j = p * W, cols = N - j < W ? N - j : W;                                       \
        T* dst = Bp + p * K * W;                                                                     \
        if (trans) { /* B given as its transpose, N x K: column c of the panel is row j + c. In blocks\
                      * of 64 bytes of k: each row's cache line is read whole, into a block of the   \
                      * panel that stays in L1 (with k outermost, one value of 32 rows a ldb apart   \
                      * at a time, the loop waited on its loads: most of matmul.c's time outside     \
                      * its products in a profile of checkpoint_every's segments) */                 \
            const int64_t KB = 64 / (int64_t)sizeof(T);                                              \
            for (int64_t k0 = 0; k0 < K; k0 += KB) {                                                 \
                const int64_t kn = K - k0 < KB ? K - k0 : KB;                                        \
                T* restrict blk = dst + k0 * W;                                                      \
                for (int64_t c = 0; c < cols; c++) {                                                 \
                    const T* restrict src = B + (j + c) * ldb + k0;                                  \
                    for (int64_t q = 0; q < kn; q++) blk[q * W + c] = src[q];                        \
                }                                                                                    \
                for (int64_t c = cols; c < W; c++)                                                   \
                    for (int64_t q = 0; q < kn; q++) blk[q * W + c] = 0;                             \
            }                                                                                        \
            continue;                                                                                \
        }                                                                                            \
        for (int64_t k = 0; k < K; k++) {                                                            \
            memcpy(dst + k * W, B + (rows ? rows[k] : k) * ldb + j, sizeof(T) * cols);               \
            for (int64_t c = cols; c < W; c++) dst[k * W + c] = 0;                                   \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* rows [0, R) of one panel's columns, over k in [0, K) of the panel slice Bp (K x W); A[r, k] at    \
 * A + r*lda + k*ldk (ldk 1: A row-major; matmul.c's transposed products pass packed A, lda 1);      \
 * added to C's values when ADD (a later block of k), else overwriting them; `cols` < W: a partial   \
 * panel */                                                                                          \
static inline __attribute__((always_inline)) void fl_gemm_tile_##SUFFIX(                             \
    const int R, int64_t K, const T* restrict A, int64_t lda, int64_t ldk, const T* restrict Bp,     \
    T* restrict C, int64_t ldc, int add, int64_t cols)                                               \
{                                                                                                    \
    const int V = FL_W_##SUFFIX / 2;                                                                 \
    fl_vec_##SUFFIX acc0[8], acc1[8];                                                                \
    for (int r = 0; r < R; r++) { acc0[r] = (fl_vec_##SUFFIX){0}; acc1[r] = (fl_vec_##SUFFIX){0}; } \
    for (int64_t k = 0; k < K; k++) {                                                                \
        const fl_vec_##SUFFIX b0 = *(const fl_vec_##SUFFIX*)(Bp + k * 2 * V);                       \
        const fl_vec_##SUFFIX b1 = *(const fl_vec_##SUFFIX*)(Bp + k * 2 * V + V);                   \
        for (int r = 0; r < R; r++) {                                                                \
            const T a = A[r * lda + k * ldk];                                                        \
            acc0[r] += a * b0;                                                                       \
            acc1[r] += a * b1;                                                                       \
        }                                                                                            \
    }                                                                                                \
    for (int r = 0; r < R; r++) {                                                                    \
        T* c = C + r * ldc;                                                                          \
        if (cols == 2 * V) {                                                                         \
            if (add) { acc0[r] += *(const fl_vec_##SUFFIX*)c; acc1[r] += *(const fl_vec_##SUFFIX*)(c + V); } \
            *(fl_vec_##SUFFIX*)c = acc0[r]; *(fl_vec_##SUFFIX*)(c + V) = acc1[r];                    \
        } else {                                                                                     \
            T tmp[2 * V];                                                                            \
            memcpy(tmp, &acc0[r], sizeof(acc0[r])); memcpy(tmp + V, &acc1[r], sizeof(acc1[r]));      \
            for (int64_t q = 0; q < cols; q++) c[q] = add ? c[q] + tmp[q] : tmp[q];                  \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
                                                                                                     \
/* fl_gemm_tile with R = rows (1 .. FL_GEMM_R), each height its own unrolled copy */                 \
static inline __attribute__((always_inline)) void fl_gemm_rows_##SUFFIX(                             \
    int64_t rows, int64_t K, const T* A, int64_t lda, int64_t ldk, const T* Bp, T* C, int64_t ldc,   \
    int add, int64_t cols)                                                                           \
{                                                                                                    \
    switch (rows) {                                                                                  \
    case 8: fl_gemm_tile_##SUFFIX(8, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 7: fl_gemm_tile_##SUFFIX(7, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 6: fl_gemm_tile_##SUFFIX(6, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 5: fl_gemm_tile_##SUFFIX(5, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 4: fl_gemm_tile_##SUFFIX(4, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 3: fl_gemm_tile_##SUFFIX(3, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    case 2: fl_gemm_tile_##SUFFIX(2, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                  \
    default: fl_gemm_tile_##SUFFIX(1, K, A, lda, ldk, Bp, C, ldc, add, cols); break;                 \
    }                                                                                                \
}                                                                                                    \
                                                                                                      \
static void fl_gemm_##SUFFIX(int64_t m, int64_t p0, int64_t p1, int64_t K, int64_t N, const T* A,    \
                             int64_t lda, const T* Bp, T* C, int64_t ldc, int accumulate)            \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX, blocks = (m + FL_GEMM_R - 1) / FL_GEMM_R;                       \
    if (K == 0) {                                                                                    \
        if (accumulate) return;                                                                      \
        for (int64_t i = 0; i < m; i++) {                                                            \
            const int64_t j0 = p0 * W, j1 = p1 * W < N ? p1 * W : N;                                 \
            if (j1 > j0) memset(C + i * ldc + j0, 0, sizeof(T) * (j1 - j0));                         \
        }                                                                                            \
        return;                                                                                      \
    }                                                                                                \
    for (int64_t k0 = 0; k0 < K; k0 += FL_GEMM_KC) {                                                 \
        const int64_t kc = K - k0 < FL_GEMM_KC ? K - k0 : FL_GEMM_KC;                                \
        for (int64_t p = p0; p < p1; p++) {                                                          \
            const int64_t j = p * W, cols = N - j < W ? N - j : W;                                   \
            const T* bp = Bp + p * K * W + k0 * W;                                                   \
            for (int64_t q = 0, i = 0; q < blocks; q++) {                                            \
                const int64_t rows = m / blocks + (q < m % blocks);                                  \
                const T* a = A + i * lda + k0; T* c = C + i * ldc + j;                               \
                const int add = accumulate || k0 > 0;                                                              \
                fl_gemm_rows_##SUFFIX(rows, kc, a, lda, 1, bp, c, ldc, add, cols);                   \
                i += rows;                                                                           \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
/* The step loops' use: the weights of D directions (direction d's K x N matrix at w + d*K*N, or   \
 * with trans its N x K transpose there) as D * np panels, q = d * np + p; each thread packs and     \
 * multiplies the same share [q0, q1) every step (fl_share), so its panels stay in its caches. */   \
static inline void fl_gemm_pack_items_##SUFFIX(int64_t q0, int64_t q1, int64_t np, int64_t K, int64_t N,   \
                                        const T* w, int trans, T* wp)                                \
{                                                                                                    \
    for (int64_t q = q0; q < q1; q++)                                                                \
        fl_gemm_pack_##SUFFIX(K, N, w + (q / np) * K * N, trans ? K : N, 0, trans,                   \
                              wp + (q / np) * np * K * FL_W_##SUFFIX, q % np, q % np + 1);           \
}                                                                                                    \
/* C_d[:m] = A_d[:m] @ W_d (accumulate = 0) or += (1) for the share's panels: A_d rows at            \
 * A + d*a_ds*K (stride K), C_d rows at C + d*c_ds*N (stride N) */                                   \
static inline void fl_gemm_items_##SUFFIX(int64_t q0, int64_t q1, int64_t np, int64_t m, int64_t K,        \
                                   int64_t N, const T* A, int64_t a_ds, const T* wp, T* C,           \
                                   int64_t c_ds, int accumulate)                                     \
{                                                                                                    \
    for (int64_t q = q0; q < q1; q++) {                                                              \
        const int64_t d = q / np, p = q % np;                                                        \
        fl_gemm_##SUFFIX(m, p, p + 1, K, N, A + d * a_ds * K, K, wp + d * np * K * FL_W_##SUFFIX,     \
                         C + d * c_ds * N, N, accumulate);                                           \
    }                                                                                                \
}                                                                                                    \
/* C_d[b] = A_d[b] @ W_d (accumulate = 0) or += (1) for the rows b in [lo, hi) by the whole packed   \
 * weight (all np panels); A_d rows at A + (d*a_ds + b)*K, C_d rows at C + (d*c_ds + b)*N. */        \
static inline void fl_gemm_own_rows_##SUFFIX(int64_t lo, int64_t hi, int64_t D, int64_t np,          \
                                             int64_t K, int64_t N, const T* A, int64_t a_ds,         \
                                             const T* wp, T* C, int64_t c_ds, int accumulate)        \
{                                                                                                    \
    if (hi <= lo) return;                                                                            \
    for (int64_t d = 0; d < D; d++)                                                                  \
        fl_gemm_##SUFFIX(hi - lo, 0, np, K, N, A + (d * a_ds + lo) * K, K,                           \
                         wp + d * np * K * FL_W_##SUFFIX, C + (d * c_ds + lo) * N, N, accumulate);   \
}                                                                                                    \
/* dh_d[b, j] += g_d[b, j] * mask_d[b, j] for the rows b in [b0, b1) and columns j in [j0, j1) of   \
 * direction d (dh and mask (D, B, N), g gs rows of N per direction): a masked recurrent product's   \
 * gradient added (fl_gemm_own_rows_add / fl_gemm_items_add, gemm_bf16.h's) */                      \
static inline void fl_add_masked_##SUFFIX(T* dh, const T* mask, const T* g, int64_t B, int64_t gs,   \
                                          int64_t N, int64_t d, int64_t b0, int64_t b1, int64_t j0,  \
                                          int64_t j1)                                                \
{                                                                                                    \
    for (int64_t b = b0; b < b1; b++) {                                                              \
        T* dhr = dh + (d * B + b) * N; const T* mr = mask + (d * B + b) * N;                         \
        const T* gr = g + (d * gs + b) * N;                                                          \
        for (int64_t j = j0; j < j1; j++) dhr[j] += gr[j] * mr[j];                                   \
    }                                                                                                \
}                                                                                                    \
/* the backward step's recurrent product on the rows [lo, hi), as fl_gemm_items_add below */         \
static inline void fl_gemm_own_rows_add_##SUFFIX(int64_t lo, int64_t hi, int64_t D, int64_t np,      \
                                                 int64_t K, int64_t N, const T* dr, int64_t dr_ds,   \
                                                 const T* wp, T* dh, int64_t B, const T* mask, T* g, \
                                                 int64_t gs)                                         \
{                                                                                                    \
    if (!mask) {                                                                                     \
        fl_gemm_own_rows_##SUFFIX(lo, hi, D, np, K, N, dr, dr_ds, wp, dh, B, 1);                     \
        return;                                                                                      \
    }                                                                                                \
    fl_gemm_own_rows_##SUFFIX(lo, hi, D, np, K, N, dr, dr_ds, wp, g, gs, 0);                         \
    for (int64_t d = 0; d < D; d++) fl_add_masked_##SUFFIX(dh, mask, g, B, gs, N, d, lo, hi, 0, N);  \
}                                                                                                    \
/* Per-thread partial parameter sums of the split by rows: thread t's at parts + t * L hold count    \
 * accumulators laid end to end (len[i] values each); acc[i] += part 0 + ... + part nt-1 (in this    \
 * order) on the thread's share of each accumulator's values; acc[i] NULL: not summed. */            \
static inline void fl_partials_reduce_##SUFFIX(const T* parts, int64_t L, int tid, int nt,           \
                                               T* const* acc, const int64_t* len, int count)         \
{                                                                                                    \
    int64_t off = 0;                                                                                 \
    for (int i = 0; i < count; off += len[i], i++) {                                                 \
        if (!acc[i]) continue;                                                                       \
        const int64_t j0 = len[i] * tid / nt, j1 = len[i] * (tid + 1) / nt;                          \
        for (int64_t j = j0; j < j1; j++) {                                                          \
            T v = acc[i][j];                                                                         \
            for (int t = 0; t < nt; t++) v += parts[t * L + off + j];                                \
            acc[i][j] = v;                                                                           \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
/* a backward step's recurrent product: dh_d[:m] += (dr_d[:m] @ W_d) * mask_d[:m] for the share's    \
 * panels (dh and mask (D, B, N); without a mask added in place, else through g, gs >= m rows of N  \
 * per direction) */                                                                                 \
static inline void fl_gemm_items_add_##SUFFIX(int64_t q0, int64_t q1, int64_t np, int64_t m, int64_t K,    \
                                       int64_t N, const T* dr, int64_t dr_ds, const T* wp, T* dh,    \
                                       int64_t B, const T* mask, T* g, int64_t gs)                   \
{                                                                                                    \
    if (!mask) { fl_gemm_items_##SUFFIX(q0, q1, np, m, K, N, dr, dr_ds, wp, dh, B, 1); return; }     \
    fl_gemm_items_##SUFFIX(q0, q1, np, m, K, N, dr, dr_ds, wp, g, gs, 0);                            \
    for (int64_t q = q0; q < q1; q++) {                                                              \
        const int64_t d = q / np, j0 = (q % np) * FL_W_##SUFFIX;                                     \
        const int64_t j1 = j0 + FL_W_##SUFFIX < N ? j0 + FL_W_##SUFFIX : N;                          \
        fl_add_masked_##SUFFIX(dh, mask, g, B, gs, N, d, 0, m, j0, j1);                              \
    }                                                                                                \
}                                                                                                    \
/* A step loop's start, inside its parallel region: this thread's share [p0, p1) of the D * np       \
 * panels of w (D matrices K x N, or with trans their N x K transposes) packed into wp; with the     \
 * split by rows every thread reads every panel, so it waits for all of them. */                     \
static inline void fl_loop_pack_##SUFFIX(int by_rows, int tid, int nt, int64_t D, int64_t np,        \
                                         int64_t K, int64_t N, const T* w, int trans, T* wp,         \
                                         int64_t* p0, int64_t* p1)                                   \
{                                                                                                    \
    fl_share(D * np, tid, nt, p0, p1);                                                               \
    fl_gemm_pack_items_##SUFFIX(*p0, *p1, np, K, N, w, trans, wp);                                   \
    if (by_rows) { _Pragma("omp barrier") }                                                          \
}                                                                                                    \
/* A forward step's recurrent product C_d[:n] = A_d[:n] @ W_d (A_d rows at A + d*a_ds*K, C_d rows    \
 * at C + d*c_ds*N): this thread's rows [lo, hi) by every panel (by_rows), else its panels [p0, p1)  \
 * for every row, then (sync) a barrier before any thread reads the product. */                      \
static inline void fl_loop_product_##SUFFIX(int by_rows, int sync, int64_t lo, int64_t hi,           \
                                            int64_t p0, int64_t p1, int64_t D, int64_t np,           \
                                            int64_t n, int64_t K, int64_t N, const T* A,             \
                                            int64_t a_ds, const T* wp, T* C, int64_t c_ds)           \
{                                                                                                    \
    if (by_rows) {                                                                                   \
        fl_gemm_own_rows_##SUFFIX(lo, hi, D, np, K, N, A, a_ds, wp, C, c_ds, 0);                     \
        return;                                                                                      \
    }                                                                                                \
    fl_gemm_items_##SUFFIX(p0, p1, np, n, K, N, A, a_ds, wp, C, c_ds, 0);                            \
    if (sync) { _Pragma("omp barrier") }                                                             \
}                                                                                                    \
/* A backward step's recurrent product dh_d[:n] += (dr_d[:n] @ W_d) (* mask_d[:n]), split as         \
 * fl_loop_product's, then (sync, panels) a barrier before the next step reads dh. */                \
static inline void fl_loop_product_add_##SUFFIX(int by_rows, int sync, int64_t lo, int64_t hi,       \
                                                int64_t p0, int64_t p1, int64_t D, int64_t np,       \
                                                int64_t n, int64_t K, int64_t N, const T* dr,        \
                                                int64_t dr_ds, const T* wp, T* dh, int64_t B,        \
                                                const T* mask, T* g, int64_t gs)                     \
{                                                                                                    \
    if (by_rows) {                                                                                   \
        fl_gemm_own_rows_add_##SUFFIX(lo, hi, D, np, K, N, dr, dr_ds, wp, dh, B, mask, g, gs);       \
        return;                                                                                      \
    }                                                                                                \
    fl_gemm_items_add_##SUFFIX(p0, p1, np, n, K, N, dr, dr_ds, wp, dh, B, mask, g, gs);              \
    if (sync) { _Pragma("omp barrier") }                                                             \
}                                                                                                    \
/* The accumulators a thread adds to: with its partial sums `part` (the split by rows) its own       \
 * (laid out as fl_partials_reduce's), else acc as given; NULL stays NULL. */                        \
static inline void fl_partials_mine_##SUFFIX(T* part, T* const* acc, const int64_t* len, int count,  \
                                             T** mine)                                               \
{                                                                                                    \
    int64_t off = 0;                                                                                 \
    for (int i = 0; i < count; off += len[i], i++) mine[i] = acc[i] && part ? part + off : acc[i];   \
}                                                                                                    \

/* the share [*a, *b) of worker `tid` of `nt` in `count` items (contiguous, balanced) */
static inline void fl_share(int64_t count, int tid, int nt, int64_t* a, int64_t* b)
{
    *a = count * tid / nt;
    *b = count * (tid + 1) / nt;
}
/* The rows a step loop's thread runs one after another at a step of n active rows, with no barrier
 * between its passes, as directions [d0, d1) by batch slots [b0, b1): with the split by rows its
 * slots [lo, hi) (fl_own_rows) of every direction, else (the thread count divides D) every row of
 * its share of the directions */
static inline void fl_row_block(int by_rows, int64_t D, int tid, int nt, int64_t n, int64_t lo,
                                int64_t hi, int64_t* d0, int64_t* d1, int64_t* b0, int64_t* b1)
{
    if (by_rows) {
        *d0 = 0; *d1 = D; *b0 = lo; *b1 = hi;
        return;
    }
    fl_share(D, tid, nt, d0, d1);
    *b0 = 0; *b1 = n;
}
/* The time loops, where a thread runs its rows one after another (fl_row_block), prefetch before
 * each row the saved or input rows of the row they run after it (those buffers are larger than
 * the caches; one row's work hides the memory's latency; the steps split into tasks do not):
 * fl_row_after gives the row a thread runs after (d, b) of its block [d0, d1) x [b0, b1): the next
 * in the loops' order, else (*shift = next_shift, the packed rows from this step's to the next's)
 * the first of its block (fl_row_block's) at the next step, of n_next rows; 0: none. fl_prefetch
 * touches [p, p + bytes) with prefetcht0 (always inlined,
 * as its callers must be: GCC takes a function that only prefetches for one without effects and
 * drops its calls). (A whole step ahead, into L2, measured the same at H = 64 and at the seed shape;
 * a row ahead does not rely on the step's product, which streams the weight through L2, leaving
 * them there.) */
static inline int fl_row_after(int by_rows, int64_t D, int64_t B, int tid, int nt, int64_t d,
                               int64_t b, int64_t d1, int64_t b0, int64_t b1, int64_t n_next,
                               int64_t next_shift, int64_t* pd, int64_t* pb, int64_t* shift)
{
    int64_t lo, hi, nd1, nb1;
    *shift = 0;
    if (b + 1 < b1) { *pd = d; *pb = b + 1; return 1; }
    if (d + 1 < d1 && b0 < b1) { *pd = d + 1; *pb = b0; return 1; }
    if (n_next <= 0) return 0;
    *shift = next_shift;
    fl_own_rows(B, tid, nt, n_next, &lo, &hi);
    fl_row_block(by_rows, D, tid, nt, n_next, lo, hi, pd, &nd1, pb, &nb1);
    return *pd < nd1 && *pb < nb1;
}
static inline __attribute__((always_inline)) void fl_prefetch(const void* p, int64_t bytes)
{
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 3);
}

FL_DEFINE_GEMM(float, f32)
FL_DEFINE_GEMM(double, f64)
#endif
