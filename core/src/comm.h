/*
 * comm.h: the internal interface between the public collectives (comm.c) and the backends
 * that move the data (comm_threads.c, comm_mpi.c, comm_nccl.c).
 *
 * comm.c owns everything backend-independent: the world and its refcount, the timeout, the
 * per-rank "done" flags, the registry of groups, the checks of a call's tensors on the
 * calling rank and the poisoning of a comm after a failed collective.  A backend is a
 * small table of function pointers (ms_backend) that creates the shared state of a group
 * and runs one already-checked collective, described by a plain struct (ms_coll).
 */
#ifndef MS_COMM_H
#define MS_COMM_H

#include "ms_internal.h"

#include <pthread.h>

typedef enum ms_coll_kind {
    MS_COLL_ALL_GATHER = 0,
    MS_COLL_REDUCE_SCATTER = 1,
    MS_COLL_ALL_REDUCE = 2,
    MS_COLL_BROADCAST = 3,
    MS_COLL_ALL_TO_ALL = 4,
    MS_COLL_BARRIER = 5
} ms_coll_kind;

/* "all_gather", "reduce_scatter", ... */
const char *ms__coll_name(ms_coll_kind kind);

/* One rank's collective call after comm.c has checked it.  Every field but the two
 * pointers must be equal on all ranks of the group (the backends compare them).
 *   kind            send (elements)       recv (elements)      count is
 *   all_gather      count                 n * count            in numel
 *   reduce_scatter  n * count             count                out numel
 *   all_reduce      = recv                count                numel
 *   broadcast       = recv                count                numel
 *   all_to_all      count                 count                in numel (n divides it)
 *   barrier         NULL                  NULL                 0
 * Pointers are NULL when their tensor has no elements.  In place: all_gather's send is
 * recv + rank * count elements or disjoint from recv; reduce_scatter's recv is send +
 * rank * count elements or disjoint from send; all_to_all's never overlap. */
enum { MS_COLL_LABEL = 40 };

typedef struct ms_coll {
    ms_coll_kind kind;
    ms_dtype dtype;
    ms_op op;       /* reduce_scatter and all_reduce; MS_OP_SUM otherwise */
    int root;       /* broadcast: group rank of the source; 0 otherwise */
    int64_t count;
    /* Who issued it: FNV-1a of the shard unit's name (0 for the rank's own calls), so that
     * ranks gathering different units of one layout disagree instead of mixing them; and
     * the name's tail, for messages.  Set by comm.c from ms__coll_label. */
    uint64_t label_hash;
    char label[MS_COLL_LABEL];
    const void *send;
    void *recv;
} ms_coll;

/* The name the collectives this thread calls next are labelled with (a shard unit's, set
 * around its collectives by unit.c); NULL for none. */
extern _Thread_local const char *ms__coll_label;
/* Fills call's label_hash and label from ms__coll_label. */
void ms__coll_set_label(ms_coll *call);

/* A call's arguments in messages: "16 x f32 sum", "in 8 x bf16", "16 x f32 root 1", ""
 * (barrier). */
const char *ms__coll_str(char *buf, size_t cap, const ms_coll *call);
/* "[0 2 5]": a group's world ranks, for messages. */
const char *ms__group_str(char *buf, size_t cap, int n, const int *world_ranks);

typedef struct ms_group ms_group;

/* ---------------------------------------------------------------- point-to-point
 *
 * comm.c checks a batch of sends and receives (ms_send, ms_recv, ms_batch_p2p) on the calling
 * rank and hands it to the backend grouped by peer.  The backend matches each peer's part
 * with that peer's side (its k-th batch naming this rank), compares the two sides with
 * ms__p2p_agree and moves the data of the pairs that agree. */

/* One send or receive as the two sides compare it (80 bytes; it travels as bytes between
 * processes).  kind MS_P2P_FINISHED: the MPI backend's note that a rank released its world. */
enum { MS_P2P_FINISHED = -1 };
typedef struct ms_p2p_desc {
    int32_t kind; /* ms_p2p_kind */
    int32_t tag;
    int32_t dtype;
    int32_t ndim;
    int64_t shape[MS_MAX_DIMS];
} ms_p2p_desc;

/* A peer's part of a batch: ops [first, first + count) of the batch, in batch order. */
typedef struct ms_p2p_peer {
    int peer; /* group rank */
    int first, count;
} ms_p2p_peer;

/* A checked batch: n ops grouped by peer (peers ascending), each peer's in batch order. */
typedef struct ms_p2p_batch {
    int n, npeers;
    ms_p2p_desc *descs;  /* (n) */
    void **data;         /* (n) the tensors' data, NULL when empty */
    ms_p2p_peer *peers;  /* (npeers) */
} ms_p2p_batch;

