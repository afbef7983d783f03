/*
 * test_comm.c: the collectives of the threads backend, checked on every rank.
 *
 * Ranks are pthreads of one threads world.  Every input element is a formula of (test
 * seed, group rank, index), so each rank computes what every peer sent and checks its own
 * result against a reference made here independently: reductions in rank order in f32
 * (f32 and the narrower floats, rounded once with cast.c's scalar converters), f64, or
 * wrapping 64-bit integers.  Wrong elements are counted per rank and the largest float
 * difference is printed.  Then the failure paths, each in a fresh world: ranks that
 * disagree on count, dtype, op, collective, root or label (the shard unit a call is for:
 * MS_ERR_MISMATCH on every rank, naming what each posted, data untouched), a rank that
 * never arrives (MS_ERR_TIMEOUT, not before the timeout), ranks reported done (MS_ERR_PEER,
 * well before the timeout), comms unusable afterwards
 * (MS_ERR_STATE), and argument errors, all by their messages.  Also ms__async_run, which the
 * nccl backend sends every collective through: it runs on the rank's communication thread
 * after what is queued there, inline when already on that thread, and passes failures back.
 */
#include "check_mt.h"
#include "comm.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_RANKS = 4 };

typedef struct rank_ctx {
    ms_world *w;
    int rank;
    ms_comm *world; /* this rank's world comm */
    void *arg;      /* the test's shared state */
} rank_ctx;

typedef void (*rank_fn)(rank_ctx *);

typedef struct rank_thread {
    rank_ctx ctx;
    rank_fn fn;
} rank_thread;

static void *rank_main(void *p) {
    rank_thread *t = p;
    CHECK_OK(ms_world_comm(t->ctx.w, t->ctx.rank, &t->ctx.world));
    t->fn(&t->ctx);
    ms_comm_release(t->ctx.world);
    return NULL;
}

/* Runs fn on n rank threads of a fresh world with the given timeout. */
static void run_ranks(int n, double timeout_s, rank_fn fn, void *arg) {
    ms_world *w = NULL;
    CHECK_OK(ms_threads_world_new(&w, n, timeout_s));
    if (!w) return;
    rank_thread th[MAX_RANKS];
    pthread_t tid[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        th[r] = (rank_thread){.ctx = {.w = w, .rank = r, .arg = arg}, .fn = fn};
        pthread_create(&tid[r], NULL, rank_main, &th[r]);
    }
    for (int r = 0; r < n; r++) pthread_join(tid[r], NULL);
    ms_world_release(w);
}

/* ---------------------------------------------------------------- tensors and inputs */

static ms_tensor *tensor(ms_dtype dt, int ndim, int64_t d0, int64_t d1) {
    int64_t shape[2] = {d0, d1};
    ms_tensor *t = NULL;
    CHECK_OK(ms_tensor_new(&t, ndim, shape, dt, MS_DEVICE_CPU, 0));
    return t;
}

/* Rows [start, start + len) of t (dim 0): a view sharing t's memory. */
static ms_tensor *rows(ms_tensor *t, int64_t start, int64_t len) {
    ms_tensor *v = NULL;
    CHECK_OK(ms_tensor_narrow(&v, t, 0, start, len));
    return v;
}

static unsigned char *elem(const ms_tensor *t, int64_t i) {
    return (unsigned char *)ms_tensor_data(t) + i * ms_dtype_size(ms_tensor_dtype(t));
}

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Stores float v into one element of a float dtype with the scalar converters. */
static void put_float(ms_dtype dt, double v, void *p) {
    float f = (float)v;
    uint16_t h;
    uint8_t b;
    switch (dt) {
    case MS_F64: memcpy(p, &v, 8); break;
    case MS_F32: memcpy(p, &f, 4); break;
    case MS_BF16: h = ms__f32_to_bf16(f), memcpy(p, &h, 2); break;
    case MS_F16: h = ms__f32_to_f16(f), memcpy(p, &h, 2); break;
    case MS_F8E4M3: b = ms__f32_to_e4m3(f), memcpy(p, &b, 1); break;
    default: b = ms__f32_to_e5m2(f), memcpy(p, &b, 1); break;
    }
}

static double get_float(ms_dtype dt, const void *p) {
    double d;
    float f;
    uint16_t h;
    switch (dt) {
    case MS_F64: memcpy(&d, p, 8); return d;
    case MS_F32: memcpy(&f, p, 4); return f;
    case MS_BF16: memcpy(&h, p, 2); return ms__bf16_to_f32(h);
    case MS_F16: memcpy(&h, p, 2); return ms__f16_to_f32(h);
    case MS_F8E4M3: return ms__e4m3_to_f32(*(const uint8_t *)p);
    default: return ms__e5m2_to_f32(*(const uint8_t *)p);
    }
}

/* Integers and bool: the value, and its low bytes stored back (wrapping). */
static int64_t get_int(ms_dtype dt, const void *p) {
    int64_t v64;
    int32_t v32;
    switch (dt) {
    case MS_I64: memcpy(&v64, p, 8); return v64;
    case MS_I32: memcpy(&v32, p, 4); return v32;
    case MS_I8: return *(const int8_t *)p;
    default: return *(const uint8_t *)p; /* u8, bool */
    }
}

static void put_int(ms_dtype dt, int64_t v, void *p) {
    memcpy(p, &v, (size_t)ms_dtype_size(dt)); /* little-endian: the low bytes */
}

/* Element i of group rank r's input in test `seed`. */
static void input(ms_dtype dt, uint32_t seed, int r, int64_t i, void *p) {
    uint64_t h = mix(((uint64_t)seed << 40) ^ ((uint64_t)r << 32) ^ (uint64_t)i);
    if (dt == MS_F64) put_float(dt, (double)((int64_t)(h % 2000001) - 1000000) / 9973.0, p);
    else if (ms_dtype_is_float(dt)) put_float(dt, (double)((float)((int)(h % 20001) - 10000) / 997.0f), p);
    else if (dt == MS_BOOL) put_int(dt, (int64_t)(h & 1), p);
    else put_int(dt, (int64_t)h, p);
}

static void fill_input(ms_tensor *t, uint32_t seed, int r) {
    for (int64_t i = 0; i < ms_tensor_numel(t); i++) input(ms_tensor_dtype(t), seed, r, i, elem(t, i));
}

/* ---------------------------------------------------------------- the reference */

static float op_f32(ms_op op, float a, float b) {
    return op == MS_OP_MAX ? (b > a ? b : a) : op == MS_OP_MIN ? (b < a ? b : a) : a + b;
}
static double op_f64(ms_op op, double a, double b) {
    return op == MS_OP_MAX ? (b > a ? b : a) : op == MS_OP_MIN ? (b < a ? b : a) : a + b;
}
static int64_t op_int(ms_op op, int64_t a, int64_t b) {
    return op == MS_OP_MAX ? (b > a ? b : a) : op == MS_OP_MIN ? (b < a ? b : a) : (int64_t)((uint64_t)a + (uint64_t)b);
}

/* Element i of the inputs of ranks 0..n-1 reduced with op, in rank order, stored in p. */
static void reference(ms_dtype dt, ms_op op, int n, uint32_t seed, int64_t i, void *p) {
    unsigned char x[8];
    if (dt == MS_F64) {
        double acc = 0;
        for (int r = 0; r < n; r++) {
            input(dt, seed, r, i, x);
            acc = r ? op_f64(op, acc, get_float(dt, x)) : get_float(dt, x);
        }
        put_float(dt, op == MS_OP_AVG ? acc / n : acc, p);
    } else if (ms_dtype_is_float(dt)) {
        float acc = 0;
        for (int r = 0; r < n; r++) {
            input(dt, seed, r, i, x);
            acc = r ? op_f32(op, acc, (float)get_float(dt, x)) : (float)get_float(dt, x);
        }
        put_float(dt, op == MS_OP_AVG ? acc / (float)n : acc, p);
    } else {
        int64_t acc = 0;
        for (int r = 0; r < n; r++) {
            input(dt, seed, r, i, x);
            acc = r ? op_int(op, acc, get_int(dt, x)) : get_int(dt, x);
        }
        put_int(dt, acc, p);
    }
}

/* ---------------------------------------------------------------- the sweep */

/* What one rank saw over all its collectives. */
typedef struct sweep_stats {
    long calls, elements, wrong;
    double max_diff; /* largest |got - want| of a float result */
} sweep_stats;

