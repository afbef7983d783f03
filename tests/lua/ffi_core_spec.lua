-- ffi_core_spec.lua: what the two bindings of libmoonshard must agree on beyond the API
-- specs: int64 sizes exact past 2^53 (Lua integers under 5.4; numbers when exact, else
-- int64_t cdata, under LuaJIT's FFI binding), handles released by the collector and by
-- release(), the binding's error messages word for word, and how the FFI binding finds
-- libmoonshard.  Runs under both interpreters.
local ms = require "moonshard"
local S = require "support"

local LUAJIT = type(jit) == "table"

-- An integer given by its digits, exactly: a Lua integer under 5.4; under LuaJIT a number
-- when it is exact as one, else an int64_t cdata (what the binding returns).
local function exact(digits)
  if math.tointeger then return math.tointeger(tonumber(digits)) end
  local v = assert(load("return " .. digits .. "LL"))()
  if v >= -2 ^ 53 and v <= 2 ^ 53 then return tonumber(v) end
  return v
end

-- the error a call raises
local function err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok)
  return e
end

describe("int64 sizes", function()
  it("stay exact above 2^53", function()
    local t = ms.tensor({ 2 ^ 40, 2 ^ 20 + 1 }, "bf16", "meta")
    assert.equal(exact("1152922604118474752"), t:numel()) -- 2^60 + 2^40
    assert.equal(exact("2305845208236949504"), t:nbytes())
    assert.same({ 2 ^ 40, 2 ^ 20 + 1 }, t:shape())
    assert.equal("tensor([1099511627776, 1048577], bf16, meta)", tostring(t))
    -- the bits of f64 -1 (0xBFF0000000000000) as a signed integer
    assert.same({ exact("-4616189618054758400") }, ms.from_table({ -1 }, "f64"):bits())
  end)

  it("are plain numbers up to 2^53 and integers (5.4) or int64 cdata (LuaJIT) beyond", function()
    local n = ms.tensor({ 2 ^ 26, 2 ^ 27 }, "u8", "meta"):numel()
    assert.equal("number", type(n))
    assert.equal(2 ^ 53, n)
    local big = ms.tensor({ 2 ^ 26, 2 ^ 27 + 1 }, "u8", "meta"):numel()
    if LUAJIT then
      assert.is_true(require("ffi").istype("int64_t", big))
    else
      assert.equal("integer", math.type(big))
    end
    assert.equal(exact("9007199321849856"), big) -- 2^53 + 2^26
  end)

  it("are accepted as arguments (int64 cdata under LuaJIT)", function()
    local n = exact("9007199254740993") -- 2^53 + 1
    local t = ms.tensor({ n, 2 }, "u8", "meta")
    assert.same({ n, 2 }, t:shape())
    assert.equal(exact("18014398509481986"), t:numel())
    local shape, offset, padded = ms.fsdp_shard({ n }, 2, 1)
    assert.same({ exact("4503599627370496") }, shape)
    assert.equal(exact("4503599627370497"), offset)
    assert.same({ exact("4503599627370497") }, padded)
    local len, off = ms.chunk_extent(n, 2, 0)
    assert.equal(exact("4503599627370497"), len)
    assert.equal(0, off)
    assert.same({ n, exact("-9223372036854775807") }, ms.from_table({ n, exact("-9223372036854775807") }, "i64"):totable())
  end)
end)

