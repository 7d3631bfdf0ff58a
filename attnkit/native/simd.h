/* attnkit native kernels: the vector layer. The flash kernel (flash.c) is written in it, and
 * the one exp and tanh of every kernel (flash.c directly, decode.c, softcap.c and terms.c
 * through vecmath.h) are written once on it.
 *
 * Two tiers:
 *   akr   one native register of AKR_LANES float32 lanes (akrm: a lane mask of it): what exp
 *         and tanh are written on, so that each costs one register's work on every target;
 *   akv   16 float32 lanes (akvi: 16 int32 lanes, or 8 64-bit ones; akvm: a 16-bit integer,
 *         bit t for lane t, combined with C's & | ~), plus akvh (16 lanes of 16 bits: float16
 *         or bfloat16 bits) and akv4 (4 float32 lanes: one value per row of a 4-row group).
 *
 * Backends, chosen by the preprocessor (AKV_BITS says which):
 *   512  AVX-512 F/BW/DQ: akv is one 512-bit register (akr == akv) and each op one intrinsic
 *        (always inlined: the code is what the intrinsics spell);
 *   256  AVX2 + FMA + F16C: akr is a 256-bit register and akv a pair of them, with the same
 *        results lane for lane (NaN handling of max/min, vpmovdw's truncation, scalef on the
 *        integral exponents exp2 passes), so both builds give the same bits up to the order
 *        of float sums (the matrix products have 256-bit versions of their own in flash.c);
 *   0    any other target: the register tier only (GCC vector extensions, 8 lanes; akv4 for
 *        akr_rows4_add), for vecmath.h's users and decode.c; flash.c is not built there.
 * Both x86 backends share the four-lane ops (SSE). A new target (NEON: akr a float32x4_t, akv
 * four of them, akv4 one) is one more section defining the types and the operations below;
 * the math after the backends is shared.
 *
 * Register tier (akr):
 *   akr_set1  akr_add  akr_sub  akr_mul  akr_div  akr_fmadd (a b + c)  akr_fnmadd (c - a b)
 *   akr_max  akr_min (the second operand where either is NaN, as vmaxps/vminps)
 *   akr_and  akr_or  akr_andnot (~a & b)  akr_round (to nearest even, |x| < 2^22)
 *   akr_scalef (x 2^n for integral n >= -160)  akr_lt (a < b, ordered)  akr_select (m ? a : b)
 *   akr_from4 (four lanes, the others zero)  akr_low4 (the first four lanes)
 *   akr_load  akr_store  akr_abs  akr_ge (a >= b, ordered)  akrm_and (both masks)
 *   akr_load_bf16  akr_load_f16 (AKR_LANES 16-bit elements as float32, in order)
 *   akr_load_bf16_eo (2 AKR_LANES bfloat16: the even elements into one register, the odd
 *   into another: a shift and a mask, no widening)  akr_store_bf16 (rounded to nearest even,
 *   NaN kept quiet, as torch's casts)  akr_reduce_add (halves, then (s0 + s2) + (s1 + s3))
 *   akr_reduce_max (halves; no NaN among the lanes)  akr_rows4_add (lane r: the sum of
 *   register r's lanes, in the backend's own tree; AVX-512's akr_rows4_lanes: that sum in
 *   every element of 128-bit lane r)  akr_transpose (AKR_LANES registers as the rows of a
 *   square: register i becomes column i, in registers; the x86 backends, for flash.c)
 *   (AVX2: akr_keep2, as akv_keep4 below, for flash.c's 256-bit matrix products)
 * Vector tier (akv), float32:
 *   akv_zero  akv_set1  akv_load  akv_store  akv_add  akv_sub  akv_mul  akv_div  akv_fmadd
 *   akv_fnmadd  akv_max  akv_min (as akr's)  akv_abs  akv_blend (m ? b : a, as vblendmps)
 *   akv_reg (register i of the AKV_REGS registers that make a vector, i a constant)
 *   akv_maskz (m ? a : 0)  akv_maskz_mul (m ? a b : 0)  akv_isnan  akv_from_i (int32 to
 *   float)  akv_reduce_add  akv_reduce_max  akv_rows4 (lane r of the result: the sum or the
 *   maximum of vector r's 16 lanes; akv_rows4_add, akv_rows4_max)  akv_keep4 (holds four
 *   vectors in registers: a loaded operand read by several multiply-adds is loaded once)
 * int32 (akvi) and 16-bit lanes (akvh):
 *   akvi_zero  akvi_set1  akvi_iota (0 .. 15)  akvi_load  akvi_store  akvi_add  akvi_and
 *   akvi_or  akvi_slli  akvi_srli  akvi_eq  akvi_lt  akvi_ge  akvi_ge_u (unsigned)
 *   akvi_blend  akvi_as_f  akv_as_i (the bits as they are)  akvh_load  akvh_store
 *   akvi_from_u16 (zero-extended)  akvh_from_i (truncated, as vpmovdw)  akv_from_f16
 *   akv_to_f16 (nearest even)  akvi_bf16_nonfinite (whether any of the 32 bfloat16 lanes is
 *   NaN or infinite)
 * 64-bit lanes of akvi (the dropout's Philox rounds):
 *   akvi_set1_64  akvi_iota_64 (0 .. 7)  akvi_add_64  akvi_mul_u32 (the low 32 bits of each
 *   lane times those of the other's, 64-bit products)  akvi_srli_64  akvi_xor3
 *   akvi_low32 (the low words of a's 8 lanes, then of b's)
 * 4 lanes (akv4):
 *   akv4_load  akv4_store  akv4_store_lo  akv4_store_hi (lanes 0-1, 2-3)  akv4_set1  akv4_add
 *   akv4_sub  akv4_mul  akv4_max  akv4_eq  akv4_select (m ? a : b)
 * The math, written once after the backends on the register (akr_; akv_ applies it to each
 * register of a vector, AKV_EACH; akv4_exp2 to four lanes):
 *   pow2 (the one exponential: 2^n p(f))  exp2 (x <= 0; exp2_bf: to bfloat16's precision)
 *   exp_nonpos (e^x, x <= 0)  tanh (tanh_fine: with exp2's most precise polynomial)
 */
