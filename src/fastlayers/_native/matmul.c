/* The recurrent layers' large products on gemm.h's kernel: the input projection (xp = X W_ih^T + b)
 * and its input gradient (dX = dpre W_ih), D directions at once; the input gradient summed over the
 * directions into the padded rows with fl_matmul_sum, the weight gradients (dW = dpre^T X) with
 * fl_matmul_tn below (both read the padded input's rows through an index: no packed copy of them).
 *
 * Why our own: on AMD CPUs torch's BLAS (MKL) runs its generic code path; at the seed shape
 * ((25600 x 512) @ (512 x 1024), 2 threads, AMD EPYC Zen 4) it reached 171-180 GFLOP/s where
 * gemm.h's kernel in row blocks reached 188-211 (BENCHMARKS.md, issue 62). Which one runs is
 * chosen here per CPU and size (fl_matmul_preferred: on AMD CPUs, where it was measured faster,
 * for products of at least FL_MATMUL_MIN_ROWS rows; MKL keeps Intel's, where it runs its own AVX-512
 * code) and can be forced from Python (fl_matmul_prefer: fastlayers._native.prefer_own_products).
 *
 * fl_matmul_SUFFIX(D, M, K, N, A, rows, B, trans_b, bias, C, Bp, scratch, nthreads): for d < D,
 *   C_d (M x N) = A_d (M x K) @ op(B_d) (+ bias_d broadcast over the rows), where op(B_d) is B_d
 *   (K x N, row-major) when trans_b == 0, or the transpose of B_d given as N x K row-major when
 *   trans_b == 1. A_d at A + d*M*K, or with `rows` (D x M indices) row i of A_d is row
 *   rows[d*M + i] of A (the packing's gather done block by block in cache, or read in place where
 *   the indices run consecutively: the padded input, never copied whole); B_d at B + d*K*N, bias_d
 *   at bias + d*N (bias may be NULL), C_d at C + d*M*N, every matrix contiguous. Bp: work space of
 *   D * panels(N) * K * W values
 *   (fl_gemm_panels, W = the panel width: at most D * K * N rounded up to 32 columns); scratch
 *   (with rows only): nthreads * fl_matmul_scratch_rows() * K values.
 * The threads pack B's panels (a share each), then take a share of the (direction, block of
 * FL_MATMUL_MC rows) items: a thread keeps one direction's packed B while it can, and each block's
 * rows stay in L2 while gemm.h's tiles stream the panels past them.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "gemm_bf16.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#define FL_MATMUL_MIN_ROWS 640

static int fl_matmul_choice = -1; /* -1: by the CPU; 0: torch's BLAS; 1: this file's kernel */

void fl_matmul_prefer(int choice) { fl_matmul_choice = choice; }

/* The fewest rows (per direction) of a product that runs here by the CPU's choice, on an AMD CPU
 * (below, packing the weight costs more than the kernel gains). Whole LayerNorm-LSTM layers against
 * torch's BLAS (benchmarks/rnn/bench_products_threshold.py, H = 64 to 512, 2 threads; BENCHMARKS.md,
 * issue 62): on a Zen 4 (family 25) at 512 rows avx512 0.95-0.98x, avx2 0.97-1.02x; at 640 rows
 * 0.92-0.96x and 0.97-1.00x; at 128-256 rows up to 1.04x and 1.08x: FL_MATMUL_MIN_ROWS. On a Zen 5
 * (family 26), whose torch sgemm runs at under half of this kernel's rate, avx512 from 64 rows
 * 0.75-0.91x (at 32 rows up to 1.16x), avx2 from 256 rows 0.92-0.96x (at 128 rows up to 1.10x).
 * Families after 26 take 26's counts. */
int64_t fl_matmul_min_rows(void)
{
    static int64_t rows = 0;
    if (!rows) {
        unsigned family = 0;
#if defined(__x86_64__) || defined(__i386__)
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (__get_cpuid(1, &a, &b, &c, &d)) { /* the family: base, plus the extended one past 15 */
            family = (a >> 8) & 0xF;
            if (family == 0xF) family += (a >> 20) & 0xFF;
        }
#endif
#if defined(__AVX512F__)
        rows = family >= 26 ? 64 : FL_MATMUL_MIN_ROWS;
#else
        rows = family >= 26 ? 256 : FL_MATMUL_MIN_ROWS;
#endif
    }
    return rows;
}

