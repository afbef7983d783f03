-- moonshard.mesh: the world of this rank, device meshes, groups, their collectives and
-- point-to-point calls, and the layout functions (local_shape with placements, fsdp_shard,
-- chunk_extent), for both interpreters, over the binding's raw functions (moonshard.raw).
-- Dims, ranks, coordinates and offsets are 0-based.

local REGISTRY = debug.getregistry()
if REGISTRY["moonshard.mesh"] then return REGISTRY["moonshard.mesh"] end

local R = require "moonshard.raw"
local A = require "moonshard.args"
local tensor = require "moonshard.tensor"
A.library_file()

local format, concat = string.format, table.concat
local ok, raise = A.ok, A.raise
local check_tensor = tensor.check
local K = R.const

local M = {}
local mesh_methods, group_methods = {}, {}

local check_mesh, check_group = A.checker("mesh"), A.checker("group")
M.check_group = check_group

-- ---------------------------------------------------------------- world

function M.rank() return R.world_rank() end
function M.world_size() return R.world_size() end
function M.backend() return R.world_backend() end

--- device() -> where this rank's tensors go: "cuda:N" (its GPU) on the nccl backend, else "cpu"
function M.device()
  local kind, index = ok(R.world_device())
  return tensor.device_string(kind, index)
end

-- ---------------------------------------------------------------- meshes

--- ms.mesh({{"dp_replicate", 2}, {"dp_shard", 4}}, {shape_only = true}?)
function M.mesh(axes, opts)
  A.check_table(axes, 1)
  local n = #axes
  if n < 1 or n > R.MAX_DIMS then
    raise("moonshard invalid_argument error: mesh: expected 1 to %d axes like {{\"dp_shard\", 4}}, got %d", R.MAX_DIMS, n)
  end
  local names, sizes = {}, {}
  for i = 1, n do
    local axis = axes[i]
    if type(axis) ~= "table" then
      raise("moonshard invalid_argument error: mesh: axis %d is %s, expected {name, size}", i, A.typename(axis))
    end
    local name, size = axis[1], A.to_integer(axis[2])
    if type(name) ~= "string" or not size then
      raise("moonshard invalid_argument error: mesh: axis %d must be {name, size} with a string and an integer", i)
    end
    names[i], sizes[i] = name, size
  end
  local shape_only = type(opts) == "table" and opts.shape_only
  return ok(R.mesh_new(names, sizes, not (shape_only ~= nil and shape_only ~= false)))
end

local function axis_names(m)
  local out = {}
  for i = 0, R.mesh_ndim(m) - 1 do out[i + 1] = R.mesh_axis_name(m, i) end
  return out
end

local function axis_index(m, name, arg)
  name = A.check_string(name, arg)
  local a = R.mesh_axis_index(m, name)
  if a < 0 then
    raise("moonshard invalid_argument error: mesh has no axis '%s' (axes: %s)", name, concat(axis_names(m), ", "))
  end
  return a
end

function mesh_methods.size(self, axis)
  local m = check_mesh(self, 1)
  if axis == nil then return R.mesh_size(m) end
  return R.mesh_axis_size(m, axis_index(m, axis, 2))
end

function mesh_methods.axes(self) return axis_names(check_mesh(self, 1)) end

local function opt_rank(m, rank, arg)
  if rank ~= nil then return A.check_integer(rank, arg) end
  local r = R.mesh_rank(m)
  if r < 0 then raise("moonshard invalid_argument error: a shape-only mesh has no rank of its own; pass a rank") end
  return r
end

function mesh_methods.rank(self)
  local r = R.mesh_rank(check_mesh(self, 1))
  if r < 0 then return nil end
  return r
end

function mesh_methods.coords(self, rank)
  local m = check_mesh(self, 1)
  local c = ok(R.mesh_coords(m, opt_rank(m, rank, 2)))
  local out = {}
  for i = 0, R.mesh_ndim(m) - 1 do out[R.mesh_axis_name(m, i)] = c[i + 1] end
  return out
end

-- An axis name or a sequence of names -> a list of axis indices.  item_arg: the argument a
-- bad entry is reported as.
local function check_axes(m, axes, arg, item_arg)
  if type(axes) == "string" then return { axis_index(m, axes, arg) } end
  A.check_table(axes, arg)
  local n, ndim = #axes, R.mesh_ndim(m)
  if n < 1 or n > ndim then
    raise("moonshard invalid_argument error: mesh group: expected 1 to %d axis names, got %d", ndim, n)
  end
  local out = {}
  for i = 1, n do out[i] = axis_index(m, axes[i], item_arg) end
  return out
end

function mesh_methods.group(self, axes)
  local m = check_mesh(self, 1)
  return ok(R.mesh_group(m, check_axes(m, axes, 2, 3)))
