/* attnkit native kernels: fp8 bytes (e4m3fn, e5m2) as float32 in registers, for the kernels
 * that read fp8 pages in place (flash.c, decode.c).
 *
 * Each byte becomes an exact float16 bit pattern, then float32 by vcvtph2ps (AVX-512, or F16C
 * with AVX2): an e5m2 byte is the high byte of a float16; an e4m3 byte b is the float16
 * (b & 0x80) << 8 | (b & 0x7f) << 7, whose value is b's times 2^-8 (the caller puts the 2^8 on
 * the descale: AK_FP8_UNIT), and its NaN (b & 0x7f == 0x7f) becomes a float16 NaN. e5m2's
 * infinities and NaNs are float16's. Needs AVX2 (the include's user has it: AVX-512 or AVX2).
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

#endif
