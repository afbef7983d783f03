-- ddp.lua: NeMo Automodel's DDP manager (nemo_automodel/components/distributed/ddp.py,
-- DDPManager.parallelize), rule by rule.
--
-- The whole model is one replicate unit: DistributedDataParallel over the world's process
-- group, every rank a full replica, the gradients averaged by one all_reduce per bucket.
-- Automodel's DDPConfig (components/distributed/config.py) takes neither tensor, pipeline nor
-- expert parallelism, and dp_replicate_size is FSDP2's only: the mesh must be dp_shard alone
-- (the data-parallel ranks; cp is refused too, DDP splitting no sequence).  Activation
-- checkpointing, when set, wraps the decoder layers before DDP wraps the model, as the manager
-- does.  DDP's options are DDPConfig's, with its defaults: bucket_cap_mb none (PyTorch's 25
-- MiB, the first bucket 1 MiB), find_unused_parameters, gradient_as_bucket_view, static_graph
-- and broadcast_buffers false.  No mixed precision: DDP computes and reduces in the stored
-- dtypes (Automodel's autocast_dtype changes neither).

local M = {}

M.options = {
  bucket_cap_mb = { default = nil, type = "nil|number", min = 0,
    doc = "DDP's bucket cap in MiB (none: PyTorch's 25, with a first bucket of 1 MiB)" },
  find_unused_parameters = { default = false,
    doc = "DDP's find_unused_parameters: the buckets stay the constructor's, never rebuilt in gradient order" },
  gradient_as_bucket_view = { default = false,
    doc = "gradients are views of DDP's buckets (false: the buckets are a second copy of the gradients)" },
  static_graph = { default = false, doc = "DDP's static_graph (the buckets are rebuilt as without it)" },
  broadcast_buffers = { default = false, doc = "DDP's broadcast_buffers (buffers synchronised before forward)" },
  activation_checkpointing = { default = false, type = "boolean|list|string",
    doc = "checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions" },
}

function M.parallelize(ctx)
  local o = ctx.options
  local unsupported = {}
  for _, axis in ipairs({ "pp", "tp", "cp", "dp_replicate" }) do
    if ctx.mesh:size(axis) > 1 then unsupported[#unsupported + 1] = axis .. "=" .. ctx.mesh:size(axis) end
  end
  if ctx.mesh:size("ep") > 1 then unsupported[#unsupported + 1] = "ep=" .. ctx.mesh:size("ep") end
  if #unsupported > 0 then
    error("DDP replicates the model over the data-parallel ranks only (Automodel's DDPConfig: no tensor, pipeline " ..
      "or expert parallelism, and dp_replicate is FSDP2's): the mesh has " .. table.concat(unsupported, ", ") ..
      "; give dp_shard alone", 0)
  end
  if o.activation_checkpointing then
    local layers = ctx.model:get("model.layers")
    if not layers then error("activation_checkpointing: the model has no model.layers to wrap", 0) end
    ctx:checkpoint_wrap(layers, o.activation_checkpointing)
  end
  ctx:replicate(ctx.model, { bucket_cap_mb = o.bucket_cap_mb, find_unused_parameters = o.find_unused_parameters,
    gradient_as_bucket_view = o.gradient_as_bucket_view, static_graph = o.static_graph,
    broadcast_buffers = o.broadcast_buffers })
end

return M
