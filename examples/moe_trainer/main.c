/*
 * main.c: moe_trainer, a host program that trains the MoE character LM of model.h through
 * moonshard shard units chosen by a Lua policy, its ranks threads of this process.
 *
 *   moe_trainer -n RANKS --mesh SPEC --policy DIR --steps N [--seed S] [--config FILE] [--save FILE]
 *               [--save-dir DIR [--save-every K] [--keep-last N]] [--resume DIR | --init-from PATH]
 *
 * Rank 0 prints a banner ("# " lines), then "step K loss L lr X grad_norm G time_ms T
 * tokens_per_s R" per step (and "eval K loss L time_ms T" with --eval-every); USAGE below
 * lists every option.  pipeline.c runs the pipeline (--mesh pp=P): train_step hands it the
 * step.
 */
#include <moonshard.h>
#include <moonshard_embed.h>

#include "route.h"
#include "save.h"
#include "tp.h"
#include "trainer.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef MOONSHARD_HAVE_MPI
#include <mpi.h>
#endif

// ----------------------------------------------------------------------------
// hyperparameters: fixed, so that runs on any number of ranks are comparable

#define LR 3e-3 // --lr; --min-lr defaults to it: a constant learning rate
#define DEFAULT_SEED 42
#define EVAL_TAIL 10 // --eval-every holds out the last 1/EVAL_TAIL of the text
#define DEFAULT_EVAL_BATCHES 4
#define EVAL_SEED 0 // the held-out batches' rows: the same whatever --seed is
#define BETA1 0.9
#define BETA2 0.95
#define ADAM_EPS 1e-8 // --eps
#define WEIGHT_DECAY 0.0
#define CLIP_NORM 1.0 // --max-norm
#define DEFAULT_BATCH 8
#define MAX_RANKS 64
#define MAX_CONFIG_VALUE (1 << 20)
// --config is a few lines: a larger file, or one that is no regular file, is refused.
#define MAX_CONFIG_BYTES (1L << 20)

// ----------------------------------------------------------------------------
// options

static const char USAGE[] =
    "usage: moe_trainer -n RANKS --mesh SPEC --policy PATH --steps N [--seed S] [options]\n"
    "\n"
    "Trains a small inkling2-like MoE character-level language model (model.h) on a text,\n"
    "its parameters held in moonshard shard units that a Lua policy chooses.  RANKS ranks\n"
    "run as threads of this process, or under mpirun (mpirun -np RANKS moe_trainer -n RANKS\n"
    "...) one rank a process.  Rank 0 prints a banner of \"# \" lines (the model, its\n"
    "parameters, the mesh and world, rank 0's units with their dtypes and resharding, the\n"
    "policy, the recipe, the optimizer, the learning-rate schedule, the seed, the data),\n"
    "then after every step one line:\n"
    "  step K loss L lr X grad_norm G time_ms T tokens_per_s R\n"
    "L the training loss of the global batch (the mean over the data-parallel ranks), X the\n"
    "learning rate step K used, G the global gradient norm before clipping (over every\n"
    "unit and rank), T the step's wall time on rank 0 and R = batch_size x seq_len / T.\n"
    "Everything before time_ms is the same bits on any backend; time_ms and tokens_per_s\n"
    "are the only fields that vary between identical runs.  With --eval-every K, after\n"
    "steps K, 2K, ... and the last: \"eval K loss L time_ms T\", L the mean loss of the\n"
    "held-out batches.  At the end \"# done: ...\" gives the totals.\n"
    "\n"
    "required:\n"
    "  -n RANKS        ranks, 1..64: pp x dp_replicate x dp_shard x tp of the mesh (under\n"
    "                  mpirun, the number of processes)\n"
    "  --mesh SPEC     e.g. dp_shard=4, dp_replicate=2,dp_shard=2 (HSDP: dp_replicate > 1\n"
    "                  needs dp_shard > 1), dp_shard=4,ep=2 (ep divides the data-parallel\n"
    "                  ranks), pp=2,dp_shard=2 (a pipeline) or dp_shard=2,tp=2 (tensor\n"
    "                  parallel), below: axes dp_replicate, dp_shard, ep, pp and tp, each at\n"
    "                  most once, sizes 1..64, unset sizes 1; cp may be given as 1 only (not\n"
    "                  implemented); ep, pp and tp: at most one of them above 1\n"
    "  --policy PATH   a policy directory or file (policies/inkling2, policies/full_fp32.lua)\n"
    "  --steps N       optimizer steps (>= 0; 0 with --save saves the initial parameters)\n"
    "options:\n"
    "  --seed S        seeds the initial parameters and the batches (default 42)\n"
    "  --lr X          the peak learning rate (default 3e-3)\n"
    "  --warmup-steps W  steps of linear warm-up (default 0)\n"
    "  --min-lr Y      the learning rate the cosine decay ends at on step N (default: --lr,\n"
    "                  a constant rate); 0 <= Y <= X.  Step k (1..N) uses\n"
    "                    X k / W                                   for k <= W\n"
    "                    Y + (X - Y) (1 + cos(pi (k - W) / (N - W))) / 2   for k > W\n"
    "  --eval-every K  hold out the last tenth of the text (at least seq_len + 1 bytes),\n"
    "                  never trained on (the batches are drawn from the rest), and after\n"
    "                  every K steps and the last step print the mean loss of\n"
    "                  --eval-batches global batches of it: the same rows every time and on\n"
    "                  any mesh, forward only, split over the ranks as a training batch\n"
    "  --eval-batches N  held-out batches of batch_size rows an eval averages (default 4)\n"
    "  --config FILE   model and batch sizes as key = value lines ('#' starts a comment);\n"
    "                  keys and defaults: hidden_size 64, num_layers 2, num_experts 4,\n"
    "                  top_k 2, expert_dim 64, num_shared 1, conv_kernel 4, seq_len 64,\n"
    "                  batch_size 8, each 1..1048576; the vocabulary is the 256 byte values\n"
    "  --data FILE     the text to learn (default " DATA_DEFAULT_PATH ")\n"
    "  --save FILE     after the last step, write every parameter (f32, model.h names) to a\n"
    "                  safetensors file: checked before training (a FILE that cannot be\n"
    "                  written fails at once), then written as FILE.XXXXXX beside it after\n"
    "                  the last step, synced to disk and renamed to FILE; a run that fails\n"
    "                  or is killed before that leaves no FILE.XXXXXX and FILE as it was\n"
    "  --save-dir DIR  moonshard checkpoints of the units (docs/checkpoints.md) in DIR:\n"
    "                  DIR/step_K (every rank writes its shards: parameters, AdamW state)\n"
    "                  after every --save-every K steps and after the last, DIR/latest\n"
    "                  naming the newest; its extra keeps the trainer's state: the data\n"
    "                  position (the batches are drawn for (seed, step)), the seed (the\n"
    "                  RNG state), the lr schedule and the step's lr, the model's sizes.\n"
    "                  A kill at any moment leaves DIR/latest naming a whole checkpoint;\n"
    "                  each save prints \"# saved: DIR/step_K (step K) in S s\".  DIR is made\n"
    "                  (with its parents) before training; refused when it holds another\n"
    "                  run's checkpoints (a fresh run: any step_*; a resumed run: those past\n"
    "                  its step).  With --steps 0 it saves step 0, the initial parameters\n"
    "  --save-every K  with --save-dir: a checkpoint after steps K, 2K, ... (default: only\n"
    "                  after the last)\n"
    "  --keep-last N   with --save-dir: after each save keep only the newest N step_*\n"
    "  --resume DIR    continue from a checkpoint (DIR/step_K, or DIR whose latest names\n"
    "                  one) saved by moe_trainer on any mesh: the units' parameters and\n"
    "                  AdamW state are loaded onto this run's mesh, and steps K+1..N run\n"
    "                  (--steps N is the total count; K = N runs none).  Refused when the\n"
    "                  checkpoint's model sizes or --seed differ from this run's (named);\n"
    "                  another --data, batch_size or --eval-every (which holds a tail out)\n"
    "                  draws other batches, said in a \"# resume: note:\" line.\n"
    "                  On the same mesh the losses and parameters are the uninterrupted\n"
    "                  run's bits; on another, within the parity figures of README.md\n"
    "  --init-from PATH  the parameters from a Hugging Face checkpoint (a model.safetensors,\n"
    "                  its index, or their directory: e.g. what `moonshard checkpoint\n"
    "                  export DIR --to OUT` writes) instead of the seed, loaded before\n"
    "                  step 1; every missing, unexpected or mis-shaped tensor is named.\n"
    "                  On any mesh (tensor-parallel ones too); not with --resume\n"
    "  --recipe FILE   a NeMo Automodel recipe (a Lua file, docs/recipes.md) given to the\n"
    "                  planner before the policy: its peft section puts LoRA adapters on\n"
    "                  the matched Linear modules (the shared experts' gate_proj, up_proj,\n"
    "                  down_proj of each layer, lm_head), y = x W^T + alpha/dim (x A^T) B^T,\n"
    "                  A initialised by lora_A_init (xavier normal or kaiming uniform), B 0;\n"
    "                  every other parameter is frozen (no gradient, no optimizer state),\n"
    "                  so only the adapters train; --save writes them beside the base.\n"
    "                  Refused: adapters on GroupedExperts, dropout > 0, 4-bit\n"
    "                  quantization, fp8, QAT, and tp > 1\n"
    "  --lora-grad-check  with --recipe and -n 1: instead of training, compare the\n"
    "                  adapters' gradients (B set nonzero) on the first batch with an\n"
    "                  independent computation (the base weight's gradient at W + s B A,\n"
    "                  projected) and with central differences; prints \"lora_grad NAME\n"
    "                  independent=D fd=D\" (each the largest difference over the tensor's\n"
    "                  largest gradient)\n"
    "  --eps E         AdamW's eps (default 1e-8)\n"
    "  --max-norm X    the gradient norm is clipped at X (default 1.0; 0: no clipping)\n"
    "  --microbatches M  with pp > 1: micro-batches a step (default pp); M divides each\n"
    "                  data-parallel rank's rows, and 1F1B needs M >= pp (PyTorch's rule)\n"
    "  --schedule NAME with pp > 1: the policy's pipeline.schedule option (GPipe or 1F1B,\n"
    "                  the policy's default 1F1B)\n"
    "  --set NAME=VALUE  one of the policy's options, as moonshard plan --set takes it\n"
    "                  (repeatable; e.g. pack_islands=true packs the inkling2 policy's FP32\n"
    "                  islands into their layers' units: the same numbers, fewer collectives)\n"
    "  --sequence-parallel  with tp > 1: the residual stream split over the tp ranks on\n"
    "                  the sequence (sets the policy's option sequence_parallel=true)\n"
    "  --records       after step 1, print every collective rank 0's units issued in that\n"
    "                  step: \"unit NAME KIND DTYPE n=GROUP bytes=BYTES\" (with pp > 1 the\n"
    "                  units of stage 0, the only ones rank 0 holds)\n"
    "  --memory        at the end, print per rank the bytes its units allocated for\n"
    "                  parameters, gradients and optimizer state after the first step\n"
    "                  (counted where the memory is allocated), against the planner's\n"
    "                  figures and the units' own books: \"memory rank R CATEGORY\n"
    "                  allocated=N planned=N books=N ratio=X\"\n"
    "  -h, --help      this text\n"
    "\n"
    "The global batch is split evenly over the data-parallel ranks (batch_size must divide\n"
    "by dp_replicate x dp_shard).  AdamW: lr from the schedule above, betas (0.9, 0.95),\n"
    "eps --eps, no weight decay; gradient norm clipped at --max-norm; e_score_correction_bias\n"
    "is frozen.\n"
    "\n"
    "Expert parallelism (ep > 1): the ranks form groups of ep consecutive ranks; rank r\n"
    "holds experts [(r mod ep) E/ep, (r mod ep + 1) E/ep) of every layer, and each layer\n"
    "sends its tokens to the experts' ranks and the results back with all_to_all on that\n"
    "group (gradients likewise in backward).  The planner's MoE mesh decides the rest:\n"
    "with ep_shard = RANKS/ep > 1 the experts are also FSDP-sharded over ep_shard.\n"
    "\n"
    "Pipelines (pp > 1): the policy splits the layers over pp stages (the embedding in the\n"
    "first, the head in the last); rank r runs stage r / dp for the rows of data-parallel\n"
    "rank r mod dp, in M micro-batches in the schedule's order (1F1B: warm-up forwards,\n"
    "then one backward and one forward, then the last backwards), sending each\n"
    "micro-batch's activation to the next stage and its gradient back.  The units reduce\n"
    "once after the last micro-batch; the loss is the mean over micro-batches and ranks.\n"
    "Not with ep > 1 or tp > 1.\n"
    "\n"
    "Tensor parallelism (tp > 1): groups of tp consecutive ranks share one data-parallel\n"
    "rank's rows; the policy splits the shared experts (gate_proj and up_proj colwise,\n"
    "down_proj rowwise) and lm_head (colwise, logits all-gathered) over them, and the units\n"
    "shard each piece over dp_shard.  Each layer all-reduces the shared experts' output and,\n"
    "in backward, d loss / d their input over the tp group; with --sequence-parallel an\n"
    "all-gather and a reduce-scatter over the sequence replace each all-reduce.  tp must\n"
    "divide expert_dim x num_shared and 256 (and seq_len with --sequence-parallel).\n"
    "Not with ep > 1 or pp > 1.  Not implemented: context parallelism (cp: each sequence\n"
    "split over ranks).\n"
    "Exit status: 0 trained; 1 a failure while planning or training (or writing --save);\n"
    "2 refused before training: a usage error, a --config, --data or --save file, a\n"
    "--resume or --init-from path or a --save-dir that cannot be used, or a text shorter\n"
    "than seq_len + 1 bytes.  A --resume whose checkpoint does not fit the run, or a\n"
    "--save-dir holding checkpoints past the step it resumes at, is 1.\n";

