/* bfloat16 rounding shared by the C kernels: fastmath.h's step loops (fl_round_bf16_SUFFIX: the
 * mixed-precision rule's bf16 operands, held in float32) and gemm_bf16.h's packing (fl_bf16_bits:
 * the bf16 values themselves). One rounding: to nearest, ties to even, as torch's float ->
 * bfloat16. */
#ifndef FASTLAYERS_BF16_H
#define FASTLAYERS_BF16_H
#include <stdint.h>
#include <string.h>

/* the bfloat16 nearest a finite float32 of bits u (ties to even, as torch's float -> bfloat16): the
 * bits above the 16 low ones after adding 0x7FFF + the lowest kept bit; fl_bf16_special(u): inf or
 * NaN, which its callers keep as they are */
static inline uint32_t fl_bf16_round_bits(uint32_t u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }
static inline int fl_bf16_special(uint32_t u) { return (u & 0x7F800000u) == 0x7F800000u; }
/* v rounded to the nearest bfloat16 in place (inf stays inf, NaN stays NaN) */
static inline void fl_round_bf16_f32(float* v, int64_t len)
{
    for (int64_t k = 0; k < len; k++) {
        uint32_t u;
        memcpy(&u, v + k, sizeof u);
        const uint32_t r = fl_bf16_round_bits(u) << 16;
        u = fl_bf16_special(u) ? u : r;
        memcpy(v + k, &u, sizeof u);
    }
}
/* the bits of the bfloat16 nearest v (as fl_round_bf16_f32; a NaN stays a NaN, its payload's high
 * bits kept) */
static inline uint16_t fl_bf16_bits(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if (fl_bf16_special(u)) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0));
    return (uint16_t)fl_bf16_round_bits(u);
}
static inline void fl_round_bf16_f64(double* v, int64_t len) /* not called: float32 loops only */
{
    for (int64_t k = 0; k < len; k++) {
        float f = (float)v[k];
        fl_round_bf16_f32(&f, 1);
        v[k] = f;
    }
}
#endif
