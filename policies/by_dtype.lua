-- by_dtype.lua: Automodel's fully_shard_by_dtype (SEMANTICS.md §6), and a policy that
-- shards every decoder layer and the root with it.
--
-- A module's remaining parameters are grouped by (stored dtype, compute dtype).  One group:
-- the module is one unit.  Two groups: the maximal uniform subtrees of the minority group
-- become units first, then the module.  Three or more: every maximal uniform subtree
-- becomes a unit, then the module.  Trainable parameters of a group that no subtree
-- isolates (held directly by the module among others) are an error: they need a module of
-- their own.  Frozen ones are not: FSDP2 takes frozen parameters of another dtype into a unit
-- (DeepSeek-V3's f32 e_score_correction_bias beside its bf16 router weight, a buffer in
-- Automodel, which its fully_shard_by_dtype never sees).

local M = {}

M.precision = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }
M.options = {
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units gathered ahead in forward" },
  ["prefetch.backward"] = { default = 2, min = 0, doc = "units gathered ahead in backward" },
}
M.with = require("derive").with_of(M)

local function key_of(ctx, p, mp)
  return p.dtype .. "->" .. ctx:compute_dtype(p, mp)
end

-- The group keys of the parameters still to place under each module of the subtree, the
-- numel per key at the top, the names per key and the keys with a trainable parameter.
local function collect(ctx, module, mp, skip)
  local keys_of, numel, params_of_key, trainable = {}, {}, {}, {}
  local function walk(m, name)
    local keys, nkeys = {}, 0
    for _, pname in ipairs(m.param_order) do
      local p = m.params[pname]
      if not skip[p] and not ctx:is_owned(p) then
        local k = key_of(ctx, p, mp)
        if not keys[k] then keys[k], nkeys = true, nkeys + 1 end
        numel[k] = (numel[k] or 0) + p.numel
        trainable[k] = trainable[k] or p.requires_grad
        params_of_key[k] = params_of_key[k] or {}
        table.insert(params_of_key[k], name == "" and pname or name .. "." .. pname)
      end
    end
    for _, cname in ipairs(m.child_order) do
      local ck = walk(m.children[cname], name == "" and cname or name .. "." .. cname)
      for k in pairs(ck) do
        if not keys[k] then keys[k], nkeys = true, nkeys + 1 end
      end
    end
    keys_of[m] = keys
    return keys
  end
  walk(module, ctx:name_of(module))
  return keys_of, numel, params_of_key, trainable
end

local function only_key(keys)
  local found
  for k in pairs(keys) do
    if found then return nil end
    found = k
  end
  return found
end

-- The maximal subtrees strictly below `module` whose remaining parameters all share one
-- key (accepted by `want`), in module order.
local function maximal_uniform(module, keys_of, want)
  local out = {}
  local function walk(m)
    for _, cname in ipairs(m.child_order) do
      local c = m.children[cname]
      local k = only_key(keys_of[c])
      if k and want(k) then out[#out + 1] = c
      elseif next(keys_of[c]) then walk(c) end
    end
  end
  walk(module)
  return out
end

--- Shards `module` by dtype groups; opts as for ctx:fully_shard (mp_policy defaults to
-- M.precision).
function M.fully_shard_by_dtype(ctx, module, opts)
  opts = opts or {}
  module = ctx:module(module)
  local mp = opts.mp_policy or M.precision
  local skip = {}
  for _, p in ipairs(opts.ignored_params or {}) do skip[p] = true end
  local keys_of, numel, params_of_key = collect(ctx, module, mp, skip)
  local keys = {}
  for k in pairs(keys_of[module]) do keys[#keys + 1] = k end
  table.sort(keys)
  local function unit(m, mp_policy)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.mp_policy = mp_policy
    return ctx:fully_shard(m, o)
  end
  if #keys > 1 then
    local want
    if #keys == 2 then
      local minority = numel[keys[1]] <= numel[keys[2]] and keys[1] or keys[2]
      want = function(k) return k == minority end
    else
      want = function() return true end
    end
    for _, sub in ipairs(maximal_uniform(module, keys_of, want)) do unit(sub, mp) end
    -- what is left for the module itself must be one group, frozen parameters aside
    local left_of, _, _, trainable = collect(ctx, module, mp, skip)
    local left_keys = {}
    for k in pairs(left_of[module]) do
      if trainable[k] then left_keys[#left_keys + 1] = k end
    end
    if #left_keys > 1 then
      table.sort(left_keys)
      local names = {}
      for _, k in ipairs(left_keys) do
        names[#names + 1] = k .. ": " .. table.concat(params_of_key[k], ", ", 1, math.min(3, #params_of_key[k]))
      end
      error(string.format("fully_shard_by_dtype(%s): parameters of different dtypes (%s) are not isolated by " ..
        "any submodule: place them in a dedicated parameter-owning module",
        ctx:name_of(module) == "" and "<root>" or ctx:name_of(module), table.concat(names, "; ")), 0)
    end
  end
  return unit(module, mp)
end

--- Every decoder layer, then the root, sharded by dtype.
function M.parallelize(ctx)
  if ctx.options.prefetch then ctx:set_prefetch(ctx.options.prefetch) end
  local layers = ctx:module("model.layers")
  local n = #layers.child_order
  for k, i in ipairs(layers.child_order) do
    M.fully_shard_by_dtype(ctx, layers.children[i], { reshard_after_forward = k < n })
  end
  M.fully_shard_by_dtype(ctx, ctx.model, {})
end

return M
