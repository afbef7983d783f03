-- fsdp2_default.lua: NeMo Automodel's default FSDP2 parallelizers, rule by rule.
--
-- Dense path (ep = 1): Automodel's DefaultParallelizationStrategy.parallelize
-- (components/distributed/parallelizer.py) over apply_fsdp2_sharding_recursively: the walk
-- goes through the whole model; in every ModuleList (and ModuleDict) the nested lists come
-- first, then each other child becomes one unit; reshard_after_forward is the option when
-- set, else false under pipeline parallelism, else true for every child of the list but its
-- last.  Then the root, one unit that does not reshard after forward.  Precision: FSDP2Config's
-- default mp_policy (bf16 gather, f32 reduce, bf16 output, inputs cast).
--
-- Expert-parallel path (ep > 1): Automodel's MoE parallelizer (components/moe/parallelizer.py,
-- parallelize_model and apply_fsdp), which replaces the dense path whenever ep > 1
-- (_transformers/infrastructure.py, instantiate_infrastructure).  Expert parallelism first
-- (apply_ep: every decoder layer's grouped experts, Shard(0) over ep); then per decoder
-- layer the experts as a unit on ep_shard (when ep_shard > 1; placement dim 1) and the layer
-- by fully_shard_by_dtype (by_dtype.lua) with its experts ignored and the model's
-- _keep_in_fp32_modules_strict names pinned to f32; then embed_tokens (when untied),
-- embed_norm (when present), lm_head (when untied: in f32, inputs still cast, only when
-- lm_head_precision = "f32"), the inner `model` (which holds the final norm) and, when
-- wrap_outer_model, the outer root, which has nothing left to hold.  reshard_after_forward is
-- the option when set, else false for every unit (MoEParallelizerConfig's default).  The
-- routers' e_score_correction_bias is a buffer, replicated on every rank, never gathered.
--
-- Prefetch: Automodel's FSDP2Config.enable_fsdp2_prefetch is false by default, so FSDP2
-- prefetches implicitly: the next unit's all-gather is issued while the current one computes
-- (forward 1) and backward prefetches the unit before it in forward order (backward 1).  With
-- prefetch.explicit true, or a depth set (prefetch.forward, prefetch.backward), the dense path
-- sets explicit chains at those depths (Automodel's fsdp2_forward_prefetch_depth 1 and
-- fsdp2_backward_prefetch_depth 2 for the one not set), except when reshard_after_forward is
-- false or under pipeline parallelism, where Automodel sets none; the MoE path never sets
-- chains (the plan warns when asked).  The plan shows the peak both ways.
--
-- Tensor parallelism (tp > 1) comes first on both paths: Automodel's plan for the
-- architecture (tp_plans.lua; tp_plan and sequence_parallel choose), before any unit.
--
-- The knobs are options (M.options, read from ctx.options), Automodel's defaults:
-- `moonshard plan --set NAME=VALUE`, `--list-options`, or a policy of one line:
--   return require("fsdp2_default").with{ reshard_after_forward = false }

local by_dtype = require "by_dtype"
local tp_plans = require "tp_plans"

local M = {}

-- FSDP2Config's default mp_policy (components/distributed/config.py).
M.precision = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }
-- apply_fsdp's lm_head policy when lm_head_precision is f32: MixedPrecisionPolicy(f32, f32,
-- f32), cast_forward_inputs left at its default (true).
M.fp32_head = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = true }