describe("handles", function()
  -- resident bytes of this process
  local function rss()
    local f = io.open("/proc/self/statm")
    if not f then return nil end
    local pages = tonumber(f:read("*l"):match("^%d+%s+(%d+)"))
    f:close()
    return pages * 4096
  end
  local MiB = 2 ^ 20

  it("are released by the garbage collector and at once by release()", function()
    collectgarbage()
    local before = rss()
    if not before then return pending("no /proc/self/statm to measure memory with") end
    local t = ms.tensor({ 2 ^ 26 }, "f32"):fill_(1) -- 256 MiB, touched
    assert.is_true(rss() > before + 200 * MiB)
    t = nil -- luacheck: ignore
    collectgarbage()
    collectgarbage()
    assert.is_true(rss() < before + 50 * MiB)
    t = ms.tensor({ 2 ^ 26 }, "f32"):fill_(1)
    t:release()
    assert.is_true(rss() < before + 50 * MiB)
    assert.matches("attempt to use a released tensor", err_of(t.numel, t))
  end)

  it("lent by a unit or viewed outlive their owner", function()
    local g = ms.mesh({ { "dp", 1 } }):group("dp")
    local u = ms.unit("u", g, nil, nil, nil, true)
    u:add_param("w", { 3 }, "f32")
    u:finalize()
    local shard = u:param_shard(0):fill_(2)
    local t = ms.from_table({ 1, 2, 3, 4 })
    local view = t:narrow(0, 1, 2)
    u, t = nil, nil
    collectgarbage()
    collectgarbage()
    assert.same({ 2, 2, 2 }, shard:totable())
    assert.same({ 2, 3 }, view:totable())
  end)
end)

