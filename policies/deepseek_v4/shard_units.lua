-- shard_units.lua: how DeepSeek-V4 becomes FSDP shard units, as NeMo Automodel's MoE
-- parallelizer makes them (components/moe/parallelizer.py parallelize_model and apply_fsdp,
-- with components/models/deepseek_v4/fsdp.py fully_shard_deepseek_v4 as the fully_shard of
-- every call, and components/distributed/parallelizer_utils.py fully_shard_by_dtype for each
-- block).  The Inkling2 pattern: the FP32 modules of fp32_modules.lua become their own units
-- with an FP32 policy, then the module around them with the caller's policy.
--
-- Units in the order Automodel calls fully_shard:
--   per decoder block (model.layers.*, then the MTP blocks mtp.layers.*: _iter_moe_blocks):
--     the grouped experts on ep_shard when ep > 1 and ep_shard > 1, then the block's FP32
--     modules (all-f32 storage), one unit each, then the block;
--   model.embed_tokens; lm_head (an all-f32 module: one FP32 unit); model's own FP32 modules
--   still unsharded (hc_head), then model; then the root (wrap_outer_model).
-- Parameters owned by expert parallelism are passed on as ignored and keep their placements.

local FP32_MODULES = require "fp32_modules"
local precision = require "precision"
local islands = require "islands"
local by_dtype = require "by_dtype"
local fsdp2_default = require "fsdp2_default"

local M = {}

-- The caller's mixed-precision policy: apply_fsdp's default when the recipe gives none.
M.mp_policy = precision.compute

-- The knobs are options (ctx.options; `moonshard plan --set NAME=VALUE`, `--list-options`),
-- Automodel's defaults:
M.options = {
  -- the default of the MoE path (parallelize_model and apply_fsdp: reshard_after_forward=False;
  -- the DeepSeek-V4 recipes set distributed.moe.reshard_after_forward: false too).  With true,
  -- the DeepseekV4FP32Parameter holders still keep theirs false (fsdp.py
  -- _fp32_module_fsdp_kwargs), and the MTP blocks' experts too (experts_reshard_after_forward)
  reshard_after_forward = { default = false, doc = "every unit's reshard_after_forward (Automodel's MoE path: false)" },
  -- the DeepSeek-V4 recipes set it false (their pipeline-parallel runs have no outer root)
  wrap_outer_model = { default = true, doc = "apply_fsdp's wrap_outer_model: shard the root DeepseekV4ForCausalLM last" },
  -- nil: lm_head goes through fully_shard_deepseek_v4, which gives an all-f32 module its FP32
  -- unit; "f32": a plain fully_shard with MixedPrecisionPolicy(fp32, fp32, fp32), inputs cast
  lm_head_precision = { default = nil, type = "nil|string", values = { "f32" },
    doc = "apply_fsdp's lm_head_precision: f32 for a plain fp32 lm_head unit" },
  -- parallelize_model's activation_checkpointing (default False; the Flash recipes leave it
  -- off): the decoder blocks are wrapped first (apply_ac; the MTP blocks are not)
  activation_checkpointing = { default = false, type = "boolean|list|string",
    doc = "checkpoint the decoder blocks: true (all), false, \"every:K\" or a list of positions" },
  offload_policy = { default = nil, type = "nil|string", values = { "cpu" },
    doc = "cpu: FSDP2's CPUOffloadPolicy, shards, gradients and optimizer state in host memory" },
  -- Automodel's MoE parallelizer sets no explicit chain (apply_fsdp): FSDP2's implicit prefetch
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward (FSDP2's implicit: 1)" },
  ["prefetch.backward"] = { default = 1, min = 0, doc = "units gathered ahead in backward (FSDP2's implicit: 1)" },
  -- not Automodel's (FSDP2 cannot: a unit's trainable parameters share one stored dtype):
  -- moonshard's packed units, docs/policies.md
  pack_islands = { default = false, type = "boolean",
    doc = "pack each block's (and model's) FP32 modules into its unit (fully_shard's islands), not a unit each" },
}
-- pp > 1: the pipeline's options, as fsdp2_default declares them (pipeline.schedule, ...)
for _, name in ipairs(fsdp2_default.PIPELINE_OPTIONS) do M.options[name] = fsdp2_default.options[name] end

