/*
 * moonshard.h: the one public header of libmoonshard.
 *
 * A C11 core for distributed-training policy: dtypes and casts, tensors (cpu, meta),
 * device meshes, DTensor / FSDP layout math and collectives over groups of ranks.
 *
 * Conventions (they hold for every function below):
 * - Every function that can fail returns an ms_status and writes its results through
 *   pointers.  On failure a message for this thread is left in ms_last_error(); nothing in
 *   the core aborts, exits or longjmps.
 * - Handles are opaque and reference counted.  A function that hands out a handle through
 *   `**out` gives the caller one reference, to be dropped with the matching *_release.
 *   *_retain(NULL) and *_release(NULL) are no-ops.
 * - Every handle and pointer argument is checked; none may be NULL unless its comment says
 *   so (a shape of 0 dims, a buffer of 0 bytes, an optional output).  A function returning
 *   an ms_status returns MS_ERR_ARG for a NULL one, with the message "<function>: <argument>
 *   is NULL" ("ms_tensor_copy: dst is NULL").  An accessor, which returns a value instead,
 *   leaves the same message and returns its invalid value: -1 for a count, size, rank or
 *   index (ms_world_timeout: -1.0), NULL for a pointer or a string, 0 for a yes/no question,
 *   MS_DTYPE_COUNT for a dtype and MS_DEVICE_INVALID for a device; a void function other
 *   than retain and release does nothing but leave the message.  tests/c/test_null.c calls
 *   every function of the public headers so.
 * - Ranks, coordinates, dims and offsets are 0-based.  Sizes are int64_t.
 *
 * The declarations between MS_API_BEGIN and MS_API_END are FFI-clean: no macros inside
 * them, no structs by value, no varargs, so LuaJIT can ffi.cdef them as they are.
 */
#ifndef MOONSHARD_H
#define MOONSHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MS_API_BEGIN */

/* ---------------------------------------------------------------- status */

typedef enum ms_status {
    MS_OK = 0,
    MS_ERR_ARG = 1,        /* an argument is invalid */
    MS_ERR_OOM = 2,        /* out of memory */
    MS_ERR_OVERFLOW = 3,   /* a size or byte count overflows int64 */
    MS_ERR_SHAPE = 4,      /* shapes do not fit together */
    MS_ERR_DTYPE = 5,      /* a dtype is not supported here */
    MS_ERR_DEVICE = 6,     /* wrong or unsupported device */
    MS_ERR_MISMATCH = 7,   /* ranks disagree on a collective's arguments */
    MS_ERR_TIMEOUT = 8,    /* a collective waited past the timeout */
    MS_ERR_PEER = 9,       /* a peer rank failed or ended without joining */
    MS_ERR_NOT_BUILT = 10, /* a backend or feature was not built in */
    MS_ERR_STATE = 11,     /* an object is in the wrong state for the call */
    MS_ERR_IO = 12,        /* a file could not be read or written */
    MS_ERR_INTERNAL = 13   /* a bug in moonshard */
} ms_status;

/* "ok", "invalid_argument", "out_of_memory", ...: a static string. */
const char *ms_status_name(ms_status status);
/* The message of the last failure on this thread ("" when none).  Valid until the next
 * moonshard call on this thread. */
const char *ms_last_error(void);
/* Sets this thread's message to `message` (NULL or "" clears it) and returns `status`: for
 * code built on the library (the embedding API, a host's own layer) that reports its
 * failures through ms_last_error as the library does.  The message is cut at 1023 bytes. */
ms_status ms_set_error(ms_status status, const char *message);
/* "0.1.0": the library's version; MS_VERSION_* are the headers' (a host built against them
 * compares the two at run time). */
const char *ms_version(void);
#define MS_VERSION_MAJOR 0
#define MS_VERSION_MINOR 1
#define MS_VERSION_PATCH 0

/* ---------------------------------------------------------------- dtypes */

typedef enum ms_dtype {
    MS_F32 = 0,
    MS_F16 = 1,
    MS_BF16 = 2,
    MS_F8E4M3 = 3, /* OCP e4m3fn: bias 7, max 448, no inf, NaN = S.1111.111 */
    MS_F8E5M2 = 4, /* OCP e5m2: bias 15, max 57344, IEEE-like */
    MS_F64 = 5,
    MS_I64 = 6,
    MS_I32 = 7,
    MS_I8 = 8,
    MS_U8 = 9,
    MS_BOOL = 10,
    MS_DTYPE_COUNT = 11
} ms_dtype;

/* Bytes per element; 0 for an invalid dtype (MS_DTYPE_COUNT included). */
int ms_dtype_size(ms_dtype dtype);
/* "f32", "bf16", ...; NULL for an invalid dtype. */
const char *ms_dtype_name(ms_dtype dtype);
/* Parses a name of the list above ("float32", "bfloat16", "half", ... are accepted too). */
ms_status ms_dtype_parse(const char *name, ms_dtype *out);
/* 1 for f32 f16 bf16 f8e4m3 f8e5m2 f64, else 0. */
int ms_dtype_is_float(ms_dtype dtype);
/* A host number as an element of the integer dtype `dtype` (i64 i32 i8 u8 bool), as
 * torch.tensor([v], dtype=...) takes it: an integer (is_float 0: `i`) exactly, a float
 * (is_float 1: `f`) truncated toward zero; bool takes any number (nonzero, NaN included, is
 * 1).  A value the dtype cannot hold is MS_ERR_ARG, "300 is out of range for i8 (-128 to
 * 127)", where a cast (ms_cast) would saturate.  The bindings' from_table and fill_. */
ms_status ms_int_element(ms_dtype dtype, int is_float, int64_t i, double f, int64_t *out);

/* Converts n elements from src (src_dtype) to dst (dst_dtype); contiguous, no overlap
 * unless dst == src with equal element sizes.  Float to narrower float rounds to nearest
 * even (bf16 and f16 bit-identical to PyTorch for non-NaN inputs; fp8 saturates to the
 * largest finite value); NaN stays NaN.  Float to integer truncates toward zero and
 * saturates, NaN -> 0; integer to integer wraps like a C cast; to bool: nonzero -> 1.
 * dst and src may be NULL when n = 0. */
ms_status ms_cast(void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype, int64_t n);

typedef enum ms_cast_impl {
    MS_CAST_AUTO = 0,     /* AVX2 when the CPU has AVX2 and F16C, else portable */
    MS_CAST_PORTABLE = 1, /* plain C */
    MS_CAST_AVX2 = 2      /* AVX2 + F16C kernels; MS_ERR_NOT_BUILT when unavailable */
} ms_cast_impl;

/* Chooses the cast kernels for the whole process (tests and benchmarks compare them). */
ms_status ms_cast_set_impl(ms_cast_impl impl);
/* The kernels in use now: MS_CAST_PORTABLE or MS_CAST_AVX2. */
ms_cast_impl ms_cast_get_impl(void);

/* ---------------------------------------------------------------- tensors */

typedef enum ms_device_type {
    MS_DEVICE_INVALID = -1, /* not a device: ms_tensor_device of a NULL tensor */
    MS_DEVICE_CPU = 0,
    MS_DEVICE_META = 1, /* shape and dtype only, no memory */
    MS_DEVICE_CUDA = 2
} ms_device_type;

enum { MS_MAX_DIMS = 8 };

/* Parses "cpu", "meta", "cuda", "cuda:N". */
ms_status ms_device_parse(const char *name, ms_device_type *type, int *index);

typedef struct ms_tensor ms_tensor;

/* A new zero-filled contiguous tensor.  ndim 0..8; sizes >= 0; the byte count must fit
 * int64.  Release with ms_tensor_release. */
ms_status ms_tensor_new(ms_tensor **out, int ndim, const int64_t *shape, ms_dtype dtype,
                        ms_device_type device, int device_index);
/* A cpu tensor over memory the caller owns (contiguous); moonshard never frees it.  data
 * may be NULL for a tensor of 0 bytes. */
ms_status ms_tensor_wrap(ms_tensor **out, void *data, int ndim, const int64_t *shape,
                         ms_dtype dtype);
