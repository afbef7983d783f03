-- megatron_units.lua STRATEGY [FLAG...]: a Megatron-FSDP plan made real on every rank of
-- `moonshard -n W` (W = 1, 2, 4) and trained STEPS steps with deterministic gradients, then
-- checked on every rank against a one-rank run of the same plan the rank makes itself
-- afterwards (a dp = 1 plan, its buckets on a group of this rank alone, the same global
-- batch).  FLAGs: fp32 (grad_reduce_in_fp32), main (preserve_fp32_weights), torch (the
-- torch_adamw optimizer), rough (gradients of full mantissas instead of small multiples of
-- 2^-6: the reduction order then shows).
--
-- The model: embed.w [5, 7] bf16 and head.w [11, 3] f32 outside the FSDP units; two Block units
-- of a.w [6, 5] bf16, a.b [6] bf16, n.w [9] f32 and, in layer 0, a frozen f.w [3, 3] bf16.
-- Slices cut a.w, embed.w and head.w across ranks.  The global batch is 4 micro-batches;
-- rank r of W takes 4/W of them and writes their mean as its gradient.
--
-- Prints per rank: the max differences of parameters (its pieces and, where it holds them, the
-- whole parameters), AdamW state and reduced gradients against the one-rank run, its bytes
-- (books and allocator) against the plan's per-rank figures, the transient peaks against the
-- plan's, its collectives against the plan's counts and bytes, and a checksum of the trained
-- parameters (equal for every W and strategy in the exact mode).
local ms = require "moonshard"
local module = require "moonshard.module"
local planner = require "moonshard.plan"
local mesh_context = require "moonshard.mesh_context"
local runtime = require "moonshard.runtime"

local STRATEGY = arg[1] or "optim"
local FLAGS = {}
for i = 2, #arg do FLAGS[arg[i]] = true end
local W, RANK, STEPS, MICRO = ms.world_size(), ms.rank(), 3, 4
local SIZE = { f32 = 4, bf16 = 2 }

local function model()
  local root = module.new("Toy")
  root:add("embed", module.new("Embedding")):param("w", { 5, 7 }, "bf16")
  local layers = root:add("layers", module.new("ModuleList"))
  for i = 0, 1 do
    local blk = layers:add(tostring(i), module.new("Block"))
    local a = blk:add("a", module.new("Linear"))
    a:param("w", { 6, 5 }, "bf16")
    a:param("b", { 6 }, "bf16")
    blk:add("n", module.new("Norm")):param("w", { 9 }, "f32")
    if i == 0 then blk:add("f", module.new("Frozen")):param("w", { 3, 3 }, "bf16", { requires_grad = false }) end
  end
  root:add("head", module.new("Linear")):param("w", { 11, 3 }, "f32")
  return root
end

local function plan_for(w)
  return planner.plan(model(), mesh_context.new("dp_shard=" .. w), { parallelize = function(ctx)
    ctx:megatron_fsdp(ctx.model, { zero_dp_strategy = STRATEGY, unit_modules = { "Block" },
      grad_reduce_in_fp32 = FLAGS.fp32 == true, preserve_fp32_weights = FLAGS.main == true })
  end }, { optimizer = FLAGS.torch and "torch_adamw" or "adamw" })
end

-- Element k (0-based) of parameter `fqn`: its initial value, and micro-batch m's gradient at
-- step t (small multiples of 2^-4: every sum and mean below is exact; rough: any float).
local function hash(s)
  local h = 7
  for i = 1, #s do h = (h * 31 + s:byte(i)) % 1000003 end
  return h
end
local function init(fqn, k) return ((hash(fqn) + k * 13) % 29 - 14) / 8 end
local function grad(fqn, k, t, m)
  if FLAGS.rough then return math.sin(hash(fqn) + k * 1.7 + t * 2.3 + m * 0.61) * 0.37 end
  return ((hash(fqn) + k * 7 + t * 3 + m * 5) % 11 - 5) / 16
end

-- One step's gradient of parameter p on a rank holding micro-batches [m0, m0 + count): their mean.
local function local_grad(fqn, n, t, m0, count)
  local v = {}
  for k = 0, n - 1 do
    local s = 0
    for m = m0, m0 + count - 1 do s = s + grad(fqn, k, t, m) end
    v[k + 1] = s / count
  end
  return v
end

