-- tp_comm_spec.lua: tensor parallelism's activation collectives, as the plan counts them
-- (moonshard.plan_comm.tp_traffic), against what PyTorch issued for the same shipped plans on
-- real transformers models (tests/reference/tp_comm.py, torch 2.15 and transformers 5.24 on a
-- fake process group: tests/reference/data/tp_comm.json): per micro-batch, forward and
-- backward, each kind's count and bus bytes.  Then the rules the reference does not reach:
-- activation checkpointing's recompute, the batch, pipelines, the per-step sums, the text
-- and the JSON.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local util = require "moonshard.util"
local S = require "support"
local assert_has = S.assert_has

local DATA = "tests/reference/data/tp_comm.json"
local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")
local KINDS = { "all_reduce", "all_gather", "reduce_scatter" }

local function load_config(path)
  return models.from_config(json.decode(assert(util.read_file(path, "json")), path), path)
end

local function tp_plan(model, mesh, set, tokens)
  return planner.plan(model, mesh_context.new(mesh), FSDP2, { set = set, tokens = tokens })
end

-- bus bytes of one collective whose whole buffer is S bytes over n ranks (nccl-tests)
local function bus(kind, S, n)
  local b = math.floor(S * (n - 1) / n)
  return kind == "all_reduce" and 2 * b or b
end

-- the reference's collectives of one phase, summed by kind
local function measured(case, phase)
  local out = {}
  for _, k in ipairs(KINDS) do out[k] = { count = 0, bytes = 0 } end
  for _, c in ipairs(case.collectives) do
    if c.phase == phase and out[c.kind] then
      out[c.kind].count = out[c.kind].count + 1
      out[c.kind].bytes = out[c.kind].bytes + bus(c.kind, c.bytes, case.tp)
    end
  end
  return out
end