/* Counts got[i] != want (bitwise) for one element; prints the first few. */
static void compare(sweep_stats *st, const char *what, ms_dtype dt, int64_t i, const void *got, const void *want) {
    int es = ms_dtype_size(dt);
    st->elements++;
    if (ms_dtype_is_float(dt)) {
        double d = fabs(get_float(dt, got) - get_float(dt, want));
        if (d > st->max_diff) st->max_diff = d;
    }
    if (!memcmp(got, want, (size_t)es)) return;
    if (st->wrong++ < 5) {
        if (ms_dtype_is_float(dt))
            fail_at(__LINE__, what, ": element %lld is %.9g, expected %.9g", (long long)i, get_float(dt, got),
                    get_float(dt, want));
        else
            fail_at(__LINE__, what, ": element %lld is %lld, expected %lld", (long long)i,
                    (long long)get_int(dt, got), (long long)get_int(dt, want));
    }
}

static bool op_valid(ms_dtype dt, ms_op op) {
    if (op == MS_OP_AVG) return ms_dtype_is_float(dt);
    return dt != MS_BOOL || op != MS_OP_SUM;
}

static const int64_t counts[] = {0, 1, 7, 2049, 5003}; /* 2049, 5003: past one reduction block */

/* One all_gather: in is out's slice for this rank, or a tensor of its own. */
static void test_all_gather(ms_comm *c, const char *where, ms_dtype dt, int64_t count, bool in_place,
                            uint32_t seed, sweep_stats *st) {
    int n = ms_comm_size(c), r = ms_comm_rank(c);
    ms_tensor *out = tensor(dt, 2, n, count);
    ms_tensor *in = in_place ? rows(out, r, 1) : tensor(dt, 1, count, 0);
    if (count) memset(ms_tensor_data(out), 0xA5, (size_t)ms_tensor_nbytes(out));
    fill_input(in, seed, r);
    char what[256];
    snprintf(what, sizeof what, "%s: all_gather %s count %lld%s", where, ms_dtype_name(dt), (long long)count,
             in_place ? " in place" : "");
    CHECK_ST(ms_all_gather(c, out, in), MS_OK, "");
    unsigned char want[8];
    for (int j = 0; j < n; j++)
        for (int64_t i = 0; i < count; i++) {
            input(dt, seed, j, i, want);
            compare(st, what, dt, j * count + i, elem(out, j * count + i), want);
        }
    st->calls++;
    ms_tensor_release(in);
    ms_tensor_release(out);
}

/* One reduce_scatter: out is in's slice for this rank, or a tensor of its own. */
static void test_reduce_scatter(ms_comm *c, const char *where, ms_dtype dt, ms_op op, int64_t count,
                                bool in_place, uint32_t seed, sweep_stats *st) {
    int n = ms_comm_size(c), r = ms_comm_rank(c);
    ms_tensor *in = tensor(dt, 2, n, count);
    ms_tensor *out = in_place ? rows(in, r, 1) : tensor(dt, 1, count, 0);
    fill_input(in, seed, r);
    char what[256];
    snprintf(what, sizeof what, "%s: reduce_scatter %s %s count %lld%s", where, ms_dtype_name(dt), ms_op_name(op),
             (long long)count, in_place ? " in place" : "");
    CHECK_ST(ms_reduce_scatter(c, out, in, op), MS_OK, "");
    unsigned char want[8];
    for (int64_t i = 0; i < count; i++) {
        reference(dt, op, n, seed, r * count + i, want);
        compare(st, what, dt, i, elem(out, i), want);
    }
    st->calls++;
    ms_tensor_release(out);
    ms_tensor_release(in);
}

static void test_all_reduce(ms_comm *c, const char *where, ms_dtype dt, ms_op op, int64_t count, uint32_t seed,
                            sweep_stats *st) {
    int n = ms_comm_size(c), r = ms_comm_rank(c);
    ms_tensor *t = tensor(dt, 1, count, 0);
    fill_input(t, seed, r);
    char what[256];
    snprintf(what, sizeof what, "%s: all_reduce %s %s count %lld", where, ms_dtype_name(dt), ms_op_name(op),
             (long long)count);
    CHECK_ST(ms_all_reduce(c, t, op), MS_OK, "");
    unsigned char want[8];
    for (int64_t i = 0; i < count; i++) {
        reference(dt, op, n, seed, i, want);
        compare(st, what, dt, i, elem(t, i), want);
    }
    st->calls++;
    ms_tensor_release(t);
}

static void test_broadcast(ms_comm *c, const char *where, ms_dtype dt, int64_t count, int root, uint32_t seed,
                           sweep_stats *st) {
    ms_tensor *t = tensor(dt, 1, count, 0);
    fill_input(t, seed, ms_comm_rank(c));
    char what[256];
    snprintf(what, sizeof what, "%s: broadcast %s count %lld root %d", where, ms_dtype_name(dt), (long long)count,
             root);
    CHECK_ST(ms_broadcast(c, t, root), MS_OK, "");
    unsigned char want[8];
    for (int64_t i = 0; i < count; i++) {
        input(dt, seed, root, i, want);
        compare(st, what, dt, i, elem(t, i), want);
    }
    st->calls++;
    ms_tensor_release(t);
}

/* all_to_all of n chunks of `chunk` elements: out chunk j = chunk r of rank j's in. */
static void test_all_to_all(ms_comm *c, const char *where, ms_dtype dt, int64_t chunk, uint32_t seed,
                            sweep_stats *st) {
    int n = ms_comm_size(c), r = ms_comm_rank(c);
    ms_tensor *in = tensor(dt, 2, n, chunk), *out = tensor(dt, 1, n * chunk, 0);
    fill_input(in, seed, r);
    char what[256];
    snprintf(what, sizeof what, "%s: all_to_all %s chunk %lld", where, ms_dtype_name(dt), (long long)chunk);
    CHECK_ST(ms_all_to_all(c, out, in), MS_OK, "");
    unsigned char want[8];
    for (int j = 0; j < n; j++)
        for (int64_t i = 0; i < chunk; i++) {
            input(dt, seed, j, r * chunk + i, want);
            compare(st, what, dt, j * chunk + i, elem(out, j * chunk + i), want);
        }
    st->calls++;
    ms_tensor_release(in);
    ms_tensor_release(out);
}

/* Every collective x dtype x op x count on one comm.  All members run the same loops, so
 * their calls match and *seed advances alike on each. */
static void sweep_comm(ms_comm *c, uint32_t *seed, sweep_stats *st) {
    char where[128], group[64];
    size_t len = 0;
    for (int j = 0; j < ms_comm_size(c); j++)
        len += (size_t)snprintf(group + len, sizeof group - len, j ? " %d" : "%d", ms_comm_world_rank(c, j));
    snprintf(where, sizeof where, "group [%s] rank %d", group, ms_comm_rank(c));
    for (int d = 0; d < MS_DTYPE_COUNT; d++) {
        ms_dtype dt = (ms_dtype)d;
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            int64_t count = counts[k];
            test_all_gather(c, where, dt, count, false, ++*seed, st);
            test_all_gather(c, where, dt, count, true, ++*seed, st);
            int root = (int)(*seed % (uint32_t)ms_comm_size(c));
            test_broadcast(c, where, dt, count, root, ++*seed, st);
            test_all_to_all(c, where, dt, count, ++*seed, st);
            for (int op = 0; op < 4; op++) {
                if (!op_valid(dt, (ms_op)op)) continue;
                test_reduce_scatter(c, where, dt, (ms_op)op, count, false, ++*seed, st);
                test_reduce_scatter(c, where, dt, (ms_op)op, count, true, ++*seed, st);
                test_all_reduce(c, where, dt, (ms_op)op, count, ++*seed, st);
            }
        }
    }
    CHECK_OK(ms_barrier(c));
    st->calls++;
}

/* The groups each world size is swept on, as partitions of the world run one after the
 * other (the groups of one partition run at the same time). */
typedef struct partition {
    int ngroups;
    int size[MAX_RANKS];
    int ranks[MAX_RANKS][MAX_RANKS];
} partition;

static const partition partitions[MAX_RANKS + 1][3] = {
    [1] = {{1, {1}, {{0}}}},
    [2] = {{1, {2}, {{0, 1}}}, {2, {1, 1}, {{0}, {1}}}},
    [3] = {{1, {3}, {{0, 1, 2}}}, {2, {2, 1}, {{0, 2}, {1}}}},
    [4] = {{1, {4}, {{0, 1, 2, 3}}}, {2, {2, 2}, {{0, 2}, {1, 3}}}, {2, {1, 3}, {{0}, {1, 2, 3}}}},
};

