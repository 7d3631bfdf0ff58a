/* attnkit native decode kernel: attention of a few query rows per sequence over a paged
 * key/value cache, read in place (no gather, no copy), in one pass over the pages.
 *
 * Built on first use by attnkit/native/__init__.py with the system C compiler and called
 * through ctypes. The Python side validates every shape, stride, dtype and page index before
 * calling and explains what is wrong; attnkit_decode checks the same facts once more, on the
 * calling thread before any work starts (check_args), and refuses a call that would read
 * outside the pages, so no input can crash the process from inside a worker thread.
 *
 * Work item = (sequence b, key split s). Keys are visited in memory order, a chunk of at most
 * AK_CHUNK tokens of one page at a time, all kv heads of a token together (the page layout is
 * token-major, so this reads each page front to back). Every key row is read once and dotted
 * with all the query rows of its kv head (G * Lq rows for GQA); scores, the online softmax and
 * the P V accumulation are float32 (in vectors of one register: simd.h's akr), except for e4m3
 * pages with bfloat16 queries on a CPU with AVX512-FP16, whose products and short sums are float16
 * (AK_H16, at e4m3_h16: twice the multiply-adds a cycle, within FlashAttention's rule).
 * A split writes its normalised partial output and log-sum-exp; the caller merges the splits
 * (flash-decoding) when there is more than one.
 *
 * Non-finite values follow the IEEE arithmetic of softmax(s) = exp(s - max) / sum over a row's
 * visible keys, as torch's math attention does: a NaN or +inf score among them makes the row's
 * output and log-sum-exp NaN (NaN, or inf - inf), a -inf score has weight 0, NaN or inf in a
 * value row propagates through its weight. Keys a row does not see (masked, past its length
 * or window, page padding) never reach its sums, whatever they hold. A row that sees no key
 * (or only -inf scores) gives 0 and log-sum-exp -inf.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnkit.h"
#include "pool.h"
#include "vecmath.h"

#define AK_CHUNK 64 /* tokens per chunk (scores buffer: rows x AK_CHUNK floats) */
#ifndef AK_DECODE_WORK_PER_THREAD
#define AK_DECODE_WORK_PER_THREAD 131072 /* multiply-adds; see attnkit_decode */
#endif

/* e4m3 pages in float16 arithmetic (see e4m3_h16; needs the bfloat16 dot products' helpers) */
#if defined(__AVX512BF16__) && defined(__AVX512FP16__)
#define AK_H16 1
#endif

/* bytes per element of a page dtype */
#define AK_ESZ(dtype) ((dtype) == AK_F32 ? 4 : (dtype) >= AK_E4M3 ? 1 : 2)

/* AVX2 without AVX-512 (simd.h's 256-bit backend): the score and P V loops in 8-lane
 * registers (see AK_N), and ways of reading pages that suit them (AK_EVEN_ODD, AK_E4M3_FINITE,
 * score4x2) */
#if AKV_BITS == 256
#define AK_AVX2 1
#endif
#if AKV_BITS == 512 || AKV_BITS == 256
#include "fp8.h"
#endif

typedef struct {
    const char *q;             /* (B, Hq, Lq, D), unscaled, in q_dtype */
    int q_dtype;               /* q's dtype: AK_F32, AK_BF16 or AK_F16 */
    int64_t qs_b, qs_h, qs_i;  /* q's element strides (B, Hq, Lq); its last dim unit stride */
    int bf16_dot;              /* bfloat16 q and keys: vdpbf16ps dot products (D % 32 == 0) */
    int h16;                   /* e4m3 pages in float16 arithmetic where they qualify (AK_H16) */
    int shared;                /* the value rows lie inside the key rows (MLA: see mla_*) */
    int bf16_pv;               /* bfloat16 pages: P V in vdpbf16ps, P rounded (pv_dp_rows) */
    float scale;
    const char *kp, *vp;       /* pages, element strides below, last dim unit stride */
    const float *kd, *vd;      /* fp8 pages: (num_pages, Hkv) descales, else NULL */
    int64_t ks_page, ks_tok, ks_head;
    int64_t vs_page, vs_tok, vs_head;
    const int64_t *bt;         /* (B, bt_cols) contiguous */
    int64_t bt_cols;
    const int64_t *seqlens;    /* (B,) */
    const int64_t *starts;     /* NULL, or (B,): sequence b's key j sits at position
                                * starts[b] + j of its block-table row (packed sequences) */
    int64_t B, Hq, Hkv, Lq, D, Dv, P;
    int64_t splits, keys_per_split;
    int dtype;
    int causal, bottom_right;
    int has_left, has_right;   /* 0: that side of the window is unbounded */
    int64_t left, right;       /* visible iff i' - left <= j <= i' + right (any sign) */
    float softcap;             /* <= 0: none */
    const float *alibi;        /* NULL or (B, Hq) slopes */
    float *out;                /* (splits, B, Hq, Lq, Dv) */
    float *lse;                /* (splits, B, Hq, Lq) */
    int64_t ntasks;
    int64_t next;              /* task counter, taken with __atomic_fetch_add */
    /* fp8 pages with bfloat16 dot products (AK_FP8DOT): the low and high bytes of the
     * bfloat16 value of each fp8 byte without its sign (what read16 gives), and the byte
     * orders that interleave them (fp8_tables) */
    uint8_t tab[2][128];
    uint8_t order[6][64];
} ak_job;

int attnkit_native_has_f16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* ---- the vectors of the score, softmax and P V loops -------------------------------------
 * simd.h's register (akr; vecmath.h's ak_vn): AK_N float32 lanes, 16 with AVX-512, 8 with
 * AVX2, whose 16 registers of 8 lanes the 16-lane vectors took two at a time (and spilled).
 * Rows are read 16 elements (AK_W) at a time, as AK_NB registers: load_w. */
#ifdef AK_AVX2
/* bfloat16 pages are read as each 16 elements' even ones, then its odd ones (AK_EVEN_ODD):
 * one 32-byte load, a shift and a mask, half the instructions of widening the 16-bit lanes
 * in order (whose vpmovzxwd crosses the register's 128-bit halves: three cycles on one pipe
 * in llvm-mca's Zen 3 model). The query rows and the P V sums of such a call are kept in
 * that order too, and the sums put back in order at the end. */
#define AK_EVEN_ODD(dtype) ((dtype) == AK_BF16)
#else
#define AK_EVEN_ODD(dtype) 0
#endif

/* e4m3 bytes known to hold no NaN (ak_e4m3_nan looked at them first): converted without the
 * NaN step, two instructions of the ten that 16 bytes took (each cost about 5% of a decode
 * call, AVX2); a code of this file only, never a page dtype a caller passes */
#define AK_E4M3_FINITE 5

/* 16 fp8 bytes at p as float32 through exact float16 bit patterns: an e5m2 byte is the high
 * byte of a float16; an e4m3 byte b is the float16 (b & 0x80) << 8 | (b & 0x7f) << 7 times
 * 2^-8 (run_task puts the 2^8 on the page's descale: `unit`), and its NaN (b & 0x7f == 0x7f)
 * becomes a float16 NaN (AK_E4M3_FINITE: none there) */
#if AKV_BITS
AK_INLINE void fp8_w(const char *p, int dtype, akr x[AK_NB]) {
    const akvh w = ak_fp8_high16((const uint8_t *)p); /* (fp8.h) */
    const akv f = akv_from_f16(dtype == AK_E4M3_FINITE ? ak_e4m3_finite_half16(w)
                                                       : ak_fp8_high_to_half16(w, dtype));
    for (int j = 0; j < AK_NB; ++j) x[j] = akv_reg(f, j);
}
#else
/* (a target without fp8.h's instructions: the same patterns a byte at a time) */
AK_INLINE void fp8_w(const char *p, int dtype, akr x[AK_NB]) {
    uint16_t h[AK_W];
    for (int i = 0; i < AK_W; ++i) {
        const unsigned b = (uint8_t)p[i];
        h[i] = (uint16_t)(dtype == AK_E5M2          ? b << 8
                          : (b & 0x7f) == 0x7f      ? 0x7e00u
                                                    : (b & 0x80) << 8 | (b & 0x7f) << 7);
    }
    for (int j = 0; j < AK_NB; ++j) x[j] = akr_load_f16(h + j * AK_N);
}
#endif

/* 16 elements at p as float32 in AK_NB registers (dtype a constant wherever this is inlined),
 * in order, or with `eo` (bfloat16, AK_NB == 2: AK_EVEN_ODD) the even ones, then the odd */
AK_INLINE void read16(const char *p, int dtype, int eo, akr x[AK_NB]) {
    const uint16_t *h = (const uint16_t *)(const void *)p;
    if (dtype == AK_F32) {
        for (int j = 0; j < AK_NB; ++j) x[j] = akr_load((const float *)(const void *)p + j * AK_N);
    } else if (dtype == AK_BF16 && eo && AK_NB == 2) {
        akr_load_bf16_eo(h, &x[0], &x[AK_NB - 1]);
    } else if (dtype == AK_BF16) {
        for (int j = 0; j < AK_NB; ++j) x[j] = akr_load_bf16(h + j * AK_N);
    } else if (dtype == AK_F16) {
        for (int j = 0; j < AK_NB; ++j) x[j] = akr_load_f16(h + j * AK_N);
    } else {
        fp8_w(p, dtype, x);
    }
}

/* 16 elements of a page row (bfloat16: in AK_EVEN_ODD's order) */
AK_INLINE void load_w(const char *p, int dtype, akr x[AK_NB]) {
    read16(p, dtype, AK_EVEN_ODD(dtype), x);
}

/* out[g * os] = the sum of a[g]'s lanes, g < 4 (the four sums together: akr_rows4_add) */
AK_INLINE void hsum4n(const akr a[4], float *out, int64_t os) {
    const akv4 x = akr_rows4_add(a[0], a[1], a[2], a[3]);
    for (int g = 0; g < 4; ++g) out[g * os] = x[g];
}

/* The next chunk's rows of one kv head, asked for into L2 a token at a time while this chunk
 * is computed: row[t] is chunk column t's K (or V) row of kv head 0 (NULL past the next
 * chunk's end), off the head's offset and bytes a row's length, in bytes. A burst of
 * requests for a whole chunk at once waited on the core's few miss slots (fill buffers)
 * with nothing to overlap it; spread over the loop that reads this chunk, the memory works
 * while the core computes (measured: fp8 decode at 8k 24-25 -> 16-17 ms, 2 threads). */
typedef struct {
    const char *const *row;
    int64_t off, bytes;
} ak_ahead;

AK_INLINE void ahead(const ak_ahead *a, int64_t t) {
    if (!a || !a->row[t]) return;
    const char *p = a->row[t] + a->off;
    for (int64_t o = 0; o < a->bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/* ahead() for every row t < n: for the loops that do not ask as they go */
/* A row's visible columns [*t0, *t1) of the chunk [c0, c1) (chunk-relative; the row sees
 * keys [lo, hi)), within the chunk's segment [st, se) */
AK_INLINE void row_span(int64_t lo, int64_t hi, int64_t c0, int64_t c1, int64_t st, int64_t se,
                        int64_t *t0, int64_t *t1) {
    *t0 = lo > c0 ? lo - c0 : 0;
    *t1 = hi < c1 ? hi - c0 : c1 - c0;
    if (*t0 < st) *t0 = st;
    if (*t1 > se) *t1 = se;
}

AK_INLINE void ahead_all(const ak_ahead *a, int64_t n) {
    for (int64_t t = 0; t < n; ++t) ahead(a, t);
}

/* Part `part` of `parts` of what ahead() asks for row by row: lines [*l0, *l1) of each row, so
 * that a loop in parts (the d blocks of P V, say) spreads the rows' lines over its passes */
AK_INLINE void ahead_part(const ak_ahead *a, int64_t part, int64_t parts, int64_t *l0,
                          int64_t *l1) {
    const int64_t n = a ? (a->bytes + 63) / 64 : 0;
    *l0 = part * n / parts;
    *l1 = (part + 1) * n / parts;
}

AK_INLINE void ahead_lines(const ak_ahead *a, int64_t t, int64_t l0, int64_t l1) {
    if (l0 >= l1 || !a->row[t]) return;
    const char *p = a->row[t] + a->off;
    for (int64_t l = l0; l < l1; ++l) __builtin_prefetch(p + 64 * l, 0, 2);
}

/* out[g * os] = q_g . k for 4 query rows q_g = q + g * D (q from L1: for larger D they do not
 * fit in registers), the sums of each native vector of 16 elements apart: eight chains of
 * multiply-adds in flight with AVX2 (the sums of 4 rows alone left the loop waiting on their
 * latency); AVX-512's four 16-lane sums fill its two units as they are */
AK_INLINE void score4(const char *k, int dtype, const float *q, int64_t D, float *out,
                      int64_t os) {
    const int esz = AK_ESZ(dtype);
    akr a[4][AK_NB];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < AK_NB; ++j) a[g][j] = akr_set1(0.0f);
    for (int64_t d = 0; d < D; d += AK_W) {
        akr kb[AK_NB];
        load_w(k + d * esz, dtype, kb);
        for (int g = 0; g < 4; ++g)
            for (int j = 0; j < AK_NB; ++j)
                a[g][j] = akr_fmadd(akr_load(q + g * D + d + j * AK_N), kb[j], a[g][j]);
    }
    akr sums[4];
    for (int g = 0; g < 4; ++g) {
        sums[g] = a[g][0];
        for (int j = 1; j < AK_NB; ++j) sums[g] = akr_add(sums[g], a[g][j]);
    }
    hsum4n(sums, out, os);
}

#ifdef AK_AVX2
/* score4 for two keys k0, k1 at once (AVX2, fp8 keys): each query block loaded once for both
 * (score4 reloads the four rows' blocks for every key: nine loads to eight multiply-adds, at
 * the load ports' limit), one sum a row and key over the row's blocks, and the eight sums
 * reduced together (pairs of lanes, quarters, then halves): out[g * os + i] for key i */
AK_INLINE void score4x2(const char *k0, const char *k1, int dtype, const float *q, int64_t D,
                        float *out, int64_t os) {
    akr a[4][2];
    for (int g = 0; g < 4; ++g) a[g][0] = a[g][1] = akr_set1(0.0f);
    for (int64_t d = 0; d < D; d += AK_W) {
        akr x[2][2];
        load_w(k0 + d, dtype, x[0]);
        load_w(k1 + d, dtype, x[1]);
        for (int g = 0; g < 4; ++g) {
            akr q0 = akr_load(q + g * D + d), q1 = akr_load(q + g * D + d + 8);
            akr_keep2(q0, q1); /* (one load for both keys, not one folded into each) */
            a[g][0] = akr_fmadd(q0, x[0][0], a[g][0]);
            a[g][1] = akr_fmadd(q0, x[1][0], a[g][1]);
            a[g][0] = akr_fmadd(q1, x[0][1], a[g][0]);
            a[g][1] = akr_fmadd(q1, x[1][1], a[g][1]);
        }
    }
    /* rows 0 and 1's two sums each, then rows 2 and 3's */
    const akv4 r01 = akr_rows4_add(a[0][0], a[0][1], a[1][0], a[1][1]);
    const akv4 r23 = akr_rows4_add(a[2][0], a[2][1], a[3][0], a[3][1]);
    akv4_store_lo(out, r01);
    akv4_store_hi(out + os, r01);
    akv4_store_lo(out + 2 * os, r23);
    akv4_store_hi(out + 3 * os, r23);
}
#endif

AK_INLINE void score1(const char *k, int dtype, const float *q, int64_t D, float *out) {
    const int esz = AK_ESZ(dtype);
    akr a0 = akr_set1(0.0f), a1 = a0;
    int64_t d = 0;
    for (; d + 2 * AK_N <= D; d += 2 * AK_N) {
        const akr q0 = akr_load(q + d), q1 = akr_load(q + d + AK_N);
        akr kb[2];
        if (AK_NB == 2) { /* (one 16-element load holds both blocks) */
            load_w(k + d * esz, dtype, kb);
        } else {
            load_w(k + d * esz, dtype, kb);
            load_w(k + (d + AK_N) * esz, dtype, kb + 1);
        }
        a0 = akr_fmadd(q0, kb[0], a0);
        a1 = akr_fmadd(q1, kb[1], a1);
    }
    for (; d < D; d += AK_W) { /* (AK_N == 16 only: D % 16 == 0) */
        akr kb[AK_NB];
        load_w(k + d * esz, dtype, kb);
        a0 = akr_fmadd(akr_load(q + d), kb[0], a0);
    }
    out[0] = akr_reduce_add(akr_add(a0, a1));
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define AK_DPBF16 1
/* bfloat16 keys and queries straight into vdpbf16ps: products of two bfloat16 are exact in
 * float32, so this is the float32 dot product of the given values, in half the instructions
 * and with no conversion. D is a multiple of 32. */
AK_INLINE __m512bh ak_bh(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

AK_INLINE void score4_dp(const uint16_t *k, const uint16_t *q, int64_t D, float scale,
                         float *out, int64_t os) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
        const __m512bh kv = ak_bh(k + d);
        a0 = _mm512_dpbf16_ps(a0, ak_bh(q + d), kv);
        a1 = _mm512_dpbf16_ps(a1, ak_bh(q + D + d), kv);
        a2 = _mm512_dpbf16_ps(a2, ak_bh(q + 2 * D + d), kv);
        a3 = _mm512_dpbf16_ps(a3, ak_bh(q + 3 * D + d), kv);
    }
    const __m512 x = _mm512_mul_ps(akr_rows4_lanes(a0, a1, a2, a3), _mm512_set1_ps(scale));
    float lanes[16];
    _mm512_storeu_ps(lanes, x);
    out[0] = lanes[0];
    out[os] = lanes[4];
    out[2 * os] = lanes[8];
    out[3 * os] = lanes[12];
}

AK_INLINE void score1_dp(const uint16_t *k, const uint16_t *q, int64_t D, float scale,
                         float *out) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) a0 = _mm512_dpbf16_ps(a0, ak_bh(q + d), ak_bh(k + d));
    out[0] = scale * _mm512_reduce_add_ps(a0);
}
#endif

