-- pp_rules_spec.lua: moonshard.plan_pp's pipeline rules against NeMo Automodel's own stage
-- split and PyTorch's own schedules, as tests/reference/pp_schedules.py measured them
-- (tests/reference/data/pp_schedules.json): for every case of the grid, the stages, the layers
-- of each, the stages of each pp rank or the error; and every rank's peak of micro-batch
-- activations, or PyTorch's refusal.
local json = require "moonshard.json"
local pp = require "moonshard.plan_pp"
local S = require "support"

local DATA = "tests/reference/data/pp_schedules.json"
local ref = json.decode(S.read_file(DATA), DATA)
local function is_null(v) return v == nil or v == json.null end

local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  if ok then return nil end
  return (tostring(e):gsub("^moonshard: pipeline: ", ""))
end

describe("the pipeline rules against Automodel and PyTorch (" .. DATA .. ")", function()
  it("is a reference made by the pinned versions, Automodel's code included", function()
    local v = table.concat(ref.versions, "; ")
    assert.matches("torch 2.15.0", v, 1, true)
    assert.matches("automodel 36044ad3d139363fb6c73c24af2e7c6b65ec52f6", v, 1, true)
    assert.is_true(#ref.splits >= 300 and #ref.in_flight >= 300)
  end)

  it("splits the layers into stages and places them on the pp ranks as Automodel does", function()
    local checked, errors = 0, 0
    for _, c in ipairs(ref.splits) do
      local what = string.format("L=%d pp=%d %s layers_per_stage=%s round=%s", c.layers, c.pp, c.schedule,
        tostring(is_null(c.layers_per_stage) and "none" or c.layers_per_stage), tostring(is_null(c.round) and "none" or c.round))
      local sched = pp.schedule(c.schedule)
      local lps = not is_null(c.layers_per_stage) and c.layers_per_stage or nil
      local round = not is_null(c.round) and c.round or nil
      local ok, n, per_rank = pcall(pp.virtual_stages, c.layers, lps, c.pp, not sched.multi, round)
      local split
      local placement = c.schedule == "ZBVZeroBubble" and "v" or "loop" -- Automodel's style
      if ok then ok, split = pcall(pp.layer_split, n, c.layers) end
      local ranks = {}
      for r = 0, c.pp - 1 do
        if ok then ok, ranks[r + 1] = pcall(pp.stages_of_rank, r, c.pp, n, placement) end
        if not ok then split = split or ranks[r + 1] end
      end
      if c.error then
        assert.is_false(ok, what .. ": Automodel refuses it: " .. c.error)
        local e = type(n) == "string" and n or type(split) == "string" and split or ranks[#ranks]
        assert.equal(c.error, (tostring(e):gsub("^moonshard: pipeline: ", "")), what)
        errors = errors + 1
      else
        assert(ok, what .. ": " .. tostring(n) .. tostring(split))
        assert.equal(c.num_stages, n, what)
        assert.equal(c.stages_per_rank, per_rank, what)
        -- Automodel's parts name the layers "model.layers.N" (and modules the tree may not have)
        for i, part in ipairs(c.parts) do
          local layers = {}
          for _, name in ipairs(part) do
            local idx = name:match("^model%.layers%.(%d+)$")
            if idx then layers[#layers + 1] = tonumber(idx) end
          end
          local want = { first = layers[1], count = #layers }
          assert.same(want, split[i], what .. ": stage " .. (i - 1))
          local has = {}
          for _, name in ipairs(part) do has[name] = true end
          assert.equal(i == 1, has["model.embed_tokens"] == true, what .. ": the embeddings in stage 0 only")
          assert.equal(i == #c.parts, has["lm_head"] == true and has["model.norm"] == true, what ..
            ": the norm and head in the last stage only")
        end
        assert.same(c.ranks, ranks, what)
        checked = checked + 1
      end
    end
    assert.is_true(checked > 100 and errors > 50, checked .. " split, " .. errors .. " refused")
  end)

  it("counts each rank's peak of micro-batch activations as PyTorch's schedules order them", function()
    local checked, refused = 0, 0
    for _, c in ipairs(ref.in_flight) do
      local what = string.format("%s pp=%d n=%d v=%d", c.schedule, c.pp, c.microbatches, c.stages_per_rank)
      local sched = pp.schedule(c.schedule)
      local why = pp.check_microbatches(sched, c.pp, c.microbatches, c.stages_per_rank)
      if c.error then
        assert(why, what .. ": PyTorch refuses it: " .. c.error)
        assert.truthy(c.error:find(why, 1, true), what .. ": " .. c.error .. " / " .. why)
        refused = refused + 1
      else
        assert.is_nil(why, what)
        local peaks = {}
        for r = 0, c.pp - 1 do peaks[r + 1] = pp.in_flight(sched, c.pp, c.microbatches, c.stages_per_rank, r) end
        assert.same(c.peaks, peaks, what)
        checked = checked + 1
      end
    end
    assert.is_true(checked > 200 and refused > 5, checked .. " counted, " .. refused .. " refused")
  end)

  it("keeps 1F1B's executor warm-up (its action list, for pictures only, is off by one on the last rank)", function()
    local s = pp.schedule("1f1b")
    local peaks = {}
    for r = 0, 3 do peaks[r + 1] = pp.in_flight(s, 4, 8, 1, r) end
    assert.same({ 4, 3, 2, 1 }, peaks)
    assert.equal("Number of microbatches (3) must be greater than or equal to the number of stages (4).",
      pp.check_microbatches(s, 4, 3, 1))
    assert.equal("Unknown schedule name 'zero_bubble'. The valid options are GPipe, 1F1B, Interleaved1F1B, LoopedBFS, " ..
      "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV", err_of(pp.schedule, "zero_bubble"))
  end)
end)
