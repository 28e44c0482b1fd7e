/* Locally connected 2-D layer (convolution with one filter per output location), CPU kernels.
 *
 * Legend: B batch, C input channels, O output channels, Hp x Wp padded input, KH x KW kernel,
 * OH x OW output, sh/sw stride, dh/dw dilation. All arrays are contiguous, row-major:
 *   x:    [B, C, Hp, Wp]           input, already zero-padded
 *   w:    [O, C, KH, KW, OH, OW]   one filter per output location
 *   bias: [O, OH, OW] or NULL
 *   y:    [B, O, OH, OW]
 * y[b,o,i,j] = bias[o,i,j] + sum_{c,p,q} w[o,c,p,q,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]
 *
 * Work is split by blocks of output rows i, so that no two threads write the same element and
 * every sum runs in a fixed order (results do not depend on the thread count). For stride 1 along
 * j, each output row is computed in register tiles of four vectors (32 floats): the forward sums
 * the C*KH*KW (filter, input) row pairs into the tile and writes y once; the parameter gradient
 * sums BB sequences at a time into the tile before touching dW. Other strides take scalar loops.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* one 32-byte vector of T (GCC/Clang vector extension: AVX on x86-64, NEON pairs on ARM) */
typedef float V_f32 __attribute__((vector_size(32)));
typedef double V_f64 __attribute__((vector_size(32)));
#define VL_f32 8
#define VL_f64 4
#define BB 4 /* sequences per sweep in the parameter-gradient kernel */
/* four consecutive vectors a0..a3 from / to p (unaligned) */
#define LOAD4(a0, a1, a2, a3, p, VL) do { memcpy(&a0, (p), sizeof a0); memcpy(&a1, (p) + (VL), sizeof a1); \
    memcpy(&a2, (p) + 2 * (VL), sizeof a2); memcpy(&a3, (p) + 3 * (VL), sizeof a3); } while (0)
#define STORE4(p, a0, a1, a2, a3, VL) do { memcpy((p), &a0, sizeof a0); memcpy((p) + (VL), &a1, sizeof a1); \
    memcpy((p) + 2 * (VL), &a2, sizeof a2); memcpy((p) + 3 * (VL), &a3, sizeof a3); } while (0)

/* Streaming (non-temporal) stores of four vectors to a 32-byte aligned p: a large output that
 * nobody reads before it leaves the cache is written without first reading its lines (x86 AVX;
 * elsewhere plain stores). STREAM_MIN_BYTES: outputs from this size on use them. */
#define STREAM_MIN_BYTES (8 << 20)
#if defined(__AVX__)
#define STREAM4_f32(p, a0, a1, a2, a3) do { _mm256_stream_ps((p), (__m256)a0); _mm256_stream_ps((p) + 8, (__m256)a1); \
    _mm256_stream_ps((p) + 16, (__m256)a2); _mm256_stream_ps((p) + 24, (__m256)a3); } while (0)
#define STREAM4_f64(p, a0, a1, a2, a3) do { _mm256_stream_pd((p), (__m256d)a0); _mm256_stream_pd((p) + 4, (__m256d)a1); \
    _mm256_stream_pd((p) + 8, (__m256d)a2); _mm256_stream_pd((p) + 12, (__m256d)a3); } while (0)
#define STREAM_FENCE() _mm_sfence()
#define CAN_STREAM 1
#else
#define STREAM4_f32(p, a0, a1, a2, a3) STORE4(p, a0, a1, a2, a3, VL_f32)
#define STREAM4_f64(p, a0, a1, a2, a3) STORE4(p, a0, a1, a2, a3, VL_f64)
#define STREAM_FENCE() do { } while (0)
#define CAN_STREAM 0
#endif

/* Output rows per block: enough that the block's filter rows (row_bytes each) fill ~96 KiB of L2,
 * but at least one block per thread. */
static int64_t rows_per_block(int64_t row_bytes, int64_t OH, int nthreads) {
    int64_t rows = (int64_t)(96 * 1024) / row_bytes;
    if (rows < 1) rows = 1;
    if (rows * nthreads > OH) rows = (OH + nthreads - 1) / nthreads;
    return rows;
}

#define DEFINE_KERNELS(T, SUFFIX)                                                                    \
/* One task per block of output rows: the filters of the block (O*C*KH*KW*rows rows of OW values, \
 * sized to stay in L2) are reused by the whole batch, and each input plane is read in contiguous   \
 * runs of `rows` rows, so x is read once and y written once. */                                    \
