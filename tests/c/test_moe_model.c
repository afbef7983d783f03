/*
 * test_moe_model.c: the MoE character model of examples/moe_trainer (model.c, data.c)
 * against values computed another way.
 *
 *  1. gradients: on a tiny config with sizes that are all different (so a transposed index
 *     cannot hide), every element of every trainable tensor: the fp32 analytic gradient
 *     against central differences of an independent double-precision forward written here
 *     from the equations of model.h. The error of a tensor is max |analytic - numeric| /
 *     max |numeric| over its elements. Perturbations that change any top-k choice are
 *     skipped and counted (the loss is not differentiable there); the baseline is checked
 *     to be far from a tie (its smallest selection margin is printed). The fp32 forward loss
 *     and routing must match the reference too. The correction bias gets NULL gradients:
 *     backward must not touch it.
 *  2. training: 100 Adam steps on the GPL-3 text at the default config; the loss falls.
 *  3. determinism: the same seed gives bit-identical losses and parameters.
 *  4. data parallel: a global batch split by rows over 2 ranks (run concurrently as
 *     threads, each with its own workspace) and the two gradients averaged == the
 *     full-batch gradient to fp32 rounding; each rank's gradient == the same rank run alone.
 *  5. stages: forward and backward stage by stage (embed, layers, head), each given only
 *     its own parameters and gradients (the others NULL, as when a host unshards one unit
 *     at a time) == model_forward + model_backward, bit for bit.
 *  6. a pipeline of two stages (embed + layer 0, then layer 1 + head), each on its own
 *     workspace filled with NaN first, the activation entering layer 1 and the gradient
 *     leaving it copied between them (model_layer_input, model_resid_grad) == the whole
 *     model, bit for bit; and two micro-batches of half the rows: the mean of their mean
 *     losses and of their gradients == the whole batch's, to fp32 rounding.
 *
 * MOONSHARD_TEST_QUICK=1 (sanitizer builds) trains on 2 rows a step instead of 8.
 *
 * Build by hand (from the repository root):
 *   gcc -std=c11 -O2 -Wall -Wextra -Werror -D_GNU_SOURCE -Icore/include -Itests/c \
 *       -Iexamples/moe_trainer tests/c/test_moe_model.c examples/moe_trainer/model.c \
 *       examples/moe_trainer/data.c -o test_moe_model -lm -pthread
 */
