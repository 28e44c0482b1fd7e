/* The step loops' recurrent products in bfloat16 (lstm.c, gru.c, float32 loops with low = 2): the
 * mixed-precision rule's products (bf16 operands, float32 sums) on AVX512-BF16's VDPBF16PS, where
 * the CPU has it (checked at run time: the avx512 variant runs on CPUs without it too), else not
 * at all (fl_bf16_ok = 0: the loops keep gemm.h's float32 products of the bf16-rounded values).
 *
 * Same results as gemm.h's products of bf16-rounded operands up to the order of the float32 sums
 * (VDPBF16PS adds two products at a time; each product of two bf16 values is exact in float32)
 * and bf16 subnormals read as zero. Twice the multiplies per instruction, and half the weight's
 * bytes: on a Zen 4 the seed's LN-LSTM under bf16 autocast took 0.85-0.88x the fwd+bwd time of the
 * same loops on gemm.h's float32 products (BENCHMARKS.md, the mixed-precision section).
 *
 * Layout: the weight B (K x N) in gemm.h's column panels of W = 32 columns, each as K2 = ceil(K/2)
 * pairs of rows: pair kp holds, per column c, B[2kp, c] and B[2kp + 1, c] side by side (one 32-bit
 * lane: VDPBF16PS's operand), zero past K and N; panel p at Bp + p * K2 * 64 (uint16 values). The
 * left operand A (m x K, float32) is converted per step into rows of 2 * K2 bf16 values (ab: the
 * calling thread's own scratch, fl_bf16_scratch), one 32-bit pair broadcast per row and k pair.
 * The micro-kernel keeps 12 rows x 32 columns of C in registers (24 of the 32 vector registers).
 *
 * Entry points mirror gemm.h's step-loop ones (fl_loop_pack / fl_loop_product /
 * fl_loop_product_add), with the thread's scratch ab. The _f64 names exist so that the type-generic
 * loops compile; fl_bf16_ok_f64 is 0 and they are never called. matmul.c's fl_matmul_bf16 (the
 * large products in bf16) uses the packing (fl_bf16_pack_items: float32 or bf16 weights), the row
 * copy (fl_bf16_copy_rows: bf16 rows, gathered) and fl_bf16_gemm.
 */
#ifndef FASTLAYERS_GEMM_BF16_H
#define FASTLAYERS_GEMM_BF16_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h" /* fl_bf16_bits */
#include "gemm.h"

/* FL_BF16: the bf16 kernels are compiled (the avx512 variant, by a compiler that knows AVX512-BF16
 * and __builtin_cpu_supports("avx512bf16"): GCC 10, clang 12 or newer); else fl_bf16_ok is 0 */
#if defined(__AVX512F__) && ((defined(__clang__) && __clang_major__ >= 12) \
                             || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FL_BF16 1
#else
#define FL_BF16 0
#endif

#define FL_BF16_W 32   /* columns per panel: gemm.h's float32 panel width with AVX-512 */
#define FL_BF16_R 12   /* rows per register tile */
#define FL_BF16_KC 2048 /* k pairs per block: a panel slice of 256 KiB, as gemm.h's FL_GEMM_KC */

/* The threads' scratch for their converted left operands (ok: the bf16 products run; else none):
 * per thread rows of at most K values as bf16 pairs, each thread's share 64-byte aligned
 * (fl_bf16_mine); NULL where the memory is not there (the loops then keep the float32 products) */
static inline int64_t fl_bf16_share(int64_t rows, int64_t K) { return (rows * ((K + 1) / 2) * 2 + 31) / 32 * 32; }
static inline uint16_t* fl_bf16_scratch(int ok, int threads, int64_t rows, int64_t K)
{
    void* p = 0;
    if (!ok || posix_memalign(&p, 64, sizeof(uint16_t) * (size_t)(threads * fl_bf16_share(rows, K)))) return 0;
    return (uint16_t*)p;
}
static inline uint16_t* fl_bf16_mine(uint16_t* scratch, int tid, int64_t rows, int64_t K)
{
    return scratch ? scratch + tid * fl_bf16_share(rows, K) : 0;
}
/* bytes of D packed K x N weights (the loops' split by rows compares them with the L2) */
static inline int64_t fl_bf16_packed_bytes(int64_t D, int64_t K, int64_t N)
{
    return D * ((N + FL_BF16_W - 1) / FL_BF16_W) * ((K + 1) / 2) * 2 * FL_BF16_W * 2;
}

