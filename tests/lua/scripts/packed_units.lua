-- packed_units.lua: a packed unit against separate units, on every rank:
--   moonshard -n N tests/lua/scripts/packed_units.lua [hsdp] [bf16reduce] [reshard2] [offload]
--   (or mpirun -np N moonshard tests/lua/scripts/packed_units.lua ...)
-- One inkling2-shaped layer (a large bf16 weight block, a bf16 norm, and five small fp32
-- "islands": two residual queries, two L2-clip scales and the router gate with its frozen
-- correction bias) is held twice: as the seed's plan makes it (every island a unit of its
-- own with the fp32 policy, then the layer with the compute policy: bf16 gather, f32
-- reduce) and as one packed unit holding all of it, each island parameter with the fp32
-- policy (ms_unit_set_packed, ms_unit_set_param_policy).  Both start from the same values
-- and take the same three steps: unshard, gradients written from the gathered values (rank-
-- and step-dependent, inexact: the reduction rounds), a second backward with gradient sync
-- off on step 2 (the accumulator), reduce, a fixed gradient scale, AdamW (f32 master
-- weights for the bf16 weights).  Checked on every rank:
--   - every parameter's gathered values, gradient shard, AdamW moments and master weights,
--     and its shard after each step, bit for bit equal between the two;
--   - each parameter's dtypes (stored, gather, reduce) equal to those of its separate unit;
--   - the packed unit's collectives: one all-gather of u8 bytes (the sum of the separate
--     units' gather bytes) and one reduce-scatter per reduce dtype (one with the f32 reduce;
--     two with bf16reduce, where the layer reduces in bf16 and the islands in f32), against
--     one all-gather and one reduce-scatter per separate unit;
--   - the bytes each category holds: the same sums.
-- offload: every unit with CPU offload (on the nccl backend its shards, gradients and AdamW
-- state on the host, the collectives on the GPU; on threads and MPI nothing changes).
-- Prints "packed_units ok <rank> collectives <packed>/<separate> checksum <hex>".
local ms = require "moonshard"

local opts = {}
for _, a in ipairs(arg or {}) do opts[a] = true end
local n, rank = ms.world_size(), ms.rank()
local hsdp = opts.hsdp
local mesh = hsdp and ms.mesh({ { "dp_replicate", 2 }, { "dp_shard", math.floor(n / 2) } }) or ms.mesh({ { "dp_shard", n } })
local shard = mesh:group("dp_shard")
local replicate = hsdp and mesh:group("dp_replicate") or nil
local reshard = opts.reshard2 and 2 or true