/* The same on a device: a cuda tensor over device memory the caller owns on cuda:device_index
 * (from cudaMalloc, or another framework's tensor), checked to be memory of that device
 * (MS_ERR_DEVICE naming what it is otherwise); collectives, copies and casts then work on it
 * in place.  MS_DEVICE_CPU is ms_tensor_wrap; MS_ERR_NOT_BUILT for cuda without CUDA. */
ms_status ms_tensor_wrap_device(ms_tensor **out, void *data, int ndim, const int64_t *shape, ms_dtype dtype,
                                ms_device_type device, int device_index);
void ms_tensor_retain(ms_tensor *t);
void ms_tensor_release(ms_tensor *t);

/* The accessors: for a NULL t, -1 (ndim, size, stride, numel, nbytes, device_index),
 * MS_DTYPE_COUNT (dtype), MS_DEVICE_INVALID (device), 0 (is_contiguous, overlaps) or NULL
 * (data), with ms_last_error() naming the function. */
int ms_tensor_ndim(const ms_tensor *t);
int64_t ms_tensor_size(const ms_tensor *t, int dim);   /* -1 when dim is out of range */
int64_t ms_tensor_stride(const ms_tensor *t, int dim); /* in elements */
int64_t ms_tensor_numel(const ms_tensor *t);
int64_t ms_tensor_nbytes(const ms_tensor *t); /* numel * element size */
ms_dtype ms_tensor_dtype(const ms_tensor *t);
ms_device_type ms_tensor_device(const ms_tensor *t);
int ms_tensor_device_index(const ms_tensor *t);
int ms_tensor_is_contiguous(const ms_tensor *t);
/* Address of the first element; NULL for meta tensors and for empty tensors. */
void *ms_tensor_data(const ms_tensor *t);
/* 1 when a and b view overlapping bytes of the same storage (0 when either is NULL). */
int ms_tensor_overlaps(const ms_tensor *a, const ms_tensor *b);

/* Views: they retain t's storage and share its memory. */
ms_status ms_tensor_narrow(ms_tensor **out, ms_tensor *t, int dim, int64_t start, int64_t length);
/* A new shape with the same numel over a contiguous tensor; one size may be -1. */
ms_status ms_tensor_view(ms_tensor **out, ms_tensor *t, int ndim, const int64_t *shape);
/* Piece `index` of torch.chunk(t, chunks, dim): ceil(n/chunks) rows per piece, the last
 * ones shorter or empty (an empty piece is a view of 0 rows at offset n). */
ms_status ms_tensor_chunk(ms_tensor **out, ms_tensor *t, int64_t chunks, int64_t index, int dim);

/* dst <- src element-wise with a cast; equal shapes; any strides. */
ms_status ms_tensor_copy(ms_tensor *dst, const ms_tensor *src);
/* Every element of t set to value (cast to t's dtype with the rules of ms_cast). */
ms_status ms_tensor_fill(ms_tensor *t, double value);
/* The same from an integer, exact for i64 (a double holds integers up to 2^53 only). */
ms_status ms_tensor_fill_int(ms_tensor *t, int64_t value);
/* A new contiguous tensor holding t cast to dtype. */
ms_status ms_tensor_to(ms_tensor **out, const ms_tensor *t, ms_dtype dtype);
/* A new contiguous tensor holding t on another device (same dtype): cpu <-> cuda:N, or
 * between CUDA devices.  A meta tensor has no data to move (MS_ERR_DEVICE). */
ms_status ms_tensor_to_device(ms_tensor **out, const ms_tensor *t, ms_device_type device, int device_index);
/* The number of CUDA devices: MS_ERR_NOT_BUILT when moonshard was built without CUDA,
 * MS_ERR_DEVICE (with the driver's reason, *out = 0) when there is none. */
ms_status ms_cuda_device_count(int *out);

/* ---------------------------------------------------------------- collectives */

typedef enum ms_op { MS_OP_SUM = 0, MS_OP_AVG = 1, MS_OP_MAX = 2, MS_OP_MIN = 3 } ms_op;

const char *ms_op_name(ms_op op);                  /* "sum", ...; NULL if invalid */
ms_status ms_op_parse(const char *name, ms_op *out);

/* The ranks of one job in this process and the backend that connects them. */
typedef struct ms_world ms_world;
/* One rank's handle on a group of ranks (a communicator). */
typedef struct ms_comm ms_comm;

/* A world of nranks ranks run as threads of this process.  timeout_s <= 0 takes
 * MOONSHARD_TIMEOUT from the environment, else 300 seconds. */
ms_status ms_threads_world_new(ms_world **out, int nranks, double timeout_s);
/* The MPI world this process belongs to, one rank per process (mpirun -np N): MPI is
 * initialised on first use (MPI_THREAD_MULTIPLE) unless the host did it, and finalised at
 * exit when moonshard initialised it.  This process's rank is its MPI_COMM_WORLD rank; take
 * its comm with ms_world_comm.  MS_ERR_NOT_BUILT when moonshard was built without MPI. */
ms_status ms_mpi_world_new(ms_world **out, double timeout_s);
/* The MPI world of a host's own communicator: mpi_comm points to an MPI_Comm (an
 * intracommunicator; moonshard duplicates it, so the host may free its own afterwards), and
 * this process's rank is its rank there.  For a trainer that runs moonshard on a
 * subcommunicator (one data-parallel replica, a pipeline stage), or beside other worlds.
 * MPI must be initialised by the host first (MS_ERR_STATE if not; thread level
 * MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE).  A collective call over mpi_comm's ranks.
 * MS_ERR_NOT_BUILT without MPI. */
ms_status ms_mpi_world_from_comm(ms_world **out, const void *mpi_comm, double timeout_s);
/* The NCCL world this process belongs to: one rank per process and GPU.  The rank and the
 * size come from MPI when an MPI launcher started the process, else from RANK, WORLD_SIZE,
 * MASTER_ADDR and MASTER_PORT (a TCP rendezvous served by rank 0), else it is a world of
 * one.  The rank's GPU is LOCAL_RANK when set, else rank mod the number of GPUs.  *rank gets
 * this process's rank (take its comm with ms_world_comm).  Collectives take cuda tensors of
 * that GPU, and cpu tensors (staged through it); a group is made with ncclCommSplit, so every
 * rank asks for its group of a partition at the same point.  MS_ERR_NOT_BUILT without NCCL. */
ms_status ms_nccl_world_new(ms_world **out, double timeout_s, int *rank);
/* This process's GPU in the NCCL world, -1 before ms_nccl_world_new (or without NCCL). */
int ms_nccl_device(void);
/* 1 when this process was started by an MPI launcher (mpirun, srun), else 0. */
int ms_mpi_launched(void);
void ms_world_retain(ms_world *w);
void ms_world_release(ms_world *w);
int ms_world_size(const ms_world *w);         /* -1 for a NULL w */
double ms_world_timeout(const ms_world *w);   /* -1.0 for a NULL w */
/* The whole world as seen from `rank`; call it on that rank's thread. */
ms_status ms_world_comm(ms_world *w, int rank, ms_comm **out);
/* Says that `rank` has finished (failed = 0) or failed (failed != 0).  Collectives waiting
 * for that rank then fail with MS_ERR_PEER instead of waiting out the timeout. */
ms_status ms_world_rank_done(ms_world *w, int rank, int failed);

void ms_comm_retain(ms_comm *c);
void ms_comm_release(ms_comm *c);
/* For a NULL c: -1 (size, rank, world_rank) or NULL (backend), with the message set. */
int ms_comm_size(const ms_comm *c);
int ms_comm_rank(const ms_comm *c);
/* The world rank of group member `group_rank`; -1 if out of range. */
int ms_comm_world_rank(const ms_comm *c, int group_rank);
/* "threads", "mpi" or "nccl". */
const char *ms_comm_backend(const ms_comm *c);
/* Where this rank's tensors for c's collectives live: *type MS_DEVICE_CPU (index -1) on
 * threads and MPI, MS_DEVICE_CUDA and the rank's GPU on nccl.  A host asks this instead of
 * comparing backend names. */
