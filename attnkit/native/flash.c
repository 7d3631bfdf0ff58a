/* attnkit native kernels: flash attention on the CPU, float32 arithmetic (AVX-512, or AVX2 +
 * FMA + F16C through avx2_as_512.h, whose matrix products have their own 256-bit versions).
 *
 * One call computes softmax(scale * Q K^T + terms, masked) V and the log-sum-exp for every
 * (batch, query head) over query blocks of AK_FM rows, with the online softmax of
 * FlashAttention: per key block of AK_FN keys the scores of AK_FR query rows are held in
 * registers (AK_FR x AK_FN / 16 accumulators), the terms are evaluated on them in place, the
 * weights go to a small L1 buffer and are multiplied into the rows' output accumulators at
 * once, so no score or mask tile is ever written to memory.
 *
 * Terms, evaluated in registers (all optional):
 *   - visibility: key j of row r is visible iff lo[r] <= j < hi[r] (per batch row: causal with
 *     either diagonal, windows, key padding and left padding as one interval) and, with
 *     segment ids, qseg[r] == kseg[j] (documents);
 *   - softcap: s = cap * tanh(s / cap) (on scale * q.k, before the additive terms);
 *   - ALiBi: s -= slope[h] * |ipos[r] - j|;
 *   - a relative-position table: s += rel[h][j - r + rel_base] (the caller expands and clamps
 *     the table so that every j of a visited block indexes inside it);
 *   - sinks: one extra logit per head in the denominator.
 * A key block that every row of a group sees whole skips the visibility test; one that no row
 * of the group sees is skipped. Scores are kept in the base-2 domain (log2(e) folded into the
 * scale and the terms), so each weight is one exp2: a degree-5 polynomial and a scalef
 * (degree 4 for weights rounded to bfloat16).
 *
 * Layout: q (N, Hq, Lq, d), k (N, Hkv, Lk, d), v (N, Hkv, Lk, dv) with any batch/head/row
 * strides and unit stride along the head dim, float32, bfloat16 or float16; keys are first packed
 * (parallel pass) transposed by blocks into float32 scratch: kt[(n, hkv, kb)][c][AK_FN],
 * values as float32 rows (only when they are not float32 already, or are read from pages).
 * out (N, Hq, Lq, dv) and lse (N, Hq, Lq) are float32, contiguous, and so are the row maxima
 * where they are asked for. Rows with no visible key (and no sink) get out 0 and lse -inf.
 *
 * Paged K/V (the forward): the packing pass reads each key block through the block table
 * (FlashAttention / vLLM layout, pages (P, page, Hkv, d), any page size), so the blocks it
 * packs are those of the contiguous call and the rest of the forward is the same, bit for
 * bit; no gathered copy is made. fp8 pages (e4m3, e5m2; a descale per (page, kv head)) are
 * dequantized there a block at a time, in registers (fp8.h), each row times its page's descale
 * and rounded to the inputs' dtype: the values a gathered, dequantized copy would hold, so the
 * result is that copy's call's, bit for bit; a NaN or an infinity (a byte, a descale, or a
 * product) is found as in any other input.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attnkit.h"
#include "pool.h"

#define AK_FM 64  /* query rows per work item */
#define AK_FN AK_FLASH_BLOCK /* keys per block */
#define AK_FR 4   /* query rows per register group */
#define AK_FD AK_FLASH_MAX_DIM /* largest head dim */

/* ak_flash_args and ak_flash_grads: attnkit.h */

/* floats of workspace one worker needs (forward: 0, backward: 1) */
#define AK_WS_FWD (2 * AK_FM * AK_FD + AK_FM * AK_FN)
#define AK_SB 4 /* most key blocks of one backward item */
#define AK_WS_BWD (5 * AK_SB * AK_FN * AK_FD + 3 * AK_FM * AK_FD + 3 * AK_FM * AK_FN)

#if defined(__AVX512F__)
#include <immintrin.h>
#define AK_FLASH_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "avx2_as_512.h" /* the same code on pairs of 256-bit registers */
#define AK_FLASH_SIMD 1
#endif

#if defined(__AVX512F__)
/* Keeps four loaded vectors in registers: without it the compiler folds each load into the
 * four multiply-adds that read it, four loads instead of one, free where a 512-bit load is
 * one operation and the limit where it is two (Zen 4: the matrix products ran at two thirds
 * of the multiply-add rate). */
#define AK_HOLD4(a, b, c, e) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(e))
#else
/* the same for two 256-bit vectors (the AVX2 products' operands) */
#define AK_HOLD2(a, b) __asm__("" : "+x"(a), "+x"(b))
#endif

#if defined(AK_FLASH_SIMD)
#include "fp8.h"

static inline __m512 ak_load_row16(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dtype == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lanes of x that are NaN or infinite (x * 0 is NaN exactly there) */
static inline __mmask16 ak_nonfinite(__m512 x) {
    const __m512 z = _mm512_setzero_ps();
    return _mm512_cmp_ps_mask(_mm512_mul_ps(x, z), z, _CMP_NEQ_UQ);
}

/* 16-bit lanes (bfloat16 bits) whose exponent is all ones: NaN or infinite */
static inline __mmask32 ak_nonfinite_bf16(__m512i x) {
    const __m512i e = _mm512_set1_epi16(0x7f80);
    return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
}

static inline void ak_flag_bad(const ak_flash_args *a) {
    __atomic_store_n(a->bad, 1, __ATOMIC_RELAXED);
}

/* x to 16 elements of dtype at p + i (bfloat16 rounded to nearest even as torch's casts) */
static inline void ak_store_row16(void *p, int dtype, int64_t i, __m512 x) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    __m256i h;
    if (dtype == 2) {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        const __m512i u = _mm512_castps_si512(x);
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
            16);
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        const __m512i qn = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, qn));
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

/* Which of keys j0 .. j0 + 63 (j0 a multiple of 64) of row i, batch/head word c2 the dropout
 * keeps, as four masks of 16 keys: keys j0 + 16 w + t take word w of the Philox call with
 * counter (j0 / 4 + t, i, c2, offset) and key (seed mod 2^32, seed / 2^32), so the block
 * takes 16 calls, two registers of 8 counters (one a 64-bit lane: _mm512_mul_epu32 reads the
 * low 32 bits, so the words may carry garbage above them until the end), as philox.c does. */
_Static_assert(AK_FN == 64, "ak_keep64 draws the keep masks of one 64-key block");
static inline void ak_keep64(const ak_flash_args *a, int32_t j0, int64_t i, uint32_t c2,
                             __mmask16 keep[4]) {
    const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m1 = _mm512_set1_epi64(0xCD9E8D57u);
    const __m512i j8 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    __m512i xa0 = _mm512_add_epi64(j8, _mm512_set1_epi64(j0 >> 2));
    __m512i xb0 = _mm512_add_epi64(j8, _mm512_set1_epi64((j0 >> 2) + 8));
    __m512i xa1 = _mm512_set1_epi64((uint32_t)i), xb1 = xa1;
    __m512i xa2 = _mm512_set1_epi64(c2), xb2 = xa2;
    __m512i xa3 = _mm512_set1_epi64(a->drop_offset), xb3 = xa3;
    uint32_t key0 = (uint32_t)(a->drop_seed & 0xFFFFFFFFu), key1 = (uint32_t)(a->drop_seed >> 32);
    for (int r = 0; r < 10; ++r) {
        const __m512i k0 = _mm512_set1_epi64(key0), k1 = _mm512_set1_epi64(key1);
        const __m512i pa0 = _mm512_mul_epu32(xa0, m0), pa1 = _mm512_mul_epu32(xa2, m1);
        const __m512i pb0 = _mm512_mul_epu32(xb0, m0), pb1 = _mm512_mul_epu32(xb2, m1);
        xa0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pa1, 32), xa1, k0, 0x96);
        xa2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pa0, 32), xa3, k1, 0x96);
        xb0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pb1, 32), xb1, k0, 0x96);
        xb2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pb0, 32), xb3, k1, 0x96);
        xa1 = pa1, xa3 = pa0, xb1 = pb1, xb3 = pb0;
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
    }
    const __m512i thr = _mm512_set1_epi32((int)a->drop_threshold);
    const __m512i xa[4] = {xa0, xa1, xa2, xa3}, xb[4] = {xb0, xb1, xb2, xb3};
    for (int w = 0; w < 4; w++) {
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(xa[w])),
                                             _mm512_cvtepi64_epi32(xb[w]), 1);
        keep[w] = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(x, 8), thr);
    }
}

/* 2^x for x <= 0 (NaN stays NaN, -inf gives 0): x = n + f, |f| <= 1/2, 2^f by the polynomial
 * c[0] + c[1] f + ... of degree `deg` (a constant where it is inlined), times 2^n by scalef */
static inline __m512 ak_exp2_poly(__m512 x, const float *c, int deg) {
    x = _mm512_max_ps(_mm512_set1_ps(-160.0f), x); /* NaN in x is kept (second operand) */
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[deg]);
    for (int i = deg - 1; i >= 0; i--) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* fitted for relative error with 2^0 exactly 1: degree 5 below 2.6e-7; degree 4 below 4.5e-6,
 * for weights then rounded to bfloat16 (relative 3.9e-3) for the bfloat16 dot products */
static const float AK_EXP2_C5[6] = {1.0f, 6.93146288e-1f, 2.40221381e-1f, 5.55148013e-2f,
                                    9.67658684e-3f, 1.30842137e-3f};
static const float AK_EXP2_C4[5] = {1.0f, 6.93113625e-1f, 2.40234613e-1f, 5.59631027e-2f,
                                    9.61857196e-3f};

static inline __m512 ak_exp2(__m512 x) { return ak_exp2_poly(x, AK_EXP2_C5, 5); }
static inline __m512 ak_exp2_bf(__m512 x) { return ak_exp2_poly(x, AK_EXP2_C4, 4); }

/* tanh(x) = sign(x) (1 - E) / (1 + E), E = 2^(-2 log2(e) |x|); an odd polynomial near 0 */
static inline __m512 ak_tanh(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 ax = _mm512_andnot_ps(sign, x);
    const __m512 e = ak_exp2(_mm512_mul_ps(_mm512_min_ps(ax, _mm512_set1_ps(9.0f)),
                                           _mm512_set1_ps(-2.8853900817779268f)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e),
                                     _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 sm = _mm512_fmadd_ps(x2, _mm512_set1_ps(-17.0f / 315.0f),
                                _mm512_set1_ps(2.0f / 15.0f));
    sm = _mm512_fmadd_ps(x2, sm, _mm512_set1_ps(-1.0f / 3.0f));
    sm = _mm512_fmadd_ps(_mm512_mul_ps(x2, ax), sm, ax);
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.125f),
                                                             _CMP_LT_OQ), big, sm);
    return _mm512_or_ps(t, _mm512_and_ps(x, sign));
}

