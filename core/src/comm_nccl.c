/*
 * comm_nccl.c: the NCCL backend.  One rank per process and GPU, collectives on CUDA tensors
 * (cpu tensors are staged through the group's device buffers).  The process finds its rank
 * and GPU in nccl_start; every communicator is nonblocking, each wait bounded by the world's
 * timeout (settle, nccl_wait); groups are splits of the world's communicator (make_comm);
 * every collective and split runs on the rank's communication thread (nccl_collective).
 */
#include "comm.h"
#include "cuda.h"
#include "store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef MOONSHARD_HAVE_NCCL

ms_status ms_nccl_world_new(ms_world **out, double timeout_s, int *rank) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(rank);
    (void)timeout_s;
    *rank = -1;
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without NCCL (the CUDA toolkit or libnccl was not "
                                      "found when it was configured)");
}

int ms_nccl_device(void) { return -1; }

#else /* MOONSHARD_HAVE_NCCL */

#include <cuda_runtime_api.h>
#include <nccl.h>

typedef enum { VIA_NONE, VIA_MPI, VIA_STORE } bootstrap;

/* The process's place in the NCCL world, set once by nccl_start. */
static struct {
    pthread_mutex_t lock;
    bool ready;
    int rank, size, device;
    bootstrap via;
    ms_store *store;
    atomic_bool aborted; /* some communicator was aborted: the others are not finalized either */
} nccl = {.lock = PTHREAD_MUTEX_INITIALIZER, .device = -1};

static ms_status cuda_err(cudaError_t e, const char *what) {
    cudaGetLastError();
    return ms__fail(e == cudaErrorMemoryAllocation ? MS_ERR_OOM : MS_ERR_DEVICE, "nccl backend: %s: %s: %s", what,
                    cudaGetErrorName(e), cudaGetErrorString(e));
}

/* what: "nccl backend: ncclAllReduce", the call with its context. */
static ms_status nccl_err(ncclResult_t r, const char *what) {
    return ms__fail(r == ncclInvalidArgument || r == ncclInvalidUsage ? MS_ERR_ARG : MS_ERR_PEER, "%s: %s", what,
                    ncclGetErrorString(r));
}

#define CUDA_OK(what, call)                              \
    do {                                                 \
        cudaError_t e_ = (call);                         \
        if (e_ != cudaSuccess) return cuda_err(e_, what); \
    } while (0)
#define NCCL_OK(what, call)                                                \
    do {                                                                   \
        ncclResult_t r_ = (call);                                          \
        if (r_ != ncclSuccess) return nccl_err(r_, "nccl backend: " what); \
    } while (0)

/* ---------------------------------------------------------------- nonblocking communicators */

/* Every communicator is nonblocking (ncclConfig_t blocking = 0), so that the NCCL calls that
 * wait for other ranks return at once: a call may return ncclInProgress, its work going on
 * in the background, and the calling thread then polls the communicator's state
 * (ncclCommGetAsyncError) until it is no longer ncclInProgress, up to the world's timeout,
 * before it calls NCCL or touches the stream again, as NCCL requires (settle, nccl_wait).
 * That bounds the creation of the world's communicator, the splits, and the enqueueing of
 * every collective (ncclGroupEnd included): past the timeout the call fails with
 * MS_ERR_TIMEOUT ("rank(s) missing or unreachable") and the communicator is aborted
 * (ncclCommAbort, which NCCL allows at any point). */

static bool nccl_failed(ncclResult_t r) { return r != ncclSuccess && r != ncclInProgress; }

/* ncclCommAbort, and a note that a communicator of the process was aborted: a peer is gone,
 * so ngroup_free aborts the others at once instead of finalizing them (a finalization might
 * wait for that peer). */
static void abort_comm(ncclComm_t *comm) {
    if (*comm) ncclCommAbort(*comm);
    *comm = NULL;
    atomic_store(&nccl.aborted, true);
}

/* The outcome of a call on comm that returned r.  On a nonblocking communicator a call may
 * return before its work is done (ncclInProgress; a split's progress is its parent's
 * state, whatever ncclCommSplit returned), so unless the call failed, comm's state is polled until
 * it is no longer ncclInProgress: ncclInProgress when deadline passes first. */
static ncclResult_t settle(ncclComm_t comm, ncclResult_t r, double deadline) {
    if (nccl_failed(r)) return r;
    for (;;) {
        ncclResult_t e = ncclCommGetAsyncError(comm, &r);
        if (e != ncclSuccess) return e;
        if (r != ncclInProgress || ms__now_s() > deadline) return r;
        nanosleep(&(struct timespec){0, 20000}, NULL);
    }
}

/* settle() up to the world's timeout, as a status; what names the call in messages.  A call
 * that fails or does not complete in time (MS_ERR_TIMEOUT) leaves nothing to do but
 * ncclCommAbort: *comm is aborted and set to NULL.  Bad arguments included: NCCL's user guide
 * asks for an abort after ncclInvalidUsage, and on a nonblocking communicator NCCL 2.28 keeps
 * even ncclInvalidArgument as the communicator's state, so every later call would fail with
 * it (the collectives' arguments are checked before they reach NCCL, so this is a bug of
 * ours, not a user's mistake). */
static ms_status nccl_wait(const ms_world *w, ncclComm_t *comm, ncclResult_t r, const char *what) {
    r = settle(*comm, r, ms__now_s() + w->timeout_s);
    if (r == ncclSuccess) return MS_OK;
    if (r != ncclInProgress) {
        abort_comm(comm);
        return nccl_err(r, what);
    }
    abort_comm(comm);
    return ms__fail(MS_ERR_TIMEOUT,
                    "%s did not complete within %g s (%s): rank(s) missing or unreachable; the communicator was "
                    "aborted",
                    what, w->timeout_s, w->timeout_origin);
}

