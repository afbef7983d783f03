/*
 * moonshard_embed.h: moonshard inside a host application (a C or C++ trainer).
 *
 * One interpreter per rank: a Lua state on the rank's world comm that loads the Lua
 * library and the host's policy.  The host describes its model (parameters by dotted name,
 * or a config.json), plans it on a mesh with a policy, materialises the shard units, and
 * then drives the units itself (ms_unit_* of moonshard.h) from its own forward and
 * backward.  No Lua error ever crosses into the host: every call returns a status, with
 * the message in ms_last_error().  Link with -lmoonshard_embed -lmoonshard.
 */
#ifndef MOONSHARD_EMBED_H
#define MOONSHARD_EMBED_H

#include "moonshard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MS_API_BEGIN */

typedef struct ms_interp ms_interp;

/* An interpreter for the rank of `world` (this rank's world comm, retained). */
ms_status ms_interp_new(ms_interp **out, ms_comm *world);
void ms_interp_free(ms_interp *in);
/* Runs a chunk of Lua in the interpreter (`require "moonshard"` works there). */
ms_status ms_interp_exec(ms_interp *in, const char *code);

/* The model, parameter by parameter: dotted names make the module tree. */
ms_status ms_interp_model_param(ms_interp *in, const char *fqn, int ndim, const int64_t *shape,
                                ms_dtype dtype, int requires_grad);
/* Sets the type of a module of that tree ("ModuleList", "MoE", "GroupedExperts", ...), for
 * policies that recognise modules by type. */
ms_status ms_interp_model_module_type(ms_interp *in, const char *name, const char *type_name);
/* Or the model from a Hugging Face config.json (the builders of moonshard plan). */
ms_status ms_interp_model_config(ms_interp *in, const char *config_path);

/* Plans the model on a mesh ("dp_replicate=2,dp_shard=2") with a policy directory or file;
 * *units gets the number of units (may be NULL). */
ms_status ms_interp_plan(ms_interp *in, const char *mesh, const char *policy, int *units);
/* How many units ahead the policy prefetches: in forward (its prefetch.forward, default 1)
 * and in backward (prefetch.backward, default 2), as the planner counted them. */
ms_status ms_interp_prefetch(ms_interp *in, int *forward, int *backward);
/* The plan JSON (DESIGN.md, version 1); *json is malloc'd: the host frees it. */
ms_status ms_interp_plan_json(ms_interp *in, char **json);
/* Builds this rank's units from the plan: the plan's units in plan order, then one
 * "ep-local" unit per experts module whose expert parameters no planned unit shards
 * (ep_shard = 1; named "<module>[ep]", on a one-rank group, in the stored dtype).  Expert
 * parameters hold this rank's experts (ep-local shapes); units reducing them divide by the
 * whole data-parallel size (moonshard/runtime.lua explains why). */
ms_status ms_interp_materialize(ms_interp *in);
/* Units this rank holds (the plan's and the ep-local ones); 0 before materialize. */
int ms_interp_unit_count(ms_interp *in);
/* Unit i (borrowed: valid while the interpreter lives), or NULL. */
ms_unit *ms_interp_unit(ms_interp *in, int i);
/* The unit and parameter index of a parameter by its name (host or plan name). */
ms_status ms_interp_find_param(ms_interp *in, const char *fqn, int *unit, int *index);

/* MS_API_END */

#ifdef __cplusplus
}
#endif

#endif /* MOONSHARD_EMBED_H */
