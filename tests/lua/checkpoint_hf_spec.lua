-- checkpoint_hf_spec.lua: Hugging Face checkpoints (tests/reference/hf_checkpoints.py: written
-- by transformers' save_pretrained) loaded into materialised plans on 1, 2 and 4 thread ranks,
-- every rank's shards compared bit for bit with the tensors read whole in plain Lua
-- (tests/lua/scripts/checkpoint_hf.lua), the bytes each rank read, dtype conversion against
-- torch's cast, and the error lists (tests/lua/scripts/checkpoint_hf_errors.lua).
local S = require "support"

local D = "tests/reference/data/hf_checkpoints/"
local LLAMA, QWEN = D .. "llama_tiny", D .. "qwen3_moe_tiny"

local function load(n, config, mesh, ckpt, dtype, ref, policy, set)
  local r = S.run({ "-n", tostring(n), "tests/lua/scripts/checkpoint_hf.lua", config, mesh, ckpt, dtype or "", ref or "",
    policy or "", set or "" })
  assert.equal("", r.err)
  assert.equal(0, r.code)
  local ranks = {}
  for rank, params, max_diff, read, data in r.out:gmatch(
    "rank (%d+): ok (%d+) params, %d+ elements, max diff (%S+), read (%d+) of (%d+) bytes") do
    ranks[tonumber(rank)] = { params = tonumber(params), max_diff = tonumber(max_diff), read = tonumber(read),
      data = tonumber(data) }
  end
  local count = 0
  for _, v in pairs(ranks) do
    count = count + 1
    assert.equal(0, v.max_diff)
  end
  assert.equal(n, count)
  local total = tonumber(r.out:match("total read (%d+) bytes"))
  return ranks, total, r.out
end

-- checkpoint_hf_errors.lua on 2 ranks with the cases given, in a scratch directory
local function errors(config, ckpt, ...)
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. dir)
  local r = S.run({ "-n", "2", "tests/lua/scripts/checkpoint_hf_errors.lua", config, ckpt, dir, ... })
  os.execute("rm -rf " .. dir)
  assert.equal("", r.err)
  assert.equal(0, r.code)
  return r
end

