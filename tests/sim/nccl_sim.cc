/*
 * nccl_sim.cc: a host simulation of the part of NCCL that moonshard's NCCL backend
 * (core/src/comm_nccl.c) uses, linked in place of libnccl by -DMOONSHARD_CUDA_SIM=ON.  It
 * moves data through the simulated runtime (cudart_sim.cc, sim.h) and checks the calls the
 * way NCCL documents them, so that a misuse that a real cluster punishes with a hang or a
 * wrong result fails here, at once and with a message.
 *
 * The world.  Communicators of one rank only (one process, one GPU): nranks != 1 is
 * ncclInvalidUsage ("simulated NCCL (tests/sim): communicators of one rank only").  A
 * communicator's device is the calling thread's current device when it is made
 * (mssim::current_device()); a split's child has its parent's.  With one rank every
 * collective is a copy: all_gather, broadcast, reduce and all_reduce copy sendbuff to
 * recvbuff (sum, prod, min, max, avg of one value is that value: avg divides by 1, exactly),
 * reduce_scatter copies the rank's block; send/recv to oneself copy the send buffer into the
 * receive buffer.  The copy is a stream operation (mssim::enqueue), so it happens when the
 * stream is waited for, in stream order, like a kernel.
 *
 * Checks, as NCCL makes them (argcheck.cc; the device pointer checks as with
 * NCCL_CHECK_POINTERS=1, and stricter: every buffer must be device memory of the
 * communicator's device covering count x element size).  A bad argument is
 * ncclInvalidArgument and the call has no effect (the user guide's error table); a call on a
 * destroyed or aborted communicator is ncclInvalidArgument too (a registry keeps every handle
 * ever handed out, so a stale one is reported, never dereferenced); a data call on a
 * finalized one is ncclInvalidUsage.  In-place forms are NCCL's (all_gather: sendbuff ==
 * recvbuff + rank*sendcount*size; reduce_scatter: recvbuff == sendbuff + rank*recvcount*size;
 * the others: sendbuff == recvbuff); buffers that overlap otherwise are ncclInvalidArgument
 * (NCCL does not check them: the result would be garbage).
 *
 * Nonblocking communicators (ncclConfig_t blocking = 0), as the user guide describes them:
 * ncclCommInitRankConfig, ncclCommSplit, ncclCommFinalize, a collective outside a group and
 * ncclGroupEnd return ncclInProgress, and the communicator's state (ncclCommGetAsyncError)
 * stays ncclInProgress until it has been polled twice; then it is ncclSuccess (or the error
 * the operation ended with).  Until then the communicator must not be used: any other call
 * on it is ncclInvalidArgument ("Attempt to use communicator before the previous operation
 * returned ncclSuccess", what NCCL's ncclCommEnsureReady answers; always printed to stderr,
 * since a correct program never does it).  A collective's copy is put on its stream only when
 * the state turns ncclSuccess, as NCCL launches in the background: work the caller puts on
 * the stream before that runs first and sees stale data (the guide forbids it).  The
 * exception is the calling thread's per-thread stream (0, cudaStreamPerThread,
 * cudaStreamLegacy), which sim.h ties to the thread that enqueues: its copy is enqueued at
 * the call.  Blocking communicators (no config, blocking = 1, or NCCL_COMM_BLOCKING=1 with
 * blocking left undefined) complete every call at once.
 *
 * ncclCommSplit, as the guide's fault tolerance example and NCCL's source have it: *newcomm
 * is NULL until the split completes; on a nonblocking parent the split's progress is the
 * parent's state (poll the parent), and *newcomm is written when that state turns
 * ncclSuccess (NULL for NCCL_SPLIT_NOCOLOR), the child then ready (ncclSuccess).  A NULL
 * config: the child inherits the parent's blocking mode.  Aborting the parent before the
 * split completes leaves *newcomm NULL.  Colors below -1 are ncclInvalidArgument.
 *
 * ncclCommFinalize marks the communicator finalized (twice: ncclInvalidArgument) and, on a
 * nonblocking one, puts it in ncclInProgress until polled twice.  ncclCommDestroy, as NCCL's:
 * refused (the state returned, the communicator kept) while the state is ncclInProgress or an
 * error, which only ncclCommAbort ends; ncclCommAbort works in any state.
 *
 * Groups.  ncclGroupStart/End nest (a per-thread depth, as NCCL's); calls inside are checked
 * at once (a bad argument is returned by the call and has no effect) and carried out at the
 * outermost ncclGroupEnd, in call order.  There each communicator's sends and receives are
 * paired first in, first out (one rank: they are all to and from oneself); a pair whose count
 * or datatype differ, or that is left unpaired, is ncclInvalidUsage from ncclGroupEnd, and
 * every communicator of the group is left in that error (the guide: dynamic errors apply to
 * the whole group and need ncclCommAbort).  A pair on two streams is ncclInvalidUsage too
 * (a limit of the simulation, which puts each copy on one stream; NCCL would order both).  A
 * send or receive outside a group is ncclInvalidUsage: to oneself it would deadlock NCCL.
 * Blocking and nonblocking communicators in one group: ncclInvalidArgument, as NCCL.
 *
 * Failure injection, for testing the callers' error paths (opt-in; without these variables
 * nothing fails).  N counts from 1, process-wide, in call order:
 *  - MS_SIM_NCCL_ASYNC_ERROR=N: the N-th data call (ncclAllGather, ncclAllReduce,
 *    ncclReduceScatter, ncclBroadcast, ncclReduce, ncclSend, ncclRecv, each counted once it
 *    passed its checks; moonshard makes two per collective, the descriptors' all-gather and
 *    the collective, three for an all_to_all) fails asynchronously, as when a peer is lost
 *    while it runs: it is posted as usual (the call returns ncclSuccess, or ncclInProgress
 *    and then ncclSuccess at the second poll when nonblocking), its copy (and those of its
 *    group on that communicator) never happens, and the next poll of the communicator
 *    (ncclCommGetAsyncError, or any later call on it) finds ncclRemoteError.  NCCL keeps the
 *    error: every later call but ncclCommGetAsyncError and ncclCommAbort returns it,
 *    ncclCommDestroy included.  (The stream itself still completes: sim.h has no operation
 *    that never ends; a caller that waits for the stream and polls NCCL, as comm_nccl.c's
 *    wait_stream does, sees the error if the stream was not yet complete at its first look.)
 *  - MS_SIM_NCCL_ENQUEUE_ERROR=N: the N-th data call fails while it is being posted: on a
 *    nonblocking communicator the state becomes ncclRemoteError (instead of ncclSuccess) at
 *    the second poll; a blocking call returns ncclRemoteError.  The copy never happens; the
 *    error is kept as above.
 *  - MS_SIM_NCCL_HANG=N: the N-th data call never completes, as when a peer never arrives:
 *    the communicator's state stays ncclInProgress until ncclCommAbort, and its copy never
 *    happens.  This is what a timeout path needs without a real hang: a caller that polls
 *    the state (comm_nccl.c's settle) sees ncclInProgress forever.  On a blocking
 *    communicator the call returns ncclSuccess and the state stays ncclInProgress; the
 *    stream itself completes (the lazy stream model has no operation that never ends: a
 *    caller waiting for the stream rather than polling NCCL does not see this hang).
 *  - MS_SIM_NCCL_HANG_INIT=N: the N-th nonblocking communicator creation (ncclCommInitRank
 *    [Config] with blocking = 0, or ncclCommSplit of a nonblocking parent; blocking ones are
 *    not counted) never completes: the new communicator's state, or the split's parent's,
 *    stays ncclInProgress until aborted.
 *  - MS_SIM_NCCL_HANG_FINALIZE=N: the N-th ncclCommFinalize of a nonblocking communicator
 *    never completes.
 * NCCL_DEBUG=WARN (or INFO, TRACE) prints each error's message to stderr, as NCCL does.
 *
 * Thread safety: NCCL may be called from several threads, on several communicators; one
 * mutex guards the registry and every communicator's state.  Group state is per thread, as
 * NCCL's.  Stream operations only copy memory and never call back into NCCL, so enqueueing
 * under the mutex cannot deadlock with the runtime.
 */
