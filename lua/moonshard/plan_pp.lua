-- moonshard.plan_pp: the rules of a pipeline: how NeMo Automodel splits a decoder into
-- stages (components/distributed/pipelining/functional.py), which pp rank holds which
-- stage, and how many micro-batches' activations each rank keeps at its peak under
-- torch.distributed.pipelining's schedules.  Pure functions; errors are Automodel's and
-- PyTorch's own messages.

local util = require "moonshard.util"

local P = {}

local function fail(msg) error("moonshard: pipeline: " .. msg, 0) end

-- PyTorch's schedules (get_schedule_class, a case-insensitive match): one stage per rank or
-- several, and where the stages sit: "loop" puts stage s on rank s % pp, "v" zig-zags
-- (rank r holds r and 2pp-1-r).  Automodel places DualPipeV's stages "loop" while PyTorch's
-- schedule expects "v"; the plan follows PyTorch, which is what runs.
P.SCHEDULES = {
  { name = "GPipe", multi = false },
  { name = "1F1B", multi = false },
  { name = "Interleaved1F1B", multi = true, placement = "loop" },
  { name = "LoopedBFS", multi = true, placement = "loop" },
  { name = "InterleavedZeroBubble", multi = true, placement = "loop" },
  { name = "ZBVZeroBubble", multi = true, placement = "v", per_rank = 2 },
  { name = "DualPipeV", multi = true, placement = "v", per_rank = 2 },
}
local BY_NAME, NAMES = {}, {}
for i, s in ipairs(P.SCHEDULES) do
  BY_NAME[s.name:lower()] = s
  NAMES[i] = s.name
end

--- The schedule named (any case), or PyTorch's error.
function P.schedule(name)
  local s = type(name) == "string" and BY_NAME[name:lower()]
  if not s then
    fail(string.format("Unknown schedule name '%s'. The valid options are %s", tostring(name),
      table.concat(NAMES, ", ")))
  end
  return s
end

--- calculate_virtual_stages: the number of stages and stages per rank for L decoder layers
-- on pp ranks.  layers_per_stage (optional) counts the stages, ceil(L / k), rounded to a
-- multiple of pp "up" or "down" when asked; without it, one stage per rank for a single-stage
-- schedule and two for a multi-stage one.
function P.virtual_stages(L, layers_per_stage, pp, single, round)
  local S
  if layers_per_stage == nil then
    S = pp * (single and 1 or 2)
  else
    S = util.ceil_div(L, layers_per_stage)
    local asked = S -- Automodel's messages name the count before rounding
    if S % pp ~= 0 then
      if round == "up" then
        S = util.ceil_div(S, pp) * pp
      elseif round == "down" then
        S = util.idiv(S, pp) * pp
      elseif round ~= nil then
        fail(string.format("Invalid value for round_to_pp_multiple: %s. Use 'up' or 'down'.", tostring(round)))
      else
        fail(string.format("Number of virtual stages (%d) must be divisible by pipeline parallel size (%d). " ..
          "Model has %d layers with pipeline_parallel_layers_per_stage=%d. Please adjust " ..
          "pipeline_parallel_layers_per_stage to a value that results in a number of stages divisible by %d.",
          S, pp, L, layers_per_stage, pp))
      end
    end
    local per_rank = util.idiv(S, pp)
    if single and per_rank ~= 1 then
      fail(string.format("Single stage schedule requires exactly 1 stage per rank, but got %d stages per rank. " ..
        "Model has %d layers with pipeline_parallel_layers_per_stage=%d, resulting in num_virtual_stages=%d " ..
        "across %d PP ranks. Please increase pipeline_parallel_layers_per_stage to %d or higher to achieve 1 " ..
        "stage per rank.", per_rank, L, layers_per_stage, asked, pp, util.idiv(L, pp)))
    end
    if not single and per_rank < 2 then
      fail(string.format("Multi-stage schedule requires at least 2 stages per rank, but got %d stages per rank. " ..
        "Model has %d layers with pipeline_parallel_layers_per_stage=%d, resulting in num_virtual_stages=%d " ..
        "across %d PP ranks. Please decrease pipeline_parallel_layers_per_stage to %d or lower to achieve at " ..
        "least 2 stages per rank.", per_rank, L, layers_per_stage, asked, pp, util.idiv(L, 2 * pp)))
    end
  end
  return S, util.idiv(S, pp)
