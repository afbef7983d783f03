-- pipeline_spec.lua: pipelines in plans: ctx:pipeline's split of a model into stages (the
-- rules themselves are held to Automodel and PyTorch by pp_rules_spec), units within a stage,
-- memory per rank from its own stages, the micro-batches each rank keeps, the sends between
-- stages, fsdp2_default under pp > 1, and the refusals.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local S = require "support"
local errmsg, assert_has = S.errmsg, S.assert_has

local LLAMA = { architectures = { "LlamaForCausalLM" }, vocab_size = 64, hidden_size = 16, intermediate_size = 24,
  num_hidden_layers = 5, num_attention_heads = 4, num_key_value_heads = 2, tie_word_embeddings = false,
  torch_dtype = "bfloat16" }
local function llama(over)
  local cfg = {}
  for k, v in pairs(LLAMA) do cfg[k] = v end
  for k, v in pairs(over or {}) do cfg[k] = v end
  return models.from_config(cfg, "llama")
end
local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")
local function plan(model, mesh, pol, opts) return planner.plan(model, mesh_context.new(mesh), pol or FSDP2, opts) end

describe("a pipeline in a plan", function()
  it("splits the layers as Automodel does, the embeddings first, the norm and head last", function()
    local p = plan(llama(), "pp=2,dp_shard=2")
    local pl = p.pipeline
    assert.equal("1F1B", pl.schedule)
    local got = {}
    for i, s in ipairs(pl.stages) do got[i] = { s.pp_rank, s.layers.first, s.layers.count, table.concat(s.modules, " ") } end
    -- 5 layers over 2 stages: 3 and 2, the remainder to the first
    assert.same({ { 0, 0, 3, "model.embed_tokens model.layers.0 model.layers.1 model.layers.2" },
      { 1, 3, 2, "model.layers.3 model.layers.4 model.norm lm_head" } }, got)
    for _, u in ipairs(p.units) do
      local name = u.name
      local layer = tonumber(name:match("^model%.layers%.(%d+)$"))
      if layer then assert.equal(layer < 3 and 0 or 1, u.stage, name) end
    end
  end)

  it("gives each rank the memory of its own stages", function()
    local p = plan(llama(), "pp=2,dp_shard=2")
    -- every rank holds its stage's parameters, halved by dp_shard (padded per parameter)
    local function stage_bytes(modules)
      local bytes = 0
      for _, name in ipairs(modules) do
        for _, np in ipairs(p.params) do
          local fqn = np[1]
          if fqn == name or fqn:sub(1, #name + 1) == name .. "." then
            local shape = np[2].shape
            local rows = math.ceil(shape[1] / 2)
            local n = rows
            for i = 2, #shape do n = n * shape[i] end
            bytes = bytes + n * 2
          end
        end
      end
      return bytes
    end
    local per = p.memory.per_rank
    for r = 0, 3 do
      local stage = p.pipeline.stages[r < 2 and 1 or 2]
      assert.equal(stage_bytes(stage.modules), per[r + 1].params, "rank " .. r)
    end
    assert.is_true(per[1].params ~= per[3].params)
  end)

  it("counts the micro-batches each rank keeps and what it sends, given a batch", function()
    local p = plan(llama(), "pp=2,dp_shard=2", nil, { tokens = { seq_len = 32, micro_batch = 2, global_batch = 16 } })
    local pl = p.pipeline
    assert.equal(4, pl.microbatches)
    assert.same({ 2, 1 }, pl.in_flight) -- 1F1B: min(n, pp - r)
    -- rank 0 sends each micro-batch's activations to stage 1: 2 x 32 tokens x 16 hidden, bf16
    assert.same({ count = 4, bytes = 4 * 2 * 32 * 16 * 2 }, p.comm.send_recv)
    local j = json.decode(report.to_json(p), "plan")
    assert.equal("1F1B", j.pipeline.schedule)
    assert.same({ 0, 1 }, j.pipeline.stages[1].ranks)
    assert.equal(4, j.comm.per_step.send_recv.count)
    assert.equal(0, j.units[1].stage)
    -- the picture: each layer's stage, each rank's own memory bar, the sends
    local svg = require("moonshard.plan_svg").render(p)
    assert_has(svg, ">layer 0 · stage 0<")
    assert_has(svg, ">layer 4 · stage 1<")
    assert_has(svg, "send_recv 4 x 8.0 KiB")
    local widths = {}
    for y, w in svg:gmatch('<rect x="[%d.]+" y="(%d+)" width="([%d.]+)" height="18" fill="#4a7fc1"/>') do
      widths[#widths + 1] = tonumber(w)
    end
    assert.equal(4, #widths) -- a params bar per rank
    assert.is_true(widths[1] ~= widths[3], "ranks of different stages draw different bars")
    -- a schedule whose micro-batch count the batch breaks is PyTorch's refusal
    assert_has(errmsg(plan, llama(), "pp=2,dp_shard=2", nil, { tokens = { seq_len = 32, global_batch = 2 } }),
      "pipeline: Number of microbatches (1) must be greater than or equal to the number of stages (2).")
    -- without a global batch, the message says how to give one (not with one given, above)
    local bare = errmsg(plan, llama(), "pp=2,dp_shard=2", nil, { tokens = { seq_len = 32 } })
    assert_has(bare, "(the batch gives 1 micro-batches a step; without a global batch (--global-batch) a step is " ..
      "one micro-batch of 1 per data-parallel rank: give one that makes enough micro-batches)")
    assert.is_nil(errmsg(plan, llama(), "pp=2,dp_shard=2", nil, { tokens = { seq_len = 32, global_batch = 2 } })
      :find("without a global batch", 1, true))
    local zbv = plan(llama({ num_hidden_layers = 8 }), "pp=2,dp_shard=2", nil,
      { set = { "pipeline.schedule=ZBVZeroBubble" }, tokens = { seq_len = 32, global_batch = 8 } })
    assert.same({ 0, 1, 1, 0 }, { zbv.pipeline.stages[1].pp_rank, zbv.pipeline.stages[2].pp_rank,
      zbv.pipeline.stages[3].pp_rank, zbv.pipeline.stages[4].pp_rank })
  end)

  it("refuses what Automodel refuses, and what it does not plan yet, by name", function()
    local function policy_of(fn) return { parallelize = fn } end
    assert_has(errmsg(plan, llama({ tie_word_embeddings = true }), "pp=2"),
      "pipeline: the head is tied to the embeddings")
    assert_has(errmsg(plan, llama(), "pp=2", policy_of(function(ctx)
      ctx:fully_shard(ctx.model:get("model.layers.0"))
      ctx:pipeline{}
    end)), "pipeline: unit model.layers.0 exists already; the pipeline split comes first")
    assert_has(errmsg(plan, llama(), "pp=2", policy_of(function(ctx)
      ctx:pipeline{}
      ctx:fully_shard(ctx.model)
    end)), "fully_shard(<root>): the module spans the pipeline's stages; give {stage = i}")
    assert_has(errmsg(plan, llama(), "pp=2", policy_of(function(ctx)
      ctx:pipeline{}
      ctx:fully_shard(ctx.model:get("model.layers.4"), { stage = 0 })
    end)), "fully_shard(model.layers.4): the module is in stage 1, not 0")
    assert_has(errmsg(plan, llama(), "pp=2", policy_of(function(ctx) ctx:pipeline{ schedule = "zero_bubble" } end)),
      "Unknown schedule name 'zero_bubble'")
    assert_has(errmsg(plan, llama(), "pp=2", policy_of(function(ctx) ctx:pipeline{ stages = 4 } end)),
      "pipeline: unknown option 'stages'")
    assert_has(errmsg(plan, llama(), "pp=2", nil, { set = { "pipeline.layers_per_stage=2" } }),
      "Number of virtual stages (3) must be divisible by pipeline parallel size (2)")
  end)
end)

describe("fsdp2_default: a pipeline on the expert-parallel path", function()
  local function mixtral(layers)
    return models.from_config({ architectures = { "MixtralForCausalLM" }, hidden_size = 16, intermediate_size = 24,
      num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = layers, num_local_experts = 4,
      num_experts_per_tok = 2, vocab_size = 64, torch_dtype = "bfloat16", tie_word_embeddings = false }, "mixtral")
  end

  it("runs the MoE parallelizer on each stage's part: its layers' experts and layers, embed or head, its root", function()
    local p = plan(mixtral(3), "pp=2,dp_shard=4,ep=2")
    local got = {}
    for _, u in ipairs(p.units) do got[#got + 1] = string.format("%s@%d:%s", u.name, u.stage, table.concat(u.mesh_axes, ",")) end
    -- 3 layers over 2 stages: 2 and 1 (Automodel's split); ep_shard = 4 / 2 = 2
    assert.same({
      "model.layers.0.block_sparse_moe.experts@0:ep_shard", "model.layers.0@0:dp_shard",
      "model.layers.1.block_sparse_moe.experts@0:ep_shard", "model.layers.1@0:dp_shard",
      "model.embed_tokens@0:dp_shard", "model@0:dp_shard", "@0:dp_shard",
      "model.layers.2.block_sparse_moe.experts@1:ep_shard", "model.layers.2@1:dp_shard",
      "lm_head@1:dp_shard", "model@1:dp_shard", "@1:dp_shard" }, got)
    for _, u in ipairs(p.units) do assert.is_false(u.reshard, u.name) end
    -- each stage's expert tensors are expert parallelism's: rank 0 (stage 0) holds 2 layers' worth
    local owned = 0
    for _, x in ipairs(p.owned) do owned = owned + 1 end
    assert.equal(3 * 2, owned) -- gate_and_up and down of 3 layers
  end)

  it("memory per rank is its stage's: the pp coordinates differ by what their stages hold", function()
    local p = plan(mixtral(3), "pp=2,dp_shard=4,ep=2")
    local stage0, stage1 = p.memory.per_rank[1], p.memory.per_rank[5] -- ranks 0 and 4: pp 0 and 1
    assert.is_true(stage0.params ~= stage1.params)
    -- every split here is even, so a rank holds a quarter of its stage's parameters either
    -- way: experts 2 of 4 over ep, halved over ep_shard; the rest a quarter over dp_shard;
    -- the dense path's pipeline (ep = 1) holds the same bytes per rank
    local dense = plan(mixtral(3), "pp=2,dp_shard=4")
    for r = 1, 8 do assert.equal(dense.memory.per_rank[r].params, p.memory.per_rank[r].params) end
    -- stage 0: embedding 64 x 16, 2 layers; stage 1: 1 layer, norm 16, head 64 x 16; in bf16
    local function layer_params(m) return m:get("model.layers.0"):param_count() end
    local m = mixtral(3)
    assert.equal((64 * 16 + 2 * layer_params(m)) * 2 / 4, stage0.params)
    assert.equal((layer_params(m) + 16 + 64 * 16) * 2 / 4, stage1.params)
  end)

  it("counts the token all_to_all of the MoE layers in rank 0's stages, and the sends between stages", function()
    local p = plan(mixtral(3), "pp=2,dp_shard=4,ep=2", nil, { tokens = { seq_len = 16, micro_batch = 1, global_batch = 8 } })
    -- 2 micro-batches a step; 2 MoE layers in stage 0; 4 all_to_alls each
    assert.equal(4 * 2 * 2, p.comm.all_to_all.count)
    assert.equal(2 * 1 * 16 * 16 * 2, p.comm.send_recv.bytes) -- 2 activations sent, 16 tokens x 16 hidden x bf16
  end)

  it("takes an explicit tensor-parallel plan under a pipeline, as the MoE path does without one", function()
    assert_has(errmsg(plan, mixtral(2), "pp=2,dp_shard=2,tp=2,ep=2"), "No safe tensor-parallel plan is registered")
    local p = plan(mixtral(2), "pp=2,dp_shard=2,tp=2,ep=2", nil, { set = { "tp_plan=default" } })
    assert.equal(2, p.tensor_parallel.size)
  end)
end)

describe("a balanced pipeline split", function()
  local pp_rules = require "moonshard.plan_pp"

  -- every way to cut L layers into S non-empty contiguous stages, by brute force
  local function brute(S, costs, first, last)
    local L, best, best_split = #costs, nil, nil
    local function go(s, start, acc, parts)
      if s == S then
        local c = last + (s == 1 and first or 0)
        for i = start + 1, L do c = c + costs[i] end
        local m = math.max(acc, c)
        if not best or m < best then
          best = m
          best_split = {}
          for i, p in ipairs(parts) do best_split[i] = p end
          best_split[s] = { first = start, count = L - start }
        end
        return
      end
      for stop = start + 1, L - (S - s) do
        local c = (s == 1 and first or 0)
        for i = start + 1, stop do c = c + costs[i] end
        parts[s] = { first = start, count = stop - start }
        go(s + 1, stop, math.max(acc, c), parts)
      end
    end
    go(1, 0, 0, {})
    return best, best_split
  end
  local function max_cost(split, costs, first, last)
    local m = 0
    for k, part in ipairs(split) do
      local c = (k == 1 and first or 0) + (k == #split and last or 0)
      for i = part.first + 1, part.first + part.count do c = c + costs[i] end
      m = math.max(m, c)
    end
    return m
  end

  it("is the least costly stage's split of all, checked by brute force over 300 random cases", function()
    local seed = 12345
    local function rand(n) -- a small LCG, the same in both interpreters
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed % n
    end
    for _ = 1, 300 do
      local L = 1 + rand(9)
      local S = 1 + rand(L)
      local costs = {}
      for i = 1, L do costs[i] = 1 + rand(20) end
      local first, last = rand(30), rand(30)
      local split = pp_rules.balanced_split(S, costs, first, last)
      local want = brute(S, costs, first, last)
      assert.equal(S, #split)
      local covered = 0
      for k, part in ipairs(split) do
        assert.equal(covered, part.first)
        assert.is_true(part.count >= 1)
        covered = covered + part.count
      end
      assert.equal(L, covered)
      assert.equal(want, max_cost(split, costs, first, last))
    end
  end)

  it("gives ties to the earlier stages, as Automodel gives them the remainder", function()
    assert.same({ { first = 0, count = 3 }, { first = 3, count = 2 } }, pp_rules.balanced_split(2, { 1, 1, 1, 1, 1 }, 0, 0))
    assert_has(errmsg(pp_rules.balanced_split, 4, { 1, 1, 1 }, 0, 0), "Number of stages (4) cannot exceed number of layers (3)")
  end)

  it("weighs a layer by its forward FLOPs a token, the head too, the embedding not; or by parameters", function()
    local m = llama({ num_hidden_layers = 8, vocab_size = 512 })
    local layer = m:get("model.layers.0")
    -- q 16x16, k and v 8x16 (2 kv heads of 4), o 16x16; gate, up 24x16, down 16x24
    local matmul = 16 * 16 + 8 * 16 + 8 * 16 + 16 * 16 + 3 * 24 * 16
    assert.equal(2 * matmul, pp_rules.module_cost(layer, "compute"))
    assert.equal(matmul + 2 * 16, pp_rules.module_cost(layer, "memory")) -- and the two norms
    assert.equal(0, pp_rules.module_cost(m:get("model.embed_tokens"), "compute"))
    assert.equal(2 * 512 * 16, pp_rules.module_cost(m:get("lm_head"), "compute"))
    -- 8 layers on 4 stages; the head costs 16384 / 3840 = 4.3 layers: balanced gives the last
    -- stage 1 layer, Automodel's 2, and spreads the other 7 as evenly as they go
    local p = plan(m, "pp=4", nil, { set = { "pipeline.split=compute" } })
    local counts = {}
    for i, s in ipairs(p.pipeline.stages) do counts[i] = s.layers.count end
    assert.same({ 3, 2, 2, 1 }, counts)
    assert.equal("compute", p.pipeline.split)
    assert.equal(2 * matmul * 2 + 2 * 512 * 16, p.pipeline.automodel_max)
    assert.equal(math.max(3 * 2 * matmul, 2 * matmul + 2 * 512 * 16), p.pipeline.max_cost)
    local text = report.to_text(p)
    assert_has(text, "split balanced by compute, the embeddings and head weighed in")
    local j = json.decode(report.to_json(p), "plan JSON").pipeline
    assert.equal("compute", j.split)
    assert.equal(p.pipeline.max_cost, j.stages[4].cost) -- the head's stage is the bottleneck
    assert.equal(3 * 2 * matmul, j.stages[1].cost)
    -- by memory the 512 x 16 embedding and head weigh in at both ends
    local mem = plan(m, "pp=4", nil, { set = { "pipeline.split=memory" } })
    counts = {}
    for i, s in ipairs(mem.pipeline.stages) do counts[i] = s.layers.count end
    assert.same({ 1, 3, 3, 1 }, counts)
    -- Automodel's split says what balancing would give
    assert_has(report.to_text(plan(m, "pp=4")), "balanced (pipeline split \"compute\") it would be")
  end)

  it("refuses an unknown split, naming the choices", function()
    assert_has(errmsg(plan, llama(), "pp=2", { parallelize = function(ctx)
      ctx:pipeline{ split = "even" }
    end }), "pipeline: split is 'even'; expected \"automodel\"")
  end)
end)

describe("a mesh with pp > 1 and a policy without a pipeline", function()
  it("is planned as it is, with a warning that every pp rank holds the whole model; tp likewise", function()
    local plain = { parallelize = function(ctx) ctx:fully_shard(ctx.model) end }
    local p = plan(llama(), "pp=2,dp_shard=2", plain)
    assert_has(table.concat(p.warnings, "\n"), "pp = 2 but the policy split the model into no pipeline stages " ..
      "(ctx:pipeline): every pp rank holds the whole model")
    local t = plan(llama(), "dp_shard=2,tp=2", plain)
    assert_has(table.concat(t.warnings, "\n"), "tp = 2 but the policy placed no parameter by tensor parallelism")
    for _, w in ipairs(plan(llama(), "pp=2,dp_shard=2").warnings) do
      assert.is_nil(w:find("no pipeline stages", 1, true), w)
    end
  end)
end)

describe("fsdp2_default: tensor parallelism with activation checkpointing under a pipeline", function()
  it("applies the plan to the layers as named before the wrappers, as Automodel applies TP before AC", function()
    local plain = plan(llama(), "pp=2,dp_shard=2,tp=2")
    local ac = plan(llama(), "pp=2,dp_shard=2,tp=2", nil, { set = { "activation_checkpointing=true" } })
    assert.equal(plain.tensor_parallel.count, ac.tensor_parallel.count)
    assert.is_true(ac.tensor_parallel.count > 0)
    for r = 1, 8 do assert.equal(plain.memory.per_rank[r].params, ac.memory.per_rank[r].params) end
    assert.is_true(#ac.checkpointed > 0)
    local moe = models.from_config({ architectures = { "MixtralForCausalLM" }, hidden_size = 16, intermediate_size = 24,
      num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 2, num_local_experts = 4,
      num_experts_per_tok = 2, vocab_size = 64, torch_dtype = "bfloat16", tie_word_embeddings = false }, "mixtral")
    local m = plan(moe, "pp=2,dp_shard=2,tp=2,ep=2", nil, { set = { "tp_plan=default", "activation_checkpointing=true" } })
    local m0 = plan(models.from_config({ architectures = { "MixtralForCausalLM" }, hidden_size = 16,
      intermediate_size = 24, num_attention_heads = 4, num_key_value_heads = 2, num_hidden_layers = 2,
      num_local_experts = 4, num_experts_per_tok = 2, vocab_size = 64, torch_dtype = "bfloat16",
      tie_word_embeddings = false }, "mixtral"), "pp=2,dp_shard=2,tp=2,ep=2", nil, { set = { "tp_plan=default" } })
    assert.equal(m0.tensor_parallel.count, m.tensor_parallel.count)
  end)
end)

describe("--rank under a pipeline", function()
  it("shows the rank's own stages and only their parameters", function()
    local p = plan(llama(), "pp=2,dp_shard=2")
    local view = report.rank_view(p, 3) -- pp 1
    assert.same({ 1 }, view.stages)
    local stage1 = {}
    for _, name in ipairs(p.pipeline.stages[2].modules) do stage1[#stage1 + 1] = name end
    local n = 0
    for _, x in ipairs(view.params) do
      local ok = false
      for _, name in ipairs(stage1) do ok = ok or x.fqn:sub(1, #name + 1) == name .. "." end
      assert.is_true(ok, x.fqn)
      n = n + 1
    end
    -- every parameter is in exactly one stage: the two views cover the model once
    assert.equal(#p.params, n + #report.rank_view(p, 0).params)
    assert_has(report.rank_text(p, view), "pipeline stage 1 (their parameters only)")
    local j = json.decode(report.rank_json(view), "rank view")
    assert.same({ 1 }, j.stages)
  end)
end)
