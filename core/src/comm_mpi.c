/*
 * comm_mpi.c: the MPI backend.  Each process is one rank (`mpirun -np N moonshard ...`);
 * a group is an MPI communicator made once, when the group is first asked for.  A collective
 * exchanges the ranks' descriptors first (exchange), then moves the data as bytes (move),
 * reducing locally in rank order so that every result is the threads backend's, bit for bit.
 */
#include "comm.h"

#include <stdlib.h>
#include <string.h>

/* Whether the process was started by an MPI launcher: OpenMPI (OMPI_COMM_WORLD_SIZE), MPICH
 * and Intel MPI (PMI_SIZE), PMIx launchers such as srun (PMIX_RANK). */
int ms_mpi_launched(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return 1;
    }
    return 0;
}

#ifndef MOONSHARD_HAVE_MPI

ms_status ms_mpi_world_new(ms_world **out, double timeout_s) {
    MS_NOT_NULL(out);
    (void)timeout_s;
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without MPI");
}

ms_status ms_mpi_world_from_comm(ms_world **out, const void *mpi_comm, double timeout_s) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(mpi_comm);
    (void)timeout_s;
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without MPI");
}

ms_status ms__mpi_rank_size(int *rank, int *size) {
    (void)rank, (void)size;
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without MPI");
}

ms_status ms__mpi_bcast(void *buf, int bytes, int root) {
    (void)buf, (void)bytes, (void)root;
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without MPI");
}

#else /* MOONSHARD_HAVE_MPI */

#include <mpi.h>

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

enum {
    PIECE_BYTES = 8 << 20,    /* staging of one reduce_scatter / all_reduce piece */
    SMALL_ALL_REDUCE = 32768, /* n x buffer bytes up to which all_reduce gathers everything */
    SPIN_TESTS = 2000,        /* MPI_Test polls before yielding the CPU between polls */
    AGREE_TAG = 0x6d73,       /* the descriptor exchange's messages */
    YIELD_TESTS = 2000,       /* polls with sched_yield before sleeping between polls */
    MAX_SLEEP_US = 1000,      /* longest sleep between polls of a slow exchange */
    FINISHED = -1             /* the descriptor kind of a rank that released its world */
};

/* ---------------------------------------------------------------- process state */

static struct {
    pthread_mutex_t lock; /* guards the fields below while a world is being made */
    bool ready;           /* MPI is initialised and the fields are set */
    bool ours;            /* this file called MPI_Init_thread: it finalises at exit */
    int level;            /* the thread level MPI provided */
    int rank, size;       /* in MPI_COMM_WORLD */
    int64_t max_bytes;    /* most bytes per peer in one MPI call (INT_MAX; lower in tests) */
    atomic_bool failing;  /* a peer waits in a collective this rank left without joining */
} mpi = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Serialises MPI calls when the library is not MPI_THREAD_MULTIPLE.  With MULTIPLE the unit
 * runtime issues a rank's collectives from its communication thread (comm_async.c) while the
 * rank's own thread may make other MPI calls.  Where the library gives less (SERIALIZED,
 * FUNNELED, SINGLE), every MPI call of this file is serialised by one mutex.  That is
 * weaker: with FUNNELED it is outside the letter of the standard, and two threads of one
 * rank blocked in collectives on different groups can then deadlock, since one holds the
 * mutex through its whole data movement (mpi_collective). */
static pthread_mutex_t mpi_mu = PTHREAD_MUTEX_INITIALIZER;
static void mpi_lock(void) {
    if (mpi.level < MPI_THREAD_MULTIPLE) pthread_mutex_lock(&mpi_mu);
}
static void mpi_unlock(void) {
    if (mpi.level < MPI_THREAD_MULTIPLE) pthread_mutex_unlock(&mpi_mu);
}

/* MPI_Finalize runs once, at exit, when this file initialised MPI (a host that initialised
 * MPI finalises it itself).  It waits for every rank.  When this rank finished while a peer
 * waited for it in a collective (the peer fails, and its launcher then ends the job), the
 * wait would race the job's teardown, which OpenMPI 4.1's mpirun does not survive (it
 * crashes or hangs in PMIx_server_finalize): the process then leaves without it, as a
 * failed rank would. */
static void finalize_at_exit(void) {
    int done = 0;
    MPI_Finalized(&done);
    if (!done && !atomic_load(&mpi.failing)) MPI_Finalize();
}

/* "MPI_Alltoallv: MPI_ERR_TRUNCATE: message truncated" */
static const char *mpi_error_str(char *buf, size_t cap, const char *fn, int rc) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "error %d", rc);
    snprintf(buf, cap, "%s: %s", fn, text);
    return buf;
}

/* Initialises MPI once per process (unless the host did), asking for MPI_THREAD_MULTIPLE
 * (OpenMPI 4.1 from Debian provides it), and reads the world.  A host that initialised MPI
 * below MPI_THREAD_SERIALIZED is refused. */
static ms_status mpi_start(void) {
    pthread_mutex_lock(&mpi.lock);
    ms_status st = MS_OK;
    if (!mpi.ready) {
        int inited = 0, finalized = 0;
        MPI_Initialized(&inited);
        MPI_Finalized(&finalized);
        if (finalized) {
            st = ms__fail(MS_ERR_STATE, "mpi world: MPI was already finalized in this process");
        } else if (!inited) {
            int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &mpi.level);
            if (rc != MPI_SUCCESS) {
                char e[MPI_MAX_ERROR_STRING + 64];
                st = ms__fail(MS_ERR_PEER, "mpi world: %s", mpi_error_str(e, sizeof e, "MPI_Init_thread", rc));
            } else {
                mpi.ours = true;
                atexit(finalize_at_exit);
            }
        } else {
            MPI_Query_thread(&mpi.level);
        }
        if (!st && mpi.level < MPI_THREAD_SERIALIZED && !mpi.ours) {
            /* A host's MPI_THREAD_SINGLE/FUNNELED: our communication threads would break it. */
            st = ms__fail(MS_ERR_STATE, "mpi world: MPI was initialised with thread level %d; moonshard needs "
                          "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE", mpi.level);
        }
        if (!st) {
            MPI_Comm_rank(MPI_COMM_WORLD, &mpi.rank);
            MPI_Comm_size(MPI_COMM_WORLD, &mpi.size);
            mpi.max_bytes = INT_MAX;
            const char *env = getenv("MOONSHARD_MPI_MAX_BYTES"); /* tests: exercise the pieces */
            if (env && *env) {
                char *end;
                long long v = strtoll(env, &end, 10);
                if (*end || v < 8 || v > INT_MAX)
                    st = ms__fail(MS_ERR_ARG, "MOONSHARD_MPI_MAX_BYTES='%s' is not a byte count in 8..%d", env,
                                  INT_MAX);
                else
                    mpi.max_bytes = v;
            }
            mpi.ready = !st;
        }
    }
    pthread_mutex_unlock(&mpi.lock);
    return st;
}

