/* Training masks of the recurrent layers (zoneout keep-masks, recurrent-dropout masks) on CPU, from
 * a counter-based generator: element i of a mask is kept when the top 32 bits of
 * splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15) (Steele, Lea & Flood 2014, the finaliser of
 * Java's SplittableRandom) are below `threshold` (= round(p * 2^32): kept with probability p to
 * 2^-33). One seed per mask, drawn from torch's generator by the caller, so a seeded run draws the
 * same masks; every element is independent of the others, so the threads split the elements
 * (torch.rand's CPU generator runs on one thread: 1.4 ms for a (2, 1600, 128) mask on AMD Zen 4
 * against 0.1 ms here; benchmarks/rnn/probe_page_faults.py, issue 62).
 * fastlayers/rnn/_masks.py has the same function in torch ops (its fallback and the tests' oracle).
 *
 * fl_keep_mask_SUFFIX(n, seed, threshold, out, nthreads): out[i] = 1 if kept, else 0, i < n.
 */
#include <omp.h>
#include <stdint.h>

static inline uint64_t fl_mask_bits(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (z ^ (z >> 31)) >> 32;
}

#define FL_DEFINE_MASK(T, SUFFIX)                                                                      \
void fl_keep_mask_##SUFFIX(int64_t n, uint64_t seed, uint64_t threshold, T* out, int nthreads)        \
{                                                                                                    \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                              \
    for (int64_t i = 0; i < n; i++) out[i] = fl_mask_bits(seed, (uint64_t)i) < threshold ? (T)1 : (T)0; \
}

FL_DEFINE_MASK(float, f32)
FL_DEFINE_MASK(double, f64)
