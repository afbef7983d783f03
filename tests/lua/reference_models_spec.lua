-- reference_models_spec.lua: moonshard's model builders against the models transformers 5.24
-- builds from the same config.json files.
--
-- tests/reference/data/model_params.json was made by tests/reference/model_params.py
-- (MOONSHARD_REF_VENV=... bash tests/reference/make.sh model_params): for every config of
-- tests/reference/configs/ and examples/configs/ that transformers has a class for, the
-- model AutoModelForCausalLM.from_config built on the meta device, in the config's dtype:
-- every parameter's name, shape, dtype and requires_grad in named_parameters() order, the
-- tied parameters, the buffers and the element count.  This spec builds each config with
-- moonshard.models and compares, exactly: the names and their order, each parameter's shape,
-- dtype and requires_grad, the ties and the count.  Where moonshard differs on purpose or
-- by a known disagreement, the difference is listed below with its reason (MAPS,
-- KNOWN); anything else fails, and so does a listed difference that no longer occurs.

local json = require "moonshard.json"
local models = require "moonshard.models"
local util = require "moonshard.util"

local DATA = "tests/reference/data/model_params.json"
local REMAKE = "MOONSHARD_REF_VENV=<venv> bash tests/reference/make.sh model_params"

local function load_reference()
  local f, why = io.open(DATA, "rb")
  if not f then error(DATA .. ": " .. tostring(why) .. " (make it with " .. REMAKE .. ")", 2) end
  local text = f:read("a")
  f:close()
  return json.decode(text, DATA)
end
local REF = load_reference()

-- ------------------------------------------------------------------ known differences

-- Renames and layouts mapped before comparing (moonshard's name and shape -> transformers').
-- Each must still map something (a map that maps nothing fails: remove it).
local MAPS = {
  { -- by design (README: "MoE experts in the grouped [experts, in, out] layout Automodel
    -- shards"): transformers 5 keeps grouped experts too, as [experts, out, in]
    what = "grouped experts: moonshard's experts.gate_and_up_projs [E, H, 2I] and experts.down_projs [E, I, H] " ..
      "(Automodel's layout) are transformers 5's experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]",
    map = function(name, shape)
      local stem = name:match("^(.*%.experts%.)gate_and_up_projs$")
      if stem then return stem .. "gate_up_proj", { shape[1], shape[3], shape[2] } end
      stem = name:match("^(.*%.experts%.)down_projs$")
      if stem then return stem .. "down_proj", { shape[1], shape[3], shape[2] } end
    end,
  },
  { -- moonshard names Mixtral's MoE block as its checkpoints (and transformers 4) do;
    -- transformers 5's MixtralDecoderLayer calls it mlp
    what = "Mixtral: moonshard's model.layers.N.block_sparse_moe is transformers 5's model.layers.N.mlp",
    arch = "MixtralForCausalLM",
    map = function(name, shape)
      local a, b = name:match("^(model%.layers%.%d+%.)block_sparse_moe(%..*)$")
      if a then return a .. "mlp" .. b, shape end
    end,
  },
}

-- moonshard's buffers (the routers' e_score_correction_bias) must be buffers of
-- transformers' model too, with the same shape and dtype; transformers has more of them
-- (rotary inv_freq), which no plan needs.

-- Differences left after the maps, as Lua patterns over the lines this spec reports, each
-- with its reason.  Every one must still occur.
local KNOWN = {
  { arch = "DeepseekV3ForCausalLM", pattern = "^model%.layers%.%d+%.mlp%.gate%.weight: dtype moonshard bf16, transformers f32$",
    why = "transformers 5.24 builds DeepSeek-V3's router weight in f32 whatever the config's dtype (as its " ..
      "checkpoints save it); moonshard's builder stores it in the model's dtype (the MoE builders' owner decides)" },
  { arch = "DeepseekV3ForCausalLM",
    pattern = "^model%.layers%.%d+%.mlp: children in the order gate, experts, shared_experts %(moonshard%), " ..
      "experts, gate, shared_experts %(transformers%)$",
    why = "transformers 5 registers the experts before the router: the same parameters in another order" },
  { arch = "Qwen3MoeForCausalLM",
    pattern = "^model%.layers%.%d+%.mlp: children in the order gate, experts %(moonshard%), experts, gate %(transformers%)$",
    why = "transformers 5 registers the experts before the router: the same parameters in another order" },
}