/* ---------------------------------------------------------------- the world */

/* A non-negative integer environment variable, or -1 when unset; *bad when malformed. */
static long env_int(const char *name, bool *bad) {
    const char *v = getenv(name);
    if (!v || !*v) return -1;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < 0) *bad = true;
    return x;
}

/* The rank's GPU: LOCAL_RANK, else rank mod the device count. */
static ms_status pick_device(void) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return ms__fail(MS_ERR_DEVICE, "nccl world: rank %d has no CUDA device (%s)", nccl.rank,
                        e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    }
    bool bad = false;
    long local = env_int("LOCAL_RANK", &bad);
    if (bad) return ms__fail(MS_ERR_ARG, "nccl world: LOCAL_RANK='%s' is not a device number", getenv("LOCAL_RANK"));
    if (local >= count)
        return ms__fail(MS_ERR_DEVICE, "nccl world: LOCAL_RANK=%ld but this machine has %d CUDA device%s", local,
                        count, count == 1 ? "" : "s");
    nccl.device = local >= 0 ? (int)local : nccl.rank % count;
    CUDA_OK("cudaSetDevice", cudaSetDevice(nccl.device));
    return MS_OK;
}

/* The process's rank and the world size, once: from MPI when an MPI launcher started it
 * (ms_mpi_launched), else from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun and
 * friends; store.h's TCP store, served by rank 0, is the rendezvous, or torchrun's own store
 * when TORCHELASTIC_USE_AGENT_STORE=True says it serves one), else a world of one.  Then
 * its GPU (pick_device). */
static ms_status nccl_start(double timeout_s) {
    pthread_mutex_lock(&nccl.lock);
    ms_status st = MS_OK;
    if (!nccl.ready) {
        nccl.rank = 0, nccl.size = 1, nccl.via = VIA_NONE;
        if (ms_mpi_launched()) {
            st = ms__mpi_rank_size(&nccl.rank, &nccl.size);
            nccl.via = VIA_MPI;
        } else if (getenv("WORLD_SIZE") || getenv("MASTER_ADDR")) {
            st = ms__store_open_env(&nccl.store, timeout_s > 0 ? timeout_s : 300);
            if (!st) nccl.rank = ms__store_rank(nccl.store), nccl.size = ms__store_world(nccl.store);
            nccl.via = VIA_STORE;
        }
        if (!st) st = pick_device();
        nccl.ready = !st;
    }
    pthread_mutex_unlock(&nccl.lock);
    return st;
}

/* Rank 0's unique id on every rank: rank 0 makes it and hands it to the others, with MPI_Bcast
 * under an MPI launcher, else through the store.  Each world the process makes has its own
 * key in the store ("moonshard/nccl/world/N", N counting the worlds made), so that a later
 * world never reads an earlier one's id; every rank makes its worlds in the same order. */
static ms_status share_world_id(ncclUniqueId *id) {
    static int worlds;
    if (nccl.rank == 0) NCCL_OK("ncclGetUniqueId", ncclGetUniqueId(id));
    size_t len = 0;
    char key[64];
    snprintf(key, sizeof key, "moonshard/nccl/world/%d", worlds++);
    switch (nccl.via) {
    case VIA_MPI: return ms__mpi_bcast(id, (int)sizeof *id, 0);
    case VIA_STORE:
        if (nccl.rank == 0) return ms__store_set(nccl.store, key, id, sizeof *id);
        return ms__store_get(nccl.store, key, id, sizeof *id, &len);
    case VIA_NONE: return MS_OK;
    }
    return MS_OK;
}

/* ---------------------------------------------------------------- groups */

/* One rank's call as the group exchanges it (as comm_mpi.c's). */
typedef struct desc {
    int32_t kind, dtype, op, root;
    int64_t count;
    uint64_t label_hash;
    char label[MS_COLL_LABEL];
} desc;

typedef struct ngroup {
    ncclComm_t comm;  /* nonblocking; NULL once aborted */
    cudaStream_t stream;
    cudaEvent_t done; /* recorded on stream after the enqueued work, polled by wait_stream */
    double timeout_s; /* the world's: bounds the finalization in ngroup_free */
    int n, rank;
    desc *descs_dev;  /* (n) the exchange's device buffer */
    desc *descs;      /* (n) host copy, pinned: copies into it stay asynchronous, so a rank
                       * that never arrives is caught by the polling, not a blocked memcpy */
    ms_coll *calls;   /* (n) the descriptors as calls, for the agreement */
    void *stage;      /* device staging for cpu tensors and the barrier, stage_cap bytes */
    size_t stage_cap;
    void *p2p_dev;    /* the headers and descriptors a send or receive exchanges, p2p_cap bytes */
    void *p2p_host;   /* their pinned host copy, as descs */
    size_t p2p_cap;
} ngroup;

static void ngroup_free(ngroup *ng) {
    if (!ng) return;
    if (cudaSetDevice(nccl.device) != cudaSuccess) cudaGetLastError();
    /* ncclCommFinalize, polled like any call (settle) up to the world's timeout, then
     * ncclCommDestroy; ncclCommAbort when the finalization fails or does not complete in
     * time, and at once when another communicator of the process was aborted (a peer is
     * gone, and a finalization might wait for it) */
    if (ng->comm) {
        if (!atomic_load(&nccl.aborted) &&
            settle(ng->comm, ncclCommFinalize(ng->comm), ms__now_s() + ng->timeout_s) == ncclSuccess)
            ncclCommDestroy(ng->comm);
        else
            abort_comm(&ng->comm);
    }
    if (ng->done) cudaEventDestroy(ng->done);
    if (ng->stream) {
        cudaStreamSynchronize(ng->stream); /* nothing may still use the buffers */
        cudaStreamDestroy(ng->stream);
    }
    ms__cuda_free(nccl.device, ng->descs_dev);
    ms__cuda_free(nccl.device, ng->stage);
    ms__cuda_free(nccl.device, ng->p2p_dev);
    cudaFreeHost(ng->descs);
    if (ng->p2p_host) cudaFreeHost(ng->p2p_host);
    cudaGetLastError(); /* nothing left to report to */
    free(ng->calls);
    free(ng);
}

