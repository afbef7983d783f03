-- full_fp32.lua: every unit gathers, computes and reduces in fp32 (no mixed precision).
--
-- The reference for parity checks: with nothing rounded to a narrower dtype, a run on N
-- ranks differs from the 1-rank run only by the order of fp32 sums (moe_trainer's parity
-- spec, tests/lua/trainer_spec.lua).  Units as Automodel's defaults make them for a model
-- with an untied head: each decoder layer (reshard after forward but the last), then
-- embed_tokens, lm_head and the root, which owns what is left (the final norm and
-- output_query) and never reshards after forward.
--
-- With expert parallelism (ep > 1) the routed experts' tensors are given to it first (each
-- rank holds E/ep experts); when ep_shard > 1 each layer's experts are also a unit of their
-- own on ep_shard, and the layer's unit ignores them (Automodel's MoE parallelizer).  Experts
-- are the GroupedExperts module of a layer, as fsdp2_default finds them: a checkpoint's
-- per-expert modules are not split (the plan warns that ep places nothing).  A tied head
-- (lm_head.weight is the embedding's) makes neither a unit: the root owns the shared weight,
-- as in fsdp2_default.
--
-- Under a pipeline (pp > 1) Automodel's AutoPipeline split comes first (ctx:pipeline, as
-- fsdp2_default plans it: the layers evenly over the stages, the embedding in stage 0, the
-- final norm, output_query and lm_head in the last); then per stage its decoder layers,
-- embed_tokens or lm_head where the stage has them, and the stage's part of the root for
-- what is left (the final norm and output_query), none of them resharding after forward
-- (Automodel's rule under pipeline parallelism: a stage runs several micro-batches through
-- its layers before any backward).  Expert parallelism with a pipeline is not planned here
-- (fsdp2_default's MoE path plans it).
--
-- With tp > 1 the model's tensor-parallel plan comes first, before any unit (as Automodel
-- applies it): tp_plans.inkling2, the plan moe_trainer's kernels implement, with its
-- sequence-parallel variant when sequence_parallel is set.  Each unit then shards this
-- rank's tp pieces over dp_shard.

local fsdp2_default = require "fsdp2_default"
local tp_plans = require "tp_plans"

local M = {}

M.fp32 = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false }
M.options = {
  activation_checkpointing = { default = false, type = "boolean|list|string",
    doc = "checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions" },
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward" },
  ["prefetch.backward"] = { default = 2, min = 0, doc = "units gathered ahead in backward" },
  sequence_parallel = { default = false, type = "boolean",
    doc = "with tp > 1: tp_plans.inkling2's sequence-parallel variant (moe_trainer --sequence-parallel)" },
}
for _, name in ipairs(fsdp2_default.PIPELINE_OPTIONS) do M.options[name] = fsdp2_default.options[name] end
M.with = require("derive").with_of(M)

local function pipelined(ctx, o)
  if ctx.mesh:size("ep") > 1 then
    error("full_fp32: pipelines with expert parallelism (pp > 1 with ep > 1) are not planned; use ep = 1 or pp = 1", 0)
  end
  local stages = fsdp2_default.split_stages(ctx, o) -- (refuses a tied head)
  for _, s in ipairs(stages) do
    for _, layer in ipairs(fsdp2_default.stage_layers(ctx, s)) do
      ctx:fully_shard(layer, { mp_policy = M.fp32, reshard_after_forward = false })
    end
    for _, name in ipairs(s.modules) do
      if name == "model.embed_tokens" or name == "lm_head" then
        ctx:fully_shard(name, { mp_policy = M.fp32, reshard_after_forward = false })
      end
    end
    if fsdp2_default.stage_has_unowned(ctx, s) then
      ctx:fully_shard(ctx.model, { stage = s.index, mp_policy = M.fp32, reshard_after_forward = false })
    end
  end
end

function M.parallelize(ctx)
  local o = ctx.options
  if o.prefetch then ctx:set_prefetch(o.prefetch) end
  if ctx.mesh:size("tp") > 1 then ctx:tensor_parallel(tp_plans.inkling2(o.sequence_parallel)) end
  local layers = ctx:module("model.layers")
  if o.activation_checkpointing then ctx:checkpoint_wrap(layers, o.activation_checkpointing) end
  if ctx.mesh:size("pp") > 1 then return pipelined(ctx, o) end
  local n = #layers.child_order
  local use_ep, ep_shard = ctx.mesh:size("ep") > 1, ctx.mesh:size("ep_shard") > 1
  local ignored = {}
  for k, i in ipairs(layers.child_order) do
    local layer = layers.children[i]
    local experts = use_ep and fsdp2_default.experts_of(layer)
    if experts then
      local owned = ctx:expert_parallel(experts)
      for _, p in ipairs(owned) do ignored[#ignored + 1] = p end
      if ep_shard then
        ctx:fully_shard(experts, { mesh = { "ep_shard" }, mp_policy = M.fp32, reshard_after_forward = k < n })
      end
    end
    ctx:fully_shard(layer, { mp_policy = M.fp32, reshard_after_forward = k < n, ignored_params = ignored })
  end
  if not fsdp2_default.tied(ctx.model) then
    for _, name in ipairs({ "model.embed_tokens", "lm_head" }) do
      if ctx.model:get(name) then ctx:fully_shard(name, { mp_policy = M.fp32 }) end
    end
  end
  ctx:fully_shard(ctx.model, { mp_policy = M.fp32, ignored_params = ignored })
end

return M
