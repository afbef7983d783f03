-- ddp_units.lua: a replicate unit (DDP) made real on every rank (moonshard -n N ddp_units.lua
-- MESH CAP_MB [frozen]): a model of mixed f32 and bf16 parameters (and with "frozen", one
-- frozen parameter) planned as ctx:replicate(model, {bucket_cap_mb = CAP_MB}); per bucket
-- unit: the parameters whole on every rank, each rank's gradients reduced and checked against
-- their mean computed here, the one all_reduce per bucket the unit recorded (group, dtype,
-- bytes), AdamW's first step on the whole parameter against its formula, and the bytes each
-- rank allocated against the plan.  Prints "rank R: replicate ok ..." per rank.
local ms = require "moonshard"
local module = require "moonshard.module"

local mesh = require("moonshard.mesh_context").new(arg[1] or "dp_shard=4")
local cap = tonumber(arg[2] or "0.0001")
local tree = module.new("Toy")
tree:param("scale", { 5 }, "f32")
local a = tree:add("a", module.new("Linear"))
a:param("weight", { 6, 4 }, "bf16")
a:param("bias", { 6 }, "bf16")
tree:add("b", module.new("Linear")):param("weight", { 3, 6 }, "f32")
tree:add("c", module.new("Linear")):param("weight", { 10, 3 }, "f32")
tree:add("n", module.new("Norm")):param("weight", { 10 }, "bf16")
if arg[3] == "frozen" then tree.children.b.params.weight.requires_grad = false end

local plan = require("moonshard.plan").plan(tree, mesh, { parallelize = function(ctx)
  ctx:replicate(ctx.model, { bucket_cap_mb = cap })
end })
local state = require("moonshard.runtime").materialize(plan)
local rank, n = ms.rank(), ms.world_size()
local pu = plan.units[1]

