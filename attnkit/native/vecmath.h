/* attnkit native kernels: 16-lane float32 vector math shared by decode.c, softcap.c and terms.c
 * (GCC/Clang vector extensions, so any target gets them; AVX-512 machines one register each).
 */
#ifndef ATTNKIT_VECMATH_H
#define ATTNKIT_VECMATH_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* 64-byte vectors on a target without AVX-512 (the portable build): GCC notes that passing
 * them would change the ABI; every function taking them here is inlined, so none is passed */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define AK_W 16 /* floats per vector */
#define AK_INLINE static inline __attribute__((always_inline))

typedef float ak_vf __attribute__((vector_size(64)));
typedef int32_t ak_vi __attribute__((vector_size(64)));
typedef uint32_t ak_vu32 __attribute__((vector_size(64)));

AK_INLINE ak_vf ak_splat(float x) {
    return (ak_vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* lanes of a where mask m is set (all bits), else b */
AK_INLINE ak_vf ak_select(ak_vi m, ak_vf a, ak_vf b) {
    return (ak_vf)(((ak_vi)a & m) | ((ak_vi)b & ~m));
}

/* the bfloat16 bit patterns of f (in each lane's low 16 bits), rounded to nearest even as
 * torch's casts round; NaN stays a (quiet) NaN */
AK_INLINE ak_vu32 ak_bf16_bits(ak_vf f) {
    ak_vu32 u;
    memcpy(&u, &f, sizeof u);
    const ak_vu32 nan = (ak_vu32)((u & 0x7fffffffu) > 0x7f800000u);
    const ak_vu32 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (r & ~nan) | (((u >> 16) | 0x40u) & nan);
}

/* exp(x) for x <= 0 (scores minus their running max), 16 lanes: 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2; relative error below 2e-7. 0 for x < -87 (where the true
 * value is below float32's normal range) and for x = -inf; NaN for x = NaN (r, hence the
 * polynomial, is NaN whatever the exponent bits; decode.c relies on it). */
AK_INLINE ak_vf exp_nonpos(ak_vf x) {
    const ak_vi under = x < ak_splat(-87.0f);
    const ak_vf xc = ak_select(under, ak_splat(-87.0f), x);
    const ak_vf magic = ak_splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to integer */
    const ak_vf n = (xc * 1.44269504088896341f + magic) - magic;
    ak_vf r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    ak_vf p = ak_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ak_vi e = (__builtin_convertvector(n, ak_vi) + 127) << 23;
    return ak_select(under, ak_splat(0.0f), p * (ak_vf)e);
}

AK_INLINE float exp_nonpos1(float x) {
    return exp_nonpos(ak_splat(x))[0];
}

/* tanh(x), 16 lanes: an odd Taylor polynomial near 0, (1 - E) / (1 + E) with E = e^{-2|x|}
 * elsewhere (one exp, one division); absolute error about 1e-7. */
AK_INLINE ak_vf tanh_approx(ak_vf x) {
    const ak_vi sign = (ak_vi)x & (ak_vi)ak_splat(-0.0f);
    ak_vf ax = (ak_vf)((ak_vi)x & ~(ak_vi)ak_splat(-0.0f));
    ax = ak_select(ax > ak_splat(9.0f), ak_splat(9.0f), ax);
    const ak_vf e = exp_nonpos(-2.0f * ax);
    const ak_vf big = (1.0f - e) / (1.0f + e);
    const ak_vf x2 = ax * ax;
    const ak_vf small = ax * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f
                                                                + x2 * (-17.0f / 315.0f))));
    const ak_vf t = ak_select(ax < ak_splat(0.125f), small, big);
    return (ak_vf)((ak_vi)t | sign);
}

#endif
