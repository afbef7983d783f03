/*
 * model.h: a small inkling2-like MoE character-level language model on the CPU: forward
 * and exact backward in fp32, single-threaded, no moonshard dependency.
 *
 * There is no attention: token mixing is a causal depthwise short convolution. One layer:
 *
 *   r   = x * (1 + q)                       ResidualQuery, q = mlp_query.query (FP32 module)
 *   hn  = RMSNorm(r) * mlp_norm.weight      eps 1e-6
 *   h   = causal depthwise conv of hn over time with mlp_sconv.weight (left zero padding):
 *         h[t, c] = sum_j w[c, 0, j] * hn[t - (Kc-1) + j, c]   (tap Kc-1 is the current token)
 *   s   = sigmoid(h @ gate.weight^T)                           router scores (E)
 *   top-K experts by s + e_score_correction_bias (ties: lower index); the bias only selects
 *   w_k = s_k / sum of the chosen s                            routing weights (K)
 *   routed = sum_k w_k * (silu(h @ Wg_e) * (h @ Wu_e)) @ Wd_e
 *            [Wg_e | Wu_e] = gate_and_up_projs[e] (H, 2I): columns [0, I) gate, [I, 2I) up
 *            Wd_e = down_projs[e] (I, H)
 *   shared = (silu(h @ Sg^T) * (h @ Su^T)) @ Sd^T              the shared experts fused (Is)
 *   x   = x + routed + shared
 *
 * then x = x * (1 + output_query.query); x = RMSNorm(x) * norm.weight; logits = x @ lm_head^T;
 * loss = mean over the B*T positions of the cross-entropy of the next byte.
 *
 * Parameters, in this order (the table of model_params; Is = I * n_shared; "fp32": the
 * module is FP32 in inkling2):
 *
 *   model.embed_tokens.weight                          (V, H)
 *   per layer i:
 *   model.layers.{i}.mlp_query.query                   (H)            fp32
 *   model.layers.{i}.mlp_norm.weight                   (H)
 *   model.layers.{i}.mlp_sconv.weight                  (H, 1, Kc)
 *   model.layers.{i}.mlp.gate.weight                   (E, H)         fp32
 *   model.layers.{i}.mlp.gate.e_score_correction_bias  (E)            fp32, requires_grad 0
 *   model.layers.{i}.mlp.experts.gate_and_up_projs     (E, H, 2I)
 *   model.layers.{i}.mlp.experts.down_projs            (E, I, H)
 *   model.layers.{i}.mlp.shared_experts.gate_proj.weight (Is, H)
 *   model.layers.{i}.mlp.shared_experts.up_proj.weight   (Is, H)
 *   model.layers.{i}.mlp.shared_experts.down_proj.weight (H, Is)
 *   model.norm.weight                                  (H)
 *   model.output_query.query                           (H)            fp32
 *   lm_head.weight                                     (V, H)         untied
 *
 * Parameters and gradients are passed as an array of pointers, one per parameter in table
 * order, each to a contiguous row-major f32 tensor of the shape above: a host points each
 * at its own (unsharded) buffer, or at offsets of one flat array (model_param_pointers).
 * Activations live in a workspace the caller allocates (model_workspace_size). No globals:
 * calls on different workspaces and gradient buffers may run concurrently on many threads.
 */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stddef.h>
#include <stdint.h>

// ----------------------------------------------------------------------------
// configuration

typedef struct {
    int vocab_size;   // V (256: bytes)
    int hidden_size;  // H
    int num_layers;   // L
    int num_experts;  // E, routed experts
    int top_k;        // K, experts per token
    int expert_dim;   // I, intermediate size of one routed expert
    int num_shared;   // n_shared; the fused shared MLP has Is = I * n_shared
    int conv_kernel;  // Kc, short-conv kernel
    int seq_len;      // T
    const struct ModelLora *lora; // LoRA adapters (below), NULL: none
} ModelConfig;

// V=256, H=64, L=2, E=4, K=2, I=64, n_shared=1, Kc=4, T=64, no LoRA.
void model_config_default(ModelConfig *cfg);
// 0 when every size is positive and K <= E; else -1 with the reason in err.
int model_config_check(const ModelConfig *cfg, char *err, size_t errlen);

// ----------------------------------------------------------------------------
// parameters

enum { MODEL_NAME_MAX = 96 };