#include <nccl.h>

#include "sim.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <strings.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

/* A communicator.  Never freed: a destroyed or aborted one stays in the registry as a
 * tombstone, so that a stale handle is recognized (and its address never reused). */
struct ncclComm {
    enum Life { kLive, kDestroyed, kAborted };
    unsigned long serial; /* creation order, for messages */
    int device, rank, nranks;
    bool blocking;
    Life life;
    bool finalize_called;
    ncclResult_t state; /* ncclSuccess, ncclInProgress, or the error that broke it */
    ncclResult_t late;  /* an error that becomes the state at the next poll (injected) */
    int polls_left;     /* while ncclInProgress: polls until it completes; -1: never (a hang) */
    std::function<ncclResult_t()> finish; /* what completing does; its result is the new state */
};

namespace {

std::mutex lock_; /* guards everything below but the per-thread group state */

/* Every communicator ever made (heap-allocated and never destroyed: usable from other
 * static destructors and atexit handlers). */
std::unordered_set<const ncclComm *> &registry() {
    static auto *r = new std::unordered_set<const ncclComm *>;
    return *r;
}
unsigned long comms_made;

std::string &last_error() {
    static auto *s = new std::string;
    return *s;
}

bool debug_warn() {
    static const bool on = [] {
        const char *v = getenv("NCCL_DEBUG");
        return v && (!strcasecmp(v, "WARN") || !strcasecmp(v, "INFO") || !strcasecmp(v, "TRACE"));
    }();
    return on;
}

/* Records msg as NCCL's last error (printed with NCCL_DEBUG=WARN, or always when loud) and
 * returns r.  Called with lock_ held. */
ncclResult_t fail_v(bool loud, ncclResult_t r, const char *fmt, va_list ap) {
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    last_error() = msg;
    if (loud || debug_warn()) fprintf(stderr, "nccl_sim: NCCL WARN %s\n", msg);
    return r;
}

__attribute__((format(printf, 2, 3))) ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    r = fail_v(false, r, fmt, ap);
    va_end(ap);
    return r;
}