// Prints an error refused before training, with the hint to --help for a usage error, and
// returns 2 (the exit status).
__attribute__((format(printf, 2, 3))) static int refuse(int usage, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("moe_trainer: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs(usage ? "\n(try 'moe_trainer --help')\n" : "\n", stderr);
    va_end(ap);
    return 2;
}
#define usage_error(...) refuse(1, __VA_ARGS__)
#define file_error(...) refuse(0, __VA_ARGS__) // a file named on the command line

// A whole-string integer in [lo, hi]; 0, or -1.
static int parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

// A finite number, the whole of s; 0 on success.
static int parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    const double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

// --mesh: the trainer needs the data-parallel and ep sizes.  Whatever it refuses is refused
// here, before any rank starts; the planner checks the sizes again.
static int parse_mesh(Options *o) {
    enum { DP_REPLICATE, DP_SHARD, EP, PP, TP, CP, NAXES }; // CP not implemented: only 1
    static const char *const axes[NAXES] = {"dp_replicate", "dp_shard", "ep", "pp", "tp", "cp"};
    static const char *const kinds[NAXES] = {[CP] = "context"};
    long size[NAXES] = {1, 1, 1, 1, 1, 1};
    int given[NAXES] = {0};
    char spec[256];
    if (!*o->mesh || snprintf(spec, sizeof spec, "%s", o->mesh) >= (int)sizeof spec)
        return usage_error("--mesh '%s': expected sizes like dp_shard=4", o->mesh);
    for (char *item = spec, *next; item; item = next) {
        next = strchr(item, ',');
        if (next) *next++ = '\0';
        char *eq = strchr(item, '=');
        if (!eq || eq == item)
            return usage_error("--mesh %s: '%s' is not AXIS=SIZE (e.g. dp_shard=4)", o->mesh, item);
        *eq = '\0';
        int a = 0;
        while (a < NAXES && strcmp(item, axes[a])) a++;
        if (a == NAXES)
            return usage_error("--mesh %s: unknown axis '%s' (axes: dp_replicate, dp_shard, ep, pp, tp; cp as 1)",
                               o->mesh, item);
        if (given[a]++) return usage_error("--mesh %s: axis '%s' given twice", o->mesh, item);
        if (parse_long(eq + 1, 1, MAX_RANKS, &size[a]))
            return usage_error("--mesh %s: the size of %s must be an integer 1..%d, got '%s'", o->mesh, item,
                               MAX_RANKS, eq + 1);
        if (a == CP && size[a] > 1)
            return usage_error("--mesh %s: %s parallelism (%s=%ld) is not implemented by moe_trainer; %s may only be 1",
                               o->mesh, kinds[a], item, size[a], item);
    }
    long dp = size[DP_REPLICATE] * size[DP_SHARD], world = dp * size[PP] * size[TP];
    if (world != o->nranks)
        return usage_error("--mesh %s has %ld ranks but -n is %d", o->mesh, world, o->nranks);
    if (size[PP] > 1 && size[EP] > 1)
        return usage_error("--mesh %s: expert parallelism under a pipeline (pp > 1 with ep > 1) is not implemented "
                           "by moe_trainer", o->mesh);
    if (size[TP] > 1 && size[EP] > 1) // tp.c runs every routed expert on the rank (route.c is per data-parallel rank)
        return usage_error("--mesh %s: tp = %ld with ep = %ld is not implemented by moe_trainer (under tensor "
                           "parallelism the routed experts stay replicated over tp); use one of them", o->mesh,
                           size[TP], size[EP]);
    if (size[TP] > 1 && size[PP] > 1)
        return usage_error("--mesh %s: tp = %ld with pp = %ld is not implemented by moe_trainer (each runs on its own; "
                           "the planner plans both together)", o->mesh, size[TP], size[PP]);
    if (size[DP_REPLICATE] > 1 && size[DP_SHARD] == 1) // the planner's rule, as Automodel's
        return usage_error("--mesh %s: dp_replicate = %ld needs dp_shard > 1 (for pure data parallelism use "
                           "dp_shard=%ld)", o->mesh, size[DP_REPLICATE], dp);
    // pp outermost, tp innermost: rank r is stage r / dp with tp = 1, data-parallel rank r / tp with pp = 1
    o->dp = (int)dp;
    o->pp = (int)size[PP];
    o->tp = (int)size[TP];
    o->ep = (int)size[EP];
    if (dp % o->ep)
        return usage_error("--mesh %s: ep = %d does not divide the %ld data-parallel ranks", o->mesh, o->ep, dp);
    return 0;
}

// --config: "key = value" lines of ModelConfig sizes and batch_size.
static int parse_config(Options *o) {
    struct { const char *key; int *value; } keys[] = {
        {"hidden_size", &o->model.hidden_size}, {"num_layers", &o->model.num_layers},
        {"num_experts", &o->model.num_experts}, {"top_k", &o->model.top_k},
        {"expert_dim", &o->model.expert_dim},   {"num_shared", &o->model.num_shared},
        {"conv_kernel", &o->model.conv_kernel}, {"seq_len", &o->model.seq_len},
        {"batch_size", &o->batch_size},
    };
    const int nkeys = sizeof keys / sizeof keys[0];
    char why[128];
    int opened;
    FILE *f = data_open_regular(o->config, MAX_CONFIG_BYTES, NULL, why, sizeof why, &opened);
    if (!f) return usage_error("--config %s: %s", o->config, why);
    char line[512];
    int status = 0;
    for (int lineno = 1; !status && fgets(line, sizeof line, f); lineno++) {
        line[strcspn(line, "#\n")] = '\0';
        for (size_t e = strlen(line); e && strchr(" \t\r", line[e - 1]); e--) line[e - 1] = '\0';
        if (line[strspn(line, " \t\r")] == '\0') continue; // blank or comment
        char key[64] = "", value[64], extra[64];
        long v;
        int n = sscanf(line, " %63[a-z_0-9] = %63s %63s", key, value, extra);
        int k = 0;
        while (k < nkeys && strcmp(key, keys[k].key)) k++;
        if (n >= 1 && k == nkeys)
            status = usage_error("--config %s:%d: unknown key '%s' (keys: hidden_size num_layers num_experts "
                                 "top_k expert_dim num_shared conv_kernel seq_len batch_size)", o->config, lineno, key);
        else if (n != 2 || value[strspn(value, "0123456789")] || !value[strspn(value, "0")])
            status = usage_error("--config %s:%d: expected 'KEY = N' with N a positive integer, got '%s'",
                                 o->config, lineno, line + strspn(line, " \t"));
        else if (parse_long(value, 1, MAX_CONFIG_VALUE, &v))
            status = usage_error("--config %s:%d: %s = %s exceeds the limit of %d", o->config, lineno, key, value,
                                 MAX_CONFIG_VALUE);
        else
            *keys[k].value = (int)v;
    }
    fclose(f);
    return status;
}

// Parses argv into o; 0 to run, -1 after --help (exit 0), 2 on a usage error.
static int parse_options(int argc, char **argv, Options *o) {
    memset(o, 0, sizeof *o);
    model_config_default(&o->model);
    o->batch_size = DEFAULT_BATCH;
    const char *n = NULL, *steps = NULL, *seed = NULL, *eps = NULL, *max_norm = NULL, *micro = NULL;
    const char *lr = NULL, *min_lr = NULL, *warmup = NULL, *eval_every = NULL, *eval_batches = NULL;
    const char *save_every = NULL, *keep_last = NULL;
    const struct { const char *flag; const char **value; } valued[] = {
        {"-n", &n},           {"--mesh", &o->mesh},     {"--policy", &o->policy}, {"--steps", &steps},
        {"--seed", &seed},    {"--config", &o->config}, {"--data", &o->data},     {"--save", &o->save},
        {"--eps", &eps},      {"--max-norm", &max_norm}, {"--microbatches", &micro},
        {"--schedule", &o->schedule}, {"--recipe", &o->recipe},
        {"--lr", &lr},        {"--min-lr", &min_lr},    {"--warmup-steps", &warmup},
        {"--eval-every", &eval_every}, {"--eval-batches", &eval_batches},
        {"--save-dir", &o->ckpt_dir}, {"--save-every", &save_every}, {"--keep-last", &keep_last},
        {"--resume", &o->resume}, {"--init-from", &o->init_from},
    };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        size_t k = 0;
        while (k < sizeof valued / sizeof valued[0] && strcmp(a, valued[k].flag)) k++;
        if (k < sizeof valued / sizeof valued[0]) {
            if (i + 1 == argc) return usage_error("%s needs a value", a);
            if (*valued[k].value) return usage_error("%s given twice", a);
            *valued[k].value = argv[++i];
        } else if (!strcmp(a, "--set")) {
            if (i + 1 == argc) return usage_error("--set needs a value (NAME=VALUE, the policy's option)");
            if (o->nsets == MAX_SETS) return usage_error("--set given more than %d times", MAX_SETS);
            if (!strchr(argv[i + 1], '=') || *argv[i + 1] == '=')
                return usage_error("--set %s: expected NAME=VALUE (e.g. pack_islands=true)", argv[i + 1]);
            o->sets[o->nsets++] = argv[++i];
        } else if (!strcmp(a, "--records")) {
            o->records = 1;
        } else if (!strcmp(a, "--memory")) {
            o->memory = 1;
        } else if (!strcmp(a, "--lora-grad-check")) {
            o->lora_grad_check = 1;
        } else if (!strcmp(a, "--sequence-parallel")) {
            o->sp = 1;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(USAGE, stdout);
            return -1;
        } else {
            return usage_error("unexpected argument '%s'", a);
        }
    }
    const char *missing = !n ? "-n RANKS" : !o->mesh ? "--mesh SPEC" : !o->policy ? "--policy PATH"
                        : !steps ? "--steps N" : NULL;
    if (missing) return usage_error("missing %s", missing);
    long v;
    if (parse_long(n, 1, MAX_RANKS, &v)) return usage_error("-n %s: expected a number of ranks 1..%d", n, MAX_RANKS);
    o->nranks = (int)v;
    if (parse_long(steps, 0, 1000000000L, &o->steps)) return usage_error("--steps %s: expected an integer >= 0", steps);
    char *end;
    errno = 0;
    o->seed = DEFAULT_SEED;
    if (seed) {
        o->seed = strtoull(seed, &end, 10);
        if (errno || end == seed || *end || *seed == '-') return usage_error("--seed %s: expected an integer >= 0", seed);
    }
    o->lr = LR;
    if (lr && (parse_double(lr, &o->lr) || !(o->lr > 0)))
        return usage_error("--lr %s: expected a finite number > 0", lr);
    o->min_lr = o->lr;
    if (min_lr && (parse_double(min_lr, &o->min_lr) || o->min_lr < 0 || o->min_lr > o->lr))
        return usage_error("--min-lr %s: expected a finite number from 0 to --lr (%g)", min_lr, o->lr);
    if (warmup && parse_long(warmup, 0, 1000000000L, &o->warmup))
        return usage_error("--warmup-steps %s: expected an integer >= 0", warmup);
    if (eval_every && parse_long(eval_every, 1, 1000000000L, &o->eval_every))
        return usage_error("--eval-every %s: expected an integer >= 1", eval_every);
    o->eval_batches = DEFAULT_EVAL_BATCHES;
    if (eval_batches && !eval_every) return usage_error("--eval-batches is for --eval-every");
    if (eval_batches && parse_long(eval_batches, 1, 1000000, &v))
        return usage_error("--eval-batches %s: expected an integer 1..1000000", eval_batches);
    if (eval_batches) o->eval_batches = (int)v;
    o->eps = ADAM_EPS;
    o->max_norm = CLIP_NORM;
    if (eps && (parse_double(eps, &o->eps) || !(o->eps > 0)))
        return usage_error("--eps %s: expected a finite number > 0", eps);
    if (max_norm && (parse_double(max_norm, &o->max_norm) || o->max_norm < 0))
        return usage_error("--max-norm %s: expected a finite number >= 0 (0: no clipping)", max_norm);
    int st = parse_mesh(o);
    if (!st && o->config) st = parse_config(o);
    if (st) return st;
    char err[256];
    if (model_config_check(&o->model, err, sizeof err)) return usage_error("%s", err);
    if (o->batch_size % o->dp)
        return usage_error("batch_size %d does not divide over the %d data-parallel ranks", o->batch_size, o->dp);
    if ((micro || o->schedule) && o->pp == 1)
        return usage_error("%s is for a pipeline (--mesh with pp > 1)", micro ? "--microbatches" : "--schedule");
    o->microbatches = o->pp;
    if (micro && parse_long(micro, 1, MAX_CONFIG_VALUE, &v))
        return usage_error("--microbatches %s: expected an integer 1..%d", micro, MAX_CONFIG_VALUE);
    if (micro) o->microbatches = (int)v;
    if (o->pp > 1 && (o->batch_size / o->dp) % o->microbatches)
        return usage_error("--microbatches %d does not divide the %d rows of each data-parallel rank (batch_size %d "
                           "over %d)", o->microbatches, o->batch_size / o->dp, o->batch_size, o->dp);
    if (o->model.num_experts % o->ep)
        return usage_error("num_experts %d does not divide over ep = %d", o->model.num_experts, o->ep);
    if (o->sp && o->tp == 1)
        return usage_error("--sequence-parallel needs tp > 1 in --mesh (it splits the sequence over the tp ranks)");
    if (model_tp_check(&o->model, o->tp, o->sp, err, sizeof err)) return usage_error("%s", err);
    if (o->recipe && o->tp > 1)
        return usage_error("--recipe with tp = %d: LoRA adapters under tensor parallelism are not implemented by "
                           "moe_trainer", o->tp);
    if ((save_every || keep_last) && !o->ckpt_dir)
        return usage_error("%s is for --save-dir", save_every ? "--save-every" : "--keep-last");
    if (save_every && parse_long(save_every, 1, 1000000000L, &o->ckpt_every))
        return usage_error("--save-every %s: expected an integer >= 1", save_every);
    if (keep_last && parse_long(keep_last, 1, 1000000, &v))
        return usage_error("--keep-last %s: expected an integer >= 1", keep_last);
    if (keep_last) o->keep_last = (int)v;
    if (o->ckpt_dir && !*o->ckpt_dir) return usage_error("--save-dir: expected a directory name, got ''");
    if (o->resume && o->init_from) return usage_error("--resume and --init-from: give one (a resumed run has its parameters)");
    if (o->lora_grad_check && (!o->recipe || o->nranks != 1))
        return usage_error("--lora-grad-check needs --recipe and -n 1");
    if (o->recipe) { // a regular file of at most 1 MiB, as --config (the interpreter reads it)
        int opened;
        FILE *f = data_open_regular(o->recipe, MAX_CONFIG_BYTES, NULL, err, sizeof err, &opened);
        if (!f) return file_error("--recipe %s: %s", o->recipe, err);
        fclose(f);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// one rank

// Records a failure in the rank's message ("WHAT: DETAIL") and returns st.
ms_status fail(Trainer *tr, ms_status st, const char *what, const char *fmt, ...) {
    char detail[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    snprintf(tr->args->err, sizeof tr->args->err, "%s: %s", what, detail);
    return st;
}

ms_status all_reduce_one(Trainer *tr, double *v, ms_op op) {
    ms_tensor *t = NULL;
    int64_t one = 1;
    TRY("wrapping a scalar", ms_tensor_wrap(&t, v, 1, &one, MS_F64));
    ms_status st = ms_all_reduce(tr->world, t, op);
    ms_tensor_release(t);
    TRY("all_reduce over the world", st);
    return MS_OK;
}

// 1 for the routed experts' tensors, which expert parallelism splits by expert (dim 0).
static int is_expert_param(const ModelConfig *cfg, int i) {
    if (i < 1 || i >= model_final_norm(cfg)) return 0;
    int k = (i - 1) % LP_COUNT;
    return k == LP_EXPERTS_GATE_UP || k == LP_EXPERTS_DOWN;
}

// The part of parameter i this rank's units hold: the whole tensor, or under expert
// parallelism the experts [ep_base, ep_base + ep_local) of an expert tensor.  Returns the
// offset in floats; *numel and shape (the part's) are filled.
size_t param_part(const Trainer *tr, int i, size_t *numel, int64_t shape[3]) {
    const ModelParam *p = &tr->table[i];
    for (int d = 0; d < 3; d++) shape[d] = p->shape[d];
    if (tp_split_dim(tr, i) >= 0) { // this rank's tp piece, contiguous at offset 0 (tp.c)
        tp_piece_shape(tr, i, numel, shape);
        return 0;
    }
    if (tr->ep == 1 || !is_expert_param(tr->cfg, i)) {
        *numel = p->numel;
        return 0;
    }
    size_t per_expert = p->numel / (size_t)p->shape[0];
    shape[0] = tr->ep_local;
    *numel = per_expert * (size_t)tr->ep_local;
    return per_expert * (size_t)tr->ep_base;
}

static int param_stage(const ModelConfig *cfg, int i) {
    const int m = model_lora_of(cfg, i, NULL); // an adapter: its module's stage
    if (m >= 0) return m == LORA_PER_LAYER * cfg->num_layers ? cfg->num_layers + 1 : 1 + m / LORA_PER_LAYER;
    if (i == MODEL_EMBED) return 0;
    if (i < model_final_norm(cfg)) return 1 + (i - 1) / LP_COUNT;
    return cfg->num_layers + 1;
}

// ----------------------------------------------------------------------------
// setup: describe, plan, materialise, initialise

// Module types the policies look for (inkling2's prepare_model needs GroupedExperts).
static const struct { const char *name, *type; } MODULE_TYPES[] = {
    {"model", "Inkling2Model"},           {"model.embed_tokens", "Embedding"},
    {"model.layers", "ModuleList"},       {"model.norm", "RMSNorm"},
    {"model.output_query", "ResidualQuery"}, {"lm_head", "Linear"},
};
// Per decoder layer, relative to model.layers.{i} ("" is the layer itself).
static const struct { const char *name, *type; } LAYER_TYPES[] = {
    {"", "Inkling2DecoderLayer"},    {"mlp_query", "ResidualQuery"},
    {"mlp_norm", "RMSNorm"},         {"mlp_sconv", "ShortConv"},
    {"mlp", "MoE"},                  {"mlp.gate", "Gate"},
    {"mlp.experts", "GroupedExperts"}, {"mlp.shared_experts", "MLP"},
    {"mlp.shared_experts.gate_proj", "Linear"}, {"mlp.shared_experts.up_proj", "Linear"},
    {"mlp.shared_experts.down_proj", "Linear"},
};

static ms_status describe_model(Trainer *tr) {
    const int n = model_base_param_count(&tr->opt->model); // the recipe adds the adapters
    ModelParam *table = calloc((size_t)n, sizeof *table);
    if (!table) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    model_params(&tr->opt->model, table);
    for (int i = 0; i < n; i++) {
        const ModelParam *p = &table[i];
        int64_t shape[3] = {p->shape[0], p->shape[1], p->shape[2]};
        ms_status st = ms_interp_model_param(tr->in, p->name, p->ndim, shape, MS_F32, p->requires_grad);
        if (st) free(table);
        TRY("describing the model", st);
    }
    free(table);
    for (size_t k = 0; k < sizeof MODULE_TYPES / sizeof MODULE_TYPES[0]; k++)
        TRY("describing the model", ms_interp_model_module_type(tr->in, MODULE_TYPES[k].name, MODULE_TYPES[k].type));
    for (int l = 0; l < tr->cfg->num_layers; l++)
        for (size_t k = 0; k < sizeof LAYER_TYPES / sizeof LAYER_TYPES[0]; k++) {
            char name[MODEL_NAME_MAX];
            snprintf(name, sizeof name, "model.layers.%d%s%s", l, *LAYER_TYPES[k].name ? "." : "", LAYER_TYPES[k].name);
            TRY("describing the model", ms_interp_model_module_type(tr->in, name, LAYER_TYPES[k].type));
        }
    return MS_OK;
}

// --recipe: the plan's model is the trainer's with the recipe's steps applied.  The steps
// the trainer runs are LoRA's (peft) on its Linear modules: every other step would change
// what the kernels compute (4-bit weights, fp8 or fake-quantized matmuls), so it is refused,
// as are expert adapters and dropout (ms_interp_recipe_ran).  Reads each Linear module's
// adapter (ms_interp_lora: rank, alpha, dropout, lora_A's init),
// checks the planned adapter shapes (ms_interp_param_info), and makes tr->cfg the model
// with them: the parameter table then continues with the adapters (model.h).
static ms_status lora_setup(Trainer *tr) {
    const Options *opt = tr->opt;
    const ModelConfig *base = &opt->model;
    static const char *const steps[] = {"quantization", "fp8", "qat"};
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        int ran;
        TRY("--recipe: reading the plan", ms_interp_recipe_ran(tr->in, steps[k], &ran));
        if (ran)
            return fail(tr, MS_ERR_ARG, "--recipe", "%s: its %s step is not implemented by moe_trainer, whose kernels "
                        "compute in f32 (it runs the peft step, LoRA on Linear modules, only)", opt->recipe, steps[k]);
    }
    const int L = base->num_layers, M = model_lora_module_count(base);
    for (int l = 0; l < L; l++) {
        char name[MODEL_NAME_MAX];
        ms_lora lora;
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts", l);
        TRY("--recipe: reading the adapters", ms_interp_lora(tr->in, name, &lora));
        if (lora.dim)
            return fail(tr, MS_ERR_ARG, "--recipe", "%s: its peft puts LoRA on the GroupedExperts %s (lora_gate_and_up_A/B, "
                        "lora_down_A/B); moe_trainer runs adapters on Linear modules only (the shared experts' gate_proj, "
                        "up_proj and down_proj, lm_head): narrow target_modules", opt->recipe, name);
    }
    tr->lora.dim = calloc((size_t)M, sizeof *tr->lora.dim);
    tr->lora.scale = calloc((size_t)M, sizeof *tr->lora.scale);
    if (!tr->lora.dim || !tr->lora.scale) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    tr->lora.a_init = LORA_INIT_XAVIER;
    for (int m = 0; m < M; m++) {
        char name[MODEL_NAME_MAX], fqn[MODEL_NAME_MAX + 16];
        int out, in;
        ms_lora lora;
        model_lora_module(base, m, name, sizeof name, &out, &in);
        TRY("--recipe: reading the adapters", ms_interp_lora(tr->in, name, &lora));
        const int dim = lora.dim;
        const double alpha = lora.alpha;
        if (!dim) continue;
        if (lora.dropout > 0)
            return fail(tr, MS_ERR_ARG, "--recipe", "%s: peft.dropout = %g: moe_trainer runs LoRA without dropout "
                        "(give dropout = 0 or leave it out)", opt->recipe, lora.dropout);
        // one peft section: every adapter is initialised alike
        tr->lora.a_init = lora.init_uniform ? LORA_INIT_UNIFORM : LORA_INIT_XAVIER;
        for (int which = 0; which < 2; which++) { // the plan's A [dim, in] and B [out, dim], trainable
            int ndim, rg;
            int64_t shape[MS_MAX_DIMS];
            snprintf(fqn, sizeof fqn, "%s.lora_%c.weight", name, which ? 'B' : 'A');
            TRY("--recipe: reading the adapters", ms_interp_param_info(tr->in, fqn, &ndim, shape, NULL, &rg));
            if (ndim != 2 || shape[0] != (which ? out : dim) || shape[1] != (which ? dim : in) || !rg)
                return fail(tr, MS_ERR_INTERNAL, "--recipe", "the plan's %s is not a trainable [%d, %d] tensor", fqn,
                            which ? out : dim, which ? dim : in);
        }
        tr->lora.dim[m] = dim;
        tr->lora.scale[m] = (float)(alpha / dim);
    }
    tr->lora_cfg = *base;
    tr->lora_cfg.lora = &tr->lora;
    tr->cfg = &tr->lora_cfg;
    tr->nparams = model_param_count(tr->cfg);
    return MS_OK;
}

// requires_grad of every parameter as planned: with a recipe's LoRA only the adapters train.
static ms_status planned_requires_grad(Trainer *tr) {
    for (int i = 0; i < tr->nparams; i++)
        TRY("reading the plan", ms_interp_param_info(tr->in, tr->table[i].name, &(int){0}, (int64_t[MS_MAX_DIMS]){0},
                                                     NULL, &tr->table[i].requires_grad));
    return MS_OK;
}

// Where every parameter lives, and which stages read each unit.
static ms_status locate_params(Trainer *tr) {
    for (int u = 0; u < tr->nunits; u++) {
        tr->units[u] = ms_interp_unit(tr->in, u);
        tr->first_stage[u] = tr->last_stage[u] = -1;
    }
    for (int i = 0; i < tr->nparams; i++) {
        TRY("locating parameters", ms_interp_find_param(tr->in, tr->table[i].name, &tr->unit_of[i], &tr->index_of[i]));
        int u = tr->unit_of[i], s = tr->stage_of[i] = param_stage(tr->cfg, i);
        if (u < 0 && tr->opt->pp > 1) continue; // another pipeline stage's
        if (u < 0) return fail(tr, MS_ERR_ARG, "locating parameters", "%s is held outside every shard unit",
                               tr->table[i].name);
        if (tr->first_stage[u] < 0 || s < tr->first_stage[u]) tr->first_stage[u] = s;
        if (s > tr->last_stage[u]) tr->last_stage[u] = s;
    }
    return MS_OK;
}

// Wraps this rank's part (param_part) of parameter i in the full buffer `data`.
static ms_status wrap_param(Trainer *tr, int i, float *data, ms_tensor **out) {
    size_t numel;
    int64_t shape[3];
    size_t off = param_part(tr, i, &numel, shape);
    TRY("wrapping a parameter", ms_tensor_wrap(out, data + off, tr->table[i].ndim, shape, MS_F32));
    return MS_OK;
}

// Every parameter from the seed into a full f32 buffer, then this rank's part into its unit
// (which keeps its own rows of it).
static ms_status init_params(Trainer *tr) {
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->unit_of[i] < 0) continue; // another pipeline stage's
        model_init_param(tr->cfg, i, tr->param_ptrs[i], tr->opt->seed);
        float *src = tr->param_ptrs[i];
        if (tp_split_dim(tr, i) >= 0) { // its tp piece, in the gradient buffer (free until step 1)
            tp_take_piece(tr, i, src, tr->grad_ptrs[i]);
            src = tr->grad_ptrs[i];
        }
        ms_tensor *full = NULL;
        ms_status st = wrap_param(tr, i, src, &full);
        if (st) return st;
        st = ms_unit_load_full(tr->units[tr->unit_of[i]], tr->index_of[i], full);
        ms_tensor_release(full);
        if (st && tr->ep > 1 && is_expert_param(tr->cfg, i))
            return fail(tr, st, "initialising the shards", "%s (with ep = %d a rank holds %d of the %d experts: "
                        "does the policy give them to expert parallelism with ctx:expert_parallel?)",
                        ms_last_error(), tr->ep, tr->ep_local, tr->cfg->num_experts);
        if (st && tp_split_dim(tr, i) >= 0)
            return fail(tr, st, "initialising the shards", "%s (with tp = %d a rank holds 1/%d of %s: does the policy "
                        "apply the tensor-parallel plan, tp_plans.inkling2, with ctx:tensor_parallel?)", ms_last_error(),
                        tr->tp, tr->tp, tr->table[i].name);
        TRY("initialising the shards", st);
    }
    return MS_OK;
}