#if defined(__AVX512F__)
/* lane r: the maximum (sum) of row r's 16 lanes, four rows in one butterfly */
static inline __m512 ak_rows4_pairs(__m512 a, __m512 b, int add) {
    return add ? _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
               : _mm512_max_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

static inline __m128 ak_rows4(__m512 x0, __m512 x1, __m512 x2, __m512 x3, int add) {
    const __m512 a = ak_rows4_pairs(x0, x1, add), b = ak_rows4_pairs(x2, x3, add);
    const __m512 lo = _mm512_shuffle_ps(a, b, 0x44), hi = _mm512_shuffle_ps(a, b, 0xEE);
    __m512 c = add ? _mm512_add_ps(lo, hi) : _mm512_max_ps(lo, hi);
    __m512 t = _mm512_shuffle_f32x4(c, c, 0x4E);
    c = add ? _mm512_add_ps(c, t) : _mm512_max_ps(c, t);
    t = _mm512_shuffle_f32x4(c, c, 0xB1);
    c = add ? _mm512_add_ps(c, t) : _mm512_max_ps(c, t);
    return _mm512_castps512_ps128(c);
}

static inline __m128 ak_exp2_4(__m128 x) {
    return _mm512_castps512_ps128(ak_exp2(_mm512_zextps128_ps512(x)));
}
#else
static inline __m128 ak_rows4(__m512 x0, __m512 x1, __m512 x2, __m512 x3, int add) {
    return add ? _mm_setr_ps(_mm512_reduce_add_ps(x0), _mm512_reduce_add_ps(x1),
                             _mm512_reduce_add_ps(x2), _mm512_reduce_add_ps(x3))
               : _mm_setr_ps(_mm512_reduce_max_ps(x0), _mm512_reduce_max_ps(x1),
                             _mm512_reduce_max_ps(x2), _mm512_reduce_max_ps(x3));
}

static inline __m128 ak_exp2_4(__m128 x) {
    float v[16] = {0}, y[16];
    _mm_storeu_ps(v, x);
    _mm512_storeu_ps(y, ak_exp2(_mm512_loadu_ps(v)));
    return _mm_loadu_ps(y);
}
#endif
#define ak_rows4_max(x0, x1, x2, x3) ak_rows4(x0, x1, x2, x3, 0)
#define ak_rows4_add(x0, x1, x2, x3) ak_rows4(x0, x1, x2, x3, 1)

/* acc[r][u] = o[r * stride + c0 + 16 u] (times alpha[r] unless alpha is NULL), 4 x 4 vectors;
 * and back */
static inline void ak_load44(__m512 acc[4][4], const float *o, int64_t stride, int64_t c0,
                             const float *alpha) {
    for (int r = 0; r < 4; r++) {
        const __m512 al = _mm512_set1_ps(alpha != NULL ? alpha[r] : 1.0f);
        for (int u = 0; u < 4; u++)
            acc[r][u] = _mm512_mul_ps(_mm512_loadu_ps(o + r * stride + c0 + 16 * u), al);
    }
}

static inline void ak_store44(float *o, int64_t stride, int64_t c0, __m512 acc[4][4]) {
    for (int r = 0; r < 4; r++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + r * stride + c0 + 16 * u, acc[r][u]);
}

#if defined(__AVX512BF16__)
#define AK_FLASH_BF16 1
/* S = Qg Kt in bfloat16 pairs: q rows of dp 32-bit pairs, kt[cp][AK_FN] pairs of one key */
static inline void ak_scores_bf(const uint32_t *q, int64_t dp, const uint32_t *kt,
                                __m512 s[AK_FR][4]) {
    for (int r = 0; r < AK_FR; r++)
        for (int v = 0; v < 4; v++) s[r][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dp; c++) {
        const uint32_t *kc = kt + c * AK_FN;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)kc);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(kc + 16));
        __m512bh k2 = (__m512bh)_mm512_loadu_si512((const void *)(kc + 32));
        __m512bh k3 = (__m512bh)_mm512_loadu_si512((const void *)(kc + 48));
        AK_HOLD4(k0, k1, k2, k3);
        for (int r = 0; r < AK_FR; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * dp + c]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
            s[r][2] = _mm512_dpbf16_ps(s[r][2], qb, k2);
            s[r][3] = _mm512_dpbf16_ps(s[r][3], qb, k3);
        }
    }
}

/* O[rows] = O * alpha + P V over njp key pairs: p rows of AK_FN / 2 pairs (bfloat16),
 * vp[jp][dv] the two keys' values of each column as one pair */
static inline void ak_pv_bf(float *o, int64_t dv, const float *alpha, const uint32_t *p,
                            const uint32_t *vp, int64_t njp) {
    int64_t c0 = 0;
    for (; c0 + 64 <= dv; c0 += 64) {
        __m512 acc[AK_FR][4];
        ak_load44(acc, o, dv, c0, alpha);
        for (int64_t j = 0; j < njp; j++) {
            const uint32_t *vr = vp + j * dv + c0;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)vr);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(vr + 16));
            __m512bh v2 = (__m512bh)_mm512_loadu_si512((const void *)(vr + 32));
            __m512bh v3 = (__m512bh)_mm512_loadu_si512((const void *)(vr + 48));
            AK_HOLD4(v0, v1, v2, v3);
            for (int r = 0; r < AK_FR; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p[r * (AK_FN / 2) + j]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pb, v2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pb, v3);
            }
        }
        ak_store44(o, dv, c0, acc);
    }
    for (; c0 < dv; c0 += 16) {
        __m512 acc[AK_FR];
        for (int r = 0; r < AK_FR; r++)
            acc[r] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dv + c0), _mm512_set1_ps(alpha[r]));
        for (int64_t j = 0; j < njp; j++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512((const void *)(vp + j * dv + c0));
            for (int r = 0; r < AK_FR; r++)
                acc[r] = _mm512_dpbf16_ps(
                    acc[r], (__m512bh)_mm512_set1_epi32((int)p[r * (AK_FN / 2) + j]), vv);
        }
        for (int r = 0; r < AK_FR; r++) _mm512_storeu_ps(o + r * dv + c0, acc[r]);
    }
}

/* acc[64 keys][cols] += X^T Y over 2 RP rows in bfloat16 pairs of rows: xp[rp][AK_FN] holds
 * (X[2rp][j], X[2rp + 1][j]), yp[rp][cols] holds (Y[2rp][c], Y[2rp + 1][c]) */
static inline void ak_tn_bf(float *acc, int64_t cols, const uint32_t *xp, const uint32_t *yp,
                            int64_t RP, int64_t nk) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        int64_t c0 = 0;
        for (; c0 + 64 <= cols; c0 += 64) {
            __m512 t[4][4];
            ak_load44(t, acc + j0 * cols, cols, c0, NULL);
            for (int64_t r = 0; r < RP; r++) {
                const uint32_t *yr = yp + r * cols + c0;
                __m512bh y0 = (__m512bh)_mm512_loadu_si512((const void *)yr);
                __m512bh y1 = (__m512bh)_mm512_loadu_si512((const void *)(yr + 16));
                __m512bh y2 = (__m512bh)_mm512_loadu_si512((const void *)(yr + 32));
                __m512bh y3 = (__m512bh)_mm512_loadu_si512((const void *)(yr + 48));
                AK_HOLD4(y0, y1, y2, y3);
                for (int jj = 0; jj < 4; jj++) {
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[r * AK_FN + j0 + jj]);
                    t[jj][0] = _mm512_dpbf16_ps(t[jj][0], xb, y0);
                    t[jj][1] = _mm512_dpbf16_ps(t[jj][1], xb, y1);
                    t[jj][2] = _mm512_dpbf16_ps(t[jj][2], xb, y2);
                    t[jj][3] = _mm512_dpbf16_ps(t[jj][3], xb, y3);
                }
            }
            ak_store44(acc + j0 * cols, cols, c0, t);
        }
        for (; c0 < cols; c0 += 16) {
            __m512 t[4];
            for (int jj = 0; jj < 4; jj++) t[jj] = _mm512_loadu_ps(acc + (j0 + jj) * cols + c0);
            for (int64_t r = 0; r < RP; r++) {
                const __m512bh yv = (__m512bh)_mm512_loadu_si512((const void *)(yp + r * cols + c0));
                for (int jj = 0; jj < 4; jj++)
                    t[jj] = _mm512_dpbf16_ps(
                        t[jj], (__m512bh)_mm512_set1_epi32((int)xp[r * AK_FN + j0 + jj]), yv);
            }
            for (int jj = 0; jj < 4; jj++) _mm512_storeu_ps(acc + (j0 + jj) * cols + c0, t[jj]);
        }
    }
}
#endif

/* 16 columns of rows a and b (bfloat16 bits) as 16 pairs (a[c], b[c]) */
static inline __m512i ak_pair16(const uint16_t *ra, const uint16_t *rb) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)ra));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)rb));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