/* whether a product of `rows` rows (per direction) runs here: forced, or on an AMD CPU from
 * fl_matmul_min_rows() rows */
int fl_matmul_preferred(int64_t rows)
{
    if (fl_matmul_choice >= 0) return fl_matmul_choice;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX2__)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && rows >= fl_matmul_min_rows() ? 1 : 0;
#else
    return 0; /* the default variant (no AVX2) and other architectures: not measured */
#endif
}

/* Whether the step loops' bf16 products run on VDPBF16PS here (gemm_bf16.h: this variant has
 * AVX-512 and the CPU AVX512-BF16); Python: fastlayers._native.bf16_products. */
int fl_bf16_products(void) { return fl_bf16_ok_f32(2); }

#define FL_MATMUL_MC 96 /* rows per item: a multiple of both micro-kernel heights (6, 8) */
int64_t fl_matmul_scratch_rows(void) { return FL_MATMUL_MC; }

/* rows per work item: FL_MATMUL_MC, or fewer (a multiple of the micro-kernel's height) where the
 * items (per of them for each block of rows) would not split evenly between the nt threads: at
 * 640 rows of one direction, 7 items of 96 on 2 threads (one thread a block more than the other)
 * ran at 182 GFLOP/s, 6 of them (576 rows) at 199 (Zen 4, ad hoc) */
static inline int64_t fl_matmul_mc(int64_t per, int64_t M, int nt)
{
    const int64_t blocks = (M + FL_MATMUL_MC - 1) / FL_MATMUL_MC;
    if (nt <= 1 || (per * blocks) % nt == 0) return FL_MATMUL_MC;
    for (int64_t b = blocks + 1; b <= blocks + nt; b++) {
        const int64_t mc = ((M + b - 1) / b + FL_GEMM_R - 1) / FL_GEMM_R * FL_GEMM_R;
        if (mc <= FL_MATMUL_MC && (per * ((M + mc - 1) / mc)) % nt == 0) return mc;
    }
    return FL_MATMUL_MC;
}

static inline int fl_consecutive(const int64_t* index, int64_t m)
{
    for (int64_t r = 1; r < m; r++)
        if (index[r] != index[0] + r) return 0;
    return m > 0;
}
/* rows index[0..m) of A (row stride K) as a block: in place where the indices run consecutively,
 * else gathered into scratch (m x K; it stays in L2) */
#define FL_DEFINE_BLOCK_ROWS(T, SUFFIX)                                                              \
static inline const T* fl_block_rows_##SUFFIX(const T* A, const int64_t* index, int64_t m,         \
                                              int64_t K, T* scratch)                                 \
{                                                                                                    \
    if (fl_consecutive(index, m)) return A + index[0] * K;                                           \
    for (int64_t r = 0; r < m; r++) memcpy(scratch + r * K, A + index[r] * K, sizeof(T) * K);        \
    return scratch;                                                                                  \
}
FL_DEFINE_BLOCK_ROWS(float, f32)
FL_DEFINE_BLOCK_ROWS(double, f64)

#define FL_DEFINE_MATMUL(T, SUFFIX)                                                                  \
void fl_matmul_##SUFFIX(int64_t D, int64_t M, int64_t K, int64_t N, const T* A, const int64_t* rows,  \
                        const T* B, int trans_b, const T* bias, T* C, T* Bp, T* scratch, int nthreads) \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX, np = fl_gemm_panels_##SUFFIX(N);                               \
    const int64_t mc = fl_matmul_mc(D, M, nthreads), blocks = (M + mc - 1) / mc;                     \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                           \
        int64_t q0, q1; /* the thread's share of B's panels packed, then a barrier (gemm.h) */       \
        fl_loop_pack_##SUFFIX(1, tid, nt, D, np, K, N, B, trans_b, Bp, &q0, &q1);                    \
        fl_share(D * blocks, tid, nt, &q0, &q1);                                                     \
        for (int64_t q = q0; q < q1; q++) {                                                          \
            const int64_t d = q / blocks, i = (q % blocks) * mc;                                     \
            const int64_t m = M - i < mc ? M - i : mc;                                               \
            T* c = C + (d * M + i) * N;                                                              \
            const T* a = rows ? fl_block_rows_##SUFFIX(A, rows + d * M + i, m, K,                    \
                                                       scratch + tid * FL_MATMUL_MC * K)             \
                              : A + (d * M + i) * K;                                                 \
            if (bias)                                                                                \
                for (int64_t r = 0; r < m; r++) memcpy(c + r * N, bias + d * N, sizeof(T) * N);      \
            fl_gemm_##SUFFIX(m, 0, np, K, N, a, K, Bp + d * np * K * W, c, N, bias != 0);             \
        }                                                                                            \
    }                                                                                                \
}

