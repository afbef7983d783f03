-- moonshard.plan_sweep: `moonshard sweep`: every layout of N ranks over pp, dp_replicate,
-- dp_shard, cp, tp and ep, and the policy's knobs (activation checkpointing, resharding after
-- forward, CPU offload), planned as `moonshard plan` plans it, ranked by estimated tokens/s.
--
-- Stages, cheapest first, each timed:
--   1. enumerate: every ordered factorisation pp x dp_replicate x dp_shard x cp x tp = N, and
--      every ep dividing dp_replicate x dp_shard x cp x tp (the MoE mesh's ep, innermost);
--   2. rules: the planner's own checks where it has them (mesh_context.new: dp_replicate needs
--      dp_shard > 1, ep divides the ranks and the routed experts; the tp head counts
--      (plan_tp.check_heads); the batch (plan.tokens: cp divides the sequence, the global
--      batch splits over micro-batch x dp); the pipeline's stages and micro-batches
--      (plan_pp.virtual_stages, layer_split, check_microbatches; tied embeddings refuse it)),
--      and the sweep's own: ep > 1 on a model without routed experts, tp groups that cross
--      nodes (plan_time.link);
--   3. a lower bound of each rank's memory (parameters, gradients and optimizer state sharded
--      as evenly as the mesh allows, each decoder layer's input kept for backward, the
--      device's fixed overhead): a layout whose bound exceeds the capacity cannot fit;
--   4. full plans, from the one model tree, in order of a cheap step-time estimate, until
--      --max-plans; the rest are left unplanned and counted.  A layout that fits with fewer
--      memory savers (checkpointing, resharding, offload) dominates the same mesh with more:
--      they only add recompute, all-gathers or host transfers.

local util = require "moonshard.util"
local json = require "moonshard.json"

local M = {}

