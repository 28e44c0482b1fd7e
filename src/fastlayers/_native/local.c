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
 * Work is split so that no two threads write the same element and every sum runs in a fixed
 * order (results do not depend on the thread count). The innermost loop runs along j, contiguous
 * in w, y and (for sw == 1) x, so the compiler vectorises it.
 */
#include <stdint.h>
#include <string.h>

#define DEFINE_KERNELS(T, SUFFIX)                                                                    \
void lc2d_forward_##SUFFIX(const T* x, const T* w, const T* bias, T* y, int64_t B, int64_t C,     \
                           int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW, int64_t OH,  \
                           int64_t OW, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int nthreads) \
{                                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t task = 0; task < B * OH; task++) {                                                \
        const int64_t b = task / OH, i = task % OH;                                                \
        for (int64_t o = 0; o < O; o++) {                                                          \
            T* yr = y + ((b * O + o) * OH + i) * OW;                                               \
            if (bias) memcpy(yr, bias + (o * OH + i) * OW, sizeof(T) * OW);                        \
            else memset(yr, 0, sizeof(T) * OW);                                                    \
            for (int64_t c = 0; c < C; c++)                                                        \
                for (int64_t p = 0; p < KH; p++) {                                                 \
                    const T* xrow = x + ((b * C + c) * Hp + i * sh + p * dh) * Wp;                 \
                    for (int64_t q = 0; q < KW; q++) {                                             \
                        const T* wr = w + ((((o * C + c) * KH + p) * KW + q) * OH + i) * OW;       \
                        const T* xr = xrow + q * dw;                                               \
                        if (sw == 1)                                                               \
                            for (int64_t j = 0; j < OW; j++) yr[j] += wr[j] * xr[j];               \
                        else                                                                       \
                            for (int64_t j = 0; j < OW; j++) yr[j] += wr[j] * xr[j * sw];          \
                    }                                                                              \
                }                                                                                  \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* dx[b,c,i*sh+p*dh,j*sw+q*dw] += sum_o dy[b,o,i,j] * w[o,c,p,q,i,j]; dx: [B, C, Hp, Wp], zeroed */ \
void lc2d_backward_input_##SUFFIX(const T* dy, const T* w, T* dx, int64_t B, int64_t C,           \
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
 * (either may be NULL); both fully written here. */                                               \
void lc2d_backward_params_##SUFFIX(const T* dy, const T* x, T* dw_, T* db, int64_t B, int64_t C, \
                                   int64_t Hp, int64_t Wp, int64_t O, int64_t KH, int64_t KW,      \
                                   int64_t OH, int64_t OW, int64_t sh, int64_t sw, int64_t dh,     \
                                   int64_t dw, int nthreads)                                       \
{                                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                           \
    for (int64_t i = 0; i < OH; i++) {                                                             \
        for (int64_t o = 0; o < O; o++) {                                                          \
            if (db) memset(db + (o * OH + i) * OW, 0, sizeof(T) * OW);                             \
            if (dw_)                                                                               \
                for (int64_t k = 0; k < C * KH * KW; k++)                                          \
                    memset(dw_ + ((o * C * KH * KW + k) * OH + i) * OW, 0, sizeof(T) * OW);        \
        }                                                                                          \
        for (int64_t b = 0; b < B; b++)                                                            \
            for (int64_t o = 0; o < O; o++) {                                                      \
                const T* dyr = dy + ((b * O + o) * OH + i) * OW;                                   \
                if (db) {                                                                          \
                    T* dbr = db + (o * OH + i) * OW;                                               \
                    for (int64_t j = 0; j < OW; j++) dbr[j] += dyr[j];                             \
                }                                                                                  \
                if (!dw_) continue;                                                                \
                for (int64_t c = 0; c < C; c++)                                                    \
                    for (int64_t p = 0; p < KH; p++) {                                             \
                        const T* xrow = x + ((b * C + c) * Hp + i * sh + p * dh) * Wp;             \
                        for (int64_t q = 0; q < KW; q++) {                                         \
                            T* dwr = dw_ + ((((o * C + c) * KH + p) * KW + q) * OH + i) * OW;      \
                            const T* xr = xrow + q * dw;                                           \
                            if (sw == 1)                                                           \
                                for (int64_t j = 0; j < OW; j++) dwr[j] += dyr[j] * xr[j];         \
                            else                                                                   \
                                for (int64_t j = 0; j < OW; j++) dwr[j] += dyr[j] * xr[j * sw];    \
                        }                                                                          \
                    }                                                                              \
            }                                                                                      \
    }                                                                                              \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(double, f64)