#if FL_BF16
#include <immintrin.h>
_Static_assert(FL_W_f32 == FL_BF16_W, "gemm.h's float32 panels are 32 columns wide with AVX-512");
#define FL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* whether this CPU runs VDPBF16PS (AVX512-BF16), asked once */
static inline int fl_bf16_cpu(void)
{
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    }
    return has;
}
static inline int fl_bf16_ok_f32(int low) { return low == 2 && fl_bf16_cpu(); }

/* panels [p0, p1) of B (K x N, row stride ldb; trans: given as its N x K transpose) into Bp; B
 * float32 values (rounded to bf16 here), or with bf bf16 values (uint16) */
static void fl_bf16_pack(int64_t K, int64_t N, const void* B, int bf, int64_t ldb, int trans, uint16_t* Bp,
                         int64_t p0, int64_t p1)
{
    const int64_t K2 = (K + 1) / 2;
    const float* Bf = (const float*)B;
    const uint16_t* Bh = (const uint16_t*)B;
    for (int64_t p = p0; p < p1; p++) {
        uint16_t* dst = Bp + p * K2 * 2 * FL_BF16_W;
        for (int64_t kp = 0; kp < K2; kp++)
            for (int64_t c = 0; c < FL_BF16_W; c++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t k = 2 * kp + e, j = p * FL_BF16_W + c;
                    const int64_t at = trans ? j * ldb + k : k * ldb + j;
                    dst[(kp * FL_BF16_W + c) * 2 + e] = k >= K || j >= N ? 0 : bf ? Bh[at] : fl_bf16_bits(Bf[at]);
                }
    }
}
/* the share [q0, q1) of the D * np panels (q = d * np + p) of D matrices K x N at w (or with trans
 * their N x K transposes; float32 values, or bf16 with bf) packed into wp (direction d's at
 * wp + d * np * K2 * 64) */
static inline void fl_bf16_pack_items(int64_t q0, int64_t q1, int64_t np, int64_t K, int64_t N, const void* w,
                                      int bf, int trans, void* wp)
{
    for (int64_t q = q0; q < q1; q++)
        fl_bf16_pack(K, N, (const char*)w + (q / np) * K * N * (bf ? 2 : 4), bf, trans ? K : N, trans,
                     (uint16_t*)wp + (q / np) * np * ((K + 1) / 2) * 2 * FL_BF16_W, q % np, q % np + 1);
}

/* rows [0, m) of A (bf16 values; row r at A + (index ? index[r] : r) * K) as rows of 2 * ceil(K / 2)
 * values in ab (the last one 0 where K is odd) */
static inline void fl_bf16_copy_rows(int64_t m, int64_t K, const uint16_t* A, const int64_t* index, uint16_t* ab)
{
    const int64_t K2 = (K + 1) / 2;
    for (int64_t r = 0; r < m; r++) {
        memcpy(ab + r * 2 * K2, A + (index ? index[r] : r) * K, sizeof(uint16_t) * (size_t)K);
        if (K % 2) ab[r * 2 * K2 + K] = 0;
    }
}

/* rows [0, m) of A (row stride lda, K values) as bf16 rows of 2 * ceil(K / 2) values (the last
 * one 0 where K is odd) */
static FL_BF16_TARGET void fl_bf16_rows(int64_t m, int64_t K, const float* A, int64_t lda, uint16_t* ab)
{
    const int64_t K2 = (K + 1) / 2;
    for (int64_t i = 0; i < m; i++) {
        const float* a = A + i * lda;
        uint16_t* o = ab + i * 2 * K2;
        for (int64_t k = 0; k < 2 * K2; k += 16) {
            const int64_t left = K - k;
            const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 out = 2 * K2 - k >= 16 ? 0xFFFF : (__mmask16)((1u << (2 * K2 - k)) - 1);
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, a + k));
            _mm256_mask_storeu_epi16(o + k, out, (__m256i)v);
        }
    }
}

/* rows [0, R) by one panel over the k pairs [0, K2) of its slice: C = (add ? C : 0) + A @ B, the
 * first `cols` columns (A rows of lda2 pairs) */