-- ------------------------------------------------------------------ comparing

local function is_null(v) return v == nil or v == json.null end

local function show(v)
  if is_null(v) then return "null" end
  local ok, s = pcall(json.encode, v)
  return (ok and s or tostring(v)):gsub('"', "")
end

local function same(a, b)
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  if #a ~= #b then return false end
  for i = 1, #a do
    if a[i] ~= b[i] then return false end
  end
  return true
end

-- The children of each module in the order its parameters first name them.
local function child_orders(names)
  local orders, seen = {}, {}
  for _, n in ipairs(names) do
    local prefix = ""
    for part in n:gmatch("([^.]+)%.") do
      local key = prefix .. "\0" .. part
      if not seen[key] then
        seen[key] = true
        orders[prefix] = orders[prefix] or {}
        table.insert(orders[prefix], part)
      end
      prefix = prefix == "" and part or prefix .. "." .. part
    end
  end
  return orders
end

-- The ties of a moonshard tree: {second name, first name} for a parameter object met again.
local function ties_of(tree)
  local first, ties = {}, {}
  for _, nm in ipairs(tree:named_modules()) do
    for _, pname in ipairs(nm[2].param_order) do
      local p, fqn = nm[2].params[pname], nm[1] == "" and pname or nm[1] .. "." .. pname
      if first[p] then ties[#ties + 1] = { fqn, first[p] } else first[p] = fqn end
    end
  end
  return ties
end

--- Compares one recorded model with moonshard's build of its config.  Returns the lines
-- that differ (without the architecture) and the figures: params (transformers'), exact
-- (same name, shape, dtype and requires_grad with no map), agree (the same after the maps),
-- and maps_used (index -> true).
local function compare(t)
  local tree = models.from_config(t.config)
  local out, maps_used = {}, {}
  local buffers = {}
  for _, b in ipairs(t.buffers) do buffers[b[1]] = b end
  local tf, tf_names = {}, {}
  for i, p in ipairs(t.params) do
    tf_names[i] = p[1]
    tf[p[1]] = { shape = p[2], dtype = p[3], requires_grad = p[4] }
  end
  local ms, ms_names, exact = {}, {}, 0
  for _, nb in ipairs(tree:named_buffers()) do
    local buf = buffers[nb[1]]
    if not buf then
      out[#out + 1] = nb[1] .. ": a buffer in moonshard, and no buffer in transformers"
    elseif not (same(buf[2], nb[2].shape) and buf[3] == nb[2].dtype) then
      out[#out + 1] = string.format("%s: a %s %s buffer in moonshard, a %s %s buffer in transformers",
        nb[1], nb[2].dtype, show(nb[2].shape), buf[3], show(buf[2]))
    end
  end
  for _, np in ipairs(tree:named_parameters()) do
    local name, p = np[1], np[2]
    local shape = p.shape
    local b = tf[name]
    if b and same(shape, b.shape) and p.dtype == b.dtype and p.requires_grad == b.requires_grad then
      exact = exact + 1
    end
    do
      for i, m in ipairs(MAPS) do
        if not m.arch or m.arch == t.architecture then
          local n2, s2 = m.map(name, shape)
          if n2 then name, shape, maps_used[i] = n2, s2, true end
        end
      end
      ms_names[#ms_names + 1] = name
      ms[name] = { shape = shape, dtype = p.dtype, requires_grad = p.requires_grad }
    end
  end
  local agree = 0
  for _, n in ipairs(ms_names) do
    local a, b = ms[n], tf[n]
    if not b then
      out[#out + 1] = n .. ": moonshard only"
    else
      local ok = true
      for _, k in ipairs({ "shape", "dtype", "requires_grad" }) do
        if not same(a[k], b[k]) then
          ok = false
          out[#out + 1] = string.format("%s: %s moonshard %s, transformers %s", n, k, show(a[k]), show(b[k]))
        end
      end
      if ok then agree = agree + 1 end
    end
  end
  for _, n in ipairs(tf_names) do
    if not ms[n] then out[#out + 1] = n .. ": transformers only" end
  end
  local mo, to = child_orders(ms_names), child_orders(tf_names)
  for _, prefix in ipairs(util.sorted_keys(mo)) do
    if to[prefix] and not same(mo[prefix], to[prefix]) then
      out[#out + 1] = string.format("%s: children in the order %s (moonshard), %s (transformers)",
        prefix, table.concat(mo[prefix], ", "), table.concat(to[prefix], ", "))
    end
  end
  local ties, tf_ties = ties_of(tree), {}
  for i, tie in ipairs(t.ties) do tf_ties[i] = tie[1] .. " is " .. tie[2] end
  for i, tie in ipairs(ties) do ties[i] = tie[1] .. " is " .. tie[2] end
  if not same(ties, tf_ties) then
    out[#out + 1] = string.format("ties: moonshard {%s}, transformers {%s}", table.concat(ties, "; "),
      table.concat(tf_ties, "; "))
  end
  -- every element counted once; buffers are no parameters, in either
  if tree:param_count() ~= t.count then
    out[#out + 1] = string.format("count: moonshard %.0f, transformers %.0f", tree:param_count(), t.count)
  end
  return out, { params = #t.params, exact = exact, agree = agree, maps_used = maps_used }
end

-- ------------------------------------------------------------------ the spec

describe("moonshard's model builders against transformers 5.24 (" .. DATA .. ")", function()
  local known_used, maps_used = {}, {}
  local families = {}   -- architecture -> {models, params, exact, agree}
  local unexplained = {}

  it("is a reference made by the pinned versions", function()
    local v = table.concat(REF.versions, "; ")
    assert.matches("torch 2.15.0", v, 1, true)
    assert.matches("transformers 5.24.0", v, 1, true)
  end)

  for _, t in ipairs(REF.models) do
    it(t.architecture .. " (" .. t.config .. ")", function()
      local lines, fig = compare(t)
      for i in pairs(fig.maps_used) do maps_used[i] = true end
      local f = families[t.architecture] or { models = 0, params = 0, exact = 0, agree = 0 }
      families[t.architecture] = f
      f.models, f.params, f.exact, f.agree = f.models + 1, f.params + fig.params, f.exact + fig.exact,
        f.agree + fig.agree
      local bad = {}
      for _, line in ipairs(lines) do
        local known
        for i, k in ipairs(KNOWN) do
          if k.arch == t.architecture and line:match(k.pattern) then known, known_used[i] = k, true end
        end
        if not known then bad[#bad + 1] = t.architecture .. ": " .. line end
      end
      for _, b in ipairs(bad) do unexplained[#unexplained + 1] = b end
      if #bad > 0 then
        error(string.format("%d differences from transformers (%s) that are not known ones:\n  %s", #bad, DATA,
          table.concat(bad, "\n  ", 1, math.min(#bad, 25))), 0)
      end
    end)
  end

  it("differs from transformers only where known, and every known difference still occurs", function()
    assert.same({}, unexplained)
    for i, m in ipairs(MAPS) do
      assert(maps_used[i], "the map '" .. m.what .. "' maps no parameter any more: remove it")
    end
    for i, k in ipairs(KNOWN) do
      assert(known_used[i], "the known difference '" .. k.pattern .. "' (" .. k.arch .. ") no longer occurs: remove it")
    end
  end)

  it("covers every builder transformers has, and says how many parameters agree", function()
    local archs = {}
    for arch in pairs(models.builders) do
      -- not transformers 5.24 architectures: inkling2 is moonshard's reconstruction, DeepSeek-V4
      -- is NeMo Automodel's model (deepseek_v4_spec checks it against Automodel's own)
      if arch ~= "Inkling2ForCausalLM" and arch ~= "DeepseekV4ForCausalLM" then archs[#archs + 1] = arch end
    end
    table.sort(archs)
    assert.same(archs, util.sorted_keys(families))
    local total = { models = 0, params = 0, agree = 0 }
    for _, arch in ipairs(archs) do
      local f = families[arch]
      io.stderr:write(string.format("\n  %-22s %d configs: %4d of %4d parameters agree with transformers (%d with no map)",
        arch, f.models, f.agree, f.params, f.exact))
      total.models, total.params, total.agree = total.models + f.models, total.params + f.params, total.agree + f.agree
    end
    io.stderr:write(string.format("\n  all: %d configs, %d of %d parameters agree\n", total.models, total.agree,
      total.params))
    -- the figures docs/verification.md quotes (configs, parameters, agreeing)
    assert.same({ models = 21, params = 4139, agree = 4080 }, total)
  end)
end)
