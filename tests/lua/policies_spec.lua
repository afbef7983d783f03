-- policies_spec.lua: the shipped policies (docs/policies.md) applied by the planner,
-- and `moonshard plan` end to end, against layouts worked out by hand.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local util = require "moonshard.util"
local json = require "moonshard.json"
local S = require "support"

local INKLING2_SMALL = "examples/configs/inkling2_small.json"

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function config(path) return json.decode(read(path), path) end

local function entry(p) return p.main or p.shard_units end

local function plan_of(cfg, mesh, policy_path)
  local tree = models.from_config(cfg, "spec")
  return planner.plan(tree, mesh_context.new(mesh), entry(policy.load(policy_path)))
end

-- `moonshard plan --safetensors` on a checkpoint of these {name, dtype, shape} tensors,
-- written to a temporary file; extra arguments follow.
local function plan_safetensors(tensors, mesh, policy_path, ...)
  local path = os.tmpname()
  S.write_safetensors(path, tensors)
  local args = { "plan", "--safetensors", path, "--mesh", mesh, "--policy", policy_path, ... }
  local r = S.run(args)
  os.remove(path)
  return r
end

local function errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

describe("the inkling2 policy", function()
  local units = policy.load("policies/inkling2").shard_units

  it("matches FP32 module names dot-bounded, through checkpoint wrappers", function()
    local yes = { "attn_query", "model.layers.1.attn_query", "model.layers.1._checkpoint_wrapped_module.attn_query",
      "model.layers.0.mlp.gate", "model.output_query", "model.layers.2.self_attn.q_l2_clip" }
    local no = { "model.layers.1.xattn_query", "model.layers.0.mlp.gate_proj", "model.layers.0.shared_mlp.gate",
      "model.layers.2.self_attn.k_l2_clip", "model.layers.0.mlp" }
    for _, n in ipairs(yes) do assert.is_true(units.is_fp32_module_name(n), n) end
    for _, n in ipairs(no) do assert.is_false(units.is_fp32_module_name(n), n) end
  end)

  it("yields FP32 islands below a module, once, skipping owned ones", function()
    -- layer { attn_query{query}, self_attn{ q_l2_clip{scale}, k_l2_clip{scale}, inner{ attn_query{q} } },
    --         mlp{ gate{ weight, attn_query{q} } } }
    local layer = module.new("Layer")
    layer:add("attn_query", module.new("ResidualQuery")):param("query", { 4 }, "f32")
    local attn = layer:add("self_attn", module.new("Attention"))
    attn:add("q_l2_clip", module.new("L2Clip")):param("scale", { 4 }, "f32")
    attn:add("k_l2_clip", module.new("L2Clip")):param("scale", { 4 }, "bf16")
    attn:add("inner", module.new("Inner")):add("attn_query", module.new("ResidualQuery")):param("q", { 4 }, "f32")
    local gate = layer:add("mlp", module.new("MoE")):add("gate", module.new("Gate"))
    gate:param("weight", { 2, 4 }, "f32")
    gate:add("attn_query", module.new("ResidualQuery")):param("q", { 4 }, "f32")
    local root = module.new("Root")
    root:add("layer", layer)
    local ctx = planner.context(root, mesh_context.new("dp_shard=2"))
    local names = {}
    for _, m in ipairs(units.iter_fp32_islands(ctx, layer, {})) do names[#names + 1] = ctx:name_of(m) end
    assert.same({ "layer.attn_query", "layer.self_attn.q_l2_clip", "layer.self_attn.inner.attn_query",
      "layer.mlp.gate" }, names)
    names = {}
    for _, m in ipairs(units.iter_fp32_islands(ctx, layer, { [layer.children.attn_query.params.query] = true })) do
      names[#names + 1] = ctx:name_of(m)
    end
    assert.same({ "layer.self_attn.q_l2_clip", "layer.self_attn.inner.attn_query", "layer.mlp.gate" }, names)
  end)

  it("makes every FP32 island its own FP32 unit ahead of its layer, experts owned by EP", function()
    local plan = plan_of(config(INKLING2_SMALL), "dp_replicate=2,dp_shard=4,ep=8", "policies/inkling2")
    local W = "_checkpoint_wrapped_module."
    local expected = {
      "model.layers.0." .. W .. "self_attn.q_l2_clip", "model.layers.0." .. W .. "self_attn.rel_l2_clip",
      "model.layers.0." .. W .. "mlp_query", "model.layers.0." .. W .. "mlp.gate", "model.layers.0" }
    for l = 1, 3 do
      local p = "model.layers." .. l .. "." .. W
      for _, n in ipairs({ p .. "attn_query", p .. "self_attn.q_l2_clip", p .. "self_attn.rel_l2_clip",
        p .. "mlp_query", p .. "mlp.gate", "model.layers." .. l }) do
        expected[#expected + 1] = n
      end
    end
    for _, n in ipairs({ "model.embed_tokens", "lm_head", "model.output_query", "" }) do expected[#expected + 1] = n end
    local got = {}
    for i, u in ipairs(plan.units) do got[i] = u.name end
    assert.same(expected, got)
    for _, u in ipairs(plan.units) do
      if u.kind == "fp32_island" then
        assert.same({ param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false }, u.mp)
        for _, e in ipairs(u.entries) do assert.equal("f32", e.gather) end
      elseif u.name:match("^model%.layers%.%d+$") then
        assert.same({ param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }, u.mp)
        assert.equal("bf16", u.entries[1].gather)
        assert.equal("f32", u.reduce_dtype_eff)
      end
    end
    -- the last layer keeps its parameters after forward; the root never reshards
    assert.is_true(plan.units[5].reshard)
    assert.is_false(plan.units[23].reshard)
    assert.is_false(plan.units[27].reshard)
    -- 4 layers x 2 grouped expert tensors, Shard(0) over ep=8: 16 experts -> 2 per rank
    assert.equal(8, #plan.owned)
    for _, o in ipairs(plan.owned) do
      assert.equal("ep", o.by)
      assert.equal(2, o.local_shape[1])
      assert.matches("%.mlp%.experts%.", o.fqn)
    end
  end)

  it("moves what the FSDP formula says, up to padding", function()
    -- Per unit and step: a forward all-gather in the gather dtype, a backward one when it
    -- reshards, and a reduce-scatter in the reduce dtype: sum over units of
    -- ((1 + reshard) b_gather + b_reduce) * P * (n-1)/n, with the exact (unpadded) P.
    local plan = plan_of(config(INKLING2_SMALL), "dp_shard=8", "policies/inkling2")
    local size = { f32 = 4, bf16 = 2 }
    local want = 0
    for _, u in ipairs(plan.units) do
      if #u.entries > 0 then
        local gathers = u.reshard == true and 2 or 1
        want = want + (gathers * size[u.entries[1].gather] + size[u.reduce_dtype_eff]) * u.numel * 7 / 8
      end
    end
    local got = plan.comm.all_gather.bytes + plan.comm.reduce_scatter.bytes
    assert.is_true(got >= want and got <= want * 1.02, string.format("got %d, formula %d", got, want))
  end)

  it("rejects a tied LM head and experts that are not grouped", function()
    local cfg = config(INKLING2_SMALL)
    cfg.tie_word_embeddings = true
    assert.matches("requires an untied LM head", errmsg(plan_of, cfg, "dp_shard=8", "policies/inkling2"))
    local tree = models.from_config(config(INKLING2_SMALL), "spec")
    local experts = tree:get("model.layers.1.mlp.experts")
    experts.params.down_projs.shape = { 16, 128 * 256 }
    assert.matches("model.layers.1.mlp.experts.down_projs has shape %[16, 32768%]; grouped expert tensors are",
      errmsg(planner.plan, tree, mesh_context.new("dp_shard=8"), policy.load("policies/inkling2").shard_units))
  end)
end)

-- Plans `config` on `mesh` with the policy at `path` with its offload_policy option set
-- (nil: left as shipped); checks every unit got the option's value and returns the plan.
local function plan_with_offload(cfg, mesh, path, offload)
  local p = policy.load(path)
  local plan = planner.plan(models.from_config(cfg, "spec"), mesh_context.new(mesh), entry(p),
    { options = { offload_policy = offload } })
  for _, u in ipairs(plan.units) do assert.equal(offload, u.offload, u.name) end
  return plan
end

describe("the offload_policy option", function()
  it("is unset in the shipped policies, so nothing offloads", function()
    for _, path in ipairs({ "policies/inkling2", "policies/fsdp2_default.lua" }) do
      local decl = entry(policy.load(path)).options.offload_policy
      assert.is_nil(decl.default, path)
      assert.equal("nil|string", decl.type, path)
    end
    local plan = plan_with_offload(config("tests/lua/configs/inkling2_tiny.json"), "dp_shard=4", "policies/inkling2")
    assert.equal(0, plan.memory.offloaded)
  end)

  -- dp_shard=3: uneven shards; ep=2: expert units on ep_shard; ep=4: expert parameters left
  -- to ep-local units, which hold them on the device
  for _, mesh in ipairs({ "dp_shard=3", "dp_replicate=2,dp_shard=2", "dp_shard=4,ep=2", "dp_shard=4,ep=4" }) do
    it("reaches every inkling2 unit and moves its bytes to the host on " .. mesh, function()
      local cfg = config("tests/lua/configs/inkling2_tiny.json")
      local plan = plan_with_offload(cfg, mesh, "policies/inkling2", "cpu")
      local kept = plan_with_offload(cfg, mesh, "policies/inkling2", nil)
      assert.equal(#kept.units, #plan.units)
      local got = {}
      for r, m in ipairs(plan.memory.per_rank) do
        got[r] = m.offloaded
        assert.equal(kept.memory.per_rank[r].total, m.total)
      end
      assert.same(S.offloaded_bytes(plan), got)
    end)
  end

  it("reaches every fsdp2_default unit, through fully_shard_by_dtype too", function()
    local plan = plan_with_offload(config("examples/configs/mixtral_8x7b.json"), "dp_shard=4,ep=2",
      "policies/fsdp2_default.lua", "cpu")
    -- 32 layers, each: experts on ep_shard = 2, then the layer; then embed, head, the inner
    -- model and the (empty) outer root
    assert.equal(32 * 2 + 4, #plan.units)
    local got = {}
    for r, m in ipairs(plan.memory.per_rank) do got[r] = m.offloaded end
    assert.same(S.offloaded_bytes(plan), got)
  end)
end)

describe("by_dtype", function()
  local by_dtype = policy.load("policies/by_dtype.lua").main

  local function layer_tree(extra)
    local root = module.new("Root")
    local layer = root:add("layer", module.new("Layer"))
    layer:add("attn", module.new("Linear")):param("weight", { 8, 8 }, "bf16")
    layer:add("mlp", module.new("Linear")):param("weight", { 8, 8 }, "bf16")
    layer:add("router", module.new("Gate")):param("weight", { 4, 8 }, "f32")
    if extra then extra(layer) end
    return root, layer
  end

  local function units_of(root, fn, mesh)
    local plan = planner.plan(root, mesh_context.new(mesh or "dp_shard=2"), { parallelize = fn })
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    return names, plan
  end

  it("gives the minority dtype group its maximal subtrees, then the module", function()
    local root = layer_tree()
    -- groups: bf16->bf16 (128 elements), f32->bf16 (32): the f32 router is the minority
    local names = units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer")
      ctx:fully_shard(ctx.model)
    end)
    assert.same({ "layer.router", "layer", "" }, names)
  end)

  it("gives every maximal uniform subtree a unit with three groups, and not the module itself", function()
    -- Automodel's rule 4: with three or more groups the module is a unit only when
    -- ignored_params were given (parallelizer_utils.fully_shard_by_dtype's last branch)
    local root = layer_tree(function(layer)
      local n = layer:add("norm", module.new("Norm"))
      n:param("weight", { 8 }, "f16")
    end)
    local names = units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer", { mp_policy = { reduce_dtype = "f32" } })
      ctx:fully_shard(ctx.model)
    end)
    assert.same({ "layer.attn", "layer.mlp", "layer.router", "layer.norm", "" }, names)
  end)

  it("makes the module a unit after three groups, or none, when ignored_params were given", function()
    local function tree(extra)
      return layer_tree(function(layer)
        local e = layer:add("experts", module.new("GroupedExperts"))
        e:param("w", { 2, 8, 8 }, "bf16")
        if extra then extra(layer) end
      end)
    end
    local function run(root, mp)
      return units_of(root, function(ctx)
        local owned = ctx:expert_parallel("layer.experts")
        by_dtype.fully_shard_by_dtype(ctx, "layer", { mp_policy = mp, ignored_params = owned })
        ctx:fully_shard(ctx.model, { ignored_params = owned })
      end, "dp_shard=2,ep=2")
    end
    local names, plan = run(tree(function(layer) layer:add("norm", module.new("Norm")):param("weight", { 8 }, "f16") end),
      { reduce_dtype = "f32" })
    assert.same({ "layer.attn", "layer.mlp", "layer.router", "layer.norm", "layer", "" }, names)
    assert.equal(0, #plan.units[5].entries)
    -- the caller's policy, not one rewritten for a group
    assert.same({ nil, "f32" }, { plan.units[5].mp.param_dtype, plan.units[5].mp.reduce_dtype })
    -- no group at all (every parameter ignored): the module is still a unit, when ignored ones were given
    local only = module.new("Root")
    only:add("layer", module.new("Layer")):add("experts", module.new("GroupedExperts")):param("w", { 2, 8, 8 }, "bf16")
    assert.same({ "layer", "" }, (run(only)))
  end)

  it("picks the minority by parameter count, not elements, and the first group met on a tie", function()
    -- bf16: attn.weight and mlp.weight (2 parameters, 128 elements); f32: router.a, b, c
    -- (3 parameters, 24 elements): the bf16 group is the minority
    local root = layer_tree(function(layer)
      local r = layer.children.router
      r.params, r.param_order = {}, {}
      for _, n in ipairs({ "a", "b", "c" }) do r:param(n, { 8 }, "f32") end
    end)
    local fp32 = { fp32_names = { "router" } }
    local function run(opts)
      return units_of(root, function(ctx)
        by_dtype.fully_shard_by_dtype(ctx, "layer", opts)
        ctx:fully_shard(ctx.model)
      end)
    end
    local names, plan = run(fp32)
    assert.same({ "layer.attn", "layer.mlp", "layer", "" }, names)
    assert.equal("f32", plan.units[3].mp.param_dtype) -- the majority's (f32) policy for the layer
    -- a tie (one bf16 parameter in attn, one f32 in router): the group named_parameters meets first
    local tie = layer_tree(function(layer) layer.children.mlp.params.weight.dtype = "f32" end)
    tie.children.layer.children.mlp.params.weight.dtype = "bf16"
    tie.children.layer.children.attn.params.weight.dtype = "bf16"
    local t = layer_tree()
    t.children.layer.child_order = { "router", "attn", "mlp" }
    assert.same({ "layer.router", "layer", "" }, (units_of(t, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer", fp32) ctx:fully_shard(ctx.model) end)))
    local one = module.new("Root")
    local l = one:add("layer", module.new("Layer"))
    l:add("attn", module.new("Linear")):param("weight", { 8, 8 }, "bf16")
    l:add("router", module.new("Gate")):param("weight", { 4, 8 }, "f32")
    assert.same({ "layer.attn", "layer", "" }, (units_of(one, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer", fp32) ctx:fully_shard(ctx.model) end)))
  end)

  it("gives an f32 group the fp32 policy: f32 gather, reduce and output, no input cast", function()
    local root = layer_tree()
    local _, plan = units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer", { fp32_names = { "router" } })
      ctx:fully_shard(ctx.model)
    end)
    assert.equal("layer.router", plan.units[1].name)
    local mp = plan.units[1].mp
    assert.same({ "f32", "f32", "f32", false }, { mp.param_dtype, mp.reduce_dtype, mp.output_dtype,
      mp.cast_forward_inputs })
    mp = plan.units[2].mp
    assert.same({ "bf16", "f32", "bf16", true }, { mp.param_dtype, mp.reduce_dtype, mp.output_dtype,
      mp.cast_forward_inputs })
  end)

  it("computes in f32 what the model's _keep_in_fp32_modules_strict names, and what a checkpoint stored in f32", function()
    -- unpinned, the f32 router is an f32 master weight computing in bf16: still a group of
    -- its own (stored f32), gathered in bf16
    local root = layer_tree()
    local _, plan = units_of(root, function(ctx) by_dtype.fully_shard_by_dtype(ctx, "layer") ctx:fully_shard(ctx.model) end)
    assert.same({ "layer.router", "bf16" }, { plan.units[1].name, plan.units[1].mp.param_dtype })
    -- pinned by the model (a substring of the name below the layer, as Automodel matches it):
    -- even a bf16 router then computes in f32, a group of its own
    root = layer_tree()
    root.children.layer.children.router.params.weight.dtype = "bf16"
    root.attrs.keep_in_fp32_strict = { "router.weight" }
    _, plan = units_of(root, function(ctx) by_dtype.fully_shard_by_dtype(ctx, "layer") ctx:fully_shard(ctx.model) end)
    assert.same({ "layer.router", "f32" }, { plan.units[1].name, plan.units[1].mp.param_dtype })
    -- read from a checkpoint that stores it in f32 (Automodel's _hf_compute_dtype)
    root = layer_tree()
    root.children.layer.children.router.params.weight.checkpoint_dtype = "f32"
    _, plan = units_of(root, function(ctx) by_dtype.fully_shard_by_dtype(ctx, "layer") ctx:fully_shard(ctx.model) end)
    assert.same({ "layer.router", "f32" }, { plan.units[1].name, plan.units[1].mp.param_dtype })
  end)

  it("counts floating buffers when it looks for uniform subtrees", function()
    -- router: an f32 projection (pinned) below it and a bf16 buffer of its own: the router is
    -- not uniform, its projection is
    local root = layer_tree(function(layer)
      local r = layer.children.router
      r.params, r.param_order = {}, {}
      r:add("proj", module.new("Linear")):param("weight", { 4, 8 }, "f32")
      r:buffer("bias", { 4 }, "bf16")
    end)
    local names = units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer", { fp32_names = { "proj" } })
      ctx:fully_shard(ctx.model)
    end)
    assert.same({ "layer.router.proj", "layer", "" }, names)
  end)

  it("one group: one unit", function()
    local root = layer_tree()
    root.children.layer.children.router.params.weight.dtype = "bf16"
    assert.same({ "layer", "" }, units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer")
      ctx:fully_shard(ctx.model)
    end))
  end)

  it("refuses a group that no subtree isolates", function()
    local root = layer_tree(function(layer) layer:param("scale", { 8 }, "f32") end)
    -- the layer holds an f32 parameter directly, beside bf16 ones in its children: three
    -- children are uniform, but "scale" can only be isolated by the layer itself
    root.children.layer.children.router.params.weight.dtype = "bf16"
    local msg = errmsg(units_of, root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer")
      ctx:fully_shard(ctx.model)
    end)
    assert.matches("could not isolate parameters with a distinct dtype from siblings in the same module: " ..
      "layer.scale. Place them in a dedicated parameter-owning module", msg, 1, true)
  end)

  it("refuses a frozen parameter that no subtree isolates too", function()
    -- a router holding a bf16 weight beside a frozen f32 parameter: Automodel's check covers
    -- every parameter of the groups to isolate, trainable or not
    local root = layer_tree(function(layer)
      layer.children.router.params.weight.dtype = "bf16"
      layer.children.router:param("e_score_correction_bias", { 4 }, "f32", { requires_grad = false })
    end)
    local msg = errmsg(units_of, root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer")
      ctx:fully_shard(ctx.model)
    end)
    assert.matches("could not isolate parameters with a distinct dtype from siblings in the same module: " ..
      "layer.router.e_score_correction_bias. Place them in a dedicated parameter-owning module", msg, 1, true)
    -- as a buffer (Automodel's Gate), nothing is to isolate: one unit
    root = layer_tree(function(layer)
      layer.children.router.params.weight.dtype = "bf16"
      layer.children.router:buffer("e_score_correction_bias", { 4 }, "f32")
    end)
    assert.same({ "layer", "" }, (units_of(root, function(ctx)
      by_dtype.fully_shard_by_dtype(ctx, "layer")
      ctx:fully_shard(ctx.model)
    end)))
  end)
end)

describe("fsdp2_default", function()
  local llama = {
    architectures = { "LlamaForCausalLM" }, vocab_size = 256, hidden_size = 64, intermediate_size = 128,
    num_hidden_layers = 3, num_attention_heads = 4, num_key_value_heads = 2, tie_word_embeddings = false,
    torch_dtype = "bfloat16", rms_norm_eps = 1e-5,
  }

  it("makes every decoder layer a unit, then the root; the last layer keeps its parameters", function()
    local plan = plan_of(llama, "dp_shard=4", "policies/fsdp2_default.lua")
    local got = {}
    for i, u in ipairs(plan.units) do got[i] = { u.name, u.reshard } end
    assert.same({ { "model.layers.0", true }, { "model.layers.1", true }, { "model.layers.2", false }, { "", false } }, got)
  end)

  it("shards experts, blocks by dtype, embed, head and root on an MoE model with ep > 1", function()
    local plan = plan_of(config("examples/configs/qwen3_30b_a3b.json"), "dp_shard=16,ep=8", "policies/fsdp2_default.lua")
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    -- 48 layers, each: experts on ep_shard = 2, then the layer; then embed, head, the inner
    -- model and the outer root
    assert.equal(48 * 2 + 4, #names)
    assert.equal("model.layers.0.mlp.experts", names[1])
    assert.same({ "ep_shard" }, plan.units[1].mesh_axes)
    -- experts are already split on dim 0 by ep; ep_shard shards them on dim 1:
    -- gate_and_up_projs [128, 2048, 1536] -> [16, 2048, 1536] per ep rank -> [16, 1024, 1536]
    local e = plan.units[1].entries[1]
    assert.equal(1, e.dim)
    assert.same({ 16, 2048, 1536 }, e.shape)
    assert.same({ 16, 1024, 1536 }, e.padded)
    assert.equal("model.layers.0", names[2])
    assert.same({ "model.embed_tokens", "lm_head", "model", "" }, { names[97], names[98], names[99], names[100] })
    assert.equal(96, #plan.owned)
  end)
end)

describe("fsdp2_default follows Automodel's parallelizers", function()
  -- plans cfg on mesh with fsdp2_default after setting its knobs
  local function plan_knobs(cfg, mesh, options)
    local p = entry(policy.load("policies/fsdp2_default.lua"))
    return planner.plan(models.from_config(cfg, "spec"), mesh_context.new(mesh), p, { options = options })
  end
  local function names_of(plan)
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    return names
  end
  local qwen3 = config("examples/configs/qwen3_30b_a3b.json")

  it("keeps every unit gathered after forward on the expert-parallel path (MoEParallelizerConfig)", function()
    local plan = plan_knobs(qwen3, "dp_shard=8,ep=4")
    for _, u in ipairs(plan.units) do assert.is_false(u.reshard, u.name) end
    -- Qwen3-30B-A3B on dp_shard=8, ep=4: every layer stays gathered from its forward to its
    -- backward: 17.0 GiB of unsharded parameters at the peak; the dense path's rule (all
    -- layers but the last reshard) would count 1.4 GiB
    assert.equal("17.0 GiB", util.bytes(plan.memory.peak_unsharded))
    local dense_rule = plan_knobs(qwen3, "dp_shard=8,ep=4", { reshard_after_forward = true })
    assert.equal("1.4 GiB", util.bytes(dense_rule.memory.peak_unsharded))
  end)

  it("shards the inner model, then the outer root holding nothing, on the expert-parallel path", function()
    local plan = plan_knobs(qwen3, "dp_shard=8,ep=4")
    local n = #plan.units
    assert.same({ "model.embed_tokens", "lm_head", "model", "" }, { plan.units[n - 3].name, plan.units[n - 2].name,
      plan.units[n - 1].name, plan.units[n].name })
    assert.same({ "model.norm.weight" }, { plan.units[n - 1].entries[1].fqn })
    assert.equal(1, #plan.units[n - 1].entries)
    assert.equal(0, #plan.units[n].params)
    plan = plan_knobs(qwen3, "dp_shard=8,ep=4", { wrap_outer_model = false })
    assert.equal("model", plan.units[#plan.units].name)
  end)

  it("keeps DeepSeek-V3's e_score_correction_bias an f32 buffer on every rank, never gathered", function()
    local cfg = config("tests/reference/configs/deepseek_v3_tiny.json")
    local plan = plan_knobs(cfg, "dp_shard=2,ep=2")
    for _, u in ipairs(plan.units) do
      for _, e in ipairs(u.entries) do assert.is_nil(e.fqn:find("e_score_correction_bias", 1, true), e.fqn) end
    end
    local tree = models.from_config(cfg, "spec")
    local bytes = 0
    for _, nb in ipairs(tree:named_buffers()) do
      assert.matches("%.mlp%.gate%.e_score_correction_bias$", nb[1])
      bytes = bytes + 4 * nb[2].numel
    end
    assert.is_true(bytes > 0)
    for _, m in ipairs(plan.memory.per_rank) do assert.equal(bytes, m.buffers) end
  end)

  it("counts FSDP2's implicit prefetch unless explicit prefetch is enabled, and shows both", function()
    local llama = config("examples/configs/llama3.1_8b.json")
    local plan = plan_knobs(llama, "dp_shard=8")
    assert.same({ forward = 1, backward = 1 }, plan.prefetch)
    assert.same({ forward = 1, backward = 2 }, plan.memory.peak_unsharded_other.prefetch)
    local explicit = plan_knobs(llama, "dp_shard=8", { ["prefetch.explicit"] = true })
    assert.same({ forward = 1, backward = 2 }, explicit.prefetch)
    assert.equal(explicit.memory.peak_unsharded, plan.memory.peak_unsharded_other.bytes)
    assert.equal(plan.memory.peak_unsharded, explicit.memory.peak_unsharded_other.bytes)
    -- Automodel sets no chain when layers keep their parameters, nor on the MoE path
    assert.same({ forward = 1, backward = 1 },
      plan_knobs(llama, "dp_shard=8", { ["prefetch.explicit"] = true, reshard_after_forward = false }).prefetch)
    assert.same({ forward = 1, backward = 1 }, plan_knobs(qwen3, "dp_shard=8,ep=4", { ["prefetch.explicit"] = true }).prefetch)
  end)

  it("gives lm_head an f32 policy only when lm_head_precision asks, inputs still cast", function()
    local cfg = config("tests/reference/configs/qwen3_moe_tiny.json")
    local function head(plan)
      for _, u in ipairs(plan.units) do if u.name == "lm_head" then return u end end
    end
    local u = head(plan_knobs(cfg, "dp_shard=2,ep=2"))
    assert.same({ "bf16", true }, { u.mp.param_dtype, u.mp.cast_forward_inputs })
    u = head(plan_knobs(cfg, "dp_shard=2,ep=2", { lm_head_precision = "f32" }))
    assert.same({ "f32", "f32", "f32", true }, { u.mp.param_dtype, u.mp.reduce_dtype, u.mp.output_dtype,
      u.mp.cast_forward_inputs })
  end)

  it("says which convention DeepSeek-V3 is built in, and warns where FSDP2 would refuse transformers' layout", function()
    local plan = plan_knobs(config("tests/reference/configs/deepseek_v3_tiny.json"), "dp_shard=4")
    local found
    for _, w in ipairs(plan.warnings) do
      if w:find("transformers 5 keeps it in f32", 1, true) then found = w end
    end
    assert.is_not_nil(found)
    assert.matches("^DeepseekV3ForCausalLM is built as NeMo Automodel's DeepseekV3ForCausalLM builds it " ..
      "%(model%.layers%.1%.mlp%.gate%.weight in bf16%).*refuse the 1 unit holding it beside bf16 weights.*: " ..
      "model%.layers%.1;", found)
    for _, w in ipairs(plan_knobs(config("tests/reference/configs/llama_tiny.json"), "dp_shard=4").warnings) do
      assert.is_nil(w:find("transformers 5 keeps", 1, true))
    end
  end)

  it("wraps the children of every ModuleList and ModuleDict in the model, nested lists first", function()
    local root = module.new("M")
    local inner = root:add("model", module.new("Model"))
    local layers = inner:add("layers", module.new("ModuleList"))
    for i = 0, 2 do layers:add(tostring(i), module.new("Layer")):param("w", { 4, 4 }, "bf16") end
    local tower = root:add("tower", module.new("Tower"))
    local blocks = tower:add("blocks", module.new("ModuleDict"))
    blocks:add("a", module.new("Block")):param("w", { 4, 4 }, "bf16")
    local nested = blocks:add("nested", module.new("ModuleList"))
    nested:add("0", module.new("Block")):param("w", { 4, 4 }, "bf16")
    blocks:add("b", module.new("Block")):param("w", { 4, 4 }, "bf16")
    root:add("head", module.new("Linear")):param("weight", { 4, 4 }, "bf16")
    local plan = planner.plan(root, mesh_context.new("dp_shard=2"), entry(policy.load("policies/fsdp2_default.lua")))
    local got = {}
    for i, u in ipairs(plan.units) do got[i] = { u.name, u.reshard } end
    assert.same({ { "model.layers.0", true }, { "model.layers.1", true }, { "model.layers.2", false },
      { "tower.blocks.nested.0", false }, { "tower.blocks.a", true }, { "tower.blocks.b", false }, { "", false } }, got)
  end)
end)

describe("full_fp32", function()
  it("gives expert parallelism the grouped experts, whatever the MoE block is called", function()
    local cfg = config("examples/configs/mixtral_8x7b.json") -- the block is block_sparse_moe
    cfg.num_hidden_layers = 2
    local plan = plan_of(cfg, "dp_shard=8,ep=4", "policies/full_fp32.lua")
    local owned = {}
    for i, o in ipairs(plan.owned) do owned[i] = o.fqn end
    assert.same({ "model.layers.0.block_sparse_moe.experts.gate_and_up_projs",
      "model.layers.0.block_sparse_moe.experts.down_projs", "model.layers.1.block_sparse_moe.experts.gate_and_up_projs",
      "model.layers.1.block_sparse_moe.experts.down_projs" }, owned)
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    -- ep_shard = 2: each layer's experts are a unit on it, ahead of the layer
    assert.same({ "model.layers.0.block_sparse_moe.experts", "model.layers.0",
      "model.layers.1.block_sparse_moe.experts", "model.layers.1", "model.embed_tokens", "lm_head", "" }, names)
  end)

  it("leaves a tied head's weight to the root, as fsdp2_default does", function()
    local cfg = config("examples/configs/llama3.1_8b.json")
    cfg.num_hidden_layers, cfg.tie_word_embeddings = 2, true
    local plan = plan_of(cfg, "dp_shard=4", "policies/full_fp32.lua")
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    assert.same({ "model.layers.0", "model.layers.1", "" }, names)
    assert.equal("model.embed_tokens.weight", plan.units[3].entries[1].fqn)
  end)

  it("places no expert of a checkpoint's per-expert layout, and says so", function()
    local tensors = { { "model.embed_tokens.weight", "F32", { 32, 8 } }, { "lm_head.weight", "F32", { 32, 8 } } }
    for e = 0, 3 do
      tensors[#tensors + 1] = { "model.layers.0.mlp.experts." .. e .. ".up_proj.weight", "F32", { 16, 8 } }
    end
    local r = plan_safetensors(tensors, "dp_shard=4,ep=4", "policies/full_fp32.lua", "--json")
    assert.equal("", r.err)
    local plan = json.decode(r.out)
    assert.same({}, plan.owned)
    assert.matches("^ep = 4 but expert parallelism places no parameter %(model.layers.0.mlp.experts holds 4 " ..
      "per%-expert modules", plan.warnings[#plan.warnings])
  end)
end)

describe("moonshard plan", function()
  local base = { "plan", "--config", INKLING2_SMALL, "--mesh", "dp_replicate=2,dp_shard=4,ep=8", "--policy",
    "policies/inkling2" }
  local function args(...)
    local a = {}
    for _, v in ipairs(base) do a[#a + 1] = v end
    for _, v in ipairs({ ... }) do a[#a + 1] = v end
    return a
  end

  it("prints the units, memory and communication as a table", function()
    local r = S.run(args())
    assert.equal("", r.err)
    assert.equal(0, r.code)
    assert.matches("Inkling2ForCausalLM", r.out)
    assert.matches("fp32_island", r.out)
    assert.matches("memory per rank", r.out)
    assert.matches("all_gather", r.out)
  end)

  it("writes the plan JSON of docs/planning.md", function()
    local r = S.run(args("--json"))
    assert.equal(0, r.code)
    local plan = json.decode(r.out, "plan JSON")
    assert.equal(1, plan.moonshard_plan)
    assert.equal("Inkling2ForCausalLM", plan.model.architecture)
    assert.equal(8164000, plan.model.params)
    assert.equal(8, plan.mesh.world)
    assert.equal(27, #plan.units)
    local island = plan.units[1]
    assert.equal("fp32_island", island.kind)
    assert.same({ "dp_replicate", "dp_shard" }, island.mesh_axes)
    assert.equal("f32", island.param_dtype)
    assert.is_false(island.cast_forward_inputs)
    local p = island.params[1]
    -- q_l2_clip.scale [nh*d] = [256] over dp_shard=4: 64 each
    assert.same({ 256 }, p.shape)
    assert.equal("Shard(0)", p.placement)
    assert.same({ 64 }, p.padded_shard_shape)
    assert.same({ { 64 }, { 64 }, { 64 }, { 64 } }, p.local_shapes)
    assert.equal(8, #plan.owned)
    assert.equal(8, #plan.memory.per_rank)
    assert.equal(7, plan.memory.per_rank[8].rank)
    for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
      assert.is_number(plan.comm.per_step[k].count)
    end
  end)

  it("draws an SVG and audits dtypes", function()
    local svg = os.tmpname()
    local r = S.run(args("--svg", svg, "--audit"))
    assert.equal(0, r.code)
    local text = read(svg)
    os.remove(svg)
    assert.matches("^<svg", text)
    assert.matches("</svg>\n$", text)
    assert.matches("memory per rank", text)
    assert.matches("model.layers.0._checkpoint_wrapped_module.mlp.gate.weight%s+f32%s+f32%s+f32", r.out)
    assert.matches("model.embed_tokens.weight%s+bf16%s+bf16%s+f32", r.out)
    -- a name with markup and a control character still makes well-formed XML
    r = S.run(args("--svg", svg, "--name", "x\1<&>"))
    assert.equal(0, r.code)
    text = read(svg)
    os.remove(svg)
    assert.matches("x\239\191\189&lt;&amp;&gt;", text, 1, true)
    assert.is_nil(text:find("[%z\1-\8\11\12\14-\31]"))
  end)

  it("changes the plan when a policy file is edited, with nothing rebuilt", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. dir .. " && cp policies/inkling2/*.lua " .. dir))
    local function edit(from, to)
      local f = assert(io.open(dir .. "/fp32_modules.lua", "rb"))
      local text = f:read("a"):gsub(from, to)
      f:close()
      f = assert(io.open(dir .. "/fp32_modules.lua", "wb"))
      f:write(text)
      f:close()
    end
    local cmd = { "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", dir, "--json" }
    local before = json.decode(S.run(cmd).out)
    -- k_l2_clip (stored in bf16) becomes an island: gathered in f32, one more unit per layer
    edit('\n}', '\n  "k_l2_clip",\n}')
    local after = json.decode(S.run(cmd).out)
    -- without mlp.gate the f32 router falls into its bf16 layer's unit: refused, by name
    edit('\n  "mlp%.gate",[^\n]*', "")
    local refused = S.run(cmd)
    os.execute("rm -rf " .. dir)
    assert.equal(27, #before.units)
    assert.equal(27 + 4, #after.units)
    local islands = 0
    for _, u in ipairs(after.units) do
      if u.name:match("k_l2_clip$") then
        islands = islands + 1
        assert.equal("fp32_island", u.kind)
        assert.equal("bf16", u.params[1].dtype)
        assert.equal("f32", u.param_dtype)
      end
    end
    assert.equal(4, islands)
    assert.equal(1, refused.code)
    assert.matches("unit model.layers.0 mixes stored dtypes %(bf16: .*; f32: model.layers.0." ..
      "_checkpoint_wrapped_module.mlp.gate.weight", refused.err)
  end)

  it("plans a model read from safetensors headers, names, dtypes and shapes as on disk", function()
    local tensors = { { "model.embed_tokens.weight", "BF16", { 64, 16 } } }
    for l = 0, 1 do
      local p = "model.layers." .. l .. "."
      tensors[#tensors + 1] = { p .. "self_attn.qkv_proj.weight", "BF16", { 48, 16 } }
      tensors[#tensors + 1] = { p .. "mlp.down_proj.weight", "BF16", { 16, 40 } }
      tensors[#tensors + 1] = { p .. "input_layernorm.weight", "BF16", { 16 } }
    end
    tensors[#tensors + 1] = { "model.norm.weight", "BF16", { 16 } }
    tensors[#tensors + 1] = { "lm_head.weight", "BF16", { 64, 16 } }
    local r = plan_safetensors(tensors, "dp_shard=4", "policies/fsdp2_default.lua", "--json")
    assert.equal("", r.err)
    local plan = json.decode(r.out)
    -- 2*64*16 + 2*(48*16 + 16*40 + 16) + 16 = 2048 + 2848 + 16 = 4912
    assert.equal(4912, plan.model.params)
    local names = {}
    for i, u in ipairs(plan.units) do names[i] = u.name end
    assert.same({ "model.layers.0", "model.layers.1", "" }, names)
    assert.same({ 12, 16 }, plan.units[1].params[1].padded_shard_shape)
    assert.equal("model.layers.0.self_attn.qkv_proj.weight", plan.units[1].params[1].fqn)
  end)

  it("plans an Automodel checkpoint's grouped experts from safetensors as from its config", function()
    -- the checkpoint of inkling2_small in Automodel's layout, written from the builder's tree
    local path = os.tmpname()
    local st_dtype = { f32 = "F32", bf16 = "BF16" }
    local tensors = {}
    local tree = models.from_config(config(INKLING2_SMALL), INKLING2_SMALL)
    for _, np in ipairs(tree:named_parameters()) do
      tensors[#tensors + 1] = { np[1], assert(st_dtype[np[2].dtype]), np[2].shape }
    end
    for _, nb in ipairs(tree:named_buffers()) do -- the routers' correction biases
      tensors[#tensors + 1] = { nb[1], assert(st_dtype[nb[2].dtype]), nb[2].shape }
    end
    S.write_safetensors(path, tensors)
    local mesh = "dp_replicate=2,dp_shard=4,ep=4"
    local from_st = S.run({ "plan", "--safetensors", path, "--mesh", mesh, "--policy", "policies/inkling2", "--json" })
    os.remove(path)
    local from_config = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", mesh, "--policy", "policies/inkling2",
      "--json" })
    assert.equal("", from_st.err)
    assert.equal(0, from_st.code)
    local a, b = json.decode(from_st.out), json.decode(from_config.out)
    assert.is_true(#a.owned > 0)
    for _, key in ipairs({ "units", "owned", "memory", "comm", "warnings" }) do assert.same(b[key], a[key]) end
    assert.equal(b.model.params, a.model.params)
  end)

  it("says why expert parallelism places nothing on a checkpoint's per-expert layout", function()
    local path = os.tmpname()
    local tensors = { { "model.embed_tokens.weight", "BF16", { 32, 8 } } }
    for e = 0, 3 do
      for _, w in ipairs({ { "w1", { 16, 8 } }, { "w2", { 8, 16 } }, { "w3", { 16, 8 } } }) do
        tensors[#tensors + 1] = { "model.layers.0.mlp.experts." .. e .. "." .. w[1] .. ".weight", "BF16", w[2] }
      end
    end
    S.write_safetensors(path, tensors)
    local r = S.run({ "plan", "--safetensors", path, "--mesh", "dp_shard=2,ep=2", "--policy",
      "policies/fsdp2_default.lua", "--json" })
    tensors[#tensors + 1] = { "lm_head.weight", "BF16", { 32, 8 } }
    S.write_safetensors(path, tensors)
    local inkling2 = S.run({ "plan", "--safetensors", path, "--mesh", "dp_shard=2,ep=2", "--policy", "policies/inkling2" })
    os.remove(path)
    assert.equal(1, inkling2.code)
    -- the policy's own error, at its line
    local line
    local n = 0
    for text in (S.read_file("policies/inkling2/shard_units.lua") .. "\n"):gmatch("([^\n]*)\n") do
      n = n + 1
      if text:find('reject(string.format("model.layers.%s.mlp.experts is %s%s', 1, true) then line = n end
    end
    assert.equal("moonshard plan: error: policies/inkling2/shard_units.lua:" .. tostring(line) .. ": inkling2 policy: " ..
      "model.layers.0.mlp.experts is ModuleList (a checkpoint's " ..
      "per-expert layout: Automodel groups the experts when it loads them; plan with --config); shared grouped " ..
      "experts are required\n", inkling2.err)
    assert.equal(0, r.code)
    local plan = json.decode(r.out)
    assert.same({}, plan.owned)
    assert.equal("ep = 2 but expert parallelism places no parameter (model.layers.0.mlp.experts " ..
      "holds 4 per-expert modules, the Hugging Face checkpoint layout; Automodel groups experts into [experts, in, " ..
      "out] tensors when it loads them: plan with --config for that layout): the ep axis only divides the ranks",
      plan.warnings[#plan.warnings])
  end)

  it("takes the expert count from the MoE blocks built, whatever the config calls it", function()
    local cfg = config("examples/configs/qwen3_30b_a3b.json")
    cfg.num_hidden_layers, cfg.num_experts, cfg.num_local_experts = 2, nil, 6 -- transformers 5's key
    local path = os.tmpname()
    local function run(mesh)
      local f = assert(io.open(path, "wb"))
      f:write(json.encode(cfg))
      f:close()
      return S.run({ "plan", "--config", path, "--mesh", mesh, "--policy", "policies/fsdp2_default.lua", "--json" })
    end
    local r = run("dp_shard=4,ep=4")
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: mesh: the model's 6 routed experts are not divisible by ep = 4 (expert " ..
      "parallelism splits them evenly over ep)\n", r.err)
    r = run("dp_shard=4,ep=2")
    assert.equal("", r.err)
    assert.equal(2 * 2, #json.decode(r.out).owned)
    -- no experts: every layer dense, nothing for expert parallelism to place
    cfg.num_local_experts = 0
    r = run("dp_shard=4,ep=2")
    os.remove(path)
    assert.equal("", r.err)
    local plan = json.decode(r.out)
    assert.same({}, plan.owned)
    assert.matches("^ep = 2 but expert parallelism places no parameter", plan.warnings[#plan.warnings])
  end)

  it("plans DeepSeek-V3's checkpoint layout from safetensors: bf16 router, f32 correction bias buffer", function()
    local function checkpoint(gate_dtype, mesh)
      local tensors = { { "model.embed_tokens.weight", "BF16", { 32, 8 } } }
      local p = "model.layers.0."
      tensors[#tensors + 1] = { p .. "self_attn.q_proj.weight", "BF16", { 8, 8 } }
      tensors[#tensors + 1] = { p .. "self_attn.o_proj.weight", "BF16", { 8, 8 } }
      tensors[#tensors + 1] = { p .. "mlp.gate.weight", gate_dtype, { 4, 8 } }
      tensors[#tensors + 1] = { p .. "mlp.gate.e_score_correction_bias", "F32", { 4 } }
      tensors[#tensors + 1] = { p .. "mlp.experts.gate_and_up_projs", "BF16", { 4, 8, 32 } }
      tensors[#tensors + 1] = { p .. "mlp.experts.down_projs", "BF16", { 4, 16, 8 } }
      tensors[#tensors + 1] = { "lm_head.weight", "BF16", { 32, 8 } }
      return plan_safetensors(tensors, mesh, "policies/fsdp2_default.lua", "--json", "--audit")
    end
    local r = checkpoint("BF16", "dp_shard=4,ep=2")
    assert.equal("", r.err)
    local plan = json.decode(r.out)
    -- the correction bias is a buffer: in no unit, whole on every rank (16 bytes)
    for _, a in ipairs(plan.audit) do assert.not_equal("model.layers.0.mlp.gate.e_score_correction_bias", a.fqn) end
    for _, m in ipairs(plan.memory.per_rank) do assert.equal(16, m.buffers) end
    assert.equal(0, checkpoint("BF16", "dp_shard=4").code)
    -- transformers 5 saves the router in f32: the checkpoint's dtype is its compute dtype
    -- (Automodel's _hf_compute_dtype), so fully_shard_by_dtype (ep > 1) gives the mlp (the
    -- gate's f32 weight and bias buffer, the experts being ignored) an fp32 unit; one unit per layer (the dense
    -- rule) would hold trainable f32 and bf16 parameters, which FSDP2 refuses ("FSDP expects
    -- uniform original parameter dtype")
    r = checkpoint("F32", "dp_shard=4,ep=2")
    assert.equal("", r.err)
    local units = json.decode(r.out).units
    assert.same({ "model.layers.0.mlp.experts", "model.layers.0.mlp", "model.layers.0" },
      { units[1].name, units[2].name, units[3].name })
    assert.same({ "f32", false }, { units[2].param_dtype, units[2].cast_forward_inputs })
    r = checkpoint("F32", "dp_shard=4")
    assert.equal(1, r.code)
    assert.matches("unit model.layers.0 mixes stored dtypes %(bf16: .*; f32: model.layers.0.mlp.gate.weight%)", r.err)
  end)

  it("fails with a clear message on bad input and bad policies", function()
    local r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8" })
    assert.equal(2, r.code)
    assert.matches("%-%-policy is required", r.err)
    r = S.run({ "plan", "--config", "examples/configs/nope.json", "--mesh", "dp_shard=8", "--policy", "policies/inkling2" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: cannot read examples/configs/nope.json: No such file or directory\n", r.err)
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", "policies/nope.lua" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: policy policies/nope.lua: No such file or directory\n", r.err)
    -- a planner error inside a policy call names the policy line that called
    local bad = os.tmpname()
    local bf = assert(io.open(bad, "wb"))
    bf:write('return { parallelize = function(ctx)\n  ctx:fully_shard("model.nonexistent")\nend }\n')
    bf:close()
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", bad })
    os.remove(bad)
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: plan: no module named 'model.nonexistent' in the model (policy " .. bad ..
      ":2)\n", r.err)
    for _, m in ipairs({ ",", "dp_shard=2,,ep=2" }) do
      r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", m, "--policy", "policies/inkling2" })
      assert.equal(1, r.code)
      assert.equal("moonshard plan: error: mesh: an empty item in '" .. m .. "'; expected sizes like " ..
        "dp_replicate=2,dp_shard=4,ep=8\n", r.err)
    end
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", "policies/inkling2",
      "--json=false" })
    assert.equal(2, r.code)
    assert.matches("--json takes no value (got '--json=false')", r.err, 1, true)
    -- an unwritable picture fails before anything is printed
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", "policies/inkling2",
      "--json", "--svg", "/no/such/dir/plan.svg" })
    assert.equal(1, r.code)
    assert.equal("", r.out)
    assert.equal("moonshard plan: error: cannot write /no/such/dir/plan.svg: No such file or directory\n", r.err)
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8,ep=3", "--policy", "policies/inkling2" })
    assert.equal(1, r.code)
    assert.matches("ep = 3 does not divide", r.err)
    -- a directory is refused by what it is
    r = S.run({ "plan", "--config", "examples", "--mesh", "dp_shard=8", "--policy", "policies/inkling2" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: cannot read examples: is a directory, not a regular file\n", r.err)
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=9223372036854775807", "--policy",
      "policies/inkling2" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: mesh: dp_shard = 9223372036854775807; sizes are integers in " ..
      "1..2147483647 (ranks are C ints)\n", r.err)
    -- a policy that forgets the root leaves parameters unowned
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p " .. dir)
    local f = assert(io.open(dir .. "/layers_only.lua", "wb"))
    f:write([[
return { parallelize = function(ctx)
  local layers = ctx:module("model.layers")
  for _, i in ipairs(layers.child_order) do ctx:fully_shard(layers.children[i]) end
end }
]])
    f:close()
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", dir .. "/layers_only.lua" })
    assert.equal(1, r.code)
    assert.matches("trainable parameters are left unowned: model.embed_tokens.weight", r.err)
    -- a checkpoint directory whose model.safetensors is a directory
    os.execute("mkdir -p " .. dir .. "/ckpt/model.safetensors")
    r = S.run({ "plan", "--safetensors", dir .. "/ckpt", "--mesh", "dp_shard=8", "--policy", dir .. "/layers_only.lua" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: safetensors: " .. dir .. "/ckpt/model.safetensors: cannot read: is a " ..
      "directory, not a regular file\n", r.err)
    -- fully_shard twice on one module: both lines of the policy, through its helper; a
    -- prefetch that is no depth
    f = assert(io.open(dir .. "/twice.lua", "wb"))
    f:write([[
local function shard(ctx, m)
  local unit = ctx:fully_shard(m)
  return unit
end
return { prefetch = { forward = 1 }, parallelize = function(ctx)
  shard(ctx, "model.layers.0")
  shard(ctx, ctx.model)
  shard(ctx, "model.layers.0")
end }
]])
    f:close()
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", dir .. "/twice.lua" })
    assert.equal(1, r.code)
    local t = dir .. "/twice.lua"
    assert.equal(string.format("moonshard plan: error: plan: fully_shard(model.layers.0) is applied twice to the " ..
      "same module: first at %s:2 (from %s:6), then at %s:2 (from %s:8); a module is one shard unit at most\n",
      t, t, t, t), r.err)
    f = assert(io.open(dir .. "/prefetch.lua", "wb"))
    f:write('return { prefetch = { forward = -3 }, parallelize = function(ctx) ctx:fully_shard(ctx.model) end }\n')
    f:close()
    r = S.run({ "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=8", "--policy", dir .. "/prefetch.lua" })
    os.execute("rm -rf " .. dir)
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: plan: the policy's prefetch.forward is -3; expected an integer >= 0 " ..
      "(units fetched ahead) (policy " .. dir .. "/prefetch.lua)\n", r.err)
  end)

  it("plans every C int of ranks at once, and refuses a JSON that would list them all", function()
    local mesh = { "plan", "--config", INKLING2_SMALL, "--mesh", "dp_shard=2147483647", "--policy", "policies/inkling2" }
    local r = S.run(mesh)
    assert.equal("", r.err)
    assert.equal(0, r.code)
    assert.matches("mesh    dp_shard=2147483647 %(world 2147483647%)", r.out)
    assert.matches("optimizer state differs across ranks by [%d.]+ MiB: from 0 to [%d,]+ bytes", r.out)
    mesh[#mesh + 1] = "--json"
    r = S.run(mesh)
    assert.equal(1, r.code)
    assert.equal("", r.out)
    assert.matches("^moonshard plan: error: plan JSON: for 2147483647 ranks its lists would take up to [%d.]+ TiB", r.err)
  end)
end)

describe("moonshard plan --help", function()
  it("names every model builder there is, and no file outside the repository", function()
    local r = S.run({ "plan", "--help" })
    assert.equal(0, r.code)
    local text = r.out:gsub("%s+", " ")
    for arch in pairs(models.builders) do assert.is_truthy(text:find(arch, 1, true), arch) end
    for path in text:gmatch("([%w_%-%.]+/[%w_%-%./]+%.md)") do
      local f = io.open(path, "rb")
      assert.is_not_nil(f, path)
      f:close()
    end
    assert.is_nil(text:find("DESIGN.md", 1, true))
  end)
end)
