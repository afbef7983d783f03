/*
 * nccl_sim.cc: a host simulation of the part of NCCL that moonshard's NCCL backend
 * (core/src/comm_nccl.c) uses, linked in place of libnccl by -DMOONSHARD_CUDA_SIM=ON.  It
 * moves data through the simulated runtime (cudart_sim.cc, sim.h) and checks the calls the
 * way NCCL documents them, so that a misuse that a real cluster punishes with a hang or a
 * wrong result fails here, at once and with a message.
 *
 * The world.  Communicators of one or several ranks, one rank a process of this machine (as
 * torchrun or mpirun start them; each process has its own simulated devices, MS_SIM_DEVICES).
 * A communicator is its ncclUniqueId (ncclGetUniqueId: random bytes, which the ranks
 * exchange themselves); its device is the calling thread's current device when it is made
 * (mssim::current_device()); a split's child has its parent's.  One rank is the degenerate
 * case of the same code.
 *
 * Shared memory.  Ranks meet in POSIX shared memory, one segment per contribution (see
 * "shared memory" below): "/mssim-KEY-TAG-RANK", KEY 32 hex digits of the unique id (a split
 * child's: a hash of its parent's, the split's number and the colour), TAG the exchange.
 * The writer creates it once (O_EXCL), fills it, marks it ready; readers map it once it is
 * ready and count themselves; the last reader unlinks it.  No locks: a rank that dies holds
 * nothing up but its own contributions, which its peers then never find.
 *  - Init (ncclCommInitRank[Config]): every rank publishes "init-RANK" with its nranks; the
 *    communicator is ready when all nranks are there (a rank number taken twice, or ranks
 *    that disagree on nranks, is ncclInvalidUsage).  Blocking: the call waits as long as it
 *    takes; nonblocking: the state is ncclInProgress until polled twice and all are there.
 *  - ncclCommSplit is collective over the parent and numbered with its collectives: every
 *    rank publishes (color, key); the child's ranks are those of its colour ordered by key,
 *    then parent rank, as NCCL documents.
 *  - Every collective is a gated stream operation (mssim::enqueue_gated) numbered per
 *    communicator in call order: when the stream reaches it, it publishes this rank's send
 *    buffer (as it is at that point of the stream), then completes at the first try that
 *    finds every contribution it needs: all_gather, all_reduce, reduce_scatter every rank's;
 *    broadcast the root's (only the root publishes); reduce: the root reads every rank's, the
 *    others complete once they published.  Until then the stream stops there: a query of an
 *    event behind it says cudaErrorNotReady, a blocking wait waits, as on a GPU.  Ranks whose
 *    calls disagree (collective, count, type, op, root) abort the process with a message:
 *    NCCL would hang or produce garbage.
 *  - A group's sends and receives on one communicator are one gated operation: every send
 *    published at once ("p<from>.<to>.<k>", the k-th from one to the other), every receive
 *    copied when its send shows up.
 * Reductions, in NCCL's arithmetic: integers in their type, wrapping (avg: the sum divided,
 * truncating, NCCL's SumPostDiv); floating types in their own type, every partial result
 * rounded to it (to nearest, ties to even; beyond the largest finite: inf, NaN for e4m3),
 * the ranks taken around a ring that starts at a different rank for each element (NCCL's
 * ring or tree sets the order; the tests may not depend on it); avg is NCCL's PreMulSum:
 * every rank's value multiplied by 1/nranks rounded to the type, then summed that way.
 * So bf16, f16 and fp8 results may differ in their last bits from one rounding of the
 * exact value once there are 3 ranks or more, as NCCL's do.
 * Peer death: a dead peer's contributions never come, so the survivors' streams stay not
 * ready and their timeouts fire; ncclCommAbort returns at once, makes the communicator's
 * pending stream operations complete without effect (the streams go on, as NCCL's abort
 * kills its kernels), and unlinks this rank's unread segments and the peers' segments of
 * the collectives it had not completed.  Segments a crashed run leaves behind are never met
 * again (names from random ids).
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
 * (NCCL does not check them: the result would be garbage).  A broadcast's sendbuff is checked
 * on the root only, a reduce's recvbuff too.
 *
 * Nonblocking communicators (ncclConfig_t blocking = 0), as the user guide describes them:
 * ncclCommInitRankConfig, ncclCommSplit, ncclCommFinalize, a collective outside a group and
 * ncclGroupEnd return ncclInProgress, and the communicator's state (ncclCommGetAsyncError)
 * stays ncclInProgress until it has been polled twice (init and split: and every peer's
 * record is there); then it is ncclSuccess (or the error the operation ended with).  Until
 * then the communicator must not be used: any other call on it is ncclInvalidArgument
 * ("Attempt to use communicator before the previous operation returned ncclSuccess", what
 * NCCL's ncclCommEnsureReady answers; always printed to stderr, since a correct program
 * never does it).  A collective's operation is put on its stream only when the state turns
 * ncclSuccess, as NCCL launches in the background: work the caller puts on the stream
 * before that runs first and sees stale data (the guide forbids it).  The exception is the
 * calling thread's per-thread stream (0, cudaStreamPerThread, cudaStreamLegacy), which
 * sim.h ties to the thread that enqueues: its operation is enqueued at the call.  Blocking
 * communicators (no config, blocking = 1, or NCCL_COMM_BLOCKING=1 with blocking left
 * undefined) complete every call at once (init and split once every peer's record is
 * there).
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
 * outermost ncclGroupEnd, in call order.  What one rank can check alone it checks there: its
 * sends to itself and receives from itself pair first in, first out, and a pair whose count
 * or datatype differ, or one left unpaired, is ncclInvalidUsage from ncclGroupEnd, every
 * communicator of the group then left in that error (the guide: dynamic errors apply to the
 * whole group and need ncclCommAbort).  A communicator's sends and receives of one group on
 * two streams are ncclInvalidUsage too (a limit of the simulation, which makes them one
 * stream operation).  A send to or receive from oneself outside a group is ncclInvalidUsage:
 * it would deadlock NCCL.  Blocking and nonblocking communicators in one group:
 * ncclInvalidArgument, as NCCL.
 *
 * Failure injection, for testing the callers' error paths (opt-in; without these variables
 * nothing fails).  N counts from 1, process-wide, in call order:
 *  - MS_SIM_NCCL_ASYNC_ERROR=N: the N-th data call (ncclAllGather, ncclAllReduce,
 *    ncclReduceScatter, ncclBroadcast, ncclReduce, ncclSend, ncclRecv, each counted once it
 *    passed its checks; moonshard makes two per collective, the descriptors' all-gather and
 *    the collective, three for an all_to_all) fails asynchronously, as when a peer is lost
 *    while it runs: it is posted as usual (the call returns ncclSuccess, or ncclInProgress
 *    and then ncclSuccess at the second poll when nonblocking), its stream operation (and
 *    those of its group on that communicator) is never put on the stream, and the next poll
 *    of the communicator
 *    (ncclCommGetAsyncError, or any later call on it) finds ncclRemoteError.  NCCL keeps the
 *    error: every later call but ncclCommGetAsyncError and ncclCommAbort returns it,
 *    ncclCommDestroy included.  (The stream itself still completes; a caller that waits for
 *    the stream and polls NCCL, as comm_nccl.c's wait_stream does, sees the error if the
 *    stream was not yet complete at its first look.)
 *  - MS_SIM_NCCL_ENQUEUE_ERROR=N: the N-th data call fails while it is being posted: on a
 *    nonblocking communicator the state becomes ncclRemoteError (instead of ncclSuccess) at
 *    the second poll; a blocking call returns ncclRemoteError.  The operation never happens;
 *    the error is kept as above.
 *  - MS_SIM_NCCL_HANG=N: the N-th data call never completes, as when a peer never arrives:
 *    it is posted as usual (the state turns ncclSuccess), but its gated stream operation (and
 *    those of its group on that communicator) never publishes nor completes until
 *    ncclCommAbort: queries of the stream say cudaErrorNotReady forever, a blocking wait
 *    for it hangs (as on a GPU).
 *  - MS_SIM_NCCL_HANG_INIT=N: the N-th nonblocking communicator creation (ncclCommInitRank
 *    [Config] with blocking = 0, or ncclCommSplit of a nonblocking parent; blocking ones are
 *    not counted) never completes: the new communicator's state, or the split's parent's,
 *    stays ncclInProgress until aborted.
 *  - MS_SIM_NCCL_HANG_FINALIZE=N: the N-th ncclCommFinalize of a nonblocking communicator
 *    never completes.
 * NCCL_DEBUG=WARN (or INFO, TRACE) prints each error's message to stderr, as NCCL does;
 * INFO (or TRACE) also a line for each communicator destroyed or aborted, as NCCL's INFO
 * lines "comm ... - Destroy COMPLETE" and "- Abort COMPLETE" (an abort's saying how long the
 * communicator's ncclCommFinalize had been in progress, when one was).
 *
 * Thread safety: NCCL may be called from several threads, on several communicators; one
 * mutex guards the registry and every communicator's state.  Group state is per thread, as
 * NCCL's.  Stream operations never take that mutex (they share only a Channel: segment
 * names and atomics with their communicator), so enqueueing under it cannot deadlock with
 * the runtime; a blocking rendezvous waits with the mutex released.
 */
