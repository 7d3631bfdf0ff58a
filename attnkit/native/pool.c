/* attnkit native thread pool (pool.h): worker threads started once, on the first call that
 * wants them, and parked between calls.
 *
 * Parking and waking. Pool thread i (1 <= i < AK_POOL_MAX) sleeps on its own condition
 * variable until its slot's `go` names a generation it has not seen. A call bumps the
 * generation, publishes (fn, ctx, n) and sets `go` in slots 1 .. n-1 under the pool mutex,
 * then signals just those threads, so a call on 2 threads wakes one thread whatever the pool's
 * size. Threads are started when a call asks for more than exist (up to AK_POOL_MAX - 1) and
 * never stopped; a thread that cannot be started leaves its indices to the others.
 *
 * Handing out indices. Index 0 is the caller's. The others are taken from one 64-bit ticket,
 * (generation << 16) | next index, by compare-and-swap, so a thread that wakes late, after its
 * call has finished and maybe another has begun, sees a different generation and takes
 * nothing: it never runs an index of a call it read no (fn, ctx) for. The caller runs index
 * 0, then takes what is left like any pool thread, then waits (a short spin, then the `idle`
 * condition variable) until every index has returned: it waits only for threads that are
 * running an index, never for one that has yet to wake.
 *
 * Concurrent callers. One call uses the pool at a time (the `busy` flag); a call that finds
 * it taken runs all of its indices on its own thread at once rather than wait, so calls from
 * several threads proceed side by side and none ever blocks on another's call, however long.
 *
 * Fork. A child process has only the thread that forked, so a pthread_atfork child handler
 * (registered when the library is loaded) resets the pool to no threads, not busy, with fresh
 * mutex and condition variables (another thread of the parent may have held them at the
 * fork); the child starts its own threads when it needs them.
 */
#include "attnkit.h"
#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef AK_POOL_SPIN
#define AK_POOL_SPIN 1024 /* polls of the done count (tens of us) before the caller sleeps */
#endif

typedef struct {
    pthread_cond_t cond; /* the thread parks here */
    uint64_t go;         /* the generation this thread is asked to join (under mu) */
} ak_slot;

static struct {
    pthread_mutex_t mu;    /* guards the job fields, the slots and the thread count */
    pthread_cond_t idle;   /* the caller waits here for the last index */
    int busy;              /* a call holds the pool (atomic) */
    int nthreads;          /* pool threads started (worker indices 1 .. nthreads) */
    uint64_t gen;          /* the current call's generation (under mu) */
    ak_pool_fn fn;         /* the current call (under mu) */
    void *ctx;
    int n;
    uint64_t ticket;       /* (gen << 16) | next index to hand out (atomic) */
    int done;              /* indices returned in the current call (atomic) */
    int64_t calls, parallel_runs, busy_runs, woken, caller_extra; /* counters (atomic) */
    int last_threads;      /* threads the latest call ran on, caller included (atomic) */
    ak_slot slot[AK_POOL_MAX];
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .idle = PTHREAD_COND_INITIALIZER};

/* ak_team_run's state: whether it runs on the OpenMP runtime's team (set from Python once
 * the runtime is known to be torch's own), and a call holding that team */
static int team_omp, team_busy;

static void pool_reset_in_child(void) {
    /* only the forking thread exists here; whatever the parent's threads held is gone */
    team_omp = 0, team_busy = 0; /* (the OpenMP runtime's team is not the child's to reuse) */
    memset(&P, 0, sizeof P);
    P.mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    P.idle = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    for (int i = 0; i < AK_POOL_MAX; ++i)
        P.slot[i].cond = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
}

/* at load time (dlopen), before any thread can hold the pool's mutex, so no fork can leave a
 * child with a mutex that a thread it lacks holds and no handler to reset it */