static void sweep_rank(rank_ctx *ctx) {
    sweep_stats *stats = ctx->arg;
    int n = ms_world_size(ctx->w);
    uint32_t seed = 0;
    for (int p = 0; p < 3 && partitions[n][p].ngroups; p++) {
        const partition *part = &partitions[n][p];
        for (int g = 0; g < part->ngroups; g++) {
            const int *members = part->ranks[g];
            bool mine = false;
            for (int j = 0; j < part->size[g]; j++) mine |= members[j] == ctx->rank;
            if (!mine) continue;
            ms_comm *c = NULL;
            CHECK_OK(ms_comm_group(ctx->world, part->size[g], members, &c));
            if (!c) continue;
            uint32_t group_seed = seed + 1000000u * (uint32_t)g;
            sweep_comm(c, &group_seed, &stats[ctx->rank]);
            ms_comm_release(c);
        }
        seed += 10000000u;
    }
}

static void test_sweep(void) {
    for (int n = 1; n <= MAX_RANKS; n++) {
        sweep_stats stats[MAX_RANKS] = {{0}};
        double t0 = now_s();
        run_ranks(n, 60, sweep_rank, stats);
        for (int r = 0; r < n; r++) {
            CHECK(stats[r].wrong == 0, "(world %d rank %d: %ld wrong elements)", n, r, stats[r].wrong);
            printf("world %d rank %d: %5ld collectives, %8ld elements checked, %ld wrong, max float diff %g\n", n, r,
                   stats[r].calls, stats[r].elements, stats[r].wrong, stats[r].max_diff);
        }
        printf("world %d: swept in %.2f s\n", n, now_s() - t0);
    }
}

/* ---------------------------------------------------------------- handles */

static void handles_rank(rank_ctx *ctx) {
    ms_comm *again = NULL, *all = NULL, *pair = NULL, *pair2 = NULL;
    CHECK_OK(ms_world_comm(ctx->w, ctx->rank, &again));
    CHECK(again == ctx->world, "(ms_world_comm twice gives the same handle)");
    CHECK(ms_comm_size(ctx->world) == 4 && ms_comm_rank(ctx->world) == ctx->rank);
    CHECK(!strcmp(ms_comm_backend(ctx->world), "threads"));
    int everyone[4] = {0, 1, 2, 3};
    CHECK_OK(ms_comm_group(ctx->world, 4, everyone, &all));
    CHECK(all == ctx->world, "(the group of all ranks is the world comm)");
    int members[2] = {ctx->rank % 2, ctx->rank % 2 + 2}; /* [0 2] or [1 3] */
    CHECK_OK(ms_comm_group(ctx->world, 2, members, &pair));
    CHECK_OK(ms_comm_group(all, 2, members, &pair2)); /* asked through another comm of the world */
    CHECK(pair && pair == pair2, "(asking for the same list again gives the same handle)");
    if (pair) {
        CHECK(ms_comm_size(pair) == 2 && ms_comm_rank(pair) == ctx->rank / 2);
        CHECK(ms_comm_world_rank(pair, 1) == members[1] && ms_comm_world_rank(pair, 2) == -1);
    }
    ms_comm_release(pair2);
    ms_comm_release(pair);
    ms_comm_release(all);
    ms_comm_release(again);
}

/* ---------------------------------------------------------------- tagged groups */

enum { TAG_ROUNDS = 300 };

typedef struct tagged_loop {
    ms_comm *c;
    float value; /* this rank's contribution; the sum over 4 ranks is 10 * value / (rank + 1) */
    int rank, wrong;
} tagged_loop;

/* TAG_ROUNDS all_reduces on one comm; counts results that are not the exact sum. */
static void *tagged_all_reduces(void *p) {
    tagged_loop *l = p;
    float sum = 10.0f * l->value / (float)(l->rank + 1);
    for (int i = 0; i < TAG_ROUNDS; i++) {
        int64_t one = 1;
        float v = l->value;
        ms_tensor *t = NULL;
        if (ms_tensor_wrap(&t, &v, 1, &one, MS_F32) || ms_all_reduce(l->c, t, MS_OP_SUM) || v != sum) l->wrong++;
        ms_tensor_release(t);
    }
    return NULL;
}

/* A tag-1 group over the same ranks as the world is a separate communicator: a second
 * thread of every rank runs all_reduces on it while the first runs them on the world,
 * with no order between the two, and every result is right. */
static void tags_rank(rank_ctx *ctx) {
    int everyone[4] = {0, 1, 2, 3};
    ms_comm *tagged = NULL, *again = NULL, *none = NULL;
    CHECK_OK(ms_comm_group_tagged(ctx->world, 4, everyone, 1, &tagged));
    CHECK_OK(ms_comm_group_tagged(ctx->world, 4, everyone, 1, &again));
    CHECK(tagged && tagged != ctx->world && tagged == again, "(tag 1 is its own group, found again)");
    CHECK_ST(ms_comm_group_tagged(ctx->world, 4, everyone, MS_GROUP_TAG_MAX + 1, &none), MS_ERR_ARG,
              "tag 1024 is outside 0..1023");
    if (!tagged) return;
    tagged_loop world = {ctx->world, (float)(ctx->rank + 1), ctx->rank, 0};
    tagged_loop side = {tagged, 100.0f * (float)(ctx->rank + 1), ctx->rank, 0};
    pthread_t tid;
    pthread_create(&tid, NULL, tagged_all_reduces, &side);
    tagged_all_reduces(&world);
    pthread_join(tid, NULL);
    CHECK(world.wrong == 0 && side.wrong == 0, "(rank %d: %d + %d wrong sums of %d)", ctx->rank, world.wrong,
          side.wrong, TAG_ROUNDS);
    ms_comm_release(again);
    ms_comm_release(tagged);
}

/* ---------------------------------------------------------------- mismatch */

typedef struct mismatch_case {
    const char *name;
    /* Makes rank r's call on t (16 elements of f32, or what the case changes). */
    ms_status (*call)(ms_comm *c, ms_tensor *t, int r);
    const char *message;
} mismatch_case;

static ms_status count_differs(ms_comm *c, ms_tensor *t, int r) {
    if (r != 2) return ms_all_reduce(c, t, MS_OP_SUM);
    ms_tensor *half = rows(t, 0, 8);
    ms_status st = ms_all_reduce(c, half, MS_OP_SUM);
    ms_tensor_release(half);
    return st;
}

static ms_status dtype_differs(ms_comm *c, ms_tensor *t, int r) {
    if (r != 1) return ms_all_reduce(c, t, MS_OP_SUM);
    int64_t shape[1] = {16};
    ms_tensor *b = NULL; /* the same bytes seen as 16 bf16 */
    CHECK_OK(ms_tensor_wrap(&b, ms_tensor_data(t), 1, shape, MS_BF16));
    ms_status st = ms_all_reduce(c, b, MS_OP_SUM);
    ms_tensor_release(b);
    return st;
}

static ms_status op_differs(ms_comm *c, ms_tensor *t, int r) {
    return ms_all_reduce(c, t, r == 3 ? MS_OP_MAX : MS_OP_SUM);
}

static ms_status kind_differs(ms_comm *c, ms_tensor *t, int r) {
    return r == 0 ? ms_broadcast(c, t, 0) : ms_all_reduce(c, t, MS_OP_SUM);
}

static ms_status root_differs(ms_comm *c, ms_tensor *t, int r) { return ms_broadcast(c, t, r < 2 ? 0 : 1); }

static ms_status barrier_differs(ms_comm *c, ms_tensor *t, int r) {
    return r == 3 ? ms_barrier(c) : ms_all_reduce(c, t, MS_OP_SUM);
}

/* The same all_reduce issued for different shard units: the label (comm.h: the unit's name,
 * which unit.c sets around a unit's collectives) is part of the call, so ranks 0 1 (unit
 * "layers.0") and ranks 2 3 (unit "layers.1") disagree although dtype, count and op agree. */
static ms_status label_differs(ms_comm *c, ms_tensor *t, int r) {
    ms__coll_label = r < 2 ? "layers.0" : "layers.1";
    ms_status st = ms_all_reduce(c, t, MS_OP_SUM);
    ms__coll_label = NULL;
    return st;
}

/* A unit's all_reduce against the same all_reduce made by the rank itself (no label). */
static ms_status label_missing(ms_comm *c, ms_tensor *t, int r) {
    ms__coll_label = r == 3 ? NULL : "layers.0";
    ms_status st = ms_all_reduce(c, t, MS_OP_SUM);
    ms__coll_label = NULL;
    return st;
}