end

--- mesh:group_ranks(axes, rank?) -> the mesh ranks of that group, without communicating
function mesh_methods.group_ranks(self, axes, rank)
  local m = check_mesh(self, 1)
  local a = check_axes(m, axes, 2, rank == nil and 3 or 4)
  return ok(R.mesh_group_ranks(m, a, opt_rank(m, rank, 3)))
end

A.define("mesh", mesh_methods, function(m)
  local axes = {}
  for i = 0, R.mesh_ndim(m) - 1 do axes[i + 1] = format("%s=%d", R.mesh_axis_name(m, i), R.mesh_axis_size(m, i)) end
  return "mesh(" .. concat(axes, ", ") .. ")"
end)

-- ---------------------------------------------------------------- groups and collectives

local function group_ranks(c)
  local out = {}
  for i = 0, R.group_size(c) - 1 do out[i + 1] = R.group_world_rank(c, i) end
  return out
end

function group_methods.size(self) return R.group_size(check_group(self, 1)) end
function group_methods.rank(self) return R.group_rank(check_group(self, 1)) end
function group_methods.ranks(self) return group_ranks(check_group(self, 1)) end

local function opt_op(v, arg)
  if v == nil then return K.OP_SUM end
  return ok(R.op_code(A.check_string(v, arg)))
end

function group_methods.all_gather(self, out, inp)
  ok(R.all_gather(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3)))
  return out
end

function group_methods.reduce_scatter(self, out, inp, op)
  ok(R.reduce_scatter(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3), opt_op(op, 4)))
  return out
end

function group_methods.all_reduce(self, t, op)
  ok(R.all_reduce(check_group(self, 1), check_tensor(t, 2), opt_op(op, 3)))
  return t
end

function group_methods.broadcast(self, t, root)
  ok(R.broadcast(check_group(self, 1), check_tensor(t, 2), A.check_int(root, 3, "broadcast: root")))
  return t
end

function group_methods.all_to_all(self, out, inp)
  ok(R.all_to_all(check_group(self, 1), check_tensor(out, 2), check_tensor(inp, 3)))
  return out
end

function group_methods.barrier(self)
  ok(R.barrier(check_group(self, 1)))
end

-- ---------------------------------------------------------------- point-to-point

--- g:send(t, peer, tag?) -> t: t to group rank peer; its matching g:recv there (tag 0 by default)
function group_methods.send(self, t, peer, tag)
  ok(R.send(check_group(self, 1), check_tensor(t, 2), A.check_int(peer, 3, "send: peer"),
    A.opt_int(tag, 4, "send: tag", 0)))
  return t
end

--- g:recv(t, peer, tag?) -> t: into t from group rank peer
function group_methods.recv(self, t, peer, tag)
  ok(R.recv(check_group(self, 1), check_tensor(t, 2), A.check_int(peer, 3, "recv: peer"),
    A.opt_int(tag, 4, "recv: tag", 0)))
  return t
end

local P2P_KIND = { send = K.P2P_SEND, recv = K.P2P_RECV }
local tensor_state, CLASS_TENSOR = R.state, K.CLASS_TENSOR

-- Field j of op i of a batch as an int (a peer, a tag), def when nil and def is given.
local function op_int(v, i, j, what, def)
  if v == nil and def then return def end
  local n = A.to_integer(v)
  if not n then
    raise("moonshard invalid_argument error: batch_p2p: ops[%d][%d] (the %s) is %s, expected an integer", i, j, what,
      A.typename(v))
  end
  if n < -2 ^ 31 or n > 2 ^ 31 - 1 then
    raise("moonshard invalid_argument error: batch_p2p: ops[%d][%d] (the %s) %s is out of range", i, j, what,
      tostring(n))
  end
  return tonumber(n)
end

--- g:batch_p2p{{"send", t, peer, tag?}, {"recv", u, peer, tag?}, ...}: every op together, in
-- any order, without deadlock
function group_methods.batch_p2p(self, ops)
  local g = check_group(self, 1)
  A.check_table(ops, 2)
  local kinds, tensors, peers, tags = {}, {}, {}, {}
  for i = 1, #ops do
    local op = ops[i]
    if type(op) ~= "table" then
      raise("moonshard invalid_argument error: batch_p2p: ops[%d] is %s, expected {\"send\" or \"recv\", tensor, " ..
        "peer, tag?}", i, A.typename(op))
    end
    kinds[i] = P2P_KIND[op[1]]
    if not kinds[i] then
      raise("moonshard invalid_argument error: batch_p2p: ops[%d][1] is %s, expected \"send\" or \"recv\"", i,
        type(op[1]) == "string" and format("%q", op[1]) or A.typename(op[1]))
    end
    local live = tensor_state(op[2], CLASS_TENSOR)
    if live == nil then
      raise("moonshard invalid_argument error: batch_p2p: ops[%d][2] is %s, expected a tensor", i, A.typename(op[2]))
    elseif not live then
      raise("moonshard state error: attempt to use a released tensor")
    end
    tensors[i], peers[i], tags[i] = op[2], op_int(op[3], i, 3, "peer"), op_int(op[4], i, 4, "tag", 0)
  end
  ok(R.batch_p2p(g, kinds, tensors, peers, tags))
