-- tp_spec.lua: tensor parallelism in the planner: ctx:tensor_parallel's rules (styles,
-- patterns, the checks NeMo Automodel makes), each parameter's placements and shapes with
-- FSDP2 on top, the shipped plans (policies/tp_plans.lua) as fsdp2_default applies them, and
-- the plan's text and JSON.  PyTorch's own placements and shapes for the same plans are held
-- by reference_layouts_spec (the llama_tp2_* cases).
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local util = require "moonshard.util"
local S = require "support"
local errmsg, assert_has = S.errmsg, S.assert_has

-- A small Llama: every split tp = 2 makes is even.
local LLAMA = { architectures = { "LlamaForCausalLM" }, vocab_size = 64, hidden_size = 16, intermediate_size = 24,
  num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, attention_bias = true,
  tie_word_embeddings = false, torch_dtype = "bfloat16" }
local function llama(over)
  local cfg = {}
  for k, v in pairs(LLAMA) do cfg[k] = v end
  for k, v in pairs(over or {}) do cfg[k] = v end
  return models.from_config(cfg, "tiny llama")
end

local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")

local function plan(model, mesh, pol, opts) return planner.plan(model, mesh_context.new(mesh), pol or FSDP2, opts) end

-- A policy of one function: parallelize(ctx), then the FSDP2 root unit.
local function with_tp(fn)
  return { parallelize = function(ctx)
    fn(ctx)
    ctx:fully_shard(ctx.model)
  end }
end

local function entries(p)
  local out = {}
  for _, u in ipairs(p.units) do
    for _, e in ipairs(u.entries) do out[e.fqn] = { unit = u, entry = e } end
  end
  return out
end

