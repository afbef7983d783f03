/*
 * comm_threads.c: the threads backend.  The ranks of a world are threads of one process;
 * a collective moves data by reading the peers' buffers directly, with no staging copy.
 * Each collective is four steps on every rank: arrive, agree, move, depart
 * (threads_collective).
 */
#include "comm.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum {
    MS_SPINS = 100,    /* busy polls before yielding, when every rank has a CPU */
    MS_YIELDS = 50,    /* sched_yield polls before sleeping */
    MS_SLICE_MS = 5,   /* longest sleep between checks of the deadline and of done ranks */
};

/* ---------------------------------------------------------------- group state */

typedef struct slot {
    _Alignas(64) ms_coll call;          /* posted by its rank when arriving; peers read it until departure */
    atomic_llong arrivals; /* calls this rank has arrived at */
    const void **srcs;     /* (n) this rank's scratch: reduction sources */
    void **dsts;           /* (n) this rank's scratch: reduction destinations */
} slot;

/* Set in tgroup.arrived when the group is poisoned: the counter then compares >= every
 * target, so a waiter stops, and the bit tells it why.  The arrival and departure counters
 * only grow: the k-th call (from 0) is complete when a counter reaches n * (k + 1).
 * Arriving and poisoning are both compare-and-swaps on the arrival counter: an arrival
 * fails once the poison bit is set, and poisoning succeeds only while the arrival is
 * incomplete, so a call either completes or is poisoned, never both. */
#define MS_POISONED (1LL << 62)

typedef struct tgroup {
    pthread_mutex_t lock;     /* the sleep/wake handshake and the poison message */
    pthread_cond_t wake;      /* broadcast when a counter moves or the group is poisoned */
    int spins;                /* MS_SPINS, or 0 when the group has more ranks than CPUs */
    atomic_int sleepers;      /* ranks blocked on wake */
    _Alignas(64) atomic_llong arrived;  /* arrivals of all ranks over all calls, | MS_POISONED */
    _Alignas(64) atomic_llong departed; /* departures of all ranks over all calls */
    ms_status poison_status;  /* under lock; written before MS_POISONED is set, never after */
    char poison_msg[1024];    /* likewise */
    slot *slots;              /* (n) indexed by group rank */
} tgroup;

static void threads_group_free(ms_group *g) {
    tgroup *t = g->impl;
    for (int i = 0; t->slots && i < g->n; i++) {
        free(t->slots[i].srcs);
        free(t->slots[i].dsts);
    }
    free(t->slots);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
    free(t);
    g->impl = NULL;
}

/* Zeroed memory on its own cache lines (the counters and slots are aligned to 64 bytes so
 * that ranks spinning on one do not share a line with another). */
static void *zalloc64(size_t bytes) {
    void *p = aligned_alloc(64, bytes); /* the sizes are multiples of 64 */
    if (p) memset(p, 0, bytes);
    return p;
}

static ms_status threads_group_init(ms_world *w, ms_group *g) {
    (void)w;
    tgroup *t = zalloc64(sizeof *t);
    if (!t) return ms__fail(MS_ERR_OOM, "threads backend: out of memory for a group of %d ranks", g->n);
    pthread_mutex_init(&t->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&t->wake, &attr);
    pthread_condattr_destroy(&attr);
    t->spins = g->n <= sysconf(_SC_NPROCESSORS_ONLN) ? MS_SPINS : 0; /* spinning starves a peer */
    atomic_init(&t->sleepers, 0);
    atomic_init(&t->arrived, 0);
    atomic_init(&t->departed, 0);
    g->impl = t;
    t->slots = zalloc64((size_t)g->n * sizeof *t->slots);
    bool ok = t->slots != NULL;
    for (int i = 0; ok && i < g->n; i++) {
        atomic_init(&t->slots[i].arrivals, 0);
        t->slots[i].srcs = malloc((size_t)g->n * sizeof *t->slots[i].srcs);
        t->slots[i].dsts = malloc((size_t)g->n * sizeof *t->slots[i].dsts);
        ok = t->slots[i].srcs && t->slots[i].dsts;
    }
    if (!ok) {
        threads_group_free(g);
        return ms__fail(MS_ERR_OOM, "threads backend: out of memory for a group of %d ranks", g->n);
    }
    return MS_OK;
}

/* ---------------------------------------------------------------- waiting */

/* Waiting spins briefly, yields, then sleeps on a condition variable in short slices (to
 * notice the deadline and ranks reported done); the lock only guards that sleep and the
 * poison message, so a call whose ranks arrive together never takes it. */

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* True once *counter >= target within a short spin-then-yield; false means: go to sleep. */
static bool spin_until(const tgroup *t, atomic_llong *counter, long long target) {
    for (int i = 0; i < t->spins; i++) {
        if (atomic_load(counter) >= target) return true;
        cpu_relax();
    }
    for (int i = 0; i < MS_YIELDS; i++) {
        if (atomic_load(counter) >= target) return true;
        sched_yield();
    }
    return false;
}

