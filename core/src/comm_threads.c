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
    struct tpair *_Atomic *pairs; /* (n) hash buckets of the pairs that sent or received */
} tgroup;

static void free_pairs(tgroup *t, int n);

static void threads_group_free(ms_group *g) {
    tgroup *t = g->impl;
    for (int i = 0; t->slots && i < g->n; i++) {
        free(t->slots[i].srcs);
        free(t->slots[i].dsts);
    }
    free(t->slots);
    free_pairs(t, g->n);
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
    t->pairs = malloc((size_t)g->n * sizeof *t->pairs);
    bool ok = t->slots && t->pairs;
    for (int i = 0; t->pairs && i < g->n; i++) atomic_init(&t->pairs[i], NULL);
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

/* ---------------------------------------------------------------- point-to-point
 *
 * Each pair of ranks {a < b} of a group meets on its own, as a collective of two: the k-th
 * batch of a naming b with the k-th batch of b naming a (comm.h).  A rank posts its ops with
 * the peer on its side of the pair and arrives (the pair's counter, poisoned as the group's
 * is in arrive); once both have arrived each compares the two sides (ms__p2p_agree: the
 * same verdict on both), copies what it receives straight from the peer's sent tensors,
 * and departs; it returns only when the peer has departed too, so no sent tensor is reused
 * while read.  A batch posts all its pairs first, then serves whichever pair is complete,
 * so its ops run in any order without deadlock and one slow peer does not hold up the
 * others. */

typedef struct tside {
    const ms_p2p_desc *descs; /* this side's ops with the peer, for the exchange in progress */
    void *const *data;
    int count;
    long long seq; /* exchanges with the peer so far: touched by its own rank only */
} tside;

typedef struct tpair {
    _Alignas(64) atomic_llong arrived; /* both sides' arrivals over all exchanges, | MS_POISONED */
    atomic_llong departed;
    tside side[2];           /* [0]: the lower group rank's */
    ms_status poison_status; /* under the group's lock, written before MS_POISONED is set */
    char *poison_msg;        /* likewise (malloc'ed) */
    int lo, hi;              /* the group ranks, lo < hi */
    struct tpair *next;      /* in its bucket: set before the pair is published, never changed */
} tpair;

static void free_pairs(tgroup *t, int n) {
    for (int i = 0; t->pairs && i < n; i++)
        for (tpair *p = atomic_load(&t->pairs[i]), *next; p; p = next) {
            next = p->next;
            free(p->poison_msg);
            free(p);
        }
    free(t->pairs);
}

/* The pair {lo < hi} of the group, made when first asked for: the buckets are read without
 * the lock (a pair is published whole and never unlinked), and filled under it, so memory
 * grows with the pairs that met, not with the square of the group's size. */
static ms_status get_pair(const ms_comm *c, tgroup *t, int lo, int hi, tpair **out) {
    const int n = c->group->n;
    tpair *_Atomic *bucket = &t->pairs[((unsigned)lo * 2654435761u ^ (unsigned)hi) % (unsigned)n];
    tpair *p = atomic_load(bucket);
    while (p && (p->lo != lo || p->hi != hi)) p = p->next;
    if (!p) {
        pthread_mutex_lock(&t->lock);
        for (p = atomic_load(bucket); p && (p->lo != lo || p->hi != hi);) p = p->next;
        if (!p && (p = zalloc64(sizeof *p))) {
            atomic_init(&p->arrived, 0);
            atomic_init(&p->departed, 0);
            p->lo = lo, p->hi = hi;
            p->next = atomic_load(bucket);
            atomic_store(bucket, p);
        }
        pthread_mutex_unlock(&t->lock);
        if (!p) return ms__fail(MS_ERR_OOM, "threads backend: out of memory for a pair of ranks of a group of %d", n);
    }
    *out = p;
    return MS_OK;
}

/* One peer of a batch as this rank serves it. */
typedef struct tpeer {
    tpair *pair;
    tside *mine, *theirs;
    long long target; /* arrived (and departed) count that completes this exchange */
    enum { WAITING, SERVED, FAILED } state;
} tpeer;

/* The pair's poison as this rank's error (lock not held). */
static ms_status pair_poison_error(tgroup *t, const tpair *pr) {
    pthread_mutex_lock(&t->lock);
    ms_status st = ms__fail(pr->poison_status, "%s", pr->poison_msg ? pr->poison_msg : "(out of memory)");
    pthread_mutex_unlock(&t->lock);
    return st;
}

/* Poisons the exchange with `peer` (lock held) when the peer was reported done (MS_ERR_PEER)
 * or, once timed_out, as late (MS_ERR_TIMEOUT); nothing when there is no reason yet or when
 * the peer arrived meanwhile. */
static void try_poison_pair(const ms_comm *c, tgroup *t, tpeer *p, int peer, bool timed_out) {
    const ms_world *w = c->world;
    const int wr = c->group->world_ranks[peer];
    const int state = atomic_load(&w->rank_state[wr]);
    char who[64];
    ms__rank_str(who, sizeof who, c, peer);
    ms_msg m = {0};
    ms__p2p_where(&m, c, peer);
    ms_status st;
    if (state == MS_RANK_FINISHED) {
        ms__msg_add(&m, ": %s finished its script without joining send/recv", who);
        st = MS_ERR_PEER;
    } else if (state == MS_RANK_FAILED) {
        ms__msg_add(&m, ": %s failed", who);
        st = MS_ERR_PEER;
    } else if (timed_out) {
        ms__msg_add(&m, " timed out after %g s: %s did not arrive (%s)", w->timeout_s, who, w->timeout_origin);
        st = MS_ERR_TIMEOUT;
    } else {
        return;
    }
    long long v = atomic_load(&p->pair->arrived);
    if (v >= p->target) return;
    char *msg = strdup(m.s);
    free(p->pair->poison_msg);
    p->pair->poison_msg = msg;
    p->pair->poison_status = st;
    if (atomic_compare_exchange_strong(&p->pair->arrived, &v, v | MS_POISONED)) pthread_cond_broadcast(&t->wake);
}

/* Both sides have arrived: compares them and copies what this rank receives from the peer's
 * sent tensors, then departs. */
static ms_status serve(const ms_comm *c, tgroup *t, tpeer *p, int peer) {
    const tside *me = p->mine, *them = p->theirs;
    ms_status st = ms__p2p_agree(c, peer, me->descs, me->count, them->descs, them->count);
    for (int i = 0, j = -1; !st && i < me->count; i++) {
        if (me->descs[i].kind != MS_P2P_RECV) continue;
        while (them->descs[++j].kind != MS_P2P_SEND) {}
        int64_t bytes = ms__p2p_bytes(&me->descs[i]);
        if (bytes) memcpy(me->data[i], them->data[j], (size_t)bytes);
    }
    atomic_fetch_add(&p->pair->departed, 1);
    wake_sleepers(t);
    p->state = SERVED;
    return st;
}

static bool any_ready(tpeer *peers, int npeers) {
    for (int i = 0; i < npeers; i++)
        if (peers[i].state == WAITING && atomic_load(&peers[i].pair->arrived) >= peers[i].target) return true;
    return false;
}

static ms_status threads_p2p(ms_comm *c, const ms_p2p_batch *b) {
    tgroup *t = c->group->impl;
    const int me = c->rank;
    tpeer *peers = malloc((size_t)b->npeers * sizeof *peers);
    if (!peers) return ms__fail(MS_ERR_OOM, "threads backend: out of memory for a batch of %d", b->n);
    for (int i = 0; i < b->npeers; i++) {
        const int peer = b->peers[i].peer, lo = me < peer ? me : peer, hi = me < peer ? peer : me;
        ms_status st = get_pair(c, t, lo, hi, &peers[i].pair);
        if (st) { /* before any arrival: nothing to undo */
            free(peers);
            return st;
        }
    }
    ms_first_error first = {0};
    const double deadline = ms__now_s() + c->world->timeout_s;

    /* post every pair, then arrive at each (a poisoned one fails this peer alone) */
    for (int i = 0; i < b->npeers; i++) {
        const ms_p2p_peer *q = &b->peers[i];
        tpeer *p = &peers[i];
        p->mine = &p->pair->side[me > q->peer];
        p->theirs = &p->pair->side[me < q->peer];
        p->target = 2 * (p->mine->seq + 1);
        p->state = WAITING;
        p->mine->seq++;
        p->mine->descs = b->descs + q->first;
        p->mine->data = b->data + q->first;
        p->mine->count = q->count;
        long long v = atomic_load(&p->pair->arrived);
        do {
            if (v & MS_POISONED) {
                ms__keep_first(&first, pair_poison_error(t, p->pair));
                p->state = FAILED;
                break;
            }
        } while (!atomic_compare_exchange_weak(&p->pair->arrived, &v, v + 1));
    }
    wake_sleepers(t);

    /* serve each pair once both sides are there, until none waits: a peer that does not come
     * in time, or is reported done, is poisoned (try_poison_pair) */
    for (long spin = 0;; spin++) {
        int waiting = 0;
        for (int i = 0; i < b->npeers; i++) {
            tpeer *p = &peers[i];
            if (p->state != WAITING) continue;
            long long v = atomic_load(&p->pair->arrived);
            if (v & MS_POISONED) {
                ms__keep_first(&first, pair_poison_error(t, p->pair));
                p->state = FAILED;
            } else if (v >= p->target) {
                ms__keep_first(&first, serve(c, t, p, b->peers[i].peer));
            } else {
                waiting++;
            }
        }
        if (!waiting) break;
        if (spin < t->spins) {
            cpu_relax();
        } else if (spin < t->spins + MS_YIELDS) {
            sched_yield();
        } else {
            double now = ms__now_s(), slice = now + MS_SLICE_MS * 1e-3, until = slice < deadline ? slice : deadline;
            struct timespec ts = {.tv_sec = (time_t)until};
            ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
            pthread_mutex_lock(&t->lock);
            for (int i = 0; i < b->npeers; i++)
                if (peers[i].state == WAITING) try_poison_pair(c, t, &peers[i], b->peers[i].peer, now >= deadline);
            atomic_fetch_add(&t->sleepers, 1);
            if (!any_ready(peers, b->npeers)) pthread_cond_timedwait(&t->wake, &t->lock, &ts);
            atomic_fetch_sub(&t->sleepers, 1);
            pthread_mutex_unlock(&t->lock);
        }
    }

    /* depart: wait until every served peer is done reading this rank's sent tensors */
    for (int i = 0; i < b->npeers; i++)
        if (peers[i].state == SERVED && !spin_until(t, &peers[i].pair->departed, peers[i].target)) {
            pthread_mutex_lock(&t->lock);
            while (atomic_load(&peers[i].pair->departed) < peers[i].target)
                sleep_until(t, &peers[i].pair->departed, peers[i].target, ms__now_s() + MS_SLICE_MS * 1e-3);
            pthread_mutex_unlock(&t->lock);
        }
    free(peers);
    return ms__first_error(&first);
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
    .p2p = threads_p2p,
};

ms_status ms_threads_world_new(ms_world **out, int nranks, double timeout_s) {
    MS_NOT_NULL(out);
    return ms__world_new(out, &threads_backend, nranks, timeout_s);
}