#include <nccl.h>

#include "sim.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <strings.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

/* What a communicator's stream operations share with it (they may run after the handle was
 * aborted, on any thread): the names of its shared-memory segments and the abort switch. */
struct Channel {
    std::string key; /* the stem of its segments' names: 32 hex digits from the unique id */
    int rank, nranks;
    std::atomic<bool> aborted{false}; /* ncclCommAbort: every pending operation gives up */
    std::atomic<uint64_t> done{0};    /* the last collective this rank completed (ncclCommAbort's sweep) */
    std::mutex m;                     /* mine */
    std::vector<std::string> mine;    /* segments this rank published that may be unread: unlinked at abort */
    Channel(std::string k, int r, int n) : key(std::move(k)), rank(r), nranks(n) {}
};

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
    int polls_left;     /* while ncclInProgress: polls until it may complete; -1: never (a hang) */
    std::function<bool()> ready;          /* and then what it waits for (the peers of a rendezvous) */
    std::function<ncclResult_t()> finish; /* what completing does; its result is the new state */
    std::shared_ptr<Channel> ch;
    uint64_t coll_seq;                    /* collectives and splits posted: each one's number */
    std::vector<uint64_t> sent, received; /* sends to / receives from each peer posted so far */
    std::chrono::steady_clock::time_point finalized_at; /* when ncclCommFinalize was called */
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