/* Sleeps on t->wake (lock held) until woken or `until` (monotonic seconds), unless *counter
 * reached target meanwhile.  The sleeper counts itself before it reads the counter and a
 * waker moves the counter before it reads the sleepers (all seq_cst), so one of the two
 * sees the other: no wake-up is lost. */
static void sleep_until(tgroup *t, atomic_llong *counter, long long target, double until) {
    struct timespec ts;
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    atomic_fetch_add(&t->sleepers, 1);
    if (atomic_load(counter) < target) pthread_cond_timedwait(&t->wake, &t->lock, &ts);
    atomic_fetch_sub(&t->sleepers, 1);
}

/* After moving a counter: wakes the sleepers, if any. */
static void wake_sleepers(tgroup *t) {
    if (atomic_load(&t->sleepers) == 0) return;
    pthread_mutex_lock(&t->lock);
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->lock);
}

/* The poison as this rank's error.  Every rank that joins the failed call gets it, whether
 * it was waiting when the group was poisoned or arrived afterwards. */
static ms_status poisoned_error(tgroup *t) {
    pthread_mutex_lock(&t->lock);
    ms_status st = ms__fail(t->poison_status, "%s", t->poison_msg);
    pthread_mutex_unlock(&t->lock);
    return st;
}

/* Tries to poison the group in the k-th call (lock held): names the ranks that have not
 * arrived, as done (MS_ERR_PEER) when ms_world_rank_done reported any of them, else as late
 * (MS_ERR_TIMEOUT, only once `timed_out`).  Does nothing when there is no reason yet or when
 * the arrival completed meanwhile. */
static void try_poison(const ms_comm *c, tgroup *t, const ms_coll *call, long long k, bool timed_out) {
    const ms_world *w = c->world;
    const ms_group *g = c->group;
    ms_msg m = {0}, missing = {0}, done = {0};
    int nmissing = 0;
    for (int j = 0; j < g->n; j++) {
        if (atomic_load(&t->slots[j].arrivals) > k) continue;
        int wr = g->world_ranks[j];
        nmissing++;
        ms__msg_add(&missing, " %d", wr);
        int state = atomic_load(&w->rank_state[wr]);
        if (state == MS_RANK_FINISHED)
            ms__msg_add(&done, "%srank %d finished its script without joining %s", done.len ? "; " : "", wr,
                    ms__coll_name(call->kind));
        else if (state == MS_RANK_FAILED)
            ms__msg_add(&done, "%srank %d failed", done.len ? "; " : "", wr);
    }
    ms__msg_where(&m, c, call->kind);
    if (done.len) {
        ms__msg_add(&m, ": %s", done.s);
        t->poison_status = MS_ERR_PEER;
    } else if (timed_out) {
        ms__msg_add(&m, " timed out after %g s: rank%s%s did not arrive (%s)", w->timeout_s, nmissing > 1 ? "s" : "",
                missing.s, w->timeout_origin);
        t->poison_status = MS_ERR_TIMEOUT;
    } else {
        return;
    }
    snprintf(t->poison_msg, sizeof t->poison_msg, "%s", m.s);
    long long v = atomic_load(&t->arrived);
    if (v < (long long)g->n * (k + 1) && atomic_compare_exchange_strong(&t->arrived, &v, v | MS_POISONED))
        pthread_cond_broadcast(&t->wake);
}

/* Posts call (pointers and arguments) into this rank's slot as its k-th, counts itself in,
 * and waits until every member has posted its k-th.  If the world's timeout passes first,
 * or a missing rank was reported done (ms_world_rank_done), the waiting rank poisons the
 * group (try_poison): every rank that joins this call, waiting or late, fails with the same
 * status and message (comm.c then refuses its later calls with MS_ERR_STATE). */
static ms_status arrive(ms_comm *c, tgroup *t, const ms_coll *call, long long k) {
    slot *me = &t->slots[c->rank];
    const long long target = (long long)c->group->n * (k + 1);
    const double deadline = ms__now_s() + c->world->timeout_s;

    me->call = *call;
    atomic_store(&me->arrivals, k + 1);
    long long v = atomic_load(&t->arrived);
    do {
        if (v & MS_POISONED) return poisoned_error(t);
    } while (!atomic_compare_exchange_weak(&t->arrived, &v, v + 1));
    wake_sleepers(t);

    if (!spin_until(t, &t->arrived, target)) {
        pthread_mutex_lock(&t->lock);
        while (atomic_load(&t->arrived) < target) {
            double now = ms__now_s(), slice = now + MS_SLICE_MS * 1e-3;
            try_poison(c, t, call, k, now >= deadline);
            sleep_until(t, &t->arrived, target, slice < deadline ? slice : deadline);
        }
        pthread_mutex_unlock(&t->lock);
    }
    return atomic_load(&t->arrived) & MS_POISONED ? poisoned_error(t) : MS_OK;
}