typedef struct {
    char name[MODEL_NAME_MAX]; // dotted inkling2 name
    int ndim;
    int shape[3];
    size_t numel;
    size_t offset;             // in floats, into one flat array of model_param_numel floats
    int fp32_module;           // 1 when the parameter belongs to an FP32 module in inkling2
    int requires_grad;         // 0 for e_score_correction_bias: backward never touches it
} ModelParam;

// Indices of one layer's parameters relative to model_layer_param(cfg, l, 0).
enum {
    LP_MLP_QUERY, LP_MLP_NORM, LP_MLP_SCONV, LP_GATE, LP_GATE_BIAS,
    LP_EXPERTS_GATE_UP, LP_EXPERTS_DOWN, LP_SHARED_GATE, LP_SHARED_UP, LP_SHARED_DOWN,
    LP_COUNT
};
enum { MODEL_EMBED = 0 }; // model.embed_tokens.weight is parameter 0

int model_param_count(const ModelConfig *cfg);             // 1 + L*LP_COUNT + 3 tensors (+ LoRA's)
int model_layer_param(const ModelConfig *cfg, int l, int k); // index of layer l's parameter k
int model_final_norm(const ModelConfig *cfg);               // index of model.norm.weight
int model_output_query(const ModelConfig *cfg);             // index of model.output_query.query
int model_lm_head(const ModelConfig *cfg);                  // index of lm_head.weight
// Fills out[model_param_count(cfg)]; returns the total number of floats.
size_t model_params(const ModelConfig *cfg, ModelParam *out);
size_t model_param_numel(const ModelConfig *cfg);
// ptrs[i] = flat + offset of parameter i (ptrs has model_param_count(cfg) entries).
void model_param_pointers(const ModelConfig *cfg, float *flat, float **ptrs);

// Deterministic init of parameter i into dst (numel floats): matrices normal with std
// 1/sqrt(fan_in) (embedding: std 1), norm weights 1, queries 0, the correction bias 0.
// The values depend on (seed, i, shape) only, so a host may init one tensor at a time.
void model_init_param(const ModelConfig *cfg, int i, float *dst, uint64_t seed);
// model_init_param for every parameter into one flat array laid out as model_params says.
void model_init(const ModelConfig *cfg, float *flat, uint64_t seed);

// ----------------------------------------------------------------------------
// LoRA adapters (NeMo Automodel's LinearLoRA) on the Linear modules
//
// The Linear modules, numbered: per layer l the shared experts' gate_proj, up_proj and
// down_proj (module 3l + LORA_GATE, LORA_UP, LORA_DOWN), then lm_head (module 3L).  An
// adapter of rank r on module W (out, in) has A (r, in) and B (out, r), named
// "NAME.lora_A.weight" and "NAME.lora_B.weight" (NAME the module), and makes the module
// y = x W^T + scale * (x A^T) B^T, scale = alpha / r (no dropout).  With cfg->lora set the
// parameter table continues after lm_head with A then B of each module whose rank is not 0,
// in module order; the stage functions apply them and backward adds their exact gradients
// (and the base weights' as before: a host that freezes the base ignores those).  Init:
// A xavier normal (std sqrt(2 / (in + r))) or kaiming uniform with a = sqrt(5) (bound
// 1/sqrt(in)), as LinearLoRA's lora_A_init "xavier" or "uniform"; B zeros.
// Not with tensor parallelism (model_tp_check refuses it).
enum { LORA_GATE, LORA_UP, LORA_DOWN, LORA_PER_LAYER };
enum { LORA_INIT_XAVIER, LORA_INIT_UNIFORM };
typedef struct ModelLora {
    int *dim;     // (3L + 1) rank of each module's adapter, 0: none
    float *scale; // (3L + 1) alpha / rank
    int a_init;   // LORA_INIT_XAVIER or LORA_INIT_UNIFORM
} ModelLora;

int model_lora_module_count(const ModelConfig *cfg); // 3L + 1
// Module m's name ("model.layers.0.mlp.shared_experts.gate_proj", "lm_head") and its
// weight's (out, in).
void model_lora_module(const ModelConfig *cfg, int m, char *name, size_t len, int *out, int *in);
int model_base_param_count(const ModelConfig *cfg); // the table without adapters
// The table index of module m's A (which 0) or B (1), -1 without an adapter; and the module
// of adapter parameter i (*which 0 for A, 1 for B), -1 for a base parameter.
int model_lora_param(const ModelConfig *cfg, int m, int which);
int model_lora_of(const ModelConfig *cfg, int i, int *which);

// ----------------------------------------------------------------------------
// forward and backward

