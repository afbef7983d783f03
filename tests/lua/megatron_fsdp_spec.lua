-- megatron_fsdp_spec.lua: Megatron-FSDP units (ctx:megatron_fsdp, NeMo Automodel's
-- MegatronFSDPManager) in the planner: the buckets and their padded flat layout against
-- megatron_fsdp 0.5.0's own _get_parameter_groups and build_data_parallel_buffer_index, run on
-- CPU (tests/reference/data/megatron_fsdp_buffers.json, made by
-- tests/reference/megatron_fsdp_buffers.py: 36 cases, 3 models x 3 strategies x dp 1, 2, 3, 8),
-- and against its rules worked out here by hand; each ZeRO stage's bytes per rank against the closed forms; the collectives per step
-- against their formulas; and the plan's manager field.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local G = require "moonshard.plan_megatron"
local S = require "support"

local MFSDP = "policies/megatron_fsdp.lua"
local TINY = "tests/reference/configs/llama_tiny.json"
local SIZE = { f32 = 4, bf16 = 2, f16 = 2 }

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function plan_of(strategy, mesh, set)
  local sets = { "zero_dp_strategy=" .. strategy }
  for _, s in ipairs(set or {}) do sets[#sets + 1] = s end
  return planner.plan(models.from_config(TINY, "spec"), mesh_context.new(mesh or "dp_shard=4"),
    policy.load(MFSDP).main, { set = sets })
end

describe("Megatron-FSDP's strategies", function()
  it("take ShardingStrategy's numbers and names (fully_shard.py)", function()
    assert.equal("no_shard", G.strategy(0))
    assert.equal("optim", G.strategy(1))
    assert.equal("optim_grads", G.strategy("2"))
    assert.equal("optim_grads_params", G.strategy("optim_grads_params"))
    assert.is_nil(G.strategy(4))
    assert.is_nil(G.strategy("zero3"))
  end)
end)

describe("Megatron-FSDP's buckets", function()
  it("are megatron_fsdp 0.5.0's own, measured (tests/reference/megatron_fsdp_buffers.py)", function()
    local PATH = "tests/reference/data/megatron_fsdp_buffers.json"
    local ref = json.decode(S.read_file(PATH), PATH)
    local checked = 0
    for _, case in ipairs(ref.cases) do
      local params, units = {}, {}
      for i, p in ipairs(ref.params[case.model]) do
        local unit = p[1]:match("^(.-layers%.%d+)%.")
        if unit and not units[unit] then
          units[#units + 1] = unit
          units[unit] = #units - 1
        end
        params[i] = { fqn = p[1], shape = p[2], dtype = p[3], requires_grad = p[4],
          unit_id = unit and units[unit] or nil, expert = p[1]:find(".experts.", 1, true) ~= nil }
      end
      local got = G.groups(params)
      local what = case.model .. " " .. case.strategy .. " dp " .. case.dp
      assert.equal(#case.buckets, #got, what)
      for bi, want in ipairs(case.buckets) do
        local b = got[bi]
        local fqns, numels = {}, {}
        for k, i in ipairs(b.indices) do fqns[k], numels[k] = params[i].fqn, numel(params[i].shape) end
        assert.same(want.params, fqns, what)
        assert.equal(want.dtype, b.dtype, what)
        assert.equal(want.requires_grad, b.requires_grad, what)
        assert.equal(want.expert, b.expert, what)
        local uid = want.fsdp_unit_id
        if uid == json.null then uid = nil end
        assert.equal(uid, b.unit_id, what)
        assert.equal(want.chunk_size_factor, b.chunk, what)
        local off, _, size = G.buffer_index(numels, b.chunk, case.dp, case.strategy)
        assert.same(want.offsets, off, what)
        assert.equal(want.size, size, what)
        checked = checked + 1
      end
    end
    assert.is_true(checked > 300)
  end)

  it("group by (dtype, expert, requires_grad, FSDP unit), in named_parameters() order (_get_parameter_groups)", function()
    local params = {
      { shape = { 8, 4 }, dtype = "bf16", requires_grad = true },                  -- 1 outside
      { shape = { 6, 4 }, dtype = "bf16", requires_grad = true, unit_id = 0 },     -- 2 unit 0
      { shape = { 4 }, dtype = "f32", requires_grad = true, unit_id = 0 },         -- 3 unit 0, f32
      { shape = { 3, 6 }, dtype = "bf16", requires_grad = true, unit_id = 0 },     -- 4 unit 0
      { shape = { 5 }, dtype = "bf16", requires_grad = false, unit_id = 0 },       -- 5 unit 0, frozen
      { shape = { 2, 2, 3 }, dtype = "bf16", requires_grad = true, unit_id = 1, expert = true }, -- 6
      { shape = { 8, 4 }, dtype = "bf16", requires_grad = true },                  -- 7 outside
    }
    local b = G.groups(params)
    assert.equal(5, #b)
    assert.same({ 1, 7 }, b[1].indices)
    assert.equal(4, b[1].chunk)
    -- sorted by row size, largest first: [3,6] (6) before [6,4] (4); chunk lcm(6, 4) = 12
    assert.same({ 4, 2 }, b[2].indices)
    assert.equal(12, b[2].chunk)
    assert.same({ 3 }, b[3].indices)
    assert.is_false(b[4].requires_grad)
    assert.is_true(b[5].expert)
    assert.equal(6, b[5].chunk) -- row of [2,2,3] is 2*3
    -- a suggested bucket size splits the groups outside units only
    local split = G.groups(params, 32)
    assert.same({ 1 }, split[1].indices)
    assert.same({ 7 }, split[2].indices)
  end)

  it("lay items out at chunk boundaries, pair remainders and fill gaps with fragments (build_data_parallel_buffer_index)", function()
    -- chunk 8: 20 (remainder 4) at 0 -> the offset rounds up to 24; 12 (remainder 4) fits the same
    -- chunk: it ends there, at 24 - 4 = 20, and the offset moves on by 8 (its whole chunks) to 32;
    -- the fragments (3, then 5, smaller than a chunk) fill the gap after 20 ... but the gap's
    -- space is 8 - 4 - 4 = 0: they go last, at 32 and 35; padded to dp*chunk = 2*8 = 16: 48
    local off, data, size = G.buffer_index({ 20, 3, 12, 5 }, 8, 2, "optim")
    assert.same({ 0, 32, 20, 35 }, off)
    assert.equal(40, data)
    assert.equal(48, size)
    -- a gap the fragments fit: 10 (remainder 2) leaves 6 behind it, 3 then 2 fill it
    off, data, size = G.buffer_index({ 10, 3, 2, 16 }, 8, 4, "optim_grads_params")
    assert.same({ 0, 10, 13, 16 }, off)
    assert.equal(32, data)
    assert.equal(32, size)
    -- no_shard pads nothing
    off, data, size = G.buffer_index({ 10, 3 }, 8, 4, "no_shard")
    assert.equal(16, data)
    assert.equal(16, size)
  end)

  it("give rank r the contiguous slice [r*S/dp, (r+1)*S/dp) (_get_item_slice_in_shard)", function()
    assert.same({ 0, 6 }, { G.slice(10, 20, 16, 0) })
    assert.same({ 6, 20 }, { G.slice(10, 20, 16, 1) })
    assert.same({ 0, 0 }, { G.slice(10, 20, 16, 2) })
  end)

  it("never overlap, stay inside the padded bucket and pad it to dp x chunk, on a real model", function()
    for _, dp in ipairs({ 2, 3, 8 }) do
      local p = planner.plan(models.from_config("examples/configs/llama3.1_8b.json", "spec"),
        mesh_context.new("dp_shard=" .. dp), policy.load(MFSDP).main, {})
      local m = p.units[1].megatron
      assert.equal(33, #m.buckets) -- the embeddings, norm and head outside units, one per layer
      for _, b in ipairs(m.buckets) do
        assert.equal(0, b.size % (dp * b.chunk))
        assert.equal(b.size, b.shard * dp)
        local spans = {}
        for k, i in ipairs(b.indices) do spans[k] = { b.offsets[k], b.offsets[k] + numel(m.items[i].shape) } end
        table.sort(spans, function(x, y) return x[1] < y[1] end)
        for k = 2, #spans do assert.is_true(spans[k][1] >= spans[k - 1][2]) end
        assert.is_true(spans[#spans][2] <= b.size)
      end
      -- a layer's bucket: down_proj first (row 14336), the chunk lcm(14336, 4096) = 28672
      assert.equal("model.layers.0.mlp.down_proj.weight", m.items[m.buckets[2].indices[1]].fqn)
      assert.equal(28672, m.buckets[2].chunk)
    end
  end)
end)

describe("Megatron-FSDP's bytes per rank", function()
  -- the closed forms over the buckets: P, G the padded bucket bytes (params, grads), N the
  -- parameters' elements, state the optimizer's bytes an element
  local function sums(u, W)
    local m = u.megatron
    local P, Gr, NS, unpadded, shardS = 0, 0, 0, 0, 0
    for _, b in ipairs(m.buckets) do
      P = P + b.size * SIZE[b.dtype]
      unpadded = unpadded + b.numel * SIZE[b.dtype]
      if b.requires_grad then
        -- moonshard's adamw: exp_avg and exp_avg_sq in f32, and an f32 master below f32
        local state = b.dtype == "f32" and 8 or 12
        Gr = Gr + b.size * SIZE[b.grad_dtype]
        NS = NS + b.numel * state
        shardS = shardS + b.shard * state
      end
    end
    return P, Gr, NS, unpadded, shardS
  end

  for _, dp in ipairs({ 2, 4 }) do
    it("follow ZeRO-0..3 on dp_shard=" .. dp .. " (optimizer state summed over ranks is every element's)", function()
      for zero = 0, 3 do
        local p = plan_of(zero, "dp_shard=" .. dp)
        local u = p.units[1]
        local P, Gr, NS, unpadded, shardS = sums(u, dp)
        local mem = p.memory
        if zero == 0 then
          assert.equal(unpadded, mem.params)
          assert.equal(Gr, mem.grads)
          assert.equal(NS, mem.optimizer)
        elseif zero == 1 then
          assert.equal(P, mem.params)
          assert.equal(Gr, mem.grads)
        elseif zero == 2 then
          assert.equal(P, mem.params)
          assert.equal(Gr / dp, mem.grads)
        else
          assert.equal(P / dp, mem.params)
          assert.equal(Gr / dp, mem.grads)
        end
        if zero > 0 then
          local total, max = 0, 0
          for _, run in ipairs(mem.runs) do
            total = total + (run.optimizer * run.count)
            max = math.max(max, run.optimizer)
          end
          assert.equal(NS, total)
          assert.is_true(max <= shardS)
        end
      end
    end)
  end

  it("count f32 main weights (preserve_fp32_weights) and f32 gradients (grad_reduce_in_fp32)", function()
    local p = plan_of("optim_grads_params", "dp_shard=4", { "preserve_fp32_weights=true", "grad_reduce_in_fp32=true" })
    local u = p.units[1]
    local P, Gr = sums(u, 4)
    local mains = 0
    for _, b in ipairs(u.megatron.buckets) do
      assert.equal("f32", b.grad_dtype)
      mains = mains + b.shard * 4
    end
    assert.equal(P / 4 + mains, p.memory.params)
    assert.equal(Gr / 4, p.memory.grads)
    assert.equal(mains, u.megatron.main_bytes)
  end)
end)

describe("Megatron-FSDP's collectives per step", function()
  local function bus(S, n) return S - math.ceil(S / n) end
  it("all-reduce under no_shard, reduce-scatter otherwise, all-gather once (ZeRO-1/2) or per unit twice (ZeRO-3)", function()
    local W = 4
    for zero = 0, 3 do
      local p = plan_of(zero, "dp_shard=" .. W)
      local m = p.units[1].megatron
      local ar, rs, ag, nag = 0, 0, 0, 0
      for _, b in ipairs(m.buckets) do
        local g = SIZE[b.grad_dtype]
        if zero == 0 then ar = ar + bus(2 * b.numel * g, W)
        else rs = rs + b.size / W * g * (W - 1) end
        if zero == 1 or zero == 2 or (zero == 3 and b.unit_id == nil) then
          ag, nag = ag + bus(b.size * SIZE[b.dtype], W), nag + 1
        elseif zero == 3 then
          ag, nag = ag + 2 * bus(b.size * SIZE[b.dtype], W), nag + 2
        end
      end
      assert.equal(ar, p.comm.all_reduce.bytes)
      assert.equal(zero == 0 and #m.buckets or 0, p.comm.all_reduce.count)
      assert.equal(rs, p.comm.reduce_scatter.bytes)
      assert.equal(zero == 0 and 0 or #m.buckets, p.comm.reduce_scatter.count)
      assert.equal(ag, p.comm.all_gather.bytes)
      assert.equal(nag, p.comm.all_gather.count)
    end
  end)

  it("gather ZeRO-3's units again every micro-batch but the once-a-step gathers only once", function()
    local one = plan_of(3, "dp_shard=4")
    local tiny = models.from_config(TINY, "spec")
    local p = planner.plan(tiny, mesh_context.new("dp_shard=4"), policy.load(MFSDP).main,
      { set = { "zero_dp_strategy=3" }, tokens = { seq_len = 16, micro_batch = 1, global_batch = 16 } })
    assert.is_true(p.comm.all_gather.count > one.comm.all_gather.count)
  end)
end)

describe("The plan's manager", function()
  it("is fsdp2, ddp or megatron_fsdp, in the table and the JSON", function()
    local tree = function() return models.from_config(TINY, "spec") end
    local f = planner.plan(tree(), mesh_context.new("dp_shard=2"), policy.load("policies/fsdp2_default.lua").main)
    local d = planner.plan(tree(), mesh_context.new("dp_shard=2"), policy.load("policies/ddp.lua").main)
    local m = planner.plan(tree(), mesh_context.new("dp_shard=2"), policy.load(MFSDP).main,
      { set = { "zero_dp_strategy=optim_grads" } })
    assert.equal("fsdp2", f.manager)
    assert.equal("ddp", d.manager)
    assert.equal("megatron_fsdp", m.manager)
    local j = json.decode(report.to_json(m), "plan")
    assert.equal("megatron_fsdp", j.manager)
    assert.equal("optim_grads", j.units[1].megatron_fsdp.zero_dp_strategy)
    assert.equal(#m.units[1].megatron.buckets, #j.units[1].megatron_buckets)
    assert.equal("fsdp2", json.decode(report.to_json(f), "plan").manager)
    local text = report.to_text(m)
    assert.matches("manager megatron_fsdp", text, 1, true)
    assert.matches("zero_dp_strategy optim_grads (2, ZeRO-2)", text, 1, true)
  end)

  it("refuses what Megatron-FSDP is not planned for, and unknown options", function()
    local msg = S.errmsg(planner.plan, models.from_config(TINY, "spec"), mesh_context.new("dp_shard=2,tp=2"),
      policy.load(MFSDP).main)
    assert.matches("tp=2", msg, 1, true)
    msg = S.errmsg(planner.plan, models.from_config(TINY, "spec"), mesh_context.new("dp_shard=2"),
      { parallelize = function(ctx) ctx:megatron_fsdp(ctx.model, { zero_dp_strategy = 5 }) end })
    assert.matches("zero_dp_strategy", msg, 1, true)
    msg = S.errmsg(planner.plan, models.from_config(TINY, "spec"), mesh_context.new("dp_shard=2"),
      { parallelize = function(ctx) ctx:megatron_fsdp(ctx.model, { bogus = 1 }) end })
    assert.matches("unknown option 'bogus'", msg, 1, true)
  end)
end)