/* The group's communicator.  The whole world's: ncclCommInitRankConfig (nonblocking) with
 * rank 0's unique id (share_world_id).  Every other group's: ncclCommSplit of the world's
 * communicator, the group's lowest world rank as the colour.  A split is collective over
 * the whole world, so every rank must ask for its group of the same partition at the same
 * point of its program (a mesh's group(axis) on every rank does exactly that; groups asked
 * for by only some ranks are not possible with NCCL).  Tags make separate communicators, as
 * with the other backends.  A split that fails or does not complete in time aborts both
 * communicators, the world's too: no group can be made after that. */
static ms_status make_comm(ms_world *w, ms_group *g, ngroup *ng) {
    ms_status st;
    if (!w->groups) { /* the whole world, made by ms__world_new before anything else */
        ncclUniqueId id;
        if ((st = share_world_id(&id))) return ms__wrap(st, "nccl world: sharing the unique id");
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        st = nccl_wait(w, &ng->comm, ncclCommInitRankConfig(&ng->comm, ng->n, id, ng->rank, &config),
                       "nccl world: ncclCommInitRank");
        if (st) abort_comm(&ng->comm);
        return st;
    }
    ngroup *world = w->groups->impl;
    if (!world->comm) return ms__fail(MS_ERR_STATE, "nccl backend: the world's communicator was aborted");
    /* the tag keeps groups over the same ranks apart; ranks order by world rank (the key); a
     * NULL config: the new communicator inherits the world's, nonblocking.  NCCL reports the
     * split's progress as the world communicator's state and sets ng->comm once it is done. */
    st = nccl_wait(w, &world->comm,
                   ncclCommSplit(world->comm, g->world_ranks[0] + g->tag * w->size, nccl.rank, &ng->comm, NULL),
                   "nccl backend: ncclCommSplit of the world's communicator");
    if (!st) st = nccl_wait(w, &ng->comm, ncclSuccess, "nccl backend: ncclCommSplit");
    if (st) { /* as NCCL's fault tolerance example does: the parent, then the child if any */
        abort_comm(&world->comm);
        abort_comm(&ng->comm);
    }
    return st;
}

/* A group's communicator, stream, event and buffers, on the rank's communication thread
 * (nccl_group_init); device memory from cuda.c (its stream-ordered pool). */
static ms_status group_init_here(ms_world *w, ms_group *g) {
    ngroup *ng = calloc(1, sizeof *ng);
    if (!ng) return ms__fail(MS_ERR_OOM, "nccl backend: out of memory");
    ng->n = g->n;
    ng->timeout_s = w->timeout_s;
    while (ng->rank < g->n && g->world_ranks[ng->rank] != nccl.rank) ng->rank++;
    ng->calls = calloc((size_t)g->n, sizeof *ng->calls);
    ms_status st = ng->calls ? MS_OK : ms__fail(MS_ERR_OOM, "nccl backend: out of memory");
    cudaError_t e = cudaSuccess;
    if (!st && (e = cudaSetDevice(nccl.device)) == cudaSuccess &&
        (e = cudaStreamCreateWithFlags(&ng->stream, cudaStreamNonBlocking)) == cudaSuccess &&
        (e = cudaEventCreateWithFlags(&ng->done, cudaEventDisableTiming)) == cudaSuccess)
        e = cudaMallocHost((void **)&ng->descs, (size_t)g->n * sizeof(desc));
    if (!st && e != cudaSuccess) st = cuda_err(e, "making a group");
    if (!st) st = ms__cuda_alloc(nccl.device, (int64_t)((size_t)g->n * sizeof(desc)), (void **)&ng->descs_dev);
    if (!st) st = make_comm(w, g, ng);
    if (st) {
        ngroup_free(ng);
        return st;
    }
    g->impl = ng;
    return MS_OK;
}

typedef struct group_call {
    ms_world *w;
    ms_group *g;
} group_call;

static ms_status run_group_init(void *arg) {
    group_call *a = arg;
    return group_init_here(a->w, a->g);
}

/* The world's group is made before anything else, on the creating thread; every other
 * group's split runs on the rank's communication thread, after the collectives queued there
 * (the world's communicator must not be used by two threads at once). */
static ms_status nccl_group_init(ms_world *w, ms_group *g) {
    if (!w->groups) return group_init_here(w, g);
    group_call a = {w, g};
    return ms__async_run(w, nccl.rank, run_group_init, &a);
}

static void nccl_group_free(ms_group *g) {
    ngroup_free(g->impl);
    g->impl = NULL;
}

/* ---------------------------------------------------------------- one collective */

/* The NCCL type of a dtype; bool reduces as u8. */
static ncclDataType_t nccl_type(ms_dtype d) {
    switch (d) {
    case MS_F16: return ncclFloat16;
    case MS_BF16: return ncclBfloat16;
    case MS_F8E4M3: return ncclFloat8e4m3;
    case MS_F8E5M2: return ncclFloat8e5m2;
    case MS_F64: return ncclFloat64;
    case MS_I64: return ncclInt64;
    case MS_I32: return ncclInt32;
    case MS_I8: return ncclInt8;
    case MS_U8:
    case MS_BOOL: return ncclUint8;
    default: return ncclFloat32;
    }
}