/* ---------------------------------------------------------------- group state */

/* One rank's call as it travels between the ranks (72 bytes). */
typedef struct desc {
    int32_t kind; /* ms_coll_kind, or FINISHED */
    int32_t dtype, op, root;
    int64_t count;
    uint64_t label_hash;
    char label[MS_COLL_LABEL];
} desc;

typedef struct mgroup {
    MPI_Comm comm;        /* over g->world_ranks, group rank order */
    MPI_Comm create_from; /* the whole-world group only: parent of the other groups' comms */
    int n, rank;          /* group size, this process's group rank */
    bool is_world;
    bool pending;         /* an exchange never completed (timeout): comm and descs stay in use */
    desc mine;            /* (1) what this rank sends in the exchange */
    desc *descs;          /* (n) what every rank sent */
    MPI_Request *reqs;    /* (2n) the exchange's receives (one a peer, in group order), then sends */
    ms_coll *calls;       /* (n) the descriptors as calls, for the agreement message */
    int *sc, *sd, *rc, *rd; /* (n) counts and displacements for the v-collectives, bytes */
    const void **srcs;    /* (n) reduction sources */
    void *tmp;            /* (tmp_cap bytes) staging of the reductions, grown on demand */
    size_t tmp_cap;
} mgroup;

static void mgroup_free(mgroup *m) {
    if (m->pending) return; /* MPI may still write into it */
    free(m->descs);
    free(m->reqs);
    free(m->calls);
    free(m->sc);
    free(m->sd);
    free(m->rc);
    free(m->rd);
    free(m->srcs);
    free(m->tmp);
    free(m);
}

/* A tag for MPI_Comm_create_group from the member list, so that concurrent creations of
 * different groups (from different threads) do not mix; 0..32767, the least MPI_TAG_UB. */
static int group_tag(int n, const int *ranks, int tag) {
    uint32_t h = (2166136261u ^ (uint32_t)tag) * 16777619u;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)ranks[i]) * 16777619u;
    return (int)(h & 0x7fff);
}

static ms_status mpi_group_init(ms_world *w, ms_group *g) {
    char list[256], e[MPI_MAX_ERROR_STRING + 64];
    ms__group_str(list, sizeof list, g->n, g->world_ranks);
    mgroup *m = calloc(1, sizeof *m);
    if (!m) return ms__fail(MS_ERR_OOM, "mpi backend: out of memory for group %s", list);
    m->n = g->n;
    m->rank = -1;
    m->is_world = w->groups == NULL; /* the first group registered is the whole world */
    /* The world's communicator: the host's (ms_mpi_world_from_comm) or MPI_COMM_WORLD; this
     * process's world rank is its rank there. */
    const MPI_Comm base = w->backend_arg ? *(const MPI_Comm *)w->backend_arg : MPI_COMM_WORLD;
    int me = -1;
    if (m->is_world) {
        mpi_lock();
        MPI_Comm_rank(base, &me);
        mpi_unlock();
    } else {
        me = ((const mgroup *)w->groups->impl)->rank;
    }
    for (int i = 0; i < g->n; i++)
        if (g->world_ranks[i] == me) m->rank = i;
    m->descs = calloc((size_t)g->n, sizeof *m->descs);
    m->reqs = calloc(2 * (size_t)g->n, sizeof *m->reqs);
    m->calls = calloc((size_t)g->n, sizeof *m->calls);
    m->sc = calloc((size_t)g->n, sizeof(int));
    m->sd = calloc((size_t)g->n, sizeof(int));
    m->rc = calloc((size_t)g->n, sizeof(int));
    m->rd = calloc((size_t)g->n, sizeof(int));
    m->srcs = calloc((size_t)g->n, sizeof *m->srcs);
    if (!m->descs || !m->reqs || !m->calls || !m->sc || !m->sd || !m->rc || !m->rd || !m->srcs) {
        mgroup_free(m);
        return ms__fail(MS_ERR_OOM, "mpi backend: out of memory for group %s", list);
    }
    if (m->rank < 0) { /* comm.c only makes groups that hold the calling rank */
        mgroup_free(m);
        return ms__fail(MS_ERR_INTERNAL, "mpi backend: group %s does not hold this process's rank %d", list, me);
    }
    m->comm = m->create_from = MPI_COMM_NULL;
    int rc;
    const char *fn;
    mpi_lock();
    if (m->is_world) {
        fn = "MPI_Comm_dup";
        rc = MPI_Comm_dup(base, &m->comm);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(base, &m->create_from);
    } else {
        /* Collective over the members only: ranks outside the group never take part. */
        const mgroup *world = w->groups->impl;
        MPI_Group all, sub;
        fn = "MPI_Comm_create_group";
        rc = MPI_Comm_group(world->create_from, &all);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Group_incl(all, g->n, g->world_ranks, &sub);
            MPI_Group_free(&all);
        }
        if (rc == MPI_SUCCESS) {
            rc = MPI_Comm_create_group(world->create_from, sub, group_tag(g->n, g->world_ranks, g->tag), &m->comm);
            MPI_Group_free(&sub);
        }
    }
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    int check = -1;
    if (rc == MPI_SUCCESS) MPI_Comm_rank(m->comm, &check);
    mpi_unlock();
    if (rc != MPI_SUCCESS) {
        mgroup_free(m);
        return ms__fail(MS_ERR_PEER, "mpi backend: group %s: %s", list, mpi_error_str(e, sizeof e, fn, rc));
    }
    if (check != m->rank) {
        int want = m->rank;
        MPI_Comm_free(&m->comm);
        if (m->create_from != MPI_COMM_NULL) MPI_Comm_free(&m->create_from);
        mgroup_free(m);
        return ms__fail(MS_ERR_INTERNAL, "mpi backend: group %s: MPI gave rank %d, expected %d", list, check, want);
    }
    g->impl = m;
    return MS_OK;
}