/* A misuse no correct program makes: printed whatever NCCL_DEBUG says. */
__attribute__((format(printf, 2, 3))) ncclResult_t misuse(ncclResult_t r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    r = fail_v(true, r, fmt, ap);
    va_end(ap);
    return r;
}

/* ---------------------------------------------------------------- failure injection */

/* A positive integer from the environment, 0 when unset (or not one: said on stderr). */
long env_nth(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    char *end;
    long n = strtol(v, &end, 10);
    if (*end || n <= 0) {
        fprintf(stderr, "nccl_sim: %s='%s' is not a positive integer; ignored\n", name, v);
        return 0;
    }
    return n;
}

struct Injection {
    long async_error = env_nth("MS_SIM_NCCL_ASYNC_ERROR"), enqueue_error = env_nth("MS_SIM_NCCL_ENQUEUE_ERROR"),
         hang = env_nth("MS_SIM_NCCL_HANG"),
         hang_init = env_nth("MS_SIM_NCCL_HANG_INIT"), hang_finalize = env_nth("MS_SIM_NCCL_HANG_FINALIZE");
    long data_calls = 0, inits = 0, finalizes = 0; /* counted so far (under lock_) */
};

Injection &inject() {
    static auto *i = new Injection;
    return *i;
}

/* ---------------------------------------------------------------- communicators */

ncclComm *new_comm(int device, bool blocking) {
    auto *c = new ncclComm{++comms_made, device, 0, 1, blocking, ncclComm::kLive, false, ncclSuccess, ncclSuccess,
                           0, nullptr};
    registry().insert(c);
    return c;
}

/* comm as a live communicator, or an error (ncclInvalidArgument) naming what it is. */
ncclResult_t check_comm(const ncclComm *comm, const char *call) {
    if (!comm) return fail(ncclInvalidArgument, "%s : comm argument is NULL", call);
    if (!registry().count(comm))
        return misuse(ncclInvalidArgument, "%s : %p is not a communicator (corrupted comm object)", call,
                      (const void *)comm);
    if (comm->life != ncclComm::kLive)
        return misuse(ncclInvalidArgument, "%s : communicator %p (#%lu) was %s; the handle is stale", call,
                      (const void *)comm, comm->serial, comm->life == ncclComm::kDestroyed ? "destroyed" : "aborted");
    return ncclSuccess;
}

/* What NCCL's polling does: an operation in progress advances (and completes at the second
 * poll), an error injected to come after an operation was posted shows. */
void poll_state(ncclComm *comm) {
    if (comm->state == ncclSuccess && comm->late != ncclSuccess) {
        comm->state = comm->late;
        comm->late = ncclSuccess;
    } else if (comm->state == ncclInProgress && comm->polls_left > 0 && --comm->polls_left == 0) {
        auto finish = std::move(comm->finish);
        comm->finish = nullptr;
        comm->state = finish ? finish() : ncclSuccess;
    }
}

/* NCCL's ncclCommEnsureReady (which polls): the communicator's previous operation has
 * completed, without error. */
ncclResult_t ensure_ready(ncclComm *comm, const char *call) {
    if (comm->state != ncclInProgress) poll_state(comm); /* a pending injected error shows */
    if (comm->state == ncclInProgress)
        return misuse(ncclInvalidArgument,
                      "%s : communicator #%lu: Attempt to use communicator before the previous operation returned "
                      "ncclSuccess (its state is ncclInProgress: poll ncclCommGetAsyncError until it is not)",
                      call, comm->serial);
    if (comm->state != ncclSuccess)
        return fail(comm->state, "%s : communicator #%lu is in error state %d (%s); only ncclCommAbort is left",
                    call, comm->serial, (int)comm->state, ncclGetErrorString(comm->state));
    return ncclSuccess;
}

