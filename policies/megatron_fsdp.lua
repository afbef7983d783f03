-- megatron_fsdp.lua: NeMo Automodel's Megatron-FSDP manager
-- (nemo_automodel/components/distributed/megatron_fsdp.py, MegatronFSDPManager.parallelize;
-- parallelizer.py, megatron_fsdp_strategy_parallelize), rule by rule.
--
-- The whole model is one Megatron-FSDP unit (moonshard.plan_megatron): megatron_fsdp's
-- fully_shard over the flattened data-parallel ranks ("dp", or "dp_cp" with context
-- parallelism), its FSDP unit modules the decoder layer classes (Automodel derives them from
-- the model's _no_split_modules when megatron_fsdp_unit_modules is unset: the classes of
-- model.layers here).  The options are MegatronFSDPConfig's (components/distributed/config.py)
-- with its defaults: zero_dp_strategy 3, grad_reduce_in_fp32 false, preserve_fp32_weights
-- false, overlap_param_gather true.  zero_dp_strategy also takes Megatron-FSDP's names:
-- no_shard, optim, optim_grads, optim_grads_params.  This plan takes no tensor, pipeline or
-- expert parallelism (Automodel's MegatronFSDPConfig has no pp or ep; its tp is not planned
-- here), and dp_replicate is refused (Automodel asserts "Hybrid-sharding not supported").

local M = {}

M.options = {
  zero_dp_strategy = { default = 3, type = "number|string",
    doc = "0/no_shard, 1/optim (ZeRO-1), 2/optim_grads (ZeRO-2), 3/optim_grads_params (ZeRO-3)" },
  megatron_fsdp_unit_modules = { default = nil, type = "nil|string",
    doc = "class names of the FSDP unit modules, comma-separated (LlamaDecoderLayer,MLP; none: the classes of " ..
      "model.layers, as _no_split_modules)" },
  grad_reduce_in_fp32 = { default = false, doc = "main gradients (and their reduction) in fp32" },
  preserve_fp32_weights = { default = false, doc = "fp32 main weights for the optimizer (sharded from ZeRO-1 on)" },
  overlap_param_gather = { default = true, doc = "prefetch the next FSDP unit's buckets (ZeRO-3's transient memory)" },
  overlap_grad_reduce = { default = true, doc = "MegatronFSDPConfig's (no effect on the plan's figures)" },
  disable_bucketing = { default = false, doc = "MegatronFSDPConfig's (the bucket size is unset either way)" },
  activation_checkpointing = { default = false, doc = "Automodel logs that Megatron-FSDP does not support it, and skips it" },
}

function M.parallelize(ctx)
  local o = ctx.options
  local unsupported = {}
  for _, axis in ipairs({ "pp", "tp", "dp_replicate", "ep" }) do
    if ctx.mesh:size(axis) > 1 then unsupported[#unsupported + 1] = axis .. "=" .. ctx.mesh:size(axis) end
  end
  if #unsupported > 0 then
    error("Megatron-FSDP is planned over the data-parallel ranks only (no pipeline or expert parallelism in " ..
      "Automodel's MegatronFSDPConfig, no hybrid sharding, tensor parallelism not planned here): the mesh has " ..
      table.concat(unsupported, ", ") .. "; give dp_shard (and cp)", 0)
  end
  if o.activation_checkpointing then
    ctx:warn("activation_checkpointing: Automodel logs \"Activation checkpointing is not yet supported with " ..
      "MegatronFSDP. Skipping.\"; the plan skips it too")
  end
  local classes = nil
  if o.megatron_fsdp_unit_modules ~= nil then
    classes = {}
    for name in o.megatron_fsdp_unit_modules:gmatch("[^,%s]+") do classes[#classes + 1] = name end
    if #classes == 0 then error("megatron_fsdp_unit_modules names no class; give class names, comma-separated", 0) end
  else
    classes = {}
    local layers = ctx.model:get("model.layers")
    local seen = {}
    if layers then
      for _, name in ipairs(layers.child_order) do
        local t = layers.children[name].type
        if not seen[t] then
          seen[t] = true
          classes[#classes + 1] = t
        end
      end
    end
    if #classes == 0 then
      error("megatron_fsdp_unit_modules is unset and the model has no model.layers to derive them from " ..
        "(Automodel: \"does not define a non-empty '_no_split_modules'\"); set it", 0)
    end
  end
  ctx:megatron_fsdp(ctx.model, { zero_dp_strategy = o.zero_dp_strategy, unit_modules = classes,
    grad_reduce_in_fp32 = o.grad_reduce_in_fp32, preserve_fp32_weights = o.preserve_fp32_weights,
    overlap_param_gather = o.overlap_param_gather })
end

return M
