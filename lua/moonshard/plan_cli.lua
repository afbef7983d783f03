-- moonshard.plan_cli: `moonshard plan`, the planner on the command line.
--
--   moonshard plan (--config config.json | --safetensors PATH | --model ORG/NAME) --mesh dp_shard=8,ep=8
--                  --policy policies/inkling2 [--set NAME=VALUE ...] [--json] [--svg FILE] [--audit]
--   moonshard plan --policy PATH --list-options

local util = require "moonshard.util"

local M = {}

M.usage = [[
usage: moonshard plan (--config FILE | --safetensors PATH | --model ORG/NAME [--checkpoint])
                     --mesh SIZES --policy PATH [options]
       moonshard plan --policy PATH --list-options

Applies a sharding policy to a model on a mesh, without GPUs, and prints what every rank
holds and sends: the shard units in the order fully_shard is called, their precision and
layouts, what expert parallelism owns, memory per rank and communication per step.

model (one of):
  --config FILE        a Hugging Face config.json; architectures[0] picks the builder
                       (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                       Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
                       MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
                       DeepseekV4ForCausalLM, Inkling2ForCausalLM)
  --safetensors PATH   a .safetensors file, a model.safetensors.index.json, or a directory
                       holding one: names, dtypes and shapes as on disk (no data read)
  --model ORG/NAME     a model in the local Hugging Face cache, never downloaded: its
                       config.json, as --config; with --checkpoint, its safetensors
                       headers, as --safetensors.  The cache is $HF_HUB_CACHE, else
                       $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
                       $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (as
                       huggingface_hub resolves it); the revision is the one refs/main
                       names, else the only snapshot, else the one modified last (said on
                       stderr)
required:
  --mesh SIZES         e.g. dp_replicate=2,dp_shard=4,ep=8 (axes pp dp_replicate dp_shard
                       cp tp ep; unset sizes are 1; the world is their product without ep);
                       with --recipe, the recipe's distributed sizes when it gives dp_size
  --policy PATH        a policy directory (e.g. policies/inkling2) or one policy file
                       (e.g. policies/fsdp2_default.lua); with --recipe, the shipped policy
                       of the recipe's manager when not given
a recipe (NeMo Automodel's infrastructure steps, docs/recipes.md):
  --recipe FILE        a Lua file returning Automodel's sections (distributed, pipeline, moe,
                       peft, quantization, fp8, qat, activation_checkpointing) with its field
                       names; loaded in the policy sandbox.  Its steps run in Automodel's
                       order on the model (4-bit quantization, LoRA, fp8, QAT), then the
                       policy shards it; its distributed, pipeline and moe fields set the
                       policy's options (--set overrides them).  The plan shows each step and
                       the modules it changed
the policy's options (declared by the policy, read by it from ctx.options):
  --set NAME=VALUE     set an option, repeatable (--set reshard_after_forward=false
                       --set prefetch.forward=2 --set activation_checkpointing=every:2);
                       VALUE is read as the option's type: none, true, false, an
                       integer, a number, a list of integers (0,3,5) or a string; an
                       unknown NAME or a VALUE of the wrong type is an error
  --list-options       print the policy's options (defaults, types, docs) and exit;
                       needs only --policy
output:
  --json               the plan JSON (version 1, described in docs/planning.md) on stdout instead of the table
  --svg FILE           also draw the units and the per-rank memory into FILE
  --audit              every parameter's stored, gathered and reduced dtype (added to the
                       JSON as "audit" with --json)
  --optimizer NAME     adamw (default: fp32 moments, fp32 master weights for non-fp32
                       parameters, as TE FusedAdam keeps them), torch_adamw
                       (torch.optim.AdamW on the stored parameters: moments of their
                       dtype, no master weights) or none
  --name NAME          the model name to print (default: the config's _name_or_path or
                       the file name; ORG/NAME with --model)
  --rank R             also show what rank R holds: its coordinates, and every
                       parameter's local shape, padded shard, placements and unit (added
                       to the JSON as "rank_view" with --json)
