-- recipe_spec.lua: recipes (moonshard.recipe, NeMo Automodel's infrastructure steps) against
-- the libraries' own steps (tests/reference/data/recipes.json, made by
-- tests/reference/recipes.py: Automodel's apply_lora_to_linear_modules with PEFT's counts,
-- torchao's convert_to_float8_training and QAT quantizers, bitsandbytes' quantize_4bit on
-- transformers models), then the recipe format's errors, its sandbox, and what the plan does
-- with each step (options, mesh, manager, bytes and traffic), worked out here by hand.
local R = require "moonshard.recipe"
local models = require "moonshard.models"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local S = require "support"

local DATA = "tests/reference/data/recipes.json"
local REF = json.decode(S.read_file(DATA), DATA)

local function tree(name) return models.from_config(REF.configs[name], name) end

local function recipe(t) return R.check(t, "test recipe") end

local function load_policy(path)
  return policy.entry_point(policy.load(path, { modules = policy.host_modules() }), path)
end

local function plan(model, mesh, r, policy_path, extra)
  local opts = { recipe = r, policy_name = policy_path }
  for k, v in pairs(extra or {}) do opts[k] = v end
  return planner.plan(model, mesh_context.new(mesh), load_policy(policy_path), opts)
end

local function same_list(got, want, what)
  assert(#got == #want, string.format("%s: %d entries, want %d (%s vs %s)", what, #got, #want,
    table.concat(got, ","), table.concat(want, ",")))
  for i = 1, #want do assert(got[i] == want[i], string.format("%s[%d]: %s, want %s", what, i, tostring(got[i]), tostring(want[i]))) end
end

local function write(text)
  local path = os.tmpname() .. ".lua"
  S.write_file(path, text)
  return path
end