ms_status ms_comm_device(const ms_comm *c, ms_device_type *type, int *index);
/* The group of the given world ranks (strictly increasing, including this rank) seen from
 * this rank.  Every member must ask for the same list; asking again returns the same group. */
ms_status ms_comm_group(ms_comm *world, int n, const int *world_ranks, ms_comm **out);
/* The same with a tag 0..MS_GROUP_TAG_MAX: groups over the same ranks with different tags
 * are separate communicators whose collectives are matched independently, so two threads
 * of a rank may use them at the same time (a host's all_to_all beside the collectives a
 * unit runs on its communication thread).  ms_comm_group is tag 0. */
enum { MS_GROUP_TAG_MAX = 1023 };
ms_status ms_comm_group_tagged(ms_comm *world, int n, const int *world_ranks, int tag, ms_comm **out);

/* Collectives.  Tensors are contiguous, on the comm's device, equal dtype; every rank of
 * the group must make the same call with the same counts, dtype and op, else every rank
 * gets MS_ERR_MISMATCH.  A rank that does not arrive within the timeout gives
 * MS_ERR_TIMEOUT; after a failed collective the comm is unusable (MS_ERR_STATE).
 * 16-bit float reductions accumulate in f32 and round once; avg divides by the group size.
 * In place: all_gather when in is out's slice for this rank; reduce_scatter when out is
 * in's slice for this rank; all_reduce always. */
ms_status ms_all_gather(ms_comm *c, ms_tensor *out, const ms_tensor *in);  /* out numel = n * in numel */
ms_status ms_reduce_scatter(ms_comm *c, ms_tensor *out, const ms_tensor *in, ms_op op); /* in numel = n * out numel */
ms_status ms_all_reduce(ms_comm *c, ms_tensor *t, ms_op op);
ms_status ms_broadcast(ms_comm *c, ms_tensor *t, int root);
ms_status ms_all_to_all(ms_comm *c, ms_tensor *out, const ms_tensor *in); /* equal numel, divisible by n */
ms_status ms_barrier(ms_comm *c);

/* Point-to-point: tensors sent to and received from one peer, a group rank of c other than
 * this rank's (MS_ERR_ARG for this rank or one out of range), with a tag >= 0.  Tensors are
 * contiguous and on the comm's device as for the collectives (cpu tensors staged on nccl).
 * A batch (ms_batch_p2p; ms_send and ms_recv are batches of one) is matched with each peer
 * it names as a unit: its sends to and receives from peer p pair, in batch order, with the
 * receives from and sends to this rank in p's batch that names this rank (the k-th batch
 * of this rank naming p with the k-th batch of p naming this rank).  The two sides must post
 * as many sends as the other receives, each pair with the same tag, shape and dtype: else
 * both get MS_ERR_MISMATCH naming what differed, and nothing moves between them.  Tags
 * check, they do not select.  Two ranks that both ms_send to each other first get a
 * mismatch, not a deadlock: post the send and the receive in one batch.  The batch's ops run
 * together, in any order, without deadlock.  Each peer's part is agreed on its own: a
 * mismatch with one peer leaves the transfers with the others done.  On threads and mpi each
 * peer's part also completes on its own, so a slow or failed peer holds up no other; on nccl
 * each step of a batch waits for all its peers (docs/backends.md).  A peer that does not post its side within the timeout gives
 * MS_ERR_TIMEOUT naming it, one reported done (or, on mpi, one that released its world)
 * MS_ERR_PEER; after any failure the comm is unusable (MS_ERR_STATE), as after a failed
 * collective.  A received tensor may not overlap any other tensor of the batch (MS_ERR_ARG);
 * a sent one may go to several peers. */
typedef enum ms_p2p_kind { MS_P2P_SEND = 0, MS_P2P_RECV = 1 } ms_p2p_kind;
typedef struct ms_p2p_op {
    ms_p2p_kind op; /* MS_P2P_SEND: t is read; MS_P2P_RECV: t is written */
    ms_tensor *t;
    int peer;       /* a group rank of the comm */
    int tag;        /* >= 0 */
} ms_p2p_op;
ms_status ms_send(ms_comm *c, const ms_tensor *t, int peer, int tag);
ms_status ms_recv(ms_comm *c, ms_tensor *t, int peer, int tag);
/* n >= 0 ops (ops may be NULL when n = 0, a no-op). */
ms_status ms_batch_p2p(ms_comm *c, const ms_p2p_op *ops, int n);

/* ---------------------------------------------------------------- meshes */

typedef struct ms_mesh ms_mesh;

/* A mesh of named axes (row-major: the last axis varies fastest).  Names are unique and
 * non-empty, sizes >= 1.  world may be NULL (a shape-only mesh, for planning); otherwise
 * the product of sizes must equal its size and the mesh retains it. */
ms_status ms_mesh_new(ms_mesh **out, int naxes, const char *const *names, const int64_t *sizes,
                      ms_comm *world);
void ms_mesh_retain(ms_mesh *m);
void ms_mesh_release(ms_mesh *m);
/* For a NULL m (or name): -1, or NULL for axis_name, with the message set (ms_mesh_rank's
 * -1 for a shape-only mesh is no error and sets none). */
int ms_mesh_ndim(const ms_mesh *m);
const char *ms_mesh_axis_name(const ms_mesh *m, int axis); /* NULL when out of range */
int64_t ms_mesh_axis_size(const ms_mesh *m, int axis);     /* -1 when out of range */
int ms_mesh_axis_index(const ms_mesh *m, const char *name); /* -1 when absent */
int64_t ms_mesh_size(const ms_mesh *m);                     /* product of the sizes */
/* This rank's world rank, -1 for a shape-only mesh. */
int64_t ms_mesh_rank(const ms_mesh *m);
ms_status ms_mesh_coords(const ms_mesh *m, int64_t rank, int64_t *coords);
ms_status ms_mesh_rank_of(const ms_mesh *m, const int64_t *coords, int64_t *rank);
/* The ranks of `rank`'s group over the given axes (axis indices in increasing mesh order,
 * as torch DeviceMesh slicing requires), ordered row-major over those axes, which is
 * increasing rank order; ranks has room for the product of their sizes; *count gets it. */
ms_status ms_mesh_group_ranks(const ms_mesh *m, int naxes, const int *axes, int64_t rank,
                              int64_t *ranks, int64_t *count);
/* This rank's group over the given axes, built once per mesh and cached. */
ms_status ms_mesh_group(ms_mesh *m, int naxes, const int *axes, ms_comm **out);

/* ---------------------------------------------------------------- layouts */

typedef enum ms_placement_kind {
    MS_PLACE_REPLICATE = 0,
    MS_PLACE_SHARD = 1,
    MS_PLACE_PARTIAL = 2
} ms_placement_kind;

/* torch.chunk extent of piece r of a dim of size n cut into k pieces. */
ms_status ms_chunk_extent(int64_t n, int64_t k, int64_t r, int64_t *length, int64_t *offset);
/* DTensor local shape and global offset of the shard at `coords` of a mesh of mesh_ndim
 * dims with one placement per mesh dim (kinds[i], shard_dims[i] for Shard).  Placements
 * apply in mesh-dim order to the current local extent.  Negative shard dims count from
 * the end. */
ms_status ms_local_shape(int ndim, const int64_t *global_shape, int mesh_ndim, const int *kinds,
                         const int *shard_dims, const int64_t *mesh_sizes, const int64_t *coords,
                         int64_t *local_shape, int64_t *global_offset);
/* FSDP2 shard of a parameter on `dim` over `world` ranks: the local shape and the offset
 * along `dim` of `rank` (torch.chunk rules; a rank may hold 0 rows) and the padded shape (ceil(n/world)
 * rows).  dim != 0 requires size % world == 0; 0-dim parameters are an error. */
ms_status ms_fsdp_shard(int ndim, const int64_t *shape, int64_t world, int64_t rank, int dim,
                        int64_t *local_shape, int64_t *offset, int64_t *padded_shape);

