/*
 * test_nccl.c: the NCCL backend on a world of one GPU (what one H200 allows: NCCL refuses
 * two ranks on one device), through the public API.
 *
 *  1. every collective, every dtype and op it takes, on cuda tensors and on cpu tensors
 *     (staged through the GPU): a one-rank group leaves the values as they are, so every
 *     result is checked against its input bit for bit, read back to the host;
 *  2. groups: a mesh group, a tagged group over the same rank, the in-place forms; a
 *     collective and a split asked for while a unit's all-gather is pending (all of them
 *     run on the rank's communication thread, in order);
 *  3. sends and receives: refused on one rank (no peer), the comm still usable;
 *  4. shard units on the NCCL world, one parameter (the in-place layout) and two (packed),
 *     in five configurations (dtypes, layouts, one of 2^22 elements), with their shards on
 *     the GPU and offloaded to the host: three training steps of two micro-batches (sync
 *     off, then on), gradient norm, clipping and AdamW, against the same on a one-rank
 *     threads world: the shards must be bit-identical to the CPU's (the device kernels
 *     compute the host's bits), every tensor on the device it belongs to.
 *
 * Exit 77 (ctest: skipped) without NCCL in the build or without a CUDA device.  Multi-GPU
 * runs (mpirun -np 2 moonshard --backend nccl ...) are in tests/gpu/run.sh when the machine
 * has two GPUs.
 */
#include "check.h"

#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1000 };

/* n values of dt from seed: multiples of 1/2 in [-5.5, 5.5] (finite in every float dtype,
 * exact but for e5m2's 4.5 and 5.5, which round; results are compared with the values as
 * stored, and no NaN payload can be rewritten by a reduction over one rank), 0/1 for
 * bool, small integers for the others. */
static ms_tensor *filled(ms_dtype dt, int64_t n, ms_device_type dev, uint32_t seed) {
    ms_tensor *f = NULL, *h = NULL, *t = NULL;
    CHECK_OK(ms_tensor_new(&f, 1, &n, MS_F64, MS_DEVICE_CPU, 0));
    double *v = ms_tensor_data(f);
    for (int64_t i = 0; i < n; i++) {
        int64_t k = (i * 7 + seed) % 23;
        v[i] = dt == MS_BOOL ? (double)(k % 2) : dt == MS_U8 ? (double)k : (double)(k - 11) / 2;
        if (!ms_dtype_is_float(dt) && dt != MS_BOOL) v[i] = (double)(dt == MS_U8 ? k : k - 11);
    }
    CHECK_OK(ms_tensor_to(&h, f, dt));
    ms_tensor_release(f);
    if (dev == MS_DEVICE_CPU) return h;
    CHECK_OK(ms_tensor_to_device(&t, h, dev, ms_nccl_device()));
    ms_tensor_release(h);
    return t;
}