static const mismatch_case mismatch_cases[] = {
    {"count", count_differs, "all_reduce on group [0 1 2 3]: ranks disagree: ranks 0 1 3: 16 x f32 sum; rank 2: 8 x f32 sum"},
    {"dtype", dtype_differs, "all_reduce on group [0 1 2 3]: ranks disagree: ranks 0 2 3: 16 x f32 sum; rank 1: 16 x bf16 sum"},
    {"op", op_differs, "all_reduce on group [0 1 2 3]: ranks disagree: ranks 0 1 2: 16 x f32 sum; rank 3: 16 x f32 max"},
    {"kind", kind_differs,
     "collectives on group [0 1 2 3]: ranks disagree on the collective: rank 0: broadcast 16 x f32 root 0; "
     "ranks 1 2 3: all_reduce 16 x f32 sum"},
    {"root", root_differs, "broadcast on group [0 1 2 3]: ranks disagree: ranks 0 1: 16 x f32 root 0; ranks 2 3: 16 x f32 root 1"},
    {"barrier", barrier_differs,
     "collectives on group [0 1 2 3]: ranks disagree on the collective: ranks 0 1 2: all_reduce 16 x f32 sum; "
     "rank 3: barrier"},
    {"label", label_differs,
     "all_reduce on group [0 1 2 3]: ranks disagree: ranks 0 1: 16 x f32 sum for unit layers.0; "
     "ranks 2 3: 16 x f32 sum for unit layers.1"},
    {"no label", label_missing,
     "all_reduce on group [0 1 2 3]: ranks disagree: ranks 0 1 2: 16 x f32 sum for unit layers.0; "
     "rank 3: 16 x f32 sum"},
};

static void mismatch_rank(rank_ctx *ctx) {
    const mismatch_case *mc = ctx->arg;
    ms_tensor *t = tensor(MS_F32, 1, 16, 0);
    fill_input(t, 7, ctx->rank);
    CHECK_ST(mc->call(ctx->world, t, ctx->rank), MS_ERR_MISMATCH, mc->message);
    CHECK(!strcmp(ms_last_error(), mc->message), "(case %s rank %d: the message is exactly \"%s\", got \"%s\")",
          mc->name, ctx->rank, mc->message, ms_last_error());
    unsigned char want[4];
    int untouched = 1;
    for (int64_t i = 0; i < 16; i++) {
        input(MS_F32, 7, ctx->rank, i, want);
        untouched &= !memcmp(elem(t, i), want, 4);
    }
    CHECK(untouched, "(case %s rank %d: a mismatch touches no data)", mc->name, ctx->rank);
    CHECK_ST(ms_barrier(ctx->world), MS_ERR_STATE, "the comm is unusable after an earlier failure: ");
    CHECK(strstr(ms_last_error(), mc->message), "(the later failure repeats why: %s)", ms_last_error());
    ms_tensor_release(t);
}

static void test_mismatch(void) {
    for (size_t i = 0; i < sizeof mismatch_cases / sizeof mismatch_cases[0]; i++)
        run_ranks(4, 30, mismatch_rank, (void *)&mismatch_cases[i]);
}

/* ---------------------------------------------------------------- timeout */

/* Wall-clock checks here bound waits from below, where the code promises "not before":
 * those hold however loaded the machine is.  An upper bound only tells "fired" from "hung,
 * or fired on the wrong scale" (or "failed at once" from "waited for the timeout"): it is
 * HANG_FACTOR times the expected time and at least HANG_MIN_S, far beyond any scheduling
 * delay of a busy CI machine (ASan included); ctest's TIMEOUT catches a real hang. */
#define HANG_FACTOR 10.0
#define HANG_MIN_S 5.0

typedef struct timeout_case {
    atomic_int returned;      /* ranks that have come back from the timed-out call */
    _Atomic double called[2]; /* when ranks 0 and 1 called it (now_s); 0 until then */
    const char *message;
} timeout_case;

/* Ranks 0 and 1 all_reduce; rank 2 joins only after both gave up. */
static void timeout_rank(rank_ctx *ctx) {
    timeout_case *tc = ctx->arg;
    double timeout = ms_world_timeout(ctx->w);
    ms_tensor *t = tensor(MS_F32, 1, 5, 0);
    if (ctx->rank < 2) {
        atomic_store(&tc->called[ctx->rank], now_s());
        CHECK_ST(ms_all_reduce(ctx->world, t, MS_OP_SUM), MS_ERR_TIMEOUT, tc->message);
        /* The rank that gives up first does so a timeout after its own call, and the other
         * then fails with it at once (a rank that called late waited less, or not at all):
         * so the wait to check runs from the earlier of the two calls.  That rank stored its
         * time before it called, so it is seen here. */
        double c0 = atomic_load(&tc->called[0]), c1 = atomic_load(&tc->called[1]);
        double first = c0 == 0 ? c1 : c1 == 0 ? c0 : fmin(c0, c1);
        double waited = now_s() - first;
        /* never before the timeout (1 ms: only the clock's rounding) */
        CHECK(waited >= timeout - 1e-3, "(rank %d back %.3f s after the first call, before the %g s timeout)",
              ctx->rank, waited, timeout);
        CHECK(waited < fmax(HANG_FACTOR * timeout, HANG_MIN_S),
              "(rank %d back %.3f s after the first call: far past the %g s timeout)", ctx->rank, waited, timeout);
        CHECK_ST(ms_all_reduce(ctx->world, t, MS_OP_SUM), MS_ERR_STATE, tc->message);
        atomic_fetch_add(&tc->returned, 1);
    } else {
        /* Late to the call that failed: the same failure, then the comm is unusable. */
        while (atomic_load(&tc->returned) < 2) sched_yield();
        CHECK_ST(ms_all_reduce(ctx->world, t, MS_OP_SUM), MS_ERR_TIMEOUT, tc->message);
        CHECK_ST(ms_barrier(ctx->world), MS_ERR_STATE, "the comm is unusable after an earlier failure: ");
    }
    ms_tensor_release(t);
}

static void test_timeout(void) {
    timeout_case tc = {.message = "all_reduce on group [0 1 2] timed out after 0.3 s: rank 2 did not arrive "
                                  "(timeout_s=0.3 given to the world)"};
    run_ranks(3, 0.3, timeout_rank, &tc);

    /* The timeout from the environment, named in the message. */
    setenv("MOONSHARD_TIMEOUT", "0.25", 1);
    timeout_case env = {.message = "all_reduce on group [0 1 2] timed out after 0.25 s: rank 2 did not arrive "
                                   "(MOONSHARD_TIMEOUT=0.25)"};
    run_ranks(3, 0, timeout_rank, &env);

    ms_world *w = NULL;
    setenv("MOONSHARD_TIMEOUT", "soon", 1);
    CHECK_ST(ms_threads_world_new(&w, 2, 0), MS_ERR_ARG, "MOONSHARD_TIMEOUT='soon' is not a positive number");
    setenv("MOONSHARD_TIMEOUT", "-1", 1);
    CHECK_ST(ms_threads_world_new(&w, 2, -5), MS_ERR_ARG, "MOONSHARD_TIMEOUT='-1'");
    unsetenv("MOONSHARD_TIMEOUT");
    CHECK_OK(ms_threads_world_new(&w, 2, 0));
    CHECK(w && ms_world_timeout(w) == 300, "(the default timeout is 300 s)");
    ms_world_release(w);
}

/* ---------------------------------------------------------------- peers reported done */

typedef struct peer_case {
    atomic_int done; /* ranks that have reported themselves done */
} peer_case;

/* World of 4, 30 s timeout.  Ranks 2 (finished) and 3 (failed) leave without joining;
 * ranks 0 and 1 must fail at once on the world; rank 1 also on its group [1 3].  "At once"
 * is checked as "well before the timeout" (half of it, 15 s): that tells failing from the
 * reports apart from waiting out the timeout, and no scheduling delay reaches it. */
static void peer_rank(rank_ctx *ctx) {
    peer_case *pc = ctx->arg;
    if (ctx->rank >= 2) {
        CHECK_OK(ms_world_rank_done(ctx->w, ctx->rank, ctx->rank == 3));
        atomic_fetch_add(&pc->done, 1);
        return;
    }
    while (atomic_load(&pc->done) < 2) sched_yield();
    ms_tensor *t = tensor(MS_F32, 1, 4, 0), *out = tensor(MS_F32, 1, 8, 0);
    double t0 = now_s();
    CHECK_ST(ms_all_reduce(ctx->world, t, MS_OP_SUM), MS_ERR_PEER,
             "all_reduce on group [0 1 2 3]: rank 2 finished its script without joining all_reduce; rank 3 failed");
    if (ctx->rank == 1) {
        int members[2] = {1, 3};
        ms_comm *g = NULL;
        CHECK_OK(ms_comm_group(ctx->world, 2, members, &g));
        CHECK_ST(ms_all_gather(g, out, t), MS_ERR_PEER, "all_gather on group [1 3]: rank 3 failed");
        ms_comm_release(g);
    }
    double waited = now_s() - t0, timeout = ms_world_timeout(ctx->w);
    CHECK(waited < timeout / 2, "(rank %d waited %.3f s for ranks reported done, with a %g s timeout)", ctx->rank,
          waited, timeout);
    CHECK_ST(ms_barrier(ctx->world), MS_ERR_STATE, "rank 3 failed");
    ms_tensor_release(out);
    ms_tensor_release(t);
}

