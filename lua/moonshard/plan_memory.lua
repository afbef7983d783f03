-- moonshard.plan_memory: what every rank holds (see moonshard.plan): parameter, gradient and
-- optimizer state shards, the peak of unsharded parameters, buffers, and what is offloaded.

local util = require "moonshard.util"
local numel_of = require("moonshard.plan_layout").numel_of

local Mem = {}

-- The planner's helpers (moonshard.plan gives them to bind): its errors and checked sums.
local plan, fail, add, mul, too_big, is_ancestor, DTYPE_SIZE, FLOAT, MAX

--- Takes the planner's helpers h (plan: the planner module; fail, add, mul, too_big,
-- is_ancestor, DTYPE_SIZE, FLOAT, MAX); returns Mem.
function Mem.bind(h)
  plan, fail, add, mul, too_big, is_ancestor = h.plan, h.fail, h.add, h.mul, h.too_big, h.is_ancestor
  DTYPE_SIZE, FLOAT, MAX = h.DTYPE_SIZE, h.FLOAT, h.MAX
  -- The terms of a rank's peak, in the order the plan names them.
Mem.PEAK_TERMS = { "params", "grads", "optimizer", "peak_unsharded", "buffers", "activations", "transient", "overhead" }

--- A run's terms (the run's figure, else the summary's): {name -> bytes}.
function Mem.terms_of(mem, run)
  local t = {}
  for _, k in ipairs(Mem.PEAK_TERMS) do t[k] = run[k] or mem[k] end
  t.optimizer, t.total = run.optimizer, run.total
  return t
end

--- With a batch (the activations counted): each run's peak, the device memory a rank needs
-- at its worst moment = total (params, grads, optimizer state, unsharded units at their
-- peak, buffers) + activations + transient + overhead (with a device profile; 0 without),
-- less what offloading holds in host memory.  With a device profile (mem.capacity) also the
-- verdict: mem.fit = {fits (every rank), over (the ranks that do not fit), worst = {rank,
-- peak, headroom (capacity - peak, negative when over), largest = {name, bytes}}}.
function Mem.peaks(mem)
  if mem.activations == nil then return end
  local worst
  local over = 0
  for _, run in ipairs(mem.runs) do
    local t = Mem.terms_of(mem, run)
    run.peak = run.total - (run.offloaded or 0) + (t.activations or 0) + (t.transient or 0) + (t.overhead or 0)
    if mem.capacity and run.peak > mem.capacity then over = over + run.count end
    if not worst or run.peak > worst.peak then worst = { rank = run.first, peak = run.peak, run = run } end
  end
  mem.peak = mem.runs[1].peak
  if not mem.capacity then return end
  local t = Mem.terms_of(mem, worst.run)
  local off = worst.run.offloaded or 0
  local largest
  for _, k in ipairs(Mem.PEAK_TERMS) do
    local v = t[k] or 0
    local name = k
    -- with offloading, the state on the device is one term (host memory holds the rest)
    if off > 0 and (k == "params" or k == "grads" or k == "optimizer") then
      name, v = "params, grads and optimizer state on the device", t.params + t.grads + t.optimizer - off
    end
    if not largest or v > largest.bytes then largest = { name = name, bytes = v } end
  end
  mem.fit = { fits = over == 0, over = over, worst = { rank = worst.rank, peak = worst.peak,
    headroom = mem.capacity - worst.peak, largest = largest } }
end

return Mem
end