local CHECKPOINT = islands.CHECKPOINT

local FLOATING = { f32 = true, f16 = true, bf16 = true, f64 = true, f8e4m3 = true, f8e5m2 = true }

-- fsdp.py _DSV4_CLASS_NAMES
local DSV4_CLASSES = { DeepseekV4ForCausalLM = true, DeepseekV4Model = true, DeepseekV4Block = true }

--- fsdp.py _matches_suffix against every entry of fp32_modules.lua, on a name relative to
-- the module being sharded (named_modules() of it), activation-checkpoint segments removed.
function M.is_fp32_module_name(name) return islands.names_one_of(name, FP32_MODULES) end

-- The dtypes of a module's floating parameters (fsdp.py _floating_param_dtypes; every
-- parameter, ignored ones too, buffers not).
local function floating_dtypes(ctx, m)
  local set, n = {}, 0
  for _, np in ipairs(ctx:params_of(m)) do
    local p = np[2]
    if FLOATING[p.dtype] and not set[p.dtype] then set[p.dtype], n = true, n + 1 end
  end
  return set, n
end

local function all_fp32(ctx, m)
  local set, n = floating_dtypes(ctx, m)
  return n == 1 and set.f32 == true
end

-- fsdp.py _is_deepseek_v4_module: a DeepSeek-V4 class, a module whose config says
-- model_type deepseek_v4 (attrs.model_type), or one with such a module below it.
local function is_dsv4(m)
  for _, nm in ipairs(m:named_modules()) do
    local x = nm[2]
    if DSV4_CLASSES[x.type] or x.attrs.model_type == "deepseek_v4" then return true end
  end
  return false
end

-- The modules already sharded (torch: _get_module_fsdp_state(module) is not None).
local sharded = {}