end

--- generate_hf_model_fqn_per_model_part: the layers of each of S stages, L // S each and the
-- remainder to the first stages; returns a list of {first, count} (0-based layer indices).
-- Stage 0 also holds the embeddings, the last the final norm and the head; Automodel gives
-- every stage the rotary embedding (it has no parameters).
function P.layer_split(S, L)
  if S < 1 then fail("Number of stages must be at least 1") end
  if S > L then fail(string.format("Number of stages (%d) cannot exceed number of layers (%d)", S, L)) end
  local base, extra, out, first = util.idiv(L, S), L % S, {}, 0
  for i = 0, S - 1 do
    local n = base + (i < extra and 1 or 0)
    out[i + 1] = { first = first, count = n }
    first = first + n
  end
  return out
end

--- A balanced split: the layers of each of S stages, contiguous and none empty, that make the
-- costliest stage as cheap as possible, where stage 0 also costs `first` (the embeddings)
-- and the last stage `last` (the final norm and the head); layer_cost[i] is layer i-1's.
-- Exact (dynamic programming over the prefix sums, O(S x L^2)).  Among splits whose costliest
-- stage costs the same, the one with the least sum of squared stage costs (the others as even
-- as the bottleneck allows; a tie-break that keeps the first goal exact, as each state keeps
-- its least maximum first), then the one whose earlier stages hold more layers, as
-- Automodel's gives the remainder to the first stages.  Returns a list of {first, count}
-- like P.layer_split.
function P.balanced_split(S, layer_cost, first, last)
  local L = #layer_cost
  if S < 1 then fail("Number of stages must be at least 1") end
  if S > L then fail(string.format("Number of stages (%d) cannot exceed number of layers (%d)", S, L)) end
  local prefix = { [0] = 0 }
  for i = 1, L do prefix[i] = prefix[i - 1] + layer_cost[i] end
  local function cost(s, a, b) -- stage s (1-based) holding layers a+1..b
    local c = prefix[b] - prefix[a]
    if s == 1 then c = c + first end
    if s == S then c = c + last end
    return c
  end
  -- best[s][b]: the least max cost of stages 1..s holding layers 1..b; cut[s][b] their split
  -- sq[s][b]: their sum of squared stage costs
  local best, sq, cut = { [0] = { [0] = 0 } }, { [0] = { [0] = 0 } }, {}
  for s = 1, S do
    best[s], sq[s], cut[s] = {}, {}, {}
    for b = s, L - (S - s) do
      local bv, bq, ba
      for a = b - 1, s - 1, -1 do -- later cuts first: more layers to the earlier stages on ties
        local prev = best[s - 1][a]
        if prev then
          local c = cost(s, a, b)
          local v, q = math.max(prev, c), sq[s - 1][a] + c * c
          if not bv or v < bv or (v == bv and q < bq) then bv, bq, ba = v, q, a end
        end
      end
      best[s][b], sq[s][b], cut[s][b] = bv, bq, ba
    end
  end
  local out, b = {}, L
  for s = S, 1, -1 do
    local a = cut[s][b]
    out[s] = { first = a, count = b - a }
    b = a
  end
  return out
end

--- The pp rank of stage s (0-based) of S under a placement ("loop" or "v").
function P.rank_of(s, S, pp, placement)
  if placement == "v" then return s < pp and s or 2 * pp - 1 - s end
  return s % pp
end

