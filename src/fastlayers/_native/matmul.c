/* The recurrent layers' large products on gemm.h's kernel: the input projection (xp = X W_ih^T + b)
 * and its input gradient (dX = dpre W_ih), D directions at once.
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
 *   rows[d*M + i] of A (the packing's gather done block by block in cache: the C++ operators'
 *   padded input, never copied whole); B_d at B + d*K*N, bias_d at bias + d*N (bias may be NULL),
 *   C_d at C + d*M*N, every matrix contiguous. Bp: work space of D * panels(N) * K * W values
 *   (fl_gemm_panels, W = the panel width: at most D * K * N rounded up to 32 columns); scratch
 *   (with rows only): nthreads * fl_matmul_scratch_rows() * K values.
 * The threads pack B's panels (a share each), then take a share of the (direction, block of
 * FL_MATMUL_MC rows) items: a thread keeps one direction's packed B while it can, and each block's
 * rows stay in L2 while gemm.h's k blocks stream the panels past them.
 */
#include <omp.h>
#include <string.h>

#include "gemm.h"

#define FL_MATMUL_MIN_ROWS 1024

static int fl_matmul_choice = -1; /* -1: by the CPU; 0: torch's BLAS; 1: this file's kernel */

void fl_matmul_prefer(int choice) { fl_matmul_choice = choice; }

/* whether a product of `rows` rows (per direction) runs here: forced, or on an AMD CPU from
 * FL_MATMUL_MIN_ROWS rows (below, packing the weight costs more than the kernel gains: at K = 512,
 * N = 1024 it was 1.59x torch's time at 32 rows, 1.04x at 512, 0.92x at 2048; Zen 4, 2 threads) */
int fl_matmul_preferred(int64_t rows)
{
    if (fl_matmul_choice >= 0) return fl_matmul_choice;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX2__)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && rows >= FL_MATMUL_MIN_ROWS ? 1 : 0;
#else
    return 0; /* the default variant (no AVX2) and other architectures: not measured */
#endif
}

#define FL_MATMUL_MC 96 /* rows per item: a multiple of both micro-kernel heights (6, 8) */
int64_t fl_matmul_scratch_rows(void) { return FL_MATMUL_MC; }

#define FL_DEFINE_MATMUL(T, SUFFIX)                                                                  \
void fl_matmul_##SUFFIX(int64_t D, int64_t M, int64_t K, int64_t N, const T* A, const int64_t* rows,  \
                        const T* B, int trans_b, const T* bias, T* C, T* Bp, T* scratch, int nthreads) \
{                                                                                                    \
    const int64_t W = FL_W_##SUFFIX, np = fl_gemm_panels_##SUFFIX(N);                               \
    const int64_t blocks = (M + FL_MATMUL_MC - 1) / FL_MATMUL_MC;                                   \
    _Pragma("omp parallel num_threads(nthreads)")                                                    \
    {                                                                                                \
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                           \
        int64_t q0, q1;                                                                              \
        fl_share(D * np, tid, nt, &q0, &q1);                                                         \
        for (int64_t q = q0; q < q1; q++) {                                                          \
            const int64_t d = q / np, p = q % np;                                                    \
            fl_gemm_pack_##SUFFIX(K, N, B + d * K * N, trans_b ? K : N, trans_b, Bp + d * np * K * W, p,  \
                                  p + 1);                                                            \
        }                                                                                            \
        _Pragma("omp barrier")                                                                       \
        fl_share(D * blocks, tid, nt, &q0, &q1);                                                     \
        for (int64_t q = q0; q < q1; q++) {                                                          \
            const int64_t d = q / blocks, i = (q % blocks) * FL_MATMUL_MC;                           \
            const int64_t m = M - i < FL_MATMUL_MC ? M - i : FL_MATMUL_MC;                           \
            T* c = C + (d * M + i) * N;                                                              \
            const T* a = A + (d * M + i) * K;                                                        \
            if (rows) { /* the block's rows of A gathered into this thread's scratch (stays in L2) */ \
                T* s = scratch + tid * FL_MATMUL_MC * K;                                             \
                for (int64_t r = 0; r < m; r++) memcpy(s + r * K, A + rows[d * M + i + r] * K, sizeof(T) * K); \
                a = s;                                                                               \
            }                                                                                        \
            if (bias)                                                                                \
                for (int64_t r = 0; r < m; r++) memcpy(c + r * N, bias + d * N, sizeof(T) * N);      \
            fl_gemm_##SUFFIX(m, 0, np, K, N, a, K, Bp + d * np * K * W, c, N, bias != 0);             \
        }                                                                                            \
    }                                                                                                \
}

FL_DEFINE_MATMUL(float, f32)
FL_DEFINE_MATMUL(double, f64)