/* ---------------------------------------------------------------- waiting */

/* The pause before poll i (from 0) of a wait: none at first, then sched_yield, then sleeps
 * doubling from 10 us up to MAX_SLEEP_US (*sleep_us, 10 to start), so a rank waiting long
 * for a late peer leaves the CPU to others. */
static void pause_before(long i, long *sleep_us) {
    if (i < SPIN_TESTS) return;
    if (i < SPIN_TESTS + YIELD_TESTS) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, *sleep_us * 1000};
    nanosleep(&ts, NULL);
    if (*sleep_us < MAX_SLEEP_US) *sleep_us *= 2;
}

/* Polls the requests until all complete (MPI_SUCCESS, *done = true) or `deadline` passes
 * (*done = false), pausing between polls (pause_before). */
static int wait_until(int count, MPI_Request *reqs, double deadline, bool *done) {
    int flag = 0, rc = MPI_SUCCESS;
    long sleep_us = 10;
    for (long i = 0;; i++) {
        mpi_lock();
        rc = MPI_Testall(count, reqs, &flag, MPI_STATUSES_IGNORE);
        mpi_unlock();
        if (rc != MPI_SUCCESS || flag) break;
        if (i >= SPIN_TESTS && (i & 63) == 0 && ms__now_s() >= deadline) break;
        pause_before(i, &sleep_us);
    }
    *done = flag != 0;
    return rc;
}

/* ---------------------------------------------------------------- messages */

/* A failed MPI call inside a collective: MS_ERR_PEER with MPI's message (the backend's
 * communicators return errors, MPI_ERRORS_RETURN, set in mpi_group_init).  A peer that dies
 * does not hang the job: the launcher (OpenMPI's ORTE) ends every process of it, and the
 * moonshard executable calls MPI_Abort when a rank's script fails. */
static ms_status mpi_fail(const ms_comm *c, ms_coll_kind kind, const char *fn, int rc) {
    ms_msg m = {0};
    char e[MPI_MAX_ERROR_STRING + 64];
    ms__msg_where(&m, c, kind);
    return ms__fail(MS_ERR_PEER, "%s: %s", m.s, mpi_error_str(e, sizeof e, fn, rc));
}

/* ---------------------------------------------------------------- agreement */

static desc desc_of(const ms_coll *call) {
    desc d = {.kind = call->kind, .dtype = call->dtype, .op = call->op, .root = call->root, .count = call->count,
              .label_hash = call->label_hash};
    memcpy(d.label, call->label, sizeof d.label);
    return d;
}

static ms_coll coll_of(const desc *d) {
    ms_coll c = {.kind = (ms_coll_kind)d->kind, .dtype = (ms_dtype)d->dtype, .op = (ms_op)d->op, .root = d->root,
                 .count = d->count, .label_hash = d->label_hash};
    memcpy(c.label, d->label, sizeof c.label);
    c.label[MS_COLL_LABEL - 1] = '\0'; /* a peer's bytes */
    return c;
}

/* MS_OK when all n descriptors agree.  Otherwise every rank returns the same status and
 * message, built from the descriptors alone: MS_ERR_PEER naming the ranks that finished
 * without joining, else the MS_ERR_MISMATCH of ms__calls_agree (as the threads backend). */
static ms_status agree(const ms_comm *c, const mgroup *mg) {
    const ms_group *g = c->group;
    const desc *s = mg->descs;
    int first_call = -1;
    bool any_finished = false;
    for (int j = 0; j < g->n; j++) {
        if (s[j].kind == FINISHED) any_finished = true;
        else if (first_call < 0) first_call = j;
    }
    if (any_finished && first_call >= 0) {
        ms_msg m = {0};
        const char *name = ms__coll_name((ms_coll_kind)s[first_call].kind);
        ms__msg_where(&m, c, (ms_coll_kind)s[first_call].kind);
        ms__msg_add(&m, ": ");
        bool first = true;
        for (int j = 0; j < g->n; j++)
            if (s[j].kind == FINISHED) {
                ms__msg_add(&m, "%srank %d finished its script without joining %s", first ? "" : "; ",
                            g->world_ranks[j], name);
                first = false;
            }
        return ms__fail(MS_ERR_PEER, "%s", m.s);
    }
    for (int j = 0; j < g->n; j++) mg->calls[j] = coll_of(&s[j]);
    return ms__calls_agree(c, mg->calls, sizeof mg->calls[0]);
}

/* Posts the exchange of mg->mine: a receive from every peer into descs (reqs[0..n-2], peers
 * in group order), then a send to every peer (reqs[n-1..2n-3]).  The caller holds mpi_lock. */
static int post_exchange(mgroup *mg) {
    mg->descs[mg->rank] = mg->mine;
    int k = 0, rc = MPI_SUCCESS;
    for (int j = 0; j < mg->n && rc == MPI_SUCCESS; j++)
        if (j != mg->rank)
            rc = MPI_Irecv(&mg->descs[j], (int)sizeof(desc), MPI_BYTE, j, AGREE_TAG, mg->comm, &mg->reqs[k++]);
    for (int j = 0; j < mg->n && rc == MPI_SUCCESS; j++)
        if (j != mg->rank)
            rc = MPI_Isend(&mg->mine, (int)sizeof(desc), MPI_BYTE, j, AGREE_TAG, mg->comm, &mg->reqs[k++]);
    return rc;
}

/* After a timeout: the world ranks whose descriptor never came, into m. */
static void name_missing(ms_msg *m, const ms_comm *c, mgroup *mg) {
    int k = 0, missing = 0;
    mpi_lock();
    for (int j = 0; j < mg->n; j++) {
        if (j == mg->rank) continue;
        int flag = 0;
        MPI_Test(&mg->reqs[k++], &flag, MPI_STATUS_IGNORE);
        if (!flag) ms__msg_add(m, "%s %d", missing++ ? "," : "", c->group->world_ranks[j]);
    }
    mpi_unlock();
    if (!missing) ms__msg_add(m, " none (their descriptors came late)");
}