describe("units", function()
  it("tell where a rank's shard sits in the full parameter", function()
    local u = ms.unit("u", ms.mesh({ { "dp", 1 } }):group("dp"), nil, nil, nil, true)
    u:add_param("w", { 5, 3 }, "f32")
    u:add_param("v", { 4, 6 }, "f32", -1)
    assert.same({ 0, 5, 0 }, { u:param_offset(0) })
    assert.same({ 0, 6, 1 }, { u:param_offset(1) })
    assert.equal("moonshard invalid_argument error: unit u has no parameter 2 (it has 2, numbered from 0)", err_of(u.param_offset, u, 2))
  end)

  -- a checkpoint of AdamW's state: the moments and master weights as views of the unit's
  -- own buffers (made on demand before the first step), the skipped counts
  it("lend their AdamW state to checkpoint and restore", function()
    local u = ms.unit("u", ms.mesh({ { "dp", 1 } }):group("dp"), nil, nil, nil, true)
    u:add_param("w", { 3 }, "bf16")
    u:add_param("f", { 2 }, "bf16", 0, false)
    u:finalize()
    u:param_shard(0):copy_(ms.from_table({ 1, 2, 3 }))
    local m = u:adamw_state(0, "master")
    assert.same({ 1, 2, 3 }, m:totable())          -- made now, from the shard
    assert.equal("f32", m:dtype())
    assert.same({ 0, 0, 0 }, u:adamw_state(0, "exp_avg"):totable())
    assert.is_nil(u:adamw_state(1, "exp_avg"))     -- frozen: no state
    u:adamw_state(0, "exp_avg_sq"):fill_(4)        -- a restored second moment
    u:unshard():wait()
    u:grad_full(0):fill_(0)
    u:reduce_grads():wait()
    u:adamw_step({ lr = 0.1, step = 2, weight_decay = 0, eps = 0 })
    -- m = 0, v = 0.999 * 4: the update is 0; the shard and master keep their values
    assert.same({ 1, 2, 3 }, u:param_shard(0):to("f32"):totable())
    assert.near(3.996, u:adamw_state(0, "exp_avg_sq"):totable()[1], 1e-6)
    u:zero_grad()
    u:adamw_step({ lr = 0.1, step = 3 })
    assert.equal(1, u:adamw_skipped(0))
    assert.equal(0, u:adamw_skipped(1))
    assert.equal(u, u:set_adamw_skipped(0, 2))
    assert.equal(2, u:adamw_skipped(0))
    assert.equal("moonshard invalid_argument error: adamw_state: 'm'; expected 'exp_avg', 'exp_avg_sq' or 'master'",
      err_of(u.adamw_state, u, 0, "m"))
    assert.equal("moonshard invalid_argument error: unit 'u': set_adamw_skipped: parameter 'w': -1: expected a " ..
      "count >= 0", err_of(u.set_adamw_skipped, u, 0, -1))
    assert.equal("moonshard invalid_argument error: unit 'u': set_adamw_skipped: parameter 'f' is frozen: it takes " ..
      "no AdamW steps, so it skips none", err_of(u.set_adamw_skipped, u, 1, 2))
  end)

  it("name the adamw_step field that is missing or wrong", function()
    local u = ms.unit("u", ms.mesh({ { "dp", 1 } }):group("dp"), nil, nil, nil, true)
    u:add_param("w", { 4 }, "f32")
    u:finalize()
    local function field_error(o) return err_of(u.adamw_step, u, o) end
    local E = "moonshard invalid_argument error: adamw_step: field "
    assert.equal(E .. "'lr' is nil; expected a number", field_error({ step = 1 }))
    assert.equal(E .. "'step' is nil; expected an integer (the step count, from 1)", field_error({ lr = 1e-3 }))
    assert.equal(E .. "'step' is not an integer; expected an integer (the step count, from 1)",
      field_error({ lr = 1e-3, step = 1.5 }))
    assert.equal(E .. "'betas' is number; expected {beta1, beta2}", field_error({ lr = 1e-3, step = 1, betas = 0.9 }))
    assert.equal(E .. "'betas' must be two numbers {beta1, beta2}", field_error({ lr = 1e-3, step = 1, betas = { 0.9 } }))
    assert.equal(E .. "'eps' is table; expected a number", field_error({ lr = 1e-3, step = 1, eps = {} }))
    assert.equal(u, u:adamw_step({ lr = 1e-3, step = 1, betas = { 0.8, 0.99 } }))
    assert.equal("moonshard invalid_argument error: set_adamw: mode 'fused'; expected 'master' (f32 master weights " ..
      "and moments) or 'torch' (torch.optim.AdamW: state in the stored dtype)", err_of(u.set_adamw, u, "fused"))
    assert.equal(u, u:set_adamw("master"))
    assert.equal("moonshard state error: unit 'u': set_adamw: the unit's AdamW state exists already (an adamw_step " ..
      "or ms_unit_adamw_state made it); choose how it is kept before it is made", err_of(u.set_adamw, u, "torch"))
    assert.equal("moonshard invalid_argument error: adamw_step: unknown field 'weightdecay'; expected lr, betas, eps, " ..
      "weight_decay and step", err_of(u.adamw_step, u, { lr = 1e-3, step = 2, weightdecay = 0.1 }))
    assert.equal("moonshard invalid_argument error: adamw_step: unknown field 'number'; expected lr, betas, eps, " ..
      "weight_decay and step", err_of(u.adamw_step, u, { 1e-3, lr = 1e-3, step = 2 }))
    local runtime = require "moonshard.runtime"
    assert.equal("moonshard: runtime: materialize: expected a plan made by require('moonshard.plan').plan(model, " ..
      "mesh, policy), got a table without its mesh (a decoded plan JSON cannot be materialised)",
      err_of(runtime.materialize, { version = 1, units = {} }))
  end)

  it("choose host memory (set_cpu_offload) before their first parameter, not after", function()
    local u = ms.unit("u", ms.mesh({ { "dp", 1 } }):group("dp"), nil, nil, nil, true)
    assert.equal(u, u:set_cpu_offload(false))
    assert.equal(u, u:set_cpu_offload(true))
    u:add_param("w", { 5, 3 }, "f32")
    u:finalize()
    -- on the threads backend every buffer is on the host, offloaded or not
    assert.equal("cpu", u:param_shard(0):device())
    assert.equal("moonshard state error: unit 'u': set_cpu_offload: the unit already holds parameters; choose " ..
      "where its shards live before the first ms_unit_add_param", err_of(u.set_cpu_offload, u, false))
  end)
end)