static void test_peer_done(void) {
    peer_case pc = {0};
    run_ranks(4, 30, peer_rank, &pc);
}

/* ---------------------------------------------------------------- argument errors */

/* Both ranks of a world of 2 make the same bad calls: each is refused on the calling rank
 * before it joins, so the comm stays usable for the good call at the end. */
static void args_rank(rank_ctx *ctx) {
    ms_comm *c = ctx->world;
    int r = ctx->rank;
    ms_tensor *f4 = tensor(MS_F32, 1, 4, 0), *f8 = tensor(MS_F32, 1, 8, 0), *f7 = tensor(MS_F32, 1, 7, 0);
    ms_tensor *f9 = tensor(MS_F32, 1, 9, 0), *b4 = tensor(MS_BF16, 1, 4, 0), *i4 = tensor(MS_I32, 1, 4, 0);
    ms_tensor *bool4 = tensor(MS_BOOL, 1, 4, 0), *f5 = tensor(MS_F32, 1, 5, 0), *m = NULL, *wide = NULL;
    int64_t shape[2] = {4, 6};
    CHECK_OK(ms_tensor_new(&m, 1, shape, MS_F32, MS_DEVICE_META, 0));
    CHECK_OK(ms_tensor_new(&wide, 2, shape, MS_F32, MS_DEVICE_CPU, 0));
    ms_tensor *strided = NULL, *shifted = rows(f8, 1, 4);
    CHECK_OK(ms_tensor_narrow(&strided, wide, 1, 0, 3));

    CHECK_ST(ms_all_gather(NULL, f8, f4), MS_ERR_ARG, "ms_all_gather: c is NULL");
    CHECK_ST(ms_all_reduce(c, NULL, MS_OP_SUM), MS_ERR_ARG, "ms_all_reduce: t is NULL");
    CHECK_ST(ms_all_reduce(c, m, MS_OP_SUM), MS_ERR_DEVICE,
             "all_reduce on group [0 1]: t [4] f32 is a meta tensor; meta tensors hold no data");
    CHECK_ST(ms_broadcast(c, strided, 0), MS_ERR_ARG,
             "broadcast on group [0 1]: t [4, 3] f32 is not contiguous (strides [6, 1])");
    CHECK_ST(ms_all_gather(c, f8, b4), MS_ERR_DTYPE,
             "all_gather on group [0 1]: out [8] f32 and in [4] bf16 must have the same dtype");
    CHECK_ST(ms_all_gather(c, f7, f4), MS_ERR_SHAPE,
             "all_gather on group [0 1]: out [7] f32 has 7 elements, expected 2 x 4 (group size x in's numel; in [4] f32)");
    CHECK_ST(ms_reduce_scatter(c, f4, f9, MS_OP_SUM), MS_ERR_SHAPE,
             "reduce_scatter on group [0 1]: in [9] f32 has 9 elements, expected 2 x 4");
    CHECK_ST(ms_all_gather(c, f8, shifted), MS_ERR_ARG,
             "all_gather on group [0 1]: in [4] f32 overlaps out [8] f32 but is not its slice for group rank");
    CHECK_ST(ms_reduce_scatter(c, shifted, f8, MS_OP_SUM), MS_ERR_ARG,
             "reduce_scatter on group [0 1]: out [4] f32 overlaps in [8] f32 but is not its slice");
    CHECK_ST(ms_all_reduce(c, i4, MS_OP_AVG), MS_ERR_DTYPE, "all_reduce on group [0 1]: avg needs a floating dtype, got i32");
    CHECK_ST(ms_all_reduce(c, bool4, MS_OP_SUM), MS_ERR_DTYPE, "bool reduces with max (logical or) and min (logical and) only");
    CHECK_ST(ms_all_reduce(c, bool4, MS_OP_AVG), MS_ERR_DTYPE, "avg needs a floating dtype, got bool");
    CHECK_ST(ms_all_reduce(c, f4, (ms_op)9), MS_ERR_ARG, "invalid reduction op 9 (expected sum, avg, max or min)");
    CHECK_ST(ms_broadcast(c, f4, 2), MS_ERR_ARG, "broadcast on group [0 1]: root 2 is not a group rank (0..1)");
    CHECK_ST(ms_all_to_all(c, f5, f5), MS_ERR_SHAPE, "must have equal numel divisible by the group size 2");
    CHECK_ST(ms_all_to_all(c, f8, f4), MS_ERR_SHAPE, "all_to_all on group [0 1]: out [8] f32 and in [4] f32");
    CHECK_ST(ms_all_to_all(c, f4, f4), MS_ERR_ARG, "overlap (all_to_all has no in-place form)");

    ms_comm *g = NULL;
    int backwards[2] = {1, 0}, outside[2] = {0, 5}, other[1] = {1 - r};
    CHECK_ST(ms_comm_group(c, 2, backwards, &g), MS_ERR_ARG, "comm_group [1 0]: world ranks must be strictly increasing");
    CHECK_ST(ms_comm_group(c, 2, outside, &g), MS_ERR_ARG, "comm_group [0 5]: rank 5 is out of range for a world of 2 ranks");
    char want[128];
    snprintf(want, sizeof want, "comm_group [%d]: the group does not contain the calling rank %d", 1 - r, r);
    CHECK_ST(ms_comm_group(c, 1, other, &g), MS_ERR_ARG, want);
    CHECK_ST(ms_comm_group(c, 0, other, &g), MS_ERR_ARG, "comm_group: 0 ranks asked for in a world of 2");
    CHECK_ST(ms_world_comm(ctx->w, 2, &g), MS_ERR_ARG, "world_comm: rank 2 is out of range for a world of 2 ranks");
    CHECK_ST(ms_world_rank_done(ctx->w, 7, 0), MS_ERR_ARG, "world_rank_done: rank 7 is out of range");

    /* Nothing above joined a collective: the comm still works and the ranks still agree. */
    float *d = ms_tensor_data(f4);
    for (int i = 0; i < 4; i++) d[i] = (float)(r + 1) * (float)i;
    CHECK_OK(ms_all_reduce(c, f4, MS_OP_SUM));
    CHECK(d[0] == 0 && d[1] == 3 && d[2] == 6 && d[3] == 9);

    ms_tensor *all[] = {f4, f8, f7, f9, b4, i4, bool4, f5, m, wide, strided, shifted};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ms_tensor_release(all[i]);
}

static void test_args(void) {
    ms_world *w = NULL;
    CHECK_ST(ms_threads_world_new(&w, 0, 1), MS_ERR_ARG, "threads world: nranks must be >= 1, got 0");
    run_ranks(2, 30, args_rank, NULL);
    run_ranks(4, 30, handles_rank, NULL);
    run_ranks(4, 30, tags_rank, NULL);
}

/* ---------------------------------------------------------------- point-to-point */

/* t against what group rank `from` filled in test `seed` (fill_input), element by element. */
static void check_from(sweep_stats *st, const char *what, const ms_tensor *t, uint32_t seed, int from) {
    ms_dtype dt = ms_tensor_dtype(t);
    unsigned char want[8];
    for (int64_t i = 0; i < ms_tensor_numel(t); i++) {
        input(dt, seed, from, i, want);
        compare(st, what, dt, i, elem(t, i), want);
    }
    st->calls++;
}

/* A tensor of `count` elements of dt filled as rank r's in test seed (a 2-D one of 3 x
 * count / 3 when 3 divides count, to carry a shape), and one to receive it into, filled
 * with 0xA5 bytes. */
static void p2p_pair(ms_dtype dt, int64_t count, uint32_t seed, int r, ms_tensor **out, ms_tensor **in) {
    bool rows3 = count && count % 3 == 0;
    *out = rows3 ? tensor(dt, 2, 3, count / 3) : tensor(dt, 1, count, 0);
    *in = rows3 ? tensor(dt, 2, 3, count / 3) : tensor(dt, 1, count, 0);
    fill_input(*out, seed, r);
    if (count) memset(ms_tensor_data(*in), 0xA5, (size_t)ms_tensor_nbytes(*in));
}