#ifndef ATTNKIT_SIMD_H
#define ATTNKIT_SIMD_H

#include <stdint.h>
#include <string.h>

#define AKV_FN static inline __attribute__((always_inline))

#if defined(__AVX512F__)
/* ---- AVX-512 ------------------------------------------------------------------------------ */
#include <immintrin.h>
#define AKV_BITS 512
#define AKR_LANES 16

typedef __m512 akr;
typedef __mmask16 akrm;
typedef __m512 akv;
typedef __m512i akvi;
typedef __mmask16 akvm;
typedef __m256i akvh;
typedef __m128 akv4;

AKV_FN akr akr_set1(float x) { return _mm512_set1_ps(x); }
AKV_FN akr akr_add(akr a, akr b) { return _mm512_add_ps(a, b); }
AKV_FN akr akr_sub(akr a, akr b) { return _mm512_sub_ps(a, b); }
AKV_FN akr akr_mul(akr a, akr b) { return _mm512_mul_ps(a, b); }
AKV_FN akr akr_div(akr a, akr b) { return _mm512_div_ps(a, b); }
AKV_FN akr akr_fmadd(akr a, akr b, akr c) { return _mm512_fmadd_ps(a, b, c); }
AKV_FN akr akr_fnmadd(akr a, akr b, akr c) { return _mm512_fnmadd_ps(a, b, c); }
AKV_FN akr akr_max(akr a, akr b) { return _mm512_max_ps(a, b); }
AKV_FN akr akr_min(akr a, akr b) { return _mm512_min_ps(a, b); }
AKV_FN akr akr_and(akr a, akr b) { return _mm512_and_ps(a, b); }
AKV_FN akr akr_or(akr a, akr b) { return _mm512_or_ps(a, b); }
AKV_FN akr akr_andnot(akr a, akr b) { return _mm512_andnot_ps(a, b); }
AKV_FN akr akr_round(akr x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
AKV_FN akr akr_scalef(akr x, akr n) { return _mm512_scalef_ps(x, n); }
AKV_FN akrm akr_lt(akr a, akr b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
AKV_FN akr akr_select(akrm m, akr a, akr b) { return _mm512_mask_blend_ps(m, b, a); }
AKV_FN akr akr_from4(akv4 x) { return _mm512_zextps128_ps512(x); }
AKV_FN akv4 akr_low4(akr x) { return _mm512_castps512_ps128(x); }
AKV_FN akr akr_load(const float *p) { return _mm512_loadu_ps(p); }
AKV_FN void akr_store(float *p, akr x) { _mm512_storeu_ps(p, x); }
AKV_FN akr akr_abs(akr x) { return _mm512_abs_ps(x); }
AKV_FN akrm akr_ge(akr a, akr b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
AKV_FN akrm akrm_and(akrm m, akrm n) { return m & n; }
AKV_FN akr akr_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AKV_FN void akr_load_bf16_eo(const uint16_t *p, akr *even, akr *odd) {
    const __m512i w = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}
AKV_FN akr akr_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* 16 x 16 32-bit words in place: word c of r[i] becomes word i of r[c] */
AKV_FN void akvi_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}
AKV_FN void akr_transpose(akr r[AKR_LANES]) {
    __m512i w[16];
    for (int i = 0; i < 16; i++) w[i] = _mm512_castps_si512(r[i]);
    akvi_transpose16(w);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(w[i]);
}
AKV_FN void akr_store_bf16(uint16_t *p, akr x) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q)));
}
AKV_FN __m256 akr_high8(akr x) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}
AKV_FN float akr_reduce_add(akr x) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), akr_high8(x));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
AKV_FN float akr_reduce_max(akr x) {
    const __m256 h = _mm256_max_ps(akr_high8(x), _mm512_castps512_ps256(x));
    __m128 s = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    s = _mm_max_ps(_mm_permute_ps(s, 0x4E), s);
    return _mm_cvtss_f32(_mm_max_ps(_mm_permute_ps(s, 0xB1), s));
}
/* halves of (x0, x1) and of (x2, x3), then quarters (register r's four partial sums in
 * 128-bit lane r), then within each lane: the tree of akr_reduce_add for every register;
 * akr_rows4_lanes leaves register r's sum in every element of 128-bit lane r (AVX-512 only:
 * decode.c's bfloat16 dot-product tiles) */
AKV_FN __m512 akr_rows4_lanes(akr x0, akr x1, akr x2, akr x3) {
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x44),
                                   _mm512_shuffle_f32x4(x0, x1, 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x44),
                                   _mm512_shuffle_f32x4(x2, x3, 0xEE));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}
AKV_FN akv4 akr_rows4_add(akr x0, akr x1, akr x2, akr x3) {
    const __m512 x = akr_rows4_lanes(x0, x1, x2, x3);
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, x));
}
#define AKV_EACH(F, x) F(x) /* F (on a register) on each register of vector x */
#define AKV_REGS 1

