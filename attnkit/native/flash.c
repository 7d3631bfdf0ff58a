/* attnkit native kernels: flash attention on the CPU, float32 arithmetic, written in simd.h's
 * vector layer (AVX-512, or AVX2 + FMA + F16C: there the matrix products have 256-bit versions
 * of their own; the bfloat16 dot products are AVX512-BF16's).
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
 * (degree 4 for weights rounded to bfloat16). A group's weights take its rows' running maxima
 * as they are while no row's new maximum passes its own by more than AK_LAZY (weights up to
 * 2^AK_LAZY, as FlashAttention-4 rescales): they need not wait for the block's maxima, a
 * chain of reductions, which only decide whether to keep them.
 *
 * Layout: q (N, Hq, Lq, d), k (N, Hkv, Lk, d), v (N, Hkv, Lk, dv) with any batch/head/row
 * strides and unit stride along the head dim, float32, bfloat16 or float16; keys are packed
 * transposed by blocks into float32 scratch, kt[(n, hkv, kb)][c][AK_FN], when a query block
 * first needs them, by whichever worker gets there first (one that needs a block another is
 * packing packs blocks no worker has taken meanwhile; the same bits whoever packs, and the
 * keys are read while the other workers compute), and the blocks no query needs at the end,
 * so that a non-finite input anywhere is found; values as float32 rows (only when they are
 * not float32 already, are read from pages, or their rows are not dv elements apart: a
 * transposed view's rows, read in place, made P V wait on memory).
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
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnkit.h"
#include "pool.h"

#define AK_FM 64  /* query rows per work item */
#define AK_FN AK_FLASH_BLOCK /* keys per block */
#define AK_FR 4   /* query rows per register group */
#define AK_LAZY 8.0f /* how far a row's maximum may pass its weights' base (log2) */
#define AK_FD AK_FLASH_MAX_DIM /* largest head dim */

/* ak_flash_args and ak_flash_grads: attnkit.h */

/* floats of workspace one worker needs (forward: 0, backward: 1) */
#define AK_WS_FWD (2 * AK_FM * AK_FD + AK_FM * AK_FN)
#define AK_SB 4 /* most key blocks of one backward item */
#define AK_WS_BWD (5 * AK_SB * AK_FN * AK_FD + 3 * AK_FM * AK_FD + 3 * AK_FM * AK_FN)

#include "simd.h" /* AVX-512, or AVX2 + FMA + F16C (AKV_BITS 512, 256; 0: not built) */

#if AKV_BITS
#include "fp8.h"

/* a function on the hot path, split out for reading only: always inlined (the same code) */
#define AK_HOT static inline __attribute__((always_inline))

static inline akv ak_load_row16(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return akv_load((const float *)p + i);
    const akvh h = akvh_load((const uint16_t *)p + i);
    if (dtype == 2) return akv_from_f16(h);
    return akvi_as_f(akvi_slli(akvi_from_u16(h), 16));
}

/* lanes of x that are NaN or infinite (x * 0 is NaN exactly there) */
static inline akvm ak_nonfinite(akv x) {
    return akv_isnan(akv_mul(x, akv_zero()));
}

static inline void ak_flag_bad(const ak_flash_args *a) {
    __atomic_store_n(a->bad, 1, __ATOMIC_RELAXED);
}

/* x to 16 elements of dtype at p + i (bfloat16 rounded to nearest even as torch's casts) */
static inline void ak_store_row16(void *p, int dtype, int64_t i, akv x) {
    if (dtype == 0) {
        akv_store((float *)p + i, x);
        return;
    }
    akvh h;
    if (dtype == 2) {
        h = akv_to_f16(x);
    } else {
        const akvi u = akv_as_i(x);
        const akvi r = akvi_srli(akvi_add(akvi_add(u, akvi_set1(0x7fff)),
                                          akvi_and(akvi_srli(u, 16), akvi_set1(1))),
                                 16);
        const akvi qn = akvi_or(akvi_srli(u, 16), akvi_set1(0x40));
        h = akvh_from_i(akvi_blend(akv_isnan(x), r, qn));
    }
    akvh_store((uint16_t *)p + i, h);
}

/* Which of keys j0 .. j0 + 63 (j0 a multiple of 64) of row i, batch/head word c2 the dropout
 * keeps, as four masks of 16 keys: keys j0 + 16 w + t take word w of the Philox call with
 * counter (j0 / 4 + t, i, c2, offset) and key (seed mod 2^32, seed / 2^32), so the block
 * takes 16 calls, two registers of 8 counters (one a 64-bit lane: akvi_mul_u32 reads the
 * low 32 bits, so the words may carry garbage above them until the end), as philox.c does. */
_Static_assert(AK_FN == 64, "ak_keep64 draws the keep masks of one 64-key block");
static inline void ak_keep64(const ak_flash_args *a, int32_t j0, int64_t i, uint32_t c2,
                             akvm keep[4]) {
    const akvi m0 = akvi_set1_64(0xD2511F53u), m1 = akvi_set1_64(0xCD9E8D57u);
    const akvi j8 = akvi_iota_64();
    akvi xa0 = akvi_add_64(j8, akvi_set1_64(j0 >> 2));
    akvi xb0 = akvi_add_64(j8, akvi_set1_64((j0 >> 2) + 8));
    akvi xa1 = akvi_set1_64((uint32_t)i), xb1 = xa1;
    akvi xa2 = akvi_set1_64(c2), xb2 = xa2;
    akvi xa3 = akvi_set1_64(a->drop_offset), xb3 = xa3;
    uint32_t key0 = (uint32_t)(a->drop_seed & 0xFFFFFFFFu), key1 = (uint32_t)(a->drop_seed >> 32);
    for (int r = 0; r < 10; ++r) {
        const akvi k0 = akvi_set1_64(key0), k1 = akvi_set1_64(key1);
        const akvi pa0 = akvi_mul_u32(xa0, m0), pa1 = akvi_mul_u32(xa2, m1);
        const akvi pb0 = akvi_mul_u32(xb0, m0), pb1 = akvi_mul_u32(xb2, m1);
        xa0 = akvi_xor3(akvi_srli_64(pa1, 32), xa1, k0);
        xa2 = akvi_xor3(akvi_srli_64(pa0, 32), xa3, k1);
        xb0 = akvi_xor3(akvi_srli_64(pb1, 32), xb1, k0);
        xb2 = akvi_xor3(akvi_srli_64(pb0, 32), xb3, k1);
        xa1 = pa1, xa3 = pa0, xb1 = pb1, xb3 = pb0;
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
    }
    const akvi thr = akvi_set1((int)a->drop_threshold);
    const akvi xa[4] = {xa0, xa1, xa2, xa3}, xb[4] = {xb0, xb1, xb2, xb3};
    for (int w = 0; w < 4; w++) {
        keep[w] = akvi_ge_u(akvi_srli(akvi_low32(xa[w], xb[w]), 8), thr);
    }
}

/* acc[r][u] = o[r * stride + c0 + 16 u] (times alpha[r] unless alpha is NULL), 4 x 4 vectors;
 * and back */
static inline void ak_load44(akv acc[4][4], const float *o, int64_t stride, int64_t c0,
                             const float *alpha) {
    for (int r = 0; r < 4; r++) {
        const akv al = akv_set1(alpha != NULL ? alpha[r] : 1.0f);
        for (int u = 0; u < 4; u++)
            acc[r][u] = akv_mul(akv_load(o + r * stride + c0 + 16 * u), al);
    }
}

static inline void ak_store44(float *o, int64_t stride, int64_t c0, akv acc[4][4]) {
    for (int r = 0; r < 4; r++)
        for (int u = 0; u < 4; u++) akv_store(o + r * stride + c0 + 16 * u, acc[r][u]);
}

/* ---- AVX512-BF16 (ISA-specific): the matrix products in bfloat16 pairs ------------------ */
#if defined(__AVX512BF16__)
#define AK_FLASH_BF16 1
/* ak_scores_bf's quarters ua .. ua + n - 1 into s (the others 0) */
static inline __attribute__((always_inline)) void
ak_scores_bf_n(const uint32_t *q, int64_t dp, const uint32_t *kt, __m512 s[AK_FR][4], int ua,
               const int n) {
    __m512 acc[AK_FR][3];
    for (int r = 0; r < AK_FR; r++)
        for (int u = 0; u < n; u++) acc[r][u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dp; c++) {
        __m512bh k[3];
        for (int u = 0; u < n; u++) {
            k[u] = (__m512bh)_mm512_loadu_si512((const void *)(kt + c * AK_FN + 16 * (ua + u)));
            __asm__("" : "+v"(k[u])); /* (loaded once for the four rows) */
        }
        for (int r = 0; r < AK_FR; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * dp + c]);
            for (int u = 0; u < n; u++) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], qb, k[u]);
        }
    }
    for (int r = 0; r < AK_FR; r++) {
        for (int u = 0; u < 4; u++) s[r][u] = _mm512_setzero_ps();
        for (int u = 0; u < n; u++) s[r][ua + u] = acc[r][u];
    }
}

/* ak_scores_bf on the 16-key quarters [ua, ue) of the block only (1 to 3), the others 0 */
static __attribute__((noinline)) void ak_scores_bf_part(const uint32_t *q, int64_t dp,
                                                        const uint32_t *kt, __m512 s[AK_FR][4],
                                                        int ua, int ue) {
    switch (ue - ua) {
    case 1: ak_scores_bf_n(q, dp, kt, s, ua, 1); return;
    case 2: ak_scores_bf_n(q, dp, kt, s, ua, 2); return;
    default: ak_scores_bf_n(q, dp, kt, s, ua, 3); return;
    }
}

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
        akv_keep4(k0, k1, k2, k3);
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
 * vp[jp][dv] the two keys' values of each column as one pair (not inlined: inside the
 * forward's item its loop had too few registers and reloaded two of the four values) */
static __attribute__((noinline)) void ak_pv_bf(float *o, int64_t dv, const float *alpha,
                                               const uint32_t *p, const uint32_t *vp,
                                               int64_t njp) {
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
            akv_keep4(v0, v1, v2, v3);
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
                akv_keep4(y0, y1, y2, y3);
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
/* 64 weights p[0..3] as bfloat16 (rounded to nearest even) at pr */
static inline void ak_store_bf16x64(uint16_t *pr, const __m512 p[4]) {
    _mm512_storeu_si512((void *)pr, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512((void *)(pr + 32), (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
}

/* P and dS of group rows r0 .. r0 + 3 (tp, tds) in bfloat16: as row pairs (ptrp, dstrp, for
 * dV and dK) and as rows (dsp, for dQ) */
static inline void ak_pds_bf(float tp[AK_FR][AK_FN], float tds[AK_FR][AK_FN], int64_t r0,
                             uint32_t *ptrp, uint32_t *dstrp, uint32_t *dsp) {
    for (int r = 0; r < AK_FR; r += 2) {
        const int64_t rp = (r0 + r) / 2;
        for (int u = 0; u < 4; u++) {
            const __m512i pa = _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tp[r] + 16 * u)));
            const __m512i pb2 = _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tp[r + 1] + 16 * u)));
            _mm512_storeu_si512((void *)(ptrp + rp * AK_FN + 16 * u),
                                _mm512_or_si512(pa, _mm512_slli_epi32(pb2, 16)));
            const __m512i sa = _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tds[r] + 16 * u)));
            const __m512i sb = _mm512_cvtepu16_epi32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tds[r + 1] + 16 * u)));
            _mm512_storeu_si512((void *)(dstrp + rp * AK_FN + 16 * u),
                                _mm512_or_si512(sa, _mm512_slli_epi32(sb, 16)));
        }
        for (int q2 = 0; q2 < 2; q2++)
            for (int u = 0; u < 4; u += 2)
                _mm512_storeu_si512((void *)(dsp + (r0 + r + q2) * (AK_FN / 2) + 8 * u),
                                    (__m512i)_mm512_cvtne2ps_pbh(
                                        _mm512_loadu_ps(tds[r + q2] + 16 * u + 16),
                                        _mm512_loadu_ps(tds[r + q2] + 16 * u)));
    }
}
#endif