M.usage = [[
usage: moonshard sweep --config FILE --world N --device NAME|FILE --seq-len S
                       --global-batch G --policy PATH [options]

Plans every valid layout of N ranks over pp, dp_replicate, dp_shard, cp, tp and ep (the
MoE mesh's ep, inside dp_replicate x dp_shard x cp x tp), with each combination of the
policy's knobs it declares (activation checkpointing, resharding after forward, CPU
offload; see --knobs), as `moonshard plan` plans them; ranks those that fit the device by
estimated tokens/s (each an estimate) and says why the others were rejected.
Layouts are rejected by rule first (the planner's checks), then by a lower bound of memory
per rank, and the rest planned in order of a cheap estimate until --max-plans.

required:
  --config FILE        a Hugging Face config.json (as moonshard plan --config)
  --world N            the ranks, a whole number from 1 to 2^31 - 1
  --device NAME|FILE   h100-80gb, h200-141gb, b200-192gb, a100-80gb, mi300x-192gb or a
                       FILE.lua profile (as moonshard plan --device)
  --seq-len S          tokens per sample
  --global-batch G     samples per optimizer step
  --policy PATH        a policy directory or file (as moonshard plan --policy)
options:
  --micro-batch B      samples per micro-batch on each data-parallel rank (default 1)
  --set NAME=VALUE     a policy option for every plan, repeatable (as moonshard plan);
                       setting a knob stops the sweep over it
  --knobs LIST         the policy knobs swept, comma-separated, among
                       activation_checkpointing, reshard_after_forward, offload_policy,
                       prefetch.explicit and pack_islands (default: those the policy declares,
                       prefetch.explicit and pack_islands only when named; a named knob the
                       policy does not declare is an error), or none
  --optimizer NAME     adamw (default), torch_adamw or none
  --efficiency X       the share of the peak FLOP/s the compute reaches, in (0, 1]
  --top K              layouts shown in the table (default 10)
  --max-plans M        full plans at most (default 32, about 8 s for DeepSeek-V3)
  --json               every layout evaluated, with its figures or why it was rejected
  --csv                the same, one layout a line
  --no-progress        no progress line on stderr (shown only when stderr is a terminal)
  -h, --help           this help

exit status: 0 when the sweep ran (even when nothing fits), 1 when an input is bad (the
config, the policy, the device), 2 on usage errors.
]]

local function usage_error(msg)
  io.stderr:write("moonshard sweep: " .. msg .. "\n(try 'moonshard sweep --help')\n")
  return 2
end

local FLAGS = { json = true, csv = true, ["no-progress"] = true }
local VALUES = { config = true, world = true, device = true, ["seq-len"] = true, ["global-batch"] = true,
  policy = true, ["micro-batch"] = true, top = true, ["max-plans"] = true, optimizer = true, efficiency = true,
  knobs = true }

function M.parse(args)
  local o = { set = {} }
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "-h" or a == "--help" then o.help = true
    else
      local key, inline = a:match("^%-%-([%w_-]+)=(.*)$")
      key = key or a:match("^%-%-([%w_-]+)$")
      if not key then return nil, "unexpected argument '" .. util.short_name(a) .. "'" end
      if FLAGS[key] then
        if inline then return nil, "--" .. key .. " takes no value" end
        o[key] = true
      elseif VALUES[key] or key == "set" then
        local v = inline
        if not v then
          i = i + 1
          v = args[i]
        end
        if v == nil or v == "" then return nil, "--" .. key .. " needs a value" end
        if key == "set" then
          if not v:find("^[^=]+=") then return nil, "--set takes NAME=VALUE, got '" .. util.short_name(v) .. "'" end
          o.set[#o.set + 1] = v
        else
          if o[key] then return nil, "--" .. key .. " given twice" end
          o[key] = v
        end
      else
        return nil, "unknown option '" .. util.short_name(a) .. "'"
      end
    end
    i = i + 1
  end
  return o
end

-- Checks the options; returns the settings or nil and the usage error.
function M.check(o)
  for _, k in ipairs({ "config", "world", "device", "seq-len", "global-batch", "policy" }) do
    if not o[k] then return nil, "--" .. k .. " is required" end
  end
  if o.json and o.csv then return nil, "--json and --csv: give one" end
  local s = {}
  local function whole(flag, lo, hi, what)
    local v = o[flag]
    if v == nil then return nil end
    local n = v:match("^%d+$") and #v <= 13 and tonumber(v)
    if not n or n < lo or n > hi then
      return false, string.format("--%s is %s, not '%s'", flag, what, util.short_name(v))
    end
    return n
  end
  local checks = {
    { "world", 1, 2147483647, "the number of ranks, a whole number from 1 to 2147483647" },
    { "seq-len", 1, 2 ^ 40, "a whole number from 1 to 2^40" },
    { "global-batch", 1, 2 ^ 40, "a whole number from 1 to 2^40" },
    { "micro-batch", 1, 2 ^ 40, "a whole number from 1 to 2^40" },
    { "top", 1, 1000000, "a whole number from 1 to 1000000" },
    { "max-plans", 0, 1000000, "a whole number from 0 to 1000000" },
  }
  for _, c in ipairs(checks) do
    local n, err = whole(c[1], c[2], c[3], c[4])
    if n == false then return nil, err end
    s[c[1]] = n
  end
  s["micro-batch"] = s["micro-batch"] or 1
  s.top = s.top or 10
  s["max-plans"] = s["max-plans"] or M.DEFAULT_MAX_PLANS
  if o.knobs then
    local known = {}
    for _, d in ipairs(M.KNOBS) do known[d.name] = true end
    s.knobs = {}
    if o.knobs ~= "none" then
      for name in (o.knobs .. ","):gmatch("%s*([^,]-)%s*,") do
        if not known[name] then
          return nil, string.format("--knobs: unknown knob '%s' (knobs: activation_checkpointing, " ..
            "reshard_after_forward, offload_policy, prefetch.explicit, pack_islands; or none)", util.short_name(name))
        end
        s.knobs[name] = true
      end
    end
  end
  if o.efficiency then
    local e = o.efficiency:match("^%d*%.?%d+$") and tonumber(o.efficiency)
    if not e or e <= 0 or e > 1 then
      return nil, "--efficiency is a number in (0, 1] (the share of the peak FLOP/s), not '" ..
        util.short_name(o.efficiency) .. "'"
    end
    s.efficiency = e
  end
  if o.optimizer and not require("moonshard.plan").OPTIMIZERS[o.optimizer] then
    return nil, "--optimizer is adamw, torch_adamw or none, not '" .. util.short_name(o.optimizer) .. "'"
  end
  local devices = require "moonshard.devices"
  if not devices.PROFILES[o.device] and not (o.device:find("/", 1, true) or o.device:find("%.lua$")) then
    return nil, "--device '" .. util.short_name(o.device) .. "' is no device profile; expected one of " ..
      table.concat(devices.NAMES, ", ") .. " or a FILE.lua"
  end
  return s
end

M.DEFAULT_MAX_PLANS = 32

local AXES = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }

local function divisors(n)
  local small, large = {}, {}
  local d = 1
  while d * d <= n do
    if n % d == 0 then
      small[#small + 1] = d
      if d * d ~= n then table.insert(large, 1, util.idiv(n, d)) end
    end
    d = d + 1
  end
  for _, v in ipairs(large) do small[#small + 1] = v end
  return small
end
M.divisors = divisors

--- Every (pp, dp_replicate, dp_shard, cp, tp, ep) with pp x dp_replicate x dp_shard x cp x tp
-- = world and ep dividing dp_replicate x dp_shard x cp x tp; a list of size tables.
function M.layouts(world)
  local out = {}
  local function rec(k, rest, sizes)
    if k == #AXES then
      sizes[AXES[k]] = rest
      local non_pp = util.idiv(world, sizes.pp)
      for _, ep in ipairs(divisors(non_pp)) do
        local c = { ep = ep }
        for _, a in ipairs(AXES) do c[a] = sizes[a] end
        out[#out + 1] = c
      end
      return
    end
    for _, d in ipairs(divisors(rest)) do
      sizes[AXES[k]] = d
      rec(k + 1, util.idiv(rest, d), sizes)
    end
  end
  rec(1, world, {})
  return out
end

--- "pp=2,dp_shard=4,ep=2": the sizes that are not 1, as --mesh takes them.
function M.mesh_text(c)
  local parts = {}
  for _, a in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep" }) do
    if c[a] ~= 1 then parts[#parts + 1] = a .. "=" .. c[a] end
  end
  return #parts > 0 and table.concat(parts, ",") or "dp_shard=1"
end

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

local function knob_key(k)
  local keys, parts = util.sorted_keys(k), {}
  for j, name in ipairs(keys) do parts[j] = name .. "=" .. tostring(k[name]) end
  return table.concat(parts, ",")
end

-- The policy knobs a sweep tries, when the policy declares them and --set does not fix them:
-- the value that leaves the policy's default (false for checkpointing), then the ones that
-- save memory at some cost in time (recompute, all-gathers again in backward, host
-- transfers).  `saves` marks a knob value that saves memory.
M.KNOBS = {
  { name = "activation_checkpointing", values = { false, true }, short = "ac" },
  { name = "reshard_after_forward", values = { "default", true }, short = "reshard" },
  { name = "offload_policy", values = { "default", "cpu" }, short = "offload" },
  -- Automodel's explicit prefetch chains (forward 1, backward 2): no memory saver, a trade
  -- that doubles the candidates for little; swept only when --knobs names it
  { name = "prefetch.explicit", values = { "default", true }, short = "prefetch", on_request = true },
  -- the inkling2 and DeepSeek-V4 policies' packed FP32 islands: fewer collectives, a larger
  -- unsharded peak (the next unit prefetched is a whole layer); swept only when --knobs names it
  { name = "pack_islands", values = { "default", true }, short = "packed", on_request = true },
}
-- the memory savers: the knob and its value that saves memory
local SAVES = { activation_checkpointing = true, reshard_after_forward = true, offload_policy = "cpu" }
local function saves(name, v) return SAVES[name] ~= nil and v == SAVES[name] end
-- The knobs a candidate sets for the plan: those whose value is not the policy's default.
local function knob_settings(k)
  local out = {}
  for _, d in ipairs(M.KNOBS) do
    local v = k[d.name]
    if v ~= nil and v ~= "default" then out[#out + 1] = d.name .. "=" .. tostring(v) end
  end
  return out
end
-- Whether knobs a saves memory in a subset of the ways b does, and in fewer (b only adds
-- cost to what a already fits with).
local function saves_less(a, b)
  local fewer = false
  for _, d in ipairs(M.KNOBS) do
    -- a knob that saves no memory (explicit prefetch, packed islands) may make b faster:
    -- only candidates alike in those compare by their memory savers
    if SAVES[d.name] == nil and a[d.name] ~= b[d.name] then return false end
    local sa, sb = saves(d.name, a[d.name]), saves(d.name, b[d.name])
    if sa and not sb then return false end
    if sb and not sa then fewer = true end
  end
  return fewer
end

-- A candidate's knobs as the table shows them: "ac", "no ac", "ac reshard offload", ...
local function knob_text(k)
  if k == nil then return "-" end
  local parts = {}
  for _, d in ipairs(M.KNOBS) do
    local v = k[d.name]
    if d.name == "activation_checkpointing" and v ~= nil then parts[#parts + 1] = v and "ac" or "no ac"
    elseif v ~= nil and v ~= "default" then parts[#parts + 1] = d.short end
  end
  return #parts > 0 and table.concat(parts, " ") or "policy's"
end

local function strip(msg) return (tostring(msg):gsub("^moonshard [%a_]+ error: ", ""):gsub("^moonshard: ", "")) end

-- What the sweep knows of the model, computed once: the layer count, hidden size, head
-- counts, routed experts and top_k, tied embeddings, and the state bytes per element.
local function model_facts(tree, config, optimizer)
  local models = require "moonshard.models"
  local f = { experts = models.routed_experts(tree), tied = tree.attrs.tie_word_embeddings and true or false }
  local layers = tree:get("model.layers")
  f.layers = layers and (layers.type == "ModuleList" or layers.type == "ModuleDict") and #layers.child_order or 0
  f.hidden = tonumber(config.hidden_size) or 0
  f.top_k = tonumber(config.num_experts_per_tok) or 1
  local expert_modules = {}
  for _, nm in ipairs(tree:named_modules()) do
    if nm[2].type == "GroupedExperts" then
      expert_modules[nm[1]] = true
      -- the sizes of dim 1 of the experts' tensors: what a unit on ep_shard splits
      for _, pname in ipairs(nm[2].param_order) do
        local d1 = nm[2].params[pname].shape[2]
        if d1 then f.expert_dim1 = f.expert_dim1 and math.min(f.expert_dim1, d1) or d1 end
        if d1 and f.expert_dim1_gcd then
          local a, b = f.expert_dim1_gcd, d1
          while b ~= 0 do a, b = b, a % b end
          f.expert_dim1_gcd = a
        elseif d1 then
          f.expert_dim1_gcd = d1
        end
      end
    end
  end
  local DT = require("moonshard.plan").DTYPE_SIZE
  local FLOAT = { f32 = true, f16 = true, bf16 = true, f64 = true, f8e4m3 = true, f8e5m2 = true }
  local function state_bytes(dt)
    if optimizer == "torch_adamw" then return 2 * DT[dt] end
    return optimizer == "adamw" and (8 + (dt == "f32" and 0 or 4)) or 0
  end
  f.dense_state, f.expert_state, f.dense_params, f.expert_params = 0, 0, 0, 0
  -- each decoder layer's parameters in their compute form (2 bytes an element at most):
  -- {dense, experts}; the largest is gathered whole (its tp and ep piece) to compute it
  local layer = {}
  for _, np in ipairs(tree:named_parameters()) do
    local fqn, p = np[1], np[2]
    local owner = fqn:match("^(.*)%.[^.]+$") or ""
    local b = p.numel * DT[p.dtype]
    if p.requires_grad and FLOAT[p.dtype] then b = b + p.numel * (DT[p.dtype] + state_bytes(p.dtype)) end
    local expert = expert_modules[owner]
    if expert then
      f.expert_state, f.expert_params = f.expert_state + b, f.expert_params + p.numel
    else
      f.dense_state, f.dense_params = f.dense_state + b, f.dense_params + p.numel
    end
    local li = fqn:match("^model%.layers%.(%d+)%.")
    if li then
      local l = layer[li] or { 0, 0 }
      layer[li] = l
      local k = expert and 2 or 1
      l[k] = l[k] + p.numel * math.min(DT[p.dtype], 2)
    end
  end
  f.layer_bytes = {}
  for _, l in pairs(layer) do f.layer_bytes[#f.layer_bytes + 1] = l end
  return f
end

--- The lower bound of the fullest rank's memory on layout c: the dense state sharded over
-- pp x dp_shard x cp x tp (FSDP shards over dp_shard x cp, replicates over dp_replicate;
-- tensor and pipeline parallelism split the rest at best evenly), the experts' over all the
-- ranks, each decoder layer's input (2 bytes an element at least) for floor(layers / pp)
-- layers of one micro-batch, split over cp and tp, and the device's fixed overhead.
function M.lower_bound(f, c, t, dev, offload)
  local state = 0
  local shard = c.pp * c.dp_shard * c.cp * c.tp
  if not offload then
    -- the experts: over ep x ep_shard (all the ranks of a stage) with ep > 1, else as the rest
    state = f.dense_state / shard + f.expert_state / (c.ep > 1 and c.pp * c.dp_replicate * c.dp_shard * c.cp * c.tp
      or shard)
  end
  -- a layer's parameters gathered to compute it, beside the shards (when FSDP shards them)
  local gathered = 0
  if c.dp_shard * c.cp > 1 then
    for _, l in ipairs(f.layer_bytes) do gathered = math.max(gathered, l[1] / c.tp + l[2] / (c.ep * c.tp)) end
  end
  local acts = math.floor(f.layers / c.pp) * t.micro_batch * t.seq_len / (c.cp * c.tp) * f.hidden * 2
  return math.floor(state + gathered + acts) + dev.cuda_context_bytes + dev.nccl_buffer_bytes,
    { state = state, gathered = gathered }
end

--- What a plan teaches about layouts like it (the same knobs), to expect their memory: its
-- activations a decoder layer keeps per token (times tp, which splits most of them), what
-- the rest keeps per token (the loss, the embedding's), the transient per token, and its
-- unsharded peak as a multiple of one layer gathered (the bound's `gathered`).  nil when
-- the plan has no activations.
function M.lessons(plan, cand, parts)
  local a = plan.activations
  if not a or not a.tokens_per_rank or a.tokens_per_rank <= 0 then return nil end
  local bytes, n = 0, 0
  for _, l in ipairs(a.layers or {}) do
    local count = type(l.layers) == "table" and #l.layers or 1
    bytes, n = bytes + l.bytes * count, n + count
  end
  local other = 0
  for _, x in ipairs(a.other or {}) do other = other + x.bytes end
  local mem = plan.memory
  local run = mem.runs[1]
  local transient = run.transient or mem.transient or 0
  local pu = run.peak_unsharded or mem.peak_unsharded or 0
  local T = a.tokens_per_rank
  return { layer_tok = n > 0 and bytes / n / T * cand.sizes.tp or 0, other_tok = other / T, transient_tok = transient / T,
    unsharded = parts.gathered > 0 and pu / parts.gathered or nil }
end

--- The memory expected of the fullest rank of layout c with the lessons of a plan like it:
-- the bound's state, the unsharded peak, its layers' activations for the micro-batches a
-- pipeline keeps (PyTorch's 1F1B warm-up on pp rank 0), the rest, the transient, the
-- device's overhead.  Only orders the plans.
function M.expected(f, c, t, dev, parts, lesson, accumulation)
  local T = t.micro_batch * t.seq_len / c.cp
  local layers = math.ceil(f.layers / c.pp)
  local in_flight = c.pp > 1 and math.min(c.pp, accumulation) or 1
  local acts = layers * lesson.layer_tok * T / c.tp * in_flight + lesson.other_tok * T
  local held = parts.state + (lesson.unsharded or 1) * parts.gathered + acts + lesson.transient_tok * T
  return held * (1 + dev.fragmentation) + dev.cuda_context_bytes + dev.nccl_buffer_bytes
end

--- A cheap step-time estimate, only to order the full plans (the ranking is theirs): the
-- model FLOPs (6 x active parameters a token, x 4/3 with checkpointing) over the ranks at
-- the device's bf16 peak x efficiency, a 1F1B bubble of (pp - 1) / micro-batches, and the
-- activation collectives a micro-batch and layer: tp's 4 all-reduces, cp's key/value
-- all-gather, ep's 4 all_to_alls of top_k copies, at the link plan_time gives the axis.
function M.estimate(f, c, t, dev, eff, knobs, parts)
  local T = require "moonshard.plan_time"
  knobs = knobs or {}
  local ac = knobs.activation_checkpointing == true
  local world = c.pp * c.dp_replicate * c.dp_shard * c.cp * c.tp
  local active = f.dense_params + (f.experts and f.expert_params * f.top_k / f.experts or 0)
  local tokens = t.global_batch * t.seq_len
  local compute = 6 * active * tokens / (world * dev.bf16_flops * eff) * (ac and 4 / 3 or 1)
  local dp = c.dp_replicate * c.dp_shard
  local n = math.max(1, util.idiv(t.global_batch, t.micro_batch * dp))
  local bubble = compute * (c.pp - 1) / n
  local mb_bytes = t.micro_batch * t.seq_len / c.cp * f.hidden * 2
  local layers = n * math.max(1, math.ceil(f.layers / c.pp))
  local comm = 0
  if c.tp > 1 then
    comm = comm + T.collective_s(dev, T.link(world, dev.gpus_per_node, 1, c.tp), 4 * layers,
      4 * layers * mb_bytes * 2 * (c.tp - 1) / c.tp)
  end
  if c.cp > 1 then
    comm = comm + T.collective_s(dev, T.link(world, dev.gpus_per_node, c.tp, c.cp), 2 * layers,
      2 * layers * mb_bytes / c.tp * (c.cp - 1))
  end
  if c.ep > 1 and f.experts then
    comm = comm + T.collective_s(dev, T.link(world, dev.gpus_per_node, 1, c.ep), 4 * layers,
      4 * layers * mb_bytes / c.tp * f.top_k * (c.ep - 1) / c.ep)
  end
  -- resharding gathers each layer again in backward: a third more of FSDP's all-gathers, at
  -- the data-parallel link; offloading moves the rank's state to the host and back each
  -- step, taken at 25 GB/s (PCIe 4 x16, one direction)
  if knobs.reshard_after_forward == true and parts and c.dp_shard * c.cp > 1 then
    comm = comm + T.collective_s(dev, T.link(world, dev.gpus_per_node, c.tp, c.dp_shard * c.cp), f.layers,
      parts.gathered * f.layers / c.pp)
  end
  if knobs.offload_policy == "cpu" and parts then comm = comm + 2 * parts.state / 25e9 end
  return compute + bubble + comm
end

-- The pipeline settings the policy's options give (fsdp2_default's names; 1F1B otherwise).
local function pipeline_options(option_list)
  local by = {}
  for _, e in ipairs(option_list) do by[e.name] = e.value end
  local sched = by["pipeline.schedule"]
  return { schedule = type(sched) == "string" and sched or "1F1B",
    layers_per_stage = by["pipeline.layers_per_stage"], round = by["pipeline.round"] }
end

--- The first rule layout c breaks: nil, or {rule, why}.  env: facts, tokens, device,
-- pipeline options, model tree.
function M.rule_check(env, c)
  local mesh_context = require "moonshard.mesh_context"
  local f = env.facts
  local sizes = { n_routed_experts = f.experts }
  for k, v in pairs(c) do sizes[k] = v end
  local ok, mesh = pcall(mesh_context.new, sizes)
  if not ok then return { "mesh", (strip(mesh):gsub("^mesh: ", "")) } end
  if c.ep > 1 and not f.experts then
    return { "ep without experts", string.format("ep = %d on a model without routed experts: the ep axis only " ..
      "divides the ranks", c.ep) }
  end
  -- the MoE path's units of experts on ep_shard split dim 1 (Automodel's _moe_shard_placement),
  -- which FSDP2 shards only evenly (the planner's rule)
  local eps = mesh:size("ep_shard")
  if c.ep > 1 and eps > 1 and f.expert_dim1_gcd and f.expert_dim1_gcd % eps ~= 0 then
    return { "experts on ep_shard", string.format("the experts' units on ep_shard = %d split their tensors' dim 1 " ..
      "(Automodel's MoE path), which FSDP2 shards only evenly: %d does not divide them (sizes %d and others)", eps, eps,
      f.expert_dim1) }
  end
  -- Automodel's MoE parallelizer takes no tensor-parallel plan it was not named
  if c.ep > 1 and c.tp > 1 and f.experts and env.options.tp_plan == "auto" then
    return { "tp on the MoE path", string.format("tp = %d with ep = %d: NeMo Automodel's MoE parallelizer registers no " ..
      "tensor-parallel plan for custom MoE models (the policy's tp_plan is auto); set tp_plan to one", c.tp, c.ep) }
  end
  local T = require "moonshard.plan_time"
  if T.link(mesh.world, env.device.gpus_per_node, 1, c.tp) == "inter" then
    return { "tp spans nodes", string.format("tp = %d groups cross nodes of %d GPUs (%s): tensor parallelism " ..
      "stays within a node", c.tp, env.device.gpus_per_node, env.device.name) }
  end
  local why = require("moonshard.plan_tp").check_heads(env.tree, c.tp)
  if why then return { "tp heads", why } end
  local tokens
  ok, tokens = pcall(require("moonshard.plan").tokens, mesh, env.tokens)
  if not ok then return { "batch", (strip(tokens):gsub("^plan: ", ""):gsub("^tokens: ", "")) } end
  if c.pp > 1 then
    if f.tied then
      return { "pipeline", "the head is tied to the embeddings, which sit in the first and last stages; " ..
        "Automodel's pipelines refuse tied embeddings" }
    end
    local P = require "moonshard.plan_pp"
    local po = env.pipeline
    local sok, sched = pcall(P.schedule, po.schedule)
    if not sok then return { "pipeline", strip(sched) } end
    local S, v
    sok, S, v = pcall(P.virtual_stages, f.layers, po.layers_per_stage, c.pp, not sched.multi, po.round)
    if not sok then return { "pipeline", (strip(S):gsub("^pipeline: ", "")) } end
    local split
    sok, split = pcall(P.layer_split, S, f.layers)
    if not sok then return { "pipeline", (strip(split):gsub("^pipeline: ", "")) } end
    local m = P.check_microbatches(sched, c.pp, tokens.accumulation, v)
    if m then return { "pipeline", m } end
  end
  return nil, mesh
end

-- A reason's group: its rule and its message with the numbers left out.
local function group_of(rule, why)
  return rule .. ": " .. (why:gsub("[%d.]+ [KMGTP]?i?B", "#"):gsub("%d+%.?%d*", "#"))
end

--- Runs the sweep; returns the result table {layouts, candidates, fits (ranked), rejected,
-- unplanned, groups, timing, ...}.  o: parsed options, s: the checked numbers.
function M.run(o, s, progress)
  local clock = os.clock
  local timing = {}
  local t0 = clock()
  local cli = require "moonshard.plan_cli"
  local planner = require "moonshard.plan"
  local devices = require "moonshard.devices"
  local config = json.decode(util.read_file(o.config, "json") or error("moonshard: cannot read " .. o.config, 0), o.config)
  local tree = require("moonshard.models").from_config(config, o.config)
  local name = type(config._name_or_path) == "string" and config._name_or_path or
    (o.config:match("([^/]+)$") or o.config):gsub("%.[^.]+$", "")
  local entry = cli.load_policy({ policy = o.policy })
  local decl = planner.declared_options(entry)
  local option_list = planner.resolve_options(decl, nil, o.set)
  local dev = devices.get(o.device)
  local optimizer = o.optimizer or "adamw"
  local facts = model_facts(tree, config, optimizer)
  local set_by_user, offload, ac_set = {}, false, false
  for _, e in ipairs(option_list) do
    if e.set then set_by_user[e.name] = true end
    if e.name == "offload_policy" and e.value == "cpu" then offload = true end
    if e.name == "activation_checkpointing" and e.value ~= false then ac_set = true end
  end
  -- every combination of the knobs the policy declares and --set leaves free
  local knobs, swept = { {} }, {}
  local declared = {}
  for _, e in ipairs(decl) do declared[e.name] = true end
  for _, d in ipairs(M.KNOBS) do -- a knob --knobs names that the policy lacks is an error, not a silent no
    if s.knobs and s.knobs[d.name] and not declared[d.name] then
      local names = {}
      for _, e in ipairs(decl) do names[#names + 1] = e.name end
      error(string.format("moonshard: --knobs %s: policy %s does not declare that option (its options: %s)", d.name,
        o.policy, #names > 0 and table.concat(names, ", ") or "none"), 0)
    end
  end
  for _, d in ipairs(M.KNOBS) do
    if declared[d.name] and not set_by_user[d.name] and (s.knobs and s.knobs[d.name] or not s.knobs and not d.on_request) then
      swept[#swept + 1] = d.name
      local more = {}
      for _, k in ipairs(knobs) do
        for _, v in ipairs(d.values) do
          local c = copy(k)
          c[d.name] = v
          more[#more + 1] = c
        end
      end
      knobs = more
    end
  end
  local tokens = { seq_len = s["seq-len"], micro_batch = s["micro-batch"], global_batch = s["global-batch"] }
  local eff = s.efficiency or require("moonshard.plan_time").DEFAULT_EFFICIENCY
  local option_values = {}
  for _, e in ipairs(option_list) do option_values[e.name] = e.value end
  local env = { facts = facts, tokens = tokens, device = dev, pipeline = pipeline_options(option_list), tree = tree,
    options = option_values }
  timing.load_s = clock() - t0

  -- 1 and 2: enumerate, rules
  t0 = clock()
  local layouts = M.layouts(s.world)
  local records, survivors = {}, {}
  local groups, group_list = {}, {}
  local function reject(r, rule, why)
    r.status, r.rule, r.reason = "rejected", rule, why
    local key = group_of(rule, why)
    local g = groups[key]
    if not g then
      g = { rule = rule, count = 0, example = why, mesh = r.mesh_text, knobs = r.knobs }
      groups[key] = g
      group_list[#group_list + 1] = g
    end
    g.count = g.count + 1
  end
  for _, c in ipairs(layouts) do
    local r = { sizes = c, mesh_text = M.mesh_text(c) }
    records[#records + 1] = r
    local broken = M.rule_check(env, c)
    if broken then reject(r, broken[1], broken[2]) else survivors[#survivors + 1] = r end
  end
  timing.rules_s = clock() - t0

  -- 3: the memory bound, then each survivor's knobs with their estimates
  t0 = clock()
  local candidates = {}
  local function cannot_fit(bound)
    return string.format("cannot fit: needs at least %s of %s (parameters, gradients and optimizer state sharded " ..
      "as evenly as the mesh allows, each layer's input, the device's fixed overhead)", util.bytes(bound),
      util.bytes(dev.memory_bytes))
  end
  for _, r in ipairs(survivors) do
    -- the bound with the state on the device, and with it offloaded (what an offloading
    -- variant needs); a layout goes when no variant can fit, a variant when it cannot
    local on_b, on_p = M.lower_bound(facts, r.sizes, tokens, dev, offload)
    local off_b, off_p = M.lower_bound(facts, r.sizes, tokens, dev, true)
    local can_offload = offload
    for _, k in ipairs(knobs) do if k.offload_policy == "cpu" then can_offload = true end end
    r.bound, r.parts = can_offload and off_b or on_b, can_offload and off_p or on_p
    if r.bound > dev.memory_bytes then
      reject(r, "cannot fit", cannot_fit(r.bound))
    else
      r.status = "candidate"
      for _, k in ipairs(knobs) do
        local offloads = offload or k.offload_policy == "cpu"
        local c = { sizes = r.sizes, mesh_text = r.mesh_text, knobs = k, bound = offloads and off_b or on_b,
          parts = offloads and off_p or on_p,
          -- (the offload's cost is of the state it moves: the bound's state on the device)
          estimate_s = M.estimate(facts, r.sizes, tokens, dev, eff, k, on_p) }
        if c.bound > dev.memory_bytes then
          records[#records + 1] = c
          reject(c, "cannot fit", cannot_fit(c.bound))
        else
          candidates[#candidates + 1] = c
        end
      end
    end
  end
  table.sort(candidates, function(a, b)
    if a.estimate_s ~= b.estimate_s then return a.estimate_s < b.estimate_s end
    if a.mesh_text ~= b.mesh_text then return a.mesh_text < b.mesh_text end
    return knob_key(a.knobs) < knob_key(b.knobs)
  end)
  timing.bound_s = clock() - t0

  -- 4: full plans
  t0 = clock()
  local fits, planned, unplanned, fits_with, attempts, first_failure = {}, 0, 0, {}, 0, nil
  local evaluated = {}
  for _, r in ipairs(records) do if r.status == "rejected" then evaluated[#evaluated + 1] = r end end
  -- The order planned: the estimate's, except that a candidate expected not to fit goes to
  -- the back of the queue.  Expected: a plan whose activations, transient and overhead
  -- alone exceed the capacity sends the rest of its class (pp, cp, tp, the knobs: what the
  -- activations depend on) back; and each plan teaches how far the fullest rank's peak
  -- exceeds the lower bound on layouts like it (the knobs, whether ep, pp and FSDP split
  -- anything: what the bound leaves out grows with them), so that a candidate whose bound
  -- times the largest such ratio seen exceeds the capacity goes back too.  Only the order
  -- changes; every candidate planned is planned in full.
  local heavy, ratio = {}, {}
  local function class_of(c)
    return string.format("%d,%d,%d,%s", c.sizes.pp, c.sizes.cp, c.sizes.tp, knob_key(c.knobs))
  end
  local function kind_of(c)
    return string.format("%s|ep%s|pp%s|fsdp%s", knob_key(c.knobs), tostring(c.sizes.ep > 1), tostring(c.sizes.pp > 1),
      tostring(c.sizes.dp_shard * c.sizes.cp > 1))
  end
  local learned = {} -- knob key -> M.lessons of the latest plan with those knobs
  local function expected_over(c)
    if heavy[class_of(c)] or c.bound * (ratio[kind_of(c)] or 1) > dev.memory_bytes then return true end
    local lesson = learned[knob_key(c.knobs)]
    if not lesson then return false end
    local dp = c.sizes.dp_replicate * c.sizes.dp_shard
    local accumulation = math.max(1, util.idiv(tokens.global_batch, tokens.micro_batch * dp))
    return M.expected(facts, c.sizes, tokens, dev, c.parts, lesson, accumulation) > dev.memory_bytes
  end
  local queue, deferred, qi = candidates, {}, 0
  local function next_candidate()
    while true do
      qi = qi + 1
      local c = queue[qi]
      if c == nil then
        if queue == deferred then return nil end
        queue, qi = deferred, 0
      elseif queue ~= deferred and expected_over(c) then deferred[#deferred + 1] = c
      else return c end
    end
  end
  local i = 0
  while true do
    local cand = next_candidate()
    if not cand then break end
    i = i + 1
    local dominated
    for _, k in ipairs(fits_with[cand.mesh_text] or {}) do
      if saves_less(k, cand.knobs) then dominated = k break end
    end
    if dominated then
      local with = knob_text(dominated)
      reject(cand, "dominated", string.format("fits with %s already; %s only adds recompute, all-gathers or host transfers",
        with, knob_text(cand.knobs)))
    elseif planned >= s["max-plans"] or attempts >= 4 * s["max-plans"] then
      cand.status = "unplanned"
      unplanned = unplanned + 1
    else
      planned, attempts = planned + 1, attempts + 1
      if progress then
        io.stderr:write(string.format("\rmoonshard sweep: planning %d of %d candidates (%d planned, budget %d) ",
          i, #candidates, planned, s["max-plans"]))
      end
      local set = {}
      for _, v in ipairs(o.set) do set[#set + 1] = v end
      for _, v in ipairs(knob_settings(cand.knobs)) do set[#set + 1] = v end
      local p0 = clock()
      local mesh = require("moonshard.mesh_context").new(copy(cand.sizes))
      -- checkpoint_wrap inserts its wrappers into the model tree (Module:checkpoint_wrap), so
      -- a plan that checkpoints gets a tree of its own; the others share the one built
      local ac = cand.knobs.activation_checkpointing or ac_set
      local t = ac and require("moonshard.models").from_config(config, o.config) or tree
      local ok, plan = pcall(planner.plan, t, mesh, entry, { name = name, optimizer = optimizer,
        policy_name = o.policy, set = set, tokens = copy(tokens), device = dev, efficiency = s.efficiency,
        log = function() end })
      cand.plan_s = clock() - p0
      -- a plan the policy or the planner refuses gives no figures: it does not use up the
      -- budget of plans (the attempts stop at 4 x the budget, which bounds the time)
      if not ok then
        planned = planned - 1
        first_failure = first_failure or (strip(plan):gsub("^plan: ", ""))
        reject(cand, "plan failed", (strip(plan):gsub("^plan: ", "")))
      else
        local mem = plan.memory
        cand.peak, cand.capacity = mem.fit.worst.peak, mem.capacity
        cand.tokens_per_s, cand.step_s, cand.mfu = plan.time.tokens_per_s, plan.time.step_s, plan.time.mfu
        local run = mem.runs[1]
        for _, x in ipairs(mem.runs) do if x.first == mem.fit.worst.rank then run = x end end
        local t = require("moonshard.plan_memory").terms_of(mem, run)
        if (t.activations or 0) + (t.transient or 0) + (t.overhead or 0) > mem.capacity then
          heavy[class_of(cand)] = true
        end
        local k = kind_of(cand)
        ratio[k] = math.max(ratio[k] or 1, mem.fit.worst.peak / cand.bound)
        learned[knob_key(cand.knobs)] = M.lessons(plan, cand, cand.parts) or learned[knob_key(cand.knobs)]
        if mem.fit.fits then
          cand.status = "fits"
          fits[#fits + 1] = cand
          fits_with[cand.mesh_text] = fits_with[cand.mesh_text] or {}
          table.insert(fits_with[cand.mesh_text], cand.knobs)
        else
          reject(cand, "does not fit", string.format("does not fit: %d of %d ranks over %s; the fullest, rank %d, " ..
            "peaks at %s (largest term: %s, %s)", mem.fit.over, mesh.world, util.bytes(mem.capacity), mem.fit.worst.rank,
            util.bytes(mem.fit.worst.peak), mem.fit.worst.largest.name, util.bytes(mem.fit.worst.largest.bytes)))
        end
      end
    end
    evaluated[#evaluated + 1] = cand
  end
  if progress and planned > 0 then io.stderr:write("\r" .. string.rep(" ", 78) .. "\r") end
  -- every plan refused (a bad --set value, a policy that cannot plan this model): an error,
  -- not an empty ranking
  if planned == 0 and first_failure then
    error("moonshard: every plan the sweep made failed; the first: " .. first_failure, 0)
  end
  -- a layout that fits with fewer memory savers than another that fits on the same mesh
  -- dominates it, whichever was planned first
  -- and of two fits on the same mesh, one no faster and no smaller than the other (the knobs
  -- changed nothing that matters, as explicit prefetch on a path that sets none) is left
  -- out too, the one with fewer knobs set kept
  local function nset(k) return #knob_settings(k) end
  local kept, gone = {}, {}
  for i, f in ipairs(fits) do
    local by, why
    for j, g in ipairs(fits) do
      if j ~= i and g.mesh_text == f.mesh_text then
        if saves_less(g.knobs, f.knobs) then
          by, why = g, "only adds recompute, all-gathers or host transfers"
        elseif not saves_less(f.knobs, g.knobs) and g.tokens_per_s >= f.tokens_per_s and g.peak <= f.peak and
            (g.tokens_per_s > f.tokens_per_s or
            g.peak < f.peak or nset(g.knobs) < nset(f.knobs) or (nset(g.knobs) == nset(f.knobs) and j < i)) then
          by, why = g, "is no faster and needs no less memory"
        end
        if by then break end
      end
    end
    if by then gone[#gone + 1] = { f, by, why } else kept[#kept + 1] = f end
  end
  for _, x in ipairs(gone) do
    local f, by, why = x[1], x[2], x[3]
    reject(f, "dominated", string.format("fits with %s already; %s %s", knob_text(by.knobs), knob_text(f.knobs), why))
    f.tokens_per_s, f.step_s, f.mfu = nil, nil, nil
  end
  fits = kept
  timing.plans_s = clock() - t0
  table.sort(fits, function(a, b)
    if a.tokens_per_s ~= b.tokens_per_s then return a.tokens_per_s > b.tokens_per_s end
    if a.mesh_text ~= b.mesh_text then return a.mesh_text < b.mesh_text end
    return knob_key(a.knobs) < knob_key(b.knobs)
  end)
  for i, f in ipairs(fits) do f.rank = i end
  table.sort(group_list, function(a, b)
    if a.count ~= b.count then return a.count > b.count end
    return a.example < b.example
  end)
  return { name = name, world = s.world, device = dev.name, capacity = dev.memory_bytes, tokens = tokens,
    policy = o.policy, layouts = #layouts, rule_survivors = #survivors, candidates = #candidates, planned = planned,
    unplanned = unplanned, max_plans = s["max-plans"], fits = fits, evaluated = evaluated, groups = group_list,
    knobs = swept, timing = timing }
end


local function pad(v, w, left)
  v = tostring(v)
  if #v >= w then return v end
  return left and v .. string.rep(" ", w - #v) or string.rep(" ", w - #v) .. v
end

--- The table: the top K that fit, then the rejections by reason.
function M.to_text(res, top)
  local T = require "moonshard.plan_time"
  local out = {}
  local function add(s) out[#out + 1] = s end
  add(string.format("sweep of %s on %d ranks of %s (%s), %d tokens x %d a step, policy %s", res.name, res.world,
    res.device, util.bytes(res.capacity), res.tokens.seq_len, res.tokens.global_batch, res.policy))
  add(string.format("%d layouts; %d pass the rules; %d candidates with the knobs (%s); %d planned (at most %d), " ..
    "%d fit, %d left unplanned", res.layouts, res.rule_survivors, res.candidates,
    #res.knobs > 0 and table.concat(res.knobs, ", ") or "none swept", res.planned, res.max_plans, #res.fits,
    res.unplanned))
  add("")
  if #res.fits == 0 then add("no layout planned fits")
  else
    local rows = { { "#", "mesh", "knobs", "tokens/s", "step", "MFU", "peak / capacity" } }
    for i = 1, math.min(top, #res.fits) do
      local f = res.fits[i]
      rows[#rows + 1] = { tostring(i), f.mesh_text, knob_text(f.knobs), util.thousands(math.floor(f.tokens_per_s + 0.5)),
        T.duration(f.step_s), string.format("%.1f%%", 100 * f.mfu),
        util.bytes(f.peak) .. " / " .. util.bytes(f.capacity) }
    end
    local widths = {}
    for _, row in ipairs(rows) do
      for j, v in ipairs(row) do widths[j] = math.max(widths[j] or 0, #v) end
    end
    for _, row in ipairs(rows) do
      local cells = {}
      for j, v in ipairs(row) do cells[j] = pad(v, widths[j], j == 2 or j == 3) end
      add("  " .. table.concat(cells, "  "))
    end
    if #res.fits > top then add(string.format("  (and %d more that fit)", #res.fits - top)) end
  end
  add("")
  if #res.groups > 0 then
    add("rejected:")
    for _, g in ipairs(res.groups) do
      add(string.format("  %6d  %s, e.g. %s%s: %s", g.count, g.rule, g.mesh,
        g.knobs and next(g.knobs) and " (" .. knob_text(g.knobs) .. ")" or "", g.example))
    end
  end
  if res.unplanned > 0 then
    add(string.format("  %6d  unplanned: past --max-plans %d (cheapest estimate first; raise it to plan them)",
      res.unplanned, res.max_plans))
  end
  local t = res.timing
  add(string.format("time (CPU): load %.2f s, rules %.2f s, bound and estimate %.2f s, %d plans %.2f s",
    t.load_s, t.rules_s, t.bound_s, res.planned, t.plans_s))
  return table.concat(out, "\n") .. "\n"
end

local function row_of(r)
  local c = r.sizes
  local k = r.knobs
  return { mesh = r.mesh_text, pp = c.pp, dp_replicate = c.dp_replicate, dp_shard = c.dp_shard, cp = c.cp, tp = c.tp,
    ep = c.ep, activation_checkpointing = k and k.activation_checkpointing,
    reshard_after_forward = k and k.reshard_after_forward, offload_policy = k and k.offload_policy,
    prefetch_explicit = k and k["prefetch.explicit"], pack_islands = k and k.pack_islands,
    status = r.status, rank = r.rank,
    rule = r.rule, reason = r.reason, lower_bound_bytes = r.bound, estimate_s = r.estimate_s,
    tokens_per_s = r.tokens_per_s, step_s = r.step_s, mfu = r.mfu, peak_bytes = r.peak, capacity_bytes = r.capacity,
    plan_s = r.plan_s }
end

M.CSV_COLUMNS = { "mesh", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "activation_checkpointing",
  "reshard_after_forward", "offload_policy", "prefetch_explicit", "pack_islands", "status",
  "rank", "tokens_per_s", "step_s", "mfu", "peak_bytes", "capacity_bytes", "lower_bound_bytes", "estimate_s", "plan_s",
  "rule", "reason" }

--- Every layout evaluated as JSON: {"moonshard_sweep": 1, ...}.
function M.to_json(res)
  local rows = {}
  for i, r in ipairs(res.evaluated) do
    local row = row_of(r)
    local keys = { "mesh", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "activation_checkpointing",
      "reshard_after_forward", "offload_policy", "prefetch_explicit", "pack_islands", "status", "rank",
      "tokens_per_s", "step_s", "mfu", "peak_bytes", "capacity_bytes", "lower_bound_bytes",
      "estimate_s", "plan_s", "rule", "reason" }
    for _, k in ipairs(keys) do if row[k] == nil then row[k] = json.null end end
    rows[i] = json.object(keys, row)
  end
  local groups = {}
  for i, g in ipairs(res.groups) do
    groups[i] = json.object({ "rule", "count", "example_mesh", "example" },
      { rule = g.rule, count = g.count, example_mesh = g.mesh, example = g.example })
  end
  local ranking = {}
  for i, f in ipairs(res.fits) do ranking[i] = f.mesh_text .. " (" .. knob_text(f.knobs) .. ")" end
  local top = json.object({ "moonshard_sweep", "model", "world", "device", "capacity_bytes", "policy", "seq_len",
    "micro_batch", "global_batch", "knobs", "layouts", "rule_survivors", "candidates", "planned", "unplanned",
    "max_plans", "fits", "ranking", "rejected", "timing", "evaluated" }, {
    moonshard_sweep = 1, model = res.name, world = res.world, device = res.device, capacity_bytes = res.capacity,
    policy = res.policy, seq_len = res.tokens.seq_len, micro_batch = res.tokens.micro_batch,
    global_batch = res.tokens.global_batch, knobs = json.array(res.knobs), layouts = res.layouts,
    rule_survivors = res.rule_survivors, candidates = res.candidates, planned = res.planned, unplanned = res.unplanned,
    max_plans = res.max_plans, fits = #res.fits, ranking = json.array(ranking), rejected = json.array(groups),
    timing = res.timing, evaluated = json.array(rows) })
  return json.encode(top, { indent = 1 }) .. "\n"
end

local function csv_cell(v)
  if v == nil then return "" end
  if type(v) == "boolean" then return v and "true" or "false" end
  if type(v) == "number" then
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%d", v) end
    return string.format("%.6g", v)
  end
  v = tostring(v)
  if v:find('[,"\n]') then return '"' .. v:gsub('"', '""') .. '"' end
  return v
end

--- The same as CSV, a header and one layout a line.
function M.to_csv(res)
  local out = { table.concat(M.CSV_COLUMNS, ",") }
  for _, r in ipairs(res.evaluated) do
    local row, cells = row_of(r), {}
    for j, k in ipairs(M.CSV_COLUMNS) do cells[j] = csv_cell(row[k]) end
    out[#out + 1] = table.concat(cells, ",")
  end
  return table.concat(out, "\n") .. "\n"
end

--- Runs `moonshard sweep`; tty: whether stderr is a terminal.  Returns the exit status.
function M.main(args, tty)
  local o, err = M.parse(args)
  if not o then return usage_error(err) end
  if o.help then
    io.stdout:write(M.usage)
    return 0
  end
  local s
  s, err = M.check(o)
  if not s then return usage_error(err) end
  local ok, res = pcall(M.run, o, s, tty and not o["no-progress"])
  if not ok then
    io.stderr:write("moonshard sweep: error: " .. strip(res) .. "\n")
    return 1
  end
  local text
  if o.json then text = M.to_json(res)
  elseif o.csv then text = M.to_csv(res)
  else text = M.to_text(res, s.top) end
  io.stdout:write(text)
  return 0
end

return M