/* Exchanges this rank's descriptor with the group and checks that all agree.  The
 * descriptor (kind, dtype, op, root, count, label) goes to every peer and theirs come back
 * (non-blocking MPI_Isend / MPI_Irecv, tag AGREE_TAG), polled until all complete or the
 * world's timeout passes: then MS_ERR_TIMEOUT names the ranks whose descriptor never came
 * (the exchange stays pending, so the group is unusable after).  Every rank then compares
 * the n descriptors (agree) before any data moves.  A rank that released its world posts a
 * "finished" descriptor on every one of its groups (finish_world), so a peer waiting for it
 * fails at once with MS_ERR_PEER, as with threads.  The exchange completes only once every
 * member arrived: the barrier is this step alone. */
static ms_status exchange(ms_comm *c, mgroup *mg, const ms_coll *call) {
    const ms_world *w = c->world;
    mg->mine = desc_of(call);
    mpi_lock();
    int rc = post_exchange(mg);
    mpi_unlock();
    if (rc != MPI_SUCCESS) return mpi_fail(c, call->kind, "MPI_Isend/MPI_Irecv", rc);
    bool done;
    rc = wait_until(2 * (mg->n - 1), mg->reqs, ms__now_s() + w->timeout_s, &done);
    if (rc != MPI_SUCCESS) return mpi_fail(c, call->kind, "MPI_Isend/MPI_Irecv", rc);
    if (!done) {
        mg->pending = true;
        ms_msg m = {0};
        ms__msg_where(&m, c, call->kind);
        ms__msg_add(&m, " timed out after %g s: ranks that did not arrive:", w->timeout_s);
        name_missing(&m, c, mg);
        ms__msg_add(&m, " (%s)", w->timeout_origin);
        return ms__fail(MS_ERR_TIMEOUT, "%s", m.s);
    }
    return agree(c, mg);
}

/* ---------------------------------------------------------------- data movement */

/* Reductions run the threads backend's kernels (ms__reduce) in the same rank order 0..n-1,
 * accumulating in f32 for f32/f16/bf16/fp8, f64 for f64 and in the integer type for
 * integers, so every result is bit for bit the threads backend's, on every rank.  Every
 * dtype travels as bytes: no MPI datatype or user-defined MPI_Op is needed, not even for
 * bf16 and fp8.  Large buffers go in pieces (PIECE_BYTES of staging at most); counts above
 * INT_MAX go in pieces too, with a resized MPI_BYTE type where the peers' blocks are
 * strided (strided_bytes). */

/* Staging of at least `bytes`, kept by the group for its next calls. */
static ms_status staging(const ms_comm *c, ms_coll_kind kind, mgroup *mg, size_t bytes, char **out) {
    if (bytes > mg->tmp_cap) {
        void *p = malloc(bytes);
        if (!p) {
            ms_msg m = {0};
            ms__msg_where(&m, c, kind);
            return ms__fail(MS_ERR_OOM, "%s: out of memory for %zu bytes of staging", m.s, bytes);
        }
        free(mg->tmp);
        mg->tmp = p;
        mg->tmp_cap = bytes;
    }
    *out = mg->tmp;
    return MS_OK;
}

/* MPI_BYTE blocks of `bytes` placed `stride` bytes apart: one peer's share of a strided
 * buffer, for pieces of buffers whose blocks exceed the per-call limit. */
static int strided_bytes(int64_t bytes, int64_t stride, MPI_Datatype *out) {
    MPI_Datatype block;
    int rc = MPI_Type_contiguous((int)bytes, MPI_BYTE, &block);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Type_create_resized(block, 0, (MPI_Aint)stride, out);
    MPI_Type_free(&block);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(out);
    return rc;
}

#define TRY(fn, call)                                                                          \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        if (rc_ != MPI_SUCCESS) return mpi_fail(c, kind, fn, rc_);                             \
    } while (0)

/* out (n x B bytes) gets every rank's B-byte send; send may be out + rank x B. */
static ms_status do_all_gather(ms_comm *c, mgroup *mg, const void *send, char *out, int64_t B) {
    const ms_coll_kind kind = MS_COLL_ALL_GATHER;
    const bool in_place = send == out + (size_t)mg->rank * (size_t)B;
    if (B <= mpi.max_bytes) {
        TRY("MPI_Allgather", MPI_Allgather(in_place ? MPI_IN_PLACE : send, (int)B, MPI_BYTE, out, (int)B, MPI_BYTE,
                                           mg->comm));
        return MS_OK;
    }
    for (int64_t off = 0; off < B; off += mpi.max_bytes) {
        int64_t m = B - off < mpi.max_bytes ? B - off : mpi.max_bytes;
        MPI_Datatype t;
        TRY("MPI_Type_create_resized", strided_bytes(m, B, &t));
        int rc = MPI_Allgather(in_place ? MPI_IN_PLACE : (const char *)send + off, (int)m, MPI_BYTE, out + off, 1, t,
                               mg->comm);
        MPI_Type_free(&t);
        TRY("MPI_Allgather", rc);
    }
    return MS_OK;
}

static ms_status do_broadcast(ms_comm *c, mgroup *mg, char *buf, int64_t bytes, int root) {
    const ms_coll_kind kind = MS_COLL_BROADCAST;
    for (int64_t off = 0; off < bytes; off += mpi.max_bytes) {
        int64_t m = bytes - off < mpi.max_bytes ? bytes - off : mpi.max_bytes;
        TRY("MPI_Bcast", MPI_Bcast(buf + off, (int)m, MPI_BYTE, root, mg->comm));
    }
    return MS_OK;
}

