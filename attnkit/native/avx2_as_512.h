/* attnkit native kernels: the AVX-512 intrinsics flash.c uses, on AVX2 + FMA + F16C.
 *
 * flash.c is written once, in AVX-512 intrinsics. On a CPU without AVX-512 (most laptops, AMD
 * before Zen 4, Intel client parts) this header maps each of them to a pair of 256-bit
 * registers: `__m512` becomes two `__m256`, `__m512i` two `__m256i`, and the 16- and 32-bit
 * lane masks stay integers (built from compares with movemask, turned back into lane masks
 * for blends). Only what flash.c uses is here, with the same semantics lane for lane
 * (including NaN handling of max/min, vpmovdw's truncation and scalef on the integral
 * exponents the kernel passes), so both builds give the same bits up to the order of float
 * sums. The AVX512-BF16 paths are not mapped: on such a CPU the kernel takes float32
 * arithmetic for bfloat16 inputs.
 */
#ifndef ATTNKIT_AVX2_AS_512_H
#define ATTNKIT_AVX2_AS_512_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define AK2 static inline __attribute__((always_inline))

typedef struct { __m256 lo, hi; } ak2_ps;
typedef struct { __m256i lo, hi; } ak2_si;

/* the names flash.c spells, bound to this header's functions (defined below under them) */
#define __m512 ak2_ps
#define __m512i ak2_si
#define _mm512_abs_ps ak2_abs_ps
#define _mm512_add_epi32 ak2_add_epi32
#define _mm512_add_epi64 ak2_add_epi64
#define _mm512_add_ps ak2_add_ps
#define _mm512_and_ps ak2_and_ps
#define _mm512_and_si512 ak2_and_si512
#define _mm512_andnot_ps ak2_andnot_ps
#define _mm512_castps_si512 ak2_castps_si512
#define _mm512_castsi256_si512 ak2_castsi256_si512
#define _mm512_castsi512_ps ak2_castsi512_ps
#define _mm512_cmpeq_epi16_mask ak2_cmpeq_epi16_mask
#define _mm512_cmpeq_epi32_mask ak2_cmpeq_epi32_mask
#define _mm512_cmpge_epi32_mask ak2_cmpge_epi32_mask
#define _mm512_cmpge_epu32_mask ak2_cmpge_epu32_mask
#define _mm512_cmplt_epi32_mask ak2_cmplt_epi32_mask
#define _mm512_cvtepi32_epi16 ak2_cvtepi32_epi16
#define _mm512_cvtepi32_ps ak2_cvtepi32_ps
#define _mm512_cvtepi64_epi32 ak2_cvtepi64_epi32
#define _mm512_cvtepu16_epi32 ak2_cvtepu16_epi32
#define _mm512_cvtepu32_epi64 ak2_cvtepu32_epi64
#define _mm512_cvtph_ps ak2_cvtph_ps
#define _mm512_div_ps ak2_div_ps
#define _mm512_fmadd_ps ak2_fmadd_ps
#define _mm512_fnmadd_ps ak2_fnmadd_ps
#define _mm512_loadu_ps ak2_loadu_ps
#define _mm512_loadu_si512 ak2_loadu_si512
#define _mm512_mask_blend_epi32 ak2_mask_blend_epi32
#define _mm512_mask_blend_ps ak2_mask_blend_ps
#define _mm512_maskz_mov_ps ak2_maskz_mov_ps
#define _mm512_maskz_mul_ps ak2_maskz_mul_ps
#define _mm512_max_ps ak2_max_ps
#define _mm512_min_ps ak2_min_ps
#define _mm512_mul_epu32 ak2_mul_epu32
#define _mm512_mul_ps ak2_mul_ps
#define _mm512_or_ps ak2_or_ps
#define _mm512_or_si512 ak2_or_si512
#define _mm512_reduce_add_ps ak2_reduce_add_ps
#define _mm512_reduce_max_ps ak2_reduce_max_ps
#define _mm512_scalef_ps ak2_scalef_ps
#define _mm512_set1_epi16 ak2_set1_epi16
#define _mm512_set1_epi32 ak2_set1_epi32
#define _mm512_set1_epi64 ak2_set1_epi64
#define _mm512_set1_ps ak2_set1_ps
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 ak2_setr_epi32
#undef _mm512_setr_epi64
#define _mm512_setr_epi64 ak2_setr_epi64
#define _mm512_setzero_ps ak2_setzero_ps
#define _mm512_setzero_si512 ak2_setzero_si512
#define _mm512_storeu_ps ak2_storeu_ps
#define _mm512_storeu_si512 ak2_storeu_si512
#define _mm512_sub_ps ak2_sub_ps