#include "check.h"
#include "data.h"
#include "model.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// helpers

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_uniform(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

// A model's parameters and gradients in flat arrays, with the per-tensor pointers.
typedef struct {
    ModelConfig cfg;
    int nparams;
    ModelParam *table; // (nparams)
    size_t numel;
    float *params;     // (numel)
    float *grads;      // (numel)
    float **pp, **gp;  // (nparams) pointers into params, grads
} Model;

static Model model_new(const ModelConfig *cfg, uint64_t seed) {
    Model m;
    m.cfg = *cfg;
    m.nparams = model_param_count(cfg);
    m.table = xcalloc(m.nparams, sizeof(ModelParam));
    m.numel = model_params(cfg, m.table);
    m.params = xcalloc(m.numel, sizeof(float));
    m.grads = xcalloc(m.numel, sizeof(float));
    m.pp = xcalloc(m.nparams, sizeof(float *));
    m.gp = xcalloc(m.nparams, sizeof(float *));
    model_param_pointers(cfg, m.params, m.pp);
    model_param_pointers(cfg, m.grads, m.gp);
    model_init(cfg, m.params, seed);
    return m;
}

static void model_free(Model *m) {
    free(m->table);
    free(m->params);
    free(m->grads);
    free(m->pp);
    free(m->gp);
}

// Zeroes the gradients, runs forward and backward; returns the loss.
static float loss_and_grads(Model *m, const int *tokens, int B, void *ws) {
    float loss = NAN;
    memset(m->grads, 0, m->numel * sizeof(float));
    if (model_forward(&m->cfg, m->pp, tokens, B, &loss, ws)) return NAN;
    model_backward(&m->cfg, m->pp, m->gp, ws);
    return loss;
}

// ----------------------------------------------------------------------------
// the double-precision reference forward, written from the equations of model.h

// Mean loss of params P (one double array per tensor). Writes the chosen experts
// (L, B*T, K) in selection order and the smallest gap between the K-th and the (K+1)-th
// selection value over all positions and layers.
static double ref_loss(const ModelConfig *c, double *const *P, const int *tok, int B,
                       int *choice, double *margin) {
    int V = c->vocab_size, H = c->hidden_size, L = c->num_layers, E = c->num_experts;
    int K = c->top_k, I = c->expert_dim, Is = c->expert_dim * c->num_shared;
    int Kc = c->conv_kernel, T = c->seq_len, BT = B * T;
    double *x = xcalloc((size_t)BT * H, sizeof(double));   // (BT, H) residual stream
    double *hn = xcalloc((size_t)BT * H, sizeof(double));  // (BT, H) normed
    double *h = xcalloc((size_t)BT * H, sizeof(double));   // (BT, H) conv output
    double *out = xcalloc(H, sizeof(double));               // (H) block output
    double *s = xcalloc(E, sizeof(double));                 // (E) scores
    double *logits = xcalloc(V, sizeof(double));            // (V)
    *margin = INFINITY;

    for (int n = 0; n < BT; n++)
        for (int ch = 0; ch < H; ch++) x[n * H + ch] = P[MODEL_EMBED][tok[(n / T) * (T + 1) + n % T] * H + ch];

    for (int l = 0; l < L; l++) {
        double *const *p = P + model_layer_param(c, l, 0);
        for (int n = 0; n < BT; n++) {
            double ms = 0.0;
            for (int ch = 0; ch < H; ch++) {
                double r = x[n * H + ch] * (1.0 + p[LP_MLP_QUERY][ch]);
                ms += r * r / H;
            }
            for (int ch = 0; ch < H; ch++)
                hn[n * H + ch] = x[n * H + ch] * (1.0 + p[LP_MLP_QUERY][ch]) / sqrt(ms + 1e-6) *
                                 p[LP_MLP_NORM][ch];
        }
        for (int n = 0; n < BT; n++) {
            int t = n % T;
            for (int ch = 0; ch < H; ch++) {
                double acc = 0.0;
                for (int j = 0; j < Kc; j++)
                    if (t - (Kc - 1) + j >= 0)
                        acc += p[LP_MLP_SCONV][ch * Kc + j] * hn[(n - (Kc - 1) + j) * H + ch];
                h[n * H + ch] = acc;
            }
        }
        for (int n = 0; n < BT; n++) {
            const double *hv = h + n * H;
            for (int e = 0; e < E; e++) {
                double z = 0.0;
                for (int ch = 0; ch < H; ch++) z += hv[ch] * p[LP_GATE][e * H + ch];
                s[e] = 1.0 / (1.0 + exp(-z));
            }
            // Rank of e: how many experts beat it (higher value, or equal and lower index).
            const double *bias = p[LP_GATE_BIAS];
            int *ch_n = choice + ((size_t)l * BT + n) * K;
            double kth = INFINITY, next = -INFINITY, sum = 0.0;
            for (int e = 0; e < E; e++) {
                int rank = 0;
                for (int f = 0; f < E; f++)
                    rank += s[f] + bias[f] > s[e] + bias[e] || (s[f] + bias[f] == s[e] + bias[e] && f < e);
                if (rank < K) {
                    ch_n[rank] = e;
                    sum += s[e];
                    if (s[e] + bias[e] < kth) kth = s[e] + bias[e];
                } else if (s[e] + bias[e] > next) next = s[e] + bias[e];
            }
            if (E > K && kth - next < *margin) *margin = kth - next;
            for (int ch = 0; ch < H; ch++) out[ch] = 0.0;
            for (int k = 0; k < K; k++) {
                int e = ch_n[k];
                const double *wgu = P[model_layer_param(c, l, LP_EXPERTS_GATE_UP)] + (size_t)e * H * 2 * I;
                const double *wd = P[model_layer_param(c, l, LP_EXPERTS_DOWN)] + (size_t)e * I * H;
                for (int i = 0; i < I; i++) {
                    double g = 0.0, u = 0.0;
                    for (int ch = 0; ch < H; ch++) {
                        g += hv[ch] * wgu[ch * 2 * I + i];
                        u += hv[ch] * wgu[ch * 2 * I + I + i];
                    }
                    double act = g / (1.0 + exp(-g)) * u;
                    for (int ch = 0; ch < H; ch++) out[ch] += s[e] / sum * act * wd[i * H + ch];
                }
            }
            for (int i = 0; i < Is; i++) {
                double g = 0.0, u = 0.0;
                for (int ch = 0; ch < H; ch++) {
                    g += hv[ch] * p[LP_SHARED_GATE][i * H + ch];
                    u += hv[ch] * p[LP_SHARED_UP][i * H + ch];
                }
                double act = g / (1.0 + exp(-g)) * u;
                for (int ch = 0; ch < H; ch++) out[ch] += act * p[LP_SHARED_DOWN][ch * Is + i];
            }
            for (int ch = 0; ch < H; ch++) x[n * H + ch] += out[ch];
        }
    }

    const double *qo = P[model_output_query(c)], *nw = P[model_final_norm(c)];
    const double *wlm = P[model_lm_head(c)];
    double total = 0.0;
    for (int n = 0; n < BT; n++) {
        double ms = 0.0;
        for (int ch = 0; ch < H; ch++) ms += pow(x[n * H + ch] * (1.0 + qo[ch]), 2) / H;
        double maxl = -INFINITY;
        for (int v = 0; v < V; v++) {
            double z = 0.0;
            for (int ch = 0; ch < H; ch++)
                z += x[n * H + ch] * (1.0 + qo[ch]) / sqrt(ms + 1e-6) * nw[ch] * wlm[v * H + ch];
            logits[v] = z;
            if (z > maxl) maxl = z;
        }
        double se = 0.0;
        for (int v = 0; v < V; v++) se += exp(logits[v] - maxl);
        total += maxl + log(se) - logits[tok[(n / T) * (T + 1) + n % T + 1]];
    }
    free(x), free(hn), free(h), free(out), free(s), free(logits);
    return total / BT;
}

// ----------------------------------------------------------------------------
// 1. gradient check

static void test_gradients(void) {
    ModelConfig cfg = {.vocab_size = 32, .hidden_size = 10, .num_layers = 2, .num_experts = 5,
                       .top_k = 2, .expert_dim = 6, .num_shared = 2, .conv_kernel = 3,
                       .seq_len = 6};
    const int B = 2, T = cfg.seq_len, L = cfg.num_layers, K = cfg.top_k;
    // eps: the double differences are good to ~1e-10 (truncation eps^2, rounding 1e-16/eps),
    // so the error measured is the fp32 analytic gradient's own: sums of at most a few hundred
    // fp32 terms, ~1e-6 relative. A wrong term shows as 1e-2 or more; 1e-4 sits between.
    const double eps = 1e-5, tol = 1e-4;
    printf("1. gradients: V=%d H=%d L=%d E=%d K=%d I=%d Is=%d Kc=%d T=%d B=%d; central "
           "differences in double, eps %g, tolerance %g\n", cfg.vocab_size, cfg.hidden_size, L,
           cfg.num_experts, K, cfg.expert_dim, cfg.expert_dim * cfg.num_shared, cfg.conv_kernel,
           T, B, eps, tol);
    Model m = model_new(&cfg, 7);
    // Move every tensor off its init (queries, norms and the bias are constants there).
    uint64_t rs = 99;
    for (size_t j = 0; j < m.numel; j++) m.params[j] += (float)(0.2 * (rng_uniform(&rs) - 0.5));
    int *tokens = xcalloc((size_t)B * (T + 1), sizeof(int)); // (B, T+1)
    for (int j = 0; j < B * (T + 1); j++) tokens[j] = (int)(rng_next(&rs) % cfg.vocab_size);

    void *ws = xcalloc(1, model_workspace_size(&cfg, B));
    float loss = NAN;
    memset(m.grads, 0, m.numel * sizeof(float));
    for (int l = 0; l < L; l++) m.gp[model_layer_param(&cfg, l, LP_GATE_BIAS)] = NULL;
    CHECK(model_forward(&cfg, m.pp, tokens, B, &loss, ws) == 0);
    model_backward(&cfg, m.pp, m.gp, ws);

    double **P = xcalloc(m.nparams, sizeof(double *)); // (nparams) double copies
    for (int i = 0; i < m.nparams; i++) {
        P[i] = xcalloc(m.table[i].numel, sizeof(double));
        for (size_t j = 0; j < m.table[i].numel; j++) P[i][j] = m.pp[i][j];
    }
    size_t nchoice = (size_t)L * B * T * K;
    int *choice0 = xcalloc(nchoice, sizeof(int)), *choice1 = xcalloc(nchoice, sizeof(int));
    double margin = 0.0, margin1 = 0.0;
    double ref = ref_loss(&cfg, P, tokens, B, choice0, &margin);
    int routing_same = 1;
    for (int l = 0; l < L; l++)
        routing_same &= !memcmp(model_routing(&cfg, l, ws), choice0 + (size_t)l * B * T * K,
                                (size_t)B * T * K * sizeof(int));
    printf("  loss fp32 %.8f, reference %.8f, diff %.2e; routing %s; smallest selection "
           "margin %.2e\n", loss, ref, fabs(loss - ref), routing_same ? "same" : "DIFFERENT",
           margin);
    CHECK(fabs(loss - ref) < 1e-5 * ref);
    CHECK(routing_same);
    CHECK(margin > 1e-5); // far above the ~1e-7 fp32 error of a score: no near tie

    printf("  %-54s %6s %10s %10s %s\n", "parameter", "numel", "max|grad|", "rel err", "skipped");
    int skipped_total = 0;
    for (int i = 0; i < m.nparams; i++) {
        const ModelParam *pd = &m.table[i];
        if (!pd->requires_grad) continue;
        double maxdiff = 0.0, maxnum = 0.0;
        int skipped = 0;
        for (size_t j = 0; j < pd->numel; j++) {
            double saved = P[i][j], lp, lm;
            int changed = 0;
            P[i][j] = saved + eps;
            lp = ref_loss(&cfg, P, tokens, B, choice1, &margin1);
            changed |= memcmp(choice0, choice1, nchoice * sizeof(int)) != 0;
            P[i][j] = saved - eps;
            lm = ref_loss(&cfg, P, tokens, B, choice1, &margin1);
            changed |= memcmp(choice0, choice1, nchoice * sizeof(int)) != 0;
            P[i][j] = saved;
            if (changed) {
                skipped++;
                continue;
            }
            double num = (lp - lm) / (2 * eps), ana = m.gp[i][j];
            if (fabs(ana - num) > maxdiff) maxdiff = fabs(ana - num);
            if (fabs(num) > maxnum) maxnum = fabs(num);
        }
        double rel = maxdiff / (maxnum > 0 ? maxnum : 1.0);
        printf("  %-54s %6zu %10.3e %10.3e %d\n", pd->name, pd->numel, maxnum, rel, skipped);
        CHECK(rel < tol);
        skipped_total += skipped;
    }
    printf("  %d perturbations skipped for changing a top-k choice\n", skipped_total);

    for (int i = 0; i < m.nparams; i++) free(P[i]);
    free(P), free(choice0), free(choice1), free(tokens), free(ws);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// 2. and 3. training with Adam on the text

typedef struct {
    float *m, *v; // (numel) first and second moments
    int step;
} Adam;

static void adam_step(Model *md, Adam *opt, float lr) {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    opt->step++;
    float c1 = 1.0f - powf(b1, (float)opt->step), c2 = 1.0f - powf(b2, (float)opt->step);
    for (int i = 0; i < md->nparams; i++) {
        if (!md->table[i].requires_grad) continue;
        size_t o = md->table[i].offset;
        for (size_t j = o; j < o + md->table[i].numel; j++) {
            float g = md->grads[j];
            opt->m[j] = b1 * opt->m[j] + (1 - b1) * g;
            opt->v[j] = b2 * opt->v[j] + (1 - b2) * g * g;
            md->params[j] -= lr * (opt->m[j] / c1) / (sqrtf(opt->v[j] / c2) + eps);
        }
    }
}

// Trains `steps` Adam steps from seed on rows of the text; losses[s] is the loss of step s
// before its update, s = 0..steps (losses has steps+1 entries). Returns the final model.
static Model train(const Dataset *d, const ModelConfig *cfg, uint64_t seed, int B, int steps,
                   float lr, float *losses) {
    Model md = model_new(cfg, seed);
    Adam opt = {xcalloc(md.numel, sizeof(float)), xcalloc(md.numel, sizeof(float)), 0};
    int *tokens = xcalloc((size_t)B * (cfg->seq_len + 1), sizeof(int)); // (B, T+1)
    void *ws = xcalloc(1, model_workspace_size(cfg, B));
    for (int s = 0; s <= steps; s++) {
        dataset_rows(d, seed, s, cfg->seq_len, 0, B, tokens);
        losses[s] = loss_and_grads(&md, tokens, B, ws);
        if (s < steps) adam_step(&md, &opt, lr);
    }
    free(opt.m), free(opt.v), free(tokens), free(ws);
    return md;
}

static void test_training(const Dataset *d, int quick) {
    ModelConfig cfg;
    model_config_default(&cfg);
    const int B = quick ? 2 : 8, steps = 100;
    const float lr = 1e-2f;
    float losses[101];
    Model md = train(d, &cfg, 1337, B, steps, lr, losses);
    printf("2. training: default config (%zu parameters), B=%d T=%d, Adam lr %g on %s\n",
           md.numel, B, cfg.seq_len, lr, DATA_DEFAULT_PATH);
    printf("  loss step 0 %.4f, step 50 %.4f, step 100 %.4f (uniform: ln 256 = %.4f)\n",
           losses[0], losses[50], losses[100], log(256.0));
    CHECK(losses[50] < losses[0] - 1.0f);
    CHECK(losses[100] < losses[50]);
    // The correction bias is not trained: still 0, gradients never written.
    int bias_untouched = 1;
    for (int l = 0; l < cfg.num_layers; l++) {
        int i = model_layer_param(&cfg, l, LP_GATE_BIAS);
        for (int e = 0; e < cfg.num_experts; e++)
            bias_untouched &= md.pp[i][e] == 0.0f && md.gp[i][e] == 0.0f;
    }
    CHECK(bias_untouched);
    model_free(&md);
}

static void test_determinism(const Dataset *d) {
    ModelConfig cfg;
    model_config_default(&cfg);
    const int B = 4, steps = 3;
    float la[4], lb[4], lc[4];
    Model a = train(d, &cfg, 42, B, steps, 1e-2f, la);
    Model b = train(d, &cfg, 42, B, steps, 1e-2f, lb);
    Model c = train(d, &cfg, 43, B, steps, 1e-2f, lc);
    int same = !memcmp(la, lb, sizeof la) && !memcmp(a.params, b.params, a.numel * sizeof(float));
    printf("3. determinism: seed 42 twice: losses and parameters after %d steps %s "
           "(loss %.9g vs %.9g); seed 43: loss %.9g\n", steps, same ? "bit-identical" : "DIFFER",
           la[steps], lb[steps], lc[steps]);
    CHECK(same);
    CHECK(la[0] != lc[0]);
    model_free(&a), model_free(&b), model_free(&c);
}

// ----------------------------------------------------------------------------
// 4. a global batch split over 2 ranks

typedef struct {
    Model *model;      // shared parameters (read-only here); grads are the rank's own
    float **grads;     // (nparams) this rank's gradient pointers
    float *grad_flat;  // (numel)
    const int *tokens; // (rows, T+1) this rank's rows
    int rows;
    float loss;
} Rank;

static void *rank_main(void *arg) {
    Rank *r = arg;
    const ModelConfig *cfg = &r->model->cfg;
    void *ws = xcalloc(1, model_workspace_size(cfg, r->rows));
    memset(r->grad_flat, 0, r->model->numel * sizeof(float));
    r->loss = NAN;
    if (model_forward(cfg, r->model->pp, r->tokens, r->rows, &r->loss, ws) == 0)
        model_backward(cfg, r->model->pp, r->grads, ws);
    free(ws);
    return NULL;
}

static void test_data_parallel(const Dataset *d) {
    ModelConfig cfg;
    model_config_default(&cfg);
    const int B = 8, W = 2, T = cfg.seq_len;
    Model md = model_new(&cfg, 5);
    int *tokens = xcalloc((size_t)B * (T + 1), sizeof(int)); // (B, T+1) the global batch
    dataset_rows(d, 11, 3, T, 0, B, tokens);
    void *ws = xcalloc(1, model_workspace_size(&cfg, B));
    float full_loss = loss_and_grads(&md, tokens, B, ws);

    Rank ranks[2];
    float *alone = xcalloc(md.numel, sizeof(float)); // rank 0 run by itself
    for (int r = 0; r < W; r++) {
        int row0 = r * B / W, rows = (r + 1) * B / W - row0;
        int *own = xcalloc((size_t)rows * (T + 1), sizeof(int));
        CHECK(dataset_rows(d, 11, 3, T, row0, rows, own) == 0);
        CHECK(!memcmp(own, tokens + (size_t)row0 * (T + 1), (size_t)rows * (T + 1) * sizeof(int)));
        ranks[r] = (Rank){&md, xcalloc(md.nparams, sizeof(float *)),
                          xcalloc(md.numel, sizeof(float)), own, rows, NAN};
        model_param_pointers(&cfg, ranks[r].grad_flat, ranks[r].grads);
    }
    rank_main(&ranks[0]);
    memcpy(alone, ranks[0].grad_flat, md.numel * sizeof(float));
    pthread_t th[2];
    for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, rank_main, &ranks[r]);
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);

    double maxdiff = 0.0, maxg = 0.0;
    for (size_t j = 0; j < md.numel; j++) {
        double avg = 0.5 * ((double)ranks[0].grad_flat[j] + ranks[1].grad_flat[j]);
        if (fabs(avg - md.grads[j]) > maxdiff) maxdiff = fabs(avg - md.grads[j]);
        if (fabs(md.grads[j]) > maxg) maxg = fabs(md.grads[j]);
    }
    float avg_loss = 0.5f * (ranks[0].loss + ranks[1].loss);
    int same_alone = !memcmp(alone, ranks[0].grad_flat, md.numel * sizeof(float));
    printf("4. data parallel: B=%d split over %d ranks (threads): loss full %.7f, mean of ranks "
           "%.7f; gradient max diff %.3e (max |grad| %.3e, relative %.2e); rank 0 concurrent "
           "== alone: %s\n", B, W, full_loss, avg_loss, maxdiff, maxg, maxdiff / maxg,
           same_alone ? "bit-identical" : "DIFFERENT");
    CHECK(fabsf(avg_loss - full_loss) < 1e-5f * full_loss);
    CHECK(maxdiff < 1e-5 * maxg);
    CHECK(same_alone);
    for (int r = 0; r < W; r++) free(ranks[r].grads), free(ranks[r].grad_flat), free((void *)ranks[r].tokens);
    free(alone), free(tokens), free(ws);
    model_free(&md);
}