local wrong = {}
local function check(cond, what) if not cond then wrong[#wrong + 1] = what end end

local SIZE = { f32 = 4, bf16 = 2 }
local index = {} -- fqn -> its position in the model (the values depend on it)
local numel, dtype_of, trainable = {}, {}, {}
for i, np in ipairs(tree:named_parameters()) do
  index[np[1]], numel[np[1]], dtype_of[np[1]] = i, np[2].numel, np[2].dtype
  trainable[np[1]] = np[2].requires_grad
end
-- multiples of 1/64: exact in bf16, and so are their means over 1, 2 or 4 ranks
local function value(k, j) return ((k * 7 + j * 5) % 64) / 64 - 0.5 end
local function grad_value(r, k, j) return (((r + 1) * (k + 3) + j % 11) % 64) / 64 end
local function full(fqn, fn)
  local vals = {}
  for j = 0, numel[fqn] - 1 do vals[j + 1] = fn(j) end
  return vals
end

-- the units: one per bucket, in DDP's order, then the frozen parameters'
local units = state.replicas[pu.name]
local expect = #pu.buckets + (arg[3] == "frozen" and 1 or 0)
check(#units == expect, string.format("%d runtime units, expected %d", #units, expect))
check(#pu.buckets > 1, "the plan has a single bucket; the cap should split them")

local max_diff, max_step = 0, 0
for ui, u in ipairs(units) do
  local fqns = {}
  for i = 0, u:count() - 1 do fqns[#fqns + 1] = u:fqn(i) end
  local b = pu.buckets[ui]
  if b then check(table.concat(fqns, ",") == table.concat(b.fqns, ","), u:name() .. " holds " .. table.concat(fqns, ",")) end
  for i, fqn in ipairs(fqns) do
    u:load_full(i - 1, ms.from_table(full(fqn, function(j) return value(index[fqn], j) end), "f64", { numel[fqn] })
      :view(u:param_shard(i - 1):shape()))
  end
  u:unshard()
  u:wait()
  for i, fqn in ipairs(fqns) do
    local got = u:param_full(i - 1):totable()
    local want = full(fqn, function(j) return value(index[fqn], j) end)
    local bad = 0
    for j = 1, #want do if got[j] ~= want[j] then bad = bad + 1 end end
    check(bad == 0, string.format("%s: %d values of the whole parameter differ", fqn, bad))
    check(u:param_shard(i - 1):numel() == numel[fqn], fqn .. ": the rank does not hold it whole")
  end
  if b then
    for i, fqn in ipairs(fqns) do
      u:grad_full(i - 1):copy_(ms.from_table(full(fqn, function(j) return grad_value(rank, index[fqn], j) end), "f64",
        { numel[fqn] }):view(u:grad_full(i - 1):shape()))
    end
    u:reduce_grads()
    u:wait()
    for i, fqn in ipairs(fqns) do
      local got = u:grad_shard(i - 1):totable()
      for j = 1, #got do
        local s = 0
        for q = 0, n - 1 do s = s + grad_value(q, index[fqn], j - 1) end
        max_diff = math.max(max_diff, math.abs(got[j] - s / n))
      end
    end
    -- the collectives: one all_reduce of the bucket over the n ranks, in its dtype (and the
    -- one-rank shard group's copy, which moves nothing between ranks)
    local ar, others = {}, {}
    for _, r in ipairs(u:records()) do
      if r.kind == "all_reduce" then ar[#ar + 1] = r
      elseif r.group_size ~= 1 then others[#others + 1] = r.kind .. " over " .. r.group_size end
    end
    check(#others == 0, u:name() .. ": collectives over several ranks besides the all_reduce: " .. table.concat(others, ", "))
    local bytes = 0
    for _, fqn in ipairs(fqns) do bytes = bytes + numel[fqn] * SIZE[dtype_of[fqn]] end
    if n > 1 then
      check(#ar == 1, string.format("%s: %d all_reduces, expected 1", u:name(), #ar))
      local r = ar[1] or {}
      check(r.group_size == n and r.dtype == b.dtype and r.bytes == bytes,
        string.format("%s: all_reduce over %s ranks in %s of %s bytes; expected %d, %s, %d", u:name(),
          tostring(r.group_size), tostring(r.dtype), tostring(r.bytes), n, b.dtype, bytes))
    else
      check(#ar == 0, u:name() .. ": an all_reduce on one rank")
    end
    -- AdamW's first step on the whole parameter: m = (1 - b1) g, v = (1 - b2) g^2, bias
    -- corrected to g and g^2: p <- p (1 - lr wd) - lr g / (|g| + eps)
    local lr, wd, eps = 0.01, 0.1, 1e-8
    u:adamw_step({ lr = lr, step = 1, betas = { 0.9, 0.999 }, eps = eps, weight_decay = wd })
    for i, fqn in ipairs(fqns) do
      local got, g = u:param_shard(i - 1):totable(), u:grad_shard(i - 1):totable()
      for j = 1, #got do
        local p0 = value(index[fqn], j - 1)
        local want = p0 * (1 - lr * wd) - lr * g[j] / (math.abs(g[j]) + eps)
        -- bf16 parameters keep an f32 master: the stored value is it rounded to bf16
        max_step = math.max(max_step, math.abs(got[j] - want) / (dtype_of[fqn] == "bf16" and 2 ^ -8 or 1e-6))
      end
    end
  else
    for i, fqn in ipairs(fqns) do check(not trainable[fqn], fqn .. " is trainable but in no bucket") end
  end
end
check(max_diff == 0, string.format("gradients differ from the mean by up to %g", max_diff))
check(max_step <= 1, string.format("AdamW's step differs from its formula by %g of the tolerance", max_step))

-- memory: the parameters and their gradients whole, as planned (the plan's grads add DDP's
-- bucket copy, which the runtime units do not keep: they reduce from a transient buffer)
local real = state:allocated()
check(real.params == plan.memory.params, string.format("params: %d bytes allocated, %d planned", real.params,
  plan.memory.params))
check(real.grads == plan.memory.grads - pu.bucket_buffer_bytes, string.format("grads: %d bytes allocated, %d planned " ..
  "less the bucket copy %d", real.grads, plan.memory.grads, pu.bucket_buffer_bytes))

if #wrong > 0 then error(string.format("rank %d: %d checks failed:\n  %s", rank, #wrong, table.concat(wrong, "\n  ")), 0) end
print(string.format("rank %d: replicate ok (%d buckets, gradient max diff %g, params %d B, grads %d B)", rank,
  #pu.buckets, max_diff, real.params, real.grads))
