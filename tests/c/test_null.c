/*
 * test_null.c: every public function of moonshard.h (and of moonshard_embed.h when the
 * embedding library is built) called with NULL for each of its handle and pointer
 * arguments, the others valid.  A function returning an ms_status must return MS_ERR_ARG
 * with a message that starts "<function>: <argument> is NULL"; an accessor must return its
 * documented invalid value with that message; retain, release and ms_interp_free take
 * NULL as a no-op (and set no message); an argument the header lets be NULL must not be
 * refused for it.
 *
 * The list cannot fall behind the headers: the test reads their prototypes (between
 * MS_API_BEGIN and MS_API_END, as tools/gen_cdef.lua does) and fails for every pointer
 * argument no call below passed NULL for, for every function without pointers that is not
 * named below, and for every call below that names a function or an argument the headers
 * do not have.
 */
#include "check.h"

#ifdef MS_TEST_EMBED
#include "moonshard_embed.h"
#endif

#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- what the calls covered */

typedef enum { REFUSED, ALLOWED, NO_POINTERS } cover_kind;
typedef struct {
    const char *fn, *arg; /* arg NULL for NO_POINTERS */
    cover_kind kind;
    int line;
} cover_rec;

enum { MAX_COVER = 1024 };
static cover_rec covered[MAX_COVER];
static int ncovered;

static void cover(const char *fn, const char *arg, cover_kind kind, int line) {
    if (ncovered == MAX_COVER) {
        fprintf(stderr, "test_null: more than %d calls: raise MAX_COVER\n", MAX_COVER);
        exit(1);
    }
    covered[ncovered++] = (cover_rec){fn, arg, kind, line};
}

/* A message of another call, so that a function that leaves the message alone is seen. */
static const char *poison(void) {
    ms_op op;
    ms_op_parse("poison", &op);
    return ms_last_error();
}

static int says_null(const char *fn, const char *arg) {
    char want[256];
    snprintf(want, sizeof want, "%s: %s is NULL", fn, arg);
    return strncmp(ms_last_error(), want, strlen(want)) == 0;
}

static void fail(int line, const char *fn, const char *arg, const char *what) {
    check_failed++;
    fprintf(stderr, "%s:%d: %s with %s = NULL: %s (message: \"%s\")\n", __FILE__, line, fn, arg, what,
            ms_last_error());
}

static void refused_status(const char *fn, const char *arg, ms_status st, int line) {
    cover(fn, arg, REFUSED, line);
    if (st != MS_ERR_ARG) fail(line, fn, arg, "expected MS_ERR_ARG");
    else if (!says_null(fn, arg)) fail(line, fn, arg, "the message does not say \"<function>: <argument> is NULL\"");
    else check_passed++;
}

static void refused_value(const char *fn, const char *arg, int invalid, int line) {
    cover(fn, arg, REFUSED, line);
    if (!invalid) fail(line, fn, arg, "expected the documented invalid value");
    else if (!says_null(fn, arg)) fail(line, fn, arg, "the message does not say \"<function>: <argument> is NULL\"");
    else check_passed++;
}

static void allowed_status(const char *fn, const char *arg, ms_status st, int want_ok, int line) {
    cover(fn, arg, ALLOWED, line);
    if (says_null(fn, arg)) fail(line, fn, arg, "refused, but the header lets it be NULL");
    else if (want_ok && st != MS_OK) fail(line, fn, arg, "expected MS_OK");
    else check_passed++;
}

static void allowed_void(const char *fn, const char *arg, const char *before, int line) {
    cover(fn, arg, ALLOWED, line);
    if (strcmp(ms_last_error(), before)) fail(line, fn, arg, "a no-op must leave the message alone");
    else check_passed++;
}

static void void_refused(const char *fn, const char *arg, int line) {
    cover(fn, arg, REFUSED, line);
    if (!says_null(fn, arg)) fail(line, fn, arg, "the message does not say \"<function>: <argument> is NULL\"");
    else check_passed++;
}