/* 16 columns of rows a and b (bfloat16 bits) as 16 pairs (a[c], b[c]) */
static inline akvi ak_pair16(const uint16_t *ra, const uint16_t *rb) {
    const akvi lo = akvi_from_u16(akvh_load(ra)), hi = akvi_from_u16(akvh_load(rb));
    return akvi_or(lo, akvi_slli(hi, 16));
}


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
#if AKV_BITS == 512
    for (int64_t j16 = 0; j16 < AK_FN; j16 += 16) /* 16 keys x 16 pairs at once */
        for (int64_t c0 = 0; c0 < d / 2; c0 += 16) {
            akvi r[16];
            for (int i = 0; i < 16; i++) {
                r[i] = j16 + i < nk ? akvi_load((const uint32_t *)kr[j16 + i] + c0) : akvi_zero();
                bad |= akvi_bf16_nonfinite(r[i]);
            }
            akvi_transpose16(r);
            for (int i = 0; i < 16; i++)
                akvi_store(kd + (c0 + i) * AK_FN + j16, r[i]);
        }
#else
    for (int64_t jj = 0; jj < nk; jj++)
        for (int64_t c = 0; c < d; c += 32)
            bad |= akvi_bf16_nonfinite(akvi_load((const uint16_t *)kr[jj] + c));
    for (int64_t c = 0; c < d / 2; c++)
        for (int64_t jj = 0; jj < AK_FN; jj++)
            kd[c * AK_FN + jj] = jj < nk ? ((const uint32_t *)kr[jj])[c] : 0u;
#endif
    for (int64_t jp = 0; jp < (nk + 1) / 2; jp++) {
        const int odd = 2 * jp + 1 < nk; /* (else the pair's second key is zero) */
        const uint16_t *r0 = (const uint16_t *)vr[2 * jp];
        const uint16_t *r1 = (const uint16_t *)vr[2 * jp + odd];
        for (int64_t c0 = 0; c0 < dv; c0 += 16) {
            const akvi both = odd ? ak_pair16(r0 + c0, r1 + c0) : akvi_from_u16(akvh_load(r0 + c0));
            bad |= akvi_bf16_nonfinite(both);
            akvi_store(vd + jp * dv + c0, both);
        }
    }
    return bad;
}

/* AKR_LANES elements of a row (float32, bfloat16 or float16: dtype) at element i */
static inline akr ak_load_row(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return akr_load((const float *)p + i);
    if (dtype == 2) return akr_load_f16((const uint16_t *)p + i);
    return akr_load_bf16((const uint16_t *)p + i);
}

/* float32 arithmetic: one block's keys transposed to float32 (zero past nk) into kt, square
 * by square of AKR_LANES keys and dims in registers, and its values as float32 rows into vd
 * (NULL: float32 values read in place, only checked here). Returns whether an input was not
 * finite: x * 0 is +-0 where x is finite and NaN where not, and the bitwise or of such
 * values is NaN exactly where one of them is (no chain of additions to wait on). */
static int ak_pack_f32(const ak_flash_args *a, const char *kr[AK_FN], const char *vr[AK_FN],
                       int64_t nk, float *kt, float *vd) {
    const int64_t d = a->d, dv = a->dv;
    const akr zero = akr_set1(0.0f);
    akr z = zero;
    for (int64_t c0 = 0; c0 < d; c0 += AKR_LANES)
        for (int64_t j = 0; j < AK_FN; j += AKR_LANES) {
            akr r[AKR_LANES];
            for (int i = 0; i < AKR_LANES; i++) {
                r[i] = j + i < nk ? ak_load_row(kr[j + i], a->dtype, c0) : zero;
                z = akr_or(z, akr_mul(r[i], zero));
            }
            akr_transpose(r);
            for (int i = 0; i < AKR_LANES; i++) akr_store(kt + (c0 + i) * AK_FN + j, r[i]);
        }
    for (int64_t jj = 0; jj < nk; jj++)
        for (int64_t c0 = 0; c0 < dv; c0 += AKR_LANES) {
            const akr x = ak_load_row(vr[jj], a->dtype, c0);
            z = akr_or(z, akr_mul(x, zero));
            if (vd != NULL) akr_store(vd + jj * dv + c0, x);
        }
    const float zs = akr_reduce_add(z);
    return zs != zs;
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
        const akv sc = akv_set1(desc[pages[(j0 + jj) / a->page] * a->Hkv + h] * unit);
        char *dst = buf + jj * AK_FD * esz;
        for (int64_t c0 = 0; c0 < c; c0 += 16) {
            const akv x = akv_from_f16(ak_fp8_half16((const uint8_t *)rows[jj] + c0, a->fp8));
            ak_store_row16(dst, a->dtype, c0, akv_mul(x, sc));
        }
        rows[jj] = dst;
    }
}

/* Packs key block t = (batch row, kv head, block) (and its values where they are packed);
 * a block past the row's keys (a block table's row shorter than Lk) is never read. Returns
 * whether an input was not finite. */
static __attribute__((noinline)) int ak_pack_block(const ak_flash_args *a, int64_t nkb,
                                                   int64_t t) {
    const int64_t d = a->d, dv = a->dv;
    const int64_t kb = t % nkb, nh = t / nkb, n = nh / a->Hkv, h = nh % a->Hkv;
    const int64_t j0 = kb * AK_FN, keys = ak_keys_of(a, n);
    const int64_t nk = keys - j0 < AK_FN ? keys - j0 : AK_FN;
    if (nk <= 0) return 0;
    /* fp8 pages: the block's keys and values dequantized (ak_stage_fp8) */
    char kbuf[AK_FN * AK_FD * 4] __attribute__((aligned(64)));
    char vbuf[AK_FN * AK_FD * 4] __attribute__((aligned(64)));
    const char *kr[AK_FN], *vr[AK_FN];
    ak_block_rows(a, a->k, a->ks, n, h, j0, nk, kr);
    ak_block_rows(a, a->v, a->vs, n, h, j0, nk, vr);
    if (a->fp8) { /* (rows of dtype in kbuf, vbuf from here on) */
        ak_stage_fp8(a, a->kd, n, h, j0, nk, d, kr, kbuf);
        ak_stage_fp8(a, a->vd, n, h, j0, nk, dv, vr, vbuf);
    }
    if (a->bf16dot)
        return ak_pack_bf(a, kr, vr, nk, (uint32_t *)a->kt + t * (d / 2) * AK_FN,
                          (uint32_t *)a->vf + (nh * ((a->Lk + 1) / 2) + j0 / 2) * dv);
    return ak_pack_f32(a, kr, vr, nk, a->kt + t * d * AK_FN,
                       a->vf != NULL ? a->vf + (nh * a->Lk + j0) * dv : NULL);
}

/* The score terms of one query row on one key block, in place on its four vectors of
 * scores (base 2, after the scale): softcap (with capd: 1 - tanh^2 stored there for the
 * backward), ALiBi, the relative table (tr: its entry for key j0 of this row), then the
 * visible interval [lo, hi) and the segment test unless the block is known full. */
static inline void ak_row_terms(const ak_flash_args *a, akv s[4], int32_t j0, float ipf,
                                float slope, const float *tr, int32_t lo, int32_t hi,
                                const int32_t *kseg, int32_t qsg, int full, float *capd) {
    static const float LOG2E = 1.4426950408889634f;
    const akvi iota = akvi_iota();
    if (a->softcap > 0.0f) {
        const akv inv = akv_set1(1.0f / a->softcap);
        const akv cl = akv_set1(a->softcap * LOG2E);
        for (int u = 0; u < 4; u++) {
            const akv th = akv_tanh(akv_mul(s[u], inv));
            if (capd != NULL)
                akv_store(capd + 16 * u, akv_fnmadd(th, th, akv_set1(1.0f)));
            s[u] = akv_mul(th, cl);
        }
    }
    if (a->alibi) {
        const akv ip = akv_set1(ipf), sl = akv_set1(slope);
        for (int u = 0; u < 4; u++) {
            const akv jf = akv_from_i(akvi_add(iota, akvi_set1(j0 + 16 * u)));
            s[u] = akv_fnmadd(sl, akv_abs(akv_sub(ip, jf)), s[u]);
        }
    }
    if (tr != NULL)
        for (int u = 0; u < 4; u++) s[u] = akv_add(s[u], akv_load(tr + 16 * u));
    if (!full) {
        const akvi a0 = akvi_set1(lo), a1 = akvi_set1(hi);
        for (int u = 0; u < 4; u++) {
            const akvi j = akvi_add(iota, akvi_set1(j0 + 16 * u));
            akvm vis = akvi_ge(j, a0) & akvi_lt(j, a1);
            if (kseg != NULL)
                vis &= akvi_eq(akvi_load(kseg + j0 + 16 * u), akvi_set1(qsg));
            s[u] = akv_blend(vis, akv_set1(-INFINITY), s[u]);
        }
    }
}

/* ---- the forward ------------------------------------------------------------------------ */

typedef struct {
    const ak_flash_args *a;
    int64_t nkb, nqb, next;
    int64_t blocks;  /* key blocks: N * Hkv * nkb */
    int64_t rest;    /* the next key block of the blocks' order a waiting or done worker tries */
    uint8_t *packed; /* per key block (as kt): 0, 1 (a worker is packing it), 2 (packed) */
} ak_fwd_ctx;