AKV_FN akr akv_reg(akv x, int i) {
    (void)i;
    return x;
}
AKV_FN akv akv_zero(void) { return _mm512_setzero_ps(); }
AKV_FN akv akv_set1(float x) { return _mm512_set1_ps(x); }
AKV_FN akv akv_load(const float *p) { return _mm512_loadu_ps(p); }
AKV_FN void akv_store(float *p, akv x) { _mm512_storeu_ps(p, x); }
AKV_FN akv akv_add(akv a, akv b) { return _mm512_add_ps(a, b); }
AKV_FN akv akv_sub(akv a, akv b) { return _mm512_sub_ps(a, b); }
AKV_FN akv akv_mul(akv a, akv b) { return _mm512_mul_ps(a, b); }
AKV_FN akv akv_div(akv a, akv b) { return _mm512_div_ps(a, b); }
AKV_FN akv akv_fmadd(akv a, akv b, akv c) { return _mm512_fmadd_ps(a, b, c); }
AKV_FN akv akv_fnmadd(akv a, akv b, akv c) { return _mm512_fnmadd_ps(a, b, c); }
AKV_FN akv akv_max(akv a, akv b) { return _mm512_max_ps(a, b); }
AKV_FN akv akv_min(akv a, akv b) { return _mm512_min_ps(a, b); }
AKV_FN akv akv_abs(akv a) { return _mm512_abs_ps(a); }
AKV_FN akv akv_blend(akvm m, akv a, akv b) { return _mm512_mask_blend_ps(m, a, b); }
AKV_FN akv akv_maskz(akvm m, akv a) { return _mm512_maskz_mov_ps(m, a); }
AKV_FN akv akv_maskz_mul(akvm m, akv a, akv b) { return _mm512_maskz_mul_ps(m, a, b); }
AKV_FN akvm akv_isnan(akv x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
AKV_FN akv akv_from_i(akvi a) { return _mm512_cvtepi32_ps(a); }
AKV_FN float akv_reduce_add(akv x) { return _mm512_reduce_add_ps(x); }
AKV_FN float akv_reduce_max(akv x) { return _mm512_reduce_max_ps(x); }
/* four rows in one butterfly: pairs of rows, then the halves of each 128-bit lane's pair,
 * then across the 128-bit lanes */
AKV_FN akv akv_rows4_step(akv a, akv b, int add) {
    return add ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b);
}
AKV_FN akv4 akv_rows4(akv x0, akv x1, akv x2, akv x3, int add) {
    const akv a = akv_rows4_step(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1), add);
    const akv b = akv_rows4_step(_mm512_unpacklo_ps(x2, x3), _mm512_unpackhi_ps(x2, x3), add);
    akv c = akv_rows4_step(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE), add);
    c = akv_rows4_step(c, _mm512_shuffle_f32x4(c, c, 0x4E), add);
    c = akv_rows4_step(c, _mm512_shuffle_f32x4(c, c, 0xB1), add);
    return _mm512_castps512_ps128(c);
}
/* Without it the compiler folds each load into the four multiply-adds that read it, four
 * loads instead of one: free where a 512-bit load is one operation, the limit where it is two
 * (Zen 4: the matrix products ran at two thirds of the multiply-add rate). */
#define akv_keep4(a, b, c, e) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(e))

AKV_FN akvi akvi_zero(void) { return _mm512_setzero_si512(); }
AKV_FN akvi akvi_set1(int32_t x) { return _mm512_set1_epi32(x); }
AKV_FN akvi akvi_iota(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
AKV_FN akvi akvi_load(const void *p) { return _mm512_loadu_si512(p); }
AKV_FN void akvi_store(void *p, akvi x) { _mm512_storeu_si512(p, x); }
AKV_FN akvi akvi_add(akvi a, akvi b) { return _mm512_add_epi32(a, b); }
AKV_FN akvi akvi_and(akvi a, akvi b) { return _mm512_and_si512(a, b); }
AKV_FN akvi akvi_or(akvi a, akvi b) { return _mm512_or_si512(a, b); }
#define akvi_slli(a, n) _mm512_slli_epi32((a), (n))
#define akvi_srli(a, n) _mm512_srli_epi32((a), (n))
AKV_FN akvm akvi_eq(akvi a, akvi b) { return _mm512_cmpeq_epi32_mask(a, b); }
AKV_FN akvm akvi_lt(akvi a, akvi b) { return _mm512_cmplt_epi32_mask(a, b); }
AKV_FN akvm akvi_ge(akvi a, akvi b) { return _mm512_cmpge_epi32_mask(a, b); }
AKV_FN akvm akvi_ge_u(akvi a, akvi b) { return _mm512_cmpge_epu32_mask(a, b); }
AKV_FN akvi akvi_blend(akvm m, akvi a, akvi b) { return _mm512_mask_blend_epi32(m, a, b); }
AKV_FN akv akvi_as_f(akvi a) { return _mm512_castsi512_ps(a); }
AKV_FN akvi akv_as_i(akv a) { return _mm512_castps_si512(a); }
AKV_FN akvh akvh_load(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
AKV_FN void akvh_store(uint16_t *p, akvh h) { _mm256_storeu_si256((__m256i *)p, h); }
AKV_FN akvi akvi_from_u16(akvh h) { return _mm512_cvtepu16_epi32(h); }
AKV_FN akvh akvh_from_i(akvi a) { return _mm512_cvtepi32_epi16(a); }
AKV_FN akv akv_from_f16(akvh h) { return _mm512_cvtph_ps(h); }
AKV_FN akvh akv_to_f16(akv x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
AKV_FN int akvi_bf16_nonfinite(akvi x) {
    const __m512i e = _mm512_set1_epi16(0x7f80);
    return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e) != 0;
}

AKV_FN akvi akvi_set1_64(uint64_t x) { return _mm512_set1_epi64((long long)x); }
AKV_FN akvi akvi_iota_64(void) { return _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7); }
AKV_FN akvi akvi_add_64(akvi a, akvi b) { return _mm512_add_epi64(a, b); }
AKV_FN akvi akvi_mul_u32(akvi a, akvi b) { return _mm512_mul_epu32(a, b); }
#define akvi_srli_64(a, n) _mm512_srli_epi64((a), (n))
AKV_FN akvi akvi_xor3(akvi a, akvi b, akvi c) { return _mm512_ternarylogic_epi64(a, b, c, 0x96); }
AKV_FN akvi akvi_low32(akvi a, akvi b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)),
                              _mm512_cvtepi64_epi32(b), 1);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* ---- AVX2 + FMA + F16C: a vector is two 256-bit registers --------------------------------- */