// ----------------------------------------------------------------------------
// forward and backward by stage

static int uses(const Trainer *tr, int s, int u) {
    for (int i = 0; i < tr->nparams; i++)
        if (tr->unit_of[i] == u && tr->stage_of[i] == s) return 1;
    return 0;
}

// Starts the all-gather of every unit stage s reads that is not gathered yet.
ms_status unshard_stage(Trainer *tr, int s) {
    for (int u = 0; u < tr->nunits; u++) {
        if (tr->gathered[u] || !uses(tr, s, u)) continue;
        TRY("unshard", ms_unit_unshard(tr->units[u]));
        tr->gathered[u] = 1;
    }
    return MS_OK;
}

// Waits for stage s's units; its parameters, in their gather dtype, cast to f32 for the kernels.
ms_status gather_stage(Trainer *tr, int s) {
    for (int u = 0; u < tr->nunits; u++)
        if (uses(tr, s, u)) TRY("waiting for an unshard", ms_unit_wait(tr->units[u]));
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->stage_of[i] != s) continue;
        ms_tensor *full;
        size_t numel;
        int64_t shape[3];
        size_t off = param_part(tr, i, &numel, shape);
        GET(full, "reading a gathered parameter", ms_unit_param_full(tr->units[tr->unit_of[i]], tr->index_of[i]));
        TRY("casting a gathered parameter", ms_cast(tr->param_ptrs[i] + off, MS_F32, ms_tensor_data(full),
                                                    ms_tensor_dtype(full), (int64_t)numel));
    }
    return MS_OK;
}