/* Block j (C bytes) of send goes to rank j; block j of out comes from rank j. */
static ms_status do_all_to_all(ms_comm *c, mgroup *mg, const char *send, char *out, int64_t C) {
    const ms_coll_kind kind = MS_COLL_ALL_TO_ALL;
    if (C <= mpi.max_bytes) {
        TRY("MPI_Alltoall", MPI_Alltoall(send, (int)C, MPI_BYTE, out, (int)C, MPI_BYTE, mg->comm));
        return MS_OK;
    }
    for (int64_t off = 0; off < C; off += mpi.max_bytes) {
        int64_t m = C - off < mpi.max_bytes ? C - off : mpi.max_bytes;
        MPI_Datatype t;
        TRY("MPI_Type_create_resized", strided_bytes(m, C, &t));
        int rc = MPI_Alltoall(send + off, 1, t, out + off, 1, t, mg->comm);
        MPI_Type_free(&t);
        TRY("MPI_Alltoall", rc);
    }
    return MS_OK;
}

/* out (count elements) = op over ranks j of block `rank` of rank j's send (n x count).  In
 * pieces of m elements per peer: each rank sends piece p of block j to rank j, receives
 * piece p of its own block from every peer into staging (n x m), and reduces its own
 * piece straight from send, so its own block never travels. */
static ms_status do_reduce_scatter(ms_comm *c, mgroup *mg, const ms_coll *call) {
    const ms_coll_kind kind = MS_COLL_REDUCE_SCATTER;
    const int n = mg->n, r = mg->rank;
    const int64_t es = ms_dtype_size(call->dtype), count = call->count, B = count * es;
    const char *send = call->send;
    char *out = call->recv, *tmp = NULL;
    int64_t m = PIECE_BYTES / (n * es); /* elements per peer per piece */
    if (m > mpi.max_bytes / es) m = mpi.max_bytes / es;
    if (m < 1) m = 1;
    if (m > count) m = count;
    /* Alltoallv takes int byte displacements: rank j's block starts at j x B. */
    const bool displaced = (int64_t)(n - 1) * B <= mpi.max_bytes - m * es;
    ms_status st = staging(c, kind, mg, (size_t)(n * m * es), &tmp);
    if (st) return st;
    MPI_Datatype piece_type = MPI_DATATYPE_NULL;
    int64_t piece_type_m = 0;
    for (int64_t off = 0; off < count; off += m) {
        const int64_t len = count - off < m ? count - off : m, lb = len * es;
        int rc;
        if (displaced) {
            for (int j = 0; j < n; j++) {
                mg->sc[j] = mg->rc[j] = j == r ? 0 : (int)lb;
                mg->sd[j] = (int)(j * B);
                mg->rd[j] = (int)(j * lb);
            }
            rc = MPI_Alltoallv(send + off * es, mg->sc, mg->sd, MPI_BYTE, tmp, mg->rc, mg->rd, MPI_BYTE, mg->comm);
        } else {
            if (piece_type_m != len) {
                if (piece_type != MPI_DATATYPE_NULL) MPI_Type_free(&piece_type);
                piece_type_m = len;
                TRY("MPI_Type_create_resized", strided_bytes(lb, B, &piece_type));
            }
            rc = MPI_Alltoall(send + off * es, 1, piece_type, tmp, (int)lb, MPI_BYTE, mg->comm);
        }
        if (rc != MPI_SUCCESS) {
            if (piece_type != MPI_DATATYPE_NULL) MPI_Type_free(&piece_type);
            return mpi_fail(c, kind, displaced ? "MPI_Alltoallv" : "MPI_Alltoall", rc);
        }
        for (int j = 0; j < n; j++) mg->srcs[j] = tmp + j * lb;
        if (displaced) mg->srcs[r] = send + r * B + off * es;
        ms__reduce(call->dtype, call->op, n, mg->srcs, (void *const[]){out + off * es}, 1, len);
    }
    if (piece_type != MPI_DATATYPE_NULL) MPI_Type_free(&piece_type);
    return MS_OK;
}

/* Elements [*off, *off + *len) of a count-element piece that group rank r reduces. */
static void all_reduce_chunk(int64_t count, int n, int r, int64_t *off, int64_t *len) {
    int64_t base = count / n, rem = count % n;
    *off = base * r + (r < rem ? r : rem);
    *len = base + (r < rem);
}

/* buf (count elements) = op over ranks of their buf.  Small buffers: gather all and reduce
 * everything on every rank.  Large: pieces of PIECE_BYTES, each split in n near-equal
 * chunks; rank j reduces chunk j of the piece (a reduce_scatter, own chunk untravelled)
 * and the chunks are gathered back in place. */
static ms_status do_all_reduce(ms_comm *c, mgroup *mg, const ms_coll *call) {
    const ms_coll_kind kind = MS_COLL_ALL_REDUCE;
    const int n = mg->n, r = mg->rank;
    const int64_t es = ms_dtype_size(call->dtype), count = call->count, T = count * es;
    char *buf = call->recv, *tmp = NULL;
    ms_status st;
    if (T * n <= SMALL_ALL_REDUCE && T <= mpi.max_bytes) {
        if ((st = staging(c, kind, mg, (size_t)(n * T), &tmp))) return st;
        TRY("MPI_Allgather", MPI_Allgather(buf, (int)T, MPI_BYTE, tmp, (int)T, MPI_BYTE, mg->comm));
        for (int j = 0; j < n; j++) mg->srcs[j] = tmp + j * T;
        ms__reduce(call->dtype, call->op, n, mg->srcs, (void *const[]){buf}, 1, count);
        return MS_OK;
    }
    int64_t piece = PIECE_BYTES / es; /* elements per piece */
    if (piece > mpi.max_bytes / es) piece = mpi.max_bytes / es;
    if (piece < 1) piece = 1;
    if (piece > count) piece = count;
    int64_t most, unused; /* the largest chunk: rank 0's */
    all_reduce_chunk(piece, n, 0, &unused, &most);
    if ((st = staging(c, kind, mg, (size_t)(n * most * es), &tmp))) return st;
    for (int64_t poff = 0; poff < count; poff += piece) {
        const int64_t plen = count - poff < piece ? count - poff : piece;
        char *p = buf + poff * es;
        int64_t off_r, len_r;
        all_reduce_chunk(plen, n, r, &off_r, &len_r);
        for (int j = 0; j < n; j++) {
            int64_t off_j, len_j;
            all_reduce_chunk(plen, n, j, &off_j, &len_j);
            mg->sc[j] = j == r ? 0 : (int)(len_j * es);
            mg->sd[j] = (int)(off_j * es);
            mg->rc[j] = j == r ? 0 : (int)(len_r * es);
            mg->rd[j] = (int)(j * len_r * es);
        }
        TRY("MPI_Alltoallv", MPI_Alltoallv(p, mg->sc, mg->sd, MPI_BYTE, tmp, mg->rc, mg->rd, MPI_BYTE, mg->comm));
        for (int j = 0; j < n; j++) mg->srcs[j] = j == r ? p + off_r * es : tmp + j * len_r * es;
        ms__reduce(call->dtype, call->op, n, mg->srcs, (void *const[]){p + off_r * es}, 1, len_r);
        for (int j = 0; j < n; j++) { /* every rank's chunk, its count and place in the piece */
            int64_t off_j, len_j;
            all_reduce_chunk(plen, n, j, &off_j, &len_j);
            mg->rc[j] = (int)(len_j * es);
            mg->rd[j] = (int)(off_j * es);
        }
        TRY("MPI_Allgatherv", MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, mg->rc, mg->rd, MPI_BYTE,
                                             mg->comm));
    }
    return MS_OK;
}