describe("ctx:tensor_parallel", function()
  it("places parameters as PyTorch's styles do: colwise Shard(0), rowwise weight Shard(1) and bias replicated, " ..
    "vocab-parallel embeddings Shard(0), sequence-parallel norms replicated", function()
    local p = plan(llama(), "dp_shard=2,tp=2", with_tp(function(ctx)
      ctx:tensor_parallel({ ["model.layers.*.self_attn.q_proj"] = "colwise",
        ["model.layers.*.self_attn.o_proj"] = "rowwise", ["model.embed_tokens"] = "vocab_parallel_embedding",
        ["model.layers.*.input_layernorm"] = "sequence_parallel", ["model.norm"] = "prepare_input" })
    end))
    local tp = p.tensor_parallel
    local dims = {}
    for param, t in pairs(tp.params) do dims[p.fqn_of[param]] = t.dim or "R" end
    assert.same({
      ["model.layers.0.self_attn.q_proj.weight"] = 0, ["model.layers.0.self_attn.q_proj.bias"] = 0,
      ["model.layers.1.self_attn.q_proj.weight"] = 0, ["model.layers.1.self_attn.q_proj.bias"] = 0,
      ["model.layers.0.self_attn.o_proj.weight"] = 1, ["model.layers.0.self_attn.o_proj.bias"] = "R",
      ["model.layers.1.self_attn.o_proj.weight"] = 1, ["model.layers.1.self_attn.o_proj.bias"] = "R",
      ["model.embed_tokens.weight"] = 0,
      ["model.layers.0.input_layernorm.weight"] = "R", ["model.layers.1.input_layernorm.weight"] = "R",
    }, dims)
    assert.equal(11, tp.count)
    assert.is_true(tp.sequence_parallel)
  end)

  it("gives FSDP the tp-local shape, with _StridedShard where both split dim 0", function()
    local p = plan(llama(), "dp_shard=2,tp=2", with_tp(function(ctx)
      ctx:tensor_parallel({ ["model.layers.*.self_attn.q_proj"] = "colwise", ["model.layers.*.self_attn.o_proj"] = "rowwise",
        ["model.layers.*.input_layernorm"] = "sequence_parallel" })
    end))
    local e = entries(p)
    local function check(fqn, shape, padded, placements, axes)
      local x = e[fqn]
      assert.same(shape, x.entry.shape, fqn)
      assert.same(padded, x.entry.padded, fqn)
      local pl, ax = planner.placements(p.mesh, p.tensor_parallel.params, x.unit, x.entry.param, x.entry.dim)
      assert.same(placements, pl, fqn)
      assert.same(axes, ax, fqn)
    end
    -- q_proj [16, 16]: tp rows 8, FSDP 4 of them per rank
    check("model.layers.0.self_attn.q_proj.weight", { 8, 16 }, { 4, 16 },
      { "_StridedShard(0, split_factor=2)", "Shard(0)" }, { "dp_shard", "tp" })
    check("model.layers.0.self_attn.o_proj.weight", { 16, 8 }, { 8, 8 }, { "Shard(0)", "Shard(1)" }, { "dp_shard", "tp" })
    check("model.layers.0.self_attn.o_proj.bias", { 16 }, { 8 }, { "Shard(0)", "Replicate()" }, { "dp_shard", "tp" })
    check("model.layers.0.input_layernorm.weight", { 16 }, { 8 }, { "Shard(0)", "Replicate()" }, { "dp_shard", "tp" })
    check("model.layers.0.post_attention_layernorm.weight", { 16 }, { 8 }, { "Shard(0)" }, { "dp_shard" })
    -- the bytes every rank holds: each parameter's tp-local shape, padded over dp_shard
    local want = 0
    for _, np in ipairs(p.params) do
      local t = p.tensor_parallel.params[np[2]]
      local shape = util.copy(np[2].shape)
      if t and t.dim then shape[t.dim + 1] = shape[t.dim + 1] / 2 end
      shape[1] = math.ceil(shape[1] / 2)
      local n = 1
      for _, s in ipairs(shape) do n = n * s end
      want = want + n * 2
    end
    assert.equal(want, p.memory.params)
  end)

  it("matches patterns a component at a time, as fnmatch, and records those that match nothing", function()
    local p = plan(llama(), "dp_shard=2,tp=2", with_tp(function(ctx)
      assert.equal(8, ctx:tensor_parallel({ ["model.layers.[01].self_attn.?_proj"] = "prepare_output",
        ["model.layers.*.self_attn.qkv_proj"] = "colwise" }))
    end))
    local text = report.to_text(p)
    assert_has(text, "tensor parallel tp=2: 0 parameters placed by 1 of 2 patterns (matching nothing: " ..
      "model.layers.*.self_attn.qkv_proj); the units below hold each tp rank's slice")
  end)

  it("refuses what PyTorch or Automodel refuse, and what it does not plan yet, by name", function()
    local function refused(model, mesh, plan_table)
      return errmsg(plan, model, mesh, with_tp(function(ctx) ctx:tensor_parallel(plan_table) end))
    end
    -- Automodel's validate_tp_mesh
    assert_has(refused(llama(), "tp=4", {}), "num_key_value_heads (2) must be divisible by TP size (4)")
    -- torch: ColwiseParallel currently only supports nn.Linear and nn.Embedding
    assert_has(refused(llama(), "tp=2", { ["model.norm"] = "colwise" }),
      "tensor_parallel: model.norm (pattern 'model.norm') is a RMSNorm; colwise shards nn.Linear and nn.Embedding only")
    assert_has(refused(llama(), "tp=2", { ["model.norm"] = "columnwise" }),
      "tensor_parallel: pattern 'model.norm': style 'columnwise'; expected one of colwise, ")
    assert_has(refused(llama(), "tp=2", { lm_head = { "colwise", output_layout = "Shard(-1)" } }),
      "tensor_parallel: pattern 'lm_head': unknown style key 'output_layout'")
    assert_has(refused(llama(), "tp=2", { lm_head = { "colwise", output_layouts = "Shard(x)" } }),
      "output_layouts holds 'Shard(x)'; expected \"Replicate()\" or \"Shard(d)\"")
    assert_has(refused(llama(), "tp=2", { ["model.layers.0.*"] = "prepare_input", ["model.layers.*.mlp"] = "prepare_input" }),
      "tensor_parallel: model.layers.0.mlp is matched by 'model.layers.*.mlp' and 'model.layers.0.*'")
    -- FSDP shards what tensor parallelism leaves: it must come first
    assert_has(errmsg(plan, llama(), "tp=2", { parallelize = function(ctx)
      ctx:fully_shard(ctx.model)
      ctx:tensor_parallel({ lm_head = "colwise" })
    end }), "tensor_parallel: unit <root> exists already; tensor parallelism comes before fully_shard")
  end)

  it("splits a dim tp does not divide as torch.chunk does, each rank's memory from its own piece", function()
    local p = plan(llama({ vocab_size = 65 }), "dp_shard=2,tp=2", with_tp(function(ctx)
      ctx:tensor_parallel({ lm_head = "colwise" })
    end))
    assert_has(table.concat(p.warnings, "\n"), "tensor parallelism splits 1 parameter unevenly (lm_head.weight dim 0: " ..
      "65 over 2): PyTorch accepts it (torch.chunk")
    -- lm_head [65, 16]: tp pieces of 33 and 32 rows, FSDP halves 17/16 and 16/16 of them
    local want = { [0] = { 17, 16 }, { 16, 16 }, { 16, 16 }, { 16, 16 } } -- rank = 2 x dp + tp
    local mem = p.memory.per_rank
    for r = 0, 3 do
      local view = report.rank_view(p, r)
      for _, vp in ipairs(view.params) do
        if vp.fqn == "lm_head.weight" then assert.same(want[r], vp.local_shape, "rank " .. r) end
      end
    end
    -- the padded pieces: 17 rows on tp rank 0, 16 on tp rank 1, so the params differ by 16 x 2 bytes
    assert.equal(mem[1].params - 32, mem[2].params)
    assert.equal(mem[3].params - 32, mem[4].params)
    assert.equal(mem[1].params, p.memory.params)
  end)

  it("does nothing on a tp of one rank, as Automodel", function()
    local p = plan(llama(), "dp_shard=2", with_tp(function(ctx)
      assert.equal(0, ctx:tensor_parallel({ lm_head = "colwise" }))
    end))
    assert.is_nil(p.tensor_parallel)
    assert.is_nil(json.decode(report.to_json(p), "plan").tensor_parallel)
  end)
end)

