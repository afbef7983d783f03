-- deepseek_v4_spec.lua: the DeepSeek-V4 builder and policies/deepseek_v4 against what NeMo
-- Automodel itself makes.
--
-- tests/reference/data/deepseek_v4_units.json was made by tests/reference/deepseek_v4_units.py
-- (MOONSHARD_REF_VENV=... bash tests/reference/make.sh deepseek_v4_units, Automodel's source
-- on AUTOMODEL_SRC): Automodel's DeepseekV4ForCausalLM built from
-- tests/lua/configs/deepseek_v4_tiny.json, sharded by Automodel's own MoE parallelizer
-- (parallelize_model: apply_ep, apply_fsdp with fsdp.py fully_shard_deepseek_v4 and
-- fully_shard_by_dtype) with torch 2.15's fully_shard on a fake process group.  This spec
-- plans the same config on the same meshes with policies/deepseek_v4 and compares every
-- fully_shard call in order: the module, its parameters in order, its mesh, its mixed
-- precision (param, reduce and output dtypes, cast_forward_inputs) and reshard_after_forward;
-- and the builder's parameters (names, shapes, dtypes, requires_grad) with Automodel's model
-- on the meta device, and its buffers (e_score_correction_bias, tid2eid) with Automodel's.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local json = require "moonshard.json"
local S = require "support"

local CONFIG = "tests/lua/configs/deepseek_v4_tiny.json"
local REF = "tests/reference/data/deepseek_v4_units.json"
local POLICY = "policies/deepseek_v4"

local ref = json.decode(S.read_file(REF), REF)

local function plan_of(mesh, options)
  local p = policy.load(POLICY)
  return planner.plan(models.from_config(CONFIG, "spec"), mesh_context.new(mesh), p.shard_units,
    { options = options })
end

