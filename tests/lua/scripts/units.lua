-- units.lua: the inkling2 plan of a config made real on every rank
-- (moonshard -n 4 units.lua MESH [CONFIG [FLAGS]], CONFIG default
-- tests/lua/configs/inkling2_tiny.json; FLAGS a comma list: "offload", the policy's option
-- offload_policy = "cpu"; "packed", its option pack_islands = true):
-- parameters gathered in each unit's param dtype and checked against the full values
-- computed here, gradients reduced and checked against the mean computed here, the
-- collectives each unit recorded, the bytes each rank allocated against the planner's
-- figures, and where the shards live (on the nccl backend the rank's GPU, unless offloaded
-- to the host).  Prints "rank R: units ok ..." per rank.
local ms = require "moonshard"
local json = require "moonshard.json"

local mesh_spec = arg[1] or "dp_shard=4"
local f = assert(io.open(arg[2] or "tests/lua/configs/inkling2_tiny.json"))
local config = json.decode(f:read("a"))
f:close()
local tree = require("moonshard.models").from_config(config, arg[2] or "inkling2_tiny")
local mesh = require("moonshard.mesh_context").new(mesh_spec)
local policy = require("moonshard.policy").load("policies/inkling2")
local flags = {}
for f in (arg[3] or ""):gmatch("[^,]+") do flags[f] = true end
local offload = flags.offload == true
local plan = require("moonshard.plan").plan(tree, mesh, policy.shard_units,
  { options = { offload_policy = offload and "cpu" or nil, pack_islands = flags.packed } })
local rank_state = require("moonshard.runtime").materialize(plan)
local rank = ms.rank()
local dp = mesh:size("dp_replicate") * mesh:size("dp_shard")