/* Packs key block t unless a worker has taken it already */
static void ak_fwd_take(ak_fwd_ctx *ctx, int64_t t) {
    uint8_t none = 0;
    if (__atomic_load_n(ctx->packed + t, __ATOMIC_RELAXED) != 0
        || !__atomic_compare_exchange_n(ctx->packed + t, &none, 1, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
        return;
    if (ak_pack_block(ctx->a, ctx->nkb, t)) ak_flag_bad(ctx->a);
    __atomic_store_n(ctx->packed + t, 2, __ATOMIC_RELEASE);
}

/* Key blocks [kb0, kb1) of (batch row n, kv head hk) packed: the ones no worker has taken,
 * here; then a wait for those another worker is packing, during which this one packs the
 * blocks no worker has taken yet in their order (all are packed in the end: a worker that
 * lost its core mid-block costs the others no idle time while any is left), then spins and
 * yields its core */
static void ak_fwd_need(ak_fwd_ctx *ctx, int64_t n, int64_t hk, int64_t kb0, int64_t kb1) {
    const int64_t base = (n * ctx->a->Hkv + hk) * ctx->nkb;
    for (int64_t kb = kb0; kb < kb1; kb++) ak_fwd_take(ctx, base + kb);
    for (int64_t kb = kb0; kb < kb1; kb++)
        for (int spins = 0; __atomic_load_n(ctx->packed + base + kb, __ATOMIC_ACQUIRE) != 2;) {
            int64_t t0, t1;
            if (ak_next_block(&ctx->rest, 1, ctx->blocks, &t0, &t1))
                ak_fwd_take(ctx, t0);
            else if (++spins < 64)
                __builtin_ia32_pause();
            else
                sched_yield();
        }
}

/* S = Qg Kt for AK_FR rows (q rows of stride d, prescaled) and one packed key block */
#if AKV_BITS != 256
static inline void ak_scores(const float *q, int64_t d, const float *kt, akv s[AK_FR][4]) {
    for (int r = 0; r < AK_FR; r++)
        for (int v = 0; v < 4; v++) s[r][v] = akv_zero();
    for (int64_t c = 0; c < d; c++) {
        const float *kc = kt + c * AK_FN;
        akv k0 = akv_load(kc), k1 = akv_load(kc + 16);
        akv k2 = akv_load(kc + 32), k3 = akv_load(kc + 48);
        akv_keep4(k0, k1, k2, k3);
        for (int r = 0; r < AK_FR; r++) {
            const akv qb = akv_set1(q[r * d + c]);
            s[r][0] = akv_fmadd(qb, k0, s[r][0]);
            s[r][1] = akv_fmadd(qb, k1, s[r][1]);
            s[r][2] = akv_fmadd(qb, k2, s[r][2]);
            s[r][3] = akv_fmadd(qb, k3, s[r][3]);
        }
    }
}

/* ak_scores' quarters ua .. ua + n - 1 into s (the others 0) */
AK_HOT void ak_scores_n(const float *q, int64_t d, const float *kt, akv s[AK_FR][4], int ua,
                        const int n) {
    akv acc[AK_FR][3];
    for (int r = 0; r < AK_FR; r++)
        for (int u = 0; u < n; u++) acc[r][u] = akv_zero();
    for (int64_t c = 0; c < d; c++) {
        akv k[3];
        for (int u = 0; u < n; u++) {
            k[u] = akv_load(kt + c * AK_FN + 16 * (ua + u));
            __asm__("" : "+v"(k[u])); /* (loaded once for the four rows) */
        }
        for (int r = 0; r < AK_FR; r++) {
            const akv qb = akv_set1(q[r * d + c]);
            for (int u = 0; u < n; u++) acc[r][u] = akv_fmadd(qb, k[u], acc[r][u]);
        }
    }
    for (int r = 0; r < AK_FR; r++) {
        for (int u = 0; u < 4; u++) s[r][u] = akv_zero();
        for (int u = 0; u < n; u++) s[r][ua + u] = acc[r][u];
    }
}

/* ak_scores on the 16-key quarters [ua, ue) of the block only (1 to 3 of them), the others 0 */
static __attribute__((noinline)) void ak_scores_part(const float *q, int64_t d, const float *kt,
                                                     akv s[AK_FR][4], int ua, int ue) {
    switch (ue - ua) {
    case 1: ak_scores_n(q, d, kt, s, ua, 1); return;
    case 2: ak_scores_n(q, d, kt, s, ua, 2); return;
    default: ak_scores_n(q, d, kt, s, ua, 3); return;
    }
}

#else /* (AVX2-specific) */
/* (the 256-bit products' step: A0, A1, A2 += B (X0, X1, X2)) */
#define AK_FMA3(B, X0, X1, X2, A0, A1, A2)                                                 \
    (A0 = _mm256_fmadd_ps(B, X0, A0), A1 = _mm256_fmadd_ps(B, X1, A1),                     \
     A2 = _mm256_fmadd_ps(B, X2, A2))

/* The same on 256-bit registers, the scores of keys 16u .. 16u + 15 into y[r][2u], y[r][2u + 1]
 * (registers of 8 keys): the four rows by 16 keys, eight accumulators, the two key vectors in
 * registers (a load and four broadcasts feed eight multiply-adds; with 32 keys by two rows,
 * the keys read as memory operands twice, it was ten) */
static inline void ak_scores16(const float *q, int64_t d, const float *kt, int u,
                               __m256 y[AK_FR][8]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
    __m256 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t c = 0; c < d; c++) {
        const float *kc = kt + c * AK_FN + 16 * u;
        __m256 k0 = _mm256_loadu_ps(kc), k1 = _mm256_loadu_ps(kc + 8);
        akr_keep2(k0, k1);
        __m256 qb = _mm256_broadcast_ss(q + c);
        a00 = _mm256_fmadd_ps(qb, k0, a00), a01 = _mm256_fmadd_ps(qb, k1, a01);
        qb = _mm256_broadcast_ss(q + d + c);
        a10 = _mm256_fmadd_ps(qb, k0, a10), a11 = _mm256_fmadd_ps(qb, k1, a11);
        qb = _mm256_broadcast_ss(q + 2 * d + c);
        a20 = _mm256_fmadd_ps(qb, k0, a20), a21 = _mm256_fmadd_ps(qb, k1, a21);
        qb = _mm256_broadcast_ss(q + 3 * d + c);
        a30 = _mm256_fmadd_ps(qb, k0, a30), a31 = _mm256_fmadd_ps(qb, k1, a31);
    }
    y[0][2 * u] = a00, y[0][2 * u + 1] = a01, y[1][2 * u] = a10, y[1][2 * u + 1] = a11;
    y[2][2 * u] = a20, y[2][2 * u + 1] = a21, y[3][2 * u] = a30, y[3][2 * u + 1] = a31;
}

/* keys j0 .. j0 + 23 likewise into y[r][j0 / 8 ..]: the four rows by 24 keys, twelve
 * accumulators and the three key vectors in registers (sixteen in all: twelve chains of
 * multiply-adds hide their latency where eight just match it) */
static inline void ak_scores24(const float *q, int64_t d, const float *kt, int j0,
                               __m256 y[AK_FR][8]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    for (int64_t c = 0; c < d; c++) {
        const float *kc = kt + c * AK_FN + j0;
        __m256 k0 = _mm256_loadu_ps(kc), k1 = _mm256_loadu_ps(kc + 8);
        __m256 k2 = _mm256_loadu_ps(kc + 16);
        __asm__("" : "+x"(k0), "+x"(k1), "+x"(k2));
        AK_FMA3(_mm256_broadcast_ss(q + c), k0, k1, k2, a00, a01, a02);
        AK_FMA3(_mm256_broadcast_ss(q + d + c), k0, k1, k2, a10, a11, a12);
        AK_FMA3(_mm256_broadcast_ss(q + 2 * d + c), k0, k1, k2, a20, a21, a22);
        AK_FMA3(_mm256_broadcast_ss(q + 3 * d + c), k0, k1, k2, a30, a31, a32);
    }
    const int i = j0 / 8;
    y[0][i] = a00, y[0][i + 1] = a01, y[0][i + 2] = a02;
    y[1][i] = a10, y[1][i + 1] = a11, y[1][i + 2] = a12;
    y[2][i] = a20, y[2][i + 1] = a21, y[2][i + 2] = a22;
    y[3][i] = a30, y[3][i + 1] = a31, y[3][i + 2] = a32;
}

/* y (registers of 8 keys) as the rows' four 16-key vectors */
static inline void ak_scores_of(__m256 y[AK_FR][8], akv s[AK_FR][4]) {
    for (int r = 0; r < AK_FR; r++)
        for (int u = 0; u < 4; u++) s[r][u] = akv_of(y[r][2 * u], y[r][2 * u + 1]);
}

/* the quarters [ua, ue) of the block by ak_scores16, the others 0 */
AK_HOT void ak_scores_range(const float *q, int64_t d, const float *kt, akv s[AK_FR][4],
                            int ua, int ue) {
    __m256 y[AK_FR][8];
    for (int u = 0; u < 4; u++) {
        if (u >= ua && u < ue) {
            ak_scores16(q, d, kt, u, y);
            continue;
        }
        for (int r = 0; r < AK_FR; r++) y[r][2 * u] = y[r][2 * u + 1] = _mm256_setzero_ps();
    }
    ak_scores_of(y, s);
}

/* a whole block: keys 0 .. 47 by 24 (ak_scores24), the last 16 by ak_scores16 */
static inline void ak_scores(const float *q, int64_t d, const float *kt, akv s[AK_FR][4]) {
    __m256 y[AK_FR][8];
    ak_scores24(q, d, kt, 0, y);
    ak_scores24(q, d, kt, 24, y);
    ak_scores16(q, d, kt, 3, y);
    ak_scores_of(y, s);
}

/* ak_scores on the 16-key quarters [ua, ue) of the block only, the others 0 */
static __attribute__((noinline)) void ak_scores_part(const float *q, int64_t d, const float *kt,
                                                     akv s[AK_FR][4], int ua, int ue) {
    ak_scores_range(q, d, kt, s, ua, ue);
}
#endif

/* O[rows] = O * alpha + P V over nk keys, dv in chunks of 64 columns */
#if AKV_BITS != 256
static inline void ak_pv(float *o, int64_t dv, const float *alpha, const float *p,
                         const float *v, int64_t vstride, int64_t nk) {
    int64_t c0 = 0;
    for (; c0 + 64 <= dv; c0 += 64) {
        akv acc[AK_FR][4];
        ak_load44(acc, o, dv, c0, alpha);
        for (int64_t j = 0; j < nk; j++) {
            const float *vr = v + j * vstride + c0;
            akv v0 = akv_load(vr), v1 = akv_load(vr + 16);
            akv v2 = akv_load(vr + 32), v3 = akv_load(vr + 48);
            akv_keep4(v0, v1, v2, v3);
            for (int r = 0; r < AK_FR; r++) {
                const akv pb = akv_set1(p[r * AK_FN + j]);
                acc[r][0] = akv_fmadd(pb, v0, acc[r][0]);
                acc[r][1] = akv_fmadd(pb, v1, acc[r][1]);
                acc[r][2] = akv_fmadd(pb, v2, acc[r][2]);
                acc[r][3] = akv_fmadd(pb, v3, acc[r][3]);
            }
        }
        ak_store44(o, dv, c0, acc);
    }
    for (; c0 < dv; c0 += 16) {
        akv acc[AK_FR];
        for (int r = 0; r < AK_FR; r++)
            acc[r] = akv_mul(akv_load(o + r * dv + c0), akv_set1(alpha[r]));
        for (int64_t j = 0; j < nk; j++) {
            const akv vv = akv_load(v + j * vstride + c0);
            for (int r = 0; r < AK_FR; r++)
                acc[r] = akv_fmadd(akv_set1(p[r * AK_FN + j]), vv, acc[r]);
        }
        for (int r = 0; r < AK_FR; r++) akv_store(o + r * dv + c0, acc[r]);
    }
}

#else /* (AVX2-specific) */
/* O[rows] columns c0 .. c0 + 23 = O * alpha + P V: the four rows by 24 columns, twelve
 * accumulators and the three value vectors in registers (sixteen in all: twelve chains of
 * multiply-adds hide their latency where eight just match it) */
static inline void ak_pv24(float *o, int64_t dv, const float *alpha, const float *p,
                           const float *v, int64_t vstride, int64_t nk) {
    float *o0 = o, *o1 = o + dv, *o2 = o + 2 * dv, *o3 = o + 3 * dv;
    const __m256 al0 = _mm256_set1_ps(alpha[0]), al1 = _mm256_set1_ps(alpha[1]);
    const __m256 al2 = _mm256_set1_ps(alpha[2]), al3 = _mm256_set1_ps(alpha[3]);
    __m256 a00 = _mm256_mul_ps(_mm256_loadu_ps(o0), al0);
    __m256 a01 = _mm256_mul_ps(_mm256_loadu_ps(o0 + 8), al0);
    __m256 a02 = _mm256_mul_ps(_mm256_loadu_ps(o0 + 16), al0);
    __m256 a10 = _mm256_mul_ps(_mm256_loadu_ps(o1), al1);
    __m256 a11 = _mm256_mul_ps(_mm256_loadu_ps(o1 + 8), al1);
    __m256 a12 = _mm256_mul_ps(_mm256_loadu_ps(o1 + 16), al1);
    __m256 a20 = _mm256_mul_ps(_mm256_loadu_ps(o2), al2);
    __m256 a21 = _mm256_mul_ps(_mm256_loadu_ps(o2 + 8), al2);
    __m256 a22 = _mm256_mul_ps(_mm256_loadu_ps(o2 + 16), al2);
    __m256 a30 = _mm256_mul_ps(_mm256_loadu_ps(o3), al3);
    __m256 a31 = _mm256_mul_ps(_mm256_loadu_ps(o3 + 8), al3);
    __m256 a32 = _mm256_mul_ps(_mm256_loadu_ps(o3 + 16), al3);
    for (int64_t j = 0; j < nk; j++) {
        const float *vr = v + j * vstride;
        __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
        __m256 v2 = _mm256_loadu_ps(vr + 16);
        __asm__("" : "+x"(v0), "+x"(v1), "+x"(v2));
        AK_FMA3(_mm256_broadcast_ss(p + j), v0, v1, v2, a00, a01, a02);
        AK_FMA3(_mm256_broadcast_ss(p + AK_FN + j), v0, v1, v2, a10, a11, a12);
        AK_FMA3(_mm256_broadcast_ss(p + 2 * AK_FN + j), v0, v1, v2, a20, a21, a22);
        AK_FMA3(_mm256_broadcast_ss(p + 3 * AK_FN + j), v0, v1, v2, a30, a31, a32);
    }
    _mm256_storeu_ps(o0, a00), _mm256_storeu_ps(o0 + 8, a01), _mm256_storeu_ps(o0 + 16, a02);
    _mm256_storeu_ps(o1, a10), _mm256_storeu_ps(o1 + 8, a11), _mm256_storeu_ps(o1 + 16, a12);
    _mm256_storeu_ps(o2, a20), _mm256_storeu_ps(o2 + 8, a21), _mm256_storeu_ps(o2 + 16, a22);
    _mm256_storeu_ps(o3, a30), _mm256_storeu_ps(o3 + 8, a31), _mm256_storeu_ps(o3 + 16, a32);
}

/* the same on 256-bit registers: the four rows by 24 columns (ak_pv24) while more than 32
 * are left, then by 16, eight accumulators, the two value vectors in registers (as
 * ak_scores) */
static inline void ak_pv(float *o, int64_t dv, const float *alpha, const float *p,
                         const float *v, int64_t vstride, int64_t nk) {
    int64_t c0 = 0;
    for (; dv - c0 > 32 || dv - c0 == 24; c0 += 24)
        ak_pv24(o + c0, dv, alpha, p, v + c0, vstride, nk);
    for (; c0 < dv; c0 += 16) {
        __m256 acc[AK_FR][2];
        for (int r = 0; r < AK_FR; r++)
            for (int u = 0; u < 2; u++)
                acc[r][u] = _mm256_mul_ps(_mm256_loadu_ps(o + r * dv + c0 + 8 * u),
                                          _mm256_set1_ps(alpha[r]));
        for (int64_t j = 0; j < nk; j++) {
            __m256 v0 = _mm256_loadu_ps(v + j * vstride + c0);
            __m256 v1 = _mm256_loadu_ps(v + j * vstride + c0 + 8);
            akr_keep2(v0, v1);
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

/* Rows i0 .. i0 + nrows - 1 of (batch row n, query head h) from their weights' bases m (base
 * 2), sums l (relative to m) and accumulated outputs obuf: out, lse and (where asked for) the
 * row maxima mt in natural units. */
static void ak_fwd_rows_out(const ak_flash_args *a, int64_t n, int64_t h, int64_t i0,
                            int64_t nrows, const float *m, const float *mt, const float *l,
                            const float *obuf) {
    static const float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
    const int64_t dv = a->dv;
    const size_t oe = a->out_dtype == 0 ? 4 : 2;
    const float sink = a->sinks ? a->sinks[h] * LOG2E : -INFINITY;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = (n * a->Hq + h) * a->Lq + i0 + r;
        char *orow = (char *)a->out + row * dv * oe;
        if (a->mx != NULL) a->mx[row] = mt[r] * LN2; /* (-inf for a row that saw no key) */
        float mf = m[r] > sink ? m[r] : sink;
        if (mf == -INFINITY || !(l[r] > 0.0f || sink > -INFINITY)) {
            memset(orow, 0, (size_t)dv * oe);
            a->lse[row] = -INFINITY;
            continue;
        }
        const float w = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mf);
        const float total = l[r] * w + (sink > -INFINITY ? exp2f(sink - mf) : 0.0f);
        const akv f = akv_set1(w / total * (a->dropout ? a->drop_scale : 1.0f));
        for (int64_t c = 0; c < dv; c += 16)
            ak_store_row16(orow, a->out_dtype, c,
                           akv_mul(akv_load(obuf + r * dv + c), f));
        a->lse[row] = (mf + log2f(total)) * LN2;
    }
}

/* One forward item: a query block (rows i0 .. i0 + nrows - 1 of batch row n, query head h) on
 * the scratch of one worker, with its rows' running state */
typedef struct {
    const ak_flash_args *a;
    int64_t n, h, i0, nrows, groups, Lk; /* (Lk: row n's keys) */
    float qmul;             /* the scale on q (log2(e) in it, unless softcap comes first) */
    int fold;               /* the scale in the weights' exponent instead (see ak_fwd_begin) */
    float slope;            /* ALiBi's */
    const float *rel;       /* the relative table at key 0 of row 0, or NULL */
    const int32_t *kseg;    /* the keys' segment ids, or NULL */
    float *qbuf, *obuf, *pbuf; /* q rows (scaled; bf16dot: raw pairs), outputs, weights */
    const float *ktb, *vb;  /* the packed key blocks of (n, kv head), and its values */
    int64_t vstride;
    float m[AK_FM], l[AK_FM], alpha[AK_FM]; /* running maxima (base 2), sums, block rescales */
    float mt[AK_FM]; /* the rows' largest scores (m, the weights' base: up to AK_LAZY below) */
    int32_t lo[AK_FM], hi[AK_FM], qs[AK_FM]; /* visible keys [lo, hi), segment ids */
    float ipf[AK_FM];       /* positions (ALiBi) */
} ak_fwd_it;

/* The item's constants: scale, terms, buffers, where its keys and values are */
static void ak_fwd_begin(ak_fwd_it *t, const ak_flash_args *a, int64_t nkb, int64_t n,
                         int64_t h, int64_t i0, int64_t i1, int worker) {
    static const float LOG2E = 1.4426950408889634f;
    const int64_t d = a->d, dv = a->dv, hk = h / (a->Hq / a->Hkv);
    const int capped = a->softcap > 0.0f;
    t->a = a, t->n = n, t->h = h, t->i0 = i0, t->nrows = i1 - i0;
    t->groups = (t->nrows + AK_FR - 1) / AK_FR;
    t->Lk = ak_keys_of(a, n);
    t->qmul = capped ? a->scale : a->scale * LOG2E;
    /* bfloat16 dot products give unscaled scores: with no score term to add, the scale goes
     * into the weights' exponent (one multiply-subtract) and the maxima (four rows at once) */
    t->fold = a->bf16dot && !capped && a->alibi == NULL && a->rel == NULL && t->qmul > 0.0f;
    t->slope = a->alibi ? a->alibi[n * a->alibi_bstride + h] : 0.0f;
    t->rel = a->rel ? a->rel + h * a->rel_hstride + a->rel_base - i0 : NULL;
    t->kseg = a->kseg ? a->kseg + n * a->kseg_bstride : NULL;
    t->qbuf = a->ws + (int64_t)worker * AK_WS_FWD;
    t->obuf = t->qbuf + AK_FM * AK_FD, t->pbuf = t->obuf + AK_FM * AK_FD;
    t->ktb = a->kt + (n * a->Hkv + hk) * nkb * d * AK_FN / (a->bf16dot ? 2 : 1);
    if (a->bf16dot) {
        t->vb = a->vf + (n * a->Hkv + hk) * ((a->Lk + 1) / 2) * dv;
        t->vstride = dv;
    } else if (a->vf != NULL) {
        t->vb = a->vf + (n * a->Hkv + hk) * a->Lk * dv;
        t->vstride = dv;
    } else {
        t->vb = (const float *)a->v + n * a->vs[0] + hk * a->vs[1];
        t->vstride = a->vs[2];
    }
}

/* Query rows i0 .. i0 + nrows - 1 (from qbase) asked for at once, where they are not d elements
 * apart (a transposed view's): the hardware follows no stream through them, and the rows read
 * one by one waited on memory */
static inline void ak_q_rows_ask(const ak_flash_args *a, const char *qbase, int64_t i0,
                                 int64_t nrows) {
    const int64_t esz = a->dtype == 0 ? 4 : 2;
    if (a->qs[2] == a->d) return;
    for (int64_t r = 0; r < nrows; r++)
        for (int64_t o = 0; o < a->d * esz; o += 64)
            __builtin_prefetch(qbase + (i0 + r) * a->qs[2] * esz + o);
}

/* Query row qr (d elements of a->dtype) into the item's buffers: its raw bfloat16 pairs into
 * raw (bf: the bfloat16 dot products scale the scores instead), else as float32 times qmul
 * into f32. Returns whether an element was not finite. */
static inline int ak_q_row_in(const ak_flash_args *a, const char *qr, int bf, float qmul,
                              void *raw, float *f32) {
    const int64_t d = a->d;
    akvm bad = 0;
    if (bf) {
        memcpy(raw, qr, (size_t)d * 2);
        for (int64_t c = 0; c < d; c += 32)
            bad |= akvi_bf16_nonfinite(akvi_load((const uint16_t *)qr + c));
    } else {
        for (int64_t c = 0; c < d; c += 16) {
            const akv x = ak_load_row16(qr, a->dtype, c);
            bad |= ak_nonfinite(x);
            akv_store(f32 + c, akv_mul(x, akv_set1(qmul)));
        }
    }
    return bad != 0;
}

/* The item's rows: q into qbuf, visible keys, segment ids and positions (a padding row past
 * nrows sees nothing), running maxima, sums and outputs cleared. Returns the key blocks
 * [*kb0, *kb1) that some row sees. */
static void ak_fwd_rows_in(ak_fwd_it *t, int64_t *kb0, int64_t *kb1) {
    const ak_flash_args *a = t->a;
    const int64_t d = a->d, dv = a->dv, n = t->n;
    const size_t esz = a->dtype == 0 ? 4 : 2;
    const int64_t ebuf = a->bf16dot ? 2 : 4; /* bytes an element of a Q or P row of qbuf/pbuf */
    const char *qbase = (const char *)a->q + (n * a->qs[0] + t->h * a->qs[1]) * esz;
    int32_t kmin = INT32_MAX, kmax = 0;
    ak_q_rows_ask(a, qbase, t->i0, t->nrows);
    for (int64_t r = 0; r < t->groups * AK_FR; r++) {
        t->m[r] = -INFINITY, t->mt[r] = -INFINITY, t->l[r] = 0.0f;
        if (r < t->nrows) {
            const int64_t i = t->i0 + r;
            const char *qr = qbase + i * a->qs[2] * esz;
            if (ak_q_row_in(a, qr, a->bf16dot, t->qmul, t->qbuf + r * (d / 2),
                            t->qbuf + r * d))
                ak_flag_bad(a);
            int32_t a0 = a->lo[n * a->bounds_bstride + i], a1 = a->hi[n * a->bounds_bstride + i];
            if (a0 < 0) a0 = 0;
            if (a1 > t->Lk) a1 = (int32_t)t->Lk;
            t->lo[r] = a0, t->hi[r] = a1;
            if (a0 < a1) {
                kmin = a0 < kmin ? a0 : kmin;
                kmax = a1 > kmax ? a1 : kmax;
            }
            t->qs[r] = a->qseg ? a->qseg[n * a->qseg_bstride + i] : 0;
            t->ipf[r] = a->ipos ? (float)a->ipos[n * a->ipos_bstride + i] : 0.0f;
        } else {
            memset((char *)t->qbuf + r * d * ebuf, 0, (size_t)(d * ebuf));
            t->lo[r] = 0, t->hi[r] = 0, t->qs[r] = 0, t->ipf[r] = 0.0f;
        }
        memset(t->obuf + r * dv, 0, (size_t)dv * 4);
    }
    *kb0 = kmax > kmin ? kmin / AK_FN : 0;
    *kb1 = kmax > kmin ? (kmax + AK_FN - 1) / AK_FN : 0;
}

/* Whether the group's rows see key block j0 (nk keys): any of them some key (the return),
 * and every row all AK_FN keys (*full), the segments aside */
static inline int ak_group_sees(const int32_t *lo, const int32_t *hi, int32_t j0, int64_t nk,
                                int *full) {
    int any = 0;
    *full = 1;
    for (int r = 0; r < AK_FR; r++) {
        any |= lo[r] < hi[r] && lo[r] < j0 + nk && hi[r] > j0;
        *full &= lo[r] <= j0 && hi[r] >= j0 + AK_FN;
    }
    return any;
}

/* Whether every key of block j0 is in the segment of each of the group's rows (qs) */
static inline int ak_fwd_same_segment(const int32_t *kseg, const int32_t *qs, int32_t j0) {
    for (int r = 0; r < AK_FR; r++)
        for (int64_t jj = 0; jj < AK_FN; jj++)
            if (kseg[j0 + jj] != qs[r]) return 0;
    return 1;
}

/* The keys [*ja, *je) of block j0 (nk keys) that some row of the group may see (lo, hi: the
 * rows' visible ranges), ja even (bfloat16 pairs): the weights outside are 0, and P V skips
 * them (a window's edge blocks, a causal diagonal; a non-finite value sends the call
 * elsewhere, so 0 * v is 0 there) */
static inline void ak_group_keys(const int32_t *lo, const int32_t *hi, int32_t j0, int64_t nk,
                                 int64_t *ja, int64_t *je) {
    int64_t a = nk, e = 0;
    for (int r = 0; r < AK_FR; r++) {
        if (lo[r] >= hi[r]) continue;
        if (lo[r] - j0 < a) a = lo[r] - j0;
        if (hi[r] - j0 > e) e = hi[r] - j0;
    }
    *ja = a < 0 ? 0 : a & ~(int64_t)1;
    *je = e > nk ? nk : e;
}

/* The 16-key quarters [*ua, *ue) of block j0 that some row of the group sees (all four where
 * every row sees the whole block): the score tiles compute only those */
static inline void ak_group_quarters(const int32_t *lo, const int32_t *hi, int32_t j0, int full,
                                     int *ua, int *ue) {
    int64_t ja = 0, je = AK_FN;
    if (!full) ak_group_keys(lo, hi, j0, AK_FN, &ja, &je);
    *ua = (int)(ja / 16);
    *ue = je > ja ? (int)((je + 15) / 16) : *ua;
}

/* S on the quarters [ua, ue) of the block, the others 0: a whole block inline (its scores stay
 * in registers), an edge's quarters through ak_scores_part */
AK_HOT void ak_scores_in(const float *q, int64_t d, const float *kt, akv s[AK_FR][4], int ua,
                         int ue) {
    if (ua == 0 && ue == 4) {
        ak_scores(q, d, kt, s);
        return;
    }
    akv sp[AK_FR][4];
    ak_scores_part(q, d, kt, sp, ua, ue);
    for (int r = 0; r < AK_FR; r++)
        for (int u = 0; u < 4; u++) s[r][u] = sp[r][u];
}

#ifdef AK_FLASH_BF16
AK_HOT void ak_scores_bf_in(const uint32_t *q, int64_t dp, const uint32_t *kt,
                            akv s[AK_FR][4], int ua, int ue) {
    if (ua == 0 && ue == 4) {
        ak_scores_bf(q, dp, kt, s);
        return;
    }
    akv sp[AK_FR][4];
    ak_scores_bf_part(q, dp, kt, sp, ua, ue);
    for (int r = 0; r < AK_FR; r++)
        for (int u = 0; u < 4; u++) s[r][u] = sp[r][u];
}
#endif

/* The scores of group rows r0 .. r0 + 3 on key block kt, scaled (but with fold): only the
 * block's quarters [ua, ue) (the ones some row sees) */
AK_HOT void ak_fwd_scores(const ak_fwd_it *t, const float *kt, int64_t r0, int ua, int ue,
                          akv s[AK_FR][4]) {
    const int64_t d = t->a->d;
#ifdef AK_FLASH_BF16
    if (t->a->bf16dot) {
        ak_scores_bf_in((const uint32_t *)t->qbuf + r0 * (d / 2), d / 2, (const uint32_t *)kt,
                        s, ua, ue);
        if (!t->fold) {
            const akv qm = akv_set1(t->qmul);
            for (int r = 0; r < AK_FR; r++)
                for (int u = 0; u < 4; u++) s[r][u] = akv_mul(s[r][u], qm);
        }
        return;
    }
#endif
    ak_scores_in(t->qbuf + r0 * d, d, kt, s, ua, ue);
}

/* The group's four rows together, from the maxima of their scores' lanes (rv): their maxima
 * in one 4-row reduction, the new running maxima and rescales (alpha) as one vector; each
 * row's base for its weights into bs (a row that sees nothing yet keeps weight 0 on base 0:
 * its scores are all -inf). Returns the rescales. */
AK_HOT akv4 ak_fwd_new_max(ak_fwd_it *t, int64_t r0, const akv rv[AK_FR], float bs[AK_FR]) {
    akv4 mx = akv_rows4_max(rv[0], rv[1], rv[2], rv[3]);
    if (t->fold) mx = akv4_mul(mx, akv4_set1(t->qmul));
    const akv4 mold = akv4_load(t->m + r0);
    const akv4 mnew = akv4_max(mx, mold);
    const akv4 base = akv4_select(akv4_eq(mnew, akv4_set1(-INFINITY)), akv4_set1(0.0f), mnew);
    const akv4 al = akv4_exp2(akv4_sub(mold, base));
    akv4_store(t->m + r0, mnew);
    akv4_store(t->alpha + r0, al);
    akv4_store(bs, base);
    return al;
}

/* p[u] = 2^(s[u] - base) for the quarters u in [ua, ue) (bfloat16 dot products: to
 * bfloat16's precision) */
AK_HOT void ak_fwd_exp(const ak_fwd_it *t, const akv s[4], float base, int ua, int ue,
                       akv p[4]) {
    if (t->fold) {
        const akv qm = akv_set1(t->qmul), nb = akv_set1(-base);
        for (int u = ua; u < ue; u++) p[u] = akv_exp2_bf(akv_fmadd(s[u], qm, nb));
    } else if (t->a->bf16dot) {
        const akv mb = akv_set1(base);
        for (int u = ua; u < ue; u++) p[u] = akv_exp2_bf(akv_sub(s[u], mb));
    } else {
        const akv mb = akv_set1(base);
        for (int u = ua; u < ue; u++) p[u] = akv_exp2(akv_sub(s[u], mb));
    }
}

/* Row rr's weights on key block j0 into pbuf, the ones the dropout drops as 0: those of the
 * quarters [ua, ue), the others 0 (the quarters no row of the group sees: their scores are
 * -inf). Returns their sums by lane (every weight: the softmax sums them all; P V only the
 * kept ones). */
AK_HOT akv ak_fwd_weights(const ak_fwd_it *t, const akv s[4], float base, int32_t j0,
                          int64_t rr, int ua, int ue) {
    const ak_flash_args *a = t->a;
    akv p[4];
    if (ua == 0 && ue == 4) { /* (constant bounds: unrolled) */
        ak_fwd_exp(t, s, base, 0, 4, p);
    } else {
        for (int u = 0; u < 4; u++) p[u] = akv_zero();
        ak_fwd_exp(t, s, base, ua, ue, p);
    }
    const akv sum = akv_add(akv_add(p[0], p[1]), akv_add(p[2], p[3]));
    if (a->dropout) {
        akvm keep[4];
        ak_keep64(a, j0, t->i0 + rr, (uint32_t)(t->h + (t->n << 16)), keep);
        for (int u = 0; u < 4; u++) p[u] = akv_maskz(keep[u], p[u]);
    }
#ifdef AK_FLASH_BF16
    if (a->bf16dot) {
        ak_store_bf16x64((uint16_t *)t->pbuf + rr * AK_FN, p);
        return sum;
    }
#endif
    for (int u = 0; u < 4; u++) akv_store(t->pbuf + rr * AK_FN + 16 * u, p[u]);
    return sum;
}

/* Group rows r0 .. r0 + 3 on key block kt (keys j0 ..): scores and their terms, the online
 * softmax's new maxima, rescales and sums, the weights into pbuf */
AK_HOT void ak_fwd_group(ak_fwd_it *t, const float *kt, int64_t r0, int32_t j0, int full) {
    akv s[AK_FR][4], rv[AK_FR];
    float bs[AK_FR];
    int ua, ue;
    ak_group_quarters(t->lo + r0, t->hi + r0, j0, full, &ua, &ue);
    ak_fwd_scores(t, kt, r0, ua, ue, s);
    for (int r = 0; r < AK_FR; r++) {
        const int64_t rr = r0 + r;
        ak_row_terms(t->a, s[r], j0, t->ipf[rr], t->slope,
                     t->rel != NULL ? t->rel + j0 - rr : NULL, t->lo[rr], t->hi[rr], t->kseg,
                     t->qs[rr], full, NULL);
        rv[r] = akv_max(akv_max(s[r][0], s[r][1]), akv_max(s[r][2], s[r][3]));
    }
    float *m = t->m + r0;
    if (m[0] > -INFINITY && m[1] > -INFINITY && m[2] > -INFINITY && m[3] > -INFINITY) {
        /* the weights on the running maxima as they are, while no row's new maximum passes
         * its own by more than AK_LAZY (weights up to 2^AK_LAZY): they need not wait for
         * this block's maxima, which only decide whether to keep them */
        akv w[AK_FR];
        for (int r = 0; r < AK_FR; r++) w[r] = ak_fwd_weights(t, s[r], m[r], j0, r0 + r, ua, ue);
        akv4 mx = akv_rows4_max(rv[0], rv[1], rv[2], rv[3]);
        if (t->fold) mx = akv4_mul(mx, akv4_set1(t->qmul));
        float x[AK_FR];
        akv4_store(x, mx);
        if (x[0] <= m[0] + AK_LAZY && x[1] <= m[1] + AK_LAZY && x[2] <= m[2] + AK_LAZY
            && x[3] <= m[3] + AK_LAZY) {
            akv4_store(t->alpha + r0, akv4_set1(1.0f));
            akv4_store(t->mt + r0, akv4_max(mx, akv4_load(t->mt + r0)));
            const akv4 sum = akv_rows4_add(w[0], w[1], w[2], w[3]);
            akv4_store(t->l + r0, akv4_add(akv4_load(t->l + r0), sum));
            return;
        }
    }
    const akv4 al = ak_fwd_new_max(t, r0, rv, bs);
    akv4_store(t->mt + r0, akv4_max(akv4_load(t->m + r0), akv4_load(t->mt + r0)));
    for (int r = 0; r < AK_FR; r++) rv[r] = ak_fwd_weights(t, s[r], bs[r], j0, r0 + r, ua, ue);
    const akv4 sum = akv_rows4_add(rv[0], rv[1], rv[2], rv[3]);
    akv4_store(t->l + r0, akv4_add(akv4_mul(akv4_load(t->l + r0), al), sum));
}

/* O = O * alpha + P V for the live groups on key block j0 (nk keys), over the keys a row of
 * the group may see */
AK_HOT void ak_fwd_pv(const ak_fwd_it *t, const uint8_t *live, int32_t j0, int64_t nk) {
    const int64_t dv = t->a->dv;
    for (int64_t g = 0; g < t->groups; g++) {
        if (!live[g]) continue;
        const int64_t r0 = g * AK_FR;
        int64_t ja, je;
        ak_group_keys(t->lo + r0, t->hi + r0, j0, nk, &ja, &je);
        if (je <= ja) je = ja; /* (alpha still rescales O) */
#ifdef AK_FLASH_BF16
        if (t->a->bf16dot) {
            ak_pv_bf(t->obuf + r0 * dv, dv, t->alpha + r0,
                     (const uint32_t *)t->pbuf + r0 * (AK_FN / 2) + ja / 2,
                     (const uint32_t *)t->vb + ((j0 + ja) / 2) * dv, (je - ja + 1) / 2);
            continue;
        }
#endif
        ak_pv(t->obuf + r0 * dv, dv, t->alpha + r0, t->pbuf + r0 * AK_FN + ja,
              t->vb + (j0 + ja) * t->vstride, t->vstride, je - ja);
    }
}

/* One query block of (batch row n, query head h): every key block some row sees, group by
 * group, then the rows' outputs */
static void ak_fwd_item(ak_fwd_ctx *ctx, int64_t n, int64_t h, int64_t i0, int64_t i1,
                        int worker) {
    const ak_flash_args *a = ctx->a;
    ak_fwd_it t;
    int64_t kb0, kb1;
    ak_fwd_begin(&t, a, ctx->nkb, n, h, i0, i1, worker);
    ak_fwd_rows_in(&t, &kb0, &kb1);
    ak_fwd_need(ctx, n, h / (a->Hq / a->Hkv), kb0, kb1);
    for (int64_t kb = kb0; kb < kb1; kb++) {
        const int32_t j0 = (int32_t)(kb * AK_FN);
        const int64_t nk = t.Lk - j0 < AK_FN ? t.Lk - j0 : AK_FN;
        const float *kt = t.ktb + kb * a->d * AK_FN / (a->bf16dot ? 2 : 1);
        uint8_t live[AK_FM / AK_FR];
        for (int64_t g = 0; g < t.groups; g++) {
            const int64_t r0 = g * AK_FR;
            int full;
            live[g] = ak_group_sees(t.lo + r0, t.hi + r0, j0, nk, &full);
            if (!live[g]) continue;
            if (t.kseg != NULL && full) full = ak_fwd_same_segment(t.kseg, t.qs + r0, j0);
            ak_fwd_group(&t, kt, r0, j0, full);
        }
        /* P V once every group's weights are written (not read back straight after the
         * stores that wrote them) */
        ak_fwd_pv(&t, live, j0, nk);
    }
    ak_fwd_rows_out(a, n, h, i0, t.nrows, t.m, t.mt, t.l, t.obuf);
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
        ak_fwd_item(ctx, nh / a->Hq, nh % a->Hq, i0, i1, w);
    }
    /* the key blocks no query needed (and no waiting worker took), packed all the same: a
     * non-finite input anywhere gives AK_NONFINITE, whatever the mask */
    while (ak_next_block(&ctx->rest, 1, ctx->blocks, &t0, &t1)) ak_fwd_take(ctx, t0);
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
    const int64_t blocks = a->N * a->Hkv * nkb;
    uint8_t *packed = calloc((size_t)blocks, 1);
    if (packed == NULL) return AK_NO_MEMORY;
    ak_fwd_ctx fc = {a, nkb, (a->Lq + AK_FM - 1) / AK_FM, 0, blocks, 0, packed};
    ak_team_run(ak_fwd_worker, &fc, a->threads);
    free(packed);
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
#if AKV_BITS != 256
static inline void ak_tn(float *acc, int64_t cols, const float *x, const float *y, int64_t R,
                         int64_t nk) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        int64_t c0 = 0;
        for (; c0 + 64 <= cols; c0 += 64) {
            akv t[4][4];
            ak_load44(t, acc + j0 * cols, cols, c0, NULL);
            for (int64_t r = 0; r < R; r++) {
                const float *yr = y + r * cols + c0;
                akv y0 = akv_load(yr), y1 = akv_load(yr + 16);
                akv y2 = akv_load(yr + 32), y3 = akv_load(yr + 48);
                akv_keep4(y0, y1, y2, y3);
                for (int jj = 0; jj < 4; jj++) {
                    const akv xb = akv_set1(x[r * AK_FN + j0 + jj]);
                    t[jj][0] = akv_fmadd(xb, y0, t[jj][0]);
                    t[jj][1] = akv_fmadd(xb, y1, t[jj][1]);
                    t[jj][2] = akv_fmadd(xb, y2, t[jj][2]);
                    t[jj][3] = akv_fmadd(xb, y3, t[jj][3]);
                }
            }
            ak_store44(acc + j0 * cols, cols, c0, t);
        }
        for (; c0 < cols; c0 += 16) {
            akv t[4];
            for (int jj = 0; jj < 4; jj++) t[jj] = akv_load(acc + (j0 + jj) * cols + c0);
            for (int64_t r = 0; r < R; r++) {
                const akv yv = akv_load(y + r * cols + c0);
                for (int jj = 0; jj < 4; jj++)
                    t[jj] = akv_fmadd(akv_set1(x[r * AK_FN + j0 + jj]), yv, t[jj]);
            }
            for (int jj = 0; jj < 4; jj++) akv_store(acc + (j0 + jj) * cols + c0, t[jj]);
        }
    }
}