/* Every rank checks what it received against the sender's inputs, computed here:
 *   1. a ring in every dtype and size: each rank sends to the next and receives from the
 *      previous in one batch, the odd ranks listing the receive first;
 *   2. a pipeline of blocking calls: rank 0 sends, each other rank receives from the one
 *      before and sends it on;
 *   3. pairs (0 1) and (2 3): two tensors each way with tags 1 and 2, of different shapes
 *      and dtypes, the sends and receives interleaved differently on the two sides;
 *   4. every rank with every other in one batch, in an order of its own: one tensor sent to
 *      all of them, one received from each;
 *   5. on 4 ranks, the groups [0 2] and [1 3]: a blocking ping-pong by group ranks. */
static void p2p_values_rank(rank_ctx *ctx) {
    sweep_stats *st = &((sweep_stats *)ctx->arg)[ctx->rank];
    ms_comm *c = ctx->world;
    const int n = ms_comm_size(c), r = ctx->rank, next = (r + 1) % n, prev = (r + n - 1) % n;
    uint32_t seed = 7000;
    char what[160];
    for (int d = 0; d < MS_DTYPE_COUNT; d++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            ms_dtype dt = (ms_dtype)d;
            ms_tensor *out, *in;
            p2p_pair(dt, counts[k], ++seed, r, &out, &in);
            ms_p2p_op ops[2] = {{MS_P2P_SEND, out, next, 7}, {MS_P2P_RECV, in, prev, 7}};
            if (r % 2) ops[0] = ops[1], ops[1] = (ms_p2p_op){MS_P2P_SEND, out, next, 7};
            CHECK_OK(ms_batch_p2p(c, ops, 2));
            snprintf(what, sizeof what, "rank %d: ring of %d, %s x %lld", r, n, ms_dtype_name(dt), (long long)counts[k]);
            check_from(st, what, in, seed, prev);
            ms_tensor_release(out);
            ms_tensor_release(in);
        }

    ms_tensor *buf = tensor(MS_BF16, 2, 4, 33);
    snprintf(what, sizeof what, "rank %d: pipeline of %d", r, n);
    ++seed;
    if (r == 0) {
        fill_input(buf, seed, 0);
        CHECK_OK(ms_send(c, buf, 1, 3));
    } else {
        CHECK_OK(ms_recv(c, buf, r - 1, 3));
        check_from(st, what, buf, seed, 0);
        if (r + 1 < n) CHECK_OK(ms_send(c, buf, r + 1, 3));
    }
    ms_tensor_release(buf);

    const int partner = r ^ 1;
    seed += 2;
    if (partner < n) {
        ms_tensor *a = tensor(MS_F32, 2, 5, 7), *b = tensor(MS_I64, 1, 3, 0);  /* sent */
        ms_tensor *ga = tensor(MS_F32, 2, 5, 7), *gb = tensor(MS_I64, 1, 3, 0); /* received */
        fill_input(a, seed - 1, r);
        fill_input(b, seed, r);
        ms_p2p_op even[4] = {{MS_P2P_SEND, a, partner, 1}, {MS_P2P_SEND, b, partner, 2},
                             {MS_P2P_RECV, ga, partner, 1}, {MS_P2P_RECV, gb, partner, 2}};
        ms_p2p_op odd[4] = {{MS_P2P_RECV, ga, partner, 1}, {MS_P2P_SEND, a, partner, 1},
                            {MS_P2P_RECV, gb, partner, 2}, {MS_P2P_SEND, b, partner, 2}};
        CHECK_OK(ms_batch_p2p(c, r % 2 ? odd : even, 4));
        snprintf(what, sizeof what, "rank %d: exchange with %d, tag 1", r, partner);
        check_from(st, what, ga, seed - 1, partner);
        snprintf(what, sizeof what, "rank %d: exchange with %d, tag 2", r, partner);
        check_from(st, what, gb, seed, partner);
        ms_tensor *all[] = {a, b, ga, gb};
        for (int i = 0; i < 4; i++) ms_tensor_release(all[i]);
    }

    ++seed;
    ms_tensor *mine = tensor(MS_F16, 1, 2049, 0), *got[MAX_RANKS] = {0};
    ms_p2p_op ops[2 * MAX_RANKS];
    int nops = 0;
    fill_input(mine, seed, r);
    for (int i = 1; i < n; i++) { /* from r + i around, and the receives in the other direction */
        int to = (r + i) % n, from = (r + n - i) % n;
        got[from] = tensor(MS_F16, 1, 2049, 0);
        ops[nops++] = (ms_p2p_op){MS_P2P_SEND, mine, to, 0};
        ops[nops++] = (ms_p2p_op){MS_P2P_RECV, got[from], from, 0};
    }
    CHECK_OK(ms_batch_p2p(c, ops, nops));
    for (int j = 0; j < n; j++) {
        if (j == r) continue;
        snprintf(what, sizeof what, "rank %d: from %d of every peer", r, j);
        check_from(st, what, got[j], seed, j);
        ms_tensor_release(got[j]);
    }
    ms_tensor_release(mine);

    if (n == 4) {
        int members[2] = {r % 2, r % 2 + 2};
        ms_comm *g = NULL;
        CHECK_OK(ms_comm_group(c, 2, members, &g));
        ms_tensor *t = tensor(MS_I32, 1, 6, 0);
        const int gr = r / 2;
        seed++;
        if (gr == 0) {
            fill_input(t, seed, r);
            CHECK_OK(ms_send(g, t, 1, 4));
            CHECK_OK(ms_recv(g, t, 1, 5));
            snprintf(what, sizeof what, "rank %d: ping-pong on group [%d %d]", r, members[0], members[1]);
            check_from(st, what, t, seed + 1, members[1]);
        } else {
            CHECK_OK(ms_recv(g, t, 0, 4));
            snprintf(what, sizeof what, "rank %d: ping-pong on group [%d %d]", r, members[0], members[1]);
            check_from(st, what, t, seed, members[0]);
            fill_input(t, seed + 1, r);
            CHECK_OK(ms_send(g, t, 0, 5));
        }
        ms_tensor_release(t);
        ms_comm_release(g);
    }
}

static void test_p2p_values(void) {
    for (int n = 2; n <= MAX_RANKS; n++) {
        sweep_stats stats[MAX_RANKS] = {{0}};
        run_ranks(n, 60, p2p_values_rank, stats);
        for (int r = 0; r < n; r++) {
            CHECK(stats[r].calls > 0 && stats[r].wrong == 0, "(p2p on %d ranks, rank %d: %ld wrong of %ld)", n, r,
                  stats[r].wrong, stats[r].elements);
            printf("p2p on %d ranks, rank %d: %ld tensors received, %ld elements checked, %ld wrong\n", n, r,
                   stats[r].calls, stats[r].elements, stats[r].wrong);
        }
    }
}

/* One side of a send or receive in the mismatch cases. */
typedef struct p2p_side {
    ms_dtype dtype;
    int64_t d0, d1; /* d1 = 0: one dim */
    int tag;
} p2p_side;

typedef enum { SEND_RECV, TWO_SENDS, BOTH_SEND } p2p_shape;

typedef struct p2p_mismatch_case {
    const char *name;
    p2p_shape shape;
    int sender;           /* the group rank that sends (SEND_RECV, TWO_SENDS) */
    p2p_side send, recv;
    const char *message;  /* the whole message, on both ranks */
} p2p_mismatch_case;

#define P2P_PAIR "send/recv on group [0 1] between rank 0 and rank 1: the sides disagree: "
static const p2p_mismatch_case p2p_mismatch_cases[] = {
    {"dtype", SEND_RECV, 0, {MS_F32, 4, 0, 0}, {MS_BF16, 4, 0, 0},
     P2P_PAIR "tensor 1 of 1 from rank 0 to rank 1: sent as tag 0 [4] f32, received as tag 0 [4] bf16 (the dtype differs)"},
    {"shape", SEND_RECV, 0, {MS_F32, 2, 3, 5}, {MS_F32, 3, 2, 5},
     P2P_PAIR "tensor 1 of 1 from rank 0 to rank 1: sent as tag 5 [2, 3] f32, received as tag 5 [3, 2] f32 (the shape differs)"},
    {"tag", SEND_RECV, 0, {MS_F32, 4, 0, 1}, {MS_F32, 4, 0, 2},
     P2P_PAIR "tensor 1 of 1 from rank 0 to rank 1: sent as tag 1 [4] f32, received as tag 2 [4] f32 (the tag differs)"},
    {"all three, sent by the higher rank", SEND_RECV, 1, {MS_F32, 4, 0, 1}, {MS_I32, 2, 2, 2},
     P2P_PAIR "tensor 1 of 1 from rank 1 to rank 0: sent as tag 1 [4] f32, received as tag 2 [2, 2] i32 (the tag, "
              "shape and dtype differ)"},
    {"count", TWO_SENDS, 0, {MS_F32, 4, 0, 0}, {MS_F32, 4, 0, 0},
     P2P_PAIR "rank 0 sends 2 tensors to rank 1, which receives 1 from it"},
    {"both send", BOTH_SEND, 0, {MS_F32, 4, 0, 0}, {MS_F32, 4, 0, 0},
     P2P_PAIR "rank 0 sends 1 tensor to rank 1, which receives 0 from it; rank 1 sends 1 tensor to rank 0, which "
              "receives 0 from it (both send first: post each rank's send and receive in one batch)"},
};

