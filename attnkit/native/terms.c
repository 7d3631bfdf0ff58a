/* attnkit native score-term tiles: ALiBi's additive term for one tile or piece, in one pass.
 *
 *   attnkit_alibi_tile: out[n, h, r, c] = rnd(rnd(|ip[n, r] - j[c]|) * rnd(-slope[n, h, r]))
 *                       where vis[n, r, c] and lo[n, r] <= c < hi[n, r] (each optional),
 *                       else -inf
 *
 * rnd() rounds to out's dtype (float32, bfloat16 or float16) to nearest even, as torch's casts
 * and its multiply in that dtype do, so the tile is bit for bit the one the torch ops built
 * (`score_terms.alibi_term`: a distance, its cast, a where and a multiply, five passes over
 * the tile, the bfloat16 multiply converting element by element). Broadcast dims are given as
 * a size of 1: ip (ip_n, R), slope (s_n, H, s_r), vis (v_n, R, C), lo and hi (ip_n, R), each
 * _n 1 or N, s_r 1 or R. A band (causal, a window) on a contiguous key range is its rows'
 * column bounds lo, hi: no bool tile to build or read. Single-threaded: the fused schedule's pieces run on their own threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attnkit.h"
#include "vecmath.h"

enum { AT_F32 = AK_F32, AT_BF16 = AK_BF16, AT_F16 = AK_F16 };

/* x rounded to bfloat16 (vecmath.h), as its bits and as a float32 */
static inline uint16_t bf16_bits(float x) { return (uint16_t)ak_bf16_bits(ak_splat(x))[0]; }

