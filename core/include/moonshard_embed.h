/*
 * moonshard_embed.h: moonshard inside a host application (a C or C++ trainer).
 *
 * One interpreter per rank: a Lua state on the rank's world comm that loads the Lua
 * library and the host's policy.  The host describes its model (parameters by dotted name,
 * or a config.json), plans it on a mesh with a policy, materialises the shard units, and
 * then drives the units itself (ms_unit_* of moonshard.h) from its own forward and
 * backward.  Link with -lmoonshard_embed -lmoonshard.
 *
 * No Lua error ever crosses into the host: every step that touches the Lua state runs
 * protected, and every call returns a status with the message in ms_last_error() (a Lua
 * error object that is not a string comes back through its __tostring).  Pointers are
 * checked as moonshard.h's conventions say (MS_ERR_ARG, "ms_interp_plan: mesh is NULL"):
 * none may be NULL but a shape of 0 dims and ms_interp_plan's units.  The statuses:
 * MS_ERR_ARG for a bad model, name, mesh or policy (and any error a policy raises);
 * MS_ERR_STATE for a call out of order (see each call); MS_ERR_IO for a file that cannot be
 * read; MS_ERR_OOM when the interpreter runs out of memory; the core's statuses (shape,
 * overflow, ...) as the core gives them.  Messages name the host's input, not places in
 * moonshard's Lua files.
 *
 * The order: ms_interp_new; the model, by ms_interp_model_param (then
 * ms_interp_model_module_type) or by one ms_interp_model_config, not both; ms_interp_plan,
 * which may be called again until the units are materialised (a failed plan keeps the
 * previous one); ms_interp_materialize, once; then the units until ms_interp_free.
 *
 * moonshard's Lua files: found in $MOONSHARD_LUA_DIR (the directory holding
 * moonshard/init.lua) when set, else where the library was installed, else in the source
 * tree it was built from.  Lua 5.4: the library runs on the system's liblua5.4.  A host
 * that has another Lua in the process (LuaJIT, a 5.1 to 5.3) binds the functions both
 * define to whichever the dynamic linker finds first; ms_interp_new then refuses
 * (MS_ERR_STATE, naming both libraries) rather than mix them.  Such a host loads this
 * library with dlopen("libmoonshard_embed.so.0", RTLD_NOW | RTLD_DEEPBIND), which binds it
 * to its own Lua (tests/c/test_embed_luajit.c does, beside a LuaJIT state of its own).
 */
#ifndef MOONSHARD_EMBED_H
#define MOONSHARD_EMBED_H

#include "moonshard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MS_API_BEGIN */

typedef struct ms_interp ms_interp;

/* An interpreter for the rank of `world` (this rank's world comm, retained), with the Lua
 * library loaded (an error when moonshard's Lua files cannot be found). */
ms_status ms_interp_new(ms_interp **out, ms_comm *world);
/* Frees the interpreter, its Lua state and its references to the units (a unit the host
 * retained lives on).  ms_interp_free(NULL) is a no-op. */
void ms_interp_free(ms_interp *in);
/* Runs a chunk of Lua in the interpreter (`require "moonshard"` works there).  The calls
 * below keep using the moonshard.embed that ms_interp_new loaded, whatever the chunk does
 * to package.loaded; a chunk that breaks that module gets errors from them, not a crash. */
ms_status ms_interp_exec(ms_interp *in, const char *code);

/* The model, parameter by parameter: dotted names make the module tree.  Checked at the
 * call: MS_ERR_ARG for a name described before, with an empty segment, or that makes a
 * parameter a module or a module a parameter; MS_ERR_SHAPE for a negative size;
 * MS_ERR_OVERFLOW for more than 2^63 elements or bytes; MS_ERR_STATE once the model was
 * planned or was given by ms_interp_model_config. */
ms_status ms_interp_model_param(ms_interp *in, const char *fqn, int ndim, const int64_t *shape,
                                ms_dtype dtype, int requires_grad);
