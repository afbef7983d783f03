-- ckpt_export_experts.lua: the tiny Qwen3-MoE Hugging Face checkpoint loaded into a plan's
-- units (checkpoint_hf.load_hf), exported with per-expert names (checkpoint.export_hf
-- {expert_names = true, dtype = "bf16"}), then loaded again into fresh units from the export.
--
--   moonshard -n N ckpt_export_experts.lua MESH OUT
--
-- Prints per rank "rank R: round trip P params, D differing elements" (every shard of the
-- second load against the first, bit for bit), and on rank 0 "export: T tensors, S same
-- bytes as the original, names equal true|false" (every tensor of the export against the
-- original checkpoint's bytes, read in plain Lua).
local ms = require "moonshard"
local json = require "moonshard.json"
local st = require "moonshard.safetensors"
local ckpt = require "moonshard.checkpoint"
local hf = require "moonshard.checkpoint_hf"

local QWEN = "tests/reference/data/hf_checkpoints/qwen3_moe_tiny"
local mesh_spec, out = arg[1], arg[2]
local f = assert(io.open(QWEN .. "/config.json"))
local config = json.decode(f:read("a"))
f:close()
local tree = require("moonshard.models").from_config(config, QWEN .. "/config.json")
local policy = require("moonshard.policy")
local path = "policies/fsdp2_default.lua"
local loaded = policy.load(path, { modules = policy.host_modules() })
local plan = require("moonshard.plan").plan(tree, require("moonshard.mesh_context").new(mesh_spec),
  policy.entry_point(loaded, path))

local a = require("moonshard.runtime").materialize(plan)
hf.load_hf(a, QWEN)
ckpt.export_hf(a, out, { expert_names = true, dtype = "bf16", max_shard_size = "8KB" })
local b = require("moonshard.runtime").materialize(plan)
hf.load_hf(b, out) -- strict: every name of the export must be one the plan takes

local params, diff = 0, 0
for k, u in ipairs(a.units) do
  local v = b.units[k]
  for i = 0, u:count() - 1 do
    local x, y = u:param_shard(i):bits(), v:param_shard(i):bits()
    params = params + 1
    if #x ~= #y then diff = diff + math.max(#x, #y) end
    for j = 1, #x do if x[j] ~= y[j] then diff = diff + 1 end end
  end
end
print(string.format("rank %d: round trip %d params, %d differing elements", ms.rank(), params, diff))

if ms.rank() == 0 then
  local function tensors(p)
    local list = p:match("%.json$") and st.read_index(p) or st.read_header(p)
    local by = {}
    for _, t in ipairs(list) do by[t.name] = t end
    return by
  end
  local function bytes(t)
    local fh = assert(io.open(t.file, "rb"))
    local h = fh:read(8)
    local n = 0
    for i = 8, 1, -1 do n = n * 256 + h:byte(i) end
    fh:seek("set", 8 + n + t.data_offsets[1])
    local s = fh:read(t.data_offsets[2] - t.data_offsets[1])
    fh:close()
    return s
  end
  local orig = tensors(QWEN .. "/model.safetensors.index.json")
  local mine = tensors(out .. "/model.safetensors.index.json")
  local count, same, names = 0, 0, true
  for name, t in pairs(orig) do
    local m = mine[name]
    if not m then
      names = false
      print("missing in the export: " .. name)
    elseif bytes(m) == bytes(t) and m.dtype == t.dtype then
      same = same + 1
    else
      print("differs: " .. name)
    end
  end
  for name in pairs(mine) do
    count = count + 1
    if not orig[name] then
      names = false
      print("not in the original: " .. name)
    end
  end
  print(string.format("export: %d tensors, %d same bytes as the original, names equal %s", count, same, tostring(names)))
end
