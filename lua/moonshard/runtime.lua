-- moonshard.runtime: a plan made real on this rank.
--
-- materialize(plan) builds the meshes of the plan's MeshContext on the running world (the
-- root mesh (pp, dp_replicate, dp_shard, cp, tp) and the MoE mesh (pp, ep_shard, ep)),
-- then one shard unit per planned unit, in plan order, over the groups of its mesh axes,
-- with the unit's precision and reshard rule and its parameters in plan order.  Parameters
-- owned by expert parallelism and by no unit get a plain local tensor of their ep-local
-- shape: the runtime leaves them alone.

local ms = require "moonshard"

local M = {}

local function fail(msg) error("moonshard: runtime: " .. msg, 0) end

-- Flattened axes are groups over several root axes.
local FLATTENED = {
  dp = { "dp_replicate", "dp_shard" },
  dp_shard_cp = { "dp_shard", "cp" },
  dp_cp = { "dp_replicate", "dp_shard", "cp" },
}

local Rank = {}
Rank.__index = Rank

--- materialize(plan) -> rank state {units = {...}, by_name = {}, local_params = {fqn -> tensor}}
function M.materialize(plan)
  local mc = plan.mesh
  if ms.world_size() ~= mc.world then
    fail(string.format("the plan is for %d ranks but %d are running (moonshard -n %d)", mc.world, ms.world_size(),
      mc.world))
  end
  local axes = {}
  for _, a in ipairs(mc:root_axes()) do axes[#axes + 1] = { a.name, a.size } end
  local root = ms.mesh(axes)
  local moe = ms.mesh({ { "pp", mc:size("pp") }, { "ep_shard", mc:size("ep_shard") }, { "ep", mc:size("ep") } })
  local function group(axis)
    if axis == "ep_shard" or axis == "ep" then return moe:group(axis) end
    return root:group(FLATTENED[axis] or axis)
  end
  local state = setmetatable({ units = {}, by_name = {}, local_params = {}, mesh = root, moe_mesh = moe,
    plan = plan }, Rank)
  for _, pu in ipairs(plan.units) do
    local axes_u = pu.mesh_axes
    local shard = group(axes_u[#axes_u])
    local replicate = #axes_u == 2 and group(axes_u[1]) or nil
    local u = ms.unit(pu.name, shard, replicate, pu.mp.param_dtype, pu.mp.reduce_dtype, pu.reshard)
    for _, e in ipairs(pu.entries) do
      u:add_param(e.fqn, e.shape, e.param.dtype, e.dim, e.param.requires_grad)
    end
    u:finalize()
    state.units[#state.units + 1] = u
    state.by_name[pu.name] = u
  end
  for _, o in ipairs(plan.owned) do
    if not o.unit then state.local_params[o.fqn] = ms.tensor(o.local_shape, o.dtype) end
  end
  return state
end

--- Bytes this rank holds in every unit and local parameter, by category.
function Rank:bytes()
  local total = { params = 0, grads = 0, optimizer = 0, unsharded = 0 }
  for _, u in ipairs(self.units) do
    for k, v in pairs(u:bytes()) do total[k] = total[k] + v end
  end
  for _, t in pairs(self.local_params) do total.params = total.params + t:nbytes() end
  return total
end

--- Every collective the units issued: a list of {unit=, kind=, dtype=, group_size=, bytes=}.
function Rank:records()
  local out = {}
  for _, u in ipairs(self.units) do
    for _, r in ipairs(u:records()) do
      r.unit = u:name()
      out[#out + 1] = r
    end
  end
  return out
end

return M
