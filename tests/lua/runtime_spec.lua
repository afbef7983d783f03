-- runtime_spec.lua: plans made real: the inkling2 plan of a tiny config with uneven shards
-- materialised on every rank, gathered and reduced, checked on every rank against values
-- computed in the script, with the bytes each rank allocated against the planner's.
local S = require "support"

describe("materialised plans", function()
  -- dp_shard=3 leaves rank 2 without rows of the 4-expert tensors (torch.chunk: 2, 2, 0)
  -- ep = 2: the experts of each of the 2 layers are a unit of their own on ep_shard = 2 (17
  -- units); ep = 4: ep_shard = 1, so the runtime adds an ep-local unit per layer (15 + 2).
  for _, case in ipairs({ { 4, "dp_shard=4", 15 }, { 4, "dp_replicate=2,dp_shard=2", 15 }, { 3, "dp_shard=3", 15 },
    { 4, "dp_shard=4,ep=2", 17 }, { 4, "dp_shard=4,ep=4", 17 } }) do
    local n, mesh, units = case[1], case[2], case[3]
    it("gather, reduce and allocate as planned on " .. mesh, function()
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/units.lua", mesh })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        assert.matches("rank " .. rank .. ": units ok %(" .. units .. " units, gradient max diff 0,", r.out)
      end
    end)
  end

  it("refuses to run a plan on the wrong number of ranks", function()
    local r = S.run({ "-n", "2", "tests/lua/scripts/units.lua", "dp_shard=4" })
    assert.equal(1, r.code)
    assert.matches("the plan is for 4 ranks but 2 are running", r.err)
  end)
end)