static inline __attribute__((always_inline)) FL_BF16_TARGET void fl_bf16_tile(
    const int R, int64_t K2, const uint32_t* restrict A, int64_t lda2, const uint16_t* restrict Bp,
    float* restrict C, int64_t ldc, int add, int64_t cols)
{
    __m512 acc0[FL_BF16_R], acc1[FL_BF16_R];
    for (int r = 0; r < R; r++) { acc0[r] = _mm512_setzero_ps(); acc1[r] = _mm512_setzero_ps(); }
    for (int64_t kp = 0; kp < K2; kp++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bp + kp * 2 * FL_BF16_W);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(Bp + kp * 2 * FL_BF16_W + FL_BF16_W);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda2 + kp]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
        }
    }
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    for (int r = 0; r < R; r++) {
        float* c = C + r * ldc;
        if (add) {
            acc0[r] = _mm512_add_ps(acc0[r], _mm512_maskz_loadu_ps(m0, c));
            acc1[r] = _mm512_add_ps(acc1[r], _mm512_maskz_loadu_ps(m1, c + 16));
        }
        _mm512_mask_storeu_ps(c, m0, acc0[r]);
        _mm512_mask_storeu_ps(c + 16, m1, acc1[r]);
    }
}

/* C[i, j] (+)= sum_k A[i, k] * B[k, j] for i < m and the columns of panels [p0, p1): A converted
 * (fl_bf16_rows, 2 * K2 values a row), Bp packed (fl_bf16_pack), C row stride ldc */
static FL_BF16_TARGET void fl_bf16_gemm(int64_t m, int64_t p0, int64_t p1, int64_t K, int64_t N,
                                        const uint16_t* ab, const uint16_t* Bp, float* C, int64_t ldc,
                                        int accumulate)
{
    const int64_t K2 = (K + 1) / 2, blocks = (m + FL_BF16_R - 1) / FL_BF16_R;
    const uint32_t* A = (const uint32_t*)ab;
    for (int64_t k0 = 0; k0 < K2 || k0 == 0; k0 += FL_BF16_KC) {
        const int64_t kc = K2 - k0 < FL_BF16_KC ? K2 - k0 : FL_BF16_KC;
        const int add = accumulate || k0 > 0;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t j = p * FL_BF16_W, cols = N - j < FL_BF16_W ? N - j : FL_BF16_W;
            const uint16_t* bp = Bp + (p * K2 + k0) * 2 * FL_BF16_W;
            for (int64_t q = 0, i = 0; q < blocks; q++) {
                const int64_t rows = m / blocks + (q < m % blocks);
                const uint32_t* a = A + i * K2 + k0;
                float* c = C + i * ldc + j;
                switch (rows) {
#define FL_BF16_CASE(R_) case R_: fl_bf16_tile(R_, kc, a, K2, bp, c, ldc, add, cols); break;
                FL_BF16_CASE(12) FL_BF16_CASE(11) FL_BF16_CASE(10) FL_BF16_CASE(9) FL_BF16_CASE(8)
                FL_BF16_CASE(7) FL_BF16_CASE(6) FL_BF16_CASE(5) FL_BF16_CASE(4) FL_BF16_CASE(3)
                FL_BF16_CASE(2) default: fl_bf16_tile(1, kc, a, K2, bp, c, ldc, add, cols); break;
#undef FL_BF16_CASE
                }
                i += rows;
            }
        }
    }
}

/* gemm.h's fl_loop_pack for the bf16 panels: this thread's share [p0, p1) of the D * np panels
 * (q = d * np + p) of w (D matrices K x N, or with trans their N x K transposes) packed into wp;
 * with the split by rows every thread reads every panel, so it waits for all of them */
static inline void fl_bf16_loop_pack_f32(int by_rows, int tid, int nt, int64_t D, int64_t np, int64_t K,
                                         int64_t N, const float* w, int trans, void* wp, int64_t* p0,
                                         int64_t* p1)
{
    fl_share(D * np, tid, nt, p0, p1);
    fl_bf16_pack_items(*p0, *p1, np, K, N, w, 0, trans, wp);
    if (by_rows) { _Pragma("omp barrier") }
}

/* C_d[rows] = A_d[rows] @ W_d (accumulate 0) or += (1), direction d of D, the rows [lo, hi) of
 * A_d (at A + d*a_ds*K, stride K) and C_d (at C + d*c_ds*N, stride N), panels [p0, p1) of each
 * direction's np (q = d * np + p; all of them: p0 = 0, p1 = D * np) */