describe("fsdp2_default under tensor parallelism", function()
  it("applies Automodel's plan for the architecture before any unit, and its sequence-parallel variant", function()
    local p = plan(llama(), "dp_shard=2,tp=2")
    local tp = p.tensor_parallel
    assert.is_false(tp.sequence_parallel)
    local styles = {}
    for _, r in ipairs(tp.plan) do styles[r.pattern] = r.style .. "/" .. r.modules end
    assert.same({ lm_head = "colwise/1", ["model.embed_tokens"] = "rowwise/1",
      ["model.layers.*.self_attn.q_proj"] = "colwise/2", ["model.layers.*.self_attn.k_proj"] = "colwise/2",
      ["model.layers.*.self_attn.v_proj"] = "colwise/2", ["model.layers.*.self_attn.qkv_proj"] = "colwise/0",
      ["model.layers.*.self_attn.o_proj"] = "rowwise/2", ["model.layers.*.mlp.gate_proj"] = "colwise/2",
      ["model.layers.*.mlp.up_proj"] = "colwise/2", ["model.layers.*.mlp.gate_up_proj"] = "colwise/0",
      ["model.layers.*.mlp.down_proj"] = "rowwise/2" }, styles)
    local sp = plan(llama(), "dp_shard=2,tp=2", nil, { set = { "sequence_parallel=true" } }).tensor_parallel
    assert.is_true(sp.sequence_parallel)
    assert.equal(tp.count + 5, sp.count) -- the four layer norms and the final one, replicated
    -- Qwen takes its own (the embedding as VocabParallelEmbedding), Mistral the default base plan
    local qwen = plan(llama({ architectures = { "Qwen3ForCausalLM" }, head_dim = 4 }), "tp=2").tensor_parallel
    local mistral = plan(llama({ architectures = { "MistralForCausalLM" } }), "tp=2").tensor_parallel
    local function style_of(t, pattern)
      for _, r in ipairs(t.plan) do if r.pattern == pattern then return r.style end end
    end
    assert.equal("vocab_parallel_embedding", style_of(qwen, "model.embed_tokens"))
    assert.equal("vocab_parallel_embedding", style_of(mistral, "model.embed_tokens"))
  end)

  it("on the expert-parallel path, takes no plan it was not given and no sequence parallel (Automodel's MoE " ..
    "parallelizer)", function()
    local mixtral = models.from_config({ architectures = { "MixtralForCausalLM" }, hidden_size = 16,
      intermediate_size = 24, num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 2,
      num_local_experts = 4, num_experts_per_tok = 2, vocab_size = 64, torch_dtype = "bfloat16" }, "mixtral")
    assert_has(errmsg(plan, mixtral, "dp_shard=2,tp=2,ep=2"),
      "No safe tensor-parallel plan is registered for custom MoE model 'MixtralForCausalLM' at tp_size=2")
    assert_has(errmsg(plan, mixtral, "dp_shard=2,tp=2,ep=2", nil, { set = { "tp_plan=default", "sequence_parallel=true" } }),
      "sequence_parallel is not supported by the MoE tensor-parallel path")
    local p = plan(mixtral, "dp_shard=2,tp=2,ep=2", nil, { set = { "tp_plan=default" } })
    assert.is_true(p.tensor_parallel.count > 0)
    assert.is_true(#p.owned > 0) -- the experts: expert parallelism's, not tensor parallelism's
  end)

  it("shows the plan in the table and the JSON", function()
    local p = plan(llama(), "dp_shard=2,tp=2")
    assert_has(report.to_text(p), "tensor parallel tp=2: 24 parameters placed by 9 of 11 patterns (matching nothing: " ..
      "model.layers.*.mlp.gate_up_proj, model.layers.*.self_attn.qkv_proj)")
    local j = json.decode(report.to_json(p), "plan")
    assert.same({ size = 2, sequence_parallel = false, params = 24 },
      { size = j.tensor_parallel.size, sequence_parallel = j.tensor_parallel.sequence_parallel,
        params = j.tensor_parallel.params })
    local q
    for _, u in ipairs(j.units) do
      for _, e in ipairs(u.params) do if e.fqn == "model.layers.1.self_attn.q_proj.weight" then q = e end end
    end
    assert.same({ 8, 16 }, q.shape)
    assert.same({ "_StridedShard(0, split_factor=2)", "Shard(0)" }, q.placements)
    assert.same({ "dp_shard", "tp" }, q.placement_axes)
    assert.same({ style = "colwise", module = "model.layers.1.self_attn.q_proj", placement = "Shard(0)",
      global_shape = { 16, 16 } }, q.tp)
  end)
end)

describe("tensor_parallel patterns", function()
  it("cost a policy no more than the names times the pattern, however many stars it holds", function()
    local p = plan(llama(), "tp=2", with_tp(function(ctx)
      -- a backtracking matcher (Lua patterns) would take ~6^40 steps on "q_proj"; this one ~6 x 80
      assert.equal(0, ctx:tensor_parallel({ ["model.layers.*.self_attn." .. string.rep("*a", 40) .. "b"] = "colwise" }))
      assert.equal(2, ctx:tensor_parallel({ ["model.layers.*.self_attn.[!qkv]_proj"] = "rowwise" }))
    end))
    assert.equal(4, p.tensor_parallel.count) -- o_proj's weight and bias, in both layers
  end)
end)

describe("moonshard plan --rank", function()
  local cfg = "tests/reference/configs/llama_tp_tiny.json"
  local base = { "plan", "--config", cfg, "--mesh", "dp_shard=3,tp=2", "--policy", "policies/fsdp2_default.lua" }
  local function args(...)
    local a = {}
    for _, x in ipairs(base) do a[#a + 1] = x end
    for _, x in ipairs({ ... }) do a[#a + 1] = x end
    return a
  end

  it("shows one rank's coordinates, and each parameter's piece of it, in the table and the JSON", function()
    local r = S.run(args("--rank", "5"))
    assert.equal(0, r.code, r.err)
    assert_has(r.out, "\nrank 5: pp=0, dp_replicate=0, dp_shard=2, cp=0, tp=1\n")
    -- q_proj [20, 20]: tp rank 1 holds rows 10..19, FSDP coordinate 2 the last 2 of them
    assert.matches("\n  model%.layers%.0%.self_attn%.q_proj%.weight +%[2, 20%] +_StridedShard%(0, split_factor=2%) " ..
      "dp_shard, Shard%(0%) tp; unit model%.layers%.0\n", r.out)
    r = S.run(args("--rank", "5", "--json"))
    assert.equal(0, r.code, r.err)
    local view = json.decode(r.out, "plan").rank_view
    assert.equal(5, view.rank)
    assert.same({ pp = 0, dp_replicate = 0, dp_shard = 2, cp = 0, tp = 1 }, view.coords)
    assert.same({ local_shape = { 6, 10 }, padded_shard_shape = { 7, 10 }, placements = { "Shard(0)", "Shard(1)" },
      placement_axes = { "dp_shard", "tp" }, unit = "model.layers.1", gather_dtype = "bf16", reduce_dtype = "f32" },
      view.params["model.layers.1.self_attn.o_proj.weight"])
  end)

  it("refuses a rank outside the world, or no rank at all", function()
    local r = S.run(args("--rank", "6"))
    assert.equal(2, r.code)
    assert_has(r.err, "moonshard plan: --rank 6: the mesh dp_shard=3,tp=2 has 6 ranks (0 to 5)")
    r = S.run(args("--rank", "-1"))
    assert.equal(2, r.code)
    assert_has(r.err, "--rank is a rank, a whole number from 0, not '-1'")
  end)
end)

describe("a tensor-parallel plan made real on ranks", function()
  it("gives each rank's units its own tp piece, uneven ones included: held bytes = planned, on every rank", function()
    local code = [[
      local ms = require "moonshard"
      local tree = require("moonshard.models").from_config({ architectures = { "LlamaForCausalLM" },
        vocab_size = 5, hidden_size = 16, intermediate_size = 3, num_hidden_layers = 1, num_attention_heads = 8,
        num_key_value_heads = 8, head_dim = 2, mlp_bias = true, attention_bias = true }, "micro")
      local P = require "moonshard.policy"
      local entry = P.entry_point(P.load("policies/fsdp2_default.lua", { modules = P.host_modules() }), "fsdp2")
      local plan = require("moonshard.plan").plan(tree, require("moonshard.mesh_context").new("dp_shard=2,tp=4"),
        entry, {})
      local state = require("moonshard.runtime").materialize(plan)
      local held, planned = state:bytes().params, plan.memory.per_rank[ms.rank() + 1].params
      assert(held == planned, string.format("rank %d holds %d bytes, planned %d", ms.rank(), held, planned))
      io.write(string.format("%d:%d ", ms.rank(), held))
    ]]
    local r = S.run_code(8, code)
    assert.equal(0, r.code, r.err)
    -- vocab 5 and intermediate 3 over tp = 4: the tp ranks hold unequal pieces
    local sizes = {}
    for rank, bytes in r.out:gmatch("(%d+):(%d+)") do sizes[tonumber(rank)] = tonumber(bytes) end
    assert.is_true(sizes[0] > sizes[3], r.out)
    assert.equal(sizes[0], sizes[4]) -- the same tp coordinate on the other dp_shard coordinate
  end)
end)