#if defined(__AVX512F__)
/* 16 x 16 32-bit words in place: r[i] (word c of row i in lane c) becomes column i */
static inline void ak_transpose16(__m512i r[16]) {
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
#endif

/* ---- packing: key blocks transposed, values to float32 ------------------------------------ */

/* The keys batch row n has: Lk, or with a block table its kv_len[n] (clamped to [0, Lk]). */
static inline int64_t ak_keys_of(const ak_flash_args *a, int64_t n) {
    if (a->kv_len == NULL) return a->Lk;
    const int64_t l = a->kv_len[n];
    return l < 0 ? 0 : l < a->Lk ? l : a->Lk;
}

/* rows[jj]: where key j0 + jj of (batch row n, kv head h) of x (k or v, strides s) starts,
 * for jj < nk: at x + n s[0] + h s[1] + j s[2], or with a block table in row j % page of
 * page table[n][j / page], at x + page s[0] + h s[1] + (j % page) s[2]. */
static inline void ak_block_rows(const ak_flash_args *a, const void *x, const int64_t s[3],
                                 int64_t n, int64_t h, int64_t j0, int64_t nk,
                                 const char *rows[AK_FN]) {
    const int64_t esz = a->fp8 ? 1 : a->dtype == 0 ? 4 : 2;
    const char *base = (const char *)x + h * s[1] * esz;
    if (a->table == NULL) {
        for (int64_t jj = 0; jj < nk; jj++) rows[jj] = base + (n * s[0] + (j0 + jj) * s[2]) * esz;
        return;
    }
    const int64_t *pages = a->table + n * a->table_w;
    for (int64_t jj = 0; jj < nk; jj++) {
        const int64_t j = j0 + jj;
        rows[jj] = base + (pages[j / a->page] * s[0] + j % a->page * s[2]) * esz;
    }
}

/* bf16dot: one block's keys as 32-bit pairs of their dims, transposed (one key a lane, zero
 * past nk), into kd; its values as pairs of keys' rows (vd[jp][c] = (V[2jp][c], V[2jp+1][c]))
 * into vd. Returns whether an input was not finite. */
static int ak_pack_bf(const ak_flash_args *a, const char *kr[AK_FN], const char *vr[AK_FN],
                      int64_t nk, uint32_t *kd, uint32_t *vd) {
    const int64_t d = a->d, dv = a->dv;
    int bad = 0;
#if defined(__AVX512F__)
    for (int64_t j16 = 0; j16 < AK_FN; j16 += 16) /* 16 keys x 16 pairs at once */
        for (int64_t c0 = 0; c0 < d / 2; c0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                r[i] = j16 + i < nk ? _mm512_loadu_si512(
                                          (const void *)((const uint32_t *)kr[j16 + i] + c0))
                                    : _mm512_setzero_si512();
                bad |= ak_nonfinite_bf16(r[i]) != 0;
            }
            ak_transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512((void *)(kd + (c0 + i) * AK_FN + j16), r[i]);
        }
#else
    for (int64_t jj = 0; jj < nk; jj++)
        for (int64_t c = 0; c < d; c += 32)
            bad |= ak_nonfinite_bf16(_mm512_loadu_si512(
                       (const void *)((const uint16_t *)kr[jj] + c))) != 0;
    for (int64_t c = 0; c < d / 2; c++)
        for (int64_t jj = 0; jj < AK_FN; jj++)
            kd[c * AK_FN + jj] = jj < nk ? ((const uint32_t *)kr[jj])[c] : 0u;
#endif
    for (int64_t jp = 0; jp < (nk + 1) / 2; jp++) {
        const int odd = 2 * jp + 1 < nk; /* (else the pair's second key is zero) */
        const uint16_t *r0 = (const uint16_t *)vr[2 * jp];
        const uint16_t *r1 = (const uint16_t *)vr[2 * jp + odd];
        for (int64_t c0 = 0; c0 < dv; c0 += 16) {
            const __m512i both = odd ? ak_pair16(r0 + c0, r1 + c0)
                                     : _mm512_cvtepu16_epi32(
                                           _mm256_loadu_si256((const __m256i *)(r0 + c0)));
            bad |= ak_nonfinite_bf16(both) != 0;
            _mm512_storeu_si512((void *)(vd + jp * dv + c0), both);
        }
    }
    return bad;
}

/* float32 arithmetic: one block's keys transposed to float32 (zero past nk) into kt, and its
 * values as float32 rows into vd (NULL: float32 values read in place, only checked here).
 * Returns whether an input was not finite. */
static int ak_pack_f32(const ak_flash_args *a, const char *kr[AK_FN], const char *vr[AK_FN],
                       int64_t nk, float *kt, float *vd) {
    const int64_t d = a->d, dv = a->dv;
    int bad = 0;
    float tile[AK_FN][16];
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
        for (int64_t jj = 0; jj < AK_FN; jj++) {
            __m512 x = _mm512_setzero_ps();
            if (jj < nk) x = ak_load_row16(kr[jj], a->dtype, c0);
            bad |= ak_nonfinite(x) != 0;
            _mm512_storeu_ps(tile[jj], x);
        }
        for (int64_t c = 0; c < 16; c++) {
            float *row = kt + (c0 + c) * AK_FN;
            for (int64_t jj = 0; jj < AK_FN; jj++) row[jj] = tile[jj][c];
        }
    }
    for (int64_t jj = 0; jj < nk; jj++)
        for (int64_t c0 = 0; c0 < dv; c0 += 16) {
            const __m512 x = ak_load_row16(vr[jj], a->dtype, c0);
            bad |= ak_nonfinite(x) != 0;
            if (vd != NULL) _mm512_storeu_ps(vd + jj * dv + c0, x);
        }
    return bad;
}

/* fp8 pages: the nk rows of one block of keys or values (dim c each, at rows[]) of kv head h
 * of batch row n, dequantized (times the descale of each row's page: desc (P, Hkv)) and
 * rounded to dtype into buf (AK_FN rows of AK_FD elements); rows[] then point there. */
static void ak_stage_fp8(const ak_flash_args *a, const float *desc, int64_t n, int64_t h,
                         int64_t j0, int64_t nk, int64_t c, const char *rows[AK_FN],
                         char *buf) {
    const int64_t esz = a->dtype == 0 ? 4 : 2;
    const int64_t *pages = a->table + n * a->table_w;
    const float unit = AK_FP8_UNIT(a->fp8);
    for (int64_t jj = 0; jj < nk; jj++) {
        const __m512 sc = _mm512_set1_ps(desc[pages[(j0 + jj) / a->page] * a->Hkv + h] * unit);
        char *dst = buf + jj * AK_FD * esz;
        for (int64_t c0 = 0; c0 < c; c0 += 16) {
            const __m512 x = _mm512_cvtph_ps(ak_fp8_half16((const uint8_t *)rows[jj] + c0,
                                                           a->fp8));
            ak_store_row16(dst, a->dtype, c0, _mm512_mul_ps(x, sc));
        }
        rows[jj] = dst;
    }
}

typedef struct {
    const ak_flash_args *a;
    int64_t nkb, next;
} ak_pack_ctx;

/* Packs the key blocks (batch row, kv head, block), in parallel; blocks past a row's keys
 * (a block table's row shorter than Lk) are never read, so not packed. */
static void ak_pack_worker(void *vctx, int w, int nw) {
    (void)w, (void)nw;
    ak_pack_ctx *ctx = vctx;
    const ak_flash_args *a = ctx->a;
    const int64_t d = a->d, dv = a->dv, nkb = ctx->nkb;
    const int64_t total = a->N * a->Hkv * nkb;
    int bad = 0;
    int64_t b0, b1;
    /* fp8 pages: one block's keys and values dequantized (ak_stage_fp8) */
    char kbuf[AK_FN * AK_FD * 4] __attribute__((aligned(64)));
    char vbuf[AK_FN * AK_FD * 4] __attribute__((aligned(64)));
    while (ak_next_block(&ctx->next, 4, total, &b0, &b1)) {
        for (int64_t t = b0; t < b1; t++) {
            const int64_t kb = t % nkb, nh = t / nkb, n = nh / a->Hkv, h = nh % a->Hkv;
            const int64_t j0 = kb * AK_FN, keys = ak_keys_of(a, n);
            const int64_t nk = keys - j0 < AK_FN ? keys - j0 : AK_FN;
            if (nk <= 0) continue;
            const char *kr[AK_FN], *vr[AK_FN];
            ak_block_rows(a, a->k, a->ks, n, h, j0, nk, kr);
            ak_block_rows(a, a->v, a->vs, n, h, j0, nk, vr);
            if (a->fp8) { /* (rows of dtype in kbuf, vbuf from here on) */
                ak_stage_fp8(a, a->kd, n, h, j0, nk, d, kr, kbuf);
                ak_stage_fp8(a, a->vd, n, h, j0, nk, dv, vr, vbuf);
            }
            if (a->bf16dot)
                bad |= ak_pack_bf(a, kr, vr, nk, (uint32_t *)a->kt + t * (d / 2) * AK_FN,
                                  (uint32_t *)a->vf + (nh * ((a->Lk + 1) / 2) + j0 / 2) * dv);
            else
                bad |= ak_pack_f32(a, kr, vr, nk, a->kt + t * d * AK_FN,
                                   a->vf != NULL ? a->vf + (nh * a->Lk + j0) * dv : NULL);
        }
    }
    if (bad) ak_flag_bad(a);
}

/* The score terms of one query row on one key block, in place on its four vectors of
 * scores (base 2, after the scale): softcap (with capd: 1 - tanh^2 stored there for the
 * backward), ALiBi, the relative table (tr: its entry for key j0 of this row), then the
 * visible interval [lo, hi) and the segment test unless the block is known full. */
static inline void ak_row_terms(const ak_flash_args *a, __m512 s[4], int32_t j0, float ipf,
                                float slope, const float *tr, int32_t lo, int32_t hi,
                                const int32_t *kseg, int32_t qsg, int full, float *capd) {
    static const float LOG2E = 1.4426950408889634f;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (a->softcap > 0.0f) {
        const __m512 inv = _mm512_set1_ps(1.0f / a->softcap);
        const __m512 cl = _mm512_set1_ps(a->softcap * LOG2E);
        for (int u = 0; u < 4; u++) {
            const __m512 th = ak_tanh(_mm512_mul_ps(s[u], inv));
            if (capd != NULL)
                _mm512_storeu_ps(capd + 16 * u, _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f)));
            s[u] = _mm512_mul_ps(th, cl);
        }
    }
    if (a->alibi) {
        const __m512 ip = _mm512_set1_ps(ipf), sl = _mm512_set1_ps(slope);
        for (int u = 0; u < 4; u++) {
            const __m512 jf = _mm512_cvtepi32_ps(
                _mm512_add_epi32(iota, _mm512_set1_epi32(j0 + 16 * u)));
            s[u] = _mm512_fnmadd_ps(sl, _mm512_abs_ps(_mm512_sub_ps(ip, jf)), s[u]);
        }
    }
    if (tr != NULL)
        for (int u = 0; u < 4; u++) s[u] = _mm512_add_ps(s[u], _mm512_loadu_ps(tr + 16 * u));
    if (!full) {
        const __m512i a0 = _mm512_set1_epi32(lo), a1 = _mm512_set1_epi32(hi);
        for (int u = 0; u < 4; u++) {
            const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(j0 + 16 * u));
            __mmask16 vis = _mm512_cmpge_epi32_mask(j, a0) & _mm512_cmplt_epi32_mask(j, a1);
            if (kseg != NULL)
                vis &= _mm512_cmpeq_epi32_mask(
                    _mm512_loadu_si512((const void *)(kseg + j0 + 16 * u)),
                    _mm512_set1_epi32(qsg));
            s[u] = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-INFINITY), s[u]);
        }
    }
}

/* ---- the forward ------------------------------------------------------------------------ */

typedef struct {
    const ak_flash_args *a;
    int64_t nkb, nqb, next;
} ak_fwd_ctx;