/* Sets the type of a module of that tree ("ModuleList", "MoE", "GroupedExperts", ...), for
 * policies that recognise modules by type.  The module must be in the model described so
 * far (a prefix of a parameter's name, "" for the root, or a module of the config's model):
 * MS_ERR_ARG otherwise; MS_ERR_STATE once the model was planned. */
ms_status ms_interp_model_module_type(ms_interp *in, const char *name, const char *type_name);
/* Ties a name to a parameter described before: fqn becomes a second name of target (one
 * parameter, as a tied lm_head.weight is model.embed_tokens.weight; policies see the same
 * parameter in both modules, and it is counted once).  MS_ERR_ARG when target was not
 * described or is itself a tie, for a name described before, or one that makes a parameter a
 * module or a module a parameter; MS_ERR_STATE once the model was planned or was given by
 * ms_interp_model_config. */
ms_status ms_interp_model_tie(ms_interp *in, const char *fqn, const char *target);
/* Or the model from a Hugging Face config.json (the builders of moonshard plan).
 * MS_ERR_IO when the file cannot be read; MS_ERR_ARG when it is not a config of a known
 * architecture; MS_ERR_STATE after ms_interp_model_param, after another config, or once the
 * model was planned. */
ms_status ms_interp_model_config(ms_interp *in, const char *config_path);

/* Plans the model on a mesh ("dp_replicate=2,dp_shard=2") with a policy directory or file;
 * *units gets the number of units (may be NULL).  May be called again to plan anew (each
 * plan starts from the model as described) until ms_interp_materialize: MS_ERR_STATE after.
 * A failed plan leaves the previous one in place. */
ms_status ms_interp_plan(ms_interp *in, const char *mesh, const char *policy, int *units);
/* The last plan's warnings (what `moonshard plan` prints under "warnings:": padding, units
 * that reduce in 16 bits, 16-bit AdamW moments, ...): their count (0 before a plan), and
 * warning i (0-based), a string the interpreter owns until the next successful
 * ms_interp_plan or ms_interp_free; NULL out of range.  For a NULL interpreter: -1 and NULL,
 * with the message set. */
int ms_interp_warning_count(ms_interp *in);
const char *ms_interp_warning(ms_interp *in, int i);
/* The optimizer whose state the plans made after this count, and whose state their units
 * keep: "adamw" (the default: f32 moments, f32 master weights for parameters stored in
 * another dtype), "torch_adamw" (torch.optim.AdamW's: moments in the stored dtype, no
 * master weights; the units get MS_ADAMW_TORCH) or "none" (counted as no state; the units
 * keep the default).  MS_ERR_ARG for another name, MS_ERR_STATE after materialize. */
ms_status ms_interp_set_optimizer(ms_interp *in, const char *optimizer);
/* Sets one of the policy's options for the plans made after this, as `moonshard plan --set`
 * does: "NAME=VALUE" (e.g. "reshard_after_forward=false", "prefetch.forward=2",
 * "activation_checkpointing=every:2"); the value is read as the option's type.  Options
 * accumulate, a later one for the same name replacing the earlier; the next ms_interp_plan
 * checks them against the policy's declared options (an unknown name is MS_ERR_ARG listing
 * them).  MS_ERR_ARG here for a setting without "NAME=", MS_ERR_STATE after materialize. */
ms_status ms_interp_set_option(ms_interp *in, const char *setting);
/* The batch the plans made after this count traffic for, as `moonshard plan --seq-len S
 * --micro-batch B --global-batch G` does: seq_len tokens per sample, micro_batch samples per
 * micro-batch on each data-parallel rank, global_batch samples per optimizer step (0: B x
 * dp); seq_len 0 forgets the batch.  MS_ERR_ARG for a negative number or one above 2^40; a
 * batch that does not split over the mesh is refused by the next plan. */
ms_status ms_interp_set_batch(ms_interp *in, int64_t seq_len, int64_t micro_batch, int64_t global_batch);
/* The policy sandbox's limits for the plans made after this, per policy call: the
 * instructions it may run and the MiB it may allocate (defaults 200e6 and 256).  MS_ERR_ARG
 * below 1 instruction or 1 MiB. */
