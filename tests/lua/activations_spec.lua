-- activations_spec.lua: the activation memory of a plan (moonshard.plan_activations) against
-- what PyTorch eager keeps for backward on transformers models (tests/reference/activations.py:
-- torch 2.15, transformers 5.24, bf16, sdpa, saved tensors counted by storage, parameters
-- excluded: tests/reference/data/activations.json), with and without full activation
-- checkpointing, and the recompute of one checkpointed layer; then the rules the reference
-- does not reach, computed by hand: tensor and sequence parallelism, context parallelism, a
-- pipeline's micro-batches, every k-th layer checkpointed, the plan without a batch, the
-- table and the JSON.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local util = require "moonshard.util"
local S = require "support"
local assert_has = S.assert_has

local DATA = "tests/reference/data/activations.json"
local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")
local LLAMA = "tests/reference/configs/act_llama.json"

local function load_config(path)
  return models.from_config(json.decode(assert(util.read_file(path, "json")), path), path)
end

local function plan_of(model, mesh, set, tokens, pol)
  return planner.plan(model, mesh_context.new(mesh), pol or FSDP2, { set = set, tokens = tokens })
end

-- transformers builds DeepSeek-V3's router weight in f32 and computes the router in f32
-- (DeepseekV3TopkRouter.forward upcasts its input); the builder follows Automodel (the model's
-- dtype).  The reference's model is planned as transformers has it: the gate weights f32, each
-- gate a unit of its own without mixed precision, so that it computes in f32.
local function transformers_deepseek(model, ac)
  for _, np in ipairs(model:named_parameters()) do
    if np[1]:find("mlp%.gate%.weight$") then np[2].dtype = "f32" end
  end
  return { parallelize = function(ctx)
    if ac then ctx:checkpoint_wrap("model.layers") end
    for _, nm in ipairs(ctx.model:named_modules()) do
      if nm[1]:find("mlp%.gate$") then ctx:fully_shard(nm[2]) end
    end
    ctx:fully_shard(ctx.model)
  end }
end

describe("activation memory against PyTorch", function()
  local ref = json.decode(assert(util.read_file(DATA, "json")), DATA)
  it("the reference holds every family, with and without checkpointing", function()
    local seen = {}
    for _, c in ipairs(ref.cases) do seen[c.name:match("^(.-)_b%d") .. "/" .. c.checkpointing] = true end
    for _, f in ipairs({ "llama", "qwen3", "gemma3", "mistral", "qwen3_moe", "mixtral", "deepseek_v3" }) do
      assert.is_true(seen[f .. "/none"], f)
      assert.is_true(seen[f .. "/full"], f)
    end
  end)
  for _, c in ipairs(ref.cases) do
    it(c.name, function()
      local model = load_config(c.config)
      local ac = c.checkpointing == "full"
      local pol, set = nil, { "activation_checkpointing=" .. tostring(ac) }
      if c.config:find("deepseek") then pol, set = transformers_deepseek(model, ac), nil end
      local p = plan_of(model, "dp_shard=2", set, { seq_len = c.seq_len, micro_batch = c.micro_batch }, pol)
      local got = p.memory.per_rank[1].activations
      local ratio = got / c.saved
      local line = string.format("%-24s plan %9d  PyTorch %9d  ratio %.4f", c.name, got, c.saved, ratio)
      if ac then
        local rec, want = 0, 0
        for _, k in ipairs(p.activations.layers) do rec = math.max(rec, k.recompute) end
        for _, r in ipairs(c.recompute) do want = math.max(want, r) end
        line = line .. string.format("  recompute plan %d PyTorch %d ratio %.4f", rec, want, rec / want)
        assert.is_true(math.abs(rec / want - 1) <= 0.05, line)
        assert.is_true(p.memory.per_rank[1].transient >= rec, line)
      end
      print(line)
      assert.is_true(math.abs(ratio - 1) <= 0.05, line)
      assert.equal(ac and "full" or "none", p.activations.checkpointing)
    end)
  end
end)

-- act_llama.json by hand: hidden 128, intermediate 352, 8 heads of 16, 2 kv heads, vocab 160,
-- 3 layers, bf16
local H, I, HEADS, KV, HD, V, L = 128, 352, 8, 2, 16, 160, 3
local function norm(rows) return rows * (4 * H + 4 + 2 * H) end
local function layer(T, tp, sp)
  return 2 * norm(T / sp) + 2 * (2 * H * T) -- two norms, attention's and the MLP's inputs
    + T * 2 * (HEADS * HD + 2 * KV * HD + HEADS * HD) / tp + T * 4 * HEADS / tp -- q, k, v, output, lse
    + 4 * T * 2 * I / tp
end
local function rest(B, Sq, T, tp, sp)
  return 8 * T + 2 * Sq * HD * 2 + norm(T / sp) + 2 * H * T + 4 * T * V / tp + 8 * (B == 1 and Sq + 1 or T) + 4
end