FL_DEFINE_MATMUL(float, f32)
FL_DEFINE_MATMUL(double, f64)

/* fl_matmul_bf16(D, M, K, N, A, rows, B, b_bf16, trans_b, bias, C, Bp, scratch, nthreads): fl_matmul_f32's
 * product (the same operands' layouts, the row index and bias included) with bf16 operands and
 * float32 sums, on VDPBF16PS (gemm_bf16.h; only where fl_bf16_products() is 1): A holds bf16 values,
 * B float32 values (rounded to bf16 as packed) or with b_bf16 bf16 ones; bias and C float32. Bp:
 * fl_bf16_packed_bytes(D, K, N) bytes; scratch: nthreads * fl_matmul_bf16_scratch(K) bf16 values
 * (each thread's block of rows, gathered and padded to an even K). The recurrent layers' large
 * products under bf16 on CPUs without AMX (torch's oneDNN then runs AVX512-BF16 too), with the
 * float32 result written in place: no bf16 result to convert (BENCHMARKS.md, the mixed-precision
 * section). */
int64_t fl_matmul_bf16_scratch(int64_t K) { return FL_MATMUL_MC * ((K + 1) / 2) * 2; }

void fl_matmul_bf16(int64_t D, int64_t M, int64_t K, int64_t N, const uint16_t* A, const int64_t* rows,
                    const void* B, int b_bf16, int trans_b, const float* bias, float* C, void* Bp,
                    uint16_t* scratch, int nthreads)
{
#if FL_BF16
    const int64_t np = (N + FL_BF16_W - 1) / FL_BF16_W, K2 = (K + 1) / 2;
    const int64_t mc = fl_matmul_mc(D, M, nthreads), blocks = (M + mc - 1) / mc;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t q0, q1; /* the thread's share of B's panels packed, then a barrier */
        fl_share(D * np, tid, nt, &q0, &q1);
        fl_bf16_pack_items(q0, q1, np, K, N, B, b_bf16, trans_b, Bp);
        _Pragma("omp barrier")
        uint16_t* ab = scratch + tid * fl_matmul_bf16_scratch(K);
        fl_share(D * blocks, tid, nt, &q0, &q1);
        for (int64_t q = q0; q < q1; q++) {
            const int64_t d = q / blocks, i = (q % blocks) * mc;
            const int64_t m = M - i < mc ? M - i : mc;
            float* c = C + (d * M + i) * N;
            fl_bf16_copy_rows(m, K, rows ? A : A + (d * M + i) * K, rows ? rows + d * M + i : 0, ab);
            if (bias)
                for (int64_t r = 0; r < m; r++) memcpy(c + r * N, bias + d * N, sizeof(float) * N);
            fl_bf16_gemm(m, 0, np, K, N, ab, (const uint16_t*)Bp + d * np * K2 * 2 * FL_BF16_W, c, N, bias != 0);
        }
    }
#else
    (void)D; (void)M; (void)K; (void)N; (void)A; (void)rows; (void)B; (void)b_bf16; (void)trans_b;
    (void)bias; (void)C; (void)Bp; (void)scratch; (void)nthreads;
    abort(); /* fl_bf16_products() is 0 here: never called */
#endif
}

/* fl_matmul_sum_SUFFIX(D, M, K, N, A, NA, arows, B, trans_b, C, crows, Bp, scratch, nthreads): for
 * i < M, row crows[i] of C = sum over d < D of A_d[arows[d*M + i]] @ op(B_d): the input gradient of
 * every direction's packed rows added into the rows of the padded input they read (dX = sum_d dpre_d
 * W_ih_d), never laid out per direction first. A_d (NA x K) at A + d*NA*K; B_d, op(B_d) and Bp as
 * fl_matmul's; C's rows at C + crows[i]*N, the others untouched; scratch: the values
 * fl_matmul_sum_scratch_SUFFIX(K, N, nthreads, &values) writes. The threads pack B's panels, then take
 * blocks of FL_MATMUL_MC of the M rows: per direction the block's rows of A_d (read in place where
 * their indices run consecutively, else gathered into the thread's scratch), the products of the
 * directions added up in the block's rows of C (in place where consecutive, else in the scratch,
 * then copied out). */
