-- policy_spec.lua: the policy loader's sandbox and budget, against the fixture policies in
-- tests/lua/policies (good ones, and evil or broken ones that must fail with clear errors).
local policy = require "moonshard.policy"
local S = require "support"

local F = "tests/lua/policies/"
-- small budgets so a runaway policy fails in milliseconds
local FAST = { instructions = 1e6, memory_mb = 16 }
local MODULES = { ["moonshard.module"] = require "moonshard.module" }

local function load_fast(path, opts)
  local o = { instructions = FAST.instructions, memory_mb = FAST.memory_mb, modules = MODULES }
  for k, v in pairs(opts or {}) do o[k] = v end
  return policy.load(path, o)
end

-- the error message of f(...), which must fail
local function failure(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

-- the line of `file` that contains `text` (plain), so the specs do not hard-code lines
local function line_of(file, text)
  local n = 0
  for line in io.lines(file) do
    n = n + 1
    if line:find(text, 1, true) then return n end
  end
  error("no '" .. text .. "' in " .. file)
end

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute("mkdir '" .. d .. "'"))
  return d
end

local function rmdir(d) os.execute("rm -rf '" .. d .. "'") end

local function seconds(f)
  local t0 = os.clock()
  f()
  return os.clock() - t0
end

describe("a policy directory", function()
  local p = load_fast(F .. "good")

  it("maps each file's stem to what it returned", function()
    assert.same({ "attn_query", "mlp_query", "output_query", "q_l2_clip", "rel_l2_clip", "gate" },
                p.fp32_modules)
    assert.equal("bf16", p.precision.default.param_dtype)
    assert.same({ F .. "good/fp32_modules.lua", F .. "good/precision.lua", F .. "good/shard_units.lua" },
                p.files)
    assert.is_nil(p.main)
    local stems = {}
    for stem in pairs(p) do stems[#stems + 1] = stem end
    table.sort(stems)
    assert.same({ "fp32_modules", "precision", "shard_units" }, stems)
  end)

  it("loads each file once, shared by the files that require it", function()
    assert.equal(p.fp32_modules, p.shard_units.fp32)
  end)

  it("gives functions that work across files that require each other", function()
    local units = p.shard_units.build({ "model.layers.0.attn_query", "model.layers.0" })
    assert.same({ "fp32_island", "module" }, { units[1].kind, units[2].kind })
    assert.equal("f32", units[1].precision.param_dtype)
    assert.equal(p.precision.default, units[2].precision)
    assert.is_true(p.shard_units.is_fp32("model.output_query"))
  end)

  it("requires the allowed host modules and no others", function()
    assert.equal(24, p.shard_units.numel({ 4, 6 }))
    local err = failure(policy.load, F .. "good", { modules = {} })
    assert.matches("moonshard: policy " .. F .. "good/shard_units.lua:"
                   .. line_of(F .. "good/shard_units.lua", 'require "moonshard.module"')
                   .. ': require "moonshard.module": not a policy file\'s name (the stem of a .lua file: letters, ' ..
                   "digits, '_' and '-') nor an allowed module (none)",
                   err, 1, true)
  end)

  it("runs every returned function under a fresh budget per call", function()
    local sum = p.shard_units.nested.deeper.sum
    -- 20 calls of ~6e5 instructions each: over the 1e6 budget together, not one by one
    for _ = 1, 20 do assert.equal(5000050000, sum(1e5)) end
    assert.matches("moonshard: policy " .. F .. "good/shard_units.lua: instruction budget of 1000000 exceeded %(an infinite loop%?%) at line %d+",
                   failure(sum, 1e7))
    local counter = p.shard_units.counter()
    assert.equal(1, counter())
    assert.equal(2, counter())
  end)

  it("describes its files and the kind of value each returned", function()
    local text = p.describe()
    assert.equal(text, policy.describe(p))
    assert.matches("policy " .. F .. "good: 3 files", text, 1, true)
    assert.matches("fp32_modules.lua: list of 6 strings", text, 1, true)
    assert.matches("precision.lua: table {default = table of 3 keys, for_module = function, fp32_island = table of 3 keys}",
                   text, 1, true)
    assert.matches("shard_units.lua: table {build = function, counter = function, fp32 = list of 6 strings", text, 1, true)
  end)

  it("describes a policy without running its metamethods (outside any call, with no budget)", function()
    local path = os.tmpname()
    local f = assert(io.open(path, "wb"))
    f:write("local function spin() while true do end end\n" ..
            "local key = setmetatable({}, { __tostring = spin, __lt = spin, __concat = spin })\n" ..
            "return setmetatable({ [key] = 1, [{}] = 2, name = 'x' }, { __index = spin, __pairs = spin })\n")
    f:close()
    local loaded = policy.load(path)
    os.remove(path)
    assert.matches(": table {name = string, table = number, table = number}", loaded.describe(), 1, true)
  end)

  it("reports a circular require while loading", function()
    assert.matches("moonshard: policy " .. F .. "circular/a.lua: circular require of 'a' while it loads",
                   failure(load_fast, F .. "circular"), 1, true)
  end)

  it("is read from disk again on every load", function()
    local d = tmpdir()
    for _, name in ipairs({ "fp32_modules.lua", "precision.lua", "shard_units.lua" }) do
      write(d .. "/" .. name, read(F .. "good/" .. name))
    end
    assert.is_false(load_fast(d).shard_units.is_fp32("model.layers.3.mlp.up_proj"))
    write(d .. "/fp32_modules.lua", 'return { "up_proj" }\n')
    local edited = load_fast(d)
    rmdir(d)
    assert.is_true(edited.shard_units.is_fp32("model.layers.3.mlp.up_proj"))
    assert.is_false(edited.shard_units.is_fp32("model.layers.3.attn_query"))
  end)
end)

describe("a single-file policy", function()
  it("is {stem = value} with main = the value", function()
    local p = load_fast(F .. "single.lua")
    assert.equal(p.single, p.main)
    assert.equal("bf16", p.main.param_dtype)
    assert.is_true(p.main.reshard_after_forward(1, 4))
    assert.is_false(p.main.reshard_after_forward(4, 4))
    assert.matches("single.lua: table {param_dtype = string, reduce_dtype = string, reshard_after_forward = function}",
                   p.describe(), 1, true)
  end)

  it("may require the files beside it", function()
    local d = tmpdir()
    write(d .. "/helper.lua", "return { dtype = 'bf16' }\n")
    write(d .. "/main.lua", "local h = require 'helper'\nreturn { dtype = function() return h.dtype end }\n")
    local p = load_fast(d .. "/main.lua")
    rmdir(d)
    assert.equal("bf16", p.main.dtype())
    assert.is_nil(rawget(p, "helper"))
  end)
end)

describe("the entry point", function()
  it("is the table with parallelize: the single file's, shard_units.lua's, else the one file's", function()
    local d = tmpdir()
    write(d .. "/precision.lua", "return { param_dtype = 'bf16' }\n")
    write(d .. "/units.lua", "return { prefetch = { forward = 3 }, parallelize = function(ctx) return 'units' end }\n")
    local p = load_fast(d)
    -- the host's table: the policy's prefetch, and its parallelize called under its budget
    local entry = policy.entry_point(p, d)
    assert.equal("units", entry.parallelize())
    assert.equal(p.units.prefetch, entry.prefetch)
    write(d .. "/other.lua", "return { parallelize = function(ctx) end }\n")
    assert.equal("moonshard: policy " .. d .. ": more than one file has parallelize(ctx) (other.lua, units.lua): " ..
      "name one with --policy, or make it shard_units.lua", failure(policy.entry_point, load_fast(d), d))
    -- shard_units.lua first, also before a main.lua (a file's stem, not the single file's)
    write(d .. "/shard_units.lua", "return { parallelize = function(ctx) return 'shard_units' end }\n")
    write(d .. "/main.lua", "return { parallelize = function(ctx) return 'main' end }\n")
    p = load_fast(d)
    assert.equal("shard_units", policy.entry_point(p, d).parallelize())
    -- a later file that puts a function of its own into the entry table: still budgeted
    write(d .. "/zz.lua", "local su = require 'shard_units'\n" ..
      "su.parallelize = function(ctx) while true do end end\nreturn true\n")
    p = load_fast(d)
    assert.matches("^moonshard: policy " .. d .. "/zz.lua: instruction budget of %d+ exceeded",
      failure(policy.entry_point(p, d).parallelize))
    -- a host function as parallelize runs for the policy, its error naming the policy
    os.remove(d .. "/zz.lua")
    write(d .. "/shard_units.lua", "return { parallelize = error }\n")
    p = load_fast(d)
    assert.matches("^moonshard: policy " .. d .. ": error object %(a table%) is not a string",
      failure(policy.entry_point(p, d).parallelize, {}))
    rmdir(d)
    local single = load_fast(F .. "single.lua")
    assert.equal("moonshard: policy " .. F .. "single.lua: no file returns a table with parallelize(ctx) " ..
      "(shard_units.lua usually does)", failure(policy.entry_point, single, F .. "single.lua"))
  end)
end)

describe("the budget", function()
  it("ends an infinite loop while loading, naming the file and line", function()
    local err
    assert.is_true(seconds(function() err = failure(load_fast, F .. "evil/loop_at_load.lua") end) < 5)
    assert.equal("moonshard: policy " .. F .. "evil/loop_at_load.lua: instruction budget of 1000000 exceeded (an infinite loop?) at line "
                 .. line_of(F .. "evil/loop_at_load.lua", "while true"), err)
  end)

  local loops = load_fast(F .. "evil/loops.lua").main
  local spin_line = line_of(F .. "evil/loops.lua", "local function spin")
  local budget_error = "moonshard: policy " .. F .. "evil/loops.lua: instruction budget of 1000000 exceeded (an infinite loop?) at line "

  it("ends an infinite loop in a returned function, also one in a nested table", function()
    assert.equal(budget_error .. spin_line, failure(loops.spin))
    assert.equal(budget_error .. line_of(F .. "evil/loops.lua", "deeper = { spin"), failure(loops.nested.deeper.spin))
  end)

  it("ends a closure a policy function returned", function()
    assert.equal(budget_error .. spin_line, failure(loops.closure()))
  end)

  it("cannot be caught by the policy's own pcall or xpcall", function()
    for _, name in ipairs({ "pcall_spin", "retry_spin", "xpcall_spin", "handler_spin" }) do
      local err
      assert.is_true(seconds(function() err = failure(loops[name]) end) < 5, name)
      assert.equal(budget_error .. spin_line, err, name)
    end
  end)

  it("covers an error object's __tostring, which runs as the error leaves the call", function()
    assert.equal(budget_error .. spin_line, failure(loops.error_object))
  end)

  it("counts a host callback the policy calls, and keeps its errors as they are", function()
    -- LuaJIT runs compiled host code without calling hooks: only interpreted host code counts
    local function host_spin() while true do end end
    if jit then jit.off(host_spin) end
    assert.equal("moonshard: policy " .. F .. "evil/loops.lua: instruction budget of 1000000 exceeded (an infinite loop?) at line "
                 .. line_of(F .. "evil/loops.lua", "callback ="),
                 failure(loops.callback, host_spin))
    -- a tail call leaves no frame of the policy function: the error names its file only
    assert.equal("moonshard: policy " .. F .. "evil/loops.lua: instruction budget of 1000000 exceeded (an infinite loop?)",
                 failure(loops.tail_callback, host_spin))
    -- an error the host raised for the policy names the policy line that called it
    assert.equal("moonshard: policy " .. F .. "evil/loops.lua:" .. line_of(F .. "evil/loops.lua", "callback =") ..
                 ": host says no", failure(loops.callback, function() error("host says no", 0) end))
    assert.equal(42, loops.callback(function() return 42 end))
  end)

  it("restores the previous hook and the string metatable after every call", function()
    local function mine() end
    debug.sethook(mine, "", 1e9)
    pcall(loops.spin)
    local h, mask, count = debug.gethook()
    debug.sethook()
    assert.equal(mine, h)
    assert.equal("", mask)
    assert.equal(1e9, count)
    assert.is_nil(debug.gethook())
    pcall(loops.spin)
    assert.is_nil(debug.gethook())
    assert.equal(string, getmetatable("").__index)
  end)

  -- instructions to spare: the memory cap must be what stops these
  local mem = load_fast(F .. "evil/memory.lua", { instructions = 1e9 }).main
  local mem_error = "moonshard: policy " .. F .. "evil/memory.lua: memory cap of 16 MiB exceeded"

  it("caps one string.rep, called as a function or as a method", function()
    assert.equal(mem_error .. " (string.rep of 1000000000 bytes) at line " .. line_of(F .. "evil/memory.lua", "rep = function"),
                 failure(mem.rep))
    assert.equal(mem_error .. " (string.rep of 1000000000 bytes) at line " .. line_of(F .. "evil/memory.lua", "method_rep ="),
                 failure(mem.method_rep))
    assert.matches(mem_error .. " (string.rep of 299999997 bytes)", failure(mem.rep_sep), 1, true)
    assert.equal(1020, mem.small())
    -- Lua 5.4 would copy "" 1e15 times
    assert.equal("moonshard: policy " .. F .. "evil/memory.lua: instruction budget of 1000000000 exceeded"
                 .. " (string.rep of 1000000000000000 copies) at line " .. line_of(F .. "evil/memory.lua", "empty_rep ="),
                 failure(mem.empty_rep))
  end)

  it("ends a loop growing a table, also under the policy's own pcall", function()
    local grow_line = line_of(F .. "evil/memory.lua", "while true")
    local err
    assert.is_true(seconds(function() err = failure(mem.grow) end) < 5)
    assert.equal(mem_error .. " at line " .. grow_line, err)
    assert.equal(mem_error .. " at line " .. grow_line, failure(mem.pcall_grow))
  end)

  it("ends `..` doubling a string between two checks of the hook", function()
    local err
    assert.is_true(seconds(function() err = failure(mem.double) end) < 5)
    assert.equal(mem_error .. " at line " .. line_of(F .. "evil/memory.lua", "double ="), err)
  end)

  it("caps what table.concat, string.gsub and string.format would build, before they build it", function()
    local function at(text) return " at line " .. line_of(F .. "evil/memory.lua", text) end
    assert.equal(mem_error .. " (table.concat of 67108864 bytes)" .. at("concat ="), failure(mem.concat))
    assert.equal(mem_error .. " (table.concat of 19922984 bytes)" .. at("concat_sep ="), failure(mem.concat_sep))
    assert.equal(mem_error .. " (string.gsub of 20021000 bytes)" .. at("gsub ="), failure(mem.gsub))
    assert.equal(mem_error .. " (string.format of 17827509 bytes)" .. at("format ="), failure(mem.format))
    assert.equal(18, mem.builders())
    assert.equal("moonshard: policy " .. F .. "evil/memory.lua:" .. line_of(F .. "evil/memory.lua", "pack =")
                 .. ": string.pack is not available (one call can build gigabytes the memory cap cannot see)",
                 failure(mem.pack))
  end)

  it("checks the memory a call holds as it returns", function()
    collectgarbage()
    -- the host's string.rep builds it in one step, unseen by the hook
    local err = failure(mem.keep, string.rep, "y", 20 * 2 ^ 20)
    assert.matches("^" .. mem_error:gsub("%p", "%%%0") .. " %(%d+ MiB more in use as the call returned%)$", err)
  end)

  -- The moonshard executable, not this interpreter: only moonshard's own Lua 5.4 states run
  -- on the counting allocator that makes the cap hard (a stock lua5.4 loading core.so does
  -- not, and LuaJIT takes no allocator of the host's, so moonshard-jit and both busted runs
  -- give the messages the tests above expect).  Under that cap Lua refuses the allocation
  -- that would pass it and raises "not enough memory" without running a message handler:
  -- the stack is gone, so the error names the policy file but no line, and it ends the call
  -- before the return-time check could ("MiB more in use as the call returned").
  it("ends memory bombs in the Lua 5.4 executable with its hard cap (no line known)", function()
    local file = F .. "evil/memory.lua"
    local code = 'local p = require("moonshard.policy").load("' .. file .. '", { memory_mb = 16, instructions = 1e9 })'
                 .. ' for _, k in ipairs({ "grow", "pcall_grow", "double", "small", "rep" }) do'
                 .. '   io.write(k, "=", tostring(select(2, pcall(p.main[k]))), "\\n") end'
                 .. ' io.write("keep=", select(2, pcall(p.main.keep, string.rep, "y", 20 * 2 ^ 20)), "\\n")'
    local r = S.run_with(S.lua54_bin, { "-e", code })
    assert.equal(0, r.code, r.err)
    local got = {}
    for k, v in r.out:gmatch("([%w_]+)=([^\n]*)") do got[k] = v end
    for _, k in ipairs({ "grow", "pcall_grow", "double", "keep" }) do assert.equal(mem_error, got[k], k) end
    assert.equal("1020", got.small)
    assert.equal(mem_error .. " (string.rep of 1000000000 bytes) at line " .. line_of(file, "rep = function"), got.rep)
  end)

  -- The executables wrap pcall and xpcall (os.exit ends a rank's script through them): a
  -- tripped call must still leave the budget behind it, under both interpreters.
  it("leaves no tripped budget behind in the executables, whose pcall and xpcall are wrapped", function()
    local file = F .. "evil/memory.lua"
    local code = 'local p = require("moonshard.policy").load("' .. file .. '", { memory_mb = 16, instructions = 1e9 })'
                 .. ' io.write(tostring(select(2, pcall(p.main.rep_sep))), "\\n")'
                 .. ' io.write(tostring(select(2, pcall(p.main.small))), "\\n", tostring(select(2, pcall(tostring, 2))))'
    for _, bin in ipairs({ S.lua54_bin, S.jit_bin }) do
      local r = S.run_with(bin, { "-e", code })
      assert.equal(0, r.code, r.err)
      assert.equal(mem_error .. " (string.rep of 299999997 bytes) at line " .. line_of(file, "rep_sep =") ..
        "\n1020\n2", r.out, bin)
    end
  end)

  it("names the policy when Lua runs out of memory in a call", function()
    -- ASan cannot run under an address-space limit, nor return a failed allocation
    if os.getenv("ASAN_OPTIONS") then return pending("not under AddressSanitizer") end
    -- the cap too large to stop the doubling before a 400 MB address space runs out
    local code = 'local p = require("moonshard.policy").load("' .. F .. 'evil/memory.lua",'
                 .. ' { memory_mb = 65536, instructions = 1e9 }) io.write(select(2, pcall(p.main.double)))'
    for _, bin in ipairs({ S.lua54_bin, S.jit_bin }) do
      local r = S.run_with("sh", { "-c", 'ulimit -v 400000 && exec "$0" "$@"', bin, "-e", code })
      assert.equal(0, r.code, r.err)
      assert.equal("moonshard: policy " .. F .. "evil/memory.lua: out of memory (not enough memory; the call's cap is 65536 MiB)",
                   r.out)
    end
  end)

  it("rejects options that are not positive numbers", function()
    assert.matches("opts.instructions must be a positive number, got 0",
                   failure(policy.load, F .. "single.lua", { instructions = 0 }), 1, true)
    assert.matches("opts.memory_mb is 1e-05; the least is 1 (a policy needs at least 1 MiB to load)",
      failure(policy.load, F .. "single.lua", { memory_mb = 1e-5 }), 1, true)
    assert.matches("opts.seconds is 0.5; the least is 1 (the clock is read in whole seconds)",
      failure(policy.load, F .. "single.lua", { seconds = 0.5 }), 1, true)
    assert.matches("opts.memory_mb must be a positive number, got lots",
                   failure(policy.load, F .. "single.lua", { memory_mb = "lots" }), 1, true)
  end)
end)

describe("pattern matching", function()
  local file = F .. "evil/patterns.lua"
  local patterns = load_fast(file).main
  local function refused(what, pattern, steps, bytes, text)
    return "moonshard: policy " .. file .. ": instruction budget of 1000000 exceeded (string." .. what .. ": the pattern "
           .. pattern .. " could take " .. steps .. " steps on a subject of " .. bytes .. " bytes; each *, +, - or ?"
           .. " that can backtrack multiplies the work) at line " .. line_of(file, text)
  end

  it("refuses at once a pattern that could backtrack longer than the budget allows", function()
    local err
    assert.is_true(seconds(function() err = failure(patterns.star) end) < 1)
    -- 31 starts and 30 a* that backtrack: the C(61, 31) ways to split 30 bytes among them
    assert.equal(refused("find", '"' .. ("a*"):rep(20) .. '"...', "1.16e+18", 30, "star ="), err)
    -- 31 starts and 30 ? that backtrack: 31 * 2^30 tries, each running 31 items
    assert.equal(refused("match", '"' .. ("a?"):rep(20) .. '"...', "1.13e+12", 30, "optional ="),
                 failure(patterns.optional))
    assert.equal(refused("gmatch", '"' .. ("a-"):rep(8) .. 'b"', "7.59e+08", 30, "gmatch ="), failure(patterns.gmatch))
    -- %b scans to the end from each start
    assert.equal(refused("gsub", '"%b()"', "2.01e+06", 1000, "balance ="), failure(patterns.balance))
  end)

  it("charges what each pattern may cost, so allowed ones in a loop end with the budget", function()
    assert.equal(refused("find", '"a*a*b"', "5.41e+05", 100, "repeated ="), failure(patterns.repeated))
  end)

  it("counts only the tries a literal after a quantifier lets through", function()
    -- worst case 5e4 steps a name, 5e3 with its 5 dots: 50 names fit in the budget
    local names = {}
    for i = 1, 50 do names[i] = "model.layers." .. i .. ".self_attn.q_proj.weight" end
    local parts = patterns.split(names)
    assert.equal(50, #parts)
    assert.equal("model|layers|50.self_attn.q_proj.weight", parts[50])
  end)

  it("allows the patterns policies use on parameter names", function()
    assert.same({
      "0 true model/layers/0/mlp/weight 5 weight 16 MODEL.LAYERS.0.MLP.WEIGHT",
      "- true lm_head/weight 2 weight nil LM_HEAD.WEIGHT",
      "7 false layers/7/mlp 3 mlp 10 LAYERS.7.MLP",
      "12 true model/layers/12/self_attn/q_proj/weight 6 weight nil MODEL.LAYERS.12.SELF_ATTN.Q_PROJ.WEIGHT",
    }, patterns.ordinary({ "model.layers.0.mlp.weight", "lm_head.weight", "layers.7.mlp",
                          "model.layers.12.self_attn.q_proj.weight" }))
  end)
end)

describe("the sandbox", function()
  local file = F .. "evil/forbidden.lua"
  local forbidden = load_fast(file).main
  local function at(text) return "moonshard: policy " .. file .. ":" .. line_of(file, text) .. ": " end
  local NOTE = " (policies run in a sandbox without io, os, package, debug, load)"

  it("has no io, os, package, debug, load or collectgarbage", function()
    for _, case in ipairs({
      { "os_execute", "os" }, { "io_open", "io" }, { "load", "load" }, { "loadstring", "loadstring" },
      { "dofile", "dofile" }, { "debug_getinfo", "debug" }, { "collectgarbage", "collectgarbage" },
      { "package", "package" },
    }) do
      assert.equal(at(case[1] .. " =") .. "unknown global '" .. case[2] .. "'" .. NOTE, failure(forbidden[case[1]]))
    end
  end)

  it("requires no host library", function()
    assert.equal(at("require_os =") .. "require 'os': no os.lua in " .. F .. "evil or the shipped policies and not an allowed module " ..
                 "(moonshard.module);"
                 .. " policies run in a sandbox without io, os, package, debug, load",
                 failure(forbidden.require_os))
    -- a tail call leaves no frame of the caller: the error names the file only
    assert.equal(1, failure(forbidden.require_os_tail):find("moonshard: policy " .. file .. ": require 'os'", 1, true))
  end)

  it("has no string.dump and hides the string metatable", function()
    assert.equal(at("string_dump =") .. "string.dump is not available" .. NOTE, failure(forbidden.string_dump))
    local string_mt, string_lib_mt = forbidden.string_metatable()
    assert.is_nil(string_mt)
    assert.is_false(string_lib_mt)
  end)

  it("refuses __gc, which would run outside the budget", function()
    assert.equal(at("gc_metamethod =") .. "setmetatable: __gc is not allowed (a finalizer would run outside the policy's budget)",
                 failure(forbidden.gc_metamethod))
  end)

  it("refuses writes to globals, when called and while loading", function()
    assert.equal(at("set_global =") .. "cannot set global 'leaked' (keep state in locals; a policy file returns its values)",
                 failure(forbidden.set_global))
    assert.is_nil(rawget(_G, "leaked"))
    assert.matches("moonshard: policy " .. F .. "evil/global_at_load.lua:2: cannot set global 'leaked'",
                   failure(load_fast, F .. "evil/global_at_load.lua"), 1, true)
  end)

  it("refuses os while loading, and nothing ran", function()
    os.remove("/tmp/moonshard-policy-pwned")
    assert.equal("moonshard: policy " .. F .. "evil/os_at_load.lua:3: unknown global 'os'" .. NOTE,
                 failure(load_fast, F .. "evil/os_at_load.lua"))
    assert.is_nil(io.open("/tmp/moonshard-policy-pwned"))
  end)

  it("refuses bytecode", function()
    local d = tmpdir()
    write(d .. "/compiled.lua", string.dump(function() return {} end))
    local err = failure(load_fast, d .. "/compiled.lua")
    rmdir(d)
    assert.equal("moonshard: policy " .. d .. "/compiled.lua: is precompiled bytecode; policies load from Lua source only", err)
  end)
end)

describe("policy errors", function()
  it("name the file and line of a syntax error", function()
    assert.matches("^moonshard: policy " .. F:gsub("%p", "%%%0") .. "broken/syntax%.lua:3: .*near '='",
                   failure(load_fast, F .. "broken/syntax.lua"))
  end)

  it("keep the position of errors the policy raises, and Lua's own", function()
    local file = F .. "broken/raises.lua"
    local raises = load_fast(file).main
    assert.equal(file .. ":" .. line_of(file, "fail =") .. ": no unit for 'x'", failure(raises.fail, "x"))
    assert.matches(file .. ":" .. line_of(file, "index_nil =") .. ": attempt to index", failure(raises.index_nil), 1, true)
    -- a message the policy raises as the library's own is not taken for it
    -- (LuaJIT keeps no frame of the tail call: the file alone)
    local err = failure(raises.call, error, "moonshard: bad shape", 0)
    assert.is_true(err == "moonshard: policy " .. file .. ":" .. line_of(file, "call =") .. ": moonshard: bad shape" or
      (jit ~= nil and err == "moonshard: policy " .. file .. ": moonshard: bad shape"), err)
  end)

  it("are strings naming the policy line when the policy raised something else", function()
    local file = F .. "broken/raises.lua"
    local raises = load_fast(file).main
    local function at(text) return "moonshard: policy " .. file .. ":" .. line_of(file, text) .. ": " end
    assert.equal(at("table =") .. 'error object (a table) is not a string: {code = 42, unit = table, why = "no unit"}',
                 failure(raises.table))
    assert.equal(at("nothing =") .. "error object is nil (error() without a message)", failure(raises.nothing))
    assert.equal(at("boolean =") .. "error object (a boolean) is not a string: true", failure(raises.boolean))
    assert.equal(at("tostring =") .. "no unit for 'x'", failure(raises.tostring))
    assert.equal(at("bad_tostring =") .. "error object (a table) whose __tostring failed: " .. file .. ":"
                 .. line_of(file, "bad_tostring =") .. ": no name", failure(raises.bad_tostring))
    assert.equal(at("table_tostring =") .. "error object (a table) whose __tostring failed: '__tostring' must return a string",
                 failure(raises.table_tostring))
    -- inside the policy, its own pcall still gets the table
    assert.same({ false, "table", 7 }, { raises.caught() })
  end)

  it("name the path of a missing file or directory", function()
    for _, name in ipairs({ "no_such_policy", "no_such.lua" }) do
      assert.matches("moonshard io error: policy " .. F .. name .. ": No such file or directory",
        failure(policy.load, F .. name), 1, true)
    end
  end)

  it("name an empty directory", function()
    local d = tmpdir()
    local err = failure(policy.load, d)
    rmdir(d)
    assert.equal("moonshard: policy " .. d .. ": directory has no .lua files", err)
  end)

  it("name a file that returns nothing", function()
    assert.equal("moonshard: policy " .. F .. "broken/nothing.lua: returned nothing (a policy file returns its data or functions)",
                 failure(load_fast, F .. "broken/nothing.lua"))
  end)
end)
