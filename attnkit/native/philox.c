/* attnkit native Philox-4x32-10 for replayable dropout: the same bits as the torch-op
 * implementation in attnkit/dropout.py (key column j takes word (j / 16) % 4 of the call
 * with counter (16 (j / 64) + j % 16, i, h + b * 2^16, offset) and key (seed mod 2^32,
 * seed / 2^32)), one element per lane: this fills arbitrary index grids; the flash kernel
 * draws a 64-key block with 16 calls instead (flash.c, ak_keep64).
 *
 * The grid is up to 4-D; each of the three index words comes as an int64 array with its own
 * strides over that grid (0 along broadcast dims). Rows of the last dim are copied into small
 * uint32 buffers first so that the ten rounds run 8 or 16 counters at a time. The Python side
 * validates the indices (0 <= word < 2^32) and shapes.
 */
#include "attnkit.h"
#include <stdint.h>

#define PX_BLOCK 256

#if defined(__AVX512F__)
#include <immintrin.h>
/* 8 counters per register, one per 64-bit lane: _mm512_mul_epu32 multiplies the low 32 bits of
 * each lane into a full 64-bit product (hi:lo words), and only ever reads the low 32 bits of
 * its inputs, so the xor-ed words may carry garbage in their upper halves until the end. */
static void philox_block(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2,
                         uint32_t c3, uint32_t k0, uint32_t k1, int64_t n, uint32_t *w) {
    const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m1 = _mm512_set1_epi64(0xCD9E8D57u);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m512i j = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(c0 + t)));
        __m512i x0 = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(j, 6), 4),
                                     _mm512_and_si512(j, _mm512_set1_epi64(15)));
        const __m512i word = _mm512_and_si512(_mm512_srli_epi64(j, 4), _mm512_set1_epi64(3));
        __m512i x1 = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(c1 + t)));
        __m512i x2 = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(c2 + t)));
        __m512i x3 = _mm512_set1_epi64(c3);
        uint32_t key0 = k0, key1 = k1;
        for (int r = 0; r < 10; ++r) {
            const __m512i p0 = _mm512_mul_epu32(x0, m0);
            const __m512i p1 = _mm512_mul_epu32(x2, m1);
            const __m512i n0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), x1,
                                                         _mm512_set1_epi64(key0), 0x96);
            const __m512i n2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), x3,
                                                         _mm512_set1_epi64(key1), 0x96);
            x1 = p1;
            x3 = p0;
            x0 = n0;
            x2 = n2;
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        x0 = _mm512_mask_blend_epi64(_mm512_cmpeq_epi64_mask(word, _mm512_set1_epi64(1)),
                                     x0, x1);
        x0 = _mm512_mask_blend_epi64(_mm512_cmpeq_epi64_mask(word, _mm512_set1_epi64(2)),
                                     x0, x2);
        x0 = _mm512_mask_blend_epi64(_mm512_cmpeq_epi64_mask(word, _mm512_set1_epi64(3)),
                                     x0, x3);
        _mm256_storeu_si256((__m256i *)(w + t), _mm512_cvtepi64_epi32(x0)); /* low words */
    }
    for (; t < n; ++t) { /* the tail, one counter at a time */
        uint32_t x0 = ((c0[t] >> 6) << 4) | (c0[t] & 15), x1 = c1[t], x2 = c2[t], x3 = c3;
        uint32_t key0 = k0, key1 = k1;
        for (int r = 0; r < 10; ++r) {
            const uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
            x0 = (uint32_t)(p1 >> 32) ^ x1 ^ key0;
            x2 = (uint32_t)(p0 >> 32) ^ x3 ^ key1;
            x1 = (uint32_t)p1;
            x3 = (uint32_t)p0;
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        const uint32_t word = (c0[t] >> 4) & 3;
        w[t] = word == 0 ? x0 : word == 1 ? x1 : word == 2 ? x2 : x3;
    }
}
#else
static void philox_block(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2,
                         uint32_t c3, uint32_t k0, uint32_t k1, int64_t n, uint32_t *w) {
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) {
        uint32_t x0 = ((c0[t] >> 6) << 4) | (c0[t] & 15), x1 = c1[t], x2 = c2[t], x3 = c3;
        uint32_t key0 = k0, key1 = k1;
        for (int r = 0; r < 10; ++r) {
            const uint64_t p0 = (uint64_t)0xD2511F53u * x0;
            const uint64_t p1 = (uint64_t)0xCD9E8D57u * x2;
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ x1 ^ key0;
            const uint32_t n2 = (uint32_t)(p0 >> 32) ^ x3 ^ key1;
            x1 = (uint32_t)p1;
            x3 = (uint32_t)p0;
            x0 = n0;
            x2 = n2;
            key0 += 0x9E3779B9u;
            key1 += 0xBB67AE85u;
        }
        const uint32_t word = (c0[t] >> 4) & 3;
        w[t] = word == 0 ? x0 : word == 1 ? x1 : word == 2 ? x2 : x3;
    }
}
#endif

