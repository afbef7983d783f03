/*
 * bench_packed.c: FP32 islands packed into their layer's unit against islands as units of
 * their own, stepped in the same run (docs/performance.md).
 *
 * A layer of the inkling2 shape: one large weight block [4H, H] stored in bf16 and gathered
 * in bf16, a norm [H] in bf16, and five small fp32 islands (two residual queries [H], two
 * L2-clip scales [H], the router gate [16, H]) gathered and reduced in fp32; the compute
 * policy reduces in f32.  L such layers are stepped two ways:
 *   separate  the seed's plan: each island a unit of its own with the fp32 policy, then the
 *             layer's unit (6 units a layer: 6 all-gathers in forward, 6 in backward, 6
 *             reduce-scatters)
 *   packed    one packed unit a layer (ms_unit_set_packed, the islands' parameters with
 *             their own fp32 policy: 1 all-gather of bytes each way, 1 reduce-scatter)
 * One step: forward, for each layer its units unsharded (all started, then waited) and
 * resharded; backward, last layer first, unsharded again, every gradient handed out (zeroed)
 * and reduced; every reduce waited for; AdamW on every unit (f32 master weights for the
 * bf16 parameters).  No model compute: the step is what the units themselves cost, so the
 * ratio shows what the islands' collectives cost per call.  The two ways alternate trial by
 * trial (separate, packed, packed, separate, ...), each trial `steps` steps between
 * barriers; printed: collectives per step, min / median / max step times, and the ratio
 * packed / separate of each pair of trials (target <= 0.7 where the islands' collectives
 * are latency bound: small H).  The two ways' parameters end bit for bit the same
 * (tests/lua/packed_units_spec.lua checks it); this checks their checksums agree too.
 *
 *   build/bench/bench_packed [-n RANKS] [-H H,...] [-L LAYERS] [-s STEPS] [-t TRIALS]
 *   mpirun --allow-run-as-root -np 2 build/bench/bench_packed --mpi [...]
 */
#include "bench.h"
#include "bench_args.h"
#include "moonshard.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANKS 16
#define MAX_LAYERS 64
#define MAX_TRIALS 64
#define MAX_LIST 8
#define MAX_H 8192
enum { NPARAM = 7, NISLAND = 5, GATE_ROWS = 16, MAX_UNITS = NISLAND + 1 };

static const char USAGE[] =
    "usage: bench_packed [-n RANKS | --mpi] [-H H,...] [-L LAYERS] [-s STEPS] [-t TRIALS]\n"
    "  layers of one bf16 block [4H, H] and five fp32 islands stepped with the islands as units of\n"
    "  their own and packed into the layer's unit, interleaved over the trials: collectives per\n"
    "  step, step times min / median / max and the ratio packed / separate (target <= 0.7 where\n"
    "  the islands' collectives are latency bound).\n"
    "  -n RANKS  ranks as threads, an integer 1.." BENCH_STR(MAX_RANKS) " (default 2)\n"
    "  --mpi     ranks as the MPI processes of mpirun -np N (moonshard built with MPI)\n"
    "  -H H,...  hidden sizes, up to " BENCH_STR(MAX_LIST) " integers 16.." BENCH_STR(MAX_H) " (default 128,512,2048)\n"
    "  -L N      layers, an integer 1.." BENCH_STR(MAX_LAYERS) " (default 4)\n"
    "  -s N      steps a trial, an integer 1..100 (default 3)\n"
    "  -t N      trials of each way, an integer 1.." BENCH_STR(MAX_TRIALS) " (default 7)\n";

typedef struct cfg {
    int n, layers, steps, trials, nh;
    double hs[MAX_LIST];
    bool mpi;
} cfg;

/* fqn suffix, rows (in H; 0: GATE_ROWS), cols (in H; 0: 1-D), stored, island */
static const struct {
    const char *name;
    int rows_h, cols_h;
    ms_dtype dtype;
    bool island;
} PARAMS[NPARAM] = {
    {"attn_query.query", 1, 0, MS_F32, true}, {"qkvr.weight", 4, 1, MS_BF16, false},
    {"q_l2_clip.scale", 1, 0, MS_F32, true},  {"rel_l2_clip.scale", 1, 0, MS_F32, true},
    {"mlp_query.query", 1, 0, MS_F32, true},  {"mlp_norm.weight", 1, 0, MS_BF16, false},
    {"gate.weight", 0, 1, MS_F32, true},
};

static int my_rank_for_messages;

