-- options_spec.lua: a policy's options (declared knobs, ctx.options, --set, --list-options),
-- policies derived from shipped ones (with{...}), ctx:set_prefetch, checkpoint_wrap of
-- chosen layers in either order with expert_parallel, ctx:log, and warnings kept when a
-- plan fails.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local json = require "moonshard.json"
local S = require "support"

local function errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

-- A plain-text search (messages hold parentheses, dots and quotes).
local function has(text, part) return text:find(part, 1, true) ~= nil end
local function assert_has(text, part)
  assert(has(text, part), string.format("expected %q in:\n%s", part, text))
end

-- A small Mixtral (4 layers, 4 grouped experts each) as config and as tree.
local MIXTRAL = { architectures = { "MixtralForCausalLM" }, hidden_size = 64, intermediate_size = 128,
  num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 4, num_local_experts = 4, num_experts_per_tok = 2, rms_norm_eps = 1e-5,
  vocab_size = 256, tie_word_embeddings = false, torch_dtype = "bfloat16" }
local function mixtral() return models.from_config(MIXTRAL, "tiny mixtral") end
local function tmp_config()
  local path = os.tmpname()
  S.write_file(path, json.encode(MIXTRAL))
  return path
end

-- root { layers { 0..3 { w [8, 4] } }, p [3] }, all f32
local function layers_tree(n)
  local root = module.new("Toy")
  local layers = root:add("layers", module.new("ModuleList"))
  for i = 0, (n or 4) - 1 do layers:add(tostring(i), module.new("Layer")):param("w", { 8, 4 }, "f32") end
  root:param("p", { 3 }, "f32")
  return root
end

local DECL = {
  reshard_after_forward = { default = nil, type = "nil|boolean|integer", doc = "override the rule" },
  offload_policy = { default = nil, type = "nil|string", values = { "cpu" }, doc = "cpu offload" },
  activation_checkpointing = { default = false, type = "boolean|list|string", doc = "which layers" },
  ["prefetch.forward"] = { default = 1, min = 0, doc = "units ahead in forward" },
  ["prefetch.backward"] = { default = 2, min = 0, doc = "units ahead in backward" },
  scale = { default = 0.5, doc = "a number" },
  label = { default = "x", doc = "a string" },
}

-- Plans layers_tree with a policy declaring DECL (or `decl`) that records what ctx.options was.
local function plan_options(opts, decl)
  local seen
  local p = { options = decl or DECL, parallelize = function(ctx)
    seen = ctx.options
    ctx:fully_shard(ctx.model)
  end }
  local plan = planner.plan(layers_tree(), mesh_context.new("dp_shard=2"), p, opts)
  return seen, plan
end