/* S = Qg Kt for AK_FR rows (q rows of stride d, prescaled) and one packed key block */
#if defined(__AVX512F__)
static inline void ak_scores(const float *q, int64_t d, const float *kt, __m512 s[AK_FR][4]) {
    for (int r = 0; r < AK_FR; r++)
        for (int v = 0; v < 4; v++) s[r][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        const float *kc = kt + c * AK_FN;
        __m512 k0 = _mm512_loadu_ps(kc), k1 = _mm512_loadu_ps(kc + 16);
        __m512 k2 = _mm512_loadu_ps(kc + 32), k3 = _mm512_loadu_ps(kc + 48);
        AK_HOLD4(k0, k1, k2, k3);
        for (int r = 0; r < AK_FR; r++) {
            const __m512 qb = _mm512_set1_ps(q[r * d + c]);
            s[r][0] = _mm512_fmadd_ps(qb, k0, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(qb, k1, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(qb, k2, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(qb, k3, s[r][3]);
        }
    }
}

#else
/* the same on 256-bit registers: the four rows by 16 keys at a time, eight accumulators, the
 * two key vectors in registers (a load and four broadcasts feed eight multiply-adds; with
 * 32 keys by two rows, the keys read as memory operands twice, it was ten) */
static inline void ak_scores(const float *q, int64_t d, const float *kt, __m512 s[AK_FR][4]) {
    for (int u = 0; u < 4; u++) {
        __m256 acc[AK_FR][2];
        for (int r = 0; r < AK_FR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c++) {
            const float *kc = kt + c * AK_FN + 16 * u;
            __m256 k0 = _mm256_loadu_ps(kc), k1 = _mm256_loadu_ps(kc + 8);
            AK_HOLD2(k0, k1);
            for (int r = 0; r < AK_FR; r++) {
                const __m256 qb = _mm256_broadcast_ss(q + r * d + c);
                acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < AK_FR; r++) s[r][u] = (__m512){acc[r][0], acc[r][1]};
    }
}
#endif

/* O[rows] = O * alpha + P V over nk keys, dv in chunks of 64 columns */
#if defined(__AVX512F__)
static inline void ak_pv(float *o, int64_t dv, const float *alpha, const float *p,
                         const float *v, int64_t vstride, int64_t nk) {
    int64_t c0 = 0;
    for (; c0 + 64 <= dv; c0 += 64) {
        __m512 acc[AK_FR][4];
        ak_load44(acc, o, dv, c0, alpha);
        for (int64_t j = 0; j < nk; j++) {
            const float *vr = v + j * vstride + c0;
            __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
            __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
            AK_HOLD4(v0, v1, v2, v3);
            for (int r = 0; r < AK_FR; r++) {
                const __m512 pb = _mm512_set1_ps(p[r * AK_FN + j]);
                acc[r][0] = _mm512_fmadd_ps(pb, v0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(pb, v1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(pb, v2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(pb, v3, acc[r][3]);
            }
        }
        ak_store44(o, dv, c0, acc);
    }
    for (; c0 < dv; c0 += 16) {
        __m512 acc[AK_FR];
        for (int r = 0; r < AK_FR; r++)
            acc[r] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dv + c0), _mm512_set1_ps(alpha[r]));
        for (int64_t j = 0; j < nk; j++) {
            const __m512 vv = _mm512_loadu_ps(v + j * vstride + c0);
            for (int r = 0; r < AK_FR; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * AK_FN + j]), vv, acc[r]);
        }
        for (int r = 0; r < AK_FR; r++) _mm512_storeu_ps(o + r * dv + c0, acc[r]);
    }
}

#else
/* the same on 256-bit registers: the four rows by 16 columns, eight accumulators, the two
 * value vectors in registers (as ak_scores) */
static inline void ak_pv(float *o, int64_t dv, const float *alpha, const float *p,
                         const float *v, int64_t vstride, int64_t nk) {
    for (int64_t c0 = 0; c0 < dv; c0 += 16) {
        __m256 acc[AK_FR][2];
        for (int r = 0; r < AK_FR; r++)
            for (int u = 0; u < 2; u++)
                acc[r][u] = _mm256_mul_ps(_mm256_loadu_ps(o + r * dv + c0 + 8 * u),
                                          _mm256_set1_ps(alpha[r]));
        for (int64_t j = 0; j < nk; j++) {
            __m256 v0 = _mm256_loadu_ps(v + j * vstride + c0);
            __m256 v1 = _mm256_loadu_ps(v + j * vstride + c0 + 8);
            AK_HOLD2(v0, v1);
            for (int r = 0; r < AK_FR; r++) {
                const __m256 pb = _mm256_broadcast_ss(p + r * AK_FN + j);
                acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < AK_FR; r++)
            for (int u = 0; u < 2; u++) _mm256_storeu_ps(o + r * dv + c0 + 8 * u, acc[r][u]);
    }
}
#endif

/* Rows i0 .. i0 + nrows - 1 of (batch row n, query head h) from their running maxima m (base
 * 2), sums l and accumulated outputs obuf: out, lse and (where asked for) the row maxima in
 * natural units. */
static void ak_fwd_rows_out(const ak_flash_args *a, int64_t n, int64_t h, int64_t i0,
                            int64_t nrows, const float *m, const float *l, const float *obuf) {
    static const float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
    const int64_t dv = a->dv;
    const size_t oe = a->out_dtype == 0 ? 4 : 2;
    const float sink = a->sinks ? a->sinks[h] * LOG2E : -INFINITY;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = (n * a->Hq + h) * a->Lq + i0 + r;
        char *orow = (char *)a->out + row * dv * oe;
        if (a->mx != NULL) a->mx[row] = m[r] * LN2; /* (-inf for a row that saw no key) */
        float mf = m[r] > sink ? m[r] : sink;
        if (mf == -INFINITY || !(l[r] > 0.0f || sink > -INFINITY)) {
            memset(orow, 0, (size_t)dv * oe);
            a->lse[row] = -INFINITY;
            continue;
        }
        const float w = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mf);
        const float total = l[r] * w + (sink > -INFINITY ? exp2f(sink - mf) : 0.0f);
        const __m512 f = _mm512_set1_ps(w / total * (a->dropout ? a->drop_scale : 1.0f));
        for (int64_t c = 0; c < dv; c += 16)
            ak_store_row16(orow, a->out_dtype, c,
                           _mm512_mul_ps(_mm512_loadu_ps(obuf + r * dv + c), f));
        a->lse[row] = (mf + log2f(total)) * LN2;
    }
}

static void ak_fwd_item(const ak_flash_args *a, int64_t nkb, int64_t n, int64_t h, int64_t i0,
                        int64_t i1, int worker) {
    const int64_t d = a->d, dv = a->dv, Lk = ak_keys_of(a, n); /* (row n's keys) */
    const int64_t hk = h / (a->Hq / a->Hkv);
    const int64_t nrows = i1 - i0;
    const int64_t groups = (nrows + AK_FR - 1) / AK_FR;
    const int64_t padded = groups * AK_FR;
    static const float LOG2E = 1.4426950408889634f;
    const int capped = a->softcap > 0.0f;
    const float qmul = capped ? a->scale : a->scale * LOG2E;
    /* bfloat16 dot products give unscaled scores: with no score term to add, the scale goes
     * into the weights' exponent (one multiply-subtract) and the maxima (four rows at once) */
    const int fold = a->bf16dot && !capped && a->alibi == NULL && a->rel == NULL && qmul > 0.0f;
    float *qbuf = a->ws + (int64_t)worker * AK_WS_FWD;
    float *obuf = qbuf + AK_FM * AK_FD, *pbuf = obuf + AK_FM * AK_FD;
    float m[AK_FM], l[AK_FM];
    int32_t lo[AK_FM], hi[AK_FM], qs[AK_FM];
    float ipf[AK_FM];
    const size_t esz = a->dtype == 0 ? 4 : 2;
    const int64_t ebuf = a->bf16dot ? 2 : 4; /* bytes an element of a Q or P row of qbuf/pbuf */
    const char *qbase = (const char *)a->q + (n * a->qs[0] + h * a->qs[1]) * esz;
    int32_t kmin = INT32_MAX, kmax = 0;
    for (int64_t r = 0; r < padded; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        if (r < nrows) {
            const int64_t i = i0 + r;
            const char *qr = qbase + i * a->qs[2] * esz;
            __mmask16 badq = 0;
            if (a->bf16dot) {
                memcpy(qbuf + r * (d / 2), qr, (size_t)d * 2); /* raw pairs, scaled on S */
                for (int64_t c = 0; c < d; c += 32)
                    badq |= ak_nonfinite_bf16(_mm512_loadu_si512(
                                (const void *)((const uint16_t *)qr + c))) != 0;
            } else {
                for (int64_t c = 0; c < d; c += 16) {
                    const __m512 x = ak_load_row16(qr, a->dtype, c);
                    badq |= ak_nonfinite(x);
                    _mm512_storeu_ps(qbuf + r * d + c, _mm512_mul_ps(x, _mm512_set1_ps(qmul)));
                }
            }
            if (badq) ak_flag_bad(a);
            int32_t a0 = a->lo[n * a->bounds_bstride + i], a1 = a->hi[n * a->bounds_bstride + i];
            if (a0 < 0) a0 = 0;
            if (a1 > Lk) a1 = (int32_t)Lk;
            lo[r] = a0, hi[r] = a1;
            if (a0 < a1) {
                kmin = a0 < kmin ? a0 : kmin;
                kmax = a1 > kmax ? a1 : kmax;
            }
            qs[r] = a->qseg ? a->qseg[n * a->qseg_bstride + i] : 0;
            ipf[r] = a->ipos ? (float)a->ipos[n * a->ipos_bstride + i] : 0.0f;
        } else {
            memset((char *)qbuf + r * d * ebuf, 0, (size_t)(d * ebuf));
            lo[r] = 0, hi[r] = 0, qs[r] = 0, ipf[r] = 0.0f;
        }
        memset(obuf + r * dv, 0, (size_t)dv * 4);
    }
    const float *ktb = a->kt + (n * a->Hkv + hk) * nkb * d * AK_FN / (a->bf16dot ? 2 : 1);
    const float *vb;
    int64_t vstride;
    if (a->bf16dot) {
        vb = a->vf + (n * a->Hkv + hk) * ((a->Lk + 1) / 2) * dv;
        vstride = dv;
    } else if (a->vf != NULL) {
        vb = a->vf + (n * a->Hkv + hk) * a->Lk * dv;
        vstride = dv;
    } else {
        vb = (const float *)a->v + n * a->vs[0] + hk * a->vs[1];
        vstride = a->vs[2];
    }
    const float slope = a->alibi ? a->alibi[n * a->alibi_bstride + h] : 0.0f;
    const float *rel = a->rel ? a->rel + h * a->rel_hstride + a->rel_base - i0 : NULL;
    const int32_t *kseg = a->kseg ? a->kseg + n * a->kseg_bstride : NULL;
    const int64_t kb0 = kmax > kmin ? kmin / AK_FN : 0;
    const int64_t kb1 = kmax > kmin ? (kmax + AK_FN - 1) / AK_FN : 0;
    for (int64_t kb = kb0; kb < kb1; kb++) {
        const int32_t j0 = (int32_t)(kb * AK_FN);
        const int64_t nk = Lk - j0 < AK_FN ? Lk - j0 : AK_FN;
        const float *kt = ktb + kb * d * AK_FN / (a->bf16dot ? 2 : 1);
        float alpha[AK_FM];
        uint8_t live[AK_FM / AK_FR];
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * AK_FR;
            int any = 0, full = 1;
            live[g] = 0;
            for (int r = 0; r < AK_FR; r++) {
                const int32_t a0 = lo[r0 + r], a1 = hi[r0 + r];
                any |= a0 < a1 && a0 < j0 + nk && a1 > j0;
                full &= a0 <= j0 && a1 >= j0 + AK_FN;
            }
            if (!any) continue;
            live[g] = 1;
            if (kseg != NULL && full) {
                for (int r = 0; r < AK_FR && full; r++)
                    for (int64_t jj = 0; jj < AK_FN; jj++)
                        if (kseg[j0 + jj] != qs[r0 + r]) {
                            full = 0;
                            break;
                        }
            }
            __m512 s[AK_FR][4];
#ifdef AK_FLASH_BF16
            if (a->bf16dot) {
                ak_scores_bf((const uint32_t *)qbuf + r0 * (d / 2), d / 2, (const uint32_t *)kt,
                             s);
                if (!fold) {
                    const __m512 qm = _mm512_set1_ps(qmul);
                    for (int r = 0; r < AK_FR; r++)
                        for (int u = 0; u < 4; u++) s[r][u] = _mm512_mul_ps(s[r][u], qm);
                }
            } else
#endif
                ak_scores(qbuf + r0 * d, d, kt, s);
            /* the group's four rows together: their maxima in one 4-row reduction, the new
             * running maxima and rescales as one vector (a row that sees nothing yet keeps
             * weight 0 on base 0: its scores are all -inf) */
            __m512 rv[AK_FR];
            for (int r = 0; r < AK_FR; r++) {
                const int64_t rr = r0 + r;
                ak_row_terms(a, s[r], j0, ipf[rr], slope, rel != NULL ? rel + j0 - rr : NULL,
                             lo[rr], hi[rr], kseg, qs[rr], full, NULL);
                rv[r] = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]),
                                      _mm512_max_ps(s[r][2], s[r][3]));
            }
            __m128 mx = ak_rows4_max(rv[0], rv[1], rv[2], rv[3]);
            if (fold) mx = _mm_mul_ps(mx, _mm_set1_ps(qmul));
            const __m128 mold = _mm_loadu_ps(m + r0);
            const __m128 mnew = _mm_max_ps(mx, mold);
            const __m128 base = _mm_blendv_ps(mnew, _mm_setzero_ps(),
                                              _mm_cmpeq_ps(mnew, _mm_set1_ps(-INFINITY)));
            const __m128 al = ak_exp2_4(_mm_sub_ps(mold, base));
            float bs[AK_FR];
            _mm_storeu_ps(m + r0, mnew);
            _mm_storeu_ps(alpha + r0, al);
            _mm_storeu_ps(bs, base);
            for (int r = 0; r < AK_FR; r++) {
                const int64_t rr = r0 + r;
                __m512 p[4];
                if (fold) {
                    const __m512 qm = _mm512_set1_ps(qmul), nb = _mm512_set1_ps(-bs[r]);
                    for (int u = 0; u < 4; u++)
                        p[u] = ak_exp2_bf(_mm512_fmadd_ps(s[r][u], qm, nb));
                } else if (a->bf16dot) {
                    const __m512 mb = _mm512_set1_ps(bs[r]);
                    for (int u = 0; u < 4; u++) p[u] = ak_exp2_bf(_mm512_sub_ps(s[r][u], mb));
                } else {
                    const __m512 mb = _mm512_set1_ps(bs[r]);
                    for (int u = 0; u < 4; u++) p[u] = ak_exp2(_mm512_sub_ps(s[r][u], mb));
                }
                rv[r] = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
                if (a->dropout) { /* the softmax sums every weight; P V only the kept ones */
                    __mmask16 keep[4];
                    ak_keep64(a, j0, i0 + rr, (uint32_t)(h + (n << 16)), keep);
                    for (int u = 0; u < 4; u++) p[u] = _mm512_maskz_mov_ps(keep[u], p[u]);
                }
#ifdef AK_FLASH_BF16
                if (a->bf16dot) {
                    uint16_t *pr = (uint16_t *)pbuf + rr * AK_FN;
                    _mm512_storeu_si512((void *)pr, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
                    _mm512_storeu_si512((void *)(pr + 32),
                                        (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
                } else
#endif
                    for (int u = 0; u < 4; u++) _mm512_storeu_ps(pbuf + rr * AK_FN + 16 * u, p[u]);
            }
            const __m128 sum = ak_rows4_add(rv[0], rv[1], rv[2], rv[3]);
            _mm_storeu_ps(l + r0, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(l + r0), al), sum));
        }
        /* P V once every group's weights are written (not read back straight after the
         * stores that wrote them) */
        for (int64_t g = 0; g < groups; g++) {
            if (!live[g]) continue;
            const int64_t r0 = g * AK_FR;
#ifdef AK_FLASH_BF16
            if (a->bf16dot)
                ak_pv_bf(obuf + r0 * dv, dv, alpha + r0, (const uint32_t *)pbuf + r0 * (AK_FN / 2),
                         (const uint32_t *)vb + (j0 / 2) * dv, (nk + 1) / 2);
            else
#endif
                ak_pv(obuf + r0 * dv, dv, alpha + r0, pbuf + r0 * AK_FN, vb + j0 * vstride,
                      vstride, nk);
        }
    }
    ak_fwd_rows_out(a, n, h, i0, nrows, m, l, obuf);
}