int attnkit_native_has_dpbf16(void) {
#ifdef AK_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* P V, 16 value dims at a time, with eight sums in flight for four rows (the chains of
 * dependent multiply-adds, not their throughput, bounded these loops): AVX-512 one vector a
 * row and the even and odd tokens in separate sums (AK_PV_PAR), AVX2 two vectors a row. */
#define AK_PV_PAR (AK_N / 8)

/* a[g][j] += p[g * ps] * x[j] for ROWS rows g: one value row's 16 dims x into their sums */
AK_INLINE void pv_fma(const akr x[AK_NB], const float *p, int64_t ps, int ROWS,
                      akr a[4][AK_NB]) {
    for (int g = 0; g < ROWS; ++g)
        for (int j = 0; j < AK_NB; ++j) a[g][j] = akr_fmadd(akr_set1(p[g * ps]), x[j], a[g][j]);
}

/* acc_g += sum_t p[g * ps + t] * v_t for ROWS rows g (1 or 4, a constant where inlined), over
 * n value rows v_t = v + t * vstride (the next chunk's rows asked for from pf, NULL: none):
 * two tokens a step, both rows loaded before their multiply-adds */
AK_INLINE void pv_rows(const char *v, int64_t vstride, int64_t n, int dtype, const float *p,
                       int64_t ps, int64_t Dv, int ROWS, float *acc, const ak_ahead *pf,
                       int64_t part0, int64_t parts) {
    const int esz = AK_ESZ(dtype);
    for (int64_t d = 0; d < Dv; d += AK_W) {
        int64_t l0, l1; /* this d block's lines of the next rows (pf: part0 + d block) */
        ahead_part(pf, part0 + d / AK_W, parts, &l0, &l1);
        akr a[4][AK_NB], b[4][AK_NB]; /* b: the odd tokens' sums (AK_PV_PAR == 2) */
        for (int g = 0; g < ROWS; ++g)
            for (int j = 0; j < AK_NB; ++j) {
                a[g][j] = akr_load(acc + g * Dv + d + j * AK_N);
                b[g][j] = akr_set1(0.0f);
            }
        const char *vd = v + d * esz;
        int64_t t = 0;
        for (; t + 1 < n; t += 2) {
            ahead_lines(pf, t, l0, l1);
            ahead_lines(pf, t + 1, l0, l1);
            akr x0[AK_NB], x1[AK_NB];
            load_w(vd + t * vstride, dtype, x0);
            load_w(vd + (t + 1) * vstride, dtype, x1);
            pv_fma(x0, p + t, ps, ROWS, a);
            if (AK_PV_PAR == 2)
                pv_fma(x1, p + t + 1, ps, ROWS, b);
            else
                pv_fma(x1, p + t + 1, ps, ROWS, a);
        }
        if (t < n) {
            ahead_lines(pf, t, l0, l1);
            akr x0[AK_NB];
            load_w(vd + t * vstride, dtype, x0);
            pv_fma(x0, p + t, ps, ROWS, a);
        }
        for (int g = 0; g < ROWS; ++g)
            for (int j = 0; j < AK_NB; ++j) {
                if (AK_PV_PAR == 2) a[g][j] = akr_add(a[g][j], b[g][j]);
                akr_store(acc + g * Dv + d + j * AK_N, a[g][j]);
            }
    }
}

/* scores of `rows` query rows (q, row-major D) against one key row, into out[r * os] */
AK_INLINE void score_head_t(const char *k, int dtype, const float *q, int64_t D, int64_t rows,
                            float *out, int64_t os) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) score4(k, dtype, q + r * D, D, out + r * os, os);
    for (; r < rows; ++r) score1(k, dtype, q + r * D, D, out + r * os);
}

AK_INLINE void pv_head_t(const char *v, int64_t vstride, int64_t n, int dtype, const float *p,
                         int64_t ps, int64_t Dv, int64_t rows, float *acc,
                         const ak_ahead *pf) {
    int64_t r = 0;
    if (rows < 4) ahead_all(pf, n);
    /* the next rows' lines spread over every group's d blocks (as pv_head_dp) */
    const int64_t blocks = (Dv + AK_W - 1) / AK_W, parts = rows / 4 * blocks;
    for (; r + 4 <= rows; r += 4)
        pv_rows(v, vstride, n, dtype, p + r * ps, ps, Dv, 4, acc + r * Dv, pf, r / 4 * blocks,
                parts);
    for (; r < rows; ++r)
        pv_rows(v, vstride, n, dtype, p + r * ps, 0, Dv, 1, acc + r * Dv, NULL, 0, 1);
}

AK_INLINE void score_head(const char *k, int dtype, const float *q, const uint16_t *qh,
                          float scale, int64_t D, int64_t rows, float *out, int64_t os) {
#ifdef AK_DPBF16
    if (qh != NULL) { /* bfloat16 with D % 32 == 0 (checked by the caller) */
        const uint16_t *kk = (const uint16_t *)k;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) score4_dp(kk, qh + r * D, D, scale, out + r * os, os);
        for (; r < rows; ++r) score1_dp(kk, qh + r * D, D, scale, out + r * os);
        return;
    }
#else
    (void)qh;
    (void)scale;
#endif
    if (dtype == AK_BF16) score_head_t(k, AK_BF16, q, D, rows, out, os);
    else if (dtype == AK_F16) score_head_t(k, AK_F16, q, D, rows, out, os);
    else if (dtype == AK_E4M3) score_head_t(k, AK_E4M3, q, D, rows, out, os);
    else if (dtype == AK_E5M2) score_head_t(k, AK_E5M2, q, D, rows, out, os);
    else score_head_t(k, AK_F32, q, D, rows, out, os);
}

static void pv_head(const char *v, int64_t vstride, int64_t n, int dtype, const float *p,
                    int64_t ps, int64_t Dv, int64_t rows, float *acc, const ak_ahead *pf) {
#ifdef AK_AVX2
    /* e4m3: the head's value rows (in L1 after this) looked at first, and converted without
     * the NaN step where they hold no NaN byte */
    if (dtype == AK_E4M3 && !ak_e4m3_nan((const uint8_t *)v, vstride, n, Dv)) {
        pv_head_t(v, vstride, n, AK_E4M3_FINITE, p, ps, Dv, rows, acc, pf);
        return;
    }
#endif
    if (dtype == AK_BF16) pv_head_t(v, vstride, n, AK_BF16, p, ps, Dv, rows, acc, pf);
    else if (dtype == AK_F16) pv_head_t(v, vstride, n, AK_F16, p, ps, Dv, rows, acc, pf);
    else if (dtype == AK_E4M3) pv_head_t(v, vstride, n, AK_E4M3, p, ps, Dv, rows, acc, pf);
    else if (dtype == AK_E5M2) pv_head_t(v, vstride, n, AK_E5M2, p, ps, Dv, rows, acc, pf);
    else pv_head_t(v, vstride, n, AK_F32, p, ps, Dv, rows, acc, pf);
}

#ifdef AK_DPBF16
/* P V in vdpbf16ps (bf16_pv: bfloat16 pages, Dv % 32 == 0): the weights rounded to bfloat16
 * (round to nearest even, as torch's bfloat16 kernels round P), two keys a step: the rows
 * v_t and v_t+1 interleaved 16 bits at a time (vpunpcklwd / vpunpckhwd) against the pair
 * (p_t, p_t+1) broadcast as one 32-bit lane, the sums in float32. An odd last key pairs with
 * a zero row and weight 0 (nothing past the n rows is read). The interleave puts dim
 * 8k + i (i < 4) of each 32 in lane 4k + i of the "lo" sums and dim 8k + 4 + i in lane 4k + i
 * of the "hi" sums: they go back in order (one permute each) when added into acc. ROWS rows
 * (1 or 4) g of weights p + g * ps, sums acc + g * Dv; 64 dims a pass where Dv allows. */
#define AK_PW (AK_CHUNK / 2 + 8)
AK_INLINE void pv_dp_pair(__m512i x0, __m512i x1, const uint32_t pw[4][AK_PW], int64_t i,
                          int ROWS, __m512 *lo, __m512 *hi) {
    const __m512bh il = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
    const __m512bh ih = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    for (int g = 0; g < ROWS; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pw[g][i]);
        lo[g] = _mm512_dpbf16_ps(lo[g], il, pp);
        hi[g] = _mm512_dpbf16_ps(hi[g], ih, pp);
    }
}

/* pv_dp_rows for DB blocks of 32 columns per pass over the keys (a constant where inlined: a
 * count read at run time kept the pass's sums in memory-tracked flags) */
AK_INLINE void pv_dp_rows_db(const char *v, int64_t vstride, int64_t n, const float *p,
                             int64_t ps, int64_t Dv, int ROWS, float *acc,
                             const ak_ahead *pf, int64_t part0, int64_t parts, const int DB) {
    uint32_t pw[4][AK_PW]; /* row g's weights in bfloat16, pair i = (p_2i, p_2i+1) */
    for (int g = 0; g < ROWS; ++g)
        for (int64_t t = 0; t < n; t += 16) {
            const int64_t m = n - t < 16 ? n - t : 16; /* lanes past n: weight 0 */
            const __m512 x = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p + g * ps + t);
            _mm256_storeu_si256((__m256i *)(void *)&pw[g][t / 2],
                                (__m256i)_mm512_cvtneps_pbh(x));
        }
    const int64_t pairs = n / 2;
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                         30, 31);
    for (int64_t d = 0; d < Dv; d += 32 * DB) {
        __m512 lo[2][4], hi[2][4];
        for (int b = 0; b < DB; ++b)
            for (int g = 0; g < ROWS; ++g) lo[b][g] = hi[b][g] = _mm512_setzero_ps();
        const char *vd = v + d * 2;
        int64_t l0, l1; /* this d block's lines of the next rows (pf: part0 + d block) */
        ahead_part(pf, part0 + d / (32 * DB), parts, &l0, &l1);
        int64_t i = 0;
        for (; i < pairs; ++i) {
            const int64_t t = 2 * i;
            ahead_lines(pf, t, l0, l1);
            ahead_lines(pf, t + 1, l0, l1);
            const char *r0 = vd + t * vstride, *r1 = r0 + vstride;
            for (int b = 0; b < DB; ++b)
                pv_dp_pair(_mm512_loadu_si512((const void *)(r0 + 64 * b)),
                           _mm512_loadu_si512((const void *)(r1 + 64 * b)), pw, i, ROWS, lo[b],
                           hi[b]);
        }
        if (n & 1) { /* the last key with a zero row */
            ahead_lines(pf, n - 1, l0, l1);
            const char *r0 = vd + (n - 1) * vstride;
            for (int b = 0; b < DB; ++b)
                pv_dp_pair(_mm512_loadu_si512((const void *)(r0 + 64 * b)),
                           _mm512_setzero_si512(), pw, i, ROWS, lo[b], hi[b]);
        }
        for (int b = 0; b < DB; ++b)
            for (int g = 0; g < ROWS; ++g) {
                float *a = acc + g * Dv + d + 32 * b;
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a),
                                                  _mm512_permutex2var_ps(lo[b][g], i0, hi[b][g])));
                _mm512_storeu_ps(a + 16,
                                 _mm512_add_ps(_mm512_loadu_ps(a + 16),
                                               _mm512_permutex2var_ps(lo[b][g], i1, hi[b][g])));
            }
    }
}

