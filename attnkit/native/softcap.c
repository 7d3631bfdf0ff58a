/* attnkit native softcap: the tiled executor's tanh passes in one vectorised sweep each.
 *
 *   attnkit_softcap_forward:  x <- cap * tanh(x)                      (in place)
 *   attnkit_softcap_backward: out <- ds * cap * (1 - tanh(raw)^2)     (d cap*tanh(raw) / d raw)
 *
 * float32, contiguous, n elements; tanh to about 1e-7 absolute (vecmath.h). Large tiles are
 * split across threads.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

typedef struct {
    float *x;
    const float *ds, *raw;
    float *out;
    int64_t n;
    float cap;
} sc_part;

static void *softcap_forward_part(void *arg) {
    const sc_part *p = (const sc_part *)arg;
    float *x = p->x;
    int64_t i = 0;
    for (; i + AK_W <= p->n; i += AK_W) {
        ak_vf v;
        memcpy(&v, x + i, sizeof v);
        v = p->cap * tanh_approx(v);
        memcpy(x + i, &v, sizeof v);
    }
    for (; i < p->n; ++i) x[i] = p->cap * tanh_approx(ak_splat(x[i]))[0];
    return NULL;
}

static void *softcap_backward_part(void *arg) {
    const sc_part *p = (const sc_part *)arg;
    int64_t i = 0;
    for (; i + AK_W <= p->n; i += AK_W) {
        ak_vf g, r;
        memcpy(&g, p->ds + i, sizeof g);
        memcpy(&r, p->raw + i, sizeof r);
        const ak_vf t = tanh_approx(r);
        g = g * (p->cap * (1.0f - t * t));
        memcpy(p->out + i, &g, sizeof g);
    }
    for (; i < p->n; ++i) {
        const float t = tanh_approx(ak_splat(p->raw[i]))[0];
        p->out[i] = p->ds[i] * (p->cap * (1.0f - t * t));
    }
    return NULL;
}

/* Run fn over [0, n) in up to `threads` contiguous parts (whole vectors each). */
static void run_parts(void *(*fn)(void *), sc_part base, int threads) {
    enum { MAX_PARTS = 64, MIN_PART = 1 << 16 };
    if (threads > MAX_PARTS) threads = MAX_PARTS;
    int64_t parts = base.n / MIN_PART;
    if (parts > threads) parts = threads;
    if (parts < 2) {
        fn(&base);
        return;
    }
    sc_part part[MAX_PARTS];
    pthread_t th[MAX_PARTS];
    int started[MAX_PARTS] = {0};
    const int64_t step = (base.n / parts + AK_W - 1) / AK_W * AK_W;
    for (int64_t k = 0; k < parts; ++k) {
        const int64_t a = k * step;
        int64_t e = k + 1 == parts ? base.n : a + step;
        if (e > base.n) e = base.n;
        part[k] = base;
        part[k].n = e > a ? e - a : 0;
        if (base.x) part[k].x = base.x + a;
        if (base.ds) part[k].ds = base.ds + a;
        if (base.raw) part[k].raw = base.raw + a;
        if (base.out) part[k].out = base.out + a;
    }
    for (int64_t k = 1; k < parts; ++k)
        started[k] = pthread_create(&th[k], NULL, fn, &part[k]) == 0;
    fn(&part[0]);
    for (int64_t k = 1; k < parts; ++k) {
        if (started[k]) pthread_join(th[k], NULL);
        else fn(&part[k]); /* no thread: do it here */
    }
}

void attnkit_softcap_forward(float *x, int64_t n, float cap, int threads) {
    sc_part p = {.x = x, .n = n, .cap = cap};
    run_parts(softcap_forward_part, p, threads);
}

void attnkit_softcap_backward(const float *ds, const float *raw, float *out, int64_t n,
                              float cap, int threads) {
    sc_part p = {.ds = ds, .raw = raw, .out = out, .n = n, .cap = cap};
    run_parts(softcap_backward_part, p, threads);
}