static void ak_fwd_worker(void *vctx, int w, int nw) {
    (void)nw;
    ak_fwd_ctx *ctx = vctx;
    const ak_flash_args *a = ctx->a;
    const int64_t nqb = ctx->nqb, total = a->N * a->Hq * nqb;
    int64_t t0, t1;
    while (ak_next_block(&ctx->next, 1, total, &t0, &t1)) {
        /* the last query blocks first: under a causal mask they hold the most work */
        const int64_t qb = nqb - 1 - t0 % nqb, nh = t0 / nqb;
        const int64_t i0 = qb * AK_FM, i1 = i0 + AK_FM < a->Lq ? i0 + AK_FM : a->Lq;
        ak_fwd_item(a, ctx->nkb, nh / a->Hq, nh % a->Hq, i0, i1, w);
    }
}

int attnkit_flash_forward(const ak_flash_args *a) {
    if (a->d <= 0 || a->dv <= 0 || a->d > AK_FD || a->dv > AK_FD || a->d % 16 || a->dv % 16)
        return AK_BAD_HEAD_DIM;
    if (a->Hkv <= 0 || a->Hq % a->Hkv) return AK_BAD_HEADS;
    if (a->dtype < AK_F32 || a->dtype > AK_F16) return AK_BAD_DTYPE;
    if (a->threads < 1 || a->threads > AK_POOL_MAX) return AK_BAD_THREADS;
    if (a->Lq <= 0 || a->Lk <= 0 || a->N <= 0) return AK_OK;
    if (a->dtype == AK_F32 && a->vf == NULL && a->vs[2] < a->dv) return AK_BAD_LAYOUT;
    if (a->table != NULL && (a->vf == NULL || a->kv_len == NULL || a->page <= 0 ||
                             a->table_w * a->page != a->Lk))
        return AK_BAD_LAYOUT; /* (paged values are always packed: no block is one strided run) */
    if (a->fp8 != 0 && (a->fp8 < AK_E4M3 || a->fp8 > AK_E5M2)) return AK_BAD_DTYPE;
    if (a->fp8 && (a->table == NULL || a->kd == NULL || a->vd == NULL)) return AK_BAD_LAYOUT;
#ifndef AK_FLASH_BF16
    if (a->bf16dot) return AK_NO_BF16_DOT;
#endif
    if (a->bf16dot && (a->dtype != AK_BF16 || a->d % 32 || a->vf == NULL)) return AK_NO_BF16_DOT;
    if (a->out_dtype < AK_F32 || a->out_dtype > AK_F16) return AK_BAD_DTYPE;
    if (a->bad == NULL || a->kt == NULL || a->out == NULL || a->lse == NULL) return AK_NO_BUFFER;
    const int64_t nkb = (a->Lk + AK_FN - 1) / AK_FN;
    ak_pack_ctx pc = {a, nkb, 0};
    ak_team_run(ak_pack_worker, &pc, a->threads);
    ak_fwd_ctx fc = {a, nkb, (a->Lq + AK_FM - 1) / AK_FM, 0};
    ak_team_run(ak_fwd_worker, &fc, a->threads);
    return *a->bad ? AK_NONFINITE : AK_OK; /* the caller runs another path on AK_NONFINITE */
}


/* ---- the backward ----------------------------------------------------------------------- */

/* FlashAttention-2's backward, one item per (batch, kv head, key super-block of up to AK_SB
 * key blocks): the item keeps its blocks' dK and dV in L1 and walks the query heads of its
 * group and the query blocks that see them; per (query block, key block) tile it recomputes
 * P = exp(S - lse) in registers, dP = dO V^T, dS = P (dP - D), and adds dV += P^T dO,
 * dK += dS^T Q and dQ += dS K, the last into one of P = `threads` dQ buffers (summed at the
 * end), so no two threads write one float.
 *
 * The same bits whatever the threads' timing: the unit a worker takes (dynamically) is
 * (batch, kv head, buffer p), and it runs that (batch, kv head)'s super-blocks of buffer p,
 * in ascending order, into dQ buffer p. Super-block s is buffer p's when s mod 2P is p or
 * 2P - 1 - p (back and forth, so that under causal masking, where the first keys are seen by
 * the most queries, every buffer gets a like share of the work). Units of one buffer write
 * the rows of different (batch, kv head)s, units of one (batch, kv head) different buffers,
 * so each float of a buffer is a sum in a fixed order, and the buffers are summed in their
 * order. The relative table's gradient is shared by the batch (and, for a table shared by
 * the heads, by the kv heads), so each unit has a sum of its own for it, which the caller
 * adds up in order. The worker's index chooses only its scratch workspace. */

typedef struct {
    const ak_flash_args *a;
    const ak_flash_grads *g;
    int64_t nkb, nqb, sb, next;
} ak_bwd_ctx;

