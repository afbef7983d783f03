-- moonshard: the Lua face of libmoonshard.
--
-- `local ms = require "moonshard"` gives the Lua API (docs/lua-api.md): ranks, tensors, meshes,
-- groups and collectives come from the binding of libmoonshard: the C binding
-- (moonshard.core) under Lua 5.4, the FFI binding (moonshard.core_ffi) under LuaJIT, with
-- the same functions and messages; placements and the layout helpers that take them are
-- here.  Dims, ranks, coordinates and offsets are 0-based.

local core = require(type(jit) == "table" and "moonshard.core_ffi" or "moonshard.core")

local M = {}
for k, v in pairs(core) do M[k] = v end

-- ---------------------------------------------------------------- placements

local Placement = {}
Placement.__index = Placement

function Placement.__tostring(p)
  if p.kind == "shard" then return "Shard(" .. p.dim .. ")" end
  if p.kind == "partial" then return "Partial(" .. p.op .. ")" end
  return "Replicate()"
end

function Placement.__eq(a, b)
  return a.kind == b.kind and a.dim == b.dim and a.op == b.op
end

local function is_placement(p) return getmetatable(p) == Placement end
M.is_placement = is_placement

local partial_ops = { sum = true, avg = true, max = true, min = true, product = true }

--- Shard(dim): the tensor dim `dim` (0-based, negative counts from the end) split over a mesh dim.
function M.Shard(dim)
  if type(dim) ~= "number" or dim ~= math.floor(dim) then
    error("moonshard invalid_argument error: Shard(dim) needs an integer dim, got " .. tostring(dim), 2)
  end
  return setmetatable({ kind = "shard", dim = dim }, Placement)
end

--- Replicate(): every rank along the mesh dim holds the whole tensor.
function M.Replicate() return setmetatable({ kind = "replicate" }, Placement) end

--- Partial(op?): the whole shape on every rank, a reduction (default sum) still pending.
function M.Partial(op)
  op = op or "sum"
  if not partial_ops[op] then
    error("moonshard invalid_argument error: Partial(op): unknown op '" .. tostring(op) .. "' (sum, avg, max, min or product)", 2)
  end
  return setmetatable({ kind = "partial", op = op }, Placement)
end

local kind_code = { replicate = 0, shard = 1, partial = 2 }

--- local_shape(global_shape, placements, mesh_shape, coords) -> local_shape, global_offset
-- placements: one per mesh dim.  mesh_shape: a sequence of sizes, or a mesh.  coords: a
-- sequence of 0-based coordinates, or a table axis name -> coordinate (as mesh:coords()
-- returns) when mesh_shape is a mesh.
function M.local_shape(global_shape, placements, mesh_shape, coords)
  local sizes, crd = mesh_shape, coords
  local kind = type(mesh_shape)
  if kind == "userdata" or kind == "cdata" then -- a mesh (C binding or FFI binding)
    sizes, crd = {}, {}
    for i, name in ipairs(mesh_shape:axes()) do
      sizes[i] = mesh_shape:size(name)
      crd[i] = coords[name] or coords[i]
      if crd[i] == nil then
        error("moonshard invalid_argument error: local_shape: no coordinate for mesh axis '" .. name .. "'", 2)
      end
    end
  end
  if type(placements) ~= "table" then
    error("moonshard invalid_argument error: local_shape: placements must be a list like {ms.Shard(0), ms.Replicate()}", 2)
  end
  local kinds, dims = {}, {}
  for i = 1, #placements do
    local p = placements[i]
    if not is_placement(p) then
      error("moonshard invalid_argument error: local_shape: placements[" .. i .. "] is " .. tostring(p) ..
            ", expected ms.Shard(d), ms.Replicate() or ms.Partial()", 2)
    end
    kinds[i] = kind_code[p.kind]
    dims[i] = p.dim or 0
  end
  -- through pcall, the binding's errors carry no position: they get the caller's line
  local ok, shape, offset = pcall(core.local_shape, global_shape, kinds, dims, sizes, crd)
  if not ok then error(shape, 2) end
  return shape, offset
end

return M
