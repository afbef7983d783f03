-- quant_spec.lua: the lower-precision kernels (core/src/quant.c through moonshard.quant)
-- against the values the real libraries gave on the CPU (tests/reference/quant.py into
-- tests/reference/data/quant.txt): bitsandbytes' NF4 with and without double quantisation,
-- torchao's float8 casts and scales, torchao's QAT fake quantizers.  Every value is compared
-- bit for bit (any NaN equals any NaN); the counts and the largest difference are printed.
-- Runs under Lua 5.4 and LuaJIT.
local ms = require "moonshard"
local S = require "support"

local D = S.refdata("quant.txt")

local XDT = { [0] = "f32", [1] = "bf16", [2] = "f16" }
local SCHEME = { [0] = "int4_weight_only", [1] = "8da4w_weight", [2] = "8da4w_activation" }

-- A float's bits (f32: x32, bf16 and f16: x16) as a Lua number; NaN as 0/0.
local function decode(b, dt)
  local ebits, mbits, bias
  if dt == "f32" then ebits, mbits, bias = 8, 23, 127
  elseif dt == "bf16" then ebits, mbits, bias = 8, 7, 127
  else ebits, mbits, bias = 5, 10, 15 end
  local signbit = 2 ^ (ebits + mbits)
  local neg = b >= signbit
  if neg then b = b - signbit end
  local e = math.floor(b / 2 ^ mbits)
  local m = b - e * 2 ^ mbits
  local v
  if e == 2 ^ ebits - 1 then
    if m ~= 0 then return 0 / 0 end
    v = math.huge
  elseif e == 0 then
    v = m * 2.0 ^ (1 - bias - mbits)
  else
    v = (m + 2 ^ mbits) * 2.0 ^ (e - bias - mbits)
  end
  return neg and -v or v
end

local function is_nan_bits(b, dt)
  if dt == "f32" then return b % 0x80000000 > 0x7F800000 end
  if dt == "bf16" then return b % 0x8000 > 0x7F80 end
  if dt == "f16" then return b % 0x8000 > 0x7C00 end
  if dt == "f8e4m3" then return b % 0x80 == 0x7F end
  if dt == "f8e5m2" then return b % 0x80 > 0x7C end
  return false
end

-- The tensor of a record's bits in dtype dt and shape.
local function tensor_of(rec, dt, shape)
  local vals = {}
  for i, b in ipairs(rec.values) do vals[i] = decode(b, dt) end
  return ms.from_table(vals, dt, shape)
end

