-- hostile_spec.lua: policies written to escape the sandbox, run through the executable
-- under test (moonshard under Lua 5.4, moonshard-jit under LuaJIT), each a file of
-- tests/lua/policies/hostile/.  Every escape ends promptly with exit status 1 and a message
-- naming the policy file, and nothing of the secret files it reaches for shows in the
-- output; every attempt to falsify the plan leaves the plan exactly the clean policy's.
-- Each new hole found gets a file here.
local S = require "support"

local SRC = "tests/lua/policies/hostile"
local CONFIG = "examples/configs/llama3.1_8b.json"
local SECRET = "/tmp/moonshard_hostile_secret"
-- small limits, so that a probe that must run into them does so quickly
local LIMITS = { "--policy-instructions", "50000000", "--policy-memory", "64", "--policy-seconds", "3" }

local dir, marker

local MOE = { "examples/configs/qwen3_30b_a3b.json", "dp_shard=8,ep=4" }

-- name: a file of the directory (name.lua) or, ending in "/", a directory of it; moe: plan
-- Qwen3-30B-A3B on dp_shard=8, ep=4 instead of Llama-3.1-8B on dp_shard=8
local function policy_path(name)
  return name:sub(-1) == "/" and dir .. "/" .. name:sub(1, -2) or dir .. "/" .. name .. ".lua"
end

local function plan(name, extra, moe)
  local args = { "plan", "--config", moe and MOE[1] or CONFIG, "--mesh", moe and MOE[2] or "dp_shard=8",
    "--policy", policy_path(name) }
  for _, a in ipairs(LIMITS) do args[#args + 1] = a end
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  return S.run(args)
end

setup(function()
  dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. S.quote(dir) .. " && cp -R " .. SRC .. "/. " .. S.quote(dir)))
  marker = string.format("SECRET-%d-%d", os.time(), math.random(1, 1e9))
  -- beside the policies (a file that is not Lua source) and at a fixed absolute path
  for _, path in ipairs({ SECRET, dir .. "/moonshard_hostile_secret" }) do
    local f = assert(io.open(path, "wb"))
    f:write("return '" .. marker .. "'\n" .. marker .. "\n")
    f:close()
  end
end)

teardown(function()
  os.execute("rm -rf " .. S.quote(dir))
  os.remove(SECRET)
end)

-- exit 1, promptly, the message naming the policy file (and matching `expect`), no secret
local function refused(name, expect, moe)
  local r = plan(name, nil, moe)
  local file = policy_path(name)
  assert.equal(1, r.code, name .. ": " .. r.err)
  assert.equal("", r.out, name)
  assert.truthy(r.err:find(file, 1, true), name .. " does not name its file: " .. r.err)
  if type(expect) == "string" then expect = { expect } end
  if expect then
    local found = false
    for _, e in ipairs(expect) do found = found or r.err:find(e, 1, true) ~= nil end
    assert.is_true(found, name .. ": " .. r.err)
  end
  assert.is_nil(r.err:find(marker, 1, true), name .. " leaked the secret")
  assert.is_true(r.seconds <= 20, name .. " took " .. r.seconds .. " s")
  return r
end

describe("a hostile policy cannot read files", function()
  it("through the helper module it may require", function()
    refused("leak_util", "attempt to call")
  end)
  it("through require of a path, a NUL, a library module, a standard library or a file that is not Lua", function()
    refused("leak_require_path", "not a policy file's name")
    refused("leak_require_nul", 'require "clean\\0": not a policy file\'s name')
    refused("leak_require_lib", 'require "moonshard.safetensors": not a policy file\'s name')
    refused("leak_require_io", "require 'io': no io.lua in " .. dir .. " or the shipped policies")
    refused("leak_require_stem", "require 'moonshard_hostile_secret': no moonshard_hostile_secret.lua")
  end)
end)

describe("policy code the planner calls runs in the policy's budget", function()
  it("shard_placement_fn: a loop, a memory bomb, a value that is no dim", function()
    refused("spf_loop", "instruction budget of 50000000 exceeded")
    -- bounded by the cap, or on a loaded machine (sanitizers, other jobs) by the clock first
    refused("spf_alloc", { "memory cap of 64 MiB exceeded", "time limit of 3 s exceeded" })
    refused("spf_value", "shard_placement_fn returned a table for parameter")
  end)
  it("values handed to the planner are checked, so none of their metamethods runs later", function()
    refused("warn_meta", "ctx:warn takes a string, got a table")
    refused("mp_meta", "mp_policy.param_dtype is a table; expected a string")
    refused("mesh_meta", "mesh[1] is a table; expected a string")
    refused("ignored_fake", "ignored_params: expected a parameter of ctx.model, got a table that is not one")
    refused("module_fake", "ctx:fully_shard: expected a module of ctx.model or a module's dotted name")
    refused("entry_meta", "no file returns a table with parallelize(ctx)")
  end)
end)