/* ---------------------------------------------------------------- shard units (FSDP2 runtime)
 *
 * A unit is one rank's part of an FSDP2 shard unit: the padded shards
 * of its parameters in their stored dtype, a flat all-gather buffer in the param dtype (bytes
 * when the parameters gather in different dtypes, as FSDP2's uint8 all-gather does), the
 * unsharded parameters and gradients while gathered, and the sharded gradients.  Lifecycle:
 *   ms_unit_new -> ms_unit_add_param (each parameter, in plan order) -> ms_unit_finalize
 *   per step: ms_unit_unshard (async) -> ms_unit_wait -> forward on ms_unit_param_full
 *             -> ms_unit_reshard (by the reshard_after_forward rule)
 *             -> ms_unit_unshard / wait again if resharded -> backward writes or adds into
 *                ms_unit_grad_full -> ms_unit_reduce_grads -> ms_unit_wait
 *             -> ms_unit_grad_sq_norm / ms_unit_scale_grads (clipping) / ms_unit_adamw_step
 * Every call checks the state and returns MS_ERR_STATE when it is out of order, with a
 * message naming the unit and its state.  All ranks of the unit's groups make the same
 * calls in the same order (they are collectives).  A unit's collectives run, in the order
 * they were started, on one communication thread per rank shared by all of its units; a
 * collective the rank calls itself on an untagged group (a loss all_reduce while a gather
 * is pending) queues behind them there, so it reaches the group in program order, and a
 * tagged group (ms_comm_group_tagged) runs at once, apart from them.  After a
 * failed collective the unit is unusable (MS_ERR_STATE with the first failure's message).
 * The tensor getters below return NULL with ms_last_error() set on failure, and NULL with
 * an empty message when there is nothing to return.  For a NULL unit the other accessors
 * return -1 (param_count, adamw_skipped, bytes, record_count) or NULL (name, param_fqn)
 * with the message set; ms_unit_clear_records(NULL) only sets it. */

typedef struct ms_unit ms_unit;

/* A unit over `shard` (its shard group, size W) and, for HSDP, `replicate` (NULL for a
 * 1-D mesh).  param_dtype / reduce_dtype: the policy's mixed-precision dtypes (floating),
 * -1 for unset (FSDP2 clamps them per parameter: an integer parameter
 * or one already stored in param_dtype is gathered as stored; with reduce_dtype unset a
 * gradient is reduced in its parameter's stored dtype, PyTorch 2.15's rule).  reshard_after_forward is
 * PyTorch's, as an integer: the size of the group the parameters stay sharded over after
 * forward.  MS_RESHARD_FULL (0) or k = W reshards over the whole shard group (PyTorch's
 * True: the unsharded parameters are freed); MS_RESHARD_KEEP (1) keeps them unsharded
 * (False); 2 <= k < W dividing W keeps a k-way shard and gathers over k consecutive ranks
 * of the shard group in backward.  Other values are MS_ERR_ARG.  The unit
 * retains the comms.  On the nccl backend every buffer of the unit is a cuda tensor on the
 * rank's GPU (shards, gradient shards, optimizer state, the unsharded parameters and
 * gradients, the gather and reduce buffers), unless ms_unit_set_cpu_offload. */
typedef enum { MS_RESHARD_FULL = 0, MS_RESHARD_KEEP = 1 } ms_reshard;
ms_status ms_unit_new(ms_unit **out, const char *name, ms_comm *shard, ms_comm *replicate,
                      int param_dtype, int reduce_dtype, int reshard_after_forward);
void ms_unit_retain(ms_unit *u);
void ms_unit_release(ms_unit *u);
/* FSDP2's CPUOffloadPolicy: with offload = 1 the shards, gradient shards and optimizer state
 * are cpu tensors (the optimizer runs on the host) while the unsharded parameters and
 * gradients and the collectives stay on the GPU; unshard copies the shards in, the reduced
 * gradients come back to the host.  Only before the first ms_unit_add_param (MS_ERR_STATE
 * after).  Without a GPU (threads, mpi) every buffer is on the host either way. */
ms_status ms_unit_set_cpu_offload(ms_unit *u, int offload);
/* Packs the unit (before the first ms_unit_add_param; MS_ERR_STATE after): a packed unit may
 * hold trainable parameters of several stored dtypes (a layer's bf16 weights and its fp32
 * "islands"), each with its own mixed-precision policy (ms_unit_set_param_policy).  Its
 * parameters are still gathered by one all-gather (of bytes, u8, when their gather dtypes
 * differ: each parameter's padded shard cast to its own gather dtype) and its gradients
 * reduced by one reduce-scatter per distinct reduce dtype of the parameters that have a
 * gradient this step (and, for HSDP, one all-reduce per reduce dtype), in the order the
 * parameters first use them.  Every parameter keeps its own stored, gather and reduce
 * dtypes: the unsharded parameter and gradient in its gather dtype, the sync-off
 * accumulator in its reduce dtype, the gradient shard, the norm, clipping and AdamW (master
 * weights when not stored in f32) in its stored dtype, so that each parameter's numbers are
 * those it would have in a unit of its own with that policy.  (FSDP2 refuses trainable
 * parameters of different stored dtypes in one unit; this is moonshard's extension.) */
ms_status ms_unit_set_packed(ms_unit *u, int packed);
/* Parameter i's own mixed-precision policy in a packed unit, in place of the unit's
 * (param_dtype / reduce_dtype as ms_unit_new takes them: floating, or -1 for unset, and
 * FSDP2's clamps apply to them per parameter).  Before finalize; MS_ERR_STATE for a unit
 * that is not packed. */
ms_status ms_unit_set_param_policy(ms_unit *u, int i, int param_dtype, int reduce_dtype);
/* Adds a parameter of global `shape` (1 to 8 dims) stored in `dtype`, sharded on `dim`
 * (0 unless a shard_placement_fn says otherwise; negative dims count from the end; another
 * dim than 0 must divide by W).  The rank's padded shard is allocated zero-filled;
 * requires_grad = 0 for frozen parameters (required for integer dtypes).  The trainable
 * parameters of a unit share one stored dtype (MS_ERR_DTYPE naming both parameters
 * otherwise), as FSDP2 demands, unless the unit is packed; frozen ones may have any dtype. */
ms_status ms_unit_add_param(ms_unit *u, const char *fqn, int ndim, const int64_t *shape,
                            ms_dtype dtype, int dim, int requires_grad);
/* Fixes the flat layout (S = sum of the padded shard numels) and the effective dtypes; no
 * parameter may be added after.  The gather and reduce buffers, the unsharded parameters
 * and gradients are taken when needed and given back when done, to a cache of free buffers
 * that the units of a rank share, so that a steady-state step allocates nothing (category 4
 * of ms_unit_bytes; ms_unit_release_unsharded frees a unit's part). */
ms_status ms_unit_finalize(ms_unit *u);
int ms_unit_param_count(const ms_unit *u);
const char *ms_unit_name(const ms_unit *u);
const char *ms_unit_param_fqn(const ms_unit *u, int i);
/* The rank's shard of parameter i (a view of its padded shard without the padding, maybe
 * of 0 rows), in the stored dtype: write initial values here.  Borrowed: valid while the
 * unit lives.  Writing it is supported until the unit's first ms_unit_adamw_step; after
 * it, a unit stored in another dtype than f32 has f32 master weights (MS_ADAMW_MASTER),
 * which AdamW updates and writes back over the shard, so a direct write would be lost at
 * the next step: load with ms_unit_load_full, which sets both.  (MS_ADAMW_TORCH keeps no
 * master: AdamW updates the shard itself.) */
ms_tensor *ms_unit_param_shard(ms_unit *u, int i);
/* Parameter i as the host's forward sees it, in any state after finalize: its global shape
 * (shape: room for MS_MAX_DIMS), stored dtype, the dtype it is gathered and computed in
 * (FSDP2's rule), and whether it requires gradients.  MS_ERR_STATE before finalize. */