/* acc[64 keys][cols] += X^T Y over R rows: X (R x AK_FN, stride AK_FN), Y (R x cols) */
#if defined(__AVX512F__)
static inline void ak_tn(float *acc, int64_t cols, const float *x, const float *y, int64_t R,
                         int64_t nk) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        int64_t c0 = 0;
        for (; c0 + 64 <= cols; c0 += 64) {
            __m512 t[4][4];
            ak_load44(t, acc + j0 * cols, cols, c0, NULL);
            for (int64_t r = 0; r < R; r++) {
                const float *yr = y + r * cols + c0;
                __m512 y0 = _mm512_loadu_ps(yr), y1 = _mm512_loadu_ps(yr + 16);
                __m512 y2 = _mm512_loadu_ps(yr + 32), y3 = _mm512_loadu_ps(yr + 48);
                AK_HOLD4(y0, y1, y2, y3);
                for (int jj = 0; jj < 4; jj++) {
                    const __m512 xb = _mm512_set1_ps(x[r * AK_FN + j0 + jj]);
                    t[jj][0] = _mm512_fmadd_ps(xb, y0, t[jj][0]);
                    t[jj][1] = _mm512_fmadd_ps(xb, y1, t[jj][1]);
                    t[jj][2] = _mm512_fmadd_ps(xb, y2, t[jj][2]);
                    t[jj][3] = _mm512_fmadd_ps(xb, y3, t[jj][3]);
                }
            }
            ak_store44(acc + j0 * cols, cols, c0, t);
        }
        for (; c0 < cols; c0 += 16) {
            __m512 t[4];
            for (int jj = 0; jj < 4; jj++) t[jj] = _mm512_loadu_ps(acc + (j0 + jj) * cols + c0);
            for (int64_t r = 0; r < R; r++) {
                const __m512 yv = _mm512_loadu_ps(y + r * cols + c0);
                for (int jj = 0; jj < 4; jj++)
                    t[jj] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * AK_FN + j0 + jj]), yv, t[jj]);
            }
            for (int jj = 0; jj < 4; jj++) _mm512_storeu_ps(acc + (j0 + jj) * cols + c0, t[jj]);
        }
    }
}

#else
/* the same on 256-bit registers: four keys by 16 columns, eight accumulators */
static inline void ak_tn(float *acc, int64_t cols, const float *x, const float *y, int64_t R,
                         int64_t nk) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4)
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            __m256 t[4][2];
            for (int jj = 0; jj < 4; jj++)
                for (int u = 0; u < 2; u++)
                    t[jj][u] = _mm256_loadu_ps(acc + (j0 + jj) * cols + c0 + 8 * u);
            for (int64_t r = 0; r < R; r++) {
                __m256 y0 = _mm256_loadu_ps(y + r * cols + c0);
                __m256 y1 = _mm256_loadu_ps(y + r * cols + c0 + 8);
                AK_HOLD2(y0, y1);
                for (int jj = 0; jj < 4; jj++) {
                    const __m256 xb = _mm256_broadcast_ss(x + r * AK_FN + j0 + jj);
                    t[jj][0] = _mm256_fmadd_ps(xb, y0, t[jj][0]);
                    t[jj][1] = _mm256_fmadd_ps(xb, y1, t[jj][1]);
                }
            }
            for (int jj = 0; jj < 4; jj++)
                for (int u = 0; u < 2; u++)
                    _mm256_storeu_ps(acc + (j0 + jj) * cols + c0 + 8 * u, t[jj][u]);
        }
}
#endif

/* Pack key block kb (transposed K and V, K rows as float32) into kt, vt, kn. */
/* Pack key block kb for the backward: float32 K^T, V^T and K rows (kt, vt, kn), or with
 * bf16dot the same as bfloat16 pairs: K^T and V^T pairs of dims (one key a lane) and K pairs
 * of keys (kp[jp][c] = (K[2jp][c], K[2jp + 1][c])). */
static void ak_bwd_pack(const ak_flash_args *a, const char *kbase, const char *vbase, int32_t j0,
                        int64_t nk, float *kt, float *vt, float *kn, float *stage) {
    const int64_t d = a->d, dv = a->dv;
    const size_t esz = a->dtype == 0 ? 4 : 2;
    int bad = 0;
    if (a->bf16dot) {
        uint32_t *ktp = (uint32_t *)kt, *vtp = (uint32_t *)vt, *kp = (uint32_t *)kn;
        static const uint16_t zero[AK_FD] = {0};
        for (int64_t jj = 0; jj < AK_FN; jj++) {
            const uint32_t *kr = (const uint32_t *)(kbase + (j0 + jj) * a->ks[2] * esz);
            const uint32_t *vr = (const uint32_t *)(vbase + (j0 + jj) * a->vs[2] * esz);
            for (int64_t c = 0; c < d / 2; c++) ktp[c * AK_FN + jj] = jj < nk ? kr[c] : 0u;
            for (int64_t c = 0; c < dv / 2; c++) vtp[c * AK_FN + jj] = jj < nk ? vr[c] : 0u;
            if (jj < nk) {
                for (int64_t c = 0; c < d; c += 32)
                    bad |= ak_nonfinite_bf16(_mm512_loadu_si512((const void *)((const uint16_t *)kr + c))) != 0;
                for (int64_t c = 0; c < dv; c += 32)
                    bad |= ak_nonfinite_bf16(_mm512_loadu_si512((const void *)((const uint16_t *)vr + c))) != 0;
            }
        }
        for (int64_t jp = 0; jp < AK_FN / 2; jp++) {
            const int64_t ja = 2 * jp, jb = 2 * jp + 1;
            const uint16_t *ra = ja < nk ? (const uint16_t *)(kbase + (j0 + ja) * a->ks[2] * esz)
                                         : zero;
            const uint16_t *rb = jb < nk ? (const uint16_t *)(kbase + (j0 + jb) * a->ks[2] * esz)
                                         : zero;
            for (int64_t c = 0; c < d; c += 16)
                _mm512_storeu_si512((void *)(kp + jp * d + c), ak_pair16(ra + c, rb + c));
        }
        if (bad) ak_flag_bad(a);
        return;
    }
    __mmask16 badm = 0;
    for (int64_t jj = 0; jj < AK_FN; jj++) {
        for (int64_t c = 0; c < d; c += 16) {
            __m512 x = _mm512_setzero_ps();
            if (jj < nk) x = ak_load_row16(kbase + (j0 + jj) * a->ks[2] * esz, a->dtype, c);
            badm |= ak_nonfinite(x);
            _mm512_storeu_ps(kn + jj * d + c, x);
        }
        for (int64_t c = 0; c < dv; c += 16) {
            __m512 x = _mm512_setzero_ps();
            if (jj < nk) x = ak_load_row16(vbase + (j0 + jj) * a->vs[2] * esz, a->dtype, c);
            badm |= ak_nonfinite(x);
            _mm512_storeu_ps(stage + jj * dv + c, x);
        }
    }
    for (int64_t c = 0; c < d; c++)
        for (int64_t jj = 0; jj < AK_FN; jj++) kt[c * AK_FN + jj] = kn[jj * d + c];
    for (int64_t c = 0; c < dv; c++)
        for (int64_t jj = 0; jj < AK_FN; jj++) vt[c * AK_FN + jj] = stage[jj * dv + c];
    if (badm) ak_flag_bad(a);
}

/* One item: key blocks [kb0, kb1) (at most AK_SB) of one (batch, kv head), on the scratch of
 * `worker`, adding into dQ buffer `buf` (and into its unit's table gradient). Each query
 * block's rows are loaded once for all of them and its dQ tile added once. With bf16dot the
 * five products run in bfloat16 pairs (P and dS rounded to bfloat16 for them, as torch's
 * bfloat16 backward rounds them); the softmax and dS stay float32. */