describe("the raw binding", function()
  -- the functions moonshard/raw.lua lists in its header, the contract of both bindings
  local function listed()
    local f = assert(io.open(assert(package.searchpath("moonshard.raw", package.path))))
    local names, listing = {}, false
    for line in f:lines() do
      if not line:match("^%-%-") then break end
      listing = listing or line:match("^%-%-   primitives ") ~= nil
      if listing then
        for name in line:gmatch("([%a_][%w_]*)%(") do names[name] = true end
      end
    end
    f:close()
    return names
  end

  it("gives every function raw.lua lists and nothing else, whichever interpreter loads it", function()
    local R, names = require "moonshard.raw", listed()
    local functions, missing, extra = {}, {}, {}
    for k, v in pairs(R) do
      if type(v) == "function" then functions[k] = true end
    end
    for name in pairs(names) do
      if not functions[name] then missing[#missing + 1] = name end
    end
    for name in pairs(functions) do
      if not names[name] then extra[#extra + 1] = name end
    end
    table.sort(missing)
    table.sort(extra)
    assert.same({ {}, {} }, { missing, extra })
    assert.is_true(#(function() local t = {} for k in pairs(names) do t[#t + 1] = k end return t end)() > 80)
  end)

  it("returns a failed core call as nil and the message, and raises nothing", function()
    local R = require "moonshard.raw"
    local t, err = R.tensor_new({ 2, -3 }, R.const.F32, R.const.DEVICE_CPU, 0)
    assert.is_nil(t)
    assert.equal("moonshard shape error: tensor_new: size of dim 1 is -3; sizes must be >= 0", err)
    assert.same({ nil, "moonshard dtype error: unknown dtype 'f12' (expected one of f32 f16 bf16 f8e4m3 f8e5m2 " ..
      "f64 i64 i32 i8 u8 bool)" }, { R.dtype_code("f12") })
  end)
end)

describe("binding errors", function()
  local t = ms.tensor({ 3, 4 })
  local m = ms.mesh({ { "dp", 1 } })
  local here = "^[^\n]*ffi_core_spec%.lua:%d+: "

  it("name the argument as luaL_argerror does, with the caller's line", function()
    assert.matches(here .. "bad argument #1 to 'narrow' %(number has no integer representation%)$",
      err_of(function() local v = t:narrow(1.5, 0, 1); return v end))
    assert.matches(here .. "bad argument #2 to 'narrow' %(number expected, got string%)$",
      err_of(function() local v = t.narrow(t, "x", 0, 1); return v end))
    assert.matches(here .. "calling 'numel' on bad self %(moonshard.Tensor expected, got table%)$",
      err_of(function() local o = { numel = t.numel }; local v = o:numel(); return v end))
    assert.matches(here .. "bad argument #1 to 'copy_' %(moonshard.Tensor expected, got moonshard.Mesh%)$",
      err_of(function() local v = t:copy_(m); return v end))
    assert.matches(here .. "bad argument #1 to 'group' %(table expected, got boolean%)$",
      err_of(function() local v = m:group(true); return v end))
  end)

  it("carry the core's status and message, and no position when called from C", function()
    assert.equal("moonshard shape error: tensor_new: size of dim 1 is -3; sizes must be >= 0", err_of(ms.tensor, { 2, -3 }))
    assert.equal("moonshard invalid_argument error: shape[2] is string, expected an integer", err_of(ms.tensor, { 2, "x" }))
    assert.equal("moonshard invalid_argument error: shape has 9 entries, at most 8 allowed", err_of(ms.tensor, { 1, 1, 1, 1, 1, 1, 1, 1, 1 }))
    assert.equal("moonshard shape error: from_table: 3 values do not fill a shape of 4 elements",
      err_of(ms.from_table, { 1, 2, 3 }, "f32", { 2, 2 }))
    assert.equal("moonshard invalid_argument error: mesh has no axis 'tp' (axes: dp)", err_of(m.group, m, "tp"))
    assert.equal("moonshard invalid_argument error: mesh: axis 1 is string, expected {name, size}", err_of(ms.mesh, { "dp" }))
    assert.equal("moonshard invalid_argument error: cast_impl: 'sse' is not auto, portable or avx2", err_of(ms.cast_impl, "sse"))
    assert.equal("moonshard device error: totable/bits: a meta tensor holds no data",
      err_of(t.totable, ms.tensor({ 2 }, "f32", "meta")))
    local u = ms.unit("u0", m:group("dp"))
    u:add_param("w", { 4 }, "f32")
    assert.equal("moonshard invalid_argument error: unit u0 has no parameter 1 (it has 1, numbered from 0)", err_of(u.fqn, u, 1))
    assert.equal("moonshard state error: unit 'u0': param_full: not allowed while the unit is building (not finalized)",
      err_of(u.param_full, u, 0))
    u:release()
    assert.equal("moonshard state error: attempt to use a released unit", err_of(u.count, u))
    assert.equal("unit (released)", tostring(u))
  end)
end)

describe("the LuaJIT binding", function()
  local luajit = io.popen("command -v luajit 2>/dev/null"):read("*l")
  local cdef = package.searchpath("moonshard.cdef", package.path)
  local lib = cdef and cdef:match("^(.*)/lua/moonshard/cdef%.lua$")
  lib = lib and lib .. "/libmoonshard.so"

  -- runs `luajit -e code` with moonshard's sources and `dir`/lua (or a share/lua/5.4 tree) on
  -- LUA_PATH and the given environment; returns its output and exit status
  local function run_luajit(lua_dir, env, code)
    local cmd = string.format("env -u MOONSHARD_LIB -u LD_LIBRARY_PATH %s LUA_PATH=%s %s -e %s 2>&1; echo \"rc=$?\"",
      env, S.quote("lua/?.lua;lua/?/init.lua;" .. lua_dir .. "/?.lua"), luajit, S.quote(code))
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    return out:match("^(.-)rc=(%d+)%s*$")
  end

  -- a scratch directory holding layout/moonshard/cdef.lua
  local function tree(layout)
    local dir = os.tmpname()
    os.remove(dir)
    local moonshard = S.quote(dir .. "/" .. layout .. "/moonshard")
    assert(os.execute("mkdir -p " .. moonshard .. " && cp " .. S.quote(cdef) .. " " .. moonshard))
    return dir
  end

  local PROBE = 'local ms = require "moonshard"; io.write(ms.world_size(), " ", ms.backend())'

  it("finds libmoonshard by MOONSHARD_LIB, beside cdef.lua, or says where it looked", function()
    if not (luajit and lib) then return pending("needs luajit and a build tree's cdef.lua") end
    local dir = tree("lua")
    local out, rc = run_luajit(dir .. "/lua", "", PROBE)
    assert.equal("1", rc)
    assert.matches("moonshard: cannot find libmoonshard; looked in ffi.C %(no ms_%* symbols in this process%), " ..
      "%$MOONSHARD_LIB %(not set%), " .. dir:gsub("%p", "%%%0") .. "/libmoonshard.so, ", out)
    assert.matches("; set MOONSHARD_LIB to its path", out)
    out, rc = run_luajit(dir .. "/lua", "MOONSHARD_LIB=" .. S.quote(lib), PROBE)
    assert.equal("1 threads", out)
    assert.equal("0", rc)
    assert(os.execute("cp -L " .. S.quote(lib) .. " " .. S.quote(dir .. "/libmoonshard.so")))
    assert.equal("1 threads", (run_luajit(dir .. "/lua", "", PROBE)))
    -- an install: PREFIX/share/lua/5.4/moonshard/cdef.lua and PREFIX/lib/libmoonshard.so
    local prefix = tree("share/lua/5.4")
    assert(os.execute("mkdir -p " .. S.quote(prefix .. "/lib") .. " && cp -L " .. S.quote(lib) .. " " ..
      S.quote(prefix .. "/lib/libmoonshard.so")))
    assert.equal("1 threads", (run_luajit(prefix .. "/share/lua/5.4", "", PROBE)))
    os.execute("rm -rf " .. S.quote(dir) .. " " .. S.quote(prefix))
  end)
end)