static void must(ms_status st, const char *what) {
    if (st == MS_OK) return;
    fprintf(stderr, "bench_packed (rank %d): %s: %s: %s\n", my_rank_for_messages, what, ms_status_name(st),
            ms_last_error());
    exit(1);
}

/* A number from parameter i's name: its values and gradients, the same in either unit. */
static unsigned name_seed(const ms_unit *u, int i) {
    unsigned seed = 0;
    for (const char *q = ms_unit_param_fqn(u, i); *q; q++) seed = seed * 31 + (unsigned char)*q;
    return seed;
}

typedef struct layer {
    ms_unit *u[MAX_UNITS];
    int nu;
} layer;

/* Layer l's units on comm c: packed (one) or separate (the islands, then the layer). */
static void build(layer *ly, ms_comm *c, int l, int64_t H, bool packed) {
    char name[128], fqn[160];
    memset(ly, 0, sizeof *ly);
    snprintf(name, sizeof name, "model.layers.%d", l);
    ms_unit *main_u = NULL;
    must(ms_unit_new(&main_u, name, c, NULL, MS_BF16, MS_F32, MS_RESHARD_FULL), "unit_new");
    if (packed) must(ms_unit_set_packed(main_u, 1), "set_packed");
    for (int i = 0; i < NPARAM; i++) {
        int64_t shape[2] = {PARAMS[i].rows_h ? PARAMS[i].rows_h * H : GATE_ROWS, H};
        const int nd = PARAMS[i].cols_h ? 2 : 1;
        snprintf(fqn, sizeof fqn, "%s.%s", name, PARAMS[i].name);
        ms_unit *u = main_u;
        if (PARAMS[i].island && !packed) {
            char island[160];
            snprintf(island, sizeof island, "model.layers.%d.%.*s", l,
                     (int)(strrchr(PARAMS[i].name, '.') - PARAMS[i].name), PARAMS[i].name);
            must(ms_unit_new(&u, island, c, NULL, MS_F32, MS_F32, MS_RESHARD_FULL), "unit_new");
            ly->u[ly->nu++] = u;
        }
        must(ms_unit_add_param(u, fqn, nd, shape, PARAMS[i].dtype, 0, 1), "add_param");
        if (PARAMS[i].island && packed)
            must(ms_unit_set_param_policy(u, ms_unit_param_count(u) - 1, MS_F32, MS_F32), "set_param_policy");
        if (u != main_u) must(ms_unit_finalize(u), "finalize");
    }
    must(ms_unit_finalize(main_u), "finalize");
    ly->u[ly->nu++] = main_u;
    /* the same values either way: each parameter's from its name */
    for (int k = 0; k < ly->nu; k++)
        for (int i = 0; i < ms_unit_param_count(ly->u[k]); i++) {
            ms_tensor *s = ms_unit_param_shard(ly->u[k], i);
            int64_t n = ms_tensor_numel(s);
            ms_tensor *f = NULL;
            must(ms_tensor_new(&f, 1, &n, MS_F32, MS_DEVICE_CPU, 0), "tensor_new");
            float *v = ms_tensor_data(f);
            const unsigned seed = name_seed(ly->u[k], i);
            for (int64_t j = 0; j < n; j++) v[j] = (float)((int64_t)((j * 37 + seed) % 19) - 9) / 64.0f;
            ms_tensor *flat = NULL;
            must(ms_tensor_view(&flat, s, 1, &n), "view");
            must(ms_tensor_copy(flat, f), "copy");
            ms_tensor_release(flat);
            ms_tensor_release(f);
        }
}

static void step(layer *ls, int L, int64_t t) {
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_unshard(ls[l].u[k]), "unshard");
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_wait(ls[l].u[k]), "wait");
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_reshard(ls[l].u[k]), "reshard");
    }
    for (int l = L - 1; l >= 0; l--) {
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_unshard(ls[l].u[k]), "unshard");
        for (int k = 0; k < ls[l].nu; k++) {
            ms_unit *u = ls[l].u[k];
            must(ms_unit_wait(u), "wait");
            for (int i = 0; i < ms_unit_param_count(u); i++) {
                ms_tensor *g = ms_unit_grad_full(u, i);
                if (!g) must(MS_ERR_STATE, "grad_full");
                /* a gradient of a few nonzero values: the reduce and AdamW see real numbers */
                ms_tensor *one = NULL;
                must(ms_tensor_narrow(&one, g, 0, 0, 1), "narrow");
                must(ms_tensor_fill(one, 0.001 * (double)(name_seed(u, i) % 7 + 1)), "fill");
                ms_tensor_release(one);
            }
            must(ms_unit_reduce_grads(u), "reduce_grads");
        }
    }
    for (int l = 0; l < L; l++)
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_wait(ls[l].u[k]), "wait");
    for (int l = 0; l < L; l++)
        for (int k = 0; k < ls[l].nu; k++) must(ms_unit_adamw_step(ls[l].u[k], 1e-3, 0.9, 0.999, 1e-8, 0.01, t), "adamw");
}

