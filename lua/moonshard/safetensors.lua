-- moonshard.safetensors: the names, dtypes and shapes of a checkpoint, read from safetensors
-- headers without reading tensor data, and the module tree they describe.
--
-- A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON
-- ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then
-- the data area.  Headers are checked as the reference implementation (the safetensors
-- package) checks them, so that a plan made from a header describes a file that a loader
-- will accept: offsets contiguous from 0, no holes, no overlaps, the data area covered
-- exactly, integer shapes and offsets, no element or byte count that overflows (here: past
-- 2^53).  Like it, moonshard takes whitespace before the header's '{', ignores keys of an
-- entry other than dtype, shape and data_offsets, and reads "__metadata__": null as none;
-- unlike it, a key twice in one object is refused (the reference keeps the last).  Sharded checkpoints
-- come with a model.safetensors.index.json whose weight_map must agree with the shards.

local json = require "moonshard.json"
local module = require "moonshard.module"
local util = require "moonshard.util"

local M = {}

local format = string.format

--- Headers longer than this (100 MiB) are refused: real ones are far smaller (a shard of
-- DeepSeek-V3 holds some 1,000 tensors in about 100 KiB of header), and a corrupt length must
-- not make moonshard read a whole checkpoint as JSON.  The 8-byte length is read as a float,
-- so no length wraps; a header must also end within the file.  Numbers in a header are
-- integers from 0 to 2^53 (json's counts mode), and shapes past 2^53 bytes are refused.
M.MAX_HEADER = 100 * 1024 * 1024

--- safetensors dtype -> {moonshard dtype, bytes per element}; the dtypes moonshard reads.
M.dtypes = {
  F64 = { "f64", 8 }, F32 = { "f32", 4 }, F16 = { "f16", 2 }, BF16 = { "bf16", 2 },
  F8_E4M3 = { "f8e4m3", 1 }, F8_E5M2 = { "f8e5m2", 1 },
  I64 = { "i64", 8 }, I32 = { "i32", 4 }, I8 = { "i8", 1 }, U8 = { "u8", 1 }, BOOL = { "bool", 1 },
}

local supported = {}
for name in pairs(M.dtypes) do supported[#supported + 1] = name end
table.sort(supported)
supported = table.concat(supported, " ")

local function fail(path, fmt, ...)
  error("moonshard: safetensors: " .. path .. ": " .. format(fmt, ...), 0)
end

local function is_object(v)
  return type(v) == "table" and v ~= json.null and getmetatable(v) ~= json.array_mt
end

local function is_array(v) return getmetatable(v) == json.array_mt end

local function is_count(v) return type(v) == "number" and v >= 0 and v == math.floor(v) end

local sorted_keys = util.sorted_keys
local show_name = util.short_name -- tensor names in errors: at most 80 bytes, no control bytes

local function show_list(a)
  local parts = {}
  for i, v in ipairs(a) do parts[i] = json.encode(v) end
  return "[" .. table.concat(parts, ", ") .. "]"
end

-- Reads the 8-byte little-endian length and the JSON header of an open file.
local function read_json_header(f, path)
  local size = f:seek("end")
  f:seek("set", 0)
  local head, rerr = f:read(8)
  if not head and rerr then fail(path, "cannot read: %s", rerr) end -- a directory opens
  if not head or #head < 8 then
    fail(path, "file is %d bytes, too short for the 8-byte header length", size)
  end
  -- Summed as a float: a corrupt length can exceed 2^63, where 5.4 integers would wrap.
  local n = 0.0
  for i = 8, 1, -1 do n = n * 256 + head:byte(i) end
  if n > M.MAX_HEADER then
    fail(path, "header length %.0f exceeds the %d-byte limit (not a safetensors file?)", n, M.MAX_HEADER)
  end
  n = math.floor(n)
  if 8 + n > size then
    fail(path, "header length %d goes beyond the end of the file (%d bytes)", n, size)
  end
  local text = n > 0 and f:read(n) or ""
  if not text:find("^[ \t\r\n]*{") then
    fail(path, "the header does not start with '{' (not a safetensors file?)")
  end
  return json.decode(text, path .. " header", { counts = true }), size - 8 - n, 8 + n
end

local MAX_COUNT = module.MAX_COUNT -- 2^53: counts past it are not exact in a double

local function check_metadata(path, meta)
  if meta == json.null then return {} end
  if not is_object(meta) then fail(path, "__metadata__ is not an object of strings") end
  for k, v in pairs(meta) do
    if type(v) ~= "string" then
      fail(path, "__metadata__[\"%s\"] is %s; metadata values are strings", show_name(k), show_name(json.encode(v)))
    end
  end
  return meta
end

-- Validates one header entry; returns {name, dtype, shape, data_offsets, file}.
local function check_entry(path, name, e, data_size)
  local function bad(fmt, ...) fail(path, "tensor '%s': " .. fmt, show_name(name), ...) end
  if not is_object(e) then bad("entry is not an object {dtype, shape, data_offsets}") end
  if type(e.dtype) ~= "string" then bad("dtype is missing or not a string") end
  local dt = M.dtypes[e.dtype]
  if not dt then bad("dtype '%s' is not supported (supported: %s)", e.dtype, supported) end
  if not is_array(e.shape) then bad("shape is missing or not an array") end
  local numel = 1
  for i, s in ipairs(e.shape) do
    if not is_count(s) then bad("shape[%d] is %s; sizes are integers >= 0", i - 1, json.encode(s)) end
    if s > 0 and numel > MAX_COUNT / s / dt[2] then
      bad("shape %s of %s is more than 2^53 bytes", show_list(e.shape), e.dtype)
    end
    numel = numel * s
  end
  local off = e.data_offsets
  if not is_array(off) or #off ~= 2 or not is_count(off[1]) or not is_count(off[2]) or off[1] > off[2] then
    bad("data_offsets must be [begin, end] with 0 <= begin <= end, got %s",
      off == nil and "nothing" or json.encode(off))
  end
  if off[2] - off[1] ~= numel * dt[2] then
    bad("data_offsets %s hold %d bytes but shape %s of %s needs %d", show_list(off), off[2] - off[1],
      show_list(e.shape), e.dtype, numel * dt[2])
  end
  if off[2] > data_size then
    bad("data_offsets %s go beyond the data area (%d bytes)", show_list(off), data_size)
  end
  return { name = name, dtype = dt[1], shape = e.shape, data_offsets = off, file = path }
end

local function by_offset(a, b)
  local x, y = a.data_offsets, b.data_offsets
  if x[1] ~= y[1] then return x[1] < y[1] end
  if x[2] ~= y[2] then return x[2] < y[2] end
  return a.name < b.name
end

-- The tensors, sorted by offset, must tile the data area: each starts where the previous
-- ended, the first at 0, the last at the end.
local function check_tiling(path, tensors, data_size)
  local cursor, prev = 0, nil
  for _, t in ipairs(tensors) do
    local b = t.data_offsets[1]
    if b < cursor then
      fail(path, "tensors '%s' %s and '%s' %s overlap", show_name(prev.name), show_list(prev.data_offsets),
        show_name(t.name), show_list(t.data_offsets))
    elseif b > cursor then
      fail(path, "bytes [%d, %d) of the data area belong to no tensor (a hole before '%s')",
        cursor, b, show_name(t.name))
    end
    cursor, prev = t.data_offsets[2], t
  end
  if cursor ~= data_size then
    fail(path, "bytes [%d, %d) of the data area belong to no tensor (after the last one)",
      cursor, data_size)
  end
end

--- read_header(path) -> tensors, metadata.  tensors: a list of {name, dtype (moonshard's
-- name), shape, data_offsets, file, data_start (the file's byte where the data area begins:
-- 8 + the header's length; data_offsets count from it)} sorted by data offset; metadata: the
-- __metadata__ map (empty when absent).  No tensor data is read.
function M.read_header(path)
  -- a FIFO would block the open, /dev/zero would pass for an empty file
  local regular, why = util.check_regular(path)
  if not regular then fail(path, "cannot read: %s", why) end
  local f, err = io.open(path, "rb")
  if not f then fail(path, "cannot open: %s", util.io_reason(path, err)) end
  local ok, header, data_size, data_start = pcall(read_json_header, f, path)
  f:close()
  if not ok then error(header, 0) end
  local tensors, metadata = {}, {}
  for _, name in ipairs(sorted_keys(header)) do
    if name == "__metadata__" then
      metadata = check_metadata(path, header[name])
    else
      local t = check_entry(path, name, header[name], data_size)
      t.data_start = data_start
      tensors[#tensors + 1] = t
    end
  end
  table.sort(tensors, by_offset)
  check_tiling(path, tensors, data_size)
  return tensors, metadata
end

local function read_file(path)
  local text, err, opened = util.read_file(path, "json")
  if not text then
    fail(path, opened and "cannot read: %s" or "cannot open: %s", opened and err or util.io_reason(path, err))
  end
  return text
end

--- read_index(path) -> tensors, metadata for a model.safetensors.index.json: the headers of
-- every shard its weight_map names (paths relative to the index), merged shard by shard (in
-- file name order) and each in data-offset order; metadata is the index's "metadata" object.
-- weight_map and the shards must agree exactly.
function M.read_index(path)
  local index = json.decode(read_file(path), path)
  if not is_object(index) or not is_object(index.weight_map) then
    fail(path, "not a safetensors index: expected an object with a \"weight_map\" object")
  end
  local weight_map = index.weight_map
  local dir = path:match("^(.*)/[^/]*$") or "."
  local names, first_name, files = sorted_keys(weight_map), {}, {}
  for _, name in ipairs(names) do
    local file = weight_map[name]
    if type(file) ~= "string" or file == "" then
      fail(path, "weight_map[\"%s\"] is %s, not a shard file name", show_name(name), show_name(json.encode(file)))
    end
    if not first_name[file] then first_name[file], files[#files + 1] = name, file end
  end
  table.sort(files)
  local all, held = {}, {}
  for _, file in ipairs(files) do
    local shard = dir .. "/" .. file
    local regular, why = util.check_regular(shard)
    local f, err
    if regular then f, err = io.open(shard, "rb") end
    if not f then
      fail(path, "weight_map puts '%s' in shard '%s', which cannot be opened: %s", show_name(first_name[file]),
        show_name(file), why or util.io_reason(shard, err))
    end
    f:close()
    for _, t in ipairs((M.read_header(shard))) do
      local listed = weight_map[t.name]
      if listed == nil then
        fail(path, "shard '%s' holds tensor '%s', which weight_map does not list", show_name(file), show_name(t.name))
      elseif listed ~= file then
        fail(path, "weight_map puts tensor '%s' in '%s', but shard '%s' holds it", show_name(t.name), show_name(listed),
          show_name(file))
      end
      held[t.name] = true
      all[#all + 1] = t
    end
  end
  for _, name in ipairs(names) do
    if not held[name] then
      fail(path, "weight_map puts tensor '%s' in shard '%s', which has no such tensor", show_name(name),
        show_name(weight_map[name]))
    end
  end
  local metadata = index.metadata
  if metadata == json.null then metadata = nil end
  if metadata ~= nil and not is_object(metadata) then fail(path, "\"metadata\" is not an object") end
  return all, metadata or {}
end

local function is_index(name) return tostring(name):match("%.json$") ~= nil end

-- Automodel's grouped experts as a checkpoint stores them: a module named "experts" (name:
-- its own, the last part of its dotted name) that holds parameters and no modules, every
-- parameter at least 2-D with the same dim 0 (the expert count), as gate_and_up_projs
-- [E, H, 2I] and down_projs [E, I, H] are.
local function is_grouped_experts(name, m)
  if name ~= "experts" or #m.child_order > 0 or #m.param_order == 0 then
    return false
  end
  local experts
  for _, pname in ipairs(m.param_order) do
    local shape = m.params[pname].shape
    if #shape < 2 or (experts and shape[1] ~= experts) then return false end
    experts = shape[1]
  end
  return true
end

--- Tensor names (the last segment) that models keep as buffers, not parameters: planned as
-- buffers (no gradient, no optimizer state, whole on every rank), as the config builders make
-- them.  e_score_correction_bias only shifts the router's top-k choice (DeepSeek-V3, f32 in a
-- bf16 checkpoint; a buffer in Automodel's Gate and in transformers' DeepSeek-V3 router).
M.BUFFERS = { e_score_correction_bias = true }

--- tree(tensors, source?) -> a module tree with one parameter per tensor, modules following
-- the dotted names.  Children come in the order the tensors first name them, except that
-- a module whose children are all integers is a "ModuleList" with them in numeric order
-- (data-offset order is name order, which puts "10" before "2").  A module named "experts"
-- holding only parameters of at least two dims with one dim 0 is "GroupedExperts" (Automodel's
-- grouped layout, which expert parallelism splits on dim 0).  Other modules: "Module".
-- Tensors named in M.BUFFERS are buffers; integer ones are frozen parameters, as in PyTorch.
-- Every parameter records its checkpoint_dtype (the dtype on disk), which Automodel's
-- fully_shard_by_dtype computes it in (model_init.py records it as _hf_compute_dtype).
-- opts.host: the tensors are a host's parameters (the embedding API), not a checkpoint's:
-- every one is a parameter, and none records a checkpoint dtype.
function M.tree(tensors, source, opts)
  local host = opts and opts.host
  local root = module.new("Module", { source = source })
  source = source or "tensors"
  local find, sub = string.find, string.sub
  for _, t in ipairs(tensors) do
    local name = t.name
    local why = module.name_limit_error(name)
    if why then fail(source, "tensor name '%s' %s", show_name(name), why) end
    -- one part at a time: no prefix string is made unless an error names it
    local m, pos = root, 1
    while true do
      local dot = find(name, ".", pos, true)
      local part = sub(name, pos, (dot or #name + 1) - 1)
      if part == "" then fail(source, "tensor name '%s' has an empty segment", show_name(name)) end
      local clash = dot and (m.params[part] or m.buffers[part]) or (not dot and m.children[part])
      if clash then
        fail(source, "'%s' is both a parameter and a module (tensor '%s')",
          show_name(sub(name, 1, (dot or #name + 1) - 1)), show_name(name))
      end
      if not dot then
        if host then
          m:param(part, t.shape, t.dtype)
        elseif M.BUFFERS[part] then
          m:buffer(part, t.shape, t.dtype).checkpoint_dtype = t.dtype
        else
          m:param(part, t.shape, t.dtype).checkpoint_dtype = t.dtype
        end
        break
      end
      m = m.children[part] or m:add(part, module.new("Module"))
      pos = dot + 1
    end
  end
  -- every module once, by its own name (no full names: a walk with a stack, not recursion)
  local stack = { root, "" }
  while #stack > 0 do
    local cname = table.remove(stack)
    local m = table.remove(stack)
    local all_ints = #m.child_order > 0
    for _, c in ipairs(m.child_order) do all_ints = all_ints and c:match("^%d+$") ~= nil end
    if all_ints then
      m.type = "ModuleList"
      table.sort(m.child_order, function(a, b) return tonumber(a) < tonumber(b) end)
    elseif is_grouped_experts(cname, m) then
      m.type = "GroupedExperts"
    end
    for _, c in ipairs(m.child_order) do
      stack[#stack + 1] = m.children[c]
      stack[#stack + 1] = c
    end
  end
  return root
end

--- tree_from_safetensors(path) -> the module tree of a .safetensors file, or of a sharded
-- checkpoint when path is its .index.json; dtypes and shapes exactly as on disk.
function M.tree_from_safetensors(path)
  local tensors, metadata
  if is_index(path) then tensors, metadata = M.read_index(path)
  else tensors, metadata = M.read_header(path) end
  local root = M.tree(tensors, path)
  root.attrs.metadata = metadata
  return root
end

return M
