/* attnkit native peaks: the most this CPU's cores and memory can do, the limits the
 * benchmark gives every case's share of (attnkit/bench/limits.py).
 *
 *   attnkit_peak_fma(iters, threads, x, y, cpu_s):  every worker runs `iters` rounds of
 *       PK_ACC independent float32 multiply-adds (acc = acc * x + y) on full vector registers
 *       (512-bit with AVX-512, 256-bit with AVX2 + FMA; what the build targets, as for the
 *       other kernels) and writes the CPU seconds its thread spent on them to cpu_s[worker]
 *       (time the thread was scheduled out, on a busy machine, is not in it). Returns one
 *       worker's FLOPs (2 per lane per multiply-add).
 *   attnkit_peak_dpbf16(iters, threads, a, cpu_s):  the same rounds of vdpbf16ps
 *       (AVX512-BF16: two bfloat16 products and their sum added to each float32 lane, 4 FLOPs
 *       a lane); 0 on a build without it (bfloat16 then computes in float32: the FMA rate is
 *       its limit).
 *   attnkit_peak_copy(dst, src, bytes, threads):  memcpy of `bytes`, one contiguous share of
 *       whole cache lines per worker.
 *   attnkit_peak_bits():  the vector width of the FMA rounds, in bits.
 *
 * PK_ACC accumulators hide the multiply-add latency (4 cycles on current x86 cores, 2 units:
 * 8 in flight) and leave registers for the operands even with AVX2's 16. The inputs come from
 * the caller, so the compiler cannot fold the rounds; the sums go to a sink.
 */
#include "attnkit.h"
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "pool.h"

#if defined(__AVX512F__)
#define PK_BYTES 64
#elif defined(__AVX__)
#define PK_BYTES 32
#else
#define PK_BYTES 16
#endif
#define PK_LANES (PK_BYTES / 4)
#define PK_ACC 12

typedef float pk_vf __attribute__((vector_size(PK_BYTES)));

static volatile float pk_sink;

typedef struct {
    int64_t iters;
    float x, y;
    uint16_t a; /* bfloat16 bits of the dot-product operands */
    char *dst;
    const char *src;
    int64_t bytes;
    double *cpu_s; /* per worker: its thread's CPU seconds over the rounds */
} pk_job;

static double pk_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static pk_vf pk_splat(float v) {
    pk_vf r;
    for (int i = 0; i < PK_LANES; ++i) r[i] = v;
    return r;
}

static float pk_sum(const pk_vf *acc, int n) {
    float s = 0.0f;
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < PK_LANES; ++i) s += acc[j][i];
    return s;
}

static void pk_fma_worker(void *ctx, int w, int n) {
    (void)n;
    const pk_job *job = (const pk_job *)ctx;
    const double t0 = pk_cpu_seconds();
    const pk_vf x = pk_splat(job->x), y = pk_splat(job->y);
    /* different starting values: equal ones would let the compiler keep one accumulator */
    pk_vf a0 = y, a1 = y + 1, a2 = y + 2, a3 = y + 3, a4 = y + 4, a5 = y + 5;
    pk_vf a6 = y + 6, a7 = y + 7, a8 = y + 8, a9 = y + 9, a10 = y + 10, a11 = y + 11;
    for (int64_t r = 0; r < job->iters; ++r) {
        /* one expression each: fused into one multiply-add by GCC and Clang alike */
        a0 = a0 * x + y;
        a1 = a1 * x + y;
        a2 = a2 * x + y;
        a3 = a3 * x + y;
        a4 = a4 * x + y;
        a5 = a5 * x + y;
        a6 = a6 * x + y;
        a7 = a7 * x + y;
        a8 = a8 * x + y;
        a9 = a9 * x + y;
        a10 = a10 * x + y;
        a11 = a11 * x + y;
    }
    const pk_vf acc[PK_ACC] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
    pk_sink = pk_sum(acc, PK_ACC);
    job->cpu_s[w] = pk_cpu_seconds() - t0;
}

double attnkit_peak_fma(int64_t iters, int threads, float x, float y, double *cpu_s) {
    pk_job job = {.iters = iters, .x = x, .y = y, .cpu_s = cpu_s};
    ak_pool_run(pk_fma_worker, &job, threads);
    return 2.0 * PK_ACC * PK_LANES * (double)iters;
}

int attnkit_peak_bits(void) { return PK_BYTES * 8; }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static void pk_dpbf16_worker(void *ctx, int w, int n) {
    (void)n;
    const pk_job *job = (const pk_job *)ctx;
    const double t0 = pk_cpu_seconds();
    const __m512bh b = (__m512bh)_mm512_set1_epi16((short)job->a);
    /* different starting values (as above) */
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_add_ps(a0, one), a2 = _mm512_add_ps(a1, one);
    __m512 a3 = _mm512_add_ps(a2, one), a4 = _mm512_add_ps(a3, one), a5 = _mm512_add_ps(a4, one);
    __m512 a6 = _mm512_add_ps(a5, one), a7 = _mm512_add_ps(a6, one), a8 = _mm512_add_ps(a7, one);
    __m512 a9 = _mm512_add_ps(a8, one), a10 = _mm512_add_ps(a9, one);
    __m512 a11 = _mm512_add_ps(a10, one);
    for (int64_t r = 0; r < job->iters; ++r) {
        a0 = _mm512_dpbf16_ps(a0, b, b);
        a1 = _mm512_dpbf16_ps(a1, b, b);
        a2 = _mm512_dpbf16_ps(a2, b, b);
        a3 = _mm512_dpbf16_ps(a3, b, b);
        a4 = _mm512_dpbf16_ps(a4, b, b);
        a5 = _mm512_dpbf16_ps(a5, b, b);
        a6 = _mm512_dpbf16_ps(a6, b, b);
        a7 = _mm512_dpbf16_ps(a7, b, b);
        a8 = _mm512_dpbf16_ps(a8, b, b);
        a9 = _mm512_dpbf16_ps(a9, b, b);
        a10 = _mm512_dpbf16_ps(a10, b, b);
        a11 = _mm512_dpbf16_ps(a11, b, b);
    }
    const __m512 s = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                      _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),
        _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    pk_sink = _mm512_reduce_add_ps(s);
    job->cpu_s[w] = pk_cpu_seconds() - t0;
}

double attnkit_peak_dpbf16(int64_t iters, int threads, uint16_t a, double *cpu_s) {
    pk_job job = {.iters = iters, .a = a, .cpu_s = cpu_s};
    ak_pool_run(pk_dpbf16_worker, &job, threads);
    return 4.0 * PK_ACC * 16 * (double)iters;
}
#else
double attnkit_peak_dpbf16(int64_t iters, int threads, uint16_t a, double *cpu_s) {
    (void)iters;
    (void)threads;
    (void)a;
    (void)cpu_s;
    return 0.0;
}
#endif

static void pk_copy_worker(void *ctx, int w, int n) {
    const pk_job *job = (const pk_job *)ctx;
    const int64_t lines = job->bytes / 64;
    const int64_t a = lines * w / n * 64;
    const int64_t e = w == n - 1 ? job->bytes : lines * (w + 1) / n * 64;
    if (e > a) memcpy(job->dst + a, job->src + a, (size_t)(e - a));
}

void attnkit_peak_copy(void *dst, const void *src, int64_t bytes, int threads) {
    pk_job job = {.dst = (char *)dst, .src = (const char *)src, .bytes = bytes};
    ak_pool_run(pk_copy_worker, &job, threads);
}