/* Reductions are NCCL's own: floating types are summed in their dtype along NCCL's ring or
 * tree, every partial sum rounded (not accumulated in f32 and rounded once as the threads
 * and MPI backends do), and ncclAvg multiplies every value by 1/n rounded to the dtype first
 * (PreMulSum), so with 3 ranks or more results may differ from theirs in the last bits (fp8
 * averages: by up to a rounding of the dtype, 1/n itself being rounded to fp8). */
static ncclRedOp_t nccl_op(ms_op op) {
    switch (op) {
    case MS_OP_AVG: return ncclAvg;
    case MS_OP_MAX: return ncclMax;
    case MS_OP_MIN: return ncclMin;
    default: return ncclSum;
    }
}

/* Waits for the work enqueued on the group's stream through the group's completion event (a
 * cudaEvent_t made with cudaEventDisableTiming), recorded here once the work is enqueued and
 * polled (cudaEventQuery) up to the world's timeout.  A rank that never arrives gives
 * MS_ERR_TIMEOUT and the communicator is aborted (a collective that never completes cannot
 * be taken back), so nothing hangs; an error NCCL reports asynchronously is MS_ERR_PEER and
 * aborts the communicator too (nothing can be assumed of its work after that). */
static ms_status wait_stream(const ms_comm *c, ngroup *ng, const char *where, const char *missing) {
    CUDA_OK("recording the completion event", cudaEventRecord(ng->done, ng->stream));
    const double deadline = ms__now_s() + c->world->timeout_s;
    for (;;) {
        cudaError_t e = cudaEventQuery(ng->done);
        if (e == cudaSuccess) return MS_OK;
        if (e != cudaErrorNotReady) return cuda_err(e, "waiting for a collective");
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(ng->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) { /* nothing can be assumed of its work: abort */
            abort_comm(&ng->comm);
            return ms__fail(MS_ERR_PEER, "%s: NCCL: %s", where, ncclGetErrorString(async));
        }
        if (ms__now_s() > deadline) {
            abort_comm(&ng->comm);
            return ms__fail(MS_ERR_TIMEOUT, "%s: %s within %g s (%s); the group's NCCL communicator was aborted",
                            where, missing, c->world->timeout_s, c->world->timeout_origin);
        }
        nanosleep(&(struct timespec){0, 20000}, NULL);
    }
}

/* wait_stream for a collective: "all_reduce on group [0 1]: not every rank arrived ...". */
static ms_status wait_collective(const ms_comm *c, ngroup *ng, ms_coll_kind kind) {
    ms_msg m = {0};
    ms__msg_where(&m, c, kind);
    return wait_stream(c, ng, m.s, "not every rank arrived");
}

/* The group's calls, all-gathered (an ncclAllGather of the 72-byte descriptors);
 * MS_ERR_MISMATCH (the same message on every rank) unless they agree, so that ranks that
 * disagree get the same error as with threads and MPI instead of a hang or garbage. */
static ms_status agree(const ms_comm *c, ngroup *ng, const ms_coll *call) {
    desc mine = {call->kind, call->dtype, call->op, call->root, call->count, call->label_hash, {0}};
    memcpy(mine.label, call->label, sizeof mine.label);
    CUDA_OK("staging the call's descriptor",
            cudaMemcpyAsync(ng->descs_dev + ng->rank, &mine, sizeof mine, cudaMemcpyHostToDevice, ng->stream));
    ms_status st = nccl_wait(c->world, &ng->comm,
                             ncclAllGather(ng->descs_dev + ng->rank, ng->descs_dev, sizeof(desc), ncclUint8,
                                           ng->comm, ng->stream),
                             "nccl backend: ncclAllGather (the call's descriptor)");
    if (st) return st;
    CUDA_OK("reading the descriptors", cudaMemcpyAsync(ng->descs, ng->descs_dev, (size_t)ng->n * sizeof(desc),
                                                       cudaMemcpyDeviceToHost, ng->stream));
    if ((st = wait_collective(c, ng, (ms_coll_kind)call->kind))) return st;
    for (int i = 0; i < ng->n; i++) {
        const desc *d = &ng->descs[i];
        ng->calls[i] = (ms_coll){.kind = (ms_coll_kind)d->kind, .dtype = (ms_dtype)d->dtype, .op = (ms_op)d->op,
                                 .root = d->root, .count = d->count, .label_hash = d->label_hash};
        memcpy(ng->calls[i].label, d->label, sizeof ng->calls[i].label);
        ng->calls[i].label[MS_COLL_LABEL - 1] = '\0';
    }
    return ms__calls_agree(c, ng->calls, sizeof(ms_coll));
}

/* Elements the call sends and receives on this rank (comm.h's table). */
static void extents(const ms_coll *call, int n, int64_t *send, int64_t *recv) {
    switch (call->kind) {
    case MS_COLL_ALL_GATHER: *send = call->count, *recv = n * call->count; break;
    case MS_COLL_REDUCE_SCATTER: *send = n * call->count, *recv = call->count; break;
    case MS_COLL_BARRIER: *send = *recv = 0; break;
    default: *send = *recv = call->count; break; /* all_reduce, broadcast (in place), all_to_all */
    }
}

/* 1 when p is memory of this rank's device, 0 when it is host memory; MS_ERR_DEVICE for
 * another device's. */
static ms_status on_device(const char *where, const void *p, int *yes) {
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        *yes = 0;
        return MS_OK;
    }
    *yes = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    if (*yes && a.device != nccl.device)
        return ms__fail(MS_ERR_DEVICE, "%s: a tensor on cuda:%d, but this rank's device is cuda:%d", where, a.device,
                        nccl.device);
    return MS_OK;
}

