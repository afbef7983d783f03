-- by_dtype.lua: NeMo Automodel's fully_shard_by_dtype, and a policy built on it.
--
-- fully_shard_by_dtype follows Automodel's components/distributed/parallelizer_utils.py
-- (fully_shard_by_dtype, _make_compute_dtype_fn, _mp_policy_with_param_dtype,
-- iter_maximal_uniform_dtype_subtrees), rule by rule:
--
--  1. A tensor's compute dtype (_make_compute_dtype_fn): a non-floating tensor keeps its
--     dtype; one whose name below the module contains a token of the model's
--     _keep_in_fp32_modules_strict (ctx.model.attrs.keep_in_fp32_strict, or opts.fp32_names)
--     computes in f32; else the dtype the checkpoint stored it in (checkpoint_dtype, set
--     when the model was read from safetensors: Automodel's _hf_compute_dtype); else an f32
--     tensor under a policy of another param_dtype is a master weight and computes in that
--     dtype; else its own dtype.
--  2. The module's parameters (ignored and already-owned ones left out) are grouped by
--     (stored dtype, compute dtype), in the order named_parameters first meets each group.
--  3. No group: the module is a unit only when ignored_params were given (to keep the
--     caller's ownership boundary), with the caller's policy.  One group: one unit, with the
--     policy for that group's compute dtype (rule 6).
--  4. Two groups: the minority is the group with the fewest *parameters* (not elements; on a
--     tie, the group met first).  Its maximal uniform subtrees become units first (a
--     ModuleList among them: each of its children), then the module with the majority's
--     policy.  Three or more: every maximal uniform subtree becomes a unit, and the module
--     itself only when ignored_params were given, with the caller's policy unchanged.
--  5. Uniform subtrees count floating *buffers* too (a gate whose bf16 weight sits beside an
--     f32 e_score_correction_bias buffer is not uniform), and skip ignored parameters.
--  6. The policy of a group (_mp_policy_with_param_dtype): the caller's, with param_dtype the
--     group's compute dtype; for f32 also reduce and output in f32 and no input cast (the
--     fp32 module owns its casts).
--  7. Every parameter of the groups to isolate must lie in a selected subtree, frozen or not;
--     otherwise it is an error naming them: "place them in a dedicated parameter-owning
--     module" (FSDP2 would refuse the unit anyway when they are trainable).
--
-- The policy (parallelize): Automodel's dense strategy with fully_shard_by_dtype per layer
-- (parallelizer.py, Qwen3_5ParallelizationStrategy over apply_fsdp2_sharding_recursively):
-- every child of every ModuleList/ModuleDict by dtype, then the root as one plain unit that
-- never reshards after forward.

local M = {}

M.precision = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }
-- Automodel's Qwen3_5ParallelizationStrategy drops the prefetch settings: FSDP2's implicit
-- prefetch, one unit ahead each way, unless set here.
M.options = {
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward (FSDP2's implicit: 1)" },
  ["prefetch.backward"] = { default = 1, min = 0, doc = "units gathered ahead in backward (FSDP2's implicit: 1)" },
}
M.with = require("derive").with_of(M)

local FLOATING = { f32 = true, f16 = true, bf16 = true, f8e4m3 = true, f8e5m2 = true, f64 = true }

--- _mp_policy_with_param_dtype: the caller's policy with param_dtype `dtype` (nil: none).
function M.policy_for(mp, dtype)
  if mp == nil then return nil end
  local out = {}
  for k, v in pairs(mp) do out[k] = v end
  out.param_dtype = dtype
  if dtype == "f32" then
    out.reduce_dtype, out.output_dtype, out.cast_forward_inputs = "f32", "f32", false
  end
  return out
end

local function compute_of_key(key) return (key:match("%->(.*)$")) end

local function join(prefix, name)
  if prefix == "" then return name end
  return prefix .. "." .. name
end

--- The compute-dtype function of rule 1 for `module` (names relative to it).  skip: the
-- parameters left out (ignored or owned).
function M.compute_dtype_fn(module, mp, fp32_names, skip)
  local policy_dtype = mp and mp.param_dtype
  local pinned = {}
  if fp32_names and #fp32_names > 0 then
    local function pin(name, t)
      for _, token in ipairs(fp32_names) do
        if name:find(token, 1, true) then pinned[t] = true return end
      end
    end
    for _, np in ipairs(module:named_parameters()) do
      if not skip[np[2]] then pin(np[1], np[2]) end
    end
    for _, nb in ipairs(module:named_buffers()) do pin(nb[1], nb[2]) end
  end
  return function(t)
    if not FLOATING[t.dtype] then return t.dtype end
    if pinned[t] then return "f32" end
    if t.checkpoint_dtype and FLOATING[t.checkpoint_dtype] then return t.checkpoint_dtype end
    if policy_dtype and t.dtype == "f32" and policy_dtype ~= "f32" then return policy_dtype end
    return t.dtype
  end
end

-- Rule 5: the maximal subtrees of `module` (itself included) whose floating, not skipped
-- parameters and floating buffers share one key; {module, key} in module order.
local function maximal_uniform(module, key_of, skip)
  local function visit(m)
    local keys, nkeys, first = {}, 0, nil
    local function note(k)
      if not keys[k] then keys[k], nkeys, first = true, nkeys + 1, first or k end
    end
    for _, pname in ipairs(m.param_order) do
      local p = m.params[pname]
      if FLOATING[p.dtype] and not skip[p] then note(key_of(p)) end
    end
    for _, bname in ipairs(m.buffer_order or {}) do
      local b = m.buffers[bname]
      if FLOATING[b.dtype] then note(key_of(b)) end
    end
    local collected = {}
    for _, cname in ipairs(m.child_order) do
      local ckeys, citems = visit(m.children[cname])
      for k in pairs(ckeys) do note(k) end
      for _, it in ipairs(citems) do collected[#collected + 1] = it end
    end
    if nkeys == 1 then return keys, { { m, first } } end
    return keys, collected
  end
  local _, items = visit(module)
  return items
end

--- Shards `module` by dtype groups.  opts: as for ctx:fully_shard (mp_policy defaults to
-- M.precision; ignored_params), plus fp32_names (default the model's keep_in_fp32_strict) and
-- fully_shard_fn (Automodel's fully_shard_fn: called as fn(module, options) for every unit
-- instead of ctx:fully_shard; DeepSeek-V4 passes its fully_shard_deepseek_v4).  Returns the
-- units ctx:fully_shard made, in order.
function M.fully_shard_by_dtype(ctx, module, opts)
  opts = opts or {}
  module = ctx:module(module)
  local mp = opts.mp_policy
  if mp == nil then mp = M.precision end
  local fp32_names = opts.fp32_names or ctx.model.attrs.keep_in_fp32_strict or {}
  local ignored = opts.ignored_params or {}
  local skip = {}
  for _, p in ipairs(ignored) do skip[p] = true end
  local prefix = ctx:name_of(module)
  for _, np in ipairs(module:named_parameters()) do
    if ctx:is_owned(np[2]) then skip[np[2]] = true end
  end
  local compute = M.compute_dtype_fn(module, mp, fp32_names, skip)
  local function key_of(t) return t.dtype .. "->" .. compute(t) end

  -- rule 2
  local groups, order = {}, {}
  for _, np in ipairs(module:named_parameters()) do
    local p = np[2]
    if not skip[p] then
      local k = key_of(p)
      if not groups[k] then
        groups[k] = { key = k, compute = compute(p), params = {}, names = {} }
        order[#order + 1] = k
      end
      local g = groups[k]
      g.params[#g.params + 1] = p
      g.names[#g.names + 1] = join(prefix, np[1])
    end
  end

  local units = {}
  local function unit(m, mp_policy)
    local o = {}
    for k, v in pairs(opts) do
      if k ~= "fp32_names" and k ~= "fully_shard_fn" then o[k] = v end
    end
    o.mp_policy = mp_policy
    if #ignored == 0 then o.ignored_params = nil end
    if opts.fully_shard_fn then
      opts.fully_shard_fn(m, o)
    else
      units[#units + 1] = ctx:fully_shard(m, o)
    end
  end

  -- rule 3
  if #order == 0 then
    if #ignored > 0 then unit(module, mp) end
    return units
  end
  if #order == 1 then
    unit(module, M.policy_for(mp, groups[order[1]].compute))
    return units
  end

  -- rule 4
  local least = order[1]
  for _, k in ipairs(order) do
    if #groups[k].params < #groups[least].params then least = k end
  end
  local selected = {}
  for _, it in ipairs(maximal_uniform(module, key_of, skip)) do
    if #order > 2 or it[2] == least then selected[#selected + 1] = it end
  end
  -- rule 7
  local covered = {}
  for _, it in ipairs(selected) do
    for _, np in ipairs(it[1]:named_parameters()) do covered[np[2]] = true end
  end
  local unresolved = {}
  for _, k in ipairs(order) do
    if #order > 2 or k == least then
      for i, p in ipairs(groups[k].params) do
        if not covered[p] then unresolved[#unresolved + 1] = groups[k].names[i] end
      end
    end
  end
  if #unresolved > 0 then
    local shown = table.concat(unresolved, ", ", 1, math.min(6, #unresolved))
    if #unresolved > 6 then shown = shown .. string.format(" and %d more", #unresolved - 6) end
    error(string.format("fully_shard_by_dtype(%s): FSDP could not isolate parameters with a distinct dtype from " ..
      "siblings in the same module: %s. Place them in a dedicated parameter-owning module (groups: %s)",
      prefix == "" and "<root>" or prefix, shown, table.concat(order, ", ")), 0)
  end
  for _, it in ipairs(selected) do
    local m, policy = it[1], M.policy_for(mp, compute_of_key(it[2]))
    if m.type == "ModuleList" then
      for _, c in ipairs(m.child_order) do unit(m.children[c], policy) end
    else
      unit(m, policy)
    end
  end
  if #order == 2 then
    local majority = order[1] == least and order[2] or order[1]
    unit(module, M.policy_for(mp, groups[majority].compute))
  elseif #ignored > 0 then
    unit(module, mp)
  end
  return units
end

--- Every child of every ModuleList/ModuleDict sharded by dtype, then the root as one unit
-- (Automodel's Qwen3_5ParallelizationStrategy, which swaps fully_shard_by_dtype into
-- apply_fsdp2_sharding_recursively).
function M.parallelize(ctx)
  if ctx.options.prefetch then ctx:set_prefetch(ctx.options.prefetch) end
  local fsdp2_default = require "fsdp2_default"
  local mp = M.precision
  fsdp2_default.apply_recursively(ctx, ctx.model, function(layer, reshard)
    M.fully_shard_by_dtype(ctx, layer, { mp_policy = mp, reshard_after_forward = reshard })
  end)
  ctx:fully_shard(ctx.model, { mp_policy = mp, reshard_after_forward = false })
end

return M
