-- tensor_spec.lua: tensors through `require "moonshard"` in a stock Lua (rank 0 of 1).
local ms = require "moonshard"

-- An integer given by its digits, exactly: a Lua integer under 5.4, an int64_t cdata under
-- LuaJIT (whose numbers are doubles).
local function exact(digits)
  if math.tointeger then return math.tointeger(tonumber(digits)) end
  return assert(load("return " .. digits .. "LL"))()
end

describe("tensors", function()
  it("are zero-filled with shape, dtype, numel and device", function()
    local t = ms.tensor({ 2, 3 }, "bf16")
    assert.same({ 2, 3 }, t:shape())
    assert.equal("bf16", t:dtype())
    assert.equal(6, t:numel())
    assert.equal(12, t:nbytes())
    assert.equal("cpu", t:device())
    assert.same({ 0, 0, 0, 0, 0, 0 }, t:totable())
    assert.equal("tensor([2, 3], bf16, cpu)", tostring(t))
    assert.equal("f32", ms.tensor({ 4 }):dtype())
  end)

  it("names a value that is not a number in from_table", function()
    local ok, err = pcall(ms.from_table, { 1, "x", 3 }, "f32")
    assert.is_false(ok)
    assert.matches("from_table: values%[2%] is string, expected a number", err)
  end)

  it("round-trips values through from_table and totable", function()
    local t = ms.from_table({ 1.5, -2, 3.25, 0 }, "f32", { 2, 2 })
    assert.same({ 2, 2 }, t:shape())
    assert.same({ 1.5, -2, 3.25, 0 }, t:totable())
    local values = { exact("9007199254740993"), exact("-9007199254740993"), exact("9223372036854775807") }
    assert.same(values, ms.from_table(values, "i64"):totable())
  end)

  it("refuses in from_table and fill_ a value an integer dtype cannot hold, as PyTorch does", function()
    -- in range: floats truncate toward zero, booleans are 0 / 1; bool takes any number
    assert.same({ 127, -128, 1, -128, 1 }, ms.from_table({ 127, -128, 1.9, -128.9, true }, "i8"):totable())
    assert.same({ 0, 255 }, ms.from_table({ -0.5, 255.5 }, "u8"):totable())
    assert.same({ 1, 0, 1 }, ms.from_table({ 0.5, 0, 0 / 0 }, "bool"):totable())
    local function refused(values, dtype, what)
      local ok, e = pcall(ms.from_table, values, dtype)
      assert.is_false(ok)
      assert.equal("moonshard invalid_argument error: from_table: " .. what, e)
    end
    refused({ 1, 300.5 }, "i8", "values[2] = 300.5 is out of range for i8 (-128 to 127)")
    refused({ -1 }, "u8", "values[1] = -1 is out of range for u8 (0 to 255)")
    refused({ 3e9 }, "i32", "values[1] = 3000000000 is out of range for i32 (-2147483648 to 2147483647)")
    refused({ 0 / 0 }, "i32", "values[1] = nan is out of range for i32 (-2147483648 to 2147483647)")
    refused({ -1 / 0 }, "i64", "values[1] = -inf is out of range for i64 (-9223372036854775808 to 9223372036854775807)")
    refused({ 2 ^ 63 }, "i64", "values[1] = 9.2233720368548e+18 is out of range for i64 " ..
      "(-9223372036854775808 to 9223372036854775807)")
    -- a cast saturates instead, as documented
    assert.same({ 127, -128 }, ms.from_table({ 300.5, -300.5 }, "f64"):to("i8"):totable())
    -- fill_: the same rules, and i64 exactly (not through a double)
    local big = exact("4611686018427387905")
    assert.same({ big, big }, ms.tensor({ 2 }, "i64"):fill_(big):totable())
    assert.same({ -7, -7 }, ms.tensor({ 2 }, "i32"):fill_(-7.9):totable())
    assert.same({ 1 }, ms.tensor({ 1 }, "bool"):fill_(0.5):totable())
    local t = ms.tensor({ 2 }, "i8")
    local ok, e = pcall(t.fill_, t, 300)
    assert.is_false(ok)
    assert.equal("moonshard invalid_argument error: fill_: 300 is out of range for i8 (-128 to 127)", e)
    assert.same({ 0, 0 }, t:totable())
  end)

  it("refuses a dim or a root beyond a C int instead of wrapping it", function()
    local t = ms.tensor({ 2, 3 })
    local huge = 2 ^ 32 + 1
    local function refused(what, f, ...)
      local ok, e = pcall(f, ...)
      assert.is_false(ok)
      assert.equal("moonshard invalid_argument error: " .. what .. " 4294967297 is out of range", e)
    end
    refused("narrow: dim", t.narrow, t, huge, 0, 1)
    refused("chunk: dim", t.chunk, t, 3, 0, huge)
    refused("fsdp_shard: dim", ms.fsdp_shard, { 4, 6 }, 2, 0, huge)
    local g = ms.mesh({ { "w", 1 } }):group("w")
    refused("broadcast: root", g.broadcast, g, ms.tensor({ 1 }), huge)
    local ok, e = pcall(ms.local_shape, { 4, 6 }, { ms.Shard(2 ^ 32) }, { 2 }, { 0 })
    assert.is_false(ok)
    assert.matches("local_shape: placement dim 4294967296 is out of range", e, 1, true)
    assert.matches("axis 1 must be {name, size} with a string and an integer", select(2, pcall(ms.mesh, { { 1, 1 } })),
      1, true)
  end)

  it("gives the raw bits of narrow floats, rounded to nearest even", function()
    -- bf16: 1 = 0x3F80, -2.5 = 0xC020, 1/3 = 0x3EAB (0x3EAAAAAB rounds up)
    assert.same({ 0x3F80, 0xC020, 0x3EAB }, ms.from_table({ 1, -2.5, 1 / 3 }, "bf16"):bits())
    -- f16: 1/3 = 0x3555, 65504 = 0x7BFF, 65520 rounds to inf 0x7C00
    assert.same({ 0x3555, 0x7BFF, 0x7C00 }, ms.from_table({ 1 / 3, 65504, 65520 }, "f16"):bits())
    -- e4m3: 448 = 0x7E, 1000 saturates to 0x7E, -0.5 = 0xB0; e5m2: 57344 = 0x7B, 1e6 -> 0x7B
    assert.same({ 0x7E, 0x7E, 0xB0 }, ms.from_table({ 448, 1000, -0.5 }, "f8e4m3"):bits())
    assert.same({ 0x7B, 0x7B }, ms.from_table({ 57344, 1e6 }, "f8e5m2"):bits())
    -- bits of a NaN stay a NaN
    local nan = ms.from_table({ 0 / 0 }, "bf16"):bits()[1]
    assert.is_true(math.floor(nan / 0x80) % 0x100 == 0xFF and nan % 0x80 ~= 0) -- exponent all ones, mantissa not 0
  end)

  it("casts with to() and copy_()", function()
    local t = ms.from_table({ 1.7, -1.7, 300 }, "f32")
    assert.same({ 1, -1, 127 }, t:to("i8"):totable())
    local dst = ms.tensor({ 3 }, "f64")
    dst:copy_(t:to("bf16"))
    assert.same({ 1.703125, -1.703125, 300 }, dst:totable())
  end)

  it("makes views that share memory", function()
    local t = ms.from_table({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }, "f32", { 3, 4 })
    local col = t:narrow(1, 1, 2)
    assert.same({ 3, 2 }, col:shape())
    assert.is_false(col:is_contiguous())
    assert.same({ 1, 2, 5, 6, 9, 10 }, col:totable())
    col:fill_(-1)
    assert.same({ 0, -1, -1, 3, 4, -1, -1, 7, 8, -1, -1, 11 }, t:totable())
    assert.same({ 2, 2, 3 }, t:view({ 2, -1, 3 }):shape())
    assert.same({ 8, -1, -1, 11 }, t:chunk(2, 1):totable())
    assert.same({ 0, 4 }, t:chunk(4, 3):shape())
  end)

  it("are meta tensors of any size without memory", function()
    local t = ms.tensor({ 129280, 7168 * 724 }, "bf16", "meta")
    assert.equal("meta", t:device())
    assert.equal(129280 * 7168 * 724, t:numel())
    assert.same({ 28, 7168 * 724 }, t:narrow(0, 100, 28):shape())
    assert.has_error(function() t:totable() end, nil)
    local ok, err = pcall(t.totable, t)
    assert.is_false(ok)
    assert.matches("meta tensor holds no data", err)
  end)

  it("release with <close> (Lua 5.4) and release(), and refuse use afterwards", function()
    local closed, released = ms.tensor({ 2 }), ms.tensor({ 2 })
    if _VERSION == "Lua 5.4" then
      assert(load("local t = ...; do local u <close> = t end"))(closed) -- a syntax LuaJIT cannot parse
    else
      closed:release()
    end
    released:release()
    released:release() -- a second release does nothing
    for _, t in ipairs({ closed, released }) do
      local ok, err = pcall(t.numel, t)
      assert.is_false(ok)
      assert.matches("attempt to use a released tensor", err)
      assert.equal("tensor (released)", tostring(t))
    end
  end)

  it("move between the host and a CUDA device when there is one", function()
    assert.equal("cpu", ms.device()) -- a threads rank's tensors live on the host
    local ndev, why = ms.cuda_device_count()
    if ndev == 0 then
      pending(why)
      return
    end
    local h = ms.from_table({ 1, -2.5, 1 / 3, 65520 }, "f32")
    local d = h:to("cuda:0")
    assert.equal("cuda:0", d:device())
    assert.same(h:to("bf16"):bits(), d:to("bf16"):bits()) -- cast on the device, read back
    assert.same(h:totable(), d:to("cpu"):totable())
    d:fill_(0.5)
    assert.same({ 0.5, 0.5, 0.5, 0.5 }, d:totable())
  end)

  it("report bad input by name and value", function()
    local function err(f, ...)
      local ok, e = pcall(f, ...)
      assert.is_false(ok)
      return e
    end
    assert.matches("unknown dtype 'f12'", err(ms.tensor, { 2 }, "f12"))
    assert.matches("moonshard shape error: tensor_new: size of dim 1 is %-3", err(ms.tensor, { 2, -3 }))
    assert.matches("shape%[2%] is string, expected an integer", err(ms.tensor, { 2, "x" }))
    -- cuda:N: not built, or no device (with the driver's reason), or a device past the last
    local ndev, why = ms.cuda_device_count()
    if ndev == 0 then
      assert.matches(why:match("built without CUDA") and "built without CUDA" or "device cuda:0: ",
        err(ms.tensor, { 2 }, "f32", "cuda:0"))
    else
      assert.matches("device cuda:" .. ndev .. ": .*CUDA device", err(ms.tensor, { 2 }, "f32", "cuda:" .. ndev))
    end
    local t = ms.tensor({ 3, 4 })
    assert.matches("start 2 and length 3 do not fit dim 1 of size 4", err(t.narrow, t, 1, 2, 3))
    assert.matches("destination shape %[3, 4%] differs from source shape %[4%]", err(t.copy_, t, ms.tensor({ 4 })))
    assert.matches("3 values do not fill a shape of 4 elements", err(ms.from_table, { 1, 2, 3 }, "f32", { 2, 2 }))
  end)
end)