#else /* (AVX2-specific) */
/* keys j0 .. j0 + 3 by columns c0 .. c0 + 23 of ak_tn: twelve accumulators and the three
 * vectors of y in registers (as ak_pv24) */
static inline void ak_tn24(float *acc, int64_t cols, const float *x, const float *y,
                           int64_t R, int64_t j0, int64_t c0) {
    float *t0 = acc + j0 * cols + c0, *t1 = t0 + cols, *t2 = t1 + cols, *t3 = t2 + cols;
    __m256 a00 = _mm256_loadu_ps(t0), a01 = _mm256_loadu_ps(t0 + 8);
    __m256 a02 = _mm256_loadu_ps(t0 + 16), a10 = _mm256_loadu_ps(t1);
    __m256 a11 = _mm256_loadu_ps(t1 + 8), a12 = _mm256_loadu_ps(t1 + 16);
    __m256 a20 = _mm256_loadu_ps(t2), a21 = _mm256_loadu_ps(t2 + 8);
    __m256 a22 = _mm256_loadu_ps(t2 + 16), a30 = _mm256_loadu_ps(t3);
    __m256 a31 = _mm256_loadu_ps(t3 + 8), a32 = _mm256_loadu_ps(t3 + 16);
    for (int64_t r = 0; r < R; r++) {
        const float *yr = y + r * cols + c0, *xr = x + r * AK_FN + j0;
        __m256 y0 = _mm256_loadu_ps(yr), y1 = _mm256_loadu_ps(yr + 8);
        __m256 y2 = _mm256_loadu_ps(yr + 16);
        __asm__("" : "+x"(y0), "+x"(y1), "+x"(y2));
        AK_FMA3(_mm256_broadcast_ss(xr), y0, y1, y2, a00, a01, a02);
        AK_FMA3(_mm256_broadcast_ss(xr + 1), y0, y1, y2, a10, a11, a12);
        AK_FMA3(_mm256_broadcast_ss(xr + 2), y0, y1, y2, a20, a21, a22);
        AK_FMA3(_mm256_broadcast_ss(xr + 3), y0, y1, y2, a30, a31, a32);
    }
    _mm256_storeu_ps(t0, a00), _mm256_storeu_ps(t0 + 8, a01), _mm256_storeu_ps(t0 + 16, a02);
    _mm256_storeu_ps(t1, a10), _mm256_storeu_ps(t1 + 8, a11), _mm256_storeu_ps(t1 + 16, a12);
    _mm256_storeu_ps(t2, a20), _mm256_storeu_ps(t2 + 8, a21), _mm256_storeu_ps(t2 + 16, a22);
    _mm256_storeu_ps(t3, a30), _mm256_storeu_ps(t3 + 8, a31), _mm256_storeu_ps(t3 + 16, a32);
}