__attribute__((constructor)) static void pool_init(void) {
    for (int i = 0; i < AK_POOL_MAX; ++i)
        P.slot[i].cond = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    pthread_atfork(NULL, NULL, pool_reset_in_child);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Take and run indices of generation `gen` until none is left. Returns how many it ran. */
static int run_indices(ak_pool_fn fn, void *ctx, int n, uint64_t gen) {
    int ran = 0;
    uint64_t t = __atomic_load_n(&P.ticket, __ATOMIC_ACQUIRE);
    for (;;) {
        if (t >> 16 != gen || (int)(t & 0xFFFF) >= n) return ran;
        if (!__atomic_compare_exchange_n(&P.ticket, &t, t + 1, 1, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue; /* t now holds the current ticket */
        fn(ctx, (int)(t & 0xFFFF), n);
        ++ran;
        if (__atomic_add_fetch(&P.done, 1, __ATOMIC_ACQ_REL) == n) {
            /* the last index: wake the caller if it sleeps (a late signal is harmless) */
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.idle);
            pthread_mutex_unlock(&P.mu);
            return ran;
        }
        t = __atomic_load_n(&P.ticket, __ATOMIC_ACQUIRE);
    }
}

static void *pool_thread(void *arg) {
    ak_slot *s = (ak_slot *)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&P.mu);
    for (;;) {
        while (s->go == seen) pthread_cond_wait(&s->cond, &P.mu);
        seen = s->go;
        if (seen != P.gen) continue; /* asked for a call that has moved on: nothing to do */
        const ak_pool_fn fn = P.fn;
        void *const ctx = P.ctx;
        const int n = P.n;
        pthread_mutex_unlock(&P.mu);
        run_indices(fn, ctx, n, seen);
        pthread_mutex_lock(&P.mu);
    }
    return NULL;
}

/* Start pool threads until `want` exist (or one fails to start); under P.mu. */
static void grow(int want) {
    if (P.nthreads >= want) return;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* pool threads take no signals */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (P.nthreads < want) {
        ak_slot *s = &P.slot[P.nthreads + 1];
        s->go = 0;
        pthread_t th;
        if (pthread_create(&th, &attr, pool_thread, s) != 0) break;
        ++P.nthreads;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void run_alone(ak_pool_fn fn, void *ctx, int n) {
    for (int w = 0; w < n; ++w) fn(ctx, w, n);
}

void ak_pool_run(ak_pool_fn fn, void *ctx, int n) {
    if (n > AK_POOL_MAX) n = AK_POOL_MAX;
    __atomic_add_fetch(&P.calls, 1, __ATOMIC_RELAXED);
    if (n <= 1) {
        __atomic_store_n(&P.last_threads, 1, __ATOMIC_RELAXED);
        fn(ctx, 0, 1);
        return;
    }
    if (__atomic_exchange_n(&P.busy, 1, __ATOMIC_ACQUIRE)) {
        __atomic_add_fetch(&P.busy_runs, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&P.last_threads, 1, __ATOMIC_RELAXED);
        run_alone(fn, ctx, n);
        return;
    }
    pthread_mutex_lock(&P.mu);
    grow(n - 1);
    const int helpers = P.nthreads < n - 1 ? P.nthreads : n - 1;
    __atomic_store_n(&P.last_threads, 1 + helpers, __ATOMIC_RELAXED); /* the caller + woken */
    if (helpers == 0) {
        pthread_mutex_unlock(&P.mu);
        __atomic_store_n(&P.busy, 0, __ATOMIC_RELEASE);
        run_alone(fn, ctx, n);
        return;
    }
    const uint64_t gen = ++P.gen;
    P.fn = fn;
    P.ctx = ctx;
    P.n = n;
    __atomic_store_n(&P.done, 1, __ATOMIC_RELAXED); /* index 0, counted as the caller's */
    __atomic_store_n(&P.ticket, gen << 16 | 1, __ATOMIC_RELEASE);
    for (int i = 1; i <= helpers; ++i) P.slot[i].go = gen;
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i <= helpers; ++i) pthread_cond_signal(&P.slot[i].cond);
    __atomic_add_fetch(&P.parallel_runs, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&P.woken, helpers, __ATOMIC_RELAXED);

    fn(ctx, 0, n);
    /* P.done started at 1 for index 0, so the helpers' last index is the one that reaches n;
     * the caller's own indices below count the same way */
    const int extra = run_indices(fn, ctx, n, gen);
    if (extra) __atomic_add_fetch(&P.caller_extra, extra, __ATOMIC_RELAXED);
    for (int i = 0; i < AK_POOL_SPIN && __atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < n; ++i)
        cpu_relax();
    if (__atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < n) {
        pthread_mutex_lock(&P.mu);
        while (__atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < n) pthread_cond_wait(&P.idle, &P.mu);
        pthread_mutex_unlock(&P.mu);
    }
    __atomic_store_n(&P.busy, 0, __ATOMIC_RELEASE);
}

/* ak_team_run on the OpenMP runtime (when compiled with it): torch's own threads, which
 * torch's operators have just used and which spin a while after each of them, so the call's
 * workers start at once; a pool thread woken then has to wait for the core such a spinning
 * thread holds, and a short call ran on the caller alone. One call uses the team at a time
 * (another caller meanwhile runs alone, as with the pool); a team smaller than n runs the
 * indices left over on its threads in turn, so every index still runs exactly once. */
/*
 * A busy machine. The team's end waits for every one of its threads, and a thread that spun
 * after torch's last operator has used its share of a contended core: the scheduler may keep
 * it off the core for milliseconds, and the whole call waits (a 1 ms call became 3-5 ms). A
 * pool thread instead sleeps until woken, and the pool's caller never waits for one that has
 * not started. So a team thread that starts more than team_late_ns (1 ms) after its call began
 * marks the machine busy: the calls of the next team_hold_ns (200 ms) run on the pool, then the
 * team is tried again. On a quiet machine team threads start within microseconds (a thread
 * woken from sleep in a VM, a few hundred) and nothing changes; 300 us sent a few of a quiet
 * run's calls to the pool, which is slower there. */
#if defined(_OPENMP)
#include <omp.h>
#include <time.h>

#ifndef AK_TEAM_LATE_NS
#define AK_TEAM_LATE_NS 1000000 /* a team thread this late to its call: the machine is busy */
#endif
#ifndef AK_TEAM_HOLD_NS
#define AK_TEAM_HOLD_NS 200000000 /* the pool's turn after that */
#endif
static int64_t team_late_ns = AK_TEAM_LATE_NS, team_hold_ns = AK_TEAM_HOLD_NS;
static int64_t team_pool_until, team_late_calls, team_held_calls; /* atomic */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* For tests and tuning: a team thread later than late_ns (< 0: every call) marks the machine
 * busy for hold_ns; both < 0 restore the defaults. Ends any hold in force. */
void attnkit_team_tune(int64_t late_ns, int64_t hold_ns) {
    const int dflt = late_ns < 0 && hold_ns < 0;
    __atomic_store_n(&team_late_ns, dflt ? AK_TEAM_LATE_NS : late_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&team_hold_ns, dflt ? AK_TEAM_HOLD_NS : hold_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&team_pool_until, 0, __ATOMIC_RELAXED);
}

int attnkit_team_openmp(int on) {
    __atomic_store_n(&team_omp, on != 0, __ATOMIC_RELAXED);
    return 1;
}
#else
static int64_t team_late_calls, team_held_calls;
void attnkit_team_tune(int64_t late_ns, int64_t hold_ns) { (void)late_ns, (void)hold_ns; }
int attnkit_team_openmp(int on) {
    (void)on;
    return 0; /* built without OpenMP: the pool always */
}
#endif

void ak_team_run(ak_pool_fn fn, void *ctx, int n) {
#if defined(_OPENMP)
    if (n > AK_POOL_MAX) n = AK_POOL_MAX;
    if (n > 1 && __atomic_load_n(&team_omp, __ATOMIC_RELAXED)) {
        const int64_t t0 = now_ns();
        if (t0 < __atomic_load_n(&team_pool_until, __ATOMIC_RELAXED)) {
            __atomic_add_fetch(&team_held_calls, 1, __ATOMIC_RELAXED);
        } else if (!__atomic_exchange_n(&team_busy, 1, __ATOMIC_ACQUIRE)) {
            int team = 1, late = 0;
            const int64_t late_ns = __atomic_load_n(&team_late_ns, __ATOMIC_RELAXED);
            __atomic_add_fetch(&P.calls, 1, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(n)
            {
                const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
                if (tid == 0) team = nt;
                else if (now_ns() - t0 > late_ns) __atomic_store_n(&late, 1, __ATOMIC_RELAXED);
                for (int w = tid; w < n; w += nt) fn(ctx, w, n);
            }
            if (late) {
                __atomic_add_fetch(&team_late_calls, 1, __ATOMIC_RELAXED);
                __atomic_store_n(&team_pool_until,
                                 now_ns() + __atomic_load_n(&team_hold_ns, __ATOMIC_RELAXED),
                                 __ATOMIC_RELAXED);
            }
            __atomic_add_fetch(&P.parallel_runs, team > 1, __ATOMIC_RELAXED);
            __atomic_store_n(&P.last_threads, team, __ATOMIC_RELAXED);
            __atomic_store_n(&team_busy, 0, __ATOMIC_RELEASE);
            return;
        }
    }
#endif
    ak_pool_run(fn, ctx, n);
}

/* The pool's counters, for tests and tuning (out[0 .. 9)): pool threads started
 * in this process, kernel calls (every ak_pool_run and ak_team_run), calls that used the pool
 * or the team, calls that ran alone because another call held it, pool threads woken (all
 * calls together), indices the caller ran beyond its own index 0 (no pool thread had taken
 * them yet), the threads the latest call ran on, the caller included (1 for a call on the
 * caller alone), team calls that found a thread late (the machine busy) and calls that ran on
 * the pool instead of the team because of it. */
void attnkit_pool_stats(int64_t *out) {
    pthread_mutex_lock(&P.mu);
    out[0] = P.nthreads;
    pthread_mutex_unlock(&P.mu);
    out[1] = __atomic_load_n(&P.calls, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&P.parallel_runs, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&P.busy_runs, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&P.woken, __ATOMIC_RELAXED);
    out[5] = __atomic_load_n(&P.caller_extra, __ATOMIC_RELAXED);
    out[6] = __atomic_load_n(&P.last_threads, __ATOMIC_RELAXED);
    out[7] = __atomic_load_n(&team_late_calls, __ATOMIC_RELAXED);
    out[8] = __atomic_load_n(&team_held_calls, __ATOMIC_RELAXED);
}

/* Self-check of the pool's contract, for tests: `calls` calls of ak_pool_run on n workers,
 * each index spinning for `spin` iterations before it counts itself. Returns how many calls
 * broke the contract: an index that did not run exactly once, or had not finished, by the
 * time ak_pool_run returned, or that ran again after it (each call's counts are read once
 * more after the next call). -AK_NO_MEMORY when the counts cannot be allocated. */
typedef struct {
    int hits[AK_POOL_MAX];
    int64_t spin;
} ak_check_job;

static void check_worker(void *arg, int worker, int nworkers) {
    ak_check_job *job = (ak_check_job *)arg;
    volatile int64_t s = 0;
    (void)nworkers;
    for (int64_t i = 0; i < job->spin; ++i) s += i;
    __atomic_add_fetch(&job->hits[worker], 1, __ATOMIC_RELAXED);
}

int64_t attnkit_pool_check(int64_t calls, int n, int64_t spin) {
    if (n < 1) n = 1;
    if (n > AK_POOL_MAX) n = AK_POOL_MAX;
    ak_check_job *jobs = (ak_check_job *)calloc(2, sizeof(ak_check_job));
    if (!jobs) return -(int64_t)AK_NO_MEMORY;
    int64_t bad = 0;
    for (int64_t c = 0; c < calls; ++c) {
        ak_check_job *job = &jobs[c % 2], *prev = &jobs[(c + 1) % 2];
        memset(job->hits, 0, sizeof job->hits);
        job->spin = spin;
        ak_pool_run(check_worker, job, n);
        int ok = 1;
        for (int w = 0; w < AK_POOL_MAX; ++w)
            ok &= __atomic_load_n(&job->hits[w], __ATOMIC_RELAXED) == (w < n);
        if (c > 0)
            for (int w = 0; w < AK_POOL_MAX; ++w)
                ok &= __atomic_load_n(&prev->hits[w], __ATOMIC_RELAXED) == (w < n);
        bad += !ok;
    }
    free(jobs);
    return bad;
}