typedef struct rank_arg {
    ms_world *w;
    int rank;
    const cfg *c;
    double sep[MAX_LIST][MAX_TRIALS], pk[MAX_LIST][MAX_TRIALS]; /* seconds a step */
    int coll_sep[MAX_LIST], coll_pk[MAX_LIST];
    uint64_t sum_sep[MAX_LIST], sum_pk[MAX_LIST];
} rank_arg;

static int collectives(layer *ls, int L) {
    int n = 0;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < ls[l].nu; k++) n += ms_unit_record_count(ls[l].u[k]);
    return n;
}

/* A hash of every parameter's shard bytes, in PARAMS order whichever unit holds it. */
static uint64_t checksum(layer *ls, int L) {
    uint64_t h = 1469598103934665603ull;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < NPARAM; i++)
            for (int k = 0; k < ls[l].nu; k++)
                for (int j = 0; j < ms_unit_param_count(ls[l].u[k]); j++) {
                    const char *fqn = ms_unit_param_fqn(ls[l].u[k], j);
                    const size_t a = strlen(fqn), b = strlen(PARAMS[i].name);
                    if (a < b || strcmp(fqn + a - b, PARAMS[i].name)) continue;
                    ms_tensor *s = ms_unit_param_shard(ls[l].u[k], j);
                    const unsigned char *d = ms_tensor_data(s);
                    for (int64_t x = 0; d && x < ms_tensor_nbytes(s); x++) h = (h ^ d[x]) * 1099511628211ull;
                }
    return h;
}

static void *run_rank(void *p) {
    rank_arg *a = p;
    const cfg *c = a->c;
    my_rank_for_messages = a->rank;
    ms_comm *comm = NULL;
    must(ms_world_comm(a->w, a->rank, &comm), "world_comm");
    static layer sep_l[MAX_RANKS][MAX_LAYERS], pk_l[MAX_RANKS][MAX_LAYERS];
    layer *S = sep_l[c->mpi ? 0 : a->rank], *P = pk_l[c->mpi ? 0 : a->rank];
    for (int h = 0; h < c->nh; h++) {
        const int64_t H = (int64_t)c->hs[h];
        for (int l = 0; l < c->layers; l++) {
            build(&S[l], comm, l, H, false);
            build(&P[l], comm, l, H, true);
        }
        int64_t t[2] = {0, 0};
        for (int w = 0; w < 2; w++) { /* warm-up: the buffer caches fill */
            step(w ? P : S, c->layers, ++t[w]);
        }
        for (int k = 0; k < 2; k++)
            for (int l = 0; l < c->layers; l++)
                for (int q = 0; q < (k ? P : S)[l].nu; q++) ms_unit_clear_records((k ? P : S)[l].u[q]);
        for (int trial = 0; trial < c->trials; trial++)
            for (int o = 0; o < 2; o++) {
                const int way = (trial + o) % 2; /* S P, P S, ... */
                layer *ls = way ? P : S;
                must(ms_barrier(comm), "barrier");
                const double t0 = now_s();
                for (int s = 0; s < c->steps; s++) step(ls, c->layers, ++t[way]);
                must(ms_barrier(comm), "barrier");
                (way ? a->pk : a->sep)[h][trial] = (now_s() - t0) / c->steps;
            }
        const int64_t steps_each = (int64_t)c->trials * c->steps;
        a->coll_sep[h] = (int)(collectives(S, c->layers) / steps_each);
        a->coll_pk[h] = (int)(collectives(P, c->layers) / steps_each);
        a->sum_sep[h] = checksum(S, c->layers);
        a->sum_pk[h] = checksum(P, c->layers);
        for (int l = 0; l < c->layers; l++)
            for (int k = 0; k < MAX_UNITS; k++) {
                ms_unit_release(S[l].u[k]);
                ms_unit_release(P[l].u[k]);
            }
    }
    ms_comm_release(comm);
    return NULL;
}