/* REFUSE(fn, arg, args...): fn(args...) with args NULL in the place of arg returns MS_ERR_ARG. */
#define REFUSE(fn, arg, ...) (poison(), refused_status(#fn, #arg, fn(__VA_ARGS__), __LINE__))
/* REFUSE_VALUE(fn, arg, invalid, args...): an accessor returns `invalid`. */
#define REFUSE_VALUE(fn, arg, invalid, ...) (poison(), refused_value(#fn, #arg, fn(__VA_ARGS__) == (invalid), __LINE__))
/* REFUSE_VOID(fn, arg, args...): a void function does nothing but set the message. */
#define REFUSE_VOID(fn, arg, ...) (poison(), fn(__VA_ARGS__), void_refused(#fn, #arg, __LINE__))
/* ALLOW(fn, arg, want_ok, args...): NULL there is allowed (MS_OK expected when want_ok). */
#define ALLOW(fn, arg, want_ok, ...) (poison(), allowed_status(#fn, #arg, fn(__VA_ARGS__), want_ok, __LINE__))
/* ALLOW_VOID(fn, arg, args...): retain, release, free of NULL: a no-op. */
#define ALLOW_VOID(fn, arg, ...)                                   \
    do {                                                           \
        char before_[1024];                                        \
        snprintf(before_, sizeof before_, "%s", poison());         \
        fn(__VA_ARGS__);                                           \
        allowed_void(#fn, #arg, before_, __LINE__);                \
    } while (0)
/* NO_POINTERS(fn): fn takes no pointer (called elsewhere below). */
#define NO_POINTERS(fn) cover(#fn, NULL, NO_POINTERS, __LINE__)

/* ---------------------------------------------------------------- the calls */

static void test_core_without_handles(void) {
    NO_POINTERS(ms_status_name);
    CHECK(ms_status_name(MS_ERR_ARG) && ms_status_name((ms_status)999));
    NO_POINTERS(ms_last_error);
    double adamw[4];
    REFUSE(ms_adamw_defaults, beta1, NULL, &adamw[1], &adamw[2], &adamw[3]);
    REFUSE(ms_adamw_defaults, beta2, &adamw[0], NULL, &adamw[2], &adamw[3]);
    REFUSE(ms_adamw_defaults, eps, &adamw[0], &adamw[1], NULL, &adamw[3]);
    REFUSE(ms_adamw_defaults, weight_decay, &adamw[0], &adamw[1], &adamw[2], NULL);
    CHECK(ms_adamw_defaults(&adamw[0], &adamw[1], &adamw[2], &adamw[3]) == MS_OK && adamw[0] == 0.9 &&
          adamw[1] == 0.999 && adamw[2] == 1e-8 && adamw[3] == 0.01);
    ALLOW(ms_set_error, message, 1, MS_OK, NULL);
    CHECK(ms_set_error(MS_ERR_IO, "host: cannot read x") == MS_ERR_IO && !strcmp(ms_last_error(), "host: cannot read x"));
    CHECK(ms_set_error(MS_OK, NULL) == MS_OK && !strcmp(ms_last_error(), ""));
    NO_POINTERS(ms_version);
    CHECK(ms_version() != NULL);
    NO_POINTERS(ms_dtype_size);
    CHECK(ms_dtype_size(MS_DTYPE_COUNT) == 0);
    NO_POINTERS(ms_dtype_name);
    CHECK(ms_dtype_name(MS_DTYPE_COUNT) == NULL);
    NO_POINTERS(ms_dtype_is_float);
    CHECK(ms_dtype_is_float(MS_DTYPE_COUNT) == 0);
    NO_POINTERS(ms_cast_set_impl);
    NO_POINTERS(ms_cast_get_impl);
    NO_POINTERS(ms_op_name);
    CHECK(ms_op_name((ms_op)99) == NULL);
    NO_POINTERS(ms_nccl_device);
    NO_POINTERS(ms_mpi_launched);
    NO_POINTERS(ms_file_kind_name);
    CHECK(ms_file_kind_name((ms_file_kind)99) == NULL);
    {
        ms_file_kind kind;
        int64_t size;
        REFUSE(ms_file_stat, path, NULL, &kind, &size);
        REFUSE(ms_file_stat, kind, "/", NULL, &size);
        REFUSE(ms_file_stat, size, "/", &kind, NULL);
    }

    ms_dtype dt;
    REFUSE(ms_dtype_parse, name, NULL, &dt);
    REFUSE(ms_dtype_parse, out, "f32", NULL);
    REFUSE(ms_int_element, out, MS_I8, 0, 1, 0.0, NULL);
    ms_op op;
    REFUSE(ms_op_parse, name, NULL, &op);
    REFUSE(ms_op_parse, out, "sum", NULL);
    ms_device_type dev;
    int idx;
    REFUSE(ms_device_parse, name, NULL, &dev, &idx);
    REFUSE(ms_device_parse, type, "cpu", NULL, &idx);
    REFUSE(ms_device_parse, index, "cpu", &dev, NULL);

    float f[4] = {1, 2, 3, 4};
    uint16_t h[4];
    REFUSE(ms_cast, dst, NULL, MS_BF16, f, MS_F32, 4);
    REFUSE(ms_cast, src, h, MS_BF16, NULL, MS_F32, 4);
    ALLOW(ms_cast, dst, 1, NULL, MS_BF16, NULL, MS_F32, 0); /* no elements, no buffers */
    ALLOW(ms_cast, src, 1, h, MS_BF16, NULL, MS_F32, 0);
    REFUSE(ms_cuda_device_count, out, NULL);

    int64_t len, off;
    REFUSE(ms_chunk_extent, length, 10, 3, 1, NULL, &off);
    REFUSE(ms_chunk_extent, offset, 10, 3, 1, &len, NULL);

    const int64_t gshape[1] = {8}, msizes[1] = {2}, coords[1] = {1};
    const int kinds[1] = {MS_PLACE_SHARD}, sdims[1] = {0};
    int64_t lshape[1], goff[1];
    REFUSE(ms_local_shape, global_shape, 1, NULL, 1, kinds, sdims, msizes, coords, lshape, goff);
    REFUSE(ms_local_shape, kinds, 1, gshape, 1, NULL, sdims, msizes, coords, lshape, goff);
    REFUSE(ms_local_shape, shard_dims, 1, gshape, 1, kinds, NULL, msizes, coords, lshape, goff);
    REFUSE(ms_local_shape, mesh_sizes, 1, gshape, 1, kinds, sdims, NULL, coords, lshape, goff);
    REFUSE(ms_local_shape, coords, 1, gshape, 1, kinds, sdims, msizes, NULL, lshape, goff);
    REFUSE(ms_local_shape, local_shape, 1, gshape, 1, kinds, sdims, msizes, coords, NULL, goff);
    REFUSE(ms_local_shape, global_offset, 1, gshape, 1, kinds, sdims, msizes, coords, lshape, NULL);
    /* a 0-dim tensor on a 0-dim mesh has no arrays to give */
    ALLOW(ms_local_shape, global_shape, 1, 0, NULL, 0, NULL, NULL, NULL, NULL, lshape, goff);
    ALLOW(ms_local_shape, kinds, 1, 1, gshape, 0, NULL, NULL, NULL, NULL, lshape, goff);

    int64_t pshape[1];
    REFUSE(ms_fsdp_shard, shape, 1, NULL, 2, 0, 0, lshape, &off, pshape);
    REFUSE(ms_fsdp_shard, local_shape, 1, gshape, 2, 0, 0, NULL, &off, pshape);
    REFUSE(ms_fsdp_shard, offset, 1, gshape, 2, 0, 0, lshape, NULL, pshape);
    REFUSE(ms_fsdp_shard, padded_shape, 1, gshape, 2, 0, 0, lshape, &off, NULL);
}

static void test_tensors(void) {
    const int64_t shape[2] = {2, 3};
    ms_tensor *t = NULL, *u = NULL, *out = NULL;
    CHECK_OK(ms_tensor_new(&t, 2, shape, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&u, 2, shape, MS_F32, MS_DEVICE_CPU, 0));

    REFUSE(ms_tensor_new, out, NULL, 2, shape, MS_F32, MS_DEVICE_CPU, 0);
    REFUSE(ms_tensor_new, shape, &out, 2, NULL, MS_F32, MS_DEVICE_CPU, 0);
    ALLOW(ms_tensor_new, shape, 1, &out, 0, NULL, MS_F32, MS_DEVICE_CPU, 0); /* a 0-dim tensor */
    ms_tensor_release(out);
    out = NULL;

    float mem[6] = {0};
    REFUSE(ms_tensor_wrap, out, NULL, mem, 2, shape, MS_F32);
    REFUSE(ms_tensor_wrap, data, &out, NULL, 2, shape, MS_F32);
    REFUSE(ms_tensor_wrap, shape, &out, mem, 2, NULL, MS_F32);
    ALLOW(ms_tensor_wrap, data, 1, &out, NULL, 1, (int64_t[]){0}, MS_F32); /* 0 bytes */
    ms_tensor_release(out);
    out = NULL;
    REFUSE(ms_tensor_wrap_device, out, NULL, mem, 2, shape, MS_F32, MS_DEVICE_CPU, 0);
    REFUSE(ms_tensor_wrap_device, data, &out, NULL, 2, shape, MS_F32, MS_DEVICE_CPU, 0);
    REFUSE(ms_tensor_wrap_device, shape, &out, mem, 2, NULL, MS_F32, MS_DEVICE_CPU, 0);

    ALLOW_VOID(ms_tensor_retain, t, NULL);
    ALLOW_VOID(ms_tensor_release, t, NULL);

    REFUSE_VALUE(ms_tensor_ndim, t, -1, NULL);
    REFUSE_VALUE(ms_tensor_size, t, -1, NULL, 0);
    REFUSE_VALUE(ms_tensor_stride, t, -1, NULL, 0);
    REFUSE_VALUE(ms_tensor_numel, t, -1, NULL);
    REFUSE_VALUE(ms_tensor_nbytes, t, -1, NULL);
    REFUSE_VALUE(ms_tensor_dtype, t, MS_DTYPE_COUNT, NULL);
    REFUSE_VALUE(ms_tensor_device, t, MS_DEVICE_INVALID, NULL);
    REFUSE_VALUE(ms_tensor_device_index, t, -1, NULL);
    REFUSE_VALUE(ms_tensor_is_contiguous, t, 0, NULL);
    REFUSE_VALUE(ms_tensor_data, t, NULL, NULL);
    REFUSE_VALUE(ms_tensor_overlaps, a, 0, NULL, t);
    REFUSE_VALUE(ms_tensor_overlaps, b, 0, t, NULL);
    CHECK(ms_dtype_name(ms_tensor_dtype(NULL)) == NULL); /* not a dtype */

    REFUSE(ms_tensor_narrow, out, NULL, t, 0, 0, 1);
    REFUSE(ms_tensor_narrow, t, &out, NULL, 0, 0, 1);
    REFUSE(ms_tensor_view, out, NULL, t, 1, (int64_t[]){6});
    REFUSE(ms_tensor_view, t, &out, NULL, 1, (int64_t[]){6});
    REFUSE(ms_tensor_view, shape, &out, t, 1, NULL);
    REFUSE(ms_tensor_chunk, out, NULL, t, 2, 0, 0);
    REFUSE(ms_tensor_chunk, t, &out, NULL, 2, 0, 0);
    REFUSE(ms_tensor_copy, dst, NULL, t);
    REFUSE(ms_tensor_copy, src, t, NULL);
    REFUSE(ms_tensor_fill, t, NULL, 1.0);
    REFUSE(ms_tensor_fill_int, t, NULL, 1);
    REFUSE(ms_tensor_to, out, NULL, t, MS_BF16);
    REFUSE(ms_tensor_to, t, &out, NULL, MS_BF16);
    REFUSE(ms_tensor_to_device, out, NULL, t, MS_DEVICE_CPU, 0);
    REFUSE(ms_tensor_to_device, t, &out, NULL, MS_DEVICE_CPU, 0);
    CHECK(out == NULL); /* nothing handed out on failure */

    ms_tensor_release(u);
    ms_tensor_release(t);
}

static void test_worlds_and_comms(ms_world *w, ms_comm *c) {
    ms_world *nw = NULL;
    REFUSE(ms_threads_world_new, out, NULL, 1, 60);
    REFUSE(ms_mpi_world_new, out, NULL, 60);
    int host_comm = 0; /* never read: out is checked first */
    REFUSE(ms_mpi_world_from_comm, out, NULL, &host_comm, 60);
    REFUSE(ms_mpi_world_from_comm, mpi_comm, &nw, NULL, 60);
    int rank;
    REFUSE(ms_nccl_world_new, out, NULL, 60, &rank);
    REFUSE(ms_nccl_world_new, rank, &nw, 60, NULL);
    CHECK(nw == NULL);

    ALLOW_VOID(ms_world_retain, w, NULL);
    ALLOW_VOID(ms_world_release, w, NULL);
    REFUSE_VALUE(ms_world_size, w, -1, NULL);
    REFUSE_VALUE(ms_world_timeout, w, -1.0, NULL);
    ms_comm *got = NULL;
    REFUSE(ms_world_comm, w, NULL, 0, &got);
    REFUSE(ms_world_comm, out, w, 0, NULL);
    REFUSE(ms_world_rank_done, w, NULL, 0, 0);

    ALLOW_VOID(ms_comm_retain, c, NULL);
    ALLOW_VOID(ms_comm_release, c, NULL);
    REFUSE_VALUE(ms_comm_size, c, -1, NULL);
    REFUSE_VALUE(ms_comm_rank, c, -1, NULL);
    REFUSE_VALUE(ms_comm_world_rank, c, -1, NULL, 0);
    REFUSE_VALUE(ms_comm_backend, c, NULL, NULL);
    ms_device_type dev_type = MS_DEVICE_INVALID;
    int dev_index = 0;
    REFUSE(ms_comm_device, c, NULL, &dev_type, &dev_index);
    REFUSE(ms_comm_device, type, c, NULL, &dev_index);
    REFUSE(ms_comm_device, index, c, &dev_type, NULL);
    CHECK(ms_comm_device(c, &dev_type, &dev_index) == MS_OK && dev_type == MS_DEVICE_CPU && dev_index == -1);
    const int ranks[1] = {0};
    REFUSE(ms_comm_group, world, NULL, 1, ranks, &got);
    REFUSE(ms_comm_group, world_ranks, c, 1, NULL, &got);
    REFUSE(ms_comm_group, out, c, 1, ranks, NULL);
    REFUSE(ms_comm_group_tagged, world, NULL, 1, ranks, 1, &got);
    REFUSE(ms_comm_group_tagged, world_ranks, c, 1, NULL, 1, &got);
    REFUSE(ms_comm_group_tagged, out, c, 1, ranks, 1, NULL);
    CHECK(got == NULL);

    ms_tensor *t = NULL, *u = NULL;
    CHECK_OK(ms_tensor_new(&t, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&u, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CPU, 0));
    REFUSE(ms_all_gather, c, NULL, t, u);
    REFUSE(ms_all_gather, out, c, NULL, u);
    REFUSE(ms_all_gather, in, c, t, NULL);
    REFUSE(ms_reduce_scatter, c, NULL, t, u, MS_OP_SUM);
    REFUSE(ms_reduce_scatter, out, c, NULL, u, MS_OP_SUM);
    REFUSE(ms_reduce_scatter, in, c, t, NULL, MS_OP_SUM);
    REFUSE(ms_all_reduce, c, NULL, t, MS_OP_SUM);
    REFUSE(ms_all_reduce, t, c, NULL, MS_OP_SUM);
    REFUSE(ms_broadcast, c, NULL, t, 0);
    REFUSE(ms_broadcast, t, c, NULL, 0);
    REFUSE(ms_all_to_all, c, NULL, t, u);
    REFUSE(ms_all_to_all, out, c, NULL, u);
    REFUSE(ms_all_to_all, in, c, t, NULL);
    REFUSE(ms_barrier, c, NULL);
    REFUSE(ms_send, c, NULL, t, 0, 0);
    REFUSE(ms_send, t, c, NULL, 0, 0);
    REFUSE(ms_recv, c, NULL, t, 0, 0);
    REFUSE(ms_recv, t, c, NULL, 0, 0);
    const ms_p2p_op op = {MS_P2P_SEND, t, 0, 0};
    REFUSE(ms_batch_p2p, c, NULL, &op, 1);
    REFUSE(ms_batch_p2p, ops, c, NULL, 1);
    ALLOW(ms_batch_p2p, ops, 1, c, NULL, 0); /* no ops: nothing to do */
    CHECK_OK(ms_all_reduce(c, t, MS_OP_SUM)); /* the comm still works: no NULL call broke it */
    ms_tensor_release(u);
    ms_tensor_release(t);
}

static void test_meshes(ms_comm *c) {
    const char *names[1] = {"dp"};
    const int64_t sizes[1] = {1};
    ms_mesh *m = NULL, *shape_only = NULL;
    REFUSE(ms_mesh_new, out, NULL, 1, names, sizes, c);
    REFUSE(ms_mesh_new, names, &m, 1, NULL, sizes, c);
    REFUSE(ms_mesh_new, sizes, &m, 1, names, NULL, c);
    ALLOW(ms_mesh_new, world, 1, &shape_only, 1, names, sizes, NULL); /* a shape-only mesh */
    CHECK(ms_mesh_rank(shape_only) == -1);
    ms_mesh_release(shape_only);
    CHECK_OK(ms_mesh_new(&m, 1, names, sizes, c));

    ALLOW_VOID(ms_mesh_retain, m, NULL);
    ALLOW_VOID(ms_mesh_release, m, NULL);
    REFUSE_VALUE(ms_mesh_ndim, m, -1, NULL);
    REFUSE_VALUE(ms_mesh_axis_name, m, NULL, NULL, 0);
    REFUSE_VALUE(ms_mesh_axis_size, m, -1, NULL, 0);
    REFUSE_VALUE(ms_mesh_axis_index, m, -1, NULL, "dp");
    REFUSE_VALUE(ms_mesh_axis_index, name, -1, m, NULL);
    REFUSE_VALUE(ms_mesh_size, m, -1, NULL);
    REFUSE_VALUE(ms_mesh_rank, m, -1, NULL);
    int64_t coords[1] = {0}, rank, ranks[1], count;
    REFUSE(ms_mesh_coords, m, NULL, 0, coords);
    REFUSE(ms_mesh_coords, coords, m, 0, NULL);
    REFUSE(ms_mesh_rank_of, m, NULL, coords, &rank);
    REFUSE(ms_mesh_rank_of, coords, m, NULL, &rank);
    REFUSE(ms_mesh_rank_of, rank, m, coords, NULL);
    const int axes[1] = {0};
    REFUSE(ms_mesh_group_ranks, m, NULL, 1, axes, 0, ranks, &count);
    REFUSE(ms_mesh_group_ranks, axes, m, 1, NULL, 0, ranks, &count);
    REFUSE(ms_mesh_group_ranks, ranks, m, 1, axes, 0, NULL, &count);
    REFUSE(ms_mesh_group_ranks, count, m, 1, axes, 0, ranks, NULL);
    ms_comm *g = NULL;
    REFUSE(ms_mesh_group, m, NULL, 1, axes, &g);
    REFUSE(ms_mesh_group, axes, m, 1, NULL, &g);
    REFUSE(ms_mesh_group, out, m, 1, axes, NULL);
    CHECK(g == NULL);
    ms_mesh_release(m);
}

static void test_units(ms_comm *c) {
    ms_unit *u = NULL, *r = NULL;
    REFUSE(ms_unit_new, out, NULL, "u", c, NULL, -1, -1, 1);
    REFUSE(ms_unit_new, name, &u, NULL, c, NULL, -1, -1, 1);
    REFUSE(ms_unit_new, shard, &u, "u", NULL, NULL, -1, -1, 1);
    ALLOW(ms_unit_new, replicate, 1, &r, "r", c, NULL, -1, -1, 1); /* a 1-D mesh */
    ms_unit_release(r);
    CHECK_OK(ms_unit_new(&u, "u", c, NULL, -1, -1, MS_RESHARD_FULL));

    ALLOW_VOID(ms_unit_retain, u, NULL);
    ALLOW_VOID(ms_unit_release, u, NULL);
    REFUSE(ms_unit_set_cpu_offload, u, NULL, 0);
    const int64_t shape[1] = {4};
    REFUSE(ms_unit_add_param, u, NULL, "w", 1, shape, MS_F32, 0, 1);
    REFUSE(ms_unit_add_param, fqn, u, NULL, 1, shape, MS_F32, 0, 1);
    REFUSE(ms_unit_add_param, shape, u, "w", 1, NULL, MS_F32, 0, 1);
    CHECK_OK(ms_unit_add_param(u, "w", 1, shape, MS_F32, 0, 1));
    REFUSE(ms_unit_finalize, u, NULL);
    CHECK_OK(ms_unit_finalize(u));

    REFUSE_VALUE(ms_unit_param_count, u, -1, NULL);
    REFUSE_VALUE(ms_unit_name, u, NULL, NULL);
    REFUSE_VALUE(ms_unit_param_fqn, u, NULL, NULL, 0);
    REFUSE_VALUE(ms_unit_param_shard, u, NULL, NULL, 0);
    int nd, rg, dim, gs;
    ms_record_kind kind;
    int64_t sh[MS_MAX_DIMS], off, rows, bytes;
    ms_dtype st, ga, dt;
    REFUSE(ms_unit_param_info, u, NULL, 0, &nd, sh, &st, &ga, &rg);
    REFUSE(ms_unit_param_info, ndim, u, 0, NULL, sh, &st, &ga, &rg);
    REFUSE(ms_unit_param_info, shape, u, 0, &nd, NULL, &st, &ga, &rg);
    REFUSE(ms_unit_param_info, stored, u, 0, &nd, sh, NULL, &ga, &rg);
    REFUSE(ms_unit_param_info, gather, u, 0, &nd, sh, &st, NULL, &rg);
    REFUSE(ms_unit_param_info, requires_grad, u, 0, &nd, sh, &st, &ga, NULL);
    REFUSE(ms_unit_reduce_dtype, u, NULL, &dt);
    REFUSE(ms_unit_reduce_dtype, reduce, u, NULL);
    REFUSE(ms_unit_param_reduce_dtype, u, NULL, 0, &dt);
    REFUSE(ms_unit_param_reduce_dtype, reduce, u, 0, NULL);
    REFUSE(ms_unit_set_packed, u, NULL, 1);
    REFUSE(ms_unit_set_param_policy, u, NULL, 0, -1, -1);
    REFUSE_VALUE(ms_unit_grad_shard, u, NULL, NULL, 0);
    REFUSE(ms_unit_load_full, u, NULL, 0, NULL);
    REFUSE(ms_unit_load_full, full, u, 0, NULL);
    REFUSE(ms_unit_param_offset, u, NULL, 0, &dim, &off, &rows);
    REFUSE(ms_unit_param_offset, dim, u, 0, NULL, &off, &rows);
    REFUSE(ms_unit_param_offset, offset, u, 0, &dim, NULL, &rows);
    REFUSE(ms_unit_param_offset, rows, u, 0, &dim, &off, NULL);

    REFUSE(ms_unit_unshard, u, NULL);
    REFUSE(ms_unit_wait, u, NULL);
    REFUSE_VALUE(ms_unit_param_full, u, NULL, NULL, 0);
    REFUSE(ms_unit_reshard, u, NULL);
    REFUSE_VALUE(ms_unit_grad_full, u, NULL, NULL, 0);
    REFUSE(ms_unit_reduce_grads, u, NULL);
    REFUSE(ms_unit_set_requires_gradient_sync, u, NULL, 1);
    REFUSE(ms_unit_set_gradient_divide_factor, u, NULL, 0);
    REFUSE(ms_unit_release_unsharded, u, NULL);
    REFUSE(ms_unit_zero_grad, u, NULL);
    double norm;
    REFUSE(ms_unit_grad_sq_norm, u, NULL, &norm);
    REFUSE(ms_unit_grad_sq_norm, out, u, NULL);
    REFUSE(ms_unit_scale_grads, u, NULL, 1.0);
    REFUSE(ms_unit_set_adamw, u, NULL, MS_ADAMW_MASTER);
    REFUSE_VALUE(ms_unit_adamw_state, u, NULL, NULL, 0, MS_ADAMW_EXP_AVG);
    REFUSE_VALUE(ms_unit_adamw_skipped, u, -1, NULL, 0);
    REFUSE(ms_unit_set_adamw_skipped, u, NULL, 0, 0);
    REFUSE(ms_unit_adamw_step, u, NULL, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    REFUSE_VALUE(ms_unit_bytes, u, -1, NULL, 0);
    REFUSE_VALUE(ms_unit_rank_allocated, u, -1, NULL, 0);
    REFUSE_VALUE(ms_unit_record_count, u, -1, NULL);
    REFUSE(ms_unit_record, u, NULL, 0, &kind, &dt, &gs, &bytes);
    REFUSE(ms_unit_record, kind, u, 0, NULL, &dt, &gs, &bytes);
    REFUSE(ms_unit_record, dtype, u, 0, &kind, NULL, &gs, &bytes);
    REFUSE(ms_unit_record, group_size, u, 0, &kind, &dt, NULL, &bytes);
    REFUSE(ms_unit_record, bytes, u, 0, &kind, &dt, &gs, NULL);
    REFUSE_VOID(ms_unit_clear_records, u, NULL);

    /* the unit still works after all that */
    CHECK_OK(ms_unit_unshard(u));
    CHECK_OK(ms_unit_wait(u));
    CHECK_OK(ms_unit_reshard(u));
    ms_unit_release(u);
}

/* Megatron-FSDP buckets (ms_unit_zero_*) */
static void test_zero(ms_comm *c) {
    ms_unit *z = NULL;
    REFUSE(ms_unit_zero_new, out, NULL, "z", c, MS_ZERO_OPTIM, MS_F32, 1, -1, 0);
    REFUSE(ms_unit_zero_new, name, &z, NULL, c, MS_ZERO_OPTIM, MS_F32, 1, -1, 0);
    REFUSE(ms_unit_zero_new, dp, &z, "z", NULL, MS_ZERO_OPTIM, MS_F32, 1, -1, 0);
    CHECK_OK(ms_unit_zero_new(&z, "z", c, MS_ZERO_OPTIM, MS_F32, 1, -1, 0));
    const int64_t shape[1] = {4};
    REFUSE(ms_unit_zero_add_param, u, NULL, "w", 1, shape, 0);
    REFUSE(ms_unit_zero_add_param, fqn, z, NULL, 1, shape, 0);
    REFUSE(ms_unit_zero_add_param, shape, z, "w", 1, NULL, 0);
    CHECK_OK(ms_unit_zero_add_param(z, "w", 1, shape, 0));
    REFUSE(ms_unit_zero_finalize, u, NULL, 4);
    CHECK_OK(ms_unit_zero_finalize(z, 4));
    REFUSE_VALUE(ms_unit_is_zero, u, 0, NULL);
    REFUSE_VALUE(ms_unit_zero_tensor, u, NULL, NULL, 0, MS_ZERO_PARAM);
    int64_t a, b;
    REFUSE(ms_unit_zero_piece, u, NULL, 0, &a, &b);
    REFUSE(ms_unit_zero_piece, start, z, 0, NULL, &b);
    REFUSE(ms_unit_zero_piece, stop, z, 0, &a, NULL);
    REFUSE(ms_unit_zero_load_full, u, NULL, 0, NULL);
    REFUSE(ms_unit_zero_load_full, full, z, 0, NULL);
    REFUSE(ms_unit_zero_make_state, u, NULL);
    REFUSE(ms_unit_zero_unshard, u, NULL);
    REFUSE(ms_unit_zero_reshard, u, NULL);
    REFUSE(ms_unit_zero_reduce_grads, u, NULL);
    REFUSE(ms_unit_zero_clear_grads, u, NULL);
    REFUSE(ms_unit_zero_adamw_step, u, NULL, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    ms_unit_release(z);
}

#ifdef MS_TEST_EMBED
static void test_interp(ms_comm *c) {
    ms_interp *in = NULL;
    REFUSE(ms_interp_new, out, NULL, c);
    REFUSE(ms_interp_new, world, &in, NULL);
    CHECK(in == NULL);
    if (ms_interp_new(&in, c)) {
        check_failed++;
        fprintf(stderr, "ms_interp_new: %s\n", ms_last_error());
        return;
    }
    ALLOW_VOID(ms_interp_free, in, NULL);
    REFUSE(ms_interp_exec, in, NULL, "return 1");
    REFUSE(ms_interp_exec, code, in, NULL);
    const int64_t shape[1] = {4};
    REFUSE(ms_interp_model_param, in, NULL, "w", 1, shape, MS_F32, 1);
    REFUSE(ms_interp_model_param, fqn, in, NULL, 1, shape, MS_F32, 1);
    REFUSE(ms_interp_model_param, shape, in, "w", 1, NULL, MS_F32, 1);
    CHECK_OK(ms_interp_model_param(in, "model.layers.0.w", 1, shape, MS_F32, 1));
    REFUSE(ms_interp_model_tie, in, NULL, "b", "a");
    REFUSE(ms_interp_model_tie, fqn, in, NULL, "a");
    REFUSE(ms_interp_model_tie, target, in, "b", NULL);
    REFUSE(ms_interp_model_module_type, in, NULL, "", "Model");
    REFUSE(ms_interp_model_module_type, name, in, NULL, "Model");
    REFUSE(ms_interp_model_module_type, type_name, in, "", NULL);
    REFUSE(ms_interp_model_config, in, NULL, "config.json");
    REFUSE(ms_interp_model_config, config_path, in, NULL);
    REFUSE(ms_interp_set_optimizer, in, NULL, "adamw");
    REFUSE(ms_interp_set_optimizer, optimizer, in, NULL);
    REFUSE(ms_interp_set_option, in, NULL, "prefetch.forward=1");
    REFUSE(ms_interp_set_option, setting, in, NULL);
    REFUSE(ms_interp_set_policy_limits, in, NULL, 1e6, 64);
    REFUSE(ms_interp_set_policy_seconds, in, NULL, 5);
    REFUSE(ms_interp_set_batch, in, NULL, 64, 1, 0);

    const char *policy = MOONSHARD_SOURCE_DIR "/policies/fsdp2_default.lua";
    int units;
    REFUSE(ms_interp_plan, in, NULL, "dp_shard=1", policy, &units);
    REFUSE(ms_interp_plan, mesh, in, NULL, policy, &units);
    REFUSE(ms_interp_plan, policy, in, "dp_shard=1", NULL, &units);
    ALLOW(ms_interp_plan, units, 1, in, "dp_shard=1", policy, NULL);
    REFUSE_VALUE(ms_interp_warning_count, in, -1, NULL);
    REFUSE_VALUE(ms_interp_warning, in, NULL, NULL, 0);
    int fw, bw;
    REFUSE(ms_interp_prefetch, in, NULL, &fw, &bw);
    REFUSE(ms_interp_prefetch, forward, in, NULL, &bw);
    REFUSE(ms_interp_prefetch, backward, in, &fw, NULL);
    char *json = NULL;
    REFUSE(ms_interp_plan_json, in, NULL, &json);
    REFUSE(ms_interp_plan_json, json, in, NULL);
    CHECK(json == NULL);
    REFUSE(ms_interp_materialize, in, NULL);
    CHECK_OK(ms_interp_materialize(in));
    REFUSE_VALUE(ms_interp_unit_count, in, -1, NULL);
    REFUSE_VALUE(ms_interp_unit, in, NULL, NULL, 0);
    int unit, index;
    REFUSE(ms_interp_find_param, in, NULL, "w", &unit, &index);
    REFUSE(ms_interp_find_param, fqn, in, NULL, &unit, &index);
    REFUSE(ms_interp_find_param, unit, in, "w", NULL, &index);
    REFUSE(ms_interp_find_param, index, in, "w", &unit, NULL);
    CHECK_OK(ms_interp_find_param(in, "model.layers.0.w", &unit, &index)); /* still works */
    int ndim, rg, ldim;
    int64_t pshape[MS_MAX_DIMS];
    ms_dtype dt;
    REFUSE(ms_interp_param_info, in, NULL, "model.layers.0.w", &ndim, pshape, &dt, &rg);
    REFUSE(ms_interp_param_info, fqn, in, NULL, &ndim, pshape, &dt, &rg);
    REFUSE(ms_interp_param_info, ndim, in, "model.layers.0.w", NULL, pshape, &dt, &rg);
    REFUSE(ms_interp_param_info, shape, in, "model.layers.0.w", &ndim, NULL, &dt, &rg);
    ALLOW(ms_interp_param_info, dtype, 1, in, "model.layers.0.w", &ndim, pshape, NULL, &rg);
    ALLOW(ms_interp_param_info, requires_grad, 1, in, "model.layers.0.w", &ndim, pshape, &dt, NULL);
    ms_lora lora;
    REFUSE(ms_interp_lora, in, NULL, "model.layers.0", &lora);
    REFUSE(ms_interp_lora, module, in, NULL, &lora);
    REFUSE(ms_interp_lora, out, in, "model.layers.0", NULL);
    REFUSE(ms_interp_recipe_ran, in, NULL, "peft", &ldim);
    REFUSE(ms_interp_recipe_ran, step, in, NULL, &ldim);
    REFUSE(ms_interp_recipe_ran, ran, in, "peft", NULL);
    REFUSE(ms_interp_set_recipe, in, NULL, "recipe.lua");
    REFUSE(ms_interp_set_recipe, path, in, NULL);
    /* checkpoints: a save without extra, loaded and read without wanting step or extra */
    char root[] = "/tmp/ms_test_null_ckpt_XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    int64_t step = -1;
    char *extra = NULL;
    REFUSE(ms_interp_checkpoint_save, in, NULL, root, 1, "{}", 0);
    REFUSE(ms_interp_checkpoint_save, dir, in, NULL, 1, "{}", 0);
    ALLOW(ms_interp_checkpoint_save, extra_json, 1, in, root, 1, NULL, 0);
    REFUSE(ms_interp_checkpoint_load, in, NULL, root, &step, &extra);
    REFUSE(ms_interp_checkpoint_load, path, in, NULL, &step, &extra);
    ALLOW(ms_interp_checkpoint_load, step, 1, in, root, NULL, &extra);
    ALLOW(ms_interp_checkpoint_load, extra_json, 1, in, root, &step, NULL);
    CHECK(step == 1 && extra == NULL);
    REFUSE(ms_interp_checkpoint_read, in, NULL, root, &step, &extra);
    REFUSE(ms_interp_checkpoint_read, path, in, NULL, &step, &extra);
    ALLOW(ms_interp_checkpoint_read, step, 1, in, root, NULL, &extra);
    ALLOW(ms_interp_checkpoint_read, extra_json, 1, in, root, &step, NULL);
    REFUSE(ms_ckpt_load_hf, in, NULL, root);
    REFUSE(ms_ckpt_load_hf, path, in, NULL);
    char cleanup[128];
    snprintf(cleanup, sizeof cleanup, "rm -rf %s", root);
    CHECK(system(cleanup) == 0);
    ms_interp_free(in);
}
#endif

/* the checkpoint file primitives (ckpt.c) */
static void test_ckpt(void) {
    const int64_t n4[1] = {4}, start[1] = {0};
    ms_tensor *t = NULL;
    CHECK_OK(ms_tensor_new(&t, 1, n4, MS_U8, MS_DEVICE_CPU, 0));
    uint32_t crc = 0;
    int fd = -1;
    int64_t len = 0;
    char buf[4];
    REFUSE(ms_crc32c, data, 0, NULL, 1, &crc);
    REFUSE(ms_crc32c, out, 0, "a", 1, NULL);
    ALLOW(ms_crc32c, data, 1, 0, NULL, 0, &crc);
    NO_POINTERS(ms_crc32c_impl);
    REFUSE(ms_tensor_crc32c, t, NULL, 0, &crc);
    REFUSE(ms_tensor_crc32c, out, t, 0, NULL);
    REFUSE(ms_ckpt_open, path, NULL, 0, &fd);
    REFUSE(ms_ckpt_open, fd, "/", 0, NULL);
    REFUSE(ms_ckpt_write, data, -1, NULL, 1);
    REFUSE(ms_ckpt_write_tensor, t, -1, NULL, &crc);
    REFUSE(ms_ckpt_write_tensor, crc, -1, t, NULL);
    REFUSE(ms_ckpt_read_box, shape, -1, 0, 1, NULL, start, t);
    REFUSE(ms_ckpt_read_box, start, -1, 0, 1, n4, NULL, t);
    REFUSE(ms_ckpt_read_box, out, -1, 0, 1, n4, start, NULL);
    NO_POINTERS(ms_ckpt_close);
    REFUSE(ms_ckpt_fsync_path, path, NULL);
    REFUSE(ms_ckpt_rename, from, NULL, "x");
    REFUSE(ms_ckpt_rename, to, "x", NULL);
    REFUSE(ms_ckpt_mkdir, path, NULL, 1);
    REFUSE(ms_ckpt_list_dir, path, NULL, buf, 4, &len);
    REFUSE(ms_ckpt_list_dir, buf, "/", NULL, 4, &len);
    REFUSE(ms_ckpt_list_dir, len, "/", buf, 4, NULL);
    /* the Hugging Face loader's box read (checkpoint_hf.lua) */
    const int64_t perm1[1] = {0};
    int64_t nread = 0;
    REFUSE(ms_file_read_region, path, NULL, 0, MS_U8, 1, n4, start, perm1, t, &nread);
    REFUSE(ms_file_read_region, src_shape, "/", 0, MS_U8, 1, NULL, start, perm1, t, &nread);
    REFUSE(ms_file_read_region, start, "/", 0, MS_U8, 1, n4, NULL, perm1, t, &nread);
    ALLOW(ms_file_read_region, perm, 0, "/", 0, MS_U8, 1, n4, start, NULL, t, &nread);
    REFUSE(ms_file_read_region, dst, "/", 0, MS_U8, 1, n4, start, perm1, NULL, &nread);
    ALLOW(ms_file_read_region, bytes_read, 0, "/", 0, MS_U8, 1, n4, start, perm1, t, NULL);
    ms_tensor_release(t);
}

/* the lower-precision kernels (quant.c) */
static void test_quant(void) {
    const int64_t n64[1] = {64}, n32[1] = {32}, one[1] = {1}, n8[2] = {2, 32};
    ms_tensor *x = NULL, *codes = NULL, *am = NULL, *q = NULL, *a2 = NULL, *f8 = NULL, *y = NULL;
    CHECK_OK(ms_tensor_new(&x, 1, n64, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&codes, 1, n32, MS_U8, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&am, 1, one, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&q, 1, one, MS_U8, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&a2, 1, one, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&f8, 1, n64, MS_F8E4M3, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_new(&y, 2, n8, MS_F32, MS_DEVICE_CPU, 0));
    REFUSE(ms_nf4_quantize, x, NULL, 64, codes, am);
    REFUSE(ms_nf4_quantize, codes, x, 64, NULL, am);
    REFUSE(ms_nf4_quantize, absmax, x, 64, codes, NULL);
    CHECK_OK(ms_nf4_quantize(x, 64, codes, am));
    REFUSE(ms_nf4_dequantize, out, NULL, codes, am, 64);
    REFUSE(ms_nf4_dequantize, codes, x, NULL, am, 64);
    REFUSE(ms_nf4_dequantize, absmax, x, codes, NULL, 64);
    double off = 0.0;
    REFUSE(ms_nf4_compress_absmax, absmax, NULL, q, a2, &off);
    REFUSE(ms_nf4_compress_absmax, qabsmax, am, NULL, a2, &off);
    REFUSE(ms_nf4_compress_absmax, absmax2, am, q, NULL, &off);
    REFUSE(ms_nf4_compress_absmax, offset, am, q, a2, NULL);
    REFUSE(ms_nf4_decompress_absmax, absmax, NULL, q, a2, 0.0);
    REFUSE(ms_nf4_decompress_absmax, qabsmax, am, NULL, a2, 0.0);
    REFUSE(ms_nf4_decompress_absmax, absmax2, am, q, NULL, 0.0);
    REFUSE(ms_nf4_bytes, out, 64, 64, 0, NULL);
    REFUSE(ms_fp8_amax, amax, NULL, x, MS_FP8_TENSORWISE);
    REFUSE(ms_fp8_amax, x, am, NULL, MS_FP8_TENSORWISE);
    REFUSE(ms_fp8_scale, scale, NULL, am, MS_F8E4M3, 0);
    REFUSE(ms_fp8_scale, amax, a2, NULL, MS_F8E4M3, 0);
    REFUSE(ms_fp8_cast, out, NULL, x, am);
    REFUSE(ms_fp8_cast, x, f8, NULL, am);
    REFUSE(ms_fp8_cast, scale, f8, x, NULL);
    REFUSE(ms_fp8_dequantize, out, NULL, f8, am);
    REFUSE(ms_fp8_dequantize, fp8, x, NULL, am);
    REFUSE(ms_fp8_dequantize, scale, x, f8, NULL);
    REFUSE(ms_qat_fake_quantize, out, NULL, y, MS_QAT_8DA4W_WEIGHT, 32, MS_F32);
    REFUSE(ms_qat_fake_quantize, x, y, NULL, MS_QAT_8DA4W_WEIGHT, 32, MS_F32);
    REFUSE(ms_unit_set_fp8_all_gather, u, NULL, 0, 1);
    ms_tensor_release(x);
    ms_tensor_release(codes);
    ms_tensor_release(am);
    ms_tensor_release(q);
    ms_tensor_release(a2);
    ms_tensor_release(f8);
    ms_tensor_release(y);
}

/* ---------------------------------------------------------------- the headers' prototypes */

typedef struct {
    char name[64];
    int nparams;
    char params[16][64];
    int pointer[16];
} proto;

enum { MAX_PROTOS = 512 };
static proto protos[MAX_PROTOS];
static int nprotos;

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

/* The identifier that ends just before end (spaces skipped) into out. */
static int ident_before(const char *begin, const char *end, char *out, size_t cap) {
    while (end > begin && isspace((unsigned char)end[-1])) end--;
    const char *s = end;
    while (s > begin && (isalnum((unsigned char)s[-1]) || s[-1] == '_')) s--;
    if (s == end || (size_t)(end - s) >= cap) return 0;
    memcpy(out, s, (size_t)(end - s));
    out[end - s] = '\0';
    return 1;
}

/* The function prototypes between MS_API_BEGIN and MS_API_END of a header. */
static int read_protos(const char *path) {
    char *text = read_file(path);
    if (!text) {
        fprintf(stderr, "test_null: cannot read %s\n", path);
        return 0;
    }
    char *begin = strstr(text, "/* MS_API_BEGIN */"), *end = begin ? strstr(begin, "/* MS_API_END */") : NULL;
    if (!begin || !end) {
        fprintf(stderr, "test_null: %s has no MS_API_BEGIN ... MS_API_END section\n", path);
        free(text);
        return 0;
    }
    begin += strlen("/* MS_API_BEGIN */");
    /* comments, then preprocessor lines, become spaces */
    for (char *p = begin; p < end; p++) {
        if (p[0] == '/' && p[1] == '*') {
            char *q = strstr(p + 2, "*/");
            q = q && q < end ? q + 2 : end;
            memset(p, ' ', (size_t)(q - p));
            p = q - 1;
        } else if (p[0] == '/' && p[1] == '/') {
            while (p < end && *p != '\n') *p++ = ' ';
        }
    }
    for (char *line = begin; line < end;) {
        char *p = line;
        while (p < end && (*p == ' ' || *p == '\t')) p++;
        if (p < end && *p == '#')
            while (p < end && *p != '\n') *p++ = ' ';
        char *nl = memchr(p, '\n', (size_t)(end - p));
        line = nl ? nl + 1 : end;
    }
    int found = 0;
    for (char *decl = begin; decl < end;) {
        char *semi = memchr(decl, ';', (size_t)(end - decl));
        if (!semi) break;
        char *open = memchr(decl, '(', (size_t)(semi - decl));
        if (open && !memchr(decl, '{', (size_t)(semi - decl)) && !memchr(decl, '}', (size_t)(semi - decl))) {
            char *close = semi;
            while (close > open && *close != ')') close--;
            if (nprotos == MAX_PROTOS) break;
            proto *pr = &protos[nprotos];
            memset(pr, 0, sizeof *pr);
            if (ident_before(decl, open, pr->name, sizeof pr->name) && !strncmp(pr->name, "ms_", 3)) {
                /* the parameters, split on commas */
                char *p = open + 1;
                while (p < close) {
                    char *comma = memchr(p, ',', (size_t)(close - p));
                    char *stop = comma ? comma : close;
                    char name[64];
                    if (ident_before(p, stop, name, sizeof name) && strcmp(name, "void") && pr->nparams < 16) {
                        strcpy(pr->params[pr->nparams], name);
                        pr->pointer[pr->nparams] = memchr(p, '*', (size_t)(stop - p)) != NULL;
                        pr->nparams++;
                    }
                    p = stop + 1;
                }
                nprotos++;
                found++;
            }
        }
        decl = semi + 1;
    }
    free(text);
    if (!found) fprintf(stderr, "test_null: no prototypes found in %s\n", path);
    return found;
}

static const proto *find_proto(const char *name) {
    for (int i = 0; i < nprotos; i++)
        if (!strcmp(protos[i].name, name)) return &protos[i];
    return NULL;
}

/* Every pointer argument of every prototype had a NULL call; nothing above names what the
 * headers do not have. */
static void test_coverage(void) {
    int before = check_failed;
    CHECK(read_protos(MOONSHARD_SOURCE_DIR "/core/include/moonshard.h") > 0);
#ifdef MS_TEST_EMBED
    CHECK(read_protos(MOONSHARD_SOURCE_DIR "/core/include/moonshard_embed.h") > 0);
#endif
    int pointer_args = 0;
    for (int i = 0; i < nprotos; i++) {
        const proto *pr = &protos[i];
        int any_pointer = 0;
        for (int a = 0; a < pr->nparams; a++) {
            if (!pr->pointer[a]) continue;
            any_pointer = 1;
            pointer_args++;
            int seen = 0;
            for (int k = 0; k < ncovered && !seen; k++)
                seen = covered[k].arg && !strcmp(covered[k].fn, pr->name) && !strcmp(covered[k].arg, pr->params[a]);
            if (!seen) {
                check_failed++;
                fprintf(stderr, "test_null: %s: no call with %s = NULL (add one to tests/c/test_null.c)\n", pr->name,
                        pr->params[a]);
            }
        }
        int named = 0;
        for (int k = 0; k < ncovered && !named; k++) named = !strcmp(covered[k].fn, pr->name);
        if (!any_pointer && !named) {
            check_failed++;
            fprintf(stderr, "test_null: %s takes no pointer: name it with NO_POINTERS in tests/c/test_null.c\n",
                    pr->name);
        }
    }
    for (int k = 0; k < ncovered; k++) {
        const proto *pr = find_proto(covered[k].fn);
        if (!pr) {
            check_failed++;
            fprintf(stderr, "%s:%d: %s is not a function of the public headers\n", __FILE__, covered[k].line,
                    covered[k].fn);
            continue;
        }
        int a = 0, any_pointer = 0;
        for (int j = 0; j < pr->nparams; j++) any_pointer |= pr->pointer[j];
        if (!covered[k].arg) {
            if (any_pointer) {
                check_failed++;
                fprintf(stderr, "%s:%d: %s takes pointers: NO_POINTERS does not cover it\n", __FILE__,
                        covered[k].line, pr->name);
            }
            continue;
        }
        while (a < pr->nparams && strcmp(pr->params[a], covered[k].arg)) a++;
        if (a == pr->nparams || !pr->pointer[a]) {
            check_failed++;
            fprintf(stderr, "%s:%d: %s has no pointer argument named %s in its header\n", __FILE__, covered[k].line,
                    pr->name, covered[k].arg);
        }
    }
    printf("test_null: %d public functions, %d pointer arguments, %d calls\n", nprotos, pointer_args, ncovered);
    if (check_failed == before) check_passed++;
}

int main(void) {
    test_core_without_handles();
    test_tensors();
    test_quant();
    test_ckpt();
    ms_world *w = NULL;
    ms_comm *c = NULL;
    CHECK_OK(ms_threads_world_new(&w, 1, 60));
    CHECK_OK(ms_world_comm(w, 0, &c));
    if (w && c) {
        test_worlds_and_comms(w, c);
        test_meshes(c);
        test_units(c);
        test_zero(c);
#ifdef MS_TEST_EMBED
        test_interp(c);
#endif
    }
    ms_comm_release(c);
    ms_world_release(w);
    test_coverage();
    return check_summary("test_null");
}
