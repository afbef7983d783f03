/*
 * unit_internal.h: private to the shard units' files (unit.c, unit_cache.c, unit_adamw.c):
 * the unit's structs and states, and the functions the three files share.  Nothing else
 * includes it.
 */
#ifndef MS_UNIT_INTERNAL_H
#define MS_UNIT_INTERNAL_H

#include "comm.h"

#include <stdbool.h>
#include <stdint.h>

/* ---------------------------------------------------------------- types */

/* ms_unit_bytes categories: the buffers the unit holds, then the free buffers it left in the
 * rank's cache. */
enum { CAT_COUNT = MS_BYTES_CACHED + 1 }; /* ms_bytes_category */

typedef enum unit_state {
    ST_BUILDING,  /* parameters are being added */
    ST_SHARDED,   /* the shards only */
    ST_GATHERING, /* an all_gather is pending (ms_unit_wait copies out) */
    ST_UNSHARDED, /* the unsharded parameters are alive */
    ST_KEPT,      /* resharded with MS_RESHARD_KEEP: the unsharded parameters are kept */
    ST_KWAY,      /* resharded to a k-way shard (u->kept) */
    ST_REDUCING,  /* a reduce_grads is pending (ms_unit_wait accumulates) */
    ST_FAILED,    /* a collective failed: u->failure */
    ST_ZERO       /* a Megatron-FSDP bucket (unit_zero.c): the FSDP2 calls refuse it */
} unit_state;

#define ST(s) (1u << (s))
/* Finalized with no pending op. */
#define ST_IDLE (ST(ST_SHARDED) | ST(ST_UNSHARDED) | ST(ST_KEPT) | ST(ST_KWAY))

typedef struct unit_param {
    char *fqn;
    int ndim;
    int64_t shape[MS_MAX_DIMS];        /* global */
    int64_t padded_shape[MS_MAX_DIMS]; /* the padded shard */
    int dim;                           /* shard dim, normalised */
    bool requires_grad;
    ms_dtype dtype;  /* stored */
    ms_dtype gather; /* the dtype it is gathered (computed) in, by FSDP2's rule (finalize) */
    ms_dtype reduce; /* the dtype its gradient is reduced in (finalize) */
    int policy_param, policy_reduce; /* its own policy dtypes in a packed unit (-1 unset), when own_policy */
    bool own_policy;                 /* ms_unit_set_param_policy gave it its own policy */
    int red;                         /* its reduce group: index into u->red_dtype (finalize) */
    int64_t padded_numel;
    int64_t flat_offset; /* into each rank's S-element gather chunk: elements, bytes in a bytes unit */
    int64_t grad_offset; /* elements into each rank's chunk of its reduce group's buffer (in_reduce) */
    bool in_reduce;      /* part of the pending reduce_grads */
    ms_tensor *padded;      /* (padded_shape) stored dtype, zero padding; MS_BYTES_SHARDS */
    ms_tensor *shard;       /* view: padded narrowed to this rank's real rows */
    ms_tensor *grad_padded; /* (padded_shape) stored dtype, from the first reduce; MS_BYTES_GRADS */
    ms_tensor *grad_shard;  /* view: grad_padded narrowed to the real rows */
    bool has_grad;          /* grad_padded holds a gradient: set by a reduce, cleared by zero_grad
                             * (PyTorch's grad = None; the buffer stays) */
    int64_t skipped_steps;  /* adamw_step calls that found no gradient: the parameter's own step
                             * count is the caller's step less these (torch's state['step']) */
    ms_tensor *exp_avg;     /* (shard numel) AdamW first moment, f32 (the stored dtype with
                             * MS_ADAMW_TORCH); MS_BYTES_OPTIMIZER */
    ms_tensor *exp_avg_sq;  /* (shard numel) AdamW second moment, as exp_avg; MS_BYTES_OPTIMIZER */
    ms_tensor *master;      /* (shard numel) f32 master weights when stored != f32; MS_BYTES_OPTIMIZER */
    /* (shape) gather dtype: the unsharded parameter and this backward's gradient;
     * MS_BYTES_UNSHARDED, or views of full_flat and grad_flat in an in_place unit */
    ms_tensor *full, *grad_full;
    ms_tensor *full_flat; /* (W*S) gather dtype: the all_gather output full views; MS_BYTES_UNSHARDED */
    ms_tensor *grad_flat; /* (W*S) gather dtype: the reduce_scatter input grad_full views; MS_BYTES_UNSHARDED */
    ms_tensor *grad_acc;    /* (shape) reduce dtype: gradients accumulated with sync off; MS_BYTES_UNSHARDED */
    bool fp8;        /* gathered as e4m3 with a dynamic scale (unit_fp8.c) */
    float fp8_scale; /* the scale of the last fp8 gather */
} unit_param;