static ms_tensor *side_tensor(const p2p_side *s) {
    return s->d1 ? tensor(s->dtype, 2, s->d0, s->d1) : tensor(s->dtype, 1, s->d0, 0);
}

/* Both ranks get the case's message exactly, the receiving rank's tensor keeps its values,
 * and the comm is unusable afterwards. */
static void p2p_mismatch_rank(rank_ctx *ctx) {
    const p2p_mismatch_case *mc = ctx->arg;
    const int r = ctx->rank, peer = 1 - r;
    const bool sends = mc->shape == BOTH_SEND || r == mc->sender;
    ms_tensor *t = side_tensor(sends ? &mc->send : &mc->recv);
    fill_input(t, 11, r);
    ms_status st;
    if (mc->shape == TWO_SENDS && sends) {
        ms_p2p_op ops[2] = {{MS_P2P_SEND, t, peer, mc->send.tag}, {MS_P2P_SEND, t, peer, mc->send.tag + 1}};
        st = ms_batch_p2p(ctx->world, ops, 2);
    } else {
        st = sends ? ms_send(ctx->world, t, peer, mc->send.tag) : ms_recv(ctx->world, t, peer, mc->recv.tag);
    }
    CHECK_ST(st, MS_ERR_MISMATCH, mc->message);
    CHECK(!strcmp(ms_last_error(), mc->message), "(case %s rank %d: the message is exactly \"%s\", got \"%s\")",
          mc->name, r, mc->message, ms_last_error());
    unsigned char want[8];
    int untouched = 1;
    for (int64_t i = 0; i < ms_tensor_numel(t); i++) {
        input(ms_tensor_dtype(t), 11, r, i, want);
        untouched &= !memcmp(elem(t, i), want, (size_t)ms_dtype_size(ms_tensor_dtype(t)));
    }
    CHECK(untouched, "(case %s rank %d: a mismatch moves nothing)", mc->name, r);
    CHECK_ST(ms_send(ctx->world, t, peer, 0), MS_ERR_STATE, mc->message);
    ms_tensor_release(t);
}

/* Rank 1 of a failure case: receives t from rank 0 beside a pair that fails, and gets what
 * rank 0 filled in test seed. */
static void recv_beside(ms_comm *c, ms_tensor *t, uint32_t seed, const char *what) {
    CHECK_OK(ms_recv(c, t, 0, 0));
    sweep_stats st = {0};
    check_from(&st, what, t, seed, 0);
    CHECK(st.wrong == 0 && st.elements == ms_tensor_numel(t));
}

/* World of 3: rank 0 sends [4] f32 to rank 1, which receives it so, and to rank 2, which
 * receives [4] bf16: ranks 0 and 2 get the mismatch, rank 1 its tensor. */
static void p2p_one_pair_mismatch_rank(rank_ctx *ctx) {
    static const char *message = "send/recv on group [0 1 2] between rank 0 and rank 2: the sides disagree: tensor 1 "
                                 "of 1 from rank 0 to rank 2: sent as tag 0 [4] f32, received as tag 0 [4] bf16 (the "
                                 "dtype differs)";
    ms_tensor *t = tensor(ctx->rank == 2 ? MS_BF16 : MS_F32, 1, 4, 0);
    if (ctx->rank == 0) {
        fill_input(t, 12, 0);
        ms_p2p_op ops[2] = {{MS_P2P_SEND, t, 2, 0}, {MS_P2P_SEND, t, 1, 0}};
        CHECK_ST(ms_batch_p2p(ctx->world, ops, 2), MS_ERR_MISMATCH, message);
    } else if (ctx->rank == 1) {
        recv_beside(ctx->world, t, 12, "rank 1: beside a mismatched pair");
    } else {
        CHECK_ST(ms_recv(ctx->world, t, 0, 0), MS_ERR_MISMATCH, message);
    }
    ms_tensor_release(t);
}

/* The same in group [1 3] of a world of 4, named by world and group rank. */
static void p2p_group_mismatch_rank(rank_ctx *ctx) {
    static const char *message = "send/recv on group [1 3] between rank 1 (group rank 0) and rank 3 (group rank 1): the "
                                 "sides disagree: tensor 1 of 1 from rank 3 (group rank 1) to rank 1 (group rank 0): "
                                 "sent as tag 9 [4] f32, received as tag 9 [5] f32 (the shape differs)";
    if (ctx->rank % 2 == 0) return;
    ms_comm *g = NULL;
    CHECK_OK(ms_comm_group(ctx->world, 2, (int[]){1, 3}, &g));
    ms_tensor *t = tensor(MS_F32, 1, ctx->rank == 1 ? 5 : 4, 0);
    CHECK_ST(ctx->rank == 1 ? ms_recv(g, t, 1, 9) : ms_send(g, t, 0, 9), MS_ERR_MISMATCH, message);
    ms_tensor_release(t);
    ms_comm_release(g);
}

static void test_p2p_mismatch(void) {
    for (size_t i = 0; i < sizeof p2p_mismatch_cases / sizeof p2p_mismatch_cases[0]; i++)
        run_ranks(2, 30, p2p_mismatch_rank, (void *)&p2p_mismatch_cases[i]);
    run_ranks(3, 30, p2p_one_pair_mismatch_rank, NULL);
    run_ranks(4, 30, p2p_group_mismatch_rank, NULL);
}

typedef struct p2p_timeout_case {
    atomic_int returned; /* rank 0 is back from its batch */
    double called;       /* when rank 0 called it */
} p2p_timeout_case;

/* World of 3, 0.3 s: rank 0 sends to ranks 1 and 2 in one batch; rank 1 receives at once
 * (and gets its tensor), rank 2 only after rank 0 gave up: rank 0 times out naming rank 2,
 * not before the timeout, and rank 2 gets the same failure, late. */
static void p2p_timeout_rank(rank_ctx *ctx) {
    static const char *message = "send/recv on group [0 1 2] between rank 0 and rank 2 timed out after 0.3 s: rank 2 "
                                 "did not arrive (timeout_s=0.3 given to the world)";
    p2p_timeout_case *tc = ctx->arg;
    ms_tensor *t = tensor(MS_F32, 1, 5, 0);
    double timeout = ms_world_timeout(ctx->w);
    if (ctx->rank == 0) {
        fill_input(t, 13, 0);
        ms_p2p_op ops[2] = {{MS_P2P_SEND, t, 1, 0}, {MS_P2P_SEND, t, 2, 0}};
        double t0 = now_s();
        CHECK_ST(ms_batch_p2p(ctx->world, ops, 2), MS_ERR_TIMEOUT, message);
        double waited = now_s() - t0;
        CHECK(waited >= timeout - 1e-3, "(rank 0 back after %.3f s, before the %g s timeout)", waited, timeout);
        CHECK(waited < fmax(HANG_FACTOR * timeout, HANG_MIN_S), "(rank 0 back after %.3f s)", waited);
        CHECK_ST(ms_send(ctx->world, t, 1, 0), MS_ERR_STATE, message);
        atomic_store(&tc->returned, 1);
    } else if (ctx->rank == 1) {
        recv_beside(ctx->world, t, 13, "rank 1: beside a peer that timed out");
    } else {
        while (!atomic_load(&tc->returned)) sched_yield();
        CHECK_ST(ms_recv(ctx->world, t, 0, 0), MS_ERR_TIMEOUT, message);
        CHECK_ST(ms_recv(ctx->world, t, 0, 0), MS_ERR_STATE, "the comm is unusable after an earlier failure: ");
    }
    ms_tensor_release(t);
}

typedef struct p2p_peer_case {
    atomic_int done;
} p2p_peer_case;