ms_status ms_interp_set_policy_limits(ms_interp *in, double instructions, double memory_mb);
/* The sandbox's wall-clock limit per policy call, in seconds, for the plans made after this
 * (default 60): the bound on work in C that the instruction count does not see.
 * MS_ERR_ARG below 1 (the clock is read in whole seconds). */
ms_status ms_interp_set_policy_seconds(ms_interp *in, double seconds);
/* How many units ahead the policy prefetches: in forward (its prefetch.forward, default 1)
 * and in backward (prefetch.backward, default 2), as the planner counted them.
 * MS_ERR_STATE before a plan. */
ms_status ms_interp_prefetch(ms_interp *in, int *forward, int *backward);
/* The plan JSON (version 1, docs/planning.md); *json is malloc'd: the host frees it.  MS_ERR_STATE
 * before a plan. */
ms_status ms_interp_plan_json(ms_interp *in, char **json);
/* Builds this rank's units from the plan: the plan's units in plan order, then one
 * "ep-local" unit per experts module whose expert parameters no planned unit shards
 * (ep_shard = 1; named "<module>[ep]", on a one-rank group, in the stored dtype).  Expert
 * parameters hold this rank's experts (ep-local shapes); units reducing them divide by the
 * whole data-parallel size (moonshard/runtime.lua explains why).  Once per interpreter:
 * MS_ERR_STATE for a second call (the units it handed out are never replaced) and before a
 * plan.  A collective call: every rank of the world materialises, and the same plan (one
 * all_gather of each rank's plan fingerprint comes first: a rank whose plan differs gets
 * MS_ERR_ARG on every rank, naming the ranks; a rank that never materialises makes the
 * others fail with MS_ERR_PEER, or MS_ERR_TIMEOUT, instead of waiting). */
ms_status ms_interp_materialize(ms_interp *in);
/* Units this rank holds (the plan's and the ep-local ones, so possibly more than
 * ms_interp_plan counted); 0 before materialize, -1 (with the message set) for a NULL
 * interpreter.  Loop over these, not over the plan's. */
int ms_interp_unit_count(ms_interp *in);
/* Unit i, 0 <= i < ms_interp_unit_count, or NULL with ms_last_error() set (MS_ERR_STATE
 * before materialize, MS_ERR_ARG out of range).  Borrowed: the interpreter holds a
 * reference to every unit it materialised until ms_interp_free, whatever the Lua code run
 * by ms_interp_exec does, so the pointer is valid until then; ms_unit_retain it to keep
 * it longer. */
ms_unit *ms_interp_unit(ms_interp *in, int i);
/* The unit and parameter index of a parameter by its name (host or plan name); under a
 * pipeline, -1 and -1 for a parameter of another pp rank's stage (this rank holds only its
 * own stage's units).  MS_ERR_STATE before materialize; MS_ERR_ARG for a name the plan
 * does not have. */
ms_status ms_interp_find_param(ms_interp *in, const char *fqn, int *unit, int *index);
/* A recipe (docs/recipes.md: a Lua file of NeMo Automodel's sections, loaded in the policy
 * sandbox with the limits set so far) that the plans made after this apply before the
 * policy shards: 4-bit quantization, LoRA adapters, fp8, QAT, and the policy options its
 * distributed fields set.  MS_ERR_IO when it cannot be read, MS_ERR_ARG for a recipe with
 * an unknown section or field (the message lists the known ones), MS_ERR_STATE after
 * materialize. */
ms_status ms_interp_set_recipe(ms_interp *in, const char *path);
/* A parameter of the last plan's model, the recipe's adapters included (a LoRA adapter of
 * module M is "M.lora_A.weight" [dim, in] and "M.lora_B.weight" [out, dim]): its ndim, its
 * sizes into shape (room for MS_MAX_DIMS), its dtype and whether it takes gradients (dtype
 * and requires_grad may be NULL).  MS_ERR_STATE before a plan; MS_ERR_ARG for a name the
 * planned model does not have. */