-- fsdp.py _fully_shard_once: nothing when the module is already a unit; ignored_params kept
-- to the module's own parameters (_fsdp_kwargs_for_module).
-- packed: {modules = {...}, mp = policy} (pack_islands), the FP32 modules below m packed
-- into its unit with that policy.
local function fully_shard_once(ctx, m, o, mp_policy, reshard, kind, stage, packed)
  if sharded[m] then return end
  local ignored = {}
  if o.ignored then
    for _, np in ipairs(ctx:params_of(m)) do
      if o.ignored[np[2]] then ignored[#ignored + 1] = np[2] end
    end
  end
  local islands = packed and #packed.modules > 0 and packed.modules or nil
  ctx:fully_shard(m, { mesh = o.mesh, mp_policy = mp_policy, reshard_after_forward = reshard, kind = kind,
    offload_policy = ctx.options.offload_policy, ignored_params = ignored, stage = stage, islands = islands,
    islands_mp_policy = islands and packed.mp or nil })
  if islands then
    for _, isl in ipairs(islands) do sharded[isl] = true end
  end
  if not stage then sharded[m] = true end -- a module spanning the stages is sharded once a stage
end

-- Two mixed-precision policies alike.
local function same_mp(a, b)
  for _, k in ipairs({ "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs" }) do
    if a[k] ~= b[k] then return false end
  end
  return true
end


-- fsdp.py _fp32_module_fsdp_kwargs: a DeepseekV4FP32Parameter returns its raw tensor to its
-- parent, so it stays gathered after forward.
local function holder_reshard(m, reshard)
  if m.type == "DeepseekV4FP32Parameter" then return false end
  return reshard
end

-- pack_islands: an FP32 module joins `packed` (the unit's islands) when its policy is the
-- others'; else (or without packing) it is a unit of its own, as fully_shard_deepseek_v4
-- makes it.  A DeepseekV4FP32Parameter holder keeps its reshard_after_forward false as a unit
-- of its own (it hands its raw tensor to its parent); packed, it is gathered with the module
-- whose forward reads it.
local function island(ctx, sub, o, mp, packed)
  if packed and (packed.mp == nil or same_mp(packed.mp, mp)) then
    packed.mp = packed.mp or mp
    packed.modules[#packed.modules + 1] = sub
    sharded[sub] = true
    return
  end
  fully_shard_once(ctx, sub, o, mp, holder_reshard(sub, o.reshard), "fp32_island")
end

--- fsdp.py fully_shard_deepseek_v4(module, mesh, mp_policy, reshard_after_forward,
-- ignored_params).  o: mesh, mp_policy, reshard, ignored (a set of params); under a
-- pipeline, for a module spanning the stages (model, the root): stage (ctx:pipeline's) and
-- prefix (the module's name), so that only the stage's part of it is sharded, as Automodel
-- runs the parallelizer on each stage's part of the model.
function M.fully_shard_deepseek_v4(ctx, m, o)
  local st = o.stage
  -- pack_islands: the FP32 modules found below m join m's unit (those fully_shard_by_dtype
  -- set aside first, o.packed, then these)
  local packed = ctx.options.pack_islands == true and (o.packed or { modules = {} }) or nil
  -- _iter_dsv4_fp32_modules: every module below whose name matches and whose floating
  -- parameters are all f32, in named_modules() order (under a pipeline, of the stage's part)
  local function islands_below(root, prefix)
    for _, nm in ipairs(root:named_modules()) do
      local name, sub = nm[1], nm[2]
      local rel = prefix == nil and name or (name == "" and prefix or prefix .. "." .. name)
      if rel ~= "" and not sharded[sub] and M.is_fp32_module_name(rel) and all_fp32(ctx, sub) then
        island(ctx, sub, o, precision.fp32_of(o.mp_policy), packed)
      end
    end
  end
  if st then
    -- a module spanning the stages (model, the root; DeepSeek-V4 with mixed dtypes): the
    -- islands in the stage's modules below it, then the stage's part of it
    for _, mine in ipairs(st.modules) do
      local rel = o.prefix == "" and mine or (mine:sub(1, #o.prefix + 1) == o.prefix .. "." and mine:sub(#o.prefix + 2))
      if rel then islands_below(ctx.model:get(mine), rel) end
    end
    return fully_shard_once(ctx, m, o, o.mp_policy, o.reshard, nil, st.index, packed)
  end
  local dsv4 = is_dsv4(m)
  local pd = o.mp_policy and o.mp_policy.param_dtype
  -- the all-fp32 fast path: one FP32 unit (a non-DeepSeek-V4 module, or a DeepSeek-V4 one
  -- under an fp32 or unset policy)
  if all_fp32(ctx, m) and (not dsv4 or pd == nil or pd == "f32") then
    return fully_shard_once(ctx, m, o, precision.fp32_of(o.mp_policy), holder_reshard(m, o.reshard), "fp32_island")
  end
  if not dsv4 then return fully_shard_once(ctx, m, o, o.mp_policy, o.reshard, nil, nil, packed) end
  islands_below(m, nil)
  return fully_shard_once(ctx, m, o, o.mp_policy, o.reshard, nil, nil, packed)
end

--- The names fully_shard_by_dtype computes in f32 (its fp32_compute_module_names, substrings
-- of a tensor's name): every entry of fp32_modules.lua, the routers' correction bias and the
-- rotary embeddings.  Automodel reads the model's _keep_in_fp32_modules_strict instead
-- (model.py), whose entries name exactly the tensors of these modules: the same tensors,
-- which deepseek_v4_spec checks on every tensor of the model; taking them from the list keeps
-- fp32_modules.lua the one file to edit.
function M.fp32_names()
  local names = { "e_score_correction_bias", "rotary_emb" }
  for _, entry in ipairs(FP32_MODULES) do names[#names + 1] = entry end
  return names
end

--- parallelizer_utils.py fully_shard_by_dtype(block, fully_shard_fn=fully_shard_deepseek_v4,
-- fp32_compute_module_names=M.fp32_names()), as by_dtype.lua implements it.  o: mesh,
-- mp_policy, reshard, ignored (a set of params).
function M.fully_shard_by_dtype(ctx, block, o)
  local ignored = {}
  for _, np in ipairs(ctx:params_of(block)) do
    if o.ignored and o.ignored[np[2]] then ignored[#ignored + 1] = np[2] end
  end
  local fp32_names = M.fp32_names()
  -- pack_islands: the all-f32 modules fully_shard_by_dtype would make units of before the
  -- block are set aside and packed into the block's unit (when the block becomes one; else
  -- they are units of their own after all, in the order met)
  local packed = ctx.options.pack_islands == true and { modules = {} } or nil
  local function shard(m, so, with)
    local set = {}
    for _, p in ipairs(so.ignored_params or {}) do set[p] = true end
    M.fully_shard_deepseek_v4(ctx, m, { mesh = so.mesh, mp_policy = so.mp_policy,
      reshard = so.reshard_after_forward, ignored = set, packed = with })
  end
  local aside = {}
  by_dtype.fully_shard_by_dtype(ctx, block, { mesh = o.mesh, mp_policy = o.mp_policy,
    reshard_after_forward = o.reshard, ignored_params = ignored, offload_policy = ctx.options.offload_policy,
    fp32_names = fp32_names,
    fully_shard_fn = function(m, so)
      local pd = so.mp_policy and so.mp_policy.param_dtype
      if packed and m ~= block and not sharded[m] and all_fp32(ctx, m) and (not is_dsv4(m) or pd == nil or pd == "f32") then
        local mp = precision.fp32_of(so.mp_policy)
        if packed.mp == nil or same_mp(packed.mp, mp) then
          packed.mp = packed.mp or mp
          packed.modules[#packed.modules + 1] = m
          aside[#aside + 1] = { m, so }
          sharded[m] = true -- (its unit's: not an island of the block again)
          return
        end
      end
      shard(m, so, m == block and packed or nil)
    end })
  if packed and not sharded[block] then
    for _, x in ipairs(aside) do
      sharded[x[1]] = nil
      shard(x[1], x[2])
    end
  end
end

--- Checks the text topology before anything is sharded: model.layers, model.embed_tokens,
-- an untied lm_head, and MoE blocks with grouped experts ([experts, input, output] tensors).
function M.prepare_model(ctx)
  local model = ctx.model
  local function reject(what) error("deepseek_v4 policy: " .. what, 2) end
  local layers = model:get("model.layers")
  if not layers then reject("the model has no model.layers: only DeepSeek-V4 text models are supported") end
  local embed, head = model:get("model.embed_tokens"), model:get("lm_head")
  if not embed or not head then reject("the model needs model.embed_tokens and lm_head") end
  if head.params.weight == embed.params.weight then
    reject("lm_head.weight is tied to model.embed_tokens.weight; DeepSeek-V4 is untied only")
  end
  for _, nm in ipairs(model:named_modules()) do
    local name, m = nm[1], nm[2]
    if m.type == "MoE" then
      local experts = m.children.experts
      if not experts or experts.type ~= "GroupedExperts" then
        reject(string.format("%s.experts is %s; grouped experts (GroupedExperts) are required", name,
          experts and experts.type or "missing"))
      end
      for _, pname in ipairs(experts.param_order) do
        if #experts.params[pname].shape ~= 3 then
          reject(string.format("%s.experts.%s is not [experts, input, output]", name, pname))
        end
      end
    end
  end
end

local function experts_of(block)
  return block:get(CHECKPOINT .. ".mlp.experts") or block:get("mlp.experts")
end

--- Automodel's MoE parallelizer (parallelize_model: apply_ep, apply_ac, apply_fsdp) on
-- DeepSeek-V4.  Under a pipeline (pp > 1) the model is split first (Automodel's
-- AutoPipeline, fsdp2_default.split_stages; the checkpoint wrappers made before, so that
-- they stay in their blocks' stages), and the parallelizer runs on each stage's part: the
-- stage's decoder blocks (the MTP blocks in the last stage, after the decoder), the embedding
-- in the first stage, the head in the last, and the stage's part of model and of the root.
function M.parallelize(ctx)
  M.prepare_model(ctx)
  sharded = {}
  local mesh = ctx.mesh
  local fsdp_mesh = mesh.fsdp_axes
  local mp = M.mp_policy
  local o = ctx.options
  if o.prefetch then ctx:set_prefetch(o.prefetch) end
  local reshard = o.reshard_after_forward
  local use_ep = mesh:size("ep") > 1
  local layers = ctx:module("model.layers")
  local mtp_layers = ctx.model:get("mtp.layers")
  local stages
  if mesh:size("pp") > 1 then
    if o.activation_checkpointing then ctx:checkpoint_wrap(layers, o.activation_checkpointing) end
    stages = fsdp2_default.split_stages(ctx, o)
  end

  -- _iter_moe_blocks: the decoder blocks, then the MTP blocks; under a pipeline, those of
  -- stage k (1-based; the MTP blocks in the last)
  local function blocks(k)
    local out = {}
    local first, count = 0, #layers.child_order
    if stages then first, count = stages[k].layers.first, stages[k].layers.count end
    for j = first, first + count - 1 do
      local i = layers.child_order[j + 1]
      out[#out + 1] = { layers.children[i], false }
    end
    if mtp_layers and (not stages or k == #stages) then
      for _, i in ipairs(mtp_layers.child_order) do out[#out + 1] = { mtp_layers.children[i], true } end
    end
    return out
  end
  local function all_blocks()
    local out = {}
    for k = 1, stages and #stages or 1 do
      for _, b in ipairs(blocks(k)) do out[#out + 1] = b end
    end
    return out
  end

  -- apply_ep first: every MoE block's experts, Shard(0) on ep
  local ignored_of = {}
  if use_ep then
    for _, b in ipairs(all_blocks()) do
      local experts = experts_of(b[1])
      if experts then
        local set = {}
        for _, p in ipairs(ctx:expert_parallel(experts)) do set[p] = true end
        ignored_of[b[1]] = set
      end
    end
  end

  -- apply_ac: the decoder blocks (apply_ac leaves the MTP blocks unwrapped)
  if o.activation_checkpointing and not stages then ctx:checkpoint_wrap(layers, o.activation_checkpointing) end

  local last = stages and #stages or 1
  for k = 1, last do
    for _, b in ipairs(blocks(k)) do
      local block, is_mtp = b[1], b[2]
      local experts = experts_of(block)
      if use_ep and experts and mesh:size("ep_shard") > 1 then
        -- apply_fsdp: the experts on ep_shard, sharded on dim 1 (_moe_shard_placement: dim 0
        -- for a 1-D tensor), with the caller's policy; the MTP blocks' experts never reshard
        ctx:fully_shard(experts, { mesh = { "ep_shard" }, mp_policy = mp, offload_policy = o.offload_policy,
          reshard_after_forward = (not is_mtp) and reshard or false,
          shard_placement_fn = function(_, p) return #p.shape < 2 and 0 or 1 end })
        sharded[experts] = true
      end
      M.fully_shard_by_dtype(ctx, block, { mesh = fsdp_mesh, mp_policy = mp, reshard = reshard,
        ignored = ignored_of[block] })
    end

    local so = { mesh = fsdp_mesh, mp_policy = mp, reshard = reshard }
    if k == 1 then M.fully_shard_deepseek_v4(ctx, ctx:module("model.embed_tokens"), so) end
    if k == last then
      local head = ctx:module("lm_head")
      if o.lm_head_precision == "f32" then
        ctx:fully_shard(head, { mesh = fsdp_mesh, reshard_after_forward = reshard, kind = "fp32_island",
          offload_policy = o.offload_policy,
          mp_policy = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = true } })
        sharded[head] = true
      else
        M.fully_shard_deepseek_v4(ctx, head, so)
      end
    end
    local roots = { mesh = fsdp_mesh, mp_policy = mp, reshard = reshard, stage = stages and stages[k] }
    roots.prefix = "model"
    M.fully_shard_deepseek_v4(ctx, ctx:module("model"), roots)
    roots.prefix = ""
    if o.wrap_outer_model then M.fully_shard_deepseek_v4(ctx, ctx.model, roots) end
  end
end

return M
