-- fsdp2_default.lua: Automodel's default parallelizer (SEMANTICS.md §6).
--
-- Dense models: every decoder layer becomes a unit, then the root.  MoE models (when the
-- mesh has ep > 1): per decoder layer, the experts (on the expert mesh, when ep_shard > 1)
-- and then the layer sharded by dtype, ignoring the expert parameters; then embed_tokens
-- (when untied), embed_norm (when the model has one), lm_head (with the FP32 policy when
-- the head is stored in FP32), and the root.  reshard_after_forward is the override below
-- when set, else false under pipeline parallelism, else true for every layer but the last;
-- the root never reshards after forward.  offload_policy is passed to every unit.
-- The knobs are options (M.options, read from ctx.options): `moonshard plan --set NAME=VALUE`,
-- or a policy of one line: return require("fsdp2_default").with{ reshard_after_forward = false }.

local by_dtype = require "by_dtype"

local M = {}

M.precision = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }
M.fp32 = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false }
M.options = {
  reshard_after_forward = { default = nil, type = "nil|boolean|integer",
    doc = "true, false or an integer for every layer's unit, overriding the rule above (none: the rule)" },
  offload_policy = { default = nil, type = "nil|string", values = { "cpu", "none" },
    doc = "cpu: FSDP2's CPUOffloadPolicy, shards, gradients and optimizer state in host memory" },
  activation_checkpointing = { default = false, type = "boolean|list|string",
    doc = "checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions" },
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward" },
  ["prefetch.backward"] = { default = 2, min = 0, doc = "units gathered ahead in backward" },
}
M.with = require("derive").with_of(M)

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

function M.parallelize(ctx)
  local o = ctx.options
  if o.prefetch then ctx:set_prefetch(o.prefetch) end
  local mesh = ctx.mesh
  local layers = ctx:module("model.layers")
  local moe = mesh:size("ep") > 1
  local ignored = {}
  if moe then
    for _, i in ipairs(layers.child_order) do
      local experts = experts_of(layers.children[i])
      if experts then
        for _, p in ipairs(ctx:expert_parallel(experts)) do ignored[#ignored + 1] = p end
      end
    end
  end
  if o.activation_checkpointing then ctx:checkpoint_wrap(layers, o.activation_checkpointing) end

  local n = #layers.child_order
  for k, i in ipairs(layers.child_order) do
    local layer = layers.children[i]
    if layer.type ~= "ModuleList" and layer.type ~= "ModuleDict" then
      local raf = o.reshard_after_forward
      if raf == nil then
        if mesh:size("pp") > 1 then raf = false else raf = k < n end
      end
      if moe then
        local experts = experts_of(layer)
        if experts and mesh:size("ep_shard") > 1 then
          ctx:fully_shard(experts, { mesh = { "ep_shard" }, mp_policy = M.precision, reshard_after_forward = raf,
            shard_placement_fn = function() return 1 end, offload_policy = o.offload_policy })
        end
        by_dtype.fully_shard_by_dtype(ctx, layer, { mp_policy = M.precision, reshard_after_forward = raf,
          ignored_params = ignored, offload_policy = o.offload_policy })
      else
        ctx:fully_shard(layer, { mp_policy = M.precision, reshard_after_forward = raf,
          offload_policy = o.offload_policy })
      end
    end
  end

  if moe then
    local embed, head, tied = ctx.model:get("model.embed_tokens"), ctx.model:get("lm_head"), M.tied(ctx.model)
    if embed and not tied then
      ctx:fully_shard(embed, { mp_policy = M.precision, offload_policy = o.offload_policy })
    end
    local embed_norm = ctx.model:get("model.embed_norm")
    if embed_norm then ctx:fully_shard(embed_norm, { mp_policy = M.precision, offload_policy = o.offload_policy }) end
    if head and not tied then
      local fp32_head = head.params.weight and head.params.weight.dtype == "f32"
      ctx:fully_shard(head, { mp_policy = fp32_head and M.fp32 or M.precision, offload_policy = o.offload_policy })
    end
  end
  ctx:fully_shard(ctx.model, { mp_policy = M.precision, ignored_params = ignored, offload_policy = o.offload_policy })
end

return M