// ----------------------------------------------------------------------------
// 5. stage by stage, each with its own parameters only

// pp, gp = the model's pointers for parameters [lo, hi), NULL elsewhere.
static void expose(const Model *m, float **pp, float **gp, int lo, int hi) {
    for (int i = 0; i < m->nparams; i++) {
        pp[i] = i >= lo && i < hi ? m->pp[i] : NULL;
        gp[i] = i >= lo && i < hi ? m->gp[i] : NULL;
    }
}

static void test_stages(const Dataset *d) {
    ModelConfig cfg;
    model_config_default(&cfg);
    const int B = 4, L = cfg.num_layers;
    Model md = model_new(&cfg, 9);
    int *tokens = xcalloc((size_t)B * (cfg.seq_len + 1), sizeof(int)); // (B, T+1)
    dataset_rows(d, 1, 0, cfg.seq_len, 0, B, tokens);
    void *ws = xcalloc(1, model_workspace_size(&cfg, B));
    float whole = loss_and_grads(&md, tokens, B, ws);
    float *whole_grads = xcalloc(md.numel, sizeof(float));
    memcpy(whole_grads, md.grads, md.numel * sizeof(float));

    float **pp = xcalloc(md.nparams, sizeof(float *)), **gp = xcalloc(md.nparams, sizeof(float *));
    int head = model_final_norm(&cfg), end = md.nparams;
    memset(md.grads, 0, md.numel * sizeof(float));
    expose(&md, pp, gp, MODEL_EMBED, MODEL_EMBED + 1);
    CHECK(model_forward_embed(&cfg, pp, tokens, B, ws) == 0);
    for (int l = 0; l < L; l++) {
        expose(&md, pp, gp, model_layer_param(&cfg, l, 0), model_layer_param(&cfg, l, LP_COUNT));
        model_forward_layer(&cfg, l, pp, ws);
    }
    expose(&md, pp, gp, head, end);
    float staged = model_forward_head(&cfg, pp, ws);
    model_backward_head(&cfg, pp, gp, ws);
    for (int l = L - 1; l >= 0; l--) {
        expose(&md, pp, gp, model_layer_param(&cfg, l, 0), model_layer_param(&cfg, l, LP_COUNT));
        model_backward_layer(&cfg, l, pp, gp, ws);
    }
    expose(&md, pp, gp, MODEL_EMBED, MODEL_EMBED + 1);
    model_backward_embed(&cfg, gp, ws);
    int same = !memcmp(&whole, &staged, sizeof whole) &&
               !memcmp(whole_grads, md.grads, md.numel * sizeof(float));
    printf("5. stages, each with only its own parameters: loss and gradients %s the whole "
           "model's\n", same ? "bit-identical to" : "DIFFER from");
    CHECK(same);
    free(pp), free(gp), free(whole_grads), free(tokens), free(ws);
    model_free(&md);
}