void lc2d_forward_##SUFFIX(const T* restrict x, const T* restrict w, const T* restrict bias,       \
                           T* restrict y, int64_t B, int64_t C,                                    \
                           int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW, int64_t OH,  \
                           int64_t OW, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int nthreads) \
{                                                                                                  \
    const int64_t K = C * KH * KW;                                                                 \
    const int64_t rows = rows_per_block((int64_t)sizeof(T) * O * K * OW, OH, nthreads);           \
    const int64_t blocks = (OH + rows - 1) / rows;                                                 \
    /* stream y when it is large and every vector row start is 32-byte aligned */                 \
    const int stream = CAN_STREAM && (int64_t)sizeof(T) * B * O * OH * OW >= STREAM_MIN_BYTES    \
                       && (uintptr_t)y % 32 == 0 && ((int64_t)sizeof(T) * OW) % 32 == 0;          \
    _Pragma("omp parallel num_threads(nthreads)")                                                \
    {                                                                                              \
    _Pragma("omp for schedule(static)")                                                           \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                   \
        const int64_t i0 = blk * rows, i1 = i0 + rows < OH ? i0 + rows : OH;                       \
        for (int64_t b = 0; b < B; b++)                                                            \
        for (int64_t o = 0; o < O; o++)                                                            \
        for (int64_t i = i0; i < i1; i++) {                                                        \
            T* restrict yr = y + ((b * O + o) * OH + i) * OW;                                      \
            const T* restrict brow = bias ? bias + (o * OH + i) * OW : 0;                          \
            int64_t j = 0;                                                                         \
            if (sw == 1) {                                                                         \
                /* row pointers of the K = C*KH*KW (filter, input) pairs of this output row */      \
                const T* wp[K]; const T* xq[K];                                                    \
                int64_t k = 0;                                                                     \
                for (int64_t c = 0; c < C; c++)                                                    \
                    for (int64_t p = 0; p < KH; p++)                                               \
                        for (int64_t q = 0; q < KW; q++, k++) {                                    \
                            wp[k] = w + ((((o * C + c) * KH + p) * KW + q) * OH + i) * OW;         \
                            xq[k] = x + ((b * C + c) * Hp + i * sh + p * dh) * Wp + q * dw;        \
                        }                                                                          \
                for (; j + 4 * VL_##SUFFIX <= OW; j += 4 * VL_##SUFFIX) {                          \
                    V_##SUFFIX a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                             \
                    if (brow) LOAD4(a0, a1, a2, a3, brow + j, VL_##SUFFIX);                        \
                    for (int64_t k2 = 0; k2 < K; k2++) {                                           \
                        const T* wr = wp[k2] + j; const T* xr = xq[k2] + j;                        \
                        V_##SUFFIX w0, w1, w2, w3, x0, x1, x2, x3;                                 \
                        LOAD4(w0, w1, w2, w3, wr, VL_##SUFFIX);                                    \
                        LOAD4(x0, x1, x2, x3, xr, VL_##SUFFIX);                                    \
                        a0 += w0 * x0; a1 += w1 * x1; a2 += w2 * x2; a3 += w3 * x3;                 \
                    }                                                                              \
                    if (stream) STREAM4_##SUFFIX(yr + j, a0, a1, a2, a3);                          \
                    else STORE4(yr + j, a0, a1, a2, a3, VL_##SUFFIX);                              \
                }                                                                                  \
            }                                                                                      \
            for (; j < OW; j++) {                                                                  \
                T acc = brow ? brow[j] : 0;                                                        \
                for (int64_t c = 0; c < C; c++)                                                    \
                    for (int64_t p = 0; p < KH; p++)                                               \
                        for (int64_t q = 0; q < KW; q++)                                           \
                            acc += w[((((o * C + c) * KH + p) * KW + q) * OH + i) * OW + j]        \
                                 * x[((b * C + c) * Hp + i * sh + p * dh) * Wp + q * dw + j * sw]; \
                yr[j] = acc;                                                                       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    if (stream) STREAM_FENCE(); /* order this thread's streaming stores before the join */        \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* dx[b,c,i*sh+p*dh,j*sw+q*dw] += sum_o dy[b,o,i,j] * w[o,c,p,q,i,j]; dx: [B, C, Hp, Wp], zeroed */ \
void lc2d_backward_input_##SUFFIX(const T* restrict dy, const T* restrict w, T* restrict dx, int64_t B, int64_t C,           \
                                  int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW,       \
                                  int64_t OH, int64_t OW, int64_t sh, int64_t sw, int64_t dh,      \
                                  int64_t dw, int nthreads)                                        \
{                                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t task = 0; task < B * C; task++) {                                                 \
        const int64_t b = task / C, c = task % C;                                                  \
        for (int64_t i = 0; i < OH; i++)                                                           \
            for (int64_t p = 0; p < KH; p++) {                                                     \
                T* dxrow = dx + ((b * C + c) * Hp + i * sh + p * dh) * Wp;                         \
                for (int64_t q = 0; q < KW; q++) {                                                 \
                    T* dxr = dxrow + q * dw;                                                       \
                    for (int64_t o = 0; o < O; o++) {                                              \
                        const T* dyr = dy + ((b * O + o) * OH + i) * OW;                           \
                        const T* wr = w + ((((o * C + c) * KH + p) * KW + q) * OH + i) * OW;       \
                        if (sw == 1)                                                               \
                            for (int64_t j = 0; j < OW; j++) dxr[j] += dyr[j] * wr[j];             \
                        else                                                                       \
                            for (int64_t j = 0; j < OW; j++) dxr[j * sw] += dyr[j] * wr[j];        \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* dw[o,c,p,q,i,j] = sum_b dy[b,o,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]; db[o,i,j] = sum_b dy[b,o,i,j] \
 * (either may be NULL); both fully written here. Blocks of output rows as in the forward: the     \
 * gradient rows of a block stay in L2 while the batch streams through. */                         \
void lc2d_backward_params_##SUFFIX(const T* restrict dy, const T* restrict x, T* restrict dw_,     \
                                   T* restrict db, int64_t B, int64_t C,                           \
                                   int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW,      \
                                   int64_t OH, int64_t OW, int64_t sh, int64_t sw, int64_t dh,     \
                                   int64_t dw, int nthreads)                                       \
{                                                                                                  \
    const int64_t rows = rows_per_block((int64_t)sizeof(T) * O * (C * KH * KW + 1) * OW, OH, nthreads); \
    const int64_t blocks = (OH + rows - 1) / rows;                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                   \
        const int64_t i0 = blk * rows, i1 = i0 + rows < OH ? i0 + rows : OH;                       \
        for (int64_t b0 = 0; b0 < B; b0 += BB) /* BB sequences per sweep: few pages at a time */  \
        for (int64_t o = 0; o < O; o++)                                                            \
            for (int64_t i = i0; i < i1; i++)                                                      \
                for (int64_t k = -1; k < C * KH * KW; k++) { /* k = -1: the bias */                \
                    if (k < 0 ? !db : !dw_) continue;                                              \
                    const int64_t c = k < 0 ? 0 : k / (KH * KW), p = k < 0 ? 0 : (k / KW) % KH,    \
                                  q = k < 0 ? 0 : k % KW;                                          \
                    T* restrict out = k < 0 ? db + (o * OH + i) * OW                               \
                                            : dw_ + ((o * C * KH * KW + k) * OH + i) * OW;         \
                    const int64_t dys = O * OH * OW, xs = C * Hp * Wp;                             \
                    const int64_t b1 = b0 + BB < B ? b0 + BB : B;                                  \
                    const T* dy0 = dy + b0 * dys + (o * OH + i) * OW;                              \
                    const T* x0 = x + b0 * xs + (c * Hp + i * sh + p * dh) * Wp + q * dw;          \
                    int64_t j = 0;                                                                 \
                    if (sw == 1)                                                                   \
                        for (; j + 4 * VL_##SUFFIX <= OW; j += 4 * VL_##SUFFIX) {                  \
                            V_##SUFFIX a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                     \
                            if (b0) LOAD4(a0, a1, a2, a3, out + j, VL_##SUFFIX);                   \
                            const T* dyr = dy0 + j; const T* xr = x0 + j;                          \
                            for (int64_t b = b0; b < b1; b++, dyr += dys, xr += xs) {              \
                                V_##SUFFIX d0, d1, d2, d3, x0v, x1v, x2v, x3v;                     \
                                LOAD4(d0, d1, d2, d3, dyr, VL_##SUFFIX);                           \
                                if (k < 0) { a0 += d0; a1 += d1; a2 += d2; a3 += d3; continue; }   \
                                LOAD4(x0v, x1v, x2v, x3v, xr, VL_##SUFFIX);                        \
                                a0 += d0 * x0v; a1 += d1 * x1v; a2 += d2 * x2v; a3 += d3 * x3v;     \
                            }                                                                      \
                            STORE4(out + j, a0, a1, a2, a3, VL_##SUFFIX);                          \
                        }                                                                          \
                    for (; j < OW; j++) {                                                          \
                        T acc = b0 ? out[j] : 0;                                                   \
                        for (int64_t b = 0; b < b1 - b0; b++)                                      \
                            acc += dy0[b * dys + j] * (k < 0 ? (T)1 : x0[b * xs + j * sw]);        \
                        out[j] = acc;                                                              \
                    }                                                                              \
                }                                                                                  \
    }                                                                                              \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(double, f64)