/* 1 when a and b (any devices) hold the same bytes. */
static int same_bits(const ms_tensor *a, const ms_tensor *b) {
    ms_tensor *ha = NULL, *hb = NULL;
    CHECK_OK(ms_tensor_to_device(&ha, a, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_to_device(&hb, b, MS_DEVICE_CPU, 0));
    int same = ha && hb && ms_tensor_nbytes(ha) == ms_tensor_nbytes(hb) &&
               !memcmp(ms_tensor_data(ha), ms_tensor_data(hb), (size_t)ms_tensor_nbytes(ha));
    ms_tensor_release(ha);
    ms_tensor_release(hb);
    return same;
}

static int reducible(ms_dtype dt, ms_op op) {
    if (op == MS_OP_AVG) return ms_dtype_is_float(dt);
    return !(dt == MS_BOOL && op == MS_OP_SUM);
}

static void collectives(ms_comm *c, ms_device_type dev) {
    int checked = 0, wrong = 0;
    for (int d = 0; d < MS_DTYPE_COUNT; d++) {
        ms_dtype dt = (ms_dtype)d;
        ms_tensor *in = filled(dt, N, dev, 1u + (uint32_t)d), *out = filled(dt, N, dev, 99);
        CHECK_OK(ms_all_gather(c, out, in));
        wrong += !same_bits(out, in), checked++;
        ms_tensor_release(out), out = filled(dt, N, dev, 98);
        CHECK_OK(ms_all_to_all(c, out, in));
        wrong += !same_bits(out, in), checked++;
        for (int op = 0; op < 4; op++) {
            if (!reducible(dt, (ms_op)op)) continue;
            ms_tensor *t = filled(dt, N, dev, 1u + (uint32_t)d);
            CHECK_OK(ms_all_reduce(c, t, (ms_op)op));
            wrong += !same_bits(t, in), checked++;
            ms_tensor_release(out), out = filled(dt, N, dev, 97);
            CHECK_OK(ms_reduce_scatter(c, out, in, (ms_op)op));
            wrong += !same_bits(out, in), checked++;
            ms_tensor_release(t);
        }
        ms_tensor *b = filled(dt, N, dev, 1u + (uint32_t)d);
        CHECK_OK(ms_broadcast(c, b, 0));
        wrong += !same_bits(b, in), checked++;
        ms_tensor_release(b);
        ms_tensor_release(in);
        ms_tensor_release(out);
    }
    CHECK_OK(ms_barrier(c));
    printf("%s tensors: %d collective results over %d dtypes, %d differ from the input\n",
           dev == MS_DEVICE_CPU ? "cpu (staged)" : "cuda", checked, MS_DTYPE_COUNT, wrong);
    CHECK(wrong == 0 && checked > 100);
}

static void groups(ms_comm *world) {
    int me = 0;
    ms_comm *tagged = NULL;
    CHECK_OK(ms_comm_group_tagged(world, 1, &me, 3, &tagged));
    CHECK(tagged && tagged != world);
    ms_tensor *t = filled(MS_F32, N, MS_DEVICE_CUDA, 5), *ref = filled(MS_F32, N, MS_DEVICE_CUDA, 5);
    if (tagged) CHECK_OK(ms_all_reduce(tagged, t, MS_OP_SUM));
    CHECK(same_bits(t, ref));
    /* in place: the input is the output's slice for this rank (the whole of it at n = 1) */
    CHECK_OK(ms_all_gather(world, t, t));
    CHECK_OK(ms_reduce_scatter(world, t, t, MS_OP_AVG));
    CHECK(same_bits(t, ref));
    ms_tensor_release(t);
    ms_tensor_release(ref);
    ms_comm_release(tagged);
    printf("groups: a tagged group, the in-place forms: checked\n");
}

/* A collective and a new group asked for on this thread while a unit's all-gather is queued
 * on the rank's communication thread: NCCL allows one thread at a time, so both are queued
 * behind it there; all three complete, with the right values. */
static void queued(ms_comm *world) {
    ms_unit *u = NULL;
    const int64_t shape[2] = {256, 64};
    CHECK_OK(ms_unit_new(&u, "queued", world, NULL, MS_BF16, -1, MS_RESHARD_FULL));
    if (!u) return;
    CHECK_OK(ms_unit_add_param(u, "w", 2, shape, MS_F32, 0, 1));
    CHECK_OK(ms_unit_finalize(u));
    CHECK_OK(ms_unit_unshard(u)); /* pending on the communication thread */
    ms_tensor *t = filled(MS_F32, N, MS_DEVICE_CUDA, 9), *ref = filled(MS_F32, N, MS_DEVICE_CUDA, 9);
    CHECK_OK(ms_all_reduce(world, t, MS_OP_MAX));
    int me = 0;
    ms_comm *fresh = NULL;
    CHECK_OK(ms_comm_group_tagged(world, 1, &me, 4, &fresh));
    if (fresh) CHECK_OK(ms_all_reduce(fresh, t, MS_OP_SUM));
    CHECK_OK(ms_unit_wait(u));
    ms_tensor *p = ms_unit_param_full(u, 0);
    CHECK(p && ms_tensor_device(p) == MS_DEVICE_CUDA && ms_tensor_numel(p) == 256 * 64);
    CHECK(same_bits(t, ref));
    ms_comm_release(fresh);
    ms_tensor_release(t);
    ms_tensor_release(ref);
    ms_unit_release(u);
    printf("a collective and a split queued behind a unit's pending all-gather: checked\n");
}

/* A unit's configuration for train(). */
typedef struct unit_cfg {
    const char *what;
    int nparams;                    /* 1: the in-place layout; 2: packed */
    ms_dtype stored, gather, reduce;
    double divide;                  /* a custom gradient divide factor */
    int64_t rows;                   /* the first parameter's rows (of 4 columns) */
    int frozen;                     /* the dtype of a frozen third parameter {5, 4}, or -1 */
    int adamw;                      /* MS_ADAMW_MASTER or MS_ADAMW_TORCH */
} unit_cfg;

/* Parameters {k->rows, 4} (and {3, 5}) of k on comm, `steps` training steps: unshard, two
 * micro-batches (the first with gradient sync off, accumulated), reduce, the squared
 * gradient norm, clipping by 1/2, AdamW with weight decay.  Gradients are written from
 * the host into whatever grad_full hands out.  *where_ok: every tensor on the device it
 * should be (unsharded on the comm's device; shards there too unless offload);
 * *gathered_ok: every gathered parameter is its shard in the gather dtype (one rank).
 * Returns host copies of the final shards and the last norm. */
static void train(ms_comm *c, const unit_cfg *k, int offload, int steps, ms_tensor *shards[3], double *norm,
                  int *where_ok, int *gathered_ok) {
    const int64_t shapes[3][2] = {{k->rows, 4}, {3, 5}, {5, 4}};
    const int n = k->nparams + (k->frozen >= 0);
    ms_dtype dtypes[3] = {k->stored, k->stored, k->stored}, gathers[3] = {k->gather, k->gather, k->gather};
    if (k->frozen >= 0) {
        dtypes[n - 1] = (ms_dtype)k->frozen; /* gathered in the param dtype when floating, else as stored */
        gathers[n - 1] = k->frozen == MS_F32 || k->frozen == MS_BF16 || k->frozen == MS_F16 ? k->gather : dtypes[n - 1];
    }
    const int gpu = !strcmp(ms_comm_backend(c), "nccl");
    const ms_device_type shard_dev = gpu && !offload ? MS_DEVICE_CUDA : MS_DEVICE_CPU;
    const ms_device_type full_dev = gpu ? MS_DEVICE_CUDA : MS_DEVICE_CPU;
    ms_unit *u = NULL;
    CHECK_OK(ms_unit_new(&u, "layer", c, NULL, (int)k->gather, (int)k->reduce, MS_RESHARD_FULL));
    if (!u) return;
    CHECK_OK(ms_unit_set_cpu_offload(u, offload));
    CHECK_OK(ms_unit_set_gradient_divide_factor(u, k->divide));
    for (int i = 0; i < n; i++)
        CHECK_OK(ms_unit_add_param(u, i == n - 1 && k->frozen >= 0 ? "layer.frozen" : i ? "layer.bias" : "layer.weight",
                                   2, shapes[i], dtypes[i], 0, i < k->nparams));
    CHECK_ERR(ms_unit_set_cpu_offload(u, 1), MS_ERR_STATE, "before the first ms_unit_add_param");
    CHECK_OK(ms_unit_finalize(u));
    CHECK_OK(ms_unit_set_adamw(u, k->adamw));
    for (int i = 0; i < n; i++) {
        ms_tensor *full = NULL;
        CHECK_OK(ms_tensor_new(&full, 2, shapes[i], MS_F32, MS_DEVICE_CPU, 0));
        for (int e = 0; e < ms_tensor_numel(full); e++) ((float *)ms_tensor_data(full))[e] = (float)((e + i) % 97) / 8 - 1;
        CHECK_OK(ms_unit_load_full(u, i, full));
        *where_ok &= ms_tensor_device(ms_unit_param_shard(u, i)) == shard_dev;
        ms_tensor_release(full);
    }
    for (int step = 1; step <= steps; step++) {
        for (int micro = 0; micro < 2; micro++) {
            CHECK_OK(ms_unit_set_requires_gradient_sync(u, micro == 1));
            CHECK_OK(ms_unit_unshard(u));
            CHECK_OK(ms_unit_wait(u));
            for (int i = 0; i < n; i++) {
                ms_tensor *p = ms_unit_param_full(u, i), *g = i < k->nparams ? ms_unit_grad_full(u, i) : NULL, *h = NULL;
                *where_ok &= p && ms_tensor_device(p) == full_dev && (i >= k->nparams || (g && ms_tensor_device(g) == full_dev));
                if (!p) continue;
                ms_tensor *shard = NULL, *want = NULL; /* one rank: the gathered parameter is its shard */
                CHECK_OK(ms_tensor_to_device(&shard, ms_unit_param_shard(u, i), MS_DEVICE_CPU, 0));
                CHECK_OK(ms_tensor_to(&want, shard, gathers[i]));
                *gathered_ok &= want && same_bits(p, want);
                ms_tensor_release(want);
                ms_tensor_release(shard);
                if (!g) continue;
                CHECK_OK(ms_tensor_new(&h, 2, shapes[i], MS_F32, MS_DEVICE_CPU, 0));
                for (int e = 0; e < ms_tensor_numel(h); e++)
                    ((float *)ms_tensor_data(h))[e] = (float)((e * 5 + i * 3 + step * 7 + micro) % 17 - 8) / 16;
                CHECK_OK(ms_tensor_copy(g, h));
                ms_tensor_release(h);
            }
            CHECK_OK(ms_unit_reduce_grads(u));
            CHECK_OK(ms_unit_wait(u));
        }
        for (int i = 0; i < k->nparams; i++) {
            ms_tensor *gs = ms_unit_grad_shard(u, i);
            *where_ok &= gs && ms_tensor_device(gs) == shard_dev;
        }
        CHECK_OK(ms_unit_grad_sq_norm(u, norm));
        CHECK_OK(ms_unit_scale_grads(u, 0.5));
        CHECK_OK(ms_unit_adamw_step(u, 1e-2, 0.9, 0.95, 1e-8, 0.1, step));
        CHECK_OK(ms_unit_zero_grad(u));
    }
    for (int i = 0; i < n; i++)
        CHECK_OK(ms_tensor_to_device(&shards[i], ms_unit_param_shard(u, i), MS_DEVICE_CPU, 0));
    ms_unit_release(u);
}

/* The configurations of train() on the NCCL world, with the shards on the GPU and offloaded
 * to the host, against the same on a one-rank threads world (the CPU's arithmetic): the
 * shards equal bit for bit after 3 steps, the gradient norms within n ulps (the device sums
 * the n squares in another order). */
static void units(ms_comm *c) {
    static const unit_cfg cfgs[] = {
        {"f32 stored, bf16 gather, f32 reduce, one parameter", 1, MS_F32, MS_BF16, MS_F32, 4, 6, -1, MS_ADAMW_MASTER},
        {"f32 stored, bf16 gather, f32 reduce, two parameters", 2, MS_F32, MS_BF16, MS_F32, 4, 6, -1, MS_ADAMW_MASTER},
        {"bf16 stored (f32 master), f16 reduce (pre- and post-divide)", 2, MS_BF16, MS_BF16, MS_F16, 6, 6, -1,
         MS_ADAMW_MASTER},
        {"f32 everywhere, one parameter", 1, MS_F32, MS_F32, MS_F32, 3, 6, -1, MS_ADAMW_MASTER},
        /* 4M elements: many blocks of every kernel, several grid-stride turns of the sum */
        {"bf16 stored, f32 reduce, one parameter of 2^22 elements", 1, MS_BF16, MS_BF16, MS_F32, 4, 1 << 20, -1,
         MS_ADAMW_MASTER},
        /* frozen parameters of another stored dtype: all gathered in bf16, or as bytes */
        {"f32 stored + a frozen bf16 one, bf16 gather", 2, MS_F32, MS_BF16, MS_F32, 4, 6, MS_BF16, MS_ADAMW_MASTER},
        {"f32 stored + a frozen i64 one, gathered as bytes", 2, MS_F32, MS_BF16, MS_F32, 4, 6, MS_I64, MS_ADAMW_MASTER},
        /* torch.optim.AdamW's state: the moments in the stored dtype, no master weights */
        {"bf16 stored, AdamW state in bf16 (torch), f32 reduce", 2, MS_BF16, MS_BF16, MS_F32, 6, 6, -1, MS_ADAMW_TORCH},
        {"f16 stored, AdamW state in f16 (torch), f32 reduce", 2, MS_F16, MS_F16, MS_F32, 5, 6, -1, MS_ADAMW_TORCH},
        {"f64 everywhere, AdamW state in f64 (torch)", 2, MS_F64, MS_F64, MS_F64, 5, 6, -1, MS_ADAMW_TORCH},
    };
    ms_world *tw = NULL;
    ms_comm *cpu = NULL;
    CHECK_OK(ms_threads_world_new(&tw, 1, 60));
    CHECK_OK(ms_world_comm(tw, 0, &cpu));
    for (size_t k = 0; cpu && k < sizeof cfgs / sizeof cfgs[0]; k++) {
        ms_tensor *ref[3] = {NULL, NULL, NULL}, *got[3] = {NULL, NULL, NULL};
        const int n = cfgs[k].nparams + (cfgs[k].frozen >= 0);
        double ref_norm = 0, worst = 0;
        int where = 1, same = 1, gathered = 1;
        train(cpu, &cfgs[k], 0, 3, ref, &ref_norm, &where, &gathered);
        for (int offload = 0; offload <= 1; offload++) {
            double norm = 0;
            train(c, &cfgs[k], offload, 3, got, &norm, &where, &gathered);
            for (int i = 0; i < n; i++) {
                same &= ref[i] && got[i] && same_bits(ref[i], got[i]);
                ms_tensor_release(got[i]);
                got[i] = NULL;
            }
            const double d = norm > ref_norm ? norm - ref_norm : ref_norm - norm;
            if (d > worst) worst = d;
        }
        CHECK(where);
        CHECK(gathered);
        CHECK(same);
        const double elems = (double)(cfgs[k].rows * 4 + (cfgs[k].nparams > 1 ? 15 : 0));
        CHECK(worst <= elems * DBL_EPSILON * ref_norm); /* two orders of an n-term sum of squares */
        printf("unit, %s: on the GPU and offloaded, shards %s the CPU's after 3 steps, |norm^2 - CPU's| <= %.3g "
               "(of %.6g), gathered = shards: %s, tensors on their devices: %s\n", cfgs[k].what,
               same ? "bit-identical to" : "DIFFER from", worst, ref_norm, gathered ? "yes" : "NO",
               where ? "yes" : "NO");
        for (int i = 0; i < 3; i++) ms_tensor_release(ref[i]);
    }
    ms_comm_release(cpu);
    ms_world_release(tw);
}

/* Sends and receives on one rank have no peer: each call is refused before it joins, and the
 * comm stays usable (tests/gpu/run.sh runs p2p.lua on 2, 3 and 4 ranks where there are
 * GPUs for them). */
static void p2p(ms_comm *c) {
    ms_tensor *t = filled(MS_F32, N, MS_DEVICE_CUDA, 5), *before = filled(MS_F32, N, MS_DEVICE_CUDA, 5);
    CHECK_ERR(ms_send(c, t, 0, 0), MS_ERR_ARG, "send on group [0]: peer 0 is this rank (a rank cannot send to itself)");
    CHECK_ERR(ms_recv(c, t, 1, 0), MS_ERR_ARG, "recv on group [0]: peer 1 is not a group rank (0..0)");
    CHECK_OK(ms_batch_p2p(c, NULL, 0));
    CHECK_OK(ms_all_reduce(c, t, MS_OP_SUM));
    CHECK(same_bits(t, before));
    ms_tensor_release(t);
    ms_tensor_release(before);
}

int main(void) {
    ms_world *w = NULL;
    int rank = -1;
    ms_status st = ms_nccl_world_new(&w, 60, &rank);
    if (st == MS_ERR_NOT_BUILT || st == MS_ERR_DEVICE) {
        printf("test_nccl: skipped: %s\n", ms_last_error());
        return 77;
    }
    CHECK_OK(st);
    if (st) return check_summary("test_nccl");
    CHECK(rank == 0 && ms_world_size(w) == 1 && ms_nccl_device() >= 0);
    ms_comm *c = NULL;
    CHECK_OK(ms_world_comm(w, rank, &c));
    CHECK(c && !strcmp(ms_comm_backend(c), "nccl"));
    if (c) {
        collectives(c, MS_DEVICE_CUDA);
        collectives(c, MS_DEVICE_CPU);
        groups(c);
        queued(c);
        p2p(c);
        units(c);
    }
    ms_comm_release(c);
    ms_world_release(w);
    return check_summary("test_nccl");
}
