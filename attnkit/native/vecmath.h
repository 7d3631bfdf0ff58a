/* attnkit native kernels: float32 vector math shared by softcap.c and terms.c (GCC/Clang
 * vector extensions, so any target gets them): 16-lane vectors (ak_vf; one register each on
 * AVX-512 machines) and the native vector of one register (ak_vn, simd.h's akr), with
 * simd.h's tanh. (decode.c is written in simd.h; its MLA score tiles still name ak_vn and
 * splatn.)
 */
#ifndef ATTNKIT_VECMATH_H
#define ATTNKIT_VECMATH_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

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

/* The native vector: AK_N float32 lanes, one register: 16 with AVX-512, else 8 (AVX2's
 * 256-bit registers: GCC keeps the 16-lane vectors of such a target in memory and compares
 * them lane by lane). tanh is simd.h's on it (tanh_approx_n); the 16-lane form applies it to
 * each of its AK_NB registers' worth. */
#define AK_N AKR_LANES /* (simd.h's register) */
#define AK_NB (AK_W / AK_N)

typedef float ak_vn __attribute__((vector_size(4 * AK_N)));

AK_INLINE ak_vn splatn(float x) {
    ak_vn v;
    for (int i = 0; i < AK_N; ++i) v[i] = x;
    return v;
}

/* tanh(x), absolute error about 1e-7: simd.h's akr_tanh_fine (NaN stays NaN) */
AK_INLINE ak_vn tanh_approx_n(ak_vn x) { return (ak_vn)akr_tanh_fine((akr)x); }

/* F (an _n function) on each native register's worth of the 16 lanes of x */
#define AK_ON_EACH(F, x)                                                                   \
    do {                                                                                   \
        ak_vn h_[AK_NB];                                                                   \
        memcpy(h_, &(x), sizeof h_);                                                       \
        for (int i_ = 0; i_ < AK_NB; ++i_) h_[i_] = F(h_[i_]);                             \
        memcpy(&(x), h_, sizeof h_);                                                       \
    } while (0)

/* tanh_approx_n, 16 lanes */
AK_INLINE ak_vf tanh_approx(ak_vf x) {
    AK_ON_EACH(tanh_approx_n, x);
    return x;
}

#endif
