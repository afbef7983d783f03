-- time_spec.lua: device profiles (moonshard.devices) and the step-time estimate
-- (moonshard.plan_time): every rule against figures computed here by hand from the tiny test
-- models' configs, profile validation by message, and the plan's output (table, JSON).
local json = require "moonshard.json"
local models = require "moonshard.models"
local mesh_context = require "moonshard.mesh_context"
local policy = require "moonshard.policy"
local planner = require "moonshard.plan"
local devices = require "moonshard.devices"
local T = require "moonshard.plan_time"
local S = require "support"

local function config(name)
  local path = "tests/reference/configs/" .. name .. ".json"
  return models.from_config(json.decode(S.read_file(path), path), path)
end
local DEFAULT = policy.entry_point(policy.load("policies/fsdp2_default.lua", { modules = policy.host_modules() }),
  "policies/fsdp2_default.lua")

-- a profile of round figures: every time below is checked against them
local function profile(over)
  local p = { name = "round", memory_bytes = 1000000, bf16_flops = 2e6, fp32_flops = 1e6, hbm_bytes_per_s = 1e9,
    gpus_per_node = 4, intra_node_bytes_per_s = 1e6, inter_node_bytes_per_s = 1e5, intra_node_latency_s = 1e-3,
    inter_node_latency_s = 1e-2, cuda_context_bytes = 1000, nccl_buffer_bytes = 2000, fragmentation = 0.1 }
  for k, v in pairs(over or {}) do p[k] = v end
  return p
end

local function plan(name, mesh, opts)
  opts = opts or {}
  opts.device = opts.device or profile()
  return planner.plan(config(name), mesh_context.new(mesh), DEFAULT, opts)
end

local function near(want, got, what)
  assert(math.abs(want - got) <= 1e-9 * math.max(1, math.abs(want)), string.format("%s: want %.17g, got %.17g",
    what or "value", want, got))
end