/* World of 3, 30 s: rank 2 finishes and rank 1 fails without joining; rank 0's receive from
 * rank 2 and, on a fresh group, its send to rank 1 fail at once (well before the timeout). */
static void p2p_peer_rank(rank_ctx *ctx) {
    p2p_peer_case *pc = ctx->arg;
    if (ctx->rank > 0) {
        CHECK_OK(ms_world_rank_done(ctx->w, ctx->rank, ctx->rank == 1));
        atomic_fetch_add(&pc->done, 1);
        return;
    }
    while (atomic_load(&pc->done) < 2) sched_yield();
    ms_tensor *t = tensor(MS_F32, 1, 4, 0);
    ms_comm *g = NULL;
    double t0 = now_s();
    CHECK_ST(ms_recv(ctx->world, t, 2, 0), MS_ERR_PEER,
             "send/recv on group [0 1 2] between rank 0 and rank 2: rank 2 finished its script without joining "
             "send/recv");
    CHECK_OK(ms_comm_group(ctx->world, 2, (int[]){0, 1}, &g));
    CHECK_ST(ms_send(g, t, 1, 0), MS_ERR_PEER, "send/recv on group [0 1] between rank 0 and rank 1: rank 1 failed");
    double waited = now_s() - t0;
    CHECK(waited < ms_world_timeout(ctx->w) / 2, "(rank 0 waited %.3f s for peers reported done)", waited);
    ms_comm_release(g);
    ms_tensor_release(t);
}

static void test_p2p_failures(void) {
    p2p_timeout_case tc = {0};
    run_ranks(3, 0.3, p2p_timeout_rank, &tc);
    p2p_peer_case pc = {0};
    run_ranks(3, 30, p2p_peer_rank, &pc);
}

/* Both ranks of a world of 2 make the same bad calls, each refused before the rank joins,
 * then a good exchange. */
static void p2p_args_rank(rank_ctx *ctx) {
    ms_comm *c = ctx->world;
    const int r = ctx->rank, peer = 1 - r;
    ms_tensor *f4 = tensor(MS_F32, 1, 4, 0), *f8 = tensor(MS_F32, 1, 8, 0), *m = NULL, *wide = NULL, *strided = NULL;
    ms_tensor *inside = rows(f8, 2, 4);
    int64_t shape[2] = {4, 6};
    CHECK_OK(ms_tensor_new(&m, 1, shape, MS_F32, MS_DEVICE_META, 0));
    CHECK_OK(ms_tensor_new(&wide, 2, shape, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_tensor_narrow(&strided, wide, 1, 0, 3));
    char want[160];
    CHECK_ST(ms_send(c, f4, 2, 0), MS_ERR_ARG, "send on group [0 1]: peer 2 is not a group rank (0..1)");
    CHECK_ST(ms_recv(c, f4, -1, 0), MS_ERR_ARG, "recv on group [0 1]: peer -1 is not a group rank (0..1)");
    snprintf(want, sizeof want, "send on group [0 1]: peer %d is this rank (a rank cannot send to itself)", r);
    CHECK_ST(ms_send(c, f4, r, 0), MS_ERR_ARG, want);
    snprintf(want, sizeof want, "recv on group [0 1]: peer %d is this rank (a rank cannot receive from itself)", r);
    CHECK_ST(ms_recv(c, f4, r, 0), MS_ERR_ARG, want);
    CHECK_ST(ms_recv(c, f4, peer, -3), MS_ERR_ARG, "recv on group [0 1]: tag -3 is negative");
    CHECK_ST(ms_send(c, m, peer, 0), MS_ERR_DEVICE, "send on group [0 1]: t [4] f32 is a meta tensor");
    CHECK_ST(ms_recv(c, strided, peer, 0), MS_ERR_ARG, "recv on group [0 1]: t [4, 3] f32 is not contiguous");
    ms_p2p_op bad_kind[1] = {{(ms_p2p_kind)7, f4, peer, 0}};
    CHECK_ST(ms_batch_p2p(c, bad_kind, 1), MS_ERR_ARG,
             "batch_p2p on group [0 1]: ops[0]: invalid op 7 (expected MS_P2P_SEND or MS_P2P_RECV)");
    ms_p2p_op no_tensor[2] = {{MS_P2P_SEND, f4, peer, 0}, {MS_P2P_RECV, NULL, peer, 0}};
    CHECK_ST(ms_batch_p2p(c, no_tensor, 2), MS_ERR_ARG, "batch_p2p on group [0 1]: ops[1].t is NULL");
    ms_p2p_op overlap[2] = {{MS_P2P_SEND, f8, peer, 0}, {MS_P2P_RECV, inside, peer, 0}};
    CHECK_ST(ms_batch_p2p(c, overlap, 2), MS_ERR_ARG,
             "batch_p2p on group [0 1]: ops[1].t [4] f32, received into, overlaps ops[0].t [8] f32");
    CHECK_ST(ms_batch_p2p(c, overlap, -1), MS_ERR_ARG, "batch_p2p on group [0 1]: n -1 is negative");
    CHECK_OK(ms_batch_p2p(c, NULL, 0)); /* nothing to do */

    /* Nothing above joined: the comm still works.  The same tensor may be sent twice. */
    fill_input(f4, 14, r);
    ms_p2p_op twice[4] = {{MS_P2P_SEND, f4, peer, 0}, {MS_P2P_SEND, f4, peer, 1}, {MS_P2P_RECV, inside, peer, 0},
                          {MS_P2P_RECV, wide, peer, 1}};
    ms_tensor *flat = NULL;
    CHECK_OK(ms_tensor_view(&flat, wide, 1, (int64_t[]){24}));
    ms_tensor *part = rows(flat, 0, 4);
    twice[3].t = part;
    CHECK_OK(ms_batch_p2p(c, twice, 4));
    sweep_stats st = {0};
    check_from(&st, "the first copy", inside, 14, peer);
    check_from(&st, "the second copy", part, 14, peer);
    CHECK(st.wrong == 0 && st.elements == 8);
    ms_tensor *all[] = {f4, f8, m, wide, strided, inside, flat, part};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ms_tensor_release(all[i]);
}

static void test_p2p(void) {
    run_ranks(2, 30, p2p_args_rank, NULL);
    test_p2p_values();
    test_p2p_mismatch();
    test_p2p_failures();
}

/* ---------------------------------------------------------------- ms__async_run */

typedef struct run_probe {
    ms_world *w;
    pthread_t thread, nested_thread; /* where the job and the job it ran ran */
    atomic_int queued_done;          /* the job queued before: finished first */
    bool saw_queued_done;
} run_probe;

static ms_status slow_job(void *p) {
    run_probe *r = p;
    nanosleep(&(struct timespec){0, 50000000}, NULL);
    atomic_store(&r->queued_done, 1);
    return MS_OK;
}

static ms_status nested_job(void *p) {
    ((run_probe *)p)->nested_thread = pthread_self();
    return MS_OK;
}

static ms_status outer_job(void *p) {
    run_probe *r = p;
    r->thread = pthread_self();
    r->saw_queued_done = atomic_load(&r->queued_done);
    return ms__async_run(r->w, 0, nested_job, r); /* from the worker itself: inline, no deadlock */
}

static ms_status failing_job(void *p) {
    (void)p;
    return ms__fail(MS_ERR_PEER, "the job failed on purpose");
}

static void test_async_run(void) {
    run_probe r = {0};
    CHECK_OK(ms_threads_world_new(&r.w, 2, 5));
    ms_ticket first;
    CHECK_OK(ms__async_submit(r.w, 0, &first, slow_job, &r));
    CHECK_OK(ms__async_run(r.w, 0, outer_job, &r));
    CHECK_OK(ms__async_wait(&first));
    CHECK(!pthread_equal(r.thread, pthread_self()), "(the job ran on the calling thread)");
    CHECK(pthread_equal(r.nested_thread, r.thread), "(the nested job ran on another thread)");
    CHECK(r.saw_queued_done, "(the job ran before the one queued ahead of it finished)");
    CHECK_ST(ms__async_run(r.w, 1, failing_job, NULL), MS_ERR_PEER, "the job failed on purpose");
    ms_world_release(r.w);
}

int main(void) {
    double t0 = now_s();
    test_async_run();
    test_args();
    test_mismatch();
    test_timeout();
    test_peer_done();
    test_p2p();
    test_sweep();
    printf("test_comm: %d passed, %d failed in %.1f s\n", atomic_load(&passed), atomic_load(&failed), now_s() - t0);
    return atomic_load(&failed) ? 1 : 0;
}