/* Puts comm in ncclInProgress until polled twice (never when hang), finish then run. */
void start_progress(ncclComm *comm, bool hang, std::function<ncclResult_t()> finish) {
    comm->state = ncclInProgress;
    comm->polls_left = hang ? -1 : 2;
    comm->finish = std::move(finish);
}

/* The blocking mode a config asks for: 1 or 0, -1 when the config is not valid. */
int config_blocking(const ncclConfig_t *config, const char *call) {
    int blocking = NCCL_CONFIG_UNDEF_INT;
    if (config) {
        /* the fields users must not touch, set by NCCL_CONFIG_INITIALIZER */
        if (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, blocking) + sizeof(int)) {
            fail(ncclInvalidArgument, "%s : ncclConfig_t was not initialized with NCCL_CONFIG_INITIALIZER "
                 "(magic 0x%x, size %zu)", call, config->magic, config->size);
            return -1;
        }
        blocking = config->blocking;
    }
    if (blocking == NCCL_CONFIG_UNDEF_INT) { /* NCCL_COMM_BLOCKING, else blocking */
        const char *env = getenv("NCCL_COMM_BLOCKING");
        blocking = env && *env ? atoi(env) : 1;
    }
    if (blocking != 0 && blocking != 1) {
        fail(ncclInvalidArgument, "%s : invalid config blocking attribute value %d", call, blocking);
        return -1;
    }
    return blocking;
}

/* ---------------------------------------------------------------- data movement */

size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
    }
}

bool per_thread_stream(cudaStream_t s) { return !s || s == cudaStreamPerThread || s == cudaStreamLegacy; }

/* One call's data movement, as a group or a lone call carries it out. */
struct Op {
    enum Kind { kColl, kSend, kRecv } kind;
    ncclComm *comm;
    cudaStream_t stream;
    void *dst;         /* host addresses (mssim::host_of): kColl, kRecv */
    const void *src;   /* kColl, kSend */
    size_t bytes;
    size_t count;      /* send/recv pairing */
    ncclDataType_t type;
    const char *name;
    long seq;          /* the data call's number (failure injection) */
};

/* A copy to put on a stream. */
struct Move {
    ncclComm *comm;
    cudaStream_t stream;
    void *dst;
    const void *src;
    size_t bytes;
};

ncclResult_t put_on_stream(const Move &m) {
    void *dst = m.dst;
    const void *src = m.src;
    const size_t bytes = m.bytes;
    /* memmove: an in-place call copies a range onto itself */
    cudaError_t e = mssim::enqueue(m.stream, [dst, src, bytes] {
        if (dst != src && bytes) memmove(dst, src, bytes);
    });
    if (e != cudaSuccess)
        return fail(ncclUnhandledCudaError, "Cuda failure '%s' enqueueing on stream %p", cudaGetErrorString(e),
                    (void *)m.stream);
    return ncclSuccess;
}

/* The copies of a nonblocking launch, put on their streams when the first of its
 * communicators completes (NCCL's group job); each communicator's outcome kept. */
struct Job {
    std::vector<Move> moves;
    std::unordered_set<ncclComm *> skip; /* injected failures and hangs: their copies never happen */
    std::unordered_map<ncclComm *, ncclResult_t> outcome;
    bool ran = false;

    void run() {
        if (ran) return;
        ran = true;
        for (const Move &m : moves) {
            if (m.comm->life != ncclComm::kLive || skip.count(m.comm)) continue;
            ncclResult_t r = put_on_stream(m);
            if (r != ncclSuccess) outcome[m.comm] = r;
        }
    }
};

/* Carries out ops (a lone call's, or a group's at its outermost end), on communicators of
 * one blocking mode.  Called with lock_ held. */
