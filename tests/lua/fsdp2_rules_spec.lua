-- fsdp2_rules_spec.lua: the planner's mixed-precision rule (plan.effective_dtypes, what every
-- plan's gather and reduce columns come from) against tests/data/fsdp2_rules.txt, the table
-- the shard units are checked against too (tests/c/test_fsdp2_rules.c).
local planner = require "moonshard.plan"
local S = require "support"

local PATH = "tests/data/fsdp2_rules.txt"

local function rows()
  local out = {}
  for line in S.read_file(PATH):gmatch("[^\n]+") do
    if not line:match("^#") then
      local s, p, r, arrow, g, rd = line:match("^(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s*$")
      assert(arrow == "->", "a row of " .. PATH .. " is not 'stored param reduce -> gathered reduced': " .. line)
      local function opt(x) if x ~= "-" then return x end end
      out[#out + 1] = { line = line, stored = s, mp = { param_dtype = opt(p), reduce_dtype = opt(r) },
        gather = g, reduce = opt(rd) }
    end
  end
  return out
end

describe("the planner's mixed-precision rule", function()
  it("gives every row of " .. PATH, function()
    local n = 0
    for _, row in ipairs(rows()) do
      local gather, reduce = planner.effective_dtypes(row.stored, row.mp)
      assert.same({ row.gather, row.reduce }, { gather, reduce }, row.line)
      n = n + 1
    end
    assert.is_true(n >= 19, n)
  end)

  it("is what a plan's units say they gather and reduce in", function()
    local module = require "moonshard.module"
    local mesh_context = require "moonshard.mesh_context"
    for _, row in ipairs(rows()) do
      local root = module.new("Root")
      root:add("a", module.new("Linear")):param("w", { 4, 4 }, row.stored)
      local plan = planner.plan(root, mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
        ctx:fully_shard("a", { mp_policy = row.mp })
        ctx:fully_shard(ctx.model)
      end })
      local u = plan.units[1]
      assert.equal(row.gather, u.gather_dtype == "bytes" and row.stored or u.gather_dtype, row.line)
      if row.reduce then assert.equal(row.reduce, u.reduce_dtype_eff, row.line) end
    end
  end)
end)