AK_INLINE void pv_dp_rows(const char *v, int64_t vstride, int64_t n, const float *p,
                          int64_t ps, int64_t Dv, int ROWS, float *acc, const ak_ahead *pf,
                          int64_t part0, int64_t parts) {
    if (Dv % 64 == 0)
        pv_dp_rows_db(v, vstride, n, p, ps, Dv, ROWS, acc, pf, part0, parts, 2);
    else
        pv_dp_rows_db(v, vstride, n, p, ps, Dv, ROWS, acc, pf, part0, parts, 1);
}

/* pv_head's bf16_pv form: the head's rows four at a time, then one at a time */
static void pv_head_dp(const char *v, int64_t vstride, int64_t n, const float *p, int64_t ps,
                       int64_t Dv, int64_t rows, float *acc, const ak_ahead *pf) {
    int64_t r = 0;
    if (rows < 4) ahead_all(pf, n);
    /* the next rows' lines spread over every group's d blocks (all at once waited on the
     * core's miss slots) */
    const int64_t blocks = Dv / (Dv % 64 == 0 ? 64 : 32), parts = rows / 4 * blocks;
    for (; r + 4 <= rows; r += 4)
        pv_dp_rows(v, vstride, n, p + r * ps, ps, Dv, 4, acc + r * Dv, pf, r / 4 * blocks,
                   parts);
    for (; r < rows; ++r)
        pv_dp_rows(v, vstride, n, p + r * ps, 0, Dv, 1, acc + r * Dv, NULL, 0, 1);
}
#endif

/* Visible keys [*a, *e) of a query at aligned position ip among L keys: ip - left <= j and
 * j <= ip + right, a side without its flag unbounded. ip and L are small (|ip| <= L + Lq) but
 * the bounds may be anywhere in int64, so this compares them with small numbers and forms
 * ip - left or ip + right + 1 only where they lie strictly inside (0, L). */
AK_INLINE void visible_range(int64_t ip, int64_t L, int has_left, int64_t left, int has_right,
                             int64_t right, int64_t *a, int64_t *e) {
    int64_t lo = 0, hi = L;
    if (has_left && left < ip) lo = left <= ip - L ? L : ip - left;
    if (has_right && right < L - 1 - ip) hi = right < -ip ? 0 : ip + right + 1;
    *a = lo;
    *e = hi < lo ? lo : hi;
}

/* P V over the key range [t0, t1) of a chunk only, row by row: for chunks that some row of a
 * kv head sees only in part, so that the keys it does not see (weight 0) never multiply
 * into its sums (0 * NaN would be NaN) */
static void pv_row_range(const char *v, int64_t vstride, int64_t t0, int64_t t1, int dtype,
                         const float *p, int64_t Dv, float *acc) {
    if (t1 <= t0) return;
    const int64_t n = t1 - t0;
    v += t0 * vstride;
    p += t0;
    if (dtype == AK_BF16) pv_rows(v, vstride, n, AK_BF16, p, 0, Dv, 1, acc, NULL, 0, 1);
    else if (dtype == AK_F16) pv_rows(v, vstride, n, AK_F16, p, 0, Dv, 1, acc, NULL, 0, 1);
    else if (dtype == AK_E4M3) pv_rows(v, vstride, n, AK_E4M3, p, 0, Dv, 1, acc, NULL, 0, 1);
    else if (dtype == AK_E5M2) pv_rows(v, vstride, n, AK_E5M2, p, 0, Dv, 1, acc, NULL, 0, 1);
    else pv_rows(v, vstride, n, AK_F32, p, 0, Dv, 1, acc, NULL, 0, 1);
}

/* One row's score terms and visibility over a chunk's lanes [0, nw), in place: softcap
 * (cap > 0), ALiBi (slope sl, the row's position ip), -inf outside its visible lanes
 * [a, e); returns the row's largest score in the chunk (NaN lanes drop out of the max) */
AK_INLINE float row_terms(float *sr, int64_t nw, float a, float e, float ip, float sl,
                          float cap, int alibi) {
    static const float lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const akr iota = akr_load(lanes), ninf = akr_set1(-INFINITY);
    akr mxv = ninf;
    for (int64_t t0 = 0; t0 < nw; t0 += AK_N) {
        akr v = akr_load(sr + t0);
        const akr t = akr_add(iota, akr_set1((float)t0));
        if (cap > 0.0f)
            v = akr_mul(akr_set1(cap), akr_tanh_fine(akr_mul(v, akr_set1(1.0f / cap))));
        if (alibi) v = akr_sub(v, akr_mul(akr_set1(sl), akr_abs(akr_sub(akr_set1(ip), t))));
        v = akr_select(akrm_and(akr_ge(t, akr_set1(a)), akr_lt(t, akr_set1(e))), v, ninf);
        mxv = akr_max(v, mxv); /* (v where v > mxv: a NaN lane drops out) */
        akr_store(sr + t0, v);
    }
    return akr_reduce_max(mxv);
}

/* One row's softmax weights exp(s - mnew) over a chunk's lanes [0, nw), in place (0 where
 * s = -inf, NaN where NaN); returns their sum */
AK_INLINE float row_weights(float *sr, int64_t nw, float mnew) {
    akr sumv = akr_set1(0.0f);
    for (int64_t t0 = 0; t0 < nw; t0 += AK_N) {
        const akr p = akr_exp_nonpos(akr_sub(akr_load(sr + t0), akr_set1(mnew)));
        akr_store(sr + t0, p);
        sumv = akr_add(sumv, p);
    }
    return akr_reduce_add(sumv);
}

/* sc[r * AK_CHUNK + t] *= unit * descale[h] for the rows r of each kv head h, t0 <= t < t1 */
static void scale_rows(float *sc, const float *descale, float unit, int64_t Hkv,
                       int64_t rows_per_head, int64_t t0, int64_t t1) {
    for (int64_t h = 0; h < Hkv; ++h) {
        const float f = unit * descale[h];
        float *row = sc + h * rows_per_head * AK_CHUNK;
        for (int64_t r = 0; r < rows_per_head; ++r, row += AK_CHUNK)
            for (int64_t t = t0; t < t1; ++t) row[t] *= f;
    }
}

/* Per-thread scratch for one work item; sized for R = Hq * Lq rows. */
typedef struct {
    float *acc, *sc, *m, *l, *slope, *q, *cmx;
    uint16_t *qh; /* q rows in bfloat16 */
#ifdef AK_H16
    _Float16 *q16;       /* AK_H16: q rows scaled to [0.5, 1) */
    uint32_t *p16;       /* AK_H16: a head's weights, each float16 twice (AK_CHUNK a row) */
    float *qf;           /* AK_H16: what scaled q row r down (a power of two) */
#endif
    int64_t *lo, *hi, *ipos;
} ak_scratch;

/* One page's part of a chunk: chunk columns [t, t + len) are tokens of `page`, from its
 * token `first` on. A chunk (up to AK_CHUNK keys) spans as many pages as it needs, so small
 * pages cost no more softmax passes than large ones. */
typedef struct {
    int64_t t, len, page, first;
} ak_seg;

/* the segments of chunk [c0, c1) of sequence b (its keys from block-table position base);
 * returns their number (at most AK_CHUNK) */
AK_INLINE int64_t chunk_segments(const ak_job *job, int64_t b, int64_t base, int64_t c0,
                                 int64_t c1, ak_seg *seg) {
    const int64_t P = job->P;
    int64_t count = 0;
    for (int64_t t = 0; t < c1 - c0;) {
        const int64_t pos = base + c0 + t, first = pos % P;
        int64_t len = P - first;
        if (len > c1 - c0 - t) len = c1 - c0 - t;
        seg[count++] = (ak_seg){t, len, job->bt[b * job->bt_cols + pos / P], first};
        t += len;
    }
    return count;
}

/* Scores of 4 query rows (q, row-major D = NB * AK_W) against `len` key rows k + t * ks
 * (bytes), into out[g * AK_CHUNK + t]: the query blocks stay in registers for every key
 * (reloading them for each key cost more loads than multiply-adds). NB is a constant where
 * this is inlined. */
AK_INLINE void score4_keys(const char *k, int64_t ks, int64_t len, int dtype, const float *q,
                           int NB, float *out, const ak_ahead *pf) {
    const int esz = AK_ESZ(dtype);
    const int64_t D = (int64_t)NB * AK_W;
    akr qv[4][4 * AK_NB];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB * AK_NB; ++j) qv[g][j] = akr_load(q + g * D + j * AK_N);
    for (int64_t t = 0; t < len; ++t) {
        ahead(pf, t);
        const char *row = k + t * ks;
        akr a[4] = {akr_set1(0.0f), akr_set1(0.0f), akr_set1(0.0f), akr_set1(0.0f)};
        for (int jb = 0; jb < NB; ++jb) {
            akr kb[AK_NB];
            load_w(row + jb * AK_W * esz, dtype, kb);
            for (int g = 0; g < 4; ++g)
                for (int j = 0; j < AK_NB; ++j)
                    a[g] = akr_fmadd(qv[g][jb * AK_NB + j], kb[j], a[g]);
        }
        hsum4n(a, out + t, AK_CHUNK);
    }
}

#ifdef AK_DPBF16
/* AK_DOT4: one key's four row sums for the bfloat16 dot products (qv, NB in scope): LOAD(row)
 * brings a key row in, KV(j) is its block j of 32 bfloat16.
 * AK_SCORE4_KEYS: the body of a 4-row score loop over `len` keys (k, ks, len, out, pf and
 * sv_, the rows' multipliers in their 128-bit lanes, in scope); DOT(row, out) is one key's
 * four row sums, row g's in 128-bit lane g. Four keys at a time share one multiply and four
 * stores (key i's sums blended into element i of each lane): storing each sum alone cost more
 * than its dot product. */
#define AK_DOT4(ROW, OUT, LOAD, KV)                                                        \
    do {                                                                                   \
        LOAD(ROW)                                                                          \
        __m512 a_[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),     \
                        _mm512_setzero_ps()};                                              \
        for (int j_ = 0; j_ < NB; ++j_)                                                    \
            for (int g_ = 0; g_ < 4; ++g_)                                                 \
                a_[g_] = _mm512_dpbf16_ps(a_[g_], qv[g_][j_], KV(j_));                     \
        (OUT) = akr_rows4_lanes(a_[0], a_[1], a_[2], a_[3]);                              \
    } while (0)
#define AK_SCORE4_KEYS(DOT)                                                                \
    int64_t t = 0;                                                                         \
    for (; t + 4 <= len; t += 4) {                                                         \
        ahead(pf, t);                                                                      \
        ahead(pf, t + 1);                                                                  \
        ahead(pf, t + 2);                                                                  \
        ahead(pf, t + 3);                                                                  \
        __m512 x0, x1, x2, x3;                                                             \
        DOT(k + t * ks, x0);                                                              \
        DOT(k + (t + 1) * ks, x1);                                                        \
        DOT(k + (t + 2) * ks, x2);                                                        \
        DOT(k + (t + 3) * ks, x3);                                                        \
        __m512 y = _mm512_mask_blend_ps(0x2222, x0, x1);                                   \
        y = _mm512_mask_blend_ps(0x4444, y, x2);                                           \
        y = _mm512_mul_ps(_mm512_mask_blend_ps(0x8888, y, x3), sv_);                       \
        _mm_storeu_ps(out + t, _mm512_castps512_ps128(y));                                 \
        _mm_storeu_ps(out + AK_CHUNK + t, _mm512_extractf32x4_ps(y, 1));                   \
        _mm_storeu_ps(out + 2 * AK_CHUNK + t, _mm512_extractf32x4_ps(y, 2));               \
        _mm_storeu_ps(out + 3 * AK_CHUNK + t, _mm512_extractf32x4_ps(y, 3));               \
    }                                                                                      \
    for (; t < len; ++t) {                                                                 \
        ahead(pf, t);                                                                      \
        __m512 x;                                                                          \
        DOT(k + t * ks, x);                                                               \
        float lanes_[16];                                                                  \
        _mm512_storeu_ps(lanes_, _mm512_mul_ps(x, sv_));                                   \
        for (int g = 0; g < 4; ++g) out[g * AK_CHUNK + t] = lanes_[4 * g];                 \
    }

/* the same with bfloat16 queries and keys in vdpbf16ps (D = NB * 32), times the scale */
AK_INLINE void score4_keys_dp(const uint16_t *k, int64_t ks, int64_t len, const uint16_t *q,
                              float scale, int NB, float *out, const ak_ahead *pf) {
    const int64_t D = (int64_t)NB * 32;
    __m512bh qv[4][4];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB; ++j) qv[g][j] = ak_bh(q + g * D + j * 32);
#define AK_LOAD16(ROW) const uint16_t *row_ = (ROW);
#define AK_KV16(J) ak_bh(row_ + (J) * 32)
#define AK_DOT(ROW, OUT) AK_DOT4(ROW, OUT, AK_LOAD16, AK_KV16)
    const __m512 sv_ = _mm512_set1_ps(scale);
    AK_SCORE4_KEYS(AK_DOT)
#undef AK_DOT
#undef AK_LOAD16
#undef AK_KV16
}
#endif

#if defined(AK_DPBF16) && defined(__AVX512VBMI__)
#define AK_FP8DOT 1
/* fp8 pages with bfloat16 queries: each fp8 byte becomes its exact value (the one read16
 * gives: e4m3 times 2^-8) by two 128-entry byte tables, the low and high byte of its
 * bfloat16 pattern, looked up with vpermi2b on the byte without its sign (the sign or-ed
 * into the high byte); byte permutes then put the halves together as bfloat16 keys for the
 * dot products, or as float32 values (exact, low bytes zero) for P V: 64 elements in six to
 * eight instructions, where the float16 route took about eight for every 16. */
typedef struct {
    __m512i lo0, lo1, hi0, hi1; /* the tables */
    __m512i w0, w1;             /* bytes 0-31 / 32-63 as 32 bfloat16 in order */
    __m512i f[4];               /* bytes 16i..16i+15 as 16 float32 in order */
} ak_tab;

