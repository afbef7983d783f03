-- moonshard.plan_time: an estimate of one training step's time on a device profile
-- (moonshard.devices), from the plan: compute from FLOPs at an efficiency, every collective
-- from its bus bytes and the links its group spans, FSDP's all-gathers and reduce-scatters
-- overlapped with compute unit by unit, and the pipeline's bubble.  Every figure is an
-- estimate; docs/planning.md ("Step time") lists the assumptions, each also noted here.

local util = require "moonshard.util"
local devices = require "moonshard.devices"

local T = {}

-- The share of the peak FLOP/s the matmuls and attention reach: a stated default, since a
-- well-tuned dense run reaches 40 to 60% MFU (torchtitan's published runs) and the rest of
-- the step is communication and the bubble, counted separately.
T.DEFAULT_EFFICIENCY = 0.5

-- ---------------------------------------------------------------- links

--- Whether a group of n ranks, stride apart in the rank order, stays inside a node of
-- gpus_per_node ranks (nodes hold consecutive ranks): every group of an axis does when the
-- groups' blocks (stride x n ranks) tile the nodes, or when the world fits one node; else
-- some group crosses nodes, and a collective waits for its slowest group.  "intra" or
-- "inter"; nil for a group of one rank.
function T.link(world, gpus_per_node, stride, n)
  if n <= 1 then return nil end
  if world <= gpus_per_node or gpus_per_node % (stride * n) == 0 then return "intra" end
  return "inter"
end

--- The link of a mesh axis's groups (k: the innermost k ranks of the axis, as a reshard to
-- k ranks uses).
local function axis_link(mesh, dev, axis, k)
  local stride, size = mesh:stride(axis)
  return T.link(mesh.world, dev.gpus_per_node, stride, k or size)
end

--- Seconds of `count` collectives moving `bytes` bus bytes in all over a link: a latency
-- per call plus the bytes at the link's bus bandwidth.
function T.collective_s(dev, link, count, bytes)
  if not link or count == 0 then return 0 end
  if link == "intra" then return count * dev.intra_node_latency_s + bytes / dev.intra_node_bytes_per_s end
  return count * dev.inter_node_latency_s + bytes / dev.inter_node_bytes_per_s
end

-- ---------------------------------------------------------------- FLOPs

-- The features of a linear's weight [out, in], this rank's tensor-parallel piece (tp rank
-- 0's) unless global.
local function features(ctx, w, dim, global)
  local t = not global and ctx.tp[w]
  local shape = t and t.local_shapes and t.local_shapes[1] or w.shape
  return shape[dim]
end

local numel = require("moonshard.plan_layout").numel_of

-- The query and output features of an attention module: its query projection's outputs
-- (q_proj, q_b_proj or wq_b) and its output projection's inputs (o_proj; the query's when it
-- has none); nil when it has no query projection.
local function attention_features(ctx, m, global)
  local q
  for _, name in ipairs({ "q_proj", "q_b_proj", "wq_b" }) do
    local c = m.children[name]
    if c and c.params.weight and #c.params.weight.shape == 2 then
      q = c.params.weight
      break
    end
  end
  if not q then return nil end
  local qf = features(ctx, q, 1, global)
  local o = m.children.o_proj and m.children.o_proj.params.weight
  return qf, o and #o.shape == 2 and features(ctx, o, 2, global) or qf, q
end