/* Counts this rank out of the k-th call and waits until every member is out, so no rank
 * returns (and reuses its buffers) while a peer may still read them.  Never fails: all
 * members arrived, so each one only has its bounded data movement left. */
static void depart(ms_comm *c, tgroup *t, long long k) {
    const long long target = (long long)c->group->n * (k + 1);
    atomic_fetch_add(&t->departed, 1);
    wake_sleepers(t);
    if (spin_until(t, &t->departed, target)) return;
    pthread_mutex_lock(&t->lock);
    while (atomic_load(&t->departed) < target) sleep_until(t, &t->departed, target, ms__now_s() + MS_SLICE_MS * 1e-3);
    pthread_mutex_unlock(&t->lock);
}

/* ---------------------------------------------------------------- agreement */

/* MS_ERR_MISMATCH unless all posted calls agree (the same message on every rank); then no
 * data is touched. */
static ms_status agree(const ms_comm *c, const tgroup *t) {
    return ms__calls_agree(c, &t->slots[0].call, sizeof t->slots[0]);
}

/* ---------------------------------------------------------------- data movement */

/* Reductions (ms__reduce, reduce.c, shared with the MPI backend) run in rank order 0..n-1,
 * accumulated in f32 for f32/f16/bf16/fp8 (rounded once per element at the end), f64 for
 * f64, and in the integer type itself, wrapping around, for integers.  bool reduces as u8:
 * max is logical or, min logical and. */

/* Elements [*off, *off + *len) of a count-element buffer that group rank r reduces in an
 * all_reduce: n near-equal chunks. */
static void all_reduce_chunk(int64_t count, int n, int r, int64_t *off, int64_t *len) {
    int64_t base = count / n, rem = count % n;
    *off = base * r + (r < rem ? r : rem);
    *len = base + (r < rem);
}

/* Rank r's part of the agreed call: reads the peers' posted buffers and writes only what it
 * owns: its own out, or (for all_reduce) its chunk of every rank's buffer. */
static void move(const ms_comm *c, const tgroup *t) {
    const int n = c->group->n, r = c->rank;
    const slot *s = t->slots;
    const ms_coll *me = &s[r].call;
    const size_t es = (size_t)ms_dtype_size(me->dtype);
    const void **srcs = s[r].srcs;
    void **dsts = s[r].dsts;
    if (me->count == 0) return;
    switch (me->kind) {
    case MS_COLL_ALL_GATHER: {
        size_t bytes = (size_t)me->count * es;
        for (int i = 0; i < n; i++) { /* start at r so the ranks read different peers */
            int j = (r + i) % n;
            char *dst = (char *)me->recv + (size_t)j * bytes;
            if (s[j].call.send != dst) memcpy(dst, s[j].call.send, bytes);
        }
        break;
    }
    case MS_COLL_REDUCE_SCATTER:
        for (int j = 0; j < n; j++) srcs[j] = (const char *)s[j].call.send + (size_t)r * (size_t)me->count * es;
        dsts[0] = me->recv;
        ms__reduce(me->dtype, me->op, n, srcs, dsts, 1, me->count);
        break;
    case MS_COLL_ALL_REDUCE: {
        int64_t off, len;
        all_reduce_chunk(me->count, n, r, &off, &len);
        for (int j = 0; j < n; j++) srcs[j] = dsts[j] = (char *)s[j].call.recv + (size_t)off * es;
        ms__reduce(me->dtype, me->op, n, srcs, dsts, n, len);
        break;
    }
    case MS_COLL_BROADCAST:
        if (r != me->root) memcpy(me->recv, s[me->root].call.send, (size_t)me->count * es);
        break;
    case MS_COLL_ALL_TO_ALL: {
        size_t chunk = (size_t)(me->count / n) * es;
        for (int i = 0; i < n; i++) {
            int j = (r + i) % n;
            memcpy((char *)me->recv + (size_t)j * chunk, (const char *)s[j].call.send + (size_t)r * chunk, chunk);
        }
        break;
    }
    case MS_COLL_BARRIER: break;
    }
}

/* ---------------------------------------------------------------- the backend */

/* One collective on a group of n ranks, seen from group rank r: arrive (post the call, wait
 * for all n), agree (compare the n calls), move (r's part of the data), depart (wait until
 * all n are done reading). */
static ms_status threads_collective(ms_comm *c, const ms_coll *call) {
    tgroup *t = c->group->impl;
    long long k = atomic_load(&t->slots[c->rank].arrivals); /* this rank's call index */
    ms_status st = arrive(c, t, call, k);
    if (st) return st;
    st = agree(c, t);
    if (!st) move(c, t);
    depart(c, t, k);
    return st;
}

static const ms_backend threads_backend = {
    .name = "threads",
    .device = MS_DEVICE_CPU,
    .group_init = threads_group_init,
    .group_free = threads_group_free,
    .collective = threads_collective,
};

ms_status ms_threads_world_new(ms_world **out, int nranks, double timeout_s) {
    MS_NOT_NULL(out);
    return ms__world_new(out, &threads_backend, nranks, timeout_s);
}