/* the tables and byte orders of an fp8 dtype into job (called before the workers start) */
static void fp8_tables(ak_job *job) {
    uint8_t bytes[128];
    for (int i = 0; i < 128; ++i) bytes[i] = (uint8_t)i;
    for (int i = 0; i < 128; i += AK_W) {
        akr x[AK_NB];
        float f[AK_W];
        read16((const char *)bytes + i, job->dtype, 0, x);
        for (int j = 0; j < AK_NB; ++j) akr_store(f + j * AK_N, x[j]);
        uint32_t u[AK_W];
        memcpy(u, f, sizeof u);
        for (int j = 0; j < AK_W; ++j) {
            job->tab[0][i + j] = (uint8_t)(u[j] >> 16); /* exact: at most 3 mantissa bits */
            job->tab[1][i + j] = (uint8_t)(u[j] >> 24);
        }
    }
    /* byte j of a result: 0-63 pick from the low bytes L, 64-127 from the high bytes H */
    for (int j = 0; j < 64; ++j) {
        const int e = j / 2, hi = (j & 1) * 64; /* word e = (L[e], H[e]) */
        job->order[0][j] = (uint8_t)(hi + e);
        job->order[1][j] = (uint8_t)(hi + 32 + e);
        /* float32 e of block i: bytes (0, 0, L, H) of element 16i + e (the zeros by mask) */
        for (int i = 0; i < 4; ++i)
            job->order[2 + i][j] = (uint8_t)((j % 4 == 3 ? 64 : 0) + 16 * i + j / 4);
    }
}

AK_INLINE ak_tab fp8_tab(const ak_job *job) {
    ak_tab T;
    T.lo0 = _mm512_loadu_si512((const void *)job->tab[0]);
    T.lo1 = _mm512_loadu_si512((const void *)(job->tab[0] + 64));
    T.hi0 = _mm512_loadu_si512((const void *)job->tab[1]);
    T.hi1 = _mm512_loadu_si512((const void *)(job->tab[1] + 64));
    T.w0 = _mm512_loadu_si512((const void *)job->order[0]);
    T.w1 = _mm512_loadu_si512((const void *)job->order[1]);
    for (int i = 0; i < 4; ++i) T.f[i] = _mm512_loadu_si512((const void *)job->order[2 + i]);
    return T;
}

/* the low and high bytes of the bfloat16 values of the 64 fp8 bytes in x */
AK_INLINE void fp8_halves(__m512i x, const ak_tab *T, __m512i *lo, __m512i *hi) {
    *lo = _mm512_permutex2var_epi8(T->lo0, x, T->lo1);
    /* hi | (x & 0x80): the sign */
    *hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(T->hi0, x, T->hi1), x,
                                    _mm512_set1_epi8((char)0x80), 0xF8);
}

/* fp8 key row `row` (NB * 32 bytes) as NB blocks of 32 bfloat16 */
AK_INLINE void fp8_row_bh(const uint8_t *row, const ak_tab *T, int NB, __m512i *kv) {
    __m512i lo, hi;
    int j = 0;
    for (; j + 1 < NB; j += 2) {
        fp8_halves(_mm512_loadu_si512((const void *)(row + j * 32)), T, &lo, &hi);
        kv[j] = _mm512_permutex2var_epi8(lo, T->w0, hi);
        kv[j + 1] = _mm512_permutex2var_epi8(lo, T->w1, hi);
    }
    if (j < NB) {
        const __m256i x = _mm256_loadu_si256((const void *)(row + j * 32));
        fp8_halves(_mm512_zextsi256_si512(x), T, &lo, &hi);
        kv[j] = _mm512_permutex2var_epi8(lo, T->w0, hi);
    }
}

/* Scores of 4 bfloat16 query rows (D = NB * 32, in registers) against `len` fp8 key rows
 * k + t * ks (bytes), times the scale, into out[g * AK_CHUNK + t] (as score4_keys_dp) */
AK_INLINE void score4_keys_dp8(const uint8_t *k, int64_t ks, int64_t len, const uint16_t *q,
                               float scale, int NB, const ak_tab *T, float *out,
                               const ak_ahead *pf) {
    const int64_t D = (int64_t)NB * 32;
    __m512bh qv[4][4];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB; ++j) qv[g][j] = ak_bh(q + g * D + j * 32);
#define AK_LOAD8(ROW)                                                                      \
    __m512i kv_[4];                                                                        \
    fp8_row_bh((ROW), T, NB, kv_);
#define AK_KV8(J) ((__m512bh)kv_[J])
#define AK_DOT(ROW, OUT) AK_DOT4(ROW, OUT, AK_LOAD8, AK_KV8)
    const __m512 sv_ = _mm512_set1_ps(scale);
    AK_SCORE4_KEYS(AK_DOT)
#undef AK_DOT
#undef AK_LOAD8
#undef AK_KV8
}

/* acc_g += sum_t p[g * ps + t] * v_t for ROWS rows g (a constant where inlined), over n fp8
 * value rows v_t = v + t * vstride (bytes), converted by table straight to float32 (exact,
 * as read16 gives them), two tokens a table lookup */
AK_INLINE void pv_tab(const uint8_t *v, int64_t vstride, int64_t n, const float *p, int64_t ps,
                      int64_t Dv, const ak_tab *T, int ROWS, float *acc, const ak_ahead *pf,
                      int64_t part0, int64_t parts) {
    const __mmask64 hi16 = 0xCCCCCCCCCCCCCCCCull; /* bytes 2, 3 of each float32 */
    for (int64_t d = 0; d < Dv; d += 32) {
        int64_t l0, l1; /* this d block's lines of the next rows (pf: part0 + d block) */
        ahead_part(pf, part0 + d / 32, parts, &l0, &l1);
        __m512 a[4][2], b[4][2];
        for (int g = 0; g < ROWS; ++g) {
            a[g][0] = _mm512_loadu_ps(acc + g * Dv + d);
            a[g][1] = _mm512_loadu_ps(acc + g * Dv + d + 16);
            b[g][0] = b[g][1] = _mm512_setzero_ps();
        }
        int64_t t = 0;
        for (; t + 1 < n; t += 2) {
            ahead_lines(pf, t, l0, l1);
            ahead_lines(pf, t + 1, l0, l1);
            const uint8_t *r0 = v + t * vstride + d;
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const void *)r0)),
                _mm256_loadu_si256((const void *)(r0 + vstride)), 1);
            __m512i lo, hi;
            fp8_halves(x, T, &lo, &hi);
            const __m512 v0 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[0], hi);
            const __m512 v1 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[1], hi);
            const __m512 v2 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[2], hi);
            const __m512 v3 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[3], hi);
            for (int g = 0; g < ROWS; ++g) {
                const __m512 w0 = _mm512_set1_ps(p[g * ps + t]);
                const __m512 w1 = _mm512_set1_ps(p[g * ps + t + 1]);
                a[g][0] = _mm512_fmadd_ps(w0, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(w0, v1, a[g][1]);
                b[g][0] = _mm512_fmadd_ps(w1, v2, b[g][0]);
                b[g][1] = _mm512_fmadd_ps(w1, v3, b[g][1]);
            }
        }
        if (t < n) {
            ahead_lines(pf, t, l0, l1);
            const uint8_t *r0 = v + t * vstride + d;
            __m512i lo, hi;
            fp8_halves(_mm512_zextsi256_si512(_mm256_loadu_si256((const void *)r0)), T, &lo,
                       &hi);
            const __m512 v0 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[0], hi);
            const __m512 v1 = (__m512)_mm512_maskz_permutex2var_epi8(hi16, lo, T->f[1], hi);
            for (int g = 0; g < ROWS; ++g) {
                const __m512 w0 = _mm512_set1_ps(p[g * ps + t]);
                a[g][0] = _mm512_fmadd_ps(w0, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(w0, v1, a[g][1]);
            }
        }
        for (int g = 0; g < ROWS; ++g) {
            _mm512_storeu_ps(acc + g * Dv + d, _mm512_add_ps(a[g][0], b[g][0]));
            _mm512_storeu_ps(acc + g * Dv + d + 16, _mm512_add_ps(a[g][1], b[g][1]));
        }
    }
}
#endif

#ifdef AK_H16
/* e4m3 pages in float16 arithmetic (AVX512-FP16: 32 lanes a multiply-add, twice the float32
 * rate, where the bfloat16 dot products run at the float32 rate). An e4m3 byte b is exactly
 * the float16 pattern (b & 0x7f) << 7 | (b & 0x80) << 8 times 2^8 (denormals included: the
 * exponent fields line up), here sign-extend, shift, clear bit 14: 3 instructions for 32
 * elements. Only the NaN bytes (0x7f, 0xff) come out finite (1.875 * 2^-8), so the loops
 * that convert a page segment's rows of one kv head also look at their bytes (e4m3_look, 2
 * instructions for 64 bytes in L1), and a head whose rows hold one is computed again by the
 * exact paths (its scores overwritten; its P V looked at before anything is added).
 *
 * The scores: the query rows are scaled by a power of two to a largest element in [0.5, 1)
 * and rounded to float16, four products a lane summed in float16 (|sum| <= 7: e4m3 values
 * times 2^-8 are at most 1.75), the two 256-bit halves added in float16 and the rest in
 * float32. P V: the softmax weights (in [0, 1]) rounded to float16, at most AK_H16_RUN tokens
 * summed in float16 (|sum| <= 112) and then added, times the page's descale, into the
 * float32 sums. The errors (about 2^-11 of the terms) are far below the inputs' own (2^-4)
 * and within FlashAttention's rule against the same computation in bfloat16 (tests). */
#define AK_H16_RUN 64
_Static_assert(AK_CHUNK <= AK_H16_RUN, "a page segment's P V is one float16 run");

/* 32 e4m3 bytes at p as float16 (their values times 2^-8) */
AK_INLINE __m512h e4m3_h16(const uint8_t *p) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const void *)p));
    return (__m512h)_mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16((short)0xBFFF));
}

/* mx = the bytewise maximum of mx and the `bytes` e4m3 bytes at p with their sign bits off
 * (bytes % 32 == 0): a row's NaN look, taken in the loops that convert the row (it is in L1
 * then); a NaN byte was seen where a byte of mx is 0x7f (e4m3_nan) */
AK_INLINE __m512i e4m3_look(__m512i mx, const uint8_t *p, int64_t bytes) {
    const __m512i m = _mm512_set1_epi8(0x7f);
    int64_t o = 0;
    for (; o + 64 <= bytes; o += 64)
        mx = _mm512_max_epu8(mx, _mm512_and_si512(_mm512_loadu_si512((const void *)(p + o)), m));
    if (o < bytes)
        mx = _mm512_max_epu8(mx, _mm512_and_si512(
            _mm512_zextsi256_si512(_mm256_loadu_si256((const void *)(p + o))), m));
    return mx;
}

AK_INLINE int e4m3_nan(__m512i mx) {
    return _mm512_cmpeq_epi8_mask(mx, _mm512_set1_epi8(0x7f)) != 0;
}

/* dst[t] = src[t] rounded to float16, in both halves, t < n: a weight that P V broadcasts with
 * a plain 32-bit load (a 16-bit broadcast from memory also takes a shuffle port) */
AK_INLINE void to_h16x2(const float *src, int64_t n, uint32_t *dst) {
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512i h = _mm512_cvtepu16_epi32(
            _mm256_castph_si256(_mm512_cvtxps_ph(_mm512_maskz_loadu_ps(m, src + t))));
        _mm512_mask_storeu_epi32(dst + t, m, _mm512_or_si512(h, _mm512_slli_epi32(h, 16)));
    }
}

/* a's and b's 256-bit halves added, in float16: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] in
 * 128-bit units */
#define AK_HALVES_PH(A, B)                                                                 \
    _mm512_add_ph(_mm512_castsi512_ph(_mm512_shuffle_i64x2(_mm512_castph_si512(A),         \
                                                           _mm512_castph_si512(B), 0x44)), \
                  _mm512_castsi512_ph(_mm512_shuffle_i64x2(_mm512_castph_si512(A),         \
                                                           _mm512_castph_si512(B), 0xEE)))

/* one key's four row sums a[g] (32 float16 lanes of NB products each): the 256-bit halves
 * added in float16 (2 * NB <= 8 products a lane, |sum| <= 14), converted, and folded twice in
 * float32: row g's 4 partial sums in 128-bit unit g */
AK_INLINE __m512 fold4_h16(const __m512h a[4]) {
    const __m512h u = AK_HALVES_PH(a[0], a[1]), w = AK_HALVES_PH(a[2], a[3]);
    const __m512 r0 = _mm512_cvtxph_ps(_mm512_castph512_ph256(u));
    const __m512 r1 = _mm512_cvtxph_ps(
        _mm256_castsi256_ph(_mm512_extracti64x4_epi64(_mm512_castph_si512(u), 1)));
    const __m512 r2 = _mm512_cvtxph_ps(_mm512_castph512_ph256(w));
    const __m512 r3 = _mm512_cvtxph_ps(
        _mm256_castsi256_ph(_mm512_extracti64x4_epi64(_mm512_castph_si512(w), 1)));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x44),
                                   _mm512_shuffle_f32x4(r0, r1, 0xEE));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x44),
                                   _mm512_shuffle_f32x4(r2, r3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

/* Scores of 4 query rows (q: float16, row-major D = NB * 32, in registers) against `len` e4m3
 * key rows k + t * ks (bytes), times f[g] for row g, into out[g * AK_CHUNK + t]. Four keys at
 * a time: each key's sums folded to 4 partials a row (fold4_h16), then the four keys' partials
 * transposed and added within the 128-bit units (row g's four scores in unit g), so no sum is
 * reduced alone. With `look` (a constant where inlined), returns 1 when a key row holds a NaN
 * byte (the scores are then wrong: the caller computes them exactly), else 0. */
AK_INLINE int score4_keys_h16(const uint8_t *k, int64_t ks, int64_t len, const _Float16 *q,
                              const float *f, int NB, float *out, const ak_ahead *pf,
                              int look) {
    const int64_t D = (int64_t)NB * 32;
    __m512h qv[4][4];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB; ++j) qv[g][j] = _mm512_loadu_ph(q + g * D + j * 32);
#define AK_KEY(ROW, OUT)                                                                   \
    do {                                                                                   \
        const uint8_t *row_ = (const uint8_t *)(ROW);                                      \
        __m512h a_[4] = {_mm512_setzero_ph(), _mm512_setzero_ph(), _mm512_setzero_ph(),    \
                         _mm512_setzero_ph()};                                             \
        for (int j_ = 0; j_ < NB; ++j_) {                                                  \
            const __m512h x_ = e4m3_h16(row_ + j_ * 32);                                   \
            for (int g_ = 0; g_ < 4; ++g_) a_[g_] = _mm512_fmadd_ph(qv[g_][j_], x_, a_[g_]); \
        }                                                                                  \
        if (look) mx = e4m3_look(mx, row_, D);                                             \
        (OUT) = fold4_h16(a_);                                                             \
    } while (0)
    const __m512 sv = _mm512_setr_ps(f[0], f[0], f[0], f[0], f[1], f[1], f[1], f[1], f[2],
                                     f[2], f[2], f[2], f[3], f[3], f[3], f[3]);
    __m512i mx = _mm512_setzero_si512();
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        __m512 z[4];
        for (int i = 0; i < 4; ++i) {
            ahead(pf, t + i);
            AK_KEY(k + (t + i) * ks, z[i]);
        }
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]),
                                         _mm512_unpackhi_ps(z[0], z[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(z[2], z[3]),
                                         _mm512_unpackhi_ps(z[2], z[3]));
        const __m512 y = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44),
                                                     _mm512_shuffle_ps(s01, s23, 0xEE)), sv);
        _mm_storeu_ps(out + t, _mm512_castps512_ps128(y));
        _mm_storeu_ps(out + AK_CHUNK + t, _mm512_extractf32x4_ps(y, 1));
        _mm_storeu_ps(out + 2 * AK_CHUNK + t, _mm512_extractf32x4_ps(y, 2));
        _mm_storeu_ps(out + 3 * AK_CHUNK + t, _mm512_extractf32x4_ps(y, 3));
    }
    for (; t < len; ++t) {
        ahead(pf, t);
        __m512 z;
        AK_KEY(k + t * ks, z);
        float l[16]; /* (the four keys' order of additions) */
        _mm512_storeu_ps(l, z);
        for (int g = 0; g < 4; ++g)
            out[g * AK_CHUNK + t] =
                ((l[4 * g] + l[4 * g + 2]) + (l[4 * g + 1] + l[4 * g + 3])) * f[g];
    }