#undef TRY

/* The agreed call's data, with MPI where MPI is good and with our own schedule where OpenMPI
 * is weak:
 *   all_gather      MPI_Allgather (MPI_IN_PLACE for the in-place form)
 *   broadcast       MPI_Bcast
 *   all_to_all      MPI_Alltoall
 *   reduce_scatter  MPI_Alltoallv of the chunks each peer reduces (own chunk skipped; an
 *                   MPI_Alltoall of a strided type where int byte displacements would not
 *                   do), then a local reduction in rank order 0..n-1
 *   all_reduce      small: MPI_Allgather of the whole buffer and the same local reduction on
 *                   every rank; large: the reduce_scatter above on n near-equal chunks, then
 *                   MPI_Allgatherv in place
 *   barrier         nothing: the exchange was the barrier */
static ms_status move(ms_comm *c, mgroup *mg, const ms_coll *call) {
    const int64_t es = ms_dtype_size(call->dtype);
    if (call->count == 0) return MS_OK;
    switch (call->kind) {
    case MS_COLL_ALL_GATHER: return do_all_gather(c, mg, call->send, call->recv, call->count * es);
    case MS_COLL_REDUCE_SCATTER: return do_reduce_scatter(c, mg, call);
    case MS_COLL_ALL_REDUCE: return do_all_reduce(c, mg, call);
    case MS_COLL_BROADCAST: return do_broadcast(c, mg, call->recv, call->count * es, call->root);
    case MS_COLL_ALL_TO_ALL: return do_all_to_all(c, mg, call->send, call->recv, call->count / mg->n * es);
    case MS_COLL_BARRIER: return MS_OK; /* the exchange was the barrier */
    }
    return MS_OK;
}

/* ---------------------------------------------------------------- point-to-point
 *
 * Each peer of a batch is served on its own (comm.h): a header each way (P2P_HEAD_TAG: the
 * op count and the first descriptors), the other descriptors when either side has more
 * (P2P_DESC_TAG), ms__p2p_agree, then the agreed ops' data in batch order (P2P_DATA_TAG,
 * in pieces of at most max_bytes).  MPI keeps the messages of one sender and tag in order,
 * so the k-th header from a peer is its k-th batch naming this rank and the data pieces
 * pair in op order.  Every peer's header is posted first, then one polling loop moves each
 * peer on as its messages complete: a batch's ops run in any order, and a slow peer holds up
 * no other.  A header that says MS_P2P_FINISHED comes from a rank that released its world
 * (finish_world): MS_ERR_PEER at once.  A peer that does not answer within the timeout is
 * MS_ERR_TIMEOUT naming it; what MPI may still write into is then left allocated. */

enum { P2P_HEAD_TAG = 0x6d74, P2P_DESC_TAG = 0x6d75, P2P_DATA_TAG = 0x6d76 };

typedef struct mpeer {
    int peer, first, count;           /* the batch's part for this peer */
    enum { HEAD, REST, DATA, DONE } phase;
    ms_p2p_header mine, theirs;
    ms_p2p_desc *descs;               /* (theirs.count) the peer's ops with this rank */
    MPI_Request req[2];               /* the header's, then the rest's, receive and send */
    MPI_Request *data;                /* (ndata) the data pieces */
    int ndata;
} mpeer;

static const ms_p2p_header finished_header = {.count = MS_P2P_FINISHED};

/* A failed MPI call with the peer: MS_ERR_PEER naming the pair and MPI's message. */
static ms_status p2p_fail(const ms_comm *c, int peer, const char *fn, int rc) {
    ms_msg m = {0};
    char e[MPI_MAX_ERROR_STRING + 64];
    ms__p2p_where(&m, c, peer);
    return ms__fail(MS_ERR_PEER, "%s: %s", m.s, mpi_error_str(e, sizeof e, fn, rc));
}

/* Posts the agreed ops' data, in order, in pieces of at most max_bytes. */
static ms_status post_data(ms_comm *c, mgroup *mg, const ms_p2p_batch *b, mpeer *p) {
    int pieces = 0;
    for (int i = p->first; i < p->first + p->count; i++)
        pieces += (int)((ms__p2p_bytes(&b->descs[i]) + mpi.max_bytes - 1) / mpi.max_bytes);
    if (!(p->data = malloc((size_t)(pieces ? pieces : 1) * sizeof *p->data))) {
        ms_msg m = {0};
        ms__p2p_where(&m, c, p->peer);
        return ms__fail(MS_ERR_OOM, "%s: out of memory", m.s);
    }
    int rc = MPI_SUCCESS;
    mpi_lock();
    for (int i = p->first; i < p->first + p->count && rc == MPI_SUCCESS; i++) {
        const int64_t bytes = ms__p2p_bytes(&b->descs[i]);
        char *d = b->data[i];
        for (int64_t off = 0; off < bytes && rc == MPI_SUCCESS; off += mpi.max_bytes) {
            const int len = (int)(bytes - off < mpi.max_bytes ? bytes - off : mpi.max_bytes);
            MPI_Request *r = &p->data[p->ndata++];
            rc = b->descs[i].kind == MS_P2P_SEND
                     ? MPI_Isend(d + off, len, MPI_BYTE, p->peer, P2P_DATA_TAG, mg->comm, r)
                     : MPI_Irecv(d + off, len, MPI_BYTE, p->peer, P2P_DATA_TAG, mg->comm, r);
        }
    }
    mpi_unlock();
    return rc == MPI_SUCCESS ? MS_OK : p2p_fail(c, p->peer, "MPI_Isend/MPI_Irecv", rc);
}