/* The floating dtypes a unit's gradients can be reduced in: at most one reduce group each. */
enum { UNIT_MAX_REDUCE = 6 };

/* One reduce_scatter of a pending reduce_grads: the gradients of one reduce dtype. */
typedef struct unit_reduce {
    ms_tensor *flat;    /* owned: the (W, S_r) reduce_scatter input in the group's dtype; MS_BYTES_UNSHARDED */
    ms_tensor *slice;   /* owned view: this rank's chunk of flat, the reduce_scatter output */
    ms_op op;           /* reduce_scatter */
    ms_op replicate_op; /* HSDP all_reduce */
    double post_divide; /* slice /= post_divide on wait */
    ms_dtype dtype;     /* the group's reduce dtype */
    int group;          /* its index in u->red_dtype (unit_param.red) */
} unit_reduce;

/* The pending collective.  Between submit and wait only the communication thread uses it. */
typedef struct unit_op {
    ms_ticket ticket;
    ms_comm *comm;      /* borrowed: the all_gather's or reduce_scatter's group */
    ms_tensor *flat;    /* borrowed: u->flat, the all_gather's whole buffer */
    ms_tensor *slice;   /* owned view: this rank's slice of flat (all_gather in) */
    ms_comm *replicate; /* borrowed: HSDP all_reduce of each reduce slice over this group, else NULL */
    const char *label;  /* borrowed: the unit's name in messages, labelling its collectives */
    int nred;           /* reduce: the reduce groups with gradients this step, in u->red_dtype order */
    unit_reduce red[UNIT_MAX_REDUCE];
} unit_op;

typedef struct buf_cache buf_cache;

typedef struct unit_record {
    ms_record_kind kind;
    ms_dtype dtype;
    int group_size;
    int64_t bytes;
} unit_record;

struct ms_unit {
    atomic_int refcount;
    char *name;
    ms_comm *shard;     /* retained; W ranks */
    ms_comm *replicate; /* retained; R ranks; NULL for a 1-D mesh */
    ms_comm *kgroup;    /* retained; the k consecutive shard ranks of a k-way reshard, else NULL */
    int W, R, rank;     /* rank: in the shard group */
    int k;              /* after forward: 0 keep, 1 free (the whole shard group), else the k-way size */
    int policy_param, policy_reduce; /* the policy's dtypes, -1 = unset */
    ms_dtype stored, gather, reduce; /* the trainable parameters' (else the first's): effective, per
                                      * FSDP2's rule, from finalize; a packed unit's first
                                      * trainable parameter's */
    bool packed;        /* trainable parameters of several stored dtypes and own policies (ms_unit_set_packed) */
    int nred;           /* the distinct reduce dtypes of the trainable parameters (finalize) */
    ms_dtype red_dtype[UNIT_MAX_REDUCE]; /* in the order of the parameters that first have them */
    unit_state state;
    char failure[1024]; /* the first failure's message (ST_FAILED) */
    unit_param *params; /* (nparams), capacity cap */
    int nparams, cap;
    int64_t S;          /* elements of one rank's gather chunk */
    bool in_place;      /* the (W, S) layout is the full tensor of the unit's one parameter (finalize) */
    bool gather_bytes;  /* parameters gathered in different dtypes: the gather buffers are u8 and S
                         * counts bytes (FSDP2's uint8 all-gather of frozen parameters of other dtypes) */
    int device;         /* the CUDA device of the transient buffers, or -1 for the host */
    bool offload;       /* the shards, gradient shards and optimizer state on the host (device >= 0) */
    int adamw;          /* MS_ADAMW_MASTER or MS_ADAMW_TORCH (ms_unit_set_adamw) */
    bool adamw_made;    /* the AdamW state exists (an adamw_step or ms_unit_adamw_state made it) */
    ms_tensor *flat;    /* (W*S) gather dtype while GATHERING (while REDUCING: op.red[g].flat); MS_BYTES_UNSHARDED */
    ms_tensor *kept;    /* ((W/k)*S) gather dtype: the k-way shard (KWAY); MS_BYTES_UNSHARDED */
    unit_op op;
    bool sync;            /* requires_gradient_sync */
    double divide_factor; /* 0 = default (W * R) */
    buf_cache *cache;     /* the rank's buffer cache, shared with its other units */
    int64_t bytes[MS_BYTES_CACHED]; /* the categories held; the cache counts MS_BYTES_CACHED */
    unit_record *records; /* (nrecords), capacity rcap */
    int nrecords, rcap;
    struct unit_zero *zero; /* a Megatron-FSDP bucket's own part (unit_zero.c), else NULL */
};