#undef AK_KEY
    return look && e4m3_nan(mx);
}

/* acc_g += f * sum_t p[g * ps + t] * v_t for 4 rows g and the value dims [d0, d0 + NB * 32)
 * (NB a constant where inlined), over n <= AK_H16_RUN e4m3 value rows v_t = v + t * vstride
 * (bytes) and float16 weights p (each twice in 32 bits), summed in float16. With `look`, the
 * rows' NaN look over all Dv bytes: a NaN byte returns 1 before anything is added to acc. */
AK_INLINE int pv_h16_block(const uint8_t *v, int64_t vstride, int64_t n, const uint32_t *p,
                           int64_t ps, int64_t Dv, int64_t d0, float f, int NB, float *acc,
                           const ak_ahead *pf, int look) {
    __m512h a[4][4];
    __m512i mx = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB; ++j) a[g][j] = _mm512_setzero_ph();
    for (int64_t t = 0; t < n; ++t) {
        if (d0 == 0) ahead(pf, t);
        const uint8_t *r = v + t * vstride + d0;
        __m512h x[4];
        for (int j = 0; j < NB; ++j) x[j] = e4m3_h16(r + j * 32);
        if (look) mx = e4m3_look(mx, r - d0, Dv);
        for (int g = 0; g < 4; ++g) {
            const __m512h w = _mm512_castsi512_ph(_mm512_set1_epi32((int)p[g * ps + t]));
            for (int j = 0; j < NB; ++j) a[g][j] = _mm512_fmadd_ph(w, x[j], a[g][j]);
        }
    }
    if (look && e4m3_nan(mx)) return 1;
    const __m512 fv = _mm512_set1_ps(f);
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < NB; ++j) {
            float *o = acc + g * Dv + d0 + j * 32;
            const __m512i h = _mm512_castph_si512(a[g][j]);
            const __m512 lo = _mm512_cvtxph_ps(_mm512_castph512_ph256(a[g][j]));
            const __m512 hi = _mm512_cvtxph_ps(
                _mm256_castsi256_ph(_mm512_extracti64x4_epi64(h, 1)));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(fv, lo, _mm512_loadu_ps(o)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(fv, hi, _mm512_loadu_ps(o + 16)));
        }
    return 0;
}

/* pv_h16_block over all of Dv (Dv % 32 == 0), 128 dims at a time, n <= AK_H16_RUN; with
 * `look`, 1 (and acc untouched) where a value row holds a NaN byte */
AK_INLINE int pv_h16(const uint8_t *v, int64_t vstride, int64_t n, const uint32_t *p,
                     int64_t ps, int64_t Dv, float f, float *acc, const ak_ahead *pf, int look) {
#define AK_PV(NB, LOOK) pv_h16_block(v, vstride, n, p, ps, Dv, d0, f, NB, acc, pf, LOOK)
#define AK_PV_NB(LOOK)                                             \
    (nb >= 4 ? AK_PV(4, LOOK) : nb == 3 ? AK_PV(3, LOOK) : nb == 2 ? AK_PV(2, LOOK) \
             : AK_PV(1, LOOK))
    for (int64_t d0 = 0; d0 < Dv; d0 += 128) {
        const int64_t nb = (Dv - d0) / 32;
        if (look && d0 == 0) { /* the look first, over every dim: then nothing was added */
            if (AK_PV_NB(1)) return 1;
        } else {
            (void)AK_PV_NB(0);
        }
    }
#undef AK_PV_NB
#undef AK_PV
    return 0;
}
#endif

/* a sequence's query rows for the float16 scores: q[r * D + d] = q_r,d * scale / f[r] */
typedef struct {
#ifdef AK_H16
    const _Float16 *q;
    const float *f;
#else
    int none;
#endif
} ak_q16;

/* 1 where e4m3 pages can be computed in float16 arithmetic (AK_H16) */
int attnkit_native_has_h16(void) {
#ifdef AK_H16
    return 1;
#else
    return 0;
#endif
}

/* 1 where fp8 pages go into the bfloat16 dot products (with bfloat16 queries) */
int attnkit_native_has_fp8dot(void) {
#ifdef AK_FP8DOT
    return 1;
#else
    return 0;
#endif
}

/* ---- MLA: values that are a view into the keys (job->shared) ------------------------------
 * DeepSeek-style multi-head latent attention caches one latent vector per token (576 dims) for
 * one kv head and reads its first 512 dims as the value: v = k[..., :512], for 16-128 query
 * heads. The caller says so (math bit 2, which check_args holds to: the same page, token and
 * head strides, each value row inside its key row), and the kernel then reads each cached row
 * once: the value rows are the key rows that the chunk's scores have just brought into cache,
 * so nothing is asked ahead for them, and P V runs the general loops on them.
 *
 * The scores of such wide heads (D > 128, shared rows or not) go through register tiles that
 * load each key and query block once for 4 rows and 4 keys, where score4_dp / score4 reload the
 * four query blocks for every key (measured, B=1-2, 2k-8k keys, one thread: the scores in
 * 0.55-0.75x the time; a latent head's 16-128 query rows are 4-32 groups). The tiles keep the
 * general loops' order of operations for every element (the same lane sums in the same
 * trees), so every output is bit-identical to what score4_dp / score4 gave. P V tiles of 4
 * rows x 32 value dims were slower than pv_rows (1.2x: registers), and blocks of 16 keys held
 * in L1 for all row groups no faster than a whole segment. AVX-512 builds only (AVX2 has too
 * few registers for the tiles: there the general loops run). */
#if AK_N == 16
#ifdef AK_DPBF16
/* score4_dp for 4 keys k + j * ks (elements) at once: out[g * AK_CHUNK + j] */
AK_INLINE void mla_score44_dp(const uint16_t *k, int64_t ks, const uint16_t *q, int64_t D,
                              float scale, float *out, const char *const *pf, int npf) {
    __m512 a[4][4];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
        __m512bh kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = ak_bh(k + j * ks + d);
        /* the four keys stay in registers (else the compiler reloads each for every row:
         * 20 loads per 16 dot products, more than the core's load ports give) */
        __asm__("" : "+v"(kv[0]), "+v"(kv[1]), "+v"(kv[2]), "+v"(kv[3]));
        /* one line of each next row asked for per step: the step reads 64 bytes of a row */
        for (int i = 0; i < npf; ++i) __builtin_prefetch(pf[i] + 2 * d, 0, 2);
        for (int g = 0; g < 4; ++g) {
            const __m512bh qv = ak_bh(q + g * D + d);
            for (int j = 0; j < 4; ++j) a[g][j] = _mm512_dpbf16_ps(a[g][j], qv, kv[j]);
        }
    }
    for (int g = 0; g < 4; ++g) /* key j's sum in lane j */
        akv4_store(out + g * AK_CHUNK, akv4_mul(akr_rows4_add(a[g][0], a[g][1], a[g][2], a[g][3]),
                                                akv4_set1(scale)));
}
#endif

/* score4 for 4 keys k + j * ks (bytes) at once: out[g * AK_CHUNK + j] */
AK_INLINE void mla_score44(const char *k, int64_t ks, int dtype, const float *q, int64_t D,
                           float *out) {
    const int esz = AK_ESZ(dtype);
    ak_vn a[4][4];
    for (int g = 0; g < 4; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = splatn(0.0f);
    for (int64_t d = 0; d < D; d += AK_W) {
        ak_vn kb[4];
        for (int j = 0; j < 4; ++j) load_w(k + j * ks + d * esz, dtype, kb + j);
        for (int g = 0; g < 4; ++g) {
            ak_vn qv;
            memcpy(&qv, q + g * D + d, sizeof qv);
            for (int j = 0; j < 4; ++j) a[g][j] += qv * kb[j];
        }
    }
    for (int g = 0; g < 4; ++g) hsum4n(a[g], out + g * AK_CHUNK, 1);
}

/* The scores of every kv head's rows against `len` key rows k + t * ks (elements; kv head
 * stride kh), into sc columns from 0: groups of 4 rows by the 4 x 4 tiles, the keys past the
 * last group of 4 and the rows past the groups of 4 by the general loops' functions (which the
 * general path uses for these head dims: score_head, score4 / score1). */
static void mla_scores(const char *k, int64_t ks, int64_t kh, int64_t len, int dtype,
                       const ak_job *job, const float *qb, const uint16_t *qhb,
                       int64_t rows_per_head, float *sc, const ak_ahead *next) {
    const int esz = AK_ESZ(dtype);
    const int64_t D = job->D, groups = rows_per_head / 4, quads = len / 4;
#ifdef AK_DPBF16
    const int dp = qhb != NULL && dtype == AK_BF16;
#else
    const int dp = 0;
    (void)qhb;
#endif
    for (int64_t h = 0; h < job->Hkv; ++h) {
        const char *kh0 = k + h * kh * esz;
        const int64_t r0 = h * rows_per_head;
        const ak_ahead head = {next->row, h * kh * esz, next->bytes}; /* the next chunk's */
        for (int64_t g = 0; g < groups; ++g) { /* (a group's q rows stay in L1) */
            const int64_t r = r0 + 4 * g;
            for (int64_t t = 0; t < 4 * quads; t += 4) {
                float *out = sc + r * AK_CHUNK + t;
#ifdef AK_DPBF16
                if (dp) {
                    /* the next chunk's rows t .. t + 3, spread over the groups' tiles (a
                     * burst of them waited on the core's miss slots) */
                    const char *pf[4];
                    int npf = 0;
                    for (int64_t i = g; i < 4; i += groups)
                        if (next->row[t + i]) pf[npf++] = next->row[t + i] + head.off;
                    mla_score44_dp((const uint16_t *)(const void *)(kh0 + t * ks * esz), ks,
                                   qhb + r * D, D, job->scale, out, pf, npf);
                    continue;
                }
#endif
                if (g == 0)
                    for (int i = 0; i < 4; ++i) ahead(&head, t + i);
                mla_score44(kh0 + t * ks * esz, ks * esz, dtype, qb + r * D, D, out);
            }
        }
        for (int64_t t = 0; t < len; ++t) { /* the keys and rows the tiles leave */
            const int64_t first = t < 4 * quads ? 4 * groups : 0;
            if (!first) ahead(&head, t);
            if (first == rows_per_head) continue;
            const int64_t r = r0 + first;
            score_head(kh0 + t * ks * esz, dtype, qb + r * D, dp ? qhb + r * D : NULL,
                       job->scale, D, rows_per_head - first, sc + r * AK_CHUNK + t, AK_CHUNK);
        }
    }
}

#endif

/* score_tokens_t's groups of 4 rows in float32 where their queries do not fit in registers:
 * keys in memory order (a token's kv heads lie together in a page), each against every kv
 * head's groups (score4), the next chunk's rows asked for as they go */
#ifdef AK_AVX2
/* score_keys_t's work for fp8 keys t and t + 1 (score4x2) */
AK_INLINE void score_key2_t(const char *k, int64_t ks, int64_t kh, int64_t t, int dtype,
                            const ak_job *job, const float *qb, int64_t groups,
                            int64_t rows_per_head, float *sc, const ak_ahead *next) {
    const int64_t D = job->D;
    for (int64_t h = 0; h < job->Hkv; ++h) {
        const ak_ahead head = {next->row, h * kh, next->bytes};
        ahead(&head, t);
        ahead(&head, t + 1);
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t r = h * rows_per_head + 4 * g;
            score4x2(k + h * kh, k + ks + h * kh, dtype, qb + r * D, D, sc + r * AK_CHUNK + t,
                     AK_CHUNK);
        }
    }
}
#endif

AK_INLINE void score_keys_t(const char *k, int64_t ks, int64_t kh, int64_t len, int dtype,
                            const ak_job *job, const float *qb, int64_t groups,
                            int64_t rows_per_head, float *sc, const ak_ahead *next) {
    const int esz = AK_ESZ(dtype);
    const int64_t D = job->D;
    int64_t t = 0;
#ifdef AK_AVX2
    /* fp8: two keys at a time (score4x2); e4m3 without the NaN step where the two tokens'
     * rows (every kv head's, in L1 after this) hold no NaN byte */
    if (dtype >= AK_E4M3)
        for (; t + 2 <= len; t += 2) {
            const char *kt = k + t * ks;
            const uint8_t *k8 = (const uint8_t *)kt;
            if (dtype == AK_E4M3 && !ak_e4m3_nan(k8, kh, job->Hkv, job->D)
                && !ak_e4m3_nan(k8 + ks, kh, job->Hkv, job->D))
                score_key2_t(kt, ks, kh, t, AK_E4M3_FINITE, job, qb, groups, rows_per_head, sc,
                             next);
            else
                score_key2_t(kt, ks, kh, t, dtype, job, qb, groups, rows_per_head, sc, next);
        }
#endif
    for (; t < len; ++t)
        for (int64_t h = 0; h < job->Hkv; ++h) {
            const ak_ahead head = {next->row, h * kh * esz, next->bytes};
            ahead(&head, t);
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t r = h * rows_per_head + 4 * g;
                score4(k + (t * ks + h * kh) * esz, dtype, qb + r * D, D,
                       sc + r * AK_CHUNK + t, AK_CHUNK);
            }
        }
}