// ----------------------------------------------------------------------------
// 6. two pipeline stages, the boundary copied

// Stage A (embed, layers [0, cut)) then stage B (layers [cut, L), head) of the B rows of
// tokens on their own workspaces, the boundary activation and its gradient copied as a
// pipeline sends them; gradients added into m's.  Returns the loss.
static float two_stages(Model *m, const int *tokens, int B, int cut, void *wsa, void *wsb) {
    const ModelConfig *cfg = &m->cfg;
    const int L = cfg->num_layers;
    const size_t act = (size_t)B * cfg->seq_len * cfg->hidden_size * sizeof(float);
    CHECK(model_forward_embed(cfg, m->pp, tokens, B, wsa) == 0);
    for (int l = 0; l < cut; l++) model_forward_layer(cfg, l, m->pp, wsa);
    CHECK(model_set_batch(cfg, tokens, B, wsb) == 0);
    memcpy(model_layer_input(cfg, cut, wsb), model_layer_input(cfg, cut, wsa), act); // the send
    for (int l = cut; l < L; l++) model_forward_layer(cfg, l, m->pp, wsb);
    float loss = model_forward_head(cfg, m->pp, wsb);
    model_backward_head(cfg, m->pp, m->gp, wsb);
    for (int l = L - 1; l >= cut; l--) model_backward_layer(cfg, l, m->pp, m->gp, wsb);
    memcpy(model_resid_grad(cfg, wsa), model_resid_grad(cfg, wsb), act); // the gradient sent back
    for (int l = cut - 1; l >= 0; l--) model_backward_layer(cfg, l, m->pp, m->gp, wsa);
    model_backward_embed(cfg, m->gp, wsa);
    return loss;
}