/* Moves peer p on once its pending requests are complete: MS_OK while all is well (phase
 * DONE at the end), else the failure with this peer. */
static ms_status p2p_step(ms_comm *c, mgroup *mg, const ms_p2p_batch *b, mpeer *p) {
    int flag = 0, rc;
    mpi_lock();
    rc = p->phase == DATA ? MPI_Testall(p->ndata, p->data, &flag, MPI_STATUSES_IGNORE)
                          : MPI_Testall(2, p->req, &flag, MPI_STATUSES_IGNORE);
    mpi_unlock();
    if (rc != MPI_SUCCESS) return p2p_fail(c, p->peer, "MPI_Isend/MPI_Irecv", rc);
    if (!flag) return MS_OK;
    ms_msg m = {0};
    if (p->phase == HEAD) {
        const int n = p->theirs.count;
        if (n == MS_P2P_FINISHED || n < 1) {
            char who[64];
            p->phase = DONE; /* nothing of the pair is pending */
            ms__p2p_where(&m, c, p->peer);
            if (n != MS_P2P_FINISHED) return ms__fail(MS_ERR_INTERNAL, "%s: a header of %d ops came", m.s, n);
            return ms__fail(MS_ERR_PEER, "%s: %s finished its script without joining send/recv", m.s,
                            ms__rank_str(who, sizeof who, c, p->peer));
        }
        if (!(p->descs = malloc((size_t)n * sizeof *p->descs))) {
            p->phase = DONE;
            ms__p2p_where(&m, c, p->peer);
            return ms__fail(MS_ERR_OOM, "%s: out of memory", m.s);
        }
        memcpy(p->descs, p->theirs.desc, (size_t)(n < MS_P2P_INLINE ? n : MS_P2P_INLINE) * sizeof *p->descs);
        if (n > MS_P2P_INLINE || p->count > MS_P2P_INLINE) { /* the other descriptors */
            p->req[0] = p->req[1] = MPI_REQUEST_NULL;
            rc = MPI_SUCCESS;
            mpi_lock();
            if (n > MS_P2P_INLINE)
                rc = MPI_Irecv(p->descs + MS_P2P_INLINE, (n - MS_P2P_INLINE) * (int)sizeof *p->descs, MPI_BYTE,
                               p->peer, P2P_DESC_TAG, mg->comm, &p->req[0]);
            if (rc == MPI_SUCCESS && p->count > MS_P2P_INLINE)
                rc = MPI_Isend(b->descs + p->first + MS_P2P_INLINE, (p->count - MS_P2P_INLINE) * (int)sizeof *p->descs,
                               MPI_BYTE, p->peer, P2P_DESC_TAG, mg->comm, &p->req[1]);
            mpi_unlock();
            p->phase = REST;
            return rc == MPI_SUCCESS ? MS_OK : p2p_fail(c, p->peer, "MPI_Isend/MPI_Irecv", rc);
        }
        p->phase = REST; /* nothing more to exchange: on to the agreement */
    }
    if (p->phase == REST) {
        ms_status st = ms__p2p_agree(c, p->peer, b->descs + p->first, p->count, p->descs, p->theirs.count);
        p->phase = st ? DONE : DATA; /* a mismatch moves nothing */
        if (!st && (st = post_data(c, mg, b, p)) && !p->ndata) p->phase = DONE; /* refused before posting */
        return st;
    }
    p->phase = DONE;
    return MS_OK;
}

static ms_status mpi_p2p(ms_comm *c, const ms_p2p_batch *b) {
    mgroup *mg = c->group->impl;
    mpeer *peers = calloc((size_t)b->npeers, sizeof *peers);
    if (!peers) return ms__fail(MS_ERR_OOM, "mpi backend: out of memory for a batch of %d", b->n);
    ms_first_error first = {0};
    int rc = MPI_SUCCESS, posted = 0;
    mpi_lock();
    for (; posted < b->npeers && rc == MPI_SUCCESS; posted++) {
        mpeer *p = &peers[posted];
        p->peer = b->peers[posted].peer, p->first = b->peers[posted].first, p->count = b->peers[posted].count;
        ms__p2p_header(b, posted, &p->mine);
        rc = MPI_Irecv(&p->theirs, (int)sizeof p->theirs, MPI_BYTE, p->peer, P2P_HEAD_TAG, mg->comm, &p->req[0]);
        if (rc == MPI_SUCCESS)
            rc = MPI_Isend(&p->mine, (int)sizeof p->mine, MPI_BYTE, p->peer, P2P_HEAD_TAG, mg->comm, &p->req[1]);
    }
    mpi_unlock();
    bool leave = false; /* MPI may still use the peers' buffers: leave them allocated */
    if (rc != MPI_SUCCESS) {
        ms__keep_first(&first, p2p_fail(c, peers[posted - 1].peer, "MPI_Isend/MPI_Irecv", rc));
        leave = true;
    } else {
        const double deadline = ms__now_s() + c->world->timeout_s;
        long sleep_us = 10;
        for (long i = 0;; i++) {
            int waiting = 0;
            for (int j = 0; j < b->npeers; j++) {
                if (peers[j].phase == DONE) continue;
                ms_status st = p2p_step(c, mg, b, &peers[j]);
                if (st) { /* left in its phase after a failed MPI call: requests may be pending */
                    ms__keep_first(&first, st);
                    leave |= peers[j].phase != DONE;
                    peers[j].phase = DONE;
                }
                waiting += peers[j].phase != DONE;
            }
            if (!waiting) break;
            if (i >= SPIN_TESTS && (i & 63) == 0 && ms__now_s() >= deadline) {
                for (int j = 0; j < b->npeers; j++) {
                    if (peers[j].phase == DONE) continue;
                    char who[64];
                    ms_msg m = {0};
                    ms__p2p_where(&m, c, peers[j].peer);
                    ms__keep_first(&first, ms__fail(MS_ERR_TIMEOUT, "%s timed out after %g s: %s did not arrive (%s)",
                                                    m.s, c->world->timeout_s,
                                                    ms__rank_str(who, sizeof who, c, peers[j].peer),
                                                    c->world->timeout_origin));
                }
                leave = true;
                break;
            }
            pause_before(i, &sleep_us);
        }
    }
    if (leave) {
        mg->pending = true; /* the group is unusable; its buffers stay too */
    } else {
        for (int j = 0; j < b->npeers; j++) {
            free(peers[j].descs);
            free(peers[j].data);
        }
        free(peers);
    }
    return ms__first_error(&first);
}