-- counts per family: values compared, values differing, the largest difference
local stats = {}
local function compare(family, what, got, want, dt)
  local st = stats[family] or { n = 0, bad = 0, max = 0 }
  stats[family] = st
  assert.are.equal(#want, #got, what .. ": element count")
  local first
  for i = 1, #want do
    local a, b = got[i], want[i]
    st.n = st.n + 1
    if a ~= b and not (is_nan_bits(a, dt) and is_nan_bits(b, dt)) then
      st.bad = st.bad + 1
      if dt == "f32" or dt == "bf16" or dt == "f16" then
        local d = math.abs(decode(a, dt) - decode(b, dt))
        if d ~= d then d = math.huge end
        if d > st.max then st.max = d end
      else
        st.max = math.huge
      end
      first = first or string.format("%s[%d]: got 0x%x, torch 0x%x", what, i, a, b)
    end
  end
  assert(first == nil, first)
end

local function cases(prefix)
  local list = {}
  for name in pairs(D) do
    local c = name:match("^" .. prefix .. "_(.+)_cfg$")
    if c then list[#list + 1] = c end
  end
  table.sort(list)
  assert(#list > 0, "no " .. prefix .. " cases in quant.txt")
  return list
end

local function rec(prefix, c, k)
  local r = D[prefix .. "_" .. c .. "_" .. k]
  assert(r, "quant.txt has no " .. prefix .. "_" .. c .. "_" .. k)
  return r
end

-- the error a call raises
local function err(f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok)
  return e
end

local function f32_bits_of(x) return ms.from_table({ x }, "f32"):bits()[1] end

describe("NF4 (bitsandbytes quantize_4bit / dequantize_4bit)", function()
  it("gives bitsandbytes' codes, absmax, nested statistics and dequantized values", function()
    for _, c in ipairs(cases("nf4")) do
      local cfg = rec("nf4", c, "cfg").values
      local dt, bs, dq = XDT[cfg[1]], cfg[2], cfg[3] == 1
      local shape = rec("nf4", c, "shape").values
      local x = tensor_of(rec("nf4", c, "x"), dt, shape)
      local q = ms.nf4_quantize(x, { blocksize = bs, double_quant = dq })
      compare("nf4", c .. " codes", q.codes:bits(), rec("nf4", c, "codes").values, "u8")
      if dq then
        compare("nf4", c .. " qabsmax", q.qabsmax:bits(), rec("nf4", c, "qabsmax").values, "u8")
        compare("nf4", c .. " absmax2", q.absmax2:bits(), rec("nf4", c, "absmax2").values, "f32")
        compare("nf4", c .. " offset", { f32_bits_of(q.offset) }, rec("nf4", c, "offset").values, "f32")
      else
        compare("nf4", c .. " absmax", q.absmax:bits(), rec("nf4", c, "absmax").values, "f32")
      end
      local y = ms.nf4_dequantize(q)
      assert.are.same(shape, y:shape())
      assert.are.equal(dt, y:dtype())
      compare("nf4", c .. " dequantized", y:bits(), rec("nf4", c, "out").values, dt)
    end
  end)

  it("holds bitsandbytes' NF4 table and 8-bit dynamic map", function()
    -- every NF4 code (two a byte) with absmax 1 gives the table
    local codes = {}
    for i = 0, 7 do codes[i + 1] = (2 * i) * 16 + 2 * i + 1 end
    local q = { codes = ms.from_table(codes, "u8"), absmax = ms.from_table({ 1 }, "f32"), shape = { 16 },
      dtype = "f32", blocksize = 32 }
    compare("nf4", "table", ms.nf4_dequantize(q):bits(), D.nf4_table.values, "f32")
    -- every 8-bit code, nested absmax 1, offset 0, gives the map
    local all = {}
    for i = 0, 255 do all[i + 1] = i end
    q = { codes = ms.tensor({ 128 * 32 }, "u8"), qabsmax = ms.from_table(all, "u8"),
      absmax2 = ms.from_table({ 1 }, "f32"), offset = 0, double_quant = true, shape = { 256 * 32 },
      dtype = "f32", blocksize = 32 }
    local y = ms.nf4_dequantize(q):totable()
    local got = {}
    for b = 0, 255 do got[b + 1] = -y[b * 32 + 1] end -- code 0 is -1.0: the block's absmax negated
    compare("nf4", "dynamic map", ms.from_table(got, "f32"):bits(), D.dynamic_map.values, "f32")
  end)

  it("counts the bytes of codes and statistics", function()
    assert.are.equal(32 + 4, ms.nf4_bytes(64))
    assert.are.equal(33 + 8, ms.nf4_bytes(65))
    -- 4096 * 4096 in blocks of 64: 262144 blocks, 1024 nested blocks
    assert.are.equal(8388608 + 262144 * 4, ms.nf4_bytes(4096 * 4096, { blocksize = 64 }))
    assert.are.equal(8388608 + 262144 + 1024 * 4 + 4, ms.nf4_bytes(4096 * 4096, { double_quant = true }))
    assert.are.equal(0, ms.nf4_bytes(0, { double_quant = true }))
    -- equal to the tensors nf4_quantize makes
    local x = ms.tensor({ 300, 70 }, "bf16")
    for _, dq in ipairs({ false, true }) do
      local q = ms.nf4_quantize(x, { blocksize = 32, double_quant = dq })
      local n = q.codes:nbytes() + (dq and (q.qabsmax:nbytes() + q.absmax2:nbytes() + 4) or q.absmax:nbytes())
      assert.are.equal(n, ms.nf4_bytes(21000, { blocksize = 32, double_quant = dq }))
    end
  end)

  it("names what is wrong in bad arguments", function()
    local x = ms.tensor({ 64 }, "f32")
    assert.matches("blocksize 48 is not one of bitsandbytes' 32, 64", err(ms.nf4_quantize, x, { blocksize = 48 }))
    assert.matches("x's dtype is f64; f32, bf16 or f16 was expected", err(ms.nf4_quantize, ms.tensor({ 4 }, "f64")))
    assert.matches("double_quant is string; a boolean was expected", err(ms.nf4_quantize, x, { double_quant = "yes" }))
    assert.matches("numel %-1 is negative", err(ms.nf4_bytes, -1))
  end)
end)

describe("float8 (torchao.float8)", function()
  it("gives torchao's amax, scales, fp8 bits and dequantized values", function()
    for _, c in ipairs(cases("fp8")) do
      local cfg = rec("fp8", c, "cfg").values
      local dt, rowwise, f8, pow2, given = XDT[cfg[1]], cfg[2] == 1, cfg[3] == 0 and "f8e4m3" or "f8e5m2", cfg[4] == 1, cfg[5] == 1
      local dqdt = XDT[cfg[6]]
      local shape = rec("fp8", c, "shape").values
      local x = tensor_of(rec("fp8", c, "x"), dt, shape)
      local scaling = rowwise and "rowwise" or "tensorwise"
      local opts = { dtype = f8, scaling = scaling, pow2 = pow2 }
      if given then
        opts.amax = tensor_of(rec("fp8", c, "amax"), "f32")
      else
        compare("fp8", c .. " amax", ms.fp8_amax(x, scaling):bits(), rec("fp8", c, "amax").values, "f32")
      end
      local data, scale = ms.fp8_cast(x, opts)
      compare("fp8", c .. " scale", scale:bits(), rec("fp8", c, "scale").values, "f32")
      compare("fp8", c .. " data", data:bits(), rec("fp8", c, "data").values, f8)
      local y = ms.fp8_dequantize(data, scale, dqdt)
      compare("fp8", c .. " dequantized", y:bits(), rec("fp8", c, "dq").values, dqdt)
    end
  end)

  it("gives amax_to_scale's bits on edge amax values", function()
    local amax = tensor_of(D.fp8_scalefn_amax, "f32")
    for _, f in ipairs({ "e4m3", "e5m2" }) do
      for _, p in ipairs({ "plain", "pow2" }) do
        local s = ms.fp8_scale(amax, { dtype = "f8" .. f, pow2 = p == "pow2" })
        compare("fp8", "scale " .. f .. " " .. p, s:bits(), D["fp8_scalefn_" .. f .. "_" .. p].values, "f32")
      end
    end
  end)

  it("names what is wrong in bad arguments", function()
    local x = ms.tensor({ 4, 8 }, "f32")
    assert.matches("scaling is columnwise; tensorwise or rowwise was expected", err(ms.fp8_cast, x, { scaling = "columnwise" }))
    assert.matches("dtype is bf16; f8e4m3 or f8e5m2 was expected", err(ms.fp8_cast, x, { dtype = "bf16" }))
    assert.matches("amax has 4 elements; 1 were expected", err(ms.fp8_cast, x, { amax = ms.tensor({ 4 }) }))
    assert.matches("x's dtype is f16; f32 or bf16 was expected", err(ms.fp8_amax, ms.tensor({ 2 }, "f16")))
  end)
end)

describe("QAT fake quantisation (torchao.quantization.qat)", function()
  it("gives torchao's fake-quantized values", function()
    for _, c in ipairs(cases("qat")) do
      local cfg = rec("qat", c, "cfg").values
      local dt, scheme, group, prec = XDT[cfg[1]], SCHEME[cfg[2]], cfg[3], XDT[cfg[4]]
      local x = tensor_of(rec("qat", c, "x"), dt, rec("qat", c, "shape").values)
      local y = ms.qat_fake_quantize(x, scheme, { group_size = group, scales_precision = prec })
      compare("qat", c, y:bits(), rec("qat", c, "out").values, dt)
    end
  end)

  it("names what is wrong in bad arguments", function()
    local x = ms.tensor({ 4, 96 }, "f32")
    assert.matches("scheme is int3; int4_weight_only, 8da4w_weight or 8da4w_activation was expected",
      err(ms.qat_fake_quantize, x, "int3"))
    assert.matches("group_size 64 does not divide the last dim 96",
      err(ms.qat_fake_quantize, x, "8da4w_weight", { group_size = 64 }))
    assert.matches("scales_precision is f16; f32 or bf16 was expected",
      err(ms.qat_fake_quantize, x, "8da4w_weight", { group_size = 32, scales_precision = "f16" }))
  end)
end)

describe("the FP8 all-gather of shard units", function()
  for _, mode in ipairs({ "", "hsdp" }) do
    it("gathers torchao's fp8 values on every rank" .. (mode == "" and "" or " (HSDP 2x2)"), function()
      local r = S.run({ "-n", "4", "tests/lua/scripts/fp8_units.lua", mode })
      assert.are.equal(0, r.code, r.out .. r.err)
      for rank = 0, 3 do assert.truthy(r.out:find("fp8_units ok " .. rank, 1, true), r.out .. r.err) end
    end)
  end
end)

describe("quant reference", function()
  it("was compared value by value", function()
    for _, fam in ipairs({ "nf4", "fp8", "qat" }) do
      local st = stats[fam]
      if st then
        print(string.format("quant_spec: %s: %d of %d values differ from the reference, max difference %g",
          fam, st.bad, st.n, st.max))
      end
    end
  end)
end)
