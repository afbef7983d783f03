-- fp8_units.lua: the FP8 all-gather of shard units (core/src/unit_fp8.c), on every rank:
--   moonshard -n 4 tests/lua/scripts/fp8_units.lua [hsdp]
-- A unit gathering in bf16 holds four parameters: three gather as e4m3 (stored f32, and a
-- frozen one in bf16; one with an empty shard on rank 3), one as plain bf16.  Every rank's gathered values are
-- compared bit for bit with the whole tensor cast at once (ms.fp8_amax, ms.fp8_scale,
-- ms.fp8_cast and ms.fp8_dequantize of the full parameter: no collective involved), the
-- records with the amax all-reduces and the one u8 all-gather torchao's FSDP2 path issues,
-- and the gradients still reduce as for any parameter.  Prints "fp8_units ok <rank>".
local ms = require "moonshard"

local hsdp = arg and arg[1] == "hsdp"
local n, rank = ms.world_size(), ms.rank()
local mesh = hsdp and ms.mesh({ { "dp_replicate", 2 }, { "dp_shard", n / 2 } }) or ms.mesh({ { "dp_shard", n } })
local shard = mesh:group("dp_shard")
local replicate = hsdp and mesh:group("dp_replicate") or nil
local W = shard:size()

-- deterministic values over many binades, the same on every rank
local function full_of(shape, dtype, seed)
  local count = 1
  for _, d in ipairs(shape) do count = count * d end
  local v = {}
  for k = 1, count do
    local m = ((k * 37 + seed * 11) % 19) - 9
    v[k] = m * 2 ^ (((k * 5 + seed) % 13) - 6) * (1 + seed / 8)
  end
  if seed == 3 then v[2] = 3e4 end -- a large value: the others scale far down
  return ms.from_table(v, dtype, shape)
end

local params = {
  { "w1", { 10, 6 }, "f32", true },
  { "w2", { 7 }, "f32", false },
  { "w3", { 5, 3 }, "bf16", true, true }, -- frozen: FSDP2 takes one stored dtype for trainable ones
  { "w4", { 3, 4 }, "f32", true }, -- 3 rows on 4 ranks: rank 3's shard is empty
}

local u = ms.unit("layer", shard, replicate, "bf16", "f32", true)
local fulls = {}
for i, p in ipairs(params) do
  u:add_param(p[1], p[2], p[3], 0, not p[5])
  if p[4] then u:set_fp8_all_gather(i - 1) end
  fulls[i] = full_of(p[2], p[3], i)
end
u:finalize()
for i = 1, #params do u:load_full(i - 1, fulls[i]) end

-- misuse is refused by name
local ok, err = pcall(function() u:set_fp8_all_gather(0) end)
assert(not ok and err:find("set_fp8_all_gather: not allowed while the unit is sharded", 1, true), tostring(err))
if W > 2 and W % 2 == 0 then
  local k2 = ms.unit("k2", shard, replicate, "bf16", "f32", 2)
  k2:add_param("w", { 4, 2 })
  ok, err = pcall(function() k2:set_fp8_all_gather(0) end)
  assert(not ok and err:find("reshards 2-way after forward", 1, true), tostring(err))
end

u:unshard():wait()
local bad = 0
for i, p in ipairs(params) do
  local got = u:param_full(i - 1)
  assert(got:dtype() == "bf16", got:dtype())
  local want
  if p[4] then
    local scale = ms.fp8_scale(ms.fp8_amax(fulls[i]))
    local data = ms.fp8_cast(fulls[i], { scale = scale })
    want = ms.fp8_dequantize(data, scale, "bf16")
  else
    want = fulls[i]:to("bf16")
  end
  local g, w = got:bits(), want:bits()
  assert(#g == #w)
  for k = 1, #w do
    if g[k] ~= w[k] then
      bad = bad + 1
      if bad < 5 then print(string.format("rank %d %s[%d]: got 0x%04x, want 0x%04x", rank, p[1], k, g[k], w[k])) end
    end
  end
end
assert(bad == 0, bad .. " gathered values differ")

-- the records: each fp8 parameter's amax all-reduce (shard group, then replicate group),
-- then one all-gather of bytes: fp8 parameters one byte an element, w2 two (bf16)
local expect = {}
local S = 0
for _, p in ipairs(params) do
  local rows = math.ceil(p[2][1] / W)
  local inner = p[2][2] or 1
  S = S + rows * inner * (p[4] and 1 or 2)
  if p[4] then
    local es = ms.dtype_size(p[3])
    expect[#expect + 1] = { kind = "all_reduce", dtype = p[3], group_size = W, bytes = es }
    if replicate then expect[#expect + 1] = { kind = "all_reduce", dtype = p[3], group_size = replicate:size(), bytes = es } end
  end
end
expect[#expect + 1] = { kind = "all_gather", dtype = "u8", group_size = W, bytes = W * S }
local recs = u:records()
assert(#recs == #expect, "records: " .. #recs .. ", expected " .. #expect)
for k, e in ipairs(expect) do
  local r = recs[k]
  assert(r.kind == e.kind and r.dtype == e.dtype and r.group_size == e.group_size and r.bytes == e.bytes,
    string.format("record %d: %s %s %d %d, expected %s %s %d %d", k, r.kind, r.dtype, r.group_size, r.bytes,
      e.kind, e.dtype, e.group_size, e.bytes))
end

-- gradients reduce as for any parameter: every rank adds rank + 1, the average is (n + 1) / 2
for i = 0, #params - 1 do
  if not params[i + 1][5] then u:grad_full(i):fill_(rank + 1) end
end
u:reduce_grads():wait()
for i = 0, #params - 1 do
  local gs = u:grad_shard(i)
  if gs then
    for _, v in ipairs(gs:totable()) do assert(v == (n + 1) / 2, "grad " .. v) end
  end
end

-- a second gather after new values (reduce_grads resharded): a new amax, a new scale
for i = 1, #params do
  fulls[i] = full_of(params[i][2], params[i][3], i + 4)
  u:load_full(i - 1, fulls[i])
end
u:unshard():wait()
for i, p in ipairs(params) do
  if p[4] then
    local scale = ms.fp8_scale(ms.fp8_amax(fulls[i]))
    local want = ms.fp8_dequantize(ms.fp8_cast(fulls[i], { scale = scale }), scale, "bf16")
    local g, w = u:param_full(i - 1):bits(), want:bits()
    for k = 1, #w do assert(g[k] == w[k], p[1] .. " second gather differs at " .. k) end
  end
end
print("fp8_units ok " .. rank)
