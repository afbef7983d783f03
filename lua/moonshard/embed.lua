-- moonshard.embed: what the embedding API (moonshard_embed.h) does in Lua, one instance
-- per rank's Lua state: the host describes its model parameter by parameter (dotted
-- names make the module tree; module types may be set so that policies recognise layers,
-- MoE blocks and experts) or by a config.json, plans it with a policy on a mesh, and
-- materialises the units once.
--
-- Errors name the host's input, never a position in this library (error(msg, 0)).  Those
-- that are not an invalid argument carry their status the way the binding's do, as
-- "moonshard <status> error: ..." (ms_embed.c reads it back): the host called in the wrong
-- order ("state") or a file could not be read ("io").

local M = {}

-- tensors: the host's parameters in order; params: fqn -> true; modules: the module names
-- those parameters make ("" is the root); config, config_data, config_tree: the path,
-- contents and module tree of the config that gave the model instead; types: module name
-- -> type; frozen: fqn -> true; optimizer and limits: what the next plans take (nil: the
-- defaults); plan; rank and where: the materialised units.
local state = { tensors = {}, params = {}, modules = { [""] = true }, types = {}, frozen = {}, ties = {} }

local function fail(msg) error("moonshard: embed: " .. msg, 0) end
local function fail_state(msg) error("moonshard state error: embed: " .. msg, 0) end

local function described()
  local n = #state.tensors
  return string.format("%d parameter%s (the first '%s')", n, n == 1 and "" or "s", state.tensors[1].name)
end

