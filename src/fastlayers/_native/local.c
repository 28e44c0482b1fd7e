/* Locally connected 2-D layer (convolution with one filter per output location), CPU kernels.
 *
 * Legend: B batch, C input channels, O output channels, Hp x Wp padded input, KH x KW kernel,
 * OH x OW output, sh/sw stride, dh/dw dilation. All arrays are contiguous, row-major:
 *   x:    [B, C, Hp, Wp]           input, already zero-padded
 *   w:    [O, C, KH, KW, OH, OW]   one filter per output location
 *   bias: [O, OH, OW] or NULL
 *   y:    [B, O, OH, OW]
 *   xoff: [C*KH*KW] int64 work space of the caller (the kernels' table of input row offsets; no
 *         stack array: its size has no bound, and one overflowed the stack from about a million)
 * y[b,o,i,j] = bias[o,i,j] + sum_{c,p,q} w[o,c,p,q,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]
 *
 * Work is split by blocks of output rows i, so that no two threads write the same element and
 * every sum runs in a fixed order (results do not depend on the thread count). For stride 1 along
 * j, output rows are computed in register tiles of four vectors (32 floats) for two output
 * channels at once, which share every x vector loaded: the forward sums the C*KH*KW (filter,
 * input) row pairs into the tiles and writes y once; the parameter gradient takes one input plane
 * at a time and sums BB sequences into the tiles before touching dW. The columns left of the last
 * whole tile go one vector at a time (all of them where OW < 32: a 28 x 28 image at stride 1 would
 * otherwise run every product scalar), the last few columns and other strides scalar; every column
 * sums in the same order.
 *
 * Against one channel per tile and all C*KH*KW planes of BB sequences at once in the gradient,
 * on the seed-003 shape (benchmarks/local/bench_local_kernels.py --against REV, side by side): forward
 * ~17% and parameter gradient ~20% faster for 1x1, within ~5% for 3x3. Taking one plane at a time
 * keeps few streams in flight, each a whole block of rows long.
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
/* four consecutive vectors a0..a3 (a tile of 4*VL elements) from / to p (unaligned) */
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

/* Number of blocks of output rows: each block's filter rows (row_bytes per output row) fill about
 * 96 KiB of L2, and the count is a multiple of nthreads so that with block blk covering rows
 * [OH*blk/blocks, OH*(blk+1)/blocks) and a static schedule every thread gets the same number of
 * rows (+-1) in one contiguous run. */
static int64_t row_blocks(int64_t row_bytes, int64_t OH, int nthreads) {
    int64_t rows = row_bytes > 0 ? (int64_t)(96 * 1024) / row_bytes : OH;  /* (no bytes: no channel) */
    if (rows < 1) rows = 1;
    int64_t blocks = (OH + rows - 1) / rows;
    blocks = (blocks + nthreads - 1) / nthreads * nthreads;
    return blocks < OH ? blocks : OH;
}

/* off[k] for k = (c*KH + p)*KW + q: where input row p, column q of channel c starts relative to
 * the row of output row i (x + (b*C*Hp + i*sh)*Wp) */
static void input_offsets(int64_t* off, int64_t C, int64_t KH, int64_t KW, int64_t Hp, int64_t Wp,
                          int64_t dh, int64_t dw) {
    int64_t k = 0;
    for (int64_t c = 0; c < C; c++)
        for (int64_t p = 0; p < KH; p++)
            for (int64_t q = 0; q < KW; q++)
                off[k++] = (c * Hp + p * dh) * Wp + q * dw;
}

#define DEFINE_KERNELS(T, SUFFIX)                                                                    \
/* One task per block of output rows: the filters of the block (O*C*KH*KW*rows rows of OW values, \
 * sized to stay in L2) are reused by the whole batch, and each input plane is read in contiguous   \
 * runs of `rows` rows, so x is read once and y written once. Output channels go in pairs (o0, o1) \
 * whose tiles share every x vector loaded; an odd last channel pairs with itself (o1 = o0) and is  \
 * stored once. */                                                                                 \
