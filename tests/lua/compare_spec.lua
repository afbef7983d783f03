-- compare_spec.lua: `moonshard compare A.json B.json`: two plans side by side, each term's
-- A, B, B - A and B / A recomputed here from the two plan JSONs themselves; the JSON form;
-- and the refusals.
local json = require "moonshard.json"
local S = require "support"
local assert_has = S.assert_has

local CONFIG = "tests/reference/configs/llama_tp_comm.json"

local function plan_json(mesh, extra)
  local args = { "plan", "--config", CONFIG, "--mesh", mesh, "--policy", "policies/fsdp2_default.lua", "--json" }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  local r = S.run(args)
  assert.equal(0, r.code, r.err)
  local path = os.tmpname()
  S.write_file(path, r.out)
  return path, json.decode(r.out, "plan JSON")
end

describe("moonshard compare", function()
  local pa, A = plan_json("dp_shard=4")
  local pb, B = plan_json("pp=2,dp_shard=2", { "--seq-len", "16", "--global-batch", "8" })
  teardown(function()
    os.remove(pa)
    os.remove(pb)
  end)

  it("gives every term of both plans with its difference and ratio", function()
    local r = S.run({ "compare", pa, pb, "--json" })
    assert.equal(0, r.code, r.err)
    local c = json.decode(r.out, "compare JSON")
    assert.equal(1, c.moonshard_compare)
    assert.equal("dp_shard=4", c.a.mesh)
    assert.equal("pp=2,dp_shard=2", c.b.mesh)
    local by = {}
    for _, t in ipairs(c.terms) do by[t.section .. "/" .. t.name] = t end
    -- memory: rank 0's, and the largest over the listed ranks, from the plans' own figures
    for _, k in ipairs({ "params", "grads", "optimizer", "peak_unsharded", "total" }) do
      local t = by["memory per rank (rank 0)/" .. k]
      assert.equal(A.memory.per_rank[1][k], t.a)
      assert.equal(B.memory.per_rank[1][k], t.b)
      assert.equal(t.b - t.a, t.diff)
      if t.a ~= 0 then assert.is_true(math.abs(t.ratio - t.b / t.a) < 1e-12) end
      local hi = 0
      for _, rk in ipairs(B.memory.per_rank) do hi = math.max(hi, rk[k]) end
      assert.equal(hi, by["memory per rank (largest of the ranks listed)/" .. k].b)
    end
    -- communication, units, the pipeline only B has, and an option that differs
    assert.equal(A.comm.per_step.all_gather.count, by["communication per step (rank 0)/all_gather count"].a)
    assert.equal(B.comm.per_step.send_recv.bytes, by["communication per step (rank 0)/send_recv bytes"].b)
    assert.equal(json.null, by["communication per step (rank 0)/send_recv bytes"].a)
    assert.equal(#A.units, by["units/units"].a)
    assert.equal(#B.units, by["units/units"].b)
    assert.equal("1F1B", by["pipeline/schedule"].b)
    assert.equal(json.null, by["pipeline/schedule"].a)
    assert.equal(4, by["plan/world"].a)
  end)

  it("shows a step's time in seconds and its rates as numbers", function()
    local pc = plan_json("dp_shard=4", { "--seq-len", "16", "--global-batch", "8", "--device", "h100-80gb" })
    local pd = plan_json("dp_shard=2", { "--seq-len", "16", "--global-batch", "8", "--device", "h100-80gb" })
    local r = S.run({ "compare", pc, pd })
    assert.equal(0, r.code, r.err)
    local step = r.out:match("\n  step_s[^\n]*")
    local rate = r.out:match("\n  tokens_per_s[^\n]*")
    assert.truthy(step and rate, r.out)
    assert_has(step, " s")
    assert.is_nil(rate:find(" s ", 1, true), rate)
    os.remove(pc)
    os.remove(pd)
  end)

  it("prints a table a person reads, with the options that differ", function()
    local _, C = plan_json("dp_shard=4", { "--set", "reshard_after_forward=true" })
    local pc = os.tmpname()
    S.write_file(pc, json.encode(C))
    local r = S.run({ "compare", pa, pc })
    assert.equal(0, r.code, r.err)
    assert_has(r.out, "A  " .. pa .. ": ")
    assert_has(r.out, "options that differ")
    local row = r.out:match("\n  reshard_after_forward[^\n]*")
    assert.truthy(row, r.out)
    assert_has(row, "none")
    assert_has(row, "true")
    assert_has(r.out, "memory per rank (rank 0)")
    os.remove(pc)
  end)

  it("refuses what is not two plans' JSON, saying what was expected", function()
    local r = S.run({ "compare", pa })
    assert.equal(2, r.code)
    assert_has(r.err, "expected two plan JSON files (A.json B.json), got 1")
    r = S.run({ "compare", pa, pb, "--csv" })
    assert.equal(2, r.code)
    assert_has(r.err, "unknown option '--csv'")
    local other = os.tmpname()
    S.write_file(other, '{"a": 1}')
    r = S.run({ "compare", pa, other })
    assert.equal(2, r.code)
    assert_has(r.err, "not a plan's JSON (made by moonshard plan --json")
    S.write_file(other, '{"moonshard_plan": 1, "model": {}')
    r = S.run({ "compare", other, pa })
    assert.equal(2, r.code)
    assert_has(r.err, other)
    S.write_file(other, '{"moonshard_plan": 1, "model": {}, "mesh": {}, "units": [], "memory": {}, "comm": {}, ' ..
      '"time": 5}')
    r = S.run({ "compare", pa, other })
    assert.equal(2, r.code)
    assert_has(r.err, other .. ': "time" is a number; a plan\'s JSON has an object there')
    S.write_file(other, '{"moonshard_plan": 1, "model": {}, "mesh": null, "units": [], "memory": {}, "comm": {}}')
    r = S.run({ "compare", pa, other })
    assert.equal(2, r.code)
    assert_has(r.err, 'without its "mesh" (an object)')
    r = S.run({ "compare", "/tmp", pa })
    assert.equal(2, r.code)
    assert_has(r.err, "/tmp: is a directory")
    r = S.run({ "compare", pa, "/nonexistent/plan.json" })
    assert.equal(2, r.code)
    assert_has(r.err, "/nonexistent/plan.json")
    os.remove(other)
    r = S.run({ "compare", "--help" })
    assert.equal(0, r.code)
    assert_has(r.out, "usage: moonshard compare A.json B.json [--json]")
  end)
end)