/* the same on 256-bit registers: four keys by 24 columns (ak_tn24) while more than 32 are
 * left, then by 16, eight accumulators */
static inline void ak_tn(float *acc, int64_t cols, const float *x, const float *y, int64_t R,
                         int64_t nk) {
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        int64_t c = 0;
        for (; cols - c > 32 || cols - c == 24; c += 24) ak_tn24(acc, cols, x, y, R, j0, c);
        for (int64_t c0 = c; c0 < cols; c0 += 16) {
            __m256 t[4][2];
            for (int jj = 0; jj < 4; jj++)
                for (int u = 0; u < 2; u++)
                    t[jj][u] = _mm256_loadu_ps(acc + (j0 + jj) * cols + c0 + 8 * u);
            for (int64_t r = 0; r < R; r++) {
                __m256 y0 = _mm256_loadu_ps(y + r * cols + c0);
                __m256 y1 = _mm256_loadu_ps(y + r * cols + c0 + 8);
                akr_keep2(y0, y1);
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
}
#endif

/* x (AK_FN rows of c floats, c a multiple of AKR_LANES) transposed into xt[c][AK_FN], square
 * by square in registers */
static inline void ak_transpose_block(const float *x, int64_t c, float *xt) {
    for (int64_t c0 = 0; c0 < c; c0 += AKR_LANES)
        for (int64_t j = 0; j < AK_FN; j += AKR_LANES) {
            akr r[AKR_LANES];
            for (int i = 0; i < AKR_LANES; i++) r[i] = akr_load(x + (j + i) * c + c0);
            akr_transpose(r);
            for (int i = 0; i < AKR_LANES; i++) akr_store(xt + (c0 + i) * AK_FN + j, r[i]);
        }
}

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
                    bad |= akvi_bf16_nonfinite(akvi_load((const uint16_t *)kr + c));
                for (int64_t c = 0; c < dv; c += 32)
                    bad |= akvi_bf16_nonfinite(akvi_load((const uint16_t *)vr + c));
            }
        }
        for (int64_t jp = 0; jp < AK_FN / 2; jp++) {
            const int64_t ja = 2 * jp, jb = 2 * jp + 1;
            const uint16_t *ra = ja < nk ? (const uint16_t *)(kbase + (j0 + ja) * a->ks[2] * esz)
                                         : zero;
            const uint16_t *rb = jb < nk ? (const uint16_t *)(kbase + (j0 + jb) * a->ks[2] * esz)
                                         : zero;
            for (int64_t c = 0; c < d; c += 16)
                akvi_store(kp + jp * d + c, ak_pair16(ra + c, rb + c));
        }
        if (bad) ak_flag_bad(a);
        return;
    }
    akvm badm = 0;
    for (int64_t jj = 0; jj < AK_FN; jj++) {
        for (int64_t c = 0; c < d; c += 16) {
            akv x = akv_zero();
            if (jj < nk) x = ak_load_row16(kbase + (j0 + jj) * a->ks[2] * esz, a->dtype, c);
            badm |= ak_nonfinite(x);
            akv_store(kn + jj * d + c, x);
        }
        for (int64_t c = 0; c < dv; c += 16) {
            akv x = akv_zero();
            if (jj < nk) x = ak_load_row16(vbase + (j0 + jj) * a->vs[2] * esz, a->dtype, c);
            badm |= ak_nonfinite(x);
            akv_store(stage + jj * dv + c, x);
        }
    }
    ak_transpose_block(kn, d, kt);
    ak_transpose_block(stage, dv, vt);
    if (badm) ak_flag_bad(a);
}