/* What the MPI and NCCL backends send a peer first: the number of this rank's ops with it
 * (or MS_P2P_FINISHED) and the descriptors of the first MS_P2P_INLINE; the rest follow in
 * a second message when either side has more, so one message each way serves most pairs. */
enum { MS_P2P_INLINE = 3 };
typedef struct ms_p2p_header {
    int32_t count;
    int32_t unused;
    ms_p2p_desc desc[MS_P2P_INLINE];
} ms_p2p_header;

typedef struct ms_backend {
    const char *name;      /* "threads", "mpi", "nccl" */
    ms_device_type device; /* where its tensors live */
    bool takes_cpu;        /* cpu tensors too (staged through the device by the backend) */
    /* Creates g->impl, the state the members of g in this process share.  Called once per
     * group, by its first member to ask, with the world's lock held. */
    ms_status (*group_init)(ms_world *w, ms_group *g);
    /* Frees g->impl when the world goes away. */
    void (*group_free)(ms_group *g);
    /* Runs one collective on c.  Any status but MS_OK leaves the comm unusable (comm.c
     * marks it); the message names the collective and the group. */
    ms_status (*collective)(ms_comm *c, const ms_coll *call);
    /* Runs one checked batch of sends and receives on c (npeers >= 1), with the same rule. */
    ms_status (*p2p)(ms_comm *c, const ms_p2p_batch *batch);
} ms_backend;

/* What ms_world_rank_done said about a rank. */
enum { MS_RANK_RUNNING = 0, MS_RANK_FINISHED = 1, MS_RANK_FAILED = 2 };

struct ms_world {
    atomic_int refcount; /* users of the world and of every one of its comms */
    const ms_backend *backend;
    int size;
    double timeout_s;
    char timeout_origin[64]; /* "MOONSHARD_TIMEOUT=2", for timeout messages */
    atomic_int *rank_state;  /* (size) MS_RANK_*; set by ms_world_rank_done */
    pthread_mutex_t lock;    /* guards the group registry */
    ms_group *groups;        /* registry, owned; the first is the whole world */
    const void *backend_arg; /* what ms__world_new_arg was given, while it makes the world's group */
};

/* A set of world ranks and one comm per member.  Comms live as long as the world: a
 * reference to a comm is a reference to its world. */
struct ms_group {
    int n;
    int *world_ranks; /* (n) strictly increasing */
    int tag;          /* groups over the same ranks with different tags are separate */
    ms_comm *comms;   /* (n) comms[i] is group rank i's handle */
    void *impl;       /* backend state shared by the members in this process */
    ms_group *next;
};

struct ms_comm {
    ms_world *world; /* not retained: the comm's references are the world's */
    ms_group *group;
    int rank;        /* group rank */
    /* Set when a collective failed: every later call returns MS_ERR_STATE with this. */
    bool unusable;
    char failure[1024];
};

/* A world of nranks ranks connected by backend (registers the whole-world group).
 * timeout_s <= 0 reads MOONSHARD_TIMEOUT, else 300 s. */
ms_status ms__world_new(ms_world **out, const ms_backend *backend, int nranks, double timeout_s);
/* The same, with arg for the backend's group_init of the whole-world group (w->backend_arg,
 * NULL again once the world is made). */
ms_status ms__world_new_arg(ms_world **out, const ms_backend *backend, int nranks, double timeout_s,
                            const void *arg);

/* comm_mpi.c, for other backends that bootstrap over MPI (comm_nccl.c): this process's
 * rank and the world size (initialising MPI), and bytes from world rank root to every
 * process.  MS_ERR_NOT_BUILT without MPI. */
ms_status ms__mpi_rank_size(int *rank, int *size);
ms_status ms__mpi_bcast(void *buf, int bytes, int root);

/* ---------------------------------------------------------------- comm_async.c
 *
 * One communication thread per (world, world rank), created on first use, runs the calls
 * queued for that rank in FIFO order: a rank that queues its collectives in program order
 * issues them in the same order as its peers, whatever thread queued them.  Used by the
 * shard units (unit.c) so that compute on the rank's thread overlaps communication. */

typedef ms_status (*ms_async_fn)(void *arg);

typedef struct ms_async_worker ms_async_worker;

/* One queued call and its outcome.  Owned by the caller: it must stay valid, untouched,
 * from ms__async_submit until ms__async_wait returns. */
typedef struct ms_ticket {
    ms_async_fn fn;
    void *arg;
    ms_async_worker *worker; /* the thread it was queued on */
    struct ms_ticket *next;  /* the worker's queue */
    bool done;               /* under the worker's lock */
    ms_status status;        /* fn's result, valid once done */
    char message[1024];      /* the worker thread's ms_last_error() when status != MS_OK */
} ms_ticket;