-- The dotted segments of a name; an empty segment is an error naming what the name is.
local function segments(name, what)
  local parts = {}
  for part in (name .. "."):gmatch("([^.]*)%.") do
    if part == "" then fail(string.format("%s name '%s' has an empty segment", what, name)) end
    parts[#parts + 1] = part
  end
  return parts
end

local module = require "moonshard.module"
local FLOATING = module.FLOATING

-- A name within the module tree's limits (module.MAX_NAME_BYTES, MAX_NAME_DEPTH), else an
-- error naming it, shortened.
local function check_limits(name, what)
  local why = module.name_limit_error(name)
  if why then fail(string.format("%s name '%s' %s", what, require("moonshard.util").short_name(name), why)) end
end

-- A new parameter name fqn (add_param's, tie's): not planned yet, no config, not described
-- before, not a module, no prefix a parameter; its prefixes become modules.
local function new_name(fqn)
  check_limits(fqn, "parameter")
  if state.plan then
    fail_state("parameter '" .. fqn .. "': the model cannot change after it was planned")
  end
  if state.config then
    fail_state("parameter '" .. fqn .. "': the model was already given by the config " .. state.config ..
      "; describe it by parameters or by a config, not both")
  end
  local parts = segments(fqn, "parameter")
  if state.params[fqn] then fail("parameter '" .. fqn .. "' is already described") end
  if state.modules[fqn] then
    fail("parameter '" .. fqn .. "': '" .. fqn .. "' is already a module of the parameters described before")
  end
  for i = 1, #parts - 1 do
    local prefix = table.concat(parts, ".", 1, i)
    if state.params[prefix] then
      fail("parameter '" .. fqn .. "': '" .. prefix .. "' is already a parameter, so it cannot be a module")
    end
  end
  for i = 1, #parts - 1 do state.modules[table.concat(parts, ".", 1, i)] = true end
  state.params[fqn] = true
end

--- tie(fqn, target): fqn a second name of the parameter target (tied weights).
function M.tie(fqn, target)
  if state.plan or state.config then return new_name(fqn) end -- (the state errors)
  if not state.params[target] then
    fail("tie '" .. fqn .. "' to '" .. target .. "': no parameter '" .. target .. "' was described" ..
      (#state.tensors > 0 and " among the " .. described() or ""))
  end
  for _, t in ipairs(state.ties) do
    if t[1] == target then
      fail("tie '" .. fqn .. "' to '" .. target .. "': '" .. target .. "' is itself a tie of '" .. t[2] ..
        "'; tie to '" .. t[2] .. "'")
    end
  end
  new_name(fqn)
  state.ties[#state.ties + 1] = { fqn, target }
end

function M.add_param(fqn, shape, dtype, requires_grad)
  if requires_grad and not FLOATING[dtype] and not state.plan and not state.config then
    fail(string.format("parameter '%s': a parameter of dtype %s cannot require gradients; only floating dtypes can",
      fqn, tostring(dtype)))
  end
  new_name(fqn)
  state.tensors[#state.tensors + 1] = { name = fqn, shape = shape, dtype = dtype }
  if not requires_grad then state.frozen[fqn] = true end
end

function M.set_module_type(name, type_name)
  if state.plan then
    fail_state("module '" .. name .. "': its type cannot change after the model was planned")
  end
  if name ~= "" then
    check_limits(name, "module")
    segments(name, "module")
  end
  if state.config then
    if not state.config_tree:get(name) then
      fail("no module '" .. name .. "' to give the type " .. type_name .. " in the model of the config " .. state.config)
    end
  elseif not state.modules[name] then
    if #state.tensors == 0 then
      fail("no module '" .. name .. "' to give the type " .. type_name ..
        ": describe the model's parameters first (modules are the prefixes of their names)")
    end
    fail("no module '" .. name .. "' to give the type " .. type_name .. " among the modules of the " .. described())
  end
  state.types[name] = type_name
end

function M.use_config(path)
  if state.plan then fail_state("config " .. path .. ": the model cannot change after it was planned") end
  if state.config then fail_state("config " .. path .. ": the model was already given by the config " .. state.config) end
  if #state.tensors > 0 then
    fail_state("config " .. path .. ": the model was already described by " .. described() ..
      "; describe it by parameters or by a config, not both")
  end
  if path == "" then fail("the config path is empty") end
  local text, err, opened = require("moonshard.util").read_file(path, "json")
  if not text then
    error("moonshard io error: embed: cannot read the config " .. (opened and path .. ": " or "") .. tostring(err), 0)
  end
  local config = require("moonshard.json").decode(text, path)
  state.config_tree = require("moonshard.models").from_config(config, path)
  state.config, state.config_data = path, config
end

-- A fresh module tree of the model for each plan (planning wraps modules for activation
-- checkpointing, so a tree is not planned twice).
local function tree()
  local root
  if state.config then
    root = require("moonshard.models").from_config(state.config_data, state.config)
  else
    if #state.tensors == 0 then fail_state("no model yet: describe its parameters or give a config first") end
    root = require("moonshard.safetensors").tree(state.tensors, "host model", { host = true })
    -- tied names: the target's parameter object in a second module
    for _, t in ipairs(state.ties) do
      local tprefix, tlast = t[2]:match("^(.*)%.([^.]+)$")
      local owner = tprefix and root:get(tprefix) or root
      local p = owner.params[tlast or t[2]]
      local m, name = root, t[1]
      local prefix, last = name:match("^(.*)%.([^.]+)$")
      for part in (prefix or ""):gmatch("[^.]+") do
        m = m.children[part] or m:add(part, module.new("Module"))
      end
      m:param(last or name, p)
      if (t[1] == "lm_head.weight" and t[2] == "model.embed_tokens.weight") or
          (t[2] == "lm_head.weight" and t[1] == "model.embed_tokens.weight") then
        root.attrs.tie_word_embeddings = true
      end
    end
  end
  for name, t in pairs(state.types) do
    local m = root:get(name)
    if not m then fail("no module '" .. name .. "' to give the type " .. t) end
    m.type = t
  end
  for _, np in ipairs(root:named_parameters()) do
    if state.frozen[np[1]] then np[2].requires_grad = false end
  end
  return root
end

--- Plans the model on `mesh` (e.g. "dp_shard=4") with the policy at `policy_path`.
function M.plan(mesh, policy_path)
  if state.rank then
    fail_state("the plan cannot change after its units were materialised (make a new interpreter to plan again)")
  end
  if policy_path == "" then fail("the policy path is empty") end
  local mc = require("moonshard.mesh_context").new(mesh)
  local policy = require "moonshard.policy"
  local limits = state.limits or {}
  local p = policy.load(policy_path, { modules = policy.host_modules(),
    instructions = limits.instructions, memory_mb = limits.memory_mb, seconds = limits.seconds })
  local entry = policy.entry_point(p, policy_path)
  state.plan = require("moonshard.plan").plan(tree(), mc, entry, { name = "host model", optimizer = state.optimizer,
    policy_name = policy_path, set = state.options, tokens = state.batch, recipe = state.recipe })
  return #state.plan.units
end

--- The recipe (moonshard.recipe) the plans made after this apply: loaded and checked now, in
-- the policy sandbox with the limits set so far.
function M.set_recipe(path)
  if state.rank then fail_state("the units were already materialised: set the recipe before planning") end
  if path == "" then fail("the recipe path is empty") end
  state.recipe = require("moonshard.recipe").load(path, state.limits)
end

-- The planned model tree (after the recipe's steps).
local function planned_tree()
  if not state.plan then fail_state("no plan yet: plan the model first") end
  return state.plan.model_tree
end

--- A parameter of the planned model (the recipe's adapters included): ndim, the shape's
-- sizes, dtype name, requires_grad.
function M.param_info(fqn)
  local strip = require("moonshard.module").strip_checkpoint
  for _, np in ipairs(planned_tree():named_parameters()) do
    if np[1] == fqn or strip(np[1]) == fqn then
      local p = np[2]
      if #p.shape > 8 then fail(string.format("parameter '%s' has %d dims, more than 8", fqn, #p.shape)) end
      return #p.shape, p.shape, p.dtype, p.requires_grad
    end
  end
  fail("the planned model has no parameter '" .. fqn .. "'")
end

--- The LoRA adapter the recipe put on a module: dim, alpha, dropout, 1 when dropout is "pre",
-- 1 when lora_A_init is "uniform"; all 0 when it has none.
function M.lora(name)
  local m = planned_tree():get(name)
  if not m then
    -- activation checkpointing wraps modules: look the name up with its wrappers
    for _, nm in ipairs(planned_tree():named_modules()) do
      if require("moonshard.module").strip_checkpoint(nm[1]) == name then m = nm[2] break end
    end
  end
  if not m then fail("the planned model has no module '" .. name .. "'") end
  local l = m.attrs and m.attrs.lora
  if not l then return 0, 0, 0, 0, 0 end
  return l.dim, l.alpha, l.dropout, l.dropout_position == "pre" and 1 or 0, l.init == "uniform" and 1 or 0
end

--- 1 when the last plan's recipe ran `step`, else 0.
function M.recipe_ran(step)
  if not state.plan then fail_state("no plan yet: plan the model first") end
  local known = { quantization = true, peft = true, fp8 = true, qat = true }
  if not known[step] then
    fail(string.format("recipe step '%s': expected quantization, peft, fp8 or qat",
      require("moonshard.util").short_name(step)))
  end
  for _, st in ipairs(state.plan.recipe and state.plan.recipe.steps or {}) do
    if st.name == step then return 1 end
  end
  return 0
end

--- The optimizer the plans made after this count (and their units follow).
function M.set_optimizer(name)
  if state.rank then fail_state("the units were already materialised: set the optimizer before planning") end
  if not require("moonshard.plan").OPTIMIZERS[name] then
    fail("optimizer '" .. name .. "': expected adamw, torch_adamw or none")
  end
  state.optimizer = name
end

--- One of the policy's options ("NAME=VALUE", as `moonshard plan --set`) for the plans made
-- after this; a later setting of the same name replaces the earlier.
function M.set_option(setting)
  if state.rank then fail_state("the units were already materialised: set options before planning") end
  local name = setting:match("^([^=]+)=")
  if not name then
    fail(string.format("option setting '%s': expected NAME=VALUE, e.g. reshard_after_forward=false",
      require("moonshard.util").short_name(setting)))
  end
  state.options = state.options or {}
  for i, s in ipairs(state.options) do
    if s:match("^([^=]+)=") == name then table.remove(state.options, i) break end
  end
  state.options[#state.options + 1] = setting
end

--- The policy sandbox's limits per call for the plans made after this.
function M.set_policy_limits(instructions, memory_mb)
  if not (instructions >= 1 and instructions < 2 ^ 53 and memory_mb >= 1 and memory_mb < 2 ^ 40) then
    fail(string.format("policy limits %.17g instructions, %.17g MiB: expected at least 1 instruction and at " ..
      "least 1 MiB", instructions, memory_mb))
  end
  state.limits = { instructions = instructions, memory_mb = memory_mb, seconds = state.limits and state.limits.seconds }
end

--- The batch the plans made after this count traffic for (ms_interp_set_batch): seq_len 0
-- forgets it; micro_batch and global_batch 0 take their defaults.
function M.set_batch(seq_len, micro_batch, global_batch)
  if state.rank then fail_state("the units were already materialised: set the batch before planning") end
  for _, v in ipairs({ seq_len, micro_batch, global_batch }) do
    if v < 0 or v > 2 ^ 40 then
      fail(string.format("batch seq_len %d, micro_batch %d, global_batch %d: expected numbers from 0 to 2^40",
        seq_len, micro_batch, global_batch))
    end
  end
  if seq_len == 0 then
    state.batch = nil
  else
    state.batch = { seq_len = seq_len, micro_batch = micro_batch > 0 and micro_batch or nil,
      global_batch = global_batch > 0 and global_batch or nil }
  end
end

--- The policy sandbox's wall-clock limit per call for the plans made after this.
function M.set_policy_seconds(seconds)
  if not (seconds >= 1 and seconds < 2 ^ 40) then
    fail(string.format("policy time limit %.17g s: expected at least 1 second (the clock is read in whole " ..
      "seconds)", seconds))
  end
  state.limits = state.limits or {}
  state.limits.seconds = seconds
end

--- The last plan's warnings, a list of strings.
function M.warnings()
  if not state.plan then fail_state("no plan yet: plan the model first") end
  return state.plan.warnings
end

--- The policy's prefetch depths: forward, backward (units ahead).
function M.prefetch()
  if not state.plan then fail_state("no plan yet: plan the model first") end
  return state.plan.prefetch.forward, state.plan.prefetch.backward
end

function M.plan_json()
  if not state.plan then fail_state("no plan yet: plan the model first") end
  return require("moonshard.plan_report").to_json(state.plan)
end

--- Makes this rank's units, once: the host holds pointers to them until it frees the
-- interpreter, so they are never replaced.
function M.materialize()
  if state.rank then
    fail_state("the units were already materialised (once per interpreter: the host's unit pointers stay " ..
      "valid until ms_interp_free)")
  end
  if not state.plan then fail_state("plan the model before materialising it") end
  local rank = require("moonshard.runtime").materialize(state.plan)
  -- Hosts know their parameters by their own names: activation-checkpoint wrapping
  -- renames them in the plan, so both names are found.
  local strip = require("moonshard.module").strip_checkpoint
  local where = {}
  for ui, u in ipairs(rank.units) do
    for pi = 0, u:count() - 1 do
      local fqn = u:fqn(pi)
      where[fqn] = { ui - 1, pi }
      where[strip(fqn)] = { ui - 1, pi }
    end
  end
  -- Under a pipeline the units of the other pp ranks' stages are not made here: their
  -- parameters are found in no unit of this rank (unit -1).
  local elsewhere = {}
  for _, u in ipairs(state.plan.units) do
    for _, e in ipairs(u.entries) do
      if not where[e.fqn] then
        elsewhere[e.fqn] = true
        elsewhere[strip(e.fqn)] = true
      end
    end
  end
  state.rank, state.where, state.elsewhere = rank, where, elsewhere
  return #rank.units
end

--- How many units this rank holds (0 before materialize).
function M.materialize_count()
  return state.rank and #state.rank.units or 0
end

--- The unit object at 0-based index i.
function M.unit(i)
  if not state.rank then fail_state("materialise the plan first") end
  local u = state.rank.units[i + 1]
  if not u then fail(string.format("no unit %d (there are %d)", i, #state.rank.units)) end
  return u
end

--- unit index, parameter index (0-based) of a parameter (expert parameters included: the
-- runtime puts the unsharded ones in ep-local units); -1, -1 for one of another pipeline
-- stage's units, which this rank does not hold.
function M.find(fqn)
  if not state.rank then fail_state("materialise the plan first") end
  local w = state.where[fqn]
  if w then return w[1], w[2] end
  if state.elsewhere[fqn] then return -1, -1 end
  fail("the plan has no parameter '" .. fqn .. "'")
end

-- ---------------------------------------------------------------- checkpoints

-- A failure of moonshard.checkpoint or moonshard.checkpoint_hf with its status: a file that
-- cannot be read or written (no such path, no checkpoint there, a failed open) is "io", the
-- rest (a bad index, a checksum, a tensor that does not fit the units) an invalid argument.
-- The Lua layer's message is kept as it is, its "moonshard: " giving way to the status.
local IO_MESSAGES = { "cannot open", "cannot create", "cannot remove", "holds no checkpoint", "which has no checkpoint.json",
  "No such file or directory", "no such file or directory", "Permission denied", "a directory without model.safetensors",
  ", not a checkpoint: a checkpoint is a directory", "holds a Hugging Face checkpoint", "is a moonshard checkpoint" }
local function checkpoint_error(ok, ...)
  if ok then return ... end
  local msg = tostring((...))
  if not msg:find("moonshard %a+ error:") then
    for _, needle in ipairs(IO_MESSAGES) do
      if msg:find(needle, 1, true) then
        msg = "moonshard io error: " .. msg:gsub("^moonshard: ", "")
        break
      end
    end
  end
  error(msg, 0)
end

local function materialised(what)
  if not state.rank then fail_state(what .. ": no units yet: materialise the plan first") end
  return state.rank
end

--- ckpt.save of the materialised units (collective): extra_json a JSON text or nil; returns
-- the checkpoint's directory.
function M.checkpoint_save(root, step, extra_json, keep_last)
  local rank = materialised("checkpoint_save")
  local json = require "moonshard.json"
  local extra
  if extra_json then
    local ok, v = pcall(json.decode, extra_json, "extra_json")
    if not ok then fail("checkpoint_save: extra_json is not JSON text: " .. tostring(v):gsub("^moonshard: ", "")) end
    if v ~= json.null then extra = v end
  end
  if keep_last < 0 then fail(string.format("checkpoint_save: keep_last %d: expected 0 (keep all) or more", keep_last)) end
  local ckpt = require "moonshard.checkpoint"
  return checkpoint_error(pcall(ckpt.save, rank, root, { step = step, extra = extra,
    keep_last = keep_last > 0 and keep_last or nil }))
end

--- ckpt.load into the materialised units (collective, any mesh): step, extra as JSON text
-- (nil when the checkpoint has none), the checkpoint's directory.
function M.checkpoint_load(path)
  local rank = materialised("checkpoint_load")
  local step, extra, dir = checkpoint_error(pcall(require("moonshard.checkpoint").load, rank, path))
  if extra ~= nil then extra = require("moonshard.json").encode(extra) end
  return step, extra, dir
end

--- The step and extra (JSON text or nil) of the checkpoint path names, from its index only:
-- at any time, on one rank.
function M.checkpoint_read(path)
  local ckpt = require "moonshard.checkpoint"
  local index = checkpoint_error(pcall(function() return ckpt.read_index(ckpt.resolve(path)) end))
  local json = require "moonshard.json"
  local extra = index.extra
  if extra == nil or extra == json.null then return index.step, nil end
  return index.step, json.encode(extra)
end

--- checkpoint_hf.load_hf into the materialised units: the number of checkpoint tensors read.
function M.load_hf(path)
  local rank = materialised("load_hf")
  local report = checkpoint_error(pcall(require("moonshard.checkpoint_hf").load_hf, rank, path))
  return report.tensors
end

-- ---------------------------------------------------------------- messages for the host

-- The directory of moonshard's Lua files as chunk names spell it ("@<dir>embed.lua").
local LIB = (debug.getinfo(1, "S").source or ""):match("^@(.*/)[^/]*$")

-- Whether `src`, the file of an error position (cut by Lua to "...<tail>" when long), is
-- one of moonshard's own Lua files.
local function internal(src)
  if not LIB then return false end
  local cut = src:sub(1, 3) == "..."
  local dir = (cut and src:sub(4) or src):match("^(.*/)[^/]*$")
  if not dir then return false end
  for _, d in ipairs({ LIB, LIB .. "models/" }) do
    if (cut and d:sub(-#dir) == dir) or d == dir then return true end
  end
  return false
end

-- A message without the leading positions inside moonshard's own files that Lua puts in
-- front of errors (a binding error raised by the runtime, a library check that reports
-- its caller): the host's input is what the message names.  Positions in the host's
-- policy files stay.
local function clean(msg)
  if type(msg) ~= "string" then return msg end
  while true do
    local src, rest = msg:match("^(.-%.lua):%d+: (.*)$")
    if not (src and internal(src)) then return msg end
    msg = rest
  end
end

local function rethrow(ok, ...)
  if ok then return ... end
  error(clean((...)), 0)
end

for name, fn in pairs(M) do
  M[name] = function(...) return rethrow(pcall(fn, ...)) end
end

return M
