/* attnkit native kernels: fp8 bytes (e4m3fn, e5m2) as float32 in registers, for the kernels
 * that read fp8 pages in place (flash.c, decode.c).
 *
 * Each byte becomes an exact float16 bit pattern, then float32 by vcvtph2ps (AVX-512, or F16C
 * with AVX2): an e5m2 byte is the high byte of a float16; an e4m3 byte b is the float16
 * (b & 0x80) << 8 | (b & 0x7f) << 7, whose value is b's times 2^-8 (the caller puts the 2^8 on
 * the descale: AK_FP8_UNIT), and its NaN (b & 0x7f == 0x7f) becomes a float16 NaN. e5m2's
 * infinities and NaNs are float16's. Needs AVX2 (the include's user has it: AVX-512 or AVX2).
 * Also the e4m3 NaN look that lets decode.c convert bytes known to be finite in fewer steps.
 */
#ifndef ATTNKIT_FP8_H
#define ATTNKIT_FP8_H

#include <immintrin.h>
#include <stdint.h>

#include "attnkit.h"

/* what a converted element is worth before its descale: 2^8 for e4m3, 1 for e5m2 */
#define AK_FP8_UNIT(fmt) ((fmt) == AK_E4M3 ? 256.0f : 1.0f)

/* 16 fp8 bytes, each already the high byte of its 16-bit lane (w), as the float16 patterns
 * above: e5m2 as it is; e4m3 by an arithmetic shift that puts the sign in bits 15 and 14 and
 * the rest below (bit 14 then cleared), its NaN bytes to a float16 NaN */
static inline __m256i ak_fp8_high_to_half16(__m256i w, int fmt) {
    if (fmt == AK_E5M2) return w;
    const __m256i h =
        _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBFFF));
    /* w + w keeps the byte's low 7 bits alone: all ones iff NaN */
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_add_epi16(w, w),
                                           _mm256_set1_epi16((short)0xFE00));
    return _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
}

/* 16 fp8 bytes at p as the float16 patterns above, in order */
static inline __m256i ak_fp8_half16(const uint8_t *p, int fmt) {
    const __m256i w = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p)), 8);
    return ak_fp8_high_to_half16(w, fmt);
}

#define AK_FP8_FN static inline __attribute__((always_inline))

/* 16 fp8 bytes at p, byte i the high byte of 16-bit lane i: one 16-byte broadcast and a byte
 * shuffle within each half (ak_fp8_half16's widening crosses the register's halves: three
 * cycles on one pipe in llvm-mca's Zen 3 model) */
AK_FP8_FN __m256i ak_fp8_high16(const uint8_t *p) {
    const __m256i b =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m256i high = _mm256_setr_epi8(-1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7,
                                          -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14,
                                          -1, 15);
    return _mm256_shuffle_epi8(b, high);
}

/* ak_fp8_high_to_half16 of e4m3 bytes known to hold no NaN: without the NaN step */
AK_FP8_FN __m256i ak_e4m3_finite_half16(__m256i w) {
    return _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBFFF));
}

/* 1 where one of the n rows p + t * stride (`bytes` e4m3 bytes each, a multiple of 16) holds a
 * NaN byte (0x7f, 0xff), else 0: the bytewise maximum of the bytes without their signs, two
 * instructions for 32 bytes, and one compare at the end */
AK_FP8_FN __m256i ak_e4m3_look32(__m256i mx, const uint8_t *p) {
    return _mm256_max_epu8(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)p),
                                                _mm256_set1_epi8(0x7f)));
}

AK_FP8_FN int ak_e4m3_nan(const uint8_t *p, int64_t stride, int64_t n, int64_t bytes) {
    __m256i mx[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                     _mm256_setzero_si256()}; /* (four chains of maxima: one is a latency) */
    for (int64_t t = 0; t < n; ++t) {
        const uint8_t *r = p + t * stride;
        int64_t o = 0;
        for (; o + 128 <= bytes; o += 128)
            for (int i = 0; i < 4; ++i) mx[i] = ak_e4m3_look32(mx[i], r + o + 32 * i);
        for (; o + 32 <= bytes; o += 32) mx[0] = ak_e4m3_look32(mx[0], r + o);
        if (o < bytes)
            mx[1] = _mm256_max_epu8(
                mx[1], _mm256_and_si256(_mm256_zextsi128_si256(
                                            _mm_loadu_si128((const __m128i *)(const void *)(r + o))),
                                        _mm256_set1_epi8(0x7f)));
    }
    const __m256i all = _mm256_max_epu8(_mm256_max_epu8(mx[0], mx[1]), _mm256_max_epu8(mx[2], mx[3]));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(all, _mm256_set1_epi8(0x7f))) != 0;
}

#endif