/* ng->stage of at least `need` bytes (the stream is idle: the last call was waited for). */
static ms_status stage_room(ngroup *ng, size_t need) {
    if (need <= ng->stage_cap) return MS_OK;
    ms__cuda_free(nccl.device, ng->stage);
    ng->stage = NULL, ng->stage_cap = 0;
    ms_status st = ms__cuda_alloc(nccl.device, (int64_t)need, &ng->stage);
    if (st) return ms__wrap(st, "nccl backend: the staging of cpu tensors");
    ng->stage_cap = need;
    return MS_OK;
}

/* Device addresses for the call's buffers: CUDA tensors on the rank's device as they are;
 * cpu tensors staged through the group's device buffers, filled from them (so a script
 * written for the threads backend runs unchanged, if slower). */
static ms_status device_buffers(const ms_comm *c, ngroup *ng, const ms_coll *call, const void **send, void **recv,
                                bool *staged) {
    const size_t es = (size_t)ms_dtype_size(call->dtype);
    int64_t ns, nr;
    extents(call, ng->n, &ns, &nr);
    int s_dev = 1, r_dev = 1;
    ms_status st = MS_OK;
    ms_msg where = {0};
    ms__msg_where(&where, c, (ms_coll_kind)call->kind);
    if (call->send && (st = on_device(where.s, call->send, &s_dev))) return st;
    if (call->recv && (st = on_device(where.s, call->recv, &r_dev))) return st;
    *send = call->send, *recv = call->recv, *staged = false;
    size_t need = ((size_t)ns + (size_t)nr) * es + 8; /* + the barrier's element */
    if (s_dev && r_dev && call->kind != MS_COLL_BARRIER) return MS_OK;
    if ((st = stage_room(ng, need))) return st;
    char *stage = ng->stage;
    *recv = stage, *send = stage + (size_t)nr * es, *staged = call->kind != MS_COLL_BARRIER;
    if (call->kind == MS_COLL_BARRIER) return MS_OK;
    if (call->send)
        CUDA_OK("staging a cpu tensor",
                cudaMemcpyAsync((void *)*send, call->send, (size_t)ns * es, cudaMemcpyDefault, ng->stream));
    if (call->recv && (call->kind == MS_COLL_ALL_REDUCE || call->kind == MS_COLL_BROADCAST))
        CUDA_OK("staging a cpu tensor", cudaMemcpyAsync(*recv, call->recv, (size_t)nr * es, cudaMemcpyDefault,
                                                        ng->stream));
    return MS_OK;
}

/* One send or receive of bytes between this rank and peer, in an NCCL group. */
typedef struct xfer {
    int peer;
    bool send;
    void *ptr; /* device memory of the rank's GPU */
    size_t bytes;
} xfer;

/* The transfers as one NCCL group of ncclSend and ncclRecv on the group's stream, in order
 * (those of 0 bytes left out: both sides leave out the same), enqueued and settled
 * (nccl_wait).  what: the call, for messages ("all_to_all"). */
static ms_status enqueue_xfers(const ms_world *w, ngroup *ng, const xfer *x, int n, const char *what) {
    char call[96];
    NCCL_OK("ncclGroupStart", ncclGroupStart());
    ncclResult_t in_group = ncclSuccess; /* the group's first failed call */
    for (int i = 0; i < n && !nccl_failed(in_group); i++) {
        if (!x[i].bytes) continue;
        in_group = x[i].send ? ncclSend(x[i].ptr, x[i].bytes, ncclUint8, x[i].peer, ng->comm, ng->stream)
                             : ncclRecv(x[i].ptr, x[i].bytes, ncclUint8, x[i].peer, ng->comm, ng->stream);
    }
    /* the group is ended, and its end settled, whatever happened in it */
    snprintf(call, sizeof call, "nccl backend: ncclGroupEnd (%s)", what);
    ms_status st = nccl_wait(w, &ng->comm, ncclGroupEnd(), call);
    if (!nccl_failed(in_group)) return st;
    snprintf(call, sizeof call, "nccl backend: ncclSend/ncclRecv (%s)", what);
    return nccl_err(in_group, call);
}

/* The NCCL collective on the group's stream (all_to_all: grouped ncclSend/ncclRecv; barrier: a
 * one-element all-reduce), its enqueueing settled by nccl_wait. */
static ms_status enqueue(const ms_world *w, ngroup *ng, const ms_coll *call, const void *send, void *recv) {
    const ncclDataType_t t = nccl_type(call->dtype);
    const size_t count = (size_t)call->count;
    ncclResult_t r = ncclSuccess;
    const char *what = "";
    switch (call->kind) {
    case MS_COLL_ALL_GATHER:
        what = "nccl backend: ncclAllGather";
        r = ncclAllGather(send, recv, count, t, ng->comm, ng->stream);
        break;
    case MS_COLL_REDUCE_SCATTER:
        what = "nccl backend: ncclReduceScatter";
        r = ncclReduceScatter(send, recv, count, t, nccl_op(call->op), ng->comm, ng->stream);
        break;
    case MS_COLL_ALL_REDUCE:
        what = "nccl backend: ncclAllReduce";
        r = ncclAllReduce(recv, recv, count, t, nccl_op(call->op), ng->comm, ng->stream);
        break;
    case MS_COLL_BROADCAST:
        what = "nccl backend: ncclBroadcast";
        r = ncclBroadcast(recv, recv, count, t, call->root, ng->comm, ng->stream);
        break;
    case MS_COLL_ALL_TO_ALL: {
        const size_t bytes = count / (size_t)ng->n * (size_t)ms_dtype_size(call->dtype);
        xfer *x = malloc(2 * (size_t)ng->n * sizeof *x);
        if (!x) return ms__fail(MS_ERR_OOM, "nccl backend: out of memory for an all_to_all");
        for (int p = 0; p < ng->n; p++) {
            x[2 * p] = (xfer){p, true, (char *)send + p * bytes, bytes};
            x[2 * p + 1] = (xfer){p, false, (char *)recv + p * bytes, bytes};
        }
        ms_status st = enqueue_xfers(w, ng, x, 2 * ng->n, "all_to_all");
        free(x);
        return st;
    }
    case MS_COLL_BARRIER:
        what = "nccl backend: ncclAllReduce (barrier)";
        r = ncclAllReduce(recv, recv, 1, ncclUint8, ncclMax, ng->comm, ng->stream);
        break;
    }
    return nccl_wait(w, &ng->comm, r, what);
}