the batch (traffic that depends on it is counted only when --seq-len is given):
  --seq-len S          tokens per sample
  --micro-batch B      samples per micro-batch on each data-parallel rank (default 1)
  --global-batch G     samples per optimizer step (default B x dp, dp = dp_replicate x
                       dp_shard); a step is G / (B x dp) micro-batches; counts expert
                       parallelism's token all_to_all (dispatch and combine, forward and
                       backward, routing spread evenly), tensor parallelism's activation
                       collectives and context parallelism's key/value exchange
  --cp-rotate M        how cp ranks exchange keys and values: allgather (default, as NeMo
                       Automodel sets it) or alltoall (a ring of cp - 1 steps)
the device (memory per rank gains its capacity and overhead; with the batch, an estimate
of the step's time, tokens/s, MFU and exposed communication; docs/planning.md lists the
model's assumptions):
  --device NAME|FILE   h100-80gb, h200-141gb, b200-192gb, a100-80gb or mi300x-192gb, or a
                       FILE.lua returning a table of figures (loaded in the policy sandbox,
                       with its limits); without it, no time is estimated
  --efficiency X       the share of the peak FLOP/s the compute reaches, in (0, 1]
                       (default 0.5)
the policy sandbox (per call into the policy):
  --policy-instructions N   the instruction budget (default 200000000)
  --policy-memory MB        the memory cap in MiB, at least 1 (default 256)
  --policy-seconds S        the wall-clock limit in seconds, at least 1, read in whole seconds
                            (default 60)
  -h, --help           this help

The policy's ctx:log lines go to stderr as it runs, prefixed with "policy PATH: " (at most
64 KiB a plan); the warnings it added (ctx:warn) are shown with the plan, and on stderr
before the error when the plan fails.  The table and the JSON record the options used,
the prefetch depths and the modules wrapped for activation checkpointing.

exit status: 0 on success, 1 when the plan is invalid or an input is bad, 2 on usage errors.
]]

local function usage_error(msg)
  io.stderr:write("moonshard plan: " .. msg .. "\n(try 'moonshard plan --help')\n")
  return 2
end

local FLAGS = { json = true, audit = true, checkpoint = true, ["list-options"] = true }
-- options given any number of times: option -> list of values
local REPEATED = { set = true }
local VALUES = { config = true, safetensors = true, model = true, mesh = true, policy = true, svg = true, optimizer = true,
  recipe = true,
  name = true, rank = true, device = true, efficiency = true, ["seq-len"] = true, ["micro-batch"] = true, ["global-batch"] = true, ["cp-rotate"] = true,
  ["policy-instructions"] = true, ["policy-memory"] = true, ["policy-seconds"] = true }
-- the sandbox's limits: option -> policy.load's opts key
local LIMITS = { ["policy-instructions"] = "instructions", ["policy-memory"] = "memory_mb",
  ["policy-seconds"] = "seconds" }