static inline float bf16_value(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* x rounded to bfloat16, kept as float32 (low bits zero) */
static inline __m512 bf16_round(__m512 x) {
    ak_vf f;
    memcpy(&f, &x, sizeof f);
    const ak_vu32 u = ak_bf16_bits(f) << 16;
    __m512 r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* lanes c .. c + 15 that lie in the visible columns [a, e) */
static inline __mmask16 band_lanes(int64_t c, int64_t a, int64_t e) {
    const int64_t lo = a > c ? a - c : 0, hi = e - c < 16 ? e - c : 16;
    if (hi <= lo) return 0;
    return (__mmask16)((((uint32_t)1 << hi) - 1) & ~(((uint32_t)1 << lo) - 1));
}

/* one row of one head, 16 keys a step: d[c] the row's distances already rounded to the dtype,
 * s the slope's negation rounded to it, keys outside [a, e) or where v[c] == 0 hidden;
 * `exact16`: s is 0 or a normal float (then so is every product, and AVX512-BF16's
 * round-to-nearest-even conversion, which flushes denormals, rounds as torch does). Returns
 * the first key left for the scalar tail. */
static int64_t alibi_row_avx512(void *y, int dtype, int64_t C, const float *d, float s,
                                const uint8_t *v, int64_t a, int64_t e, int exact16) {
    const __m512 sv = _mm512_set1_ps(s), ninf = _mm512_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __mmask16 keep = band_lanes(c, a, e);
        if (v) keep &= _mm_test_epi8_mask(_mm_loadu_si128((const void *)(v + c)), _mm_set1_epi8(-1));
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(d + c), sv);
        if (dtype == AT_F32) {
            _mm512_storeu_ps((float *)y + c, _mm512_mask_blend_ps(keep, ninf, p));
        } else if (dtype == AT_BF16) {
#ifdef __AVX512BF16__
            if (exact16) {
                const __m256i b = (__m256i)_mm512_cvtneps_pbh(p);
                _mm256_storeu_si256((void *)((uint16_t *)y + c),
                                    _mm256_mask_blend_epi16(keep, _mm256_set1_epi16((short)0xFF80), b));
                continue;
            }
#endif
            const __m512i bits = _mm512_srli_epi32(
                _mm512_castps_si512(_mm512_mask_blend_ps(keep, ninf, bf16_round(p))), 16);
            _mm256_storeu_si256((void *)((uint16_t *)y + c), _mm512_cvtepi32_epi16(bits));
        } else {
            _mm256_storeu_si256((void *)((uint16_t *)y + c),
                                _mm512_cvtps_ph(_mm512_mask_blend_ps(keep, ninf, p),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
    (void)exact16;
    return c;
}
#endif

/* one row of one head, keys c0 <= c < C (the scalar tail, and targets without AVX-512) */
static void alibi_row_scalar(void *y, int dtype, int64_t c0, int64_t C, const float *d, float s,
                             const uint8_t *v, int64_t a, int64_t e) {
    for (int64_t c = c0; c < C; ++c) {
        const int hide = c < a || c >= e || (v && !v[c]);
        if (dtype == AT_F32) {
            ((float *)y)[c] = hide ? -INFINITY : d[c] * s;
        } else if (dtype == AT_BF16) {
            ((uint16_t *)y)[c] = hide ? (uint16_t)0xFF80 : bf16_bits(d[c] * s);
        }
#ifdef __FLT16_MAX__
        else {
            ((_Float16 *)y)[c] = hide ? (_Float16)-INFINITY : (_Float16)(d[c] * s);
        }
#endif
    }
}

/* d[c] = |ipf - jf[c]| rounded to the dtype, as a float32 (exact: positions below 2^24) */
static void row_distances(float *d, int dtype, int64_t C, float ipf, const float *jf) {
    int64_t c = 0;
#ifdef __AVX512F__
    const __m512 ip = _mm512_set1_ps(ipf);
    for (; c + 16 <= C; c += 16) {
        __m512 x = _mm512_abs_ps(_mm512_sub_ps(ip, _mm512_loadu_ps(jf + c)));
        if (dtype == AT_BF16) x = bf16_round(x);
        else if (dtype == AT_F16)
            x = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm512_storeu_ps(d + c, x);
    }
#endif
    for (; c < C; ++c) {
        float x = fabsf(ipf - jf[c]);
        if (dtype == AT_BF16) x = bf16_value(bf16_bits(x));
#ifdef __FLT16_MAX__
        else if (dtype == AT_F16) x = (float)(_Float16)x;
#endif
        d[c] = x;
    }
}

/* Returns AK_OK, or AK_BAD_ARGS (nothing written) for a dtype this build cannot write, sizes
 * that do not fit together or positions at or beyond 2^24 (where float32 distances would
 * round).
 * lo, hi (ip_n, R) or NULL: row r's visible columns [lo, hi) (besides vis); scratch: 2 * C
 * floats (the key positions, a row's distances). */
int attnkit_alibi_tile(void *out, int dtype, int64_t N, int64_t H, int64_t R, int64_t C,
                       const int64_t *ip, int64_t ip_n, const int64_t *j, const float *slope,
                       int64_t s_n, int64_t s_r, const uint8_t *vis, int64_t v_n,
                       const int64_t *lo, const int64_t *hi, float *scratch) {
    if (!out || !ip || !j || !slope || !scratch || N < 1 || H < 1 || R < 0 || C < 0)
        return AK_BAD_ARGS;
    if ((ip_n != 1 && ip_n != N) || (s_n != 1 && s_n != N) || (s_r != 1 && s_r != R))
        return AK_BAD_ARGS;
    if ((vis && v_n != 1 && v_n != N) || (!lo != !hi)) return AK_BAD_ARGS;
    if (dtype != AT_F32 && dtype != AT_BF16) {
#ifdef __FLT16_MAX__
        if (dtype != AT_F16) return AK_BAD_ARGS;
#else
        return AK_BAD_ARGS;
#endif
    }
    const int64_t big = (int64_t)1 << 24;
    for (int64_t i = 0; i < ip_n * R; ++i)
        if (ip[i] <= -big || ip[i] >= big) return AK_BAD_ARGS;
    float *jf = scratch, *d = scratch + C;
    for (int64_t c = 0; c < C; ++c) {
        if (j[c] <= -big || j[c] >= big) return AK_BAD_ARGS;
        jf[c] = (float)j[c];
    }
    const int esz = dtype == AT_F32 ? 4 : 2;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t ir = (ip_n > 1 ? n : 0) * R + r;
            int64_t a = lo ? lo[ir] : 0, e = hi ? hi[ir] : C;
            if (a < 0) a = 0;
            if (e > C) e = C;
            row_distances(d, dtype, C, (float)ip[ir], jf); /* (once for all H heads) */
            const uint8_t *v = vis ? vis + ((v_n > 1 ? n : 0) * R + r) * C : NULL;
            for (int64_t h = 0; h < H; ++h) {
                float s = -slope[((s_n > 1 ? n : 0) * H + h) * s_r + (s_r > 1 ? r : 0)];
                if (dtype == AT_BF16) s = bf16_value(bf16_bits(s));
#ifdef __FLT16_MAX__
                if (dtype == AT_F16) s = (float)(_Float16)s;
#endif
                char *y = (char *)out + ((n * H + h) * R + r) * C * esz;
                int64_t c = 0;
#ifdef __AVX512F__
                c = alibi_row_avx512(y, dtype, C, d, s, v, a, e, s == 0.0f || fabsf(s) >= 0x1p-126f);
#endif
                alibi_row_scalar(y, dtype, c, C, d, s, v, a, e);
            }
        }
    return AK_OK;
}