describe("activation memory: the rules", function()
  -- checkpoint wrapping changes the tree: every plan gets a model of its own
  local llama = function() return load_config(LLAMA) end
  local batch = { seq_len = 64, micro_batch = 2 }
  it("no parallelism: the layers and the rest, as counted by hand", function()
    local p = plan_of(llama(), "dp_shard=2", nil, batch)
    assert.equal(L * layer(128, 1, 1) + rest(2, 64, 128, 1, 1), p.memory.activations)
    assert.equal(128, p.activations.tokens_per_rank)
    -- the transient: the logits (bf16) and two f32 tensors their size in the loss's backward
    assert.equal(128 * V * (2 + 8), p.memory.transient)
  end)
  it("tensor parallelism divides what colwise modules produce; sequence parallelism the norms", function()
    local p = plan_of(llama(), "tp=2", { "sequence_parallel=false" }, batch)
    assert.equal(L * layer(128, 2, 1) + rest(2, 64, 128, 2, 1), p.memory.activations)
    local q = plan_of(llama(), "tp=2", { "sequence_parallel=true" }, batch)
    assert.equal(L * layer(128, 2, 2) + rest(2, 64, 128, 2, 2), q.memory.activations)
    for _, r in ipairs(q.memory.per_rank) do assert.equal(q.memory.activations, r.activations) end
  end)
  it("context parallelism divides the tokens and the positions", function()
    local p = plan_of(llama(), "cp=2,dp_shard=2", nil, batch)
    assert.equal(64, p.activations.tokens_per_rank)
    assert.equal(L * layer(64, 1, 1) + 8 * 64 + 2 * 32 * HD * 2 + norm(64) + 2 * H * 64 + 4 * 64 * V + 8 * 64 + 4,
      p.memory.activations)
  end)
  it("full checkpointing keeps each layer's input and the position ids; the recompute is one layer", function()
    local p = plan_of(llama(), "dp_shard=2", { "activation_checkpointing=true" }, batch)
    assert.equal(L * 2 * H * 128 + 8 * 64 + rest(2, 64, 128, 1, 1), p.memory.activations)
    assert.equal("full", p.activations.checkpointing)
    assert.equal(layer(128, 1, 1), p.activations.layers[1].recompute)
    assert.equal(math.max(layer(128, 1, 1), 128 * V * 10), p.memory.transient)
  end)
  it("every k-th layer: those layers keep their input, the others everything", function()
    local p = plan_of(llama(), "dp_shard=2", { "activation_checkpointing=every:2" }, batch)
    assert.equal((L - 1) * layer(128, 1, 1) + 2 * H * 128 + 8 * 64 + rest(2, 64, 128, 1, 1), p.memory.activations)
    assert.equal("layers", p.activations.checkpointing)
  end)
  it("a module checkpointed inside a layer keeps its input; the layer's recompute is that module's", function()
    local p = plan_of(llama(), "dp_shard=2", nil, batch, { parallelize = function(ctx)
      for i = 0, L - 1 do ctx:checkpoint_wrap("model.layers." .. i, { only = { 1 } }) end -- the mlp
      ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "bf16" } })
    end })
    local mlp = 2 * H * 128 + 4 * 128 * 2 * I
    assert.equal(L * (layer(128, 1, 1) - mlp + 2 * H * 128) + 8 * 64 + rest(2, 64, 128, 1, 1), p.memory.activations)
    assert.equal("modules", p.activations.checkpointing)
    assert.equal(mlp, p.activations.layers[1].recompute)
  end)
  it("a pipeline keeps its schedule's micro-batches of its own stages", function()
    local p = plan_of(llama(), "pp=3", nil, { seq_len = 64, micro_batch = 2, global_batch = 12 })
    -- 1F1B on 3 ranks, 6 micro-batches: pp rank r keeps 3 - r; one layer a stage
    local per = p.activations.per_pp
    local first = layer(128, 1, 1) + 8 * 128 + 2 * 64 * HD * 2
    local last = layer(128, 1, 1) + 2 * 64 * HD * 2 + rest(2, 64, 128, 1, 1) - 8 * 128 - 2 * 64 * HD * 2
    local want = { [0] = 3 * first, 2 * (layer(128, 1, 1) + 2 * 64 * HD * 2), last }
    for _, r in ipairs(p.memory.per_rank) do
      local pp = p.mesh:coord("pp", r.rank)
      assert.equal(want[pp], r.activations, "rank " .. r.rank)
    end
    assert.equal(3, per[0].in_flight)
    assert.equal(128 * V * 10, p.memory.per_rank[3].transient)
    assert.equal(0, p.memory.per_rank[1].transient)
  end)
  it("without a batch nothing is counted, and the table says so; totals do not change", function()
    local p = plan_of(llama(), "dp_shard=2", nil, nil)
    assert.is_nil(p.memory.activations)
    assert.is_nil(p.activations)
    assert_has(report.to_text(p), "activations: not counted (give the batch, --seq-len")
    assert.is_truthy(report.to_json(p):find('"activations":null,"transient":null', 1, true))
    local q = plan_of(llama(), "dp_shard=2", nil, batch)
    assert.equal(p.memory.total, q.memory.total)
  end)
  it("the table and the JSON show the breakdown", function()
    local p = plan_of(llama(), "dp_shard=2", { "activation_checkpointing=every:2" }, batch)
    local text = report.to_text(p)
    assert_has(text, "activations (rank 0): ")
    assert_has(text, "checkpointing layers")
    assert_has(text, "1 x LlamaDecoderLayer (checkpointed: layer)")
    local j = json.decode(report.to_json(p))
    assert.equal(p.memory.activations, j.memory.per_rank[1].activations)
    assert.equal(p.memory.transient, j.memory.per_rank[1].transient)
    assert.equal(128, j.activations.tokens_per_rank)
    assert.equal(2, #j.activations.layers)
    assert.equal("model.layers.1", j.activations.layers[2].layers[1])
    assert.equal(p.memory.activations, j.activations.per_pp_rank[1].activations)
  end)
end)