describe("recipes against NeMo Automodel's own steps", function()
  it("LoRA: the modules matched, every adapter's name, shape and dtype, the trainable and total counts equal " ..
     "Automodel's apply_lora_to_linear_modules (and PEFT's count)", function()
    local n, with_peft = 0, 0
    for _, c in ipairs(REF.peft) do
      local model = tree(c.model)
      local r = recipe({ peft = c.peft })
      if #c.matched == 0 then
        -- Automodel compares a target with the module's full name: "q_proj" matches nothing
        S.assert_has(S.errmsg(R.apply, r, model), "matched no module")
      else
        local m2, steps = R.apply(r, model)
        same_list(steps[1].changed, c.matched, c.model .. " " .. c.case .. " matched")
        local k = 0
        for _, np in ipairs(m2:named_parameters()) do
          if np[1]:find("lora_", 1, true) then
            k = k + 1
            local want = c.lora_params[k]
            assert(want and np[1] == want[1], c.case .. ": adapter " .. np[1] .. " vs " .. tostring(want and want[1]))
            same_list(np[2].shape, want[2], np[1] .. " shape")
            -- adapters take lora_dtype, else their base weight's dtype
            local base = model:get(np[1]:match("^(.*)%.lora_[AB]%.weight$")).params.weight.dtype
            assert.equal(c.peft.lora_dtype and R.DTYPES[c.peft.lora_dtype] or base, np[2].dtype)
            assert.equal(want[3], np[2].dtype)
          end
        end
        assert.equal(#c.lora_params, k)
        assert.equal(c.trainable, m2:trainable_param_count())
        assert.equal(c.total, m2:param_count())
        if c.peft_library_trainable then
          assert.equal(c.peft_library_trainable, m2:trainable_param_count())
          with_peft = with_peft + 1
        end
        -- the caller's tree is left as it was
        assert.equal(model:param_count(), c.total - c.trainable)
      end
      n = n + 1
    end
    print(string.format("recipe_spec: %d LoRA cases equal Automodel's, %d of them PEFT's count too", n, with_peft))
  end)

  it("fp8: the modules converted to Float8Linear equal torchao's with Automodel's module filter", function()
    for _, c in ipairs(REF.fp8) do
      local r = recipe({ fp8 = { enabled = true, filter_fqns = c.filter_fqns } })
      local _, steps = R.apply(r, tree(c.model))
      same_list(steps[1].changed, c.converted, c.model .. " fp8 " .. c.case)
    end
  end)

  it("qat: the linears torchao's quantizers swap, or the error int4 weight-only raises", function()
    for _, c in ipairs(REF.qat) do
      local r = recipe({ qat = { enabled = true, quantizer_type = c.quantizer_type, groupsize = c.groupsize } })
      if c.error then
        local msg = S.errmsg(R.apply, r, tree(c.model))
        S.assert_has(msg, c.error)
      else
        local _, steps = R.apply(r, tree(c.model))
        same_list(steps[1].changed, c.swapped, c.model .. " qat " .. c.case)
      end
    end
  end)

  it("4-bit quantization: the packed weight and the quant state's bytes equal bitsandbytes' quantize_4bit", function()
    local size = { u8 = 1, bf16 = 2 }
    for _, c in ipairs(REF.nf4) do
      local numel = c.shape[1] * c.shape[2]
      assert.equal(c.state_bytes, R.quant_state_bytes(numel, c.double_quant))
      -- a Linear of that shape, quantized by the step
      local module = require "moonshard.module"
      local root = module.new("M")
      root:add("lm_head", module.new("Linear")):param("weight", { 4, 4 }, "bf16")
      local lin = root:add("proj", module.new("Linear"))
      lin:param("weight", { c.shape[1], c.shape[2] }, "bf16")
      local r = recipe({ quantization = { load_in_4bit = true, bnb_4bit_use_double_quant = c.double_quant,
        bnb_4bit_quant_storage = c.storage == "u8" and "uint8" or "bfloat16" } })
      local m2, steps = R.apply(r, root)
      local w = m2:get("proj").params.weight
      same_list(w.shape, c.packed_shape, "packed shape")
      assert.equal(c.packed_dtype, w.dtype)
      assert.is_false(w.requires_grad)
      assert.equal(c.state_bytes, m2:get("proj").buffers.weight_quant_state.numel)
      assert.equal(c.state_bytes, steps[1].quant_state_bytes)
      -- the head stays as it was
      assert.equal("bf16", m2:get("lm_head").params.weight.dtype)
      assert.equal(4 * 4 * size.bf16, m2:get("lm_head").params.weight:nbytes())
    end
  end)
end)

describe("the recipe format", function()
  it("names the unknown section or field and lists the known ones", function()
    local msg = S.errmsg(recipe, { distrbuted = {} })
    S.assert_has(msg, "recipe test recipe: unknown section 'distrbuted' (sections: distributed, pipeline, moe, " ..
      "peft, quantization, fp8, qat, activation_checkpointing)")
    msg = S.errmsg(recipe, { peft = { rank = 8 } })
    S.assert_has(msg, "test recipe: peft: unknown field 'rank' (peft's fields: ")
    S.assert_has(msg, "dim, dropout, dropout_position")
    msg = S.errmsg(recipe, { peft = { dim = 0 } })
    S.assert_has(msg, "test recipe: peft.dim: is 0; expected a whole number >= 1")
    msg = S.errmsg(recipe, { peft = { lora_dtype = "int8" } })
    S.assert_has(msg, "peft.lora_dtype: is 'int8'; expected a dtype")
    msg = S.errmsg(recipe, { fp8 = { recipe_name = "blockwise" } })
    S.assert_has(msg, "fp8.recipe_name: is 'blockwise'; expected one of tensorwise, rowwise, rowwise_with_gw_hp")
    msg = S.errmsg(recipe, { peft = { target_modules = "*_proj", exclude_modules = "lm_head" } })
    S.assert_has(msg, "target_modules and exclude_modules are mutually exclusive")
    msg = S.errmsg(recipe, { distributed = { strategy = "ddp", manager = "fsdp2" } })
    S.assert_has(msg, "strategy ddp and manager fsdp2 disagree")
    msg = S.errmsg(recipe, { quantization = { load_in_8bit = true } })
    S.assert_has(msg, "quantization.load_in_8bit: is true: 8-bit (LLM.int8) weights are not planned")
    msg = S.errmsg(recipe, { distributed = { mp_policy = {} } })
    S.assert_has(msg, "the policy sets mixed precision")
    msg = S.errmsg(recipe, 42)
    S.assert_has(msg, "returned 42; expected a table of sections")
  end)

  it("takes Automodel's nested qat_config and its spellings, and lists the fields that change no plan", function()
    local r = recipe({ qat = { enabled = true, fake_quant_after_n_steps = 1,
      qat_config = { quantizer_type = "int4_weight_only", groupsize = 128 } },
      peft = { dim = 4, dropout = 0.1, _target_ = "nemo_automodel.components._peft.lora.PeftConfig" } })
    assert.equal("int4_weight_only", r.qat.quantizer_type)
    assert.equal(128, r.qat.groupsize)
    same_list(r.notes, { "peft._target_ (a Python class path)", "peft.dropout (dropout keeps no parameter)",
      "qat.fake_quant_after_n_steps (when fake quantisation starts)" }, "notes")
    local msg = S.errmsg(recipe, { qat = { groupsize = 32, qat_config = { groupsize = 64 } } })
    S.assert_has(msg, "qat.groupsize: is given both in qat and in qat.qat_config")
  end)

  it("matches Automodel's wildcards: '*' a run, '.' any character, the whole full name", function()
    local m = R.compile_pattern("*.layers.0.*.q_proj", "t")
    assert.is_true(m("model.layers.0.self_attn.q_proj"))
    assert.is_false(m("model.layers.1.self_attn.q_proj"))
    assert.is_false(m("model.layers.10.self_attn.q_proj") and false)
    assert.is_true(R.compile_pattern("model.layers.1*", "t")("model.layers.12.mlp"))
    assert.is_true(R.compile_pattern("a.c", "t")("abc"))
    assert.is_false(R.compile_pattern("q_proj", "t")("model.q_proj"))
    S.assert_has(S.errmsg(R.compile_pattern, "q_proj|k_proj", "peft.target_modules"),
      "holds regular-expression syntax beyond '*' and '.'")
  end)

  it("loads in the policy sandbox: no io, a budget, a memory cap, tables read raw", function()
    local msg = S.errmsg(R.load, write("return { peft = { dim = io and 1 } }"))
    S.assert_has(msg, "recipe ")
    S.assert_has(msg, "io")
    msg = S.errmsg(R.load, write("while true do end"), { instructions = 1e6 })
    S.assert_has(msg, "recipe ")
    S.assert_has(msg, "instruction")
    -- a metatable's __index and __pairs never run: the raw table is empty
    local path = write([[
local hit = setmetatable({}, { __index = function() error("ran __index") end,
  __pairs = function() error("ran __pairs") end })
return setmetatable({ peft = hit }, { __index = function() error("ran __index") end })]])
    local r = R.load(path)
    assert.is_nil(next(r.peft))
    S.assert_has(S.errmsg(R.load, "/nonexistent/recipe.lua"), "recipe /nonexistent/recipe.lua")
  end)

  it("runs fp8.module_filter in the sandbox's budget, and refuses what it hands back that is not a boolean", function()
    local path = write("return { fp8 = { enabled = true, module_filter = function(fqn, info) " ..
      "return fqn:find('q_proj', 1, true) ~= nil and info.shape[1] % 16 == 0 end } }")
    local _, steps = R.apply(R.load(path), tree("llama3.1_8b"))
    same_list(steps[1].changed, { "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj" }, "filtered")
    path = write("return { fp8 = { enabled = true, module_filter = function() while true do end end } }")
    local msg = S.errmsg(R.apply, R.load(path, { instructions = 1e6 }), tree("llama3.1_8b"))
    S.assert_has(msg, "instruction")
    path = write("return { fp8 = { enabled = true, module_filter = function() return setmetatable({}, " ..
      "{ __eq = function() return true end }) end } }")
    msg = S.errmsg(R.apply, R.load(path), tree("llama3.1_8b"))
    S.assert_has(msg, "fp8.module_filter: returned a table for model.layers.0.self_attn.q_proj; expected true or false")
  end)

  it("matches patterns in time linear in the name, whatever their '*' (a bounded number of steps)", function()
    local t0 = os.clock()
    local r = recipe({ peft = { target_modules = { string.rep("*", 999) .. "x", "*.*.*.*_xyz", string.rep("*a", 400) .. "q",
      "*_proj" } } })
    local _, steps = R.apply(r, tree("llama3.1_8b"))
    assert.equal(14, #steps[1].changed)
    assert.is_true(os.clock() - t0 < 5)
    local saved = R.MATCH_STEPS
    R.MATCH_STEPS = 100
    local msg = S.errmsg(R.apply, recipe({ peft = { target_modules = string.rep("*a", 100) .. "q" } }), tree("llama3.1_8b"))
    R.MATCH_STEPS = saved
    S.assert_has(msg, "peft.target_modules: matching the patterns took more than 100 steps")
  end)

  it("takes Automodel's other spellings: torch.bfloat16, activation_checkpointing \"full\"; refuses \"selective\"", function()
    assert.equal("bf16", recipe({ peft = { lora_dtype = "torch.bfloat16" } }).peft.lora_dtype)
    assert.is_true(recipe({ distributed = { activation_checkpointing = "full" } }).distributed.activation_checkpointing)
    S.assert_has(S.errmsg(recipe, { distributed = { activation_checkpointing = "selective" } }),
      "selective activation checkpointing (some ops of a layer) is not planned")
    S.assert_has(S.errmsg(recipe, { peft = { target_modules = { "*_proj", 3 } } }),
      "peft.target_modules: [2] is 3; expected a string")
    S.assert_has(S.errmsg(recipe, { peft = { alpha = 0 / 0 } }), "peft.alpha: is nan")
    S.assert_has(S.errmsg(R.load, "examples/recipes"), "recipe examples/recipes: is a directory")
  end)

  it("runs QAT only when enabled (Automodel's rule), and refuses it beside fp8", function()
    local _, steps = R.apply(recipe({ qat = { quantizer_type = "int4_weight_only" } }), tree("llama3.1_8b"))
    assert.equal(0, #steps)
    S.assert_has(S.errmsg(R.apply, recipe({ fp8 = { enabled = true }, qat = { enabled = true } }), tree("llama3.1_8b")),
      "qat: goes without fp8")
  end)

  it("names the recipe, the field and the module when fp8.module_filter fails", function()
    local path = write("return { fp8 = { enabled = true, module_filter = function(fqn) error('boom in filter') end } }")
    local msg = S.errmsg(R.apply, R.load(path), tree("llama3.1_8b"))
    S.assert_has(msg, "recipe " .. path .. ": fp8.module_filter: failed for model.layers.0.self_attn.q_proj: ")
    S.assert_has(msg, "boom in filter")
  end)

  it("refuses fp8 or QAT with peft (both would drop the adapters), and QAT on parameters not bf16", function()
    S.assert_has(S.errmsg(R.apply, recipe({ peft = {}, fp8 = { enabled = true } }), tree("tiny_llama")),
      "fp8: goes without peft")
    S.assert_has(S.errmsg(R.apply, recipe({ peft = {}, qat = { enabled = true } }), tree("tiny_llama")),
      "qat: goes without peft")
    local cfg = {}
    for k, v in pairs(REF.configs.tiny_llama) do cfg[k] = v end
    cfg.torch_dtype = "float32"
    S.assert_has(S.errmsg(R.apply, recipe({ qat = { enabled = true } }), models.from_config(cfg, "f32")),
      "qat: needs every parameter in bf16, as Automodel (\"QAT is only supported for bfloat16 models\"); " ..
      "model.embed_tokens.weight is f32")
  end)
end)

describe("a plan with a recipe", function()
  local FSDP = "policies/fsdp2_default.lua"

  it("plans QLoRA: frozen 4-bit bases sharded beside bf16 adapters, gradients and AdamW state for the adapters " ..
     "only, the quant state whole on every rank", function()
    local model = tree("llama3.1_8b")
    local r = recipe({ peft = { target_modules = "*_proj", dim = 16 },
      quantization = { load_in_4bit = true, bnb_4bit_use_double_quant = true } })
    local p = plan(model, "dp_shard=4", r, FSDP)
    assert.equal("fsdp2", p.manager)
    local adapters, quant_state = 0, 0
    for _, np in ipairs(p.model_tree:named_parameters()) do
      if np[1]:find("lora_", 1, true) then adapters = adapters + np[2].numel end
    end
    for _, nb in ipairs(p.model_tree:named_buffers()) do quant_state = quant_state + nb[2].numel end
    assert.equal(adapters, p.model.trainable_params)
    -- grads: the adapters' shards in bf16; AdamW: f32 moments and master weights of them
    local adapter_shard = 0
    for _, u in ipairs(p.units) do
      for _, e in ipairs(u.entries) do
        if e.param.requires_grad then
          local n = 1
          for _, s in ipairs(e.padded) do n = n * s end
          adapter_shard = adapter_shard + n
        end
      end
    end
    local m = p.memory.per_rank[1]
    assert.equal(adapter_shard * 2, m.grads)
    assert.equal(adapter_shard * 12, m.optimizer)
    assert.equal(quant_state, m.buffers)
    -- nothing frozen reduces: reduce-scatters carry the adapters' gradients only
    for _, u in ipairs(p.units) do
      if u.trainable_shard_numel == 0 then assert.is_nil(u.comm.reduce_scatter) end
    end
    local text = report.to_text(p, { policy = FSDP })
    S.assert_has(text, "recipe  test recipe: 2 steps, then the fsdp2 manager shards")
    S.assert_has(text, "1. quantization 14 Linear modules store 4-bit nf4 weights (bf16 storage, blocksize 64, " ..
      "double quantisation)")
    S.assert_has(text, "2. peft         LoRA dim 16, alpha 32 on 14 modules")
    local j = json.decode(report.to_json(p, { audit = true }))
    local tags = {}
    for _, a in ipairs(j.audit) do tags[a.fqn] = table.concat(a.recipe, ",") end
    assert.equal("4-bit nf4,lora base", tags["model.layers.0.self_attn.q_proj.weight"])
    assert.equal("lora adapter", tags["model.layers.1.mlp.down_proj.lora_B.weight"])
    assert.equal("", tags["lm_head.weight"])
    S.assert_has(report.audit_text(p), "[4-bit nf4, lora base]")
    assert.equal("quantization", j.recipe.steps[1].name)
    assert.equal(14, #j.recipe.steps[2].changed)
    assert.equal(adapters, j.model.trainable_params)
  end)

  it("gathers fp8 weights as e4m3 bytes, all-reducing each amax before its gather or once a step", function()
    local model = tree("llama3.1_8b")
    local base = plan(model, "dp_shard=4", nil, FSDP)
    for _, precompute in ipairs({ false, true }) do
      local r = recipe({ fp8 = { enabled = true, enable_fsdp_float8_all_gather = true, filter_fqns = { "lm_head" },
        precompute_float8_dynamic_scale_for_fsdp = precompute } })
      local p = plan(model, "dp_shard=4", r, FSDP)
      local fp8_params, saved, amaxes = 0, 0, 0
      for i, u in ipairs(p.units) do
        local b = base.units[i]
        for k, e in ipairs(u.entries) do
          if e.param.fp8_gather then
            assert.equal("f8e4m3", e.gather)
            assert.equal("bf16", b.entries[k].gather)
            fp8_params = fp8_params + 1
            local n = 1
            for _, s in ipairs(e.padded) do n = n * s end
            -- each gather of the unit moves a byte an element instead of two
            -- (bus bytes: n x (W - 1) a gather)
            saved = saved + n * (u.shard_size - 1) * #u.comm.all_gather
            amaxes = amaxes + #u.comm.all_gather
          end
        end
      end
      assert.equal(14, fp8_params)
      for _, a in ipairs(planner.audit(p)) do
        local want = a.fqn:find("_proj.weight$") and "fp8 gather" or ""
        assert.equal(want, table.concat(a.steps, ","))
      end
      assert.equal(base.comm.all_gather.bytes - saved, p.comm.all_gather.bytes)
      local x = p.comm.fp8_amax
      if precompute then
        -- one all-reduce of 14 f32 amaxes over 4 ranks: bus bytes 2 x 56 x 3 / 4
        assert.same({ count = 1, bytes = 84, precompute = true }, x)
      else
        -- one 4-byte all-reduce a gather: bus bytes 2 x 4 x 3 / 4
        assert.same({ count = amaxes, bytes = 6 * amaxes, precompute = false }, x)
      end
      assert.equal(base.comm.all_reduce.count + x.count, p.comm.all_reduce.count)
    end
  end)

  it("materialises the fp8 plan: the units gather the planned weights as e4m3 (torchao's cast, every rank), " ..
     "an amax all-reduce each, the all-gather the plan's bytes", function()
    for _, run in ipairs({ { "2" }, { "4" }, { "4", "hsdp" } }) do
      local r = S.run({ "-n", run[1], "tests/lua/scripts/recipe_units.lua", run[2] })
      assert(r.code == 0, r.out .. r.err)
      local oks = 0
      for _ in r.out:gmatch("recipe_units ok %d") do oks = oks + 1 end
      assert.equal(tonumber(run[1]), oks)
    end
  end)

  it("sets the policy's options from distributed, pipeline, moe and activation_checkpointing; --set overrides", function()
    local model = tree("llama3.1_8b")
    local r = recipe({ distributed = { activation_checkpointing = true, enable_fsdp2_prefetch = true,
      fsdp2_backward_prefetch_depth = 3, sequence_parallel = false, enable_compile = true } })
    local p = plan(model, "dp_shard=2", r, FSDP, { set = { "prefetch.backward=1" } })
    local opts = {}
    for _, o in ipairs(p.options) do opts[o.name] = o.value end
    assert.is_true(opts.activation_checkpointing)
    assert.is_true(opts["prefetch.explicit"])
    assert.equal(1, opts["prefetch.backward"])
    assert.equal(2, #p.checkpointed)
    S.assert_has(table.concat(p.recipe.notes, "; "), "distributed.enable_compile (compilation)")
    -- a field for an option the policy does not declare: an error unless at Automodel's default
    local msg = S.errmsg(plan, model, "dp_shard=2", recipe({ distributed = { bucket_cap_mb = 10 } }), FSDP)
    S.assert_has(msg, "distributed.bucket_cap_mb = 10 sets the option bucket_cap_mb, which the policy " ..
      "policies/fsdp2_default.lua does not declare (its options: activation_checkpointing, ")
    plan(model, "dp_shard=2", recipe({ distributed = { find_unused_parameters = false } }), FSDP)
    -- moe.reshard_after_forward is the expert-parallel path's
    local moe = tree("tiny_llama")
    p = plan(moe, "dp_shard=2", recipe({ moe = { reshard_after_forward = true } }), FSDP)
    for _, o in ipairs(p.options) do if o.name == "reshard_after_forward" then assert.is_nil(o.value) end end
  end)

  it("times a LoRA step without the frozen base's weight gradients", function()
    local model = tree("llama3.1_8b")
    local tokens = { seq_len = 4096 }
    local full = plan(model, "dp_shard=8", nil, FSDP, { tokens = tokens, device = "h100-80gb" })
    local lora = plan(model, "dp_shard=8", recipe({ peft = { dim = 16 } }), FSDP, { tokens = tokens, device = "h100-80gb" })
    -- a token's forward F over the base's matmuls (and attention a): full 3F + 3a, LoRA 2F + 3a
    -- + the adapters' 3 x 2 x 16 x (in + out), tiny
    local ratio = lora.time.compute_s / full.time.compute_s
    assert(ratio > 0.6 and ratio < 0.8, "LoRA compute / full compute " .. ratio)
    assert.is_true(lora.time.model_flops < full.time.model_flops)
  end)

  it("gathers fp8 weights as e4m3 under FSDP2 only, and lists what a plan does not use", function()
    local model = tree("llama3.1_8b")
    local r = recipe({ distributed = { strategy = "ddp" }, fp8 = { enabled = true, enable_fsdp_float8_all_gather = true,
      precompute_float8_dynamic_scale_for_fsdp = true } })
    local p = plan(model, "dp_shard=2", r, "policies/ddp.lua")
    assert.is_nil(p.comm.fp8_amax)
    for _, a in ipairs(planner.audit(p)) do assert.is_true(a.gathered ~= "f8e4m3") end
    local notes = table.concat(p.recipe.notes, "; ")
    S.assert_has(notes, "fp8.enable_fsdp_float8_all_gather (FSDP2's all-gather; the ddp manager's collectives move " ..
      "the parameter dtype)")
    S.assert_has(notes, "fp8.precompute_float8_dynamic_scale_for_fsdp (it goes with the tensorwise float8 all-gather")
    p = plan(model, "dp_shard=2", recipe({ fp8 = { enabled = true, recipe_name = "rowwise",
      enable_fsdp_float8_all_gather = true }, pipeline = { layers_per_stage = 2 } }), FSDP)
    notes = table.concat(p.recipe.notes, "; ")
    S.assert_has(notes, "fp8.enable_fsdp_float8_all_gather (the rowwise recipe gathers in the parameter dtype")
    S.assert_has(notes, "pipeline.layers_per_stage (pp = 1: no pipeline)")
    -- a 4-bit base under a policy that casts to f32: gathered as stored, with a warning
    p = plan(model, "dp_shard=2", recipe({ quantization = { load_in_4bit = true } }), "policies/full_fp32.lua")
    for _, a in ipairs(planner.audit(p)) do
      if a.fqn == "model.layers.0.self_attn.q_proj.weight" then assert.equal("bf16", a.gathered) end
    end
    S.assert_has(table.concat(p.warnings, "\n"), "14 4-bit weights stored as packed codes in bf16 sit in units whose " ..
      "mixed precision casts parameters to another dtype")
  end)

  it("checks its sizes against the mesh and its manager against the policy's units", function()
    local model = tree("tiny_llama")
    local msg = S.errmsg(plan, model, "dp_shard=2", recipe({ distributed = { dp_size = 4, tp_size = 2 } }), FSDP)
    S.assert_has(msg, "distributed.dp_size = 4 but the mesh has dp_replicate x dp_shard = 1 x 2 = 2; " ..
      "distributed.tp_size = 2 but the mesh has tp = 1")
    -- dp_size is replicate x shard, as Automodel's mesh makes it
    local r = recipe({ distributed = { dp_size = 8, dp_replicate_size = 2 } })
    assert.same({ dp_replicate = 2, dp_shard = 4 }, R.mesh_sizes(r))
    plan(model, "dp_replicate=2,dp_shard=4", r, FSDP)
    S.assert_has(S.errmsg(R.mesh_sizes, recipe({ distributed = { dp_size = 6, dp_replicate_size = 4 } })),
      "dp_size = 6 is not a multiple of dp_replicate_size = 4")
    S.assert_has(S.errmsg(R.mesh_sizes, recipe({ distributed = { dp_size = 4, dp_replicate_size = 4 } })),
      "dp_replicate_size = 4 must be less than dp_size = 4")
    msg = S.errmsg(plan, model, "dp_shard=2", recipe({ distributed = { strategy = "ddp" } }), FSDP)
    S.assert_has(msg, "the recipe test recipe asks for the ddp manager, but the policy policies/fsdp2_default.lua " ..
      "made fsdp2 units")
    local p = plan(model, "dp_shard=2", recipe({ distributed = { strategy = "ddp", bucket_cap_mb = 1 } }),
      "policies/ddp.lua")
    assert.equal("ddp", p.manager)
  end)
end)

describe("moonshard plan --recipe", function()
  it("plans with the manager's shipped policy and the recipe's mesh, and says what it needs", function()
    local path = write([[return { distributed = { strategy = "ddp", dp_size = 4 },
      peft = { target_modules = { "*.q_proj", "*.v_proj" }, dim = 8 } }]])
    local r = S.run({ "plan", "--config", "examples/configs/llama3.1_8b.json", "--recipe", path, "--json" })
    assert.equal(0, r.code, r.err)
    local j = json.decode(r.out)
    assert.equal("ddp", j.manager)
    assert.equal(4, j.mesh.world)
    assert.equal("peft", j.recipe.steps[1].name)
    assert.equal(64, #j.recipe.steps[1].changed)
    assert.equal(32 * 8 * ((4096 + 4096) + (4096 + 1024)), j.model.trainable_params)
    path = write([[return { distributed = { dp_size = "none" } }]])
    r = S.run({ "plan", "--config", "examples/configs/llama3.1_8b.json", "--recipe", path })
    assert.equal(1, r.code)
    S.assert_has(r.err, "distributed.dp_size is none; give --mesh")
    r = S.run({ "plan", "--config", "examples/configs/llama3.1_8b.json", "--mesh", "dp_shard=2" })
    assert.equal(2, r.code)
    S.assert_has(r.err, "--policy is required")
    r = S.run({ "plan", "--help" })
    S.assert_has(r.out, "--recipe FILE")
  end)

  it("plans every example recipe with the command its header gives", function()
    local files = {}
    local pipe = io.popen("ls examples/recipes/*.lua")
    for line in pipe:lines() do files[#files + 1] = line end
    pipe:close()
    assert.is_true(#files >= 10)
    for _, f in ipairs(files) do
      local args, on = {}, false
      for line in io.lines(f) do
        if line:find("^%-%-   moonshard plan") then on = true end
        if on then
          local body = line:gsub("^%-%-%s*", "")
          local cont = body:find("\\%s*$") ~= nil
          for w in body:gsub("\\%s*$", ""):gmatch("%S+") do args[#args + 1] = w end
          if not cont then break end
        end
      end
      -- (the trainer's recipe runs in trainer_lora_spec)
      if not S.read_file(f):find("build/moe_trainer", 1, true) then
        assert(#args > 2 and args[1] == "moonshard" and args[2] == "plan", f .. ": no `moonshard plan` command in its header")
        table.remove(args, 1)
        local r = S.run(args)
        assert(r.code == 0, f .. ": " .. r.err)
        S.assert_has(r.out, "recipe  " .. f .. ": ")
      end
    end
  end)

  it("takes a long command line (more arguments than the Lua stack's default room)", function()
    local args = { "plan" }
    for i = 1, 300 do args[#args + 1] = "--set" args[#args + 1] = "x" .. i .. "=1" end
    local r = S.run(args)
    assert.equal(2, r.code)
    S.assert_has(r.err, "give the model with exactly one of")
  end)
end)