#include <immintrin.h>
#define AKV_BITS 256
#define AKR_LANES 8

typedef __m256 akr;
typedef __m256 akrm; /* all ones in the lanes set */
typedef struct { __m256 lo, hi; } akv;
typedef struct { __m256i lo, hi; } akvi;
typedef uint16_t akvm;
typedef __m256i akvh;
typedef __m128 akv4;

AKV_FN akr akr_set1(float x) { return _mm256_set1_ps(x); }
AKV_FN akr akr_add(akr a, akr b) { return _mm256_add_ps(a, b); }
AKV_FN akr akr_sub(akr a, akr b) { return _mm256_sub_ps(a, b); }
AKV_FN akr akr_mul(akr a, akr b) { return _mm256_mul_ps(a, b); }
AKV_FN akr akr_div(akr a, akr b) { return _mm256_div_ps(a, b); }
AKV_FN akr akr_fmadd(akr a, akr b, akr c) { return _mm256_fmadd_ps(a, b, c); }
AKV_FN akr akr_fnmadd(akr a, akr b, akr c) { return _mm256_fnmadd_ps(a, b, c); }
AKV_FN akr akr_max(akr a, akr b) { return _mm256_max_ps(a, b); }
AKV_FN akr akr_min(akr a, akr b) { return _mm256_min_ps(a, b); }
AKV_FN akr akr_and(akr a, akr b) { return _mm256_and_ps(a, b); }
AKV_FN akr akr_or(akr a, akr b) { return _mm256_or_ps(a, b); }
AKV_FN akr akr_andnot(akr a, akr b) { return _mm256_andnot_ps(a, b); }
AKV_FN akr akr_round(akr x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* two exact powers of two, so that a result below the normal range is rounded once, as
 * vscalefps rounds it */
AKV_FN akr akr_scalef(akr x, akr n) {
    const __m256i t = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(t, 1);
    const __m256i one = _mm256_set1_epi32(127);
    const __m256 ph = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, one), 23));
    const __m256 pr = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(t, h), one), 23));
    return _mm256_mul_ps(_mm256_mul_ps(x, ph), pr);
}
AKV_FN akrm akr_lt(akr a, akr b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
AKV_FN akr akr_select(akrm m, akr a, akr b) { return _mm256_blendv_ps(b, a, m); }
AKV_FN akr akr_from4(akv4 x) { return _mm256_zextps128_ps256(x); }
AKV_FN akv4 akr_low4(akr x) { return _mm256_castps256_ps128(x); }
AKV_FN akr akr_load(const float *p) { return _mm256_loadu_ps(p); }
AKV_FN void akr_store(float *p, akr x) { _mm256_storeu_ps(p, x); }
AKV_FN akr akr_abs(akr x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
AKV_FN akrm akr_ge(akr a, akr b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
AKV_FN akrm akrm_and(akrm m, akrm n) { return _mm256_and_ps(m, n); }
AKV_FN akr akr_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AKV_FN void akr_load_bf16_eo(const uint16_t *p, akr *even, akr *odd) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}
AKV_FN akr akr_load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
AKV_FN void akr_transpose(akr r[AKR_LANES]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) { /* (r0[0] r1[0] r0[1] r1[1] | r0[4] r1[4] ..) .. */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) { /* (r0[c] r1[c] r2[c] r3[c] | the same of c + 4) */
        u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xee);
        u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
AKV_FN void akr_store_bf16(uint16_t *p, akr x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i b = _mm256_blendv_epi8(r, q, nan); /* (every lane below 2^16: packs exactly) */
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
AKV_FN float akr_reduce_add(akr x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
AKV_FN float akr_reduce_max(akr x) {
    __m128 s = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    s = _mm_max_ps(_mm_permute_ps(s, 0x4E), s);
    return _mm_cvtss_f32(_mm_max_ps(_mm_permute_ps(s, 0xB1), s));
}
/* pairs of lanes (vhaddps), twice, then the halves */
AKV_FN akv4 akr_rows4_add(akr x0, akr x1, akr x2, akr x3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(x0, x1), _mm256_hadd_ps(x2, x3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#define AKV_EACH(F, x) akv_of(F((x).lo), F((x).hi))
#define AKV_REGS 2
/* holds two registers (a loaded operand read by several multiply-adds is then loaded once,
 * not folded into each of them) */
#define akr_keep2(a, b) __asm__("" : "+x"(a), "+x"(b))

/* (backend-specific: flash.c's 256-bit matrix products build their vectors with these) */
AKV_FN akv akv_of(__m256 lo, __m256 hi) { return (akv){lo, hi}; }
AKV_FN akvi akvi_of(__m256i lo, __m256i hi) { return (akvi){lo, hi}; }
AKV_FN akr akv_reg(akv x, int i) { return i ? x.hi : x.lo; }

/* lane masks <-> integers */
AKV_FN __m256 akv_lanes8(unsigned k) { /* bit t of k -> all ones in lane t */
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)k), bits), bits));
}
AKV_FN akvm akv_bits(__m256 lo, __m256 hi) {
    return (akvm)(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}
AKV_FN akvm akvi_bits(__m256i lo, __m256i hi) {
    return akv_bits(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
}

AKV_FN akv akv_zero(void) { return akv_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
AKV_FN akv akv_set1(float x) { return akv_of(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
AKV_FN akv akv_load(const float *p) { return akv_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
AKV_FN void akv_store(float *p, akv x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}
#define AKV_PAIRWISE(name, op) \
    AKV_FN akv name(akv a, akv b) { return akv_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
AKV_PAIRWISE(akv_add, _mm256_add_ps)
AKV_PAIRWISE(akv_sub, _mm256_sub_ps)
AKV_PAIRWISE(akv_mul, _mm256_mul_ps)
AKV_PAIRWISE(akv_div, _mm256_div_ps)
AKV_PAIRWISE(akv_max, _mm256_max_ps)
AKV_PAIRWISE(akv_min, _mm256_min_ps)
#undef AKV_PAIRWISE
AKV_FN akv akv_fmadd(akv a, akv b, akv c) {
    return akv_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
AKV_FN akv akv_fnmadd(akv a, akv b, akv c) {
    return akv_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
AKV_FN akv akv_abs(akv a) {
    const __m256 s = _mm256_set1_ps(-0.0f);
    return akv_of(_mm256_andnot_ps(s, a.lo), _mm256_andnot_ps(s, a.hi));
}
AKV_FN akv akv_blend(akvm m, akv a, akv b) {
    return akv_of(_mm256_blendv_ps(a.lo, b.lo, akv_lanes8(m & 0xffu)),
                  _mm256_blendv_ps(a.hi, b.hi, akv_lanes8((unsigned)m >> 8)));
}
AKV_FN akv akv_maskz(akvm m, akv a) { return akv_blend(m, akv_zero(), a); }
AKV_FN akv akv_maskz_mul(akvm m, akv a, akv b) { return akv_maskz(m, akv_mul(a, b)); }
AKV_FN akvm akv_isnan(akv x) {
    return akv_bits(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q),
                    _mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q));
}
AKV_FN akv akv_from_i(akvi a) { return akv_of(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
AKV_FN float akv_reduce_add(akv x) {
    const __m256 t = _mm256_add_ps(x.lo, x.hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AKV_FN float akv_reduce_max(akv x) {
    const __m256 m = _mm256_max_ps(x.lo, x.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AKV_FN akv4 akv_rows4(akv x0, akv x1, akv x2, akv x3, int add) {
    return add ? _mm_setr_ps(akv_reduce_add(x0), akv_reduce_add(x1), akv_reduce_add(x2),
                             akv_reduce_add(x3))
               : _mm_setr_ps(akv_reduce_max(x0), akv_reduce_max(x1), akv_reduce_max(x2),
                             akv_reduce_max(x3));
}
#define akv_keep4(a, b, c, e) ((void)0) /* (the 256-bit products read their operands once) */

AKV_FN akvi akvi_zero(void) { return akvi_of(_mm256_setzero_si256(), _mm256_setzero_si256()); }
AKV_FN akvi akvi_set1(int32_t x) { return akvi_of(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
AKV_FN akvi akvi_iota(void) {
    return akvi_of(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                   _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}
AKV_FN akvi akvi_load(const void *p) {
    return akvi_of(_mm256_loadu_si256((const __m256i *)p),
                   _mm256_loadu_si256((const __m256i *)p + 1));
}
AKV_FN void akvi_store(void *p, akvi x) {
    _mm256_storeu_si256((__m256i *)p, x.lo);
    _mm256_storeu_si256((__m256i *)p + 1, x.hi);
}
#define AKVI_PAIRWISE(name, op) \
    AKV_FN akvi name(akvi a, akvi b) { return akvi_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
AKVI_PAIRWISE(akvi_add, _mm256_add_epi32)
AKVI_PAIRWISE(akvi_and, _mm256_and_si256)
AKVI_PAIRWISE(akvi_or, _mm256_or_si256)
AKVI_PAIRWISE(akvi_add_64, _mm256_add_epi64)
AKVI_PAIRWISE(akvi_mul_u32, _mm256_mul_epu32)
#undef AKVI_PAIRWISE
#define akvi_slli(a, n) akvi_of(_mm256_slli_epi32((a).lo, (n)), _mm256_slli_epi32((a).hi, (n)))
#define akvi_srli(a, n) akvi_of(_mm256_srli_epi32((a).lo, (n)), _mm256_srli_epi32((a).hi, (n)))
AKV_FN akvm akvi_eq(akvi a, akvi b) {
    return akvi_bits(_mm256_cmpeq_epi32(a.lo, b.lo), _mm256_cmpeq_epi32(a.hi, b.hi));
}
AKV_FN akvm akvi_lt(akvi a, akvi b) {
    return akvi_bits(_mm256_cmpgt_epi32(b.lo, a.lo), _mm256_cmpgt_epi32(b.hi, a.hi));
}
AKV_FN akvm akvi_ge(akvi a, akvi b) { return (akvm)~akvi_lt(a, b); }
AKV_FN akvm akvi_ge_u(akvi a, akvi b) {
    return akvi_bits(_mm256_cmpeq_epi32(_mm256_max_epu32(a.lo, b.lo), a.lo),
                     _mm256_cmpeq_epi32(_mm256_max_epu32(a.hi, b.hi), a.hi));
}
AKV_FN akv akvi_as_f(akvi a) {
    return akv_of(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi));
}
AKV_FN akvi akv_as_i(akv a) {
    return akvi_of(_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi));
}
AKV_FN akvi akvi_blend(akvm m, akvi a, akvi b) {
    return akv_as_i(akv_blend(m, akvi_as_f(a), akvi_as_f(b)));
}
AKV_FN akvh akvh_load(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
AKV_FN void akvh_store(uint16_t *p, akvh h) { _mm256_storeu_si256((__m256i *)p, h); }
AKV_FN akvi akvi_from_u16(akvh h) {
    return akvi_of(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)),
                   _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
AKV_FN akvh akvh_from_i(akvi a) {
    const __m256i m = _mm256_set1_epi32(0xffff);
    const __m256i p = _mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m));
    return _mm256_permute4x64_epi64(p, 0xD8);
}
AKV_FN akv akv_from_f16(akvh h) {
    return akv_of(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                  _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
AKV_FN akvh akv_to_f16(akv x) {
    return _mm256_set_m128i(_mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                            _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
AKV_FN int akvi_bf16_nonfinite(akvi x) {
    const __m256i e = _mm256_set1_epi16(0x7f80);
    const __m256i lo = _mm256_cmpeq_epi16(_mm256_and_si256(x.lo, e), e);
    const __m256i hi = _mm256_cmpeq_epi16(_mm256_and_si256(x.hi, e), e);
    return !_mm256_testz_si256(_mm256_or_si256(lo, hi), _mm256_or_si256(lo, hi));
}

AKV_FN akvi akvi_set1_64(uint64_t x) {
    return akvi_of(_mm256_set1_epi64x((long long)x), _mm256_set1_epi64x((long long)x));
}
AKV_FN akvi akvi_iota_64(void) {
    return akvi_of(_mm256_setr_epi64x(0, 1, 2, 3), _mm256_setr_epi64x(4, 5, 6, 7));
}
#define akvi_srli_64(a, n) akvi_of(_mm256_srli_epi64((a).lo, (n)), _mm256_srli_epi64((a).hi, (n)))
AKV_FN akvi akvi_xor3(akvi a, akvi b, akvi c) {
    return akvi_of(_mm256_xor_si256(_mm256_xor_si256(a.lo, b.lo), c.lo),
                   _mm256_xor_si256(_mm256_xor_si256(a.hi, b.hi), c.hi));
}
AKV_FN __m256i akvi_low32_half(akvi a) { /* a's 8 low words, in order */
    const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    return _mm256_permute2x128_si256(_mm256_permutevar8x32_epi32(a.lo, idx),
                                     _mm256_permutevar8x32_epi32(a.hi, idx), 0x20);
}
AKV_FN akvi akvi_low32(akvi a, akvi b) { return akvi_of(akvi_low32_half(a), akvi_low32_half(b)); }

#else
/* ---- any other target: the register tier only, in GCC vector extensions ------------------- */
#define AKV_BITS 0
#define AKR_LANES 8

#if defined(__GNUC__) && !defined(__clang__)
/* (every function taking these vectors is inlined, so none is passed: no ABI question) */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float akr __attribute__((vector_size(4 * AKR_LANES)));
typedef int32_t akrm __attribute__((vector_size(4 * AKR_LANES))); /* all ones in the lanes set */

AKV_FN akr akr_set1(float x) { return (akr){x, x, x, x, x, x, x, x}; }
AKV_FN akr akr_add(akr a, akr b) { return a + b; }
AKV_FN akr akr_sub(akr a, akr b) { return a - b; }
AKV_FN akr akr_mul(akr a, akr b) { return a * b; }
AKV_FN akr akr_div(akr a, akr b) { return a / b; }
AKV_FN akr akr_fmadd(akr a, akr b, akr c) { return a * b + c; }
AKV_FN akr akr_fnmadd(akr a, akr b, akr c) { return c - a * b; }
AKV_FN akrm akr_lt(akr a, akr b) { return a < b; }
AKV_FN akr akr_select(akrm m, akr a, akr b) { return (akr)(((akrm)a & m) | ((akrm)b & ~m)); }
AKV_FN akr akr_max(akr a, akr b) { return akr_select(a > b, a, b); }
AKV_FN akr akr_min(akr a, akr b) { return akr_select(a < b, a, b); }
AKV_FN akr akr_and(akr a, akr b) { return (akr)((akrm)a & (akrm)b); }
AKV_FN akr akr_or(akr a, akr b) { return (akr)((akrm)a | (akrm)b); }
AKV_FN akr akr_andnot(akr a, akr b) { return (akr)(~(akrm)a & (akrm)b); }
AKV_FN akr akr_round(akr x) { /* adding 1.5 * 2^23 rounds to an integer */
    const akr magic = akr_set1(12582912.0f);
    return (x + magic) - magic;
}
AKV_FN akr akr_scalef(akr x, akr n) { /* two exact powers of two, as the AVX2 backend */
    const akrm t = __builtin_convertvector(n, akrm), h = t >> 1;
    return x * (akr)((h + 127) << 23) * (akr)((t - h + 127) << 23);
}

typedef float akv4 __attribute__((vector_size(16)));
typedef uint32_t akru __attribute__((vector_size(4 * AKR_LANES)));
typedef uint16_t akrh __attribute__((vector_size(2 * AKR_LANES)));

AKV_FN akr akr_load(const float *p) {
    akr x;
    memcpy(&x, p, sizeof x);
    return x;
}
AKV_FN void akr_store(float *p, akr x) { memcpy(p, &x, sizeof x); }
AKV_FN akr akr_abs(akr x) { return akr_andnot(akr_set1(-0.0f), x); }
AKV_FN akrm akr_ge(akr a, akr b) { return a >= b; }
AKV_FN akrm akrm_and(akrm m, akrm n) { return m & n; }
AKV_FN akr akr_load_bf16(const uint16_t *p) {
    akrh h;
    memcpy(&h, p, sizeof h);
    return (akr)(__builtin_convertvector(h, akru) << 16);
}
AKV_FN void akr_load_bf16_eo(const uint16_t *p, akr *even, akr *odd) {
    akru w; /* (little-endian: element 2i is the low half of word i) */
    memcpy(&w, p, sizeof w);
    *even = (akr)(w << 16);
    *odd = (akr)(w & 0xFFFF0000u);
}
AKV_FN akr akr_load_f16(const uint16_t *p) {
#ifdef __FLT16_MAX__
    typedef _Float16 akrf16 __attribute__((vector_size(2 * AKR_LANES)));
    akrf16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, akr);
#else
    (void)p;
    return akr_set1(0.0f); /* (the kernels refuse float16 without _Float16) */
#endif
}
AKV_FN void akr_store_bf16(uint16_t *p, akr x) {
    const akru u = (akru)x;
    const akru nan = (akru)((u & 0x7fffffffu) > 0x7f800000u);
    const akru r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const akrh h = __builtin_convertvector((r & ~nan) | (((u >> 16) | 0x40u) & nan), akrh);
    memcpy(p, &h, sizeof h);
}
AKV_FN float akr_reduce_add(akr x) {
    const akv4 s = __builtin_shufflevector(x, x, 0, 1, 2, 3)
                   + __builtin_shufflevector(x, x, 4, 5, 6, 7);
    return (s[0] + s[2]) + (s[1] + s[3]);
}
AKV_FN float akr_reduce_max(akr x) {
    akr w = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x = akr_max(w, x);
    w = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x = akr_max(w, x);
    w = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
    return akr_max(w, x)[0];
}
/* adjacent lanes of x and y added, as vhaddps does: x0+x1, x2+x3, y0+y1, y2+y3, then the same
 * of the high halves */
#define AKR_HADD(X, Y)                                                                     \
    (__builtin_shufflevector(X, Y, 0, 2, 8, 10, 4, 6, 12, 14)                              \
     + __builtin_shufflevector(X, Y, 1, 3, 9, 11, 5, 7, 13, 15))
AKV_FN akv4 akr_rows4_add(akr x0, akr x1, akr x2, akr x3) {
    const akr u = AKR_HADD(AKR_HADD(x0, x1), AKR_HADD(x2, x3));
    return __builtin_shufflevector(u, u, 0, 1, 2, 3) + __builtin_shufflevector(u, u, 4, 5, 6, 7);
}
#undef AKR_HADD
#endif

#if AKV_BITS == 512 || AKV_BITS == 256
/* ---- both x86 backends: four lanes are SSE's --------------------------------------------- */
AKV_FN akv4 akv4_load(const float *p) { return _mm_loadu_ps(p); }
AKV_FN void akv4_store(float *p, akv4 x) { _mm_storeu_ps(p, x); }
AKV_FN void akv4_store_lo(float *p, akv4 x) { _mm_storel_pi((__m64 *)(void *)p, x); }
AKV_FN void akv4_store_hi(float *p, akv4 x) { _mm_storeh_pi((__m64 *)(void *)p, x); }
AKV_FN akv4 akv4_set1(float x) { return _mm_set1_ps(x); }
AKV_FN akv4 akv4_add(akv4 a, akv4 b) { return _mm_add_ps(a, b); }
AKV_FN akv4 akv4_sub(akv4 a, akv4 b) { return _mm_sub_ps(a, b); }
AKV_FN akv4 akv4_mul(akv4 a, akv4 b) { return _mm_mul_ps(a, b); }
AKV_FN akv4 akv4_max(akv4 a, akv4 b) { return _mm_max_ps(a, b); }
AKV_FN akv4 akv4_eq(akv4 a, akv4 b) { return _mm_cmpeq_ps(a, b); }
AKV_FN akv4 akv4_select(akv4 m, akv4 a, akv4 b) { return _mm_blendv_ps(b, a, m); }
#endif

/* ---- the math, written once ---------------------------------------------------------------- */

/* 2^(n + f) for integral n >= -160 and |f| <= 1/2 (a little more is fine): 2^f by the
 * polynomial c[0] + c[1] f + ... of degree `deg` (a constant where it is inlined), times 2^n
 * by scalef. The one exponential: exp2 and exp below reduce their arguments to it (AVX2's
 * exp2 computes the same bits in fewer instructions). */
AKV_FN akr akr_pow2(akr n, akr f, const float *c, int deg) {
    akr p = akr_set1(c[deg]);
    for (int i = deg - 1; i >= 0; i--) p = akr_fmadd(p, f, akr_set1(c[i]));
    return akr_scalef(p, n);
}

/* 2^x for x <= 0 (NaN stays NaN, -inf gives 0): x = n + f, n = round(x) */
#if AKV_BITS == 256
/* (AVX2, 12 instructions where akr_pow2 takes 17: n comes from adding 1.5 * 2^23, which leaves
 * round(x) in the low bits of the sum (ties to even, as akr_round), and the sum shifted gives
 * 2^(n + 64) whole; the polynomial's coefficients carry the 2^-64, an exact scaling of every
 * step, so that p 2^(n + 64) is the exact product rounded once, the bits akr_pow2 gives) */
AKV_FN akr akr_exp2_poly(akr x, const float *c, int deg) {
    static const float MAGIC = 12582912.0f; /* 1.5 * 2^23 */
    x = akr_max(akr_set1(-160.0f), x);       /* NaN in x is kept (second operand) */
    const akr y = akr_add(x, akr_set1(MAGIC));
    const akr f = akr_sub(x, akr_sub(y, akr_set1(MAGIC)));
    akr p = akr_set1(c[deg] * 0x1p-64f);
    for (int i = deg - 1; i >= 0; i--) p = akr_fmadd(p, f, akr_set1(c[i] * 0x1p-64f));
    const __m256i e = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(y), 23),
                                       _mm256_set1_epi32((127 + 64) << 23));
    return akr_mul(p, _mm256_castsi256_ps(e));
}
#else
AKV_FN akr akr_exp2_poly(akr x, const float *c, int deg) {
    x = akr_max(akr_set1(-160.0f), x); /* NaN in x is kept (second operand) */
    const akr n = akr_round(x);
    return akr_pow2(n, akr_sub(x, n), c, deg);
}
#endif

/* 2^f on |f| <= 1/2, fitted for relative error with 2^0 exactly 1: degree 6 below 1.6e-8 (a
 * float32 result's own rounding then dominates: below 1.3e-7 in all), for vecmath.h's users;
 * degree 5 below 2.6e-7, the flash kernel's weights; degree 4 below 4.5e-6, for weights then
 * rounded to bfloat16 (relative 3.9e-3) for the bfloat16 dot products */
static const float AK_EXP2_C6[7] = {1.0f, 6.93147182e-1f, 2.40226477e-1f, 5.55033237e-2f,
                                    9.61843692e-3f, 1.33988762e-3f, 1.53533590e-4f};
static const float AK_EXP2_C5[6] = {1.0f, 6.93146288e-1f, 2.40221381e-1f, 5.55148013e-2f,
                                    9.67658684e-3f, 1.30842137e-3f};
static const float AK_EXP2_C4[5] = {1.0f, 6.93113625e-1f, 2.40234613e-1f, 5.59631027e-2f,
                                    9.61857196e-3f};

AKV_FN akr akr_exp2(akr x) { return akr_exp2_poly(x, AK_EXP2_C5, 5); }
AKV_FN akr akr_exp2_bf(akr x) { return akr_exp2_poly(x, AK_EXP2_C4, 4); }

/* e^x for x <= 0 as 2^(x log2(e)), the exponent's integer part n taken first so that its
 * fraction keeps float32's precision: r = x - n ln2 (ln2 in two parts: exact for these n),
 * then 2^(r log2(e)) by exp2's degree 6. Relative error below 2e-7 (1.2e-7 measured over
 * [-87, 0]). 0 for x < -87 (where the true value is below float32's normal range) and for
 * x = -inf; NaN for x = NaN (the polynomial is NaN whatever the exponent; decode.c relies on
 * it). */
AKV_FN akr akr_exp_nonpos(akr x) {
    static const float LOG2E = 1.44269504088896341f;
    const akrm under = akr_lt(x, akr_set1(-87.0f));
    const akr xc = akr_max(akr_set1(-87.0f), x);
    const akr n = akr_round(akr_mul(xc, akr_set1(LOG2E)));
    akr r = akr_fnmadd(n, akr_set1(0.693359375f), xc);
    r = akr_fnmadd(n, akr_set1(-2.12194440e-4f), r);
    const akr e = akr_pow2(n, akr_mul(r, akr_set1(LOG2E)), AK_EXP2_C6, 6);
    return akr_select(under, akr_set1(0.0f), e);
}

/* tanh(x) = sign(x) (1 - E) / (1 + E), E = 2^(-2 log2(e) |x|) with exp2's polynomial c of
 * degree deg; an odd Taylor polynomial below |x| = 1/8. NaN stays NaN. */
AKV_FN akr akr_tanh_poly(akr x, const float *c, int deg) {
    const akr sign = akr_set1(-0.0f), one = akr_set1(1.0f);
    const akr ax = akr_andnot(sign, x);
    const akr e = akr_exp2_poly(akr_mul(akr_min(akr_set1(9.0f), ax), /* NaN kept (second) */
                                        akr_set1(-2.8853900817779268f)),
                                c, deg);
    const akr big = akr_div(akr_sub(one, e), akr_add(one, e));
    const akr x2 = akr_mul(ax, ax);
    akr sm = akr_fmadd(x2, akr_set1(-17.0f / 315.0f), akr_set1(2.0f / 15.0f));
    sm = akr_fmadd(x2, sm, akr_set1(-1.0f / 3.0f));
    sm = akr_fmadd(akr_mul(x2, ax), sm, ax);
    return akr_or(akr_select(akr_lt(ax, akr_set1(0.125f)), sm, big), akr_and(x, sign));
}

/* absolute error: 1.5e-7 at most with degree 5 (the flash kernel's softcap), 1.1e-7 with
 * degree 6 (vecmath.h's users; measured over [-12, 12]) */
AKV_FN akr akr_tanh(akr x) { return akr_tanh_poly(x, AK_EXP2_C5, 5); }
AKV_FN akr akr_tanh_fine(akr x) { return akr_tanh_poly(x, AK_EXP2_C6, 6); }

#if AKV_BITS
AKV_FN akv akv_exp2(akv x) { return AKV_EACH(akr_exp2, x); }
AKV_FN akv akv_exp2_bf(akv x) { return AKV_EACH(akr_exp2_bf, x); }
AKV_FN akv akv_tanh(akv x) { return AKV_EACH(akr_tanh, x); }
AKV_FN akv4 akv4_exp2(akv4 x) { return akr_low4(akr_exp2(akr_from4(x))); }

#define akv_rows4_max(x0, x1, x2, x3) akv_rows4(x0, x1, x2, x3, 0)
#define akv_rows4_add(x0, x1, x2, x3) akv_rows4(x0, x1, x2, x3, 1)
#endif

#endif