--- stage_ids_this_rank: the stages pp rank r holds, in order (0-based).
function P.stages_of_rank(r, pp, S, placement)
  local per_rank = util.idiv(S, pp)
  if placement == "v" and per_rank ~= 2 then fail(string.format("v schedules assume 2 stages per rank, got %d", per_rank)) end
  local out = {}
  for s = 0, S - 1 do
    if P.rank_of(s, S, pp, placement) == r then out[#out + 1] = s end
  end
  return out
end

--- PyTorch's constraint on the micro-batch count n of a schedule with v stages per rank on pp
-- ranks; nil when it holds, else its message.
function P.check_microbatches(sched, pp, n, v)
  local S = pp * v
  if sched.per_rank and v ~= sched.per_rank then
    return string.format("%s requires exactly %d stages per rank, but got %d.", sched.name, sched.per_rank, v)
  end
  if sched.name == "1F1B" and n < S then
    return string.format("Number of microbatches (%d) must be greater than or equal to the number of stages (%d).",
      n, S)
  end
  if sched.name == "Interleaved1F1B" or sched.name == "InterleavedZeroBubble" then
    local rounds = math.max(1, util.idiv(n, pp))
    if n % rounds ~= 0 then
      return string.format("%s requires the number of microbatches to be a multiple of the number of rounds (%d), " ..
        "but got %d.", sched.name == "Interleaved1F1B" and "Interleaved 1F1B" or "Zero bubble", rounds, n)
    end
  end
  if sched.name == "DualPipeV" and n < S then
    return string.format("DualPipeV requires at least as many microbatches as stages, but got %d microbatches and " ..
      "%d stages.", n, S)
  end
  return nil
end

--- The micro-batch activations (each of one stage: L / S layers) rank r keeps at its peak
-- under the schedule with n micro-batches and v stages per rank on pp ranks, as PyTorch's
-- schedules order their work: an activation lives from its forward to its full backward, or
-- to its weight backward where a zero-bubble schedule splits it.
function P.in_flight(sched, pp, n, v, r)
  local name = sched.name
  if name == "GPipe" then return n end
  if name == "1F1B" then return math.min(n, pp - r) end -- the executor's warm-up
  local m = util.idiv(n, math.max(1, util.idiv(n, pp))) -- micro-batches per round
  if name == "Interleaved1F1B" then return math.min((v - 1) * m + 2 * (pp - 1 - r) + 1, n * v) end
  if name == "LoopedBFS" then return n * v end
  if name == "InterleavedZeroBubble" then return math.min((v - 1) * m + pp, n * v) end
  if name == "ZBVZeroBubble" then return math.min(2 * pp, n + r + 1, 2 * n) end
  if name == "DualPipeV" then return 2 * pp + (r == pp - 1 and 1 or 0) end
  fail("no in-flight rule for schedule " .. name)
end

--- What module m costs a stage, by metric: "compute", the forward FLOPs per token of its
-- matrix multiplies (2 x the elements of every weight of 2 or more dims outside an
-- Embedding; a grouped-experts module's by top_k / experts, as each token runs top_k of
-- them, top_k from its MoE block); or "memory", its parameters' elements.  Attention's
-- scores (which grow with the sequence), norms and the loss are left out of "compute".
function P.module_cost(m, metric, parent_of)
  local total = 0
  local function walk(x, active)
    if x.type == "GroupedExperts" then
      local block = parent_of and parent_of[x]
      local k, e = block and block.attrs and block.attrs.top_k, block and block.attrs and block.attrs.n_experts
      if util.is_int(k) and util.is_int(e) and e > 0 then active = active * k / e end
    end
    for _, pname in ipairs(x.param_order) do
      local p = x.params[pname]
      if metric == "memory" then
        total = total + p.numel
      elseif #p.shape >= 2 and x.type ~= "Embedding" then
        total = total + 2 * p.numel * active
      end
    end
    for _, c in ipairs(x.child_order) do walk(x.children[c], active) end
  end
  walk(m, 1)
  return total
end

P.SPLITS = { automodel = true, compute = true, memory = true }

-- ---------------------------------------------------------------- ctx:pipeline

local plan_fail, display, plan_dtype_size -- the planner's helpers (bind)

--- Takes the planner's helpers h (fail, display, DTYPE_SIZE); returns P.
function P.bind(h)
  plan_fail, display = h.fail, h.display
  plan_dtype_size = function(d) return h.DTYPE_SIZE[d] end
  return P
end

local PIPELINE_KEYS = { schedule = true, layers_per_stage = true, round_virtual_stages_to_pp_multiple = true,
  split = true }

--- ctx:pipeline{schedule =, layers_per_stage =, round_virtual_stages_to_pp_multiple =}: splits
-- the model into stages as Automodel's AutoPipeline does (the decoder layers of
-- model.layers evenly, the remainder to the first stages; what comes before the layers in the
-- model, the embeddings, in stage 0; what comes after, the final norm and the head, in the
-- last) and places the stages on the pp ranks.  Returns the stages: {index, rank, layers =
-- {first, count}, modules = {names}}.
function P.apply(ctx, opts)
  opts = opts or {}
  if type(opts) ~= "table" then plan_fail("pipeline: the options are a " .. type(opts) .. "; expected a table") end
  for k in pairs(opts) do
    if not PIPELINE_KEYS[k] then
      plan_fail(string.format("pipeline: unknown option %s (options: schedule, layers_per_stage, " ..
        "round_virtual_stages_to_pp_multiple, split)", type(k) == "string" and "'" .. k .. "'" or tostring(k)))
    end
  end
  if ctx.pp then plan_fail("pipeline: the model is split into stages already (ctx:pipeline is called once)") end
  if ctx.units[1] then
    plan_fail(string.format("pipeline: unit %s exists already; the pipeline split comes first (Automodel applies it " ..
      "outermost), since every unit lies in one stage", display(ctx.units[1].name)))
  end
  local pp = ctx.mesh:size("pp")
  local ok, sched = pcall(P.schedule, opts.schedule or "1F1B")
  if not ok then plan_fail((tostring(sched):gsub("^moonshard: ", ""))) end
  local layers = ctx.model:get("model.layers")
  if not layers or (layers.type ~= "ModuleList" and layers.type ~= "ModuleDict") or #layers.child_order == 0 then
    plan_fail("pipeline: the model has no model.layers list of decoder layers to split into stages")
  end
  if ctx.model.attrs.tie_word_embeddings then
    plan_fail("pipeline: the head is tied to the embeddings, which sit in the first and last stages; Automodel's " ..
      "pipelines refuse tied embeddings")
  end
  local L = #layers.child_order
  local lps = opts.layers_per_stage
  if lps ~= nil and not (util.is_int(lps) and lps >= 1) then
    plan_fail("pipeline: layers_per_stage is " .. tostring(lps) .. "; expected an integer >= 1")
  end
  local S, per_rank
  ok, S, per_rank = pcall(P.virtual_stages, L, lps, pp, not sched.multi, opts.round_virtual_stages_to_pp_multiple)
  if not ok then plan_fail((tostring(S):gsub("^moonshard: ", ""))) end
  local how = opts.split or "automodel"
  if not P.SPLITS[how] then
    plan_fail(string.format("pipeline: split is %s; expected \"automodel\" (NeMo Automodel's: layers evenly, the " ..
      "remainder to the first stages), \"compute\" or \"memory\" (balanced, the embeddings and the head weighed in)",
      type(how) == "string" and "'" .. how .. "'" or tostring(how)))
  end
  local split
  ok, split = pcall(P.layer_split, S, L)
  if not ok then plan_fail((tostring(split):gsub("^moonshard: ", ""))) end
  -- each layer's cost, and what comes before the layers (stage 0) and after them (the last)
  local parent_of = {}
  for _, nm in ipairs(ctx.model:named_modules()) do
    for _, c in ipairs(nm[2].child_order) do parent_of[nm[2].children[c]] = nm[2] end
  end
  local metric = how == "memory" and "memory" or "compute"
  local layer_cost = {}
  for i, c in ipairs(layers.child_order) do layer_cost[i] = P.module_cost(layers.children[c], metric, parent_of) end
  local function contains_layers(m)
    if m == layers then return true end
    for _, c in ipairs(m.child_order) do if contains_layers(m.children[c]) then return true end end
    return false
  end
  -- what comes before the layers in the tree (stage 0's) and after them (the last stage's)
  local edge, after_layers = { 0, 0 }, false
  local function edges(m)
    if m == layers then after_layers = true return end
    for _, c in ipairs(m.child_order) do
      local x = m.children[c]
      if contains_layers(x) then edges(x)
      else
        local k = after_layers and 2 or 1
        edge[k] = edge[k] + P.module_cost(x, metric, parent_of)
      end
    end
  end
  edges(ctx.model)
  local automodel_split = split
  if how ~= "automodel" then split = P.balanced_split(S, layer_cost, edge[1], edge[2]) end
  local function costs_of(sp)
    local out = {}
    for k, part in ipairs(sp) do
      local c = 0
      for i = part.first + 1, part.first + part.count do c = c + layer_cost[i] end
      if k == 1 then c = c + edge[1] end
      if k == #sp then c = c + edge[2] end
      out[k] = c
    end
    return out
  end
  local placement = sched.placement or "loop"
  if placement == "v" and per_rank ~= 2 then
    plan_fail(string.format("pipeline: v schedules assume 2 stages per rank, got %d", per_rank))
  end
  -- every module's stage: a decoder layer's subtree its stage; what precedes the layers in
  -- the tree stage 0, what follows the last; the containers of the layers (the root, model,
  -- model.layers) span the stages and may hold no parameter of their own
  local stage_of, spanning = {}, {}
  local layer_stage = {}
  for s, part in ipairs(split) do
    for i = part.first, part.first + part.count - 1 do layer_stage[layers.children[layers.child_order[i + 1]]] = s - 1 end
  end
  local after = false
  local stages = {}
  for s = 0, S - 1 do
    stages[s + 1] = { index = s, rank = P.rank_of(s, S, pp, placement), layers = split[s + 1], modules = {} }
  end
  local function assign(m, name, s)
    stage_of[m] = s
    for _, c in ipairs(m.child_order) do assign(m.children[c], name == "" and c or name .. "." .. c, s) end
  end
  local function walk(m, name)
    if m == layers then
      for _, c in ipairs(m.child_order) do
        local s = layer_stage[m.children[c]]
        assign(m.children[c], name .. "." .. c, s)
        table.insert(stages[s + 1].modules, name .. "." .. c)
      end
      spanning[m] = true
      after = true
      return
    end
    if contains_layers(m) then
      spanning[m] = true
      if m.param_order[1] then
        plan_fail(string.format("pipeline: %s holds parameters of its own (%s) but spans the stages; a stage " ..
          "holds whole modules", display(name), m.param_order[1]))
      end
      for _, c in ipairs(m.child_order) do walk(m.children[c], name == "" and c or name .. "." .. c) end
      return
    end
    local s = after and S - 1 or 0
    assign(m, name, s)
    table.insert(stages[s + 1].modules, name)
  end
  walk(ctx.model, "")
  local costs = costs_of(split)
  for k, st in ipairs(stages) do st.cost = costs[k] end
  local function max_of(list)
    local m = 0
    for _, v in ipairs(list) do m = math.max(m, v) end
    return m
  end
  ctx.pp = { schedule = sched, stages = stages, per_rank = per_rank, placement = placement, stage_of = stage_of,
    spanning = spanning, count = S, split = how, metric = metric, max_cost = max_of(costs),
    automodel_max = max_of(costs_of(automodel_split)),
    balanced_max = how == "automodel" and max_of(costs_of(P.balanced_split(S, layer_cost, edge[1], edge[2]))) or nil }
  return stages
