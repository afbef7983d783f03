-- recipe_units.lua: a plan made with a recipe's fp8 step (torchao's float8 all-gather) made
-- real on every rank: moonshard -n N recipe_units.lua [hsdp]
-- A small Llama-like tree, planned by policies/fsdp2_default.lua with the recipe
-- {fp8 = {enabled, enable_fsdp_float8_all_gather}}, is materialised (moonshard.runtime): the
-- units gather the planned fp8 weights as e4m3, every rank's gathered values equal the whole
-- tensor cast at once (ms.fp8_amax / fp8_scale / fp8_cast / fp8_dequantize, no collective),
-- the other weights as plain bf16; each unit's records hold one amax all-reduce per fp8
-- weight and one all-gather whose bytes are the plan's unsharded bytes (a byte an fp8
-- element).  Prints "recipe_units ok <rank>".
local ms = require "moonshard"
local module = require "moonshard.module"
local policy = require "moonshard.policy"
local R = require "moonshard.recipe"

local hsdp = arg and arg[1] == "hsdp"
local n, rank = ms.world_size(), ms.rank()
local mesh = require("moonshard.mesh_context").new(hsdp and ("dp_replicate=2,dp_shard=" .. math.floor(n / 2)) or
  ("dp_shard=" .. n))

local root = module.new("ToyForCausalLM")
local model = root:add("model", module.new("ToyModel"))
model:add("embed_tokens", module.new("Embedding")):param("weight", { 64, 32 }, "bf16")
local layers = model:add("layers", module.new("ModuleList"))
for i = 0, 1 do
  local layer = layers:add(tostring(i), module.new("ToyDecoderLayer"))
  local attn = layer:add("self_attn", module.new("ToyAttention"))
  attn:add("q_proj", module.new("Linear")):param("weight", { 32, 32 }, "bf16")
  attn:add("k_proj", module.new("Linear")):param("weight", { 8, 32 }, "bf16") -- 8 rows: not fp8
  local mlp = layer:add("mlp", module.new("ToyMLP"))
  mlp:add("up_proj", module.new("Linear")):param("weight", { 48, 32 }, "bf16")
  mlp:add("down_proj", module.new("Linear")):param("weight", { 32, 48 }, "bf16")
  layer:add("input_layernorm", module.new("RMSNorm")):param("weight", { 32 }, "bf16")
end
model:add("norm", module.new("RMSNorm")):param("weight", { 32 }, "bf16")
root:add("lm_head", module.new("Linear")):param("weight", { 64, 32 }, "bf16")

local recipe = R.check({ fp8 = { enabled = true, enable_fsdp_float8_all_gather = true, filter_fqns = { "lm_head" } } },
  "recipe_units")
local path = "policies/fsdp2_default.lua"
local entry = policy.entry_point(policy.load(path, { modules = policy.host_modules() }), path)
local plan = require("moonshard.plan").plan(root, mesh, entry, { recipe = recipe, policy_name = path })
local state = require("moonshard.runtime").materialize(plan)

-- deterministic values over many binades, the same on every rank
local function full_of(shape, seed)
  local count = 1
  for _, d in ipairs(shape) do count = count * d end
  local v = {}
  for k = 1, count do
    local m = ((k * 37 + seed * 11) % 19) - 9
    v[k] = m * 2 ^ (((k * 5 + seed) % 13) - 6)
  end
  return ms.from_table(v, "bf16", shape)
end

local bad, fp8_seen = 0, 0
for ui, pu in ipairs(plan.units) do
  local u = state.by_name[pu.name]
  assert(u, "no runtime unit " .. pu.name)
  local fulls, fp8 = {}, 0
  for i, e in ipairs(pu.entries) do
    fulls[i] = full_of(e.shape, ui * 10 + i)
    u:load_full(i - 1, fulls[i])
    if e.param.fp8_gather then fp8 = fp8 + 1 end
  end
  u:clear_records()
  u:unshard():wait()
  for i, e in ipairs(pu.entries) do
    local want
    if e.param.fp8_gather then
      local scale = ms.fp8_scale(ms.fp8_amax(fulls[i]))
      want = ms.fp8_dequantize(ms.fp8_cast(fulls[i], { scale = scale }), scale, "bf16")
    else
      want = fulls[i]
    end
    local g, w = u:param_full(i - 1):bits(), want:bits()
    assert(#g == #w, e.fqn)
    for k = 1, #w do
      if g[k] ~= w[k] then
        bad = bad + 1
        if bad < 5 then print(string.format("rank %d %s[%d]: got 0x%04x, want 0x%04x", rank, e.fqn, k, g[k], w[k])) end
      end
    end
  end
  -- the records against the plan: an amax all-reduce per fp8 weight and group, then one
  -- all-gather of the unit's unsharded bytes
  local ar, ag = 0, nil
  for _, r in ipairs(u:records()) do
    if r.kind == "all_reduce" then ar = ar + 1 end
    if r.kind == "all_gather" then ag = r end
  end
  local groups = hsdp and 2 or 1
  if pu.shard_size > 1 then
    assert(ar == fp8 * groups, string.format("%s: %d amax all-reduces, planned %d", pu.name, ar, fp8 * groups))
    assert(ag and ag.bytes == pu.unsharded_bytes, string.format("%s: all-gather of %s bytes, planned %d", pu.name,
      ag and ag.bytes or "no", pu.unsharded_bytes))
    assert(fp8 == 0 or ag.dtype == "u8", pu.name .. ": the fp8 gather moves bytes")
  end
  fp8_seen = fp8_seen + fp8
  u:reshard()
end
assert(bad == 0, bad .. " gathered values differ")
assert(fp8_seen == 6, "fp8 weights: " .. fp8_seen)
print("recipe_units ok " .. rank)