/* One collective, on the rank's communication thread (nccl_collective): the call's descriptor
 * is all-gathered first (agree), then the NCCL collective runs on the group's own stream
 * (enqueue).  The calling thread waits for each of the two (the descriptors copied back to
 * the host, then the collective) through the group's completion event (wait_stream). */
static ms_status collective_here(ms_comm *c, const ms_coll *call) {
    ngroup *ng = c->group->impl;
    if (!ng->comm) return ms__fail(MS_ERR_STATE, "nccl backend: the group's communicator was aborted");
    CUDA_OK("cudaSetDevice", cudaSetDevice(nccl.device));
    ms_status st = agree(c, ng, call);
    if (st) return st;
    const void *send;
    void *recv;
    bool staged;
    if ((st = device_buffers(c, ng, call, &send, &recv, &staged))) return st;
    if ((st = enqueue(c->world, ng, call, send, recv))) return st;
    if ((st = wait_collective(c, ng, (ms_coll_kind)call->kind))) return st;
    if (staged && call->recv) { /* after the wait: a copy into pageable memory would block on the stream */
        int64_t ns, nr;
        extents(call, ng->n, &ns, &nr);
        const size_t bytes = (size_t)nr * (size_t)ms_dtype_size(call->dtype);
        CUDA_OK("copying a result to a cpu tensor",
                cudaMemcpyAsync(call->recv, recv, bytes, cudaMemcpyDefault, ng->stream));
        CUDA_OK("copying a result to a cpu tensor", cudaStreamSynchronize(ng->stream));
    }
    return MS_OK;
}

/* ---------------------------------------------------------------- point-to-point
 *
 * A batch runs in three NCCL groups of ncclSend/ncclRecv on the group's stream, each with
 * every peer of the batch and waited for (wait_stream): the headers (comm.h: each side's op
 * count and first descriptors), the other descriptors when either side of a pair has more,
 * then, after ms__p2p_agree, the data of the pairs that agree (cpu tensors staged through
 * the GPU).  NCCL keeps the sends and receives between two ranks in order, so the k-th
 * header from a peer is its k-th batch naming this rank.  Unlike on threads and MPI, each
 * step completes for all peers of the batch together: a batch whose peers wait, through
 * other batches, for one another can deadlock (and end in the timeout) here where the
 * other backends go on; a batch that names every peer it exchanges with at that point does
 * not. */

/* The group's header and descriptor buffers (device and pinned host) of at least `need`
 * bytes; their contents are not kept. */
static ms_status p2p_room(ngroup *ng, size_t need) {
    if (need <= ng->p2p_cap) return MS_OK;
    ms__cuda_free(nccl.device, ng->p2p_dev);
    if (ng->p2p_host) cudaFreeHost(ng->p2p_host);
    ng->p2p_dev = ng->p2p_host = NULL, ng->p2p_cap = 0;
    ms_status st = ms__cuda_alloc(nccl.device, (int64_t)need, &ng->p2p_dev);
    if (st) return ms__wrap(st, "nccl backend: the descriptors of a send or receive");
    CUDA_OK("the descriptors of a send or receive", cudaMallocHost(&ng->p2p_host, need));
    ng->p2p_cap = need;
    return MS_OK;
}

/* One exchange of descriptors: this rank's mine_bytes at p2p_host's start go to the peers
 * (mine[i] bytes each, in peer order), the peers' theirs[i] bytes come back after them, and
 * are copied to the host beside them once waited for. */
static ms_status p2p_exchange(const ms_comm *c, ngroup *ng, const ms_p2p_batch *b, const size_t *mine,
                              const size_t *theirs, xfer *x, const char *where, const char *missing) {
    size_t out = 0, in = 0;
    for (int i = 0; i < b->npeers; i++) out += mine[i], in += theirs[i];
    if (!out && !in) return MS_OK;
    char *dev = ng->p2p_dev, *host = ng->p2p_host;
    CUDA_OK("staging descriptors", cudaMemcpyAsync(dev, host, out, cudaMemcpyHostToDevice, ng->stream));
    for (size_t i = 0, o = 0, r = out; i < (size_t)b->npeers; o += mine[i], r += theirs[i], i++) {
        x[2 * i] = (xfer){b->peers[i].peer, true, dev + o, mine[i]};
        x[2 * i + 1] = (xfer){b->peers[i].peer, false, dev + r, theirs[i]};
    }
    ms_status st = enqueue_xfers(c->world, ng, x, 2 * b->npeers, "send/recv");
    if (!st && in)
        st = cudaMemcpyAsync(host + out, dev + out, in, cudaMemcpyDeviceToHost, ng->stream) == cudaSuccess
                 ? MS_OK
                 : cuda_err(cudaGetLastError(), "reading descriptors");
    return st ? st : wait_stream(c, ng, where, missing);
}

/* Where the batch's data lies for NCCL: its own pointer (device memory of the rank's GPU) or
 * an offset into ng->stage (cpu tensors); *stage_bytes the staging needed. */
