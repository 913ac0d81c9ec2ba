/* The threads of slotserve_qmatmul_q8_x (q8call.h): a process-wide pool of helper threads that
 * claim chunks of a call's rows from a shared counter, with the calling thread claiming them
 * too, so that a helper which is slow to start (asleep, or descheduled on a busy machine)
 * costs the caller nothing: the caller runs every chunk the helper has not claimed, and at the
 * end takes back a helper that never started instead of waiting for it. It waits only for a
 * chunk a helper is running (chunks are small: a few per thread and weight).
 *
 * Why not OpenMP's team: its end-of-region barrier waits for every member whether or not it
 * has work, and spins meanwhile, so on a shared machine one descheduled member stalls the
 * caller for a time slice (measured: splitting any product smaller than the 262k-row output
 * projection cost more than it saved). Here a helper spins briefly for the next job (the next
 * product follows in microseconds during a step), then sleeps on a futex.
 *
 * A helper's `state`: IDLE -> POSTED (the caller gave it a job) -> RUNNING (it took the job)
 * -> IDLE (done); or POSTED -> IDLE when the caller takes the job back before it started.
 *
 * The caller waits for a running chunk by spinning briefly, then sleeping on the helper's
 * state (the helper wakes it when done). Why not spin on (or sched_yield): when another
 * process takes the helper's core, the helper sits preempted in that core's run queue, and a
 * caller spinning on the other core keeps that core busy, so the scheduler never moves the
 * helper onto it; the caller then waits out the other process's time slice (measured on a
 * shared 2-core machine: the helper ran a third of the chunks instead of half). A sleeping
 * caller leaves its core idle, and an idle core pulls the waiting helper at once.
 *
 * Each participant gets a slot (0 the caller, i + 1 helper i), so a job can give each one
 * its own scratch whatever chunks it runs.
 * A forked child starts helpers of its own (threads do not survive fork), and a call that
 * finds the pool in use by another thread runs alone. Included by q8call.h only. */
#ifndef SLOTSERVE_Q8POOL_H
#define SLOTSERVE_Q8POOL_H
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define POOL_MAX_HELPERS 15
/* Pause loops a helper polls for the next job before sleeping: ~25 us on an AMD EPYC (a pause
   ~25 ns), longer than the caller's work between a step's jobs (a layer's RoPE + K/V write at
   32 rows ~15 us; the rest is split). Why not longer: whatever a helper spins is taken from
   the caller (or another process) when the cores are shared; 4000 (~100 us) cost a 2-thread
   step of Gemma 3 270M 6-14 ms of CPU over one thread's at batch 32, 1000 cost 4-6. */
#define POOL_SPIN 1000
#define POOL_WAIT_SPIN 2000  /* pause loops the caller polls a running chunk before sleeping */
enum { POOL_IDLE = 0, POOL_POSTED = 1, POOL_RUNNING = 2 };

typedef struct pool_job pool_job;
struct pool_job {
    void (*run)(const pool_job*, int64_t chunk, int slot);  /* slot: see above */
    int64_t chunks;
    _Atomic int64_t next;  /* the next chunk to claim */
    const void* arg;
};

typedef struct {
    _Atomic int state;
    _Atomic int sleeping;
    _Atomic int waited;  /* the caller sleeps on `state` until the running job is done */
    pool_job* job;
    pthread_t thread;
} pool_helper;

static pool_helper pool_helpers[POOL_MAX_HELPERS];
static int pool_started = 0;  /* helpers running in this process (guarded by pool_busy) */
static _Atomic int pool_busy = 0;

/* A forked child has none of the helper threads (and no call in flight). */
static void pool_after_fork(void) {
    pool_started = 0;
    atomic_store(&pool_busy, 0);
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void pool_sleep(_Atomic int* word, int value) {
#ifdef __linux__
    syscall(SYS_futex, (int*)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word; (void)value;
    sched_yield();
#endif
}

static void pool_wake(_Atomic int* word) {
#ifdef __linux__
    syscall(SYS_futex, (int*)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
    (void)word;
#endif
}

static void pool_run_chunks(pool_job* job, int slot) {
    int64_t c;
    while ((c = atomic_fetch_add(&job->next, 1)) < job->chunks) job->run(job, c, slot);
}

static void* pool_helper_main(void* p) {
    pool_helper* h = (pool_helper*)p;
    for (;;) {
        int spins = 0;
        while (atomic_load(&h->state) != POOL_POSTED) {
            if (++spins < POOL_SPIN) {
                pool_pause();
                continue;
            }
            atomic_store(&h->sleeping, 1);
            if (atomic_load(&h->state) == POOL_IDLE) pool_sleep(&h->state, POOL_IDLE);
            atomic_store(&h->sleeping, 0);
        }
        int expect = POOL_POSTED;
        if (!atomic_compare_exchange_strong(&h->state, &expect, POOL_RUNNING))
            continue;  /* the caller took the job back */
        pool_run_chunks(h->job, (int)(h - pool_helpers) + 1);
        atomic_store(&h->state, POOL_IDLE);
        if (atomic_load(&h->waited)) pool_wake(&h->state);
    }
    return NULL;
}

/* Helpers 0..want-1 started in this process (the caller holds pool_busy); how many are
   (fewer when a thread cannot start). */
static int pool_ensure(int want) {
    while (pool_started < want) {
        pool_helper* h = &pool_helpers[pool_started];
        atomic_store(&h->state, POOL_IDLE);
        atomic_store(&h->sleeping, 0);
        atomic_store(&h->waited, 0);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&h->thread, &attr, pool_helper_main, h);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool_started++;
    }
    return pool_started < want ? pool_started : want;
}

/* Runs every chunk of `job` on the calling thread and up to threads - 1 helpers. */
static void pool_run(pool_job* job, int threads) {
    int helpers = threads - 1 > POOL_MAX_HELPERS ? POOL_MAX_HELPERS : threads - 1;
    int claimed = 0;
    if (helpers > 0 && job->chunks > 1) {
        int expect = 0;
        claimed = atomic_compare_exchange_strong(&pool_busy, &expect, 1);
    }
    helpers = claimed ? pool_ensure(helpers) : 0;
    for (int i = 0; i < helpers; i++) {
        pool_helper* h = &pool_helpers[i];
        h->job = job;
        atomic_store(&h->state, POOL_POSTED);
        if (atomic_load(&h->sleeping)) pool_wake(&h->state);
    }
    pool_run_chunks(job, 0);
    for (int i = 0; i < helpers; i++) {
        pool_helper* h = &pool_helpers[i];
        int posted = POOL_POSTED;
        if (atomic_compare_exchange_strong(&h->state, &posted, POOL_IDLE)) continue;
        for (int spins = 0; spins < POOL_WAIT_SPIN && atomic_load(&h->state) != POOL_IDLE;
             spins++)
            pool_pause();
        while (atomic_load(&h->state) == POOL_RUNNING) {
            /* The helper reads `waited` after it stores IDLE, and the futex sleeps only while
               the state is still RUNNING: one of the two sees the other (both seq_cst). */
            atomic_store(&h->waited, 1);
            pool_sleep(&h->state, POOL_RUNNING);
            atomic_store(&h->waited, 0);
        }
    }
    if (claimed) atomic_store(&pool_busy, 0);
}

#endif
