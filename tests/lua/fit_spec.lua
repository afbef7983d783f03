-- fit_spec.lua: each rank's peak (memory.per_rank[r].peak = total + activations + transient +
-- overhead, less what offloading keeps in host memory) and the fit verdict against a
-- device's capacity, recomputed here from the plan's own terms; the text and the JSON.
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local svg = require "moonshard.plan_svg"
local json = require "moonshard.json"
local S = require "support"
local assert_has = S.assert_has

local FSDP2 = policy.entry_point(policy.load("policies/fsdp2_default.lua"), "fsdp2_default")
local LLAMA = { architectures = { "LlamaForCausalLM" }, vocab_size = 1024, hidden_size = 256, intermediate_size = 512,
  num_hidden_layers = 4, num_attention_heads = 8, num_key_value_heads = 4, tie_word_embeddings = false,
  torch_dtype = "bfloat16" }

local function plan(mesh, opts)
  return planner.plan(models.from_config(LLAMA, "llama"), mesh_context.new(mesh), FSDP2, opts)
end

-- a device of `gib` GiB, otherwise an H100
local function device(bytes) return { base = "h100-80gb", name = "small", memory_bytes = bytes } end

describe("a rank's peak and whether it fits", function()
  local TOK = { seq_len = 512, micro_batch = 2 }

  it("is the sum of the rank's terms, on every rank, pipelines included", function()
    local p = plan("pp=2,dp_shard=2", { tokens = { seq_len = 512, micro_batch = 1, global_batch = 4 }, device = "h100-80gb" })
    local seen = {}
    for _, r in ipairs(p.memory.per_rank) do
      assert.is_number(r.activations)
      local want = r.total - r.offloaded + r.activations + r.transient + r.overhead
      assert.equal(want, r.peak)
      seen[r.peak] = true
    end
    local n = 0
    for _ in pairs(seen) do n = n + 1 end
    assert.is_true(n >= 2, "the two stages peak differently")
  end)

  it("says whether every rank fits, and by how much the fullest is over, naming its largest term", function()
    local p = plan("dp_shard=4", { tokens = TOK, device = "h100-80gb" })
    local r0 = p.memory.per_rank[1]
    assert.is_true(p.memory.fit.fits)
    assert.equal(0, p.memory.fit.over)
    assert.equal(r0.capacity - r0.peak, p.memory.fit.worst.headroom)
    -- a device just too small for it
    local small = plan("dp_shard=4", { tokens = TOK, device = device(r0.peak - 1) })
    local f = small.memory.fit
    assert.is_false(f.fits)
    assert.equal(4, f.over)
    -- overhead's fragmentation is a share of what the allocator holds: the same on the smaller device
    assert.equal(small.memory.per_rank[1].peak, r0.peak)
    assert.equal(-1, f.worst.headroom)
    local terms = small.memory.per_rank[1]
    local largest, name = 0, nil
    for _, k in ipairs({ "params", "grads", "optimizer", "peak_unsharded", "buffers", "activations", "transient", "overhead" }) do
      if terms[k] > largest then largest, name = terms[k], k end
    end
    assert.same({ name = name, bytes = largest }, f.worst.largest)
    local text = report.to_text(small)
    assert_has(text, "does not fit (estimate): 4 of 4 ranks need more than")
    assert_has(text, "over by 1 B; its largest term: " .. name:gsub("_", " "))
    assert_has(report.to_text(p), "fits (estimate): every rank; the fullest, rank 0, peaks at")
  end)

  it("with offloading, leaves out what host memory holds", function()
    local p = plan("dp_shard=4", { tokens = TOK, device = "h100-80gb", set = { "offload_policy=cpu" } })
    local r = p.memory.per_rank[1]
    assert.is_true(r.offloaded > 0)
    assert.equal(r.total - r.offloaded + r.activations + r.transient + r.overhead, r.peak)
  end)

  it("without a device gives the peak and says how to check it; without a batch, none", function()
    local p = plan("dp_shard=4", { tokens = TOK })
    local r = p.memory.per_rank[1]
    assert.equal(r.total + r.activations + r.transient, r.peak)
    assert.is_nil(p.memory.fit)
    assert_has(report.to_text(p), "give --device to check it against a GPU's memory")
    local none = plan("dp_shard=4", {})
    assert.is_nil(none.memory.per_rank[1].peak)
    assert.is_nil(none.memory.peak)
  end)

  it("shows in the JSON: per rank peak, and the fit", function()
    local p = plan("dp_shard=4", { tokens = TOK, device = "h100-80gb" })
    local j = json.decode(report.to_json(p), "plan JSON").memory
    assert.equal(p.memory.per_rank[1].peak, j.per_rank[1].peak)
    assert.is_true(j.fit.fits)
    assert.equal(0, j.fit.ranks_over)
    assert.equal(p.memory.fit.worst.headroom, j.fit.worst.headroom)
    local none = json.decode(report.to_json(plan("dp_shard=4", {})), "plan JSON").memory
    assert.equal(json.null, none.per_rank[1].peak)
    assert.is_nil(none.fit)
  end)

  it("draws each rank's stack to its peak against the device's memory", function()
    local p = plan("dp_shard=4", { tokens = TOK, device = "h100-80gb" })
    local pic = svg.render(p)
    assert_has(pic, "at the peak (estimate) on rank 0 of 79.6 GiB: every rank fits")
    assert_has(pic, "the device's memory: 79.6 GiB")
    assert_has(pic, ">activations ")
    assert_has(pic, ">overhead ")
    -- rank 0's bar: its eight terms' widths sum to its peak on the capacity line's scale
    local bars = pic:match("rank 0</text>(.-)<text")
    local width = 0
    for w in bars:gmatch('width="([%d.]+)"') do width = width + tonumber(w) end
    local line = tonumber(pic:match('<line x1="([%d.]+)"'))
    local r0 = p.memory.per_rank[1]
    -- the bar starts where the capacity line's scale starts (margin 20 + 70)
    assert.is_true(math.abs(width / (line - 90) - r0.peak / r0.capacity) < 0.002,
      string.format("bar %g, capacity at %g: %g vs %g", width, line - 90, width / (line - 90), r0.peak / r0.capacity))
  end)
end)