local COMPUTE = { "bf16", opts.bf16reduce and "bf16" or "f32" }
local FP32 = { "f32", "f32" }
-- fqn, shape, stored dtype, island (nil: the layer's), frozen
local PARAMS = {
  { "layer.attn_query.query", { 16 }, "f32", "attn_query" },
  { "layer.qkvr.weight", { 52, 16 }, "bf16" },
  { "layer.q_l2_clip.scale", { 24 }, "f32", "q_l2_clip" },
  { "layer.rel_l2_clip.scale", { 22 }, "f32", "rel_l2_clip" },
  { "layer.mlp_query.query", { 16 }, "f32", "mlp_query" },
  { "layer.mlp_norm.weight", { 16 }, "bf16" },
  { "layer.gate.weight", { 7, 16 }, "f32", "gate" },
  { "layer.gate.e_score_correction_bias", { 7 }, "f32", "gate", true },
  { "layer.down.weight", { 16, 30 }, "bf16" },
}

local function numel(shape)
  local c = 1
  for _, d in ipairs(shape) do c = c * d end
  return c
end

-- deterministic values over several binades, the same on every rank
local function initial(k, shape, dtype)
  local v = {}
  for i = 1, numel(shape) do v[i] = (((i * 37 + k * 11) % 19) - 9) * 2 ^ (((i * 5 + k) % 9) - 6) / 7 end
  return ms.from_table(v, dtype, shape)
end

-- The separate plan: the islands in the order they come (each island's parameters), then
-- the layer; entry k of PARAMS -> {unit, index}.
local separate, where_sep = {}, {}
do
  local by_island, order = {}, {}
  for k, p in ipairs(PARAMS) do
    local key = p[4] or "<layer>"
    if not by_island[key] then
      by_island[key] = {}
      if p[4] then order[#order + 1] = key end
    end
    table.insert(by_island[key], k)
  end
  order[#order + 1] = "<layer>"
  for _, key in ipairs(order) do
    local pol = key == "<layer>" and COMPUTE or FP32
    local u = ms.unit(key == "<layer>" and "layer" or "layer." .. key, shard, replicate, pol[1], pol[2], reshard)
    if opts.offload then u:set_cpu_offload(true) end
    for _, k in ipairs(by_island[key]) do
      local p = PARAMS[k]
      where_sep[k] = { u, u:add_param(p[1], p[2], p[3], 0, not p[5]) }
    end
    u:finalize()
    separate[#separate + 1] = u
  end
end

-- The packed unit: every parameter in PARAMS order, the islands' with the fp32 policy.
local packed = ms.unit("layer", shard, replicate, COMPUTE[1], COMPUTE[2], reshard):set_packed(true)
if opts.offload then packed:set_cpu_offload(true) end
local where_pk = {}
for k, p in ipairs(PARAMS) do
  local i = packed:add_param(p[1], p[2], p[3], 0, not p[5])
  if p[4] then packed:set_param_policy(i, FP32[1], FP32[2]) end
  where_pk[k] = { packed, i }
end
packed:finalize()

local wrong = {}
local function check(cond, what) if not cond then wrong[#wrong + 1] = what end end
local function same_bits(a, b, what)
  if a == nil or b == nil then
    check(a == nil and b == nil, what .. ": one is missing")
    return
  end
  local x, y = a:bits(), b:bits()
  check(#x == #y, what .. ": sizes differ")
  for i = 1, #x do
    if x[i] ~= y[i] then
      check(false, string.format("%s: element %d differs (%s vs %s)", what, i - 1, tostring(x[i]), tostring(y[i])))
      return
    end
  end
end

for k, p in ipairs(PARAMS) do
  local full = initial(k, p[2], p[3])
  where_sep[k][1]:load_full(where_sep[k][2], full)
  where_pk[k][1]:load_full(where_pk[k][2], full)
  local a, b = where_sep[k][1]:param_dtypes(where_sep[k][2]), where_pk[k][1]:param_dtypes(where_pk[k][2])
  for _, f in ipairs({ "stored", "gather", "reduce", "requires_grad" }) do
    check(a[f] == b[f], string.format("%s: %s %s separate, %s packed", p[1], f, tostring(a[f]), tostring(b[f])))
  end
end
-- the layer's bf16 weights gather in bf16, the islands in f32: one unit of two gather dtypes
check(packed:param_dtypes(1).gather == "bf16" and packed:param_dtypes(0).gather == "f32", "packed gather dtypes")

-- A rank- and step-dependent gradient of the gathered values: inexact, so the sums round.
local function write_grads(units, where, step, micro)
  for k, p in ipairs(PARAMS) do
    if not p[5] then
      local u, i = where[k][1], where[k][2]
      local full = u:param_full(i):totable()
      local g = {}
      local flat = {}
      local function walk(t) for _, x in ipairs(t) do if type(x) == "table" then walk(x) else flat[#flat + 1] = x end end end
      walk(type(full) == "table" and full or { full })
      for j, x in ipairs(flat) do g[j] = x * (rank + 1.37) / 3 + ((j * 7 + k + step + micro) % 11) / 13 end
      u:grad_full(i):copy_(ms.from_table(g, "f64", p[2]))
    end
  end
  (function() end)(units)
end

local function one_step(units, where, step)
  for _, u in ipairs(units) do u:unshard():wait() end
  local micros = step == 2 and 2 or 1
  for m = 1, micros do
    if m > 1 then for _, u in ipairs(units) do u:unshard():wait() end end
    write_grads(units, where, step, m)
    for _, u in ipairs(units) do
      u:set_requires_gradient_sync(m == micros)
      u:reduce_grads():wait()
    end
  end
  for _, u in ipairs(units) do
    u:scale_grads(0.8125)
    u:adamw_step { lr = 1e-2, step = step, weight_decay = 0.01 }
  end
end

local gathered_checked = false
for step = 1, 3 do
  for _, u in ipairs(separate) do u:clear_records() end
  packed:clear_records()
  one_step(separate, where_sep, step)
  one_step(packed and { packed }, where_pk, step)
  if not gathered_checked then
    -- the gathered values of the next step's unshard, bit for bit
    for _, u in ipairs(separate) do u:unshard():wait() end
    packed:unshard():wait()
    for k, p in ipairs(PARAMS) do
      same_bits(where_sep[k][1]:param_full(where_sep[k][2]), where_pk[k][1]:param_full(where_pk[k][2]),
        p[1] .. " gathered")
    end
    for _, u in ipairs(separate) do u:reshard() end
    packed:reshard()
    gathered_checked = true
  end
  for k, p in ipairs(PARAMS) do
    local us, is, up, ip = where_sep[k][1], where_sep[k][2], where_pk[k][1], where_pk[k][2]
    local tag = string.format("%s step %d", p[1], step)
    same_bits(us:param_shard(is), up:param_shard(ip), tag .. " shard")
    same_bits(us:grad_shard(is), up:grad_shard(ip), tag .. " gradient")
    for _, which in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
      same_bits(us:adamw_state(is, which), up:adamw_state(ip, which), tag .. " " .. which)
    end
  end
end

-- the last step's collectives: one all-gather (bytes) and one reduce-scatter per reduce dtype
local function tally(units)
  local t = { all_gather = 0, reduce_scatter = 0, all_reduce = 0, ag_bytes = 0, rs_bytes = 0, dtypes = {} }
  for _, u in ipairs(units) do
    for _, r in ipairs(u:records()) do
      t[r.kind] = t[r.kind] + 1
      if r.kind == "all_gather" then t.ag_bytes = t.ag_bytes + r.bytes end
      if r.kind == "reduce_scatter" then
        t.rs_bytes = t.rs_bytes + r.bytes
        t.dtypes[r.dtype] = true
      end
    end
  end
  return t
end
local ts, tp = tally(separate), tally({ packed })
local reduce_dtypes = opts.bf16reduce and 2 or 1
check(tp.all_gather == 1, "packed all_gathers " .. tp.all_gather)
check(tp.reduce_scatter == reduce_dtypes, "packed reduce_scatters " .. tp.reduce_scatter)
check(tp.all_reduce == (hsdp and reduce_dtypes or 0), "packed all_reduces " .. tp.all_reduce)
check(ts.all_gather == #separate and ts.reduce_scatter == #separate, "separate collectives")
check(tp.ag_bytes == ts.ag_bytes, string.format("all-gather bytes %d packed, %d separate", tp.ag_bytes, ts.ag_bytes))
check(tp.rs_bytes == ts.rs_bytes, string.format("reduce-scatter bytes %d packed, %d separate", tp.rs_bytes, ts.rs_bytes))
check(packed:records()[1].dtype == "u8", "the packed all-gather moves bytes")
-- what each rank holds: the same bytes in every category
local function held(units)
  local t = { params = 0, grads = 0, optimizer = 0 }
  for _, u in ipairs(units) do
    local b = u:bytes()
    for c in pairs(t) do t[c] = t[c] + b[c] end
  end
  return t
end
local hs, hp = held(separate), held({ packed })
for _, c in ipairs({ "params", "grads", "optimizer" }) do
  check(hs[c] == hp[c], string.format("%s bytes %d separate, %d packed", c, hs[c], hp[c]))
end

-- misuse is refused by name
local ok, err = pcall(function() packed:set_param_policy(0, "f32", "f32") end)
check(not ok and tostring(err):find("set_param_policy: not allowed while the unit is sharded", 1, true), tostring(err))
ok, err = pcall(function()
  local u = ms.unit("plain", shard, nil, "bf16", "f32")
  u:add_param("w", { 4 }, "f32")
  u:set_param_policy(0, "f32", "f32")
end)
check(not ok and tostring(err):find("the unit is not packed", 1, true), tostring(err))
ok, err = pcall(function()
  local u = ms.unit("late", shard, nil, "bf16", "f32")
  u:add_param("w", { 4 }, "f32")
  u:set_packed(true)
end)
check(not ok and tostring(err):find("pack it before the first ms_unit_add_param", 1, true), tostring(err))
ok, err = pcall(function()
  local u = ms.unit("mixed", shard, nil, "bf16", "f32")
  u:add_param("a", { 4 }, "f32")
  u:add_param("b", { 4 }, "bf16")
end)
check(not ok and tostring(err):find("or pack them (ms_unit_set_packed)", 1, true), tostring(err))

if ms.backend() ~= "nccl" then -- the fp8 all-gather runs on cpu units
  ok, err = pcall(function()
    local u = ms.unit("f8", shard, nil, "bf16", "f32"):set_packed(true)
    u:add_param("w", { 4 }, "f32")
    u:set_fp8_all_gather(0)
    u:set_param_policy(0, "f32", "f32")
  end)
  check(not ok and tostring(err):find("give it its policy before ms_unit_set_fp8_all_gather", 1, true), tostring(err))
end

-- a checksum of every final shard, to compare runs (threads against MPI)
local crc = 0
for k = 1, #PARAMS do
  for _, b in ipairs(where_pk[k][1]:param_shard(where_pk[k][2]):bits()) do crc = (crc * 31 + b) % 4294967291 end
end
if #wrong > 0 then error(string.format("rank %d: %d wrong: %s", rank, #wrong, table.concat(wrong, "; ", 1,
  math.min(#wrong, 5))), 0) end
print(string.format("packed_units ok %d collectives %d/%d checksum %08x", rank,
  tp.all_gather + tp.reduce_scatter + tp.all_reduce, ts.all_gather + ts.reduce_scatter + ts.all_reduce, crc))