/* the largest head dim at which 4 query rows stay in registers (half the register file) */
#define AK_QREG_D (AK_N == 16 ? 64 : 16)

/* scores of `len` key rows (token stride ks, kv head stride kh, in elements) for every kv
 * head's rows, into sc columns from t (dtype a constant where this is inlined): groups of 4
 * rows with their queries in registers where the head dim allows (D <= AK_QREG_D, or <= 128
 * for the bfloat16 dot products), else key by key (score_keys_t; the bfloat16 dot products and
 * the rows past the groups of 4 through score_head) */
#define AK_NB_CASES(CALL) \
    switch (nb) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
                  default: CALL(4); }
AK_INLINE void score_tokens_t(const char *k, int64_t ks, int64_t kh, int64_t len, int dtype,
                              const ak_job *job, const float *qb, const uint16_t *qhb,
                              const ak_q16 *q16, int64_t rows_per_head, float *sc,
                              const ak_ahead *next) {
    const int esz = AK_ESZ(dtype);
    const int64_t D = job->D, groups = rows_per_head / 4, rest = rows_per_head % 4;
#ifdef AK_H16
    if (q16 != NULL && dtype == AK_E4M3) { /* (rows_per_head % 4 == 0, D % 32 == 0, <= 128) */
        const int nb = (int)(D / 32);
        for (int64_t h = 0; h < job->Hkv; ++h) {
            const uint8_t *kh0 = (const uint8_t *)k + h * kh;
            const ak_ahead head = {next->row, h * kh, next->bytes};
            const int64_t r0 = h * rows_per_head;
            int nan = 0;
            for (int64_t r = r0; r < r0 + rows_per_head && !nan; r += 4) {
                /* the first group looks at the key rows (the others find them in cache) */
#define AK_H(NB) nan = r == r0 ? score4_keys_h16(kh0, ks, len, q16->q + r * D, q16->f + r, NB, \
                                                 sc + r * AK_CHUNK, &head, 1)                \
                             : score4_keys_h16(kh0, ks, len, q16->q + r * D, q16->f + r, NB, \
                                               sc + r * AK_CHUNK, NULL, 0)
                AK_NB_CASES(AK_H)
#undef AK_H
            }
            if (nan) /* a NaN key byte: this head again, exactly, in float32 */
                for (int64_t tt = 0; tt < len; ++tt)
                    score_head((const char *)kh0 + tt * ks, dtype, qb + r0 * D, NULL,
                               job->scale, D, rows_per_head, sc + r0 * AK_CHUNK + tt,
                               AK_CHUNK);
        }
        return;
    }
#else
    (void)q16;
#endif
#ifdef AK_DPBF16
    const int dp = qhb != NULL && D <= 128;
#else
    const int dp = 0;
#endif
    const int qregs = dp || D <= AK_QREG_D;
    const int by_key = !qregs && !(qhb && dtype == AK_BF16);
    if (groups && by_key) {
        score_keys_t(k, ks, kh, len, dtype, job, qb, groups, rows_per_head, sc, next);
        if (!rest) return;
    }
    if (groups && qregs) {
        const int nb = (int)(dp ? D / 32 : D / AK_W);
#ifdef AK_FP8DOT
        ak_tab T;
        if (dp && dtype >= AK_E4M3) T = fp8_tab(job);
#endif
        for (int64_t h = 0; h < job->Hkv; ++h) {
            const char *kh0 = k + h * kh * esz;
            const ak_ahead head = {next->row, h * kh * esz, next->bytes};
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t r = h * rows_per_head + 4 * g;
                float *out = sc + r * AK_CHUNK;
                const ak_ahead *pf = g == 0 ? &head : NULL; /* (each key row once) */
#ifdef AK_DPBF16
                if (dp) {
#ifdef AK_FP8DOT
                    if (dtype >= AK_E4M3) { /* fp8 keys, by table (bf16_dot: AK_FP8DOT) */
#define AK_DP8(NB) score4_keys_dp8((const uint8_t *)kh0, ks, len, qhb + r * D, job->scale, NB, \
                                   &T, out, pf)
                        AK_NB_CASES(AK_DP8)
#undef AK_DP8
                        continue;
                    }
#endif
#define AK_DP(NB) score4_keys_dp((const uint16_t *)kh0, ks, len, qhb + r * D, job->scale, NB, \
                                 out, pf)
                    AK_NB_CASES(AK_DP)
#undef AK_DP
                    continue;
                }
#endif
#define AK_F(NB) score4_keys(kh0, ks * esz, len, dtype, qb + r * D, NB, out, pf)
                AK_NB_CASES(AK_F)
#undef AK_F
            }
        }
        if (!rest) return;
    }
    const int64_t first = groups && (qregs || by_key) ? 4 * groups : 0;
    if (!first)
        for (int64_t h = 0; h < job->Hkv; ++h) {
            const ak_ahead head = {next->row, h * kh * esz, next->bytes};
            ahead_all(&head, len);
        }
    for (int64_t tt = 0; tt < len; ++tt)
        for (int64_t h = 0; h < job->Hkv; ++h) {
            const int64_t r = h * rows_per_head + first;
            score_head(k + (tt * ks + h * kh) * esz, dtype, qb + r * D,
                       qhb && dtype == AK_BF16 ? qhb + r * D : NULL, job->scale, D,
                       rows_per_head - first,
                       sc + r * AK_CHUNK + tt, AK_CHUNK);
        }
}
#undef AK_NB_CASES

/* score_tokens_t for one page dtype, in a function of its own: inlined together into one,
 * the dtypes' loops shared its register allocation, which cost the AVX-512 bfloat16 and fp8
 * dot products 5-10% */
#define AK_ST_FN(NAME, DT)                                                                 \
    static __attribute__((noinline)) void NAME(                                            \
        const char *k, int64_t len, const ak_job *job, const float *qb,                    \
        const uint16_t *qhb, const ak_q16 *q16, int64_t rows_per_head, float *sc,          \
        const ak_ahead *next) {                                                            \
        score_tokens_t(k, job->ks_tok, job->ks_head, len, DT, job, qb, qhb, q16,           \
                       rows_per_head, sc, next);                                           \
    }
AK_ST_FN(score_tokens_bf16, AK_BF16)
AK_ST_FN(score_tokens_f16, AK_F16)
AK_ST_FN(score_tokens_e4m3, AK_E4M3)
AK_ST_FN(score_tokens_e5m2, AK_E5M2)
AK_ST_FN(score_tokens_f32, AK_F32)
#undef AK_ST_FN

static void score_tokens(const char *k, int64_t len, const ak_job *job, const float *qb,
                         const uint16_t *qhb, const ak_q16 *q16, int64_t rows_per_head,
                         float *sc, const ak_ahead *next) {
#define AK_ST(F) F(k, len, job, qb, qhb, q16, rows_per_head, sc, next)
    switch (job->dtype) {
    case AK_BF16: AK_ST(score_tokens_bf16); break;
    case AK_F16: AK_ST(score_tokens_f16); break;
    case AK_E4M3: AK_ST(score_tokens_e4m3); break;
    case AK_E5M2: AK_ST(score_tokens_e5m2); break;
    default: AK_ST(score_tokens_f32);
    }
#undef AK_ST
}

/* nk[t], nv[t]: the K and V rows (kv head 0) of column t of chunk [c0, c1) of sequence b,
 * NULL from column c1 - c0 on (see ak_ahead). Decoding reads each key once, and without
 * asking ahead a core waits on memory at every page's first rows. */
static void next_rows(const ak_job *job, int64_t b, int64_t base, int64_t c0, int64_t c1,
                      const char **nk, const char **nv) {
    ak_seg seg[AK_CHUNK];
    const int esz = AK_ESZ(job->dtype);
    const int64_t nseg = c0 < c1 ? chunk_segments(job, b, base, c0, c1, seg) : 0;
    for (int64_t t = 0; t < AK_CHUNK; ++t) nk[t] = nv[t] = NULL;
    for (int64_t g = 0; g < nseg; ++g)
        for (int64_t t = 0; t < seg[g].len; ++t) {
            const int64_t tok = seg[g].first + t;
            nk[seg[g].t + t] = job->kp + (seg[g].page * job->ks_page + tok * job->ks_tok) * esz;
            nv[seg[g].t + t] = job->vp + (seg[g].page * job->vs_page + tok * job->vs_tok) * esz;
        }
}

/* Sequence b's query rows (row r = hq * Lq + i) into qb in float32 times the scale (in the
 * order AK_EVEN_ODD reads the pages in), and as given into qhb (bfloat16, for the dot
 * products: exact products, the scale after) unless NULL */
static void query_rows(const ak_job *job, int64_t b, float *qb, uint16_t *qhb) {
    const int64_t D = job->D, Lq = job->Lq, R = job->Hq * Lq;
    const int qesz = AK_ESZ(job->q_dtype), eo = AK_EVEN_ODD(job->dtype);
    const akr scale = akr_set1(job->scale);
    for (int64_t r = 0; r < R; ++r) {
        const char *src = job->q + (b * job->qs_b + (r / Lq) * job->qs_h
                                    + (r % Lq) * job->qs_i) * qesz;
        float *dst = qb + r * D;
        if (qhb) memcpy(qhb + r * D, src, (size_t)D * sizeof(uint16_t));
        for (int64_t d = 0; d < D; d += AK_W) {
            akr x[AK_NB];
            read16(src + d * qesz, job->q_dtype, eo, x);
            for (int j = 0; j < AK_NB; ++j) akr_store(dst + d + j * AK_N, akr_mul(x[j], scale));
        }
        if (eo && job->q_dtype != AK_BF16) /* (read16 reads only bfloat16 in that order) */
            for (int64_t d = 0; d < D; d += AK_W) {
                float t[AK_W];
                memcpy(t, dst + d, sizeof t);
                for (int i = 0; i < AK_W; ++i) dst[d + i] = t[i < 8 ? 2 * i : 2 * i - 15];
            }
    }
}

/* dst[d] = sums[d] * f for d < n (a multiple of 16), the sums in the order AK_EVEN_ODD reads
 * the pages in where `eo` */
static void sums_out(float *dst, const float *sums, int64_t n, float f, int eo) {
    for (int64_t d = 0; d < n; d += AK_W)
        for (int i = 0; i < AK_W; ++i) dst[d + i] = sums[d + (eo ? i % 2 * 8 + i / 2 : i)] * f;
}

/* What the steps of one work item share: its sequence b and key split s, its rows (row r =
 * hq * Lq + i; kv head h: rows [h, h + 1) * rows_per_head), the query rows in float32 times the
 * scale (qb) and as given in bfloat16 for the dot products (qhb: exact products, the scale
 * after; NULL without them), and which arithmetic its pages take */
typedef struct {
    const ak_job *job;
    ak_scratch *w;
    int64_t s, b, L, base, R, rows_per_head;
    float unit; /* fp8: what a converted element is worth before the page's descale (e4m3: 2^8) */
    float *qb;
    uint16_t *qhb;
    const ak_q16 *q16; /* the rows for the float16 scores (AK_H16), else NULL */
    int h16;           /* e4m3 pages in float16 arithmetic (AK_H16) */
    int mla_sc;        /* the score tiles (mla_scores) */
#ifdef AK_FP8DOT
    int fp8dot;        /* fp8 pages by table (keys into the dot products, values to float32) */
    const ak_tab *T;
#endif
} ak_task;

#ifdef AK_H16
/* e4m3 pages in float16 arithmetic where everything fits (AK_H16): the query rows scaled by a
 * power of two to a largest element in [0.5, 1) into w->q16 (the powers in w->qf); 0 where the
 * shapes do not qualify or a row has a non-finite or out-of-range element (this sequence then
 * takes the exact paths), else 1 */
static int task_q16(const ak_job *job, ak_scratch *w, const float *qb, int64_t rows_per_head) {
    const int64_t D = job->D, R = job->Hq * job->Lq;
    if (!(job->h16 && rows_per_head % 4 == 0 && D >= 32 && D <= 128 && job->Dv % 32 == 0))
        return 0;
    for (int64_t r = 0; r < R; ++r) {
        const float *x = qb + r * D;
        __m512 mxv = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + d));
            bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ); /* inf, NaN */
            mxv = _mm512_max_ps(mxv, a);
        }
        int e = 0;
        frexpf(_mm512_reduce_max_ps(mxv), &e); /* max = m * 2^e, m in [0.5, 1) (0: e = 0) */
        if (bad || e > 100 || e < -100) return 0;
        const __m512 down = _mm512_set1_ps(ldexpf(1.0f, -e));
        w->qf[r] = ldexpf(1.0f, e);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_ph(w->q16 + r * D + d,
                             _mm512_cvtxps_ph(_mm512_mul_ps(_mm512_loadu_ps(x + d), down)));
    }
    return 1;
}
#endif

/* Every row's visible keys [lo, hi) and aligned position ipos, ALiBi slope, softmax state
 * (m = -inf, l = 0) and sums (0); returns the union of the visible ranges in [*klo, *khi) */
AK_INLINE void task_rows(const ak_task *tk, int64_t *klo, int64_t *khi) {
    const ak_job *job = tk->job;
    ak_scratch *w = tk->w;
    const int64_t Lq = job->Lq, L = tk->L;
    /* causal: j <= i', i.e. a right bound of at most 0 */
    const int has_right = job->has_right || job->causal;
    const int64_t right = job->causal && (!job->has_right || job->right > 0) ? 0 : job->right;
    *klo = L;
    *khi = 0;
    for (int64_t r = 0; r < tk->R; ++r) {
        const int64_t hq = r / Lq, i = r % Lq;
        w->ipos[r] = job->bottom_right ? i + L - Lq : i;
        int64_t a, e; /* visible keys: [a, e) */
        visible_range(w->ipos[r], L, job->has_left, job->left, has_right, right, &a, &e);
        w->lo[r] = a;
        w->hi[r] = e;
        if (a < e && a < *klo) *klo = a;
        if (a < e && e > *khi) *khi = e;
        w->slope[r] = job->alibi ? job->alibi[tk->b * job->Hq + hq] : 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, (size_t)(tk->R * job->Dv) * sizeof(float));
}