// Unit u's f32 gradients cast into its unsharded gradients (gather dtype), then reduced.
ms_status reduce_unit(Trainer *tr, int u) {
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->unit_of[i] != u || !tr->table[i].requires_grad) continue;
        ms_tensor *g;
        size_t numel;
        int64_t shape[3];
        size_t off = param_part(tr, i, &numel, shape);
        GET(g, "handing out a gradient", ms_unit_grad_full(tr->units[u], tr->index_of[i]));
        TRY("casting a gradient", ms_cast(ms_tensor_data(g), ms_tensor_dtype(g), tr->grad_ptrs[i] + off, MS_F32,
                                          (int64_t)numel));
    }
    TRY("reduce_grads", ms_unit_reduce_grads(tr->units[u]));
    tr->gathered[u] = 0;
    return MS_OK;
}

// With expert parallelism (ep > 1) a rank holds E/ep experts of each layer
// (setup_expert_parallel); a layer's routed experts run between its two halves, their
// tokens sent to the experts' ranks and the results brought back with all_to_all on the
// rank's ep group (route.c; README.md, "Expert parallelism").  Backward likewise.
ms_status forward_layer(Trainer *tr, int l) {
    if (tr->tp > 1) return tp_forward_layer(tr, l);
    if (tr->ep == 1) {
        model_forward_layer(tr->cfg, l, tr->param_ptrs, tr->ws);
        return MS_OK;
    }
    model_forward_layer_begin(tr->cfg, l, tr->param_ptrs, tr->ws);
    CHECK(ep_forward(tr, l));
    model_forward_layer_end(tr->cfg, l, tr->param_ptrs, tr->ws);
    return MS_OK;
}

ms_status backward_layer(Trainer *tr, int l) {
    if (tr->tp > 1) return tp_backward_layer(tr, l);
    if (tr->ep == 1) {
        model_backward_layer(tr->cfg, l, tr->param_ptrs, tr->grad_ptrs, tr->ws);
        return MS_OK;
    }
    model_backward_layer_begin(tr->cfg, l, tr->ws);
    CHECK(ep_backward(tr, l));
    model_backward_layer_end(tr->cfg, l, tr->param_ptrs, tr->grad_ptrs, tr->ws);
    return MS_OK;
}

// Forward stage by stage (embed, layer 0..L-1, head): the units holding a stage's
// parameters are unsharded (the next stages' are prefetched, as many as the policy's
// prefetch.forward), their gathered parameters (bf16 or f32, as the policy says) cast to f32
// for the kernels, and resharded after the last stage that reads them.
static ms_status forward(Trainer *tr, float *loss) {
    const ModelConfig *cfg = tr->cfg;
    CHECK(unshard_stage(tr, 0));
    for (int s = 0; s < tr->nstages; s++) {
        CHECK(gather_stage(tr, s));
        for (int p = s + 1; p <= s + tr->prefetch_fwd && p < tr->nstages; p++) CHECK(unshard_stage(tr, p));
        if (s == 0) {
            if (model_forward_embed(cfg, tr->param_ptrs, tr->tokens, tr->rows, tr->ws))
                return fail(tr, MS_ERR_ARG, "forward", "a byte of the text is outside the vocabulary");
        } else if (s <= cfg->num_layers) {
            CHECK(forward_layer(tr, s - 1));
        } else {
            CHECK(tp_forward_head(tr, loss));
        }
        for (int u = 0; u < tr->nunits; u++) {
            if (tr->last_stage[u] != s) continue;
            TRY("reshard", ms_unit_reshard(tr->units[u])); // frees, keeps or k-way shards, as planned
            tr->gathered[u] = 0;
        }
    }
    return MS_OK;
}

