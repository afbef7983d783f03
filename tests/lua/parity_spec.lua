-- parity_spec.lua: the planner gives the same bytes under Lua 5.4 (moonshard) and LuaJIT
-- (moonshard-jit): the plan JSON, the table, the audit, the SVG and the errors, for every
-- built-in builder, on 1-D FSDP, HSDP and expert-parallel meshes, with the shipped policies.
local S = require "support"

local INKLING2 = "policies/inkling2"
local FSDP2 = "policies/fsdp2_default.lua"

-- { config, mesh, policy }: plans that succeed
local PLANS = {
  { "tests/lua/configs/inkling2_tiny.json", "dp_shard=4", INKLING2 },
  { "tests/lua/configs/inkling2_tiny.json", "dp_replicate=2,dp_shard=2,ep=4", INKLING2 },
  { "tests/lua/configs/inkling2_tiny.json", "dp_replicate=2,dp_shard=2,cp=2", INKLING2 },
  { "examples/configs/inkling2_16b.json", "dp_replicate=2,dp_shard=16,ep=8", INKLING2 },
  { "examples/configs/deepseek_v3.json", "dp_shard=64,ep=64", INKLING2 },
  { "examples/configs/qwen3_30b_a3b.json", "dp_replicate=2,dp_shard=8,ep=16", FSDP2 },
  { "examples/configs/mixtral_8x7b.json", "dp_replicate=2,dp_shard=4,ep=8", FSDP2 },
  { "examples/configs/llama3.1_8b.json", "dp_replicate=4,dp_shard=8", "policies/by_dtype.lua" },
  { "examples/configs/llama3.1_8b.json", "dp_shard=7", "policies/full_fp32.lua" },
}

-- { config, mesh, policy }: plans the planner refuses, with the same message
local REFUSED = {
  { "tests/lua/configs/inkling2_tiny.json", "dp_shard=8,ep=3", INKLING2 },
  { "tests/lua/configs/inkling2_tiny.json", "dp_replicate=2,dp_shard=3,ep=2", FSDP2 },
  { "examples/configs/inkling2_small.json", "dp_shard=4", FSDP2 },
  { "examples/configs/mixtral_8x7b.json", "dp_shard=8,ep=8", INKLING2 },
}

-- what each plan is asked to print
local OUTPUTS = { { "--json" }, {}, { "--audit" }, { "--json", "--audit" } }

local function plan_args(case, extra)
  local args = { "plan", "--config", case[1], "--mesh", case[2], "--policy", case[3] }
  for _, a in ipairs(extra) do args[#args + 1] = a end
  return args
end

-- nil when a and b are the same bytes, else where they first differ, line by line
local function first_difference(a, b)
  if a == b then return nil end
  local line, pos = 1, 1
  while true do
    local ea, eb = a:find("\n", pos, true), b:find("\n", pos, true)
    local la, lb = a:sub(pos, ea or #a), b:sub(pos, eb or #b)
    if la ~= lb then
      return ("line %d:\n  lua5.4: %s\n  luajit: %s"):format(line, la:sub(1, 300), lb:sub(1, 300))
    end
    pos, line = (ea or #a) + 1, line + 1
  end
end

-- runs the same plan under both executables; checks the exit status, stdout and stderr match
local function same_under_both(args)
  local a, b = S.run_with(S.lua54_bin, args), S.run_with(S.jit_bin, args)
  local what = table.concat(args, " ")
  assert(a.code == b.code, ("%s: exit status %d under Lua 5.4, %d under LuaJIT\n%s"):format(what, a.code, b.code, b.err))
  local diff = first_difference(a.out, b.out)
  assert(not diff, what .. ": stdout differs at " .. tostring(diff))
  diff = first_difference(a.err, b.err)
  assert(not diff, what .. ": stderr differs at " .. tostring(diff))
  return a
end

describe("plans under Lua 5.4 and LuaJIT", function()
  if not S.jit_bin then
    pending("moonshard-jit was not built (LuaJIT not found; MOONSHARD_JIT_BIN unset): nothing to compare")
    return
  end

  for _, case in ipairs(PLANS) do
    it("are the same bytes: " .. table.concat(case, " "), function()
      for _, extra in ipairs(OUTPUTS) do
        local r = same_under_both(plan_args(case, extra))
        assert.equal(0, r.code, r.err)
        assert.is_true(#r.out > 0)
      end
    end)
  end

  for _, case in ipairs(REFUSED) do
    it("are refused with the same message: " .. table.concat(case, " "), function()
      local r = same_under_both(plan_args(case, { "--json" }))
      assert.equal(1, r.code)
      assert.matches("^moonshard plan: ", r.err)
    end)
  end

  -- the policy's offload_policy option set by a script (plan's opts.options)
  it("are the same bytes with every unit offloaded to the host (offload_policy)", function()
    local code = [[
      local json = require "moonshard.json"
      local f = assert(io.open("tests/lua/configs/inkling2_tiny.json"))
      local config = json.decode(f:read("a"))
      f:close()
      local policy = require("moonshard.policy").load("policies/inkling2")
      local plan = require("moonshard.plan").plan(require("moonshard.models").from_config(config, "tiny"),
        require("moonshard.mesh_context").new("dp_replicate=2,dp_shard=3"), policy.shard_units,
        { options = { offload_policy = "cpu" } })
      local report = require "moonshard.plan_report"
      io.write(report.to_json(plan), report.to_text(plan))
    ]]
    local r = same_under_both({ "-e", code })
    assert.equal(0, r.code, r.err)
    assert.matches('"offload_policy":"cpu"', r.out)
    assert.matches("offloaded to host memory", r.out)
  end)

  it("draw the same SVG", function()
    local files = { os.tmpname(), os.tmpname() }
    for i, bin in ipairs({ S.lua54_bin, S.jit_bin }) do
      local r = S.run_with(bin, plan_args(PLANS[2], { "--svg", files[i] }))
      assert.equal(0, r.code, r.err)
    end
    local svg = {}
    for i, path in ipairs(files) do
      local f = assert(io.open(path, "rb"))
      svg[i] = f:read("a")
      f:close()
      os.remove(path)
    end
    assert.matches("^<svg", svg[1])
    local diff = first_difference(svg[1], svg[2])
    assert(not diff, "the SVG differs at " .. tostring(diff))
  end)
end)