static ms_status p2p_places(const ms_p2p_batch *b, const char *where, int64_t *offs, size_t *stage_bytes) {
    size_t need = 0;
    for (int i = 0; i < b->n; i++) {
        int dev = 1;
        ms_status st = b->data[i] ? on_device(where, b->data[i], &dev) : MS_OK;
        if (st) return st;
        offs[i] = dev ? -1 : (int64_t)need;
        if (!dev) need += ((size_t)ms__p2p_bytes(&b->descs[i]) + 255) & ~(size_t)255;
    }
    *stage_bytes = need;
    return MS_OK;
}

/* What p2p_here keeps for a batch of n ops with np peers (one calloc but their_descs). */
typedef struct p2p_work {
    size_t *mine, *theirs; /* (np) bytes of descriptors to and from each peer in an exchange */
    int *their_first;      /* (np + 1) where each peer's descriptors start in their_descs */
    bool *agreed;          /* (np) */
    int64_t *offs;         /* (n) where op i lies in ng->stage, -1 when on the device */
    xfer *x;               /* (2 np + n) */
    ms_p2p_desc *their_descs;
} p2p_work;

static p2p_work *p2p_work_new(int n, int np) {
    size_t bytes = sizeof(p2p_work) + (2 * (size_t)np + (size_t)n) * sizeof(xfer) + 2 * (size_t)np * sizeof(size_t) +
                   (size_t)n * sizeof(int64_t) + ((size_t)np + 1) * sizeof(int) + (size_t)np * sizeof(bool);
    p2p_work *w = calloc(1, bytes);
    if (!w) return NULL;
    w->x = (xfer *)(w + 1);
    w->mine = (size_t *)(w->x + 2 * np + n);
    w->theirs = w->mine + np;
    w->offs = (int64_t *)(w->theirs + np);
    w->their_first = (int *)(w->offs + n);
    w->agreed = (bool *)(w->their_first + np + 1);
    return w;
}

/* "send/recv on group [0 1 2] between rank 0 and rank 1" and "rank 1 did not arrive", or for
 * several peers "send/recv on group [0 1 2] from rank 0 with rank 1 and rank 2" and "rank 1
 * or rank 2 did not arrive" (NCCL cannot tell which). */
static void p2p_names(const ms_comm *c, const ms_p2p_batch *b, ms_msg *where, ms_msg *missing) {
    char who[64], group[256];
    const int np = b->npeers;
    if (np == 1) ms__p2p_where(where, c, b->peers[0].peer);
    else ms__msg_add(where, "send/recv on group %s from %s with", ms__group_str(group, sizeof group, c->group->n,
                     c->group->world_ranks), ms__rank_str(who, sizeof who, c, c->rank));
    for (int i = 0; i < np; i++) {
        ms__rank_str(who, sizeof who, c, b->peers[i].peer);
        if (np > 1) ms__msg_add(where, "%s %s", i ? (i + 1 < np ? "," : " and") : "", who);
        ms__msg_add(missing, "%s%s", i ? (i + 1 < np ? ", " : " or ") : "", who);
    }
    ms__msg_add(missing, " did not arrive");
}

/* The headers each way, then the other descriptors where either side of a pair has more:
 * w->their_descs and w->their_first hold the peers' ops with this rank. */
static ms_status p2p_descriptors(const ms_comm *c, ngroup *ng, const ms_p2p_batch *b, p2p_work *w, const char *where,
                                 const char *missing) {
    const int np = b->npeers;
    const size_t hb = sizeof(ms_p2p_header);
    ms_status st = p2p_room(ng, 2 * (size_t)np * hb);
    if (st) return st;
    for (int i = 0; i < np; i++) {
        ms__p2p_header(b, i, (ms_p2p_header *)ng->p2p_host + i);
        w->mine[i] = w->theirs[i] = hb;
    }
    if ((st = p2p_exchange(c, ng, b, w->mine, w->theirs, w->x, where, missing))) return st;
    const ms_p2p_header *h = (const ms_p2p_header *)ng->p2p_host + np;
    int total = 0;
    for (int i = 0; i < np; i++) {
        if (h[i].count < 1) return ms__fail(MS_ERR_INTERNAL, "%s: a header of %d ops came", where, h[i].count);
        w->their_first[i] = total;
        total += h[i].count;
    }
    w->their_first[np] = total;
    if (!(w->their_descs = malloc((size_t)total * sizeof *w->their_descs)))
        return ms__fail(MS_ERR_OOM, "%s: out of memory", where);
    size_t mine_rest = 0;
    bool more = false;
    for (int i = 0; i < np; i++) {
        const int n = h[i].count, mr = b->peers[i].count - MS_P2P_INLINE, tr = n - MS_P2P_INLINE;
        memcpy(w->their_descs + w->their_first[i], h[i].desc,
               (size_t)(n < MS_P2P_INLINE ? n : MS_P2P_INLINE) * sizeof(ms_p2p_desc));
        w->mine[i] = mr > 0 ? (size_t)mr * sizeof(ms_p2p_desc) : 0;
        w->theirs[i] = tr > 0 ? (size_t)tr * sizeof(ms_p2p_desc) : 0;
        mine_rest += w->mine[i];
        more |= mr > 0 || tr > 0;
    }
    if (!more) return MS_OK;
    size_t their_rest = 0;
    for (int i = 0; i < np; i++) their_rest += w->theirs[i];
    if ((st = p2p_room(ng, mine_rest + their_rest))) return st;
    char *host = ng->p2p_host;
    for (int i = 0; i < np; host += w->mine[i], i++)
        memcpy(host, b->descs + b->peers[i].first + MS_P2P_INLINE, w->mine[i]);
    if ((st = p2p_exchange(c, ng, b, w->mine, w->theirs, w->x, where, missing))) return st;
    for (int i = 0; i < np; host += w->theirs[i], i++)
        memcpy(w->their_descs + w->their_first[i] + MS_P2P_INLINE, host, w->theirs[i]);
    return MS_OK;
}

