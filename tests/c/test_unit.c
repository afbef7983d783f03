/*
 * test_unit.c: shard units (unit.c, unit_cache.c, unit_adamw.c; comm_async.c) on ranks run
 * as threads.
 *
 * Every rank builds the same units over a 1-D mesh of W = 1, 2, 3, 4 ranks or an HSDP 2x2
 * mesh (replicate 2 x shard 2), with parameters of uneven dim-0 sizes (one smaller than W,
 * so some ranks hold 0 rows), a dim-1 sharded one, a frozen one and a 3-d one, under several
 * mixed-precision policies.  Parameter values are arbitrary floats, so the gather dtype's
 * rounding shows; gradients are multiples of 1/16 written per data-parallel rank, so the
 * sums are exact and every difference comes from the documented roundings.  References
 * are computed here in double, with the layout math (torch.chunk) written out again, and
 * rounded with ms_cast as the dtypes of each stage dictate.  Checked on every rank: the
 * unsharded parameters bit for bit, the gradient shards after one and two steps, gradient
 * accumulation with sync off, the reshard modes keep, full and k, AdamW with fp32 master weights,
 * the gradient norm, the collective records, the bytes held, state errors by message and a
 * failed collective.  Units of one parameter (in place where the layout allows) must give
 * the same bits as the parameter inside the full unit; the rank's buffer cache must serve a
 * steady-state step without allocating, be shared by the units of a rank and never reuse a
 * tensor a caller still holds; ms_unit_param_offset must place every shard as torch.chunk
 * does for W = 1..8.  Max differences are printed per scenario.
 */
#include "check.h"
#include "refdata.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- harness (thread-safe) */

/* check.h counts in plain ints: ranks take this lock around every check.  The checked
 * call runs before the lock is taken (it may be a collective). */
static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;

#define LOCKED(...)                          \
    do {                                     \
        pthread_mutex_lock(&check_lock);     \
        __VA_ARGS__;                         \
        pthread_mutex_unlock(&check_lock);   \
    } while (0)

