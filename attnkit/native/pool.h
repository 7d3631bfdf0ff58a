/* attnkit native kernels' threads: ak_team_run, on which every kernel runs its parallel regions
 * (torch's OpenMP team where the library shares torch's runtime), and attnkit's own persistent
 * pool, ak_pool_run, which ak_team_run falls back to (no shared runtime, a busy machine, a
 * forked child) and the bench's limit kernels use.
 *
 *
 * ak_pool_run(fn, ctx, n) calls fn(ctx, w, n) once for every worker index w in [0, n) and
 * returns when all of those calls have returned. The calling thread runs w = 0 itself and
 * then takes any index no pool thread has taken yet, so a call never waits for a thread that
 * has not been scheduled, and n = 1 (or a pool that could start no thread) runs everything
 * on the caller without touching the pool. See pool.c for how threads park and wake, how
 * concurrent callers and fork are handled.
 */
#ifndef ATTNKIT_POOL_H
#define ATTNKIT_POOL_H

#include <stdint.h>

#include "attnkit.h" /* AK_POOL_MAX: most workers of one call, the caller included */

typedef void (*ak_pool_fn)(void *ctx, int worker, int nworkers);

/* Run fn(ctx, w, n) for w in [0, n) on the calling thread and up to n - 1 pool threads
 * (n is clamped to [1, AK_POOL_MAX]). Safe to call from several threads at once: a call that
 * finds the pool in use runs all its indices on its own thread. */
__attribute__((visibility("hidden"))) void ak_pool_run(ak_pool_fn fn, void *ctx, int n);

/* The same contract on the OpenMP runtime's threads when attnkit_team_openmp(1) has been
 * called and the library was built with OpenMP (torch's runtime: see pool.c), else
 * ak_pool_run. Every kernel's parallel regions (flash, decode, softcap) run here: torch's
 * threads have just run torch's operators and spin a while after each, so they start at once,
 * where a pool thread woken then waits for a core that a spinning thread holds. */
__attribute__((visibility("hidden"))) void ak_team_run(ak_pool_fn fn, void *ctx, int n);

/* The next block [*a, *e) of `block` elements out of [0, n), taken from the shared counter
 * *next (atomically, so every worker of a call may take blocks); 0 when none is left. */
static inline int ak_next_block(int64_t *next, int64_t block, int64_t n, int64_t *a,
                                int64_t *e) {
    *a = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * block;
    if (*a >= n) return 0;
    *e = *a + block < n ? *a + block : n;
    return 1;
}

#endif