static void ak_bwd_item(const ak_flash_args *a, const ak_flash_grads *gr, int64_t nqb,
                        int64_t n, int64_t hk, int64_t kb0, int64_t kb1, int worker,
                        int64_t buf) {
    const int64_t d = a->d, dv = a->dv, Lk = a->Lk, Lq = a->Lq, G = a->Hq / a->Hkv;
    static const float LOG2E = 1.4426950408889634f;
    const int capped = a->softcap > 0.0f, bf = a->bf16dot;
    const float qmul = capped ? a->scale : a->scale * LOG2E;
    const size_t esz = a->dtype == 0 ? 4 : 2;
    const int64_t nb = kb1 - kb0;
    const int32_t jlo = (int32_t)(kb0 * AK_FN);
    const int32_t jhi = (int32_t)(kb1 * AK_FN < Lk ? kb1 * AK_FN : Lk);
    float *kt = a->ws + (int64_t)worker * AK_WS_BWD;       /* [AK_SB] K^T blocks */
    float *vt = kt + AK_SB * AK_FD * AK_FN;                  /* [AK_SB] V^T blocks */
    float *kn = vt + AK_SB * AK_FD * AK_FN;                  /* [AK_SB] K rows, float32 */
    float *dkb = kn + AK_SB * AK_FN * AK_FD, *dvb = dkb + AK_SB * AK_FN * AK_FD;
    float *qbuf = dvb + AK_SB * AK_FN * AK_FD, *dobuf = qbuf + AK_FM * AK_FD;
    float *dqt = dobuf + AK_FM * AK_FD;
    float *pb = dqt + AK_FM * AK_FD, *dsb = pb + AK_FM * AK_FN;
    float *capd = dsb + AK_FM * AK_FN; /* 1 - tanh^2 with softcap */
    /* bfloat16 layouts (bf16dot): raw q and dO rows, their row pairs, P and dS as row pairs
     * (for dV and dK) and dS rows (for dQ) */
    uint32_t *qraw = (uint32_t *)qbuf, *qrp = qraw + AK_FM * (d / 2);
    uint32_t *dor = (uint32_t *)dobuf, *dorp = dor + AK_FM * (dv / 2);
    uint32_t *ptrp = (uint32_t *)pb, *dstrp = (uint32_t *)dsb, *dsp = dstrp + AK_FM / 2 * AK_FN;
    float tp[AK_FR][AK_FN], tds[AK_FR][AK_FN];
    int32_t lo[AK_FM], hi[AK_FM], qsg[AK_FM];
    float ipf[AK_FM], lsel[AK_FM], dl[AK_FM];
    const char *kbase = (const char *)a->k + (n * a->ks[0] + hk * a->ks[1]) * esz;
    const char *vbase = (const char *)a->v + (n * a->vs[0] + hk * a->vs[1]) * esz;
    for (int64_t b = 0; b < nb; b++) {
        const int32_t j0 = (int32_t)((kb0 + b) * AK_FN);
        const int64_t nk = Lk - j0 < AK_FN ? Lk - j0 : AK_FN;
        ak_bwd_pack(a, kbase, vbase, j0, nk, kt + b * AK_FD * AK_FN, vt + b * AK_FD * AK_FN,
                    kn + b * AK_FN * AK_FD, dvb + b * AK_FN * AK_FD);
    }
    memset(dkb, 0, sizeof(float) * AK_SB * AK_FN * AK_FD);
    memset(dvb, 0, sizeof(float) * AK_SB * AK_FN * AK_FD);
    const int32_t *kseg = a->kseg ? a->kseg + n * a->kseg_bstride : NULL;
    const int64_t bb = n * a->bounds_bstride;
    const __m512 sc = _mm512_set1_ps(a->scale); /* dQ = scale dS K */
    const size_t doe = gr->dout_dtype == 0 ? 4 : 2;
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        const float slope = a->alibi ? a->alibi[n * a->alibi_bstride + h] : 0.0f;
        const char *qbase = (const char *)a->q + (n * a->qs[0] + h * a->qs[1]) * esz;
        const int64_t nh = n * a->Hq + h;
        float *dqw = gr->dq + (buf * a->N * a->Hq + nh) * Lq * d;
        for (int64_t qb = 0; qb < nqb; qb++) {
            const int64_t i0 = qb * AK_FM, i1 = i0 + AK_FM < Lq ? i0 + AK_FM : Lq;
            const int64_t nrows = i1 - i0, groups = (nrows + AK_FR - 1) / AK_FR;
            const int64_t padded = groups * AK_FR;
            int anyb = 0;
            for (int64_t r = 0; r < nrows; r++) {
                int32_t a0 = a->lo[bb + i0 + r], a1 = a->hi[bb + i0 + r];
                if (a0 < 0) a0 = 0;
                if (a1 > Lk) a1 = (int32_t)Lk;
                lo[r] = a0, hi[r] = a1;
                anyb |= a0 < a1 && a0 < jhi && a1 > jlo;
            }
            if (!anyb) continue;
            const float *rel = a->rel ? a->rel + h * a->rel_hstride + a->rel_base - i0 : NULL;
            float *drel = gr->drel ? gr->drel + ((buf * a->N + n) * a->Hkv + hk) *
                                         gr->drel_wstride + g * a->rel_hstride +
                                         a->rel_base - i0 : NULL;
            for (int64_t r = 0; r < padded; r++) {
                if (r < nrows) {
                    const int64_t i = i0 + r;
                    const char *qr = qbase + i * a->qs[2] * esz;
                    const char *dor_i = (const char *)gr->dout + (nh * Lq + i) * dv * doe;
                    __mmask32 badq = 0;
                    if (bf) {
                        memcpy(qraw + r * (d / 2), qr, (size_t)d * 2);
                        memcpy(dor + r * (dv / 2), dor_i, (size_t)dv * 2);
                        for (int64_t c = 0; c < d; c += 32)
                            badq |= ak_nonfinite_bf16(_mm512_loadu_si512(
                                (const void *)((const uint16_t *)qr + c)));
                    } else {
                        for (int64_t c = 0; c < d; c += 16) {
                            const __m512 x = ak_load_row16(qr, a->dtype, c);
                            badq |= ak_nonfinite(x);
                            _mm512_storeu_ps(qbuf + r * d + c,
                                             _mm512_mul_ps(x, _mm512_set1_ps(qmul)));
                        }
                        for (int64_t c = 0; c < dv; c += 16)
                            _mm512_storeu_ps(dobuf + r * dv + c,
                                             ak_load_row16(dor_i, gr->dout_dtype, c));
                    }
                    if (badq) ak_flag_bad(a);
                    const float l = gr->lse[nh * Lq + i];
                    lsel[r] = l == -INFINITY ? INFINITY : l * LOG2E;
                    dl[r] = gr->delta[nh * Lq + i];
                    qsg[r] = a->qseg ? a->qseg[n * a->qseg_bstride + i] : 0;
                    ipf[r] = a->ipos ? (float)a->ipos[n * a->ipos_bstride + i] : 0.0f;
                } else {
                    if (bf) {
                        memset(qraw + r * (d / 2), 0, (size_t)d * 2);
                        memset(dor + r * (dv / 2), 0, (size_t)dv * 2);
                    } else {
                        memset(qbuf + r * d, 0, (size_t)d * 4);
                        memset(dobuf + r * dv, 0, (size_t)dv * 4);
                    }
                    lo[r] = 0, hi[r] = 0, lsel[r] = INFINITY, dl[r] = 0.0f, qsg[r] = 0;
                    ipf[r] = 0.0f;
                }
            }
            if (bf) /* row pairs of q and dO, for dK and dV */
                for (int64_t rp = 0; rp < padded / 2; rp++) {
                    const uint16_t *qa = (const uint16_t *)(qraw + 2 * rp * (d / 2));
                    const uint16_t *qb2 = (const uint16_t *)(qraw + (2 * rp + 1) * (d / 2));
                    const uint16_t *da = (const uint16_t *)(dor + 2 * rp * (dv / 2));
                    const uint16_t *db2 = (const uint16_t *)(dor + (2 * rp + 1) * (dv / 2));
                    for (int64_t c = 0; c < d; c += 16)
                        _mm512_storeu_si512((void *)(qrp + rp * d + c), ak_pair16(qa + c, qb2 + c));
                    for (int64_t c = 0; c < dv; c += 16)
                        _mm512_storeu_si512((void *)(dorp + rp * dv + c),
                                            ak_pair16(da + c, db2 + c));
                }
            memset(dqt, 0, sizeof(float) * padded * d);
            for (int64_t b = 0; b < nb; b++) {
                const int32_t j0 = (int32_t)((kb0 + b) * AK_FN);
                const int64_t nk = Lk - j0 < AK_FN ? Lk - j0 : AK_FN;
                const float *ktb = kt + b * AK_FD * AK_FN, *vtb = vt + b * AK_FD * AK_FN;
                int seen = 0;
                for (int64_t r = 0; r < nrows; r++)
                    seen |= lo[r] < hi[r] && lo[r] < j0 + nk && hi[r] > j0;
                if (!seen) continue;
                int kfull_seg = 1; /* every key of the block in one segment */
                if (kseg != NULL)
                    for (int64_t jj = 1; jj < AK_FN; jj++) kfull_seg &= kseg[j0 + jj] == kseg[j0];
                for (int64_t gi = 0; gi < groups; gi++) {
                    const int64_t r0 = gi * AK_FR;
                    int any = 0, full = 1;
                    for (int r = 0; r < AK_FR; r++) {
                        const int32_t a0 = lo[r0 + r], a1 = hi[r0 + r];
                        any |= a0 < a1 && a0 < j0 + nk && a1 > j0;
                        full &= a0 <= j0 && a1 >= j0 + AK_FN;
                    }
                    if (!any) {
                        if (bf) {
                            memset(ptrp + r0 / 2 * AK_FN, 0, AK_FR / 2 * AK_FN * 4);
                            memset(dstrp + r0 / 2 * AK_FN, 0, AK_FR / 2 * AK_FN * 4);
                            memset(dsp + r0 * (AK_FN / 2), 0, AK_FR * (AK_FN / 2) * 4);
                        } else {
                            memset(pb + r0 * AK_FN, 0, AK_FR * AK_FN * 4);
                            memset(dsb + r0 * AK_FN, 0, AK_FR * AK_FN * 4);
                        }
                        continue;
                    }
                    if (kseg != NULL && full)
                        for (int r = 0; r < AK_FR; r++)
                            full &= kfull_seg && qsg[r0 + r] == kseg[j0];
                    __m512 s[AK_FR][4], dp[AK_FR][4];
#ifdef AK_FLASH_BF16
                    if (bf) {
                        ak_scores_bf(qraw + r0 * (d / 2), d / 2, (const uint32_t *)ktb, s);
                        ak_scores_bf(dor + r0 * (dv / 2), dv / 2, (const uint32_t *)vtb, dp);
                        const __m512 qm = _mm512_set1_ps(qmul);
                        for (int r = 0; r < AK_FR; r++)
                            for (int u = 0; u < 4; u++) s[r][u] = _mm512_mul_ps(s[r][u], qm);
                    } else
#endif
                    {
                        ak_scores(qbuf + r0 * d, d, ktb, s);
                        ak_scores(dobuf + r0 * dv, dv, vtb, dp);
                    }
                    for (int r = 0; r < AK_FR; r++) {
                        const int64_t rr = r0 + r;
                        ak_row_terms(a, s[r], j0, ipf[rr], slope,
                                     rel != NULL ? rel + j0 - rr : NULL, lo[rr], hi[rr], kseg,
                                     qsg[rr], full, capped ? capd + rr * AK_FN : NULL);
                        const __m512 lb = _mm512_set1_ps(lsel[rr]), db = _mm512_set1_ps(dl[rr]);
                        __mmask16 keep[4] = {0xffff, 0xffff, 0xffff, 0xffff};
                        if (a->dropout)
                            ak_keep64(a, j0, i0 + rr, (uint32_t)(h + (n << 16)), keep);
                        for (int u = 0; u < 4; u++) {
                            __m512 p = ak_exp2(_mm512_sub_ps(s[r][u], lb));
                            __m512 dpu = dp[r][u];
                            const __m512 zs = _mm512_set1_ps(a->drop_scale);
                            if (a->dropout) /* dS = P (Z dP - D), dV += (Z P)^T dO */
                                dpu = _mm512_maskz_mul_ps(keep[u], dpu, zs);
                            __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(dpu, db));
                            if (a->dropout) p = _mm512_maskz_mul_ps(keep[u], p, zs);
                            if (drel != NULL) { /* the table's term is added after softcap */
                                float *dr = drel + j0 - rr + 16 * u;
                                _mm512_storeu_ps(dr, _mm512_add_ps(_mm512_loadu_ps(dr), ds));
                            }
                            if (capped)
                                ds = _mm512_mul_ps(ds,
                                                   _mm512_loadu_ps(capd + rr * AK_FN + 16 * u));
                            if (bf) {
                                _mm512_storeu_ps(tp[r] + 16 * u, p);
                                _mm512_storeu_ps(tds[r] + 16 * u, ds);
                            } else {
                                _mm512_storeu_ps(pb + rr * AK_FN + 16 * u, p);
                                _mm512_storeu_ps(dsb + rr * AK_FN + 16 * u, ds);
                            }
                        }
                    }
#ifdef AK_FLASH_BF16
                    if (bf) /* P and dS in bfloat16: row pairs (dV, dK) and rows (dQ) */
                        for (int r = 0; r < AK_FR; r += 2) {
                            const int64_t rp = (r0 + r) / 2;
                            for (int u = 0; u < 4; u++) {
                                const __m512i pa = _mm512_cvtepu16_epi32(
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tp[r] + 16 * u)));
                                const __m512i pb2 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                                    _mm512_loadu_ps(tp[r + 1] + 16 * u)));
                                _mm512_storeu_si512((void *)(ptrp + rp * AK_FN + 16 * u),
                                                    _mm512_or_si512(pa, _mm512_slli_epi32(pb2, 16)));
                                const __m512i sa = _mm512_cvtepu16_epi32(
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tds[r] + 16 * u)));
                                const __m512i sb = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                                    _mm512_loadu_ps(tds[r + 1] + 16 * u)));
                                _mm512_storeu_si512((void *)(dstrp + rp * AK_FN + 16 * u),
                                                    _mm512_or_si512(sa, _mm512_slli_epi32(sb, 16)));
                            }
                            for (int q2 = 0; q2 < 2; q2++)
                                for (int u = 0; u < 4; u += 2)
                                    _mm512_storeu_si512(
                                        (void *)(dsp + (r0 + r + q2) * (AK_FN / 2) + 8 * u),
                                        (__m512i)_mm512_cvtne2ps_pbh(
                                            _mm512_loadu_ps(tds[r + q2] + 16 * u + 16),
                                            _mm512_loadu_ps(tds[r + q2] + 16 * u)));
                        }