// Bytes of workspace for batches of up to B rows (64-byte aligned memory is best).
size_t model_workspace_size(const ModelConfig *cfg, int B);

// tokens: (B, T+1) bytes as ints, row b predicts tokens[b][1..T] from tokens[b][0..T-1].
// Writes the mean loss; keeps the activations (and a copy of the tokens) in ws for
// model_backward. Returns 0, or -1 when a token is outside [0, V).
int model_forward(const ModelConfig *cfg, float *const *params, const int *tokens, int B,
                  float *loss, void *ws);
// Adds d(mean loss)/d(param) into grads[i] for every parameter with requires_grad (the
// caller zeroes them; adding allows accumulation over micro-batches); grads of the other
// parameters are not touched and may be NULL. Needs the ws of the latest model_forward.
// params must hold the values the forward saw.
void model_backward(const ModelConfig *cfg, float *const *params, float *const *grads, void *ws);

// The same, by stage, for a host that unshards one unit at a time: a stage reads only its
// own parameters (embed: embed_tokens; layer l: layer l's; head: norm, output_query,
// lm_head) and may be given a params array whose other entries are NULL.
// model_forward = embed, layers 0..L-1, head; model_backward = head, layers L-1..0, embed.
int model_forward_embed(const ModelConfig *cfg, float *const *params, const int *tokens, int B,
                        void *ws);
void model_forward_layer(const ModelConfig *cfg, int l, float *const *params, void *ws);
float model_forward_head(const ModelConfig *cfg, float *const *params, void *ws);
void model_backward_head(const ModelConfig *cfg, float *const *params, float *const *grads,
                         void *ws);
void model_backward_layer(const ModelConfig *cfg, int l, float *const *params,
                          float *const *grads, void *ws);
void model_backward_embed(const ModelConfig *cfg, float *const *grads, void *ws);

// Pipeline stages (a host running layers [a, b) on one rank and the rest elsewhere):
// model_set_batch records the batch in ws as model_forward_embed does, without the embedding
// (a stage after the first needs the tokens for the head's targets; 0, or -1 when a token
// is outside [0, V)).  model_layer_input(l) is the residual stream entering layer l, (B, T,
// H) f32 in ws, l = L the head's input: write a received activation into layer a's before
// running it, read layer b's after running layer b-1 to send it on.  model_resid_grad is
// d loss / d residual stream, (B, T, H): after model_backward_head or model_backward_layer(l)
// it holds d loss / d model_layer_input(l) (L for the head); write a received gradient into
// it before running model_backward_layer(b-1).  All three need the batch size set first
// (model_set_batch or model_forward_embed), and point into ws.
int model_set_batch(const ModelConfig *cfg, const int *tokens, int B, void *ws);
float *model_layer_input(const ModelConfig *cfg, int l, void *ws);
float *model_resid_grad(const ModelConfig *cfg, void *ws);

// The experts chosen in the latest forward: (B, T, K) indices for layer l, in the order
// of selection. Borrowed from ws.
const int *model_routing(const ModelConfig *cfg, int l, const void *ws);

// ----------------------------------------------------------------------------
// routed experts run elsewhere (expert parallelism)
//
// A layer's routed experts work on BT*K pairs: pair p = n*K + k sends the MoE input row
// h[n] (model_layer_moe_input) to expert model_routing(...)[p] and gets one output row
// back.  A host whose experts live on other ranks runs a layer in parts around them:
//   forward:  model_forward_layer_begin (norm, conv, router); fill the (BT*K, H) rows of
//             model_layer_expert_out with model_experts_forward run where each expert
//             lives; model_forward_layer_end (weighted sum of the pairs, shared experts).
//   backward: model_backward_layer_begin (fills model_layer_expert_dout: d loss / d output
//             of each pair); model_experts_backward where each expert lives, writing d loss
//             / d h of each pair into model_layer_expert_dh; model_backward_layer_end
//             (shared experts, router, conv, norm; layer l's dense gradients).
// model_forward_layer and model_backward_layer are exactly these with every expert local,
// so an expert-parallel run computes every pair with the same arithmetic.

void model_forward_layer_begin(const ModelConfig *cfg, int l, float *const *params, void *ws);
float *model_layer_moe_input(const ModelConfig *cfg, int l, void *ws);  // (BT, H)
float *model_layer_expert_out(const ModelConfig *cfg, int l, void *ws); // (BT*K, H)
void model_forward_layer_end(const ModelConfig *cfg, int l, float *const *params, void *ws);
void model_backward_layer_begin(const ModelConfig *cfg, int l, void *ws);
float *model_layer_expert_dout(const ModelConfig *cfg, void *ws); // (BT*K, H), current layer
float *model_layer_expert_dh(const ModelConfig *cfg, void *ws);   // (BT*K, H), current layer
void model_backward_layer_end(const ModelConfig *cfg, int l, float *const *params,
                              float *const *grads, void *ws);