// Backward: the stages in reverse, regathering what was resharded (prefetching as many as
// the policy's prefetch.backward); a unit's f32 gradients are cast into its unsharded
// gradients and reduced (reduce_scatter, and the HSDP all_reduce) after the first stage
// that reads it.
static ms_status backward(Trainer *tr) {
    const ModelConfig *cfg = tr->cfg;
    memset(tr->grads, 0, model_param_numel(cfg) * sizeof(float));
    CHECK(unshard_stage(tr, tr->nstages - 1));
    for (int s = tr->nstages - 1; s >= 0; s--) {
        CHECK(gather_stage(tr, s));
        for (int p = s - 1; p >= s - tr->prefetch_bwd && p >= 0; p--) CHECK(unshard_stage(tr, p));
        if (s == 0) model_backward_embed(cfg, tr->grad_ptrs, tr->ws);
        else if (s <= cfg->num_layers) CHECK(backward_layer(tr, s - 1));
        else CHECK(tp_backward_head(tr));
        CHECK(tp_reduce_stage_grads(tr, s));
        for (int u = 0; u < tr->nunits; u++)
            if (tr->first_stage[u] == s) CHECK(reduce_unit(tr, u));
    }
    for (int u = 0; u < tr->nunits; u++) TRY("waiting for reduce_grads", ms_unit_wait(tr->units[u]));
    return MS_OK;
}

// ----------------------------------------------------------------------------
// one step

// The learning rate of step k (1..N = --steps): a linear warm-up over W = --warmup-steps
// steps to X = --lr, then a cosine decay to Y = --min-lr at step N.  With the defaults (W = 0,
// Y = X) it is X exactly: Y + 0 * (...) = X.
static double lr_at(const Options *o, long k) {
    const double X = o->lr, Y = o->min_lr;
    if (k <= o->warmup) return X * (double)k / (double)o->warmup;
    const double progress = (double)(k - o->warmup) / (double)(o->steps - o->warmup);
    return Y + (X - Y) * (1.0 + cos(M_PI * progress)) / 2.0;
}

// The global gradient norm before clipping (tr->grad_norm, every rank) and clipping at
// --max-norm (unless 0; 1.0 by default), then AdamW on every unit's shards at the schedule's
// learning rate (tr->lr).
ms_status update(Trainer *tr, long step) {
    double sq = 0.0;
    for (int u = 0; tr->tp == 1 && u < tr->nunits; u++) {
        double s;
        TRY("gradient norm", ms_unit_grad_sq_norm(tr->units[u], &s));
        sq += s;
    }
    if (tr->tp > 1) CHECK(tp_grad_sq_norm(tr, &sq)); // replicated parameters once over tp
    CHECK(all_reduce_one(tr, &sq, MS_OP_SUM));
    double norm = tr->grad_norm = sqrt(sq);
    tr->lr = lr_at(tr->opt, step);
    for (int u = 0; u < tr->nunits; u++) {
        const double max_norm = tr->opt->max_norm;
        if (max_norm > 0 && norm > max_norm) TRY("clipping", ms_unit_scale_grads(tr->units[u], max_norm / norm));
        TRY("adamw_step", ms_unit_adamw_step(tr->units[u], tr->lr, BETA1, BETA2, tr->opt->eps, WEIGHT_DECAY, step));
        TRY("zero_grad", ms_unit_zero_grad(tr->units[u]));
    }
    return MS_OK;
}

// One step: the batch (the global batch of batch_size rows of seq_len+1 bytes, the same
// whatever RANKS is, split by rows across the data-parallel ranks), forward, backward, the
// loss averaged over the ranks, then the update.
static ms_status train_step(Trainer *tr, long step, double *loss) {
    if (tr->pipe) return pipeline_step(tr, step, loss);
    const int T = tr->cfg->seq_len;
    if (dataset_rows(tr->args->data, tr->opt->seed, step, T, tr->args->rank / tr->tp * tr->rows, tr->rows, tr->tokens))
        return fail(tr, MS_ERR_ARG, "reading the batch", "the text is shorter than seq_len + 1 = %d bytes", T + 1);
    float local = 0.0f;
    CHECK(forward(tr, &local));
    CHECK(backward(tr));
    *loss = local;
    CHECK(all_reduce_one(tr, loss, MS_OP_AVG)); // the loss of the global batch
    return update(tr, step);
}

// --eval-every: the mean loss of --eval-batches global batches of the held-out text, forward
// only, each split over the ranks as a training batch (so the same rows on any mesh) and
// averaged over them as the training loss is.  The units are left as a step leaves them:
// sharded, nothing gathered.
static ms_status evaluate(Trainer *tr, double *loss) {
    const Dataset *d = tr->args->eval_data;
    const int T = tr->cfg->seq_len;
    double sum = 0.0;
    for (int b = 0; b < tr->opt->eval_batches; b++) {
        double l;
        if (tr->pipe) {
            CHECK(pipeline_eval_batch(tr, d, EVAL_SEED, b, &l));
        } else {
            if (dataset_rows(d, EVAL_SEED, b, T, tr->args->rank / tr->tp * tr->rows, tr->rows, tr->tokens))
                return fail(tr, MS_ERR_ARG, "eval", "the held-out text is shorter than seq_len + 1 = %d bytes", T + 1);
            float local = 0.0f;
            CHECK(forward(tr, &local));
            l = local;
            CHECK(all_reduce_one(tr, &l, MS_OP_AVG));
        }
        sum += l;
    }
    for (int u = 0; u < tr->nunits; u++) {
        TRY("eval: releasing the gathered parameters", ms_unit_release_unsharded(tr->units[u]));
        tr->gathered[u] = 0;
    }
    *loss = sum / tr->opt->eval_batches;
    return MS_OK;
}

// ----------------------------------------------------------------------------
// --records and --memory
//
// These (and --save, written by save.c) expose what the runtime did, for the checks of
// tests/lua/trainer_spec.lua.

static void print_records(const Trainer *tr) {
    static const char *const kinds[] = {"all_gather", "reduce_scatter", "all_reduce"};
    for (int u = 0; u < tr->nunits; u++)
        for (int r = 0; r < ms_unit_record_count(tr->units[u]); r++) {
            ms_record_kind kind;
            int group;
            ms_dtype dtype;
            int64_t bytes;
            if (ms_unit_record(tr->units[u], r, &kind, &dtype, &group, &bytes) || (unsigned)kind > MS_RECORD_ALL_REDUCE) continue;
            const char *name = ms_unit_name(tr->units[u]);
            printf("unit %s %s %s n=%d bytes=%lld\n", *name ? name : "<root>", kinds[kind], ms_dtype_name(dtype),
                   group, (long long)bytes);
        }
    fflush(stdout);
}

// The integer after `key` in the plan JSON's memory record of this rank: a minimal scan of
// '{"rank":R,"params":N,"grads":N,"optimizer":N,...}' (plan JSON version 1, docs/planning.md).
static int64_t planned_bytes(const char *json, int rank, const char *key) {
    char anchor[32], k[32];
    snprintf(anchor, sizeof anchor, "{\"rank\":%d,", rank);
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(json, "\"per_rank\"");
    if (p) p = strstr(p, anchor);
    if (p) p = strstr(p, k);
    return p ? strtoll(p + strlen(k), NULL, 10) : -1;
}

static ms_status measure_memory(Trainer *tr) {
    static const char *const keys[3] = {"params", "grads", "optimizer"};
    char *json = NULL;
    TRY("reading the plan JSON", ms_interp_plan_json(tr->in, &json));
    for (int c = 0; c < 3; c++) {
        // every unit of the rank shares one account of what the allocator handed out
        tr->args->bytes[c] = tr->nunits ? ms_unit_rank_allocated(tr->units[0], c) : 0;
        tr->args->books[c] = 0;
        for (int u = 0; u < tr->nunits; u++) tr->args->books[c] += ms_unit_bytes(tr->units[u], c);
        tr->args->planned[c] = planned_bytes(json, tr->args->rank, keys[c]);
    }
    free(json);
    return MS_OK;
}

// ----------------------------------------------------------------------------
// the banner and the step lines (rank 0)

double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// n with thousands separators, into buf.
static const char *grouped(int64_t n, char *buf, size_t len) {
    char digits[32];
    int k = snprintf(digits, sizeof digits, "%lld", (long long)n), o = 0;
    for (int i = 0; i < k && o + 2 < (int)len; i++) {
        if (i && digits[i - 1] != '-' && (k - i) % 3 == 0) buf[o++] = ',';
        buf[o++] = digits[i];
    }
    buf[o] = '\0';
    return buf;
}

// The value of `key` in the plan JSON's unit named `name` (plan JSON version 1,
// docs/planning.md: '{"name":NAME,"kind":...,"mesh_axes":[...],...,"reshard_after_forward":X,
// "params":[...'), its quotes and brackets dropped, into out; "-" when the plan has no such
// unit (an ep-local unit: the runtime's, not the plan's).
static const char *plan_unit_field(const char *json, const char *name, const char *key, char *out, size_t len) {
    char anchor[MODEL_NAME_MAX + 32], k[48];
    snprintf(anchor, sizeof anchor, "{\"name\":\"%s\",\"kind\":", name);
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(json, anchor), *end = p ? strstr(p, "\"params\":") : NULL;
    p = p ? strstr(p, k) : NULL;
    snprintf(out, len, "-");
    if (!p || !end || p > end) return out;
    p += strlen(k);
    size_t o = 0;
    for (int depth = 0; *p && o + 1 < len && (depth || (*p != ',' && *p != '}')); p++) {
        if (*p == '[') depth++;
        else if (*p == ']') depth--;
        else if (*p != '"') out[o++] = *p;
    }
    out[o] = '\0';
    return out;
}

