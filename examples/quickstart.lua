-- quickstart.lua: one FSDP step's communication on a 2 x 2 HSDP mesh, for real.
--
--   moonshard -n 4 examples/quickstart.lua
--
-- Every rank runs this script.  Each one holds a shard of a 9 x 6 parameter (FSDP pads
-- the last shard), gathers the whole parameter in bf16 over its dp_shard group,
-- reduce-scatters a gradient in f32 and all-reduces it over dp_replicate (HSDP), then
-- checks what it got against values it computes itself.

local ms = require "moonshard"

local rank, world = ms.rank(), ms.world_size()
if world ~= 4 then
  error("run me on 4 ranks: " .. (ms.backend() == "threads" and "moonshard -n 4" or "mpirun -np 4 moonshard") ..
    " examples/quickstart.lua", 0)
end

local mesh = ms.mesh({ { "dp_replicate", 2 }, { "dp_shard", 2 } })
local shard_group = mesh:group("dp_shard")
local replicate_group = mesh:group("dp_replicate")
local coords = mesh:coords()
local n_shard = mesh:size("dp_shard")

local rows, cols = 9, 6
local function weight(i, j) return (i * cols + j) / 7 - 3 end      -- the full parameter
local function grad(q, i, j) return (q + 1) * (i - j) / 4 end      -- rank q's gradient

local function values(row0, nrows, f)
  local v = {}
  for i = row0, row0 + nrows - 1 do
    for j = 0, cols - 1 do v[#v + 1] = f(i, j) end
  end
  return v
end

-- 1. The shard this rank owns: a narrow of a zero-filled padded buffer (FSDP2's layout).
local local_shape, offset, padded_shape = ms.fsdp_shard({ rows, cols }, n_shard, coords.dp_shard)
local padded = ms.tensor(padded_shape, "f32")
local shard = padded:narrow(0, 0, local_shape[1])
shard:copy_(ms.from_table(values(offset, local_shape[1], weight), "f32", local_shape))

-- 2. Unshard: cast to bf16, all-gather over dp_shard, drop the padding tail.
local gathered = ms.tensor({ n_shard * padded_shape[1], cols }, "bf16")
shard_group:all_gather(gathered, padded:to("bf16"))
local full = gathered:narrow(0, 0, rows)
local want_bits = ms.from_table(values(0, rows, weight), "f32"):to("bf16"):bits()
local got_bits, wrong_bits = full:bits(), 0
for k = 1, #want_bits do
  if got_bits[k] ~= want_bits[k] then wrong_bits = wrong_bits + 1 end
end

-- 3. Reduce the gradient: reduce-scatter (avg) in f32 over dp_shard, then all-reduce
--    (avg) over dp_replicate: every rank ends with its shard of the mean of 4 gradients.
local g_full = ms.tensor({ n_shard * padded_shape[1], cols }, "f32")
g_full:narrow(0, 0, rows):copy_(ms.from_table(values(0, rows, function(i, j) return grad(rank, i, j) end),
  "f32", { rows, cols }))
local g_shard = ms.tensor(padded_shape, "f32")
shard_group:reduce_scatter(g_shard, g_full, "avg")
replicate_group:all_reduce(g_shard, "avg")
local got = g_shard:narrow(0, 0, local_shape[1]):totable()
local want = values(offset, local_shape[1], function(i, j)
  local s = 0
  for q = 0, world - 1 do s = s + grad(q, i, j) end
  return s / world
end)
local max_diff = 0
for k = 1, #want do max_diff = math.max(max_diff, math.abs(got[k] - want[k])) end

-- 4. The report: rank 0 describes the step, then each rank says how it went, in order.
local function bus_bytes(kind, buffer_bytes, n)
  -- nccl-tests bus bytes: what one rank moves
  if kind == "all_reduce" then return math.floor(2 * buffer_bytes * (n - 1) / n) end
  return math.floor(buffer_bytes * (n - 1) / n)
end

local world_group = ms.mesh({ { "world", world } }):group("world")
if rank == 0 then
  print(string.format("moonshard %s quickstart: %d ranks (%s), backend %s", ms.version, world,
    tostring(mesh), ms.backend()))
  print(string.format("  parameter %dx%d f32, FSDP over dp_shard=%d: shard %dx%d, padded %dx%d",
    rows, cols, n_shard, local_shape[1], local_shape[2], padded_shape[1], padded_shape[2]))
  print(string.format("  %-15s %-12s %-6s %14s", "collective", "group", "dtype", "bytes/rank"))
  print(string.format("  %-15s %-12s %-6s %14d", "all-gather", "dp_shard", "bf16",
    bus_bytes("all_gather", gathered:nbytes(), n_shard)))
  print(string.format("  %-15s %-12s %-6s %14d", "reduce-scatter", "dp_shard", "f32",
    bus_bytes("reduce_scatter", g_full:nbytes(), n_shard)))
  print(string.format("  %-15s %-12s %-6s %14d", "all-reduce", "dp_replicate", "f32",
    bus_bytes("all_reduce", g_shard:nbytes(), mesh:size("dp_replicate"))))
end
local ok = wrong_bits == 0 and max_diff <= 1e-6
for q = 0, world - 1 do
  world_group:barrier()
  if q == rank then
    print(string.format("  rank %d %s: coords (%d, %d), rows %d..%d, bf16 gather %d/%d bits exact, " ..
      "grad max diff %.3g", rank, ok and "ok" or "FAILED", coords.dp_replicate, coords.dp_shard, offset, offset + local_shape[1] - 1,
      #want_bits - wrong_bits, #want_bits, max_diff))
  end
end
if not ok then
  error(string.format("rank %d: %d wrong bf16 values, gradient max diff %g", rank, wrong_bits, max_diff), 0)
end