/* ---------------------------------------------------------------- the backend */

static ms_status mpi_collective(ms_comm *c, const ms_coll *call) {
    mgroup *mg = c->group->impl;
    ms_status st = exchange(c, mg, call);
    if (st) return st;
    if (mpi.level < MPI_THREAD_MULTIPLE) {
        mpi_lock();
        st = move(c, mg, call);
        mpi_unlock();
    } else {
        st = move(c, mg, call);
    }
    return st ? st : ms__ok();
}

/* Posts a FINISHED descriptor on every group of the world (g is the whole-world group, the
 * head of the registry), and a FINISHED point-to-point header to every peer, so that peers
 * waiting in a collective or a send or receive this rank will never join fail at once, and
 * waits up to the timeout for the peers to finish too. */
static void finish_world(ms_group *g) {
    const ms_world *w = g->comms[0].world;
    const double deadline = ms__now_s() + w->timeout_s;
    int count = 0;
    for (ms_group *h = g; h; h = h->next) count += h->impl != NULL;
    mgroup **owners = calloc((size_t)count, sizeof *owners);
    if (!owners) return;
    int posted = 0;
    mpi_lock();
    for (ms_group *h = g; h; h = h->next) {
        mgroup *mg = h->impl;
        if (!mg || mg->pending) continue; /* after a timeout the comm is unusable anyway */
        mg->mine = (desc){.kind = FINISHED};
        if (post_exchange(mg) == MPI_SUCCESS) owners[posted++] = mg;
        for (int j = 0; j < mg->n; j++) { /* and to a peer's next send or receive with this rank */
            MPI_Request r;
            if (j != mg->rank && MPI_Isend(&finished_header, (int)sizeof finished_header, MPI_BYTE, j, P2P_HEAD_TAG,
                                           mg->comm, &r) == MPI_SUCCESS)
                MPI_Request_free(&r);
        }
    }
    mpi_unlock();
    for (int i = 0; i < posted; i++) {
        bool done = false;
        wait_until(2 * (owners[i]->n - 1), owners[i]->reqs, deadline, &done);
        if (!done) { /* a peer is still running: its exchanges keep our buffers */
            owners[i]->pending = true;
            continue;
        }
        for (int j = 0; j < owners[i]->n; j++)
            if (owners[i]->descs[j].kind != FINISHED) atomic_store(&mpi.failing, true);
    }
    free(owners);
}

static void mpi_group_free(ms_group *g) {
    mgroup *mg = g->impl;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        if (mg->is_world) finish_world(g);
        mpi_lock();
        if (mg->comm != MPI_COMM_NULL) MPI_Comm_free(&mg->comm);
        if (mg->create_from != MPI_COMM_NULL) MPI_Comm_free(&mg->create_from);
        mpi_unlock();
    }
    mgroup_free(mg);
    g->impl = NULL;
}

static const ms_backend mpi_backend = {
    .name = "mpi",
    .device = MS_DEVICE_CPU,
    .group_init = mpi_group_init,
    .group_free = mpi_group_free,
    .collective = mpi_collective,
    .p2p = mpi_p2p,
};

ms_status ms_mpi_world_new(ms_world **out, double timeout_s) {
    MS_NOT_NULL(out);
    ms_status st = mpi_start();
    if (st) return st;
    return ms__world_new(out, &mpi_backend, mpi.size, timeout_s);
}

ms_status ms_mpi_world_from_comm(ms_world **out, const void *mpi_comm, double timeout_s) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(mpi_comm);
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
        return ms__fail(MS_ERR_STATE, "mpi world: MPI is not initialised: a host's communicator needs MPI_Init_thread "
                        "first (MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE)");
    ms_status st = mpi_start();
    if (st) return st;
    const MPI_Comm base = *(const MPI_Comm *)mpi_comm;
    if (base == MPI_COMM_NULL) return ms__fail(MS_ERR_ARG, "mpi world: the communicator is MPI_COMM_NULL");
    int inter = 0, size = 0;
    mpi_lock();
    int rc = MPI_Comm_test_inter(base, &inter);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(base, &size);
    mpi_unlock();
    if (rc != MPI_SUCCESS) {
        char e[MPI_MAX_ERROR_STRING + 64];
        return ms__fail(MS_ERR_ARG, "mpi world: %s", mpi_error_str(e, sizeof e, "MPI_Comm_size", rc));
    }
    if (inter) return ms__fail(MS_ERR_ARG, "mpi world: an intercommunicator; expected an intracommunicator");
    return ms__world_new_arg(out, &mpi_backend, size, timeout_s, mpi_comm);
}

ms_status ms__mpi_rank_size(int *rank, int *size) {
    ms_status st = mpi_start();
    if (st) return st;
    *rank = mpi.rank;
    *size = mpi.size;
    return MS_OK;
}

ms_status ms__mpi_bcast(void *buf, int bytes, int root) {
    ms_status st = mpi_start();
    if (st) return st;
    mpi_lock();
    int rc = MPI_Bcast(buf, bytes, MPI_BYTE, root, MPI_COMM_WORLD);
    mpi_unlock();
    if (rc == MPI_SUCCESS) return MS_OK;
    char e[MPI_MAX_ERROR_STRING + 64];
    return ms__fail(MS_ERR_PEER, "%s", mpi_error_str(e, sizeof e, "MPI_Bcast", rc));
}

#endif /* MOONSHARD_HAVE_MPI */
