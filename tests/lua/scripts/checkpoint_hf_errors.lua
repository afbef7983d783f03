-- checkpoint_hf_errors.lua: load_hf against altered copies of a checkpoint's header (tensors
-- dropped, added, reshaped; data zeros), printing each error, and checking that nothing was
-- written into a unit before the error (moonshard -n 2 checkpoint_hf_errors.lua CONFIG CKPT OUTDIR
-- CASE...), CASE: "drop:NAME", "add:NAME:D0xD1", "shape:NAME:D0xD1", joined by "+".
local ms = require "moonshard"
local json = require "moonshard.json"
local st = require "moonshard.safetensors"
local hf = require "moonshard.checkpoint_hf"

local config_path, ckpt, outdir = arg[1], arg[2], arg[3]
local f = assert(io.open(config_path))
local config = json.decode(f:read("a"))
f:close()
local tree = require("moonshard.models").from_config(config, config_path)
local mesh = require("moonshard.mesh_context").new("dp_shard=" .. ms.world_size())
local policy = require("moonshard.policy")
local loaded = policy.load("policies/fsdp2_default.lua", { modules = policy.host_modules() })
local plan = require("moonshard.plan").plan(tree, mesh, policy.entry_point(loaded, "policies/fsdp2_default.lua"))
local state = require("moonshard.runtime").materialize(plan)
for _, u in ipairs(state.units) do
  for i = 0, u:count() - 1 do u:param_shard(i):fill_(7) end
end

local list = ckpt:match("%.json$") and st.read_index(ckpt) or st.read_header(ckpt)
local SIZE = { f32 = 4, bf16 = 2 }
local ST = { f32 = "F32", bf16 = "BF16" }

local function write(path, tensors)
  local header, off = {}, 0
  for _, t in ipairs(tensors) do
    local n = SIZE[t.dtype]
    for _, s in ipairs(t.shape) do n = n * s end
    header[#header + 1] = string.format('"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', t.name, ST[t.dtype],
      table.concat(t.shape, ","), off, off + n)
    off = off + n
  end
  local h = "{" .. table.concat(header, ",") .. "}"
  local len = #h
  local bytes = {}
  for i = 1, 8 do bytes[i] = string.char(len % 256) len = math.floor(len / 256) end
  local out = assert(io.open(path, "wb"))
  out:write(table.concat(bytes), h, string.rep("\0", off))
  out:close()
end

local function dims(s)
  local out = {}
  for d in s:gmatch("%d+") do out[#out + 1] = tonumber(d) end
  return out
end

for c = 4, #arg do
  local tensors = {}
  for _, t in ipairs(list) do tensors[#tensors + 1] = { name = t.name, dtype = t.dtype, shape = t.shape } end
  for change in arg[c]:gmatch("[^+]+") do
    local kind, name, shape = change:match("^(%a+):([^:]+):?(.*)$")
    if kind == "drop" then
      for i, t in ipairs(tensors) do if t.name == name then table.remove(tensors, i) break end end
    elseif kind == "add" then
      tensors[#tensors + 1] = { name = name, dtype = list[1].dtype, shape = dims(shape) }
    elseif kind == "shape" then
      for _, t in ipairs(tensors) do if t.name == name then t.shape = dims(shape) end end
    end
  end
  local path = string.format("%s/case%d_rank%d.safetensors", outdir, c - 3, ms.rank())
  write(path, tensors)
  local ok, err = pcall(hf.load_hf, state, path)
  os.remove(path)
  if ms.rank() == 0 then print("case " .. (c - 3) .. ": " .. (ok and "loaded" or err)) end
end
local untouched = true
for _, u in ipairs(state.units) do
  for i = 0, u:count() - 1 do
    for _, v in ipairs(u:param_shard(i):totable()) do if v ~= 7 then untouched = false end end
  end
end
print(string.format("rank %d: units untouched %s", ms.rank(), tostring(untouched)))