static void test_pipeline(const Dataset *d) {
    ModelConfig cfg;
    model_config_default(&cfg);
    const int B = 4, T = cfg.seq_len;
    Model md = model_new(&cfg, 11);
    int *tokens = xcalloc((size_t)B * (T + 1), sizeof(int));
    dataset_rows(d, 3, 0, T, 0, B, tokens);
    const size_t wsn = model_workspace_size(&cfg, B);
    void *ws = xcalloc(1, wsn), *wsa = xcalloc(1, wsn), *wsb = xcalloc(1, wsn);
    float whole = loss_and_grads(&md, tokens, B, ws);
    float *whole_grads = xcalloc(md.numel, sizeof(float));
    memcpy(whole_grads, md.grads, md.numel * sizeof(float));

    memset(wsa, 0xFF, wsn); // NaN: a stage reading what it never wrote shows
    memset(wsb, 0xFF, wsn);
    memset(md.grads, 0, md.numel * sizeof(float));
    float piped = two_stages(&md, tokens, B, 1, wsa, wsb);
    int same = !memcmp(&whole, &piped, sizeof whole) && !memcmp(whole_grads, md.grads, md.numel * sizeof(float));
    printf("6. two pipeline stages (embed + layer 0 | layer 1 + head), the boundary copied: loss and "
           "gradients %s the whole model's\n", same ? "bit-identical to" : "DIFFER from");
    CHECK(same);

    // two micro-batches of B/2 rows, gradients accumulated, then scaled by 1/2
    memset(md.grads, 0, md.numel * sizeof(float));
    float micro = 0.0f;
    for (int k = 0; k < 2; k++) micro += two_stages(&md, tokens + (size_t)k * (B / 2) * (T + 1), B / 2, 1, wsa, wsb);
    micro /= 2;
    double gerr = 0.0, gmax = 0.0;
    for (size_t j = 0; j < md.numel; j++) {
        gerr = fmax(gerr, fabs(md.grads[j] / 2 - whole_grads[j]));
        gmax = fmax(gmax, fabs(whole_grads[j]));
    }
    double lerr = fabs((double)micro - whole) / whole;
    printf("   2 micro-batches of %d rows: mean of the mean losses vs the batch's %.3g (relative), "
           "mean gradient %.3g (relative to the largest)\n", B / 2, lerr, gerr / gmax);
    CHECK(lerr < 1e-6);
    CHECK(gerr / gmax < 1e-5);
    free(whole_grads), free(tokens), free(ws), free(wsa), free(wsb);
    model_free(&md);
}

// ----------------------------------------------------------------------------

int main(void) {
    char err[256];
    ModelConfig cfg;
    model_config_default(&cfg);
    CHECK(model_config_check(&cfg, err, sizeof err) == 0);
    cfg.top_k = 5;
    CHECK(model_config_check(&cfg, err, sizeof err) == -1 && strstr(err, "top_k 5 exceeds"));

    test_gradients();

    Dataset d;
    CHECK(dataset_open(&d, "/nonexistent/moe.txt", err, sizeof err) == -1 &&
          strstr(err, "cannot open /nonexistent/moe.txt: No such file"));
    if (dataset_open(&d, NULL, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    const char *quick = getenv("MOONSHARD_TEST_QUICK");
    test_training(&d, quick && strcmp(quick, "0") != 0);
    test_determinism(&d);
    test_data_parallel(&d);
    test_stages(&d);
    test_pipeline(&d);
    dataset_close(&d);
    return check_summary("test_moe_model");
}