ms_status ms_unit_param_info(const ms_unit *u, int i, int *ndim, int64_t *shape, ms_dtype *stored, ms_dtype *gather,
                             int *requires_grad);
/* The dtype the unit reduces its gradients in (after finalize; MS_ERR_STATE before): a packed
 * unit's first trainable parameter's (ms_unit_param_reduce_dtype gives each one's). */
ms_status ms_unit_reduce_dtype(const ms_unit *u, ms_dtype *reduce);
/* The dtype parameter i's gradient is reduced in (after finalize; MS_ERR_STATE before). */
ms_status ms_unit_param_reduce_dtype(const ms_unit *u, int i, ms_dtype *reduce);
/* The rank's sharded gradient of parameter i (stored dtype), or NULL (with an empty
 * message) while the parameter has no gradient: before the first reduce_grads that
 * reduces one for it, and after ms_unit_zero_grad until the next.  Borrowed. */
ms_tensor *ms_unit_grad_shard(ms_unit *u, int i);
/* Copies this rank's rows of a full tensor (global shape, any dtype) into shard i, with a
 * cast; before finalize or while sharded.  Once a step has made f32 master weights (stored
 * dtype not f32), they take the rows cast to f32 (an f32 checkpoint's exact values) and
 * the shard their rounding to the stored dtype, so the next step starts from the loaded
 * values; the optimizer moments are kept.  Before the first step there are no master
 * weights: the first step makes them from the stored shard. */
ms_status ms_unit_load_full(ms_unit *u, int i, const ms_tensor *full);
/* Where shard i sits in the full parameter: its shard dim (normalised, 0 unless a
 * shard_placement_fn said otherwise) and this rank's rows of that dim, [offset, offset +
 * rows) (torch.chunk: rows may be 0, with offset the dim's size); the shard is the full
 * parameter narrowed to them.  In any state. */
ms_status ms_unit_param_offset(const ms_unit *u, int i, int *dim, int64_t *offset, int64_t *rows);

/* Starts the all-gather of the unit's parameters in the param dtype (asynchronous: the
 * collective runs on the rank's communication thread); ms_unit_wait completes it. */
ms_status ms_unit_unshard(ms_unit *u);
/* Waits for the unit's pending collective (unshard or reduce_grads), then finishes it
 * (copy-out of the unsharded parameters; cast-back and accumulation of gradients).  A no-op
 * when nothing is pending. */
ms_status ms_unit_wait(ms_unit *u);
/* The unsharded parameter i (global shape, gather dtype) while unsharded (or kept by
 * MS_RESHARD_KEEP).  Borrowed. */
ms_tensor *ms_unit_param_full(ms_unit *u, int i);
/* Frees (or keeps, per reshard_after_forward) the unsharded parameters after forward. */
ms_status ms_unit_reshard(ms_unit *u);
/* The unsharded gradient of parameter i (global shape, gather dtype) to write or add
 * into during backward, while unsharded; zeroed when first handed out after a reduce.
 * Frozen parameters have none.  Borrowed. */
ms_tensor *ms_unit_grad_full(ms_unit *u, int i);
/* Reduces the unsharded gradients of the parameters handed out by grad_full since the last
 * reduce (and those accumulated with sync off): reduce-scatter in the reduce dtype over the
 * shard group (FSDP2's divide factors, docs/numerics.md), all-reduce over the replicate group for
 * HSDP, cast back and accumulate into the sharded gradients (asynchronous: ms_unit_wait).
 * With sync off, adds them into an unsharded accumulator in the reduce dtype instead (no
 * collective).  Either way it then frees the unsharded parameters and gradients, as FSDP2
 * reshards after backward.  MS_ERR_STATE when no gradient was handed out (a unit without
 * trainable parameters only reshards). */
ms_status ms_unit_reduce_grads(ms_unit *u);
ms_status ms_unit_set_requires_gradient_sync(ms_unit *u, int sync);
/* 0 = the default divide factor N = shard x replicate size (f32/bf16 reduces: AVG in both
 * collectives); else a custom factor f, divided as PyTorch 2.15's FSDP2 does: f equal to
 * the shard group's size W averages in the reduce-scatter and sums in the all-reduce, any
 * other f (f = N included, for HSDP) is premul-sum(1/f) then SUM, and with W = 1 the
 * input is divided by f.  f16 reduces divide by about sqrt(f) before and after the sums. */
ms_status ms_unit_set_gradient_divide_factor(ms_unit *u, double factor);
/* Frees the unsharded parameters and gradients whatever the reshard rule (end of step),
 * and the free buffers the unit left in the rank's cache; the sync-off accumulator is kept
 * for the next synchronised reduce. */
ms_status ms_unit_release_unsharded(ms_unit *u);
/* PyTorch's optimizer.zero_grad() with its default set_to_none=True: every parameter of
 * the unit has no gradient afterwards (ms_unit_grad_shard is NULL; the norm, scale_grads
 * and adamw_step skip it, so AdamW applies neither weight decay nor momentum to it) until a
 * reduce_grads gives it one.  As in FSDP2, the first reduce after that assigns the reduced
 * gradient (cast to the stored dtype; a -0.0 stays -0.0) and later ones accumulate into
 * it; a parameter not handed out by ms_unit_grad_full keeps no gradient.  The gradient
 * buffers are kept (ms_unit_bytes category 1 does not change), only marked empty.  There is
 * no set_to_none=False mode: to have AdamW decay a parameter without a gradient, hand out
 * its gradient (zeros) before reduce_grads. */
ms_status ms_unit_zero_grad(ms_unit *u);

/* Sum of squares of this rank's gradient shards (padding excluded; parameters without a
 * gradient count nothing), each divided by the number of ranks holding the same shard
 * (the replicate size), so that summing over the world counts every element once. */
ms_status ms_unit_grad_sq_norm(ms_unit *u, double *out);
/* Multiplies the sharded gradients (of the parameters that have one) by scale (clipping);
 * MS_ERR_ARG for a scale that is not finite (NaN or infinite). */
ms_status ms_unit_scale_grads(ms_unit *u, double scale);
/* How ms_unit_adamw_step keeps its state, for parameters stored in another dtype than f32
 * (for f32 ones both are the same, bit for bit):
 *   MS_ADAMW_MASTER (the default): f32 moments and f32 master weights, which AdamW updates
 *     and rounds into the stored shard (what TE's FusedAdam with master weights does; 12
 *     bytes a bf16 parameter);
 *   MS_ADAMW_TORCH: torch.optim.AdamW on the stored parameters: moments in the stored
 *     dtype, no master weights, every operation rounded to that dtype as PyTorch's kernels
 *     round it (4 bytes a bf16 parameter; 16 an f64 one, computed in f64).
 * Set before the unit's AdamW state is made (by its first adamw_step, or by
 * ms_unit_adamw_state): MS_ERR_STATE after, if the mode changes. */
typedef enum ms_adamw_mode { MS_ADAMW_MASTER = 0, MS_ADAMW_TORCH = 1 } ms_adamw_mode;
ms_status ms_unit_set_adamw(ms_unit *u, ms_adamw_mode mode);
/* AdamW's state of parameter i on this rank, to checkpoint it and restore it: which =
 * MS_ADAMW_EXP_AVG or MS_ADAMW_EXP_AVG_SQ, the moments (f32, or the stored dtype with
 * MS_ADAMW_TORCH), or MS_ADAMW_MASTER_WEIGHTS, the f32 master weights; flat tensors of the
 * shard's element count, where the shards are (the device, or the host when offloaded).
 * Borrowed: valid while the unit lives.  The unit's first adamw_step makes the state, or
 * this call does before it (zero moments, master weights from the shard; the unit's
 * ms_unit_set_adamw mode is then fixed): to restore a checkpoint into a new unit, load the
 * parameters (ms_unit_load_full), then write these, then ms_unit_set_adamw_skipped.  NULL
 * with an empty message where there is none: a frozen parameter; the master weights of an
 * f32 unit or with MS_ADAMW_TORCH.  NULL with the message set on error (MS_ERR_ARG,
 * MS_ERR_STATE before finalize or while an op is pending). */
