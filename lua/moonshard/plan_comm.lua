-- moonshard.plan_comm: what a plan's ranks send per step (see moonshard.plan): the units'
-- collectives, summed, and the batch's traffic (expert parallelism's token all_to_all).

local util = require "moonshard.util"

local T = {}

-- context parallelism's rotate methods (torch's set_rotate_method)
local CP_ROTATE = { allgather = true, alltoall = true }

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
    if k ~= "seq_len" and k ~= "micro_batch" and k ~= "global_batch" and k ~= "cp_rotate" then
      fail(string.format("tokens: unknown key %s (keys: seq_len, micro_batch, global_batch, cp_rotate)",
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
  if t.cp_rotate ~= nil and not CP_ROTATE[t.cp_rotate] then
    fail(string.format("tokens: cp_rotate is %s; expected \"allgather\" or \"alltoall\" (torch's set_rotate_method)",
      type(t.cp_rotate) == "string" and "'" .. t.cp_rotate .. "'" or shown(t.cp_rotate)), true)
  end
  return { seq_len = S, micro_batch = B, global_batch = G, accumulation = util.idiv(G, B * dp), cp_rotate = t.cp_rotate,
    global_batch_default = t.global_batch == nil }
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
      local dtype = unit and select(1, plan.effective_dtypes(p.dtype, plan.param_mp(unit, p))) or p.dtype
      local S = mul(mul(per_rank, top_k, "the tokens an MoE layer dispatches"), p.shape[2] * DTYPE_SIZE[dtype],
        "the bytes an MoE layer dispatches")
      out[#out + 1] = { count = 4 * tokens.accumulation, bytes = S - util.ceil_div(S, ep) }
    end
  end
  return out
end

-- Tensor parallelism's activation collectives, per micro-batch, as PyTorch's ParallelStyles
-- issue them (torch.distributed.tensor.parallel.style, 2.15; NeMo Automodel's
-- SequenceParallelAllGatherActivation).  A style redistributes activations where a layout it
-- declares differs from the one it needs, and the backward of each redistribution is the
-- mirror one (Partial -> Replicate: all-reduce; Partial -> Shard: reduce-scatter; Shard ->
-- Replicate: all-gather, whose backward from a Partial gradient is a reduce-scatter):
--   colwise     its input, declared input_layouts (Replicate) and made Replicate: a plain
--               tensor declared Replicate costs an all-reduce of its gradient in backward
--               (one per module: separate q, k and v projections cost three); declared
--               Shard(1) (sequence parallel), an all-gather forward and a reduce-scatter
--               backward.  An input that a sequence-parallel norm (or PrepareModuleInput)
--               hands over as a DTensor costs nothing here when it is Replicate (the norm's
--               all-gather is counted once, at the norm) and an all-gather forward and a
--               reduce-scatter backward per module when it is Shard(1) (plain
--               SequenceParallel norms).  output_layouts Replicate: an all-gather of the
--               output forward.
--   rowwise     its output (Partial) made output_layouts: Replicate, an all-reduce forward;
--               Shard(1), a reduce-scatter forward and an all-gather backward.  So is a
--               vocabulary-parallel embedding's.
--   sequence_parallel_all_gather   an all-gather of the norm's output forward and, handed on
--               as a DTensor (use_local_output false), a reduce-scatter of its gradient.
--   prepare_input   input_layouts Shard -> desired Replicate, the same as that norm.
-- Which norm feeds a colwise module: an ancestor's PrepareModuleInput, else the sequence-
-- parallel modules nearest to it in the tree (a decoder layer's norms feed its attention's
-- and MLP's projections; the final norm feeds the head).  Sizes: the activation a module
-- reads or writes, tokens (micro_batch x seq_len / cp) x its features, in its unit's compute
-- dtype.  A module inside an activation-checkpointed layer runs its forward collectives
-- again in backward.  Sequence-parallel norms' weight gradients are Partial over tp, and
-- FSDP2's post-backward all-reduces them (once a step).  Not counted (notes): the loss
-- (the logits come out as the head's style leaves them), rotary embeddings' from_local
-- checks, and the redistributions DTensor's own operators make inside a plain
-- SequenceParallel norm's backward (torch 2.15 on a Mistral-shaped model: 1 reduce-scatter
-- and 7 all-gathers more per layer than the styles').
local REPLICATE = "Replicate()"
local SP_KINDS = { sequence_parallel = true, sequence_parallel_all_gather = true }

function T.tp_traffic(ctx, mesh, tokens)
  local n = mesh:size("tp")
  local tok = util.idiv(tokens.micro_batch * tokens.seq_len, mesh:size("cp"))
  local parent, depth = {}, {}
  local function walk(m, d)
    depth[m] = d
    for _, c in ipairs(m.child_order) do
      parent[m.children[c]] = m
      walk(m.children[c], d + 1)
    end
  end
  walk(ctx.model, 0)
  local styled, sp_under = {}, {}
  for _, e in ipairs(ctx.tp_modules) do
    styled[e.object] = e
    if SP_KINDS[e.style] then
      local a = parent[e.object]
      while a do
        sp_under[a] = sp_under[a] or {}
        table.insert(sp_under[a], e)
        a = parent[a]
      end
    end
  end
  local function inside(m, a) -- m is a or below a
    while m do
      if m == a then return true end
      m = parent[m]
    end
    return false
  end
  -- the style that hands module m its input: a PrepareModuleInput above it, else the
  -- nearest sequence-parallel modules outside m's own branch
  local function feeder(m)
    local a = parent[m]
    while a do
      local e = styled[a]
      if e and e.style == "prepare_input" then return e end
      a = parent[a]
    end
    local below = m
    a = parent[m]
    while a do
      local best
      for _, e in ipairs(sp_under[a] or {}) do
        if not inside(e.object, below) and (not best or depth[e.object] < depth[best.object]) then best = e end
      end
      if best then return best end
      below, a = a, parent[a]
    end
    return nil
  end
  local hidden = ctx.model.attrs.hidden_size
  local embed = ctx.model:get("model.embed_tokens")
  if not util.is_int(hidden) then hidden = embed and embed.params.weight and embed.params.weight.shape[2] end
  local function act_bytes(m, features)
    local w = m.params.weight or m.params[m.param_order[1] or ""]
    local dtype = ctx.model.attrs.dtype or "f32"
    if w then
      local unit = ctx.owner[w]
      dtype = unit and select(1, plan.effective_dtypes(w.dtype, plan.param_mp(unit, w))) or w.dtype
    end
    return mul(mul(tok, features, "a tensor-parallel activation"), DTYPE_SIZE[dtype], "a tensor-parallel activation")
  end
  local fwd, bwd = {}, {}
  for _, k in ipairs({ "all_reduce", "all_gather", "reduce_scatter" }) do
    fwd[k] = { count = 0, bytes = 0 }
    bwd[k] = { count = 0, bytes = 0 }
  end
  local function bus(kind, S)
    local b = util.idiv(mul(S, n - 1, "a tensor-parallel collective"), n)
    return kind == "all_reduce" and mul(b, 2, "a tensor-parallel collective") or b
  end
  local function ev(t, kind, S)
    t[kind].count = t[kind].count + 1
    t[kind].bytes = add(t[kind].bytes, bus(kind, S), "tensor parallelism's %s bytes", kind)
  end
  local notes, plain_sp, norm = {}, false, { count = 0, bytes = 0 }
  local pp = ctx.pp
  for _, e in ipairs(ctx.tp_modules) do
    local m, spec = e.object, e.spec
    local s = pp and pp.stage_of[m]
    if not (s ~= nil and pp.stages[s + 1].rank ~= 0) then
      local recompute = ctx:name_of(m):find("_checkpoint_wrapped_module", 1, true) ~= nil
      local f = {}
      local function fw(kind, S) f[#f + 1] = { kind, S } end
      local w = m.params.weight
      local kind = e.style
      if kind == "colwise" and m.type == "Linear" and w then
        local S_in, declared = act_bytes(m, w.shape[2]), spec.input_layouts or REPLICATE
        local src = feeder(m)
        local handed = src and not (src.spec.use_local_output == true)
        if handed and (src.style == "sequence_parallel_all_gather" or src.style == "prepare_input") then
          -- a Replicate DTensor: nothing here
        elseif handed and src.style == "sequence_parallel" then
          fw("all_gather", S_in); ev(bwd, "reduce_scatter", S_in); plain_sp = true
        elseif declared ~= REPLICATE then
          fw("all_gather", S_in); ev(bwd, "reduce_scatter", S_in)
        else
          ev(bwd, "all_reduce", S_in)
        end
        -- DTensor gathers an uneven split padded to tp equal chunks (torch.chunk's largest)
        if spec.output_layouts == REPLICATE then fw("all_gather", act_bytes(m, util.ceil_div(w.shape[1], n) * n)) end
      elseif kind == "colwise" and w then -- an Embedding split on its columns
        if spec.output_layouts == REPLICATE then fw("all_gather", act_bytes(m, util.ceil_div(w.shape[2], n) * n)) end
      elseif (kind == "rowwise" or kind == "vocab_parallel_embedding") and w then
        local S_out = act_bytes(m, m.type == "Embedding" and w.shape[2] or w.shape[1])
        local out = spec.output_layouts or REPLICATE
        if out == REPLICATE then fw("all_reduce", S_out) else fw("reduce_scatter", S_out); ev(bwd, "all_gather", S_out) end
      elseif kind == "sequence_parallel_all_gather" or kind == "prepare_input" then
        local shard_in = kind == "sequence_parallel_all_gather" or (spec.input_layouts or REPLICATE) ~= REPLICATE
        if shard_in and (kind ~= "prepare_input" or (spec.desired_input_layouts or REPLICATE) == REPLICATE) then
          local S = act_bytes(m, w and w.shape[1] or hidden)
          fw("all_gather", S)
          if spec.use_local_output ~= true then ev(bwd, "reduce_scatter", S) end
        end
      elseif kind == "rotary_embed_parallel" then
        notes.rotary = true
      end
      if SP_KINDS[kind] then
        for _, pname in ipairs(m.param_order) do
          local p = m.params[pname]
          local unit = ctx.owner[p]
          if p.requires_grad and unit then
            local rd = select(2, plan.effective_dtypes(p.dtype, plan.param_mp(unit, p))) or p.dtype
            norm.count = norm.count + 1
            norm.bytes = add(norm.bytes, bus("all_reduce", mul(p.numel, DTYPE_SIZE[rd], "a norm's gradient")),
              "tensor parallelism's all_reduce bytes")
          end
        end
      end
      for _, x in ipairs(f) do
        ev(fwd, x[1], x[2])
        if recompute then ev(bwd, x[1], x[2]) end
      end
    end
  end
  local out = { forward = fwd, backward = bwd, norm_grads = norm, size = n, notes = {} }
  if plain_sp then
    out.notes[#out.notes + 1] = "the redistributions DTensor makes inside plain SequenceParallel norms' backward"
  end
  if notes.rotary then out.notes[#out.notes + 1] = "rotary embeddings' from_local checks" end
  out.notes[#out.notes + 1] = "the loss (the logits as the head's style leaves them)"
  return out
end

-- Context parallelism's key/value exchange per micro-batch, as PyTorch's ring attention
-- does it (torch.distributed.tensor.experimental._context_parallel._attention, 2.15:
-- _templated_ring_attention and its backward), which NeMo Automodel's context-parallel
-- sharder enables with cp_rotate_method "allgather".  Each attention layer's local K and V
-- (tokens / cp rows of the k_proj and v_proj outputs, this rank's tp piece) travel as one
-- buffer.  "allgather": forward one all-gather of it (cp x the buffer), backward the same
-- all-gather again and cp exchanges of the K and V gradients with the next rank (an
-- all_to_all each, always; in f32, convert_to_f32); "alltoall" (the ring): cp - 1 exchanges
-- forward, cp - 1 again in backward, and the cp gradient exchanges.  An exchange's bytes are
-- what one rank sends.  Attention without k_proj and v_proj (DeepSeek's MLA, fused qkv) is
-- not counted, and the result says so.
function T.cp_traffic(ctx, mesh, tokens, rotate)
  rotate = rotate or "allgather" -- T.tokens checked it
  local c = mesh:size("cp")
  local tok = util.idiv(tokens.micro_batch * tokens.seq_len, c)
  local out = { size = c, rotate = rotate, layers = 0, skipped = 0,
    forward = { all_gather = { count = 0, bytes = 0 }, all_to_all = { count = 0, bytes = 0 } },
    backward = { all_gather = { count = 0, bytes = 0 }, all_to_all = { count = 0, bytes = 0 } } }
  local function ev(t, kind, times, bytes)
    t[kind].count = t[kind].count + times
    t[kind].bytes = add(t[kind].bytes, mul(times, bytes, "context parallelism's %s bytes", kind),
      "context parallelism's %s bytes", kind)
  end
  local pp = ctx.pp
  for _, nm in ipairs(ctx.model:named_modules()) do
    local m = nm[2]
    if type(m.type) == "string" and m.type:find("Attention$") then
      local s = pp and pp.stage_of[m]
      if not (s ~= nil and pp.stages[s + 1].rank ~= 0) then
        local k, v = m.children.k_proj, m.children.v_proj
        local kw, vw = k and k.params.weight, v and v.params.weight
        if kw and vw then
          local function rows(w)
            local t = ctx.tp[w]
            return t and t.local_shapes[1][1] or w.shape[1]
          end
          local unit = ctx.owner[kw]
          local dtype = unit and select(1, plan.effective_dtypes(kw.dtype, plan.param_mp(unit, kw))) or kw.dtype
          local feats = rows(kw) + rows(vw)
          local kv = mul(mul(tok, feats, "a layer's keys and values"), DTYPE_SIZE[dtype], "a layer's keys and values")
          local grads = mul(mul(tok, feats, "a layer's keys and values"), 4, "a layer's key and value gradients")
          out.layers = out.layers + 1
          if rotate == "allgather" then
            ev(out.forward, "all_gather", 1, mul(kv, c - 1, "a layer's keys and values"))
            ev(out.backward, "all_gather", 1, mul(kv, c - 1, "a layer's keys and values"))
          else
            ev(out.forward, "all_to_all", c - 1, kv)
            ev(out.backward, "all_to_all", c - 1, kv)
          end
          ev(out.backward, "all_to_all", c, grads)
        else
          out.skipped = out.skipped + 1
        end
      end
    end
  end
  return out
end

-- Adds n micro-batches of t's forward and backward collectives (kinds) to comm's per-step sums.
local function add_micro_batches(comm, t, kinds, n)
  for _, k in ipairs(kinds) do
    for _, phase in ipairs({ t.forward, t.backward }) do
      comm[k].count = comm[k].count + phase[k].count * n
      comm[k].bytes = add(comm[k].bytes, mul(phase[k].bytes, n, "the %s bytes per step", k), "the %s bytes per step", k)
    end
  end
end

--- Communication per step: the units' collectives summed, and with a batch expert
-- parallelism's token all_to_all (without one, uncounted_ep says it is left out).
-- torchao's float8 all-gather needs one scale for a weight on every rank: the amax of its
-- shard all-reduced (MAX, f32) over the unit's mesh before each gather
-- (torchao/float8/fsdp_utils.py: tensor_to_scale with reduce_amax), or, with
-- precompute_float8_dynamic_scale_for_fsdp, once a step for all the weights together
-- (precompute_float8_dynamic_scale_for_fsdp: one all-reduce of the stacked amaxes).
function T.fp8_amax(ctx, comm, gathers)
  -- bus bytes of an all-reduce of S bytes over n ranks, as plan_layout counts them
  local function bus(S, n) return 2 * S - util.ceil_div(2 * S, n) end
  local count, bytes, stacked, group, precompute = 0, 0, 0, 1, false
  for _, u in ipairs(ctx.units) do
    local n = 0
    for _, e in ipairs(u.entries or {}) do
      if e.param.fp8_gather then
        n = n + 1
        precompute = precompute or e.param.fp8_gather.precompute
      end
    end
    local ranks = (u.shard_size or 1) * (u.replicate_size or 1)
    if n > 0 and ranks > 1 and u.kind ~= "replicate" and u.kind ~= "megatron_fsdp" then
      if precompute then
        stacked, group = stacked + n, math.max(group, ranks)
      else
        local k = n * #u.comm.all_gather * gathers
        count, bytes = count + k, bytes + k * bus(4, ranks)
      end
    end
  end
  if stacked > 0 then count, bytes = 1, bus(4 * stacked, group) end
  if count == 0 then return end
  local x = { count = count, bytes = bytes, precompute = stacked > 0 }
  comm.fp8_amax = x
  comm.all_reduce.count = comm.all_reduce.count + x.count
  comm.all_reduce.bytes = add(comm.all_reduce.bytes, x.bytes, "the all_reduce bytes per step")
end

function T.per_step(ctx, mesh, owned, tokens)
  local comm = { all_gather = { count = 0, bytes = 0 }, reduce_scatter = { count = 0, bytes = 0 },
    all_reduce = { count = 0, bytes = 0 }, all_to_all = { count = 0, bytes = 0 } }
  -- with a batch of several micro-batches and no pipeline, every micro-batch gathers the
  -- units again (FSDP2 reshards after backward); gradients reduce once a step (accumulation
  -- without gradient sync).  A pipeline stage keeps its units gathered across micro-batches.
  local gathers = tokens and not ctx.pp and tokens.accumulation or 1
  comm.gathers = gathers
  -- packed units (fully_shard's islands): the collectives packing saved a step against a
  -- unit for each island (plan_layout.packing_saved), all-gathers once per gather
  local packing = { units = 0, islands = 0, all_gather = 0, reduce_scatter = 0, all_reduce = 0, collectives_saved = 0 }
  for _, u in ipairs(ctx.units) do
    if u.packing then
      packing.units, packing.islands = packing.units + 1, packing.islands + #u.islands
      packing.all_gather = packing.all_gather + u.packing.all_gather * gathers
      packing.reduce_scatter = packing.reduce_scatter + u.packing.reduce_scatter
      packing.all_reduce = packing.all_reduce + u.packing.all_reduce
    end
  end
  packing.collectives_saved = packing.all_gather + packing.reduce_scatter + packing.all_reduce
  if packing.units > 0 then comm.packing = packing end
  for _, u in ipairs(ctx.units) do
    for _, c in ipairs(u.comm.all_gather) do
      local g = c.once and 1 or gathers -- Megatron-FSDP's once-a-step gathers (plan_megatron)
      comm.all_gather.count = comm.all_gather.count + g
      comm.all_gather.bytes = add(comm.all_gather.bytes, mul(c.bytes, g, "the all-gather bytes per step"),
        "the all-gather bytes per step")
    end
    for _, kind in ipairs({ "reduce_scatter", "all_reduce" }) do
      local c = u.comm[kind]
      if c then
        comm[kind].count = comm[kind].count + (c.count or 1) -- a replicate unit: one per bucket
        comm[kind].bytes = add(comm[kind].bytes, c.bytes, "the %s bytes per step", kind)
      end
    end
  end
  T.fp8_amax(ctx, comm, gathers)
  if mesh:size("tp") > 1 and #ctx.tp_modules > 0 then
    if tokens then
      local t = T.tp_traffic(ctx, mesh, tokens)
      add_micro_batches(comm, t, { "all_reduce", "all_gather", "reduce_scatter" }, tokens.accumulation)
      comm.all_reduce.count = comm.all_reduce.count + t.norm_grads.count
      comm.all_reduce.bytes = add(comm.all_reduce.bytes, t.norm_grads.bytes, "the all_reduce bytes per step")
      comm.tensor_parallel = t
    else
      comm.all_reduce.uncounted_tp = mesh:size("tp")
    end
  end
  if mesh:size("cp") > 1 then
    if tokens then
      local t = T.cp_traffic(ctx, mesh, tokens, tokens.cp_rotate)
      add_micro_batches(comm, t, { "all_gather", "all_to_all" }, tokens.accumulation)
      comm.context_parallel = t
    else
      comm.all_gather.uncounted_cp = mesh:size("cp")
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
