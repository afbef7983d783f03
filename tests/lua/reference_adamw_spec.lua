-- reference_adamw_spec.lua: the shard units against real FSDP2 with torch.optim.AdamW on
-- gloo (tests/reference/fsdp2_adamw.py wrote tests/reference/data/fsdp2_adamw.txt):
-- tests/lua/scripts/reference_adamw.lua replays each run on the same mesh and compares
-- the gathered parameters, the reduced gradient shards, the parameter shards, exp_avg,
-- exp_avg_sq, state['step'] and the optimizer bytes on every rank, bit for bit.  Here:
-- every rank says 0 differ in every category, and compared as many values as the file
-- holds for it; and a file with one bit changed is caught, with the value named.
local S = require "support"

local DATA = "fsdp2_adamw.txt"

-- The values the file holds for a config and rank, per category of the script.
local function expected(D, config, rank)
  local n = { grad = 0, param = 0, exp_avg = 0, exp_avg_sq = 0, step = 0, optimizer_bytes = 0 }
  local prefix = string.format("%s.r%d.", config, rank)
  for name, r in pairs(D) do
    if name:sub(1, #prefix) == prefix then
      local cat = name:match("%.([%w_]+)$")
      assert(n[cat], "unknown record " .. name)
      -- optimizer_bytes: the moments' bytes (the second value, the count of step tensors,
      -- is torch's alone)
      n[cat] = n[cat] + (cat == "optimizer_bytes" and 1 or r.n)
    end
  end
  return n
end

local function counts(out, rank)
  local got = {}
  for cat, differ, total in out:gmatch("rank " .. rank .. ": ([%w_]+) (%d+) of (%d+) values differ") do
    got[cat] = { tonumber(differ), tonumber(total) }
  end
  return got
end

describe("shard units against FSDP2 and torch.optim.AdamW on gloo", function()
  local D = S.refdata(DATA)

  for _, case in ipairs({ { "fsdp2", 2 }, { "fsdp4", 4 }, { "hsdp", 4 } }) do
    local config, n = case[1], case[2]
    it("match torch bit for bit on every rank: " .. config, function()
      assert.equal(n, D["config." .. config].values[2])
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/reference_adamw.lua", config })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        assert.matches("rank " .. rank .. ": reference_adamw " .. config .. " ok", r.out, 1, true)
        local got, want = counts(r.out, rank), expected(D, config, rank)
        for cat, total in pairs(want) do
          assert.are.same({ cat, 0, total }, { cat, got[cat][1], got[cat][2] })
          assert.is_true(total > 0, cat)
        end
        -- the gathered parameters: every unit's, every step (F skips one)
        assert.are.same(0, got.gather[1])
        assert.is_true(got.gather[2] > 0)
      end
    end)
  end

  it("catches one bit changed in torch's exp_avg_sq, naming it", function()
    local text = S.read_file("tests/reference/data/" .. DATA)
    local name = "fsdp4.r2.s5.H1.w.exp_avg_sq"
    local line = text:match("\n(" .. name:gsub("%.", "%%.") .. " x16 %d+ [^\n]*)")
    assert.is_not_nil(line)
    local first = line:match("^%S+ %S+ %d+ (%x+)")
    local v = tonumber(first, 16)
    local flipped = string.format("%x", v % 2 == 0 and v + 1 or v - 1)
    local changed = line:gsub("^(%S+ %S+ %d+ )%x+", "%1" .. flipped)
    local path = os.tmpname()
    S.write_file(path, (text:gsub(line:gsub("%p", "%%%0"), (changed:gsub("%%", "%%%%")), 1)))
    local r = S.run({ "-n", "4", "tests/lua/scripts/reference_adamw.lua", "fsdp4", path })
    os.remove(path)
    assert.equal(1, r.code)
    assert.matches("rank 2: exp_avg_sq 1 of %d+ values differ", r.out)
    assert.matches("rank 2: first exp_avg_sq difference: " .. name .. string.format("[0]: moonshard 0x%04x (", v),
      r.out, 1, true)
    assert.matches("rank 2: fsdp4 differs from torch", r.err, 1, true)
    for _, rank in ipairs({ 0, 1, 3 }) do assert.matches("rank " .. rank .. ": reference_adamw fsdp4 ok", r.out, 1, true) end
  end)
end)