AK2 ak2_ps ak2_ps_of(__m256 lo, __m256 hi) { return (ak2_ps){lo, hi}; }
AK2 ak2_si ak2_si_of(__m256i lo, __m256i hi) { return (ak2_si){lo, hi}; }

/* lane masks <-> integers */
AK2 __m256i ak2_lanes8(unsigned k) { /* bit t of k -> all ones in 32-bit lane t */
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)k), bits), bits);
}
AK2 __mmask16 ak2_bits_ps(__m256 lo, __m256 hi) {
    return (__mmask16)(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}
AK2 __mmask16 ak2_bits_epi32(__m256i lo, __m256i hi) {
    return ak2_bits_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
}

/* ---- float32 ---- */
AK2 ak2_ps _mm512_setzero_ps(void) { return ak2_ps_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
AK2 ak2_ps _mm512_set1_ps(float x) { return ak2_ps_of(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
AK2 ak2_ps _mm512_loadu_ps(const void *p) {
    return ak2_ps_of(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
AK2 void _mm512_storeu_ps(void *p, ak2_ps x) {
    _mm256_storeu_ps((float *)p, x.lo);
    _mm256_storeu_ps((float *)p + 8, x.hi);
}
#define AK2_BINOP_PS(name, op) \
    AK2 ak2_ps name(ak2_ps a, ak2_ps b) { return ak2_ps_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
AK2_BINOP_PS(_mm512_add_ps, _mm256_add_ps)
AK2_BINOP_PS(_mm512_sub_ps, _mm256_sub_ps)
AK2_BINOP_PS(_mm512_mul_ps, _mm256_mul_ps)
AK2_BINOP_PS(_mm512_div_ps, _mm256_div_ps)
AK2_BINOP_PS(_mm512_max_ps, _mm256_max_ps) /* NaN: the second operand, as vmaxps */
AK2_BINOP_PS(_mm512_min_ps, _mm256_min_ps)
AK2_BINOP_PS(_mm512_and_ps, _mm256_and_ps)
AK2_BINOP_PS(_mm512_or_ps, _mm256_or_ps)
AK2_BINOP_PS(_mm512_andnot_ps, _mm256_andnot_ps)
AK2 ak2_ps _mm512_fmadd_ps(ak2_ps a, ak2_ps b, ak2_ps c) {
    return ak2_ps_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
AK2 ak2_ps _mm512_fnmadd_ps(ak2_ps a, ak2_ps b, ak2_ps c) {
    return ak2_ps_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
AK2 ak2_ps _mm512_abs_ps(ak2_ps a) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), a); }
#define _mm512_roundscale_ps(x, imm) \
    ak2_ps_of(_mm256_round_ps((x).lo, (imm)), _mm256_round_ps((x).hi, (imm)))
/* x * 2^n for integral n (what flash.c's exp2 passes, n >= -160): two exact powers of two so
 * that a result below the normal range is rounded once, as vscalefps rounds it */
AK2 __m256 ak2_scalef8(__m256 x, __m256 n) {
    const __m256i t = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(t, 1);
    const __m256i one = _mm256_set1_epi32(127);
    const __m256 ph = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, one), 23));
    const __m256 pr = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(t, h), one), 23));
    return _mm256_mul_ps(_mm256_mul_ps(x, ph), pr);
}
AK2 ak2_ps _mm512_scalef_ps(ak2_ps x, ak2_ps n) {
    return ak2_ps_of(ak2_scalef8(x.lo, n.lo), ak2_scalef8(x.hi, n.hi));
}
AK2 float ak2_hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AK2 float _mm512_reduce_add_ps(ak2_ps x) { return ak2_hsum8(_mm256_add_ps(x.lo, x.hi)); }
AK2 float _mm512_reduce_max_ps(ak2_ps x) {
    const __m256 m = _mm256_max_ps(x.lo, x.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define _mm512_cmp_ps_mask(a, b, pred) \
    ak2_bits_ps(_mm256_cmp_ps((a).lo, (b).lo, (pred)), _mm256_cmp_ps((a).hi, (b).hi, (pred)))
/* lanes of k from b, the others from a */
AK2 ak2_ps _mm512_mask_blend_ps(__mmask16 k, ak2_ps a, ak2_ps b) {
    return ak2_ps_of(_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(ak2_lanes8(k & 0xffu))),
                     _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(ak2_lanes8(k >> 8))));
}
AK2 ak2_ps _mm512_maskz_mov_ps(__mmask16 k, ak2_ps a) {
    return _mm512_mask_blend_ps(k, _mm512_setzero_ps(), a);
}
AK2 ak2_ps _mm512_maskz_mul_ps(__mmask16 k, ak2_ps a, ak2_ps b) {
    return _mm512_maskz_mov_ps(k, _mm512_mul_ps(a, b));
}
AK2 ak2_ps _mm512_cvtepi32_ps(ak2_si a) {
    return ak2_ps_of(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi));
}
AK2 ak2_ps _mm512_castsi512_ps(ak2_si a) {
    return ak2_ps_of(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi));
}
AK2 ak2_si _mm512_castps_si512(ak2_ps a) {
    return ak2_si_of(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi));
}
/* 16 halves <-> 16 floats */
AK2 ak2_ps _mm512_cvtph_ps(__m256i h) {
    return ak2_ps_of(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                     _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtps_ph(x, imm) \
    _mm256_set_m128i(_mm256_cvtps_ph((x).hi, (imm)), _mm256_cvtps_ph((x).lo, (imm)))

/* ---- integers ---- */
AK2 ak2_si _mm512_setzero_si512(void) {
    return ak2_si_of(_mm256_setzero_si256(), _mm256_setzero_si256());
}
AK2 ak2_si _mm512_set1_epi32(int x) { return ak2_si_of(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
AK2 ak2_si _mm512_set1_epi16(short x) {
    return ak2_si_of(_mm256_set1_epi16(x), _mm256_set1_epi16(x));
}
AK2 ak2_si _mm512_set1_epi64(long long x) {
    return ak2_si_of(_mm256_set1_epi64x(x), _mm256_set1_epi64x(x));
}
AK2 ak2_si _mm512_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7,
                             int e8, int e9, int e10, int e11, int e12, int e13, int e14,
                             int e15) {
    return ak2_si_of(_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7),
                     _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15));
}
AK2 ak2_si _mm512_setr_epi64(long long e0, long long e1, long long e2, long long e3,
                             long long e4, long long e5, long long e6, long long e7) {
    return ak2_si_of(_mm256_setr_epi64x(e0, e1, e2, e3), _mm256_setr_epi64x(e4, e5, e6, e7));
}
AK2 ak2_si _mm512_loadu_si512(const void *p) {
    return ak2_si_of(_mm256_loadu_si256((const __m256i *)p),
                     _mm256_loadu_si256((const __m256i *)p + 1));
}
AK2 void _mm512_storeu_si512(void *p, ak2_si x) {
    _mm256_storeu_si256((__m256i *)p, x.lo);
    _mm256_storeu_si256((__m256i *)p + 1, x.hi);
}
#define AK2_BINOP_SI(name, op) \
    AK2 ak2_si name(ak2_si a, ak2_si b) { return ak2_si_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
AK2_BINOP_SI(_mm512_add_epi32, _mm256_add_epi32)
AK2_BINOP_SI(_mm512_add_epi64, _mm256_add_epi64)
AK2_BINOP_SI(_mm512_and_si512, _mm256_and_si256)
AK2_BINOP_SI(_mm512_or_si512, _mm256_or_si256)
AK2_BINOP_SI(_mm512_mul_epu32, _mm256_mul_epu32)
#define _mm512_slli_epi32(a, n) ak2_si_of(_mm256_slli_epi32((a).lo, (n)), _mm256_slli_epi32((a).hi, (n)))
#define _mm512_srli_epi32(a, n) ak2_si_of(_mm256_srli_epi32((a).lo, (n)), _mm256_srli_epi32((a).hi, (n)))
#define _mm512_srli_epi64(a, n) ak2_si_of(_mm256_srli_epi64((a).lo, (n)), _mm256_srli_epi64((a).hi, (n)))
/* flash.c's only truth table: 0x96, a ^ b ^ c */
/* (any other table fails to compile: the array size is negative) */
#define _mm512_ternarylogic_epi64(a, b, c, imm) \
    ak2_xor3((a), (b), (c), sizeof(char[(imm) == 0x96 ? 1 : -1]))
AK2 ak2_si ak2_xor3(ak2_si a, ak2_si b, ak2_si c, size_t only_0x96) {
    (void)only_0x96;
    return ak2_si_of(_mm256_xor_si256(_mm256_xor_si256(a.lo, b.lo), c.lo),
                     _mm256_xor_si256(_mm256_xor_si256(a.hi, b.hi), c.hi));
}
/* 16 uint16 -> 16 int32 (zero-extended) */
AK2 ak2_si _mm512_cvtepu16_epi32(__m256i h) {
    return ak2_si_of(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                     _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
/* 16 int32 -> 16 int16, truncating (vpmovdw) */
AK2 __m256i _mm512_cvtepi32_epi16(ak2_si a) {
    const __m256i m = _mm256_set1_epi32(0xffff);
    const __m256i p = _mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m));
    return _mm256_permute4x64_epi64(p, 0xD8);
}
/* 8 int64 -> 8 int32, their low words (vpmovqd) */
AK2 __m256i _mm512_cvtepi64_epi32(ak2_si a) {
    const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i l = _mm256_permutevar8x32_epi32(a.lo, idx);
    const __m256i h = _mm256_permutevar8x32_epi32(a.hi, idx);
    return _mm256_permute2x128_si256(l, h, 0x20);
}
AK2 ak2_si _mm512_cvtepu32_epi64(__m256i a) {
    return ak2_si_of(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(a)),
                     _mm256_cvtepu32_epi64(_mm256_extracti128_si256(a, 1)));
}
AK2 ak2_si _mm512_castsi256_si512(__m256i a) { return ak2_si_of(a, _mm256_setzero_si256()); }
AK2 ak2_si ak2_insert_hi(ak2_si a, __m256i b, size_t only_1) {
    (void)only_1;
    return ak2_si_of(a.lo, b);
}
/* the upper half only (index 1; index 0 fails to compile) */
#define _mm512_inserti64x4(a, b, one) \
    ak2_insert_hi((a), (b), sizeof(char[(one) == 1 ? 1 : -1]))
AK2 ak2_si _mm512_mask_blend_epi32(__mmask16 k, ak2_si a, ak2_si b) {
    return _mm512_castps_si512(_mm512_mask_blend_ps(k, _mm512_castsi512_ps(a),
                                                    _mm512_castsi512_ps(b)));
}
AK2 __mmask16 _mm512_cmpeq_epi32_mask(ak2_si a, ak2_si b) {
    return ak2_bits_epi32(_mm256_cmpeq_epi32(a.lo, b.lo), _mm256_cmpeq_epi32(a.hi, b.hi));
}
AK2 __mmask16 _mm512_cmplt_epi32_mask(ak2_si a, ak2_si b) {
    return ak2_bits_epi32(_mm256_cmpgt_epi32(b.lo, a.lo), _mm256_cmpgt_epi32(b.hi, a.hi));
}
AK2 __mmask16 _mm512_cmpge_epi32_mask(ak2_si a, ak2_si b) {
    return (__mmask16)~_mm512_cmplt_epi32_mask(a, b);
}
AK2 __mmask16 _mm512_cmpge_epu32_mask(ak2_si a, ak2_si b) {
    return ak2_bits_epi32(_mm256_cmpeq_epi32(_mm256_max_epu32(a.lo, b.lo), a.lo),
                          _mm256_cmpeq_epi32(_mm256_max_epu32(a.hi, b.hi), a.hi));
}
AK2 __mmask32 _mm512_cmpeq_epi16_mask(ak2_si a, ak2_si b) {
    const __m256i p = _mm256_packs_epi16(_mm256_cmpeq_epi16(a.lo, b.lo),
                                         _mm256_cmpeq_epi16(a.hi, b.hi));
    return (__mmask32)(uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(p, 0xD8));
}

#endif
