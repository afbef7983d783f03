-- packed_islands_spec.lua: packed FP32 islands (fully_shard's islands option, the policies'
-- pack_islands): a unit holding parameters of several stored dtypes, each with its own policy;
-- one all-gather a gather and one reduce-scatter per reduce dtype.  The expected figures are
-- computed here from the unit lists, not read from the plan's own sums.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local S = require "support"

local SIZE = { f32 = 4, bf16 = 2, f16 = 2 }

local function errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

local function config(path) return json.decode(S.read_file(path), path) end

local function plan_policy(cfg_path, mesh, policy_path, opts)
  local tree = models.from_config(config(cfg_path), "spec")
  local p = policy.load(policy_path)
  return planner.plan(tree, mesh_context.new(mesh), p.main or p.shard_units, opts)
end

local function count(list, pred)
  local n = 0
  for _, x in ipairs(list) do if pred(x) then n = n + 1 end end
  return n
end

-- layer { w [8, 4] bf16, attn_query { query [4] f32 }, gate { weight [2, 4] f32 }, norm { w [4] bf16 } }
-- and root { layer, head { w [4, 8] bf16 } }
local function tree()
  local root = module.new("Toy")
  local layer = root:add("layer", module.new("Block"))
  layer:param("w", { 8, 4 }, "bf16")
  layer:add("attn_query", module.new("ResidualQuery")):param("query", { 4 }, "f32")
  layer:add("gate", module.new("Gate")):param("weight", { 2, 4 }, "f32")
  layer:add("norm", module.new("Norm")):param("w", { 4 }, "bf16")
  root:add("head", module.new("Linear")):param("w", { 4, 8 }, "bf16")
  return root
end

local COMPUTE = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16" }

local function policy_of(fn) return { parallelize = fn } end

