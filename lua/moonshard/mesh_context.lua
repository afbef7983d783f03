-- moonshard.mesh_context: Automodel's MeshContext, as shapes.
--
-- The root mesh is (pp, dp_replicate, dp_shard, cp, tp) with the flattened axes
-- dp = (dp_replicate, dp_shard), dp_shard_cp = (dp_shard, cp), dp_cp = (dp_replicate,
-- dp_shard, cp).  The MoE mesh flattens (dp_replicate, dp_shard, cp, tp) and splits it
-- into (ep_shard, ep), ep innermost.  No ranks are needed: this is the planner's view.

local util = require "moonshard.util"

local M = {}

local MeshContext = {}
MeshContext.__index = MeshContext

local AXES = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }
M.AXES = AXES
local KNOWN = { pp = true, dp_replicate = true, dp_shard = true, cp = true, tp = true, ep = true }

local function fail(msg) error("moonshard: mesh: " .. msg, 0) end

local is_int = util.is_int

-- Ranks are C ints (MPI, NCCL, the core): no axis and no world holds more.
M.MAX_RANKS = 2147483647

local function check_size(name, v, shown)
  if not is_int(v) or v < 1 or v > M.MAX_RANKS then
    if not shown then
      shown = is_int(v) and math.abs(v) < 2 ^ 63 and string.format("%d", v) or tostring(v)
    end
    fail(string.format("%s = %s; sizes are integers in 1..%d (ranks are C ints)", name, shown, M.MAX_RANKS))
  end
end

--- Parses "dp_replicate=2,dp_shard=4,ep=8" into a table of sizes.
function M.parse(spec)
  if type(spec) ~= "string" or spec == "" then
    fail("expected sizes like dp_replicate=2,dp_shard=4,ep=8")
  end
  local sizes = {}
  -- every comma separates two items: "", "," and "dp_shard=2,,ep=2" name no axis somewhere
  for item in (spec .. ","):gmatch("([^,]*),") do
    if not item:find("%S") then
      fail("an empty item in '" .. spec .. "'; expected sizes like dp_replicate=2,dp_shard=4,ep=8")
    end
    local name, value = item:match("^%s*([%w_]+)%s*=%s*(%-?%d+)%s*$")
    if not name then
      fail("'" .. item .. "' is not name=size with a whole number size, like dp_shard=8 (in '" .. spec .. "')")
    end
    if not KNOWN[name] then
      fail("unknown axis '" .. name .. "' (axes: pp, dp_replicate, dp_shard, cp, tp, ep)")
    end
    if sizes[name] then fail("axis '" .. name .. "' given twice") end
    check_size(name, tonumber(value), value) -- before anything is sized by it
    sizes[name] = tonumber(value)
  end
  return sizes
end

--- new{pp=, dp_replicate=, dp_shard=, cp=, tp=, ep=, world=?, n_routed_experts=?}
-- Unset sizes are 1, except dp_shard, which fills the world when `world` is given.
function M.new(sizes)
  if type(sizes) == "string" then sizes = M.parse(sizes) end
  local s = {}
  for _, a in ipairs(AXES) do s[a] = sizes[a] end
  s.ep = sizes.ep or 1
  for _, name in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep" }) do
    if s[name] ~= nil then check_size(name, s[name]) end
  end
  if sizes.world ~= nil then check_size("world", sizes.world) end
  for _, a in ipairs(AXES) do
    if a ~= "dp_shard" then s[a] = s[a] or 1 end
  end
  -- each factor is at most MAX_RANKS, so no product below wraps or loses exactness
  local others = 1
  for _, a in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp" }) do
    if a ~= "dp_shard" then
      others = others * s[a]
      if others > M.MAX_RANKS then
        fail(string.format("pp*dp_replicate*cp*tp is more than %d ranks (ranks are C ints)", M.MAX_RANKS))
      end
    end
  end
  if not s.dp_shard then
    if not sizes.world then s.dp_shard = 1
    elseif sizes.world % others ~= 0 then
      fail(string.format("world %d is not divisible by pp*dp_replicate*cp*tp = %d", sizes.world, others))
    else s.dp_shard = util.idiv(sizes.world, others) end
  end
  local world = others * s.dp_shard
  if world > M.MAX_RANKS then
    fail(string.format("pp*dp_replicate*dp_shard*cp*tp = %s is more than %d ranks (ranks are C ints)",
      string.format("%.0f", world), M.MAX_RANKS))
  end
  if sizes.world and sizes.world ~= world then
    fail(string.format("pp*dp_replicate*dp_shard*cp*tp = %d but the world has %d ranks", world, sizes.world))
  end
  local dp = s.dp_replicate * s.dp_shard
  if s.dp_replicate ~= 1 and s.dp_replicate >= dp then
    fail(string.format("dp_replicate = %d needs dp_shard > 1 (dp_replicate >= dp_size = %d is rejected, " ..
      "as Automodel does: use dp_shard for pure data parallel sharding)", s.dp_replicate, dp))
  end
  local non_pp = dp * s.cp * s.tp
  if s.ep > non_pp then
    fail(string.format("ep = %d is larger than dp_replicate*dp_shard*cp*tp = %d", s.ep, non_pp))
  end
  if non_pp % s.ep ~= 0 then
    fail(string.format("ep = %d does not divide dp_replicate*dp_shard*cp*tp = %d", s.ep, non_pp))
  end
  local nre = sizes.n_routed_experts
  if nre ~= nil and (not is_int(nre) or nre < 1) then
    fail("n_routed_experts = " .. tostring(nre) .. "; expected an integer >= 1")
  end
  if sizes.n_routed_experts and s.ep > 1 and sizes.n_routed_experts % s.ep ~= 0 then
    fail(string.format("the model's %d routed experts are not divisible by ep = %d (expert parallelism splits " ..
      "them evenly over ep)", sizes.n_routed_experts, s.ep))
  end
  local ctx = setmetatable({ sizes = s, world = world, non_pp = non_pp }, MeshContext)
  s.ep_shard = s.ep < non_pp and util.idiv(non_pp, s.ep) or 1
  s.dp = dp
  s.dp_shard_cp = s.dp_shard * s.cp
  s.dp_cp = dp * s.cp
  -- FSDP mesh: Automodel's MeshContext rule
  if s.cp == 1 and s.dp_replicate == 1 then ctx.fsdp_axes = { "dp_shard" }
  elseif s.cp == 1 then ctx.fsdp_axes = { "dp_replicate", "dp_shard" }
  elseif s.dp_replicate == 1 then ctx.fsdp_axes = { "dp_shard_cp" }
  else ctx.fsdp_axes = { "dp_replicate", "dp_shard_cp" } end
  return ctx