/* One backward item, key blocks [kb0, kb0 + nb) of (batch row n, kv head hk) adding into dQ
 * buffer buf, on the scratch of one worker; and the query block it is on (rows i0 .. i0 +
 * nrows - 1 of query head h, the g-th of the kv head's group) with its rows' state */
typedef struct {
    const ak_flash_args *a;
    const ak_flash_grads *gr;
    int64_t n, hk, kb0, nb, buf;
    float qmul;             /* the scale on q (log2(e) in it, unless softcap comes first) */
    int capped, bf;         /* softcap; bf16dot */
    const int32_t *kseg;    /* the keys' segment ids, or NULL */
    float *kt, *vt, *kn;    /* [AK_SB] K^T, V^T blocks and K rows (float32, or pairs) */
    float *dkb, *dvb;       /* [AK_SB] the blocks' dK and dV */
    float *qbuf, *dobuf, *dqt; /* the query block's q (scaled) and dO rows, its dQ tile */
    float *pb, *dsb, *capd; /* P, dS of the block, 1 - tanh^2 with softcap */
    /* bfloat16 layouts (bf16dot): raw q and dO rows, their row pairs, P and dS as row pairs
     * (for dV and dK) and dS rows (for dQ) */
    uint32_t *qraw, *qrp, *dor, *dorp, *ptrp, *dstrp, *dsp;
    int64_t h, g, i0, nrows, groups;
    float slope;            /* ALiBi's */
    const float *rel;       /* the relative table at key 0 of row 0, or NULL */
    float *drel;            /* its gradient (this unit's), or NULL */
    int32_t lo[AK_FM], hi[AK_FM], qsg[AK_FM]; /* visible keys [lo, hi), segment ids */
    float ipf[AK_FM], lsel[AK_FM], dl[AK_FM]; /* positions, lse (base 2), delta */
} ak_bwd_it;