describe("a policy's options", function()
  it("are the declared defaults, nested by their dots, when nothing is set", function()
    local seen, plan = plan_options()
    assert.same({ activation_checkpointing = false, prefetch = { forward = 1, backward = 2 }, scale = 0.5,
      label = "x" }, seen)
    local names = {}
    for i, o in ipairs(plan.options) do names[i] = o.name .. "=" .. planner.option_text(o.value) end
    assert.same({ "activation_checkpointing=false", "label=x", "offload_policy=none", "prefetch.backward=2",
      "prefetch.forward=1", "reshard_after_forward=none", "scale=0.5" }, names)
  end)

  it("take --set strings by the declared type, and Lua values from opts.options", function()
    local seen, plan = plan_options({ options = { offload_policy = "cpu", prefetch = { backward = 0 } },
      set = { "reshard_after_forward=false", "prefetch.forward=3", "activation_checkpointing=0,2",
        "scale=1e-3", "label=true" } })
    assert.is_false(seen.reshard_after_forward)
    assert.equal("cpu", seen.offload_policy)
    assert.same({ forward = 3, backward = 0 }, seen.prefetch)
    assert.same({ 0, 2 }, seen.activation_checkpointing)
    assert.equal(1e-3, seen.scale)
    assert.equal("true", seen.label) -- a string option keeps the string
    local set = {}
    for _, o in ipairs(plan.options) do set[o.name] = o.set end
    assert.same({ activation_checkpointing = true, label = true, offload_policy = true, ["prefetch.backward"] = true,
      ["prefetch.forward"] = true, reshard_after_forward = true, scale = true }, set)
    -- --set comes after opts.options; none is nil, integers are integers
    seen = plan_options({ options = { reshard_after_forward = 2 }, set = { "reshard_after_forward=none" } })
    assert.is_nil(seen.reshard_after_forward)
    seen = plan_options({ set = { "reshard_after_forward=2", "activation_checkpointing=every:2" } })
    assert.equal(2, seen.reshard_after_forward)
    assert.equal("every:2", seen.activation_checkpointing)
    -- the string "none" from Lua is nil where the option takes nil and no free string
    seen = plan_options({ options = { reshard_after_forward = "none" } })
    assert.is_nil(seen.reshard_after_forward)
  end)

  it("refuses an unknown name, listing the options with their docs", function()
    local msg = errmsg(plan_options, { set = { "reshard=false" } })
    assert_has(msg, "moonshard: plan: unknown option 'reshard'; the policy's options are:\n")
    assert_has(msg, "  reshard_after_forward = none  (none, true, false or an integer)\n      override the rule")
    assert_has(msg, "  prefetch.forward = 1  (an integer >= 0)\n      units ahead in forward")
    msg = errmsg(plan_options, { options = { prefetch = { sideways = 1 } } })
    assert_has(msg, "unknown option 'prefetch.sideways'")
    msg = errmsg(plan_options, { set = { "x=1" } }, {})
    assert_has(msg, "unknown option 'x'; the policy declares no options")
  end)

  it("refuses a value of the wrong type, naming the option, the value and what it takes", function()
    local cases = {
      { { set = { "reshard_after_forward=maybe" } },
        "option reshard_after_forward is 'maybe'; expected none, true, false or an integer" },
      { { set = { "prefetch.forward=-1" } }, "option prefetch.forward is -1; expected an integer >= 0" },
      { { set = { "prefetch.forward=1.5" } }, "option prefetch.forward is '1.5'; expected an integer >= 0" },
      { { set = { "offload_policy=gpu" } }, "option offload_policy is 'gpu'; expected none or 'cpu'" },
      { { set = { "scale=big" } }, "option scale is 'big'; expected a number" },
      { { options = { scale = "big" } }, "option scale is 'big'; expected a number" },
      { { options = { reshard_after_forward = 1.5 } },
        "option reshard_after_forward is 1.5; expected none, true, false or an integer" },
      { { options = { activation_checkpointing = { 1, "x" } } },
        "option activation_checkpointing is a table; expected true, false, a list of integers (0,3,5) or a " ..
        "string (element 2 is 'x')" },
      { { options = { label = false } }, "option label is false; expected a string" },
      { { set = { "label" } }, "option setting 'label' is not name=value" },
    }
    for _, c in ipairs(cases) do assert_has(errmsg(plan_options, c[1]), c[2]) end
  end)

  it("refuses declarations that are not what they should be", function()
    local cases = {
      { { x = { default = 1 } }, "the policy's option x has no doc (one line saying what it does)" },
      { { x = { doc = "d" } }, "the policy's option x: its default is none; declare its type" },
      { { x = { doc = "d", default = 1, type = "int" } }, "the policy's option x: type 'int': 'int' is not a type" },
      { { x = { doc = "d", default = "a", typ = "string" } }, "the policy's option x has the key 'typ'" },
      { { x = { doc = "d", default = "a" }, ["x.y"] = { doc = "d", default = 1 } },
        "the policy's options x and x.y clash" },
      { { ["bad name"] = { doc = "d", default = 1 } }, "the policy's options: 'bad name' is not an option name" },
      { { x = { doc = "d", default = 5, max = 3 } }, "option x (its default) is 5; expected an integer <= 3" },
      { { x = 3 }, "the policy's option x is 3; expected a table {default = ..., doc = \"...\"}" },
    }
    for _, c in ipairs(cases) do assert_has(errmsg(plan_options, nil, c[1]), c[2]) end
    assert_has(errmsg(plan_options, nil, "x"), "the policy's options are x; expected a table")
  end)

  it("hand the policy a copy: changing ctx.options changes nothing the plan records", function()
    local plan = planner.plan(layers_tree(), mesh_context.new("dp_shard=2"), { options = DECL,
      parallelize = function(ctx)
        ctx.options.prefetch.forward = 99
        ctx.options.label = "changed"
        ctx:fully_shard(ctx.model)
      end })
    for _, o in ipairs(plan.options) do
      if o.name == "prefetch.forward" then assert.equal(1, o.value) end
      if o.name == "label" then assert.equal("x", o.value) end
    end
    assert.same({ forward = 1, backward = 1 }, plan.prefetch) -- FSDP2's implicit depths: none was set
  end)

  it("are read raw: a declaration's metamethods never run", function()
    local trap = setmetatable({}, { __index = function() error("metamethod ran") end,
      __pairs = function() error("metamethod ran") end })
    local decl = setmetatable({ x = setmetatable({ doc = "d", default = 1 }, getmetatable(trap)) },
      getmetatable(trap))
    local seen = plan_options(nil, decl)
    assert.same({ x = 1 }, seen)
  end)
end)

