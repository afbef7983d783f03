-- moonshard.plan_comm: what a plan's ranks send per step (see moonshard.plan): the units'
-- collectives, summed, and the batch's traffic (expert parallelism's token all_to_all).

local util = require "moonshard.util"

local T = {}

-- The planner's helpers (moonshard.plan gives them to bind): its errors and checked sums.
local plan, fail, add, mul, display, shown, DTYPE_SIZE

--- Takes the planner's helpers h; returns T.
function T.bind(h)
  plan, fail, add, mul, display, shown, DTYPE_SIZE = h.plan, h.fail, h.add, h.mul, h.display, h.shown, h.DTYPE_SIZE
  return T
end

-- The batch the plan counts traffic for: nil, or {seq_len, micro_batch, global_batch,
-- accumulation}: opts.tokens {seq_len = S, micro_batch = B (default 1), global_batch = G
-- (default B x dp)}, a step being G / (B x dp) micro-batches on each data-parallel rank (the
-- cp and tp ranks of one sample share it), as Automodel's step scheduler accumulates them.
function T.tokens(mesh, t)
  if t == nil then return nil end
  if type(t) ~= "table" then fail("tokens: expected {seq_len =, micro_batch =, global_batch =}, got a " .. type(t), true) end
  for k in pairs(t) do
    if k ~= "seq_len" and k ~= "micro_batch" and k ~= "global_batch" then
      fail(string.format("tokens: unknown key %s (keys: seq_len, micro_batch, global_batch)",
        type(k) == "string" and "'" .. k .. "'" or shown(k)), true)
    end
  end
  local function count(key, v, need)
    if v == nil and not need then return nil end
    if not util.is_int(v) or v < 1 or v > 2 ^ 40 then
      fail(string.format("tokens: %s is %s; expected a whole number from 1 to 2^40", key, shown(v)), true)
    end
    return v
  end
  local S = count("seq_len", t.seq_len, true)
  local B = count("micro_batch", t.micro_batch) or 1
  local dp = mesh:size("dp")
  local G = count("global_batch", t.global_batch) or B * dp
  if G % (B * dp) ~= 0 then
    fail(string.format("tokens: global batch %d is not a multiple of micro-batch %d x data-parallel ranks %d = %d",
      G, B, dp, B * dp), true)
  end
  if S % mesh:size("cp") ~= 0 then
    fail(string.format("tokens: sequence length %d is not divisible by cp = %d (context parallelism splits it)",
      S, mesh:size("cp")), true)
  end
  return { seq_len = S, micro_batch = B, global_batch = G, accumulation = util.idiv(G, B * dp) }
end

-- Expert parallelism's token traffic per step: in every MoE layer whose grouped experts
-- expert parallelism placed, each micro-batch's tokens go to their top_k experts' ranks and
-- come back (dispatch and combine, an all_to_all each over ep), forward and backward: 4
-- all_to_alls per layer and micro-batch, each sending tokens x top_k x hidden activations
-- (in the experts' compute dtype) per rank, routing spread evenly (a rank keeps 1/ep of them).
-- Tokens per rank: micro_batch x seq_len / cp.  Returns {count, bytes (bus bytes of one)} per
-- layer.
local function expert_token_traffic(ctx, mesh, tokens)
  local ep = mesh:size("ep")
  local per_rank = util.idiv(tokens.micro_batch * tokens.seq_len, mesh:size("cp"))
  local out, seen = {}, {}
  for _, p in ipairs(ctx.ep_order) do
    local e = ctx.ep[p]
    local experts = e.module
    if experts and not seen[experts] and #p.shape >= 2 then
      seen[experts] = true
      local name = ctx:name_of(experts)
      local block = name:find("%.") and ctx.model:get(name:match("^(.*)%.[^.]+$")) or nil
      local top_k = block and block.attrs and block.attrs.top_k
      if not util.is_int(top_k) or top_k < 1 then
        fail(string.format("expert parallelism's token traffic: the MoE block of %s gives no top_k (its experts " ..
          "per token); plan without tokens, or from a config whose builder records it", display(ctx:name_of(experts))))
      end
      local unit = ctx.owner[p]
      local dtype = unit and select(1, plan.effective_dtypes(p.dtype, unit.mp)) or p.dtype
      local S = mul(mul(per_rank, top_k, "the tokens an MoE layer dispatches"), p.shape[2] * DTYPE_SIZE[dtype],
        "the bytes an MoE layer dispatches")
      out[#out + 1] = { count = 4 * tokens.accumulation, bytes = S - util.ceil_div(S, ep) }
    end
  end
  return out
end

--- Communication per step: the units' collectives summed, and with a batch expert
-- parallelism's token all_to_all (without one, uncounted_ep says it is left out).
function T.per_step(ctx, mesh, owned, tokens)
  local comm = { all_gather = { count = 0, bytes = 0 }, reduce_scatter = { count = 0, bytes = 0 },
    all_reduce = { count = 0, bytes = 0 }, all_to_all = { count = 0, bytes = 0 } }
  for _, u in ipairs(ctx.units) do
    for _, c in ipairs(u.comm.all_gather) do
      comm.all_gather.count = comm.all_gather.count + 1
      comm.all_gather.bytes = add(comm.all_gather.bytes, c.bytes, "the all-gather bytes per step")
    end
    for _, kind in ipairs({ "reduce_scatter", "all_reduce" }) do
      local c = u.comm[kind]
      if c then
        comm[kind].count = comm[kind].count + (c.count or 1) -- a replicate unit: one per bucket
        comm[kind].bytes = add(comm[kind].bytes, c.bytes, "the %s bytes per step", kind)
      end
    end
  end
  local ep = mesh:size("ep")
  if ep > 1 and #owned > 0 then
    if tokens then
      for _, x in ipairs(expert_token_traffic(ctx, mesh, tokens)) do
        comm.all_to_all.count = comm.all_to_all.count + x.count
        comm.all_to_all.bytes = add(comm.all_to_all.bytes, mul(x.count, x.bytes, "the all_to_all bytes per step"),
          "the all_to_all bytes per step")
      end
    else
      comm.all_to_all.uncounted_ep = ep
    end
  end
  return comm
end

return T