/* How messages name a unit: the root (the empty name) as "<root>", as the planner shows it. */
static inline const char *unit_label(const ms_unit *u) { return u->name[0] ? u->name : "<root>"; }

/* The shards, gradient shards and optimizer state are on the unit's GPU. */
static inline bool shards_on_device(const ms_unit *u) { return u->device >= 0 && !u->offload; }

/* ---------------------------------------------------------------- unit_cache.c */

/* The cache of (w, rank), created if needed; the caller uses it until cache_release. */
ms_status cache_acquire(ms_world *w, int rank, buf_cache **out);
/* Ends a use of c; the last frees it with whatever it still holds. */
void cache_release(buf_cache *c);
/* Frees the buffers `owner` left in c. */
void cache_drop(buf_cache *c, const ms_unit *owner);

/* Elements [off, off + n) of a contiguous buffer set to zero, on the host or the device. */
ms_status zero_elems(ms_tensor *t, int64_t off, int64_t n);
/* A contiguous buffer of category cat for u: for a transient (unsharded) one, a free one of
 * the same dtype and numel from the rank's cache, holding what it held (zero-filled when
 * `zero`); else a new zero-filled one. */
ms_status buf_new(ms_unit *u, int cat, ms_tensor **out, int ndim, const int64_t *shape, ms_dtype dtype, bool zero);
/* Drops u's reference to a buffer of category cat: a transient (unsharded) one goes into
 * the rank's cache unless it is shared. */
void buf_free(ms_unit *u, int cat, ms_tensor **t);

/* ---------------------------------------------------------------- unit.c */

/* MS_OK when u's state is one of `allowed`, else MS_ERR_STATE naming the unit, the call
 * and the state (with the first failure's message once the unit failed). */
ms_status check_state(const ms_unit *u, const char *call, unsigned allowed);
/* Parameter i of u (u checked by the caller). */
ms_status param_at(const ms_unit *u, const char *call, int i, unit_param **out);
/* flat[at, at + numel(src)) <- src (contiguous, any device), cast to flat's dtype. */
ms_status copy_into_flat(ms_tensor *flat, int64_t at, ms_tensor *src);

/* Records a collective of u (ms_unit_record). */
ms_status unit_add_record(ms_unit *u, ms_record_kind kind, ms_dtype dtype, int group_size, int64_t bytes);

/* ---------------------------------------------------------------- unit_zero.c */

/* Frees a Megatron-FSDP bucket's own buffers (ms_unit_release, before the cache is dropped). */
void zero_free(ms_unit *u);

/* unit_fp8.c: the FP8 all-gather (ms_unit_set_fp8_all_gather) */
bool ms__unit_has_fp8(const ms_unit *u);
ms_status ms__unit_fp8_all_gather(void *arg); /* the pending op: amax all-reduce, cast, all_gather */
ms_status ms__unit_fp8_unpack(ms_unit *u, unit_param *p); /* p->full from the gathered fp8 bytes */

#endif /* MS_UNIT_INTERNAL_H */