typedef enum ms_adamw_state_kind {
    MS_ADAMW_EXP_AVG = 0,
    MS_ADAMW_EXP_AVG_SQ = 1,
    MS_ADAMW_MASTER_WEIGHTS = 2
} ms_adamw_state_kind;
ms_tensor *ms_unit_adamw_state(ms_unit *u, int i, ms_adamw_state_kind which);
/* How many of the unit's adamw_step calls parameter i had no gradient in (its own step
 * count, torch's state['step'], is the caller's step less this); -1 with the message set
 * for a bad unit or index.  Checkpoint it with the state; ms_unit_set_adamw_skipped
 * restores it (MS_ERR_ARG below 0, or above 0 for a frozen parameter, which takes no steps). */
int64_t ms_unit_adamw_skipped(const ms_unit *u, int i);
ms_status ms_unit_set_adamw_skipped(ms_unit *u, int i, int64_t skipped);
/* AdamW on the rank's shards that have a gradient (parameters without one are left alone,
 * as torch skips a parameter whose grad is None), while sharded, its state kept as
 * ms_unit_set_adamw says (made on the first step), decoupled weight decay.  step is the caller's step, counting every call from 1; as torch counts
 * steps per parameter (state['step'] advances only when the parameter has a gradient), a
 * parameter that had no gradient in k earlier calls takes step - k in its bias corrections
 * (MS_ERR_ARG, naming it, where that is below 1).  torch.optim.AdamW op by op (core/src/unit_math.h):
 * f32 results, and the bf16 and f16 ones of MS_ADAMW_TORCH, are PyTorch's bits (its x86-64
 * CPU kernels; its CUDA kernels fuse the same multiply-adds), up to torch's CPU sqrt, which
 * is not always correctly rounded where this one is. */
/* torch.optim.AdamW's defaults for what a caller leaves out: betas (0.9, 0.999), eps 1e-8,
 * weight_decay 0.01 (the bindings' adamw_step reads them here). */
ms_status ms_adamw_defaults(double *beta1, double *beta2, double *eps, double *weight_decay);
ms_status ms_unit_adamw_step(ms_unit *u, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int64_t step);
/* Bytes this rank holds for the unit now, by category: MS_BYTES_SHARDS padded shards,
 * MS_BYTES_GRADS padded gradient shards, MS_BYTES_OPTIMIZER optimizer state incl. master
 * weights, MS_BYTES_UNSHARDED unsharded parameters and gradients (for
 * a unit of one dim-0 parameter, the padded all-gather and reduce-scatter buffers they are
 * views of), the sync-off accumulator, the k-way shard and the flat buffer of a pending
 * collective, MS_BYTES_CACHED the free buffers the unit gave back to the rank's cache, kept for reuse by
 * any unit of the rank.  -1 for another category.  Summed over the units of a rank, the
 * categories count everything the rank holds for them. */
typedef enum ms_bytes_category {
    MS_BYTES_SHARDS = 0,
    MS_BYTES_GRADS = 1,
    MS_BYTES_OPTIMIZER = 2,
    MS_BYTES_UNSHARDED = 3,
    MS_BYTES_CACHED = 4
} ms_bytes_category;
int64_t ms_unit_bytes(const ms_unit *u, ms_bytes_category category);
/* The memory allocated for the units of u's rank (every unit of its world and world rank,
 * which share a buffer cache), by category: MS_BYTES_SHARDS, MS_BYTES_GRADS,
 * MS_BYTES_OPTIMIZER, and MS_BYTES_UNSHARDED for the unsharded and cached buffers
 * together (ms_unit_bytes' last two).  Counted where storage
 * is allocated and freed (the calloc / cudaMalloc sizes of the buffers the units made, taken
 * off when the last reference to one goes, a caller's included), not from the units' own
 * books, so a host can hold both the books and the planner to the memory really used.  -1
 * with the message set for a NULL unit or another category. */
int64_t ms_unit_rank_allocated(const ms_unit *u, ms_bytes_category category);

/* The collectives a unit has issued, for audits: their kind, the dtype, the group size and
 * the bytes of the whole buffer. */
typedef enum ms_record_kind {
    MS_RECORD_ALL_GATHER = 0,
    MS_RECORD_REDUCE_SCATTER = 1,
    MS_RECORD_ALL_REDUCE = 2
} ms_record_kind;
int ms_unit_record_count(const ms_unit *u);
ms_status ms_unit_record(const ms_unit *u, int i, ms_record_kind *kind, ms_dtype *dtype, int *group_size,
                         int64_t *bytes);
void ms_unit_clear_records(ms_unit *u);

/* ---------------------------------------------------------------- files */

/* What a path names, as stat(2) sees it (symbolic links followed). */
typedef enum ms_file_kind {
    MS_FILE_REGULAR = 0,
    MS_FILE_DIRECTORY = 1,
    MS_FILE_FIFO = 2,         /* a named pipe: opening it for reading waits for a writer */
    MS_FILE_CHAR_DEVICE = 3,  /* /dev/zero, a terminal, ... */
    MS_FILE_BLOCK_DEVICE = 4,
    MS_FILE_SOCKET = 5,
    MS_FILE_OTHER = 6
} ms_file_kind;

/* The kind of file at path and, for a regular file, its size in bytes (0 for any other
 * kind), without opening it: callers refuse what is not a regular file before an open
 * could block (a FIFO) or a read could never end (/dev/zero).  MS_ERR_IO with
 * "<path>: <strerror>" when stat fails (a missing file, a permission), MS_ERR_ARG for a
 * NULL argument. */
ms_status ms_file_stat(const char *path, ms_file_kind *kind, int64_t *size);
/* "regular file", "directory", "FIFO (named pipe)", "character device", "block device",
 * "socket", "special file": a static string; NULL for an invalid kind. */
const char *ms_file_kind_name(ms_file_kind kind);
/* Reads the box [start, start + size) of a row-major tensor of ndim dims src_shape and dtype
 * src_dtype stored at byte data_offset of the file at path, and copies it with a cast (ms_cast's
 * rules) into dst (cpu, any strides), whose dim i is the box's dim perm[i] (perm NULL: the
 * identity; the box's sizes are dst's, permuted).  One pread of the bytes from the box's first
 * element to its last (exactly the box when it is rows of dim 0); *bytes_read (may be NULL)
 * gets their count.  The Hugging Face checkpoint loader's reads (core/src/ckpt_hf.c). */
ms_status ms_file_read_region(const char *path, int64_t data_offset, ms_dtype src_dtype, int ndim,
                              const int64_t *src_shape, const int64_t *start, const int64_t *perm, ms_tensor *dst,
                              int64_t *bytes_read);