end

--- The pipeline as the plan shows it: schedule, placement, stages per rank, micro-batches
-- (the batch's, when given), each stage {index, pp_rank, ranks (the world ranks holding it),
-- layers, modules, params (elements), memory (the total bytes of a rank holding it: its pp
-- rank's, data-parallel coordinate 0)}, and per pp rank the micro-batch activations it keeps
-- at its peak (in_flight) and what it sends to the neighbouring stages per step
-- (send_recv: {count, bytes}), with a batch.
function P.summary(ctx, mesh, tokens, total_of_pp)
  local pp, npp = ctx.pp, mesh:size("pp")
  local n = tokens and tokens.accumulation
  if n then
    local why = P.check_microbatches(pp.schedule, npp, n, pp.per_rank)
    if why then
      plan_fail("pipeline: " .. why .. " (the batch gives " .. n .. " micro-batches a step" ..
        (tokens.global_batch_default and string.format("; without a global batch (--global-batch) a step is one " ..
          "micro-batch of %d per data-parallel rank: give one that makes enough micro-batches", tokens.micro_batch)
          or "") .. ")", true)
    end
  end
  -- the ranks of each pp coordinate, in order
  local ranks_of = {}
  for r = 0, mesh.world - 1 do
    local p = mesh:coord("pp", r)
    ranks_of[p] = ranks_of[p] or {}
    table.insert(ranks_of[p], r)
  end
  local stages = {}
  for i, s in ipairs(pp.stages) do
    local params = 0
    for _, name in ipairs(s.modules) do params = params + ctx.model:get(name):param_count() end
    stages[i] = { index = s.index, pp_rank = s.rank, ranks = ranks_of[s.rank], layers = s.layers, modules = s.modules,
      params = params, memory = total_of_pp(s.rank) }
  end
  for i, s in ipairs(pp.stages) do stages[i].cost = s.cost end
  local out = { schedule = pp.schedule.name, placement = pp.placement, stages_per_rank = pp.per_rank, microbatches = n,
    stages = stages, split = pp.split, metric = pp.metric, max_cost = pp.max_cost, automodel_max = pp.automodel_max,
    balanced_max = pp.balanced_max }
  if n then
    out.in_flight, out.send_recv = {}, {}
    local embed = ctx.model:get("model.embed_tokens")
    local hidden = embed and embed.params.weight and embed.params.weight.shape[2]
    -- what a stage sends is a decoder layer's output: in its unit's output_dtype, else the
    -- dtype it computes in (its param_dtype); else the first unit's param_dtype that is set
    -- (an FP32 island's unit, first in post-order, does not say what the layers compute in)
    local dtype = ctx.model.attrs.dtype or "f32"
    local layer_unit
    for _, u in ipairs(ctx.units) do
      if ctx:name_of(u.module):match("^model%.layers%.%d+$") then layer_unit = u break end
    end
    if layer_unit and (layer_unit.mp.output_dtype or layer_unit.mp.param_dtype) then
      dtype = layer_unit.mp.output_dtype or layer_unit.mp.param_dtype
    else
      for _, u in ipairs(ctx.units) do
        if u.mp.param_dtype then dtype = u.mp.param_dtype break end
      end
    end
    local act = hidden and util.idiv(tokens.micro_batch * tokens.seq_len, mesh:size("cp")) * hidden *
      plan_dtype_size(dtype) or 0
    for p = 0, npp - 1 do
      out.in_flight[p + 1] = P.in_flight(pp.schedule, npp, n, pp.per_rank, p)
      local count = 0
      for _, s in ipairs(pp.stages) do
        if s.rank == p then
          if s.index < pp.count - 1 and pp.stages[s.index + 2].rank ~= p then count = count + n end -- activations
          if s.index > 0 and pp.stages[s.index].rank ~= p then count = count + n end -- their gradients
        end
      end
      out.send_recv[p + 1] = { count = count, bytes = count * act }
    end
  end
  return out
end

--- What pp rank p holds: the units of its stages, and the expert parameters of its stages'
-- modules (expert parallelism's, in units or not).
function P.on_rank(ctx, units, ep_order, p)
  local pp = ctx.pp
  local mine_units, mine_ep = {}, {}
  for _, u in ipairs(units) do
    if pp.stages[u.stage + 1].rank == p then mine_units[#mine_units + 1] = u end
  end
  for _, x in ipairs(ep_order) do
    local s = pp.stage_of[ctx.ep[x].module]
    if s ~= nil and pp.stages[s + 1].rank == p then mine_ep[#mine_ep + 1] = x end
  end
  return mine_units, mine_ep
end

--- The buffers pp rank p holds, a set of names: those of its stages' modules, and those of
-- the modules spanning the stages (every stage has them, as Automodel gives every stage the
-- rotary embedding).
function P.buffer_filter(ctx, p)
  local pp, out = ctx.pp, {}
  for _, nm in ipairs(ctx.model:named_modules()) do
    local name, m = nm[1], nm[2]
    local s = pp.stage_of[m]
    if s == nil or pp.stages[s + 1].rank == p then
      for _, b in ipairs(m.buffer_order or {}) do out[name == "" and b or name .. "." .. b] = true end
    end
  end
  return out
end

return P