describe("fully_shard's islands", function()
  local function packed(opts)
    return planner.plan(tree(), mesh_context.new("dp_shard=4"), policy_of(function(ctx)
      local o = { mp_policy = COMPUTE, islands = { "layer.attn_query", ctx.model:get("layer.gate") } }
      for k, v in pairs(opts or {}) do o[k] = v end
      ctx:fully_shard("layer", o)
      ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
    end))
  end

  it("packs the islands into the unit, each island parameter with the FP32 policy", function()
    local plan = packed()
    assert.equal(2, #plan.units)
    local u = plan.units[1]
    assert.is_true(u.packed)
    assert.equal("module", u.kind)
    assert.same({ "layer.attn_query", "layer.gate" }, { u.islands[1].name, u.islands[2].name })
    assert.same({ param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false },
      u.islands[1].mp)
    local by = {}
    for _, e in ipairs(u.entries) do by[e.fqn] = e end
    -- FSDP2's managed order: the children (post-order), then the module's own
    local order = {}
    for i, e in ipairs(u.entries) do order[i] = e.fqn end
    assert.same({ "layer.attn_query.query", "layer.gate.weight", "layer.norm.w", "layer.w" }, order)
    assert.same({ "f32", "f32" }, { by["layer.attn_query.query"].gather, by["layer.attn_query.query"].reduce })
    assert.same({ "f32", "f32" }, { by["layer.gate.weight"].gather, by["layer.gate.weight"].reduce })
    assert.same({ "bf16", "f32" }, { by["layer.w"].gather, by["layer.w"].reduce })
    assert.equal(u.islands[1].mp, planner.param_mp(u, by["layer.attn_query.query"].param))
    assert.equal(u.mp, planner.param_mp(u, by["layer.w"].param))
    assert.equal(plan.units[2].mp, planner.param_mp(plan.units[2], plan.units[2].entries[1].param))
    -- gathered as bytes (two gather dtypes); one all-gather forward, one re-gather backward
    assert.equal("bytes", u.gather_dtype)
    assert.equal(2, #u.comm.all_gather)
    -- shards over 4 ranks: query [1] f32, gate [1, 4] f32, norm [1] bf16, w [2, 4] bf16:
    -- gathered 4 x (4 + 16 + 2 + 16) = 152 bytes; bus bytes 152 - 38 = 114
    assert.equal(114, u.comm.all_gather[1].bytes)
    -- every gradient reduces in f32: one reduce-scatter of (1 + 4 + 1 + 8) x 4 bytes x 3
    assert.same({ 1, 14 * 4 * 3 }, { u.comm.reduce_scatter.count, u.comm.reduce_scatter.bytes })
    -- (per gather: two islands' units, each gathering forward and again in backward)
    assert.same({ all_gather = 4, reduce_scatter = 2, all_reduce = 0 }, u.packing)
  end)

  it("reduces each reduce dtype in a reduce-scatter (and HSDP all-reduce) of its own", function()
    local plan = planner.plan(tree(), mesh_context.new("dp_replicate=2,dp_shard=2"), policy_of(function(ctx)
      ctx:fully_shard("layer", { mp_policy = { param_dtype = "bf16" }, islands = { "layer.attn_query", "layer.gate" } })
      ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
    end))
    local u = plan.units[1]
    -- the module's own parameters reduce in bf16 (stored bf16, reduce_dtype unset), the island's in f32
    assert.same({ "f32", "bf16" }, u.reduce_dtypes)
    assert.equal(2, u.comm.reduce_scatter.count)
    assert.equal(2, u.comm.all_reduce.count)
    -- shards over 2: query [2] + gate [1, 4] f32 = 24 bytes; norm [2] + w [4, 4] bf16 = 36 bytes;
    -- reduce-scatter bus bytes: shard x (W - 1)
    assert.equal((24 + 36) * 1, u.comm.reduce_scatter.bytes)
    -- all-reduce over 2 replicas, per dtype: 2S - ceil(2S / 2)
    assert.equal(24 + 36, u.comm.all_reduce.bytes)
    -- separately: three units (the module's own, two islands), each gathering forward and
    -- backward (layer is no FSDP root: it reshards) and reducing once; packed, 2 reduce dtypes
    assert.same({ all_gather = 4, reduce_scatter = 1, all_reduce = 1 }, u.packing)
    assert.equal(count(plan.units, function(x) return x.comm.reduce_scatter ~= nil end) + 1, plan.comm.reduce_scatter.count)
    assert.equal("f32+bf16", select(2, report.to_text(plan):match("\n +1 +layer +module +dp_replicate,dp_shard +[%d,]+ +(%S+) +(%S+)")))
  end)

  it("refuses bad islands by name", function()
    local function shard(islands, extra)
      return errmsg(planner.plan, tree(), mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        if extra then extra(ctx) end
        ctx:fully_shard("layer", { mp_policy = COMPUTE, islands = islands })
        ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
      end))
    end
    assert.matches("fully_shard(layer): islands is empty", shard({}), 1, true)
    assert.matches("fully_shard(layer): islands is a string; expected a list", shard("layer.gate"), 1, true)
    assert.matches("islands[1] (layer) is the unit's module itself", shard({ "layer" }), 1, true)
    assert.matches("islands[1] (head) is not below layer", shard({ "head" }), 1, true)
    assert.matches("islands[2] (layer.gate) is given twice (also islands[1])", shard({ "layer.gate", "layer.gate" }), 1,
      true)
    assert.matches("islands[1] (layer.gate) is a unit already (fully_shard at ", shard({ "layer.gate" }, function(ctx)
      ctx:fully_shard("layer.gate", {})
    end), 1, true)
    assert.matches("islands[1] (layer.gate) holds no parameter the unit layer takes", errmsg(planner.plan, tree(),
      mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("layer", { islands = { "layer.gate" }, ignored_params = { "layer.gate.weight" } })
      end)), 1, true)
    assert.matches("fully_shard(layer): islands[1]: no module named 'layer.nothing' in the model (nor without " ..
      "activation checkpointing's _checkpoint_wrapped_module segments)", shard({ "layer.nothing" }), 1, true)
    assert.matches("fully_shard(head): islands_mp_policy is the policy of the islands packed into the unit, and no " ..
      "islands are given", errmsg(planner.plan, tree(), mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("head", { islands_mp_policy = { param_dtype = "f32" } })
      end)), 1, true)
    assert.matches("islands_mp_policy.param_dtype of unit layer is 'i8'", errmsg(planner.plan, tree(),
      mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("layer", { islands = { "layer.gate" }, islands_mp_policy = { param_dtype = "i8" } })
      end)), 1, true)
    assert.matches("unknown islands_mp_policy key 'bogus'", errmsg(planner.plan, tree(),
      mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("layer", { islands = { "layer.gate" }, islands_mp_policy = { bogus = 1 } })
      end)), 1, true)
  end)

  it("refuses nested islands, and still holds each part to one stored dtype", function()
    local root = tree()
    root:get("layer.gate"):add("inner", module.new("X")):param("b", { 2 }, "f32")
    assert.matches("islands[2] (layer.gate.inner) and islands[1] (layer.gate) are nested", errmsg(planner.plan, root,
      mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("layer", { islands = { "layer.gate", "layer.gate.inner" } })
      end)), 1, true)
    -- the module's own parameters mixing bf16 and f32 are still refused (FSDP2's rule, per part)
    local mixed = tree()
    mixed:get("layer"):param("extra", { 4 }, "f32")
    assert.matches("unit layer mixes stored dtypes (bf16: layer.norm.w, layer.w; f32: layer.extra)", errmsg(
      planner.plan, mixed, mesh_context.new("dp_shard=4"), policy_of(function(ctx)
        ctx:fully_shard("layer", { mp_policy = COMPUTE, islands = { "layer.attn_query", "layer.gate" } })
        ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
      end)), 1, true)
  end)

  it("takes an island's dotted name with or without activation checkpointing's wrapper segments", function()
    local root = tree()
    local plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy_of(function(ctx)
      ctx:checkpoint_wrap(ctx.model, { 0 })
      ctx:fully_shard("layer", { mp_policy = COMPUTE, islands = { "layer.attn_query",
        "layer._checkpoint_wrapped_module.gate" } })
      ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
    end))
    assert.same({ "layer._checkpoint_wrapped_module.attn_query", "layer._checkpoint_wrapped_module.gate" },
      { plan.units[1].islands[1].name, plan.units[1].islands[2].name })
  end)

  it("takes islands from a sandboxed policy as module copies or names", function()
    local dir = os.tmpname()
    os.remove(dir)
    S.write_file(dir, [[
return { parallelize = function(ctx)
  ctx:fully_shard(ctx.model:get("layer"), { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" },
    islands = { ctx.model:get("layer.attn_query"), "layer.gate" } })
  ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" } })
end }
]])
    local p = policy.load(dir)
    os.remove(dir)
    local plan = planner.plan(tree(), mesh_context.new("dp_shard=4"), p.main or p)
    assert.is_true(plan.units[1].packed)
    assert.equal(2, #plan.units[1].islands)
  end)
end)

