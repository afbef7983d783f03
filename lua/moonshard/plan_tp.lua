-- moonshard.plan_tp: tensor parallelism in the planner: ctx:tensor_parallel(plan) applies a
-- plan of PyTorch ParallelStyles to the module tree (parallelize_module's rules), and each
-- parameter's placements with FSDP2 on top (_StridedShard where both split the same dim).

local util = require "moonshard.util"

local T = {}

local fail, display -- the planner's helpers (bind)

--- Takes the planner's helpers h (fail, display); returns T.
function T.bind(h)
  fail, display = h.fail, h.display
  return T
end

-- The styles a plan names, as torch.distributed.tensor.parallel and NeMo Automodel's
-- optimized_tp_plans.py define them, by what they do to parameters: ColwiseParallel splits
-- a Linear's weight and bias on dim 0 (out) and an Embedding's weight on dim 1;
-- RowwiseParallel a Linear's weight on dim 1 (in), its bias replicated, and an Embedding's
-- weight on dim 0 (the vocabulary: Automodel's VocabParallelEmbedding is this style);
-- SequenceParallel replicates a norm's parameters (and so does Automodel's all-gathering
-- variant); PrepareModuleInput / PrepareModuleOutput and rotary embeddings touch none.
local STYLES = {
  colwise = "colwise", rowwise = "rowwise", sequence_parallel = "sequence_parallel",
  vocab_parallel_embedding = "rowwise", sequence_parallel_all_gather = "sequence_parallel",
  prepare_input = "none", prepare_output = "none", rotary_embed_parallel = "none",
}
--- What a style does to parameters: "colwise", "rowwise", "sequence_parallel" or "none".
function T.kind(style) return STYLES[style] end

local STYLE_NAMES = {}
for k in pairs(STYLES) do STYLE_NAMES[#STYLE_NAMES + 1] = k end
table.sort(STYLE_NAMES)
T.STYLE_NAMES = STYLE_NAMES

-- The keys a style table takes beside its name ([1]): the activations' layouts, recorded.
local STYLE_KEYS = { input_layouts = true, output_layouts = true, desired_input_layouts = true,
  use_local_output = true }

local function layout_ok(v)
  if type(v) == "string" then
    return v == "Replicate()" or v:match("^Shard%(%-?%d+%)$") ~= nil
  end
  return false
end

-- A plan value: "colwise" or {"colwise", output_layouts = "Shard(-1)", use_local_output = false}.
local function style_of(v, pattern)
  local name, spec = v, {}
  if type(v) == "table" then
    name = rawget(v, 1)
    for k, x in pairs(v) do
      if k ~= 1 then
        if not STYLE_KEYS[k] then
          fail(string.format("tensor_parallel: pattern '%s': unknown style key %s (keys: input_layouts, " ..
            "output_layouts, desired_input_layouts, use_local_output)", pattern,
            type(k) == "string" and "'" .. k .. "'" or tostring(k)))
        end
        if k == "use_local_output" then
          if type(x) ~= "boolean" then
            fail(string.format("tensor_parallel: pattern '%s': use_local_output is %s; expected true or false",
              pattern, type(x)))
          end
        else
          local list = type(x) == "table" and x or { x }
          for _, l in ipairs(list) do
            if not layout_ok(l) then
              fail(string.format("tensor_parallel: pattern '%s': %s holds %s; expected \"Replicate()\" or " ..
                "\"Shard(d)\"", pattern, k, type(l) == "string" and "'" .. l .. "'" or "a " .. type(l)))
            end
          end
        end
        spec[k] = type(x) == "table" and util.copy(x) or x
      end
    end
  end
  if type(name) ~= "string" or not STYLES[name] then
    fail(string.format("tensor_parallel: pattern '%s': %s; expected one of %s (or a table with the style " ..
      "first: {\"colwise\", output_layouts = \"Shard(-1)\"})", pattern,
      type(name) == "string" and "style '" .. name .. "'" or type(v) == "table" and "the table names no style first" or
      "the style is a " .. type(name), table.concat(STYLE_NAMES, ", ")))
  end
  spec.style = name
  return spec
end

-- fnmatch of one dotted component (torch's parallelize_module matches each token of the key
-- against the children's names): * any run, ? one character, [...] a set ([!...] its
-- complement).  A token is parsed into single-character items and stars, and matched with one
-- backtrack point per star, so a policy's pattern costs at most O(len(name) x len(token)),
-- however many stars it holds.
local function parse_glob(token)
  local items, i = {}, 1
  while i <= #token do
    local c = token:sub(i, i)
    local close = c == "[" and token:find("]", i + 2, true)
    if c == "*" then
      if items[#items] ~= "*" then items[#items + 1] = "*" end
    elseif c == "?" then
      items[#items + 1] = { any = true }
    elseif close then
      local body = token:sub(i + 1, close - 1)
      local negate = body:sub(1, 1) == "!"
      local set = {}
      for ch in (negate and body:sub(2) or body):gmatch(".") do set[ch] = true end
      items[#items + 1] = { set = set, negate = negate }
      i = close
    else
      items[#items + 1] = { char = c }
    end
    i = i + 1
  end
  return items
end

local function item_matches(item, ch)
  if item.any then return true end
  if item.set then return (item.set[ch] == true) ~= item.negate end
  return item.char == ch
end

local function glob_matches(items, name)
  local i, j, star, mark = 1, 1, nil, 0
  while i <= #name do
    local item = items[j]
    if item == "*" then
      star, mark, j = j, i, j + 1
    elseif item and item_matches(item, name:sub(i, i)) then
      i, j = i + 1, j + 1
    elseif star then
      mark = mark + 1
      i, j = mark, star + 1
    else
      return false
    end
  end
  while items[j] == "*" do j = j + 1 end
  return j > #items
end

-- The modules a dotted pattern names, with their names, in the tree's order.
local function matches(root, pattern)
  local found = { { root, "" } }
  for token in (pattern .. "."):gmatch("([^.]*)%.") do
    local items, next_found = parse_glob(token), {}
    for _, mn in ipairs(found) do
      local m, name = mn[1], mn[2]
      for _, c in ipairs(m.child_order) do
        if glob_matches(items, c) then next_found[#next_found + 1] = { m.children[c], name == "" and c or name .. "." .. c } end
      end
    end
    found = next_found
  end
  return found
end

-- What a style does to a module's parameters: {param name -> tp dim or false (replicate)}.
local function placements_of(spec, module, fqn, pattern)
  local kind = STYLES[spec.style]
  local out = {}
  if kind == "none" then return out end
  if kind == "sequence_parallel" then
    for _, pname in ipairs(module.param_order) do out[pname] = false end
    return out
  end
  local t = module.type
  if t ~= "Linear" and t ~= "Embedding" then
    fail(string.format("tensor_parallel: %s (pattern '%s') is a %s; %s shards nn.Linear and nn.Embedding only",
      display(fqn), pattern, tostring(t), spec.style))
  end
  for _, pname in ipairs(module.param_order) do
    if kind == "colwise" then out[pname] = t == "Linear" and 0 or 1
    elseif t == "Embedding" then out[pname] = 0
    else out[pname] = pname == "weight" and 1 or false end
  end
  return out
end

-- The model's head counts, as Automodel's validate_tp_mesh reads them from the config.
local function head_counts(model)
  local a = model.attrs or {}
  local cfg = type(a.config) == "table" and a.config or {}
  local heads = a.num_attention_heads or cfg.num_attention_heads
  local kv = a.num_key_value_heads or cfg.num_key_value_heads or heads
  return heads, kv
end

--- Automodel's validate_tp_mesh: the key/value heads first, then the attention heads; nil
-- when tp divides both, else the message.
function T.check_heads(model, tp)
  local heads, kv = head_counts(model)
  if tp > 1 and util.is_int(kv) and kv % tp ~= 0 then
    return string.format("num_key_value_heads (%d) must be divisible by TP size (%d)", kv, tp)
  end
  if tp > 1 and util.is_int(heads) and heads % tp ~= 0 then
    return string.format("num_attention_heads (%d) must be divisible by TP size (%d)", heads, tp)
  end
  return nil
end

-- Places parameter p (pname of module fqn) on the tp axis: dim, or false for replicated.
function T.place(ctx, p, dim, fqn, pname, spec, tp)
  local pfqn = fqn == "" and pname or fqn .. "." .. pname
  if ctx.ep[p] then
    fail(string.format("tensor_parallel: %s is placed by expert parallelism; a parameter takes one of them",
      pfqn))
  end
  local prev = ctx.tp[p]
  if prev and prev.module == fqn then
    fail(string.format("tensor_parallel: %s is placed twice (by an earlier tensor_parallel call); a module takes " ..
      "one style", display(fqn)))
  end
  if prev and prev.dim ~= dim then -- a tied weight: both uses must agree
    fail(string.format("tensor_parallel: %s is one parameter with %s through %s and %s through %s",
      pfqn, prev.dim and "Shard(" .. prev.dim .. ")" or "Replicate()", prev.module,
      dim and "Shard(" .. dim .. ")" or "Replicate()", fqn))
  end
  if dim and not p.shape[dim + 1] then
    fail(string.format("tensor_parallel: %s has %d dims; %s splits dim %d", pfqn, #p.shape, spec.style, dim))
  end
  if not prev then
    -- each tp coordinate's piece, as torch.chunk cuts it: ceil(n / tp) rows, the last
    -- coordinates fewer or none (PyTorch accepts any tp; so does the plan, with a warning)
    local shapes = {}
    for t = 0, tp - 1 do
      local s = util.copy(p.shape)
      if dim then
        local n = p.shape[dim + 1]
        local c = util.ceil_div(n, tp)
        s[dim + 1] = math.max(0, math.min(n, (t + 1) * c) - t * c)
      end
      shapes[t + 1] = s
    end
    local uneven = dim and p.shape[dim + 1] % tp ~= 0
    ctx.tp[p] = { dim = dim or nil, style = spec.style, module = fqn, local_shapes = shapes, uneven = uneven or nil }
    ctx.tp_order[#ctx.tp_order + 1] = p
    if uneven then ctx.tp_uneven[#ctx.tp_uneven + 1] = { fqn = pfqn, dim = dim, size = p.shape[dim + 1] } end
  end
end

--- ctx:tensor_parallel(plan): plan maps module patterns ("model.layers.*.self_attn.q_proj")
-- to styles; returns the number of modules it placed.  Patterns that match nothing are
-- skipped, as Automodel lets torch skip them (its plans name fused projections a model may
-- not have); the plan records them.
function T.apply(ctx, plan)
  local tp = ctx.mesh:size("tp")
  if type(plan) ~= "table" then
    fail("tensor_parallel: the plan is a " .. type(plan) .. "; expected a table of module pattern = style")
  end
  if ctx.units[1] then
    fail(string.format("tensor_parallel: unit %s exists already; tensor parallelism comes before fully_shard (as " ..
      "NeMo Automodel applies it), since FSDP shards what it leaves on each rank", display(ctx.units[1].name)))
  end
  local why = T.check_heads(ctx.model, tp)
  if why then fail(why) end
  local patterns = {}
  for k, v in pairs(plan) do
    if type(k) ~= "string" or k == "" then
      fail("tensor_parallel: a plan key is " .. (type(k) == "string" and "empty" or "a " .. type(k)) ..
        "; keys are module patterns like \"model.layers.*.self_attn.q_proj\"")
    end
    patterns[#patterns + 1] = { k, style_of(v, k) }
  end
  table.sort(patterns, function(a, b) return a[1] < b[1] end)
  if tp == 1 then return 0 end -- as Automodel: no tensor parallelism on a tp of one rank
  local placed, by_module, record = 0, {}, {}
  for _, ps in ipairs(patterns) do
    local pattern, spec = ps[1], ps[2]
    local found = matches(ctx.model, pattern)
    record[#record + 1] = { pattern = pattern, style = spec.style, spec = spec, modules = #found }
    for _, mn in ipairs(found) do
      local m, fqn = mn[1], mn[2]
      if by_module[m] then
        fail(string.format("tensor_parallel: %s is matched by '%s' and '%s'; a module takes one style",
          display(fqn), by_module[m], pattern))
      end
      by_module[m] = pattern
      placed = placed + 1
      ctx.tp_modules[#ctx.tp_modules + 1] = { module = fqn, style = spec.style, spec = spec, object = m }
      local dims = placements_of(spec, m, fqn, pattern)
      for _, pname in ipairs(m.param_order) do
        local dim = dims[pname]
        if dim ~= nil then T.place(ctx, m.params[pname], dim, fqn, pname, spec, tp) end
      end
    end
  end
  for _, r in ipairs(record) do ctx.tp_plan[#ctx.tp_plan + 1] = r end
  return placed
end

--- The placements of a parameter in a unit, as its DTensor has them after fully_shard: the
-- unit's mesh dims (Replicate() on a replicate axis, the FSDP shard dim on the shard axis)
-- then, for a tensor-parallel parameter, its tp placement; FSDP's shard dim becomes
-- _StridedShard(d, split_factor=tp) where tp split the same dim (FSDP2's
-- _init_sharding_spec_tp: FSDP shards inside each tp chunk).  tp: the plan's map param ->
-- its tensor-parallel placement (or nil).  Returns placements, axes.
function T.placements(mesh, tp, unit, p, d)
  local axes, out = {}, {}
  for i, a in ipairs(unit.mesh_axes) do
    axes[i] = a
    out[i] = (i < #unit.mesh_axes or unit.kind == "replicate") and "Replicate()" or string.format("Shard(%d)", d)
  end
  local t = tp and tp[p]
  if t then
    if t.dim == d then out[#out] = string.format("_StridedShard(%d, split_factor=%d)", d, mesh:size("tp")) end
    axes[#axes + 1] = "tp"
    out[#out + 1] = t.dim and string.format("Shard(%d)", t.dim) or "Replicate()"
  end
  return out, axes
end

return T