#define R_CHECK(cond)                                                  \
    do {                                                               \
        const bool ok_ = (cond);                                       \
        LOCKED(CHECK(ok_); if (!ok_) fprintf(stderr, "  %s\n", #cond)); \
    } while (0)

#define R_OK(call)                                                      \
    do {                                                                \
        const ms_status s_ = (call);                                    \
        LOCKED(CHECK_OK(s_); if (s_) fprintf(stderr, "  %s\n", #call)); \
    } while (0)

#define R_ERR(call, want, needle)                                                   \
    do {                                                                            \
        const ms_status s_ = (call);                                                \
        LOCKED(CHECK_ERR(s_, want, needle); if (s_ != (want)) fprintf(stderr, "  %s\n", #call)); \
    } while (0)

enum { MAX_RANKS = 8 };

typedef struct rank_ctx {
    int rank, nranks;
    ms_comm *world;  /* this rank's world comm */
    const void *arg; /* the scenario */
} rank_ctx;

typedef void (*rank_fn)(rank_ctx *);

typedef struct rank_thread {
    ms_world *w;
    rank_ctx ctx;
    rank_fn fn;
} rank_thread;

static void *rank_main(void *p) {
    rank_thread *t = p;
    R_OK(ms_world_comm(t->w, t->ctx.rank, &t->ctx.world));
    t->fn(&t->ctx);
    ms_comm_release(t->ctx.world);
    return NULL;
}

/* Runs fn on n rank threads of a fresh threads world. */
static void run_ranks(int n, rank_fn fn, const void *arg) {
    ms_world *w = NULL;
    CHECK_OK(ms_threads_world_new(&w, n, 60));
    if (!w) return;
    rank_thread th[MAX_RANKS];
    pthread_t tid[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        th[r] = (rank_thread){.w = w, .ctx = {.rank = r, .nranks = n, .arg = arg}, .fn = fn};
        pthread_create(&tid[r], NULL, rank_main, &th[r]);
    }
    for (int r = 0; r < n; r++) pthread_join(tid[r], NULL);
    ms_world_release(w);
}

/* The largest v over the world, printed by rank 0 with `what`. */
static double world_max(const rank_ctx *c, double v) {
    ms_tensor *t = NULL;
    R_OK(ms_tensor_wrap(&t, &v, 1, (int64_t[]){1}, MS_F64));
    R_OK(ms_all_reduce(c->world, t, MS_OP_MAX));
    ms_tensor_release(t);
    return v;
}

static double world_sum(const rank_ctx *c, double v) {
    ms_tensor *t = NULL;
    R_OK(ms_tensor_wrap(&t, &v, 1, (int64_t[]){1}, MS_F64));
    R_OK(ms_all_reduce(c->world, t, MS_OP_SUM));
    ms_tensor_release(t);
    return v;
}

/* ---------------------------------------------------------------- meshes */

/* world = R x W ranks, row-major: rank = a*W + b with a the replica, b the shard rank. */
typedef struct layout {
    int W, R;
} layout;

/* This rank's shard group and (HSDP) replicate group. */
static void layout_comms(const rank_ctx *c, const layout *l, ms_comm **shard, ms_comm **replicate) {
    *replicate = NULL;
    if (l->R == 1) {
        ms_comm_retain(c->world);
        *shard = c->world;
        return;
    }
    int a = c->rank / l->W, b = c->rank % l->W, sr[MAX_RANKS], rr[MAX_RANKS];
    for (int i = 0; i < l->W; i++) sr[i] = a * l->W + i;
    for (int i = 0; i < l->R; i++) rr[i] = i * l->W + b;
    R_OK(ms_comm_group(c->world, l->W, sr, shard));
    R_OK(ms_comm_group(c->world, l->R, rr, replicate));
}

/* ---------------------------------------------------------------- parameters and values */

typedef struct param_spec {
    const char *fqn;
    int ndim;
    int64_t shape[3];
    int dim; /* as given to add_param; normalised by spec_dim */
    int requires_grad;
} param_spec;

static const param_spec specs[] = {
    {"layers.0.w", 2, {7, 5}, 0, 1},     /* uneven for W = 2, 3, 4 */
    {"layers.0.b", 1, {2}, 0, 1},        /* smaller than W = 3, 4: ranks with 0 rows */
    {"layers.0.proj", 2, {3, 12}, -1, 1}, /* Shard(1), given as -1 */
    {"layers.0.frozen", 2, {5, 3}, 0, 0},
    {"layers.0.conv", 3, {4, 3, 2}, 0, 1},
    {"layers.0.gain", 2, {1, 12}, 1, 1}, /* Shard(1) behind a dim of size 1 */
};
enum { NSPEC = sizeof specs / sizeof specs[0] };

static int spec_dim(const param_spec *p) { return p->dim < 0 ? p->dim + p->ndim : p->dim; }

static int64_t spec_numel(const param_spec *p) {
    int64_t n = 1;
    for (int d = 0; d < p->ndim; d++) n *= p->shape[d];
    return n;
}

/* torch.chunk, written out: rows [*off, *off + *len) of a dim of size n for rank q of W. */
static void chunk(int64_t n, int W, int q, int64_t *len, int64_t *off) {
    int64_t c = (n + W - 1) / W, start = c * q;
    *off = start < n ? start : n;
    *len = start < n ? (n - start < c ? n - start : c) : 0;
}

/* Rows of the padded shard: ceil(n/W) on dim 0, n/W on another dim. */
static int64_t padded_rows(const param_spec *p, int W) {
    int64_t n = p->shape[spec_dim(p)];
    return spec_dim(p) == 0 ? (n + W - 1) / W : n / W;
}

static int64_t padded_numel(const param_spec *p, int W) {
    return spec_numel(p) / p->shape[spec_dim(p)] * padded_rows(p, W);
}

/* Global flat index of element l (row-major) of rank q's block of p. */
static int64_t global_index(const param_spec *p, int W, int q, int64_t l) {
    int64_t len, off, idx = 0, stride = 1;
    chunk(p->shape[spec_dim(p)], W, q, &len, &off);
    for (int d = p->ndim - 1; d >= 0; d--) {
        int64_t size = d == spec_dim(p) ? len : p->shape[d];
        int64_t i = l % size + (d == spec_dim(p) ? off : 0);
        l /= size;
        idx += i * stride;
        stride *= p->shape[d];
    }
    return idx;
}

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Initial value of element i of parameter pid: an arbitrary float. */
static double param_value(int pid, int64_t i) { return (float)(3 * sin(1.0 + 0.37 * pid + 0.113 * (double)i)); }

/* Gradient that data-parallel rank r computes in step `step`: a multiple of 1/16 in
 * [-2, 2), exact in every float dtype used here, with exact sums. */
static double grad_value(int step, int r, int pid, int64_t i) {
    uint64_t h = mix(((uint64_t)step << 48) ^ ((uint64_t)r << 40) ^ ((uint64_t)pid << 32) ^ (uint64_t)i);
    return (double)((int)(h % 64) - 32) / 16.0;
}

/* v rounded to dtype with the core's casts (f64 -> 16-bit goes through f32). */
static double round_as(ms_dtype dt, double v) {
    unsigned char b[8];
    double r;
    ms_cast(b, dt, &v, MS_F64, 1);
    ms_cast(&r, MS_F64, b, dt, 1);
    return r;
}

/* The spacing of dtype's values at x. */
static double ulp_of(ms_dtype dt, double x) {
    int mant = dt == MS_F16 ? 10 : dt == MS_BF16 ? 7 : dt == MS_F64 ? 52 : 23, e;
    frexp(x == 0 ? 1e-30 : x, &e);
    return ldexp(1, e - 1 - mant);
}

/* A new tensor of p's global shape holding f(pid, i) as f64. */
static ms_tensor *full_of(int pid, double (*f)(int, int64_t)) {
    const param_spec *p = &specs[pid];
    ms_tensor *t = NULL;
    R_OK(ms_tensor_new(&t, p->ndim, p->shape, MS_F64, MS_DEVICE_CPU, 0));
    double *d = ms_tensor_data(t);
    for (int64_t i = 0; d && i < spec_numel(p); i++) d[i] = f(pid, i);
    return t;
}

/* t (any dtype, any strides) as a new contiguous f64 copy. */
static ms_tensor *as_f64(const ms_tensor *t) {
    ms_tensor *r = NULL;
    R_OK(ms_tensor_to(&r, t, MS_F64));
    return r;
}

/* ---------------------------------------------------------------- policies */

typedef struct policy {
    const char *name;
    ms_dtype stored;
    int param_dtype, reduce_dtype; /* -1 = unset */
    double factor;                 /* custom gradient divide factor, 0 = default */
} policy;

static const policy policies[] = {
    {"f32 stored, bf16 gather, f32 reduce", MS_F32, MS_BF16, MS_F32, 0},
    {"bf16 stored, f32 reduce", MS_BF16, -1, MS_F32, 0},
    {"f32 stored, f16 reduce (pre/post)", MS_F32, -1, MS_F16, 0},
    {"f32, custom divide factor 8", MS_F32, -1, -1, 8},
    {"f32 stored, bf16 gather and reduce", MS_F32, MS_BF16, MS_BF16, 0},
    {"f32 stored, f16 reduce, factor 8", MS_F32, MS_F16, MS_F16, 8},
    {"f32 stored, bf16 gather, reduce unset (f32: PyTorch 2.15)", MS_F32, MS_BF16, -1, 0},
};
enum { NPOLICY = sizeof policies / sizeof policies[0] };

/* FSDP2's mixed-precision rules (PyTorch 2.15), written out: reduce_dtype unset reduces in
 * the stored dtype. */
static ms_dtype gather_dtype(const policy *pol) {
    return pol->param_dtype >= 0 && pol->param_dtype != (int)pol->stored ? (ms_dtype)pol->param_dtype : pol->stored;
}
static ms_dtype reduce_dtype(const policy *pol) {
    return pol->reduce_dtype >= 0 ? (ms_dtype)pol->reduce_dtype : pol->stored;
}

typedef struct scenario {
    layout l;
    const policy *pol;
} scenario;

/* A unit of the n specs from `first` under pol (unit parameter i is spec first + i), loaded
 * with param_value. */
static ms_unit *build_unit_of(const char *name, const policy *pol, ms_comm *shard, ms_comm *replicate, int reshard,
                              int first, int n) {
    ms_unit *u = NULL;
    R_OK(ms_unit_new(&u, name, shard, replicate, pol->param_dtype, pol->reduce_dtype, reshard));
    if (!u) return NULL;
    for (int i = first; i < first + n; i++)
        R_OK(ms_unit_add_param(u, specs[i].fqn, specs[i].ndim, specs[i].shape, pol->stored, specs[i].dim,
                               specs[i].requires_grad));
    R_OK(ms_unit_finalize(u));
    if (pol->factor) R_OK(ms_unit_set_gradient_divide_factor(u, pol->factor));
    for (int i = first; i < first + n; i++) {
        ms_tensor *full = full_of(i, param_value);
        R_OK(ms_unit_load_full(u, i - first, full));
        ms_tensor_release(full);
    }
    return u;
}

/* A unit of all specs. */
static ms_unit *build_unit(const char *name, const policy *pol, ms_comm *shard, ms_comm *replicate, int reshard) {
    return build_unit_of(name, pol, shard, replicate, reshard, 0, NSPEC);
}

/* ---------------------------------------------------------------- checks */

/* The unsharded parameters against the stored values rounded to the gather dtype, bit for
 * bit (f64 holds every value of the narrower dtypes exactly); returns the max |diff|. */
static double check_params_full(ms_unit *u, const policy *pol) {
    double worst = 0;
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *full = ms_unit_param_full(u, i);
        R_CHECK(full && ms_tensor_dtype(full) == gather_dtype(pol) && ms_tensor_ndim(full) == specs[i].ndim);
        if (!full) continue;
        ms_tensor *f = as_f64(full);
        const double *d = ms_tensor_data(f);
        int64_t wrong = 0;
        for (int64_t e = 0; e < spec_numel(&specs[i]); e++) {
            double want = round_as(gather_dtype(pol), round_as(pol->stored, param_value(i, e)));
            wrong += d[e] != want;
            worst = fmax(worst, fabs(d[e] - want));
        }
        R_CHECK(wrong == 0);
        ms_tensor_release(f);
    }
    return worst;
}

/* Writes data-parallel rank r's gradient of `step` of spec pid into unit parameter ui. */
static void write_grad(ms_unit *u, int ui, int pid, int step, int r) {
    ms_tensor *g = ms_unit_grad_full(u, ui);
    R_CHECK(g != NULL);
    if (!g) return;
    ms_tensor *src = NULL;
    R_OK(ms_tensor_new(&src, specs[pid].ndim, specs[pid].shape, MS_F64, MS_DEVICE_CPU, 0));
    double *d = ms_tensor_data(src);
    for (int64_t e = 0; d && e < spec_numel(&specs[pid]); e++) d[e] = grad_value(step, r, pid, e);
    R_OK(ms_tensor_copy(g, src));
    ms_tensor_release(src);
}

/* Writes data-parallel rank r's gradients of `step` into the trainable parameters. */
static void write_grads(ms_unit *u, int step, int r) {
    for (int i = 0; i < NSPEC; i++)
        if (specs[i].requires_grad) write_grad(u, i, i, step, r);
}

/* Element e of parameter pid's gradient after reducing the gradients of `steps` (summed
 * per rank: several backwards accumulated before one reduce) over the N data-parallel
 * ranks: the mean (or sum / custom factor) in the reduce dtype, cast to the stored dtype. */
static double reduced_grad(const policy *pol, int N, const int *steps, int nsteps, int pid, int64_t e) {
    double sum = 0;
    for (int r = 0; r < N; r++)
        for (int s = 0; s < nsteps; s++) sum += grad_value(steps[s], r, pid, e);
    return round_as(pol->stored, round_as(reduce_dtype(pol), sum / (pol->factor ? pol->factor : N)));
}

/* This rank's gradient shards against want(pid, e); differences within tol_ulps of the
 * reduce dtype count as right.  Returns the max |diff|. */
typedef double (*grad_ref)(const scenario *sc, int pid, int64_t e);

static double check_grads(ms_unit *u, const scenario *sc, int shard_rank, grad_ref want, double tol_ulps) {
    double worst = 0;
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *g = ms_unit_grad_shard(u, i);
        if (!specs[i].requires_grad) {
            R_CHECK(g == NULL);
            continue;
        }
        R_CHECK(g && ms_tensor_dtype(g) == sc->pol->stored);
        if (!g) continue;
        ms_tensor *f = as_f64(g);
        const double *d = ms_tensor_data(f);
        int64_t wrong = 0, n = ms_tensor_numel(f);
        for (int64_t l = 0; l < n; l++) {
            double ref = want(sc, i, global_index(&specs[i], sc->l.W, shard_rank, l)), diff = fabs(d[l] - ref);
            wrong += diff > tol_ulps * ulp_of(reduce_dtype(sc->pol), ref);
            worst = fmax(worst, diff);
        }
        int64_t len, off;
        chunk(specs[i].shape[spec_dim(&specs[i])], sc->l.W, shard_rank, &len, &off);
        R_CHECK(n == spec_numel(&specs[i]) / specs[i].shape[spec_dim(&specs[i])] * len);
        R_CHECK(wrong == 0);
        ms_tensor_release(f);
    }
    return worst;
}

static double ref_step1(const scenario *sc, int pid, int64_t e) {
    return reduced_grad(sc->pol, sc->l.W * sc->l.R, (int[]){1}, 1, pid, e);
}

/* Two reduces accumulated into the stored gradient: each rounded, then added in opmath. */
static double ref_step12(const scenario *sc, int pid, int64_t e) {
    return round_as(sc->pol->stored, ref_step1(sc, pid, e) + reduced_grad(sc->pol, sc->l.W * sc->l.R, (int[]){2}, 1,
                                                                           pid, e));
}

/* One reduce of the per-rank sums of steps 1 and 2 (sync off for step 1). */
static double ref_summed(const scenario *sc, int pid, int64_t e) {
    return reduced_grad(sc->pol, sc->l.W * sc->l.R, (int[]){1, 2}, 2, pid, e);
}

/* f16 reduces round at each stage (pre-divide, sum, post-divide): one f16 ulp allowed. */
static double tolerance(const policy *pol) { return reduce_dtype(pol) == MS_F16 ? 1 : 0; }

/* The records since the last clear: want[i] = {kind, group size, bytes}, all in dtype
 * `dt[kind]`. */
static void check_records(ms_unit *u, int n, const int64_t (*want)[3], const ms_dtype *dt) {
    R_CHECK(ms_unit_record_count(u) == n);
    for (int i = 0; i < n && i < ms_unit_record_count(u); i++) {
        ms_record_kind kind = (ms_record_kind)-1;
        int size = -1;
        ms_dtype d = MS_DTYPE_COUNT;
        int64_t bytes = -1;
        R_OK(ms_unit_record(u, i, &kind, &d, &size, &bytes));
        R_CHECK(kind == want[i][0] && size == want[i][1] && bytes == want[i][2] && d == dt[kind]);
    }
}

/* Sums over the specs of the padded shard numel (trainable only when `trainable`), the
 * global numel, and this rank's real numel. */
static int64_t sum_padded(int W, bool trainable) {
    int64_t s = 0;
    for (int i = 0; i < NSPEC; i++)
        if (!trainable || specs[i].requires_grad) s += padded_numel(&specs[i], W);
    return s;
}

static int64_t sum_full(bool trainable) {
    int64_t s = 0;
    for (int i = 0; i < NSPEC; i++)
        if (!trainable || specs[i].requires_grad) s += spec_numel(&specs[i]);
    return s;
}

static int64_t sum_local_trainable(int W, int q) {
    int64_t s = 0, len, off;
    for (int i = 0; i < NSPEC; i++) {
        if (!specs[i].requires_grad) continue;
        chunk(specs[i].shape[spec_dim(&specs[i])], W, q, &len, &off);
        s += spec_numel(&specs[i]) / specs[i].shape[spec_dim(&specs[i])] * len;
    }
    return s;
}

/* The units' books (ms_unit_bytes, summed over the n units of a rank, 3 and 4 together)
 * against the memory the allocator really handed out for them (ms_unit_rank_allocated),
 * with `held` more bytes of category 3 that a caller keeps alive. */
static void check_allocated(ms_unit *const *units, int n, int64_t held) {
    int64_t books[4] = {0, 0, 0, held};
    for (int i = 0; i < n; i++)
        for (int c = 0; c < 5; c++) books[c < 3 ? c : 3] += ms_unit_bytes(units[i], c);
    for (int c = 0; c < 4; c++) {
        const int64_t real = ms_unit_rank_allocated(units[0], c);
        R_CHECK(real == books[c]);
        if (real != books[c])
            LOCKED(fprintf(stderr, "  category %d: %lld bytes allocated, %lld in the units' books\n", c, (long long)real,
                           (long long)books[c]));
    }
}

static void check_bytes(ms_unit *u, int64_t params, int64_t grads, int64_t optim, int64_t unsharded) {
    R_CHECK(ms_unit_bytes(u, 0) == params && ms_unit_bytes(u, 1) == grads && ms_unit_bytes(u, 2) == optim &&
            ms_unit_bytes(u, 3) == unsharded);
    check_allocated(&u, 1, 0); /* the rank's only unit */
}

/* ---------------------------------------------------------------- scenario: two steps */

/* unshard, reshard (full), regather, backward, reduce; then a second step accumulating into
 * the gradient shards.  Checks the parameters, gradients, norm, records and bytes. */
static void two_steps(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    ms_unit *u = build_unit("layers.0", pol, shard, replicate, MS_RESHARD_FULL);
    if (!u) return;
    const ms_dtype g = gather_dtype(pol), rd = reduce_dtype(pol);
    const int64_t ges = ms_dtype_size(g), res = ms_dtype_size(rd), ses = ms_dtype_size(pol->stored);
    const int64_t S = sum_padded(W, false), Sr = sum_padded(W, true);
    check_bytes(u, S * ses, 0, 0, 0);

    /* forward, reshard, backward regather */
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    double pdiff = check_params_full(u, pol);
    check_bytes(u, S * ses, 0, 0, sum_full(false) * ges);
    R_OK(ms_unit_reshard(u));
    check_bytes(u, S * ses, 0, 0, 0);
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    pdiff = fmax(pdiff, check_params_full(u, pol));
    write_grads(u, 1, c->rank);
    check_bytes(u, S * ses, 0, 0, (sum_full(false) + sum_full(true)) * ges);
    R_OK(ms_unit_reduce_grads(u));
    check_bytes(u, S * ses, 0, 0, W * Sr * res); /* only the reduce_scatter buffer is left */
    R_OK(ms_unit_wait(u));
    check_bytes(u, S * ses, Sr * ses, 0, 0);
    double g1 = check_grads(u, sc, q, ref_step1, tolerance(pol));

    /* the norm: every element of the full mean gradient once over the world */
    double sq = -1, want = 0;
    R_OK(ms_unit_grad_sq_norm(u, &sq));
    for (int i = 0; i < NSPEC; i++)
        for (int64_t e = 0; specs[i].requires_grad && e < spec_numel(&specs[i]); e++)
            want += ref_step1(sc, i, e) * ref_step1(sc, i, e);
    double total = world_sum(c, sq), rel = fabs(total - want) / want;
    R_CHECK(rel < 1e-12);

    /* a second step accumulates into the gradient shards */
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    write_grads(u, 2, c->rank);
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
    double g12 = check_grads(u, sc, q, ref_step12, 2 * tolerance(pol));

    /* records: AG, AG, RS (+AR), AG, RS (+AR) */
    const int64_t ag[3] = {0, W, W * S * ges}, rs[3] = {1, W, W * Sr * res}, ar[3] = {2, sc->l.R, Sr * res};
    const ms_dtype dts[3] = {g, rd, rd};
    if (replicate) {
        const int64_t want_rec[7][3] = {{ag[0], ag[1], ag[2]}, {ag[0], ag[1], ag[2]}, {rs[0], rs[1], rs[2]},
                                        {ar[0], ar[1], ar[2]}, {ag[0], ag[1], ag[2]}, {rs[0], rs[1], rs[2]},
                                        {ar[0], ar[1], ar[2]}};
        check_records(u, 7, want_rec, dts);
    } else {
        const int64_t want_rec[5][3] = {{ag[0], ag[1], ag[2]}, {ag[0], ag[1], ag[2]}, {rs[0], rs[1], rs[2]},
                                        {ag[0], ag[1], ag[2]}, {rs[0], rs[1], rs[2]}};
        check_records(u, 5, want_rec, dts);
    }
    ms_unit_clear_records(u);
    R_CHECK(ms_unit_record_count(u) == 0);

    pdiff = world_max(c, pdiff);
    g1 = world_max(c, g1);
    g12 = world_max(c, g12);
    double relmax = world_max(c, rel);
    if (c->rank == 0)
        printf("  W=%d R=%d  %-38s params max|diff| %g  grads %g, accumulated %g  |g|^2 rel %.1e\n", W, sc->l.R,
               pol->name, pdiff, g1, g12, relmax);
    ms_unit_release(u);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: sync off */

/* Unit a: step 1 with sync off (no collective), step 2 with sync on.  Unit b: one step
 * whose per-rank gradients are the sums of steps 1 and 2.  Same gradient shards. */
static void sync_off(rank_ctx *c) {
    const scenario *sc = c->arg;
    const int W = sc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    ms_unit *a = build_unit("a", sc->pol, shard, replicate, MS_RESHARD_FULL), *b = build_unit("b", sc->pol, shard, replicate, MS_RESHARD_FULL);
    if (!a || !b) return;
    const int64_t rfull = sum_full(true) * ms_dtype_size(reduce_dtype(sc->pol));

    R_OK(ms_unit_set_requires_gradient_sync(a, 0));
    R_OK(ms_unit_unshard(a));
    R_OK(ms_unit_wait(a));
    write_grads(a, 1, c->rank);
    R_OK(ms_unit_reduce_grads(a));
    R_OK(ms_unit_wait(a));
    R_CHECK(ms_unit_record_count(a) == 1); /* the all_gather only */
    R_CHECK(ms_unit_bytes(a, 3) == rfull); /* the accumulator, in the reduce dtype */
    R_CHECK(ms_unit_grad_shard(a, 0) == NULL);
    R_OK(ms_unit_set_requires_gradient_sync(a, 1));
    R_OK(ms_unit_unshard(a));
    R_OK(ms_unit_wait(a));
    write_grads(a, 2, c->rank);
    R_OK(ms_unit_reduce_grads(a));
    R_OK(ms_unit_wait(a));
    R_CHECK(ms_unit_bytes(a, 3) == 0);

    R_OK(ms_unit_unshard(b));
    R_OK(ms_unit_wait(b));
    for (int i = 0; i < NSPEC; i++) {
        if (!specs[i].requires_grad) continue;
        ms_tensor *g = ms_unit_grad_full(b, i), *src = NULL;
        R_OK(ms_tensor_new(&src, specs[i].ndim, specs[i].shape, MS_F64, MS_DEVICE_CPU, 0));
        double *d = ms_tensor_data(src);
        for (int64_t e = 0; d && e < spec_numel(&specs[i]); e++)
            d[e] = grad_value(1, c->rank, i, e) + grad_value(2, c->rank, i, e);
        R_OK(ms_tensor_copy(g, src));
        ms_tensor_release(src);
    }
    R_OK(ms_unit_reduce_grads(b));
    R_OK(ms_unit_wait(b));

    int64_t differ = 0;
    for (int i = 0; i < NSPEC; i++) {
        if (!specs[i].requires_grad) continue;
        ms_tensor *ga = as_f64(ms_unit_grad_shard(a, i)), *gb = as_f64(ms_unit_grad_shard(b, i));
        const double *x = ms_tensor_data(ga), *y = ms_tensor_data(gb);
        for (int64_t l = 0; l < ms_tensor_numel(ga); l++) differ += x[l] != y[l];
        ms_tensor_release(ga);
        ms_tensor_release(gb);
    }
    R_CHECK(differ == 0);
    double diff = world_max(c, check_grads(a, sc, q, ref_summed, tolerance(sc->pol)));
    if (c->rank == 0)
        printf("  W=%d R=%d  %-38s sync off then on == summed step; max|diff| vs reference %g\n", W, sc->l.R,
               sc->pol->name, diff);
    ms_unit_release(a);
    ms_unit_release(b);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* Sync off with a 16-bit reduce dtype: each backward's gradient is rounded to the reduce
 * dtype before it is added, as FSDP2's gradients are (torch 2.15 makes the unsharded
 * gradient's dtype the reduce dtype).  One rank, f32 parameter, f16 reduce: g1 = 1 and
 * g2 = 2^-11 + 2^-23 (f32, not an f16).  Rounding g2 first gives 2^-11 and 1 + 2^-11, a tie
 * that goes to the even 1; adding g2 unrounded would pass the tie and give 1 + 2^-10. */
static void sync_off_rounding(rank_ctx *c) {
    ms_unit *u = NULL;
    const int64_t shape[1] = {4};
    R_OK(ms_unit_new(&u, "acc", c->world, NULL, -1, MS_F16, MS_RESHARD_FULL));
    if (!u) return;
    R_OK(ms_unit_add_param(u, "w", 1, shape, MS_F32, 0, 1));
    R_OK(ms_unit_finalize(u));
    const double g[2] = {1.0, ldexp(1, -11) + ldexp(1, -23)};
    for (int step = 0; step < 2; step++) {
        R_OK(ms_unit_set_requires_gradient_sync(u, step == 1));
        R_OK(ms_unit_unshard(u));
        R_OK(ms_unit_wait(u));
        R_OK(ms_tensor_fill(ms_unit_grad_full(u, 0), g[step]));
        R_OK(ms_unit_reduce_grads(u));
        R_OK(ms_unit_wait(u));
    }
    ms_tensor *gs = ms_unit_grad_shard(u, 0), *f64 = gs ? as_f64(gs) : NULL;
    int bad = 0;
    for (int64_t e = 0; f64 && e < 4; e++) bad += ((double *)ms_tensor_data(f64))[e] != 1.0;
    R_CHECK(f64 && bad == 0);
    printf("  f16 reduce, sync off then on: round(round(g1) + round(g2)) = 1, as FSDP2\n");
    ms_tensor_release(f64);
    ms_unit_release(u);
}

/* Sync off against FSDP2 itself (tests/reference/fsdp2_sync_off.py, torch 2.15 on 2 gloo
 * ranks): per dtype case a (2, 4) parameter, three backwards of measured gradients, sync off
 * for the first two; each rank's gradient shard bit for bit.  The cases part where the
 * rules do: rounding to the reduce dtype each backward, and reduce_dtype unset (the stored
 * dtype in torch 2.15, not param_dtype). */
static const char *const SYNC_OFF_CASES[] = {"f32_f16reduce", "f32_bf16_unset", "f32_bf16_f32", "f32_bf16_bf16",
                                             "bf16_f32_unset", "bf16_f32reduce"};
static void sync_off_torch(rank_ctx *c) {
    const refdata *d = c->arg;
    const ms_dtype codes[3] = {MS_F32, MS_BF16, MS_F16};
    char name[160];
    double worst = 0;
    for (size_t k = 0; k < sizeof SYNC_OFF_CASES / sizeof SYNC_OFF_CASES[0]; k++) {
        const char *cs = SYNC_OFF_CASES[k];
        snprintf(name, sizeof name, "case.%s", cs);
        const refrec *cr = refdata_get(d, name);
        const int64_t st = (int64_t)cr->v[0], pd = (int64_t)cr->v[1], rd = (int64_t)cr->v[2];
        ms_unit *u = NULL;
        const int64_t shape[2] = {2, 4};
        R_OK(ms_unit_new(&u, cs, c->world, NULL, pd < 0 ? -1 : (int)codes[pd], rd < 0 ? -1 : (int)codes[rd],
                         MS_RESHARD_FULL));
        if (!u) return;
        R_OK(ms_unit_add_param(u, "w", 2, shape, codes[st], 0, 1));
        R_OK(ms_unit_finalize(u));
        for (int b = 0; b < 3; b++) {
            R_OK(ms_unit_set_requires_gradient_sync(u, b == 2));
            R_OK(ms_unit_unshard(u));
            R_OK(ms_unit_wait(u));
            snprintf(name, sizeof name, "g.%s.r%d.b%d", cs, c->rank, b);
            const refrec *g = refdata_get(d, name);
            ms_tensor *src = NULL;
            R_OK(ms_tensor_new(&src, 2, shape, MS_F64, MS_DEVICE_CPU, 0));
            for (int64_t e = 0; src && e < 8; e++) ((double *)ms_tensor_data(src))[e] = refdata_f64(g, e);
            R_OK(ms_tensor_copy(ms_unit_grad_full(u, 0), src)); /* the compute dtype's rounding, as torch's cast */
            ms_tensor_release(src);
            R_OK(ms_unit_reduce_grads(u));
            R_OK(ms_unit_wait(u));
        }
        snprintf(name, sizeof name, "grad.%s.r%d", cs, c->rank);
        const refrec *want = refdata_get(d, name);
        ms_tensor *gs = ms_unit_grad_shard(u, 0), *f64 = gs ? as_f64(gs) : NULL;
        int bad = 0;
        for (int64_t e = 0; f64 && e < 4; e++) {
            const double x = ((double *)ms_tensor_data(f64))[e], y = refdata_f64(want, e);
            bad += x != y;
            worst = fmax(worst, fabs(x - y));
        }
        R_CHECK(f64 && ms_tensor_numel(f64) == 4 && bad == 0);
        if (bad) fprintf(stderr, "sync off against torch: case %s rank %d: %d of 4 differ\n", cs, c->rank, bad);
        ms_tensor_release(f64);
        ms_unit_release(u);
    }
    if (c->rank == 0)
        printf("  sync off then on against FSDP2 (torch 2.15, 2 ranks, %d dtype cases): max|diff| %g\n",
               (int)(sizeof SYNC_OFF_CASES / sizeof SYNC_OFF_CASES[0]), worst);
}

/* ---------------------------------------------------------------- scenario: reshard modes */

/* Three units with reshard_after_forward MS_RESHARD_KEEP, MS_RESHARD_FULL and 2 on W = 4, unsharded together (the
 * second and third prefetched behind the first on the communication thread), resharded and
 * regathered: the same unsharded parameters, the expected collectives and bytes. */
static void reshard_modes(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, modes[3] = {MS_RESHARD_KEEP, MS_RESHARD_FULL, 2};
    ms_unit *u[3];
    for (int m = 0; m < 3; m++) u[m] = build_unit(m == 0 ? "keep" : m == 1 ? "free" : "two_way", pol, c->world,
                                                  NULL, modes[m]);
    if (!u[0] || !u[1] || !u[2]) return;
    const int64_t ges = ms_dtype_size(gather_dtype(pol)), S = sum_padded(W, false);
    double worst = 0;
    for (int m = 0; m < 3; m++) R_OK(ms_unit_unshard(u[m]));
    for (int m = 0; m < 3; m++) R_OK(ms_unit_wait(u[m]));
    for (int m = 0; m < 3; m++) worst = fmax(worst, check_params_full(u[m], pol));
    for (int m = 0; m < 3; m++) R_OK(ms_unit_reshard(u[m]));

    R_CHECK(ms_unit_param_full(u[0], 0) != NULL); /* kept */
    R_CHECK(ms_unit_bytes(u[0], 3) == sum_full(false) * ges);
    R_CHECK(ms_unit_param_full(u[1], 0) == NULL && strstr(ms_last_error(), "'free': param_full") &&
            strstr(ms_last_error(), "sharded"));
    R_CHECK(ms_unit_bytes(u[1], 3) == 0);
    R_CHECK(ms_unit_param_full(u[2], 0) == NULL && strstr(ms_last_error(), "k-way"));
    R_CHECK(ms_unit_bytes(u[2], 3) == W / 2 * S * ges); /* this rank's segment of the (W, S) layout */

    for (int m = 0; m < 3; m++) R_OK(ms_unit_unshard(u[m]));
    for (int m = 0; m < 3; m++) R_OK(ms_unit_wait(u[m]));
    for (int m = 0; m < 3; m++) worst = fmax(worst, check_params_full(u[m], pol));

    const ms_dtype dts[3] = {gather_dtype(pol), reduce_dtype(pol), reduce_dtype(pol)};
    const int64_t keep[1][3] = {{0, W, W * S * ges}};
    const int64_t freed[2][3] = {{0, W, W * S * ges}, {0, W, W * S * ges}};
    const int64_t two_way[2][3] = {{0, W, W * S * ges}, {0, 2, W * S * ges}};
    check_records(u[0], 1, keep, dts);
    check_records(u[1], 2, freed, dts);
    check_records(u[2], 2, two_way, dts);

    /* backward after the k-way regather reduces as usual */
    write_grads(u[2], 1, c->rank);
    R_OK(ms_unit_reduce_grads(u[2]));
    R_OK(ms_unit_wait(u[2]));
    const scenario one_d = {.l = {W, 1}, .pol = pol};
    double gd = check_grads(u[2], &one_d, c->rank, ref_step1, tolerance(pol));

    worst = world_max(c, worst);
    gd = world_max(c, gd);
    if (c->rank == 0)
        printf("  W=%d      reshard_after_forward keep, full, 2 (prefetched): params max|diff| %g, grads after the 2-way "
               "regather %g\n", W, worst, gd);
    for (int m = 0; m < 3; m++) ms_unit_release(u[m]);
}

/* ---------------------------------------------------------------- scenario: AdamW */

enum { ADAM_STEPS = 3 };
static const double LR = 1e-2, B1 = 0.9, B2 = 0.999, EPS = 1e-8, WD = 0.1;

/* PyTorch's AdamW (torch.optim.AdamW, decoupled weight decay) on one f32 element, written
 * out here op by op from its single-tensor code: param.mul_(1 - lr*wd);
 * exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 -
 * beta2); param.addcdiv_(exp_avg, sqrt(exp_avg_sq) / sqrt(bias_correction2) + eps,
 * value=-lr/bias_correction1), with the Python floats rounded to f32 as the kernels take
 * them and the lerp's and the addcmul's multiply-add fused, as torch's x86-64 (AVX2,
 * AVX-512) and CUDA kernels compute them. */
static void torch_adamw(float *w, float *m, float *v, float g, int step) {
    const float decay = (float)(1 - LR * WD), wt = (float)(1 - B1), b2 = (float)B2, vt = (float)(1 - B2);
    const float ss = (float)(-(LR / (1 - pow(B1, step)))), bc2 = (float)sqrt(1 - pow(B2, step)), eps = (float)EPS;
    *w *= decay;
    *m = wt < 0.5f ? fmaf(wt, g - *m, *m) : fmaf(wt - 1, g - *m, g);
    *v = fmaf(vt * g, g, *v * b2);
    *w += ss * *m / (sqrtf(*v) / bc2 + eps);
}

/* This rank's shards of unit u after `steps` AdamW steps against torch_adamw on the reduced
 * gradients (reduced_grad, exact here), from the stored parameters, with the parameters
 * loaded again from their f64 full tensors (a checkpoint) after step `reload` (0: never),
 * which sets the master weights to the loaded values in f32: the f32 master weights (f32
 * stored: the parameters themselves) bit for bit, so the stored parameters too.  Returns
 * the max |diff|. */
static double check_adamw(ms_unit *u, const scenario *sc, int q, int steps, int reload) {
    const policy *pol = sc->pol;
    double worst = 0;
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *f = as_f64(ms_unit_param_shard(u, i));
        const double *d = ms_tensor_data(f);
        int64_t wrong = 0;
        for (int64_t l = 0; l < ms_tensor_numel(f); l++) {
            int64_t e = global_index(&specs[i], sc->l.W, q, l);
            float w = (float)round_as(pol->stored, param_value(i, e)), m = 0, v = 0;
            for (int s = 1; specs[i].requires_grad && s <= steps; s++) {
                torch_adamw(&w, &m, &v, (float)reduced_grad(pol, sc->l.W * sc->l.R, (int[]){s}, 1, i, e), s);
                if (s == reload) w = (float)param_value(i, e);
            }
            if (!specs[i].requires_grad && reload) w = (float)param_value(i, e);
            double want = round_as(pol->stored, w), diff = fabs(d[l] - want);
            wrong += d[l] != want;
            worst = fmax(worst, diff);
        }
        R_CHECK(wrong == 0);
        ms_tensor_release(f);
    }
    return worst;
}

/* Step s's gradients on u, every trainable parameter: gather, write, reduce. */
static void reduce_step(rank_ctx *c, ms_unit *u, int s) {
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    write_grads(u, s, c->rank);
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
}

/* AdamW steps s0 + 1 .. s1 on u: reduce, step, zero_grad. */
static void adamw_steps(rank_ctx *c, ms_unit *u, int s0, int s1) {
    for (int s = s0 + 1; s <= s1; s++) {
        reduce_step(c, u, s);
        R_OK(ms_unit_adamw_step(u, LR, B1, B2, EPS, WD, s));
        R_OK(ms_unit_zero_grad(u));
    }
}

/* Three steps; the parameters loaded again (a checkpoint restored into a unit that has
 * optimizer state: the master weights must follow, or the next step would undo the load);
 * two more steps. */
static void adamw(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    ms_unit *u = build_unit("adamw", pol, shard, replicate, MS_RESHARD_FULL);
    if (!u) return;
    adamw_steps(c, u, 0, ADAM_STEPS);
    const int64_t local = sum_local_trainable(W, q);
    R_CHECK(ms_unit_bytes(u, 2) == local * 4 * (pol->stored == MS_F32 ? 2 : 3));
    double worst = check_adamw(u, sc, q, ADAM_STEPS, 0);
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *full = full_of(i, param_value);
        R_OK(ms_unit_load_full(u, i, full));
        ms_tensor_release(full);
    }
    adamw_steps(c, u, ADAM_STEPS, ADAM_STEPS + 2);
    double reloaded = check_adamw(u, sc, q, ADAM_STEPS + 2, ADAM_STEPS);
    worst = world_max(c, worst);
    reloaded = world_max(c, reloaded);
    if (c->rank == 0)
        printf("  W=%d R=%d  AdamW, %s: max|diff| vs torch's AdamW written out in f32 %g after %d steps, %g after a "
               "reload and 2 more\n", W, sc->l.R, pol->name, worst, ADAM_STEPS, reloaded);
    ms_unit_release(u);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: AdamW as torch's */

/* torch.optim.AdamW on parameters of dtype dt, the state of dt too (no master weights),
 * written out op by op as torch's kernels run it: a 16-bit tensor's ops widen to f32, compute
 * and round back to dt one by one; Python scalars reach them in f32, except eps, which the
 * add of a scalar to a 16-bit tensor takes in dt; the lerp's and the addcmul's
 * multiply-adds fused; f64 computes in f64 throughout. */
static void torch_adamw_as(ms_dtype dt, double *w, double *m, double *v, double g, int step, double eps_) {
    if (dt == MS_F64) {
        const double w1 = 1 - B1, ss = LR / (1 - pow(B1, step)), bc2 = sqrt(1 - pow(B2, step));
        *w *= 1 - LR * WD;
        *m = w1 < 0.5 ? fma(w1, g - *m, *m) : fma(w1 - 1, g - *m, g);
        *v = fma((1 - B2) * g, g, *v * B2);
        *w += -ss * *m / (sqrt(*v) / bc2 + eps_);
        return;
    }
#define RND(x) ((float)round_as(dt, (double)(x)))
    const float decay = (float)(1 - LR * WD), w1 = (float)(1 - B1), b2 = (float)B2, c2 = (float)(1 - B2);
    const float ss = (float)(-(LR / (1 - pow(B1, step)))), bc2 = (float)sqrt(1 - pow(B2, step)), eps = RND(eps_);
    const float fw = (float)*w, fm = (float)*m, fv = (float)*v, fg = (float)g;
    const float pw = RND(fw * decay);                                                              /* mul_ */
    const float pm = RND(w1 < 0.5f ? fmaf(w1, fg - fm, fm) : fmaf(w1 - 1, fg - fm, fg));          /* lerp_ */
    const float pv = RND(fmaf(c2 * fg, fg, RND(fv * b2)));                                         /* mul_, addcmul_ */
    const float denom = RND(RND(RND(sqrtf(pv)) / bc2) + eps);                                      /* sqrt, /, add_ */
    *w = RND(pw + ss * pm / denom);                                                                /* addcdiv_ */
#undef RND
    *m = pm;
    *v = pv;
}

/* MS_ADAMW_TORCH: three steps against torch_adamw_as, bit for bit, the state's bytes (two
 * moments of the stored dtype, no master), a checkpoint loaded (the shard itself is what
 * AdamW updates) and two more; the mode fixed once a step has run.  eps 0.3, not 1e-8:
 * of the size of these denominators, so that its rounding to a 16-bit dtype shows. */
static const double TORCH_EPS = 0.3;

static void adamw_torch(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    ms_unit *u = build_unit("adamw_torch", pol, shard, replicate, MS_RESHARD_FULL);
    if (!u) return;
    R_OK(ms_unit_set_adamw(u, MS_ADAMW_TORCH));
    R_ERR(ms_unit_set_adamw(u, 7), MS_ERR_ARG, "mode 7: expected MS_ADAMW_MASTER (0) or MS_ADAMW_TORCH (1)");
    enum { STEPS = 5, RELOAD = 3 };
    int64_t wrong = 0, moved = 0;
    double worst = 0;
    for (int s = 1; s <= STEPS; s++) {
        reduce_step(c, u, s);
        R_OK(ms_unit_adamw_step(u, LR, B1, B2, TORCH_EPS, WD, s));
        R_OK(ms_unit_zero_grad(u));
        if (s == 1) {
            R_CHECK(ms_unit_bytes(u, 2) == sum_local_trainable(W, q) * 2 * ms_dtype_size(pol->stored));
            R_ERR(ms_unit_set_adamw(u, MS_ADAMW_MASTER), MS_ERR_STATE, "choose how it is kept before it is made");
            R_OK(ms_unit_set_adamw(u, MS_ADAMW_TORCH));
        }
        if (s == RELOAD)
            for (int i = 0; i < NSPEC; i++) {
                ms_tensor *full = full_of(i, param_value);
                R_OK(ms_unit_load_full(u, i, full));
                ms_tensor_release(full);
            }
    }
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *f = as_f64(ms_unit_param_shard(u, i));
        const double *d = ms_tensor_data(f);
        for (int64_t l = 0; l < ms_tensor_numel(f); l++) {
            const int64_t e = global_index(&specs[i], W, q, l);
            double w = round_as(pol->stored, param_value(i, e)), m = 0, v = 0;
            for (int s = 1; specs[i].requires_grad && s <= STEPS; s++) {
                torch_adamw_as(pol->stored, &w, &m, &v, reduced_grad(pol, W * sc->l.R, (int[]){s}, 1, i, e), s,
                               TORCH_EPS);
                if (s == RELOAD) w = round_as(pol->stored, param_value(i, e));
            }
            wrong += d[l] != w;
            moved += d[l] != round_as(pol->stored, param_value(i, e));
            worst = fmax(worst, fabs(d[l] - w));
        }
        ms_tensor_release(f);
    }
    R_CHECK(wrong == 0 && world_sum(c, (double)moved) > 0);
    worst = world_max(c, worst);
    if (c->rank == 0)
        printf("  W=%d R=%d  AdamW as torch.optim.AdamW (state in %s, no master): max|diff| vs torch's ops written "
               "out %g after %d steps and a reload\n", W, sc->l.R, ms_dtype_name(pol->stored), worst, STEPS);
    ms_unit_release(u);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: no gradient */

/* torch's zero_grad() (set_to_none) and FSDP2's sharded gradients: after zero_grad no
 * parameter has a gradient (grad_shard NULL; the norm, scaling and AdamW skip it) until a
 * reduce assigns one; a parameter without a gradient in a step keeps none and AdamW leaves
 * it alone.  Step 1: every trainable parameter gets a gradient, layers.0.b's all -0.0, which
 * the first reduce assigns (an accumulation into zeros would make it +0.0).  Step 2: only
 * layers.0.w (spec 0) gets one.  With an exact reduce (f32) spec 0 is checked against
 * torch's AdamW written out, the others must keep their bits of step 1. */
static void no_grad(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    ms_unit *u = build_unit("no_grad", pol, shard, replicate, MS_RESHARD_FULL);
    if (!u) return;
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    write_grads(u, 1, c->rank);
    R_OK(ms_tensor_fill(ms_unit_grad_full(u, 1), -0.0));
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
    ms_tensor *b = as_f64(ms_unit_grad_shard(u, 1));
    int64_t positive = 0;
    for (int64_t l = 0; l < ms_tensor_numel(b); l++) positive += !signbit(((const double *)ms_tensor_data(b))[l]);
    ms_tensor_release(b);
    R_CHECK(positive == 0);
    R_OK(ms_unit_adamw_step(u, LR, B1, B2, EPS, WD, 1));
    R_OK(ms_unit_zero_grad(u));
    double sq = -1;
    R_OK(ms_unit_grad_sq_norm(u, &sq));
    R_CHECK(sq == 0);
    ms_tensor *after1[NSPEC];
    for (int i = 0; i < NSPEC; i++) {
        R_CHECK(ms_unit_grad_shard(u, i) == NULL && !ms_last_error()[0]);
        after1[i] = as_f64(ms_unit_param_shard(u, i));
    }

    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    write_grad(u, 0, 0, 2, c->rank);
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
    for (int i = 0; i < NSPEC; i++) R_CHECK((ms_unit_grad_shard(u, i) != NULL) == (i == 0));
    R_OK(ms_unit_grad_sq_norm(u, &sq));
    double want = 0;
    for (int64_t e = 0; e < spec_numel(&specs[0]); e++) want += pow(reduced_grad(pol, W * sc->l.R, (int[]){2}, 1, 0, e), 2);
    const double rel = fabs(world_sum(c, sq) - want) / want;
    R_CHECK(rel < (tolerance(pol) ? 1e-2 : 1e-12));
    R_OK(ms_unit_scale_grads(u, 1)); /* skips the others */
    R_OK(ms_unit_adamw_step(u, LR, B1, B2, EPS, WD, 2));
    int64_t moved = 0, wrong = 0;
    for (int i = 0; i < NSPEC; i++) {
        ms_tensor *f = as_f64(ms_unit_param_shard(u, i));
        const double *d = ms_tensor_data(f), *d1 = ms_tensor_data(after1[i]);
        for (int64_t l = 0; l < ms_tensor_numel(f); l++) {
            if (i) {
                wrong += d[l] != d1[l];
                continue;
            }
            moved += d[l] != d1[l];
            const int64_t e = global_index(&specs[0], W, q, l);
            float w = (float)round_as(pol->stored, param_value(0, e)), m = 0, v = 0;
            for (int s = 1; s <= 2; s++)
                torch_adamw(&w, &m, &v, (float)reduced_grad(pol, W * sc->l.R, (int[]){s}, 1, 0, e), s);
            wrong += !tolerance(pol) && d[l] != round_as(pol->stored, w);
        }
        ms_tensor_release(f);
        ms_tensor_release(after1[i]);
    }
    R_CHECK(wrong == 0 && world_sum(c, (double)moved) > 0);

    /* Step 3, every trainable parameter with a gradient: the ones that skipped step 2 take
     * their own second step (torch's per-parameter state['step']), not the caller's third,
     * whose bias corrections would move them differently. */
    R_OK(ms_unit_zero_grad(u));
    reduce_step(c, u, 3);
    R_OK(ms_unit_adamw_step(u, LR, B1, B2, EPS, WD, 3));
    int64_t own = 0, callers = 0;
    for (int i = 0; i < NSPEC; i++) {
        if (!specs[i].requires_grad) continue;
        ms_tensor *f = as_f64(ms_unit_param_shard(u, i));
        const double *d = ms_tensor_data(f);
        for (int64_t l = 0; l < ms_tensor_numel(f); l++) {
            const int64_t e = global_index(&specs[i], W, q, l);
            const float w0 = (float)round_as(pol->stored, param_value(i, e));
            float w = w0, m = 0, v = 0, wc = w0, mc = 0, vc = 0; /* own count; the caller's step */
            for (int s = 1; s <= 3; s++) {
                if (i && s == 2) continue;
                const float g = i == 1 && s == 1 ? -0.0f : (float)reduced_grad(pol, W * sc->l.R, (int[]){s}, 1, i, e);
                torch_adamw(&w, &m, &v, g, i && s == 3 ? 2 : s);
                torch_adamw(&wc, &mc, &vc, g, s);
            }
            own += d[l] != round_as(pol->stored, w);
            callers += d[l] != round_as(pol->stored, wc);
        }
        ms_tensor_release(f);
    }
    R_CHECK(tolerance(pol) || own == 0);
    R_CHECK(tolerance(pol) || world_sum(c, (double)callers) > 0);

    /* A caller that does not count its steps: step 1 again would be step 0 for the
     * parameters that skipped one; refused by name, nothing changed. */
    R_OK(ms_unit_zero_grad(u));
    reduce_step(c, u, 4);
    ms_tensor *before = as_f64(ms_unit_param_shard(u, 0));
    R_ERR(ms_unit_adamw_step(u, LR, B1, B2, EPS, WD, 1), MS_ERR_ARG, "had no gradient in 1 earlier steps, so this would "
          "be its step 0: expected step to count every adamw_step call from 1");
    ms_tensor *after = as_f64(ms_unit_param_shard(u, 0));
    R_CHECK(!memcmp(ms_tensor_data(before), ms_tensor_data(after), (size_t)ms_tensor_numel(after) * sizeof(double)));
    ms_tensor_release(before);
    ms_tensor_release(after);
    if (c->rank == 0)
        printf("  W=%d R=%d  %-38s no gradient after zero_grad: skipped by norm, scale and AdamW; -0.0 assigned; "
               "|g|^2 rel %.1e; a skipped step not counted (%lld of rank 0's elements tell the counts apart)\n", W,
               sc->l.R, pol->name, world_max(c, rel), (long long)callers);
    else
        world_max(c, rel);
    ms_unit_release(u);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: divide factors */

typedef struct divide_case {
    layout l;
    double factor; /* custom, 0 = default */
} divide_case;

/* Data-parallel rank r's gradient element e: an f32 whose sums and quotients round. */
static float divide_grad(int r, int64_t e) { return (float)(1 + 0.1 * r + 0.0137 * (double)e); }

/* The reduced gradient element e as FSDP2 computes it in f32 (torch 2.15,
 * _get_gradient_divide_factors): the default factor N = W*R averages in both collectives
 * (AVG: the sum, then / the group size); a custom factor equal to W averages in the
 * reduce_scatter and sums in the all_reduce; any other custom factor is premul-sum(1/f) and
 * SUM; with one shard rank (no reduce_scatter) the input is divided by the custom factor.
 * The collectives sum in rank order. */
static float divide_ref(const divide_case *dc, int64_t e) {
    const int W = dc->l.W, R = dc->l.R;
    const float f = (float)dc->factor, pre = (float)(1 / dc->factor);
    float total = 0;
    for (int a = 0; a < R; a++) {
        float s = 0;
        for (int b = 0; b < W; b++) {
            float x = divide_grad(a * W + b, e);
            if (dc->factor && W == 1) x = x / f;
            else if (dc->factor && dc->factor != W) x = x * pre;
            s = b ? s + x : x;
        }
        if (!dc->factor || (W > 1 && dc->factor == W)) s = s / (float)W;
        total = a ? total + s : s;
    }
    return !dc->factor && R > 1 ? total / (float)R : total;
}

/* One f32 reduce of spec 0 with the case's factor, bit for bit against divide_ref. */
static void divide_factors(rank_ctx *c) {
    const divide_case *dc = c->arg;
    const int W = dc->l.W, q = c->rank % W;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &dc->l, &shard, &replicate);
    const policy pol = {"f32", MS_F32, -1, -1, dc->factor};
    ms_unit *u = build_unit_of("divide", &pol, shard, replicate, MS_RESHARD_FULL, 0, 1);
    if (!u) return;
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    ms_tensor *g = ms_unit_grad_full(u, 0);
    float *gd = g ? ms_tensor_data(g) : NULL;
    for (int64_t e = 0; gd && e < spec_numel(&specs[0]); e++) gd[e] = divide_grad(c->rank, e);
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
    ms_tensor *gs = ms_unit_grad_shard(u, 0);
    const float *d = gs ? ms_tensor_data(gs) : NULL;
    int64_t wrong = 0;
    double worst = 0;
    for (int64_t l = 0; d && l < ms_tensor_numel(gs); l++) {
        const float want = divide_ref(dc, global_index(&specs[0], W, q, l));
        wrong += memcmp(&d[l], &want, sizeof want) != 0;
        worst = fmax(worst, fabs((double)d[l] - want));
    }
    R_CHECK(gs && wrong == 0);
    worst = world_max(c, worst);
    if (c->rank == 0)
        printf("  W=%d R=%d  f32, divide factor %-8s max|diff| vs FSDP2's rule in f32 %g\n", W, dc->l.R,
               dc->factor ? (dc->factor == W ? "W" : dc->factor == W * dc->l.R ? "W*R" : "custom") : "default", worst);
    ms_unit_release(u);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: one parameter per unit */

/* Spec j with nothing before its shard dim: alone in a unit, it works in place. */
static bool in_place_spec(int j) {
    int64_t outer = 1;
    for (int d = 0; d < spec_dim(&specs[j]); d++) outer *= specs[j].shape[d];
    return outer == 1;
}

/* The same bits in a and b (any dtype, compared as their f64 copies). */
static bool same_bits(const ms_tensor *a, const ms_tensor *b) {
    if (!a || !b || ms_tensor_dtype(a) != ms_tensor_dtype(b) || ms_tensor_numel(a) != ms_tensor_numel(b)) return false;
    ms_tensor *x = as_f64(a), *y = as_f64(b);
    const void *dx = ms_tensor_data(x), *dy = ms_tensor_data(y);
    const bool same = !dx || !memcmp(dx, dy, (size_t)ms_tensor_nbytes(x));
    ms_tensor_release(x);
    ms_tensor_release(y);
    return same;
}

/* ---------------------------------------------------------------- scenario: AdamW checkpoints */

typedef struct ckpt_case {
    layout l;
    const policy *pol;
    int adamw; /* MS_ADAMW_MASTER or MS_ADAMW_TORCH */
} ckpt_case;

static const char *const state_names[3] = {"exp_avg", "exp_avg_sq", "master"};

/* A checkpoint restored into a new unit continues as the unit it was taken from: unit A
 * takes steps 1 to 3 (in step 2 only spec 0 has a gradient: the others skip a step),
 * then its shards, AdamW state and skipped counts are copied out; unit B, new, gets them
 * (shards written before its first step, the state through ms_unit_adamw_state's views,
 * the counts by ms_unit_set_adamw_skipped); both take steps 4 and 5: every shard and every
 * state tensor bit for bit alike. */
static void checkpoint(rank_ctx *c) {
    const ckpt_case *k = c->arg;
    const scenario sc = {k->l, k->pol};
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &k->l, &shard, &replicate);
    ms_unit *a = build_unit("ckpt_a", k->pol, shard, replicate, MS_RESHARD_FULL), *b = build_unit("ckpt_b", k->pol, shard, replicate, MS_RESHARD_FULL);
    if (!a || !b) return;
    R_OK(ms_unit_set_adamw(a, k->adamw));
    R_OK(ms_unit_set_adamw(b, k->adamw));
    for (int s = 1; s <= 3; s++) {
        if (s == 2) {
            R_OK(ms_unit_unshard(a));
            R_OK(ms_unit_wait(a));
            write_grad(a, 0, 0, 2, c->rank);
            R_OK(ms_unit_reduce_grads(a));
            R_OK(ms_unit_wait(a));
        } else {
            reduce_step(c, a, s);
        }
        R_OK(ms_unit_adamw_step(a, LR, B1, B2, EPS, WD, s));
        R_OK(ms_unit_zero_grad(a));
    }
    int restored = 0;
    for (int i = 0; i < NSPEC; i++) {
        R_OK(ms_tensor_copy(ms_unit_param_shard(b, i), ms_unit_param_shard(a, i)));
        for (int w = MS_ADAMW_EXP_AVG; w <= MS_ADAMW_MASTER_WEIGHTS; w++) {
            ms_tensor *from = ms_unit_adamw_state(a, i, w), *to = ms_unit_adamw_state(b, i, w);
            R_CHECK(!ms_last_error()[0] && (from == NULL) == (to == NULL));
            /* moments for the trainable parameters; master weights for a bf16 unit without torch's state */
            const bool want = specs[i].requires_grad &&
                              (w != MS_ADAMW_MASTER_WEIGHTS || (k->pol->stored != MS_F32 && k->adamw == MS_ADAMW_MASTER));
            R_CHECK((from != NULL) == want);
            if (!from || !to) continue;
            R_CHECK(ms_tensor_numel(to) == ms_tensor_numel(ms_unit_param_shard(a, i)));
            R_OK(ms_tensor_copy(to, from));
            restored++;
        }
        R_CHECK(ms_unit_adamw_skipped(a, i) == (specs[i].requires_grad && i ? 1 : 0));
        R_OK(ms_unit_set_adamw_skipped(b, i, ms_unit_adamw_skipped(a, i)));
    }
    R_ERR(ms_unit_set_adamw(b, k->adamw == MS_ADAMW_MASTER ? MS_ADAMW_TORCH : MS_ADAMW_MASTER), MS_ERR_STATE,
          "choose how it is kept before it is made");
    R_ERR(ms_unit_set_adamw_skipped(b, 0, -1), MS_ERR_ARG, "-1: expected a count >= 0");
    R_CHECK(ms_unit_adamw_state(b, 0, 3) == NULL && strstr(ms_last_error(), "which 3: expected MS_ADAMW_EXP_AVG"));
    for (int s = 4; s <= 5; s++)
        for (int u = 0; u < 2; u++) {
            reduce_step(c, u ? b : a, s);
            R_OK(ms_unit_adamw_step(u ? b : a, LR, B1, B2, EPS, WD, s));
            R_OK(ms_unit_zero_grad(u ? b : a));
        }
    int64_t differ = 0;
    for (int i = 0; i < NSPEC; i++) {
        differ += !same_bits(ms_unit_param_shard(a, i), ms_unit_param_shard(b, i));
        for (int w = MS_ADAMW_EXP_AVG; w <= MS_ADAMW_MASTER_WEIGHTS; w++) {
            const ms_tensor *x = ms_unit_adamw_state(a, i, w), *y = ms_unit_adamw_state(b, i, w);
            if (x || y) differ += !same_bits(x, y);
            if ((x || y) && !same_bits(x, y) && c->rank == 0)
                printf("    %s of %s differs\n", state_names[w], specs[i].fqn);
        }
    }
    R_CHECK(differ == 0);
    if (c->rank == 0)
        printf("  W=%d R=%d  %s, %s: a checkpoint (shards, %d state tensors, skipped counts) restored into a new unit "
               "continues bit for bit\n", k->l.W, k->l.R, k->pol->name, k->adamw == MS_ADAMW_TORCH ? "torch's state" :
               "f32 master", restored);
    (void)sc;
    ms_unit_release(a);
    ms_unit_release(b);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* A unit of spec j alone against the unit of all specs, step for step: a parameter with
 * nothing before its shard dim alone in a unit works in place (the unsharded parameter, and
 * the gradient when the reduce dtype is the gather dtype, are views of the padded flat
 * buffers), the others copy as usual; the unsharded parameters and the gradient shards must
 * be the same bits, through a regather, two reduces and a sync-off accumulation.  The
 * single units reshard with k = 2 on W = 4, keep on W = 2, over the whole group otherwise. */
static void one_param(rank_ctx *c) {
    const scenario *sc = c->arg;
    const policy *pol = sc->pol;
    const int W = sc->l.W, k = W == 4 ? 2 : W == 2 ? MS_RESHARD_KEEP : MS_RESHARD_FULL;
    const ms_dtype g = gather_dtype(pol);
    const int64_t ges = ms_dtype_size(g);
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, &sc->l, &shard, &replicate);
    int64_t wrong = 0;
    for (int j = 0; j < NSPEC; j++) {
        ms_unit *all = build_unit("all", pol, shard, replicate, MS_RESHARD_FULL), *one = build_unit_of("one", pol, shard, replicate,
                                                                                       k, j, 1);
        if (!all || !one) return;
        const bool place = in_place_spec(j), train = specs[j].requires_grad;
        const int64_t pbytes = (place ? W * padded_numel(&specs[j], W) : spec_numel(&specs[j])) * ges;
        const int64_t gbytes = (place && reduce_dtype(pol) == g ? W * padded_numel(&specs[j], W)
                                                                 : spec_numel(&specs[j])) * ges;
        for (int pass = 0; pass < 2; pass++) { /* forward, then the backward regather */
            R_OK(ms_unit_unshard(all));
            R_OK(ms_unit_unshard(one));
            R_OK(ms_unit_wait(all));
            R_OK(ms_unit_wait(one));
            wrong += !same_bits(ms_unit_param_full(one, 0), ms_unit_param_full(all, j));
            R_CHECK(ms_unit_bytes(one, 3) == pbytes);
            if (pass) break;
            R_OK(ms_unit_reshard(all));
            R_OK(ms_unit_reshard(one));
            R_CHECK((ms_unit_param_full(one, 0) != NULL) == (k == MS_RESHARD_KEEP)); /* freed views stay state errors */
        }
        /* step 1; steps 2 (sync off) and 3 accumulated into one reduce */
        for (int step = 1; step <= 3; step++) {
            if (step > 1) {
                R_OK(ms_unit_set_requires_gradient_sync(all, step == 3));
                R_OK(ms_unit_set_requires_gradient_sync(one, step == 3));
                R_OK(ms_unit_unshard(all));
                R_OK(ms_unit_unshard(one));
                R_OK(ms_unit_wait(all));
                R_OK(ms_unit_wait(one));
            }
            write_grads(all, step, c->rank);
            if (train) {
                write_grad(one, 0, j, step, c->rank);
                R_CHECK(step == 3 || ms_unit_bytes(one, 3) == pbytes + gbytes); /* 3: + the accumulator */
            }
            R_OK(ms_unit_reduce_grads(all));
            R_OK(ms_unit_reduce_grads(one));
            R_OK(ms_unit_wait(all));
            R_OK(ms_unit_wait(one));
            if (step != 2) wrong += train && !same_bits(ms_unit_grad_shard(one, 0), ms_unit_grad_shard(all, j));
        }
        R_CHECK(ms_unit_bytes(one, 3) == 0);
        ms_unit_release(all);
        ms_unit_release(one);
    }
    R_CHECK(wrong == 0);
    if (c->rank == 0)
        printf("  W=%d R=%d  %-38s each parameter alone (in place where it can be) == in the full unit\n", W, sc->l.R,
               pol->name);
    ms_comm_release(shard);
    ms_comm_release(replicate);
}

/* ---------------------------------------------------------------- scenario: buffer cache */

/* One step: forward gather, reshard, backward regather, gradients, reduce. */
static void unit_step(ms_unit *u, int step, int r, int first, int n) {
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    R_OK(ms_unit_reshard(u));
    R_OK(ms_unit_unshard(u));
    R_OK(ms_unit_wait(u));
    for (int i = first; i < first + n; i++)
        if (specs[i].requires_grad) write_grad(u, i - first, i, step, r);
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
}

/* The rank's buffer cache: a step leaves its transient buffers cached (category 4), the next
 * step takes them all back (allocates nothing), another unit of the rank takes them over,
 * release_unsharded frees a unit's part, and a tensor the caller still holds is never
 * cached nor reused. */
static void cache(rank_ctx *c) {
    const policy *pol = &policies[0]; /* f32 stored, bf16 gather, f32 reduce */
    const int W = c->nranks;
    const int64_t ges = ms_dtype_size(gather_dtype(pol)), res = ms_dtype_size(reduce_dtype(pol));
    const int64_t flat = W * sum_padded(W, false) * ges, rflat = W * sum_padded(W, true) * res;
    const int64_t full = sum_full(false) * ges, gfull = sum_full(true) * ges;
    ms_unit *a = build_unit("a", pol, c->world, NULL, MS_RESHARD_FULL), *b = build_unit("b", pol, c->world, NULL, MS_RESHARD_FULL);
    ms_unit *w = build_unit_of("w", &policies[3], c->world, NULL, MS_RESHARD_FULL, 0, 1); /* f32 throughout: in place */
    if (!a || !b || !w) return;
    ms_unit *const units[3] = {a, b, w};
    R_CHECK(ms_unit_bytes(a, 4) == 0);
    check_allocated(units, 3, 0);

    /* a step leaves the gather buffer, the unsharded parameters and gradients and the reduce
     * buffer cached; the next step reuses every one of them */
    for (int step = 1; step <= 2; step++) {
        unit_step(a, step, c->rank, 0, NSPEC);
        R_CHECK(ms_unit_bytes(a, 3) == 0 && ms_unit_bytes(a, 4) == flat + full + gfull + rflat);
        check_allocated(units, 3, 0);
    }
    int64_t steady = -1;
    for (int step = 1; step <= 3; step++) {
        unit_step(w, step, c->rank, 0, 1);
        R_CHECK(ms_unit_bytes(w, 3) == 0 && ms_unit_bytes(w, 4) > 0);
        if (step > 1) R_CHECK(ms_unit_bytes(w, 4) == steady);
        steady = ms_unit_bytes(w, 4);
    }

    /* b (the same layout) takes a's buffers: the gather buffer and one of each shape */
    R_OK(ms_unit_unshard(b));
    R_OK(ms_unit_wait(b));
    R_CHECK(ms_unit_bytes(b, 3) == full && ms_unit_bytes(b, 4) == flat);
    R_CHECK(ms_unit_bytes(a, 4) == gfull + rflat);
    R_OK(ms_unit_release_unsharded(a));
    R_CHECK(ms_unit_bytes(a, 4) == 0 && ms_unit_bytes(b, 4) == flat);
    check_allocated(units, 3, 0);

    /* a parameter the caller holds on to keeps its memory: it is not cached when b reshards,
     * and a's gather does not write into it */
    ms_tensor *held = ms_unit_param_full(b, 0);
    ms_tensor_retain(held);
    ms_tensor *before = NULL;
    R_OK(ms_tensor_to(&before, held, ms_tensor_dtype(held)));
    const int64_t held_bytes = ms_tensor_nbytes(held);
    R_OK(ms_unit_reshard(b));
    R_CHECK(ms_unit_bytes(b, 3) == 0 && ms_unit_bytes(b, 4) == flat + full - held_bytes);
    check_allocated(units, 3, held_bytes); /* the caller's tensor is still allocated memory */
    R_OK(ms_unit_unshard(a));
    R_OK(ms_unit_wait(a));
    R_CHECK(ms_tensor_data(ms_unit_param_full(a, 0)) != ms_tensor_data(held));
    R_OK(ms_tensor_fill(ms_unit_param_full(a, 0), 0));
    R_CHECK(same_bits(held, before));
    R_CHECK(ms_unit_param_full(b, 0) == NULL); /* the state rule stands */
    ms_tensor_release(before);
    check_allocated(units, 3, held_bytes);
    ms_tensor_release(held);
    check_allocated(units, 3, 0);

    ms_unit_release(a);
    ms_unit_release(b);
    ms_unit_release(w);
    if (c->rank == 0) printf("  W=%d      steady state allocates nothing; shared, released and held buffers\n", W);
}

/* ---------------------------------------------------------------- scenario: shard offsets */

/* Unit parameter ui (spec spec_of[ui]) placed as torch.chunk written out and ms_fsdp_shard
 * say, its shard as many rows long; counts the empty shards into *empty. */
static void check_offsets(ms_unit *u, const int *spec_of, int n, int W, int q, int64_t *empty) {
    for (int ui = 0; ui < n; ui++) {
        const param_spec *p = &specs[spec_of[ui]];
        const int d = spec_dim(p);
        int dim = -1;
        int64_t off = -1, rows = -1, len, o, foff = -1, local[3], padded[3];
        R_OK(ms_unit_param_offset(u, ui, &dim, &off, &rows));
        chunk(p->shape[d], W, q, &len, &o);
        R_OK(ms_fsdp_shard(p->ndim, p->shape, W, q, p->dim, local, &foff, padded));
        R_CHECK(dim == d && off == o && rows == len && off == foff && rows == local[d]);
        R_CHECK(ms_tensor_size(ms_unit_param_shard(u, ui), d) == rows);
        *empty += rows == 0;
    }
}

/* ms_unit_param_offset for every spec that W allows (uneven and empty dim-0 shards,
 * Shard(1)), while building and after finalize, and its errors. */
static void param_offsets(rank_ctx *c) {
    const int W = c->nranks, q = c->rank;
    ms_unit *u = NULL;
    R_OK(ms_unit_new(&u, "offsets", c->world, NULL, -1, -1, MS_RESHARD_FULL));
    if (!u) return;
    int spec_of[NSPEC], n = 0;
    for (int i = 0; i < NSPEC; i++) {
        const param_spec *p = &specs[i];
        if (spec_dim(p) != 0 && p->shape[spec_dim(p)] % W) continue; /* Shard(1) needs W | size */
        R_OK(ms_unit_add_param(u, p->fqn, p->ndim, p->shape, MS_F32, p->dim, p->requires_grad));
        spec_of[n++] = i;
    }
    int64_t empty = 0;
    check_offsets(u, spec_of, n, W, q, &empty);
    R_OK(ms_unit_finalize(u));
    R_ERR(ms_unit_finalize(u), MS_ERR_STATE, "finalize: the unit is already finalized (it is sharded)");
    check_offsets(u, spec_of, n, W, q, &empty);
    R_ERR(ms_unit_param_offset(u, n, &(int){0}, &(int64_t){0}, &(int64_t){0}), MS_ERR_ARG, "no parameter");
    R_ERR(ms_unit_param_offset(u, 0, NULL, &(int64_t){0}, &(int64_t){0}), MS_ERR_ARG, "ms_unit_param_offset: dim is NULL");
    const double empties = world_sum(c, (double)empty) / 2;
    if (c->rank == 0) printf("  W=%d  shard offsets of %d parameters, %.0f empty shards\n", W, n, empties);
    ms_unit_release(u);
}

/* ---------------------------------------------------------------- scenario: errors */

static void errors(rank_ctx *c) {
    const policy *pol = &policies[0];
    ms_unit *u = build_unit("errs", pol, c->world, NULL, MS_RESHARD_FULL), *x = NULL;
    if (!u) return;
    const int64_t shape[2] = {4, 3};
    R_ERR(ms_unit_add_param(u, "late", 2, shape, MS_F32, 0, 1), MS_ERR_STATE, "unit 'errs': add_param 'late'");
    R_ERR(ms_unit_reduce_grads(u), MS_ERR_STATE, "no gradient was handed out");
    R_CHECK(ms_unit_param_full(u, 0) == NULL && strstr(ms_last_error(), "'errs': param_full: not allowed while the "
                                                                      "unit is sharded"));
    R_ERR(ms_unit_reshard(u), MS_ERR_STATE, "reshard");
    R_OK(ms_unit_unshard(u));
    R_ERR(ms_unit_unshard(u), MS_ERR_STATE, "unsharding (all_gather pending");
    R_ERR(ms_unit_adamw_step(u, 1e-3, 0.9, 0.999, 1e-8, 0, 1), MS_ERR_STATE, "adamw_step");
    R_OK(ms_unit_wait(u));
    R_OK(ms_unit_wait(u)); /* nothing pending: a no-op */
    R_ERR(ms_unit_unshard(u), MS_ERR_STATE, "'errs': unshard: not allowed while the unit is unsharded");
    R_CHECK(ms_unit_grad_full(u, 3) == NULL && strstr(ms_last_error(), "'layers.0.frozen' is frozen"));
    R_CHECK(ms_unit_grad_full(u, 99) == NULL && strstr(ms_last_error(), "no parameter 99"));
    R_ERR(ms_unit_load_full(u, 0, NULL), MS_ERR_ARG, "NULL");
    R_OK(ms_unit_release_unsharded(u));
    R_ERR(ms_unit_set_gradient_divide_factor(u, -2), MS_ERR_ARG, "divide factor");
    R_ERR(ms_unit_scale_grads(u, NAN), MS_ERR_ARG, "unit 'errs': scale_grads: scale nan: expected a finite scale");
    R_ERR(ms_unit_scale_grads(u, INFINITY), MS_ERR_ARG, "unit 'errs': scale_grads: scale inf: expected a finite scale");
    R_ERR(ms_unit_scale_grads(u, -INFINITY), MS_ERR_ARG, "scale -inf: expected a finite scale");
    R_ERR(ms_unit_record(u, 5, &(ms_record_kind){0}, &(ms_dtype){0}, &(int){0}, &(int64_t){0}), MS_ERR_ARG, "out of range");
    R_CHECK(ms_unit_bytes(u, 7) == -1);
    /* a unit released with its all_gather pending waits for it */
    R_OK(ms_unit_unshard(u));
    ms_unit_release(u);

    R_OK(ms_unit_new(&x, "mixed", c->world, NULL, -1, -1, MS_RESHARD_FULL));
    R_OK(ms_unit_set_cpu_offload(x, 1)); /* accepted on the host: every buffer is there already */
    R_OK(ms_unit_add_param(x, "a.weight", 2, shape, MS_F32, 0, 1));
    R_ERR(ms_unit_set_cpu_offload(x, 0), MS_ERR_STATE, "'mixed': set_cpu_offload: the unit already holds parameters");
    R_ERR(ms_unit_add_param(x, "b.weight", 2, shape, MS_BF16, 0, 1), MS_ERR_DTYPE,
          "'b.weight' is stored in bf16 but 'a.weight' is stored in f32");
    R_ERR(ms_unit_add_param(x, "a.weight", 2, shape, MS_F32, 0, 1), MS_ERR_ARG, "already in the unit");
    R_ERR(ms_unit_add_param(x, "scalar", 0, shape, MS_F32, 0, 1), MS_ERR_SHAPE, "scalar");
    R_ERR(ms_unit_add_param(x, "cols", 2, shape, MS_F32, 1, 1), MS_ERR_SHAPE, "not divisible"); /* 3 cols, W = 2 */
    ms_unit_release(x);
    x = NULL;
    R_OK(ms_unit_new(&x, "ints", c->world, NULL, -1, -1, MS_RESHARD_FULL));
    R_ERR(ms_unit_add_param(x, "ids", 2, shape, MS_I64, 0, 1), MS_ERR_DTYPE, "cannot require gradients");
    ms_unit_release(x);
    x = NULL;
    /* the root unit has the empty name: messages call it <root>, as the planner does */
    R_OK(ms_unit_new(&x, "", c->world, NULL, -1, -1, MS_RESHARD_FULL));
    R_ERR(ms_unit_scale_grads(x, NAN), MS_ERR_ARG, "unit '<root>': scale_grads: scale nan");
    ms_unit_release(x);
    x = NULL;
    R_ERR(ms_unit_new(&x, "k3", c->world, NULL, -1, -1, 3), MS_ERR_ARG, "reshard_after_forward 3");
    R_ERR(ms_unit_new(&x, "dt", c->world, NULL, MS_I32, -1, MS_RESHARD_FULL), MS_ERR_DTYPE,
          "unit 'dt': param_dtype i32 is not a floating dtype");
    R_ERR(ms_unit_new(&x, "dt", c->world, NULL, -1, 42, MS_RESHARD_FULL), MS_ERR_DTYPE,
          "unit 'dt': reduce_dtype 42 is not a dtype (a floating ms_dtype, or -1 for unset)");
    R_CHECK(x == NULL);
}

/* ---------------------------------------------------------------- frozen parameters of other dtypes */

/* A LoRA-like unit (param bf16, reduce f32): frozen bf16 base [9,4], trainable f32 adapter
 * [6,4], frozen i64 ids [7] (never cast), trainable f32 norm [5].  The gather dtypes differ
 * (bf16, bf16, i64, bf16), so the parameters travel as bytes, FSDP2's uint8 all-gather: each
 * rank's chunk is its padded shards' bytes in order.  Values are small integers and halves,
 * exact in every dtype, so every check is exact. */
enum { FM_N = 4 };
static const struct {
    const char *fqn;
    int ndim;
    int64_t shape[2];
    ms_dtype dtype;
    int requires_grad;
} fm[FM_N] = {{"a.base", 2, {9, 4}, MS_BF16, 0},
              {"a.lora", 2, {6, 4}, MS_F32, 1},
              {"a.ids", 1, {7}, MS_I64, 0},
              {"a.norm", 1, {5}, MS_F32, 1}};

static double fm_value(int j, int64_t e) { return j == 2 ? (double)(3 * e - 7) : (double)(e % 13) / 2 - 2 * j; }
static double fm_grad(int r, int64_t e) { return (double)(r + 1 + e % 11); }

typedef struct fm_case {
    layout l;
    bool ints; /* with the i64 ids: gathered as bytes; without: all in bf16, stored dtypes mixed */
} fm_case;

static void frozen_mixed(rank_ctx *c) {
    const fm_case *fc = c->arg;
    const layout *l = &fc->l;
    const int W = l->W, N = l->W * l->R, k = W == 4 ? 2 : MS_RESHARD_FULL;
    ms_comm *shard = NULL, *replicate = NULL;
    layout_comms(c, l, &shard, &replicate);
    ms_unit *u = NULL;
    R_OK(ms_unit_new(&u, "lora", shard, replicate, MS_BF16, MS_F32, k));
    ms_comm_release(shard);
    ms_comm_release(replicate);
    if (!u) return;
    int64_t chunk_bytes = 0, numel[FM_N];
    int slot[FM_N], n = 0; /* fm j is unit parameter slot[j], -1 when left out */
    for (int j = 0; j < FM_N; j++) {
        slot[j] = -1;
        if (j == 2 && !fc->ints) continue;
        slot[j] = n++;
        R_OK(ms_unit_add_param(u, fm[j].fqn, fm[j].ndim, fm[j].shape, fm[j].dtype, 0, fm[j].requires_grad));
        numel[j] = fm[j].ndim == 2 ? fm[j].shape[0] * fm[j].shape[1] : fm[j].shape[0];
        const int64_t rows = (fm[j].shape[0] + W - 1) / W, per_row = fm[j].ndim == 2 ? fm[j].shape[1] : 1;
        chunk_bytes += rows * per_row * (fm[j].dtype == MS_I64 ? 8 : 2); /* f32 and bf16 gather in bf16 */
    }
    /* a second trainable dtype is refused, frozen ones are not */
    R_ERR(ms_unit_add_param(u, "a.half", 1, (int64_t[]){4}, MS_F16, 0, 1), MS_ERR_DTYPE,
          "'a.half' is stored in f16 but 'a.lora' is stored in f32: FSDP expects uniform original parameter dtype "
          "of the trainable parameters");
    int nd = 0, rg = 0;
    int64_t shape[MS_MAX_DIMS];
    ms_dtype stored, gather, reduce;
    R_ERR(ms_unit_param_info(u, 0, &nd, shape, &stored, &gather, &rg), MS_ERR_STATE,
          "not allowed while the unit is building");
    R_OK(ms_unit_finalize(u));
    /* what the host's forward sees: shapes and dtypes as given, each gathered in the param
     * dtype when floating (an integer one as stored), reduced in f32 */
    for (int j = 0; j < FM_N; j++) {
        if (slot[j] < 0) continue;
        R_OK(ms_unit_param_info(u, slot[j], &nd, shape, &stored, &gather, &rg));
        R_CHECK(nd == fm[j].ndim && !memcmp(shape, fm[j].shape, (size_t)nd * sizeof *shape) && stored == fm[j].dtype &&
                gather == (fm[j].dtype == MS_I64 ? MS_I64 : MS_BF16) && rg == fm[j].requires_grad);
    }
    R_OK(ms_unit_reduce_dtype(u, &reduce));
    R_CHECK(reduce == MS_F32);
    R_ERR(ms_unit_param_info(u, n, &nd, shape, &stored, &gather, &rg), MS_ERR_ARG, "no parameter");
    for (int j = 0; j < FM_N; j++) {
        if (slot[j] < 0) continue;
        ms_tensor *full = NULL;
        R_OK(ms_tensor_new(&full, fm[j].ndim, fm[j].shape, MS_F64, MS_DEVICE_CPU, 0));
        for (int64_t e = 0; e < numel[j]; e++) ((double *)ms_tensor_data(full))[e] = fm_value(j, e);
        R_OK(ms_unit_load_full(u, slot[j], full));
        ms_tensor_release(full);
    }
    for (int pass = 0; pass < 2; pass++) { /* the second gather runs from the k-way shard when k = 2 */
        ms_unit_clear_records(u);
        R_OK(ms_unit_unshard(u));
        R_OK(ms_unit_wait(u));
        const int64_t want[1][3] = {{0, pass && k > 1 ? k : W, W * chunk_bytes}};
        check_records(u, 1, want, (ms_dtype[]){fc->ints ? MS_U8 : MS_BF16, MS_F32, MS_F32});
        int bad = 0;
        for (int j = 0; j < FM_N; j++) {
            if (slot[j] < 0) continue;
            ms_tensor *full = ms_unit_param_full(u, slot[j]), *f64 = full ? as_f64(full) : NULL;
            R_CHECK(full && ms_tensor_dtype(full) == (fm[j].dtype == MS_I64 ? MS_I64 : MS_BF16));
            for (int64_t e = 0; f64 && e < numel[j]; e++) bad += ((double *)ms_tensor_data(f64))[e] != fm_value(j, e);
            ms_tensor_release(f64);
        }
        R_CHECK(bad == 0);
        if (pass == 0) R_OK(ms_unit_reshard(u));
    }
    R_CHECK(ms_unit_grad_full(u, 0) == NULL && strstr(ms_last_error(), "'a.base' is frozen"));
    for (int j = 1; j < FM_N; j += 2) {
        ms_tensor *g = ms_unit_grad_full(u, slot[j]), *vals = NULL;
        R_CHECK(g && ms_tensor_dtype(g) == MS_BF16);
        if (!g) continue;
        R_OK(ms_tensor_new(&vals, fm[j].ndim, fm[j].shape, MS_F64, MS_DEVICE_CPU, 0));
        for (int64_t e = 0; e < numel[j]; e++) ((double *)ms_tensor_data(vals))[e] = fm_grad(c->rank, e);
        R_OK(ms_tensor_copy(g, vals));
        ms_tensor_release(vals);
    }
    R_OK(ms_unit_reduce_grads(u));
    R_OK(ms_unit_wait(u));
    /* the mean over the N ranks: e % 11 + 1 + (N - 1) / 2, exact */
    int bad = 0;
    for (int j = 1; j < FM_N; j += 2) {
        int dim = 0;
        int64_t off = 0, rows = 0;
        R_OK(ms_unit_param_offset(u, slot[j], &dim, &off, &rows));
        ms_tensor *gs = ms_unit_grad_shard(u, slot[j]), *f64 = gs ? as_f64(gs) : NULL;
        R_CHECK(gs != NULL);
        const int64_t per_row = fm[j].ndim == 2 ? fm[j].shape[1] : 1;
        for (int64_t e = 0; f64 && e < rows * per_row; e++)
            bad += ((double *)ms_tensor_data(f64))[e] != (double)((off * per_row + e) % 11 + 1) + (N - 1) / 2.0;
        ms_tensor_release(f64);
    }
    R_CHECK(bad == 0);
    R_CHECK(ms_unit_grad_shard(u, 0) == NULL && (!fc->ints || ms_unit_grad_shard(u, 2) == NULL));
    LOCKED(if (c->rank == 0) printf("  W=%d R=%d k=%d: %lld bytes a rank gathered as %s, exact\n", W, l->R, k,
                                    (long long)chunk_bytes, fc->ints ? "u8" : "bf16"));
    ms_unit_release(u);
}

/* Ranks that disagree on the unit's layout: the all_gather fails with a mismatch on the
 * communication thread; the message comes back through the ticket and the unit is unusable. */
static void failed_collective(rank_ctx *c) {
    ms_unit *u = NULL;
    const int64_t shape[2] = {4 + 2 * c->rank, 3};
    R_OK(ms_unit_new(&u, "bad", c->world, NULL, -1, -1, MS_RESHARD_FULL));
    R_OK(ms_unit_add_param(u, "w", 2, shape, MS_F32, 0, 1));
    R_OK(ms_unit_finalize(u));
    R_OK(ms_unit_unshard(u));
    R_ERR(ms_unit_wait(u), MS_ERR_MISMATCH, "unit 'bad': unshard: all_gather on group [0 1]: ranks disagree");
    R_ERR(ms_unit_unshard(u), MS_ERR_STATE, "unusable after a failed collective");
    R_CHECK(ms_unit_bytes(u, 3) == 0);
    ms_unit_release(u);
}

/* ---------------------------------------------------------------- main */

int main(void) {
    const layout layouts[] = {{1, 1}, {2, 1}, {3, 1}, {4, 1}, {2, 2}};
    printf("two steps (a, b, c, g, i, j):\n");
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
        for (int p = 0; p < NPOLICY; p++) {
            const scenario sc = {layouts[l], &policies[p]};
            run_ranks(layouts[l].W * layouts[l].R, two_steps, &sc);
        }
    printf("sync off (d):\n");
    for (size_t l = 1; l < sizeof layouts / sizeof layouts[0]; l++) {
        const scenario sc = {layouts[l], &policies[1]};
        run_ranks(layouts[l].W * layouts[l].R, sync_off, &sc);
    }
    run_ranks(1, sync_off_rounding, NULL);
    refdata *sync_ref = refdata_load("fsdp2_sync_off.txt");
    run_ranks(2, sync_off_torch, sync_ref);
    refdata_free(sync_ref);
    printf("reshard modes (e):\n");
    const scenario four = {{4, 1}, &policies[0]};
    run_ranks(4, reshard_modes, &four);
    printf("AdamW (f):\n");
    const scenario adam[] = {{{3, 1}, &policies[1]}, {{2, 2}, &policies[1]}, {{2, 1}, &policies[0]}};
    for (int i = 0; i < 3; i++) run_ranks(adam[i].l.W * adam[i].l.R, adamw, &adam[i]);
    static const policy torch_pols[] = {{"bf16 stored, f32 reduce", MS_BF16, -1, MS_F32, 0},
                                        {"f16 stored, f32 reduce", MS_F16, -1, MS_F32, 0},
                                        {"f64 stored", MS_F64, -1, -1, 0},
                                        {"f32 stored, bf16 gather", MS_F32, MS_BF16, -1, 0}};
    const scenario tadam[] = {{{3, 1}, &torch_pols[0]}, {{2, 2}, &torch_pols[1]}, {{2, 1}, &torch_pols[2]},
                              {{4, 1}, &torch_pols[3]}};
    for (int i = 0; i < 4; i++) run_ranks(tadam[i].l.W * tadam[i].l.R, adamw_torch, &tadam[i]);
    printf("AdamW checkpoints:\n");
    const ckpt_case ckpts[] = {{{3, 1}, &policies[1], MS_ADAMW_MASTER},
                               {{2, 2}, &policies[1], MS_ADAMW_TORCH},
                               {{2, 1}, &policies[0], MS_ADAMW_MASTER}};
    for (int i = 0; i < 3; i++) run_ranks(ckpts[i].l.W * ckpts[i].l.R, checkpoint, &ckpts[i]);
    printf("no gradient (set_to_none):\n");
    const scenario nog[] = {{{2, 1}, &policies[0]}, {{2, 2}, &policies[1]}, {{3, 1}, &policies[2]}};
    for (int i = 0; i < 3; i++) run_ranks(nog[i].l.W * nog[i].l.R, no_grad, &nog[i]);
    printf("gradient divide factors:\n");
    const divide_case dcs[] = {{{3, 2}, 0}, {{3, 2}, 3}, {{3, 2}, 6}, {{3, 2}, 5}, {{3, 1}, 3}, {{3, 1}, 0},
                               {{1, 2}, 3}, {{1, 2}, 0}};
    for (size_t i = 0; i < sizeof dcs / sizeof dcs[0]; i++) run_ranks(dcs[i].l.W * dcs[i].l.R, divide_factors, &dcs[i]);
    printf("one parameter per unit, in place:\n");
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++)
        for (int p = 0; p < NPOLICY; p++) {
            const scenario sc = {layouts[l], &policies[p]};
            run_ranks(layouts[l].W * layouts[l].R, one_param, &sc);
        }
    printf("buffer cache:\n");
    for (int n = 1; n <= 3; n++) run_ranks(n, cache, NULL);
    printf("shard offsets:\n");
    for (int n = 1; n <= MAX_RANKS; n++) run_ranks(n, param_offsets, NULL);
    printf("frozen parameters of other dtypes (gathered as bytes):\n");
    const fm_case fml[] = {{{1, 1}, true}, {{3, 1}, true}, {{4, 1}, true}, {{2, 2}, true},
                           {{1, 1}, false}, {{3, 1}, false}, {{4, 1}, false}, {{2, 2}, false}};
    for (size_t i = 0; i < sizeof fml / sizeof fml[0]; i++)
        run_ranks(fml[i].l.W * fml[i].l.R, frozen_mixed, &fml[i]);
    printf("errors (h):\n");
    run_ranks(2, errors, NULL);
    run_ranks(2, failed_collective, NULL);
    return check_summary("test_unit");
}