// What the run is, before step 1: "# " lines on rank 0 (README.md, "The trainer").
static ms_status print_banner(Trainer *tr) {
    const Options *o = tr->opt;
    const ModelConfig *c = &o->model;
    char a[32], b[32], e[32];
    int64_t total = 0, trainable = 0;
    for (int i = 0; i < tr->nparams; i++) {
        total += (int64_t)tr->table[i].numel;
        if (tr->table[i].requires_grad) trainable += (int64_t)tr->table[i].numel;
    }
    printf("# moe_trainer: %d rank%s %s\n", o->nranks, o->nranks > 1 ? "s" : "",
           ms_mpi_launched() ? "as MPI processes" : o->nranks > 1 ? "as threads of one process" : "(a thread)");
    printf("# model: vocab 256, hidden_size %d, num_layers %d, num_experts %d (top_k %d), expert_dim %d, num_shared "
           "%d, conv_kernel %d, seq_len %d\n", c->hidden_size, c->num_layers, c->num_experts, c->top_k, c->expert_dim,
           c->num_shared, c->conv_kernel, c->seq_len);
    printf("# parameters: %s (trainable %s, frozen %s)\n", grouped(total, a, sizeof a), grouped(trainable, b, sizeof b),
           grouped(total - trainable, e, sizeof e));
    printf("# batch: %d rows x %d tokens = %s tokens a step, %d rows on each of %d data-parallel ranks", o->batch_size,
           c->seq_len, grouped((int64_t)o->batch_size * c->seq_len, a, sizeof a), tr->rows, o->dp);
    if (o->pp > 1) printf(" in %d micro-batches", o->microbatches);
    printf("\n# mesh: %s (world %d: pp %d, dp_replicate x dp_shard %d, ep %d, tp %d%s)\n", o->mesh, o->nranks, o->pp,
           o->dp, o->ep, o->tp, o->sp ? ", sequence parallel" : "");
    printf("# policy: %s", o->policy);
    for (int k = 0; k < o->nsets; k++) printf("%s%s", k ? " " : " (--set ", o->sets[k]);
    printf("%s\n", o->nsets ? ")" : "");
    for (int w = 0; w < ms_interp_warning_count(tr->in); w++) printf("# plan warning: %s\n", ms_interp_warning(tr->in, w));
    if (o->recipe) {
        int adapted = 0, dim = 0;
        double scale = 0;
        for (int m = 0; m < model_lora_module_count(&o->model); m++)
            if (tr->lora.dim[m]) adapted++, dim = tr->lora.dim[m], scale = tr->lora.scale[m];
        printf("# recipe: %s (LoRA on %d Linear modules, rank %d, alpha/rank %g, lora_A init %s; the rest frozen)\n",
               o->recipe, adapted, dim, scale, tr->lora.a_init == LORA_INIT_UNIFORM ? "kaiming uniform" : "xavier normal");
    } else {
        printf("# recipe: none\n");
    }
    char *json = NULL;
    TRY("reading the plan JSON", ms_interp_plan_json(tr->in, &json));
    printf("# units: rank 0 holds %d (mesh, elements, gather dtype, reduce dtype, reshard after forward)\n", tr->nunits);
    for (int u = 0; u < tr->nunits; u++) {
        const char *name = ms_unit_name(tr->units[u]);
        char gather[64] = "", mesh[128], reshard[32];
        int64_t elements = 0;
        for (int i = 0; i < ms_unit_param_count(tr->units[u]); i++) {
            int ndim;
            int64_t shape[MS_MAX_DIMS], n = 1;
            ms_dtype stored, g;
            if (ms_unit_param_info(tr->units[u], i, &ndim, shape, &stored, &g, &(int){0})) continue;
            for (int d = 0; d < ndim; d++) n *= shape[d];
            elements += n;
            const char *gn = ms_dtype_name(g);
            if (!strstr(gather, gn) && strlen(gather) + strlen(gn) + 2 < sizeof gather)
                snprintf(gather + strlen(gather), sizeof gather - strlen(gather), "%s%s", *gather ? "+" : "", gn);
        }
        ms_dtype reduce = MS_F32;
        ms_unit_reduce_dtype(tr->units[u], &reduce);
        printf("#   %-52s mesh=%s elements=%s gather=%s reduce=%s reshard=%s\n", *name ? name : "<root>",
               plan_unit_field(json, name, "mesh_axes", mesh, sizeof mesh), grouped(elements, a, sizeof a),
               *gather ? gather : "-", ms_dtype_name(reduce), plan_unit_field(json, name, "reshard_after_forward",
               reshard, sizeof reshard));
    }
    free(json);
    printf("# optimizer: AdamW, betas (%g, %g), eps %g, weight_decay %g; gradient norm ", BETA1, BETA2, o->eps,
           WEIGHT_DECAY);
    if (o->max_norm > 0) printf("clipped at %g\n", o->max_norm);
    else printf("not clipped\n");
    if (o->warmup == 0 && o->min_lr == o->lr)
        printf("# lr: constant %g\n", o->lr);
    else
        printf("# lr: %g, linear warm-up over %ld steps, cosine decay to %g at step %ld\n", o->lr, o->warmup, o->min_lr,
               o->steps);
    printf("# seed: %llu\n", o->seed);
    if (o->resume) printf("# resume: %s\n", tr->resume_note);
    if (o->resume && tr->resume_schedule[0]) printf("# resume: note: %s\n", tr->resume_schedule);
    if (o->resume && tr->resume_data[0]) printf("# resume: note: %s\n", tr->resume_data);
    if (o->init_from) printf("# init: the parameters from %s (Hugging Face safetensors), not the seed\n", o->init_from);
    if (o->ckpt_dir && tr->done >= o->steps && o->steps > 0) {
        printf("# checkpoints: %s: none (no step runs here)\n", o->ckpt_dir);
    } else if (o->ckpt_dir) {
        printf("# checkpoints: %s, ", o->ckpt_dir);
        if (o->steps == 0) printf("step 0 (the initial parameters)");
        else if (o->ckpt_every == 1) printf("every step");
        else if (o->ckpt_every) printf("every %ld steps and after the last", o->ckpt_every);
        else printf("after the last step");
        if (o->keep_last) printf(", the newest %d kept\n", o->keep_last);
        else printf(", all kept\n");
    }
    const Dataset *d = tr->args->data, *ev = tr->args->eval_data;
    printf("# data: %s, %s bytes", o->data ? o->data : DATA_DEFAULT_PATH, grouped((int64_t)(d->size + (ev ? ev->size : 0)),
           a, sizeof a));
    if (ev)
        printf(": the first %s trained on, the last %s held out (eval every %ld steps, %d batches)\n",
               grouped((int64_t)d->size, b, sizeof b), grouped((int64_t)ev->size, e, sizeof e), o->eval_every,
               o->eval_batches);
    else
        printf(", all trained on (no eval)\n");
    fflush(stdout);
    return MS_OK;
}

// ----------------------------------------------------------------------------
// a rank's life

// Everything indexed by parameter, and the kernels' buffers.
static ms_status alloc_buffers(Trainer *tr) {
    const ModelConfig *cfg = tr->cfg;
    const size_t n = (size_t)tr->nparams, P = model_param_numel(cfg);
    tr->table = calloc(n, sizeof *tr->table);
    tr->unit_of = calloc(n, sizeof(int));
    tr->index_of = calloc(n, sizeof(int));
    tr->stage_of = calloc(n, sizeof(int));
    tr->params = calloc(P, sizeof(float));
    tr->grads = calloc(P, sizeof(float));
    tr->param_ptrs = calloc(n, sizeof(float *));
    tr->grad_ptrs = calloc(n, sizeof(float *));
    tr->tokens = calloc((size_t)tr->rows * (cfg->seq_len + 1), sizeof(int));
    tr->ws = malloc(model_workspace_size(cfg, tr->rows));
    if (!tr->table || !tr->unit_of || !tr->index_of || !tr->stage_of || !tr->params || !tr->grads ||
        !tr->param_ptrs || !tr->grad_ptrs || !tr->tokens || !tr->ws)
        return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    model_params(cfg, tr->table);
    model_param_pointers(cfg, tr->params, tr->param_ptrs);
    model_param_pointers(cfg, tr->grads, tr->grad_ptrs);
    return MS_OK;
}

// Everything indexed by unit, once the plan says how many there are.
static ms_status alloc_unit_state(Trainer *tr) {
    const size_t U = (size_t)tr->nunits;
    tr->units = calloc(U, sizeof *tr->units);
    tr->first_stage = calloc(U, sizeof(int));
    tr->last_stage = calloc(U, sizeof(int));
    tr->gathered = calloc(U, sizeof(int));
    if (U && (!tr->units || !tr->first_stage || !tr->last_stage || !tr->gathered))
        return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    return MS_OK;
}

// The ep group (tag 1, so that its all_to_alls never pair up with a unit's collectives on
// the same ranks) and each layer's routing state.
static ms_status setup_expert_parallel(Trainer *tr) {
    const int ep = tr->opt->ep, L = tr->cfg->num_layers, rank = tr->args->rank;
    tr->ep = ep;
    tr->ep_local = tr->cfg->num_experts / ep;
    tr->ep_base = rank % ep * tr->ep_local;
    if (ep == 1) return MS_OK;
    int members[MAX_RANKS];
    for (int j = 0; j < ep; j++) members[j] = rank / ep * ep + j;
    TRY("making the ep group", ms_comm_group_tagged(tr->world, ep, members, 1, &tr->ep_group));
    tr->ep_layers = calloc((size_t)L, sizeof *tr->ep_layers);
    if (!tr->ep_layers) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    const size_t P = (size_t)tr->rows * tr->cfg->seq_len * tr->cfg->top_k;
    for (int l = 0; l < L; l++) {
        EpLayer *el = &tr->ep_layers[l];
        el->send_count = calloc((size_t)ep, sizeof(int));
        el->recv_count = calloc((size_t)ep, sizeof(int));
        el->order = calloc(P, sizeof(int));
        if (!el->send_count || !el->recv_count || !el->order) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    }
    return MS_OK;
}

static void free_buffers(Trainer *tr) {
    pipeline_free(tr);
    for (int l = 0; tr->ep_layers && l < tr->cfg->num_layers; l++) {
        EpLayer *el = &tr->ep_layers[l];
        void *bufs[] = {el->send_count, el->recv_count, el->order, el->ids, el->x, el->gu, el->act};
        for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) free(bufs[k]);
    }
    free(tr->ep_layers);
    free(tr->ep_send);
    free(tr->ep_recv);
    ms_comm_release(tr->ep_group);
    ms_comm_release(tr->tp_group);
    free(tr->lora.dim);
    free(tr->lora.scale);
    void *all[] = {tr->table, tr->units, tr->unit_of, tr->index_of, tr->stage_of, tr->first_stage, tr->last_stage,
                   tr->gathered, tr->params, tr->grads, tr->param_ptrs, tr->grad_ptrs, tr->tokens, tr->ws};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) free(all[k]);
}