--- The forward FLOPs a token costs, per unit: walks the model (under a pipeline only the
-- modules of pp rank `pp_rank`'s stages; every module when nil) and gives each unit
-- {matmul = {dtype = FLOPs}, recompute = {dtype = FLOPs}, attention = {dtype = FLOPs},
-- weights = FLOPs}: 2 x the elements of every weight of 2 or more dims outside an
-- Embedding (this rank's tensor-parallel piece unless global; grouped experts by top_k /
-- experts), in its compute dtype; attention's own (causal: each query meets seq_len / 2
-- keys on average, QK^T and AV, 2 FLOPs a multiply-add: seq_len x (query + output
-- features)); recompute, the forward of modules under activation checkpointing again.
-- Compute outside every unit goes to key false.  Also returns the attention modules it
-- could not size.
function T.flops(ctx, seq_len, pp_rank, global)
  local plan = require "moonshard.plan"
  local pp = ctx.pp
  local wrapped = {}
  for _, w in ipairs(ctx.checkpointed) do wrapped[w] = true end
  local by_unit, order, skipped = {}, {}, 0
  local function slot(u)
    local key = u or false
    if not by_unit[key] then
      by_unit[key] = { matmul = {}, recompute = {}, attention = {}, frozen = {}, weights = 0 }
      order[#order + 1] = key
    end
    return by_unit[key]
  end
  local function put(t, dtype, v) t[dtype] = (t[dtype] or 0) + v end
  local function dtype_of(p, u)
    local owner = ctx.owner[p] or u
    return owner and owner.mp and (plan.effective_dtypes(p.dtype, plan.param_mp(owner, p))) or p.dtype
  end
  local function walk(m, cur, active, recompute)
    local s = pp and pp.stage_of[m]
    local mine = not pp or pp_rank == nil or (s ~= nil and pp.stages[s + 1].rank == pp_rank)
    cur = ctx.unit_of[m] or cur
    if wrapped[m] then recompute = true end
    if mine then
      if m.type ~= "Embedding" then
        for _, pname in ipairs(m.param_order) do
          local p = m.params[pname]
          -- a 4-bit weight (a recipe's quantization) counts at its logical shape, in its
          -- compute dtype; an fp8 linear's (torchao's Float8Linear) matmuls run in e4m3
          local shape = p.quant and p.quant.shape or p.shape
          if #shape >= 2 then
            local n = numel((not global and ctx.tp[p] and ctx.tp[p].local_shapes and ctx.tp[p].local_shapes[1]) or shape)
            local f = 2 * n * active
            local u = ctx.owner[p] or cur
            local e, d = slot(u), p.quant and p.quant.compute or dtype_of(p, u)
            if m.attrs and m.attrs.fp8 and pname == "weight" then d = "f8e4m3" end
            put(e.matmul, d, f)
            -- a frozen weight (a LoRA base) has no weight-gradient matmul in backward
            if not p.requires_grad then put(e.frozen, d, f) end
            e.weights = e.weights + f
            if recompute then put(e.recompute, d, f) end
          end
        end
      end
      if type(m.type) == "string" and m.type:find("Attention$") then
        local qf, of, q = attention_features(ctx, m, global)
        if qf then
          local u = ctx.owner[q] or cur
          local e = slot(u)
          local d = dtype_of(q, u)
          if d == "f8e4m3" or d == "f8e5m2" then d = "bf16" end -- attention runs in bf16
          local f = seq_len * (qf + of)
          put(e.attention, d, f)
          if recompute then put(e.recompute, d, f) end
        else
          skipped = skipped + 1
        end
      end
    end
    for _, c in ipairs(m.child_order) do
      local child = m.children[c]
      local a = active
      if child.type == "GroupedExperts" then
        local k, n = m.attrs and m.attrs.top_k, m.attrs and m.attrs.n_experts
        if util.is_int(k) and util.is_int(n) and n > 0 then a = active * k / n end
      end
      walk(child, cur, a, recompute)
    end
  end
  walk(ctx.model, nil, 1, false)
  return by_unit, order, skipped
end

-- The sum of a {dtype = FLOPs} table.
local function total(t)
  local s = 0
  for _, v in pairs(t) do s = s + v end
  return s
end

-- Seconds for {dtype = FLOPs} x factor at the device's peak for each dtype and the efficiency.
local function seconds(t, factor, dev, eff)
  local s = 0
  for d, v in pairs(t) do s = s + v * factor / (devices.peak(dev, d) * eff) end
  return s
end

-- ---------------------------------------------------------------- one micro-batch

-- Simulates one micro-batch of FSDP2's streams: a compute stream and an all-gather stream in
-- forward and backward, and a reduce-scatter stream (the HSDP all-reduce after each
-- reduce-scatter, on the same stream), as FSDP2 issues them.  units: in forward order, each
-- {cf, cb (compute seconds), agf, agb (all-gather seconds, nil when none), rs (seconds, nil
-- when none), name}.  A unit's forward all-gather is issued when the unit `pf` ahead of it
-- starts computing (FSDP2's prefetch; at its own start with no prefetch), and runs once the
-- stream is free; its compute starts when the gather is done and the previous compute is.
-- Backward mirrors it with pb, in reverse order.  Returns the duration and the events
-- ({lane, label, t0, t1}) when events is a table.
function T.micro_batch(units, pf, pb, flags, events)
  local cmp, ag, rs = 0, 0, 0
  local function ev(lane, label, t0, t1)
    if events and t1 > t0 then events[#events + 1] = { lane = lane, label = label, t0 = t0, t1 = t1 } end
  end
  local n = #units
  -- the k-th unit of a pass (u), gathered (when gather is its seconds) once the stream is
  -- free and the unit `ahead` before it in the pass has started (its own start without
  -- prefetch), then computed for c seconds; starts[k] its start
  local function run_unit(u, k, starts, ahead, gather, c)
    local ready = 0
    if gather then
      local t0 = math.max(ag, k - ahead >= 1 and starts[k - ahead] or cmp)
      ag = t0 + gather
      ev("all_gather", u.name, t0, ag)
      ready = ag
    end
    starts[k] = math.max(cmp, ready)
    cmp = starts[k] + c
    ev("compute", u.name, starts[k], cmp)
  end
  local fstart, bstart = {}, {}
  for i = 1, n do
    local u = units[i]
    run_unit(u, i, fstart, pf, flags.forward_gather and u.agf, u.cf)
  end
  for j = 1, n do
    local u = units[n + 1 - j]
    run_unit(u, j, bstart, pb, flags.backward_gather and u.agb, u.cb)
    if flags.reduce and u.rs then
      local t0 = math.max(rs, cmp)
      rs = t0 + u.rs
      ev("reduce_scatter", u.name, t0, rs)
    end
  end
  return math.max(cmp, ag, rs)
end

-- ---------------------------------------------------------------- the step

-- A unit's collectives in seconds: forward and backward all-gather, reduce-scatter with the
-- HSDP all-reduce; and the totals by kind into sums[kind] = {count, bytes, seconds, links}.
-- Times `count` collectives of `kind` over a link and adds them to sums; returns the seconds.
local function record(sums, dev, kind, link, count, bytes)
  local s = T.collective_s(dev, link, count, bytes)
  local e = sums[kind]
  e.count, e.bytes, e.seconds = e.count + count, e.bytes + bytes, e.seconds + s
  if link then e.links[link] = true end
  return s
end

local function unit_comm(mesh, dev, u, sums)
  local function add(kind, link, count, bytes) return record(sums, dev, kind, link, count, bytes) end
  local axes = u.mesh_axes
  local shard, out = axes[#axes], {}
  local ag = u.comm.all_gather
  if ag[1] then out.agf = add("all_gather", axis_link(mesh, dev, shard, ag[1].n), 1, ag[1].bytes) end
  if ag[2] then out.agb = add("all_gather", axis_link(mesh, dev, shard, ag[2].n), 1, ag[2].bytes) end
  local r = u.comm.reduce_scatter
  -- (a packed unit: one reduce-scatter per reduce dtype, r.count)
  if r then out.rs = add("reduce_scatter", axis_link(mesh, dev, shard), r.count or 1, r.bytes) end
  local a = u.comm.all_reduce
  if a then out.rs = (out.rs or 0) + add("all_reduce", axis_link(mesh, dev, axes[1]), a.count or 1, a.bytes) end
  return out
end

-- Tensor, context and expert parallelism's collectives a micro-batch, forward and backward,
-- as the plan counts them for pp rank 0 (comm.tensor_parallel, comm.context_parallel and the
-- expert all_to_all), in seconds over their axes; and the once-a-step all-reduce of
-- sequence-parallel norms' gradients.  Into sums as unit_comm does.
local function activation_comm(mesh, dev, comm, tokens, sums)
  local fwd, bwd, once = 0, 0, 0
  local function add(kind, axis, count, bytes) return record(sums, dev, kind, axis_link(mesh, dev, axis), count, bytes) end
  local M = tokens.accumulation
  local tpc = comm.tensor_parallel
  if tpc then
    for _, k in ipairs({ "all_reduce", "all_gather", "reduce_scatter" }) do
      fwd = fwd + add(k, "tp", tpc.forward[k].count * M, tpc.forward[k].bytes * M) / M
      bwd = bwd + add(k, "tp", tpc.backward[k].count * M, tpc.backward[k].bytes * M) / M
    end
    once = once + add("all_reduce", "tp", tpc.norm_grads.count, tpc.norm_grads.bytes)
  end
  local cpc = comm.context_parallel
  local cp_a2a = { count = 0, bytes = 0 }
  if cpc then
    for _, k in ipairs({ "all_gather", "all_to_all" }) do
      fwd = fwd + add(k, "cp", cpc.forward[k].count * M, cpc.forward[k].bytes * M) / M
      bwd = bwd + add(k, "cp", cpc.backward[k].count * M, cpc.backward[k].bytes * M) / M
    end
    cp_a2a.count = (cpc.forward.all_to_all.count + cpc.backward.all_to_all.count) * M
    cp_a2a.bytes = (cpc.forward.all_to_all.bytes + cpc.backward.all_to_all.bytes) * M
  end
  -- expert parallelism's dispatch and combine: half forward, half backward
  local ep_count, ep_bytes = comm.all_to_all.count - cp_a2a.count, comm.all_to_all.bytes - cp_a2a.bytes
  if ep_count > 0 then
    local s = add("all_to_all", "ep", ep_count, ep_bytes) / M
    fwd, bwd = fwd + s / 2, bwd + s / 2
  end
  return fwd, bwd, once
end

-- The pipeline's bubble (idle time of the bottleneck rank a step) under a schedule, from
-- one micro-batch's forward f, backward b (both on the rank, all its stages) and the
-- weight-gradient part w of b, pp ranks, v stages a rank:
--   GPipe, 1F1B                 (pp - 1)(f + b)                       (GPipe, Huang et al. 2019;
--                               1F1B, Narayanan et al. 2021: the same bubble, less memory)
--   Interleaved1F1B, LoopedBFS  (pp - 1)(f + b) / v                   (Narayanan et al. 2021, SC'21;
--                               Lamy-Poirier 2023 for breadth-first)
--   InterleavedZeroBubble       (pp - 1)(f + b - 2w) / v              (ZB1P in DeepSeek-V3's report,
--                               Table 2, by chunk)
--   ZBVZeroBubble               (pp - 1) max(0, F + B - 3W), F, B, W a chunk's (f, b, w / 2):
--                               ZB-V, Qi et al. 2024, T_F + T_B - 2T_W with T_B the input-gradient
--                               part; zero when the three are equal
--   DualPipeV                   max(0, pp/2 - 1)(F&B + B - 3W), F&B = F + B by chunk (DualPipe's row
--                               of DeepSeek-V3's Table 2; DualPipeV taken to match)
function T.bubble(schedule, pp, v, f, b, w)
  if pp <= 1 then return 0 end
  if schedule == "GPipe" or schedule == "1F1B" then return (pp - 1) * (f + b) end
  if schedule == "Interleaved1F1B" or schedule == "LoopedBFS" then return (pp - 1) * (f + b) / v end
  if schedule == "InterleavedZeroBubble" then return (pp - 1) * math.max(0, f + b - 2 * w) / v end
  local F, B, W = f / v, b / v, w / v
  if schedule == "ZBVZeroBubble" then return (pp - 1) * math.max(0, F + B - 3 * W) end
  if schedule == "DualPipeV" then return math.max(0, pp / 2 - 1) * math.max(0, (F + B) + B - 3 * W) end
  error("moonshard: plan_time: no bubble rule for schedule " .. tostring(schedule), 0)
end

-- CPU offload's rates, assumptions (no profile holds them): host <-> device copies at 25 GB/s
-- a direction (PCIe 4 x16 or 5 x16 as achieved), and the host's AdamW on the offloaded state at
-- 20 GB/s of host memory traffic.
T.HOST_LINK_BYTES_PER_S, T.HOST_OPTIMIZER_BYTES_PER_S = 25e9, 20e9

--- The optimizer step's seconds: AdamW is bound by memory: it reads the parameters, the
-- gradients and its state and writes the parameters and the state back, at the HBM bandwidth.
-- With CPU offload (mem.offloaded: the bytes of parameters, gradients and state in host
-- memory), that part steps on the host instead, and the parameter shards and gradients cross
-- the host link once each way (the parameters' copies to the device for every gather, the
-- gradients' back: once a step here, an underestimate when micro-batches gather again).
function T.optimizer_s(dev, mem)
  local off = mem.offloaded or 0
  local total = 2 * (mem.params + mem.optimizer) + mem.grads
  local share = (mem.params + mem.grads + mem.optimizer) > 0 and off / (mem.params + mem.grads + mem.optimizer) or 0
  local device_s = total * (1 - share) / dev.hbm_bytes_per_s
  if off == 0 then return device_s end
  return device_s + total * share / T.HOST_OPTIMIZER_BYTES_PER_S + off / T.HOST_LINK_BYTES_PER_S
end

-- The units of pp rank p (all of them without a pipeline), in forward order, with their
-- FLOPs and collectives; comm sums added to sums.
local function rank_units(ctx, mesh, dev, eff, tokens, p, sums)
  local by_unit, order, skipped = T.flops(ctx, tokens.seq_len, p)
  local tok = util.idiv(tokens.micro_batch * tokens.seq_len, mesh:size("cp"))
  ctx:name_of(ctx.model) -- the preorder
  local list = {}
  local function entry(u)
    local f = by_unit[u or false] or { matmul = {}, recompute = {}, attention = {}, frozen = {}, weights = 0 }
    local fwd = seconds(f.matmul, tok, dev, eff) + seconds(f.attention, tok, dev, eff)
    -- backward: the input gradients (as the forward) and the weight gradients (as the
    -- forward, but none for frozen weights), and what checkpointing recomputes
    local frozen = seconds(f.frozen, tok, dev, eff)
    local e = { unit = u or nil, name = u and (u.name == "" and "<root>" or u.name) or "(no unit)",
      cf = fwd, cb = 2 * fwd - frozen + seconds(f.recompute, tok, dev, eff),
      w = seconds(f.matmul, tok, dev, eff) - frozen,
      flops = tok * (3 * (total(f.matmul) + total(f.attention)) - total(f.frozen) + total(f.recompute)),
      pos = u and (ctx.preorder[u.module] or 0) or 0 }
    if u then
      local c = unit_comm(mesh, dev, u, sums)
      e.agf, e.agb, e.rs = c.agf, c.agb, c.rs
    end
    list[#list + 1] = e
  end
  local seen = {}
  for _, u in ipairs(ctx.units) do
    if not ctx.pp or p == nil or ctx.pp.stages[u.stage + 1].rank == p then
      entry(u)
      seen[u] = true
    end
  end
  for _, key in ipairs(order) do
    if key == false then entry(nil) elseif not seen[key] then entry(key) end
  end
  table.sort(list, function(a, b)
    if a.pos ~= b.pos then return a.pos < b.pos end
    return (a.unit and a.unit.index or 0) < (b.unit and b.unit.index or 0)
  end)
  return list, skipped
end

-- The decoder layers of pp rank p's stages.
local function layers_of(pp, p)
  local n = 0
  for _, s in ipairs(pp.stages) do
    if s.rank == p then n = n + s.layers.count end
  end
  return n
end

--- estimate(ctx, mesh, tokens, comm, mem, device, opts) -> the step's time: {step_s,
-- tokens_per_s, mfu, exposed_comm_s, compute_s, bubble_s, optimizer_s, efficiency,
-- model_flops, collectives (by kind: count, bytes, seconds, links), stages (under a
-- pipeline: per pp rank), timeline (events of one step), notes}.  comm: the plan's (pp rank
-- 0's); mem: rank 0's memory.
function T.estimate(ctx, mesh, tokens, comm, mem, dev, opts)
  opts = opts or {}
  local eff = opts.efficiency or T.DEFAULT_EFFICIENCY
  local M = tokens.accumulation
  local sums = {}
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    sums[k] = { count = 0, bytes = 0, seconds = 0, links = {} }
  end
  local pf, pb = ctx.prefetch.forward, ctx.prefetch.backward
  local act_f, act_b, act_once = activation_comm(mesh, dev, comm, tokens, sums)
  local notes = {}
  local optimizer_s = T.optimizer_s(dev, mem)
  local out = { efficiency = eff, optimizer_s = optimizer_s, notes = notes, timeline = {} }
  -- spreads a micro-batch's exposed activation collectives over the units by their compute
  local function with_act(list, af, ab)
    local sf, sb = 0, 0
    for _, u in ipairs(list) do sf, sb = sf + u.cf, sb + u.cb end
    for _, u in ipairs(list) do
      u.xf, u.xb = sf > 0 and af * u.cf / sf or 0, sb > 0 and ab * u.cb / sb or 0
      u.cf, u.cb = u.cf + u.xf, u.cb + u.xb
    end
    return sf, sb
  end
  local skipped
  if not ctx.pp then
    local list
    list, skipped = rank_units(ctx, mesh, dev, eff, tokens, nil, sums)
    local cf, cb = with_act(list, act_f, act_b)
    local last = { forward_gather = true, backward_gather = true, reduce = true }
    local other = { forward_gather = true, backward_gather = true, reduce = false }
    -- micro-batches do not overlap each other's collectives; all but the last are alike
    local events = {}
    local t_last = T.micro_batch(list, pf, pb, last, events)
    local t_other = M > 1 and T.micro_batch(list, pf, pb, other) or 0
    out.compute_s = M * (cf + cb)
    out.bubble_s = 0
    out.step_s = (M - 1) * t_other + t_last + act_once + optimizer_s
    out.timeline = { { rank = 0, before = (M - 1) * t_other, micro_batches = M, events = events,
      step_s = out.step_s } }
  else
    local pp = ctx.pp
    local npp = mesh:size("pp")
    local layers0 = layers_of(pp, 0)
    local stages, worst, extra = {}, nil, 0
    local function fresh()
      local t = {}
      for k in pairs(sums) do t[k] = { count = 0, bytes = 0, seconds = 0, links = {} } end
      return t
    end
    for p = 0, npp - 1 do
      -- the collectives a step are pp rank 0's, as the plan's comm
      local list, sk = rank_units(ctx, mesh, dev, eff, tokens, p, p == 0 and sums or fresh())
      skipped = (skipped or 0) + sk
      local scale = layers0 > 0 and layers_of(pp, p) / layers0 or 1
      local cf, cb = with_act(list, act_f * scale, act_b * scale)
      local f, b, w = 0, 0, 0
      for _, u in ipairs(list) do f, b, w = f + u.cf, b + u.cb, w + u.w end
      -- the stage is gathered once a step and reduced after its last backward (the
      -- schedules keep it unsharded between micro-batches): what the collectives add to one
      -- micro-batch's compute is exposed once
      local events = {}
      local once = T.micro_batch(list, pf, pb, { forward_gather = true, backward_gather = false, reduce = true },
        events) - (f + b)
      local st = { pp_rank = p, forward_s = f, backward_s = b, weight_s = w, compute_s = M * (cf + cb),
        fsdp_exposed_s = once, busy_s = M * (f + b), events = events }
      stages[p + 1] = st
      if not worst or f + b > worst.forward_s + worst.backward_s then worst = st end
      extra = math.max(extra, once)
    end
    local bubble = T.bubble(pp.schedule.name, npp, pp.per_rank, worst.forward_s, worst.backward_s, worst.weight_s)
    out.compute_s = worst.compute_s
    out.bubble_s = bubble
    out.step_s = M * (worst.forward_s + worst.backward_s) + bubble + extra + act_once + optimizer_s
    for _, st in ipairs(stages) do st.idle_s = out.step_s - st.busy_s - st.fsdp_exposed_s - act_once - optimizer_s end
    out.stages = stages
    out.timeline = stages
    out.schedule = pp.schedule.name
    notes[#notes + 1] = "the pipeline's sends and receives overlap compute (not counted); its other ranks' tensor, " ..
      "context and expert parallelism's collectives are rank 0's per decoder layer"
  end
  out.exposed_comm_s = math.max(0, out.step_s - out.compute_s - out.bubble_s - optimizer_s)
  out.collectives = sums
  -- model FLOPs: the whole model's, a token's forward x 3 (forward and backward, no recompute),
  -- less the weight gradients frozen weights do not have
  local by_unit = T.flops(ctx, tokens.seq_len, nil, true)
  local per_token = 0
  local frozen = 0
  for _, f in pairs(by_unit) do
    per_token = per_token + total(f.matmul) + total(f.attention)
    frozen = frozen + total(f.frozen)
  end
  out.model_flops = (3 * per_token - frozen) * tokens.global_batch * tokens.seq_len
  out.tokens_per_s = tokens.global_batch * tokens.seq_len / out.step_s
  out.mfu = out.model_flops / (mesh.world * dev.bf16_flops * out.step_s)
  if skipped and skipped > 0 then
    notes[#notes + 1] = string.format("%d attention modules without a query projection: their scores not counted", skipped)
  end
  return out
end

--- The device's figures a plan gains (opts.device: a profile name, a FILE.lua or a table of
-- figures; opts.efficiency): result.device (the profile), memory.capacity and each run's
-- overhead (memory.per_rank[r].capacity, .overhead), and with a batch result.time.
function T.attach(result, ctx, opts)
  local dev = opts.device
  if type(dev) == "string" then dev = devices.get(dev, opts.device_limits)
  else dev = devices.check(dev, "opts.device") end
  local eff = opts.efficiency
  if eff ~= nil and (type(eff) ~= "number" or eff ~= eff or eff <= 0 or eff > 1) then
    error(string.format("moonshard: plan: efficiency is %s; expected a number in (0, 1], the share of the peak " ..
      "FLOP/s the compute reaches", tostring(eff)), 0)
  end
  local mem = result.memory
  mem.capacity = dev.memory_bytes
  -- what the allocator holds at the peak: the state on the device, and with a batch the
  -- activations and the transient peak (fragmentation is a share of it)
  local function held(run)
    return run.total - (run.offloaded or 0) + (run.activations or mem.activations or 0) +
      (run.transient or mem.transient or 0)
  end
  for _, run in ipairs(mem.runs) do run.overhead = devices.overhead(dev, held(run)).total end
  mem.overhead = devices.overhead(dev, held(mem.runs[1]))
  result.device = dev
  if result.tokens then
    result.time = T.estimate(ctx, result.mesh, result.tokens, result.comm, mem, dev, { efficiency = eff })
  end
  return result
end

-- ---------------------------------------------------------------- FP32 islands

--- The warning about latency-bound FP32 island units (kind "fp32_island"), or nil.  A unit's
-- collectives a step (its all-gathers once per gather, comm.gathers; its reduce-scatter; its
-- HSDP all-reduce) are latency bound, with a device profile, when their per-call latency
-- (dev's intra- or inter-node latency for the link of the unit's axis) adds up to more than
-- their bus bytes take at the link's bandwidth; without one, when its all-gather moves less
-- than plan.LATENCY_BOUND_BYTES a rank (the plan's latency-bound threshold).  Packing an
-- island into the nearest unit around it (same mesh) removes its all-gathers, and its
-- reduce-scatter and all-reduce when that unit already reduces in the island's reduce dtype;
-- the seconds saved are those calls' latency (an estimate, before overlap).  The remedy
-- named: the policy's pack_islands option (`--set pack_islands=true`) when it declares one
-- and it is off, else fully_shard's islands option.
function T.island_warning(ctx, result, dev)
  local plan = require "moonshard.plan"
  local mesh = ctx.mesh
  local gathers = result.comm.gathers or 1
  local unit_at = {}
  for _, u in ipairs(ctx.units) do
    if u.kind ~= "fp32_island" then unit_at[ctx:name_of(u.module)] = unit_at[ctx:name_of(u.module)] or u end
  end
  -- the nearest unit (not an island unit) whose module contains module `name`
  local function around(name)
    local n = name
    while n ~= "" do
      n = n:match("^(.*)%.[^.]+$") or ""
      if unit_at[n] then return unit_at[n] end
    end
    return nil
  end
  local function same_axes(a, b)
    if #a.mesh_axes ~= #b.mesh_axes then return false end
    for i, x in ipairs(a.mesh_axes) do if b.mesh_axes[i] ~= x then return false end end
    return true
  end
  local bound, saved = {}, { all_gather = 0, reduce_scatter = 0, all_reduce = 0, seconds = 0 }
  for _, u in ipairs(ctx.units) do
    local c = u.comm
    -- under a pipeline, pp rank 0's stages, as the communication per step and packing's
    -- total count them
    local mine = not ctx.pp or u.stage == nil or ctx.pp.stages[u.stage + 1].rank == 0
    if mine and u.kind == "fp32_island" and c and #u.params > 0 and (#c.all_gather > 0 or c.reduce_scatter or c.all_reduce) then
      local shard = u.mesh_axes[#u.mesh_axes]
      local lat, bw = 0, 0
      local calls = {} -- {kind, count, seconds of latency}
      local function call(kind, axis, n, count, bytes)
        local link
        if dev then
          local stride, size = mesh:stride(axis)
          link = T.link(mesh.world, dev.gpus_per_node, stride, n or size)
        end
        local l = 0
        if link then
          l = count * (link == "intra" and dev.intra_node_latency_s or dev.inter_node_latency_s)
          bw = bw + bytes / (link == "intra" and dev.intra_node_bytes_per_s or dev.inter_node_bytes_per_s)
        end
        lat = lat + l
        calls[#calls + 1] = { kind = kind, count = count, seconds = l }
      end
      for _, ag in ipairs(c.all_gather) do call("all_gather", shard, ag.n, gathers, ag.bytes * gathers) end
      if c.reduce_scatter then call("reduce_scatter", shard, nil, c.reduce_scatter.count or 1, c.reduce_scatter.bytes) end
      if c.all_reduce then call("all_reduce", u.mesh_axes[1], nil, c.all_reduce.count or 1, c.all_reduce.bytes) end
      local is_bound
      if dev then is_bound = lat > bw else is_bound = u.gather_bytes_per_rank < plan.LATENCY_BOUND_BYTES end
      local host = around(ctx:name_of(u.module))
      -- (a unit around it that gathers nothing would gather for it: nothing saved)
      if is_bound and host and same_axes(host, u) and #host.params > 0 and #host.comm.all_gather > 0 then
        bound[#bound + 1] = plan.display(u.name)
        local same_reduce = host.grad_shard_bytes > 0 and host.reduce_dtype_eff == u.reduce_dtype_eff
        for _, x in ipairs(calls) do
          if x.kind == "all_gather" or same_reduce then
            saved[x.kind] = saved[x.kind] + x.count
            saved.seconds = saved.seconds + x.seconds
          end
        end
      end
    end
  end
  if #bound == 0 then return nil end
  local declared, on = false, false
  for _, op in ipairs(result.options or {}) do
    if op.name == "pack_islands" then declared, on = true, op.value == true end
  end
  local them = #bound == 1 and "it into the unit around it" or "them into the units around them"
  local remedy = (declared and not on) and "set the policy's pack_islands option (--set pack_islands=true) to pack " ..
    them or "pack " .. them .. " with ctx:fully_shard(module, {islands = {...}}) (each island parameter keeps its own " ..
    "policy)"
  local n = saved.all_gather + saved.reduce_scatter + saved.all_reduce
  return string.format("%d FP32 island unit%s %s latency bound (%s): %s; %s: that saves %d collective%s a step%s " ..
    "(all-gather %d, reduce-scatter %d, all-reduce %d)%s",
    #bound, #bound == 1 and "" or "s", #bound == 1 and "is" or "are",
    dev and string.format("the latency of %s collectives a step exceeds their time at the link's bandwidth on %s",
      #bound == 1 and "its" or "their", dev.name) or string.format("%s all-gather moves less than %s a rank",
      #bound == 1 and "its" or "each", util.bytes(plan.LATENCY_BOUND_BYTES)),
    table.concat(bound, ", ", 1, math.min(#bound, 4)) .. (#bound > 4 and string.format(" (and %d more)", #bound - 4) or ""),
    remedy, n, n == 1 and "" or "s", ctx.pp and " on pp rank 0" or "", saved.all_gather, saved.reduce_scatter, saved.all_reduce,
    dev and string.format(" and about %s of collective latency a step (estimate, before overlap)", T.duration(saved.seconds))
      or "; give --device to estimate the seconds")
end

-- ---------------------------------------------------------------- output

--- A duration as the table shows it: 3 significant digits, in s, ms or us.
function T.duration(s)
  -- under a picosecond is the rounding of sums of seconds, not time (3.4e-15 s left by
  -- step - compute - bubble): shown as 0
  if math.abs(s) < 1e-12 then return "0 s" end
  if s >= 1 then return string.format("%.3g s", s) end
  if s >= 1e-3 then return string.format("%.3g ms", s * 1e3) end
  return string.format("%.3g us", s * 1e6)
end
local dur = T.duration

local function link_text(links)
  local l = {}
  if links.intra then l[#l + 1] = "intra-node" end
  if links.inter then l[#l + 1] = "inter-node" end
  return table.concat(l, " and ")
end

--- The table's lines about the device and the step's time (add: the report's line sink).
function T.text(plan, add)
  local dev, t = plan.device, plan.time
  add("")
  if not dev then
    add("time per step: not estimated; give the device, --device NAME|FILE (" .. table.concat(devices.NAMES, ", ") ..
      ", or a profile FILE.lua), and the batch, --seq-len S")
    return
  end
  local o = plan.memory.overhead
  add(string.format("device %s: %s per GPU, %d GPUs per node; overhead per rank %s outside the allocator's " ..
    "tensors (CUDA context %s, NCCL buffers %s, fragmentation %g%%: %s on rank 0)", dev.name,
    util.bytes(dev.memory_bytes), dev.gpus_per_node, util.bytes(o.total), util.bytes(o.cuda_context),
    util.bytes(o.nccl_buffers), dev.fragmentation * 100, util.bytes(o.fragmentation)))
  if not t then
    add("time per step: not estimated; give the batch, --seq-len S (with --micro-batch, --global-batch)")
    return
  end
  add(string.format("time per step (estimate, %s at %g%% of peak): %s; %s tokens/s; MFU %.1f%% (estimate)",
    dev.name, t.efficiency * 100, dur(t.step_s), util.thousands(math.floor(t.tokens_per_s + 0.5)), t.mfu * 100))
  add(string.format("  compute %s, exposed communication %s, pipeline bubble %s, optimizer %s (estimates)",
    dur(t.compute_s), dur(t.exposed_comm_s), dur(t.bubble_s), dur(t.optimizer_s)))
  local parts = {}
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    local c = t.collectives[k]
    if c.count > 0 then
      parts[#parts + 1] = string.format("%s %d in %s (%s)", k, c.count, dur(c.seconds), link_text(c.links))
    end
  end
  if #parts > 0 then
    add(string.format("  collectives a step%s, if nothing overlapped them: %s", t.stages and " (pp rank 0's)" or "",
      table.concat(parts, ", ")))
  end
  -- per pp rank, consecutive ranks that read alike on one line
  local lines, first = {}, {}
  for _, st in ipairs(t.stages or {}) do
    local line = string.format("a micro-batch forward %s, backward %s; busy %s, FSDP exposed %s, idle %s",
      dur(st.forward_s), dur(st.backward_s), dur(st.busy_s), dur(st.fsdp_exposed_s), dur(st.idle_s))
    if lines[#lines] == line then first[#first][2] = st.pp_rank
    else lines[#lines + 1], first[#first + 1] = line, { st.pp_rank, st.pp_rank } end
  end
  for i, line in ipairs(lines) do
    local r = first[i]
    add(string.format("  pp rank%s: %s", r[1] == r[2] and " " .. r[1] or string.format("s %d-%d", r[1], r[2]), line))
  end
  for _, n in ipairs(t.notes) do add("  note: " .. n) end
  add("  assumptions: docs/planning.md, \"Step time\"")
end

-- A number for the JSON: whole numbers as integers, others with 6 significant digits.
local function jnum(n)
  if n == math.floor(n) and math.abs(n) < 2 ^ 53 then return string.format("%d", n) end
  return string.format("%.6g", n)
end

--- The JSON's "device" and "time" members (jstr, jobj: the report's encoders), ending ",\n".
function T.json(plan, jstr, jobj)
  local dev, t = plan.device, plan.time
  if not dev then return "" end
  local fields = {}
  for _, k in ipairs(devices.KEYS) do
    local v = dev[k[1]]
    if k[1] ~= "base" then
      fields[#fields + 1] = { k[1], v == nil and "null" or type(v) == "string" and jstr(v) or jnum(v) }
    end
  end
  local out = ' "device":' .. jobj(fields) .. ",\n"
  if not t then return out end
  local coll = {}
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    local c = t.collectives[k]
    local links = {}
    if c.links.intra then links[#links + 1] = jstr("intra") end
    if c.links.inter then links[#links + 1] = jstr("inter") end
    coll[#coll + 1] = { k, jobj({ { "count", jnum(c.count) }, { "bytes", jnum(c.bytes) }, { "seconds", jnum(c.seconds) },
      { "links", "[" .. table.concat(links, ",") .. "]" } }) }
  end
  local stages = "null"
  if t.stages then
    local rows = {}
    for i, st in ipairs(t.stages) do
      rows[i] = jobj({ { "pp_rank", jnum(st.pp_rank) }, { "forward_s", jnum(st.forward_s) },
        { "backward_s", jnum(st.backward_s) }, { "busy_s", jnum(st.busy_s) }, { "fsdp_exposed_s", jnum(st.fsdp_exposed_s) },
        { "idle_s", jnum(st.idle_s) } })
    end
    stages = "[" .. table.concat(rows, ",") .. "]"
  end
  local notes = {}
  for i, n in ipairs(t.notes) do notes[i] = jstr(n) end
  return out .. ' "time":' .. jobj({ { "estimate", "true" }, { "step_s", jnum(t.step_s) },
    { "tokens_per_s", jnum(t.tokens_per_s) }, { "mfu", jnum(t.mfu) }, { "exposed_comm_s", jnum(t.exposed_comm_s) },
    { "compute_s", jnum(t.compute_s) }, { "bubble_s", jnum(t.bubble_s) }, { "optimizer_s", jnum(t.optimizer_s) },
    { "efficiency", jnum(t.efficiency) }, { "model_flops", jnum(t.model_flops) },
    { "collectives", jobj(coll) }, { "stages", stages }, { "notes", "[" .. table.concat(notes, ",") .. "]" } }) .. ",\n"
end

local LANE_COLOUR = { compute = "#4a7fc1", all_gather = "#e8833a", reduce_scatter = "#6aa84f", idle = "#d5d8dc",
  exposed = "#e8833a", optimizer = "#9b59b6" }

--- The picture's time line (moonshard.plan_svg): one step's compute and communication, from
-- y down; without a pipeline the streams of the step's last micro-batch (compute, all-gather,
-- reduce-scatter), under one a row per pp rank (the first 32).  Returns the SVG text and its
-- height, or "" and 0 without a time.
function T.svg(plan, y, width, margin, esc)
  local t = plan.time
  if not t then return "", 0 end
  local out = {}
  local function put(fmt, ...) out[#out + 1] = string.format(fmt, ...) end
  local label_w, row_h = 110, 20
  local x0, span = margin + label_w, width - 2 * margin - label_w
  put('<text x="%d" y="%d" font-size="14" font-weight="bold">%s</text>', margin, y + 14, esc(string.format(
    "one step on %s (estimate): %s, %s tokens/s, MFU %.1f%%, exposed communication %s%s", plan.device.name,
    dur(t.step_s), util.thousands(math.floor(t.tokens_per_s + 0.5)), t.mfu * 100, dur(t.exposed_comm_s),
    t.bubble_s > 0 and ", bubble " .. dur(t.bubble_s) or "")))
  local function bar(x, yy, w, colour, tip)
    put('<g><title>%s</title><rect x="%s" y="%d" width="%s" height="%d" fill="%s"/></g>', esc(tip), util.fixed1(x), yy,
      util.fixed1(math.max(w, 0.5)), row_h - 4, colour)
  end
  local rows = 0
  if not t.stages then
    local tl = t.timeline[1]
    local last = 0
    for _, e in ipairs(tl.events) do last = math.max(last, e.t1) end
    put('<text x="%d" y="%d">%s</text>', margin, y + 32, esc(tl.micro_batches > 1 and string.format(
      "the last of %d micro-batches (the others take %s before it), then the optimizer (%s)", tl.micro_batches,
      dur(tl.before), dur(t.optimizer_s)) or string.format("its one micro-batch, then the optimizer (%s)",
      dur(t.optimizer_s))))
    local scale = span / math.max(last, 1e-12)
    for i, lane in ipairs({ "compute", "all_gather", "reduce_scatter" }) do
      local yy = y + 40 + (i - 1) * row_h
      put('<text x="%d" y="%d">%s</text>', margin, yy + 12, lane:gsub("_", " "))
      for _, e in ipairs(tl.events) do
        if e.lane == lane then
          bar(x0 + e.t0 * scale, yy, (e.t1 - e.t0) * scale, LANE_COLOUR[lane],
            string.format("%s %s: %s from %s", e.label, lane, dur(e.t1 - e.t0), dur(e.t0)))
        end
      end
    end
    rows = 3
  else
    put('<text x="%d" y="%d">%s</text>', margin, y + 32, esc(string.format("%s, %d micro-batches: per pp rank, " ..
      "FSDP's exposed collectives, idle (the bubble), its micro-batches' compute, the optimizer", t.schedule,
      plan.tokens.accumulation)))
    local scale = span / t.step_s
    local worst_f = 0
    for _, st in ipairs(t.stages) do worst_f = math.max(worst_f, st.forward_s) end
    for i, st in ipairs(t.stages) do
      if i > 32 then break end
      local yy = y + 40 + (i - 1) * row_h
      put('<text x="%d" y="%d">pp rank %d</text>', margin, yy + 12, st.pp_rank)
      local x = x0
      local warm = math.min(st.idle_s, st.pp_rank * worst_f)
      for _, seg in ipairs({ { st.fsdp_exposed_s, "exposed", "FSDP collectives not hidden" },
        { warm, "idle", "waiting for the first micro-batch" }, { st.busy_s, "compute", "forward and backward" },
        { st.idle_s - warm, "idle", "idle: the rest of the bubble" }, { t.optimizer_s, "optimizer", "optimizer step" } }) do
        if seg[1] > 0 then
          bar(x, yy, seg[1] * scale, LANE_COLOUR[seg[2]], string.format("%s: %s", seg[3], dur(seg[1])))
          x = x + seg[1] * scale
        end
      end
      rows = i
    end
  end
  return table.concat(out, "\n"), 50 + rows * row_h
end

return T
