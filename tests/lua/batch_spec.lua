-- batch_spec.lua: the batch a plan counts traffic for (--seq-len, --micro-batch,
-- --global-batch; plan opts.tokens) and expert parallelism's token all_to_all, recomputed
-- here from the model's sizes.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local S = require "support"
local errmsg, assert_has = S.errmsg, S.assert_has

local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")
-- a small Mixtral: 3 MoE layers of 8 experts, 2 per token, hidden 32, bf16
local MIXTRAL = { architectures = { "MixtralForCausalLM" }, hidden_size = 32, intermediate_size = 48,
  num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 3, num_local_experts = 8,
  num_experts_per_tok = 2, vocab_size = 64, torch_dtype = "bfloat16" }

local function plan(mesh, tokens)
  return planner.plan(models.from_config(MIXTRAL, "mixtral"), mesh_context.new(mesh), FSDP2, { tokens = tokens })
end

describe("a plan's batch", function()
  it("makes a step of global / (micro x dp) micro-batches, dp = dp_replicate x dp_shard", function()
    local p = plan("dp_replicate=2,dp_shard=2,cp=2,ep=2", { seq_len = 128, micro_batch = 2, global_batch = 32 })
    assert.same({ seq_len = 128, micro_batch = 2, global_batch = 32, accumulation = 4, global_batch_default = false },
      p.tokens)
    -- (global_batch_default: the global batch was not given, B x dp taken)
    assert.same({ seq_len = 128, micro_batch = 1, global_batch = 4, accumulation = 1, global_batch_default = true },
      plan("dp_shard=4", { seq_len = 128 }).tokens)
    assert.is_nil(plan("dp_shard=4").tokens)
  end)

  it("counts expert parallelism's dispatch and combine, forward and backward, per MoE layer and micro-batch", function()
    local p = plan("dp_shard=4,ep=4", { seq_len = 100, micro_batch = 3, global_batch = 24 })
    -- per rank and micro-batch: 300 tokens x 2 experts x 32 hidden x 2 bytes sent, 3/4 of it off-rank
    local send = 300 * 2 * 32 * 2
    local per_call = send - math.ceil(send / 4)
    local calls = 4 * 3 * 2 -- 4 all_to_alls x 3 layers x 2 micro-batches
    assert.same({ count = calls, bytes = calls * per_call }, { count = p.comm.all_to_all.count, bytes = p.comm.all_to_all.bytes })
    for _, w in ipairs(p.warnings) do assert.is_nil(w:find("all_to_all counts none", 1, true), w) end
    -- context parallelism splits the sequence: half the tokens per rank
    local cp = plan("dp_shard=2,cp=2,ep=4", { seq_len = 100, micro_batch = 3, global_batch = 6 })
    local half = 150 * 2 * 32 * 2
    -- (and the cp ranks' key/value gradient exchanges, counted apart)
    assert.equal(4 * 3 * (half - math.ceil(half / 4)),
      cp.comm.all_to_all.bytes - cp.comm.context_parallel.backward.all_to_all.bytes)
    -- without a batch, nothing is counted and the plan says how to count it
    local none = plan("dp_shard=4,ep=4")
    assert.equal(0, none.comm.all_to_all.count)
    assert_has(table.concat(none.warnings, "\n"), "give the batch (--seq-len, --micro-batch, --global-batch) to count it")
  end)

  it("refuses a batch that does not split, naming the numbers", function()
    assert_has(errmsg(plan, "dp_shard=4", { seq_len = 128, micro_batch = 3, global_batch = 20 }),
      "tokens: global batch 20 is not a multiple of micro-batch 3 x data-parallel ranks 4 = 12")
    assert_has(errmsg(plan, "dp_shard=2,cp=2", { seq_len = 127 }),
      "tokens: sequence length 127 is not divisible by cp = 2")
    assert_has(errmsg(plan, "dp_shard=4", { seq_len = 0 }), "tokens: seq_len is 0; expected a whole number from 1")
    assert_has(errmsg(plan, "dp_shard=4", { seq_len = 8, microbatch = 2 }), "tokens: unknown key 'microbatch'")
  end)

  it("comes from the command line, and shows in the table and the JSON", function()
    local cfg = os.tmpname()
    S.write_file(cfg, json.encode(MIXTRAL))
    local base = { "plan", "--config", cfg, "--mesh", "dp_shard=4,ep=4", "--policy", "policies/fsdp2_default.lua" }
    local function run(...)
      local a = {}
      for _, x in ipairs(base) do a[#a + 1] = x end
      for _, x in ipairs({ ... }) do a[#a + 1] = x end
      return S.run(a)
    end
    local r = run("--seq-len", "100", "--micro-batch", "3", "--global-batch", "24")
    assert.equal(0, r.code, r.err)
    assert_has(r.out, "\nbatch   seq_len 100, micro-batch 3, global batch 24: 2 micro-batches a step on each " ..
      "data-parallel rank\n")
    r = run("--seq-len", "100", "--micro-batch", "3", "--global-batch", "24", "--json")
    local j = json.decode(r.out, "plan")
    assert.same({ seq_len = 100, micro_batch = 3, global_batch = 24, accumulation = 2 }, j.tokens)
    assert.equal(24, j.comm.per_step.all_to_all.count)
    r = run("--micro-batch", "3")
    assert.equal(2, r.code)
    assert_has(r.err, "--micro-batch, --global-batch and --cp-rotate go with --seq-len S")
    r = run("--seq-len", "1k")
    assert.equal(2, r.code)
    assert_has(r.err, "--seq-len is a whole number from 1 to 2^40, not '1k'")
    r = run("--seq-len", "0")
    assert.equal(2, r.code)
    r = run("--seq-len", "99999999999999999999")
    assert.equal(2, r.code)
    assert_has(r.err, "not '99999999999999999999'")
    os.remove(cfg)
  end)
end)

describe("FSDP's collectives over a step of several micro-batches", function()
  it("gathers every micro-batch again and reduces once a step; a pipeline stage gathers once", function()
    local one = plan("dp_shard=4", { seq_len = 32, micro_batch = 1, global_batch = 4 })
    local four = plan("dp_shard=4", { seq_len = 32, micro_batch = 1, global_batch = 16 })
    assert.equal(4, four.tokens.accumulation)
    assert.equal(4 * one.comm.all_gather.count, four.comm.all_gather.count)
    assert.equal(4 * one.comm.all_gather.bytes, four.comm.all_gather.bytes)
    assert.same(one.comm.reduce_scatter, four.comm.reduce_scatter)
    local none = plan("dp_shard=4")
    assert.equal(one.comm.all_gather.count, none.comm.all_gather.count)
  end)
end)

describe("context parallelism's key/value exchange", function()
  -- a Llama of 3 layers, 2 key/value heads of 8 (hidden 32 over 4 heads), bf16
  local LLAMA = { architectures = { "LlamaForCausalLM" }, hidden_size = 32, intermediate_size = 48,
    num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 3, vocab_size = 64,
    tie_word_embeddings = false, torch_dtype = "bfloat16" }
  local function llama_plan(mesh, tokens)
    return planner.plan(models.from_config(LLAMA, "llama"), mesh_context.new(mesh), FSDP2, { tokens = tokens })
  end
  -- per rank: 2 x 64 / cp tokens x (16 key + 16 value features)
  local function kv(cp, tp) return 2 * 64 / cp * 32 / (tp or 1) end

  it("allgather (Automodel's): one all-gather forward, again in backward, cp gradient exchanges in f32", function()
    local t = llama_plan("dp_shard=2,cp=4", { seq_len = 64, micro_batch = 2 }).comm.context_parallel
    assert.equal("allgather", t.rotate)
    assert.equal(3, t.layers)
    assert.same({ count = 3, bytes = 3 * kv(4) * 2 * 3 }, t.forward.all_gather)
    assert.same({ count = 0, bytes = 0 }, t.forward.all_to_all)
    assert.same(t.forward.all_gather, t.backward.all_gather)
    assert.same({ count = 3 * 4, bytes = 3 * 4 * kv(4) * 4 }, t.backward.all_to_all)
  end)

  it("alltoall: a ring of cp - 1 exchanges forward and backward; tp splits the heads", function()
    local p = llama_plan("dp_shard=2,cp=4,tp=2", { seq_len = 64, micro_batch = 2, global_batch = 8, cp_rotate = "alltoall" })
    local t = p.comm.context_parallel
    assert.same({ count = 3 * 3, bytes = 3 * 3 * kv(4, 2) * 2 }, t.forward.all_to_all)
    assert.same({ count = 3 * 3 + 3 * 4, bytes = 3 * 3 * kv(4, 2) * 2 + 3 * 4 * kv(4, 2) * 4 }, t.backward.all_to_all)
    assert.same({ count = 0, bytes = 0 }, t.backward.all_gather)
    -- a step: 2 micro-batches on each of the 2 data-parallel ranks
    assert.equal(2 * (9 + 21), p.comm.all_to_all.count)
  end)

  it("shows in the text and the JSON; without a batch says how to count it; refuses an unknown rotation", function()
    local text = report.to_text(llama_plan("dp_shard=2,cp=2"))
    assert_has(text, "context parallelism's keys and values over cp = 2: give the batch, --seq-len, to count them")
    local p = llama_plan("dp_shard=2,cp=2", { seq_len = 64 })
    assert_has(report.to_text(p), "of which context parallelism's keys and values over cp = 2 (allgather, 3 attention " ..
      "layers), per micro-batch: forward 3 all_gather")
    local j = json.decode(report.to_json(p), "plan JSON").comm.context_parallel
    assert.same({ count = 3, bytes = 3 * 2 * 64 / 2 * 32 }, j.per_micro_batch.forward.all_gather)
    assert.equal("allgather", j.rotate)
    assert_has(table.concat(llama_plan("dp_shard=2", { seq_len = 64, cp_rotate = "alltoall" }).warnings, "\n"),
      "cp_rotate alltoall has no effect: cp = 1")
    assert_has(errmsg(llama_plan, "dp_shard=2,cp=2", { seq_len = 64, cp_rotate = "ring" }),
      "cp_rotate is 'ring'; expected \"allgather\" or \"alltoall\"")
  end)
end)