end

--- Size of an axis (root, flattened or MoE: pp dp_replicate dp_shard cp tp dp dp_shard_cp
-- dp_cp ep ep_shard).
function MeshContext:size(axis)
  local v = self.sizes[axis]
  if not v then fail("no axis '" .. tostring(axis) .. "'") end
  return v
end

--- Product of the sizes of a list of axes.
function MeshContext:group_size(axes)
  local n = 1
  for _, a in ipairs(axes) do n = n * self:size(a) end
  return n
end

-- The root axes a flattened axis stands for; the MoE mesh (pp, ep_shard, ep) is separate.
local FLATTENED = { dp = { "dp_replicate", "dp_shard" }, dp_shard_cp = { "dp_shard", "cp" },
  dp_cp = { "dp_replicate", "dp_shard", "cp" } }

--- stride, size of an axis (root, flattened or MoE): world rank r has coordinate
-- floor(r / stride) % size on it.  Every axis is a contiguous group of row-major digits of
-- (pp, dp_replicate, dp_shard, cp, tp), or of (pp, ep_shard, ep) with ep innermost.
function MeshContext:stride(axis)
  local s = self.sizes
  if axis == "ep" then return 1, s.ep end
  if axis == "ep_shard" then return s.ep, s.ep_shard end
  local parts = FLATTENED[axis] or { axis }
  if not s[parts[1]] then fail("no axis '" .. tostring(axis) .. "'") end
  local stride, size, inner = 1, 1, false
  for i = #AXES, 1, -1 do
    local a = AXES[i]
    local part = false
    for _, p in ipairs(parts) do part = part or p == a end
    if part then size, inner = size * s[a], true
    elseif not inner then stride = stride * s[a] end
  end
  return stride, size
end

--- Whether axis `outer` lies wholly outside axis `inner` in one mesh (every dim of outer
-- before every dim of inner: (pp, dp_replicate, dp_shard, cp, tp), or (pp, ep_shard, ep)),
-- as torch's DeviceMesh slicing mesh[(outer, inner)] requires.
function MeshContext:outside(outer, inner)
  local MOE = { ep_shard = 1, ep = 2 }
  local function dims(axis)
    if MOE[axis] then return "moe", MOE[axis], MOE[axis] end
    local first, last
    for i, a in ipairs(AXES) do
      for _, part in ipairs(FLATTENED[axis] or { axis }) do
        if part == a then first, last = first or i, i end
      end
    end
    if not first then fail("no axis '" .. tostring(axis) .. "'") end
    return "root", first, last
  end
  local fo, _, lo = dims(outer)
  local fi, ii = dims(inner)
  return fo == fi and lo < ii
end

--- The 0-based coordinate of world rank r along an axis (root, flattened or MoE), row-major.
function MeshContext:coord(axis, r)
  local stride, size = self:stride(axis)
  return util.idiv(r, stride) % size
end

--- "dp_replicate=2, dp_shard=4, ep=8": the sizes that are not 1, in mesh order.
function MeshContext:describe()
  local parts = {}
  for _, a in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep" }) do
    if self.sizes[a] ~= 1 then parts[#parts + 1] = a .. "=" .. self.sizes[a] end
  end
  if #parts == 0 then return "world=1" end
  return table.concat(parts, ", ")
end

--- The root mesh axes with sizes, in order (for the plan JSON).
function MeshContext:root_axes()
  local out = {}
  for _, a in ipairs(AXES) do out[#out + 1] = { name = a, size = self.sizes[a] } end
  return out
end

M.MeshContext = MeshContext
return M