describe("pack_islands", function()
  local CFG = "examples/configs/inkling2_small.json"

  -- per step, from the unit list: all-gathers (forward, backward re-gather when resharding),
  -- one reduce-scatter per distinct reduce dtype of the unit's gradients
  local function by_hand(plan)
    local ag, rs = 0, 0
    for _, u in ipairs(plan.units) do
      if u.shard_size > 1 and #u.params > 0 then
        ag = ag + (u.reshard == true and 2 or 1)
        local dtypes = {}
        for _, e in ipairs(u.entries) do
          if e.param.requires_grad then dtypes[e.reduce] = true end
        end
        for _ in pairs(dtypes) do rs = rs + 1 end
      end
    end
    return ag, rs
  end

  for _, case in ipairs({ { "policies/inkling2", CFG, "dp_shard=4" },
    { "policies/inkling2", "tests/lua/configs/inkling2_tiny.json", "pp=2,dp_shard=2" },
    { "policies/inkling2", "tests/lua/configs/inkling2_tiny.json", "dp_shard=4,ep=2" },
    { "policies/deepseek_v4", "tests/lua/configs/deepseek_v4_tiny.json", "dp_shard=4" },
    { "policies/deepseek_v4", "tests/lua/configs/deepseek_v4_tiny.json", "pp=2,dp_shard=2" } }) do
    local pol, cfg, mesh = case[1], case[2], case[3]
    it(string.format("packs %s's islands on %s: fewer units and collectives, the same bytes and state", pol, mesh),
      function()
        local sep = plan_policy(cfg, mesh, pol)
        local pk = plan_policy(cfg, mesh, pol, { set = { "pack_islands=true" } })
        -- the islands (every fp32_island unit but a whole FP32 lm_head) joined their modules' units
        local islands, whole = 0, 0
        for _, u in ipairs(sep.units) do
          if u.kind == "fp32_island" then
            if u.name == "lm_head" then whole = whole + 1 else islands = islands + 1 end
          end
        end
        assert.is_true(islands > 0)
        assert.equal(#sep.units - islands, #pk.units)
        assert.equal(whole, count(pk.units, function(u) return u.kind == "fp32_island" end))
        local held = 0
        for _, u in ipairs(pk.units) do held = held + #(u.islands or {}) end
        assert.equal(islands, held)
        -- every island parameter sits in its module's unit, gathered and reduced in f32, beside
        -- the module's bf16 weights gathered in bf16
        local where = {}
        for _, u in ipairs(pk.units) do
          for _, e in ipairs(u.entries) do where[e.fqn] = { u, e } end
        end
        local checked = 0
        for _, u in ipairs(sep.units) do
          if u.kind == "fp32_island" and u.name ~= "lm_head" then
            for _, e in ipairs(u.entries) do
              local pu, pe = where[e.fqn][1], where[e.fqn][2]
              assert.is_true(pu.packed, e.fqn)
              assert.equal("f32", e.param.dtype)
              assert.same({ "f32", "f32" }, { pe.gather, pe.reduce }, e.fqn)
              local prefix = pu.name == "" and "" or pu.name .. "."
              assert.equal(prefix, e.fqn:sub(1, #prefix), e.fqn)
              checked = checked + 1
            end
          end
        end
        local expected = 0
        for _, u in ipairs(sep.units) do
          if u.kind == "fp32_island" and u.name ~= "lm_head" then expected = expected + #u.params end
        end
        assert.equal(expected, checked)
        for _, u in ipairs(pk.units) do
          if u.packed then
            for _, e in ipairs(u.entries) do
              if e.param.dtype == "bf16" then assert.equal("bf16", e.gather, e.fqn) end
            end
          end
        end
        -- the collectives a step, counted by hand from the unit lists (rank 0's under a pipeline)
        local function on_rank0(plan)
          if not plan.pipeline then return plan.units end
          local out = {}
          local stages = {}
          for _, st in ipairs(plan.pipeline.stages) do if st.pp_rank == 0 then stages[st.index] = true end end
          for _, u in ipairs(plan.units) do if stages[u.stage] then out[#out + 1] = u end end
          return out
        end
        for _, plan in ipairs({ sep, pk }) do
          local ag, rs = by_hand({ units = on_rank0(plan) })
          assert.same({ ag, rs }, { plan.comm.all_gather.count, plan.comm.reduce_scatter.count })
        end
        assert.is_true(pk.comm.all_gather.count < sep.comm.all_gather.count)
        assert.is_true(pk.comm.reduce_scatter.count < sep.comm.reduce_scatter.count)
        -- the bytes: reduce-scatters move the same bytes; all-gathers too, but for islands
        -- whose own unit re-gathered in backward where the unit packing them does not (the
        -- root's output_query: its unit reshards, the root does not)
        assert.equal(sep.comm.reduce_scatter.bytes, pk.comm.reduce_scatter.bytes)
        local regathered = 0
        for _, u in ipairs(sep.units) do
          if u.kind == "fp32_island" and #u.comm.all_gather == 2 then
            local host = where[u.entries[1].fqn][1]
            if host.packed and #host.comm.all_gather == 1 and (not sep.pipeline or
              (function() for _, st in ipairs(sep.pipeline.stages) do
                if st.index == u.stage then return st.pp_rank == 0 end end end)()) then
              regathered = regathered + u.comm.all_gather[2].bytes
            end
          end
        end
        assert.equal(sep.comm.all_gather.bytes - regathered, pk.comm.all_gather.bytes)
        -- what packing saved, as the plan says it
        assert.equal(sep.comm.reduce_scatter.count - pk.comm.reduce_scatter.count, pk.comm.packing.reduce_scatter)
        assert.equal(sep.comm.all_gather.count - pk.comm.all_gather.count, pk.comm.packing.all_gather)
        assert.equal(sep.comm.all_reduce.count - pk.comm.all_reduce.count, pk.comm.packing.all_reduce)
        -- memory per rank: each parameter keeps its dtypes, so its state is the same
        for k, run in ipairs(sep.memory.runs) do
          local other = pk.memory.runs[k]
          assert.same({ run.params or sep.memory.params, run.grads or sep.memory.grads, run.optimizer },
            { other.params or pk.memory.params, other.grads or pk.memory.grads, other.optimizer })
        end
      end)
  end

  it("estimates a step no slower, and the warning goes once the islands are packed", function()
    local opts = { device = "h100-80gb", tokens = { seq_len = 256 } }
    local sep = plan_policy(CFG, "dp_shard=16", "policies/inkling2", opts)
    local pk = plan_policy(CFG, "dp_shard=16", "policies/inkling2",
      { device = "h100-80gb", tokens = { seq_len = 256 }, set = { "pack_islands=true" } })
    assert.is_true(pk.time.step_s <= sep.time.step_s)
    -- each collective pays one latency: the plan's time sums count x latency + bytes / bandwidth
    assert.equal(pk.comm.all_gather.count, pk.time.collectives.all_gather.count)
    local function island_warning(plan)
      for _, w in ipairs(plan.warnings) do
        if w:find("FP32 island unit", 1, true) then return w end
      end
    end
    local w = island_warning(sep)
    assert.is_string(w)
    assert.matches("20 FP32 island units are latency bound (the latency of their collectives a step exceeds their " ..
      "time at the link's bandwidth on h100-80gb)", w, 1, true)
    assert.matches("--set pack_islands=true", w, 1, true)
    -- the collectives it names are the ones packing removes
    local saved = sep.comm.all_gather.count - pk.comm.all_gather.count + sep.comm.reduce_scatter.count -
      pk.comm.reduce_scatter.count
    assert.matches(string.format("saves %d collectives a step", saved), w, 1, true)
    assert.matches("s of collective latency a step (estimate, before overlap)", w, 1, true)
    assert.is_nil(island_warning(pk))
    -- without a device: by the all-gather threshold, no seconds
    local bare = plan_policy(CFG, "dp_shard=4", "policies/inkling2")
    w = island_warning(bare)
    assert.matches("each all-gather moves less than 1.0 MiB a rank", w, 1, true)
    assert.matches("give --device to estimate the seconds", w, 1, true)
    assert.is_nil(w:find("on pp rank 0", 1, true))
    -- under a pipeline the count is pp rank 0's, as the packed plan's total and comm.packing
    local piped = plan_policy(CFG, "pp=2,dp_shard=2", "policies/inkling2")
    local piped_pk = plan_policy(CFG, "pp=2,dp_shard=2", "policies/inkling2", { set = { "pack_islands=true" } })
    local pk = piped_pk.comm.packing
    assert.matches(string.format("saves %d collectives a step on pp rank 0 (all-gather %d, reduce-scatter %d, " ..
      "all-reduce %d)", pk.all_gather + pk.reduce_scatter + pk.all_reduce, pk.all_gather, pk.reduce_scatter,
      pk.all_reduce), island_warning(piped), 1, true)
    -- a policy without the option: fully_shard's islands named instead
    local plain = planner.plan(tree(), mesh_context.new("dp_shard=4"), policy_of(function(ctx)
      ctx:fully_shard("layer.attn_query", { kind = "fp32_island", mp_policy = planner.ISLAND_MP })
      ctx:fully_shard("layer.gate", { kind = "fp32_island", mp_policy = planner.ISLAND_MP })
      ctx:fully_shard("layer", { mp_policy = COMPUTE })
      ctx:fully_shard(ctx.model, { mp_policy = COMPUTE })
    end))
    w = island_warning(plain)
    assert.matches("2 FP32 island units are latency bound (each all-gather moves less than 1.0 MiB a rank): " ..
      "layer.attn_query, layer.gate; pack them into the units around them with ctx:fully_shard(module, " ..
      "{islands = {...}}) (each island parameter keeps its own policy): that saves 6 collectives a step " ..
      "(all-gather 4, reduce-scatter 2, all-reduce 0)", w, 1, true)
    assert.matches("ctx:fully_shard(module, {islands = {...}})", w, 1, true)
  end)

  it("leaves a pipeline's sends as they were: the layers' bf16 activations either way", function()
    local function sends(set)
      local args = { "plan", "--config", CFG, "--mesh", "pp=2,dp_shard=2", "--policy", "policies/inkling2",
        "--seq-len", "256", "--global-batch", "8", "--json" }
      if set then args[#args + 1] = "--set" args[#args + 1] = set end
      local r = S.run(args)
      assert.equal(0, r.code, r.err)
      return json.decode(r.out, "plan").comm.per_step.send_recv
    end
    -- 4 sends on pp rank 0 (2 micro-batches: activations, then their gradients) of one
    -- micro-batch's 256 tokens x hidden 256 in bf16 (the first unit, an f32 island, once
    -- made them f32)
    local want = { count = 4, bytes = 4 * 256 * 256 * 2 }
    assert.same(want, sends(nil))
    assert.same(want, sends("pack_islands=true"))
  end)

  it("shows an island policy's effective dtypes, and warns when it leaves reduce_dtype unset", function()
    -- the islands gather in bf16 with reduce_dtype unset: reduced in their stored f32
    local pol = S.write_file(os.tmpname() .. ".lua", [[
      local COMPUTE = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16" }
      return { parallelize = function(ctx)
        for _, i in ipairs(ctx:module("model.layers").child_order) do
          local name = "model.layers." .. i
          local isl = {}
          for _, m in ipairs({ "attn_query", "self_attn.q_l2_clip", "self_attn.rel_l2_clip", "mlp_query", "mlp.gate" }) do
            if ctx.model:get(name .. "." .. m) then isl[#isl + 1] = name .. "." .. m end
          end
          ctx:fully_shard(name, { mp_policy = COMPUTE, islands = isl, islands_mp_policy = { param_dtype = "bf16" } })
        end
        ctx:fully_shard(ctx.model, { mp_policy = COMPUTE, islands = { "model.output_query" } })
      end }]])
    local r = S.run({ "plan", "--config", CFG, "--mesh", "dp_shard=4", "--policy", pol })
    os.remove(pol)
    assert.equal(0, r.code, r.err)
    S.assert_has(r.out, "model.layers.0: 4 islands (self_attn.q_l2_clip, self_attn.rel_l2_clip, mlp_query, " ..
      "mlp.gate), gather bf16, reduce f32;")
    S.assert_has(r.out, "<root>: 1 island (model.output_query), gather f32, reduce f32;") -- the default fp32 policy
    -- the 19 layer islands, not output_query (its policy is fp32 throughout)
    S.assert_has(r.out, "19 packed islands set param_dtype but not reduce_dtype: planned as PyTorch 2.15's FSDP2 " ..
      "runs them, reducing gradients in the stored dtype")
    S.assert_has(r.out, "model.layers.0.self_attn.q_l2_clip (island of model.layers.0, f32)")
  end)

  it("shows in the table, the JSON, the audit and the rank view", function()
    local args = { "plan", "--config", CFG, "--mesh", "dp_shard=4", "--policy", "policies/inkling2",
      "--set", "pack_islands=true" }
    local r = S.run(args)
    assert.equal(0, r.code, r.err)
    S.assert_has(r.out, "packed units: 5 hold 20 FP32 islands")
    S.assert_has(r.out, "  <root>: 1 island (model.output_query), gather f32, reduce f32")
    args[#args + 1] = "--json"
    args[#args + 1] = "--audit"
    r = S.run(args)
    assert.equal(0, r.code, r.err)
    local j = json.decode(r.out, "plan")
    local u = j.units[1]
    assert.equal("model.layers.0", u.name)
    assert.equal(4, #u.packed.islands)
    assert.same({ "model.layers.0._checkpoint_wrapped_module.self_attn.q_l2_clip", "f32", "f32", "f32", false },
      { u.packed.islands[1].name, u.packed.islands[1].param_dtype, u.packed.islands[1].reduce_dtype,
        u.packed.islands[1].output_dtype, u.packed.islands[1].cast_forward_inputs })
    assert.same({ "f32" }, u.packed.reduce_dtypes)
    -- model.layers.0 reshards after forward: each island's forward and backward gather saved
    assert.same({ all_gather = 8, reduce_scatter = 4, all_reduce = 0 }, u.packed.collectives_saved)
    local dt = {}
    for _, p in ipairs(u.params) do dt[p.fqn] = { p.gather_dtype, p.reduce_dtype } end
    assert.same({ "f32", "f32" }, dt["model.layers.0._checkpoint_wrapped_module.mlp.gate.weight"])
    assert.same({ "bf16", "f32" }, dt["model.layers.0._checkpoint_wrapped_module.self_attn.qkvr.weight"])
    assert.is_nil(j.units[5].packed) -- embed_tokens
    assert.same({ units = 5, islands = 20 }, { units = j.comm.packing.units, islands = j.comm.packing.islands })
    local saved = j.comm.packing.all_gather + j.comm.packing.reduce_scatter + j.comm.packing.all_reduce
    assert.equal(saved, j.comm.packing.collectives_saved)
    local islands = 0
    for _, a in ipairs(j.audit) do
      if a.island ~= json.null then
        islands = islands + 1
        assert.same({ "f32", "f32", "f32" }, { a.stored, a.gathered, a.reduced }, a.fqn)
      end
    end
    assert.equal(20, islands) -- one parameter each (mlp.gate's correction bias is a buffer)
    r = S.run({ "plan", "--config", CFG, "--mesh", "dp_shard=4", "--policy", "policies/inkling2",
      "--set", "pack_islands=true", "--rank", "1" })
    assert.equal(0, r.code, r.err)
    S.assert_has(r.out, "; unit model.layers.0 (packed: gathers f32, reduces f32)")
    S.assert_has(r.out, "; unit model.layers.0 (packed: gathers bf16, reduces f32)")
    -- the picture: each packed unit outlined, its elements by gather dtype in the tip, which
    -- add up to the unit's parameters (from the JSON above)
    local svg = os.tmpname()
    r = S.run({ "plan", "--config", CFG, "--mesh", "dp_shard=4", "--policy", "policies/inkling2",
      "--set", "pack_islands=true", "--svg", svg })
    assert.equal(0, r.code, r.err)
    local text = S.read_file(svg)
    os.remove(svg)
    assert.equal(5, select(2, text:gsub('stroke%-dasharray="3,2"', "")))
    local bf16, f32 = text:match("<title>model%.layers%.0: [%d,]+ params, packed %(one all%-gather%): ([%d,]+) bf16, " ..
      "([%d,]+) f32; 4 FP32 islands: self_attn%.q_l2_clip, self_attn%.rel_l2_clip, mlp_query, mlp%.gate; reduce f32")
    assert.is_truthy(bf16, "layer 0's tip")
    local by = { bf16 = 0, f32 = 0 }
    for _, p in ipairs(u.params) do
      local e = 1
      for _, d in ipairs(p.shape) do e = e * d end
      by[p.gather_dtype] = by[p.gather_dtype] + e
    end
    assert.same(by, { bf16 = tonumber((bf16:gsub(",", ""))), f32 = tonumber((f32:gsub(",", ""))) })
  end)
end)