ms_status ms_interp_param_info(ms_interp *in, const char *fqn, int *ndim, int64_t *shape, ms_dtype *dtype,
                               int *requires_grad);
/* A LoRA adapter a recipe put on a module (Automodel's LinearLoRA, from the recipe's peft
 * section): its rank (0 when the module has none), alpha (the adapter's output is scaled by
 * alpha / dim), dropout probability and position, and how lora_A is initialised (lora_B
 * starts at zero). */
typedef struct ms_lora {
    int dim;
    double alpha;
    double dropout;
    int dropout_pre;  /* 1: dropout_position "pre" (on the adapter's input), 0: "post" */
    int init_uniform; /* lora_A_init: 0 "xavier" (xavier normal), 1 "uniform" (kaiming uniform, a = sqrt 5) */
} ms_lora;
/* The adapter on module `module` of the last plan's model into *out (out->dim = 0 when the
 * module has none).  MS_ERR_STATE before a plan; MS_ERR_ARG for a module the planned model
 * does not have. */
ms_status ms_interp_lora(ms_interp *in, const char *module, ms_lora *out);
/* Whether the last plan's recipe ran a step ("quantization", "peft", "fp8" or "qat"): *ran
 * 1 or 0 (0 without a recipe).  MS_ERR_STATE before a plan; MS_ERR_ARG for another name. */
ms_status ms_interp_recipe_ran(ms_interp *in, const char *step, int *ran);

/* Checkpoints of the materialised units (docs/checkpoints.md; moonshard.checkpoint and
 * moonshard.checkpoint_hf do the work).  Errors carry the Lua layer's messages: MS_ERR_IO for
 * a path that cannot be read or written (none there, no checkpoint in it, a failed open),
 * MS_ERR_ARG for content (extra_json that is not JSON, a bad index, a checksum mismatch, a
 * tensor the checkpoint lacks or whose shape differs), MS_ERR_STATE before
 * ms_interp_materialize. */
/* Saves every unit of this rank (parameters, AdamW state once stepped, skipped-step counts)
 * as DIR/step_<step> (8 digits) and points DIR/latest at it: a collective call, every rank
 * with the same arguments.  extra_json: a JSON text the checkpoint keeps for the host (a
 * data loader's position, RNG state), or NULL.  keep_last > 0 removes the older step_*
 * beyond the newest keep_last once the new one is complete; 0 keeps them all.  A kill at
 * any moment leaves DIR/latest naming a complete checkpoint; a step saved before is
 * MS_ERR_ARG naming it. */
ms_status ms_interp_checkpoint_save(ms_interp *in, const char *dir, int64_t step, const char *extra_json, int keep_last);
/* Loads the checkpoint PATH names (a checkpoint, or a DIR whose latest names one) into the
 * units, on any mesh and world size (each rank reads only the parts it holds; checksums
 * verified): a collective call.  *step gets its step, *extra_json its extra as JSON text
 * (malloc'd: the host frees it; NULL when it has none); either pointer may be NULL. */
ms_status ms_interp_checkpoint_load(ms_interp *in, const char *path, int64_t *step, char **extra_json);
/* The step and extra of the checkpoint PATH names, as ms_interp_checkpoint_load gives them,
 * from its index alone: nothing is loaded, at any time, not collective (a host checks its
 * extra before loading).  Either pointer may be NULL. */
ms_status ms_interp_checkpoint_read(ms_interp *in, const char *path, int64_t *step, char **extra_json);
/* Loads a Hugging Face checkpoint (a .safetensors file, a model.safetensors.index.json, or a
 * directory holding one; what `moonshard checkpoint export` writes) into the units, each rank
 * reading only what it holds, cast to the stored dtype (and into master weights once a unit
 * has them).  Every missing, unexpected or mis-shaped tensor is named in one MS_ERR_ARG
 * before anything is written.  Not collective. */
ms_status ms_ckpt_load_hf(ms_interp *in, const char *path);

/* MS_API_END */

#ifdef __cplusplus
}
#endif

#endif /* MOONSHARD_EMBED_H */