describe("tensor parallelism's activation collectives against PyTorch", function()
  local ref = json.decode(assert(util.read_file(DATA, "json")), DATA)
  local names = util.sorted_keys(ref.cases)
  it("the reference holds every case", function()
    assert.same({ "llama_tp2", "llama_tp2_sp", "mistral_default_tp2", "mistral_default_tp2_sp",
      "mistral_llama_plan_tp4_sp", "qwen3_tp2", "qwen3_tp2_sp" }, names)
  end)
  for _, name in ipairs(names) do
    it(name, function()
      local case = ref.cases[name]
      local p = tp_plan(load_config(case.config), "tp=" .. case.tp,
        { "tp_plan=" .. case.plan, "sequence_parallel=" .. tostring(case.sequence_parallel) },
        { seq_len = case.seq_len, micro_batch = case.micro_batch })
      local t = assert(p.comm.tensor_parallel, "the plan counts tensor parallelism's activations")
      local fwd, bwd = measured(case, "forward"), measured(case, "backward")
      local function pairs_of(m, planned)
        local q = {}
        for _, k in ipairs(KINDS) do q[#q + 1] = string.format("%s %d/%d", k, m[k].count, planned[k].count) end
        return table.concat(q, " ")
      end
      io.stderr:write(string.format("tp_comm %s: forward %s; backward %s (measured by torch / planned)\n", name,
        pairs_of(fwd, t.forward), pairs_of(bwd, t.backward)))
      assert.same(fwd, t.forward)
      if name == "mistral_default_tp2_sp" then
        -- plain SequenceParallel norms: DTensor's operators redistribute inside each norm's
        -- backward too, 1 reduce-scatter and 7 all-gathers of the layer's activations (or of
        -- their f32 form, or of the norm's weight) per decoder layer; the plan says it does
        -- not count them
        local L = 2
        assert.equal(bwd.all_reduce.count, t.backward.all_reduce.count)
        assert.equal(bwd.reduce_scatter.count, t.backward.reduce_scatter.count + L)
        assert.equal(bwd.all_gather.count, t.backward.all_gather.count + 7 * L)
        assert_has(table.concat(t.notes, "; "), "plain SequenceParallel norms' backward")
      else
        assert.same(bwd, t.backward)
      end
    end)
  end
end)

local LLAMA = { architectures = { "LlamaForCausalLM" }, vocab_size = 64, hidden_size = 16, intermediate_size = 24,
  num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 4, tie_word_embeddings = false,
  torch_dtype = "bfloat16" }

describe("tensor parallelism's activations in the plan", function()
  local function llama() return models.from_config(LLAMA, "tiny llama") end
  local TOK = { seq_len = 32, micro_batch = 2 }
  local A = 2 * 32 * 16 * 2 -- one activation: tokens x hidden x bf16

  it("counts a Llama layer's collectives by hand: 2 all-reduces forward, 5 backward", function()
    local t = tp_plan(llama(), "tp=4", nil, TOK).comm.tensor_parallel
    -- embedding, then o_proj and down_proj per layer; q, k, v, gate, up per layer and the head
    assert.same({ count = 1 + 2 * 4, bytes = (1 + 2 * 4) * 2 * A * 3 / 4 }, t.forward.all_reduce)
    assert.same({ count = 5 * 4 + 1, bytes = (5 * 4 + 1) * 2 * A * 3 / 4 }, t.backward.all_reduce)
    assert.same({ count = 0, bytes = 0 }, t.norm_grads)
  end)

  it("sequence parallel: gathers and scatters, and the norms' Partial gradients once a step", function()
    local t = tp_plan(llama(), "tp=2", { "sequence_parallel=true" }, TOK).comm.tensor_parallel
    assert.same({ count = 2 * 4 + 1, bytes = (2 * 4 + 1) * A / 2 }, t.forward.all_gather)
    assert.same({ count = 2 * 4 + 1, bytes = (2 * 4 + 1) * A / 2 }, t.forward.reduce_scatter)
    assert.same(t.forward.all_gather, t.backward.reduce_scatter)
    assert.same(t.forward.reduce_scatter, t.backward.all_gather)
    -- two norms per layer and the final norm, 16 weights each, reduced in f32
    assert.same({ count = 2 * 4 + 1, bytes = (2 * 4 + 1) * 2 * (16 * 4) / 2 }, t.norm_grads)
  end)

  it("activation checkpointing runs each layer's forward collectives again in backward", function()
    local plain = tp_plan(llama(), "tp=2", nil, TOK).comm.tensor_parallel
    local ac = tp_plan(llama(), "tp=2", { "activation_checkpointing=true" }, TOK).comm.tensor_parallel
    assert.same(plain.forward, ac.forward)
    -- 2 all-reduces per layer again (the embedding is outside the layers)
    assert.equal(plain.backward.all_reduce.count + 2 * 4, ac.backward.all_reduce.count)
  end)

  it("a step is the micro-batches' collectives, added to the per-step lines", function()
    local one = tp_plan(llama(), "dp_shard=2,tp=2", nil, TOK)
    local four = tp_plan(llama(), "dp_shard=2,tp=2", nil,
      { seq_len = 32, micro_batch = 2, global_batch = 16 })
    local t = four.comm.tensor_parallel
    local per_mb = t.forward.all_reduce.count + t.backward.all_reduce.count
    assert.equal(4, four.tokens.accumulation)
    assert.equal(one.comm.all_reduce.count + 3 * per_mb, four.comm.all_reduce.count)
  end)

  it("under a pipeline, rank 0 counts its own stages' modules", function()
    local whole = tp_plan(llama(), "tp=2", nil, TOK).comm.tensor_parallel
    local pp = tp_plan(llama(), "pp=2,tp=2", nil, { seq_len = 32, micro_batch = 2, global_batch = 4 })
    local t = pp.comm.tensor_parallel
    -- stage 0: the embedding and layers 0 and 1
    assert.equal(1 + 2 * 2, t.forward.all_reduce.count)
    assert.equal(5 * 2, t.backward.all_reduce.count)
    assert.is_true(t.forward.all_reduce.count < whole.forward.all_reduce.count)
  end)

  it("without a batch, the text says what is left out; with one, the JSON and text show it", function()
    local text = report.to_text(tp_plan(llama(), "tp=2"))
    assert_has(text, "tensor parallelism's activations over tp = 2: give the batch, --seq-len, to count them")
    local p = tp_plan(llama(), "tp=2", { "sequence_parallel=true" }, TOK)
    text = report.to_text(p)
    assert_has(text, "of which tensor parallelism's activations over tp = 2, per micro-batch: forward 9 all_gather")
    assert_has(text, "the all_reduce of 9 sequence-parallel norm gradients")
    local j = json.decode(report.to_json(p), "plan JSON")
    local tj = j.comm.tensor_parallel
    assert.equal(2, tj.size)
    assert.same({ count = 9, bytes = 9 * A / 2 }, tj.per_micro_batch.forward.all_gather)
    assert.equal(9, tj.norm_grads.count)
    assert_has(table.concat(tj.notes, "; "), "the loss")
  end)
end)
