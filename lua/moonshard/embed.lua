-- moonshard.embed: what the embedding API (moonshard_embed.h) does in Lua, one instance
-- per rank's Lua state: the host describes its model parameter by parameter (dotted
-- names make the module tree; module types may be set so that policies recognise layers,
-- MoE blocks and experts), plans it with a policy on a mesh, and materialises the units.

local M = {}

local state = { tensors = {}, types = {}, frozen = {} }

function M.add_param(fqn, shape, dtype, requires_grad)
  if state.plan then error("moonshard: embed: the model cannot change after it was planned", 0) end
  state.tensors[#state.tensors + 1] = { name = fqn, shape = shape, dtype = dtype }
  if not requires_grad then state.frozen[fqn] = true end
end

function M.set_module_type(name, type_name)
  state.types[name] = type_name
end

function M.use_config(path)
  local f, err = io.open(path, "rb")
  if not f then error("moonshard: embed: cannot read " .. path .. ": " .. tostring(err), 0) end
  local config = require("moonshard.json").decode(f:read("a"), path)
  f:close()
  state.tree = require("moonshard.models").from_config(config, path)
  state.config = config
end

local function tree()
  if state.tree then return state.tree end
  if #state.tensors == 0 then error("moonshard: embed: no model: describe its parameters or give a config", 0) end
  local root = require("moonshard.safetensors").tree(state.tensors, "host model")
  for name, t in pairs(state.types) do
    local m = root:get(name)
    if not m then error("moonshard: embed: no module '" .. name .. "' to give the type " .. t, 0) end
    m.type = t
  end
  for _, np in ipairs(root:named_parameters()) do
    if state.frozen[np[1]] then np[2].requires_grad = false end
  end
  state.tree = root
  return root
end

--- Plans the model on `mesh` (e.g. "dp_shard=4") with the policy at `policy_path`.
function M.plan(mesh, policy_path)
  local mc = require("moonshard.mesh_context").new(mesh)
  local p = require("moonshard.policy").load(policy_path, { modules = { ["moonshard.util"] = require "moonshard.util" } })
  local entry = (type(p.main) == "table" and p.main.parallelize and p.main) or p.shard_units
  if type(entry) ~= "table" or not entry.parallelize then
    error("moonshard: embed: policy " .. policy_path .. " has no parallelize(ctx)", 0)
  end
  state.plan = require("moonshard.plan").plan(tree(), mc, entry, { name = "host model" })
  return #state.plan.units
end

--- The policy's prefetch depths: forward, backward (units ahead).
function M.prefetch()
  if not state.plan then error("moonshard: embed: no plan yet", 0) end
  return state.plan.prefetch.forward, state.plan.prefetch.backward
end

function M.plan_json()
  if not state.plan then error("moonshard: embed: no plan yet", 0) end
  return require("moonshard.plan_report").to_json(state.plan)
end

function M.materialize()
  if not state.plan then error("moonshard: embed: plan the model before materialising it", 0) end
  state.rank = require("moonshard.runtime").materialize(state.plan)
  -- Hosts know their parameters by their own names: activation-checkpoint wrapping
  -- renames them in the plan, so both names are found.
  local strip = require("moonshard.module").strip_checkpoint
  state.where = {}
  for ui, u in ipairs(state.rank.units) do
    for pi = 0, u:count() - 1 do
      local fqn = u:fqn(pi)
      state.where[fqn] = { ui - 1, pi }
      state.where[strip(fqn)] = { ui - 1, pi }
    end
  end
  return #state.rank.units
end

--- How many units this rank holds (0 before materialize).
function M.materialize_count()
  return state.rank and #state.rank.units or 0
end

--- The unit object at 0-based index i.
function M.unit(i)
  if not state.rank then error("moonshard: embed: materialise the plan first", 0) end
  local u = state.rank.units[i + 1]
  if not u then error(string.format("moonshard: embed: no unit %d (there are %d)", i, #state.rank.units), 0) end
  return u
end

--- unit index, parameter index (0-based) of a parameter (expert parameters included: the
-- runtime puts the unsharded ones in ep-local units).
function M.find(fqn)
  if not state.rank then error("moonshard: embed: materialise the plan first", 0) end
  local w = state.where[fqn]
  if w then return w[1], w[2] end
  error("moonshard: embed: the plan has no parameter '" .. fqn .. "'", 0)
end

return M
