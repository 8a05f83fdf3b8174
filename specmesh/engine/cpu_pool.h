/* A small persistent thread pool for the C kernels (int4_kernel.c, attention_kernel.c), included by each: every
   kernel library gets its own pool (one worker a core beyond the caller's), started on first use.

   `pool_run(threads, num_chunks, fn, ctx)` calls fn(ctx, chunk, thread) once for every chunk in [0, num_chunks) and
   returns when all are done; `thread` is in [0, threads), the caller being 0, so a job can index per-thread scratch.
   Threads claim chunks one at a time from a shared cursor, the caller included: a thread that loses its core (to the
   draft model or the gateway on a shared host) holds up at most the chunk it is on, not a fixed share of every
   layer. Workers spin briefly for the next job (the next layer's call usually follows within tens of microseconds),
   then sleep on a condition variable. One caller at a time: a second concurrent caller runs its chunks on its own
   thread (as thread 0). How a job is cut into chunks is the kernel's business: every kernel here computes each
   output the same way whichever thread runs it, so the numbers never depend on the split.

   The cursor packs (job generation << 32 | next chunk). A chunk is claimed by a compare-and-swap of the cursor, so a
   worker that wakes late (its job already done, maybe the next one posted) claims nothing of a job it has not read:
   the swap fails once the generation moved on. Jobs alternate between two slots; slot g % 2 is rewritten only for
   job g + 2, which is posted after every chunk of job g has been done, so a claimed chunk's slot stays intact.

   Workers keep off the caller's core. The caller posts its core with each job; a worker that finds itself on it
   narrows its own affinity to the process's other cores (and widens it back to all but the caller's new core when
   the caller moves). Without that the kernel left both on one core for tens of milliseconds: on a 2-core host, once
   another task (kdamond) took the worker's core, the worker was moved to the caller's core while the caller slept,
   the caller woke beside it, and the two shared that core for 40 ms with the other one idle, until the periodic
   load balancer split them (a sched_switch trace of bench.stall: a decode step beside a long prompt 106 ms against
   its 86 ms bound, the longest gap of the stream). Only the worker's own affinity changes, only when it stacks. */

#ifndef SPECMESH_CPU_POOL_H
#define SPECMESH_CPU_POOL_H

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define POOL_MAX_THREADS 64
#define POOL_SPIN_ITERS 20000         /* ~0.1-1 ms of pause instructions before sleeping */
#define POOL_YIELD_EVERY_SPINS 256    /* a waiting worker's pauses between yields of its core */
#define POOL_YIELD_AFTER_SPINS 2000   /* the caller's pauses waiting for the last chunks before it yields its core */

typedef void (*pool_chunk_fn)(void *ctx, int64_t chunk, int thread);

typedef struct {
    pool_chunk_fn fn; void *ctx; int64_t num_chunks; int threads;
} pool_job_t;

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;      /* held by the caller driving the pool */
static pthread_mutex_t pool_wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pool_job_t pool_jobs[2];
static atomic_ullong pool_generation;     /* the latest job posted; workers wake when it changes */
static atomic_ullong pool_cursor;         /* (generation << 32) | next unclaimed chunk of that job */
static atomic_llong pool_chunks_done;     /* chunks of the current job finished */
static int pool_num_workers;     /* started so far; each serves every job with index < the job's thread count */
static atomic_int pool_caller_cpu = -1;   /* the core the caller ran on when it posted the current job */
static cpu_set_t pool_cpus;               /* the process's cores when the first worker started */

/* A worker on the caller's core moves to the process's other cores (see above); a no-op where there is no other. */
static void pool_keep_off_caller_core(void) {
    const int caller = atomic_load_explicit(&pool_caller_cpu, memory_order_relaxed);
    if (caller < 0 || sched_getcpu() != caller || CPU_COUNT(&pool_cpus) < 2 || !CPU_ISSET(caller, &pool_cpus))
        return;
    cpu_set_t others = pool_cpus;
    CPU_CLR(caller, &others);
    sched_setaffinity(0, sizeof others, &others);
}
static unsigned long long pool_start_generation[POOL_MAX_THREADS];   /* the generation before a worker's first job */