static void report(const cfg *c, const char *backend, int n, rank_arg *a, bool same) {
    printf("bench_packed: %s, %d ranks, %d layers, %d steps a trial, %d trials each way (seconds a step)\n", backend,
           n, c->layers, c->steps, c->trials);
    printf("%6s %10s %14s %30s %30s %22s\n", "H", "block MiB", "collectives", "separate min/med/max ms",
           "packed min/med/max ms", "packed/separate");
    for (int h = 0; h < c->nh; h++) {
        double s[MAX_TRIALS], p[MAX_TRIALS], r[MAX_TRIALS];
        for (int t = 0; t < c->trials; t++) {
            s[t] = a->sep[h][t] * 1e3;
            p[t] = a->pk[h][t] * 1e3;
            r[t] = a->pk[h][t] / a->sep[h][t];
        }
        const double ms_ = median(s, c->trials), mp = median(p, c->trials), mr = median(r, c->trials);
        char cs[32], ss[64], ps[64], rs[64];
        snprintf(cs, sizeof cs, "%d / %d", a->coll_pk[h], a->coll_sep[h]);
        snprintf(ss, sizeof ss, "%.3f / %.3f / %.3f", s[0], ms_, s[c->trials - 1]);
        snprintf(ps, sizeof ps, "%.3f / %.3f / %.3f", p[0], mp, p[c->trials - 1]);
        snprintf(rs, sizeof rs, "%.2f / %.2f / %.2f", r[0], mr, r[c->trials - 1]);
        const double H = c->hs[h];
        printf("%6.0f %10.2f %14s %30s %30s %22s\n", H, 4 * H * H * 2 / 1048576.0, cs, ss, ps, rs);
    }
    printf("collectives: a step's, packed / separate; ratio target <= 0.7 where the islands are latency bound\n");
    printf("parameters after the run: %s\n", same ? "the same bits both ways" : "DIFFERENT (a bug)");
}

int main(int argc, char **argv) {
    cfg c = {.n = 2, .layers = 4, .steps = 3, .trials = 7, .nh = 3, .hs = {128, 512, 2048}};
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    if (!r) r = getenv("PMI_RANK");
    bench_quiet = r && strcmp(r, "0");
    bench_args("bench_packed", USAGE, argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "-n")) c.n = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_RANKS);
        else if (!strcmp(opt, "--mpi")) c.mpi = true;
        else if (!strcmp(opt, "-H")) c.nh = bench_list(opt, bench_value(argc, argv, &i), c.hs, MAX_LIST, 16, MAX_H, true);
        else if (!strcmp(opt, "-L")) c.layers = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_LAYERS);
        else if (!strcmp(opt, "-s")) c.steps = (int)bench_int(opt, bench_value(argc, argv, &i), 1, 100);
        else if (!strcmp(opt, "-t")) c.trials = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_TRIALS);
        else bench_fail("unknown argument '%s'; expected -n, --mpi, -H, -L, -s or -t", opt);
    }
    for (int h = 0; h < c.nh; h++)
        if ((int64_t)c.hs[h] % 16) bench_fail("-H %g: expected a multiple of 16", c.hs[h]);
    ms_world *w = NULL;
    static rank_arg args[MAX_RANKS];
    bool same = true;
    if (c.mpi) {
        must(ms_mpi_world_new(&w, 0), "mpi_world_new");
        const int rank = r ? atoi(r) : 0;
        args[0] = (rank_arg){.w = w, .rank = rank, .c = &c};
        run_rank(&args[0]);
        for (int h = 0; h < c.nh; h++) same &= args[0].sum_sep[h] == args[0].sum_pk[h];
        if (rank == 0) report(&c, "mpi", ms_world_size(w), &args[0], same);
    } else {
        must(ms_threads_world_new(&w, c.n, 0), "threads_world_new");
        pthread_t th[MAX_RANKS];
        for (int k = 0; k < c.n; k++) {
            args[k] = (rank_arg){.w = w, .rank = k, .c = &c};
            if (pthread_create(&th[k], NULL, run_rank, &args[k])) bench_fail("cannot start rank %d's thread", k);
        }
        for (int k = 0; k < c.n; k++) pthread_join(th[k], NULL);
        for (int k = 0; k < c.n; k++)
            for (int h = 0; h < c.nh; h++) same &= args[k].sum_sep[h] == args[k].sum_pk[h];
        report(&c, "threads", c.n, &args[0], same);
    }
    ms_world_release(w);
    return same ? 0 : 1;
}
