/*
 * test_nccl.c: the NCCL backend on a world of one GPU (what one H200 allows: NCCL refuses
 * two ranks on one device), through the public API.
 *
 *  1. every collective, every dtype and op it takes, on cuda tensors and on cpu tensors
 *     (staged through the GPU): a one-rank group leaves the values as they are, so every
 *     result is checked against its input bit for bit, read back to the host;
 *  2. groups: a mesh group, a tagged group over the same rank, the in-place forms;
 *  3. shard units on the NCCL world, one parameter (the in-place layout) and two (packed):
 *     the unsharded parameters and gradients are cuda tensors, the shards stay on the host;
 *     load, unshard (all-gather through NCCL) equal to what was loaded in bf16, gradients
 *     filled on the device reduced (reduce-scatter through NCCL) into the host shards, AdamW.
 *
 * Exit 77 (ctest: skipped) without NCCL in the build or without a CUDA device.  Multi-GPU
 * runs (mpirun -np 2 moonshard --backend nccl ...) are in tests/gpu/run.sh when the machine
 * has two GPUs.
 */
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1000 };

/* n values of dt from seed: multiples of 1/2 in [-5.5, 5.5] (finite and exact in every
 * float dtype, so no NaN payload can be rewritten by a reduction over one rank), 0/1 for
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

/* A unit of nparams parameters of shape {6, 4} (and {3, 5}) gathered in bf16, reduced in f32. */
static void unit(ms_comm *world, int nparams) {
    ms_unit *u = NULL;
    CHECK_OK(ms_unit_new(&u, "layer", world, NULL, MS_BF16, MS_F32, 1));
    if (!u) return;
    const int64_t shapes[2][2] = {{6, 4}, {3, 5}};
    for (int i = 0; i < nparams; i++) CHECK_OK(ms_unit_add_param(u, i ? "layer.bias" : "layer.weight", 2, shapes[i],
                                                                 MS_F32, 0, 1));
    CHECK_OK(ms_unit_finalize(u));
    ms_tensor *full[2] = {NULL, NULL};
    for (int i = 0; i < nparams; i++) {
        CHECK_OK(ms_tensor_new(&full[i], 2, shapes[i], MS_F32, MS_DEVICE_CPU, 0));
        for (int e = 0; e < ms_tensor_numel(full[i]); e++) ((float *)ms_tensor_data(full[i]))[e] = (float)(e + i) / 8;
        CHECK_OK(ms_unit_load_full(u, i, full[i]));
    }
    CHECK_OK(ms_unit_unshard(u));
    CHECK_OK(ms_unit_wait(u));
    int ok = 1;
    for (int i = 0; i < nparams; i++) {
        ms_tensor *p = ms_unit_param_full(u, i), *as_bf16 = NULL;
        CHECK_OK(ms_tensor_to(&as_bf16, full[i], MS_BF16));
        ok &= p && ms_tensor_device(p) == MS_DEVICE_CUDA && same_bits(p, as_bf16);
        ms_tensor_release(as_bf16);
        ms_tensor *g = ms_unit_grad_full(u, i);
        ok &= g && ms_tensor_device(g) == MS_DEVICE_CUDA;
        if (g) CHECK_OK(ms_tensor_fill(g, 0.25 * (i + 1)));
    }
    CHECK_OK(ms_unit_reduce_grads(u));
    CHECK_OK(ms_unit_wait(u));
    for (int i = 0; i < nparams; i++) {
        ms_tensor *gs = ms_unit_grad_shard(u, i);
        ok &= gs && ms_tensor_device(gs) == MS_DEVICE_CPU;
        for (int e = 0; gs && e < ms_tensor_numel(gs); e++) ok &= ((float *)ms_tensor_data(gs))[e] == 0.25f * (i + 1);
    }
    CHECK_OK(ms_unit_adamw_step(u, 1e-2, 0.9, 0.95, 1e-8, 0.0, 1));
    CHECK(ok);
    printf("a shard unit of %d parameter%s on the NCCL world: cuda unsharded tensors, gathered in bf16 bit-exact, "
           "gradients reduced into the host shards, AdamW: %s\n", nparams, nparams == 1 ? "" : "s", ok ? "ok" : "WRONG");
    for (int i = 0; i < nparams; i++) ms_tensor_release(full[i]);
    ms_unit_release(u);
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
        unit(c, 1);
        unit(c, 2);
    }
    ms_comm_release(c);
    ms_world_release(w);
    return check_summary("test_nccl");
}