bool debug_info() {
    static const bool on = [] {
        const char *v = getenv("NCCL_DEBUG");
        return v && (!strcasecmp(v, "INFO") || !strcasecmp(v, "TRACE"));
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

/* ---------------------------------------------------------------- shared memory */

/* Every exchange between ranks goes through segments of POSIX shared memory, one a rank's
 * contribution: "/mssim-KEY-TAG-RANK" (KEY the communicator's, TAG the exchange's: "init",
 * "c7" for its 7th collective or split, "p2.5" a send from rank 2 to the receiver of that
 * name, with its number).  The writer creates it (O_EXCL: a name is written once), writes a
 * header and the data, and sets `ready` last; a reader opens it when it is there and ready,
 * reads, and counts itself in `readers`; the reader that makes the count what the writer
 * asked for unlinks the name.  Lock-free, so that a rank that dies at any point blocks
 * nobody: its peers just never find what it did not publish. */
struct SegHeader {
    std::atomic<uint32_t> ready;   /* 1 once header and data are written */
    std::atomic<uint32_t> readers; /* ranks that have read it */
    uint32_t readers_expected;
    int32_t rank;                  /* the writer's */
    uint64_t bytes;                /* of data */
    int32_t kind, type, op, root;  /* what the writer called, for the agreement check */
    uint64_t count;
};
constexpr size_t kDataOffset = 64;
static_assert(sizeof(SegHeader) <= kDataOffset, "the header fits before the data");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "atomics in shared memory must be lock-free");

std::string seg_name(const Channel &ch, const std::string &tag, int rank) {
    return "/mssim-" + ch.key + "-" + tag + "-" + std::to_string(rank);
}

/* Publishes data (bytes) under name for `readers` ranks; 0, or the errno (EEXIST: the name
 * was published already). */
int publish(Channel &ch, const std::string &name, const void *data, size_t bytes, uint32_t readers,
            const SegHeader &info) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return errno;
    const size_t len = kDataOffset + bytes;
    /* reserved now: a full /dev/shm is an error here rather than a SIGBUS at the copy */
    int e = posix_fallocate(fd, 0, (off_t)len);
    void *m = MAP_FAILED;
    if (!e && (m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) e = errno;
    close(fd);
    if (e) {
        shm_unlink(name.c_str());
        return e;
    }
    auto *h = static_cast<SegHeader *>(m); /* zero-filled: the atomics start at 0 */
    h->readers_expected = readers, h->rank = ch.rank, h->bytes = bytes;
    h->kind = info.kind, h->type = info.type, h->op = info.op, h->root = info.root, h->count = info.count;
    if (bytes) memcpy(static_cast<char *>(m) + kDataOffset, data, bytes);
    h->ready.store(1, std::memory_order_release);
    munmap(m, len);
    std::lock_guard<std::mutex> g(ch.m);
    ch.mine.push_back(name);
    if (ch.mine.size() > 512) { /* forget those read (unlinked) since */
        std::vector<std::string> keep;
        for (const std::string &n : ch.mine) {
            int f = shm_open(n.c_str(), O_RDONLY, 0);
            if (f >= 0) keep.push_back(n), close(f);
        }
        ch.mine.swap(keep);
    }
    return 0;
}

/* A peer's contribution, mapped for reading once it is complete. */
struct Seg {
    std::string name;
    void *map = nullptr;
    size_t len = 0;
    const SegHeader *h() const { return static_cast<const SegHeader *>(map); }
    const char *data() const { return static_cast<const char *>(map) + kDataOffset; }
    Seg() = default;
    Seg(const Seg &) = delete;
    Seg &operator=(const Seg &) = delete;
    ~Seg() {
        if (map) munmap(map, len);
    }

    /* Maps name if it is there and complete (true; at once when mapped already). */
    bool open(const std::string &n) {
        if (map) return true;
        int fd = shm_open(n.c_str(), O_RDWR, 0);
        if (fd < 0) return false; /* not yet (or never: a peer that died) */
        struct stat st;
        void *m = MAP_FAILED;
        if (fstat(fd, &st) == 0 && (size_t)st.st_size >= kDataOffset)
            m = mmap(nullptr, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (m == MAP_FAILED) return false;
        auto *hd = static_cast<SegHeader *>(m);
        if (!hd->ready.load(std::memory_order_acquire) || kDataOffset + hd->bytes > (size_t)st.st_size) {
            munmap(m, (size_t)st.st_size);
            return false;
        }
        name = n, map = m, len = (size_t)st.st_size;
        return true;
    }

    /* Done with it: counted as a reader (the last one unlinks the name), unmapped. */
    void release() {
        if (!map) return;
        auto *hd = static_cast<SegHeader *>(map);
        if (hd->readers.fetch_add(1, std::memory_order_acq_rel) + 1 == hd->readers_expected)
            shm_unlink(name.c_str());
        munmap(map, len);
        map = nullptr;
    }
};

/* The unique id's first 16 bytes as hex: random (ncclGetUniqueId), so that two runs, or a
 * run after a crashed one that left segments behind, never meet. */
std::string key_of(const ncclUniqueId &id) {
    static const char hex[] = "0123456789abcdef";
    std::string k;
    for (int i = 0; i < 16; i++) {
        const unsigned char b = (unsigned char)id.internal[i];
        k += hex[b >> 4], k += hex[b & 15];
    }
    return k;
}

/* A split child's key: a hash of the parent's, the split's number and the colour (every
 * member computes the same, nobody else does). */
std::string child_key(const std::string &parent, uint64_t seq, int color) {
    const std::string s = parent + "/" + std::to_string(seq) + "/" + std::to_string(color);
    ncclUniqueId id{};
    uint64_t h[2] = {1469598103934665603ULL, 0x9e3779b97f4a7c15ULL}; /* FNV-1a, two seeds */
    for (uint64_t &x : h)
        for (unsigned char c : s) x = (x ^ c) * 1099511628211ULL;
    memcpy(id.internal, h, sizeof h);
    return key_of(id);
}

/* Fatal: a mismatch between ranks NCCL would answer with a hang or garbage. */
[[noreturn]] __attribute__((format(printf, 1, 2))) void peer_mismatch(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("nccl_sim: ranks disagree: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

[[noreturn]] void shm_fatal(const std::string &name, int e) {
    fprintf(stderr, "nccl_sim: cannot publish shared memory %s: %s\n", name.c_str(), strerror(e));
    abort();
}

/* One small record from every rank (the init's rendezvous, a split's colours and keys):
 * this rank's published at once, the others' mapped as they come. */
struct Rendezvous {
    std::shared_ptr<Channel> ch;
    std::string tag;
    std::vector<Seg> segs;
    Rendezvous(std::shared_ptr<Channel> c, std::string t) : ch(std::move(c)), tag(std::move(t)), segs(ch->nranks) {}
    bool all_there() {
        for (int q = 0; q < ch->nranks; q++)
            if (!segs[q].open(seg_name(*ch, tag, q))) return false;
        return true;
    }
    const SegHeader &of(int q) const { return *segs[q].h(); }
    void release() {
        for (Seg &s : segs) s.release();
    }
};

/* ---------------------------------------------------------------- communicators */

/* A communicator of rank ch->rank of ch->nranks. */
ncclComm *new_comm(int device, bool blocking, std::shared_ptr<Channel> ch) {
    auto *c = new ncclComm{++comms_made, device, ch->rank, ch->nranks, blocking, ncclComm::kLive, false, ncclSuccess,
                           ncclSuccess, 0, nullptr, nullptr, ch, 0, {}, {}, {}};
    c->sent.assign((size_t)ch->nranks, 0);
    c->received.assign((size_t)ch->nranks, 0);
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
 * poll, or at the first poll after that which finds what it waits for: the peers of a
 * rendezvous), an error injected to come after an operation was posted shows. */
void poll_state(ncclComm *comm) {
    if (comm->state == ncclSuccess && comm->late != ncclSuccess) {
        comm->state = comm->late;
        comm->late = ncclSuccess;
    } else if (comm->state == ncclInProgress && comm->polls_left > 0) {
        if (comm->polls_left > 1) {
            comm->polls_left--;
            return;
        }
        if (comm->ready && !comm->ready()) return;
        comm->polls_left = 0;
        comm->ready = nullptr;
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

/* Puts comm in ncclInProgress until polled twice (never when hang) and ready() (when given)
 * says yes; finish then runs. */
void start_progress(ncclComm *comm, bool hang, std::function<ncclResult_t()> finish,
                    std::function<bool()> ready = nullptr) {
    comm->state = ncclInProgress;
    comm->polls_left = hang ? -1 : 2;
    comm->ready = std::move(ready);
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

/* ---- reductions, in NCCL's arithmetic (the header's "Reductions") */

/* A binary floating format narrower than float: bits of exponent and mantissa, bias, and
 * whether the all-ones exponent is inf/NaN (IEEE) or, as in e4m3 ("fn"), only S.1111.111
 * is NaN and there is no inf. */
struct Mini {
    int ebits, mbits, bias;
    bool ieee;
};
constexpr Mini kF16{5, 10, 15, true}, kBF16{8, 7, 127, true}, kE4M3{4, 3, 7, false}, kE5M2{5, 2, 15, true};

double mini_decode(Mini f, uint32_t bits) {
    const uint32_t emax = (1u << f.ebits) - 1, mmask = (1u << f.mbits) - 1;
    const uint32_t e = bits >> f.mbits & emax, m = bits & mmask;
    double v;
    if (f.ieee && e == emax) v = m ? NAN : INFINITY;
    else if (!f.ieee && e == emax && m == mmask) v = NAN;
    else if (e == 0) v = ldexp((double)m, 1 - f.bias - f.mbits);
    else v = ldexp((double)(m | (1u << f.mbits)), (int)e - f.bias - f.mbits);
    return bits >> (f.ebits + f.mbits) & 1 ? -v : v;
}

/* Rounded to nearest even; beyond the largest finite: inf (IEEE formats), NaN (e4m3). */
uint32_t mini_encode(Mini f, double v) {
    const uint32_t sign = std::signbit(v) ? 1u << (f.ebits + f.mbits) : 0;
    const uint32_t emax = (1u << f.ebits) - 1, mmask = (1u << f.mbits) - 1;
    const uint32_t nan = f.ieee ? emax << f.mbits | 1u << (f.mbits - 1) : emax << f.mbits | mmask;
    const uint32_t inf = f.ieee ? emax << f.mbits : nan;
    if (std::isnan(v)) return sign | nan;
    const double a = fabs(v);
    if (std::isinf(a)) return sign | inf;
    const int top = f.ieee ? (int)emax - 1 : (int)emax; /* the largest finite's exponent field */
    const uint32_t top_m = f.ieee ? mmask : mmask - 1;
    const double max = ldexp((double)(top_m | (1u << f.mbits)), top - f.bias - f.mbits);
    int e;
    frexp(a, &e);
    int ue = std::max(e - 1, 1 - f.bias); /* the exponent of a's quantum; subnormals share the least */
    const double r = ldexp(std::nearbyint(ldexp(a, f.mbits - ue)), ue - f.mbits);
    if (r > max) return sign | inf;
    if (r == 0) return sign;
    frexp(r, &e);
    ue = e - 1;
    if (ue < 1 - f.bias) return sign | (uint32_t)ldexp(r, f.bias - 1 + f.mbits); /* subnormal */
    return sign | (uint32_t)(ue + f.bias) << f.mbits | ((uint32_t)ldexp(r, f.mbits - ue) & mmask);
}

double load_float(ncclDataType_t t, const char *p) {
    switch (t) {
    case ncclFloat64: { double v; memcpy(&v, p, 8); return v; }
    case ncclFloat32: { float v; memcpy(&v, p, 4); return v; }
    case ncclFloat16: { uint16_t b; memcpy(&b, p, 2); return mini_decode(kF16, b); }
    case ncclBfloat16: { uint16_t b; memcpy(&b, p, 2); return mini_decode(kBF16, b); }
    case ncclFloat8e4m3: return mini_decode(kE4M3, (unsigned char)*p);
    default: return mini_decode(kE5M2, (unsigned char)*p);
    }
}

void store_float(ncclDataType_t t, char *p, double v) {
    switch (t) {
    case ncclFloat64: memcpy(p, &v, 8); break;
    case ncclFloat32: { float f = (float)v; memcpy(p, &f, 4); break; }
    case ncclFloat16: { uint16_t b = (uint16_t)mini_encode(kF16, v); memcpy(p, &b, 2); break; }
    case ncclBfloat16: { uint16_t b = (uint16_t)mini_encode(kBF16, v); memcpy(p, &b, 2); break; }
    case ncclFloat8e4m3: *p = (char)mini_encode(kE4M3, v); break;
    default: *p = (char)mini_encode(kE5M2, v); break;
    }
}

/* v rounded to type t (through its bits). */
double round_to(ncclDataType_t t, double v) {
    char b[8];
    store_float(t, b, v);
    return load_float(t, b);
}

template <class T> void reduce_int(int op, const std::vector<const char *> &in, char *out, size_t count) {
    using U = std::make_unsigned_t<T>; /* wrapping arithmetic, no signed overflow */
    const size_t n = in.size();
    for (size_t i = 0; i < count; i++) {
        T acc;
        memcpy(&acc, in[0] + i * sizeof(T), sizeof(T));
        for (size_t q = 1; q < n; q++) {
            T v;
            memcpy(&v, in[q] + i * sizeof(T), sizeof(T));
            switch (op) {
            case ncclProd: acc = (T)(U)((U)acc * (U)v); break;
            case ncclMax: acc = v > acc ? v : acc; break;
            case ncclMin: acc = v < acc ? v : acc; break;
            default: acc = (T)(U)((U)acc + (U)v); break; /* sum, avg */
            }
        }
        if (op == ncclAvg) acc = (T)(acc / (T)n);
        memcpy(out + i * sizeof(T), &acc, sizeof(T));
    }
}

/* out[i] = op over the ranks' in[q][i]; out may be one of the inputs' memory only if it is
 * not among in (the inputs are the published copies). */
void reduce(ncclDataType_t t, int op, const std::vector<const char *> &in, char *out, size_t count) {
    switch (t) {
    case ncclInt8: return reduce_int<int8_t>(op, in, out, count);
    case ncclUint8: return reduce_int<uint8_t>(op, in, out, count);
    case ncclInt32: return reduce_int<int32_t>(op, in, out, count);
    case ncclUint32: return reduce_int<uint32_t>(op, in, out, count);
    case ncclInt64: return reduce_int<int64_t>(op, in, out, count);
    case ncclUint64: return reduce_int<uint64_t>(op, in, out, count);
    default: break;
    }
    const size_t es = type_size(t), n = in.size();
    const double scale = op == ncclAvg ? round_to(t, 1.0 / (double)n) : 1.0; /* PreMulSum's scalar */
    for (size_t i = 0; i < count; i++) {
        const size_t first = i % n; /* the ring's start for this element */
        double acc = 0;
        for (size_t k = 0; k < n; k++) {
            double v = load_float(t, in[(first + k) % n] + i * es);
            if (op == ncclAvg) v = round_to(t, v * scale);
            if (k == 0) {
                acc = v;
                continue;
            }
            switch (op) {
            case ncclProd: acc = round_to(t, acc * v); break;
            case ncclMax: acc = v > acc ? v : acc; break;
            case ncclMin: acc = v < acc ? v : acc; break;
            default: acc = round_to(t, acc + v); break; /* sum, avg */
            }
        }
        store_float(t, out + i * es, acc);
    }
}

/* One call's data movement, as a group or a lone call carries it out. */
struct Op {
    enum Kind { kColl, kSend, kRecv } kind;
    enum Coll { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kReduce } coll;
    ncclComm *comm;
    cudaStream_t stream;
    void *dst;         /* host addresses (mssim::host_of); null where this rank has none */
    const void *src;
    size_t send_bytes, recv_bytes;
    size_t count;      /* the call's element count */
    ncclDataType_t type;
    int redop, root;   /* collectives; peer: send/recv */
    int peer;
    const char *name;
    long seq;          /* the data call's number (failure injection) */
};

const char *coll_name(int c) {
    static const char *const names[] = {"AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Reduce"};
    return c >= 0 && c < 5 ? names[c] : "?";
}

/* A collective as a gated stream operation (mssim::enqueue_gated): its first try publishes
 * this rank's contribution (segment c<seq>-<rank>: the send buffer as it is at that point of
 * the stream, copied); every try maps what the peers have published so far; the try that
 * finds every contribution it needs writes the result, releases them and completes.  Until
 * then the stream stops there, and queries say cudaErrorNotReady.  Once the communicator is
 * aborted it completes at once, doing nothing (as NCCL's abort kills its kernels); a hang
 * (MS_SIM_NCCL_HANG) never publishes nor completes until then. */
struct CollTask {
    std::shared_ptr<Channel> ch;
    Op op;
    uint64_t seq;
    bool hang;
    bool published = false;
    std::vector<Seg> segs;

    bool publishes() const { return op.coll != Op::kBroadcast || ch->rank == op.root; }
    bool reads(int q) const {
        switch (op.coll) {
        case Op::kBroadcast: return q == op.root;
        case Op::kReduce: return ch->rank == op.root;
        default: return true;
        }
    }

    bool step() {
        if (ch->aborted.load()) return true;
        if (hang) return false;
        const std::string tag = "c" + std::to_string(seq);
        if (!published) {
            SegHeader info{};
            info.kind = op.coll, info.type = op.type, info.op = op.redop, info.root = op.root, info.count = op.count;
            const uint32_t readers = op.coll == Op::kReduce ? 1 : (uint32_t)ch->nranks;
            if (publishes()) {
                const std::string name = seg_name(*ch, tag, ch->rank);
                if (int e = publish(*ch, name, op.src, op.send_bytes, readers, info)) shm_fatal(name, e);
            }
            published = true;
            segs = std::vector<Seg>(ch->nranks);
        }
        for (int q = 0; q < ch->nranks; q++)
            if (reads(q) && !segs[q].open(seg_name(*ch, tag, q))) return false;
        std::vector<const char *> in;
        for (int q = 0; q < ch->nranks; q++) {
            if (!reads(q)) continue;
            const SegHeader &h = *segs[q].h();
            if (h.kind != op.coll || h.type != op.type || h.count != op.count ||
                (op.coll != Op::kAllGather && h.root != op.root) || h.op != op.redop)
                peer_mismatch("collective #%llu of a communicator: rank %d called %s(count %zu, type %d, op %d, root "
                              "%d), rank %d %s(count %llu, type %d, op %d, root %d)", (unsigned long long)seq,
                              ch->rank, coll_name(op.coll), op.count, (int)op.type, op.redop, op.root, q,
                              coll_name(h.kind), (unsigned long long)h.count, h.type, h.op, h.root);
            in.push_back(segs[q].data());
        }
        const size_t es = type_size(op.type);
        char *dst = static_cast<char *>(op.dst);
        switch (op.coll) {
        case Op::kAllGather: {
            const size_t block = op.recv_bytes / (size_t)ch->nranks;
            for (int q = 0; q < ch->nranks; q++) memcpy(dst + (size_t)q * block, in[q], block);
            break;
        }
        case Op::kBroadcast: memcpy(dst, in[0], op.recv_bytes); break;
        case Op::kReduceScatter:
            for (const char *&p : in) p += (size_t)ch->rank * op.count * es;
            reduce(op.type, op.redop, in, dst, op.count);
            break;
        case Op::kAllReduce: reduce(op.type, op.redop, in, dst, op.count); break;
        case Op::kReduce:
            if (ch->rank == op.root) reduce(op.type, op.redop, in, dst, op.count);
            break;
        }
        for (Seg &s : segs) s.release();
        uint64_t d = ch->done.load();
        while (d < seq && !ch->done.compare_exchange_weak(d, seq)) {
        }
        return true;
    }
};

/* A communicator's sends and receives of one group (one stream), as one gated operation:
 * every send published at the first try (segment p<from>.<to>.<k> for the k-th send from
 * one rank to the other), every receive copied as its send shows up; done when all are.
 * One operation, so that a rank's send to itself and the receive of it cannot wait for
 * each other on one stream, and a group's sends never wait for its receives. */
struct P2PTask {
    struct Side {
        int peer;
        uint64_t k;
        const Op *op;
        bool done;
    };
    std::shared_ptr<Channel> ch;
    std::vector<Op> ops; /* the group's sends and receives on this communicator */
    std::vector<Side> sends, recvs;
    bool hang;
    bool published = false;

    static std::string tag(int from, int to, uint64_t k) {
        return "p" + std::to_string(from) + "." + std::to_string(to) + "." + std::to_string(k);
    }

    bool step() {
        if (ch->aborted.load()) return true;
        if (hang) return false;
        if (!published) {
            for (const Side &s : sends) {
                SegHeader info{};
                info.kind = -1, info.type = s.op->type, info.count = s.op->count;
                const std::string name = seg_name(*ch, tag(ch->rank, s.peer, s.k), ch->rank);
                if (int e = publish(*ch, name, s.op->src, s.op->send_bytes, 1, info)) shm_fatal(name, e);
            }
            published = true;
        }
        bool all = true;
        for (Side &r : recvs) {
            if (r.done) continue;
            Seg seg;
            if (!seg.open(seg_name(*ch, tag(r.peer, ch->rank, r.k), r.peer))) {
                all = false;
                continue;
            }
            const SegHeader &h = *seg.h();
            if (h.type != r.op->type || h.count != r.op->count)
                peer_mismatch("ncclRecv of %zu elements of type %d on rank %d from rank %d paired with its ncclSend "
                              "of %llu elements of type %d", r.op->count, (int)r.op->type, ch->rank, r.peer,
                              (unsigned long long)h.count, h.type);
            if (h.bytes) memcpy(r.op->dst, seg.data(), h.bytes);
            seg.release();
            r.done = true;
        }
        return all;
    }
};

/* A gated operation to put on a stream. */
struct Task {
    ncclComm *comm;
    cudaStream_t stream;
    std::function<bool()> step;
};

ncclResult_t put_on_stream(const Task &t) {
    cudaError_t e = mssim::enqueue_gated(t.stream, t.step);
    if (e != cudaSuccess)
        return fail(ncclUnhandledCudaError, "Cuda failure '%s' enqueueing on stream %p", cudaGetErrorString(e),
                    (void *)t.stream);
    return ncclSuccess;
}

/* The operations of a nonblocking launch, put on their streams when the first of its
 * communicators completes (NCCL's group job); each communicator's outcome kept. */
struct Job {
    std::vector<Task> tasks;
    std::unordered_set<ncclComm *> skip; /* injected failures: their operations never happen */
    std::unordered_map<ncclComm *, ncclResult_t> outcome;
    bool ran = false;

    void run() {
        if (ran) return;
        ran = true;
        for (const Task &t : tasks) {
            if (t.comm->life != ncclComm::kLive || skip.count(t.comm)) continue;
            ncclResult_t r = put_on_stream(t);
            if (r != ncclSuccess) outcome[t.comm] = r;
        }
    }
};

/* Carries out ops (a lone call's, or a group's at its outermost end), on communicators of
 * one blocking mode.  Called with lock_ held. */
ncclResult_t launch(std::vector<Op> &ops, bool blocking) {
    std::vector<ncclComm *> comms; /* those of the launch, in order of first use */
    std::unordered_map<ncclComm *, std::vector<const Op *>> p2p;
    auto involve = [&](ncclComm *c) {
        for (ncclComm *k : comms)
            if (k == c) return;
        comms.push_back(c);
    };
    ncclResult_t bad = ncclSuccess;
    for (const Op &op : ops) {
        if (op.comm->life != ncclComm::kLive) continue; /* aborted meanwhile (by another thread) */
        involve(op.comm);
        if (op.kind != Op::kColl) p2p[op.comm].push_back(&op);
    }
    /* the checks a rank can make alone: its sends to itself and receives from itself paired
     * first in, first out, agreeing; all of a communicator's on one stream */
    for (ncclComm *c : comms) {
        std::vector<const Op *> self_sends, self_recvs;
        for (const Op *op : p2p[c]) {
            if (op->stream != p2p[c].front()->stream && (op->send_bytes || op->recv_bytes))
                bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: sends and receives on streams %p and "
                           "%p: the simulation puts a group's sends and receives on one stream", c->serial,
                           (void *)p2p[c].front()->stream, (void *)op->stream);
            if (op->peer != c->rank) continue;
            auto &mine = op->kind == Op::kSend ? self_sends : self_recvs;
            auto &other = op->kind == Op::kSend ? self_recvs : self_sends;
            if (other.empty()) {
                mine.push_back(op);
                continue;
            }
            const Op *s = op->kind == Op::kSend ? op : other.front(), *r = op->kind == Op::kRecv ? op : other.front();
            other.erase(other.begin());
            if (s->count != r->count || s->type != r->type)
                bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: ncclSend of %zu elements of type %d "
                           "paired with ncclRecv of %zu elements of type %d (a send and its receive must agree)",
                           c->serial, s->count, (int)s->type, r->count, (int)r->type);
        }
        if (!self_sends.empty() || !self_recvs.empty())
            bad = fail(ncclInvalidUsage, "ncclGroupEnd : communicator #%lu: %zu ncclSend and %zu ncclRecv to and from "
                       "rank %d itself left unpaired (every send to a rank needs its receive in the same group; to "
                       "oneself it would deadlock)", c->serial, self_sends.size(), self_recvs.size(), c->rank);
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
    auto skipped = [&](ncclComm *c) { return early.count(c) || late.count(c); };
    auto lost = [](ncclComm *c, const char *knob) {
        return fail(ncclRemoteError, "communicator #%lu: remote process exited or there was a network error "
                    "(injected by %s)", c->serial, knob);
    };

    /* the stream operations, numbered now, in call order (as every rank posts them) */
    std::vector<Task> tasks;
    for (const Op &op : ops) {
        /* an empty collective (the same count on every rank) has nothing to exchange */
        if (op.comm->life != ncclComm::kLive || op.kind != Op::kColl || !op.recv_bytes) continue;
        auto t = std::make_shared<CollTask>(
            CollTask{op.comm->ch, op, ++op.comm->coll_seq, hangs.count(op.comm) > 0, false, {}});
        tasks.push_back({op.comm, op.stream, [t] { return t->step(); }});
    }
    for (ncclComm *c : comms) {
        if (p2p[c].empty()) continue;
        auto t = std::make_shared<P2PTask>();
        t->ch = c->ch, t->hang = hangs.count(c) > 0;
        t->ops.reserve(p2p[c].size());
        for (const Op *op : p2p[c]) t->ops.push_back(*op);
        for (const Op &op : t->ops) {
            if (op.kind == Op::kSend) t->sends.push_back({op.peer, c->sent[(size_t)op.peer]++, &op, false});
            else t->recvs.push_back({op.peer, c->received[(size_t)op.peer]++, &op, false});
        }
        tasks.push_back({c, p2p[c].front()->stream, [t] { return t->step(); }});
    }

    if (blocking) {
        ncclResult_t r = ncclSuccess;
        for (const Task &t : tasks) {
            if (skipped(t.comm)) continue;
            ncclResult_t e = put_on_stream(t);
            if (e != ncclSuccess) r = e;
        }
        for (ncclComm *c : comms) {
            if (early.count(c)) { /* a blocking call reports what failed while posting */
                c->state = r = lost(c, "MS_SIM_NCCL_ENQUEUE_ERROR");
            } else if (late.count(c)) {
                lost(c, "MS_SIM_NCCL_ASYNC_ERROR");
                c->late = ncclRemoteError;
            }
        }
        return r;
    }

    /* nonblocking: the operations go on their streams when the first communicator completes,
     * but those on a per-thread stream now (sim.h ties those to the calling thread) */
    auto job = std::make_shared<Job>();
    ncclResult_t r = ncclInProgress;
    for (const Task &t : tasks) {
        if (!per_thread_stream(t.stream)) job->tasks.push_back(t);
        else if (!skipped(t.comm) && put_on_stream(t) != ncclSuccess) r = ncclUnhandledCudaError;
    }
    if (r != ncclInProgress) return r;
    for (ncclComm *c : comms) {
        if (skipped(c)) job->skip.insert(c);
        const bool fails_posting = early.count(c) > 0, fails_after = late.count(c) > 0;
        start_progress(c, false, [job, c, fails_posting, fails_after, lost] {
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
    } else if (op.kind != Op::kColl && op.peer == op.comm->rank) {
        return fail(ncclInvalidUsage, "%s : outside ncclGroupStart/ncclGroupEnd: a send or receive to oneself "
                    "needs its counterpart in the same group (it would deadlock NCCL)", op.name);
    }
    /* a stream that is not live fails now, whenever the operation is put on it */
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

/* A collective of count elements (NCCL's count argument: a block, where the collective has
 * one a rank).  A broadcast's sendbuff is the root's only, a reduce's recvbuff too: the
 * other ranks' are not checked (NCCL ignores them). */
ncclResult_t collective(Op::Coll coll, const char *call, const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t type, int op, int root, ncclComm_t comm, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_call(comm, call, type, op, root);
    if (r != ncclSuccess) return r;
    const size_t b = count * type_size(type), n = (size_t)comm->nranks, rank = (size_t)comm->rank;
    /* what this rank sends and receives; in_place: where NCCL's in-place form has sendbuff
     * (all_gather: recvbuff's block rank; reduce_scatter: recvbuff is sendbuff's block rank) */
    size_t send_bytes = b, recv_bytes = b;
    const void *in_place = recvbuff;
    if (coll == Op::kAllGather) recv_bytes = b * n, in_place = (const char *)recvbuff + rank * b;
    if (coll == Op::kReduceScatter) send_bytes = b * n, in_place = (const char *)recvbuff - rank * b;
    const bool uses_send = coll != Op::kBroadcast || comm->rank == root;
    const bool uses_recv = coll != Op::kReduce || comm->rank == root;
    void *dst = nullptr, *src = nullptr;
    if (recv_bytes) { /* an empty collective is discarded, its buffers unchecked (as NCCL) */
        if ((uses_send && (r = device_range(comm, call, "sendbuff", sendbuff, send_bytes, &src)) != ncclSuccess) ||
            (uses_recv && (r = device_range(comm, call, "recvbuff", recvbuff, recv_bytes, &dst)) != ncclSuccess))
            return r;
        if (uses_send && uses_recv && sendbuff != in_place && overlap(sendbuff, send_bytes, recvbuff, recv_bytes))
            return fail(ncclInvalidArgument, "%s : sendbuff %p (%zu bytes) and recvbuff %p (%zu bytes) overlap but "
                        "are not the in-place form (sendbuff %p): NCCL's result would be undefined", call, sendbuff,
                        send_bytes, (void *)recvbuff, recv_bytes, in_place);
    }
    Op o{};
    o.kind = Op::kColl, o.coll = coll, o.comm = comm, o.stream = stream, o.dst = dst, o.src = src;
    o.send_bytes = uses_send ? send_bytes : 0, o.recv_bytes = recv_bytes, o.count = count, o.type = type;
    o.redop = op, o.root = root, o.name = call;
    return submit(o);
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
    Op op{};
    op.kind = kind, op.comm = comm, op.stream = stream, op.count = count, op.type = type, op.peer = peer;
    op.name = call;
    if (kind == Op::kSend) op.src = host, op.send_bytes = bytes;
    else op.dst = host, op.recv_bytes = bytes;
    return submit(op);
}

/* ---------------------------------------------------------------- creation */

/* Waits, lk released, until ready() says yes (a blocking communicator's rendezvous: NCCL's
 * blocking calls wait for the peers as long as it takes). */
void block_until(std::unique_lock<std::mutex> &lk, const std::function<bool()> &ready) {
    while (!ready()) {
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        lk.lock();
    }
}

/* The rendezvous of init: every rank publishes (nranks, rank) as "init-RANK" of the id's
 * key; the communicator is ready when all nranks records are there.  A rank number taken
 * twice is caught by the name (published once only). */
ncclResult_t init_rank(ncclComm_t *comm, int nranks, const ncclUniqueId &id, int rank, ncclConfig_t *config,
                       const char *call) {
    std::unique_lock<std::mutex> lk(lock_);
    if (!comm) return fail(ncclInvalidArgument, "%s : comm argument is NULL", call);
    *comm = nullptr;
    if (nranks < 1) return fail(ncclInvalidArgument, "%s : invalid device count (%d) requested", call, nranks);
    if (rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "%s : rank %d exceeds ndev=%d", call, rank, nranks);
    const int blocking = config_blocking(config, call);
    if (blocking < 0) return ncclInvalidArgument;
    auto ch = std::make_shared<Channel>(key_of(id), rank, nranks);
    SegHeader info{};
    info.count = (uint64_t)nranks;
    const std::string name = seg_name(*ch, "init", rank);
    if (int e = publish(*ch, name, nullptr, 0, (uint32_t)nranks, info))
        return e == EEXIST ? fail(ncclInvalidUsage, "%s : rank %d of this unique id's communicator was taken "
                                  "already (by another process, or an earlier init)", call, rank)
                           : fail(ncclSystemError, "%s : shared memory %s: %s", call, name.c_str(), strerror(e));
    auto rv = std::make_shared<Rendezvous>(ch, "init");
    ncclComm *c = new_comm(mssim::current_device(), blocking == 1, ch);
    auto finish = [rv, c, call]() -> ncclResult_t {
        ncclResult_t r = ncclSuccess;
        for (int q = 0; q < c->nranks; q++)
            if (rv->of(q).count != (uint64_t)c->nranks)
                r = fail(ncclInvalidUsage, "%s : rank %d asked for %d ranks, rank %d for %llu", call, c->rank,
                         c->nranks, q, (unsigned long long)rv->of(q).count);
        rv->release();
        return r;
    };
    *comm = c; /* at once, also when nonblocking: the caller polls it */
    if (c->blocking) {
        block_until(lk, [rv] { return rv->all_there(); });
        return c->state = finish();
    }
    const long n = ++inject().inits;
    start_progress(c, n == inject().hang_init, finish, [rv] { return rv->all_there(); });
    return ncclInProgress;
}

} // namespace

/* ---------------------------------------------------------------- the API */

extern "C" {

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
    return init_rank(comm, nranks, commId, rank, config, "ncclCommInitRankConfig");
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return init_rank(comm, nranks, commId, rank, nullptr, "ncclCommInitRank");
}

/* Collective over the parent, numbered with its collectives: every rank publishes (color,
 * key) as the parent's collective "c<seq>"; once all are there the members of each colour
 * are ordered by key, then parent rank, and the child's segments are named from a hash of
 * the parent's key, the split's number and the colour. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    std::unique_lock<std::mutex> lk(lock_);
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
    const uint64_t seq = ++comm->coll_seq;
    std::shared_ptr<Channel> ch = comm->ch;
    const std::string tag = "c" + std::to_string(seq);
    SegHeader info{};
    info.kind = -2, info.root = color, info.op = key; /* a split's record: colour and key */
    const std::string name = seg_name(*ch, tag, ch->rank);
    if (int e = publish(*ch, name, nullptr, 0, (uint32_t)ch->nranks, info))
        return fail(ncclSystemError, "ncclCommSplit : shared memory %s: %s", name.c_str(), strerror(e));
    auto rv = std::make_shared<Rendezvous>(ch, tag);
    auto make_child = [rv, ch, seq, newcomm, color, device, blocking]() -> ncclResult_t {
        std::vector<std::pair<int, int>> members; /* (key, parent rank) of my colour */
        for (int q = 0; q < ch->nranks; q++) {
            if (rv->of(q).kind != -2)
                peer_mismatch("ncclCommSplit, the parent's operation #%llu on rank %d, met rank %d's %s",
                              (unsigned long long)seq, ch->rank, q, coll_name(rv->of(q).kind));
            if (rv->of(q).root == color) members.emplace_back(rv->of(q).op, q);
        }
        rv->release();
        if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
        std::sort(members.begin(), members.end());
        int me = 0;
        while (members[(size_t)me].second != ch->rank) me++;
        auto child = std::make_shared<Channel>(child_key(ch->key, seq, color), me, (int)members.size());
        *newcomm = new_comm(device, blocking == 1, child);
        return ncclSuccess;
    };
    if (comm->blocking) {
        block_until(lk, [rv, ch] { return ch->aborted.load() || rv->all_there(); });
        if (ch->aborted.load()) return ncclSuccess; /* aborted by another thread: no child */
        return make_child();
    }
    /* the split's progress is the parent's state; *newcomm is written as it completes */
    const long n = ++inject().inits;
    start_progress(comm, n == inject().hang_init, make_child, [rv] { return rv->all_there(); });
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
    comm->finalized_at = std::chrono::steady_clock::now();
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
    comm->life = ncclComm::kDestroyed; /* implicitly finalized (the simulation's finalize waits for nobody) */
    if (debug_info())
        fprintf(stderr, "nccl_sim: NCCL INFO comm #%lu rank %d nRanks %d - Destroy COMPLETE\n", comm->serial,
                comm->rank, comm->nranks);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    std::lock_guard<std::mutex> g(lock_);
    ncclResult_t r = check_comm(comm, "ncclCommAbort");
    if (r != ncclSuccess) return r;
    if (debug_info()) {
        char finalizing[96] = "";
        if (comm->finalize_called && comm->state == ncclInProgress)
            snprintf(finalizing, sizeof finalizing, " (its ncclCommFinalize in progress for %.3f s)",
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - comm->finalized_at).count());
        fprintf(stderr, "nccl_sim: NCCL INFO comm #%lu rank %d nRanks %d - Abort COMPLETE%s\n", comm->serial,
                comm->rank, comm->nranks, finalizing);
    }
    /* any state, at once, never waiting for a peer: what was in progress never completes (a
     * split's child is never made), the stream operations still pending give up (the
     * streams go on), and this rank's segments that no peer has read yet are unlinked */
    comm->life = ncclComm::kAborted;
    comm->finish = nullptr;
    comm->ready = nullptr;
    comm->ch->aborted.store(true);
    std::vector<std::string> mine;
    {
        std::lock_guard<std::mutex> m(comm->ch->m);
        mine.swap(comm->ch->mine);
    }
    for (const std::string &n : mine) shm_unlink(n.c_str());
    /* and what peers published for the collectives this rank has not completed (the last 64
     * at most): a peer that died leaves its contribution behind, nobody else will read it */
    const uint64_t posted = comm->coll_seq;
    for (uint64_t s = std::max(comm->ch->done.load() + 1, posted > 64 ? posted - 63 : 1); s <= posted; s++)
        for (int q = 0; q < comm->nranks; q++) shm_unlink(seg_name(*comm->ch, "c" + std::to_string(s), q).c_str());
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

/* The collectives: the element counts NCCL's header gives them. */

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    return collective(Op::kAllGather, "AllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return collective(Op::kReduceScatter, "ReduceScatter", sendbuff, recvbuff, recvcount, datatype, (int)op, 0, comm,
                      stream);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return collective(Op::kAllReduce, "AllReduce", sendbuff, recvbuff, count, datatype, (int)op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    return collective(Op::kBroadcast, "Broadcast", sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    return collective(Op::kReduce, "Reduce", sendbuff, recvbuff, count, datatype, (int)op, root, comm, stream);
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
