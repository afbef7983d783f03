-- bench_ckpt.lua IO_BIN DIR [MIB] [TRIALS] [TENSORS]: moonshard.checkpoint's save and load
-- against writing and reading the same bytes with plain write/fsync and pread
-- (bench/bench_ckpt_io), interleaved in the same run (docs/performance.md).  Run on several
-- ranks (threads: moonshard -n 4; processes: mpirun -np 4 moonshard); bench/bench_ckpt.sh
-- runs both.
--
-- The units: TENSORS f32 parameters of [rows, 1024] (MIB MiB in all, default 512), one unit
-- of each 4 parameters, sharded on dim 0 over the world.  Each trial: ckpt.save (a new
-- checkpoint: every rank writes its file, fsync, the index, the renames) and plain write of
-- the same bytes per rank (a file each, fsync), then ckpt.load (every box checksummed) and
-- plain read (pread into a buffer allocated before) - the two sides' order alternating by
-- trial; then ckpt.load{verify = false}, no checksums, timed for the share CRC32C takes.  Both
-- read files just written, from the page cache.  Prints the bytes, GB/s of each
-- side and the ratio plain time / checkpoint time (min / median / max over the trials; the
-- target is >= 0.8: the checkpoint within 20% of plain I/O).
--
-- Times of the checkpoint side are wall clock (`date +%s%N` by rank 0 around barriers; the
-- clock's own cost, measured, is subtracted); the plain side times itself (CLOCK_MONOTONIC).
local ms = require "moonshard"
local ckpt = require "moonshard.checkpoint"

local io_bin, dir = arg[1], arg[2]
local mib, trials, ntensors = tonumber(arg[3] or 512), tonumber(arg[4] or 5), tonumber(arg[5] or 32)
local rank, n = ms.rank(), ms.world_size()
local function usage(msg)
  if rank == 0 then
    io.stderr:write("bench_ckpt.lua: " .. msg .. "\nusage: moonshard -n RANKS bench/bench_ckpt.lua IO_BIN DIR [MIB] [TRIALS] [TENSORS]\n")
  end
  os.exit(2)
end
if not io_bin or not dir then usage("IO_BIN (build/bench/bench_ckpt_io) and DIR expected") end
if not mib or mib < 1 or mib > 65536 then usage("MIB wants a number 1..65536, got " .. tostring(arg[3])) end
if not trials or trials < 1 or trials > 100 or trials % 1 ~= 0 then usage("TRIALS wants an integer 1..100") end
if not ntensors or ntensors < 1 or ntensors > 4096 or ntensors % 1 ~= 0 then usage("TENSORS wants an integer 1..4096") end

local g = ms.mesh({ { "dp", n } }):group("dp")
local COLS = 1024
-- rows a tensor: a multiple of the world size, the total close to MIB
local rows = math.max(n, math.floor(mib * 1024 * 1024 / (4 * COLS * ntensors) / n) * n)
local units = {}
for u0 = 0, ntensors - 1, 4 do
  local u = ms.unit("u" .. math.floor(u0 / 4), g, nil, nil, nil, true)
  for k = u0, math.min(u0 + 3, ntensors - 1) do u:add_param(string.format("model.layers.%d.weight", k), { rows, COLS }, "f32") end
  u:finalize()
  for i = 0, u:count() - 1 do u:param_shard(i):fill_(rank * 0.25 + i + u0) end
  units[#units + 1] = u
end
local total = rows * COLS * 4 * ntensors
local per_rank = math.floor(total / n)

-- wall-clock seconds, rank 0 only
local function clock()
  local p = assert(io.popen("date +%s%N"))
  local s = p:read("a")
  p:close()
  return tonumber(s) / 1e9
end
local overhead = 0
if rank == 0 then
  local v = {}
  for i = 1, 5 do
    local a = clock()
    v[i] = clock() - a
  end
  table.sort(v)
  overhead = v[3]
end

local function sh(cmd)
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  local ok = p:close()
  if not ok then error("bench_ckpt.lua: failed: " .. cmd .. "\n" .. out, 0) end
  return out
end

local function quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- plain write or read on rank 0's behalf (the helper runs its n threads); seconds
local function plain(mode)
  local t
  if rank == 0 then
    local out = sh(string.format("%s %s %s -n %d -b %d", quote(io_bin), mode, quote(dir), n, per_rank))
    local m, b, s = out:match("^(%a+) (%d+) ([%d%.]+)")
    assert(m == mode and tonumber(b) == per_rank * n, "bench_ckpt_io said: " .. out)
    t = tonumber(s)
  end
  g:barrier()
  return t
end

local function timed(f)
  g:barrier()
  local t0 = rank == 0 and clock()
  f()
  g:barrier()
  return rank == 0 and clock() - t0 - overhead
end

if rank == 0 then sh("mkdir -p " .. quote(dir)) end
g:barrier()
local root = dir .. "/ckpt"
local res = { save = {}, write = {}, load = {}, read = {}, load_nv = {} }
for trial = 1, trials + 1 do -- trial 1 warms up and is not counted
  local ts, tw, tl, tr, tn
  local function save() ts = timed(function() ckpt.save(units, root, { step = trial, progress = false }) end) end
  local function load()
    tl = timed(function() ckpt.load(units, root, { progress = false }) end)
    tn = timed(function() ckpt.load(units, root, { progress = false, verify = false }) end)
  end
  if trial % 2 == 0 then
    save(); tw = plain("write"); load(); tr = plain("read")
  else
    tw = plain("write"); save(); tr = plain("read"); load()
  end
  if rank == 0 then
    if trial > 1 then
      local k = trial - 1
      res.save[k], res.write[k], res.load[k], res.read[k], res.load_nv[k] = ts, tw, tl, tr, tn
    end
    sh("rm -rf " .. quote(root) .. " " .. quote(dir) .. "/plain*.bin")
  end
  g:barrier()
end

if rank == 0 then
  local function stats(v)
    local s = {}
    for i, x in ipairs(v) do s[i] = x end
    table.sort(s)
    local m = #s % 2 == 1 and s[(#s + 1) / 2] or (s[#s / 2] + s[#s / 2 + 1]) / 2
    return s[1], m, s[#s]
  end
  local gb = total / 1e9
  print(string.format("bench_ckpt: %s, %d ranks (%s), %d tensors of %dx%d f32 in %d units, %.1f MiB in all " ..
    "(%.1f MiB a rank), %d trials interleaved, in %s", type(jit) == "table" and jit.version or _VERSION, n,
    ms.backend(), ntensors, rows, COLS, #units, total / 2 ^ 20, per_rank / 2 ^ 20, trials, dir))
  for _, pair in ipairs({ { "save", "write" }, { "load", "read" }, { "load_nv", "read" } }) do
    local c, p = res[pair[1]], res[pair[2]]
    local ratio = {}
    for i = 1, #c do ratio[i] = p[i] / c[i] end
    local c1, cm, c2 = stats(c)
    local p1, pm, p2 = stats(p)
    local r1, rm, r2 = stats(ratio)
    if pair[1] == "load_nv" then print("  (load with verify = false: no CRC32C of what is read)") end
    print(string.format("  checkpoint %-4s %6.3f / %6.3f / %6.3f s  (%5.2f GB/s median)", pair[1], c1, cm, c2, gb / cm))
    print(string.format("  plain %-9s %6.3f / %6.3f / %6.3f s  (%5.2f GB/s median)", pair[2] .. (pair[2] == "write" and "+fsync" or ""),
      p1, pm, p2, gb / pm))
    print(string.format("  ratio %s: plain / checkpoint %.2f / %.2f / %.2f (min / median / max); target >= 0.8: %s",
      pair[1], r1, rm, r2, rm >= 0.8 and "met" or "MISSED"))
  end
end