describe("moonshard.checkpoint_hf", function()
  -- FSDP on 1, 2 and 4 ranks (shards on dim 0): every byte read once, by one rank.
  for _, n in ipairs({ 1, 2, 4 }) do
    it("loads a tied f32 Llama (a directory) under FSDP on " .. n .. " ranks, reading each byte once", function()
      local ranks, total = load(n, LLAMA .. "/config.json", "dp_shard=" .. n, LLAMA)
      assert.equal(44608, total)
      for _, v in pairs(ranks) do
        assert.equal(26, v.params) -- lm_head.weight tied: one parameter, read once
        if n > 1 then assert.is_true(v.read < v.data) end
      end
    end)
    it("loads a sharded bf16 Qwen3-MoE (its index) under FSDP on " .. n .. " ranks, per-expert into grouped", function()
      local ranks, total = load(n, QWEN .. "/config.json", "dp_shard=" .. n, QWEN .. "/model.safetensors.index.json")
      assert.equal(17368, total)
      for _, v in pairs(ranks) do
        if n > 1 then assert.is_true(v.read <= v.data / n + 1024) end
      end
    end)
  end

  it("loads HSDP (dp_replicate=2, dp_shard=2): each replica reads the checkpoint once", function()
    local ranks, total = load(4, QWEN .. "/config.json", "dp_replicate=2,dp_shard=2", QWEN)
    assert.equal(2 * 17368, total)
    for _, v in pairs(ranks) do assert.equal(17368 / 2, v.read) end
  end)

  it("loads expert parallelism: ep=2 (each rank its two experts), ep=4, and ep=2 over ep_shard=2", function()
    local ranks, total = load(2, QWEN .. "/config.json", "dp_shard=2,ep=2", QWEN)
    assert.equal(17368, total)
    for _, v in pairs(ranks) do assert.equal(8684, v.read) end
    local _, total4 = load(4, QWEN .. "/config.json", "dp_shard=4,ep=4", QWEN)
    assert.equal(17368, total4)
    -- experts sharded on dim 1 over ep_shard: the transposed reads cover a little more
    local ranks2 = load(4, QWEN .. "/config.json", "dp_shard=4,ep=2", QWEN)
    for _, v in pairs(ranks2) do assert.is_true(v.read < v.data / 2) end
  end)

  it("loads tensor-parallel plans (tp=2, tp=2 over dp_shard=2): each rank its tp piece's rows, lm_head's 67 split 34 + 33", function()
    for _, case in ipairs({ { 2, "tp=2" }, { 4, "tp=2,dp_shard=2" } }) do
      local ranks, _, out = load(case[1], LLAMA .. "/config.json", case[2], LLAMA)
      local elements = 0
      for _, v in pairs(ranks) do assert.equal(26, v.params) end
      for e in out:gmatch("params, (%d+) elements") do elements = elements + tonumber(e) end
      -- every element of the 11,152 once per replica of what tp leaves whole (the norms, and
      -- what the plan does not split), so at least the model's count
      assert.is_true(elements >= 11152, case[2] .. ": " .. elements)
    end
  end)

  it("loads Megatron-FSDP buckets: the whole parameter under ZeRO-0..2, each rank its flat piece under ZeRO-3", function()
    for _, strategy in ipairs({ "no_shard", "optim", "optim_grads", "optim_grads_params" }) do
      local ranks, total = load(2, LLAMA .. "/config.json", "dp_shard=2", LLAMA, nil, nil, "policies/megatron_fsdp.lua",
        "zero_dp_strategy=" .. strategy)
      for _, v in pairs(ranks) do assert.equal(26, v.params) end
      -- ZeRO-3: every byte once, by the rank whose piece holds it; else every rank all of them
      assert.equal(strategy == "optim_grads_params" and 44608 or 2 * 44608, total)
    end
  end)

  it("converts dtypes as the plan stores them: f32 into bf16 units as torch casts, bf16 into f32", function()
    -- the reference is torch's .to(torch.bfloat16) of every tensor
    load(2, LLAMA .. "/config.json", "dp_shard=2", LLAMA, "bfloat16", D .. "llama_tiny_bf16.safetensors")
    load(4, LLAMA .. "/config.json", "dp_replicate=2,dp_shard=2", LLAMA .. "/model.safetensors", "bfloat16",
      D .. "llama_tiny_bf16.safetensors")
    load(2, QWEN .. "/config.json", "dp_shard=2,ep=2", QWEN, "float32")
    for _, strategy in ipairs({ "optim", "optim_grads_params" }) do
      load(2, LLAMA .. "/config.json", "dp_shard=2", LLAMA, "bfloat16", D .. "llama_tiny_bf16.safetensors",
        "policies/megatron_fsdp.lua", "zero_dp_strategy=" .. strategy .. " preserve_fp32_weights=true")
    end
  end)

  it("names every missing, unexpected and mis-shaped tensor before writing anything", function()
    local r = errors(QWEN .. "/config.json", QWEN .. "/model.safetensors.index.json",
      "drop:model.norm.weight+drop:model.layers.1.mlp.experts.3.up_proj.weight+add:extra.weight:2x2" ..
      "+add:model.layers.0.mlp.bias:4+shape:model.layers.1.mlp.experts.1.down_proj.weight:20x13" ..
      "+shape:lm_head.weight:51x20",
      "drop:model.layers.1.mlp.experts.2.gate_proj.weight")
    local case1 = r.out:match("case 1: ([^\n]*)")
    assert.matches("the checkpoint does not fit the plan%. 2 missing: " ..
      "model%.layers%.1%.mlp%.experts%.3%.up_proj%.weight; model%.norm%.weight%. 2 mis%-shaped: lm_head%.weight: %[51, 20%] in the " ..
      "checkpoint, %[50, 20%] planned; model%.layers%.1%.mlp%.experts%.1%.down_proj%.weight: %[20, 13%] in the " ..
      "checkpoint, %[20, 12%] for model%.layers%.1%.mlp%.experts%.down_projs %[4, 12, 20%]%. 2 unexpected: " ..
      "extra%.weight; model%.layers%.0%.mlp%.bias%. Nothing was loaded", case1)
    assert.matches("case 2: .*1 missing: model%.layers%.1%.mlp%.experts%.2%.gate_proj%.weight%. Nothing", r.out)
    assert.matches("rank 0: units untouched true", r.out)
    assert.matches("rank 1: units untouched true", r.out)
  end)

  it("errors leave the units as they were", function()
    local r = errors(LLAMA .. "/config.json", LLAMA .. "/model.safetensors", "drop:model.norm.weight",
      "shape:model.embed_tokens.weight:66x24", "add:lm_head.weight:67x24+add:stray:1")
    assert.matches("case 1: .*1 missing: model%.norm%.weight%. Nothing", r.out)
    assert.matches("case 2: .*1 mis%-shaped: model%.embed_tokens%.weight: %[66, 24%] in the checkpoint, %[67, 24%] planned",
      r.out)
    -- the tied name is no surprise; a stray tensor is
    assert.matches("case 3: .*1 unexpected: stray%. Nothing", r.out)
    assert.matches("rank 0: units untouched true", r.out)
    assert.matches("rank 1: units untouched true", r.out)
  end)
end)