void lc2d_forward_##SUFFIX(const T* restrict x, const T* restrict w, const T* restrict bias,       \
                           T* restrict y, int64_t B, int64_t C,                                    \
                           int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW, int64_t OH,  \
                           int64_t OW, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int nthreads, \
                           int64_t* restrict xoff)                                                 \
{                                                                                                  \
    const int64_t K = C * KH * KW, OHW = OH * OW;                                                  \
    input_offsets(xoff, C, KH, KW, Hp, Wp, dh, dw);                                                \
    const int64_t blocks = row_blocks((int64_t)sizeof(T) * O * K * OW, OH, nthreads);             \
    /* stream y when it is large and every vector row start is 32-byte aligned */                 \
    const int stream = CAN_STREAM && (int64_t)sizeof(T) * B * O * OH * OW >= STREAM_MIN_BYTES    \
                       && (uintptr_t)y % 32 == 0 && ((int64_t)sizeof(T) * OW) % 32 == 0;          \
    _Pragma("omp parallel num_threads(nthreads)")                                                \
    {                                                                                              \
    _Pragma("omp for schedule(static)")                                                           \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                   \
        const int64_t i0 = OH * blk / blocks, i1 = OH * (blk + 1) / blocks;                       \
        for (int64_t b = 0; b < B; b++)                                                            \
        for (int64_t i = i0; i < i1; i++) {                                                        \
            const T* xb = x + (b * C * Hp + i * sh) * Wp; /* + xoff[k]: input row of pair k */     \
            T* yb = y + (b * O * OH + i) * OW;            /* + o * OHW: output row of channel o */ \
            int64_t j = 0;                                                                         \
            if (sw == 1)                                                                           \
                for (; j + 4 * VL_##SUFFIX <= OW; j += 4 * VL_##SUFFIX)                            \
                    for (int64_t o0 = 0; o0 < O; o0 += 2) {                                        \
                        const int64_t o1 = o0 + 1 < O ? o0 + 1 : o0;                               \
                        V_##SUFFIX a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                         \
                        V_##SUFFIX c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};                         \
                        if (bias) {                                                                \
                            LOAD4(a0, a1, a2, a3, bias + (o0 * OH + i) * OW + j, VL_##SUFFIX);     \
                            LOAD4(c0, c1, c2, c3, bias + (o1 * OH + i) * OW + j, VL_##SUFFIX);     \
                        }                                                                          \
                        const T* w0 = w + (o0 * K * OH + i) * OW + j;                              \
                        const T* w1 = w + (o1 * K * OH + i) * OW + j;                              \
                        for (int64_t k = 0; k < K; k++) {                                          \
                            V_##SUFFIX x0, x1, x2, x3, u0, u1, u2, u3;                             \
                            LOAD4(x0, x1, x2, x3, xb + xoff[k] + j, VL_##SUFFIX);                  \
                            LOAD4(u0, u1, u2, u3, w0 + k * OHW, VL_##SUFFIX);                      \
                            a0 += u0 * x0; a1 += u1 * x1; a2 += u2 * x2; a3 += u3 * x3;             \
                            LOAD4(u0, u1, u2, u3, w1 + k * OHW, VL_##SUFFIX);                      \
                            c0 += u0 * x0; c1 += u1 * x1; c2 += u2 * x2; c3 += u3 * x3;             \
                        }                                                                          \
                        if (stream) {                                                              \
                            STREAM4_##SUFFIX(yb + o0 * OHW + j, a0, a1, a2, a3);                   \
                            if (o1 != o0) STREAM4_##SUFFIX(yb + o1 * OHW + j, c0, c1, c2, c3);     \
                        } else {                                                                   \
                            STORE4(yb + o0 * OHW + j, a0, a1, a2, a3, VL_##SUFFIX);                \
                            if (o1 != o0) STORE4(yb + o1 * OHW + j, c0, c1, c2, c3, VL_##SUFFIX);  \
                        }                                                                          \
                    }                                                                              \
            if (sw == 1) /* then one vector at a time (an output narrower than a tile: OW < 32) */ \
                for (; j + VL_##SUFFIX <= OW; j += VL_##SUFFIX)                                    \
                    for (int64_t o0 = 0; o0 < O; o0 += 2) {                                        \
                        const int64_t o1 = o0 + 1 < O ? o0 + 1 : o0;                               \
                        V_##SUFFIX a = {0}, c = {0}, xv, u;                                        \
                        if (bias) {                                                                \
                            memcpy(&a, bias + (o0 * OH + i) * OW + j, sizeof a);                   \
                            memcpy(&c, bias + (o1 * OH + i) * OW + j, sizeof c);                   \
                        }                                                                          \
                        const T* w0 = w + (o0 * K * OH + i) * OW + j;                              \
                        const T* w1 = w + (o1 * K * OH + i) * OW + j;                              \
                        for (int64_t k = 0; k < K; k++) {                                          \
                            memcpy(&xv, xb + xoff[k] + j, sizeof xv);                              \
                            memcpy(&u, w0 + k * OHW, sizeof u); a += u * xv;                       \
                            memcpy(&u, w1 + k * OHW, sizeof u); c += u * xv;                       \
                        }                                                                          \
                        memcpy(yb + o0 * OHW + j, &a, sizeof a);                                   \
                        if (o1 != o0) memcpy(yb + o1 * OHW + j, &c, sizeof c);                     \
                    }                                                                              \
            for (; j < OW; j++) /* other strides, and the last columns */                          \
                for (int64_t o = 0; o < O; o++) {                                                  \
                    T acc = bias ? bias[(o * OH + i) * OW + j] : 0;                                \
                    for (int64_t k = 0; k < K; k++)                                                \
                        acc += w[((o * K + k) * OH + i) * OW + j] * xb[xoff[k] + j * sw];          \
                    yb[o * OHW + j] = acc;                                                         \
                }                                                                                  \
        }                                                                                          \
    }                                                                                              \
    if (stream) STREAM_FENCE(); /* order this thread's streaming stores before the join */        \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* dx[b,c,i*sh+p*dh,j*sw+q*dw] += sum_o dy[b,o,i,j] * w[o,c,p,q,i,j]; dx: [B, C, Hp, Wp], zeroed.  \
 * One task per input channel c and chunk of sequences (as few chunks as give every thread about   \
 * four tasks; with 1x1 filters one sequence), in blocks of output rows whose filter rows (for c)  \
 * stay in L2 while each sequence of the chunk streams through the block: a filter row comes from  \
 * memory once per chunk, not once per sequence. Each input-row segment takes its O terms in       \
 * registers (tiles of four vectors, then single vectors, then scalars), read and written once     \
 * instead of once per output channel; every element adds its terms in the order (i, p, q, o),     \
 * whatever the thread count. */                                                                   \
void lc2d_backward_input_##SUFFIX(const T* restrict dy, const T* restrict w, T* restrict dx, int64_t B, int64_t C,           \
                                  int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW,       \
                                  int64_t OH, int64_t OW, int64_t sh, int64_t sw, int64_t dh,      \
                                  int64_t dw, int nthreads)                                        \
{                                                                                                  \
    const int64_t OHW = OH * OW, ws = C * KH * KW * OHW; /* the strides of o in dy and w */       \
    /* a 1x1 filter row is no larger than the gradient row it meets: there one task per (b, c),     \
     * b-major, so that consecutive tasks of a thread read the same dy[b] */                      \
    const int per_sequence = KH * KW == 1;                                                         \
    int64_t chunks = per_sequence ? B : C > 0 ? (4 * (int64_t)nthreads + C - 1) / C : 1;           \
    if (chunks > B) chunks = B > 0 ? B : 1;                                                        \
    /* blocks of output rows whose filter rows (for one c) stay in L2 while a chunk streams through */ \
    const int64_t row_bytes = (int64_t)sizeof(T) * O * KH * KW * OW;                              \
    int64_t rows = row_bytes > 0 ? (int64_t)(256 * 1024) / row_bytes : OH;                         \
    if (rows < 1) rows = 1;                                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t task = 0; task < C * chunks; task++) {                                            \
        const int64_t c = per_sequence ? task % C : task / chunks;                                 \
        const int64_t chunk = per_sequence ? task / C : task % chunks;                             \
        const int64_t b0 = B * chunk / chunks, b1 = B * (chunk + 1) / chunks;                      \
        for (int64_t i0 = 0; i0 < OH; i0 += rows)                                                  \
        for (int64_t b = b0; b < b1; b++)                                                          \
        for (int64_t i = i0; i < i0 + rows && i < OH; i++)                                         \
            for (int64_t p = 0; p < KH; p++)                                                       \
                for (int64_t q = 0; q < KW; q++) {                                                 \
                    T* dxr = dx + ((b * C + c) * Hp + i * sh + p * dh) * Wp + q * dw;              \
                    const T* dyr = dy + (b * O * OH + i) * OW;           /* + o * OHW */          \
                    const T* wr = w + (((c * KH + p) * KW + q) * OH + i) * OW; /* + o * ws */      \
                    int64_t j = 0;                                                                 \
                    if (sw == 1) {                                                                 \
                        for (; j + 4 * VL_##SUFFIX <= OW; j += 4 * VL_##SUFFIX) {                  \
                            V_##SUFFIX a0, a1, a2, a3, d0, d1, d2, d3, u0, u1, u2, u3;             \
                            LOAD4(a0, a1, a2, a3, dxr + j, VL_##SUFFIX);                           \
                            for (int64_t o = 0; o < O; o++) {                                      \
                                LOAD4(d0, d1, d2, d3, dyr + o * OHW + j, VL_##SUFFIX);             \
                                LOAD4(u0, u1, u2, u3, wr + o * ws + j, VL_##SUFFIX);               \
                                a0 += d0 * u0; a1 += d1 * u1; a2 += d2 * u2; a3 += d3 * u3;         \
                            }                                                                      \
                            STORE4(dxr + j, a0, a1, a2, a3, VL_##SUFFIX);                          \
                        }                                                                          \
                        for (; j + VL_##SUFFIX <= OW; j += VL_##SUFFIX) {                          \
                            V_##SUFFIX a, d, u;                                                    \
                            memcpy(&a, dxr + j, sizeof a);                                         \
                            for (int64_t o = 0; o < O; o++) {                                      \
                                memcpy(&d, dyr + o * OHW + j, sizeof d);                           \
                                memcpy(&u, wr + o * ws + j, sizeof u);                             \
                                a += d * u;                                                        \
                            }                                                                      \
                            memcpy(dxr + j, &a, sizeof a);                                         \
                        }                                                                          \
                    }                                                                              \
                    for (; j < OW; j++) {                                                          \
                        T acc = dxr[j * sw];                                                       \
                        for (int64_t o = 0; o < O; o++) acc += dyr[o * OHW + j] * wr[o * ws + j];  \
                        dxr[j * sw] = acc;                                                         \
                    }                                                                              \
                }                                                                                  \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* dw[o,c,p,q,i,j] = sum_b dy[b,o,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]; db[o,i,j] = sum_b dy[b,o,i,j] \
 * (either may be NULL); both fully written here. Blocks of output rows as in the forward: the     \
 * gradient rows of a block stay in L2 while the batch streams through, BB sequences per sweep.    \
 * Within a sweep one input plane at a time (k = -1: the bias), for a pair of output channels     \
 * (o0, o1) whose tiles share the x vectors: few concurrent streams, each a run of `rows` rows. */ \
void lc2d_backward_params_##SUFFIX(const T* restrict dy, const T* restrict x, T* restrict dw_,     \
                                   T* restrict db, int64_t B, int64_t C,                           \
                                   int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW,      \
                                   int64_t OH, int64_t OW, int64_t sh, int64_t sw, int64_t dh,     \
                                   int64_t dw, int nthreads, int64_t* restrict xoff)               \
{                                                                                                  \
    const int64_t K = C * KH * KW;                                                                 \
    if (B == 0) { /* no sequences: empty sums, zero gradients */                                   \
        if (dw_) memset(dw_, 0, sizeof(T) * O * K * OH * OW);                                      \
        if (db) memset(db, 0, sizeof(T) * O * OH * OW);                                            \
        return;                                                                                    \
    }                                                                                              \
    input_offsets(xoff, C, KH, KW, Hp, Wp, dh, dw);                                                \
    const int64_t blocks = row_blocks((int64_t)sizeof(T) * O * (K + 1) * OW, OH, nthreads);       \
    const int64_t dys = O * OH * OW, xs = C * Hp * Wp; /* sequence strides */                      \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                   \
        const int64_t i0 = OH * blk / blocks, i1 = OH * (blk + 1) / blocks;                       \
        for (int64_t b0 = 0; b0 < B; b0 += BB) /* BB sequences per sweep: few pages at a time */  \
        for (int64_t o0 = 0; o0 < O; o0 += 2)                                                      \
        for (int64_t k = -1; k < K; k++) {                                                         \
            if (k < 0 ? !db : !dw_) continue;                                                      \
            const int64_t o1 = o0 + 1 < O ? o0 + 1 : o0;                                           \
            const int64_t b1 = b0 + BB < B ? b0 + BB : B;                                          \
            for (int64_t i = i0; i < i1; i++) {                                                    \
                T* restrict out0 = k < 0 ? db + (o0 * OH + i) * OW : dw_ + ((o0 * K + k) * OH + i) * OW; \
                T* restrict out1 = k < 0 ? db + (o1 * OH + i) * OW : dw_ + ((o1 * K + k) * OH + i) * OW; \
                const T* dy0 = dy + b0 * dys + (o0 * OH + i) * OW;                                 \
                const T* dy1 = dy + b0 * dys + (o1 * OH + i) * OW;                                 \
                const T* x0 = x + b0 * xs + i * sh * Wp + (k < 0 ? 0 : xoff[k]); /* unread for k < 0 */ \
                int64_t j = 0;                                                                     \
                if (sw == 1)                                                                       \
                    for (; j + 4 * VL_##SUFFIX <= OW; j += 4 * VL_##SUFFIX) {                      \
                        V_##SUFFIX a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                         \
                        V_##SUFFIX c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};                         \
                        if (b0) {                                                                  \
                            LOAD4(a0, a1, a2, a3, out0 + j, VL_##SUFFIX);                          \
                            LOAD4(c0, c1, c2, c3, out1 + j, VL_##SUFFIX);                          \
                        }                                                                          \
                        for (int64_t b = 0; b < b1 - b0; b++) {                                    \
                            V_##SUFFIX x0v = (V_##SUFFIX){0} + 1, x1v = x0v, x2v = x0v, x3v = x0v, d0, d1, d2, d3; /* bias: x = 1 */ \
                            if (k >= 0) LOAD4(x0v, x1v, x2v, x3v, x0 + b * xs + j, VL_##SUFFIX);   \
                            LOAD4(d0, d1, d2, d3, dy0 + b * dys + j, VL_##SUFFIX);                 \
                            a0 += d0 * x0v; a1 += d1 * x1v; a2 += d2 * x2v; a3 += d3 * x3v;         \
                            LOAD4(d0, d1, d2, d3, dy1 + b * dys + j, VL_##SUFFIX);                 \
                            c0 += d0 * x0v; c1 += d1 * x1v; c2 += d2 * x2v; c3 += d3 * x3v;         \
                        }                                                                          \
                        STORE4(out0 + j, a0, a1, a2, a3, VL_##SUFFIX);                             \
                        if (o1 != o0) STORE4(out1 + j, c0, c1, c2, c3, VL_##SUFFIX);               \
                    }                                                                              \
                if (sw == 1) /* then one vector at a time */                                       \
                    for (; j + VL_##SUFFIX <= OW; j += VL_##SUFFIX) {                              \
                        V_##SUFFIX a = {0}, c = {0}, xv = (V_##SUFFIX){0} + 1, d; /* bias: x = 1 */ \
                        if (b0) { memcpy(&a, out0 + j, sizeof a); memcpy(&c, out1 + j, sizeof c); } \
                        for (int64_t b = 0; b < b1 - b0; b++) {                                    \
                            if (k >= 0) memcpy(&xv, x0 + b * xs + j, sizeof xv);                   \
                            memcpy(&d, dy0 + b * dys + j, sizeof d); a += d * xv;                  \
                            memcpy(&d, dy1 + b * dys + j, sizeof d); c += d * xv;                  \
                        }                                                                          \
                        memcpy(out0 + j, &a, sizeof a);                                            \
                        if (o1 != o0) memcpy(out1 + j, &c, sizeof c);                              \
                    }                                                                              \
                for (; j < OW; j++) {                                                              \
                    T acc0 = b0 ? out0[j] : 0, acc1 = b0 ? out1[j] : 0;                            \
                    for (int64_t b = 0; b < b1 - b0; b++) {                                        \
                        const T xv = k < 0 ? (T)1 : x0[b * xs + j * sw];                           \
                        acc0 += dy0[b * dys + j] * xv; acc1 += dy1[b * dys + j] * xv;              \
                    }                                                                              \
                    out0[j] = acc0;                                                                \
                    if (o1 != o0) out1[j] = acc1;                                                  \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(double, f64)