/* Claims and runs chunks of job `gen` until none is left or a newer job replaced it. */
static void pool_run_chunks(unsigned long long gen, int thread) {
    for (;;) {
        unsigned long long c = atomic_load_explicit(&pool_cursor, memory_order_acquire);
        if (c >> 32 != (gen & 0xFFFFFFFFull)) return;
        const pool_job_t *j = &pool_jobs[gen & 1];
        const int64_t chunk = (int64_t)(c & 0xFFFFFFFFull);
        if (chunk >= j->num_chunks) return;     /* read before the claim; the swap below fails if j was replaced */
        if (!atomic_compare_exchange_weak_explicit(&pool_cursor, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        j->fn(j->ctx, chunk, thread);
        atomic_fetch_add_explicit(&pool_chunks_done, 1, memory_order_acq_rel);
    }
}

#define POOL_WORKER_NAME "specmesh-kernel"   /* /proc/<pid>/task/<tid>/comm: how the engine finds its workers */

static void *pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg;           /* 1 .. pool_num_workers; the caller is 0 */
    unsigned long long seen = pool_start_generation[index];
    for (;;) {
        unsigned long long now;
        int spins = 0;
        while ((now = atomic_load_explicit(&pool_generation, memory_order_acquire)) == seen
               && spins < POOL_SPIN_ITERS) {
            if (++spins % POOL_YIELD_EVERY_SPINS) _mm_pause();
            else sched_yield();      /* a thread that shares this core (the caller, the draft model) runs first */
        }
        if (now == seen) {
            pthread_mutex_lock(&pool_wake_lock);
            while ((now = atomic_load_explicit(&pool_generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool_wake, &pool_wake_lock);
            pthread_mutex_unlock(&pool_wake_lock);
        }
        seen = now;
        if (index < pool_jobs[now & 1].threads) {   /* a stale read only skips a job or tries a claim that fails */
            pool_keep_off_caller_core();
            pool_run_chunks(now, index);
        }
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start afresh. */
static void pool_reset_after_fork(void) {
    pool_num_workers = 0;
    pthread_mutex_init(&pool_busy, NULL);
    pthread_mutex_init(&pool_wake_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
}

static pthread_once_t pool_fork_handler_once = PTHREAD_ONCE_INIT;
static void pool_install_fork_handler(void) { pthread_atfork(NULL, NULL, pool_reset_after_fork); }

/* fn(ctx, chunk, thread) for every chunk in [0, num_chunks) on up to `threads` threads (the caller included), on
   this library's own workers. */
static void pool_run_own(int threads, int64_t num_chunks, pool_chunk_fn fn, void *ctx) {
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    pthread_once(&pool_fork_handler_once, pool_install_fork_handler);
    if (threads <= 1 || num_chunks <= 1 || pthread_mutex_trylock(&pool_busy) != 0) {
        for (int64_t chunk = 0; chunk < num_chunks; chunk++) fn(ctx, chunk, 0);
        return;
    }
    if (pool_num_workers == 0 && sched_getaffinity(0, sizeof pool_cpus, &pool_cpus) != 0) CPU_ZERO(&pool_cpus);
    while (pool_num_workers < threads - 1) {
        pthread_t t;
        pool_start_generation[pool_num_workers + 1] = atomic_load(&pool_generation);
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)(pool_num_workers + 1)) != 0) break;
        pthread_setname_np(t, POOL_WORKER_NAME);     /* named before it may run (it may not, before the job ends) */
        pthread_detach(t);
        pool_num_workers++;
    }
    if (threads > pool_num_workers + 1) threads = pool_num_workers + 1;
    /* the previous job is done: no thread holds a chunk of it, and none can claim one of this job before the
       cursor below is published */
    const unsigned long long gen = atomic_load_explicit(&pool_generation, memory_order_relaxed) + 1;
    pool_jobs[gen & 1] = (pool_job_t){fn, ctx, num_chunks, threads};
    atomic_store_explicit(&pool_caller_cpu, sched_getcpu(), memory_order_relaxed);
    atomic_store_explicit(&pool_chunks_done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool_cursor, (gen & 0xFFFFFFFFull) << 32, memory_order_release);
    pthread_mutex_lock(&pool_wake_lock);
    atomic_store_explicit(&pool_generation, gen, memory_order_release);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_wake_lock);
    pool_run_chunks(gen, 0);
    /* the chunks still running on other threads; yield the core after a while, in case the thread running the last
       one waits for it */
    for (int spins = 0; atomic_load_explicit(&pool_chunks_done, memory_order_acquire) < num_chunks; spins++) {
        if (spins < POOL_YIELD_AFTER_SPINS) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool_busy);
}

/* One pool for every kernel library of a process. Each library that includes this header has its own workers, and a
   forward alternates between libraries (an int4 matmul, then attention, then the next matmul): with a pool each,
   every core beyond the caller's held one worker per library, the idle one spinning while the other library's
   job ran (on a 2-core host the attention pool's worker took ~3 ms of CPU a decoded token from the matmul's two
   threads). The loader (cpu_build.py) points every library at the first one's pool: `sm_use_pool(that library's
   sm_pool_run)`; NULL goes back to the library's own. */
typedef void (*pool_run_fn)(int threads, int64_t num_chunks, pool_chunk_fn fn, void *ctx);
static pool_run_fn pool_shared;

void sm_use_pool(pool_run_fn run) { __atomic_store_n(&pool_shared, run, __ATOMIC_RELEASE); }

void sm_pool_run(int threads, int64_t num_chunks, pool_chunk_fn fn, void *ctx) {
    pool_run_own(threads, num_chunks, fn, ctx);
}

/* fn(ctx, chunk, thread) for every chunk in [0, num_chunks) on up to `threads` threads: on the shared pool where the
   loader gave one, else on this library's own. */
static void pool_run(int threads, int64_t num_chunks, pool_chunk_fn fn, void *ctx) {
    const pool_run_fn shared = __atomic_load_n(&pool_shared, __ATOMIC_ACQUIRE);
    if (shared) shared(threads, num_chunks, fn, ctx);
    else pool_run_own(threads, num_chunks, fn, ctx);
}

#endif