/* The item's constants and its workspace's layout */
static void ak_bwd_begin(ak_bwd_it *t, const ak_flash_args *a, const ak_flash_grads *gr,
                         int64_t n, int64_t hk, int64_t kb0, int64_t kb1, int worker,
                         int64_t buf) {
    static const float LOG2E = 1.4426950408889634f;
    const int64_t d = a->d, dv = a->dv;
    t->a = a, t->gr = gr, t->n = n, t->hk = hk, t->kb0 = kb0, t->nb = kb1 - kb0, t->buf = buf;
    t->capped = a->softcap > 0.0f, t->bf = a->bf16dot;
    t->qmul = t->capped ? a->scale : a->scale * LOG2E;
    t->kseg = a->kseg ? a->kseg + n * a->kseg_bstride : NULL;
    t->kt = a->ws + (int64_t)worker * AK_WS_BWD;
    t->vt = t->kt + AK_SB * AK_FD * AK_FN;
    t->kn = t->vt + AK_SB * AK_FD * AK_FN;
    t->dkb = t->kn + AK_SB * AK_FN * AK_FD, t->dvb = t->dkb + AK_SB * AK_FN * AK_FD;
    t->qbuf = t->dvb + AK_SB * AK_FN * AK_FD, t->dobuf = t->qbuf + AK_FM * AK_FD;
    t->dqt = t->dobuf + AK_FM * AK_FD;
    t->pb = t->dqt + AK_FM * AK_FD, t->dsb = t->pb + AK_FM * AK_FN;
    t->capd = t->dsb + AK_FM * AK_FN;
    t->qraw = (uint32_t *)t->qbuf, t->qrp = t->qraw + AK_FM * (d / 2);
    t->dor = (uint32_t *)t->dobuf, t->dorp = t->dor + AK_FM * (dv / 2);
    t->ptrp = (uint32_t *)t->pb, t->dstrp = (uint32_t *)t->dsb;
    t->dsp = t->dstrp + AK_FM / 2 * AK_FN;
}

/* Key block b of the item, packed (ak_bwd_pack); the first key and the count of its keys */
static inline int32_t ak_bwd_block_keys(const ak_bwd_it *t, int64_t b, int64_t *nk) {
    const int32_t j0 = (int32_t)((t->kb0 + b) * AK_FN);
    *nk = t->a->Lk - j0 < AK_FN ? t->a->Lk - j0 : AK_FN;
    return j0;
}

/* Query block qb of head h (the g-th of the group): its rows' visible keys. Returns whether
 * any row sees a key of the item's blocks. */
static int ak_bwd_bounds(ak_bwd_it *t, int64_t g, int64_t qb) {
    const ak_flash_args *a = t->a;
    const int64_t Lk = a->Lk, bb = t->n * a->bounds_bstride;
    const int32_t jlo = (int32_t)(t->kb0 * AK_FN);
    const int32_t jhi = (int32_t)((t->kb0 + t->nb) * AK_FN < Lk ? (t->kb0 + t->nb) * AK_FN : Lk);
    t->g = g, t->h = t->hk * (a->Hq / a->Hkv) + g;
    t->i0 = qb * AK_FM;
    t->nrows = (t->i0 + AK_FM < a->Lq ? t->i0 + AK_FM : a->Lq) - t->i0;
    t->groups = (t->nrows + AK_FR - 1) / AK_FR;
    int anyb = 0;
    for (int64_t r = 0; r < t->nrows; r++) {
        int32_t a0 = a->lo[bb + t->i0 + r], a1 = a->hi[bb + t->i0 + r];
        if (a0 < 0) a0 = 0;
        if (a1 > Lk) a1 = (int32_t)Lk;
        t->lo[r] = a0, t->hi[r] = a1;
        anyb |= a0 < a1 && a0 < jhi && a1 > jlo;
    }
    return anyb;
}

/* The query block's rows: q and dO (bf16dot: raw, and as row pairs), lse, delta, segment ids
 * and positions (a padding row past nrows sees nothing); its terms; its dQ tile cleared */
static void ak_bwd_rows_in(ak_bwd_it *t) {
    static const float LOG2E = 1.4426950408889634f;
    const ak_flash_args *a = t->a;
    const ak_flash_grads *gr = t->gr;
    const int64_t d = a->d, dv = a->dv, Lq = a->Lq, n = t->n, h = t->h;
    const int64_t nh = n * a->Hq + h, padded = t->groups * AK_FR;
    const size_t esz = a->dtype == 0 ? 4 : 2, doe = gr->dout_dtype == 0 ? 4 : 2;
    const char *qbase = (const char *)a->q + (n * a->qs[0] + h * a->qs[1]) * esz;
    t->slope = a->alibi ? a->alibi[n * a->alibi_bstride + h] : 0.0f;
    t->rel = a->rel ? a->rel + h * a->rel_hstride + a->rel_base - t->i0 : NULL;
    t->drel = gr->drel ? gr->drel + ((t->buf * a->N + n) * a->Hkv + t->hk) * gr->drel_wstride +
                             t->g * a->rel_hstride + a->rel_base - t->i0
                       : NULL;
    for (int64_t r = 0; r < padded; r++) {
        if (r < t->nrows) {
            const int64_t i = t->i0 + r;
            const char *qr = qbase + i * a->qs[2] * esz;
            const char *dor_i = (const char *)gr->dout + (nh * Lq + i) * dv * doe;
            if (ak_q_row_in(a, qr, t->bf, t->qmul, t->qraw + r * (d / 2), t->qbuf + r * d))
                ak_flag_bad(a);
            if (t->bf)
                memcpy(t->dor + r * (dv / 2), dor_i, (size_t)dv * 2);
            else
                for (int64_t c = 0; c < dv; c += 16)
                    akv_store(t->dobuf + r * dv + c, ak_load_row16(dor_i, gr->dout_dtype, c));
            const float l = gr->lse[nh * Lq + i];
            t->lsel[r] = l == -INFINITY ? INFINITY : l * LOG2E;
            t->dl[r] = gr->delta[nh * Lq + i];
            t->qsg[r] = a->qseg ? a->qseg[n * a->qseg_bstride + i] : 0;
            t->ipf[r] = a->ipos ? (float)a->ipos[n * a->ipos_bstride + i] : 0.0f;
        } else {
            if (t->bf) {
                memset(t->qraw + r * (d / 2), 0, (size_t)d * 2);
                memset(t->dor + r * (dv / 2), 0, (size_t)dv * 2);
            } else {
                memset(t->qbuf + r * d, 0, (size_t)d * 4);
                memset(t->dobuf + r * dv, 0, (size_t)dv * 4);
            }
            t->lo[r] = 0, t->hi[r] = 0, t->lsel[r] = INFINITY, t->dl[r] = 0.0f, t->qsg[r] = 0;
            t->ipf[r] = 0.0f;
        }
    }
    if (t->bf) /* row pairs of q and dO, for dK and dV */
        for (int64_t rp = 0; rp < padded / 2; rp++) {
            const uint16_t *qa = (const uint16_t *)(t->qraw + 2 * rp * (d / 2));
            const uint16_t *qb2 = (const uint16_t *)(t->qraw + (2 * rp + 1) * (d / 2));
            const uint16_t *da = (const uint16_t *)(t->dor + 2 * rp * (dv / 2));
            const uint16_t *db2 = (const uint16_t *)(t->dor + (2 * rp + 1) * (dv / 2));
            for (int64_t c = 0; c < d; c += 16)
                akvi_store(t->qrp + rp * d + c, ak_pair16(qa + c, qb2 + c));
            for (int64_t c = 0; c < dv; c += 16)
                akvi_store(t->dorp + rp * dv + c, ak_pair16(da + c, db2 + c));
        }
    memset(t->dqt, 0, sizeof(float) * padded * d);
}

/* Row rr on key block j0, from its scores s and dP = dO V^T: the terms, P = 2^(s - lse) and
 * dS = P (dP - delta) (with dropout, dS = P (Z dP - delta) and P := Z P; softcap's factor and
 * the table's gradient on dS), into p and ds */
AK_HOT void ak_bwd_row(const ak_bwd_it *t, akv s[4], const akv dp[4], int64_t rr, int32_t j0,
                       int full, float *p, float *ds) {
    const ak_flash_args *a = t->a;
    ak_row_terms(a, s, j0, t->ipf[rr], t->slope, t->rel != NULL ? t->rel + j0 - rr : NULL,
                 t->lo[rr], t->hi[rr], t->kseg, t->qsg[rr], full,
                 t->capped ? t->capd + rr * AK_FN : NULL);
    const akv lb = akv_set1(t->lsel[rr]), db = akv_set1(t->dl[rr]);
    akvm keep[4] = {0xffff, 0xffff, 0xffff, 0xffff};
    if (a->dropout) ak_keep64(a, j0, t->i0 + rr, (uint32_t)(t->h + (t->n << 16)), keep);
    for (int u = 0; u < 4; u++) {
        akv pu = akv_exp2(akv_sub(s[u], lb));
        akv dpu = dp[u];
        const akv zs = akv_set1(a->drop_scale);
        if (a->dropout) /* dS = P (Z dP - D), dV += (Z P)^T dO */
            dpu = akv_maskz_mul(keep[u], dpu, zs);
        akv dsu = akv_mul(pu, akv_sub(dpu, db));
        if (a->dropout) pu = akv_maskz_mul(keep[u], pu, zs);
        if (t->drel != NULL) { /* the table's term is added after softcap */
            float *dr = t->drel + j0 - rr + 16 * u;
            akv_store(dr, akv_add(akv_load(dr), dsu));
        }
        if (t->capped) dsu = akv_mul(dsu, akv_load(t->capd + rr * AK_FN + 16 * u));
        akv_store(p + 16 * u, pu);
        akv_store(ds + 16 * u, dsu);
    }
}

