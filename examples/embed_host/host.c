/*
 * host.c: a minimal host application driving moonshard through its embedding API.
 *
 *   embed_host N CONFIG POLICY [MESH]   e.g. embed_host 4 inkling2_small.json policies/inkling2
 *
 * Runs N ranks as threads.  Each rank makes an interpreter, describes the model with a
 * config.json, plans it on MESH (default dp_shard=N) with the policy, materialises its
 * shard units, and gathers and releases every unit it holds (the plan's and, with expert
 * parallelism, the ep-local ones the plan does not count) the way a trainer's forward
 * would.  Prints one line per rank with the units held, the plan's unit count and the
 * parameters gathered; exits non-zero on any error.
 */
#include <moonshard.h>
#include <moonshard_embed.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    ms_world *world;
    int rank, n;
    const char *config, *policy, *mesh;
    int ok;
} rank_arg;

#define TRY(call)                                                                          \
    do {                                                                                   \
        ms_status st_ = (call);                                                            \
        if (st_) {                                                                         \
            fprintf(stderr, "rank %d: %s failed: %s: %s\n", a->rank, #call, ms_status_name(st_), \
                    ms_last_error());                                                      \
            goto done;                                                                     \
        }                                                                                  \
    } while (0)

static void *rank_main(void *p) {
    rank_arg *a = p;
    ms_comm *world = NULL;
    ms_interp *in = NULL;
    char mesh[256];
    if (a->mesh) snprintf(mesh, sizeof mesh, "%s", a->mesh);
    else snprintf(mesh, sizeof mesh, "dp_shard=%d", a->n);
    TRY(ms_world_comm(a->world, a->rank, &world));
    TRY(ms_interp_new(&in, world));
    TRY(ms_interp_model_config(in, a->config));
    int planned = 0;
    TRY(ms_interp_plan(in, mesh, a->policy, &planned));
    TRY(ms_interp_materialize(in));
    /* every unit this rank holds: the plan's, then the ep-local ones */
    const int units = ms_interp_unit_count(in);
    int64_t gathered = 0;
    for (int i = 0; i < units; i++) {
        ms_unit *u = ms_interp_unit(in, i);
        if (!u) TRY(MS_ERR_STATE); /* ms_last_error() says why */
        TRY(ms_unit_unshard(u));
        TRY(ms_unit_wait(u));
        for (int k = 0; k < ms_unit_param_count(u); k++) gathered += ms_tensor_numel(ms_unit_param_full(u, k));
        TRY(ms_unit_release_unsharded(u));
    }
    int ui, pi, ahead_fwd, ahead_bwd;
    TRY(ms_interp_find_param(in, "model.layers.0.mlp.gate.weight", &ui, &pi));
    TRY(ms_interp_prefetch(in, &ahead_fwd, &ahead_bwd));
    printf("rank %d: %d units (%d planned, %d ep-local), %lld parameters gathered, mlp.gate of layer 0 in unit %d "
           "(%s), prefetch %d/%d\n",
           a->rank, units, planned, units - planned, (long long)gathered, ui, ms_unit_name(ms_interp_unit(in, ui)),
           ahead_fwd, ahead_bwd);
    a->ok = 1;
done:
    ms_interp_free(in);
    ms_world_rank_done(a->world, a->rank, !a->ok);
    ms_comm_release(world);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: embed_host N CONFIG POLICY [MESH]\n");
        return 2;
    }
    int n = atoi(argv[1]);
    if (n < 1 || n > 64) {
        fprintf(stderr, "embed_host: N must be 1..64\n");
        return 2;
    }
    ms_world *w;
    if (ms_threads_world_new(&w, n, 0)) {
        fprintf(stderr, "embed_host: %s\n", ms_last_error());
        return 1;
    }
    pthread_t tid[64];
    rank_arg args[64];
    for (int r = 0; r < n; r++) {
        args[r] = (rank_arg){.world = w, .rank = r, .n = n, .config = argv[2], .policy = argv[3],
                           .mesh = argc == 5 ? argv[4] : NULL};
        pthread_create(&tid[r], NULL, rank_main, &args[r]);
    }
    int ok = 1;
    for (int r = 0; r < n; r++) {
        pthread_join(tid[r], NULL);
        ok &= args[r].ok;
    }
    ms_world_release(w);
    return ok ? 0 : 1;
}