ncclResult_t launch(std::vector<Op> &ops, bool blocking) {
    std::vector<ncclComm *> comms; /* those of the launch, in order of first use */
    std::vector<Move> moves;
    std::unordered_map<ncclComm *, std::vector<const Op *>> sends, recvs;
    auto involve = [&](ncclComm *c) {
        for (ncclComm *k : comms)
            if (k == c) return;
        comms.push_back(c);
    };
    ncclResult_t bad = ncclSuccess;
    for (const Op &op : ops) {
        if (op.comm->life != ncclComm::kLive) continue; /* aborted meanwhile (by another thread) */
        involve(op.comm);
        if (op.kind == Op::kColl) {
            moves.push_back({op.comm, op.stream, op.dst, op.src, op.bytes});
            continue;
        }
        /* one rank: every send is to oneself, every receive from oneself; first in, first out */
        auto &mine = op.kind == Op::kSend ? sends[op.comm] : recvs[op.comm];
        auto &other = op.kind == Op::kSend ? recvs[op.comm] : sends[op.comm];
        mine.push_back(&op);
        if (other.empty()) continue;
        const Op *s = op.kind == Op::kSend ? &op : other.front(), *r = op.kind == Op::kRecv ? &op : other.front();
        other.erase(other.begin());
        mine.pop_back();
        if (s->count != r->count || s->type != r->type) {
            bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: ncclSend of %zu elements of type %d "
                       "paired with ncclRecv of %zu elements of type %d (a send and its receive must agree)",
                       op.comm->serial, s->count, (int)s->type, r->count, (int)r->type);
        } else if (s->stream != r->stream && s->bytes) {
            bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: ncclSend on stream %p paired with "
                       "ncclRecv on stream %p: the simulation orders one stream only", op.comm->serial,
                       (void *)s->stream, (void *)r->stream);
        } else {
            moves.push_back({op.comm, r->stream, r->dst, s->src, r->bytes});
        }
    }
    for (ncclComm *c : comms) {
        size_t ns = sends[c].size(), nr = recvs[c].size();
        if (ns || nr)
            bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: %zu ncclSend and %zu ncclRecv left "
                       "unpaired (every send to a rank needs its receive in the same group; to oneself it would "
                       "deadlock)", c->serial, ns, nr);
    }
    if (comms.empty()) return ncclSuccess; /* every communicator was aborted meanwhile */
    if (bad != ncclSuccess) { /* a dynamic error: the whole group, and its communicators, are lost */
        for (ncclComm *c : comms) c->state = bad;
        return bad;
    }

    /* the injected failures, by communicator: a hang, an error while posting, an error after */
    std::unordered_set<ncclComm *> hangs, early, late;
    for (const Op &op : ops) {
        if (op.comm->life != ncclComm::kLive) continue;
        if (op.seq == inject().hang) hangs.insert(op.comm);
        if (op.seq == inject().enqueue_error) early.insert(op.comm);
        if (op.seq == inject().async_error) late.insert(op.comm);
    }
    auto skipped = [&](ncclComm *c) { return hangs.count(c) || early.count(c) || late.count(c); };
    auto lost = [](ncclComm *c, const char *knob) {
        return fail(ncclRemoteError, "communicator #%lu: remote process exited or there was a network error "
                    "(injected by %s)", c->serial, knob);
    };

    if (blocking) {
        ncclResult_t r = ncclSuccess;
        for (const Move &m : moves) {
            if (skipped(m.comm)) continue;
            ncclResult_t e = put_on_stream(m);
            if (e != ncclSuccess) r = e;
        }
        for (ncclComm *c : comms) {
            if (hangs.count(c)) {
                start_progress(c, true, nullptr);
            } else if (early.count(c)) { /* a blocking call reports what failed while posting */
                c->state = r = lost(c, "MS_SIM_NCCL_ENQUEUE_ERROR");
            } else if (late.count(c)) {
                lost(c, "MS_SIM_NCCL_ASYNC_ERROR");
                c->late = ncclRemoteError;
            }
        }
        return r;
    }

    /* nonblocking: the copies go on their streams when the first communicator completes,
     * but those on a per-thread stream now (sim.h ties those to the calling thread) */
    auto job = std::make_shared<Job>();
    ncclResult_t r = ncclInProgress;
    for (const Move &m : moves) {
        if (!per_thread_stream(m.stream)) job->moves.push_back(m);
        else if (!skipped(m.comm) && put_on_stream(m) != ncclSuccess) r = ncclUnhandledCudaError;
    }
    if (r != ncclInProgress) return r;
    for (ncclComm *c : comms) {
        if (skipped(c)) job->skip.insert(c);
        const bool fails_posting = early.count(c) > 0, fails_after = late.count(c) > 0;
        start_progress(c, hangs.count(c) > 0, [job, c, fails_posting, fails_after, lost] {
            job->run();
            if (fails_posting) return lost(c, "MS_SIM_NCCL_ENQUEUE_ERROR");
            if (fails_after) {
                lost(c, "MS_SIM_NCCL_ASYNC_ERROR");
                c->late = ncclRemoteError;
            }
            auto o = job->outcome.find(c);
            return o == job->outcome.end() ? ncclSuccess : o->second;
        });
    }
    return ncclInProgress;
}

