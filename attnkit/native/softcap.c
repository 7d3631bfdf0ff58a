/* attnkit native softcap: the tiled executor's tanh passes in one vectorised sweep each.
 *
 *   attnkit_softcap_forward:  x <- cap * tanh(x)                      (in place)
 *   attnkit_softcap_backward: out <- ds * cap * (1 - tanh(raw)^2)     (d cap*tanh(raw) / d raw)
 *
 * float32, contiguous, n elements; tanh to about 1e-7 absolute (vecmath.h). Large tiles are
 * cut into blocks that the pool's threads (pool.h) take in turn.
 */
#include "attnkit.h"
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "vecmath.h"

#ifndef SC_WORK_PER_THREAD
#define SC_WORK_PER_THREAD (1 << 15) /* elements; fewer per thread run on the caller alone */
#endif
#define SC_BLOCK (1 << 13) /* elements a thread takes at a time (a multiple of AK_W) */

typedef struct {
    float *x;
    const float *ds, *raw;
    float *out;
    int64_t n;
    float cap;
    int64_t next; /* next block, taken with __atomic_fetch_add */
} sc_job;

static void softcap_forward_range(const sc_job *p, int64_t a, int64_t e) {
    float *x = p->x;
    int64_t i = a;
    for (; i + AK_W <= e; i += AK_W) {
        ak_vf v;
        memcpy(&v, x + i, sizeof v);
        v = p->cap * tanh_approx(v);
        memcpy(x + i, &v, sizeof v);
    }
    for (; i < e; ++i) x[i] = p->cap * tanh_approx(ak_splat(x[i]))[0];
}

static void softcap_backward_range(const sc_job *p, int64_t a, int64_t e) {
    int64_t i = a;
    for (; i + AK_W <= e; i += AK_W) {
        ak_vf g, r;
        memcpy(&g, p->ds + i, sizeof g);
        memcpy(&r, p->raw + i, sizeof r);
        const ak_vf t = tanh_approx(r);
        g = g * (p->cap * (1.0f - t * t));
        memcpy(p->out + i, &g, sizeof g);
    }
    for (; i < e; ++i) {
        const float t = tanh_approx(ak_splat(p->raw[i]))[0];
        p->out[i] = p->ds[i] * (p->cap * (1.0f - t * t));
    }
}

/* pool workers: blocks of SC_BLOCK elements until none is left */
static void softcap_forward_worker(void *arg, int worker, int nworkers) {
    sc_job *p = (sc_job *)arg;
    (void)worker;
    (void)nworkers;
    int64_t a, e;
    while (ak_next_block(&p->next, SC_BLOCK, p->n, &a, &e)) softcap_forward_range(p, a, e);
}

static void softcap_backward_worker(void *arg, int worker, int nworkers) {
    sc_job *p = (sc_job *)arg;
    (void)worker;
    (void)nworkers;
    int64_t a, e;
    while (ak_next_block(&p->next, SC_BLOCK, p->n, &a, &e)) softcap_backward_range(p, a, e);
}

/* threads for n elements: at most `threads`, each with SC_WORK_PER_THREAD elements or more */
static int workers_for(int64_t n, int threads) {
    int64_t w = n / SC_WORK_PER_THREAD;
    if (w > threads) w = threads;
    if (w > AK_POOL_MAX) w = AK_POOL_MAX;
    return w < 1 ? 1 : (int)w;
}

void attnkit_softcap_forward(float *x, int64_t n, float cap, int threads) {
    if (!x || n <= 0) return;
    sc_job p = {.x = x, .n = n, .cap = cap, .next = 0};
    ak_team_run(softcap_forward_worker, &p, workers_for(n, threads));
}

void attnkit_softcap_backward(const float *ds, const float *raw, float *out, int64_t n,
                              float cap, int threads) {
    if (!ds || !raw || !out || n <= 0) return;
    sc_job p = {.ds = ds, .raw = raw, .out = out, .n = n, .cap = cap, .next = 0};
    ak_team_run(softcap_backward_worker, &p, workers_for(n, threads));
}