end

A.define("group", group_methods, function(c)
  return format("group(%s, rank %d of %d, ranks [%s])", R.group_backend(c), R.group_rank(c), R.group_size(c),
    concat(group_ranks(c), " "))
end)

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
    raise("moonshard invalid_argument error: Shard(dim) needs an integer dim, got %s", tostring(dim))
  end
  return setmetatable({ kind = "shard", dim = dim }, Placement)
end

--- Replicate(): every rank along the mesh dim holds the whole tensor.
function M.Replicate() return setmetatable({ kind = "replicate" }, Placement) end

--- Partial(op?): the whole shape on every rank, a reduction (default sum) still pending.
function M.Partial(op)
  op = op or "sum"
  if not partial_ops[op] then
    raise("moonshard invalid_argument error: Partial(op): unknown op '%s' (sum, avg, max, min or product)", tostring(op))
  end
  return setmetatable({ kind = "partial", op = op }, Placement)
end

local kind_code = { replicate = K.PLACEMENT_REPLICATE, shard = K.PLACEMENT_SHARD, partial = K.PLACEMENT_PARTIAL }

-- ---------------------------------------------------------------- layouts

--- local_shape(global_shape, placements, mesh_shape, coords) -> local_shape, global_offset
-- placements: one per mesh dim.  mesh_shape: a sequence of sizes, or a mesh.  coords: a
-- sequence of 0-based coordinates, or a table axis name -> coordinate (as mesh:coords()
-- returns) when mesh_shape is a mesh.
function M.local_shape(global_shape, placements, mesh_shape, coords)
  local sizes, crd = mesh_shape, coords
  if R.classof(mesh_shape) == "mesh" then
    local m = check_mesh(mesh_shape, 3)
    sizes, crd = {}, {}
    for i, name in ipairs(axis_names(m)) do
      sizes[i] = R.mesh_axis_size(m, i - 1)
      crd[i] = coords[name] or coords[i]
      if crd[i] == nil then
        raise("moonshard invalid_argument error: local_shape: no coordinate for mesh axis '%s'", name)
      end
    end
  end
  if type(placements) ~= "table" then
    raise("moonshard invalid_argument error: local_shape: placements must be a list like {ms.Shard(0), ms.Replicate()}")
  end
  local kinds, dims = {}, {}
  for i = 1, #placements do
    local p = placements[i]
    if not is_placement(p) then
      raise("moonshard invalid_argument error: local_shape: placements[%d] is %s, expected ms.Shard(d), " ..
        "ms.Replicate() or ms.Partial()", i, tostring(p))
    end
    kinds[i] = kind_code[p.kind]
    dims[i] = p.dim or 0
  end
  local shape = A.int_list(global_shape, 1, "global_shape")
  sizes = A.int_list(sizes, 3, "mesh_shape")
  crd = A.int_list(crd, 4, "coords")
  local nm = #sizes
  if #kinds ~= nm or #crd ~= nm then
    raise("moonshard invalid_argument error: local_shape: %d placements and %d coordinates for a mesh of %d dims " ..
      "(one of each per mesh dim)", #kinds, #crd, nm)
  end
  for i = 1, nm do
    if dims[i] < -2 ^ 31 or dims[i] > 2 ^ 31 - 1 then
      raise("moonshard invalid_argument error: local_shape: placement dim %d is out of range", dims[i])
    end
  end
  return ok(R.local_shape(shape, kinds, dims, sizes, crd))
end

--- fsdp_shard(global_shape, world, rank, dim?) -> local_shape, offset, padded_shape: FSDP2's
-- torch.chunk shard of rank `rank` of `world` along dim (default 0)
function M.fsdp_shard(global_shape, world, rank, dim)
  local shape = A.int_list(global_shape, 1, "global_shape")
  world, rank = A.check_integer(world, 2), A.check_integer(rank, 3)
  return ok(R.fsdp_shard(shape, world, rank, A.opt_int(dim, 4, "fsdp_shard: dim", 0)))
end

--- chunk_extent(n, k, r) -> length, offset of torch.chunk piece r of n rows in k chunks
function M.chunk_extent(n, k, r)
  return ok(R.chunk_extent(A.check_integer(n, 1), A.check_integer(k, 2), A.check_integer(r, 3)))
end

REGISTRY["moonshard.mesh"] = M
return M