-- A unit as the reference writes it.
local function unit_record(u)
  local params = {}
  for _, e in ipairs(u.entries) do
    params[#params + 1] = e.fqn
  end
  local mp = u.mp
  local empty = #params == 0
  return { module = u.name, params = params,
    param_dtype = mp.param_dtype, reduce_dtype = mp.reduce_dtype, output_dtype = mp.output_dtype,
    cast_forward_inputs = mp.cast_forward_inputs,
    -- torch records no mesh and no reshard rule for a unit without parameters
    mesh_dims = (not empty) and u.mesh_axes or nil, reshard_after_forward = (not empty) and u.reshard or nil }
end

local function ref_record(u)
  return { module = u.module, params = u.params, param_dtype = u.param_dtype, reduce_dtype = u.reduce_dtype,
    output_dtype = u.output_dtype, cast_forward_inputs = u.cast_forward_inputs,
    mesh_dims = u.mesh_dims ~= json.null and u.mesh_dims or nil,
    reshard_after_forward = u.reshard_after_forward ~= json.null and u.reshard_after_forward or nil }
end

describe("policies/deepseek_v4 against Automodel's own MoE parallelizer", function()
  assert.is_true(#ref.cases >= 2)
  for _, case in ipairs(ref.cases) do
    it(case.name .. " (" .. case.mesh .. "): every fully_shard call in order", function()
      local plan = plan_of(case.mesh)
      local got, want = {}, {}
      for i, u in ipairs(plan.units) do got[i] = unit_record(u) end
      for i, u in ipairs(case.units) do want[i] = ref_record(u) end
      -- the root's name: "" in both
      for i = 1, math.max(#got, #want) do
        assert.same(want[i], got[i], string.format("unit %d of %s", i, case.name))
      end
      assert.equal(#want, #got)
    end)
  end

  it("the mesh sizes of the reference are the plan's", function()
    for _, case in ipairs(ref.cases) do
      local ctx = mesh_context.new(case.mesh)
      for _, u in ipairs(case.units) do
        if u.mesh_dims ~= json.null then
          assert.same({ ctx:size(u.mesh_dims[1]) }, u.mesh_shape, case.name .. " " .. u.module)
        end
      end
    end
  end)
end)

describe("the DeepSeek-V4 builder against Automodel's DeepseekV4ForCausalLM", function()
  it("has Automodel's parameters, in order, with their shapes, dtypes and requires_grad, and its buffers", function()
    local tree = models.from_config(CONFIG, "spec")
    local got = {}
    for _, np in ipairs(tree:named_parameters()) do
      local p = np[2]
      got[#got + 1] = { np[1], p.shape, p.dtype, p.requires_grad }
    end
    local want = {}
    for i, p in ipairs(ref.model.params) do want[i] = { p[1], p[2], p[3], p[4] } end
    for i = 1, math.max(#got, #want) do assert.same(want[i], got[i], "parameter " .. i) end
    -- every buffer Automodel has, but the rotary embeddings' (non-persistent) inv_freq, is a
    -- buffer of the same shape and dtype here, in the same order
    local bufs, want_bufs = {}, {}
    for _, nb in ipairs(tree:named_buffers()) do bufs[#bufs + 1] = { nb[1], nb[2].shape, nb[2].dtype } end
    for _, b in ipairs(ref.model.buffers) do
      if not b[1]:find("inv_freq$") then want_bufs[#want_bufs + 1] = { b[1], b[2], b[3] } end
    end
    assert.is_true(#want_bufs > 0)
    assert.same(want_bufs, bufs)
  end)

  it("pins by fp32_modules.lua exactly the tensors Automodel's _keep_in_fp32_modules_strict pins", function()
    local tree = models.from_config(CONFIG, "spec")
    local units = policy.load(POLICY).shard_units
    local list = units.fp32_names()
    local function pinned(names, fqn)
      for _, t in ipairs(names) do if fqn:find(t, 1, true) then return true end end
      return false
    end
    local tensors = tree:named_parameters()
    for _, nb in ipairs(tree:named_buffers()) do tensors[#tensors + 1] = nb end
    local n = 0
    for _, np in ipairs(tensors) do
      assert.equal(pinned(tree.attrs.keep_in_fp32_strict, np[1]), pinned(list, np[1]), np[1])
      if pinned(list, np[1]) then n = n + 1 end
    end
    assert.is_true(n > 20, n)
  end)

  it("counts DeepSeek-V4-Flash and -Pro as published (284B and 1.6T without the MTP layer)", function()
    local function counts(path)
      local total, mtp = 0, 0
      for _, np in ipairs(models.from_config(path):named_parameters()) do
        if np[2].requires_grad then
          total = total + np[2].numel
          if np[1]:find("^mtp%.") then mtp = mtp + np[2].numel end
        end
      end
      return total, mtp
    end
    local flash, flash_mtp = counts("examples/configs/deepseek_v4_flash.json")
    assert.equal(290942278866, flash)
    assert.equal(284332230231, flash - flash_mtp)
    local pro, pro_mtp = counts("examples/configs/deepseek_v4_pro.json")
    assert.equal(1598837325086, pro)
    assert.equal(1572997179491, pro - pro_mtp)
  end)
end)

describe("policies/deepseek_v4 rule by rule (fsdp.py, parallelizer.py)", function()
  local plan = plan_of("dp_shard=4,ep=2")
  local by_name = {}
  for _, u in ipairs(plan.units) do by_name[u.name] = u end

  it("every module of fp32_modules.lua with all-f32 parameters is an FP32 unit before its block (_iter_dsv4_fp32_modules)", function()
    for _, name in ipairs({ "model.layers.1.attn_hc", "model.layers.1.ffn_hc", "model.layers.1.self_attn.sinks_param",
      "model.layers.1.self_attn.compressor.wkv", "model.layers.1.self_attn.compressor.indexer.ape_param",
      "model.hc_head", "mtp.layers.0.hc_head", "lm_head" }) do
      local u = assert(by_name[name], name)
      assert.equal("fp32_island", u.kind, name)
      assert.equal("f32", u.mp.param_dtype, name)
      assert.equal("f32", u.mp.output_dtype, name)
    end
    assert.is_true(by_name["model.layers.1.attn_hc"].index < by_name["model.layers.1"].index)
  end)

  it("block islands take fully_shard_by_dtype's policy (no input cast), hc_head and lm_head _fp32_mp_policy's (the caller's cast)", function()
    assert.is_false(by_name["model.layers.0.attn_hc"].mp.cast_forward_inputs)
    assert.is_true(by_name["model.hc_head"].mp.cast_forward_inputs)
    assert.is_true(by_name["lm_head"].mp.cast_forward_inputs)
  end)

  it("experts are expert-parallel, then one unit on ep_shard sharded on dim 1, first in their block (apply_fsdp)", function()
    local u = by_name["model.layers.0.mlp.experts"]
    assert.same({ "ep_shard" }, u.mesh_axes)
    assert.equal(1, u.entries[1].dim)
    assert.equal(by_name["model.layers.0.self_attn.sinks_param"].index - 1, u.index)
  end)

  it("nothing reshards after forward (the MoE path's default), and the holders stay gathered when the rest does (_fp32_module_fsdp_kwargs)", function()
    for _, u in ipairs(plan.units) do assert.is_false(u.reshard, u.name) end
    local p = plan_of("dp_shard=4", { reshard_after_forward = true })
    for _, u in ipairs(p.units) do
      if u.name:find("sinks_param$") or u.name:find("ape_param$") then
        assert.is_false(u.reshard, u.name)
      elseif u.name == "model.layers.0" then
        assert.is_true(u.reshard, u.name)
      end
    end
  end)

  it("an all-f32 model under an f32 policy is one unit per block (the all-fp32 fast path)", function()
    local cfg = json.decode(S.read_file(CONFIG), CONFIG)
    cfg.torch_dtype = "float32"
    local p = policy.load(POLICY)
    p.shard_units.mp_policy = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32" }
    local pl = planner.plan(models.from_config(cfg, "spec"), mesh_context.new("dp_shard=4"), p.shard_units)
    local names = {}
    for _, u in ipairs(pl.units) do names[#names + 1] = u.name end
    assert.same({ "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "mtp.layers.0",
      "model.embed_tokens", "lm_head", "model", "" }, names)
  end)
end)

describe("policies/deepseek_v4 under a pipeline", function()
  -- Automodel runs the MoE parallelizer on each stage's part of the model: a stage's units are
  -- the whole model's units that lie in it, in the same order (the same fully_shard calls, the
  -- same parameters, meshes and precision), then its own part of model and of the root.
  local function record(u)
    local params = {}
    for _, e in ipairs(u.entries) do params[#params + 1] = e.fqn end
    return { name = u.name, kind = u.kind, mesh = table.concat(u.mesh_axes, ","), params = params,
      pd = u.mp.param_dtype or "none", rd = u.mp.reduce_dtype or "none" }
  end
  for _, case in ipairs({ { mesh = "pp=2,dp_shard=2,ep=2", flat = "dp_shard=2,ep=2" },
    { mesh = "pp=2,dp_shard=4", flat = "dp_shard=4" } }) do
    it("makes each stage's units those of the whole model in that stage, on " .. case.mesh, function()
      local pp = plan_of(case.mesh)
      local flat = plan_of(case.flat)
      local stage_of_param = {}
      for _, u in ipairs(pp.units) do
        for _, e in ipairs(u.entries) do
          assert.is_nil(stage_of_param[e.fqn], e.fqn .. " in two units")
          stage_of_param[e.fqn] = u.stage
        end
      end
      local want = { [0] = {}, [1] = {} }
      for _, u in ipairs(flat.units) do
        if u.name ~= "model" and u.name ~= "" then
          local s = stage_of_param[u.entries[1].fqn]
          assert.is_not_nil(s, u.name)
          table.insert(want[s], record(u))
        end
      end
      local got = { [0] = {}, [1] = {} }
      local roots = { [0] = 0, [1] = 0 }
      for _, u in ipairs(pp.units) do
        if u.name == "model" or u.name == "" then
          roots[u.stage] = roots[u.stage] + 1
        else
          table.insert(got[u.stage], record(u))
        end
      end
      assert.same(want[0], got[0])
      assert.same(want[1], got[1])
      assert.same({ [0] = 2, [1] = 2 }, roots) -- model and the root (wrap_outer_model), each stage
      -- every parameter in some unit or placed by expert parallelism, as without a pipeline
      local owned = 0
      for _ in pairs(stage_of_param) do owned = owned + 1 end
      local flat_owned = 0
      for _, u in ipairs(flat.units) do flat_owned = flat_owned + #u.entries end
      assert.equal(flat_owned, owned)
      -- the embedding in stage 0; the head, the final norm, hc_head and the MTP blocks in stage 1
      assert.equal(0, stage_of_param["model.embed_tokens.weight"])
      assert.equal(1, stage_of_param["lm_head.weight"])
      assert.equal(1, stage_of_param["model.norm.weight"])
      for fqn, s in pairs(stage_of_param) do
        if fqn:find("^mtp%.") or fqn:find("^model%.hc_head%.") then assert.equal(1, s, fqn) end
      end
    end)
  end
end)