-- Trains buckets (a rank's, over `dp` ranks) for STEPS steps; the schedule of Megatron-FSDP:
-- buckets outside units gathered once a step, a unit's gathered for its forward (the next
-- unit's prefetched) and again for its backward; gradients handed out per unit, reduced.
-- Returns the transient peaks: gathered parameters, one unit's gradient buckets.
local function train(buckets, info, dp, rank)
  local per = math.floor(MICRO / dp)
  local units, outside = {}, {}
  for _, bk in ipairs(buckets) do
    local u = bk.plan_bucket.unit_id
    if u then
      units[u + 1] = units[u + 1] or {}
      table.insert(units[u + 1], bk)
    else
      outside[#outside + 1] = bk
    end
  end
  local function unsharded(list)
    local n = 0
    for _, bk in ipairs(list) do n = n + bk:bytes().unsharded end
    return n
  end
  local all_units = {}
  for _, l in ipairs(units) do for _, bk in ipairs(l) do all_units[#all_units + 1] = bk end end
  local function gathered() return unsharded(outside) + unsharded(all_units) end
  local peak_params, peak_grads = 0, 0
  local function hand_grads(list, t)
    for _, bk in ipairs(list) do
      for i = 0, bk:count() - 1 do
        local g = bk:grad(i)
        if g then
          local fqn = bk:fqn(i)
          g:copy_(ms.from_table(local_grad(fqn, info[fqn].numel, t, rank * per, per), "f64", g:shape()))
        end
      end
    end
  end
  for t = 1, STEPS do
    for _, bk in ipairs(outside) do bk:unshard() end
    for u, list in ipairs(units) do -- forward
      for _, bk in ipairs(list) do if u == 1 then bk:unshard() end end
      for _, bk in ipairs(units[u + 1] or {}) do bk:unshard() end -- prefetch
      peak_params = math.max(peak_params, gathered())
      for _, bk in ipairs(list) do bk:reshard() end
    end
    for u = #units, 1, -1 do -- backward
      local list = units[u]
      for _, bk in ipairs(list) do bk:unshard() end
      peak_params = math.max(peak_params, gathered())
      hand_grads(list, t)
      for _, bk in ipairs(list) do bk:reshard() end
      peak_grads = math.max(peak_grads, unsharded(list))
      for _, bk in ipairs(list) do bk:reduce_grads() end
    end
    hand_grads(outside, t)
    for _, bk in ipairs(outside) do
      bk:reshard()
      peak_grads = math.max(peak_grads, bk:bytes().unsharded)
      bk:reduce_grads()
    end
    for _, bk in ipairs(buckets) do bk:adamw_step({ lr = 0.01, step = t, weight_decay = 0.1 }) end
    if t < STEPS then for _, bk in ipairs(buckets) do bk:clear_grads() end end
  end
  return peak_params, peak_grads
end

local function load(buckets, info)
  for _, bk in ipairs(buckets) do
    for i = 0, bk:count() - 1 do
      local fqn = bk:fqn(i)
      local v = {}
      for k = 0, info[fqn].numel - 1 do v[k + 1] = init(fqn, k) end
      bk:load_full(i, ms.from_table(v, "f64"))
    end
  end
end

-- ---------------------------------------------------------------- the W-rank run

local plan = plan_for(W)
local pu = plan.units[1]
local info = {}
for _, it in ipairs(pu.megatron.items) do info[it.fqn] = { numel = it.param.numel } end
local state = runtime.materialize(plan)
local buckets = state.buckets
load(buckets, info)
local peak_params, peak_grads = train(buckets, info, W, RANK)

-- what the rank holds, its pieces, the whole parameters where it has them
local held = { params = 0, grads = 0, optimizer = 0 }
for _, bk in ipairs(buckets) do
  local b = bk:bytes()
  for k in pairs(held) do held[k] = held[k] + b[k] end
end
local allocated = state:allocated()
local records = state:records()
local got = {}
for _, bk in ipairs(buckets) do
  for i = 0, bk:count() - 1 do
    local fqn = bk:fqn(i)
    local s, e = bk:piece(i)
    local g = { s = s, e = e }
    for _, which in ipairs({ "param", "grad", "exp_avg", "exp_avg_sq", "main" }) do
      local t = bk:piece_tensor(i, which)
      g[which] = t and t:totable()
    end
    local ok_full, full = pcall(bk.param, bk, i)
    g.full = ok_full and full and full:view({ info[fqn].numel }):totable() or nil
    got[fqn] = g
  end
end

-- every element belongs to exactly one rank: the pieces' lengths summed over the ranks
local dp_group = ms.mesh({ { "dp", W } }):group("dp")
local counts = {}
for _, it in ipairs(pu.megatron.items) do counts[#counts + 1] = got[it.fqn].e - got[it.fqn].s end
local ct = ms.from_table(counts, "f64")
dp_group:all_reduce(ct, "sum")
local covered = true
for j, it in ipairs(pu.megatron.items) do
  local want = STRATEGY == "no_shard" and W * it.param.numel or it.param.numel
  covered = covered and ct:totable()[j] == want
end

-- ---------------------------------------------------------------- the one-rank run

local one = ms.mesh({ { "replicas", W }, { "self", 1 } }):group("self")
local ref_plan = plan_for(1)
local ref = runtime.megatron_buckets(ref_plan.units[1], one, ref_plan.optimizer)
load(ref, info)
train(ref, info, 1, 0)
local want = {}
for _, bk in ipairs(ref) do
  for i = 0, bk:count() - 1 do
    local w = {}
    for _, which in ipairs({ "param", "grad", "exp_avg", "exp_avg_sq", "main" }) do
      local t = bk:piece_tensor(i, which)
      w[which] = t and t:totable()
    end
    want[bk:fqn(i)] = w
  end
end

local function maxdiff(a, b, off)
  if a == nil and b == nil then return 0 end
  if (a == nil) ~= (b == nil) then return math.huge end
  local d = 0
  for k = 1, #a do d = math.max(d, math.abs(a[k] - b[k + off])) end
  return d
end
local dp_, ds, dg, dfull = 0, 0, 0, 0
local checksum = 0
for fqn, g in pairs(got) do
  local w = want[fqn]
  dp_ = math.max(dp_, maxdiff(g.param, w.param, g.s))
  dg = math.max(dg, maxdiff(g.grad, w.grad, g.s))
  for _, which in ipairs({ "exp_avg", "exp_avg_sq", "main" }) do ds = math.max(ds, maxdiff(g[which], w[which], g.s)) end
  if g.full then dfull = math.max(dfull, maxdiff(g.full, w.param, 0)) end
  for k, v in ipairs(w.param) do checksum = (checksum + v * ((k % 97) + 1)) end
end

-- ---------------------------------------------------------------- the plan's figures

local planned = plan.memory.per_rank[RANK + 1]
local m = pu.megatron
local function count_kind(kind)
  local n, bytes = 0, 0
  for _, r in ipairs(records) do
    if r.kind == kind then
      n = n + 1
      -- the plan counts each rank's bus bytes: all_gather and reduce_scatter move (W-1)/W of the
      -- buffer, all_reduce 2x the buffer less its 1/W
      if kind == "all_reduce" then bytes = bytes + 2 * r.bytes - math.ceil(2 * r.bytes / W)
      else bytes = bytes + r.bytes - math.floor(r.bytes / W) end
    end
  end
  return n, bytes
end
local comm = pu.comm
local ag_n, ag_b = 0, 0
for _, c in ipairs(comm.all_gather) do ag_n, ag_b = ag_n + 1, ag_b + c.bytes end
local rs_n, rs_b = comm.reduce_scatter and comm.reduce_scatter.count or 0, comm.reduce_scatter and comm.reduce_scatter.bytes or 0
local ar_n, ar_b = comm.all_reduce and comm.all_reduce.count or 0, comm.all_reduce and comm.all_reduce.bytes or 0
local g_ag_n, g_ag_b = count_kind("all_gather")
local g_rs_n, g_rs_b = count_kind("reduce_scatter")
local g_ar_n, g_ar_b = count_kind("all_reduce")

print(string.format("rank %d: megatron %s W=%d: params max diff %.17g (whole %.17g), state max diff %.17g, grads max diff %.17g, " ..
  "covered %s; bytes params %d/%d grads %d/%d optimizer %d/%d, allocated params %d grads %d optimizer %d; " ..
  "gathered %d/%d grad bucket %d/%d; all_gather %d/%d %d/%d, reduce_scatter %d/%d %d/%d, all_reduce %d/%d %d/%d; " ..
  "checksum %.17g",
  RANK, STRATEGY, W, dp_, dfull, ds, dg, tostring(covered), held.params, planned.params, held.grads, planned.grads,
  held.optimizer, planned.optimizer, allocated.params, allocated.grads, allocated.optimizer,
  peak_params, m.gathered_bytes, peak_grads, m.grad_bucket_bytes,
  g_ag_n, STEPS * ag_n, g_ag_b, STEPS * ag_b, g_rs_n, STEPS * rs_n, g_rs_b, STEPS * rs_b,
  g_ar_n, STEPS * ar_n, g_ar_b, STEPS * ar_b, checksum))