describe("ctx:set_prefetch", function()
  local function plan_prefetch(pf, static)
    return planner.plan(layers_tree(), mesh_context.new("dp_shard=2"), { prefetch = static,
      parallelize = function(ctx)
        ctx:set_prefetch(pf)
        ctx:fully_shard(ctx.model)
      end })
  end

  it("sets the depths the planner uses; keys not given keep theirs", function()
    assert.same({ forward = 3, backward = 0 }, plan_prefetch({ forward = 3, backward = 0 }).prefetch)
    assert.same({ forward = 4, backward = 5 }, plan_prefetch({ forward = 4 }, { backward = 5 }).prefetch)
    -- the peak follows: every unit of a 4-layer list prefetched with forward = 3
    local function peak(pf)
      return planner.plan(layers_tree(), mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
        ctx:set_prefetch(pf)
        for i = 0, 3 do ctx:fully_shard("layers." .. i) end
        ctx:fully_shard(ctx.model)
      end }).memory.peak_unsharded
    end
    assert.is_true(peak({ forward = 3 }) > peak({ forward = 0, backward = 0 }))
  end)

  it("refuses what prefetch_of refuses, naming the policy line", function()
    local expected = "; expected an integer >= 0 %(units fetched ahead%)"
    assert.matches("^moonshard: plan: ctx:set_prefetch: prefetch.forward is %-1" .. expected,
      errmsg(plan_prefetch, { forward = -1 }))
    assert.matches("^moonshard: plan: ctx:set_prefetch: prefetch.backward is 'x'" .. expected,
      errmsg(plan_prefetch, { backward = "x" }))
    assert.matches("^moonshard: plan: ctx:set_prefetch: prefetch has the key fwd; expected forward and backward only",
      errmsg(plan_prefetch, { fwd = 1 }))
    assert.matches("^moonshard: plan: ctx:set_prefetch: prefetch is nil; expected a table {forward = n, backward = n}",
      errmsg(plan_prefetch, nil))
    -- read raw: an __index gives nothing (the planner's default, FSDP2's implicit depths, stays)
    assert.same({ forward = 1, backward = 1 },
      plan_prefetch(setmetatable({}, { __index = function() return 7 end })).prefetch)
  end)
end)

