-- packed_units_spec.lua: a packed unit (a layer's bf16 weights and its fp32 islands in one
-- unit, each parameter with its own policy) against the separate units of the seed's plan,
-- run by tests/lua/scripts/packed_units.lua on 1 to 4 thread ranks, 1-D and HSDP, with one
-- reduce dtype and with two, and with a 2-way reshard after forward: every rank checks every
-- parameter's gathered values, gradient shard, AdamW state and shard after three steps bit for
-- bit against the separate units, its dtypes, the collectives (one all-gather, one
-- reduce-scatter per reduce dtype) and the bytes it holds.
local S = require "support"

local function run(n, flags)
  local args = { "-n", tostring(n), "tests/lua/scripts/packed_units.lua" }
  for _, f in ipairs(flags) do args[#args + 1] = f end
  local r = S.run(args)
  assert.equal("", r.err)
  assert.equal(0, r.code)
  local lines = {}
  for rank = 0, n - 1 do
    local c, sep, sum = r.out:match("packed_units ok " .. rank .. " collectives (%d+)/(%d+) checksum (%x+)")
    assert.is_not_nil(c, r.out)
    lines[rank] = { packed = tonumber(c), separate = tonumber(sep), checksum = sum }
  end
  return lines
end

describe("packed units", function()
  it("give the separate units' bits on 1 to 4 ranks in 2 collectives a step instead of 12", function()
    for n = 1, 4 do
      for _, l in pairs(run(n, {})) do
        assert.equal(2, l.packed)
        assert.equal(12, l.separate)
      end
    end
  end)

  it("reduce once per reduce dtype, with HSDP all-reduces, and keep their bits under a 2-way reshard", function()
    for _, l in pairs(run(4, { "bf16reduce" })) do assert.same({ 3, 12 }, { l.packed, l.separate }) end
    for _, l in pairs(run(4, { "hsdp" })) do assert.same({ 3, 18 }, { l.packed, l.separate }) end
    for _, l in pairs(run(4, { "hsdp", "bf16reduce" })) do assert.same({ 5, 18 }, { l.packed, l.separate }) end
    local plain, two_way = run(4, {}), run(4, { "reshard2" })
    for rank = 0, 3 do assert.equal(plain[rank].checksum, two_way[rank].checksum) end
  end)
end)
