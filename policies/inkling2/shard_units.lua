-- shard_units.lua: how Inkling2 becomes FSDP shard units (the seed's Inkling2Parallelizer,
-- docs/policies.md).
--
-- FP32 modules ("islands") become their own units with the FP32 policy, then the module
-- around them is sharded with the compute policy (with pack_islands, the islands join the
-- module's unit instead, each island parameter keeping the FP32 policy); parameters owned by expert parallelism
-- are passed on as ignored and keep their placements.  Units are made in the order
-- PyTorch's fully_shard would be called: per decoder layer its islands, then the layer
-- (experts first on the expert mesh when ep_shard > 1); then embed_tokens, lm_head, the
-- islands of the root (output_query) and the root.

local FP32_MODULES = require "fp32_modules"
local precision = require "precision"
local islands = require "islands"
local fsdp2_default = require "fsdp2_default"
local tp_plans = require "tp_plans"

local M = {}

-- The knobs, read from ctx.options (`moonshard plan --set NAME=VALUE`):
-- activation_checkpointing: whole decoder layers are activation-checkpointed (the residual
--   histories are explicit immutable inputs of each layer), which renames their modules with
--   "_checkpoint_wrapped_module": is_fp32_module_name looks through that.
-- prefetch: the depth in forward and backward.  Automodel's MoE parallelizer, which this one
-- extends, sets no explicit chain (components/moe/parallelizer.py apply_fsdp): FSDP2's
-- implicit prefetch, one unit ahead each way.
-- offload_policy: of every unit: none (or "none") keeps everything on the device; "cpu" is
--   FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state in host memory.
M.options = {
  activation_checkpointing = { default = true, type = "boolean|list|string",
    doc = "checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions" },
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward (FSDP2's implicit: 1)" },
  ["prefetch.backward"] = { default = 1, min = 0, doc = "units gathered ahead in backward (FSDP2's implicit: 1)" },
  offload_policy = { default = nil, type = "nil|string", values = { "cpu" },
    doc = "cpu: FSDP2's CPUOffloadPolicy, shards, gradients and optimizer state in host memory" },
  sequence_parallel = { default = false, type = "boolean",
    doc = "with tp > 1: tp_plans.inkling2's sequence-parallel variant (moe_trainer --sequence-parallel)" },
  pack_islands = { default = false, type = "boolean",
    doc = "pack each module's FP32 islands into its unit (fully_shard's islands): one all-gather, not one per island" },
}
-- pp > 1: pipeline.schedule, pipeline.layers_per_stage, pipeline.round, as fsdp2_default's
for _, name in ipairs(fsdp2_default.PIPELINE_OPTIONS) do M.options[name] = fsdp2_default.options[name] end

local CHECKPOINT = islands.CHECKPOINT

--- true when `name` names an FP32 module: equal to an entry of fp32_modules.lua or ending
-- with "." .. entry, after removing activation-checkpoint segments.
function M.is_fp32_module_name(name) return islands.names_one_of(name, FP32_MODULES) end

-- Already sharded parameters count as owned too: an island sharded with its layer is not
-- an island of the root again.
local function has_unowned(ctx, module, owned)
  for _, np in ipairs(ctx:params_of(module)) do
    if not owned[np[2]] and not ctx:is_owned(np[2]) then return true end
  end
  return false
end

--- The FP32 modules strictly below `module` that still hold parameters not in `owned`,
-- in module order; a module inside an island already yielded is not yielded again.
function M.iter_fp32_islands(ctx, module, owned)
  local islands, inside = {}, nil
  for _, nm in ipairs(module:named_modules(ctx:name_of(module))) do
    local name, m = nm[1], nm[2]
    local below_island = inside and name:sub(1, #inside + 1) == inside .. "."
    if m ~= module and not below_island and M.is_fp32_module_name(name) and has_unowned(ctx, m, owned) then
      islands[#islands + 1] = m
      inside = name
    end
  end
  return islands
end

--- Makes `module` one unit of its remaining parameters; the owned parameters inside it are
-- passed on as ignored.  stage (an index) for a module spanning a pipeline's stages: the
-- unit holds that stage's part of it.
-- islands (a list of modules below `module`, or nil): packed into the unit with the FP32
-- policy (fully_shard's islands option) instead of being units of their own.
function M.shard(ctx, module, mesh, mp_policy, offload_policy, reshard_after_forward, owned, kind, stage, islands)
  local ignored = {}
  for _, np in ipairs(ctx:params_of(module)) do
    if owned[np[2]] then ignored[#ignored + 1] = np[2] end
  end
  local packed = islands and #islands > 0 or nil
  return ctx:fully_shard(module, { mesh = mesh, mp_policy = mp_policy, kind = kind, offload_policy = offload_policy,
    reshard_after_forward = reshard_after_forward, ignored_params = ignored, stage = stage,
    islands = packed and islands or nil, islands_mp_policy = packed and precision.fp32 or nil })
end

-- true when the module named lies in the pipeline stage (one of its modules or below one).
local function in_stage(name, stage)
  for _, m in ipairs(stage.modules) do
    if name == m or name:sub(1, #m + 1) == m .. "." then return true end
  end
  return false
end

--- Shards every FP32 island below `module` as its own unit with the FP32 policy, adding its
-- parameters to the owned set, then shards `module` with `mp_policy`; every unit gets
-- `offload_policy`.  With a pipeline stage (one of ctx:pipeline's), only the islands of
-- that stage, and `module` (spanning the stages: the root) holds that stage's part.  With
-- the option pack_islands, the islands join the module's unit instead (fully_shard's
-- islands, each island parameter with the FP32 policy): one all-gather for the layer and its
-- islands, one reduce-scatter per reduce dtype.
function M.fully_shard_module(ctx, module, mesh, mp_policy, offload_policy, reshard_after_forward, ignored_params,
                              stage)
  local owned = {}
  for _, p in ipairs(ignored_params or {}) do owned[p] = true end
  local pack = ctx.options.pack_islands == true
  local packed = {}
  for _, island in ipairs(M.iter_fp32_islands(ctx, module, owned)) do
    if not stage or in_stage(ctx:name_of(island), stage) then
      if pack then
        packed[#packed + 1] = island
      else
        M.shard(ctx, island, mesh, precision.fp32, offload_policy, reshard_after_forward, owned, "fp32_island")
        for _, np in ipairs(ctx:params_of(island)) do owned[np[2]] = true end
      end
    end
  end
  return M.shard(ctx, module, mesh, mp_policy, offload_policy, reshard_after_forward, owned, nil, stage and stage.index,
    packed)
end

--- Checks the text topology before anything is sharded: decoder layers whose MoE blocks
-- use shared grouped experts ([experts, input, output] tensors) and an untied LM head.
function M.prepare_model(ctx)
  local model = ctx.model
  local function reject(what) error("inkling2 policy: " .. what, 2) end
  local layers = model:get("model.layers")
  if not layers then reject("the model has no model.layers: only text decoder models are supported") end
  local embed, head = model:get("model.embed_tokens"), model:get("lm_head")
  if not embed or not head then reject("the model needs model.embed_tokens and lm_head") end
  if head.params.weight == embed.params.weight then
    reject("lm_head.weight is tied to model.embed_tokens.weight; Inkling2 requires an untied LM head " ..
      "(set tie_word_embeddings to false)")
  end
  local moe_layers = 0
  for _, i in ipairs(layers.child_order) do
    local layer = layers.children[i]
    local experts = layer:get("mlp.experts")
    if experts then
      moe_layers = moe_layers + 1
      if experts.type ~= "GroupedExperts" then
        local hint = experts.type == "ModuleList" and " (a checkpoint's per-expert layout: Automodel groups the " ..
          "experts when it loads them; plan with --config)" or ""
        reject(string.format("model.layers.%s.mlp.experts is %s%s; shared grouped experts are required", i,
          experts.type, hint))
      end
      for _, pname in ipairs(experts.param_order) do
        local p = experts.params[pname]
        if #p.shape ~= 3 then
          reject(string.format("model.layers.%s.mlp.experts.%s has shape [%s]; grouped expert tensors are " ..
            "[experts, input, output]", i, pname, table.concat(p.shape, ", ")))
        end
      end
    end
  end
  if moe_layers == 0 then reject("no decoder layer has an MoE block with grouped experts (mlp.experts)") end
end

-- embed_tokens, or lm_head (FP32 when fp32_modules.lua names it): a unit of its own.
local function shard_end(ctx, o, name)
  local fp32 = name == "lm_head" and M.is_fp32_module_name(name)
  ctx:fully_shard(name, { mesh = ctx.mesh.fsdp_axes, mp_policy = fp32 and precision.fp32 or precision.compute,
    kind = fp32 and "fp32_island" or nil, offload_policy = o.offload_policy })
end

-- Under a pipeline (pp > 1): Automodel's AutoPipeline split (fsdp2_default.split_stages)
-- after activation checkpointing, then per stage its decoder layers (islands first), its
-- embed_tokens or lm_head, and its part of the root with the islands left there
-- (output_query); nothing reshards after forward (Automodel's rule under pipeline
-- parallelism).
local function pipelined(ctx, o, ac)
  if ctx.mesh:size("ep") > 1 then
    error("inkling2 policy: pipelines with expert parallelism (pp > 1 with ep > 1) are not planned; use ep = 1 " ..
      "or pp = 1", 0)
  end
  if ac then ctx:checkpoint_wrap("model.layers", ac) end
  local fsdp_mesh = ctx.mesh.fsdp_axes
  for _, s in ipairs(fsdp2_default.split_stages(ctx, o)) do
    for _, layer in ipairs(fsdp2_default.stage_layers(ctx, s)) do
      M.fully_shard_module(ctx, layer, fsdp_mesh, precision.compute, o.offload_policy, false)
    end
    for _, name in ipairs(s.modules) do
      if name == "model.embed_tokens" or name == "lm_head" then shard_end(ctx, o, name) end
    end
    if fsdp2_default.stage_has_unowned(ctx, s) then
      M.fully_shard_module(ctx, ctx.model, fsdp_mesh, precision.compute, o.offload_policy, false, nil, s)
    end
  end
end

--- Automodel's MoE parallelizer with the Inkling2 islands.
function M.parallelize(ctx)
  local o = ctx.options
  if o.prefetch then ctx:set_prefetch(o.prefetch) end
  M.prepare_model(ctx)
  -- (activation checkpointing is on by default, also under a ctx whose options do not name it)
  local ac = o.activation_checkpointing
  if ac == nil then ac = true end
  local mesh = ctx.mesh
  -- Tensor parallelism before any unit (Automodel's parallelize_model): the plan of the
  -- inkling2-like model (tp_plans.inkling2); each unit then shards the rank's tp pieces.
  if mesh:size("tp") > 1 then ctx:tensor_parallel(tp_plans.inkling2(o.sequence_parallel)) end
  if mesh:size("pp") > 1 then return pipelined(ctx, o, ac) end
  local fsdp_mesh = mesh.fsdp_axes
  local use_ep = mesh:size("ep") > 1
  local layers = ctx:module("model.layers")

  -- Expert parallelism first: its parameters are ignored by every unit around them.
  local ignored = {}
  if use_ep then
    for _, i in ipairs(layers.child_order) do
      local experts = layers.children[i]:get("mlp.experts")
      if experts then
        for _, p in ipairs(ctx:expert_parallel(experts)) do ignored[#ignored + 1] = p end
      end
    end
  end

  if ac then ctx:checkpoint_wrap(layers, ac) end

  local n = #layers.child_order
  for k, i in ipairs(layers.child_order) do
    local layer = layers.children[i]
    -- Every layer but the last reshards after forward; the last one's backward comes first.
    local reshard = k < n
    local experts = layer:get(CHECKPOINT .. ".mlp.experts") or layer:get("mlp.experts")
    if use_ep and experts and mesh:size("ep_shard") > 1 then
      ctx:fully_shard(experts, { mesh = { "ep_shard" }, mp_policy = precision.compute,
        reshard_after_forward = reshard, shard_placement_fn = function() return 1 end,
        offload_policy = o.offload_policy })
    end
    M.fully_shard_module(ctx, layer, fsdp_mesh, precision.compute, o.offload_policy, reshard, ignored)
  end

  shard_end(ctx, o, "model.embed_tokens")
  shard_end(ctx, o, "lm_head")
  -- The root never reshards after forward (its reshard_after_forward default).
  M.fully_shard_module(ctx, ctx.model, fsdp_mesh, precision.compute, o.offload_policy, nil, ignored)
end

return M
