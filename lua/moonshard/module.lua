-- moonshard.module: module trees, the shape of a model that policies and the planner see.
--
-- A module has a type name (the PyTorch class it stands for: "LlamaDecoderLayer",
-- "ModuleList", "GroupedExperts", ...), ordered children, ordered parameters and buffers.
-- Names are dotted paths from the root ("" is the root), exactly as PyTorch's named_modules
-- and named_parameters give them.

local M = {}

local Module = {}
Module.__index = Module
M.Module = Module

local Param = {}
Param.__index = Param
M.Param = Param

-- Counts are exact Lua integers up to 2^53 (MAX_COUNT), where LuaJIT's doubles stop being
-- exact; a larger count is kept as a float (Lua 5.4's integers would wrap) for the planner
-- to refuse.
M.MAX_COUNT = 2 ^ 53

-- The library's directory: its frames are not where a caller's mistake is.
local LIB = (debug.getinfo(1, "S").source:match("^@(.*[/\\])[^/\\]+$"))

-- Raises msg at the first caller outside the library (a user's script), or with no
-- position when there is none (the CLI, an embedding host).
local function fail(msg)
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if not info or info.what == "C" then level = 0 break end
    local src = info.source
    if not (LIB and src:sub(1, 1) == "@" and src:sub(2, #LIB + 1) == LIB) then break end
    level = level + 1
  end
  error("moonshard: " .. msg, level)
end

--- The longest dotted name a module tree takes from its inputs (a checkpoint's tensor names,
-- an embedding host's parameters): bytes and parts.  Real names are far shorter (DeepSeek-V3's
-- longest, "model.layers.60.mlp.experts.255.gate_proj.weight_scale_inv", is 58 bytes in 8
-- parts).  The limits keep what planning makes from names (every module's full name, the
-- prefixes of the parameter's) proportional to the input.
M.MAX_NAME_BYTES = 1024
M.MAX_NAME_DEPTH = 64

--- nil when the dotted name is within the limits, else why not (without the name itself).
function M.name_limit_error(name)
  if #name > M.MAX_NAME_BYTES then
    return string.format("is %d bytes, more than the %d-byte limit on names", #name, M.MAX_NAME_BYTES)
  end
  local parts, at = 1, string.find(name, ".", 1, true)
  while at do parts, at = parts + 1, string.find(name, ".", at + 1, true) end
  if parts > M.MAX_NAME_DEPTH then
    return string.format("has %d dotted parts, more than the %d-part limit on names", parts, M.MAX_NAME_DEPTH)
  end
  return nil
end

local function check_name(name, what)
  if type(name) ~= "string" or name == "" or name:find(".", 1, true) then
    fail(what .. " name must be a non-empty string without dots, got " .. tostring(name))
  end
end

--- The floating dtypes: the ones that can require gradients and take mixed precision.
M.FLOATING = { f32 = true, f16 = true, bf16 = true, f8e4m3 = true, f8e5m2 = true, f64 = true }
local FLOATING = M.FLOATING

--- A parameter of the given shape (a sequence of non-negative integers) and dtype: a plain
-- table {shape = {...}, dtype = "bf16", numel = n, requires_grad = true}.  A parameter read
-- from a checkpoint also records checkpoint_dtype, the dtype the file stores it in
-- (Automodel's _hf_compute_dtype: the dtype its fully_shard_by_dtype computes it in).
function M.param(shape, dtype, opts)
  if type(shape) ~= "table" then fail("parameter shape is " .. tostring(shape) .. "; expected a list of sizes") end
  local numel, zero = 1, false
  for i, s in ipairs(shape) do
    if type(s) ~= "number" or s ~= math.floor(s) or s < 0 or s == math.huge then
      fail(string.format("parameter shape[%d] is %s; sizes are integers >= 0", i, tostring(s)))
    end
    zero = zero or s == 0
    -- past MAX_COUNT in floats, which do not wrap
    if s > 0 and numel > M.MAX_COUNT / s then numel = numel + 0.0 end
    numel = numel * s
  end
  if zero then numel = 0 end
  dtype = dtype or "f32"
  -- as in PyTorch, only floating parameters can require gradients (and do by default)
  local floating = FLOATING[dtype] == true
  if opts and opts.requires_grad == true and not floating then
    fail(string.format("a parameter of dtype %s cannot require gradients; only floating dtypes can", tostring(dtype)))
  end
  local p = setmetatable({ shape = shape, dtype = dtype, numel = numel,
    requires_grad = floating and not (opts and opts.requires_grad == false) }, Param)
  return p
end

--- A meta tensor of the parameter's shape and dtype, when one is wanted.
function Param:meta()
  return require("moonshard").tensor(self.shape, self.dtype, "meta")
end

function Param:nbytes()
  return self.numel * require("moonshard").dtype_size(self.dtype)
end

function Param:__tostring()
  return string.format("param([%s], %s)", table.concat(self.shape, ", "), self.dtype)
end

--- A new module of the given type name.
function M.new(type_name, attrs)
  local m = setmetatable({ type = type_name or "Module", children = {}, child_order = {},
    params = {}, param_order = {}, buffers = {}, buffer_order = {}, attrs = attrs or {} }, Module)
  return m
end

--- Adds (or replaces, keeping its place) a child module; returns the child.
function Module:add(name, child)
  check_name(name, "module")
  if getmetatable(child) ~= Module then fail("add: child '" .. name .. "' is not a module") end
  if not self.children[name] then self.child_order[#self.child_order + 1] = name end
  self.children[name] = child
  return child
end

--- Adds a parameter (a shape and dtype, or a param made with M.param); returns it.
function Module:param(name, shape, dtype, opts)
  check_name(name, "parameter")
  if self.params[name] or (self.buffers and self.buffers[name]) then
    fail("parameter '" .. name .. "' is already registered")
  end
  local p = getmetatable(shape) == Param and shape or M.param(shape, dtype, opts)
  self.params[name] = p
  self.param_order[#self.param_order + 1] = name
  return p
end

--- Adds a buffer: a plain table {shape, dtype, numel, persistent} (persistent: saved in the
-- state dict; default true), never a parameter.  Returns it.  Buffers are tensors a module
-- keeps that are not parameters: no gradient, no optimizer state, never sharded (FSDP2
-- leaves them whole on every rank); they are listed apart (named_buffers) and counted by
-- nobody's param_count, as in PyTorch.
function Module:buffer(name, shape, dtype, opts)
  check_name(name, "buffer")
  if self.buffers[name] or self.params[name] then fail("'" .. name .. "' is already registered") end
  local p = M.param(shape, dtype, { requires_grad = false })
  local b = { shape = p.shape, dtype = p.dtype, numel = p.numel, persistent = not (opts and opts.persistent == false) }
  self.buffers[name] = b
  self.buffer_order[#self.buffer_order + 1] = name
  return b
end

local function join(prefix, name)
  if prefix == "" then return name end
  return prefix .. "." .. name
end
M.join = join

--- Every module in pre-order as a list of {name, module}; the root is "" (or prefix).
function Module:named_modules(prefix)
  local out = {}
  local function walk(m, name)
    out[#out + 1] = { name, m }
    for _, cname in ipairs(m.child_order) do walk(m.children[cname], join(name, cname)) end
  end
  walk(self, prefix or "")
  return out
end

--- Every parameter as a list of {fqn, param, owner_module_name}, in PyTorch's order: a
-- module's own parameters before its children's, and a parameter shared by two modules (tied
-- weights) once, under its first name.
function Module:named_parameters(prefix)
  local out, seen = {}, {}
  for _, nm in ipairs(self:named_modules(prefix)) do
    local mname, m = nm[1], nm[2]
    for _, pname in ipairs(m.param_order) do
      local p = m.params[pname]
      if not seen[p] then
        seen[p] = true
        out[#out + 1] = { join(mname, pname), p, mname }
      end
    end
  end
  return out
end

--- Every buffer as a list of {fqn, buffer, owner_module_name}, in PyTorch's order.
function Module:named_buffers(prefix)
  local out = {}
  for _, nm in ipairs(self:named_modules(prefix)) do
    for _, bname in ipairs(nm[2].buffer_order or {}) do
      out[#out + 1] = { join(nm[1], bname), nm[2].buffers[bname], nm[1] }
    end
  end
  return out
end

--- The module at a dotted name ("" is this module), or nil.
function Module:get(name)
  local m = self
  if name == "" then return m end
  for part in name:gmatch("[^.]+") do
    m = m.children[part]
    if not m then return nil end
  end
  return m
end

--- Total parameter count (shared parameters once), an exact integer.
function Module:param_count()
  local n = 0
  for _, np in ipairs(self:named_parameters()) do n = n + np[2].numel end
  return n
end

--- Total elements of the parameters that take gradients (requires_grad), tied ones once.
function Module:trainable_param_count()
  local n = 0
  for _, np in ipairs(self:named_parameters()) do
    if np[2].requires_grad then n = n + np[2].numel end
  end
  return n
end

--- Total bytes of the parameters in their stored dtypes.
function Module:param_bytes()
  local n = 0
  for _, np in ipairs(self:named_parameters()) do n = n + np[2]:nbytes() end
  return n
end

M.CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"

--- Wraps child `name` of this module in an activation-checkpoint wrapper, as PyTorch's
-- checkpoint_wrapper does: the child's names gain a "_checkpoint_wrapped_module" segment.
function Module:checkpoint_wrap(name)
  local child = self.children[name]
  if not child then fail("checkpoint_wrap: no child '" .. tostring(name) .. "'") end
  local wrapper = M.new("CheckpointWrapper")
  wrapper:add(M.CHECKPOINT_WRAPPED, child)
  self.children[name] = wrapper
  return wrapper
end

--- A name with every "_checkpoint_wrapped_module" segment removed.
function M.strip_checkpoint(name)
  local parts = {}
  for part in name:gmatch("[^.]+") do
    if part ~= M.CHECKPOINT_WRAPPED then parts[#parts + 1] = part end
  end
  return table.concat(parts, ".")
end

function Module:__tostring()
  return string.format("%s(%d children, %d params)", self.type, #self.child_order, #self.param_order)
end

return M