#define FL_DEFINE_MATMUL_SUM(T, SUFFIX)                                                              \
void fl_matmul_sum_scratch_##SUFFIX(int64_t K, int64_t N, int64_t nthreads, int64_t* values)         \
{                                                                                                    \
    *values = nthreads * FL_MATMUL_MC * (K + N);                                                     \
}                                                                                                    \
void fl_matmul_sum_##SUFFIX(int64_t D, int64_t M, int64_t K, int64_t N, const T* A, int64_t NA,      \
                            const int64_t* arows, const T* B, int trans_b, T* C, const int64_t* crows, \
                            T* Bp, T* scratch, int nthreads)                                         \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX, np = fl_gemm_panels_##SUFFIX(N);                                \
    const int64_t mc = fl_matmul_mc(1, M, nthreads), blocks = (M + mc - 1) / mc;                     \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        int64_t q0, q1; /* as fl_matmul's */                                                         \
        fl_loop_pack_##SUFFIX(1, tid, nt, D, np, K, N, B, trans_b, Bp, &q0, &q1);                    \
        T* const sa = scratch + tid * FL_MATMUL_MC * (K + N);                                        \
        T* const sc = sa + FL_MATMUL_MC * K;                                                         \
        fl_share(blocks, tid, nt, &q0, &q1);                                                         \
        for (int64_t q = q0; q < q1; q++) {                                                          \
            const int64_t i = q * mc, m = M - i < mc ? M - i : mc;                                   \
            const int direct = fl_consecutive(crows + i, m);                                         \
            T* c = direct ? C + crows[i] * N : sc;                                                   \
            for (int64_t d = 0; d < D; d++) {                                                        \
                const T* a = fl_block_rows_##SUFFIX(A + d * NA * K, arows + d * M + i, m, K, sa);    \
                fl_gemm_##SUFFIX(m, 0, np, K, N, a, K, Bp + d * np * K * W, c, N, d > 0);            \
            }                                                                                        \
            if (!direct)                                                                             \
                for (int64_t r = 0; r < m; r++) memcpy(C + crows[i + r] * N, sc + r * N, sizeof(T) * N); \
        }                                                                                            \
    }                                                                                                \
}

FL_DEFINE_MATMUL_SUM(float, f32)
FL_DEFINE_MATMUL_SUM(double, f64)

/* fl_matmul_tn_SUFFIX(D, M, N, K, P, Q, qrows, C, scratch, nthreads): for d < D, C_d (M x N) =
 * P_d^T Q_d, with P_d (K x M) at P + d*K*M, Q_d (K x N) at Q + d*K*N (or with qrows, D x K indices:
 * row k of Q_d is row qrows[d*K + k] of Q, the padded input's rows the packed rows read) and C_d at
 * C + d*M*N (overwritten), every matrix contiguous: the weight gradients dW_d = dpre_d^T X_d over
 * all packed rows (K of them).
 * scratch: the values fl_matmul_tn_scratch_SUFFIX(N, nthreads, &values) writes.
 * The threads split the D * M rows of C into contiguous shares. Per block of FL_TN_KC values of k,
 * a thread packs Q_d's slice into column panels (all N columns; it stays in L2), then, per
 * FL_TN_MC of its rows, P_d's slice into blocks of FL_GEMM_R rows, each k's values of a block side
 * by side (the micro-kernel's A values are contiguous: a block of P_d^T read in place would step
 * M values per k); each block then runs gemm.h's tile against every panel while it stays in L1.
 * On AMD Zen 4 (2 threads), at the seed shape's dW_ih (2 x 1024 x 512 over 25600 rows) this ran at
 * 207 GFLOP/s against torch.bmm's (MKL) 193 (benchmarks/rnn/bench_large_products.py; BENCHMARKS.md,
 * issue 62's fourth Zen 4 section). */