static inline void fl_bf16_product(int64_t lo, int64_t hi, int64_t q0, int64_t q1, int64_t D, int64_t np,
                                   int64_t K, int64_t N, const float* A, int64_t a_ds, const void* wp,
                                   float* C, int64_t c_ds, int accumulate, uint16_t* ab)
{
    const int64_t K2 = (K + 1) / 2;
    if (hi <= lo) return;
    for (int64_t d = 0; d < D; d++) {
        const int64_t a0 = q0 > d * np ? q0 - d * np : 0, a1 = q1 < (d + 1) * np ? q1 - d * np : np;
        if (a1 <= a0) continue;
        fl_bf16_rows(hi - lo, K, A + (d * a_ds + lo) * K, K, ab);
        fl_bf16_gemm(hi - lo, a0, a1, K, N, ab, (const uint16_t*)wp + d * np * K2 * 2 * FL_BF16_W,
                     C + (d * c_ds + lo) * N, N, accumulate);
    }
}

/* gemm.h's fl_loop_product in bf16: C_d[:n] = A_d[:n] @ W_d, this thread's rows [lo, hi) by every
 * panel (by_rows), else its panels [p0, p1) for every row, then (sync) a barrier */
static inline void fl_bf16_loop_product_f32(int by_rows, int sync, int64_t lo, int64_t hi, int64_t p0,
                                            int64_t p1, int64_t D, int64_t np, int64_t n, int64_t K,
                                            int64_t N, const float* A, int64_t a_ds, const void* wp,
                                            float* C, int64_t c_ds, uint16_t* ab)
{
    if (by_rows) {
        fl_bf16_product(lo, hi, 0, D * np, D, np, K, N, A, a_ds, wp, C, c_ds, 0, ab);
        return;
    }
    fl_bf16_product(0, n, p0, p1, D, np, K, N, A, a_ds, wp, C, c_ds, 0, ab);
    if (sync) { _Pragma("omp barrier") }
}

/* gemm.h's fl_loop_product_add in bf16: dh_d[:n] += (dr_d[:n] @ W_d) (* mask_d[:n], through g, gs
 * rows of N per direction), split as fl_bf16_loop_product's */
static inline void fl_bf16_loop_product_add_f32(int by_rows, int sync, int64_t lo, int64_t hi, int64_t p0,
                                                int64_t p1, int64_t D, int64_t np, int64_t n, int64_t K,
                                                int64_t N, const float* dr, int64_t dr_ds, const void* wp,
                                                float* dh, int64_t B, const float* mask, float* g,
                                                int64_t gs, uint16_t* ab)
{
    const int64_t r0 = by_rows ? lo : 0, r1 = by_rows ? hi : n;
    const int64_t q0 = by_rows ? 0 : p0, q1 = by_rows ? D * np : p1;
    if (!mask) fl_bf16_product(r0, r1, q0, q1, D, np, K, N, dr, dr_ds, wp, dh, B, 1, ab);
    else {
        fl_bf16_product(r0, r1, q0, q1, D, np, K, N, dr, dr_ds, wp, g, gs, 0, ab);
        for (int64_t q = q0; q < q1; q++) {
            const int64_t d = q / np, j0 = (q % np) * FL_BF16_W, j1 = j0 + FL_BF16_W < N ? j0 + FL_BF16_W : N;
            fl_add_masked_f32(dh, mask, g, B, gs, N, d, r0, r1, j0, j1);
        }
    }
    if (!by_rows && sync) { _Pragma("omp barrier") }
}
#endif

/* Never called (fl_bf16_ok_SUFFIX = 0): the names the type-generic loops compile against, for
 * double, and for float where the variant has no AVX-512 */
#define FL_BF16_STUBS(T, SUFFIX)                                                                     \
static inline int fl_bf16_ok_##SUFFIX(int low) { return low < 0; }                                   \
static inline void fl_bf16_loop_pack_##SUFFIX(int by_rows, int tid, int nt, int64_t D, int64_t np,  \
    int64_t K, int64_t N, const T* w, int trans, void* wp, int64_t* p0, int64_t* p1) { abort(); }    \
static inline void fl_bf16_loop_product_##SUFFIX(int by_rows, int sync, int64_t lo, int64_t hi,      \
    int64_t p0, int64_t p1, int64_t D, int64_t np, int64_t n, int64_t K, int64_t N, const T* A,      \
    int64_t a_ds, const void* wp, T* C, int64_t c_ds, uint16_t* ab) { abort(); }                     \