/* ---------------------------------------------------------------- Megatron-FSDP buckets (ZeRO-0..3 runtime)
 *
 * One rank's part of one bucket of a Megatron-FSDP unit (moonshard.plan_megatron; megatron_fsdp's
 * param_and_grad_buffer.py): parameters of one dtype and requires_grad, placed at given offsets
 * in a flat buffer of `size` elements (padded by the plan to a multiple of dp x chunk, except
 * for no_shard), dp rank r owning elements [r*size/dp, (r+1)*size/dp): its slice, which may cut
 * a parameter anywhere (each element belongs to exactly one rank).  It is an ms_unit handle of
 * its own mode, made by ms_unit_zero_new: ms_unit_name, ms_unit_param_count, ms_unit_param_fqn,
 * ms_unit_param_info, ms_unit_set_adamw, ms_unit_bytes, ms_unit_rank_allocated,
 * ms_unit_record* and ms_unit_release serve it; the FSDP2 calls refuse it (MS_ERR_STATE).
 * What a rank holds, per strategy (W = dp ranks, S = size):
 *   no_shard (0)   each parameter whole (MS_BYTES_SHARDS), the gradient buffer of S elements;
 *                  AdamW state for every element; all_reduce of the gradients
 *   optim (1)      the parameter buffer of S elements, the gradient buffer of S elements;
 *                  AdamW state for the rank's slice; reduce_scatter of the gradients, all_gather
 *                  of the updated slices after AdamW
 *   optim_grads (2) as optim, but the gradients kept are the rank's slice (S/W): the whole
 *                  gradient bucket is transient (MS_BYTES_UNSHARDED), from the first
 *                  ms_unit_zero_tensor(MS_ZERO_GRAD) to its reduce_scatter
 *   optim_grads_params (3) as optim_grads, and the parameters kept are the rank's slice:
 *                  ms_unit_zero_unshard all_gathers the whole bucket (transient) for forward
 *                  or backward, ms_unit_zero_reshard frees it
 * With W = 1 the slice is the whole bucket: nothing is transient and no collective runs.
 * Gradients are in grad_dtype (grad_reduce_in_fp32: f32), multiplied by 1/W and summed.  With
 * main_f32 (preserve_fp32_weights) the rank's slice has f32 main weights (MS_BYTES_SHARDS, the
 * whole buffer for no_shard), which AdamW updates and rounds into the parameters; else AdamW
 * works as ms_unit_set_adamw says (MS_ADAMW_MASTER: f32 moments and master weights of the
 * slice's parameter elements; MS_ADAMW_TORCH: moments in the stored dtype), the state
 * (MS_BYTES_OPTIMIZER) counting only the parameter elements of the slice (not padding), made
 * by the first adamw_step.  AdamW is the shard units' (unit_math.h), element by element.
 * Collectives run on the rank's thread, synchronously, and are recorded (ms_unit_record):
 * the bytes of the whole buffer. */
typedef enum ms_zero_strategy {
    MS_ZERO_NO_SHARD = 0,
    MS_ZERO_OPTIM = 1,
    MS_ZERO_OPTIM_GRADS = 2,
    MS_ZERO_OPTIM_GRADS_PARAMS = 3
} ms_zero_strategy;
/* A bucket over the dp group `dp`: stored dtype `dtype`; requires_grad 0 for a frozen bucket
 * (no gradients, no optimizer state); grad_dtype a floating dtype or -1 for `dtype`;
 * main_f32: f32 main weights (trainable buckets only). */
ms_status ms_unit_zero_new(ms_unit **out, const char *name, ms_comm *dp, ms_zero_strategy strategy, ms_dtype dtype,
                           int requires_grad, int grad_dtype, int main_f32);
/* Adds a parameter of `shape` (0 to 8 dims) at element `offset` of the bucket, in plan order. */
ms_status ms_unit_zero_add_param(ms_unit *u, const char *fqn, int ndim, const int64_t *shape, int64_t offset);
/* Fixes the bucket's size (a multiple of W unless no_shard), checks that the parameters fit
 * without overlapping, and allocates what the strategy keeps (zero-filled). */
ms_status ms_unit_zero_finalize(ms_unit *u, int64_t size);
/* 1 for a unit made by ms_unit_zero_new, else 0. */
int ms_unit_is_zero(const ms_unit *u);
/* Views, borrowed while the buffer behind them lives:
 *   MS_ZERO_PARAM  parameter i (its shape, stored dtype) in the whole bucket: always, except
 *                  under optim_grads_params with W > 1, where only while unsharded
 *   MS_ZERO_GRAD   parameter i's gradient (its shape, grad dtype) in the whole gradient bucket,
 *                  for the host's backward to write or add into (a transient bucket is made
 *                  zero-filled by the first call after a reduce)
 *   MS_ZERO_PIECE_* the elements [start, stop) of parameter i that this rank owns
 *                  (ms_unit_zero_piece), flat: its parameter values, its reduced gradient,
 *                  AdamW's exp_avg, exp_avg_sq (once made), and its f32 main or master weights
 * NULL with an empty message where there is none (a frozen bucket's gradient; no state yet). */
typedef enum ms_zero_view {
    MS_ZERO_PARAM = 0,
    MS_ZERO_GRAD = 1,
    MS_ZERO_PIECE_PARAM = 2,
    MS_ZERO_PIECE_GRAD = 3,
    MS_ZERO_PIECE_EXP_AVG = 4,
    MS_ZERO_PIECE_EXP_AVG_SQ = 5,
    MS_ZERO_PIECE_MAIN = 6
} ms_zero_view;
ms_tensor *ms_unit_zero_tensor(ms_unit *u, int i, ms_zero_view which);
/* The elements [*start, *stop) of parameter i (flat, row-major) in this rank's slice (no_shard:
 * all of them; an empty piece has start == stop). */
ms_status ms_unit_zero_piece(const ms_unit *u, int i, int64_t *start, int64_t *stop);
/* Copies a full tensor (parameter i's numel, contiguous, any dtype) into what this rank holds
 * of parameter i: the parameter (or its piece under optim_grads_params) and the piece's main
 * or master weights. */
ms_status ms_unit_zero_load_full(ms_unit *u, int i, const ms_tensor *full);
/* optim_grads_params: all_gather of the bucket into a transient whole bucket; reshard frees
 * it.  A no-op for the other strategies and for W = 1. */
ms_status ms_unit_zero_unshard(ms_unit *u);
ms_status ms_unit_zero_reshard(ms_unit *u);
/* Makes AdamW's state of a trainable bucket now, as its first adamw_step would (zero moments,
 * main or master weights from the parameters), for a checkpoint's load to fill; a no-op when
 * it exists or the bucket is frozen. */
ms_status ms_unit_zero_make_state(ms_unit *u);
/* The gradient bucket multiplied by 1/W and reduced: all_reduce (no_shard) or reduce_scatter
 * into the rank's slice (added into the kept slice under optim_grads and optim_grads_params,
 * freeing the transient bucket).  A no-op for a frozen bucket. */
ms_status ms_unit_zero_reduce_grads(ms_unit *u);
/* Zeroes the kept gradients (Megatron-FSDP's zero_grad of the main gradient buffer). */
ms_status ms_unit_zero_clear_grads(ms_unit *u);
/* AdamW (step counted from 1) on the rank's slice of a trainable bucket with reduced gradients,
 * then, under optim and optim_grads with W > 1, the all_gather of every rank's updated slice
 * into the parameter buffer (frozen buckets too: Megatron-FSDP gathers every bucket once a step). */
ms_status ms_unit_zero_adamw_step(ms_unit *u, double lr, double beta1, double beta2, double eps,
                                  double weight_decay, int64_t step);

/* ---------------------------------------------------------------- lower precision (quant.c)
 *
 * The numerics of NeMo Automodel's lower-precision steps, value for value as the libraries
 * that define them (docs/numerics.md, "Lower precision", cites their source): QLoRA's NF4
 * (bitsandbytes' quantize_4bit / dequantize_4bit, compress_statistics), torchao's float8
 * training casts (torchao.float8) and torchao's QAT fake quantisation.  Every tensor is a
 * contiguous cpu tensor; outputs are the caller's, of the shapes and dtypes stated
 * (MS_ERR_SHAPE / MS_ERR_DTYPE / MS_ERR_DEVICE naming the argument otherwise). */

/* NF4.  x (f32, bf16 or f16, any shape) in blocks of `blocksize` consecutive elements
 * (bitsandbytes' sizes: 32, 64, 128, 256, 512, 1024, 2048, 4096): absmax (f32, one per
 * block, the last block may be short) and codes (u8, ceil(numel / 2): element 2i in the
 * high nibble of byte i, 2i + 1 in the low one, as bitsandbytes packs them), each element
 * the index of the nearest value of the NF4 table to x / absmax. */
ms_status ms_nf4_quantize(const ms_tensor *x, int64_t blocksize, ms_tensor *codes, ms_tensor *absmax);
/* out (f32, bf16 or f16; numel <= 2 * codes' numel) = table[code] * absmax of its block. */
ms_status ms_nf4_dequantize(ms_tensor *out, const ms_tensor *codes, const ms_tensor *absmax, int64_t blocksize);
/* Double quantisation of the absmax (compress_statistics): offset = mean(absmax) (f32), and
 * absmax - offset quantized blockwise (blocks of 256) with bitsandbytes' 8-bit dynamic map:
 * qabsmax (u8, absmax's numel), absmax2 (f32, ceil(numel / 256)).  *offset holds an f32. */