/* one row of n index words (stride 0: broadcast, 1: contiguous) as uint32 */
static void load_words(const int64_t *src, int64_t stride, int64_t n, uint32_t *dst) {
    if (stride == 0) {
        const uint32_t v = (uint32_t)src[0];
        for (int64_t t = 0; t < n; ++t) dst[t] = v;
    } else if (stride == 1) {
        for (int64_t t = 0; t < n; ++t) dst[t] = (uint32_t)src[t];
    } else {
        for (int64_t t = 0; t < n; ++t) dst[t] = (uint32_t)src[t * stride];
    }
}

/* mode 0: out is uint8 (bool), out = (word >> 8) >= threshold
 * mode 1: out is float32, out = (word >> 8) * 2^-24
 * out is contiguous over the grid `shape` (4 dims, leading ones padded with 1). */
void attnkit_philox(const int64_t *c0, const int64_t *s0, const int64_t *c1, const int64_t *s1,
                    const int64_t *c2, const int64_t *s2, const int64_t *shape, uint32_t offset,
                    uint64_t seed, int mode, uint32_t threshold, void *out) {
    const uint32_t k0 = (uint32_t)(seed & 0xFFFFFFFFu), k1 = (uint32_t)(seed >> 32);
    uint32_t b0[PX_BLOCK], b1[PX_BLOCK], b2[PX_BLOCK], w[PX_BLOCK];
    int64_t pos = 0;
    for (int64_t a = 0; a < shape[0]; ++a)
        for (int64_t b = 0; b < shape[1]; ++b)
            for (int64_t c = 0; c < shape[2]; ++c) {
                const int64_t o0 = a * s0[0] + b * s0[1] + c * s0[2];
                const int64_t o1 = a * s1[0] + b * s1[1] + c * s1[2];
                const int64_t o2 = a * s2[0] + b * s2[1] + c * s2[2];
                for (int64_t d0 = 0; d0 < shape[3]; d0 += PX_BLOCK) {
                    const int64_t n = shape[3] - d0 < PX_BLOCK ? shape[3] - d0 : PX_BLOCK;
                    load_words(c0 + o0 + d0 * s0[3], s0[3], n, b0);
                    load_words(c1 + o1 + d0 * s1[3], s1[3], n, b1);
                    load_words(c2 + o2 + d0 * s2[3], s2[3], n, b2);
                    philox_block(b0, b1, b2, offset, k0, k1, n, w);
                    if (mode == 0) {
                        uint8_t *dst = (uint8_t *)out + pos;
                        for (int64_t t = 0; t < n; ++t) dst[t] = (w[t] >> 8) >= threshold;
                    } else {
                        float *dst = (float *)out + pos;
                        for (int64_t t = 0; t < n; ++t)
                            dst[t] = (float)(w[t] >> 8) * (1.0f / 16777216.0f);
                    }
                    pos += n;
                }
            }
}