/* The data of the pairs that agree, one NCCL group in op order; cpu tensors staged through
 * ng->stage, the received ones copied back after the wait (a copy into pageable memory
 * would block on the stream). */
static ms_status p2p_data(const ms_comm *c, ngroup *ng, const ms_p2p_batch *b, p2p_work *w, size_t stage_bytes,
                          const char *where, const char *missing) {
    ms_status st = stage_bytes ? stage_room(ng, stage_bytes) : MS_OK;
    int nx = 0;
    for (int i = 0; !st && i < b->npeers; i++)
        for (int k = b->peers[i].first; w->agreed[i] && k < b->peers[i].first + b->peers[i].count; k++) {
            const bool send = b->descs[k].kind == MS_P2P_SEND;
            const size_t bytes = (size_t)ms__p2p_bytes(&b->descs[k]);
            void *ptr = w->offs[k] < 0 ? b->data[k] : (char *)ng->stage + w->offs[k];
            if (send && w->offs[k] >= 0 && bytes)
                CUDA_OK("staging a cpu tensor", cudaMemcpyAsync(ptr, b->data[k], bytes, cudaMemcpyHostToDevice,
                                                                 ng->stream));
            w->x[nx++] = (xfer){b->peers[i].peer, send, ptr, bytes};
        }
    if (st || !nx) return st;
    if ((st = enqueue_xfers(c->world, ng, w->x, nx, "send/recv")) || (st = wait_stream(c, ng, where, missing)))
        return st;
    for (int i = 0; i < b->npeers; i++)
        for (int k = b->peers[i].first; w->agreed[i] && k < b->peers[i].first + b->peers[i].count; k++) {
            const size_t bytes = (size_t)ms__p2p_bytes(&b->descs[k]);
            if (b->descs[k].kind == MS_P2P_RECV && w->offs[k] >= 0 && bytes)
                CUDA_OK("copying a result to a cpu tensor",
                        cudaMemcpyAsync(b->data[k], (char *)ng->stage + w->offs[k], bytes, cudaMemcpyDeviceToHost,
                                        ng->stream));
        }
    CUDA_OK("copying a result to a cpu tensor", cudaStreamSynchronize(ng->stream));
    return MS_OK;
}

static ms_status p2p_here(ms_comm *c, const ms_p2p_batch *b) {
    ngroup *ng = c->group->impl;
    if (!ng->comm) return ms__fail(MS_ERR_STATE, "nccl backend: the group's communicator was aborted");
    CUDA_OK("cudaSetDevice", cudaSetDevice(nccl.device));
    ms_msg where = {0}, missing = {0};
    p2p_names(c, b, &where, &missing);
    p2p_work *w = p2p_work_new(b->n, b->npeers);
    if (!w) return ms__fail(MS_ERR_OOM, "%s: out of memory", where.s);
    size_t stage_bytes = 0;
    ms_first_error first = {0};
    /* the devices first: a tensor on another GPU is refused before this rank joins */
    ms_status st = p2p_places(b, where.s, w->offs, &stage_bytes);
    if (!st) st = p2p_descriptors(c, ng, b, w, where.s, missing.s);
    for (int i = 0; !st && i < b->npeers; i++) {
        const ms_p2p_peer *q = &b->peers[i];
        ms_status agreed = ms__p2p_agree(c, q->peer, b->descs + q->first, q->count,
                                         w->their_descs + w->their_first[i], w->their_first[i + 1] - w->their_first[i]);
        ms__keep_first(&first, agreed);
        w->agreed[i] = !agreed;
    }
    if (!st) st = p2p_data(c, ng, b, w, stage_bytes, where.s, missing.s);
    free(w->their_descs);
    free(w);
    return st ? st : ms__first_error(&first);
}

typedef struct coll_call {
    ms_comm *c;
    const ms_coll *call;        /* a collective, */
    const ms_p2p_batch *batch;  /* or a batch of sends and receives */
} coll_call;

static ms_status run_collective(void *arg) {
    coll_call *a = arg;
    return a->call ? collective_here(a->c, a->call) : p2p_here(a->c, a->batch);
}

/* NCCL forbids using communicators of one device from two threads at once, and wants the
 * operations of different communicators issued in the same order on every rank: every
 * collective (and every split, nccl_group_init) of the process runs on its rank's
 * communication thread (comm_async.c, ms__async_run), in the order the rank queued them.
 * The shard units queue theirs there anyway (they overlap the rank's compute), in the order
 * they were started; a collective asked for on any other thread is queued behind them and
 * waited for. */
static ms_status nccl_collective(ms_comm *c, const ms_coll *call) {
    coll_call a = {c, call, NULL};
    return ms__async_run(c->world, nccl.rank, run_collective, &a);
}

/* A batch of sends and receives, on the communication thread likewise. */
static ms_status nccl_p2p(ms_comm *c, const ms_p2p_batch *batch) {
    coll_call a = {c, NULL, batch};
    return ms__async_run(c->world, nccl.rank, run_collective, &a);
}

static const ms_backend nccl_backend = {
    .name = "nccl",
    .device = MS_DEVICE_CUDA,
    .takes_cpu = true,
    .group_init = nccl_group_init,
    .group_free = nccl_group_free,
    .collective = nccl_collective,
    .p2p = nccl_p2p,
};

ms_status ms_nccl_world_new(ms_world **out, double timeout_s, int *rank) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(rank);
    ms_status st = nccl_start(timeout_s);
    if (st) return st;
    *rank = nccl.rank;
    return ms__world_new(out, &nccl_backend, nccl.size, timeout_s);
}

int ms_nccl_device(void) { return nccl.ready ? nccl.device : -1; }

#endif /* MOONSHARD_HAVE_NCCL */