M.options = {
  reshard_after_forward = { default = nil, type = "nil|boolean|integer",
    doc = "true, false or an integer for every unit (none: Automodel's rule: dense, all layers of a list but " ..
      "its last; expert-parallel, false)" },
  offload_policy = { default = nil, type = "nil|string", values = { "cpu" },
    doc = "cpu: FSDP2's CPUOffloadPolicy, shards, gradients and optimizer state in host memory" },
  activation_checkpointing = { default = false, type = "boolean|list|string",
    doc = "checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions" },
  ["prefetch.explicit"] = { default = false,
    doc = "Automodel's enable_fsdp2_prefetch: explicit chains on the dense path (false: FSDP2's implicit 1/1)" },
  ["prefetch.forward"] = { default = nil, type = "nil|integer", min = 0,
    doc = "explicit forward depth (fsdp2_forward_prefetch_depth, 1 when unset); setting it enables the chains" },
  ["prefetch.backward"] = { default = nil, type = "nil|integer", min = 0,
    doc = "explicit backward depth (fsdp2_backward_prefetch_depth, 2 when unset); setting it enables the chains" },
  lm_head_precision = { default = nil, type = "nil|string", values = { "f32" },
    doc = "MoEParallelizerConfig.lm_head_precision: f32 gives lm_head an f32 unit on the expert-parallel path" },
  wrap_outer_model = { default = true,
    doc = "MoEParallelizerConfig.wrap_outer_model: shard the outer root after the inner model (ep > 1)" },
  tp_plan = { default = "auto", type = "string", values = { "auto", "llama", "qwen", "gemma3", "default" },
    doc = "the tensor-parallel plan when tp > 1 (tp_plans.lua): auto picks Automodel's for the architecture" },
  sequence_parallel = { default = false,
    doc = "the plan's sequence-parallel variant (Automodel's sequence_parallel), when tp > 1" },
  ["pipeline.schedule"] = { default = "1F1B", type = "string",
    doc = "the pipeline schedule when pp > 1 (Automodel's pp_schedule, any case as PyTorch matches it): GPipe, " ..
      "1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV" },
  ["pipeline.layers_per_stage"] = { default = nil, type = "nil|integer", min = 1,
    doc = "decoder layers a stage (Automodel's layers_per_stage: it counts the stages; none: 1 stage a rank, 2 " ..
      "for a multi-stage schedule)" },
  ["pipeline.split"] = { default = "automodel", type = "string", values = { "automodel", "compute", "memory" },
    doc = "how layers go to stages: automodel (evenly, the remainder first), or balanced by compute (forward FLOPs " ..
      "a token) or memory (parameters), the embeddings and head weighed in" },
  ["pipeline.round"] = { default = nil, type = "nil|string", values = { "up", "down" },
    doc = "round_virtual_stages_to_pp_multiple: round the stage count to a multiple of pp" },
}
M.with = require("derive").with_of(M)

-- FSDP2's implicit prefetch: what the planner counts when no explicit chain is set.
M.IMPLICIT_PREFETCH = { forward = 1, backward = 1 }