-- llama_tiny: hidden 24, 4 heads of 6, 2 key/value heads, MLP 40, 2 layers, vocab 67, its
-- head tied to the embedding (the logits are still a 67x24 matmul), stored in f32 and
-- computed in bf16 (fsdp2_default's mixed precision).  A layer's weights: q 24x24, k 12x24,
-- v 12x24, o 24x24, gate, up 40x24, down 24x40 = 4608 elements; attention a token: seq_len x
-- (24 query + 24 output features).
local LLAMA_MATMUL = 2 * (2 * (576 + 288 + 288 + 576 + 3 * 960) + 67 * 24)
local function llama_attention(S_) return 2 * S_ * (24 + 24) end

describe("the FLOPs of a step", function()
  it("counts 2 x the weights a token meets and causal attention's own", function()
    local p = plan("llama_tiny", { dp_shard = 1 }, { tokens = { seq_len = 16 } })
    -- model FLOPs: 3 x forward (backward twice the forward), the global batch's tokens
    near(3 * (LLAMA_MATMUL + llama_attention(16)) * 1 * 16, p.time.model_flops, "model FLOPs")
  end)

  it("counts only the experts a token is routed to (top_k of them)", function()
    -- qwen3_moe_tiny: hidden 20, 2 heads of 6 (1 key/value head), layer 0 dense (MLP 36),
    -- layer 1 4 experts of 12, top 2, a router 4x20; lm_head 50x20
    local attn = 12 * 20 + 6 * 20 + 6 * 20 + 20 * 12
    local dense = attn + 3 * 36 * 20
    local moe = attn + 4 * 20 + (4 * 20 * 24 + 4 * 12 * 20) * 2 / 4
    local per_token = 2 * (dense + moe + 50 * 20) + 2 * 8 * (12 + 12)
    local p = plan("qwen3_moe_tiny", { dp_shard = 2, ep = 2 }, { tokens = { seq_len = 8 } })
    near(3 * per_token * 2 * 8, p.time.model_flops, "model FLOPs")
  end)

  it("runs the checkpointed layers' forward again in backward, and times compute at peak x efficiency", function()
    local S_, G = 16, 4
    local fwd = LLAMA_MATMUL + llama_attention(S_)
    local base = plan("llama_tiny", { dp_shard = 1 }, { tokens = { seq_len = S_, global_batch = G }, efficiency = 0.25 })
    -- bf16 compute at bf16_flops (2e6) x 0.25
    near(G * S_ * 3 * fwd / (2e6 * 0.25), base.time.compute_s, "compute")
    local ckpt = plan("llama_tiny", { dp_shard = 1 }, { tokens = { seq_len = S_, global_batch = G }, efficiency = 0.25,
      set = { "activation_checkpointing=true" } })
    -- the layers' forward again: all but the head, which no wrapper holds
    near(G * S_ * (3 * fwd + fwd - 2 * 67 * 24) / (2e6 * 0.25), ckpt.time.compute_s, "compute with recompute")
    -- the policy's f32 compute (full_fp32) runs at fp32_flops (1e6)
    local f32 = planner.plan(config("llama_tiny"), mesh_context.new({ dp_shard = 1 }),
      policy.entry_point(policy.load("policies/full_fp32.lua", { modules = policy.host_modules() }), "full_fp32"),
      { tokens = { seq_len = S_, global_batch = G }, efficiency = 0.25, device = profile() })
    near(G * S_ * 3 * fwd / (1e6 * 0.25), f32.time.compute_s, "f32 compute")
    -- MFU counts no recompute, against the bf16 peak of every rank
    near(ckpt.time.model_flops / (2e6 * ckpt.time.step_s), ckpt.time.mfu, "mfu")
    near(G * S_ / ckpt.time.step_s, ckpt.time.tokens_per_s, "tokens/s")
    -- one rank: nothing to communicate; the optimizer reads and writes its state at the HBM rate
    local m = ckpt.memory
    near((2 * (m.params + m.optimizer) + m.grads) / 1e9, ckpt.time.optimizer_s, "optimizer")
    near(ckpt.time.compute_s + ckpt.time.optimizer_s, ckpt.time.step_s, "step")
    near(0, ckpt.time.exposed_comm_s, "exposed")
  end)
end)

describe("collectives", function()
  it("stay in a node when their groups tile its GPUs, else cross", function()
    assert.equal("intra", T.link(16, 8, 1, 8))
    assert.equal("inter", T.link(16, 8, 8, 2)) -- dp_replicate over dp_shard = 8
    assert.equal("inter", T.link(16, 8, 1, 16))
    assert.equal("intra", T.link(16, 8, 2, 4))
    assert.equal("inter", T.link(24, 8, 1, 3)) -- groups of 3 straddle the nodes of 8
    assert.equal("intra", T.link(6, 8, 1, 6))  -- the world fits one node
    assert.is_nil(T.link(16, 8, 1, 1))
  end)

  it("cost a latency per call and their bus bytes at the bandwidth of the link the group spans", function()
    -- HSDP on 8 ranks, 4 a node: dp_shard (stride 1, 4 ranks) in a node, dp_replicate (stride 4) across
    local p = plan("llama_tiny", { dp_replicate = 2, dp_shard = 4 }, { tokens = { seq_len = 16 } })
    local c, per_step = p.time.collectives, p.comm
    assert.same({ intra = true }, c.all_gather.links)
    assert.same({ inter = true }, c.all_reduce.links)
    near(per_step.all_gather.count * 1e-3 + per_step.all_gather.bytes / 1e6, c.all_gather.seconds, "all_gather")
    near(per_step.reduce_scatter.count * 1e-3 + per_step.reduce_scatter.bytes / 1e6, c.reduce_scatter.seconds, "rs")
    near(per_step.all_reduce.count * 1e-2 + per_step.all_reduce.bytes / 1e5, c.all_reduce.seconds, "all_reduce")
    -- 8 GPUs a node: all inside
    local q = plan("llama_tiny", { dp_replicate = 2, dp_shard = 4 }, { tokens = { seq_len = 16 },
      device = profile({ gpus_per_node = 8 }) })
    assert.same({ intra = true }, q.time.collectives.all_reduce.links)
  end)

  it("hide behind compute as FSDP2's prefetch allows, unit by unit", function()
    local function units() return {
      { name = "a", cf = 1, cb = 2, agf = 0.5, agb = 0.5, rs = 0.5 },
      { name = "b", cf = 1, cb = 2, agf = 0.5, agb = 0.5, rs = 0.5 } } end
    local all = { forward_gather = true, backward_gather = true, reduce = true }
    -- forward: a's gather 0-0.5, b's issued as a starts (0.5-1.0), computes 0.5-1.5, 1.5-2.5;
    -- backward: b's gather 2.5-3.0, computes 3.0-5.0, reduces 5.0-5.5; a's gather issued as b's
    -- backward starts (3.0-3.5), computes 5.0-7.0, reduces 7.0-7.5
    near(7.5, T.micro_batch(units(), 1, 1, all), "prefetch 1")
    -- no prefetch: each gather waits for the compute before it: b's forward gather 1.5-2.0
    -- (+0.5), a's backward gather 5.0-5.5 (+0.5)
    near(8.5, T.micro_batch(units(), 0, 0, all), "no prefetch")
    -- a gather longer than the compute it hides behind shows: b's forward gather 0.5-3.5
    -- holds b's compute from 1.5 to 3.5 (+2)
    local slow = units()
    slow[2].agf = 3
    near(7.5 + 2, T.micro_batch(slow, 1, 1, all), "a slow gather")
    -- nothing to gather or reduce: compute alone
    near(6, T.micro_batch(units(), 1, 1, { forward_gather = false, backward_gather = false, reduce = false }), "none")
  end)
end)

describe("the pipeline's bubble", function()
  it("follows each schedule's formula", function()
    near(9, T.bubble("1F1B", 4, 1, 1, 2, 1))
    near(9, T.bubble("GPipe", 4, 1, 1, 2, 1))
    near(4.5, T.bubble("Interleaved1F1B", 4, 2, 1, 2, 1))
    near(4.5, T.bubble("LoopedBFS", 4, 2, 1, 2, 1))
    near(1.5, T.bubble("InterleavedZeroBubble", 4, 2, 1, 2, 1))
    near(0, T.bubble("ZBVZeroBubble", 4, 2, 2, 4, 2))     -- chunks of F = B_input = W: none
    near(4.5, T.bubble("ZBVZeroBubble", 4, 2, 2, 4, 1))
    near(2, T.bubble("DualPipeV", 4, 2, 2, 4, 2))         -- (4/2 - 1)(F + 2B - 3W), F=1 B=2 W=1
    near(0, T.bubble("DualPipeV", 2, 2, 2, 4, 2))
    near(0, T.bubble("1F1B", 1, 1, 1, 2, 1))
  end)

  it("is the slowest rank's under the plan's schedule, and the step adds it", function()
    local p = plan("qwen3_tiny", { pp = 2 }, { tokens = { seq_len = 16, global_batch = 4 } })
    local t = p.time
    assert.equal(2, #t.stages)
    local worst = t.stages[1]
    if t.stages[2].forward_s + t.stages[2].backward_s > worst.forward_s + worst.backward_s then worst = t.stages[2] end
    near((2 - 1) * (worst.forward_s + worst.backward_s), t.bubble_s, "1F1B bubble")
    near(t.compute_s + t.exposed_comm_s + t.bubble_s + t.optimizer_s, t.step_s, "step")
    assert.is_true(t.bubble_s > 0)
  end)
end)

describe("device profiles", function()
  it("has the five built-in profiles, dense figures", function()
    for _, name in ipairs({ "h100-80gb", "h200-141gb", "b200-192gb", "a100-80gb", "mi300x-192gb" }) do
      local p = devices.get(name)
      assert.equal(name, p.name)
      assert.same(p, devices.check(p, name))
    end
    assert.equal(989.4e12, devices.get("h100-80gb").bf16_flops)
    assert.is_nil(devices.get("a100-80gb").fp8_flops)
    assert.equal(312e12, devices.peak(devices.get("a100-80gb"), "f8e4m3")) -- no FP8: at BF16's
  end)

  local function err(t)
    local ok, e = pcall(devices.check, t, "x.lua")
    assert.is_false(ok)
    return e
  end
  it("refuses unknown keys, wrong types and missing figures, naming the key and what it takes", function()
    assert.matches("device profile x.lua: unknown key 'hbm' %(keys: name", err(profile({ hbm = 1 })))
    assert.matches("memory_bytes is 'lots'; expected a whole number of bytes", err(profile({ memory_bytes = "lots" })))
    assert.matches("gpus_per_node is 0; expected a whole number from 1", err(profile({ gpus_per_node = 0 })))
    assert.matches("fragmentation is 2; expected a number from 0 to 1", err(profile({ fragmentation = 2 })))
    assert.matches("bf16_flops is a table; expected a number > 0", err(profile({ bf16_flops = {} })))
    local p = profile()
    p.hbm_bytes_per_s = nil
    assert.matches("has no hbm_bytes_per_s", err(p))
    assert.matches("base is 'h1000'; expected one of h100%-80gb", err({ base = "h1000" }))
    assert.equal(4, devices.check({ base = "h100-80gb", gpus_per_node = 4 }, "x").gpus_per_node)
    assert.equal(989.4e12, devices.check({ base = "h100-80gb", gpus_per_node = 4 }, "x").bf16_flops)
  end)

  it("loads a user profile file in the policy sandbox", function()
    local good = S.write_file(os.tmpname() .. ".lua", 'return { base = "h200-141gb", name = "mine", gpus_per_node = 4 }')
    local p = devices.get(good)
    assert.equal("mine", p.name)
    assert.equal(4, p.gpus_per_node)
    assert.equal(4.8e12, p.hbm_bytes_per_s)
    local evil = S.write_file(os.tmpname() .. ".lua", 'io.open("/tmp/x", "w") return {}')
    local ok, e = pcall(devices.get, evil)
    assert.is_false(ok)
    assert.matches("io", e)
    local loop = S.write_file(os.tmpname() .. ".lua", 'while true do end')
    ok, e = pcall(devices.get, loop, { instructions = 100000 })
    assert.is_false(ok)
    assert.matches("instruction", e)
    local bad = S.write_file(os.tmpname() .. ".lua", 'return { base = "h100-80gb", gpus_per_node = 2.5 }')
    ok, e = pcall(devices.get, bad)
    assert.matches("gpus_per_node is 2.5; expected a whole number", e)
    for _, f in ipairs({ good, evil, loop, bad }) do os.remove(f) end
    ok, e = pcall(devices.get, "h100")
    assert.matches("no such profile %(built in: h100%-80gb", e)
  end)

  it("gives each rank its capacity and the overhead outside the allocator", function()
    local p = plan("llama_tiny", { dp_shard = 2 })
    assert.is_nil(p.time) -- no batch
    local r = p.memory.per_rank[1]
    assert.equal(1000000, r.capacity)
    assert.equal(1000 + 2000 + math.ceil(0.1 * r.total), r.overhead)
  end)
end)

describe("moonshard plan --device", function()
  local args = { "plan", "--config", "tests/reference/configs/llama_tiny.json", "--mesh", "dp_shard=2",
    "--policy", "policies/fsdp2_default.lua" }
  local function with(...)
    local a = {}
    for _, x in ipairs(args) do a[#a + 1] = x end
    for _, x in ipairs({ ... }) do a[#a + 1] = x end
    return a
  end

  it("adds device and time to the JSON, keeping the earlier fields", function()
    local r = S.run(with("--seq-len", "16", "--device", "h100-80gb", "--json"))
    assert.equal(0, r.code, r.err)
    local j = json.decode(r.out, "plan")
    for _, k in ipairs({ "step_s", "tokens_per_s", "mfu", "exposed_comm_s", "compute_s", "bubble_s", "optimizer_s" }) do
      assert.is_number(j.time[k], k)
    end
    assert.is_true(j.time.estimate)
    assert.equal("h100-80gb", j.device.name)
    assert.equal(81559 * 1024 * 1024, j.memory.per_rank[1].capacity)
    assert.is_number(j.memory.per_rank[2].overhead)
    assert.is_number(j.comm.per_step.all_gather.bytes)
    local without = json.decode(S.run(with("--seq-len", "16", "--json")).out, "plan")
    assert.is_nil(without.time)
    assert.is_nil(without.device)
    assert.is_nil(without.memory.per_rank[1].capacity)
  end)

  it("labels the table's figures estimates, and says how to get one", function()
    local r = S.run(with("--seq-len", "16", "--device", "a100-80gb", "--efficiency", "0.4"))
    assert.equal(0, r.code, r.err)
    assert.matches("time per step %(estimate, a100%-80gb at 40%% of peak%)", r.out)
    assert.matches("MFU [%d.]+%% %(estimate%)", r.out)
    assert.matches("time per step: not estimated; give the device, %-%-device", S.run(args).out)
    assert.matches("give the batch, %-%-seq%-len", S.run(with("--device", "h100-80gb")).out)
    local svg = os.tmpname()
    r = S.run(with("--seq-len", "16", "--device", "h100-80gb", "--svg", svg))
    assert.equal(0, r.code, r.err)
    assert.matches("one step on h100%-80gb %(estimate%)", S.read_file(svg))
    os.remove(svg)
  end)

  it("refuses a bad device or efficiency", function()
    local r = S.run(with("--device", "h100"))
    assert.equal(1, r.code)
    assert.matches("no such profile", r.err)
    r = S.run(with("--device", "h100-80gb", "--efficiency", "1.5"))
    assert.equal(2, r.code)
    assert.matches("%-%-efficiency is a number in %(0, 1%]", r.err)
    assert.equal(2, S.run(with("--efficiency", "0.5")).code)
    assert.matches("%-%-device NAME|FILE", S.run({ "plan", "--help" }).out)
  end)
end)

describe("the optimizer step with CPU offload", function()
  local T = require "moonshard.plan_time"
  it("steps the offloaded share on the host and moves it across the host link", function()
    local dev = { hbm_bytes_per_s = 3e12 }
    local mem = { params = 1e9, grads = 1e9, optimizer = 4e9, offloaded = 0 }
    local on_device = (2 * (1e9 + 4e9) + 1e9) / 3e12
    assert.near(on_device, T.optimizer_s(dev, mem), 1e-12)
    mem.offloaded = 6e9 -- all of it
    assert.near((2 * (1e9 + 4e9) + 1e9) / T.HOST_OPTIMIZER_BYTES_PER_S + 6e9 / T.HOST_LINK_BYTES_PER_S,
      T.optimizer_s(dev, mem), 1e-9)
    mem.offloaded = 3e9 -- half
    assert.near(on_device / 2 + 11e9 / 2 / T.HOST_OPTIMIZER_BYTES_PER_S + 3e9 / T.HOST_LINK_BYTES_PER_S,
      T.optimizer_s(dev, mem), 1e-9)
  end)
end)