/* Queues fn(arg) on the communication thread of world rank `world_rank` of w (starting the
 * thread on first use).  fn runs on that thread; it may fail with a status and message. */
ms_status ms__async_submit(ms_world *w, int world_rank, ms_ticket *t, ms_async_fn fn, void *arg);
/* Waits until t has run; returns fn's status with fn's message as this thread's message. */
ms_status ms__async_wait(ms_ticket *t);
/* fn(arg) on the communication thread of world rank `world_rank` of w, after what is queued
 * there, and waits for it: at once when called from that thread.  Backends whose
 * communicators must not be used by two threads at once (nccl) run everything through it. */
ms_status ms__async_run(ms_world *w, int world_rank, ms_async_fn fn, void *arg);
/* true when world rank `world_rank` of w has a communication thread and the caller is not
 * it: a collective the rank calls itself then queues behind the units' (ms__async_run). */
bool ms__async_elsewhere(ms_world *w, int world_rank);
/* Stops and joins the communication threads of w (its queues are empty: every ticket holds
 * a reference to w through its caller).  Called when the world is freed. */
void ms__async_world_stop(ms_world *w);

/* Messages built piece by piece (cut at 1 KiB), shared by the backends. */
typedef struct ms_msg {
    char s[1024];
    size_t len;
} ms_msg;
void ms__msg_add(ms_msg *m, const char *fmt, ...) MS_PRINTF(2, 3);
/* "all_reduce on group [0 1 2 3]" */
void ms__msg_where(ms_msg *m, const ms_comm *c, ms_coll_kind kind);
/* Seconds on the monotonic clock. */
double ms__now_s(void);
/* MS_OK when the group's calls (calls[i] is group rank i's, `stride` bytes apart) agree;
 * else MS_ERR_MISMATCH with a message built from the calls alone, so every rank returns the
 * same one: each distinct call with the ranks that made it, e.g. "all_reduce on group
 * [0 1 2 3]: ranks disagree: ranks 0 1 3: 16 x f32 sum; rank 2: 8 x f32 sum". */
ms_status ms__calls_agree(const ms_comm *c, const ms_coll *calls, size_t stride);

/* Bytes of the tensor a descriptor describes (its shape's product x the dtype's size). */
int64_t ms__p2p_bytes(const ms_p2p_desc *d);
/* "send/recv on group [0 1 2] between ranks 0 and 2": the pair named lower group rank
 * first, so both sides write the same words. */
void ms__p2p_where(ms_msg *m, const ms_comm *c, int peer);
/* MS_OK when this rank's ops with `peer` (mine, in batch order) and the peer's ops with this
 * rank (theirs) pair up: as many sends one way as receives the other, in order with equal
 * tags, dtypes and shapes.  Else MS_ERR_MISMATCH with a message built from both lists alone,
 * lower group rank first, so both ranks return the same one: "send/recv on group [0 1]
 * between ranks 0 and 1: the sides disagree: tensor 1 of 1 from rank 0 to rank 1: sent as
 * tag 0 [4] f32, received as tag 0 [4] bf16 (the dtype differs)". */
ms_status ms__p2p_agree(const ms_comm *c, int peer, const ms_p2p_desc *mine, int n_mine, const ms_p2p_desc *theirs,
                        int n_theirs);
/* The first of several failures (a batch's peers fail apart): its status and message. */
typedef struct ms_first_error {
    ms_status st;
    char msg[1024];
} ms_first_error;
/* Keeps st (not MS_OK) and this thread's message, unless a failure is kept already. */
void ms__keep_first(ms_first_error *f, ms_status st);
/* MS_OK, or the kept failure, its message again this thread's. */
ms_status ms__first_error(const ms_first_error *f);
/* The header of peer i of a batch (its op count and first descriptors). */
void ms__p2p_header(const ms_p2p_batch *b, int i, ms_p2p_header *h);
/* "rank 2", or "rank 5 (group rank 1)" in a group whose ranks are not the world's first. */
const char *ms__rank_str(char *buf, size_t cap, const ms_comm *c, int group_rank);

/* reduce.c: dsts[d][i] = srcs[0][i] op ... op srcs[n-1][i] for i < count and each of the ndst
 * destinations, in rank order, accumulated in f32 for 8- and 16-bit floats (f64 for f64)
 * and rounded once; avg divides by n before rounding.  A destination may be one of the
 * sources (each block is read from every source before any destination is written). */
enum { MS_REDUCE_BLOCK = 2048 }; /* elements per block: the accumulator stays in L1 */
void ms__reduce(ms_dtype dtype, ms_op op, int n, const void *const *srcs, void *const *dsts, int ndst,
                int64_t count);

#endif /* MS_COMM_H */