describe("a hostile policy cannot get a false plan accepted", function()
  local clean
  setup(function()
    local r = plan("clean", { "--json" })
    assert.equal(0, r.code, r.err)
    clean = r.out
  end)
  for _, name in ipairs({ "ctx_tamper", "unit_tamper", "tree_tamper", "class_tamper", "mesh_tamper",
                          "prefetch_meta", "after_return", "string_tamper" }) do
    it(name .. " plans exactly what the clean policy plans", function()
      local r = plan(name, { "--json" })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      assert.equal(clean, r.out)
    end)
  end
end)

describe("a policy's options, prefetch, layer choice and log", function()
  it("run none of its metamethods (options_meta)", function()
    local r = plan("options_meta", { "--json" })
    assert.equal(0, r.code, r.err)
    assert.equal("policy " .. policy_path("options_meta") .. ": {knob = 1} {}\n", r.err)
    assert.matches('"options":{"knob":1}', r.out, 1, true)
    assert.matches('"prefetch":{"forward":2,"backward":1}', r.out, 1, true)
    assert.matches('"checkpointed":["model.layers.15","model.layers.31"]', r.out, 1, true)
  end)
  it("and the tables ctx:pipeline and ctx:tensor_parallel take run none of their metamethods (split_meta)", function()
    local args = { "plan", "--config", CONFIG, "--mesh", "pp=2,dp_shard=2,tp=2", "--policy", policy_path("split_meta"),
      "--json" }
    for _, a in ipairs(LIMITS) do args[#args + 1] = a end
    local r = S.run(args)
    assert.equal(0, r.code, r.err)
    local j = require("moonshard.json").decode(r.out, "plan")
    assert.same({ 2, 64 }, { j.tensor_parallel.size, j.tensor_parallel.params })
    -- the planner's stages, not the policy's changed copies
    assert.same({ 0, 16 }, { j.pipeline.stages[1].index, j.pipeline.stages[2].layers.count })
    assert.equal("model.embed_tokens", j.pipeline.stages[1].modules[1])
    assert.equal(34, #j.units)
  end)
  it("and the options ctx:replicate takes run none of their metamethods (replicate_meta)", function()
    local r = plan("replicate_meta", { "--json" })
    assert.equal(0, r.code, r.err)
    local j = require("moonshard.json").decode(r.out, "plan")
    assert.equal(1, #j.units)
    assert.equal("replicate", j.units[1].kind)
    assert.equal(1, j.units[1].ddp.bucket_cap_mb)
  end)
  it("a device profile's table is read raw: none of its metamethods runs", function()
    local dev = S.write_file(os.tmpname() .. ".lua", "local spin = { __index = function() while true do end end, " ..
      "__pairs = function() while true do end end }\nreturn setmetatable({}, spin)\n")
    local args = { "plan", "--config", CONFIG, "--mesh", "dp_shard=8", "--policy", "policies/fsdp2_default.lua",
      "--device", dev }
    for _, a in ipairs(LIMITS) do args[#args + 1] = a end
    local r = S.run(args)
    assert.equal(1, r.code)
    assert.matches("device profile " .. dev .. ": has no memory_bytes", r.err, 1, true)
    os.remove(dev)
  end)
  it("print a bounded log however often it is called (log_flood)", function()
    local r = plan("log_flood")
    assert.equal(0, r.code, r.err:sub(-300))
    local planner = require "moonshard.plan"
    local prefix = "policy " .. policy_path("log_flood") .. ": "
    assert.is_true(#r.err < planner.LOG_TOTAL_BYTES + 60 * (#prefix + 10) + 200, #r.err)
    assert.matches("ctx:log: the 65536 bytes a plan may print are spent; later lines are dropped%)\n$", r.err)
  end)
end)

describe("what a tester found, each held now", function()
  it("a later file of a directory swaps parallelize for a loop: it runs in the budget", function()
    refused("dir_replace/", "instruction budget of 50000000 exceeded")
  end)
  it("files that each keep most of the cap keep no more than the cap together", function()
    refused("dir_keep/", "files keep")
  end)
  it("C loops of the table library and string counts are charged before they run", function()
    refused("table_move", "table.move of 1000000000000 elements")
    refused("rep_string_count", "string.rep of 100000000000000000 copies")
    refused("concat_string_bounds", { "instruction budget of 50000000 exceeded", "memory cap of 64 MiB exceeded",
      "time limit of 3 s exceeded" })
    refused("concat_bad_bound", "bad argument #3 to 'concat'")
    refused("sort_big", "table.sort of 2000000 elements")
    if not jit then refused("len_insert", "table.insert: a table whose metatable has __len is refused") end
  end)
  it("errors name the policy: a host function as parallelize, a message posing as the library's, a deep value", function()
    refused("host_parallelize", "error object (a table) is not a string")
    refused("spoof_error", "spoof_error.lua:3: moonshard: config")
    local r = plan("deep_return")
    assert.equal(0, r.code, r.err) -- walked without recursion
  end)
  it("units whose meshes leave data-parallel replicas unreduced, experts that are not, late wrapping", function()
    refused("mesh_size_one", "over 1 rank (mesh {cp}), but the parameter lives on 8 data-parallel ranks")
    refused("ep_shard_dense", "over 2 ranks (mesh {ep_shard}), but the parameter lives on 8 data-parallel ranks", true)
    refused("ep_dense", "expert_parallel(<root>): the module is a LlamaForCausalLM, not grouped experts")
    refused("checkpoint_after", "checkpoint_wrap(model.layers) after fully_shard(model.layers.0)")
    refused("ep_label", "by is a label for the plan", true)
  end)
  it("a warning cannot forge lines of the report", function()
    local r = plan("warn_forge")
    assert.equal(0, r.code, r.err)
    assert.truthy(r.out:find("fine\\x0Amemory per rank (every rank alike): params 1.9 GiB\\x1B[2K\\x1B[1A", 1, true),
      r.out)
    assert.is_nil(r.out:find("\27", 1, true))
  end)
end)

describe("runaway policies end with an error naming the policy", function()
  it("recursion through C (gsub, sort) and in Lua", function()
    refused("gsub_recursion", "string.gsub: replacements nest more than 100 deep")
    refused("sort_recursion", "stack overflow")
    -- 200,000 frames deep: on a loaded machine the time limit may come first
    refused("lua_recursion", { "stack overflow", "time limit of 3 s exceeded" })
  end)
  it("work in C that the instruction count does not see, bounded by the time limit", function()
    refused("concat_time", "time limit of 3 s exceeded")
  end)
  it("memory, within the cap", function()
    refused("memory_concat", "memory cap of 64 MiB exceeded")
    refused("memory_table", "memory cap of 64 MiB exceeded")
    -- LuaJIT interns the string it builds again and again: time, not memory, ends it there
    local r = plan("concat_interned")
    assert.equal(1, r.code)
    assert.truthy(r.err:find("memory cap of 64 MiB exceeded", 1, true) or r.err:find("time limit of 3 s", 1, true),
      r.err)
  end)
end)

-- A recipe's code (moonshard.recipe: the file, and fp8.module_filter, the one function it
-- hands back) runs in the same sandbox, under the CLI's limits.
describe("hostile recipes end with an error naming the recipe", function()
  local function recipe_plan(text)
    local path = os.tmpname() .. ".lua"
    S.write_file(path, text)
    local args = { "plan", "--config", CONFIG, "--recipe", path, "--policy-instructions", "1000000",
      "--policy-seconds", "3" }
    local r = S.run(args)
    os.remove(path)
    return r, path
  end
  it("a runaway file, a runaway module_filter, io and os out of reach", function()
    local r, path = recipe_plan("while true do end")
    assert.equal(1, r.code)
    S.assert_has(r.err, "recipe " .. path)
    S.assert_has(r.err, "instruction budget")
    r = recipe_plan("return { distributed = { dp_size = 8 }, fp8 = { enabled = true, " ..
      "module_filter = function() while true do end end } }")
    assert.equal(1, r.code)
    S.assert_has(r.err, "fp8.module_filter: failed for model.layers.0.self_attn.q_proj")
    S.assert_has(r.err, "instruction budget")
    r = recipe_plan("return { peft = { dim = io.open('/etc/passwd'):read('a') } }")
    assert.equal(1, r.code)
    assert.is_nil(r.err:find("root:", 1, true))
  end)
  it("values handed back run none of their metamethods", function()
    local r = recipe_plan([[
local boom = { __index = function() error("ran __index") end, __eq = function() error("ran __eq") end,
  __tostring = function() error("ran __tostring") end, __len = function() error("ran __len") end }
return setmetatable({ distributed = setmetatable({ dp_size = 8 }, boom),
  fp8 = { enabled = true, module_filter = function() return setmetatable({}, boom) end } }, boom)]])
    assert.equal(1, r.code)
    assert.is_nil(r.err:find("ran __", 1, true), r.err)
    S.assert_has(r.err, "fp8.module_filter: returned a table for model.layers.0.self_attn.q_proj; expected true or false")
  end)
end)