describe("checkpoint_wrap of chosen layers", function()
  local function wrapped(which, n)
    return planner.plan(layers_tree(n), mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
      ctx:checkpoint_wrap("layers", which)
      ctx:fully_shard(ctx.model)
    end }).checkpointed
  end

  it("wraps all, none, every K-th (the K-th, 2K-th, ...) or the positions given", function()
    local all = { "layers.0", "layers.1", "layers.2", "layers.3" }
    assert.same(all, wrapped(nil))
    assert.same(all, wrapped(true))
    assert.same({}, wrapped(false))
    assert.same({ "layers.1", "layers.3" }, wrapped({ every = 2 }))
    assert.same({ "layers.1", "layers.3" }, wrapped("every:2"))
    assert.same({ "layers.2" }, wrapped("every:3"))
    assert.same(all, wrapped({ every = 1 }))
    assert.same({}, wrapped({ every = 5 }))
    assert.same({ "layers.0", "layers.3" }, wrapped({ only = { 3, 0 } }))
    assert.same({ "layers.0", "layers.3" }, wrapped({ 0, 3 }))
    assert.same({}, wrapped({}))
  end)

  it("refuses K < 1, positions out of range or twice, and what is no choice", function()
    local W = "^moonshard: plan: checkpoint_wrap%(layers%): "
    assert.matches(W .. "every is 0; expected an integer K >= 1 %(every K%-th layer%)", errmsg(wrapped, { every = 0 }))
    assert.matches(W .. "every is 1.5; expected an integer K >= 1", errmsg(wrapped, { every = 1.5 }))
    assert.matches(W .. "every is %-2; expected an integer K >= 1", errmsg(wrapped, "every:-2"))
    assert.matches(W .. "position 4 is out of range: the list has 4 layers, positions 0..3", errmsg(wrapped, { 4 }))
    assert.matches(W .. "position %-1 is out of range", errmsg(wrapped, { only = { -1 } }))
    assert.matches(W .. "position 'a' is out of range", errmsg(wrapped, { "a" }))
    assert.matches(W .. "position 2 is given twice", errmsg(wrapped, { 2, 1, 2 }))
    assert.matches(W .. "every and only together; give one", errmsg(wrapped, { every = 2, only = { 1 } }))
    assert.matches(W .. "unknown key 'evry'", errmsg(wrapped, { evry = 2, only = { 1 } }))
    assert.matches(W .. "'every 2' is not a choice of layers", errmsg(wrapped, "every 2"))
    assert.matches(W .. "the layers to wrap are 3; expected true, false", errmsg(wrapped, 3))
  end)

  -- Expert parallelism before or after the wrap, on all layers or every other one, the
  -- modules held by the policy across the wrap: the same units, owners and wrapped layers.
  local function moe_plan(order, which, mesh)
    return planner.plan(mixtral(), mesh_context.new(mesh), { parallelize = function(ctx)
      local layers = ctx:module("model.layers")
      local experts, ignored = {}, {}
      for _, i in ipairs(layers.child_order) do
        experts[i] = layers.children[i]:get("block_sparse_moe.experts")
      end
      local function ep()
        for _, i in ipairs(layers.child_order) do
          for _, p in ipairs(ctx:expert_parallel(experts[i])) do ignored[#ignored + 1] = p end
        end
      end
      if order == "ep first" then ep() end
      ctx:checkpoint_wrap(layers, which)
      if order == "wrap first" then ep() end
      for _, i in ipairs(layers.child_order) do
        if ctx.mesh:size("ep_shard") > 1 then
          ctx:fully_shard(experts[i], { mesh = { "ep_shard" }, shard_placement_fn = function() return 1 end })
        end
        ctx:fully_shard(layers.children[i], { ignored_params = ignored })
      end
      ctx:fully_shard(ctx.model, { ignored_params = ignored })
    end })
  end
  local function summary(plan)
    local units, owned = {}, {}
    for i, u in ipairs(plan.units) do units[i] = u.name .. " " .. #u.params end
    for i, o in ipairs(plan.owned) do owned[i] = o.fqn .. " " .. (o.unit or "-") end
    return { units = units, owned = owned, checkpointed = plan.checkpointed, memory = plan.memory.total }
  end

  for _, mesh in ipairs({ "dp_shard=4,ep=2", "dp_shard=4,ep=4" }) do
    for _, which in ipairs({ true, "every:2" }) do
      it("gives the same plan with expert_parallel before or after it (" .. tostring(which) .. ", " .. mesh .. ")",
        function()
          local a, b = summary(moe_plan("ep first", which, mesh)), summary(moe_plan("wrap first", which, mesh))
          assert.same(a, b)
          assert.equal(4 * 2, #a.owned) -- 2 grouped tensors a layer, all with expert parallelism
          assert.same(which == true and { "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3" }
            or { "model.layers.1", "model.layers.3" }, a.checkpointed)
          -- layer 0 is wrapped with every layer only, layer 1 both times
          assert.matches("^model%.layers%.0%." .. (which == true and "_checkpoint_wrapped_module%." or "") ..
            "block_sparse_moe%.experts%.", a.owned[1])
          assert.matches("^model%.layers%.1%._checkpoint_wrapped_module%.block_sparse_moe%.experts%.", a.owned[3])
        end)
    end
  end

  it("is shown in the text and the JSON of the plan", function()
    local plan = moe_plan("ep first", "every:2", "dp_shard=4,ep=2")
    local report = require "moonshard.plan_report"
    assert_has(report.to_text(plan), "\nactivation checkpointing: 2 modules: model.layers.1, model.layers.3\n")
    assert.same({ "model.layers.1", "model.layers.3" }, json.decode(report.to_json(plan), "plan").checkpointed)
  end)
end)

describe("the shipped policies' options", function()
  local SHIPPED = { "policies/fsdp2_default.lua", "policies/full_fp32.lua", "policies/by_dtype.lua",
    "policies/inkling2" }
  local function entry(p) return policy.entry_point(p, "spec") end

  it("are declared with docs, and their defaults are the old knobs' values", function()
    local defaults = {}
    for _, path in ipairs(SHIPPED) do
      local d = {}
      for _, o in ipairs(planner.declared_options(entry(policy.load(path)))) do
        assert.is_true(#o.doc > 10, path .. " " .. o.name)
        d[o.name] = o.default == nil and "none" or o.default
      end
      defaults[path] = d
    end
    assert.same({
      -- Automodel's defaults (FSDP2Config, MoEParallelizerConfig): no explicit prefetch
      ["policies/fsdp2_default.lua"] = { reshard_after_forward = "none", offload_policy = "none",
        activation_checkpointing = false, ["prefetch.explicit"] = false, ["prefetch.forward"] = "none",
        ["prefetch.backward"] = "none", lm_head_precision = "none", wrap_outer_model = true,
        -- Automodel's distributed config: no sequence parallel, the plan of the architecture
        sequence_parallel = false, tp_plan = "auto",
        -- Automodel's pipeline config: pp_schedule 1f1b, no layers_per_stage, no rounding
        ["pipeline.schedule"] = "1F1B", ["pipeline.layers_per_stage"] = "none", ["pipeline.round"] = "none",
        ["pipeline.split"] = "automodel" },
      -- (and fsdp2_default's pipeline options, for pp > 1)
      ["policies/full_fp32.lua"] = { activation_checkpointing = false, ["prefetch.forward"] = 1,
        ["prefetch.backward"] = 2, ["pipeline.schedule"] = "1F1B", ["pipeline.layers_per_stage"] = "none",
        ["pipeline.round"] = "none", ["pipeline.split"] = "automodel", sequence_parallel = false },
      -- FSDP2's implicit prefetch, which Automodel's parallelizers leave in place
      ["policies/by_dtype.lua"] = { ["prefetch.forward"] = 1, ["prefetch.backward"] = 1 },
      ["policies/inkling2"] = { offload_policy = "none", activation_checkpointing = true,
        ["prefetch.forward"] = 1, ["prefetch.backward"] = 1, ["pipeline.schedule"] = "1F1B",
        ["pipeline.layers_per_stage"] = "none", ["pipeline.round"] = "none", ["pipeline.split"] = "automodel",
        sequence_parallel = false, pack_islands = false },
    }, defaults)
  end)

  it("reach the plan: reshard_after_forward, prefetch and activation checkpointing of fsdp2_default", function()
    local p = entry(policy.load("policies/fsdp2_default.lua"))
    local plan = planner.plan(mixtral(), mesh_context.new("dp_shard=4,ep=2"), p,
      { set = { "reshard_after_forward=true", "activation_checkpointing=every:2" } })
    for _, u in ipairs(plan.units) do
      if u.name:find("^model%.layers") then assert.is_true(u.reshard, u.name) end
    end
    assert.same({ "model.layers.1", "model.layers.3" }, plan.checkpointed)
    local default = planner.plan(mixtral(), mesh_context.new("dp_shard=4,ep=2"), p)
    assert.same({}, default.checkpointed)
    assert.is_false(default.units[1].reshard) -- the expert-parallel path's default
    -- a depth set turns on the dense path's explicit chains, the other at Automodel's depth
    plan = planner.plan(mixtral(), mesh_context.new("dp_shard=4"), p, { set = { "prefetch.forward=2" } })
    assert.same({ forward = 2, backward = 2 }, plan.prefetch)
    assert.same({ forward = 1, backward = 1 }, planner.plan(mixtral(), mesh_context.new("dp_shard=4"), p).prefetch)
  end)

  it("checkpoint every other inkling2 layer, the FP32 islands found through the wrapper", function()
    local cfg = json.decode(S.read_file("tests/lua/configs/inkling2_tiny.json"), "tiny")
    local p = entry(policy.load("policies/inkling2"))
    local plan = planner.plan(models.from_config(cfg, "tiny"), mesh_context.new("dp_shard=4,ep=2"), p,
      { set = { "activation_checkpointing=1" } })
    assert.same({ "model.layers.1" }, plan.checkpointed)
    local islands = {}
    for _, u in ipairs(plan.units) do
      if u.kind == "fp32_island" and u.name:find("^model%.layers") then islands[#islands + 1] = u.name end
    end
    assert.is_true(#islands >= 4)
    assert.matches("^model%.layers%.0%.[^_]", islands[1])
    assert.matches("^model%.layers%.1%._checkpoint_wrapped_module%.", islands[#islands])
  end)
end)

describe("a derived policy (with)", function()
  local dir
  before_each(function()
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. S.quote(dir)))
  end)
  after_each(function() os.execute("rm -rf " .. S.quote(dir)) end)

  local function load(text)
    S.write_file(dir .. "/derived.lua", text)
    local p = policy.load(dir .. "/derived.lua")
    return policy.entry_point(p, dir .. "/derived.lua"), p
  end

  it("keeps the base's parallelize with new defaults; opts.set applies on top; it derives again", function()
    local e = load('return require("fsdp2_default").with{ reshard_after_forward = false, ' ..
      'prefetch = { forward = 3 } }.with{ activation_checkpointing = { 0 } }\n')
    local plan = planner.plan(mixtral(), mesh_context.new("dp_shard=4"), e)
    for _, u in ipairs(plan.units) do assert.is_false(u.reshard, u.name) end -- dense: layers and the root
    -- layers that keep their parameters get no explicit chain (Automodel), and the plan says so
    assert.same({ forward = 1, backward = 1 }, plan.prefetch)
    assert_has(table.concat(plan.warnings, "\n"), "prefetch: Automodel sets no explicit prefetch chain")
    assert.same({ "model.layers.0" }, plan.checkpointed)
    plan = planner.plan(mixtral(), mesh_context.new("dp_shard=4"), e, { set = { "reshard_after_forward=none",
      "activation_checkpointing=false" } })
    assert.is_true(plan.units[1].reshard)
    assert.same({}, plan.checkpointed)
    -- the base is unchanged
    local base = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "base")
    assert.same({}, planner.plan(mixtral(), mesh_context.new("dp_shard=4"), base).checkpointed)
  end)

  it("refuses an unknown option by name, and a wrong default when planned", function()
    local msg = errmsg(load, 'return require("fsdp2_default").with{ reshard = 1 }\n')
    assert_has(msg, "with: unknown option 'reshard'; the options are: activation_checkpointing, lm_head_precision, " ..
      "offload_policy, pipeline.layers_per_stage, pipeline.round, pipeline.schedule, pipeline.split, prefetch.backward, " ..
      "prefetch.explicit, prefetch.forward, reshard_after_forward, sequence_parallel, tp_plan, wrap_outer_model")
    -- the file that called with, not derive.lua: a tail call leaves no line of it on the stack
    assert_has(msg, "moonshard: policy " .. dir .. "/derived.lua: with: unknown option")
    assert_has(errmsg(load, 'local p = require("by_dtype").with(5)\nreturn p\n'),
      dir .. "/derived.lua:1: with: expected a table of option values")
    local e = load('return require("by_dtype").with{ prefetch = { forward = "x" } }\n')
    assert_has(errmsg(planner.plan, mixtral(), mesh_context.new("dp_shard=4"), e),
      "option prefetch.forward (its default) is 'x'; expected an integer >= 0")
  end)

  it("is the example examples/policies/no_reshard.lua, from the command line", function()
    local cfg = tmp_config()
    local r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", "examples/policies/no_reshard.lua",
      "--json" })
    assert.equal(0, r.code, r.err)
    local plan = json.decode(r.out, "plan")
    assert.is_false(plan.options.reshard_after_forward)
    assert.equal("every:2", plan.options.activation_checkpointing)
    assert.same({ "model.layers.1", "model.layers.3" }, plan.checkpointed)
    for _, u in ipairs(plan.units) do assert.is_false(u.reshard_after_forward, u.name) end
    r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", "examples/policies/no_reshard.lua",
      "--set", "activation_checkpointing=false" })
    os.remove(cfg)
    assert.equal(0, r.code, r.err)
    assert_has(r.out, "\noptions activation_checkpointing=false (set), lm_head_precision=none, offload_policy=none, " ..
      "pipeline.layers_per_stage=none, pipeline.round=none, pipeline.schedule=1F1B, pipeline.split=automodel, " ..
      "prefetch.backward=none, " ..
      "prefetch.explicit=false, prefetch.forward=none, reshard_after_forward=false, sequence_parallel=false, " ..
      "tp_plan=auto, wrap_outer_model=true\n")
    assert.is_false(has(r.out, "activation checkpointing:"))
  end)
end)