/* The scores of a chunk's keys (its nseg page segments) for every row, into sc, token by token
 * in memory order, one page segment at a time (fp8 keys: times the page's descale per kv head);
 * nk: the next chunk's key rows, asked for ahead */
AK_INLINE void chunk_scores(const ak_task *tk, const ak_seg *seg, int64_t nseg,
                            const char *const *nk) {
    const ak_job *job = tk->job;
    const int dtype = job->dtype, esz = AK_ESZ(dtype);
    float *sc = tk->w->sc;
    for (int64_t g = 0; g < nseg; ++g) {
        const char *kbase = job->kp + (seg[g].page * job->ks_page
                                       + seg[g].first * job->ks_tok) * esz;
        const ak_ahead next = {nk + seg[g].t, 0, job->D * esz};
#if AK_N == 16
        if (tk->mla_sc)
            mla_scores(kbase, job->ks_tok, job->ks_head, seg[g].len, dtype, job, tk->qb,
                       tk->qhb, tk->rows_per_head, sc + seg[g].t, &next);
        else
#endif
            score_tokens(kbase, seg[g].len, job, tk->qb, tk->qhb, tk->q16, tk->rows_per_head,
                         sc + seg[g].t, &next);
        if (job->kd) /* fp8 keys: the page's descale per kv head, on the scores */
            scale_rows(sc, job->kd + seg[g].page * job->Hkv, tk->unit, job->Hkv,
                       tk->rows_per_head, seg[g].t, seg[g].t + seg[g].len);
    }
}

/* The online softmax over chunk [c0, c1) (nw score lanes in use; lanes past the chunk are
 * masked like invisible keys): first every row's score terms, visibility and chunk maximum
 * (cmx; no row waits on another's), then the updates that depend on them. sc becomes the
 * weights (0 where a row is NaN), m and l move on, the sums are rescaled. */
AK_INLINE void chunk_softmax(const ak_task *tk, int64_t c0, int64_t c1, int64_t nw) {
    const ak_job *job = tk->job;
    ak_scratch *w = tk->w;
    const int64_t R = tk->R, Dv = job->Dv, n = c1 - c0;
    float *sc = w->sc, *m = w->m, *l = w->l, *cmx = w->cmx;
    for (int64_t r = 0; r < R; ++r) {
        if (isnan(m[r])) continue; /* (the row is NaN: below) */
        /* visible t: [a, e) within the chunk */
        const float a = (float)(w->lo[r] - c0), e = (float)(w->hi[r] < c1 ? w->hi[r] - c0 : n);
        cmx[r] = row_terms(sc + r * AK_CHUNK, nw, a, e, (float)(w->ipos[r] - c0), w->slope[r],
                           job->softcap, job->alibi != NULL);
    }
    for (int64_t r = 0; r < R; ++r) {
        float *sr = sc + r * AK_CHUNK;
        if (isnan(m[r])) { /* a NaN or +inf score seen already: the row is NaN */
            memset(sr, 0, (size_t)nw * sizeof(float));
            continue;
        }
        const float mx = cmx[r];
        if (mx == -INFINITY) { /* nothing visible (or only -inf, NaN) in this chunk */
            int nan = 0;
            for (int64_t t = 0; t < nw; ++t) nan |= isnan(sr[t]);
            if (nan) m[r] = NAN; /* the row is NaN from now on */
            memset(sr, 0, (size_t)nw * sizeof(float));
            continue;
        }
        const float mnew = mx > m[r] ? mx : m[r];
        const float alpha = akr_exp_nonpos(akr_set1(m[r] - mnew))[0];
        const float sum = row_weights(sr, nw, mnew);
        if (isnan(sum)) { /* a NaN score, or +inf (the max, inf - inf): the row is NaN */
            m[r] = NAN;
            memset(sr, 0, (size_t)nw * sizeof(float));
            continue;
        }
        if (alpha != 1.0f) {
            float *ar = w->acc + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
        }
        l[r] = l[r] * alpha + sum;
        m[r] = mnew;
    }
}

/* P V of kv head h's rows over one page segment (seg; vh its value rows, chunk [c0, c1)): all
 * the head's rows together where they all see the whole chunk (always when decoding one row),
 * else each row over what it sees; next: the next chunk's value rows, asked for ahead (NULL:
 * none) */
AK_INLINE void head_pv(const ak_task *tk, const ak_seg *seg, int64_t h, const char *vh,
                       int64_t c0, int64_t c1, const ak_ahead *next) {
    const ak_job *job = tk->job;
    ak_scratch *w = tk->w;
    const int dtype = job->dtype, esz = AK_ESZ(dtype);
    const int64_t Dv = job->Dv, rows_per_head = tk->rows_per_head;
    const int64_t st = seg->t, len = seg->len, se = st + len;
    const int64_t r0 = h * rows_per_head, r1 = r0 + rows_per_head;
    float *sc = w->sc, *acc = w->acc;
    int whole = 1;
    for (int64_t r = r0; r < r1; ++r) whole &= w->lo[r] <= c0 && w->hi[r] >= c1;
#ifdef AK_H16
    if (tk->h16) { /* float16 weights, the page's descale on their sums */
        const float f = tk->unit * job->vd[seg->page * job->Hkv + h];
        const uint8_t *v8 = (const uint8_t *)vh;
        if (whole) {
            for (int64_t r = r0; r < r1; ++r)
                to_h16x2(sc + r * AK_CHUNK + st, len, w->p16 + (r - r0) * AK_CHUNK);
            /* the first group looks at the value rows: a NaN byte there returns before any
             * row's sums have moved */
            int nan = pv_h16(v8, job->vs_tok, len, w->p16, AK_CHUNK, Dv, f, acc + r0 * Dv, next,
                             1);
            for (int64_t r = r0 + 4; r < r1 && !nan; r += 4)
                pv_h16(v8, job->vs_tok, len, w->p16 + (r - r0) * AK_CHUNK, AK_CHUNK, Dv, f,
                       acc + r * Dv, NULL, 0);
            if (!nan) return;
        }
        /* (the exact paths take float32 weights with the descale on them) */
        scale_rows(sc + r0 * AK_CHUNK, job->vd + seg->page * job->Hkv + h, tk->unit, 1,
                   rows_per_head, st, se);
    }
#endif
#ifdef AK_FP8DOT
    if (whole && tk->fp8dot) { /* fp8 values by table */
        const uint8_t *v8 = (const uint8_t *)vh;
        const float *pr = sc + r0 * AK_CHUNK + st;
        /* the next rows' lines spread over every group's d blocks (as pv_head_dp) */
        const int64_t blocks = Dv / 32, groups = (r1 - r0) / 4;
        const int64_t parts = (groups > 0 ? groups : 1) * blocks;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4, pr += 4 * AK_CHUNK)
            pv_tab(v8, job->vs_tok, len, pr, AK_CHUNK, Dv, tk->T, 4, acc + r * Dv, next,
                   (r - r0) / 4 * blocks, parts);
        for (; r < r1; ++r, pr += AK_CHUNK)
            pv_tab(v8, job->vs_tok, len, pr, AK_CHUNK, Dv, tk->T, 1, acc + r * Dv,
                   r == r0 ? next : NULL, 0, parts);
        return;
    }
#endif
#ifdef AK_DPBF16
    if (job->bf16_pv) { /* P V in vdpbf16ps (bfloat16 pages) */
        if (whole) {
            pv_head_dp(vh, job->vs_tok * esz, len, sc + r0 * AK_CHUNK + st, AK_CHUNK, Dv,
                       rows_per_head, acc + r0 * Dv, next);
            return;
        }
        ahead_all(next, len);
        for (int64_t r = r0; r < r1; ++r) {
            int64_t t0, t1;
            row_span(w->lo[r], w->hi[r], c0, c1, st, se, &t0, &t1);
            if (t1 > t0)
                pv_dp_rows(vh + (t0 - st) * job->vs_tok * esz, job->vs_tok * esz, t1 - t0,
                           sc + r * AK_CHUNK + t0, 0, Dv, 1, acc + r * Dv, NULL, 0, 1);
        }
        return;
    }
#endif
    if (whole) {
        pv_head(vh, job->vs_tok * esz, len, dtype, sc + r0 * AK_CHUNK + st, AK_CHUNK, Dv,
                rows_per_head, acc + r0 * Dv, next);
        return;
    }
    ahead_all(next, len);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t t0, t1;
        row_span(w->lo[r], w->hi[r], c0, c1, st, se, &t0, &t1);
        pv_row_range(vh, job->vs_tok * esz, t0 - st, t1 - st, dtype, sc + r * AK_CHUNK + st,
                     Dv, acc + r * Dv);
    }
}

/* P V of chunk [c0, c1), one page segment and kv head at a time (head_pv); fp8 values: the
 * page's descale goes on the weights (the sums l are already taken). nv: the next chunk's
 * value rows, asked for ahead */
AK_INLINE void chunk_pv(const ak_task *tk, const ak_seg *seg, int64_t nseg, int64_t c0,
                        int64_t c1, const char *const *nv) {
    const ak_job *job = tk->job;
    const int esz = AK_ESZ(job->dtype);
    const int64_t Hkv = job->Hkv;
    for (int64_t g = 0; g < nseg; ++g) {
        const int64_t st = seg[g].t, se = st + seg[g].len;
        if (job->vd && !tk->h16)
            scale_rows(tk->w->sc, job->vd + seg[g].page * Hkv, tk->unit, Hkv, tk->rows_per_head,
                       st, se);
        const char *vbase = job->vp + (seg[g].page * job->vs_page
                                       + seg[g].first * job->vs_tok) * esz;
        for (int64_t h = 0; h < Hkv; ++h) {
            /* the next chunk's value rows asked for ahead, unless they are key rows (shared:
             * the scores ask for those) */
            const ak_ahead next_v = {nv + st, h * job->vs_head * esz, job->Dv * esz};
            head_pv(tk, &seg[g], h, vbase + h * job->vs_head * esz, c0, c1,
                    job->shared ? NULL : &next_v);
        }
    }
}

/* Each row's output for this split: its sums over l (NaN for a NaN row, 0 for a row that saw
 * nothing) and its log-sum-exp */
AK_INLINE void task_out(const ak_task *tk) {
    const ak_job *job = tk->job;
    const ak_scratch *w = tk->w;
    const int64_t R = tk->R, Dv = job->Dv;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t o = (tk->s * job->B + tk->b) * R + r; /* (split, b, hq, i) */
        float *dst = job->out + o * Dv;
        if (isnan(w->m[r])) {
            for (int64_t d = 0; d < Dv; ++d) dst[d] = NAN;
            if (job->lse) job->lse[o] = NAN;
        } else if (w->l[r] > 0.0f) {
            sums_out(dst, w->acc + r * Dv, Dv, 1.0f / w->l[r], AK_EVEN_ODD(job->dtype));
            if (job->lse) job->lse[o] = w->m[r] + logf(w->l[r]);
        } else {
            memset(dst, 0, (size_t)Dv * sizeof(float));
            if (job->lse) job->lse[o] = -INFINITY;
        }
    }
}

/* One work item (sequence b, key split s): the query rows, then this split's keys a chunk at
 * a time (scores, online softmax, P V), then the outputs */
static void run_task(ak_job *job, int64_t task, ak_scratch *w) {
    ak_task tk = {.job = job, .w = w, .s = task % job->splits, .b = task / job->splits};
    tk.L = job->seqlens[tk.b];
    tk.base = job->starts ? job->starts[tk.b] : 0;
    tk.R = job->Hq * job->Lq;
    tk.rows_per_head = (job->Hq / job->Hkv) * job->Lq;
    tk.unit = job->dtype == AK_E4M3 ? 256.0f : 1.0f;
    tk.qb = w->q;
    tk.qhb = job->bf16_dot ? w->qh : NULL;
#ifdef AK_FP8DOT
    /* fp8 pages by table (keys into the dot products, values to float32; Dv % 32 == 0) */
    tk.fp8dot = job->bf16_dot && job->dtype >= AK_E4M3 && job->Dv % 32 == 0;
    ak_tab T;
    if (tk.fp8dot) T = fp8_tab(job);
    tk.T = &T;
#endif
    query_rows(job, tk.b, tk.qb, tk.qhb);
#ifdef AK_H16
    tk.h16 = task_q16(job, w, tk.qb, tk.rows_per_head);
    const ak_q16 q16v = {w->q16, w->qf};
    tk.q16 = tk.h16 ? &q16v : NULL;
#endif
#if AK_N == 16
    /* the score tiles (see mla_scores) where the head dim is past what the general loops keep
     * in registers (D > 128), shared rows or not: the same sums, in less time */
    tk.mla_sc = !tk.h16 && job->D > 128;
#endif
    int64_t klo, khi;
    task_rows(&tk, &klo, &khi);

    /* this split's keys, clipped to what any row sees */
    int64_t k0 = tk.s * job->keys_per_split, k1 = k0 + job->keys_per_split;
    if (k0 < klo) k0 = klo;
    if (k1 > khi) k1 = khi;
    ak_seg seg[AK_CHUNK];
    for (int64_t c0 = k0; c0 < k1;) {
        const int64_t c1 = c0 + AK_CHUNK < k1 ? c0 + AK_CHUNK : k1, n = c1 - c0;
        const int64_t nseg = chunk_segments(job, tk.b, tk.base, c0, c1, seg);
        const int64_t nw = (n + AK_W - 1) / AK_W * AK_W; /* score lanes in use */
        const char *nk[AK_CHUNK], *nv[AK_CHUNK]; /* the next chunk's rows, asked for ahead */
        next_rows(job, tk.b, tk.base, c1, c1 + AK_CHUNK < k1 ? c1 + AK_CHUNK : k1, nk, nv);
        chunk_scores(&tk, seg, nseg, nk);
        chunk_softmax(&tk, c0, c1, nw);
        chunk_pv(&tk, seg, nseg, c0, c1, nv);
        c0 = c1;
    }
    task_out(&tk);
}

/* One pool worker: takes work items off job->next until none is left. It allocates its
 * scratch only while items are left (a worker index that the caller runs after it drained the
 * queue allocates nothing); a worker that cannot allocate takes no item. */