static inline void fl_bf16_loop_product_add_##SUFFIX(int by_rows, int sync, int64_t lo, int64_t hi,  \
    int64_t p0, int64_t p1, int64_t D, int64_t np, int64_t n, int64_t K, int64_t N, const T* dr,     \
    int64_t dr_ds, const void* wp, T* dh, int64_t B, const T* mask, T* g, int64_t gs, uint16_t* ab)  \
    { abort(); }
FL_BF16_STUBS(double, f64)
#if !FL_BF16
FL_BF16_STUBS(float, f32)
#endif

/* The step loops' products, bf16 (gemm_bf16.h) or float32 (gemm.h), one call each:
 * fl_step_pack_SUFFIX: at a loop's start, inside its parallel region, whether the loop splits a step
 *   by rows (fl_by_rows, with rows allowed, for the weight's packed bytes), and this thread's share
 *   [p0, p1) of the panels of w (D matrices K x N, or with trans their N x K transposes) packed
 *   into wp (bf: in bf16);
 * fl_step_product_SUFFIX / fl_step_product_add_SUFFIX: gemm.h's fl_loop_product /
 *   fl_loop_product_add, in bf16 where the thread has its scratch ab (fl_bf16_mine), else in T. */
#define FL_DEFINE_STEP_PRODUCTS(T, SUFFIX)                                                           \
static inline int fl_step_pack_##SUFFIX(int bf, int rows, int tid, int nt, int64_t D, int64_t B,     \
                                        int64_t K, int64_t N, const T* w, int trans, void* wp,       \
                                        int64_t* p0, int64_t* p1)                                    \
{                                                                                                    \
    const int64_t np = fl_gemm_panels_##SUFFIX(N);                                                   \
    const int64_t bytes = bf ? fl_bf16_packed_bytes(D, K, N) : D * K * np * FL_W_##SUFFIX * (int64_t)sizeof(T); \
    const int by_rows = rows && fl_by_rows(D, B, nt, bytes);                                         \
    if (bf) fl_bf16_loop_pack_##SUFFIX(by_rows, tid, nt, D, np, K, N, w, trans, wp, p0, p1);         \
    else fl_loop_pack_##SUFFIX(by_rows, tid, nt, D, np, K, N, w, trans, (T*)wp, p0, p1);             \
    return by_rows;                                                                                  \
}                                                                                                    \
static inline void fl_step_product_##SUFFIX(uint16_t* ab, int by_rows, int sync, int64_t lo,         \
                                            int64_t hi, int64_t p0, int64_t p1, int64_t D,           \
                                            int64_t np, int64_t n, int64_t K, int64_t N, const T* A, \
                                            int64_t a_ds, const void* wp, T* C, int64_t c_ds)        \
{                                                                                                    \
    if (ab) fl_bf16_loop_product_##SUFFIX(by_rows, sync, lo, hi, p0, p1, D, np, n, K, N, A, a_ds,    \
                                          wp, C, c_ds, ab);                                          \
    else fl_loop_product_##SUFFIX(by_rows, sync, lo, hi, p0, p1, D, np, n, K, N, A, a_ds,            \
                                  (const T*)wp, C, c_ds);                                            \
}                                                                                                    \
static inline void fl_step_product_add_##SUFFIX(uint16_t* ab, int by_rows, int sync, int64_t lo,     \
                                                int64_t hi, int64_t p0, int64_t p1, int64_t D,       \
                                                int64_t np, int64_t n, int64_t K, int64_t N,         \
                                                const T* dr, int64_t dr_ds, const void* wp, T* dh,   \
                                                int64_t B, const T* mask, T* g, int64_t gs)          \
{                                                                                                    \
    if (ab) fl_bf16_loop_product_add_##SUFFIX(by_rows, sync, lo, hi, p0, p1, D, np, n, K, N, dr,     \
                                              dr_ds, wp, dh, B, mask, g, gs, ab);                    \
    else fl_loop_product_add_##SUFFIX(by_rows, sync, lo, hi, p0, p1, D, np, n, K, N, dr, dr_ds,      \
                                      (const T*)wp, dh, B, mask, g, gs);                             \
}
FL_DEFINE_STEP_PRODUCTS(float, f32)
FL_DEFINE_STEP_PRODUCTS(double, f64)
#endif