/* ---------------------------------------------------------------- groups (per thread) */

thread_local int group_depth;
thread_local int group_blocking = -1; /* the blocking mode of the group's communicators */
thread_local std::vector<Op> group_ops;

/* Checks an op's buffer: device memory of comm's device covering bytes; its host address. */
ncclResult_t device_range(const ncclComm *comm, const char *call, const char *what, const void *p, size_t bytes,
                          void **host) {
    if (!p) return fail(ncclInvalidArgument, "%s : %s argument is NULL", call, what);
    int dev = -1;
    void *h = mssim::host_of(p, bytes, &dev);
    if (!h)
        return fail(ncclInvalidArgument, "%s : %s %p is not a valid pointer (no device allocation holds its %zu "
                    "bytes)", call, what, p, bytes);
    if (dev != comm->device)
        return fail(ncclInvalidArgument, "%s : %s allocated on device %d mismatchs with NCCL device %d", call, what,
                    dev, comm->device);
    *host = h;
    return ncclSuccess;
}

/* What every data call does once its buffers are known: a group keeps the op, a lone call
 * is carried out.  Called with lock_ held. */
ncclResult_t submit(Op op) {
    Injection &inj = inject();
    if (group_depth > 0) {
        const int mode = op.comm->blocking ? 1 : 0;
        if (group_blocking == -1) group_blocking = mode;
        else if (group_blocking != mode)
            return fail(ncclInvalidArgument, "%s : Blocking and nonblocking communicators are not allowed in the "
                        "same group.", op.name);
    } else if (op.kind != Op::kColl) {
        return fail(ncclInvalidUsage, "%s : outside ncclGroupStart/ncclGroupEnd: a send or receive to oneself "
                    "needs its counterpart in the same group (it would deadlock NCCL)", op.name);
    }
    /* a stream that is not live fails now, whenever the copy is put on it */
    cudaError_t e = mssim::enqueue(op.stream, [] {});
    if (e != cudaSuccess)
        return fail(ncclUnhandledCudaError, "%s : Cuda failure '%s' (stream %p)", op.name, cudaGetErrorString(e),
                    (void *)op.stream);
    op.seq = ++inj.data_calls;
    if (group_depth > 0) {
        group_ops.push_back(op);
        return ncclSuccess;
    }
    std::vector<Op> one{op};
    return launch(one, op.comm->blocking);
}

/* The checks of every data call (ncclEnqueueCheck, ArgsCheck), in NCCL's order. */
ncclResult_t check_call(ncclComm *comm, const char *call, ncclDataType_t type, int op, int root) {
    ncclResult_t r = check_comm(comm, call);
    if (r == ncclSuccess) r = ensure_ready(comm, call);
    if (r != ncclSuccess) return r;
    if (comm->finalize_called)
        return fail(ncclInvalidUsage, "%s : communicator #%lu was finalized", call, comm->serial);
    if (root < 0 || root >= comm->nranks)
        return fail(ncclInvalidArgument, "%s : invalid root %d (root should be in the 0..%d range)", call, root,
                    comm->nranks);
    if (type < 0 || type >= ncclNumTypes || !type_size(type))
        return fail(ncclInvalidArgument, "%s : invalid type %d", call, (int)type);
    if (op < 0 || op >= (int)ncclNumOps)
        return fail(ncclInvalidArgument, "%s : invalid reduction operation %d (the simulation has NCCL's "
                    "built-in operations only)", call, op);
    return ncclSuccess;
}