static void decode_worker(void *arg, int worker, int nworkers) {
    ak_job *job = (ak_job *)arg;
    (void)worker;
    (void)nworkers;
    if (__atomic_load_n(&job->next, __ATOMIC_RELAXED) >= job->ntasks) return;
    const int64_t R = job->Hq * job->Lq;
    ak_scratch w;
    const int64_t D = job->D; /* (q rows in float32, then in bfloat16: D floats a row) */
    float *f = (float *)malloc(sizeof(float)
                               * (size_t)(R * job->Dv + R * AK_CHUNK + 4 * R + 2 * R * D));
    int64_t *ix = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * R));
    if (!f || !ix) {
        free(f);
        free(ix);
        return;
    }
    w.acc = f;
    w.sc = w.acc + R * job->Dv;
    w.m = w.sc + R * AK_CHUNK;
    w.l = w.m + R;
    w.slope = w.l + R;
    w.cmx = w.slope + R;
    w.q = w.cmx + R;
    w.qh = (uint16_t *)(w.q + R * D);
    w.lo = ix;
    w.hi = ix + R;
    w.ipos = ix + 2 * R;
#ifdef AK_H16
    void *h16 = NULL;
    if (job->h16) { /* q rows, one head's weights (at most R rows), the rows' powers of two */
        h16 = aligned_alloc(64, (sizeof(_Float16) * (size_t)(R * D)
                                 + sizeof(uint32_t) * (size_t)(R * AK_CHUNK)
                                 + sizeof(float) * (size_t)R + 63) / 64 * 64);
        if (!h16) {
            free(f);
            free(ix);
            return;
        }
        w.q16 = (_Float16 *)h16;
        w.p16 = (uint32_t *)(w.q16 + R * D);
        w.qf = (float *)(w.p16 + R * AK_CHUNK);
    }
#endif
    for (;;) {
        const int64_t task = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (task >= job->ntasks) break;
        run_task(job, task, &w);
    }
#ifdef AK_H16
    free(h16);
#endif
    free(f);
    free(ix);
}

/* 0 when the call is one the kernel can run without reading or writing out of bounds: sane
 * dims, and for every sequence a length that its block-table row and the key splits cover
 * and page indices in [0, num_pages) for every page it uses; else nonzero. */
static int check_args(const ak_job *job, int64_t num_pages) {
    const int64_t B = job->B, P = job->P;
    if (!job->q || !job->kp || !job->vp || !job->seqlens || !job->out) return 1;
    if (!job->lse && job->splits != 1) return 1; /* the caller merges splits by their LSE */
    if (job->q_dtype < AK_F32 || job->q_dtype > AK_F16) return 1;
#ifndef __FLT16_MAX__
    if (job->q_dtype == AK_F16) return 1;
#endif
    if (job->qs_b < 0 || job->qs_h < 0 || job->qs_i < 0) return 1;
    if (B < 0 || job->Hq < 1 || job->Hkv < 1 || job->Hq % job->Hkv || job->Lq < 1) return 1;
    if (job->D < 0 || job->D % AK_W || job->Dv < 0 || job->Dv % AK_W) return 1;
    if (P < 1 || num_pages < 0 || job->bt_cols < 0 || job->splits < 1) return 1;
    if (job->keys_per_split < 1 || job->splits > INT64_MAX / job->keys_per_split) return 1;
    if (B > INT64_MAX / job->splits) return 1; /* ntasks = B * splits */
    if (job->dtype < AK_F32 || job->dtype > AK_E5M2) return 1;
#ifndef __FLT16_MAX__
    if (job->dtype != AK_F32 && job->dtype != AK_BF16) return 1;
#endif
    const int fp8 = job->dtype >= AK_E4M3;
    if (fp8 != (job->kd != NULL) || fp8 != (job->vd != NULL)) return 1; /* descales iff fp8 */
#ifdef AK_FP8DOT
    const int dot_pages = job->dtype == AK_BF16 || fp8;
#elif defined(AK_DPBF16)
    const int dot_pages = job->dtype == AK_BF16;
#endif
#ifdef AK_DPBF16
    if (job->bf16_dot && (!dot_pages || job->q_dtype != AK_BF16 || job->D % 32))
        return 1; /* bf16 dot products need bf16 q and bf16 (or, AK_FP8DOT, fp8) keys */
#else
    if (job->bf16_dot) return 1;
#endif
#ifdef AK_DPBF16
    if (job->bf16_pv && (!job->bf16_dot || job->dtype != AK_BF16 || job->Dv % 32))
        return 1; /* P V in bf16 dot products: with bf16_dot, bfloat16 pages, Dv % 32 == 0 */
#else
    if (job->bf16_pv) return 1;
#endif
#ifdef AK_H16
    if (job->h16 && (job->dtype != AK_E4M3 || job->q_dtype != AK_BF16 || job->D % 32))
        return 1; /* float16 arithmetic: e4m3 pages, bfloat16 q, D % 32 == 0 */
#else
    if (job->h16) return 1;
#endif
    if (job->ks_page < 0 || job->ks_tok < 0 || job->ks_head < 0 || job->vs_page < 0
        || job->vs_tok < 0 || job->vs_head < 0)
        return 1;
    if (job->shared) { /* v = k + off elements, the same strides, off + Dv <= D */
        const uintptr_t kp = (uintptr_t)job->kp, vp = (uintptr_t)job->vp;
        const uintptr_t esz = (uintptr_t)AK_ESZ(job->dtype);
        if (vp < kp || (vp - kp) % esz || (vp - kp) / esz > (uintptr_t)job->D) return 1;
        if ((int64_t)((vp - kp) / esz) > job->D - job->Dv) return 1;
        if (job->ks_page != job->vs_page || job->ks_tok != job->vs_tok
            || job->ks_head != job->vs_head)
            return 1;
    }
    if (B > 0 && !job->bt) return 1;
    if (job->bt_cols > INT64_MAX / P) return 1;
    const int64_t row_keys = job->bt_cols * P;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = job->seqlens[b], base = job->starts ? job->starts[b] : 0;
        if (L < 0 || base < 0 || base > row_keys || L > row_keys - base) return 1;
        if (L > job->splits * job->keys_per_split) return 1;
        if (L == 0) continue;
        const int64_t *row = job->bt + b * job->bt_cols;
        for (int64_t c = base / P; c <= (base + L - 1) / P; ++c)
            if (row[c] < 0 || row[c] >= num_pages) return 1;
    }
    return 0;
}

/* Returns AK_OK, AK_NO_MEMORY when no worker could allocate its scratch buffer, AK_BAD_ARGS
 * (nothing done) when check_args refuses the arguments. `math`: bit 0 the bfloat16 dot
 * products (bf16_dot), bit 1 e4m3 in float16 arithmetic (h16), bit 2 the value rows lie inside
 * the key rows (shared: MLA's latent cache, read once), bit 3 P V in bfloat16 dot products
 * too (bf16_pv: with bf16_dot and bfloat16 pages, Dv % 32 == 0; the weights rounded to
 * bfloat16, see pv_dp_rows). */
int attnkit_decode(const void *q, int q_dtype, int math, float scale, const void *kp,
                   const void *vp, const float *kd, const float *vd,
                   const int64_t *kstrides, const int64_t *vstrides,
                   const int64_t *bt, int64_t bt_cols, const int64_t *seqlens,
                   const int64_t *starts,
                   /* B, Hq, Hkv, Lq, D, Dv, P, num_pages, then q's strides (B, Hq, Lq) */
                   const int64_t *dims,
                   int64_t splits, int64_t keys_per_split, int dtype,
                   int causal, int bottom_right, int has_left, int64_t left,
                   int has_right, int64_t right,
                   float softcap, const float *alibi, float *out, float *lse,
                   int nthreads) {
    ak_job job = {
        .q = (const char *)q, .q_dtype = q_dtype, .bf16_dot = math & 1, .h16 = (math >> 1) & 1,
        .shared = (math >> 2) & 1, .bf16_pv = (math >> 3) & 1,
        .scale = scale,
        .qs_b = dims[8], .qs_h = dims[9], .qs_i = dims[10],
        .kp = (const char *)kp, .vp = (const char *)vp, .kd = kd, .vd = vd,
        .ks_page = kstrides[0], .ks_tok = kstrides[1], .ks_head = kstrides[2],
        .vs_page = vstrides[0], .vs_tok = vstrides[1], .vs_head = vstrides[2],
        .bt = bt, .bt_cols = bt_cols, .seqlens = seqlens, .starts = starts,
        .B = dims[0], .Hq = dims[1], .Hkv = dims[2], .Lq = dims[3],
        .D = dims[4], .Dv = dims[5], .P = dims[6],
        .splits = splits, .keys_per_split = keys_per_split, .dtype = dtype,
        .causal = causal, .bottom_right = bottom_right,
        .has_left = has_left, .has_right = has_right, .left = left, .right = right,
        .softcap = softcap, .alibi = alibi, .out = out, .lse = lse,
        .ntasks = 0, .next = 0,
    };
    if (math & ~15 || check_args(&job, dims[7])) return AK_BAD_ARGS;
#ifdef AK_FP8DOT
    if (job.bf16_dot && job.dtype >= AK_E4M3) fp8_tables(&job);
#endif
    job.ntasks = job.B * job.splits;
    if (job.ntasks == 0) return AK_OK;
    /* threads only where each gets enough work to repay waking it: multiply-adds of the
     * scores and P V over every sequence's keys, AK_DECODE_WORK_PER_THREAD per thread, as
     * many as the caller's `nthreads` (torch.get_num_threads()) at most */
    int64_t keys = 0;
    for (int64_t b = 0; b < job.B; ++b) keys += seqlens[b];
    const int64_t work = keys * job.Hq * job.Lq * (job.D + job.Dv);
    int64_t n = work / AK_DECODE_WORK_PER_THREAD;
    if (n > nthreads) n = nthreads;
    if (n > job.ntasks) n = job.ntasks;
    if (n > AK_POOL_MAX) n = AK_POOL_MAX;
    if (n < 1) n = 1;
    ak_team_run(decode_worker, &job, (int)n);
    /* a worker that could not allocate takes no task; one that could drains the queue, which
     * leaves the counter past ntasks */
    return __atomic_load_n(&job.next, __ATOMIC_RELAXED) > job.ntasks ? AK_OK : AK_NO_MEMORY;
}

/* ---- fp8 dequantization: x8 * descale into float32 or bfloat16, for fp8 q/k/v ----------
 *
 * src holds `slabs` slabs of `slab_len` fp8 bytes each (a (batch, head) block of a q/k/v
 * tensor), slab s scaled by descale[s]. Each value is converted exactly (read16) and
 * multiplied once in float32; bfloat16 output rounds that product to nearest even (NaN stays
 * NaN), as torch's float32 -> bfloat16 cast does. */
#define AK_DQ_BLOCK (1 << 14) /* elements a thread takes at a time */

typedef struct {
    const uint8_t *src;
    int64_t slabs, slab_len, n;
    const float *descale;
    int fmt, out_bf16;
    void *dst;
    int64_t next;
} ak_dq_job;

/* 16 elements at src (fmt) times f into dst from element i on, the first `count` of them */
AK_INLINE void dq_block(const ak_dq_job *p, const uint8_t *src, float f, int64_t i,
                        int64_t count) {
    akr x[AK_NB];
    if (p->fmt == AK_E4M3) read16((const char *)src, AK_E4M3, 0, x);
    else read16((const char *)src, AK_E5M2, 0, x);
    float y[AK_W];
    uint16_t h[AK_W];
    float *fd = count == AK_W ? (float *)p->dst + i : y; /* (a tail through y or h) */
    uint16_t *hd = count == AK_W ? (uint16_t *)p->dst + i : h;
    for (int j = 0; j < AK_NB; ++j) {
        const akr v = akr_mul(x[j], akr_set1(f));
        if (p->out_bf16) akr_store_bf16(hd + j * AK_N, v);
        else akr_store(fd + j * AK_N, v);
    }
    if (count == AK_W) return;
    if (p->out_bf16) memcpy((uint16_t *)p->dst + i, h, (size_t)count * sizeof(uint16_t));
    else memcpy((float *)p->dst + i, y, (size_t)count * sizeof(float));
}

static void dq_range(const ak_dq_job *p, int64_t a, int64_t e) {
    const float unit = p->fmt == AK_E4M3 ? 256.0f : 1.0f;
    while (a < e) {
        const int64_t s = a / p->slab_len, slab_end = (s + 1) * p->slab_len;
        const int64_t stop = slab_end < e ? slab_end : e;
        const float f = unit * p->descale[s];
        int64_t i = a;
        for (; i + AK_W <= stop; i += AK_W) dq_block(p, p->src + i, f, i, AK_W);
        if (i < stop) { /* the slab's tail, through a zero-padded copy */
            uint8_t tail[AK_W] = {0};
            memcpy(tail, p->src + i, (size_t)(stop - i));
            dq_block(p, tail, f, i, stop - i);
        }
        a = stop;
    }
}

static void dq_worker(void *arg, int worker, int nworkers) {
    ak_dq_job *p = (ak_dq_job *)arg;
    (void)worker;
    (void)nworkers;
    int64_t a, e;
    while (ak_next_block(&p->next, AK_DQ_BLOCK, p->n, &a, &e)) dq_range(p, a, e);
}

/* Returns AK_OK, or AK_BAD_ARGS (nothing written) for arguments it cannot run. */
int attnkit_fp8_dequantize(const void *src, int64_t slabs, int64_t slab_len,
                           const float *descale, int fmt, int out_bf16, void *dst,
                           int nthreads) {
#ifndef __FLT16_MAX__
    return AK_BAD_ARGS;
#endif
    if (!src || !descale || !dst || slabs < 0 || slab_len < 0) return AK_BAD_ARGS;
    if (fmt != AK_E4M3 && fmt != AK_E5M2) return AK_BAD_ARGS;
    if (slab_len && slabs > INT64_MAX / slab_len) return AK_BAD_ARGS;
    ak_dq_job job = {.src = (const uint8_t *)src, .slabs = slabs, .slab_len = slab_len,
                     .n = slabs * slab_len, .descale = descale, .fmt = fmt,
                     .out_bf16 = out_bf16 != 0, .dst = dst, .next = 0};
    if (job.n == 0) return AK_OK;
    int64_t n = job.n / (4 * AK_DQ_BLOCK);
    if (n > nthreads) n = nthreads;
    if (n > AK_POOL_MAX) n = AK_POOL_MAX;
    if (n < 1) n = 1;
    ak_team_run(dq_worker, &job, (int)n);
    return AK_OK;
}