#define FL_TN_KC 256
#define FL_TN_MC 256
#define FL_DEFINE_MATMUL_TN(T, SUFFIX)                                                               \
static inline int64_t fl_matmul_tn_thread_scratch_##SUFFIX(int64_t N)                                \
{                                                                                                    \
    /* Q's panels, then P's row blocks (whole blocks of FL_GEMM_R: FL_TN_MC rounded up) */           \
    const int64_t blocks = (FL_TN_MC + FL_GEMM_R - 1) / FL_GEMM_R;                                   \
    return (fl_gemm_panels_##SUFFIX(N) * FL_W_##SUFFIX + blocks * FL_GEMM_R) * FL_TN_KC;             \
}                                                                                                    \
void fl_matmul_tn_scratch_##SUFFIX(int64_t N, int64_t nthreads, int64_t* values)                     \
{                                                                                                    \
    *values = nthreads * fl_matmul_tn_thread_scratch_##SUFFIX(N);                                    \
}                                                                                                    \
void fl_matmul_tn_##SUFFIX(int64_t D, int64_t M, int64_t N, int64_t K, const T* P, const T* Q,       \
                           const int64_t* qrows, T* C, T* scratch, int nthreads)                     \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX, R = FL_GEMM_R, np = fl_gemm_panels_##SUFFIX(N);                 \
    const int64_t units = (M + R - 1) / R; /* a share is whole blocks of R rows */                   \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        T* const qp = scratch + tid * fl_matmul_tn_thread_scratch_##SUFFIX(N);                       \
        T* const ap = qp + np * FL_TN_KC * W;                                                        \
        int64_t u0, u1;                                                                              \
        fl_share(D * units, tid, nt, &u0, &u1);                                                      \
        while (u0 < u1) { /* the share's rows [r0, r1) of direction d */                             \
            const int64_t d = u0 / units, ue = u1 < (d + 1) * units ? u1 : (d + 1) * units;          \
            const int64_t r0 = (u0 - d * units) * R, re = (ue - d * units) * R, r1 = re < M ? re : M; \
            u0 = ue;                                                                                 \
            const T* pd = P + d * K * M; T* cd = C + d * M * N;                                      \
            const T* qd = qrows ? Q : Q + d * K * N; const int64_t* qr = qrows ? qrows + d * K : 0;  \
            if (K == 0)                                                                              \
                for (int64_t i = r0; i < r1; i++) memset(cd + i * N, 0, sizeof(T) * N);              \
            for (int64_t k0 = 0; k0 < K; k0 += FL_TN_KC) {                                           \
                const int64_t kc = K - k0 < FL_TN_KC ? K - k0 : FL_TN_KC;                            \
                /* (with qr, row k of Q_d is row qr[k] of Q) */                                      \
                fl_gemm_pack_##SUFFIX(kc, N, qr ? qd : qd + k0 * N, N, qr ? qr + k0 : 0, 0, qp, 0,   \
                                      np);                                                           \
                for (int64_t s0 = r0; s0 < r1; s0 += FL_TN_MC) {                                     \
                    const int64_t m = r1 - s0 < FL_TN_MC ? r1 - s0 : FL_TN_MC;                       \
                    const int64_t blocks = (m + R - 1) / R;                                          \
                    /* block q: rows s0 + i .. s0 + i + rows, value (r, k) at ap + q*kc*R + k*R + r */ \
                    for (int64_t q = 0, i = 0; q < blocks; q++) {                                    \
                        const int64_t rows = m / blocks + (q < m % blocks);                          \
                        const T* src = pd + k0 * M + s0 + i; T* dst = ap + q * kc * R;               \
                        if (rows == R) /* one vector move per k */                                   \
                            for (int64_t k = 0; k < kc; k++)                                         \
                                memcpy(dst + k * R, src + k * M, sizeof(T) * R);                     \
                        else                                                                         \
                            for (int64_t k = 0; k < kc; k++)                                         \
                                for (int64_t r = 0; r < rows; r++) dst[k * R + r] = src[k * M + r];  \
                        i += rows;                                                                   \
                    }                                                                                \
                    for (int64_t q = 0, i = 0; q < blocks; q++) {                                    \
                        const int64_t rows = m / blocks + (q < m % blocks);                          \
                        for (int64_t p = 0; p < np; p++)                                             \
                            fl_gemm_rows_##SUFFIX(rows, kc, ap + q * kc * R, 1, R, qp + p * kc * W,  \
                                                  cd + (s0 + i) * N + p * W, N, k0 > 0,              \
                                                  N - p * W < W ? N - p * W : W);                    \
                        i += rows;                                                                   \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

FL_DEFINE_MATMUL_TN(float, f32)
FL_DEFINE_MATMUL_TN(double, f64)