bool overlap(const void *a, size_t na, const void *b, size_t nb) {
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

/* A collective of one rank: recv_bytes copied from the start of sendbuff (send_bytes long)
 * to recvbuff (rank 0's block, where the collective has blocks); in_place is where NCCL's
 * in-place form puts sendbuff. */
ncclResult_t collective(const char *call, const void *sendbuff, size_t send_bytes, void *recvbuff,
                        size_t recv_bytes, const void *in_place, ncclDataType_t type, int op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_call(comm, call, type, op, root);
    if (r != ncclSuccess) return r;
    void *dst = nullptr, *src = nullptr;
    if (recv_bytes) { /* an empty collective is discarded, its buffers unchecked (as NCCL) */
        if ((r = device_range(comm, call, "sendbuff", sendbuff, send_bytes, &src)) != ncclSuccess ||
            (r = device_range(comm, call, "recvbuff", recvbuff, recv_bytes, &dst)) != ncclSuccess)
            return r;
        if (sendbuff != in_place && overlap(sendbuff, send_bytes, recvbuff, recv_bytes))
            return fail(ncclInvalidArgument, "%s : sendbuff %p (%zu bytes) and recvbuff %p (%zu bytes) overlap but "
                        "are not the in-place form (sendbuff %p): NCCL's result would be undefined", call, sendbuff,
                        send_bytes, (void *)recvbuff, recv_bytes, in_place);
    }
    return submit({Op::kColl, comm, stream, dst, src, recv_bytes, 0, type, call, 0});
}

ncclResult_t point_to_point(Op::Kind kind, const char *call, const void *buff, size_t count, ncclDataType_t type,
                            int peer, ncclComm_t comm, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_call(comm, call, type, 0, 0);
    if (r != ncclSuccess) return r;
    if (peer < 0 || peer >= comm->nranks)
        return fail(ncclInvalidArgument, "%s : invalid peer %d (peer should be in the 0..%d range)", call, peer,
                    comm->nranks);
    const size_t bytes = count * type_size(type);
    void *host = nullptr;
    if (bytes) { /* an empty send or receive still pairs, but has no buffer to check */
        r = device_range(comm, call, kind == Op::kSend ? "sendbuff" : "recvbuff", buff, bytes, &host);
        if (r != ncclSuccess) return r;
    }
    Op op{kind, comm, stream, nullptr, nullptr, bytes, count, type, call, 0};
    if (kind == Op::kSend) op.src = host;
    else op.dst = host;
    return submit(op);
}

/* ---------------------------------------------------------------- creation */

ncclResult_t init_rank(ncclComm_t *comm, int nranks, int rank, ncclConfig_t *config, const char *call) {
    std::lock_guard<std::mutex> g(lock_);
    if (!comm) return fail(ncclInvalidArgument, "%s : comm argument is NULL", call);
    *comm = nullptr;
    if (nranks < 1) return fail(ncclInvalidArgument, "%s : invalid device count (%d) requested", call, nranks);
    if (rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "%s : rank %d exceeds ndev=%d", call, rank, nranks);
    if (nranks != 1)
        return fail(ncclInvalidUsage, "simulated NCCL (tests/sim): communicators of one rank only (%s with nranks "
                    "%d)", call, nranks);
    const int blocking = config_blocking(config, call);
    if (blocking < 0) return ncclInvalidArgument;
    ncclComm *c = new_comm(mssim::current_device(), blocking == 1);
    *comm = c; /* at once, also when nonblocking: the caller polls it */
    if (c->blocking) return ncclSuccess;
    const long n = ++inject().inits;
    start_progress(c, n == inject().hang_init, [] { return ncclSuccess; });
    return ncclInProgress;
}

} // namespace

/* ---------------------------------------------------------------- the API */

extern "C" {

ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) {
        std::lock_guard<std::mutex> g(lock_);
        return fail(ncclInvalidArgument, "GetUniqueId : out argument is NULL");
    }
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    for (size_t i = 0; i < sizeof uniqueId->internal; i++) uniqueId->internal[i] = (char)(rng() & 0xff);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
    (void)commId; /* one rank: nobody to meet */
    return init_rank(comm, nranks, rank, config, "ncclCommInitRankConfig");
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    (void)commId;
    return init_rank(comm, nranks, rank, nullptr, "ncclCommInitRank");
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    (void)key; /* one rank: the order within the new communicator is trivial */
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommSplit");
    if (r != ncclSuccess) return r;
    if (!newcomm) return fail(ncclInvalidArgument, "ncclCommSplit : newcomm argument is NULL");
    if ((r = ensure_ready(comm, "ncclCommSplit")) != ncclSuccess) return r;
    *newcomm = nullptr; /* NCCL: NULL until the split fully completes */
    if (comm->finalize_called)
        return fail(ncclInvalidUsage, "ncclCommSplit : communicator #%lu was finalized", comm->serial);
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR)
        return fail(ncclInvalidArgument, "ncclCommSplit : color %d must be non-negative or NCCL_SPLIT_NOCOLOR",
                    color);
    int blocking = comm->blocking ? 1 : 0; /* a NULL config: the parent's */
    if (config && (blocking = config_blocking(config, "ncclCommSplit")) < 0) return ncclInvalidArgument;
    const int device = comm->device;
    auto make_child = [newcomm, color, device, blocking]() -> ncclResult_t {
        if (color != NCCL_SPLIT_NOCOLOR) *newcomm = new_comm(device, blocking == 1);
        return ncclSuccess;
    };
    if (comm->blocking) return make_child();
    /* the split's progress is the parent's state; *newcomm is written as it completes */
    const long n = ++inject().inits;
    start_progress(comm, n == inject().hang_init, make_child);
    return ncclInProgress;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommFinalize");
    if (r == ncclSuccess) r = ensure_ready(comm, "ncclCommFinalize");
    if (r != ncclSuccess) return r;
    if (comm->finalize_called)
        return fail(ncclInvalidArgument, "ncclCommFinalize : communicator #%lu was finalized already", comm->serial);
    comm->finalize_called = true;
    if (comm->blocking) return ncclSuccess;
    const long n = ++inject().finalizes;
    start_progress(comm, n == inject().hang_finalize, [] { return ncclSuccess; });
    return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommDestroy");
    /* as NCCL's: a communicator whose last operation is in progress or failed is kept (only
     * ncclCommAbort frees it) */
    if (r == ncclSuccess) r = ensure_ready(comm, "ncclCommDestroy");
    if (r != ncclSuccess) return r;
    comm->life = ncclComm::kDestroyed; /* implicitly finalized: one rank, nothing to wait for */
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommAbort");
    if (r != ncclSuccess) return r;
    /* any state: what was in progress never completes (a split's child is never made, a
     * collective's copy never happens) */
    comm->life = ncclComm::kAborted;
    comm->finish = nullptr;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommGetAsyncError");
    if (r != ncclSuccess) return r;
    if (!asyncError) return fail(ncclInvalidArgument, "ncclGetAsyncError : asyncError argument is NULL");
    poll_state(comm);
    *asyncError = comm->state;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* NCCL's last error is process-wide (comm unused); a per-thread copy keeps the returned
 * string stable while other threads fail. */
