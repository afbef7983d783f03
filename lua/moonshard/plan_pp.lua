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

return P