describe("ctx:log", function()
  local function plan_logging(fn, opts)
    local lines = {}
    opts = opts or {}
    opts.log = function(s) lines[#lines + 1] = s end
    opts.policy_name = "p.lua"
    planner.plan(layers_tree(2), mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
      fn(ctx)
      ctx:fully_shard(ctx.model)
    end }, opts)
    return lines
  end

  it("prints one line a call, prefixed with the policy, values formatted", function()
    local lines = plan_logging(function(ctx)
      ctx:log("layers:", 2, 1.5, true, nil, { a = 1, "x", b = { c = { d = { e = 1 } } } }, ctx:module("layers.0"),
        ctx.model.params.p, print, "tab\there")
    end)
    assert.same({ 'policy p.lua: layers: 2 1.5 true nil {"x", a = 1, b = {c = {d = {...}}}} <module layers.0 (Layer)> ' ..
      "<param [3] f32> <function> tab\\x09here" }, lines)
  end)

  it("runs no metamethod and is bounded per call and per plan", function()
    local trap = setmetatable({ k = 1 }, { __index = error, __tostring = error, __pairs = error, __len = error })
    local lines = plan_logging(function(ctx) ctx:log(trap) end)
    assert.same({ "policy p.lua: {k = 1}" }, lines)
    lines = plan_logging(function(ctx)
      local wide = {}
      for i = 1, 200 do wide["k" .. i] = i end
      ctx:log(wide)
      ctx:log(string.rep("y", 10000))
    end)
    assert.matches("^policy p%.lua: {k1 = 1, k10 = 10, k100 = 100, ", lines[1])
    assert.matches(", %.%.%.}$", lines[1])
    assert.equal(#"policy p.lua: " + planner.LOG_CALL_BYTES + 3, #lines[2])
    lines = plan_logging(function(ctx)
      for _ = 1, 100 do ctx:log(string.rep("z", 5000)) end
    end)
    local bytes = 0
    for i = 1, #lines - 1 do bytes = bytes + #lines[i] - #"policy p.lua: " end
    assert.is_true(bytes <= planner.LOG_TOTAL_BYTES + 3)
    assert.matches("ctx:log: the 65536 bytes a plan may print are spent; later lines are dropped", lines[#lines])
  end)

  it("prints to stderr from a sandboxed policy, inside its budget", function()
    local cfg = tmp_config()
    local file = os.tmpname() .. ".lua"
    S.write_file(file, [[
return { parallelize = function(ctx)
  local deep = {}
  for i = 1, 100000 do deep = { deep } end
  ctx:log("layers", #ctx.model:get("model.layers").child_order, deep)
  ctx:warn("kept")
  ctx:log(setmetatable({}, { __index = function() while true do end end }))
  while true do end
end }
]])
    local r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", file,
      "--policy-instructions", "2000000" })
    os.remove(cfg)
    os.remove(file)
    assert.equal(1, r.code)
    assert.equal("policy " .. file .. ": layers 4 {{{{...}}}}\npolicy " .. file .. ": {}\n" ..
      "moonshard plan: warning: kept\nmoonshard plan: error: policy " .. file .. ": instruction budget of 2000000 " ..
      "exceeded (an infinite loop?) at line 7\n", r.err)
  end)
end)

describe("moonshard plan with options", function()
  it("lists a policy's options", function()
    local r = S.run({ "plan", "--policy", "policies/fsdp2_default.lua", "--list-options" })
    assert.equal(0, r.code, r.err)
    assert_has(r.out, "options of policy policies/fsdp2_default.lua (set with --set NAME=VALUE):\n")
    assert_has(r.out, "  activation_checkpointing = false  (true, false, a list of integers (0,3,5) or a string)\n" ..
      "      checkpoint the decoder layers: true (all), false, \"every:K\" (every K-th) or a list of positions\n")
    r = S.run({ "plan", "--list-options" })
    assert.equal(2, r.code)
    assert_has(r.err, "--list-options needs --policy")
  end)

  it("says so in --help", function()
    local r = S.run({ "plan", "--help" })
    assert_has(r.out, "  --set NAME=VALUE     set an option, repeatable")
    assert_has(r.out, "  --list-options       print the policy's options")
    assert_has(r.out, "       moonshard plan --policy PATH --list-options\n")
    assert_has(r.out, "The policy's ctx:log lines go to stderr as it runs")
    assert_has(r.out, "on stderr\nbefore the error when the plan fails")
  end)

  it("refuses --set without NAME=VALUE, and an unknown option with the list", function()
    local cfg = tmp_config()
    local r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", "policies/by_dtype.lua",
      "--set", "prefetch" })
    assert.equal(2, r.code)
    assert_has(r.err, "--set takes NAME=VALUE")
    r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", "policies/by_dtype.lua",
      "--set", "prefetch.fwd=1" })
    os.remove(cfg)
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: plan: unknown option 'prefetch.fwd' (policy policies/by_dtype.lua); the " ..
      "policy's options are:\n  prefetch.backward = 1  (an integer >= 0)\n      units gathered ahead in backward " ..
      "(FSDP2's implicit: 1)\n  prefetch.forward = 1  (an integer >= 0)\n      units gathered ahead in forward " ..
      "(FSDP2's implicit: 1)\n", r.err)
  end)

  it("records the options and the prefetch in the JSON", function()
    local cfg = tmp_config()
    local r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", "policies/fsdp2_default.lua",
      "--json", "--set", "offload_policy=cpu", "--set", "prefetch.backward=0" })
    os.remove(cfg)
    assert.equal(0, r.code, r.err)
    local plan = json.decode(r.out, "plan")
    assert.equal("cpu", plan.options.offload_policy)
    assert.equal(json.null, plan.options.reshard_after_forward)
    assert.same({ "offload_policy", "prefetch.backward" }, plan.options_set)
    assert.same({ forward = 1, backward = 0 }, plan.prefetch)
  end)

  it("shows the policy's warnings when the plan fails", function()
    local file = os.tmpname() .. ".lua"
    S.write_file(file, 'return { parallelize = function(ctx) ctx:warn("first\\nline") ctx:fully_shard("nope") end }\n')
    local cfg = tmp_config()
    local r = S.run({ "plan", "--config", cfg, "--mesh", "dp_shard=4", "--policy", file })
    os.remove(cfg)
    os.remove(file)
    assert.equal(1, r.code)
    assert.equal("moonshard plan: warning: first\\x0Aline\nmoonshard plan: error: plan: no module named 'nope' in " ..
      "the model (policy " .. file .. ":1)\n", r.err)
  end)
end)