function M.parse(args)
  local o = {}
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "-h" or a == "--help" then
      o.help = true
    else
      local key, inline = a:match("^%-%-([%w_-]+)=(.*)$")
      key = key or a:match("^%-%-([%w_-]+)$")
      if not key then return nil, "unexpected argument '" .. a .. "'" end
      if FLAGS[key] then
        if inline then return nil, "--" .. key .. " takes no value (got '" .. a .. "')" end
        o[key] = true
      elseif REPEATED[key] or VALUES[key] then
        local v = inline
        if not v then
          i = i + 1
          v = args[i]
        end
        if v == nil or v == "" then return nil, "--" .. key .. " needs a value" end
        if REPEATED[key] then
          if key == "set" and not v:find("^[^=]+=") then
            return nil, "--set takes NAME=VALUE (e.g. --set reshard_after_forward=false), got '" .. v .. "'"
          end
          o[key] = o[key] or {}
          o[key][#o[key] + 1] = v
        else
          if o[key] then return nil, "--" .. key .. " given twice" end
          o[key] = v
        end
      else
        return nil, "unknown option '" .. a .. "'"
      end
    end
    i = i + 1
  end
  return o
end

local function read_file(path)
  local s, err, opened = util.read_file(path, "json")
  if not s then
    error("moonshard: cannot read " .. path .. ": " .. (opened and tostring(err) or util.io_reason(path, err)), 0)
  end
  return s
end

local function stem(path) return (path:match("([^/]+)$") or path):gsub("%.[^.]+$", "") end

local function is_dir(path)
  local f = io.open(path .. "/.", "r")
  if f then f:close() return true end
  return false
end

-- --model: the config.json, or with --checkpoint the snapshot folder, of the model in the
-- local Hugging Face cache (moonshard.hf_cache); a note on stderr when refs/main did not say
-- which revision.
local function from_cache(o)
  local hf = require "moonshard.hf_cache"
  local path, info
  if o.checkpoint then
    info, path = hf.snapshot(o.model)
    if info then
      path = info.dir
      if not util.exists(path .. "/model.safetensors.index.json") and not util.exists(path .. "/model.safetensors") then
        error(string.format("moonshard: %s: revision %s (%s) has neither model.safetensors.index.json nor " ..
          "model.safetensors (download them with `hf download %s`, or plan from its config.json without " ..
          "--checkpoint)", o.model, info.revision, path, o.model), 0)
      end
    end
  else
    path, info = hf.find(o.model, "config.json")
  end
  if not path then error("moonshard: " .. info, 0) end
  if info.note then io.stderr:write("moonshard plan: note: " .. info.note .. "\n") end
  return path
end

-- The model tree, its name and its config (nil for safetensors).
local function load_model(o)
  if o.model then
    local path = from_cache(o)
    if o.checkpoint then o = { safetensors = path, name = o.name or o.model } else
      o = { config = path, name = o.name or o.model } end
  end
  if o.config then
    local json = require "moonshard.json"
    local config = json.decode(read_file(o.config), o.config)
    local tree = require("moonshard.models").from_config(config, o.config)
    local name = o.name or (type(config._name_or_path) == "string" and config._name_or_path) or stem(o.config)
    return tree, name, config
  end
  local st = require "moonshard.safetensors"
  local path = o.safetensors
  if is_dir(path) then
    local index = path .. "/model.safetensors.index.json"
    -- asked without opening: an index that is a FIFO is refused by name, not waited on
    if util.exists(index) then path = index else path = path .. "/model.safetensors" end
  end
  return st.tree_from_safetensors(path), o.name or stem(o.safetensors), nil
end

--- Builds the plan from parsed options; returns plan, name of the policy.
function M.make_plan(o)
  local mesh_context = require "moonshard.mesh_context"
  local tree, name, config = load_model(o)
  local recipe = o.recipe and require("moonshard.recipe").load(o.recipe, o.limits)
  local sizes
  if o.mesh then
    sizes = mesh_context.parse(o.mesh)
  else
    -- the recipe's distributed sizes (M.main made sure it has a recipe)
    sizes = require("moonshard.recipe").mesh_sizes(recipe)
    if not sizes.dp_shard then
      error(string.format("moonshard: recipe %s: distributed.dp_size is %s; give --mesh, or a number of ranks " ..
        "as dp_size (Automodel infers \"none\" from the world size, which a plan does not have)", recipe.file,
        recipe.distributed and recipe.distributed.dp_size or "not given"), 0)
    end
  end
  -- the experts of the MoE blocks the builder made, whatever its config calls them (none
  -- for a dense model, and for a checkpoint's tree, whose experts expert_parallel checks)
  sizes.n_routed_experts = config and require("moonshard.models").routed_experts(tree) or nil
  local mesh = mesh_context.new(sizes)
  if not o.policy then o.policy = M.manager_policy(recipe) end
  local entry = M.load_policy(o)
  local plan = require("moonshard.plan").plan(tree, mesh, entry, {
    name = name, architecture = config and config.architectures and config.architectures[1] or tree.type,
    optimizer = o.optimizer, policy_name = o.policy, set = o.set, warnings = o.warnings,
    tokens = o["seq-len"] and { seq_len = tonumber(o["seq-len"]), micro_batch = tonumber(o["micro-batch"]),
      global_batch = tonumber(o["global-batch"]), cp_rotate = o["cp-rotate"] } or nil,
    device = o.device, efficiency = o.efficiency and tonumber(o.efficiency), device_limits = o.limits,
    recipe = recipe,
  })
  return plan
end

--- The shipped policy of a recipe's manager (policies/fsdp2_default.lua, ddp.lua,
-- megatron_fsdp.lua).
function M.manager_policy(recipe)
  local R = require "moonshard.recipe"
  local dir = require("moonshard.policy").shipped_dir()
  local file = R.POLICIES[recipe.manager]
  if not dir or not util.exists(dir .. "/" .. file) then
    error(string.format("moonshard: recipe %s: the %s manager's policy %s is not installed; give --policy",
      recipe.file, recipe.manager, file), 0)
  end
  -- "lua/moonshard/../../policies" read as "policies": each "x/.." dropped
  local parts = {}
  for part in (dir .. "/" .. file):gmatch("[^/]+") do
    if part == ".." and #parts > 0 and parts[#parts] ~= ".." then parts[#parts] = nil
    elseif part ~= "." then parts[#parts + 1] = part end
  end
  return (dir:sub(1, 1) == "/" and "/" or "") .. table.concat(parts, "/")
end

--- The policy's entry table, loaded in the sandbox with the limits given.
function M.load_policy(o)
  local popts = { modules = require("moonshard.policy").host_modules() }
  for _, key in pairs(LIMITS) do popts[key] = o.limits and o.limits[key] end
  local policy = require("moonshard.policy").load(o.policy, popts)
  return require("moonshard.policy").entry_point(policy, o.policy)
end

--- --list-options: the policy's options as text.
function M.options_listing(o)
  local planner = require "moonshard.plan"
  local decl = planner.declared_options(M.load_policy(o))
  return string.format("options of policy %s (set with --set NAME=VALUE):\n", o.policy) .. planner.options_text(decl)
end

--- Runs `moonshard plan` with a list of arguments; returns the exit status.
function M.main(args)
  local o, err = M.parse(args)
  if not o then return usage_error(err) end
  if o.help then
    io.stdout:write(M.usage)
    return 0
  end
  local models_given = (o.config and 1 or 0) + (o.safetensors and 1 or 0) + (o.model and 1 or 0)
  if o["list-options"] then
    if not o.policy and not o.recipe then return usage_error("--list-options needs --policy (or --recipe)") end
  elseif models_given ~= 1 then
    return usage_error("give the model with exactly one of --config FILE, --safetensors PATH or --model ORG/NAME")
  end
  if o.checkpoint and not o.model then
    return usage_error("--checkpoint goes with --model ORG/NAME (give a checkpoint's files with --safetensors PATH)")
  end
  if o.model then
    local ok, why = require("moonshard.hf_cache").check_repo_id(o.model)
    if not ok then
      return usage_error(string.format("--model '%s' is no Hugging Face model id (ORG/NAME, e.g. Qwen/Qwen3-8B): it %s",
        util.short_name(o.model), why))
    end
  end
  if not o.mesh and not o["list-options"] and not o.recipe then
    return usage_error("--mesh is required, e.g. --mesh dp_shard=8")
  end
  if not o.policy and not o.recipe then return usage_error("--policy is required, e.g. --policy policies/inkling2") end
  for flag, key in pairs(LIMITS) do
    local v = o[flag]
    if v then
      local n = tonumber(v)
      if not n or n <= 0 or n ~= n or n == math.huge or (key == "instructions" and n ~= math.floor(n)) then
        return usage_error(string.format("--%s is %s; expected a %s", flag, v,
          key == "instructions" and "whole number > 0" or "number >= 1"))
      end
      if key ~= "instructions" and n < 1 then
        return usage_error(string.format("--%s is %s; expected a number >= 1 (%s)", flag, v, key == "seconds" and
          "the wall clock is read in whole seconds" or "a policy needs at least 1 MiB to load"))
      end
      o.limits = o.limits or {}
      o.limits[key] = n
    end
  end
  -- whole numbers of at most 13 digits (2^40 has 13), checked as written: no float form
  for _, flag in ipairs({ "seq-len", "micro-batch", "global-batch" }) do
    local v = o[flag]
    if v and not (v:match("^%d+$") and #v <= 13 and tonumber(v) >= 1 and tonumber(v) <= 2 ^ 40) then
      return usage_error(string.format("--%s is a whole number from 1 to 2^40, not '%s'", flag, util.short_name(v)))
    end
  end
  if (o["micro-batch"] or o["global-batch"] or o["cp-rotate"]) and not o["seq-len"] then
    return usage_error("--micro-batch, --global-batch and --cp-rotate go with --seq-len S (the tokens per sample)")
  end
  if o["cp-rotate"] and o["cp-rotate"] ~= "allgather" and o["cp-rotate"] ~= "alltoall" then
    return usage_error("--cp-rotate is allgather or alltoall, not '" .. util.short_name(o["cp-rotate"]) .. "'")
  end
  if o.rank and not (o.rank:match("^%d+$") and #o.rank <= 10) then
    return usage_error("--rank is a rank, a whole number from 0, not '" .. util.short_name(o.rank) .. "'")
  end
  if o.rank then
    o.rank = tonumber(o.rank)
    -- the world the mesh spells, when it parses (the planner reports a mesh that does not)
    local ok, sizes = pcall(require("moonshard.mesh_context").parse, o.mesh or "")
    if ok and type(sizes) == "table" then
      local world = 1
      for _, a in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp" }) do world = world * (sizes[a] or 1) end
      if o.rank >= world then
        return usage_error(string.format("--rank %d: the mesh %s has %d ranks (0 to %d)", o.rank, o.mesh, world,
          world - 1))
      end
    end
  end
  if o.efficiency and not (o.efficiency:match("^%d*%.?%d+$") and tonumber(o.efficiency) > 0 and
      tonumber(o.efficiency) <= 1) then
    return usage_error("--efficiency is a number in (0, 1] (the share of the peak FLOP/s), not '" ..
      util.short_name(o.efficiency) .. "'")
  end
  if o.efficiency and not o.device then return usage_error("--efficiency goes with --device NAME|FILE") end
  if o.optimizer and not require("moonshard.plan").OPTIMIZERS[o.optimizer] then
    return usage_error("--optimizer is adamw, torch_adamw or none, not '" .. o.optimizer .. "'")
  end
  -- "moonshard: x" and "moonshard <status> error: x" alike print as x
  local function print_error(err)
    local msg = tostring(err):gsub("^moonshard [%a_]+ error: ", ""):gsub("^moonshard: ", "")
    io.stderr:write("moonshard plan: error: " .. msg .. "\n")
  end
  if o["list-options"] then
    local ok, text = pcall(function()
      -- with only a recipe: its manager's shipped policy
      if not o.policy then o.policy = M.manager_policy(require("moonshard.recipe").load(o.recipe, o.limits)) end
      return M.options_listing(o)
    end)
    if not ok then
      print_error(text)
      return 1
    end
    io.stdout:write(text)
    return 0
  end
  local report = require "moonshard.plan_report"
  -- ctx:warn's messages as they come: a plan that fails still shows them
  o.warnings = {}
  -- Everything is rendered, and the picture written, before anything is printed: a failure
  -- leaves no partial plan on stdout.
  local ok, result = pcall(M.make_plan, o)
  local text, svg
  if ok then
    ok, text = pcall(function()
      if o.svg then svg = require("moonshard.plan_svg").render(result) end
      if o.json then return report.to_json(result, { audit = o.audit, rank = o.rank }) end
      return report.to_text(result, { policy = o.policy }) .. (o.audit and "\n" .. report.audit_text(result) or "") ..
        (o.rank and "\n" .. report.rank_text(result, report.rank_view(result, o.rank)) or "")
    end)
    if not ok then result = text end
  end
  if not ok then
    -- the policy's warnings up to the failure (a plan shows them with the plan)
    for _, w in ipairs(o.warnings) do io.stderr:write("moonshard plan: warning: " .. w .. "\n") end
    print_error(result)
    return 1
  end
  if svg then
    local f, ferr = io.open(o.svg, "wb")
    local wrote = f and f:write(svg)
    if f then wrote = f:close() and wrote end
    if not wrote then
      io.stderr:write("moonshard plan: error: cannot write " .. o.svg .. ": " .. util.io_reason(o.svg, ferr) .. "\n")
      return 1
    end
    if not o.json then text = text .. "picture written to " .. o.svg .. "\n" end
  end
  io.stdout:write(text)
  return 0
end

return M