local wrong = {}
local function check(cond, what) if not cond then wrong[#wrong + 1] = what end end

-- Deterministic full values: parameter p (by its index k in the plan) at flat index i.
local function value(k, i) return ((k * 131 + i * 17) % 97) / 97 - 0.5 end
-- multiples of 1/64 below 1: exact in bf16, so the gradients written in the gather dtype are
-- exact and the mean of 4 is exact too
local function grad_value(r, k, i) return (((r + 1) * (k + 3) + i % 13) % 64) / 64 end

local function full_tensor(shape, fn)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local vals = {}
  for i = 0, n - 1 do vals[i + 1] = fn(i) end
  return ms.from_table(vals, "f64", shape), n
end

-- Every unit this rank holds, with what a check needs: its entries (fqn, shape, dim, gather
-- and reduce dtypes, param), the shard group's size and this rank's coordinate on it, the
-- ranks whose gradients its reduction sums and the factor it divides by.  Dense units shard
-- over dp_shard and average over every data-parallel rank; expert units (on ep_shard, and
-- the ep-local units of the runtime) sum the ranks holding the same experts and divide by
-- the whole data-parallel size, since each expert's gradient already holds the tokens of
-- its whole ep group.
local ep, ep_shard = mesh:size("ep"), mesh:size("ep_shard")
local function range(from, to, step)
  local t = {}
  for q = from, to, step do t[#t + 1] = q end
  return t
end
local work = {}
for ui, pu in ipairs(plan.units) do
  local on_ep = pu.mesh_axes[#pu.mesh_axes] == "ep_shard" and ep * ep_shard > 1
  work[#work + 1] = { unit = rank_state.units[ui], name = pu.name, entries = pu.entries, reduce = pu.reduce_dtype_eff,
    shard_size = on_ep and ep_shard or mesh:size("dp_shard"),
    coord = on_ep and math.floor(rank / ep) or rank % mesh:size("dp_shard"),
    peers = on_ep and range(rank % ep, mesh.world - 1, ep) or range(0, dp - 1, 1),
    factor = on_ep and ep * ep_shard or dp }
end
local owned = {}
for _, o in ipairs(plan.owned) do owned[o.fqn] = o end
for _, u in ipairs(rank_state.ep_local) do
  local entries = {}
  for i = 0, u:count() - 1 do
    local o = owned[u:fqn(i)]
    entries[#entries + 1] = { fqn = o.fqn, shape = o.local_shape, dim = 0, gather = o.dtype, reduce = o.dtype,
      param = { dtype = o.dtype, requires_grad = o.requires_grad } }
  end
  work[#work + 1] = { unit = u, name = u:name(), entries = entries, reduce = entries[1].reduce, shard_size = 1,
    coord = 0, peers = { rank }, factor = ep * ep_shard }
end
check(#work == #rank_state.units, string.format("%d units checked of %d", #work, #rank_state.units))

-- where the shards live: the rank's device, or the host for units planned with offload (the
-- ep-local units never offload); unsharded tensors are always on the rank's device
for ui, w in ipairs(work) do
  local pu = plan.units[ui]
  local want = pu and pu.offload == "cpu" and "cpu" or ms.device()
  check(not offload or not pu or pu.offload == "cpu", w.name .. " was not planned with offload_policy cpu")
  for i = 0, w.unit:count() - 1 do
    local got = w.unit:param_shard(i):device()
    check(got == want, string.format("%s: shard %d on %s, expected %s", w.name, i, got, want))
  end
end

local k = 0
for _, w in ipairs(work) do
  for i, e in ipairs(w.entries) do
    k = k + 1
    local kk = k
    w.unit:load_full(i - 1, (full_tensor(e.shape, function(j) return value(kk, j) end)))
  end
end

-- unshard every unit; the gathered parameters are the full values in the gather dtype
k = 0
for _, w in ipairs(work) do
  w.unit:unshard()
  w.unit:wait()
  for i, e in ipairs(w.entries) do
    k = k + 1
    local kk = k
    local ref = full_tensor(e.shape, function(j) return value(kk, j) end)
    local got = w.unit:param_full(i - 1)
    check(got:dtype() == e.gather, e.fqn .. " gathered in " .. got:dtype() .. ", planned " .. e.gather)
    local want_bits, got_bits = ref:to(e.gather):bits(), got:bits()
    local bad = 0
    for j = 1, #want_bits do if want_bits[j] ~= got_bits[j] then bad = bad + 1 end end
    check(bad == 0, string.format("%s: %d of %d gathered values differ", e.fqn, bad, #want_bits))
  end
end

-- backward: rank r's gradient of every parameter, then reduce; the shard holds the sum
-- over the unit's peers divided by its factor (the mean for dense units)
local max_diff = 0
k = 0
for _, w in ipairs(work) do
  local u = w.unit
  local kk0 = k
  for i, e in ipairs(w.entries) do
    local kk = kk0 + i
    if e.param.requires_grad then
      u:grad_full(i - 1):copy_((full_tensor(e.shape, function(j) return grad_value(rank, kk, j) end)))
    end
  end
  u:reduce_grads()
  u:wait()
  for i, e in ipairs(w.entries) do
    k = k + 1
    local kk = k
    if e.param.requires_grad then
      local shard = u:grad_shard(i - 1)
      local rows = shard:shape()[e.dim + 1]
      local lo = w.coord * math.ceil(e.shape[e.dim + 1] / w.shard_size)
      local ref = full_tensor(e.shape, function(j)
        local s = 0
        for _, q in ipairs(w.peers) do s = s + grad_value(q, kk, j) end
        return s / w.factor
      end)
      if rows > 0 then
        local want = ref:narrow(e.dim, lo, rows):to(e.reduce):to(e.param.dtype):totable()
        local got = shard:totable()
        for j = 1, #want do max_diff = math.max(max_diff, math.abs(want[j] - got[j])) end
      end
    end
  end
end
check(max_diff <= 1e-6, string.format("gradient shards differ from the mean by up to %g", max_diff))

-- the records: islands gather and reduce in f32, the layers gather in bf16 and reduce in f32;
-- a unit whose parameters gather in several dtypes (a packed unit holding its islands) moves
-- bytes (u8)
for _, w in ipairs(work) do
  local gather = w.entries[1].gather
  for _, e in ipairs(w.entries) do if e.gather ~= w.entries[1].gather then gather = "u8" end end
  for _, r in ipairs(w.unit:records()) do
    if r.kind == "all_gather" then
      check(r.dtype == gather, w.name .. " gathered in " .. r.dtype .. ", expected " .. gather)
    elseif r.kind == "reduce_scatter" then
      check(r.dtype == w.reduce, w.name .. " reduced in " .. r.dtype)
    end
  end
end

-- memory: what the allocator handed out for this rank's units against the planner and the
-- units' own books (parameters and gradients now), exactly
local bytes, real = rank_state:bytes(), rank_state:allocated()
for _, cat in ipairs({ "params", "grads" }) do
  local planned = plan.memory[cat]
  check(real[cat] == planned and bytes[cat] == planned,
    string.format("%s: %d bytes allocated (%d in the units' books), %d planned", cat, real[cat], bytes[cat], planned))
end

if #wrong > 0 then error(string.format("rank %d: %d checks failed:\n  %s", rank, #wrong, table.concat(wrong, "\n  ")), 0) end
print(string.format("rank %d: units ok (%d units, gradient max diff %g, params %d B, grads %d B)", rank,
  #work, max_diff, bytes.params, bytes.grads))