#endif
                }
#ifdef AK_FLASH_BF16
                if (bf) {
                    const float ones[AK_FR] = {1.0f, 1.0f, 1.0f, 1.0f};
                    ak_tn_bf(dvb + b * AK_FN * AK_FD, dv, ptrp, dorp, padded / 2, nk);
                    ak_tn_bf(dkb + b * AK_FN * AK_FD, d, dstrp, qrp, padded / 2, nk);
                    for (int64_t gi = 0; gi < groups; gi++)
                        ak_pv_bf(dqt + gi * AK_FR * d, d, ones, dsp + gi * AK_FR * (AK_FN / 2),
                                 (const uint32_t *)(kn + b * AK_FN * AK_FD), (nk + 1) / 2);
                    continue;
                }
#endif
                ak_tn(dvb + b * AK_FN * AK_FD, dv, pb, dobuf, padded, nk);
                ak_tn(dkb + b * AK_FN * AK_FD, d, dsb, qbuf, padded, nk);
                const float ones[AK_FR] = {1.0f, 1.0f, 1.0f, 1.0f};
                for (int64_t gi = 0; gi < groups; gi++)
                    ak_pv(dqt + gi * AK_FR * d, d, ones, dsb + gi * AK_FR * AK_FN,
                          kn + b * AK_FN * AK_FD, d, nk);
            }
            for (int64_t r = 0; r < nrows; r++) {
                float *dst = dqw + (i0 + r) * d;
                for (int64_t c = 0; c < d; c += 16)
                    _mm512_storeu_ps(dst + c, _mm512_fmadd_ps(_mm512_loadu_ps(dqt + r * d + c),
                                                              sc, _mm512_loadu_ps(dst + c)));
            }
        }
    }
    /* dK = scale dS^T q = dS^T (q * qmul) * (scale / qmul) (bf16dot: q as given, so scale);
     * dV as accumulated */
    const __m512 kf = _mm512_set1_ps(bf ? a->scale : a->scale / qmul);
    for (int64_t b = 0; b < nb; b++) {
        const int32_t j0 = (int32_t)((kb0 + b) * AK_FN);
        const int64_t nk = Lk - j0 < AK_FN ? Lk - j0 : AK_FN;
        const float *dks = dkb + b * AK_FN * AK_FD, *dvs = dvb + b * AK_FN * AK_FD;
        const int gt = gr->grad_dtype;
        const int64_t ge = gt == 0 ? 4 : 2, row0 = (n * a->Hkv + hk) * Lk + j0;
        for (int64_t jj = 0; jj < nk; jj++) {
            char *dk = (char *)gr->dk + (row0 + jj) * d * ge;
            char *dvo = (char *)gr->dv + (row0 + jj) * dv * ge;
            for (int64_t c = 0; c < d; c += 16)
                ak_store_row16(dk, gt, c, _mm512_mul_ps(_mm512_loadu_ps(dks + jj * d + c), kf));
            for (int64_t c = 0; c < dv; c += 16)
                ak_store_row16(dvo, gt, c, _mm512_loadu_ps(dvs + jj * dv + c));
        }
    }
}

/* Takes units (batch, kv head, buffer p) and runs each one's super-blocks in order (see the
 * comment above ak_flash_grads). */
static void ak_bwd_worker(void *vctx, int w, int nw) {
    (void)nw;
    ak_bwd_ctx *ctx = vctx;
    const ak_flash_args *a = ctx->a;
    const int64_t nkb = ctx->nkb, sb = ctx->sb, nsb = (nkb + sb - 1) / sb;
    const int64_t P = a->threads, total = a->N * a->Hkv * P;
    int64_t t0, t1;
    while (ak_next_block(&ctx->next, 1, total, &t0, &t1)) {
        const int64_t p = t0 % P, nh = t0 / P;
        for (int64_t round = 0; round < nsb; round += 2 * P)
            for (int half = 0; half < 2; half++) {
                const int64_t s = round + (half ? 2 * P - 1 - p : p);
                if (s >= nsb) break;
                const int64_t kb0 = s * sb, kb1 = kb0 + sb < nkb ? kb0 + sb : nkb;
                ak_bwd_item(a, ctx->g, ctx->nqb, nh / a->Hkv, nh % a->Hkv, kb0, kb1, w, p);
            }
    }
}

/* Rows [r0, r1) of (N, Hq, Lq): delta and zeroed dQ buffers (phase 0), or the dQ buffers
 * summed into the first in their order (phase 1), and written in grad_dtype to dq_out where
 * one is asked. */
typedef struct {
    const ak_flash_args *a;
    const ak_flash_grads *g;
    int phase;
    int64_t next;
} ak_rows_ctx;

static void ak_rows_worker(void *vctx, int w, int nw) {
    (void)w, (void)nw;
    ak_rows_ctx *ctx = vctx;
    const ak_flash_args *a = ctx->a;
    const ak_flash_grads *g = ctx->g;
    const int64_t rows = a->N * a->Hq * a->Lq, d = a->d, dv = a->dv;
    const size_t oe = g->out_dtype == 0 ? 4 : 2, de = g->dout_dtype == 0 ? 4 : 2;
    int64_t r0, r1;
    while (ak_next_block(&ctx->next, 256, rows, &r0, &r1)) {
        if (ctx->phase == 0) {
            for (int64_t r = r0; r < r1; r++) {
                __m512 acc = _mm512_setzero_ps();
                const char *o = (const char *)g->out + r * dv * oe;
                const char *dd = (const char *)g->dout + r * dv * de;
                for (int64_t c = 0; c < dv; c += 16)
                    acc = _mm512_fmadd_ps(ak_load_row16(o, g->out_dtype, c),
                                          ak_load_row16(dd, g->dout_dtype, c), acc);
                g->delta[r] = _mm512_reduce_add_ps(acc) - (g->dlse ? g->dlse[r] : 0.0f);
            }
            for (int64_t t = 0; t < a->threads; t++)
                memset(g->dq + (t * rows + r0) * d, 0, (size_t)((r1 - r0) * d) * 4);
        } else {
            for (int64_t t = 1; t < a->threads; t++) {
                const float *src = g->dq + (t * rows + r0) * d;
                float *dst = g->dq + r0 * d;
                for (int64_t e = 0; e < (r1 - r0) * d; e += 16)
                    _mm512_storeu_ps(dst + e, _mm512_add_ps(_mm512_loadu_ps(dst + e),
                                                            _mm512_loadu_ps(src + e)));
            }
            if (g->grad_dtype != 0) {
                const float *sum = g->dq + r0 * d;
                char *dst = (char *)g->dq_out + r0 * d * 2;
                for (int64_t e = 0; e < (r1 - r0) * d; e += 16)
                    ak_store_row16(dst, g->grad_dtype, e, _mm512_loadu_ps(sum + e));
            }
        }
    }
}

/* The gradients: dK and dV in dk and dv, dQ in the first of dq's `a->threads` buffers (in
 * dq_out with a grad_dtype other than float32). Returns AK_OK, AK_NONFINITE when an input
 * was not finite (the caller runs another path), or the code of an argument it does not
 * run. */
int attnkit_flash_backward(const ak_flash_args *a, const ak_flash_grads *g) {
    if (a->d <= 0 || a->dv <= 0 || a->d > AK_FD || a->dv > AK_FD || a->d % 16 || a->dv % 16)
        return AK_BAD_HEAD_DIM;
    if (a->Hkv <= 0 || a->Hq % a->Hkv) return AK_BAD_HEADS;
    if (a->dtype < AK_F32 || a->dtype > AK_F16) return AK_BAD_DTYPE;
    if (a->threads < 1 || a->threads > AK_POOL_MAX) return AK_BAD_THREADS;
    if (a->Lq <= 0 || a->Lk <= 0 || a->N <= 0) return AK_OK;
    if (g->drel != NULL && a->rel == NULL) return AK_NO_TABLE;
    if (a->table != NULL) return AK_PAGED_BACKWARD;
    if (g->dout_dtype < AK_F32 || g->dout_dtype > AK_F16 || g->out_dtype < AK_F32 ||
        g->out_dtype > AK_F16 || g->grad_dtype < AK_F32 || g->grad_dtype > AK_F16)
        return AK_BAD_DTYPE;
    if (a->bad == NULL || g->dq == NULL || g->dk == NULL || g->dv == NULL ||
        (g->grad_dtype != AK_F32 && g->dq_out == NULL))
        return AK_NO_BUFFER;
#ifndef AK_FLASH_BF16
    if (a->bf16dot) return AK_NO_BF16_DOT;
#endif
    if (a->bf16dot && (a->dtype != AK_BF16 || a->d % 32 || a->dv % 32 || g->dout_dtype != AK_BF16))
        return AK_NO_BF16_DOT;
    ak_rows_ctx rc0 = {a, g, 0, 0};
    ak_team_run(ak_rows_worker, &rc0, a->threads);
    const int64_t nkb = (a->Lk + AK_FN - 1) / AK_FN;
    /* super-blocks of up to AK_SB key blocks, halved while there are fewer than 8 a worker:
     * with few (batch, kv head)s (few units) each then has enough for its buffers to get like
     * shares of its work; with many, the units themselves balance the workers (sb AK_SB) */
    int64_t sb = AK_SB;
    while (sb > 1 && a->N * a->Hkv * ((nkb + sb - 1) / sb) < 8 * (int64_t)a->threads) sb /= 2;
    ak_bwd_ctx bc = {a, g, nkb, (a->Lq + AK_FM - 1) / AK_FM, sb, 0};
    ak_team_run(ak_bwd_worker, &bc, a->threads);
    if (*a->bad) return AK_NONFINITE;
    if (a->threads > 1 || g->grad_dtype != 0) {
        ak_rows_ctx rc1 = {a, g, 1, 0};
        ak_team_run(ak_rows_worker, &rc1, a->threads);
    }
    return AK_OK;
}

#else /* neither AVX-512 nor AVX2 + FMA: the executor refuses before calling */

int attnkit_flash_forward(const ak_flash_args *a) {
    (void)a;
    return AK_NOT_BUILT;
}

int attnkit_flash_backward(const ak_flash_args *a, const ak_flash_grads *g) {
    (void)a, (void)g;
    return AK_NOT_BUILT;
}

#endif

int64_t attnkit_flash_workspace(int backward) { return backward ? AK_WS_BWD : AK_WS_FWD; }
int attnkit_flash_has_bf16dot(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
/* the kernel's vector width in bits: 512 (AVX-512), 256 (AVX2 + FMA), 0 (not built) */
int attnkit_flash_available(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(AK_FLASH_SIMD)
    return 256;
#else
    return 0;
#endif
}