ms_status ms_nf4_compress_absmax(const ms_tensor *absmax, ms_tensor *qabsmax, ms_tensor *absmax2, double *offset);
/* absmax (f32) = dynamic_map[qabsmax] * absmax2 of its block + offset (an f32 value). */
ms_status ms_nf4_decompress_absmax(ms_tensor *absmax, const ms_tensor *qabsmax, const ms_tensor *absmax2,
                                   double offset);
/* Bytes of a quantized tensor of numel elements: ceil(numel / 2) codes + 4 per block
 * (absmax), or with double_quant 1 per block + 4 per 256 blocks + 4 (the offset).  The
 * 256-byte dynamic map is shared by every tensor and not counted. */
ms_status ms_nf4_bytes(int64_t numel, int64_t blocksize, int double_quant, int64_t *out);

/* Float8 (torchao.float8).  Tensorwise: one amax (and scale) for the whole tensor; rowwise
 * (axiswise on the last dim): one per row, numel / size(-1) of them. */
typedef enum ms_fp8_scaling {
    MS_FP8_TENSORWISE = 0,
    MS_FP8_ROWWISE = 1
} ms_fp8_scaling;
/* amax (f32, 1 or rows elements) = max |x| (x f32 or bf16); NaN propagates, as torch.max. */
ms_status ms_fp8_amax(ms_tensor *amax, const ms_tensor *x, ms_fp8_scaling scaling);
/* scale (f32, amax's numel) = fp8_max / max(amax, 1e-12) in f64, rounded to f32
 * (amax_to_scale); round_pow2 then rounds it down to a power of two
 * (round_scales_to_power_of_2).  fp8: f8e4m3 (max 448) or f8e5m2 (57344). */
ms_status ms_fp8_scale(ms_tensor *scale, const ms_tensor *amax, ms_dtype fp8, int round_pow2);
/* out (f8e4m3 or f8e5m2, x's numel) = x.to(f32) * scale, clamped to +-fp8_max, cast (x f32 or
 * bf16; scale f32 of 1 or rows elements): hp_tensor_and_scale_to_float8. */
ms_status ms_fp8_cast(ms_tensor *out, const ms_tensor *x, const ms_tensor *scale);
/* out (f32, bf16 or f16) = fp8.to(out's dtype) / scale, as torchao's to_original_precision. */
ms_status ms_fp8_dequantize(ms_tensor *out, const ms_tensor *fp8, const ms_tensor *scale);

/* QAT fake quantisation (torchao.quantization.qat): the forward values; the gradient is
 * the straight-through estimator, the identity. */
typedef enum ms_qat_scheme {
    MS_QAT_INT4_WEIGHT_ONLY = 0, /* Int4WeightOnlyQATQuantizer's weight: uint4 groupwise
                                  * asymmetric, tinygemm's float zero-point domain */
    MS_QAT_8DA4W_WEIGHT = 1,     /* Int8DynActInt4WeightQATQuantizer's weight: int4 groupwise
                                  * symmetric */
    MS_QAT_8DA4W_ACTIVATION = 2  /* its activation: int8 per-token asymmetric, dynamic */
} ms_qat_scheme;
/* out (x's dtype and numel) = x (f32 or bf16, groups of group_size along the last dim, which
 * group_size divides; the activation's groups are its rows) quantized and dequantized;
 * scales_precision (f32 or bf16) is the quantizer's (the activation ignores it and the group
 * size). */
ms_status ms_qat_fake_quantize(ms_tensor *out, const ms_tensor *x, ms_qat_scheme scheme, int64_t group_size,
                               ms_dtype scales_precision);

/* The FP8 all-gather of a parameter, as torchao's float8 weights under FSDP2
 * (torchao/float8/fsdp_utils.py, WeightWithDynamicFloat8CastTensor with dynamic scaling):
 * on unshard this rank's shard's amax is all-reduced MAX over the unit's shard group (and
 * replicate group), each rank casts its shard to e4m3 with that scale (ms_fp8_scale,
 * ms_fp8_cast), the fp8 bytes are all-gathered, and the unsharded parameter is the gathered
 * data dequantized to its gather dtype (ms_fp8_dequantize).  Set while the unit is being
 * built (before ms_unit_finalize), on a parameter stored in f32 or bf16 and gathered in f32,
 * bf16 or f16, in a cpu unit without a k-way reshard; MS_ERR_STATE, MS_ERR_DTYPE or
 * MS_ERR_ARG naming the reason otherwise.  Gradients are reduced as for any parameter. */
ms_status ms_unit_set_fp8_all_gather(ms_unit *u, int i, int enable);

/* ---------------------------------------------------------------- checkpoint files (ckpt.c)
 *
 * The primitives of lua/moonshard/checkpoint.lua (docs/checkpoints.md): checksums, files
 * written from tensors and synced, byte ranges read back with pread, renames that survive a
 * crash.  Tensors are contiguous cpu tensors (MS_ERR_DEVICE / MS_ERR_ARG otherwise); fds are
 * POSIX file descriptors from ms_ckpt_open.  Failures of the system are MS_ERR_IO with the
 * path (where there is one) and strerror. */

/* CRC32C (Castagnoli, as iSCSI, ext4 and Google's crc32c): *out = the checksum of nbytes
 * bytes continuing crc (0 to start), so crc32c(a..b) = ms_crc32c(ms_crc32c(0, a), b).
 * "123456789" gives 0xE3069283.  data may be NULL when nbytes = 0. */
ms_status ms_crc32c(uint32_t crc, const void *data, int64_t nbytes, uint32_t *out);
/* "sse4.2" (the crc32 instruction) or "table" (slicing-by-8; MOONSHARD_CRC32C=table forces
 * it): the same values either way. */
const char *ms_crc32c_impl(void);
/* The same over a tensor's bytes. */
ms_status ms_tensor_crc32c(const ms_tensor *t, uint32_t crc, uint32_t *out);
/* Opens path for reading (write = 0) or creates / truncates it for writing (mode 0644). */
ms_status ms_ckpt_open(const char *path, int write, int *fd);
/* Appends nbytes bytes (data may be NULL when nbytes = 0). */
ms_status ms_ckpt_write(int fd, const void *data, int64_t nbytes);
/* Appends a tensor's bytes; *crc gets their CRC32C. */
ms_status ms_ckpt_write_tensor(int fd, const ms_tensor *t, uint32_t *crc);
/* Reads a box of a row-major tensor of `shape` (ndim 1 to 8 dims) stored at byte `offset` of
 * the file, in out's dtype (its element size): the elements [start[d], start[d] + out's
 * size(d)) of each dim d, into out (contiguous, ndim dims), with one pread per contiguous
 * run.  MS_ERR_SHAPE for a box outside shape, MS_ERR_IO for a file that ends too soon. */
ms_status ms_ckpt_read_box(int fd, int64_t offset, int ndim, const int64_t *shape, const int64_t *start,
                           ms_tensor *out);
/* Closes fd, after fsync(2) when sync is nonzero (a failed fsync is reported, fd closed). */
ms_status ms_ckpt_close(int fd, int sync);
/* fsync(2) of a file or directory by path. */
ms_status ms_ckpt_fsync_path(const char *path);
/* rename(2), then fsync of the directory holding `to`. */
ms_status ms_ckpt_rename(const char *from, const char *to);
/* mkdir(2), mode 0755; exist_ok: an existing directory is no error. */
ms_status ms_ckpt_mkdir(const char *path, int exist_ok);
/* The names in a directory (not "." and ".."), each followed by a NUL byte, into buf when
 * they fit in cap bytes; *len gets the bytes they need (call again with a larger buf when
 * *len > cap).  buf may be NULL when cap = 0. */
ms_status ms_ckpt_list_dir(const char *path, char *buf, int64_t cap, int64_t *len);

/* MS_API_END */

#ifdef __cplusplus
}
#endif

#endif /* MOONSHARD_H */
