/*
 * test_core.c: tensors (views, copy with cast, fill, meta, wrapped memory, errors), meshes
 * and layout math, against values worked out by hand.
 */
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>


static void test_tensor_basics(void) {
    int64_t shape[2] = {3, 4};
    ms_tensor *t = NULL;
    CHECK_OK(ms_tensor_new(&t, 2, shape, MS_F32, MS_DEVICE_CPU, 0));
    CHECK(ms_tensor_ndim(t) == 2 && ms_tensor_size(t, 0) == 3 && ms_tensor_size(t, 1) == 4);
    CHECK(ms_tensor_numel(t) == 12 && ms_tensor_nbytes(t) == 48);
    CHECK(ms_tensor_stride(t, 0) == 4 && ms_tensor_stride(t, 1) == 1);
    CHECK(ms_tensor_is_contiguous(t));
    float *d = ms_tensor_data(t);
    int zeros = 1;
    for (int i = 0; i < 12; i++) zeros &= d[i] == 0.0f;
    CHECK(zeros);
    for (int i = 0; i < 12; i++) d[i] = (float)i;

    /* narrow on dim 1: a strided view sharing memory */
    ms_tensor *v = NULL;
    CHECK_OK(ms_tensor_narrow(&v, t, 1, 1, 2));
    CHECK(ms_tensor_size(v, 0) == 3 && ms_tensor_size(v, 1) == 2 && !ms_tensor_is_contiguous(v));
    CHECK(((float *)ms_tensor_data(v))[0] == 1.0f);
    CHECK_OK(ms_tensor_fill(v, -1.0));
    /* rows of t: [0 -1 -1 3] [4 -1 -1 7] [8 -1 -1 11] */
    CHECK(d[0] == 0 && d[1] == -1 && d[2] == -1 && d[3] == 3 && d[5] == -1 && d[7] == 7 && d[10] == -1);
    ms_tensor *vc = NULL;
    CHECK_OK(ms_tensor_to(&vc, v, MS_I32));
    int32_t *vi = ms_tensor_data(vc);
    CHECK(ms_tensor_is_contiguous(vc) && vi[0] == -1 && vi[5] == -1 && ms_tensor_numel(vc) == 6);
    CHECK_ERR(ms_tensor_view(&vc, v, 1, (int64_t[]){6}), MS_ERR_SHAPE, "not contiguous");
    ms_tensor_release(vc);

    /* view with -1, overlaps, chunk */
    ms_tensor *w = NULL;
    CHECK_OK(ms_tensor_view(&w, t, 3, (int64_t[]){2, -1, 3}));
    CHECK(ms_tensor_size(w, 1) == 2 && ms_tensor_overlaps(w, t) && ms_tensor_overlaps(v, t));
    ms_tensor_release(w);
    CHECK_ERR(ms_tensor_view(&w, t, 2, (int64_t[]){5, -1}), MS_ERR_SHAPE, "does not fit 12 elements");
    CHECK_ERR(ms_tensor_view(&w, t, 2, (int64_t[]){5, 2}), MS_ERR_SHAPE, "is not a view of [3, 4]");
    ms_tensor *c = NULL;
    CHECK_OK(ms_tensor_chunk(&c, t, 2, 1, 0)); /* rows 2..2 */
    CHECK(ms_tensor_size(c, 0) == 1 && ((float *)ms_tensor_data(c))[0] == 8.0f);
    ms_tensor_release(c);
    CHECK_OK(ms_tensor_chunk(&c, t, 4, 3, 0)); /* ceil(3/4)=1: pieces 1,1,1,0 */
    CHECK(ms_tensor_size(c, 0) == 0 && ms_tensor_data(c) == NULL);
    ms_tensor_release(c);

    /* copy from a strided view into a transposed-like strided view of another tensor */
    ms_tensor *u = NULL, *uv = NULL;
    CHECK_OK(ms_tensor_new(&u, 2, (int64_t[]){3, 5}, MS_BF16, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_narrow(&uv, u, 1, 3, 2));
    CHECK_OK(ms_tensor_copy(uv, v));
    uint16_t *ub = ms_tensor_data(u);
    CHECK(ub[3] == 0xBF80 && ub[4] == 0xBF80 && ub[2] == 0 && ub[13] == 0xBF80); /* -1.0 in bf16 */
    CHECK_ERR(ms_tensor_copy(u, t), MS_ERR_SHAPE, "destination shape [3, 5] differs from source shape [3, 4]");

    /* overlapping copy inside one tensor: rows 0..1 <- rows 1..2 */
    ms_tensor *a = NULL, *b = NULL;
    CHECK_OK(ms_tensor_narrow(&a, t, 0, 0, 2));
    CHECK_OK(ms_tensor_narrow(&b, t, 0, 1, 2));
    CHECK_OK(ms_tensor_copy(a, b));
    CHECK(d[0] == 4 && d[3] == 7 && d[4] == 8 && d[7] == 11 && d[8] == 8);
    ms_tensor_release(a);
    ms_tensor_release(b);

    /* views keep the storage alive after the base is released */
    ms_tensor_release(t);
    CHECK(((float *)ms_tensor_data(v))[0] == -1.0f);
    ms_tensor_release(v);
    ms_tensor_release(uv);
    ms_tensor_release(u);
}

static void test_tensor_errors(void) {
    ms_tensor *t = NULL;
    CHECK_ERR(ms_tensor_new(&t, 9, (int64_t[9]){0}, MS_F32, MS_DEVICE_CPU, 0), MS_ERR_SHAPE, "0 to 8 dims");
    CHECK_ERR(ms_tensor_new(&t, 1, (int64_t[]){-2}, MS_F32, MS_DEVICE_CPU, 0), MS_ERR_SHAPE, "size of dim 0 is -2");
    CHECK_ERR(ms_tensor_new(&t, 3, (int64_t[]){1LL << 31, 1LL << 31, 1LL << 31}, MS_F32, MS_DEVICE_CPU, 0),
              MS_ERR_OVERFLOW, "more than 2^63 elements");
    CHECK_ERR(ms_tensor_new(&t, 2, (int64_t[]){1LL << 31, 1LL << 31}, MS_F32, MS_DEVICE_CPU, 0), MS_ERR_OVERFLOW,
              "overflow int64 bytes");
    /* a cuda tensor: not built, no device (the driver's reason), or made */
    int ndev = 0;
    ms_status cuda = ms_cuda_device_count(&ndev);
    if (cuda == MS_ERR_NOT_BUILT) {
        CHECK_ERR(ms_tensor_new(&t, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CUDA, 0), MS_ERR_NOT_BUILT, "without CUDA");
    } else if (cuda == MS_ERR_DEVICE) {
        CHECK(ndev == 0);
        CHECK_ERR(ms_tensor_new(&t, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CUDA, 0), MS_ERR_DEVICE,
                  "device cuda:0: ");
    } else {
        CHECK_OK(ms_tensor_new(&t, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CUDA, 0));
        ms_tensor_release(t);
        CHECK_ERR(ms_tensor_new(&t, 1, (int64_t[]){4}, MS_F32, MS_DEVICE_CUDA, ndev), MS_ERR_DEVICE, "CUDA device");
    }
    CHECK_ERR(ms_tensor_new(&t, 1, (int64_t[]){4}, (ms_dtype)42, MS_DEVICE_CPU, 0), MS_ERR_DTYPE, "invalid dtype");

    /* a meta tensor of 671e9 elements costs nothing */
    CHECK_OK(ms_tensor_new(&t, 2, (int64_t[]){129280, 7168LL * 724}, MS_BF16, MS_DEVICE_META, 0));
    CHECK(ms_tensor_data(t) == NULL && ms_tensor_nbytes(t) == 129280LL * 7168 * 724 * 2);
    ms_tensor *n = NULL;
    CHECK_OK(ms_tensor_narrow(&n, t, 0, 100, 28));
    CHECK(ms_tensor_size(n, 0) == 28);
    CHECK_OK(ms_tensor_fill(n, 1.0));
    ms_tensor *cpu = NULL;
    CHECK_OK(ms_tensor_new(&cpu, 2, (int64_t[]){28, 7168LL * 724}, MS_BF16, MS_DEVICE_META, 0));
    CHECK_OK(ms_tensor_copy(cpu, n));
    ms_tensor_release(cpu);
    CHECK_OK(ms_tensor_new(&cpu, 1, (int64_t[]){28}, MS_BF16, MS_DEVICE_CPU, 0));
    ms_tensor *m1 = NULL;
    CHECK_OK(ms_tensor_new(&m1, 1, (int64_t[]){28}, MS_BF16, MS_DEVICE_META, 0));
    CHECK_ERR(ms_tensor_copy(cpu, m1), MS_ERR_DEVICE, "from a meta tensor to a cpu tensor");
    ms_tensor_release(m1);
    ms_tensor_release(cpu);
    CHECK_ERR(ms_tensor_narrow(&n, t, 0, 129000, 281), MS_ERR_SHAPE, "do not fit dim 0 of size 129280");
    CHECK_ERR(ms_tensor_narrow(&n, t, 2, 0, 1), MS_ERR_ARG, "dim 2 out of range");
    ms_tensor_release(n);
    ms_tensor_release(t);

    /* wrapped memory is written through and never freed */
    double host[6] = {0};
    CHECK_OK(ms_tensor_wrap(&t, host, 2, (int64_t[]){2, 3}, MS_F64));
    CHECK_OK(ms_tensor_fill(t, 2.5));
    CHECK(host[0] == 2.5 && host[5] == 2.5);
    ms_tensor_release(t);

    /* an integer fill is exact in i64 (2^62 + 1 has no double) and wraps like an i64 cast */
    int64_t ih[3] = {0};
    CHECK_OK(ms_tensor_wrap(&t, ih, 1, (int64_t[]){3}, MS_I64));
    CHECK_OK(ms_tensor_fill_int(t, (INT64_C(1) << 62) + 1));
    CHECK(ih[0] == (INT64_C(1) << 62) + 1 && ih[2] == ih[0]);
    ms_tensor_release(t);
    int8_t i8h[2] = {0};
    CHECK_OK(ms_tensor_wrap(&t, i8h, 1, (int64_t[]){2}, MS_I8));
    CHECK_OK(ms_tensor_fill_int(t, 300)); /* integer to integer wraps: 300 - 256 */
    CHECK(i8h[0] == 44 && i8h[1] == 44);
    ms_tensor_release(t);
    CHECK_ERR(ms_tensor_wrap(&t, NULL, 1, (int64_t[]){3}, MS_F64), MS_ERR_ARG, "data is NULL");

    ms_device_type dev;
    int idx;
    CHECK_OK(ms_device_parse("cuda:3", &dev, &idx));
    CHECK(dev == MS_DEVICE_CUDA && idx == 3);
    CHECK_ERR(ms_device_parse("tpu", &dev, &idx), MS_ERR_DEVICE, "unknown device 'tpu'");
    ms_dtype dt;
    CHECK_OK(ms_dtype_parse("bfloat16", &dt));
    CHECK(dt == MS_BF16 && ms_dtype_size(dt) == 2);
    CHECK_ERR(ms_dtype_parse("f12", &dt), MS_ERR_DTYPE, "unknown dtype 'f12'");

    /* a host number as an integer dtype's element: torch.tensor([v], dtype=...)'s rules */
    int64_t e = 0;
    CHECK_OK(ms_int_element(MS_I8, 1, 0, -127.9, &e));
    CHECK(e == -127); /* truncated toward zero */
    CHECK_OK(ms_int_element(MS_U8, 0, 255, 0, &e));
    CHECK(e == 255);
    CHECK_OK(ms_int_element(MS_BOOL, 1, 0, 0.0 / 0.0, &e));
    CHECK(e == 1); /* bool(nan) is True */
    CHECK_OK(ms_int_element(MS_I64, 0, INT64_MIN, 0, &e));
    CHECK(e == INT64_MIN);
    CHECK_ERR(ms_int_element(MS_I8, 0, 300, 0, &e), MS_ERR_ARG, "300 is out of range for i8 (-128 to 127)");
    CHECK_ERR(ms_int_element(MS_I32, 1, 0, 0.0 / 0.0, &e), MS_ERR_ARG, "nan is out of range for i32");
    CHECK_ERR(ms_int_element(MS_I64, 1, 0, 0x1p63, &e), MS_ERR_ARG, "9.2233720368548e+18 is out of range for i64");
    CHECK_ERR(ms_int_element(MS_F32, 0, 1, 0, &e), MS_ERR_DTYPE, "f32 is not an integer dtype");
}

static void test_layout(void) {
    int64_t len, off;
    /* torch.chunk: 10 over 4 -> 3,3,3,1; 5 over 4 -> 2,2,1,0; 2 over 4 -> 1,1,0,0 */
    const int64_t want10[4][2] = {{3, 0}, {3, 3}, {3, 6}, {1, 9}};
    const int64_t want5[4][2] = {{2, 0}, {2, 2}, {1, 4}, {0, 5}};
    const int64_t want2[4][2] = {{1, 0}, {1, 1}, {0, 2}, {0, 2}};
    for (int r = 0; r < 4; r++) {
        CHECK_OK(ms_chunk_extent(10, 4, r, &len, &off));
        CHECK(len == want10[r][0] && off == want10[r][1]);
        CHECK_OK(ms_chunk_extent(5, 4, r, &len, &off));
        CHECK(len == want5[r][0] && off == want5[r][1]);
        CHECK_OK(ms_chunk_extent(2, 4, r, &len, &off));
        CHECK(len == want2[r][0] && off == want2[r][1]);
    }
    CHECK_ERR(ms_chunk_extent(4, 0, 0, &len, &off), MS_ERR_ARG, "0 chunks");

    int64_t local[4], goff[4];
    /* [10,4], (Shard(0), Shard(0)) on 2x2 at (1,1): 10 -> 5 at 5 -> 3,2 -> rows 8..9 */
    CHECK_OK(ms_local_shape(2, (int64_t[]){10, 4}, 2, (int[]){MS_PLACE_SHARD, MS_PLACE_SHARD}, (int[]){0, 0},
                            (int64_t[]){2, 2}, (int64_t[]){1, 1}, local, goff));
    CHECK(local[0] == 2 && local[1] == 4 && goff[0] == 8 && goff[1] == 0);
    /* [10,6], (Shard(0), Shard(1)) on 2x3 at (0,2) */
    CHECK_OK(ms_local_shape(2, (int64_t[]){10, 6}, 2, (int[]){MS_PLACE_SHARD, MS_PLACE_SHARD}, (int[]){0, 1},
                            (int64_t[]){2, 3}, (int64_t[]){0, 2}, local, goff));
    CHECK(local[0] == 5 && local[1] == 2 && goff[0] == 0 && goff[1] == 4);
    /* Replicate and Partial leave the shape alone; Shard(-1) of 6 over 4 at 3 is empty at 6 */
    CHECK_OK(ms_local_shape(2, (int64_t[]){4, 6}, 3, (int[]){MS_PLACE_REPLICATE, MS_PLACE_PARTIAL, MS_PLACE_SHARD},
                            (int[]){0, 0, -1}, (int64_t[]){2, 2, 4}, (int64_t[]){1, 1, 3}, local, goff));
    CHECK(local[0] == 4 && local[1] == 0 && goff[0] == 0 && goff[1] == 6);
    CHECK_ERR(ms_local_shape(2, (int64_t[]){4, 6}, 1, (int[]){MS_PLACE_SHARD}, (int[]){2}, (int64_t[]){2},
                             (int64_t[]){0}, local, goff),
              MS_ERR_ARG, "Shard(2) on mesh dim 0 is out of range for a 2-dim tensor");
    CHECK_ERR(ms_local_shape(1, (int64_t[]){4}, 1, (int[]){MS_PLACE_SHARD}, (int[]){0}, (int64_t[]){2},
                             (int64_t[]){2}, local, goff),
              MS_ERR_ARG, "coordinate 2 out of range");

    int64_t padded[4], foff;
    CHECK_OK(ms_fsdp_shard(2, (int64_t[]){10, 4}, 4, 3, 0, local, &foff, padded));
    CHECK(local[0] == 1 && local[1] == 4 && foff == 9 && padded[0] == 3 && padded[1] == 4);
    CHECK_OK(ms_fsdp_shard(2, (int64_t[]){3, 5}, 4, 3, 0, local, &foff, padded));
    CHECK(local[0] == 0 && foff == 3 && padded[0] == 1);
    CHECK_OK(ms_fsdp_shard(2, (int64_t[]){4, 8}, 4, 1, -1, local, &foff, padded));
    CHECK(local[0] == 4 && local[1] == 2 && foff == 2 && padded[1] == 2);
    CHECK_ERR(ms_fsdp_shard(2, (int64_t[]){4, 6}, 4, 1, 1, local, &foff, padded), MS_ERR_SHAPE,
              "has size 6, not divisible by world size 4");
    CHECK_ERR(ms_fsdp_shard(0, NULL, 4, 1, 0, local, &foff, padded), MS_ERR_SHAPE, "scalar");
    CHECK_ERR(ms_fsdp_shard(1, (int64_t[]){4}, 4, 4, 0, local, &foff, padded), MS_ERR_ARG, "rank 4 out of range");
}

static void test_mesh(void) {
    ms_mesh *m = NULL;
    CHECK_OK(ms_mesh_new(&m, 2, (const char *[]){"dp_replicate", "dp_shard"}, (int64_t[]){2, 4}, NULL));
    CHECK(ms_mesh_size(m) == 8 && ms_mesh_rank(m) == -1 && ms_mesh_axis_index(m, "dp_shard") == 1);
    int64_t c[3], r, ranks[8], count;
    CHECK_OK(ms_mesh_coords(m, 6, c));
    CHECK(c[0] == 1 && c[1] == 2);
    CHECK_OK(ms_mesh_rank_of(m, c, &r));
    CHECK(r == 6);
    CHECK_OK(ms_mesh_group_ranks(m, 1, (int[]){1}, 6, ranks, &count));
    CHECK(count == 4 && ranks[0] == 4 && ranks[3] == 7);
    CHECK_OK(ms_mesh_group_ranks(m, 1, (int[]){0}, 6, ranks, &count));
    CHECK(count == 2 && ranks[0] == 2 && ranks[1] == 6);
    CHECK_OK(ms_mesh_group_ranks(m, 2, (int[]){0, 1}, 6, ranks, &count));
    CHECK(count == 8 && ranks[0] == 0 && ranks[7] == 7);
    CHECK_ERR(ms_mesh_group_ranks(m, 2, (int[]){1, 0}, 6, ranks, &count), MS_ERR_ARG, "not in mesh order");
    ms_comm *g = NULL;
    CHECK_ERR(ms_mesh_group(m, 1, (int[]){0}, &g), MS_ERR_STATE, "shape-only mesh");
    ms_mesh_release(m);

    CHECK_OK(ms_mesh_new(&m, 3, (const char *[]){"a", "b", "c"}, (int64_t[]){2, 3, 2}, NULL));
    CHECK_OK(ms_mesh_coords(m, 7, c));
    CHECK(c[0] == 1 && c[1] == 0 && c[2] == 1);
    CHECK_OK(ms_mesh_group_ranks(m, 2, (int[]){0, 2}, 7, ranks, &count));
    CHECK(count == 4 && ranks[0] == 0 && ranks[1] == 1 && ranks[2] == 6 && ranks[3] == 7);
    ms_mesh_release(m);

    CHECK_ERR(ms_mesh_new(&m, 2, (const char *[]){"x", "x"}, (int64_t[]){2, 2}, NULL), MS_ERR_ARG,
              "axis name 'x' appears twice");
    CHECK_ERR(ms_mesh_new(&m, 1, (const char *[]){"x"}, (int64_t[]){0}, NULL), MS_ERR_ARG, "size 0");

    /* a mesh over a 1-rank world must have 1 rank */
    ms_world *w = NULL;
    ms_comm *world = NULL;
    CHECK_OK(ms_threads_world_new(&w, 1, 1.0));
    CHECK_OK(ms_world_comm(w, 0, &world));
    CHECK_ERR(ms_mesh_new(&m, 2, (const char *[]){"dp_replicate", "dp_shard"}, (int64_t[]){2, 4}, world),
              MS_ERR_SHAPE, "dp_replicate=2 x dp_shard=4 has 8 ranks but the world has 1");
    CHECK_OK(ms_mesh_new(&m, 1, (const char *[]){"dp"}, (int64_t[]){1}, world));
    CHECK_OK(ms_mesh_group(m, 1, (int[]){0}, &g));
    ms_comm *g2 = NULL;
    CHECK_OK(ms_mesh_group(m, 1, (int[]){0}, &g2));
    CHECK(g == g2 && ms_comm_size(g) == 1 && ms_mesh_rank(m) == 0);
    ms_comm_release(g);
    ms_comm_release(g2);
    ms_mesh_release(m);
    ms_comm_release(world);
    ms_world_release(w);
}

/* The library's version is the headers' (CMake checks the header against the project). */
static void test_version(void) {
    char want[64];
    snprintf(want, sizeof want, "%d.%d.%d", MS_VERSION_MAJOR, MS_VERSION_MINOR, MS_VERSION_PATCH);
    CHECK(!strcmp(ms_version(), want));
}

/* ms_file_stat: kinds and sizes without opening (a FIFO would block an open) */
static void test_file_stat(void) {
    char dir[] = "/tmp/ms_test_core_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char reg[64], fifo[64], missing[64];
    snprintf(reg, sizeof reg, "%s/f", dir);
    snprintf(fifo, sizeof fifo, "%s/p", dir);
    snprintf(missing, sizeof missing, "%s/none", dir);
    FILE *f = fopen(reg, "wb");
    CHECK(f && fwrite("12345", 1, 5, f) == 5);
    if (f) fclose(f);
    CHECK(mkfifo(fifo, 0600) == 0);
    ms_file_kind kind = MS_FILE_OTHER;
    int64_t size = -1;
    CHECK_OK(ms_file_stat(reg, &kind, &size));
    CHECK(kind == MS_FILE_REGULAR && size == 5);
    CHECK_OK(ms_file_stat(dir, &kind, &size));
    CHECK(kind == MS_FILE_DIRECTORY && size == 0);
    CHECK_OK(ms_file_stat(fifo, &kind, &size));
    CHECK(kind == MS_FILE_FIFO && size == 0);
    CHECK_OK(ms_file_stat("/dev/zero", &kind, &size));
    CHECK(kind == MS_FILE_CHAR_DEVICE && size == 0);
    CHECK(!strcmp(ms_file_kind_name(MS_FILE_FIFO), "FIFO (named pipe)"));
    CHECK(!strcmp(ms_file_kind_name(MS_FILE_CHAR_DEVICE), "character device"));
    CHECK(ms_file_kind_name((ms_file_kind)99) == NULL);
    CHECK_ERR(ms_file_stat(missing, &kind, &size), MS_ERR_IO, "/none: No such file or directory");
    CHECK_ERR(ms_file_stat(NULL, &kind, &size), MS_ERR_ARG, "ms_file_stat: path is NULL");
    CHECK_ERR(ms_file_stat(reg, NULL, &size), MS_ERR_ARG, "ms_file_stat: kind is NULL");
    unlink(reg);
    unlink(fifo);
    rmdir(dir);
}

int main(void) {
    test_version();
    test_file_stat();
    test_tensor_basics();
    test_tensor_errors();
    test_layout();
    test_mesh();
    return check_summary("test_core");
}