const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    static thread_local char copy[1024];
    std::lock_guard<std::mutex> g(lock_);
    snprintf(copy, sizeof copy, "%s", last_error().c_str());
    return copy;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "CommCount");
    if (r == ncclSuccess && !count) r = fail(ncclInvalidArgument, "CommCount : count argument is NULL");
    if (r == ncclSuccess) r = ensure_ready(comm, "CommCount");
    if (r == ncclSuccess) *count = comm->nranks;
    return r;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "CommCuDevice");
    if (r == ncclSuccess && !device) r = fail(ncclInvalidArgument, "CommCuDevice : devid argument is NULL");
    if (r == ncclSuccess) r = ensure_ready(comm, "CommCuDevice");
    if (r == ncclSuccess) *device = comm->device;
    return r;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "CommUserRank");
    if (r == ncclSuccess && !rank) r = fail(ncclInvalidArgument, "CommUserRank : rank argument is NULL");
    if (r == ncclSuccess) r = ensure_ready(comm, "CommUserRank");
    if (r == ncclSuccess) *rank = comm->rank;
    return r;
}

/* The collectives, one rank each: the element counts NCCL's header gives them.  The rank is
 * always 0 (so rank * count offsets vanish), nranks always 1. */

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    const size_t b = sendcount * type_size(datatype);
    /* recvbuff holds nranks blocks; in place: sendbuff is recvbuff's block rank */
    return collective("AllGather", sendbuff, b, recvbuff, b, recvbuff, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    const size_t b = recvcount * type_size(datatype);
    /* sendbuff holds nranks blocks, recvbuff gets block rank; in place: recvbuff is that
     * block of sendbuff, i.e. sendbuff == recvbuff - rank * b */
    return collective("ReduceScatter", sendbuff, b, recvbuff, b, recvbuff, datatype, (int)op, 0, comm, stream);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    const size_t b = count * type_size(datatype);
    return collective("AllReduce", sendbuff, b, recvbuff, b, recvbuff, datatype, (int)op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    const size_t b = count * type_size(datatype);
    return collective("Broadcast", sendbuff, b, recvbuff, b, recvbuff, datatype, ncclSum, root, comm, stream);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
    return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    const size_t b = count * type_size(datatype);
    /* one rank is the root: recvbuff is needed */
    return collective("Reduce", sendbuff, b, recvbuff, b, recvbuff, datatype, (int)op, root, comm, stream);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return point_to_point(Op::kSend, "Send", sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return point_to_point(Op::kRecv, "Recv", recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    std::lock_guard<std::mutex> g(lock_);
    if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: not in a group call.");
    if (--group_depth > 0) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(group_ops);
    const int blocking = group_blocking;
    group_blocking = -1;
    if (ops.empty()) return ncclSuccess;
    return launch(ops, blocking == 1);
}

} // extern "C"