/* Group rows r0 .. r0 + 3 on key block b (keys j0 ..): P and dS into pb and dsb (bf16dot:
 * rounded to bfloat16, as row pairs into ptrp and dstrp and as rows into dsp) */
AK_HOT void ak_bwd_group(const ak_bwd_it *t, int64_t b, int64_t r0, int32_t j0, int full) {
    const int64_t d = t->a->d, dv = t->a->dv;
    const float *ktb = t->kt + b * AK_FD * AK_FN, *vtb = t->vt + b * AK_FD * AK_FN;
    akv s[AK_FR][4], dp[AK_FR][4];
    int ua, ue; /* (as the forward: only the quarters some row of the group sees) */
    ak_group_quarters(t->lo + r0, t->hi + r0, j0, full, &ua, &ue);
#ifdef AK_FLASH_BF16
    if (t->bf) {
        float tp[AK_FR][AK_FN], tds[AK_FR][AK_FN];
        ak_scores_bf_in(t->qraw + r0 * (d / 2), d / 2, (const uint32_t *)ktb, s, ua, ue);
        ak_scores_bf_in(t->dor + r0 * (dv / 2), dv / 2, (const uint32_t *)vtb, dp, ua, ue);
        const akv qm = akv_set1(t->qmul);
        for (int r = 0; r < AK_FR; r++)
            for (int u = 0; u < 4; u++) s[r][u] = akv_mul(s[r][u], qm);
        for (int r = 0; r < AK_FR; r++)
            ak_bwd_row(t, s[r], dp[r], r0 + r, j0, full, tp[r], tds[r]);
        ak_pds_bf(tp, tds, r0, t->ptrp, t->dstrp, t->dsp);
        return;
    }
#endif
    ak_scores_in(t->qbuf + r0 * d, d, ktb, s, ua, ue);
    ak_scores_in(t->dobuf + r0 * dv, dv, vtb, dp, ua, ue);
    for (int r = 0; r < AK_FR; r++) {
        const int64_t rr = r0 + r;
        ak_bwd_row(t, s[r], dp[r], rr, j0, full, t->pb + rr * AK_FN, t->dsb + rr * AK_FN);
    }
}

/* Group rows r0 .. r0 + 3 see nothing of the block: their P and dS are 0 */
static inline void ak_bwd_group_zero(const ak_bwd_it *t, int64_t r0) {
    if (t->bf) {
        memset(t->ptrp + r0 / 2 * AK_FN, 0, AK_FR / 2 * AK_FN * 4);
        memset(t->dstrp + r0 / 2 * AK_FN, 0, AK_FR / 2 * AK_FN * 4);
        memset(t->dsp + r0 * (AK_FN / 2), 0, AK_FR * (AK_FN / 2) * 4);
    } else {
        memset(t->pb + r0 * AK_FN, 0, AK_FR * AK_FN * 4);
        memset(t->dsb + r0 * AK_FN, 0, AK_FR * AK_FN * 4);
    }
}

/* The query block on key block b: P and dS group by group, then dV += P^T dO,
 * dK += dS^T q and the dQ tile += dS K */
static inline void ak_bwd_block(const ak_bwd_it *t, int64_t b) {
    const int64_t d = t->a->d, dv = t->a->dv, padded = t->groups * AK_FR;
    const int32_t *kseg = t->kseg;
    int64_t nk;
    const int32_t j0 = ak_bwd_block_keys(t, b, &nk);
    int seen = 0;
    for (int64_t r = 0; r < t->nrows; r++)
        seen |= t->lo[r] < t->hi[r] && t->lo[r] < j0 + nk && t->hi[r] > j0;
    if (!seen) return;
    int kfull_seg = 1; /* every key of the block in one segment */
    if (kseg != NULL)
        for (int64_t jj = 1; jj < AK_FN; jj++) kfull_seg &= kseg[j0 + jj] == kseg[j0];
    for (int64_t gi = 0; gi < t->groups; gi++) {
        const int64_t r0 = gi * AK_FR;
        int full;
        if (!ak_group_sees(t->lo + r0, t->hi + r0, j0, nk, &full)) {
            ak_bwd_group_zero(t, r0);
            continue;
        }
        if (kseg != NULL && full)
            for (int r = 0; r < AK_FR; r++) full &= kfull_seg && t->qsg[r0 + r] == kseg[j0];
        ak_bwd_group(t, b, r0, j0, full);
    }
    const float ones[AK_FR] = {1.0f, 1.0f, 1.0f, 1.0f};
    float *dkb = t->dkb + b * AK_FN * AK_FD, *dvb = t->dvb + b * AK_FN * AK_FD;
    const float *kn = t->kn + b * AK_FN * AK_FD;
#ifdef AK_FLASH_BF16
    if (t->bf) {
        ak_tn_bf(dvb, dv, t->ptrp, t->dorp, padded / 2, nk);
        ak_tn_bf(dkb, d, t->dstrp, t->qrp, padded / 2, nk);
        for (int64_t gi = 0; gi < t->groups; gi++)
            ak_pv_bf(t->dqt + gi * AK_FR * d, d, ones, t->dsp + gi * AK_FR * (AK_FN / 2),
                     (const uint32_t *)kn, (nk + 1) / 2);
        return;
    }
#endif
    ak_tn(dvb, dv, t->pb, t->dobuf, padded, nk);
    ak_tn(dkb, d, t->dsb, t->qbuf, padded, nk);
    for (int64_t gi = 0; gi < t->groups; gi++)
        ak_pv(t->dqt + gi * AK_FR * d, d, ones, t->dsb + gi * AK_FR * AK_FN, kn, d, nk);
}

/* The query block's dQ tile, times the scale (dQ = scale dS K), added into dQ buffer buf */
static void ak_bwd_dq_out(const ak_bwd_it *t) {
    const ak_flash_args *a = t->a;
    const int64_t d = a->d, nh = t->n * a->Hq + t->h;
    float *dqw = t->gr->dq + ((t->buf * a->N * a->Hq + nh) * a->Lq + t->i0) * d;
    const akv sc = akv_set1(a->scale);
    for (int64_t r = 0; r < t->nrows; r++)
        for (int64_t c = 0; c < d; c += 16)
            akv_store(dqw + r * d + c, akv_fmadd(akv_load(t->dqt + r * d + c), sc,
                                                 akv_load(dqw + r * d + c)));
}

/* The item's dK = scale dS^T q = dS^T (q * qmul) * (scale / qmul) (bf16dot: q as given, so
 * scale) and dV as accumulated, in grad_dtype */
static void ak_bwd_dkv_out(const ak_bwd_it *t) {
    const ak_flash_args *a = t->a;
    const int64_t d = a->d, dv = a->dv;
    const akv kf = akv_set1(t->bf ? a->scale : a->scale / t->qmul);
    const int gt = t->gr->grad_dtype;
    const int64_t ge = gt == 0 ? 4 : 2;
    for (int64_t b = 0; b < t->nb; b++) {
        int64_t nk;
        const int32_t j0 = ak_bwd_block_keys(t, b, &nk);
        const float *dks = t->dkb + b * AK_FN * AK_FD, *dvs = t->dvb + b * AK_FN * AK_FD;
        const int64_t row0 = (t->n * a->Hkv + t->hk) * a->Lk + j0;
        for (int64_t jj = 0; jj < nk; jj++) {
            char *dk = (char *)t->gr->dk + (row0 + jj) * d * ge;
            char *dvo = (char *)t->gr->dv + (row0 + jj) * dv * ge;
            for (int64_t c = 0; c < d; c += 16)
                ak_store_row16(dk, gt, c, akv_mul(akv_load(dks + jj * d + c), kf));
            for (int64_t c = 0; c < dv; c += 16)
                ak_store_row16(dvo, gt, c, akv_load(dvs + jj * dv + c));
        }
    }
}

/* One item: key blocks [kb0, kb1) (at most AK_SB) of one (batch, kv head), on the scratch of
 * `worker`, adding into dQ buffer `buf` (and into its unit's table gradient). Each query
 * block's rows are loaded once for all of them and its dQ tile added once. With bf16dot the
 * five products run in bfloat16 pairs (P and dS rounded to bfloat16 for them, as torch's
 * bfloat16 backward rounds them); the softmax and dS stay float32. */
static void ak_bwd_item(const ak_flash_args *a, const ak_flash_grads *gr, int64_t nqb,
                        int64_t n, int64_t hk, int64_t kb0, int64_t kb1, int worker,
                        int64_t buf) {
    ak_bwd_it t;
    ak_bwd_begin(&t, a, gr, n, hk, kb0, kb1, worker, buf);
    const size_t esz = a->dtype == 0 ? 4 : 2;
    const char *kbase = (const char *)a->k + (n * a->ks[0] + hk * a->ks[1]) * esz;
    const char *vbase = (const char *)a->v + (n * a->vs[0] + hk * a->vs[1]) * esz;
    for (int64_t b = 0; b < t.nb; b++) {
        int64_t nk;
        const int32_t j0 = ak_bwd_block_keys(&t, b, &nk);
        ak_bwd_pack(a, kbase, vbase, j0, nk, t.kt + b * AK_FD * AK_FN, t.vt + b * AK_FD * AK_FN,
                    t.kn + b * AK_FN * AK_FD, t.dvb + b * AK_FN * AK_FD);
    }
    memset(t.dkb, 0, sizeof(float) * AK_SB * AK_FN * AK_FD);
    memset(t.dvb, 0, sizeof(float) * AK_SB * AK_FN * AK_FD);
    for (int64_t g = 0; g < a->Hq / a->Hkv; g++)
        for (int64_t qb = 0; qb < nqb; qb++) {
            if (!ak_bwd_bounds(&t, g, qb)) continue;
            ak_bwd_rows_in(&t);
            for (int64_t b = 0; b < t.nb; b++) ak_bwd_block(&t, b);
            ak_bwd_dq_out(&t);
        }
    ak_bwd_dkv_out(&t);
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
                akv acc = akv_zero();
                const char *o = (const char *)g->out + r * dv * oe;
                const char *dd = (const char *)g->dout + r * dv * de;
                for (int64_t c = 0; c < dv; c += 16)
                    acc = akv_fmadd(ak_load_row16(o, g->out_dtype, c),
                                    ak_load_row16(dd, g->dout_dtype, c), acc);
                g->delta[r] = akv_reduce_add(acc) - (g->dlse ? g->dlse[r] : 0.0f);
            }
            for (int64_t t = 0; t < a->threads; t++)
                memset(g->dq + (t * rows + r0) * d, 0, (size_t)((r1 - r0) * d) * 4);
        } else { /* each element's sum in thread order, to dq_out (or the first buffer) */
            float *first = g->dq + r0 * d;
            char *dst = g->dq_out != NULL
                            ? (char *)g->dq_out + r0 * d * (g->grad_dtype == 0 ? 4 : 2)
                            : (char *)first;
            for (int64_t e = 0; e < (r1 - r0) * d; e += 16) {
                akv sum = akv_load(first + e);
                for (int64_t t = 1; t < a->threads; t++)
                    sum = akv_add(sum, akv_load(first + t * rows * d + e));
                ak_store_row16(dst, g->grad_dtype, e, sum);
            }
        }
    }
}

/* The gradients: dK and dV in dk and dv, dQ in dq_out (NULL: in the first of dq's
 * `a->threads` buffers, float32 only). Returns AK_OK, AK_NONFINITE when an input
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
int attnkit_flash_available(void) { return AKV_BITS; }