// --lora-grad-check (-n 1, after planning; no unit is used): every parameter from the seed,
// each lora_B set to a deterministic nonzero pattern (at init B = 0 makes d A = 0), and the
// first batch.  The adapters' gradients from model_backward are compared with (1) an
// independent computation: the model without adapters at the merged weights W' = W + s B A
// gives d W', and d A = s B^T d W', d B = s d W' A^T (in double); (2) central differences of
// the loss (eps 5e-2 x the largest |element| of the tensor) at 8 elements of each tensor, the
// largest gradients first, skipping (and counting) a perturbation that changes a top-k
// choice.  Prints one line per adapter tensor, each difference divided by the tensor's
// largest |gradient|.
static ms_status lora_grad_check(Trainer *tr) {
    const ModelConfig *cfg = tr->cfg, *base = &tr->opt->model;
    const int nb = model_base_param_count(base), T = cfg->seq_len, B = tr->rows;
    const size_t Pb = model_param_numel(base);
    for (int i = 0; i < tr->nparams; i++) model_init_param(cfg, i, tr->param_ptrs[i], tr->opt->seed);
    for (int i = nb; i < tr->nparams; i++) {
        int which;
        model_lora_of(cfg, i, &which);
        for (size_t j = 0; which && j < tr->table[i].numel; j++) tr->param_ptrs[i][j] = 0.05f * sinf(0.7f * (float)j + (float)i);
    }
    if (dataset_rows(tr->args->data, tr->opt->seed, 1, T, 0, B, tr->tokens))
        return fail(tr, MS_ERR_ARG, "--lora-grad-check", "the text is shorter than seq_len + 1 = %d bytes", T + 1);
    float loss;
    memset(tr->grads, 0, model_param_numel(cfg) * sizeof(float));
    if (model_forward(cfg, tr->param_ptrs, tr->tokens, B, &loss, tr->ws))
        return fail(tr, MS_ERR_ARG, "--lora-grad-check", "a byte of the text is outside the vocabulary");
    model_backward(cfg, tr->param_ptrs, tr->grad_ptrs, tr->ws);
    // every layer's top-k choices (contiguous in ws), to skip perturbations that change one
    const size_t route_bytes = (size_t)cfg->num_layers * B * T * cfg->top_k * sizeof(int);
    int *routing = malloc(route_bytes);
    if (routing) memcpy(routing, model_routing(cfg, 0, tr->ws), route_bytes);
    // the merged model: the base table is the first nb entries, laid out alike
    float *merged = malloc(Pb * sizeof *merged), *mgrad = calloc(Pb, sizeof *mgrad);
    float **mp = calloc((size_t)nb, sizeof *mp), **mg = calloc((size_t)nb, sizeof *mg);
    void *ws = malloc(model_workspace_size(base, B));
    ms_status st = merged && mgrad && mp && mg && ws && routing ? MS_OK : fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    if (!st) {
        memcpy(merged, tr->params, Pb * sizeof *merged);
        model_param_pointers(base, merged, mp);
        model_param_pointers(base, mgrad, mg);
        for (int m = 0; m < model_lora_module_count(base); m++) {
            const int ia = model_lora_param(cfg, m, 0), r = ia < 0 ? 0 : tr->lora.dim[m];
            if (!r) continue;
            const int w = m == LORA_PER_LAYER * base->num_layers ? model_lm_head(base)
                        : model_layer_param(base, m / LORA_PER_LAYER, LP_SHARED_GATE + m % LORA_PER_LAYER);
            const int out = tr->table[w].shape[0], in = tr->table[w].shape[1];
            const float *A = tr->param_ptrs[ia], *Bm = tr->param_ptrs[ia + 1];
            for (int o = 0; o < out; o++)
                for (int c = 0; c < in; c++) {
                    double v = 0;
                    for (int k = 0; k < r; k++) v += (double)Bm[o * r + k] * A[k * in + c];
                    mp[w][o * in + c] += (float)(tr->lora.scale[m] * v);
                }
        }
        float mloss;
        model_forward(base, mp, tr->tokens, B, &mloss, ws);
        model_backward(base, mp, mg, ws);
        printf("lora_grad loss %.9g merged %.9g\n", loss, mloss);
    }
    for (int i = nb; !st && i < tr->nparams; i++) {
        int which, m = model_lora_of(cfg, i, &which), r = tr->lora.dim[m];
        const int ia = model_lora_param(cfg, m, 0);
        const int w = m == LORA_PER_LAYER * base->num_layers ? model_lm_head(base)
                    : model_layer_param(base, m / LORA_PER_LAYER, LP_SHARED_GATE + m % LORA_PER_LAYER);
        const int out = tr->table[w].shape[0], in = tr->table[w].shape[1];
        const float *A = tr->param_ptrs[ia], *Bm = tr->param_ptrs[ia + 1], *dW = mg[w], *g = tr->grad_ptrs[i];
        const size_t n = tr->table[i].numel;
        const double s = tr->lora.scale[m];
        double gmax = 0, ind = 0, fd = 0, xmax = 0;
        for (size_t j = 0; j < n; j++) {
            double v = 0; // (1) the independent gradient of element j
            if (!which) { // A [r, in]: s sum_o B[o, k] dW'[o, c]
                const int k = (int)(j / (size_t)in), c = (int)(j % (size_t)in);
                for (int o = 0; o < out; o++) v += (double)Bm[o * r + k] * dW[(size_t)o * in + c];
            } else {      // B [out, r]: s sum_c dW'[o, c] A[k, c]
                const int o = (int)(j / (size_t)r), k = (int)(j % (size_t)r);
                for (int c = 0; c < in; c++) v += (double)dW[(size_t)o * in + c] * A[k * in + c];
            }
            v *= s;
            if (fabs(v) > gmax) gmax = fabs(v);
            if (fabs(v - g[j]) > ind) ind = fabs(v - g[j]);
            if (fabs(tr->param_ptrs[i][j]) > xmax) xmax = fabs(tr->param_ptrs[i][j]);
        }
        // (2) central differences at the 8 largest |gradients|
        int picked[8], np = 0;
        for (int q = 0; q < 8 && q < (int)n; q++) {
            size_t best = n;
            for (size_t j = 0; j < n; j++) {
                int taken = 0;
                for (int t = 0; t < np; t++) taken |= picked[t] == (int)j;
                if (!taken && (best == n || fabs(g[j]) > fabs(g[best]))) best = j;
            }
            picked[np++] = (int)best;
        }
        const float eps = (float)(5e-2 * xmax);
        int skipped = 0;
        for (int q = 0; q < np; q++) {
            float *x = &tr->param_ptrs[i][picked[q]], x0 = *x, lp, lm;
            *x = x0 + eps;
            model_forward(cfg, tr->param_ptrs, tr->tokens, B, &lp, tr->ws);
            int flip = memcmp(model_routing(cfg, 0, tr->ws), routing, route_bytes) != 0;
            *x = x0 - eps;
            model_forward(cfg, tr->param_ptrs, tr->tokens, B, &lm, tr->ws);
            flip |= memcmp(model_routing(cfg, 0, tr->ws), routing, route_bytes) != 0;
            *x = x0;
            const double num = ((double)lp - lm) / (2.0 * eps);
            if (flip) skipped++; // a top-k choice changed: the loss is not smooth there
            else if (fabs(num - g[picked[q]]) > fd) fd = fabs(num - g[picked[q]]);
        }
        printf("lora_grad %s elements=%zu max_grad=%.3g independent=%.3g fd=%.3g skipped=%d\n", tr->table[i].name, n,
               gmax, gmax > 0 ? ind / gmax : ind, gmax > 0 ? fd / gmax : fd, skipped);
    }
    fflush(stdout);
    free(merged);
    free(mgrad);
    free(mp);
    free(mg);
    free(ws);
    free(routing);
    return st;
}

// A rank's training: it makes an interpreter (moonshard_embed.h), describes the model
// parameter by parameter in f32 (the fp32 master weights of FSDP2 training with a bf16
// param_dtype), plans it on the mesh with the policy, materialises its units and
// initialises its shards from the seed; then the steps.
static ms_status train(Trainer *tr) {
    const Options *opt = tr->opt;
    tr->nparams = model_param_count(tr->cfg);
    tr->nstages = tr->cfg->num_layers + 2;
    tr->rows = opt->batch_size / opt->dp;
    TRY("joining the world", ms_world_comm(tr->args->world, tr->args->rank, &tr->world));
    TRY("making the interpreter", ms_interp_new(&tr->in, tr->world));
    CHECK(describe_model(tr));
    if (opt->recipe) TRY("--recipe", ms_interp_set_recipe(tr->in, opt->recipe));
    if (opt->pp > 1) { // the planner checks the micro-batches against the schedule (plan_pp)
        TRY("planning", ms_interp_set_batch(tr->in, tr->cfg->seq_len, tr->rows / opt->microbatches, opt->batch_size));
        if (opt->schedule) {
            char set[96];
            snprintf(set, sizeof set, "pipeline.schedule=%s", opt->schedule);
            TRY("--schedule", ms_interp_set_option(tr->in, set));
        }
    }
    if (opt->sp) TRY("setting the policy's sequence_parallel", ms_interp_set_option(tr->in, "sequence_parallel=true"));
    for (int k = 0; k < opt->nsets; k++) TRY("--set", ms_interp_set_option(tr->in, opt->sets[k]));
    TRY("planning", ms_interp_plan(tr->in, opt->mesh, opt->policy, &tr->nunits));
    if (opt->recipe) CHECK(lora_setup(tr));
    CHECK(alloc_buffers(tr));
    CHECK(planned_requires_grad(tr));
    if (opt->lora_grad_check) return lora_grad_check(tr);
    TRY("reading the policy's prefetch", ms_interp_prefetch(tr->in, &tr->prefetch_fwd, &tr->prefetch_bwd));
    TRY("materialising the plan", ms_interp_materialize(tr->in));
    tr->nunits = ms_interp_unit_count(tr->in); // the plan's and the ep-local ones
    CHECK(alloc_unit_state(tr));
    CHECK(setup_expert_parallel(tr));
    CHECK(tp_setup(tr));
    CHECK(locate_params(tr));
    if (opt->pp > 1) CHECK(pipeline_setup(tr));
    CHECK(init_params(tr));
    if (opt->init_from) TRY("--init-from", ms_ckpt_load_hf(tr->in, opt->init_from));
    long done = 0; // steps done before this run: --resume's checkpoint's
    if (opt->resume) CHECK(checkpoint_resume(tr, &done));
    tr->done = done;
    const int rank0 = tr->args->rank == 0;
    if (rank0) CHECK(print_banner(tr));
    const double tokens = (double)opt->batch_size * tr->cfg->seq_len; // a step's, global
    double train_s = 0.0, eval_s = 0.0;
    for (long step = done + 1; step <= opt->steps; step++) {
        double loss;
        const double t0 = now_seconds(); // timing only: nothing below depends on it
        CHECK(train_step(tr, step, &loss));
        const double dt = now_seconds() - t0;
        train_s += dt;
        if (rank0) {
            printf("step %ld loss %.9g lr %.9g grad_norm %.9g time_ms %.3f tokens_per_s %.0f\n", step, loss, tr->lr,
                   tr->grad_norm, 1e3 * dt, dt > 0 ? tokens / dt : 0.0);
            fflush(stdout);
            if (step == done + 1 && opt->records) print_records(tr);
        }
        if (step == done + 1 && opt->memory) CHECK(measure_memory(tr));
        if (opt->eval_every && (step % opt->eval_every == 0 || step == opt->steps)) {
            double eval_loss = 0.0;
            const double e0 = now_seconds();
            CHECK(evaluate(tr, &eval_loss));
            const double de = now_seconds() - e0;
            eval_s += de;
            if (rank0) {
                printf("eval %ld loss %.9g time_ms %.3f\n", step, eval_loss, 1e3 * de);
                fflush(stdout);
            }
        }
        if (opt->ckpt_dir && ((opt->ckpt_every && step % opt->ckpt_every == 0) || step == opt->steps))
            CHECK(checkpoint_save(tr, step));
        for (int u = 0; u < tr->nunits; u++) ms_unit_clear_records(tr->units[u]); // one step's worth at a time
    }
    if (opt->ckpt_dir && opt->steps == 0) CHECK(checkpoint_save(tr, 0)); // the initial parameters
    const long ran = opt->steps - done;
    if (rank0 && ran == 0) {
        printf("# done: 0 steps (%s)\n", opt->resume ? "the checkpoint is at --steps, the total" : "--steps 0");
        fflush(stdout);
    } else if (rank0 && ran > 0) {
        printf("# done: %ld steps, %.0f tokens in %.3f s (%.0f tokens/s)%s", ran, tokens * ran, train_s,
               train_s > 0 ? tokens * ran / train_s : 0.0, opt->eval_every ? "" : "\n");
        if (opt->eval_every) printf(", eval %.3f s\n", eval_s);
        fflush(stdout);
    }
    return opt->save ? save(tr) : MS_OK;
}

static void *rank_main(void *p) {
    RankArgs *a = p;
    Trainer tr = {.opt = a->opt, .cfg = &a->opt->model, .args = a};
    a->status = train(&tr);
    if (a->status && !a->err[0]) snprintf(a->err, sizeof a->err, "%s", ms_last_error());
    free_buffers(&tr);
    ms_interp_free(tr.in);
    ms_world_rank_done(a->world, a->rank, a->status != MS_OK);
    ms_comm_release(tr.world);
    return NULL;
}

// ----------------------------------------------------------------------------
// main

// --save: FILE checked before any rank starts, so that a FILE that cannot be written fails
// at once: not a directory nor another kind of file, writable when it exists, in a
// directory where a new file can be made and renamed over it.  Nothing is created until
// rank 0 saves after the last step (write_save_file in save.c).  0, or 2.
static int save_check(Options *o) {
    if (!*o->save) return usage_error("--save: expected a file name, got ''");
    struct stat st;
    mode_t mode = umask(0);
    umask(mode);
    mode = 0666 & ~mode; // a new file's mode, as fopen would make it
    if (stat(o->save, &st) == 0) {
        if (S_ISDIR(st.st_mode)) return file_error("--save %s: it is a directory, expected a file name", o->save);
        if (!S_ISREG(st.st_mode)) return file_error("--save %s: it exists and is not a regular file", o->save);
        if (faccessat(AT_FDCWD, o->save, W_OK, AT_EACCESS)) return file_error("--save %s: %s", o->save, strerror(errno));
        mode = st.st_mode & 07777;
        o->save_path = realpath(o->save, NULL);
    } else {
        o->save_path = strdup(o->save);
    }
    if (!o->save_path) return file_error("--save %s: %s", o->save, strerror(errno));
    o->save_mode = mode;
    const char *slash = strrchr(o->save_path, '/');
    o->save_dir = !slash ? strdup(".") : strndup(o->save_path, slash == o->save_path ? 1 : (size_t)(slash - o->save_path));
    if (!o->save_dir) return file_error("--save %s: %s", o->save, strerror(errno));
    if (faccessat(AT_FDCWD, o->save_dir, W_OK | X_OK, AT_EACCESS))
        return file_error("--save %s: cannot create a file in %s: %s", o->save, o->save_dir, strerror(errno));
    return 0;
}

