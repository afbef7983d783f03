/*
 * model.c: the MoE character model of model.h: parameter table, init, forward and exact
 * backward in fp32 with plain loops (single-threaded; the ranks of a host are the threads).
 *
 * Every kernel works one token at a time on contiguous rows: matrices stored (in, out)
 * (the grouped experts) are applied as axpy over input rows, matrices stored (out, in)
 * (nn.Linear layout: router, shared experts, lm_head) as dot products with eight partial
 * sums, so the inner loops vectorize without reassociation flags and the order of every
 * sum is fixed: results are bit-identical from run to run.
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define RMS_EPS 1e-6f

// ----------------------------------------------------------------------------
// configuration

void model_config_default(ModelConfig *cfg) {
    cfg->vocab_size = 256;
    cfg->hidden_size = 64;
    cfg->num_layers = 2;
    cfg->num_experts = 4;
    cfg->top_k = 2;
    cfg->expert_dim = 64;
    cfg->num_shared = 1;
    cfg->conv_kernel = 4;
    cfg->seq_len = 64;
    cfg->lora = NULL;
}

int model_config_check(const ModelConfig *cfg, char *err, size_t errlen) {
    const struct { const char *name; int value; } sizes[] = {
        {"vocab_size", cfg->vocab_size},   {"hidden_size", cfg->hidden_size},
        {"num_layers", cfg->num_layers},   {"num_experts", cfg->num_experts},
        {"top_k", cfg->top_k},             {"expert_dim", cfg->expert_dim},
        {"num_shared", cfg->num_shared},   {"conv_kernel", cfg->conv_kernel},
        {"seq_len", cfg->seq_len},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (sizes[i].value <= 0) {
            snprintf(err, errlen, "model config: %s is %d; it must be positive", sizes[i].name,
                     sizes[i].value);
            return -1;
        }
    }
    if (cfg->top_k > cfg->num_experts) {
        snprintf(err, errlen, "model config: top_k %d exceeds num_experts %d", cfg->top_k,
                 cfg->num_experts);
        return -1;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// parameter table

int model_base_param_count(const ModelConfig *cfg) { return 1 + cfg->num_layers * LP_COUNT + 3; }
int model_lora_module_count(const ModelConfig *cfg) { return LORA_PER_LAYER * cfg->num_layers + 1; }

int model_lora_param(const ModelConfig *cfg, int m, int which) {
    if (!cfg->lora || m < 0 || m >= model_lora_module_count(cfg) || !cfg->lora->dim[m]) return -1;
    int i = model_base_param_count(cfg);
    for (int k = 0; k < m; k++) i += cfg->lora->dim[k] ? 2 : 0;
    return i + which;
}

int model_lora_of(const ModelConfig *cfg, int i, int *which) {
    int j = model_base_param_count(cfg);
    for (int m = 0; cfg->lora && m < model_lora_module_count(cfg); m++) {
        if (!cfg->lora->dim[m]) continue;
        if (i == j || i == j + 1) {
            if (which) *which = i - j;
            return m;
        }
        j += 2;
    }
    return -1;
}

int model_param_count(const ModelConfig *cfg) {
    int n = model_base_param_count(cfg);
    for (int m = 0; cfg->lora && m < model_lora_module_count(cfg); m++) n += cfg->lora->dim[m] ? 2 : 0;
    return n;
}

void model_lora_module(const ModelConfig *cfg, int m, char *name, size_t len, int *out, int *in) {
    static const char *const leaf[LORA_PER_LAYER] = {"gate_proj", "up_proj", "down_proj"};
    const int H = cfg->hidden_size, Is = cfg->expert_dim * cfg->num_shared;
    if (m == LORA_PER_LAYER * cfg->num_layers) {
        snprintf(name, len, "lm_head");
        *out = cfg->vocab_size, *in = H;
        return;
    }
    snprintf(name, len, "model.layers.%d.mlp.shared_experts.%s", m / LORA_PER_LAYER, leaf[m % LORA_PER_LAYER]);
    *out = m % LORA_PER_LAYER == LORA_DOWN ? H : Is;
    *in = m % LORA_PER_LAYER == LORA_DOWN ? Is : H;
}
int model_layer_param(const ModelConfig *cfg, int l, int k) { (void)cfg; return 1 + l * LP_COUNT + k; }
int model_final_norm(const ModelConfig *cfg) { return 1 + cfg->num_layers * LP_COUNT; }
int model_output_query(const ModelConfig *cfg) { return model_final_norm(cfg) + 1; }
int model_lm_head(const ModelConfig *cfg) { return model_final_norm(cfg) + 2; }

// Name, shape and flags of parameter i (offset left 0).
static void param_desc(const ModelConfig *cfg, int i, ModelParam *p) {
    int V = cfg->vocab_size, H = cfg->hidden_size, E = cfg->num_experts;
    int I = cfg->expert_dim, Is = cfg->expert_dim * cfg->num_shared, Kc = cfg->conv_kernel;
    memset(p, 0, sizeof *p);
    p->requires_grad = 1;
    int s0 = 0, s1 = 0, s2 = 0, which, m = model_lora_of(cfg, i, &which);
    if (m >= 0) {
        char module[MODEL_NAME_MAX - 16]; // the longest module name is 45 bytes
        int out, in, r = cfg->lora->dim[m];
        model_lora_module(cfg, m, module, sizeof module, &out, &in);
        snprintf(p->name, sizeof p->name, "%s.lora_%c.weight", module, which ? 'B' : 'A');
        s0 = which ? out : r, s1 = which ? r : in;
    } else if (i == MODEL_EMBED) {
        snprintf(p->name, sizeof p->name, "model.embed_tokens.weight");
        s0 = V, s1 = H;
    } else if (i == model_final_norm(cfg)) {
        snprintf(p->name, sizeof p->name, "model.norm.weight");
        s0 = H;
    } else if (i == model_output_query(cfg)) {
        snprintf(p->name, sizeof p->name, "model.output_query.query");
        s0 = H, p->fp32_module = 1;
    } else if (i == model_lm_head(cfg)) {
        snprintf(p->name, sizeof p->name, "lm_head.weight");
        s0 = V, s1 = H;
    } else {
        int l = (i - 1) / LP_COUNT, k = (i - 1) % LP_COUNT;
        static const char *const suffix[LP_COUNT] = {
            "mlp_query.query", "mlp_norm.weight", "mlp_sconv.weight", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias", "mlp.experts.gate_and_up_projs",
            "mlp.experts.down_projs", "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
        };
        snprintf(p->name, sizeof p->name, "model.layers.%d.%s", l, suffix[k]);
        switch (k) {
        case LP_MLP_QUERY: s0 = H, p->fp32_module = 1; break;
        case LP_MLP_NORM: s0 = H; break;
        case LP_MLP_SCONV: s0 = H, s1 = 1, s2 = Kc; break;
        case LP_GATE: s0 = E, s1 = H, p->fp32_module = 1; break;
        case LP_GATE_BIAS: s0 = E, p->fp32_module = 1, p->requires_grad = 0; break;
        case LP_EXPERTS_GATE_UP: s0 = E, s1 = H, s2 = 2 * I; break;
        case LP_EXPERTS_DOWN: s0 = E, s1 = I, s2 = H; break;
        case LP_SHARED_GATE: case LP_SHARED_UP: s0 = Is, s1 = H; break;
        case LP_SHARED_DOWN: s0 = H, s1 = Is; break;
        }
    }
    p->ndim = s2 ? 3 : s1 ? 2 : 1;
    p->shape[0] = s0, p->shape[1] = s1, p->shape[2] = s2;
    p->numel = (size_t)s0 * (size_t)(s1 ? s1 : 1) * (size_t)(s2 ? s2 : 1);
}

size_t model_params(const ModelConfig *cfg, ModelParam *out) {
    size_t offset = 0;
    for (int i = 0; i < model_param_count(cfg); i++) {
        param_desc(cfg, i, &out[i]);
        out[i].offset = offset;
        offset += out[i].numel;
    }
    return offset;
}

size_t model_param_numel(const ModelConfig *cfg) {
    size_t total = 0;
    ModelParam p;
    for (int i = 0; i < model_param_count(cfg); i++) {
        param_desc(cfg, i, &p);
        total += p.numel;
    }
    return total;
}

void model_param_pointers(const ModelConfig *cfg, float *flat, float **ptrs) {
    size_t offset = 0;
    ModelParam p;
    for (int i = 0; i < model_param_count(cfg); i++) {
        param_desc(cfg, i, &p);
        ptrs[i] = flat + offset;
        offset += p.numel;
    }
}

// ----------------------------------------------------------------------------
// init

// splitmix64: a counter-based generator, so each tensor's stream depends on (seed, i) only.
static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Standard normal by Box-Muller (one value per pair of uniforms).
static double normal(uint64_t *state) {
    double u1 = (double)((splitmix64(state) >> 11) + 1) * 0x1.0p-53; // (0, 1]
    double u2 = (double)(splitmix64(state) >> 11) * 0x1.0p-53;       // [0, 1)
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void model_init_param(const ModelConfig *cfg, int i, float *dst, uint64_t seed) {
    ModelParam p;
    param_desc(cfg, i, &p);
    uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(i + 1));
    int which, m = model_lora_of(cfg, i, &which);
    if (m >= 0) { // LinearLoRA.init_lora_weights: A xavier normal or kaiming uniform (a = sqrt 5), B zeros
        const double in = p.shape[1], r = p.shape[0];
        for (size_t j = 0; j < p.numel; j++)
            dst[j] = which ? 0.0f
                   : cfg->lora->a_init == LORA_INIT_UNIFORM
                       ? (float)((2.0 * (double)(splitmix64(&state) >> 11) * 0x1.0p-53 - 1.0) / sqrt(in))
                       : (float)(sqrt(2.0 / (in + r)) * normal(&state));
        return;
    }
    int k = (i >= 1 && i < model_final_norm(cfg)) ? (i - 1) % LP_COUNT : -1;
    double H = cfg->hidden_size, std = 0.0; // std 0: the constant `value`
    float value = 0.0f;                     // queries and the correction bias
    if (i == MODEL_EMBED) std = 1.0;
    else if (i == model_lm_head(cfg)) std = 1.0 / sqrt(H);
    else if (i == model_final_norm(cfg)) value = 1.0f;
    else switch (k) {
    case LP_MLP_NORM: value = 1.0f; break;
    case LP_MLP_SCONV: std = 1.0 / sqrt(cfg->conv_kernel); break;
    case LP_GATE: case LP_EXPERTS_GATE_UP: case LP_SHARED_GATE: case LP_SHARED_UP:
        std = 1.0 / sqrt(H); break;
    case LP_EXPERTS_DOWN: std = 1.0 / sqrt(cfg->expert_dim); break;
    case LP_SHARED_DOWN: std = 1.0 / sqrt((double)cfg->expert_dim * cfg->num_shared); break;
    default: break;
    }
    for (size_t j = 0; j < p.numel; j++) dst[j] = std > 0.0 ? (float)(std * normal(&state)) : value;
}

void model_init(const ModelConfig *cfg, float *flat, uint64_t seed) {
    size_t offset = 0;
    ModelParam p;
    for (int i = 0; i < model_param_count(cfg); i++) {
        param_desc(cfg, i, &p);
        model_init_param(cfg, i, flat + offset, seed);
        offset += p.numel;
    }
}

// ----------------------------------------------------------------------------
// workspace

typedef struct {
    int *tokens;     // (B, T+1) copy of the batch
    float *resid;    // (L+1, BT, H) residual stream entering layer l; [L] enters the head
    float *rstd;     // (L, BT) 1/rms of r = x * (1 + mlp_query)
    float *hnorm;    // (L, BT, H) RMSNorm(r) * mlp_norm.weight: the conv input
    float *h;        // (L, BT, H) conv output: the MoE input
    float *score;    // (L, BT, E) sigmoid router scores
    int *choice;     // (L, BT, K) chosen experts, in selection order
    float *weight;   // (L, BT, K) routing weights (chosen scores normalised)
    float *egu;      // (L, BT, K, 2I) expert gate | up pre-activations
    float *eact;     // (L, BT, K, I) silu(gate) * up
    float *eout;     // (L, BT, K, H) expert outputs before weighting
    float *sgu;      // (L, BT, 2Is) shared gate | up pre-activations
    float *sact;     // (L, BT, Is) shared silu(gate) * up
    float *frstd;    // (BT) 1/rms of x * (1 + output_query)
    float *fnorm;    // (BT, H) final RMSNorm output: the lm_head input
    float *probs;    // (BT, V) softmax of the logits
    float *losses;   // (BT) per-position cross-entropy
    float *dresid;   // (BT, H) d loss / d residual stream at the stage being run backward
    float *dh;       // (BT, H) d loss / d h (conv output)
    float *dhnorm;   // (BT, H) d loss / d hnorm (conv input)
    float *dlogits;  // (V) one position's scratch
    float *dfnorm;   // (H)
    float *dsact;    // (Is)
    float *dsgu;     // (2Is)
    float *deact;    // (I)
    float *degu;     // (2I)
    float *dweight;  // (K)
    float *edw;      // (BT, K) d loss / d routing weight, of the layer being run backward
    float *edout;    // (BT, K, H) d loss / d expert output of each pair, same layer
    float *edh;      // (BT, K, H) d loss / d h through each pair's expert, same layer
    float *tpbuf;    // (3, BT, max(H, V)) tensor parallelism: a full buffer, then scratch
    float *lu, *lg;  // (max LoRA rank) one row's x A^T and B^T dy
} Acts;

enum { WS_ALIGN = 64 };

// Reserves `bytes` at *off (aligned); NULL when only measuring.
static void *take(char *base, size_t *off, size_t bytes) {
    *off = (*off + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
    void *p = base ? base + *off : NULL;
    *off += bytes;
    return p;
}

// Lays out the workspace for B rows after its header (the int B of the latest forward);
// returns its size in bytes. base NULL: measure only.
static size_t acts_layout(const ModelConfig *c, int B, char *base, Acts *a) {
    size_t L = (size_t)c->num_layers, BT = (size_t)B * c->seq_len, H = c->hidden_size;
    size_t V = c->vocab_size, E = c->num_experts, K = c->top_k, I = c->expert_dim;
    size_t Is = I * (size_t)c->num_shared, f = sizeof(float), n = sizeof(int);
    size_t off = sizeof(int); // header: B
    a->tokens = take(base, &off, (size_t)B * (c->seq_len + 1) * n);
    a->resid = take(base, &off, (L + 1) * BT * H * f);
    a->rstd = take(base, &off, L * BT * f);
    a->hnorm = take(base, &off, L * BT * H * f);
    a->h = take(base, &off, L * BT * H * f);
    a->score = take(base, &off, L * BT * E * f);
    a->choice = take(base, &off, L * BT * K * n);
    a->weight = take(base, &off, L * BT * K * f);
    a->egu = take(base, &off, L * BT * K * 2 * I * f);
    a->eact = take(base, &off, L * BT * K * I * f);
    a->eout = take(base, &off, L * BT * K * H * f);
    a->sgu = take(base, &off, L * BT * 2 * Is * f);
    a->sact = take(base, &off, L * BT * Is * f);
    a->frstd = take(base, &off, BT * f);
    a->fnorm = take(base, &off, BT * H * f);
    a->probs = take(base, &off, BT * V * f);
    a->losses = take(base, &off, BT * f);
    a->dresid = take(base, &off, BT * H * f);
    a->dh = take(base, &off, BT * H * f);
    a->dhnorm = take(base, &off, BT * H * f);
    a->dlogits = take(base, &off, V * f);
    a->dfnorm = take(base, &off, H * f);
    a->dsact = take(base, &off, Is * f);
    a->dsgu = take(base, &off, 2 * Is * f);
    a->deact = take(base, &off, I * f);
    a->degu = take(base, &off, 2 * I * f);
    a->dweight = take(base, &off, K * f);
    a->edw = take(base, &off, BT * K * f);
    a->edout = take(base, &off, BT * K * H * f);
    a->edh = take(base, &off, BT * K * H * f);
    a->tpbuf = take(base, &off, 3 * BT * (H > V ? H : V) * f);
    size_t r = 0;
    for (int m = 0; c->lora && m < model_lora_module_count(c); m++)
        if ((size_t)c->lora->dim[m] > r) r = (size_t)c->lora->dim[m];
    a->lu = take(base, &off, r * f);
    a->lg = take(base, &off, r * f);
    return off;
}

size_t model_workspace_size(const ModelConfig *cfg, int B) {
    Acts a;
    return acts_layout(cfg, B, NULL, &a);
}

// Points `a` at ws as laid out by the latest forward; returns its B.
static int acts_of(const ModelConfig *cfg, void *ws, Acts *a) {
    int B;
    memcpy(&B, ws, sizeof B);
    acts_layout(cfg, B, ws, a);
    return B;
}

// One layer's slice of the activations: rows of BT positions.
typedef struct {
    float *x, *xnext;      // (BT, H) residual stream in and out
    float *rstd;           // (BT)
    float *hnorm, *h;      // (BT, H)
    float *score;          // (BT, E)
    int *choice;           // (BT, K)
    float *weight;         // (BT, K)
    float *egu, *eact;     // (BT, K, 2I), (BT, K, I)
    float *eout;           // (BT, K, H)
    float *sgu, *sact;     // (BT, 2Is), (BT, Is)
} LayerActs;

static LayerActs layer_acts(const ModelConfig *c, const Acts *a, int B, int l) {
    size_t BT = (size_t)B * c->seq_len, H = c->hidden_size, K = c->top_k, I = c->expert_dim;
    size_t Is = I * (size_t)c->num_shared;
    LayerActs la;
    la.x = a->resid + l * BT * H;
    la.xnext = la.x + BT * H;
    la.rstd = a->rstd + l * BT;
    la.hnorm = a->hnorm + l * BT * H;
    la.h = a->h + l * BT * H;
    la.score = a->score + l * BT * c->num_experts;
    la.choice = a->choice + l * BT * K;
    la.weight = a->weight + l * BT * K;
    la.egu = a->egu + l * BT * K * 2 * I;
    la.eact = a->eact + l * BT * K * I;
    la.eout = a->eout + l * BT * K * H;
    la.sgu = a->sgu + l * BT * 2 * Is;
    la.sact = a->sact + l * BT * Is;
    return la;
}

// What this rank computes under tensor parallelism (model.h, "tensor parallelism"); with
// no tp, everything.
typedef struct {
    const ModelTp *tp; // NULL: no tensor parallelism
    int size, rank, sp;
    int t0, t1;        // this rank's positions of every row: [t0, t1), [0, T) without sp
    int Is, V;         // the local sizes of the shared experts and of the vocabulary
} Span;

static Span span_of(const ModelConfig *c, const ModelTp *tp) {
    Span s;
    s.tp = tp && tp->size > 1 ? tp : NULL;
    s.size = s.tp ? tp->size : 1;
    s.rank = s.tp ? tp->rank : 0;
    s.sp = s.tp && tp->sp;
    s.t0 = s.sp ? s.rank * (c->seq_len / s.size) : 0;
    s.t1 = s.sp ? s.t0 + c->seq_len / s.size : c->seq_len;
    s.Is = c->expert_dim * c->num_shared / s.size;
    s.V = c->vocab_size / s.size;
    return s;
}

// 1 when position n (of B*T) is this rank's.
static int own(const Span *s, int n, int T) { return n % T >= s->t0 && n % T < s->t1; }

// The scratch half of tpbuf (two (BT, max(H, V)) blocks); the first block is a full buffer.
static float *tp_scratch(const ModelConfig *c, const Acts *a, int B) {
    int w = c->hidden_size > c->vocab_size ? c->hidden_size : c->vocab_size;
    return a->tpbuf + (size_t)B * c->seq_len * w;
}

// Sequence parallel: buf (B, T, w) holds this rank's positions; afterwards every position
// (all_gather over the sequence, pieces packed by rank).
static int seq_gather(const Span *s, float *buf, float *scratch, int B, int T, int w) {
    const size_t row = (size_t)(s->t1 - s->t0) * w, piece = (size_t)B * row;
    float *send = scratch, *recv = scratch + piece;
    for (int b = 0; b < B; b++)
        memcpy(send + b * row, buf + ((size_t)b * T + s->t0) * w, row * sizeof(float));
    if (s->tp->all_gather(s->tp->host, recv, send, piece)) return -1;
    for (int r = 0; r < s->size; r++)
        for (int b = 0; b < B; b++)
            memcpy(buf + (size_t)b * T * w + r * row, recv + r * piece + b * row, row * sizeof(float));
    return 0;
}

// Sequence parallel: buf (B, T, w) holds partial sums at every position; afterwards this
// rank's positions hold the sums over the group (reduce_scatter over the sequence).
static int seq_reduce_scatter(const Span *s, float *buf, float *scratch, int B, int T, int w) {
    const size_t row = (size_t)(s->t1 - s->t0) * w, piece = (size_t)B * row;
    float *send = scratch, *recv = scratch + piece * s->size;
    for (int r = 0; r < s->size; r++)
        for (int b = 0; b < B; b++)
            memcpy(send + r * piece + b * row, buf + (size_t)b * T * w + r * row, row * sizeof(float));
    if (s->tp->reduce_scatter(s->tp->host, recv, send, piece)) return -1;
    for (int b = 0; b < B; b++)
        memcpy(buf + ((size_t)b * T + s->t0) * w, recv + b * row, row * sizeof(float));
    return 0;
}

// Without sequence parallel: the sum over the tp group of buf (n) (a no-op without tp);
// with it: seq_reduce_scatter of buf (B, T, w).
static int tp_reduce(const Span *s, float *buf, float *scratch, int B, int T, int w) {
    if (!s->tp) return 0;
    if (s->sp) return seq_reduce_scatter(s, buf, scratch, B, T, w);
    return s->tp->all_reduce(s->tp->host, buf, (size_t)B * T * w);
}

int model_tp_check(const ModelConfig *cfg, int tp, int sp, char *err, size_t errlen) {
    const int Is = cfg->expert_dim * cfg->num_shared;
    if (tp < 1) {
        snprintf(err, errlen, "tensor parallel: tp is %d; it must be positive", tp);
        return -1;
    }
    if (Is % tp) {
        snprintf(err, errlen, "tensor parallel: tp = %d does not divide the shared experts' "
                 "intermediate size expert_dim * num_shared = %d (gate_proj and up_proj are "
                 "split on it)", tp, Is);
        return -1;
    }
    if (cfg->vocab_size % tp) {
        snprintf(err, errlen, "tensor parallel: tp = %d does not divide the vocabulary of %d "
                 "(lm_head is split on it)", tp, cfg->vocab_size);
        return -1;
    }
    if (tp > 1 && cfg->lora) {
        snprintf(err, errlen, "tensor parallel: tp = %d with LoRA adapters is not implemented", tp);
        return -1;
    }
    if (sp && cfg->seq_len % tp) {
        snprintf(err, errlen, "sequence parallel: tp = %d does not divide seq_len = %d (each tp "
                 "rank holds seq_len / tp positions of every row)", tp, cfg->seq_len);
        return -1;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// kernels on one row

// Eight partial sums in a fixed order: vectorizes, and the result is reproducible.
static float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

// y += alpha * x
static void axpy(float *y, float alpha, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// One module's LoRA adapter as the stage functions see it: rank 0 means none.
typedef struct {
    const float *A, *B; // (r, in), (out, r)
    float *dA, *dB;     // their gradients (NULL in forward)
    int r, in, out;
    float scale;
} Lora;

static Lora lora_of(const ModelConfig *cfg, int m, float *const *params, float *const *grads) {
    Lora a = {0};
    const int i = model_lora_param(cfg, m, 0);
    if (i < 0) return a;
    char name[MODEL_NAME_MAX];
    model_lora_module(cfg, m, name, sizeof name, &a.out, &a.in);
    a.r = cfg->lora->dim[m], a.scale = cfg->lora->scale[m];
    a.A = params[i], a.B = params[i + 1];
    if (grads) a.dA = grads[i], a.dB = grads[i + 1];
    return a;
}

// y (out) += scale * B (A x) for one row x (in); u (r) scratch.
static void lora_forward(const Lora *a, float *y, const float *x, float *u) {
    if (!a->r) return;
    for (int k = 0; k < a->r; k++) u[k] = dot(x, a->A + (size_t)k * a->in, a->in);
    for (int o = 0; o < a->out; o++) y[o] += a->scale * dot(u, a->B + (size_t)o * a->r, a->r);
}

// Backward of lora_forward for one row, given dy (out): dA += scale (B^T dy) x^T, dB +=
// scale dy (A x)^T, dx (in) += scale A^T (B^T dy).  u, g (r) scratch.
static void lora_backward(const Lora *a, float *dx, const float *dy, const float *x, float *u, float *g) {
    if (!a->r) return;
    for (int k = 0; k < a->r; k++) u[k] = dot(x, a->A + (size_t)k * a->in, a->in);
    memset(g, 0, (size_t)a->r * sizeof(float));
    for (int o = 0; o < a->out; o++) {
        axpy(g, dy[o], a->B + (size_t)o * a->r, a->r);
        axpy(a->dB + (size_t)o * a->r, a->scale * dy[o], u, a->r);
    }
    for (int k = 0; k < a->r; k++) {
        axpy(a->dA + (size_t)k * a->in, a->scale * g[k], x, a->in);
        axpy(dx, a->scale * g[k], a->A + (size_t)k * a->in, a->in);
    }
}

// act (n) = silu(gu[0, n)) * gu[n, 2n): the gated unit of every expert.
static void swiglu_forward(float *act, const float *gu, int n) {
    for (int i = 0; i < n; i++) act[i] = gu[i] * sigmoidf(gu[i]) * gu[n + i];
}

// Backward of swiglu_forward: dgu (2n) from dact (n).
static void swiglu_backward(float *dgu, const float *dact, const float *gu, int n) {
    for (int i = 0; i < n; i++) {
        float s = sigmoidf(gu[i]);
        dgu[i] = dact[i] * gu[n + i] * s * (1.0f + gu[i] * (1.0f - s));
        dgu[n + i] = dact[i] * gu[i] * s;
    }
}

// out = RMSNorm(x * (1 + q)) * w; writes 1/rms to *rstd.
static void query_norm_forward(float *out, float *rstd, const float *x, const float *q,
                               const float *w, int H) {
    float ss = 0.0f;
    for (int c = 0; c < H; c++) {
        float r = x[c] * (1.0f + q[c]);
        ss += r * r;
    }
    float rs = 1.0f / sqrtf(ss / H + RMS_EPS);
    for (int c = 0; c < H; c++) out[c] = x[c] * (1.0f + q[c]) * rs * w[c];
    *rstd = rs;
}

// Backward of query_norm_forward: adds into dx, dq and dw.
static void query_norm_backward(float *dx, float *dq, float *dw, const float *dout,
                                const float *x, const float *q, const float *w, float rstd,
                                int H) {
    float m = 0.0f; // mean over c of dn * n
    for (int c = 0; c < H; c++) m += dout[c] * w[c] * x[c] * (1.0f + q[c]) * rstd;
    m /= H;
    for (int c = 0; c < H; c++) {
        float n = x[c] * (1.0f + q[c]) * rstd;
        float dr = rstd * (dout[c] * w[c] - n * m);
        dw[c] += dout[c] * n;
        dq[c] += dr * x[c];
        dx[c] += dr * (1.0f + q[c]);
    }
}

// ----------------------------------------------------------------------------
// forward

int model_set_batch(const ModelConfig *cfg, const int *tokens, int B, void *ws) {
    int T = cfg->seq_len;
    for (int j = 0; j < B * (T + 1); j++)
        if (tokens[j] < 0 || tokens[j] >= cfg->vocab_size) return -1;
    memcpy(ws, &B, sizeof B);
    Acts a;
    acts_of(cfg, ws, &a);
    memcpy(a.tokens, tokens, (size_t)B * (T + 1) * sizeof(int));
    return 0;
}

float *model_layer_input(const ModelConfig *cfg, int l, void *ws) {
    Acts a;
    int B = acts_of(cfg, ws, &a);
    return a.resid + (size_t)l * B * cfg->seq_len * cfg->hidden_size;
}

float *model_resid_grad(const ModelConfig *cfg, void *ws) {
    Acts a;
    acts_of(cfg, ws, &a);
    return a.dresid;
}

int model_forward_embed(const ModelConfig *cfg, float *const *params, const int *tokens, int B,
                        void *ws) {
    int T = cfg->seq_len, H = cfg->hidden_size;
    if (model_set_batch(cfg, tokens, B, ws)) return -1;
    Acts a;
    acts_of(cfg, ws, &a);
    const float *wte = params[MODEL_EMBED]; // (V, H)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            memcpy(a.resid + ((size_t)b * T + t) * H, wte + (size_t)tokens[b * (T + 1) + t] * H,
                   H * sizeof(float));
    return 0;
}

// h (B, T, H) = causal depthwise conv of hn with w (H, 1, Kc), zero left padding.
static void sconv_forward(float *h, const float *hn, const float *w, int B, int T, int H, int Kc) {
    memset(h, 0, (size_t)B * T * H * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < Kc; j++) {
                int src = t - (Kc - 1) + j;
                if (src < 0) continue;
                float *out = h + ((size_t)b * T + t) * H;
                const float *in = hn + ((size_t)b * T + src) * H;
                for (int c = 0; c < H; c++) out[c] += w[c * Kc + j] * in[c];
            }
}

// Router of one position: scores (E), top-K choice by score + bias, normalised weights.
static void router_forward(float *score, int *choice, float *weight, const float *h,
                           const float *gate, const float *bias, int E, int K, int H) {
    for (int e = 0; e < E; e++) score[e] = sigmoidf(dot(h, gate + (size_t)e * H, H));
    float sum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= choice[j] == e;
            if (!taken && (best < 0 || score[e] + bias[e] > score[best] + bias[best])) best = e;
        }
        choice[k] = best;
        sum += score[best];
    }
    for (int k = 0; k < K; k++) weight[k] = score[choice[k]] / sum;
}

// One expert on one row: gu (2I) = x @ Wgu (H, 2I), act (I), out (H) = act @ Wd (I, H).
static void expert_forward(float *out, float *gu, float *act, const float *x, const float *wgu,
                           const float *wd, int H, int I) {
    memset(gu, 0, 2 * (size_t)I * sizeof(float));
    for (int c = 0; c < H; c++) axpy(gu, x[c], wgu + (size_t)c * 2 * I, 2 * I);
    swiglu_forward(act, gu, I);
    memset(out, 0, (size_t)H * sizeof(float));
    for (int i = 0; i < I; i++) axpy(out, act[i], wd + (size_t)i * H, H);
}

void model_experts_forward(const ModelConfig *cfg, const float *wgu, const float *wd,
                           const int *ids, const float *x, int rep, int n, float *out, float *gu,
                           float *act) {
    int H = cfg->hidden_size, I = cfg->expert_dim;
    for (int j = 0; j < n; j++) {
        size_t e = (size_t)ids[j];
        expert_forward(out + (size_t)j * H, gu + (size_t)j * 2 * I, act + (size_t)j * I,
                       x + (size_t)(j / rep) * H, wgu + e * H * 2 * I, wd + e * I * H, H, I);
    }
}

void model_experts_backward(const ModelConfig *cfg, const float *wgu, const float *wd,
                            const int *ids, const float *x, int rep, int n, const float *gu,
                            const float *act, const float *dout, float *dx, float *dwgu,
                            float *dwd, void *ws) {
    int H = cfg->hidden_size, I = cfg->expert_dim;
    Acts a;
    acts_of(cfg, ws, &a);
    for (int j = 0; j < n; j++) {
        size_t e = (size_t)ids[j];
        const float *wgu_e = wgu + e * H * 2 * I, *wd_e = wd + e * I * H;
        const float *dy = dout + (size_t)j * H, *xj = x + (size_t)(j / rep) * H;
        const float *gu_j = gu + (size_t)j * 2 * I, *act_j = act + (size_t)j * I;
        float *dxj = dx + (size_t)j * H;
        for (int i = 0; i < I; i++) {
            a.deact[i] = dot(wd_e + (size_t)i * H, dy, H);
            axpy(dwd + e * I * H + (size_t)i * H, act_j[i], dy, H);
        }
        swiglu_backward(a.degu, a.deact, gu_j, I);
        for (int c = 0; c < H; c++) {
            dxj[c] = dot(wgu_e + (size_t)c * 2 * I, a.degu, 2 * I);
            axpy(dwgu + e * H * 2 * I + (size_t)c * 2 * I, xj[c], a.degu, 2 * I);
        }
    }
}

// The layer's parameters by role.
typedef struct {
    const float *query, *norm, *sconv;    // (H), (H), (H, 1, Kc)
    const float *gate, *bias;             // (E, H), (E)
    const float *wgu, *wd;                // (E, H, 2I), (E, I, H)
    const float *sg, *su, *sd;            // (Is, H), (Is, H), (H, Is)
} LayerParams;

static LayerParams layer_params(const ModelConfig *cfg, int l, float *const *params) {
    float *const *p = params + model_layer_param(cfg, l, 0);
    return (LayerParams){p[LP_MLP_QUERY], p[LP_MLP_NORM], p[LP_MLP_SCONV], p[LP_GATE],
                         p[LP_GATE_BIAS], p[LP_EXPERTS_GATE_UP], p[LP_EXPERTS_DOWN],
                         p[LP_SHARED_GATE], p[LP_SHARED_UP], p[LP_SHARED_DOWN]};
}

// The norm, conv and router of layer l, at this rank's positions (the conv at every position:
// under sequence parallel its input is all-gathered first).
static int layer_begin(const ModelConfig *cfg, int l, float *const *params, void *ws,
                       const Span *sp) {
    int T = cfg->seq_len, H = cfg->hidden_size, E = cfg->num_experts, K = cfg->top_k;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    LayerActs la = layer_acts(cfg, &a, B, l);
    LayerParams lp = layer_params(cfg, l, params);
    for (int n = 0; n < BT; n++)
        if (own(sp, n, T))
            query_norm_forward(la.hnorm + (size_t)n * H, la.rstd + n, la.x + (size_t)n * H,
                               lp.query, lp.norm, H);
    if (sp->sp && seq_gather(sp, la.hnorm, tp_scratch(cfg, &a, B), B, T, H)) return -1;
    sconv_forward(la.h, la.hnorm, lp.sconv, B, T, H, cfg->conv_kernel);
    for (int n = 0; n < BT; n++)
        if (own(sp, n, T))
            router_forward(la.score + (size_t)n * E, la.choice + (size_t)n * K,
                           la.weight + (size_t)n * K, la.h + (size_t)n * H, lp.gate, lp.bias, E,
                           K, H);
    return 0;
}

// The routed experts' sum and the shared experts (this rank's Is/tp of them, at every
// position; their output reduced over tp) added to the residual at this rank's positions.
static int layer_end(const ModelConfig *cfg, int l, float *const *params, void *ws,
                     const Span *sp) {
    int T = cfg->seq_len, H = cfg->hidden_size, K = cfg->top_k, Is = sp->Is;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    LayerActs la = layer_acts(cfg, &a, B, l);
    LayerParams lp = layer_params(cfg, l, params);
    float *y = a.dh; // (BT, H) the shared experts' output, partial over tp (dh is free here)
    const int m0 = LORA_PER_LAYER * l; // the shared experts' adapters (none under tp)
    const Lora lg = lora_of(cfg, m0 + LORA_GATE, params, NULL), lu = lora_of(cfg, m0 + LORA_UP, params, NULL);
    const Lora ld = lora_of(cfg, m0 + LORA_DOWN, params, NULL);
    for (int n = 0; n < BT; n++) {
        const float *h = la.h + (size_t)n * H;
        if (own(sp, n, T)) {
            float *xnext = la.xnext + (size_t)n * H;
            memcpy(xnext, la.x + (size_t)n * H, H * sizeof(float));
            for (int k = 0; k < K; k++)
                axpy(xnext, la.weight[(size_t)n * K + k], la.eout + ((size_t)n * K + k) * H, H);
        }
        float *sgu = la.sgu + (size_t)n * 2 * Is, *sact = la.sact + (size_t)n * Is;
        for (int i = 0; i < Is; i++) {
            sgu[i] = dot(h, lp.sg + (size_t)i * H, H);
            sgu[Is + i] = dot(h, lp.su + (size_t)i * H, H);
        }
        lora_forward(&lg, sgu, h, a.lu);
        lora_forward(&lu, sgu + Is, h, a.lu);
        swiglu_forward(sact, sgu, Is);
        for (int c = 0; c < H; c++) y[(size_t)n * H + c] = dot(sact, lp.sd + (size_t)c * Is, Is);
        lora_forward(&ld, y + (size_t)n * H, sact, a.lu);
    }
    if (tp_reduce(sp, y, tp_scratch(cfg, &a, B), B, T, H)) return -1;
    for (int n = 0; n < BT; n++)
        if (own(sp, n, T))
            axpy(la.xnext + (size_t)n * H, 1.0f, y + (size_t)n * H, H);
    return 0;
}

void model_forward_layer_begin(const ModelConfig *cfg, int l, float *const *params, void *ws) {
    Span sp = span_of(cfg, NULL);
    layer_begin(cfg, l, params, ws, &sp);
}

void model_forward_layer_end(const ModelConfig *cfg, int l, float *const *params, void *ws) {
    Span sp = span_of(cfg, NULL);
    layer_end(cfg, l, params, ws, &sp);
}

float *model_layer_moe_input(const ModelConfig *cfg, int l, void *ws) {
    Acts a;
    int B = acts_of(cfg, ws, &a);
    return layer_acts(cfg, &a, B, l).h;
}

float *model_layer_expert_out(const ModelConfig *cfg, int l, void *ws) {
    Acts a;
    int B = acts_of(cfg, ws, &a);
    return layer_acts(cfg, &a, B, l).eout;
}

// The runs of consecutive positions this rank computes: one run of B*T, or under sequence
// parallel B runs (one per row) of T/tp.  Sets *n0 (first position) of run r; returns the
// number of runs and *len their length.
static int own_runs(const Span *sp, int B, int T, int *len) {
    *len = sp->sp ? sp->t1 - sp->t0 : B * T;
    return sp->sp ? B : 1;
}
static size_t run_start(const Span *sp, int r, int T) { return sp->sp ? (size_t)r * T + sp->t0 : 0; }

int model_tp_forward_layer(const ModelConfig *cfg, int l, float *const *params, void *ws,
                           const ModelTp *tp) {
    int T = cfg->seq_len, H = cfg->hidden_size, K = cfg->top_k, I = cfg->expert_dim, len;
    Span sp = span_of(cfg, tp);
    Acts a;
    int B = acts_of(cfg, ws, &a);
    LayerActs la = layer_acts(cfg, &a, B, l);
    LayerParams lp = layer_params(cfg, l, params);
    if (layer_begin(cfg, l, params, ws, &sp)) return -1;
    const int runs = own_runs(&sp, B, T, &len);
    for (int r = 0; r < runs; r++) {
        const size_t n0 = run_start(&sp, r, T);
        model_experts_forward(cfg, lp.wgu, lp.wd, la.choice + n0 * K, la.h + n0 * H, K, len * K,
                              la.eout + n0 * K * H, la.egu + n0 * K * 2 * I,
                              la.eact + n0 * K * I);
    }
    return layer_end(cfg, l, params, ws, &sp);
}

void model_forward_layer(const ModelConfig *cfg, int l, float *const *params, void *ws) {
    model_tp_forward_layer(cfg, l, params, ws, NULL);
}

int model_tp_forward_head(const ModelConfig *cfg, float *const *params, void *ws,
                          const ModelTp *tp, float *loss) {
    int T = cfg->seq_len, H = cfg->hidden_size, V = cfg->vocab_size, L = cfg->num_layers;
    Span sp = span_of(cfg, tp);
    const int Vl = sp.V;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    const float *x = a.resid + (size_t)L * BT * H;        // (BT, H)
    const float *norm = params[model_final_norm(cfg)];    // (H)
    const float *query = params[model_output_query(cfg)]; // (H)
    const float *wlm = params[model_lm_head(cfg)];        // (V/tp, H): this rank's rows
    float *scratch = tp_scratch(cfg, &a, B);
    for (int n = 0; n < BT; n++)
        if (own(&sp, n, T))
            query_norm_forward(a.fnorm + (size_t)n * H, a.frstd + n, x + (size_t)n * H, query,
                               norm, H);
    if (sp.sp && seq_gather(&sp, a.fnorm, scratch, B, T, H)) return -1;
    // this rank's logits (BT, V/tp), all-gathered over tp into probs (BT, V)
    float *logits = sp.tp ? a.tpbuf : a.probs;
    const Lora lh = lora_of(cfg, LORA_PER_LAYER * L, params, NULL); // none under tp
    for (int n = 0; n < BT; n++) {
        for (int v = 0; v < Vl; v++)
            logits[(size_t)n * Vl + v] = dot(a.fnorm + (size_t)n * H, wlm + (size_t)v * H, H);
        lora_forward(&lh, logits + (size_t)n * Vl, a.fnorm + (size_t)n * H, a.lu);
    }
    if (sp.tp) {
        const size_t piece = (size_t)BT * Vl;
        if (sp.tp->all_gather(sp.tp->host, scratch, logits, piece)) return -1;
        for (int r = 0; r < sp.size; r++)
            for (int n = 0; n < BT; n++)
                memcpy(a.probs + (size_t)n * V + (size_t)r * Vl, scratch + r * piece + (size_t)n * Vl,
                       Vl * sizeof(float));
    }
    double total = 0.0;
    for (int n = 0; n < BT; n++) {
        float *probs = a.probs + (size_t)n * V, maxv = -INFINITY;
        for (int v = 0; v < V; v++)
            if (probs[v] > maxv) maxv = probs[v];
        int target = a.tokens[(n / T) * (T + 1) + n % T + 1];
        float target_logit = probs[target], sum = 0.0f;
        for (int v = 0; v < V; v++) {
            probs[v] = expf(probs[v] - maxv);
            sum += probs[v];
        }
        for (int v = 0; v < V; v++) probs[v] /= sum;
        a.losses[n] = logf(sum) - (target_logit - maxv);
        total += a.losses[n];
    }
    *loss = (float)(total / BT);
    return 0;
}

float model_forward_head(const ModelConfig *cfg, float *const *params, void *ws) {
    float loss = 0.0f;
    model_tp_forward_head(cfg, params, ws, NULL, &loss);
    return loss;
}

int model_forward(const ModelConfig *cfg, float *const *params, const int *tokens, int B,
                  float *loss, void *ws) {
    if (model_forward_embed(cfg, params, tokens, B, ws)) return -1;
    for (int l = 0; l < cfg->num_layers; l++) model_forward_layer(cfg, l, params, ws);
    *loss = model_forward_head(cfg, params, ws);
    return 0;
}

const int *model_routing(const ModelConfig *cfg, int l, const void *ws) {
    Acts a;
    int B = acts_of(cfg, (void *)ws, &a);
    return a.choice + (size_t)l * B * cfg->seq_len * cfg->top_k;
}

// ----------------------------------------------------------------------------
// backward

int model_tp_backward_head(const ModelConfig *cfg, float *const *params, float *const *grads,
                           void *ws, const ModelTp *tp) {
    int T = cfg->seq_len, H = cfg->hidden_size, V = cfg->vocab_size, L = cfg->num_layers;
    Span sp = span_of(cfg, tp);
    const int Vl = sp.V, v0 = sp.rank * Vl;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    const float *x = a.resid + (size_t)L * BT * H;        // (BT, H)
    int in = model_final_norm(cfg), iq = model_output_query(cfg), ih = model_lm_head(cfg);
    const float *wlm = params[ih];                        // (V/tp, H)
    float *dwlm = grads[ih];                              // (V/tp, H)
    float *dxn = a.dh; // (BT, H) d loss / d fnorm: partial over tp (dh is free here)
    const Lora lh = lora_of(cfg, LORA_PER_LAYER * L, params, grads); // none under tp
    memset(a.dresid, 0, (size_t)BT * H * sizeof(float));
    for (int n = 0; n < BT; n++) {
        const float *xn = a.fnorm + (size_t)n * H, *probs = a.probs + (size_t)n * V;
        int target = a.tokens[(n / T) * (T + 1) + n % T + 1];
        for (int v = 0; v < V; v++) a.dlogits[v] = probs[v] / BT;
        a.dlogits[target] -= 1.0f / BT;
        float *d = dxn + (size_t)n * H;
        memset(d, 0, (size_t)H * sizeof(float));
        for (int v = 0; v < Vl; v++) {
            axpy(dwlm + (size_t)v * H, a.dlogits[v0 + v], xn, H);
            axpy(d, a.dlogits[v0 + v], wlm + (size_t)v * H, H);
        }
        lora_backward(&lh, d, a.dlogits, xn, a.lu, a.lg);
    }
    if (tp_reduce(&sp, dxn, tp_scratch(cfg, &a, B), B, T, H)) return -1;
    for (int n = 0; n < BT; n++)
        if (own(&sp, n, T))
            query_norm_backward(a.dresid + (size_t)n * H, grads[iq], grads[in], dxn + (size_t)n * H,
                                x + (size_t)n * H, params[iq], params[in], a.frstd[n], H);
    return 0;
}

void model_backward_head(const ModelConfig *cfg, float *const *params, float *const *grads,
                         void *ws) {
    model_tp_backward_head(cfg, params, grads, ws, NULL);
}

// Backward of sconv_forward: dhn (B, T, H) = conv^T dh; adds into dw (H, 1, Kc).
static void sconv_backward(float *dhn, float *dw, const float *dh, const float *hn,
                           const float *w, int B, int T, int H, int Kc) {
    memset(dhn, 0, (size_t)B * T * H * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < Kc; j++) {
                int src = t - (Kc - 1) + j;
                if (src < 0) continue;
                const float *dout = dh + ((size_t)b * T + t) * H;
                const float *in = hn + ((size_t)b * T + src) * H;
                float *din = dhn + ((size_t)b * T + src) * H;
                for (int c = 0; c < H; c++) {
                    din[c] += w[c * Kc + j] * dout[c];
                    dw[c * Kc + j] += dout[c] * in[c];
                }
            }
}

// d loss / d (routing weight, expert output) of the pairs at this rank's positions.
static void layer_backward_begin(const ModelConfig *cfg, int l, void *ws, const Span *sp) {
    int T = cfg->seq_len, H = cfg->hidden_size, K = cfg->top_k;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    LayerActs la = layer_acts(cfg, &a, B, l);
    // dresid holds d loss / d xnext, which is also d loss / d (routed + shared).
    for (int n = 0; n < BT; n++) {
        if (!own(sp, n, T)) continue;
        const float *dy = a.dresid + (size_t)n * H;
        for (int k = 0; k < K; k++) {
            size_t nk = (size_t)n * K + k;
            a.edw[nk] = dot(dy, la.eout + nk * H, H);
            float *dout = a.edout + nk * H;
            for (int c = 0; c < H; c++) dout[c] = la.weight[nk] * dy[c];
        }
    }
}

void model_backward_layer_begin(const ModelConfig *cfg, int l, void *ws) {
    Span sp = span_of(cfg, NULL);
    layer_backward_begin(cfg, l, ws, &sp);
}

float *model_layer_expert_dout(const ModelConfig *cfg, void *ws) {
    Acts a;
    acts_of(cfg, ws, &a);
    return a.edout;
}

float *model_layer_expert_dh(const ModelConfig *cfg, void *ws) {
    Acts a;
    acts_of(cfg, ws, &a);
    return a.edh;
}

// The shared experts (this rank's part, at every position), then the routed pairs and the
// router at this rank's positions, the conv and the norm.  Without sequence parallel d loss /
// d h of the column-parallel shared experts is all-reduced over tp before the rest adds to
// it; with it, d output is all-gathered first and d conv input reduce-scattered after.
static int layer_backward_end(const ModelConfig *cfg, int l, float *const *params,
                              float *const *grads, void *ws, const Span *sp) {
    int T = cfg->seq_len, H = cfg->hidden_size, K = cfg->top_k, Is = sp->Is;
    Acts a;
    int B = acts_of(cfg, ws, &a), BT = B * T;
    LayerActs la = layer_acts(cfg, &a, B, l);
    LayerParams lp = layer_params(cfg, l, params);
    float *const *g = grads + model_layer_param(cfg, l, 0);
    float *dgate = g[LP_GATE];                               // (E, H)
    float *dsg = g[LP_SHARED_GATE], *dsu = g[LP_SHARED_UP]; // (Is/tp, H)
    float *dsd = g[LP_SHARED_DOWN];                          // (H, Is/tp)
    float *scratch = tp_scratch(cfg, &a, B);
    const int m0 = LORA_PER_LAYER * l; // the shared experts' adapters (none under tp)
    const Lora lg = lora_of(cfg, m0 + LORA_GATE, params, grads), lu = lora_of(cfg, m0 + LORA_UP, params, grads);
    const Lora ld = lora_of(cfg, m0 + LORA_DOWN, params, grads);

    const float *dyall = a.dresid; // d loss / d shared output at every position
    if (sp->sp) {
        memcpy(a.tpbuf, a.dresid, (size_t)BT * H * sizeof(float));
        if (seq_gather(sp, a.tpbuf, scratch, B, T, H)) return -1;
        dyall = a.tpbuf;
    }
    memset(a.dh, 0, (size_t)BT * H * sizeof(float));
    for (int n = 0; n < BT; n++) {
        const float *dy = dyall + (size_t)n * H, *h = la.h + (size_t)n * H;
        float *dh = a.dh + (size_t)n * H;
        const float *sgu = la.sgu + (size_t)n * 2 * Is, *sact = la.sact + (size_t)n * Is;
        memset(a.dsact, 0, (size_t)Is * sizeof(float));
        for (int c = 0; c < H; c++) {
            axpy(a.dsact, dy[c], lp.sd + (size_t)c * Is, Is);
            axpy(dsd + (size_t)c * Is, dy[c], sact, Is);
        }
        lora_backward(&ld, a.dsact, dy, sact, a.lu, a.lg);
        swiglu_backward(a.dsgu, a.dsact, sgu, Is);
        lora_backward(&lg, dh, a.dsgu, h, a.lu, a.lg);
        lora_backward(&lu, dh, a.dsgu + Is, h, a.lu, a.lg);
        for (int i = 0; i < Is; i++) {
            axpy(dsg + (size_t)i * H, a.dsgu[i], h, H);
            axpy(dh, a.dsgu[i], lp.sg + (size_t)i * H, H);
            axpy(dsu + (size_t)i * H, a.dsgu[Is + i], h, H);
            axpy(dh, a.dsgu[Is + i], lp.su + (size_t)i * H, H);
        }
    }
    if (sp->tp && !sp->sp && sp->tp->all_reduce(sp->tp->host, a.dh, (size_t)BT * H)) return -1;
    for (int n = 0; n < BT; n++) {
        if (!own(sp, n, T)) continue;
        const float *h = la.h + (size_t)n * H;
        float *dh = a.dh + (size_t)n * H;
        for (int k = 0; k < K; k++) axpy(dh, 1.0f, a.edh + ((size_t)n * K + k) * H, H);

        // w_k = s_k / S: d s_k = (d w_k - sum_j w_j d w_j) / S; d logit = d s * s (1 - s).
        const int *choice = la.choice + (size_t)n * K;
        const float *weight = la.weight + (size_t)n * K, *score = la.score + (size_t)n * cfg->num_experts;
        const float *dweight = a.edw + (size_t)n * K;
        float sum = 0.0f, wdw = 0.0f;
        for (int k = 0; k < K; k++) {
            sum += score[choice[k]];
            wdw += weight[k] * dweight[k];
        }
        for (int k = 0; k < K; k++) {
            float s = score[choice[k]];
            float dlogit = (dweight[k] - wdw) / sum * s * (1.0f - s);
            axpy(dgate + (size_t)choice[k] * H, dlogit, h, H);
            axpy(dh, dlogit, lp.gate + (size_t)choice[k] * H, H);
        }
    }

    sconv_backward(a.dhnorm, g[LP_MLP_SCONV], a.dh, la.hnorm, lp.sconv, B, T, H,
                   cfg->conv_kernel);
    if (sp->sp && seq_reduce_scatter(sp, a.dhnorm, scratch, B, T, H)) return -1;
    // x feeds both xnext (identity: dresid already holds it) and the norm.
    for (int n = 0; n < BT; n++)
        if (own(sp, n, T))
            query_norm_backward(a.dresid + (size_t)n * H, g[LP_MLP_QUERY], g[LP_MLP_NORM],
                                a.dhnorm + (size_t)n * H, la.x + (size_t)n * H, lp.query,
                                lp.norm, la.rstd[n], H);
    return 0;
}

void model_backward_layer_end(const ModelConfig *cfg, int l, float *const *params,
                              float *const *grads, void *ws) {
    Span sp = span_of(cfg, NULL);
    layer_backward_end(cfg, l, params, grads, ws, &sp);
}

int model_tp_backward_layer(const ModelConfig *cfg, int l, float *const *params,
                            float *const *grads, void *ws, const ModelTp *tp) {
    int T = cfg->seq_len, H = cfg->hidden_size, K = cfg->top_k, I = cfg->expert_dim, len;
    Span sp = span_of(cfg, tp);
    Acts a;
    int B = acts_of(cfg, ws, &a);
    LayerActs la = layer_acts(cfg, &a, B, l);
    LayerParams lp = layer_params(cfg, l, params);
    float *const *g = grads + model_layer_param(cfg, l, 0);
    layer_backward_begin(cfg, l, ws, &sp);
    const int runs = own_runs(&sp, B, T, &len);
    for (int r = 0; r < runs; r++) {
        const size_t n0 = run_start(&sp, r, T);
        model_experts_backward(cfg, lp.wgu, lp.wd, la.choice + n0 * K, la.h + n0 * H, K, len * K,
                               la.egu + n0 * K * 2 * I, la.eact + n0 * K * I, a.edout + n0 * K * H,
                               a.edh + n0 * K * H, g[LP_EXPERTS_GATE_UP], g[LP_EXPERTS_DOWN], ws);
    }
    return layer_backward_end(cfg, l, params, grads, ws, &sp);
}

void model_backward_layer(const ModelConfig *cfg, int l, float *const *params,
                          float *const *grads, void *ws) {
    model_tp_backward_layer(cfg, l, params, grads, ws, NULL);
}

void model_backward_embed(const ModelConfig *cfg, float *const *grads, void *ws) {
    int T = cfg->seq_len, H = cfg->hidden_size;
    Acts a;
    int B = acts_of(cfg, ws, &a);
    float *dwte = grads[MODEL_EMBED]; // (V, H)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            axpy(dwte + (size_t)a.tokens[b * (T + 1) + t] * H, 1.0f,
                 a.dresid + ((size_t)b * T + t) * H, H);
}

void model_backward(const ModelConfig *cfg, float *const *params, float *const *grads, void *ws) {
    model_backward_head(cfg, params, grads, ws);
    for (int l = cfg->num_layers - 1; l >= 0; l--) model_backward_layer(cfg, l, params, grads, ws);
    model_backward_embed(cfg, grads, ws);
}
