-- tests/reference/fsdp2_layouts.lua: what tests/reference/fsdp2_layouts.py hands to PyTorch,
-- taken from moonshard's own planner, and what tests/lua/reference_layouts_spec.lua checks
-- has not changed since the reference was made.
--
-- For a case {config, mesh, policy, optimizer}, `plan` makes the plan exactly as
-- `moonshard plan` does (moonshard.plan_cli.make_plan), and `describe` gives:
--   tree   the module tree the policy left (checkpoint wrappers included): per module its
--          type, its own parameters {name, shape, dtype, requires_grad, same_as} (same_as:
--          the fqn of a parameter object met earlier, a tied weight), its buffers {name,
--          shape, dtype, persistent} and its children;
--   calls  the fully_shard calls in order: module, mesh axes, mp_policy as given,
--          reshard_after_forward as given (null: FSDP2's default), ignored_params (fqns),
--          the dims shard_placement_fn returned (fqn -> dim), offload_policy;
--   ep     what expert parallelism owns: fqn and placements over ep;
--   tp     the modules tensor parallelism placed, in order: module, the kind of its style
--          (colwise, rowwise, sequence_parallel: what it does to parameters).
-- The plan JSON (`plan --json`) has no ignored parameters, no tie and no module tree, which
-- PyTorch needs to be handed the same model and the same calls: hence this file.
--
-- Run by the reference script as
--   build/moonshard tests/reference/fsdp2_layouts.lua CASES.json
-- (CASES.json: a list of {name, config, mesh, policy, optimizer}), it prints
-- {"<name>": {"tree": ..., "calls": ..., "ep": ...}, ...} on stdout.  Loaded with dofile,
-- it returns its functions.

local json = require "moonshard.json"

local M = {}

--- The plan of a case, made as `moonshard plan --config C --mesh M --policy P
-- --optimizer O` makes it.
function M.plan(case)
  return require("moonshard.plan_cli").make_plan({ config = case.config, mesh = case.mesh, policy = case.policy,
    optimizer = case.optimizer })
end

local function ints(list)
  local out = json.array()
  for i, v in ipairs(list) do out[i] = v end
  return out
end

local function nullable(v)
  if v == nil then return json.null end
  return v
end

-- The root module of a plan: the unit named "" (every shipped policy shards the root).
local function root_of(plan)
  for _, u in ipairs(plan.units) do
    if u.name == "" then return u.module end
  end
  error("fsdp2_layouts: the plan has no unit of the root module; the reference needs one")
end

--- The module tree of a plan's model, as described above.
function M.tree(plan)
  local first = {} -- param -> the fqn it was met at first
  local function walk(m, name)
    local params = json.array()
    for _, pname in ipairs(m.param_order) do
      local p = m.params[pname]
      local fqn = name == "" and pname or name .. "." .. pname
      params[#params + 1] = json.object({ "name", "shape", "dtype", "requires_grad", "same_as" }, {
        name = pname, shape = ints(p.shape), dtype = p.dtype, requires_grad = p.requires_grad,
        same_as = nullable(first[p]) })
      first[p] = first[p] or fqn
    end
    local buffers = json.array()
    for _, bname in ipairs(m.buffer_order or {}) do
      local b = m.buffers[bname]
      buffers[#buffers + 1] = json.object({ "name", "shape", "dtype", "persistent" }, {
        name = bname, shape = ints(b.shape), dtype = b.dtype, persistent = b.persistent })
    end
    local children = json.array()
    for _, cname in ipairs(m.child_order) do
      children[#children + 1] = json.array({ cname, walk(m.children[cname], name == "" and cname or name .. "." .. cname) })
    end
    return json.object({ "type", "params", "buffers", "children" },
      { type = m.type, params = params, buffers = buffers, children = children })
  end
  return walk(root_of(plan), "")
end

--- The fully_shard calls of a plan, in order, as described above.
function M.calls(plan)
  local out = json.array()
  for i, u in ipairs(plan.units) do
    local ignored = json.array()
    for _, p in ipairs(u.ignored) do ignored[#ignored + 1] = plan.fqn_of[p] end
    table.sort(ignored)
    local dims = {}
    for p, d in pairs(u.dims) do dims[plan.fqn_of[p]] = d end
    local raf = u.reshard_after_forward
    out[i] = json.object({ "module", "mesh", "mp_policy", "reshard_after_forward", "ignored_params",
      "shard_dims", "offload_policy" }, {
      module = u.name,
      mesh = ints(u.mesh_axes),
      mp_policy = json.object({ "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs" }, {
        param_dtype = nullable(u.mp.param_dtype), reduce_dtype = nullable(u.mp.reduce_dtype),
        output_dtype = nullable(u.mp.output_dtype), cast_forward_inputs = u.mp.cast_forward_inputs }),
      reshard_after_forward = nullable(raf),
      ignored_params = ignored,
      shard_dims = dims,
      offload_policy = nullable(u.offload),
    })
  end
  return out
end

--- What expert parallelism owns, in the order it was given, and how it places it (the
-- local shapes are the plan's claim, which the spec compares with torch's, not an input).
function M.ep(plan)
  local out = json.array()
  for i, o in ipairs(plan.owned) do
    out[i] = json.object({ "fqn", "placements" }, { fqn = o.fqn, placements = ints(o.placements) })
  end
  return out
end

--- The modules tensor parallelism placed, in the order the plan matched them (a tied weight
-- through both of its modules).
function M.tp(plan)
  local out = json.array()
  local tp = plan.tensor_parallel
  if not tp then return out end
  local kind = require("moonshard.plan_tp").kind
  for _, m in ipairs(tp.modules) do
    if kind(m.style) ~= "none" then
      out[#out + 1] = json.object({ "module", "kind" }, { module = m.module, kind = kind(m.style) })
    end
  end
  return out
end

function M.describe(plan)
  return json.object({ "tree", "calls", "ep", "tp" },
    { tree = M.tree(plan), calls = M.calls(plan), ep = M.ep(plan), tp = M.tp(plan) })
end

local function main(cases_path)
  local f = assert(io.open(cases_path, "rb"))
  local cases = json.decode(f:read("a"), cases_path)
  f:close()
  local out = json.object()
  for _, case in ipairs(cases) do out[case.name] = M.describe(M.plan(case)) end
  io.stdout:write(json.encode(out), "\n")
end

if select("#", ...) > 0 and type((...)) == "string" and (...):match("%.json$") then
  main(...)
end

return M