--- The grouped experts ([experts, ...] tensors, module type GroupedExperts) of a decoder
-- layer, nil when it has none: what expert parallelism splits on dim 0, whatever the MoE
-- block is called (Mixtral's block_sparse_moe, mlp elsewhere).  A checkpoint's per-expert
-- modules are not: expert parallelism places no parameter of them, and the plan says so.
function M.experts_of(layer)
  for _, nm in ipairs(layer:named_modules()) do
    if nm[2].type == "GroupedExperts" then return nm[2] end
  end
end
local experts_of = M.experts_of

--- true when lm_head's weight is the embedding's (tie_word_embeddings): neither is a unit of
-- its own then, and the root owns the shared weight.
function M.tied(model)
  local embed, head = model:get("model.embed_tokens"), model:get("lm_head")
  return embed ~= nil and head ~= nil and head.params.weight ~= nil and head.params.weight == embed.params.weight
end

--- apply_fsdp2_sharding_recursively's walk: calls shard(child, reshard_after_forward) for each
-- child of every ModuleList / ModuleDict below `module` (nested lists first, not descending
-- into a child it shards).  A ModuleList's children that are ModuleLists are nested lists; a
-- ModuleDict's that are ModuleLists or ModuleDicts are.  Returns the children sharded.
function M.apply_recursively(ctx, module, shard, reshard_override)
  local pp = ctx.mesh:size("pp") > 1
  local sharded = {}
  local function walk(m)
    if m.type == "ModuleList" or m.type == "ModuleDict" then
      local flat = {}
      for _, k in ipairs(m.child_order) do
        local c = m.children[k]
        local nested = c.type == "ModuleList" or (m.type == "ModuleDict" and c.type == "ModuleDict")
        if nested then walk(c) else flat[#flat + 1] = c end
      end
      for i, c in ipairs(flat) do
        local raf = reshard_override
        if raf == nil then
          if pp then raf = false else raf = i < #flat end
        end
        shard(c, raf)
        sharded[#sharded + 1] = c
      end
    else
      for _, k in ipairs(m.child_order) do walk(m.children[k]) end
    end
  end
  walk(module)
  return sharded
end

-- The explicit prefetch asked for, nil when none (Automodel's default).
local function explicit_prefetch(o)
  local pf = o.prefetch or {}
  if not (pf.explicit or pf.forward ~= nil or pf.backward ~= nil) then return nil end
  return { forward = pf.forward or 1, backward = pf.backward or 2 }
end

local function dense(ctx, o)
  local raf = o.reshard_after_forward
  M.apply_recursively(ctx, ctx.model, function(layer, reshard)
    ctx:fully_shard(layer, { mp_policy = M.precision, reshard_after_forward = reshard,
      offload_policy = o.offload_policy })
  end, raf)
  -- "do not reshard after forward for root model because its parameters will be used in
  -- backward immediately" (DefaultParallelizationStrategy.parallelize)
  ctx:fully_shard(ctx.model, { mp_policy = M.precision, reshard_after_forward = false,
    offload_policy = o.offload_policy })
  -- apply_fsdp2_sharding_recursively: chains only when layers reshard and there is no pipeline
  local explicit = explicit_prefetch(o)
  if explicit and (raf == false or ctx.mesh:size("pp") > 1) then
    ctx:warn("prefetch: Automodel sets no explicit prefetch chain when reshard_after_forward is false or under " ..
      "pipeline parallelism; FSDP2's implicit prefetch (forward 1, backward 1) is counted")
    explicit = nil
  end
  ctx:set_prefetch(explicit or M.IMPLICIT_PREFETCH)
end

-- The MoE parallelizer (moe/parallelizer.py parallelize_model: apply_ep, apply_ac,
-- apply_fsdp).  Under a pipeline (stages given) Automodel runs it on each stage's part of
-- the model, so each stage gets its layers' units, the embedding (first stage) or the head
-- (last stage), and its own root.
local function expert_parallel(ctx, o, stages)
  local mesh = ctx.mesh
  local layers = ctx:module("model.layers")
  local raf = o.reshard_after_forward
  if raf == nil then raf = false end
  if explicit_prefetch(o) then
    ctx:warn("prefetch: Automodel's MoE parallelizer (ep > 1) sets no explicit prefetch chain; FSDP2's implicit " ..
      "prefetch (forward 1, backward 1) is counted")
  end
  ctx:set_prefetch(M.IMPLICIT_PREFETCH)
  local owned = {} -- layer name -> the parameters expert parallelism took from it
  for _, i in ipairs(layers.child_order) do
    local experts = experts_of(layers.children[i])
    if experts then owned[i] = ctx:expert_parallel(experts) end
  end
  -- parallelize_model: apply_ep, then apply_ac, then apply_fsdp (under a pipeline the
  -- wrappers came first, so that they stay in their layers' stages)
  if o.activation_checkpointing and not stages then ctx:checkpoint_wrap(layers, o.activation_checkpointing) end
  local model = ctx.model
  local inner = model:get("model") or model
  local embed, head, tied = model:get("model.embed_tokens"), model:get("lm_head"), M.tied(model)
  local embed_norm = model:get("model.embed_norm")
  local common = { mp_policy = M.precision, reshard_after_forward = raf, offload_policy = o.offload_policy }
  local last = stages and #stages or 1
  for k = 1, last do
    local first_layer, count = 0, #layers.child_order
    if stages then first_layer, count = stages[k].layers.first, stages[k].layers.count end
    for j = first_layer, first_layer + count - 1 do
      local i = layers.child_order[j + 1]
      local layer = layers.children[i]
      local experts = experts_of(layer)
      if experts and mesh:size("ep_shard") > 1 then
        ctx:fully_shard(experts, { mesh = { "ep_shard" }, mp_policy = M.precision, reshard_after_forward = raf,
          shard_placement_fn = function() return 1 end, offload_policy = o.offload_policy })
      end
      by_dtype.fully_shard_by_dtype(ctx, layer, { mp_policy = M.precision, reshard_after_forward = raf,
        ignored_params = owned[i], offload_policy = o.offload_policy })
    end
    if k == 1 then
      if embed and not tied then ctx:fully_shard(embed, common) end
      if embed_norm then ctx:fully_shard(embed_norm, common) end
    end
    if k == last then
      if head and not tied then
        if o.lm_head_precision == "f32" then
          ctx:fully_shard(head, { mp_policy = M.fp32_head, reshard_after_forward = raf, offload_policy = o.offload_policy })
        else
          ctx:fully_shard(head, common)
        end
      elseif head and o.lm_head_precision ~= nil then
        ctx:warn("lm_head.weight is tied to model.embed_tokens.weight: lm_head_precision = " ..
          tostring(o.lm_head_precision) .. " is not applied (Automodel skips the separate lm_head unit)")
      end
    end
    local root = { mp_policy = M.precision, reshard_after_forward = raf, offload_policy = o.offload_policy,
      stage = stages and stages[k].index or nil }
    ctx:fully_shard(inner, root)
    if o.wrap_outer_model and inner ~= model then ctx:fully_shard(model, root) end
  end
end

-- Tensor parallelism first, when tp > 1 (DefaultParallelizationStrategy.parallelize, and
-- the MoE parallelizer's parallelize_model): the plan o.tp_plan names, or Automodel's for the
-- architecture.  The MoE path takes no sequence parallel and no plan it was not given
-- (moe/parallelizer.py, _resolve_moe_tp_plan).
local function tensor_parallel(ctx, o, moe)
  if ctx.mesh:size("tp") == 1 then return end
  if moe then
    if o.sequence_parallel then
      error("sequence_parallel is not supported by the MoE tensor-parallel path (NeMo Automodel's MoE " ..
        "parallelizer, ep > 1, says so: \"not supported by the custom MoE TP path yet\"); set sequence_parallel=false", 0)
    end
    if o.tp_plan == "auto" then
      error(string.format("No safe tensor-parallel plan is registered for custom MoE model '%s' at tp_size=%d " ..
        "(NeMo Automodel's MoE parallelizer, ep > 1): name one with tp_plan (%s) or call ctx:tensor_parallel " ..
        "with your own", ctx.model.type, ctx.mesh:size("tp"), table.concat(tp_plans.NAMES, ", ")), 0)
    end
  end
  ctx:tensor_parallel((tp_plans.for_model(ctx.model, o.tp_plan, o.sequence_parallel)))
end

-- Whether the model has grouped experts (an MoE model the MoE parallelizer is for).
local function has_experts(model) return experts_of(model) ~= nil end

--- Automodel's AutoPipeline split (ctx:pipeline) with the options pipeline.schedule,
-- pipeline.layers_per_stage, pipeline.round and pipeline.split (the policies that plan pp > 1 declare them:
-- M.PIPELINE_OPTIONS); returns the stages.
function M.split_stages(ctx, o)
  local pipeline = o.pipeline or {}
  return ctx:pipeline{ schedule = pipeline.schedule, layers_per_stage = pipeline.layers_per_stage,
    round_virtual_stages_to_pp_multiple = pipeline.round, split = pipeline.split }
end
M.PIPELINE_OPTIONS = { "pipeline.schedule", "pipeline.layers_per_stage", "pipeline.round", "pipeline.split" }

--- The decoder layers of a stage, in order.
function M.stage_layers(ctx, stage)
  local layers, out = ctx:module("model.layers"), {}
  for i = stage.layers.first, stage.layers.first + stage.layers.count - 1 do
    out[#out + 1] = layers.children[layers.child_order[i + 1]]
  end
  return out
end

--- true when a module of the stage still holds a parameter no unit owns: the stage's part
-- of the root has something to hold.
function M.stage_has_unowned(ctx, stage)
  for _, name in ipairs(stage.modules) do
    for _, np in ipairs(ctx:params_of(name)) do
      if not ctx:is_owned(np[2]) then return true end
    end
  end
  return false
end

-- Under a pipeline (pp > 1), Automodel's AutoPipeline splits the model first and the dense
-- parallelizer shards each stage's part: its layers, then its root, which does not reshard
-- after forward; the layers do not either (Automodel's rule under pipeline parallelism).
local function pipelined(ctx, o)
  -- tensor parallelism on the module names as the model has them (before any wrapper), then
  -- activation checkpointing before the split, so that the wrappers stay in their layers'
  -- stages
  tensor_parallel(ctx, o, false)
  if o.activation_checkpointing then ctx:checkpoint_wrap("model.layers", o.activation_checkpointing) end
  local stages = M.split_stages(ctx, o)
  local raf = o.reshard_after_forward
  if raf == nil then raf = false end
  for _, s in ipairs(stages) do
    for _, layer in ipairs(M.stage_layers(ctx, s)) do
      ctx:fully_shard(layer, { mp_policy = M.precision, reshard_after_forward = raf, offload_policy = o.offload_policy })
    end
    ctx:fully_shard(ctx.model, { stage = s.index, mp_policy = M.precision, reshard_after_forward = false,
      offload_policy = o.offload_policy })
  end
  if explicit_prefetch(o) then
    ctx:warn("prefetch: Automodel sets no explicit prefetch chain under pipeline parallelism; FSDP2's implicit " ..
      "prefetch (forward 1, backward 1) is counted")
  end
  ctx:set_prefetch(M.IMPLICIT_PREFETCH)
end

function M.parallelize(ctx)
  local o = ctx.options
  local moe = ctx.mesh:size("ep") > 1
  if ctx.mesh:size("pp") > 1 then
    if moe and has_experts(ctx.model) then
      tensor_parallel(ctx, o, true)
      if o.activation_checkpointing then ctx:checkpoint_wrap("model.layers", o.activation_checkpointing) end
      local stages = M.split_stages(ctx, o)
      return expert_parallel(ctx, o, stages)
    end
    return pipelined(ctx, o)
  end
  tensor_parallel(ctx, o, moe and has_experts(ctx.model))
  if moe then
    expert_parallel(ctx, o)
  else
    -- DefaultParallelizationStrategy.parallelize: activation checkpointing, then FSDP
    if o.activation_checkpointing then ctx:checkpoint_wrap("model.layers", o.activation_checkpointing) end
    dense(ctx, o)
  end
end

return M