-- The peak of unsharded parameters and gradients alive at once, walking the units in
-- forward order (pre-order of their modules) and then backward (the reverse): a unit is
-- gathered while its module and its descendants run, the next `forward` units are
-- prefetched, units that keep their parameters after forward stay gathered until their
-- backward, and in backward a unit also holds its unsharded gradient.
--
-- Walking t over the units, what is alive at t is: every earlier unit's kept bytes, the
-- extra of the earlier ones still gathered (the units whose modules contain t's, and in
-- backward the prefetched ones), t's own, and in forward the prefetched later ones.  The
-- units containing t's are a chain, kept on a stack as the walk goes (pre-order: a unit
-- leaves the stack when the walk leaves its module), and the rest are prefix sums, so the
-- walk is O(n log n) (a model of 1024 layers plans in well under a second, where a sum over
-- every unit at every step took minutes).
local function peak_unsharded(ctx, units)
  local order = {}
  for _, u in ipairs(units) do order[#order + 1] = u end
  table.sort(order, function(a, b)
    local pa, pb = ctx.preorder[a.module], ctx.preorder[b.module]
    if pa ~= pb then return pa < pb end
    return a.index < b.index
  end)
  local n = #order
  local function kept_bytes(u) -- what stays after forward
    if u.reshard == false then return u.unsharded_bytes end
    if util.is_int(u.reshard) then return util.idiv(u.unsharded_bytes, u.reshard) end
    return 0
  end
  local what = "the unsharded bytes alive at once"
  -- PU, PK: prefix sums of the gathered and the kept bytes (PK <= PU); D = U - K of a unit
  local PU, PK = { [0] = 0 }, { [0] = 0 }
  for i, u in ipairs(order) do
    PU[i] = add(PU[i - 1], u.unsharded_bytes, what)
    PK[i] = PK[i - 1] + kept_bytes(u)
  end
  local df, db = ctx.prefetch.forward, ctx.prefetch.backward
  local stack, SD = {}, { [0] = 0 } -- the units containing the current one; prefix sums of their D
  local peak = 0
  for t = 1, n do
    local mod = order[t].module
    while #stack > 0 and not is_ancestor(ctx, order[stack[#stack]].module, mod) do
      SD[#stack], stack[#stack] = nil, nil
    end
    local top = #stack
    local base = add(add(PK[t - 1], SD[top], what), order[t].unsharded_bytes, what)
    -- forward: the next df units are prefetched
    local last = math.min(n, t + df)
    peak = math.max(peak, add(base, PU[last] - PU[t], what))
    -- backward: the previous db units are prefetched (those not already counted as
    -- containing t); t holds its gradient too
    local lo = math.max(1, t - db)
    local a, z = 1, top + 1 -- the first stack entry at or after lo
    while a < z do
      local mid = util.idiv(a + z, 2)
      if stack[mid] >= lo then z = mid else a = mid + 1 end
    end
    local window = (PU[t - 1] - PU[lo - 1]) - (PK[t - 1] - PK[lo - 1]) - (SD[top] - SD[a - 1])
    peak = math.max(peak, add(add(base, window, what), order[t].unsharded_grad_bytes, what))
    stack[top + 1], SD[top + 1] = t, SD[top] + (PU[t] - PU[t - 1]) - (PK[t] - PK[t - 1])
  end
  return peak
end

-- Parameters and gradients live in padded shards, equal on every rank; AdamW state is kept
-- for the rows a rank really holds (as the runtime and PyTorch do), so it depends on the
-- rank's coordinate along each unit's shard axis.  torch.chunk gives a coordinate `c` rows,
-- one coordinate the rest, the others none: per axis a step function of the coordinate,
-- kept as its steps (O(parameters), whatever the axis size).  The units with offload_policy
-- "cpu" keep their part of params, grads and optimizer in host memory: `offloaded` sums it
-- the same way, in steps of its own.
--
-- The shards of the units and of expert parallelism: mem {params, grads, optimizer (what
-- every rank holds alike)}, host {params, grads} (the offloaded units' shares of them) and
-- events (shard axis -> list of {coordinate, optimizer bytes from it on, offloaded bytes}).
local function shards(ctx, optimizer, fqn_of)
  local mem = { params = 0, grads = 0, optimizer = 0 }
  local host = { params = 0, grads = 0 } -- the offloaded units' shares of mem.params, mem.grads
  local function state_bytes(stored)
    if optimizer == "torch_adamw" then return 2 * DTYPE_SIZE[stored] end
    return optimizer == "adamw" and (8 + (stored == "f32" and 0 or 4)) or 0
  end
  local events = {} -- shard axis -> list of {coordinate, optimizer bytes from it on, offloaded bytes}
  local function add_rows(axis, W, n, per_row, bytes, offloaded, fqn)
    local ev = events[axis]
    if not ev then
      ev = {}
      events[axis] = ev
    end
    local c = util.ceil_div(n, W)
    local full = math.min(W, util.idiv(n, c))
    local v = mul(c * per_row, bytes, "the optimizer state bytes of parameter %s", fqn)
    local h = offloaded and v or 0
    ev[#ev + 1] = { 0, v, h }
    ev[#ev + 1] = { full, -v, -h }
    local rest = n - full * c
    if rest > 0 and full < W then
      local rv = rest * per_row * bytes
      local rh = offloaded and rv or 0
      ev[#ev + 1] = { full, rv, rh }
      ev[#ev + 1] = { full + 1, -rv, -rh }
    end
  end
  for _, u in ipairs(ctx.units) do
    local grads = 0
    -- a megatron_fsdp unit's figures come from its buffers (moonshard.plan_megatron)
    if u.kind == "megatron_fsdp" then require("moonshard.plan_megatron").optimizer_events(u, events, state_bytes) end
    for _, e in ipairs(u.kind ~= "megatron_fsdp" and u.entries or {}) do
      if e.param.requires_grad and FLOAT[e.param.dtype] then
        grads = grads + numel_of(e.padded) * DTYPE_SIZE[e.param.dtype]
        local n = e.shape[e.dim + 1]
        if u.kind == "replicate" then -- whole on every rank of the unit's axis: the same everywhere
          mem.optimizer = add(mem.optimizer, mul(numel_of(e.shape), state_bytes(e.param.dtype),
            "the optimizer state bytes of parameter %s", e.fqn), "the optimizer state bytes per rank")
        elseif n > 0 then
          add_rows(u.mesh_axes[#u.mesh_axes], u.shard_size, n, util.idiv(numel_of(e.shape), n),
            state_bytes(e.param.dtype), u.offload ~= nil, e.fqn)
        end
      end
    end
    -- DDP's bucket buffers beside the gradients (gradient_as_bucket_view false)
    grads = grads + (u.bucket_buffer_bytes or 0)
    mem.params = add(mem.params, u.param_shard_bytes, "the parameter bytes per rank")
    mem.grads = add(mem.grads, grads, "the gradient bytes per rank")
    if u.offload then host.params, host.grads = host.params + u.param_shard_bytes, host.grads + grads end
  end
  -- expert parameters in no unit: each rank holds its experts whole
  for _, p in ipairs(ctx.ep_order) do
    local e = ctx.ep[p]
    local fqn = fqn_of[p]
    if not ctx.owner[p] then
      local ln = numel_of(e.local_shape)
      mem.params = add(mem.params, ln * DTYPE_SIZE[p.dtype], "the parameter bytes per rank")
      if p.requires_grad and FLOAT[p.dtype] then
        mem.grads = add(mem.grads, ln * DTYPE_SIZE[p.dtype], "the gradient bytes per rank")
        mem.optimizer = add(mem.optimizer, mul(ln, state_bytes(p.dtype), "the optimizer state bytes of %s", fqn),
          "the optimizer state bytes per rank")
      end
    end
  end
  return mem, host, events
end

-- Each axis's steps: starts (0-based coordinates, ascending, from 0) and the bytes from
-- each start on.  Axis a gives rank r the coordinate floor(r / stride) % size.
local function axis_steps(events, mesh)
  local axes = {}
  for _, axis in ipairs(util.sorted_keys(events)) do
    local ev = events[axis]
    table.sort(ev, function(x, y) return x[1] < y[1] end)
    local stride, size = mesh:stride(axis)
    local a = { stride = stride, size = size, starts = { 0 }, opt = { 0 }, host = { 0 } }
    local o, h = 0, 0
    for _, x in ipairs(ev) do
      if x[1] >= size then break end
      o, h = o + x[2], h + x[3]
      if x[1] > a.starts[#a.starts] then
        a.starts[#a.starts + 1], a.opt[#a.opt + 1], a.host[#a.host + 1] = x[1], o, h
      else
        a.opt[#a.opt], a.host[#a.host] = o, h
      end
    end
    for i, o in ipairs(a.opt) do
      if o > MAX then too_big("the optimizer state bytes of coordinate %d of %s", a.starts[i], axis) end
    end
    axes[#axes + 1] = a
  end
  return axes
end

-- Ranks in runs of equal figures, walked from step boundary to step boundary: as many
-- runs as the steps' pattern over the ranks has, not one table per rank.
local function rank_runs(mem, host, axes, world)
  local runs = {}
  local base = add(add(add(mem.params, mem.grads, "the bytes per rank"), mem.peak_unsharded, "the bytes per rank"),
    mem.buffers, "the bytes per rank")
  local host_base = host.params + host.grads
  local r = 0
  while r < world do
    local optimizer, offloaded, len = mem.optimizer, host_base, world - r
    for _, a in ipairs(axes) do
      local c = util.idiv(r, a.stride) % a.size
      local lo, hi = 1, #a.starts -- the last start <= c
      while lo < hi do
        local mid = util.idiv(lo + hi + 1, 2)
        if a.starts[mid] <= c then lo = mid else hi = mid - 1 end
      end
      optimizer = add(optimizer, a.opt[lo], "the optimizer state bytes of rank %d", r)
      offloaded = add(offloaded, a.host[lo], "the offloaded bytes of rank %d", r)
      len = math.min(len, ((a.starts[lo + 1] or a.size) - c) * a.stride - r % a.stride)
    end
    local last = runs[#runs]
    if last and last.optimizer == optimizer and last.offloaded == offloaded then
      last.count = last.count + len
    else
      runs[#runs + 1] = { first = r, count = len, optimizer = optimizer, offloaded = offloaded,
        total = add(base, optimizer, "the bytes of rank %d", r) }
    end
    r = r + len
  end
  return runs
end

--- The memory of every rank: params, grads, optimizer, peak_unsharded (and
-- peak_unsharded_other, the peak under the other common prefetch), buffers, total and
-- offloaded, rank 0's; runs ({first, count, optimizer, offloaded, total}: every rank's, in
-- runs of equal ranks); per_rank (a table per rank, built when read).
function Mem.per_rank(ctx, model, mesh, optimizer, fqn_of, buffer_ok)
  local mem, host, events = shards(ctx, optimizer, fqn_of)
  mem.peak_unsharded = peak_unsharded(ctx, ctx.units)
  -- the same peak with the other common prefetch: FSDP2's implicit (1, 1) against Automodel's
  -- explicit chains (enable_fsdp2_prefetch: forward 1, backward 2), so a reader sees both
  do
    local pf = ctx.prefetch
    local other = (pf.forward == 1 and pf.backward == 1) and { forward = 1, backward = 2 } or { forward = 1, backward = 1 }
    ctx.prefetch = other
    mem.peak_unsharded_other = { prefetch = other, bytes = peak_unsharded(ctx, ctx.units) }
    ctx.prefetch = pf
  end
  -- Buffers are never sharded: every rank holds all of them (FSDP2 moves them to the device
  -- whole; Automodel's MoE parallelizer replicates e_score_correction_bias over the FSDP mesh).
  mem.buffers = 0
  for _, nb in ipairs(model:named_buffers()) do
    if not buffer_ok or buffer_ok[nb[1]] then
      mem.buffers = add(mem.buffers, nb[2].numel * DTYPE_SIZE[nb[2].dtype], "the buffer bytes per rank")
    end
  end
  local world = mesh.world
  local runs = rank_runs(mem, host, axis_steps(events, mesh), world)
  Mem.attach(mem, runs, world)
  return mem
end

-- Gives mem its runs (rank 0's figures as the summary) and its per_rank list, built when
-- read.
function Mem.attach(mem, runs, world)
  -- the summary figures are rank 0's; runs has every rank's, per_rank too (built when read)
  mem.optimizer, mem.total, mem.offloaded = runs[1].optimizer, runs[1].total, runs[1].offloaded
  mem.runs = runs
  setmetatable(mem, { __index = function(t, k)
    if k ~= "per_rank" then return nil end
    if world > plan.PER_RANK_LIMIT then
      fail(string.format("memory.per_rank makes a table for each of the %d ranks and is built for at most %d; " ..
        "memory.runs has the same figures in runs of equal ranks", world, plan.PER_RANK_LIMIT))
    end
    local list = {}
    for _, run in ipairs(runs) do
      for rank = run.first, run.first + run.count - 1 do
        list[rank + 1] = { rank = rank, params = run.params or t.params, grads = run.grads or t.grads,
          optimizer = run.optimizer, peak_unsharded = run.peak_unsharded or t.peak_unsharded,
          buffers = run.buffers or t.buffers,
          total = run.total, offloaded = run.offloaded,
          activations = run.activations or t.activations, transient = run.transient or t.transient,
          overhead = run.overhead, capacity = t.capacity, -- with a device profile (plan_time)
          peak = run.peak } -- with a batch (Mem.peaks)
      end
    end
    rawset(t, "per_rank", list)
    return list
  end })
end

--- The memory of every rank when ranks hold different things (the units of their pipeline
-- stages; unequal tensor-parallel pieces): mem_of(r) is the memory laid out for what rank r
-- holds (Mem.per_rank), and rank r takes what it says of r.  The summary figures are rank
-- 0's; the runs carry each rank's params, grads and peak too.
function Mem.combine(mem_of, mesh)
  local function run_of(runs, r)
    local lo, hi = 1, #runs
    while lo < hi do
      local mid = util.idiv(lo + hi + 1, 2)
      if runs[mid].first <= r then lo = mid else hi = mid - 1 end
    end
    return runs[lo]
  end
  local runs = {}
  for r = 0, mesh.world - 1 do
    local m = mem_of(r)
    local run = run_of(m.runs, r)
    local last = runs[#runs]
    if last and last.params == m.params and last.grads == m.grads and last.peak_unsharded == m.peak_unsharded and
        last.buffers == m.buffers and last.optimizer == run.optimizer and last.offloaded == run.offloaded and
        last.activations == m.activations and last.transient == m.transient then
      last.count = last.count + 1
    else
      runs[#runs + 1] = { first = r, count = 1, params = m.params, grads = m.grads, peak_unsharded = m.peak_unsharded,
        buffers = m.buffers, optimizer = run.optimizer, offloaded = run.offloaded, total = run.total,
        activations = m.activations, transient = m.transient }
    end
  end
  local base = mem_of(0)
  local mem = { params = base.params, grads = base.grads, peak_unsharded = base.peak_unsharded,
    peak_unsharded_other = base.peak_unsharded_other, buffers = base.buffers, activations = base.activations,
    transient = base.transient }
  Mem.attach(mem, runs, mesh.world)
  return mem
end

return Mem