// fsync of a directory, so that a rename in it lasts (a file system that cannot sync a
// directory, EINVAL, has nothing to do).
static int sync_dir(const char *dir) {
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = fsync(fd), e = errno;
    if (r && e == EINVAL) r = 0;
    close(fd);
    errno = e;
    return r;
}

// Renames the file rank 0 wrote to FILE when the run succeeded and syncs the directory,
// else removes it; the exit status given, or 1 when the file cannot be completed.
static int save_end(Options *o, int status) {
    if (o->save_tmp) {
        if (status) {
            unlink(o->save_tmp);
        } else if (rename(o->save_tmp, o->save_path)) {
            fprintf(stderr, "moe_trainer: --save %s: cannot rename %s to %s: %s\n", o->save, o->save_tmp,
                    o->save_path, strerror(errno));
            unlink(o->save_tmp);
            status = 1;
        } else if (sync_dir(o->save_dir)) {
            fprintf(stderr, "moe_trainer: --save %s: written, but syncing its directory %s failed: %s\n", o->save,
                    o->save_dir, strerror(errno));
            status = 1;
        }
    }
    free(o->save_tmp);
    free(o->save_dir);
    free(o->save_path);
    return status;
}

// --memory: a rank's lines.
static void print_memory(const RankArgs *a) {
    static const char *const cats[3] = {"params", "grads", "optimizer"};
    for (int c = 0; c < 3; c++)
        printf("memory rank %d %s allocated=%lld planned=%lld books=%lld ratio=%.6f\n", a->rank, cats[c],
               (long long)a->bytes[c], (long long)a->planned[c], (long long)a->books[c],
               a->planned[c] > 0 ? (double)a->bytes[c] / (double)a->planned[c] : 0.0);
}

// Under an MPI launcher (mpirun -np RANKS moe_trainer -n RANKS ...): this process is one
// rank of the MPI world and runs rank_main itself.  A failing rank prints its message and
// ends the job (MPI_Abort: no peer is left waiting in a collective); --memory prints this
// rank's lines; rank 0 renames --save's file after a barrier, once every rank succeeded.
static int run_mpi_rank(Options *opt, const Dataset *data, const Dataset *eval_data) {
#ifndef MOONSHARD_HAVE_MPI
    (void)data;
    (void)eval_data;
    fprintf(stderr, "moe_trainer: started by an MPI launcher, but built without MPI\n");
    return save_end(opt, 1);
#else
    ms_world *world = NULL;
    if (ms_mpi_world_new(&world, 0)) {
        fprintf(stderr, "moe_trainer: %s\n", ms_last_error());
        return save_end(opt, 1);
    }
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (ms_world_size(world) != opt->nranks) {
        const int st = usage_error("-n %d, but the MPI launcher started %d ranks (mpirun -np N moe_trainer -n N ...)",
                                   opt->nranks, ms_world_size(world));
        ms_world_release(world);
        return save_end(opt, st);
    }
    static RankArgs args;
    args = (RankArgs){.opt = opt, .data = data, .eval_data = eval_data, .world = world, .rank = rank};
    rank_main(&args);
    if (args.status) {
        fflush(stdout);
        fprintf(stderr, "moe_trainer: rank %d: %s\n", rank, args.err);
        fflush(stderr);
        if (args.save_tmp) unlink(args.save_tmp);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (opt->memory) print_memory(&args);
    fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
    ms_world_release(world); // MPI_Finalize runs at exit
    opt->save_tmp = args.save_tmp;
    return save_end(opt, 0);
#endif
}

// --resume PATH, before any rank starts: a directory holding a checkpoint (checkpoint.json)
// or a root of them (latest); a file, a Hugging Face checkpoint or another directory is
// refused with what it is.  (What is in the checkpoint is checked by the ranks.)
static int resume_path_check(const char *path) {
    struct stat ps;
    char sub[4096];
    if (stat(path, &ps) == 0 && !S_ISDIR(ps.st_mode))
        return file_error("--resume %s: a file; --resume takes a checkpoint directory (DIR/step_K, or a DIR whose "
                          "latest names one)", path);
    static const char *const have[] = {"checkpoint.json", "latest"};
    for (int k = 0; k < 2; k++) {
        snprintf(sub, sizeof sub, "%s/%s", path, have[k]);
        if (stat(sub, &ps) == 0) return 0;
    }
    static const char *const hf[] = {"model.safetensors.index.json", "model.safetensors"};
    for (int k = 0; k < 2; k++) {
        snprintf(sub, sizeof sub, "%s/%s", path, hf[k]);
        if (stat(sub, &ps) == 0)
            return file_error("--resume %s: a Hugging Face checkpoint (%s), not a moonshard one: start from it with "
                              "--init-from %s", path, hf[k], path);
    }
    return file_error("--resume %s: no checkpoint there (neither checkpoint.json nor latest)", path);
}

// mkdir -p: each missing directory of path made (0777 less the umask); 0 or an errno.
static int make_dirs(const char *path) {
    char buf[4096];
    const size_t n = strlen(path);
    if (n >= sizeof buf) return ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        const char c = buf[i];
        buf[i] = '\0';
        struct stat ds;
        if (stat(buf, &ds) != 0) {
            if (mkdir(buf, 0777) != 0 && errno != EEXIST) return errno;
        } else if (!S_ISDIR(ds.st_mode)) {
            return ENOTDIR;
        }
        buf[i] = c;
    }
    return 0;
}

// --save-dir DIR, before any rank starts: made with its parents when missing, writable, and
// without a checkpoint of another run (a fresh run's step_* would mix with them, and
// --keep-last would prune by step across both); a resumed run's are checked by the ranks
// once they know its step (save.c, checkpoint_dir_check).
static int save_dir_check(const Options *o) {
    struct stat ds;
    if (stat(o->ckpt_dir, &ds) == 0 && !S_ISDIR(ds.st_mode))
        return file_error("--save-dir %s: it exists and is not a directory", o->ckpt_dir);
    const int e = make_dirs(o->ckpt_dir);
    if (e) return file_error("--save-dir %s: cannot make it: %s", o->ckpt_dir, strerror(e));
    if (access(o->ckpt_dir, W_OK | X_OK) != 0)
        return file_error("--save-dir %s: cannot write there: %s", o->ckpt_dir, strerror(errno));
    if (!o->resume) {
        char first[64] = "", last[64] = "";
        const int n = checkpoint_dir_steps(o->ckpt_dir, -1, first, last, sizeof first);
        if (n > 0)
            return file_error("--save-dir %s holds %d checkpoint%s (%s%s%s) of another run: this run would mix its "
                              "own with them (and --keep-last prune across both); remove them or give another "
                              "--save-dir (a --resume run keeps those up to its step)", o->ckpt_dir, n,
                              n == 1 ? "" : "s", first, n > 1 ? " .. " : "", n > 1 ? last : "");
    }
    return 0;
}

int main(int argc, char **argv) {
    Options opt;
    int st = parse_options(argc, argv, &opt);
    if (st) return st < 0 ? 0 : st;
    Dataset data;
    char err[512];
    if (dataset_open(&data, opt.data, err, sizeof err)) return file_error("%s", err);
    if (data.size < (size_t)opt.model.seq_len + 1) {
        st = file_error("dataset: %s has %zu bytes, fewer than seq_len + 1 = %d", opt.data ? opt.data : DATA_DEFAULT_PATH,
                        data.size, opt.model.seq_len + 1);
        dataset_close(&data);
        return st;
    }
    // --eval-every: the last tenth (at least a row) held out; the batches come from the rest
    Dataset whole = data, eval = {0}, *eval_data = NULL;
    if (opt.eval_every) {
        const size_t row = (size_t)opt.model.seq_len + 1, tail = data.size / EVAL_TAIL > row ? data.size / EVAL_TAIL : row;
        if (data.size < tail + row) {
            st = file_error("dataset: %s has %zu bytes, too few for --eval-every: at least 2 x (seq_len + 1) = %zu, "
                            "a row to train on and a row held out", opt.data ? opt.data : DATA_DEFAULT_PATH, data.size,
                            2 * row);
            dataset_close(&data);
            return st;
        }
        eval = (Dataset){data.bytes + data.size - tail, tail};
        data.size -= tail;
        eval_data = &eval;
    }
    const char *paths[2][2] = {{"--resume", opt.resume}, {"--init-from", opt.init_from}};
    for (int k = 0; k < 2; k++) {
        struct stat ps;
        if (paths[k][1] && stat(paths[k][1], &ps)) {
            st = file_error("%s %s: %s", paths[k][0], paths[k][1], strerror(errno));
            dataset_close(&whole);
            return st;
        }
    }
    if (opt.resume && (st = resume_path_check(opt.resume))) {
        dataset_close(&whole);
        return st;
    }
    if (opt.ckpt_dir && (st = save_dir_check(&opt))) {
        dataset_close(&whole);
        return st;
    }
    if (opt.save && (st = save_check(&opt))) {
        dataset_close(&whole);
        return save_end(&opt, st);
    }
    if (ms_mpi_launched()) {
        st = run_mpi_rank(&opt, &data, eval_data);
        dataset_close(&whole);
        return st;
    }
    ms_world *world = NULL; // RANKS ranks as threads of this process: moonshard's threads world
    if (ms_threads_world_new(&world, opt.nranks, 0)) {
        fprintf(stderr, "moe_trainer: %s\n", ms_last_error());
        dataset_close(&whole);
        return save_end(&opt, 1);
    }
    pthread_t tid[MAX_RANKS];
    int started[MAX_RANKS];
    static RankArgs args[MAX_RANKS];
    for (int r = 0; r < opt.nranks; r++) {
        args[r] = (RankArgs){.opt = &opt, .data = &data, .eval_data = eval_data, .world = world, .rank = r};
        started[r] = pthread_create(&tid[r], NULL, rank_main, &args[r]) == 0;
        if (!started[r]) { // the others must not wait for it
            args[r].status = MS_ERR_OOM;
            snprintf(args[r].err, sizeof args[r].err, "cannot start its thread");
            ms_world_rank_done(world, r, 1);
        }
    }
    for (int r = 0; r < opt.nranks; r++)
        if (started[r]) pthread_join(tid[r], NULL);
    // The first failure that is not a peer's echo of another rank's failure.
    int failed = -1;
    for (int r = opt.nranks - 1; r >= 0; r--)
        if (args[r].status && (failed < 0 || args[r].status != MS_ERR_PEER)) failed = r;
    if (failed >= 0) {
        fprintf(stderr, "moe_trainer: rank %d: %s\n", failed, args[failed].err);
    } else if (opt.memory) {
        for (int r = 0; r < opt.nranks; r++) print_memory(&args[r]);
    }
    ms_world_release(world);
    dataset_close(&whole);
    opt.save_tmp = args[0].save_tmp; // rank 0's file, written after the last step
    return save_end(&opt, failed >= 0 ? 1 : 0);
}