// n rows through experts: row j is x + (j / rep) * H (rep = K walks a layer's pairs, 1 a
// packed list) through expert ids[j] of wgu (E', H, 2I) and wd (E', I, H), E' the experts
// this caller holds.  Writes out (n, H) and keeps gu (n, 2I) and act (n, I) for backward.
void model_experts_forward(const ModelConfig *cfg, const float *wgu, const float *wd,
                           const int *ids, const float *x, int rep, int n, float *out, float *gu,
                           float *act);
// Backward of the same rows: dout (n, H) gives dx (n, H) (written) and adds into dwgu and
// dwd (shaped as wgu and wd).  ws: any workspace of this config (scratch rows).
void model_experts_backward(const ModelConfig *cfg, const float *wgu, const float *wd,
                            const int *ids, const float *x, int rep, int n, const float *gu,
                            const float *act, const float *dout, float *dx, float *dwgu,
                            float *dwd, void *ws);

// ----------------------------------------------------------------------------
// tensor parallelism (tp ranks share each data-parallel rank's rows; the host's tp.c)
//
// The shared experts are split Megatron-style over the tp ranks: gate_proj and up_proj
// column-parallel (rank t holds rows [t Is/tp, (t+1) Is/tp) of the (Is, H) weights),
// down_proj row-parallel (columns [t Is/tp, ...) of the (H, Is) weight, stored as an
// (H, Is/tp) piece); lm_head column-parallel (rows [t V/tp, (t+1) V/tp) of (V, H)), its
// logits all-gathered over tp before the cross-entropy.  Every other parameter is
// replicated over tp.  params[i] of a split tensor points at this rank's piece, contiguous.
//
// Without sequence parallel (sp = 0) every tp rank holds the whole residual stream; each
// layer all-reduces the shared MLP's output (forward) and d loss / d h of its input
// (backward), the head all-gathers logits and all-reduces d loss / d (normed input).  The
// gradients of replicated parameters come out equal on every tp rank.
// With sp = 1 the residual stream is split on the sequence (Shard(1) of (B, T, H)): rank t
// holds positions [t T/tp, (t+1) T/tp) of every row and runs the per-token parts (query,
// norms, router, routed experts) there.  The norm output is all-gathered before the causal
// conv (which mixes positions) and the shared MLP; the shared MLP's output reduce-scattered
// back to the sequence; backward: all-gather of d output before the row-parallel part,
// reduce-scatter of d conv input.  The head all-gathers its normed input.  The gradients of
// the replicated parameters are then partial sums over tp: the host all-reduces them.
typedef struct ModelTp {
    int size, rank; // the tp group and this rank's place in it
    int sp;         // sequence parallel
    void *host;     // passed to the collectives
    // Collectives on the tp group, f32, 0 or -1 on failure: the sum over the group in
    // place; out (size * n) = every rank's in (n) in rank order; out (n) = the sum over
    // the group of chunk `rank` of in (size * n).
    int (*all_reduce)(void *host, float *x, size_t n);
    int (*all_gather)(void *host, float *out, const float *in, size_t n);
    int (*reduce_scatter)(void *host, float *out, const float *in, size_t n);
} ModelTp;

// 0 when tp (with sp) splits this config and B rows evenly (and, tp > 1, it has no LoRA
// adapter); else -1 with the reason in err.
int model_tp_check(const ModelConfig *cfg, int tp, int sp, char *err, size_t errlen);
// The stage functions under tensor parallelism (tp NULL or size 1: the plain ones).  Every
// expert is local.  -1 when a collective failed.
int model_tp_forward_layer(const ModelConfig *cfg, int l, float *const *params, void *ws,
                           const ModelTp *tp);
int model_tp_forward_head(const ModelConfig *cfg, float *const *params, void *ws,
                          const ModelTp *tp, float *loss);
int model_tp_backward_head(const ModelConfig *cfg, float *const *params, float *const *grads,
                           void *ws, const ModelTp *tp);
int model_tp_backward_layer(const ModelConfig *cfg, int l, float *const *params,
                            float *const *grads, void *ws, const ModelTp *tp);

#endif
