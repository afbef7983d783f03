-- json_spec.lua: the strict decoder (every malformed input refused with line and column) and
-- the deterministic encoder.
local json = require "moonshard.json"

local function decode_error(text)
  local ok, err = pcall(json.decode, text, "t.json")
  assert.is_false(ok, "decoded: " .. text)
  return err
end

describe("json.decode", function()
  it("reads every kind of value", function()
    local v = json.decode('{"a": [1, -2.5, 1e2, true, false, null, "x"], "b": {}, "c": []}')
    assert.same({ 1, -2.5, 100, true, false, json.null, "x" }, v.a)
    assert.equal(json.null, v.a[6])
    assert.same({}, v.b)
    assert.is_nil(getmetatable(v.b))
    assert.equal(json.array_mt, getmetatable(v.c))
    assert.equal(json.array_mt, getmetatable(v.a))
  end)

  it("keeps integers exact and integer-valued", function()
    local v = json.decode("[9007199254740992, 0, -0, 42, 4.0]")
    assert.equal(9007199254740992, v[1])
    if math.type then
      assert.equal("integer", math.type(v[1]))
      assert.equal("integer", math.type(v[3]))
      assert.equal("float", math.type(v[5]))
    end
  end)

  it("decodes escapes and surrogate pairs to UTF-8", function()
    assert.equal('"\\/\b\f\n\r\t', json.decode([["\"\\\/\b\f\n\r\t"]]))
    assert.equal("\u{e9}\u{20ac}\u{1F600}", json.decode([["\u00e9\u20AC\ud83d\ude00"]]))
    assert.equal("h\u{e9}", json.decode('"h\u{e9}"'))
  end)

  it("allows JSON whitespace around values", function()
    assert.same({ 1 }, json.decode(" \t\r\n[ 1 ]\n "))
  end)

  it("refuses every malformed input, saying where and what was expected", function()
    local cases = {
      { "[1,]", "t.json:1:4: trailing comma in array %(expected a value after ','%)" },
      { '{"a":1,}', "t.json:1:8: trailing comma in object %(expected a key after ','%)" },
      { '"\\x"', "t.json:1:2: invalid escape '\\x' %(expected one of" },
      { '"\\u12G4"', "t.json:1:2: invalid \\u escape %(expected four hex digits after \\u%)" },
      { '"a\tb"', "t.json:1:3: control character U%+0009 in string %(expected it escaped" },
      { '"a\nb"', "t.json:1:3: control character U%+000A in string" },
      { "01", "t.json:1:1: leading zero in number %(expected a single 0" },
      { "[-01]", "t.json:1:2: leading zero in number" },
      { '{"a": "abc', "t.json:1:7: unterminated string %(expected '\"' before the end of input%)" },
      { '"abc\\', "t.json:1:1: unterminated string" },
      { '{"a": 1, "a": 2}', 't.json:1:10: duplicate key "a" in object %(expected each key once%)' },
      { "[1] x", "t.json:1:5: unexpected 'x' after the value %(expected end of input%)" },
      { "{} {}", "t.json:1:4: unexpected '{' after the value" },
      { "", "t.json:1:1: unexpected end of input %(expected a value%)" },
      { "[1\n,\n  +2]", "t.json:3:3: unexpected '%+' %(expected a value%)" },
      { "tru", "t.json:1:1: invalid literal %(expected true, false or null%)" },
      { "NaN", "t.json:1:1: unexpected 'N' %(expected a value%)" },
      { ".5", "t.json:1:1: unexpected '%.' %(expected a value%)" },
      { "-", "t.json:1:2: unexpected end of input in number %(expected a digit%)" },
      { "1.", "t.json:1:3: unexpected end of input after '%.' %(expected a digit%)" },
      { "1e+", "t.json:1:4: unexpected end of input in exponent %(expected a digit%)" },
      { "1ex", "t.json:1:3: unexpected 'x' in exponent %(expected a digit%)" },
      { "1e400", "t.json:1:1: number 1e400 is out of range %(expected a finite double%)" },
      { '"\\ud800"', "t.json:1:2: lone high surrogate in \\u escape" },
      { '"\\udc00"', "t.json:1:2: lone low surrogate in \\u escape" },
      { '"\xff"', "t.json:1:2: invalid UTF%-8 in string %(expected UTF%-8 text%)" },
      { '"\xc0\xaf"', "t.json:1:2: invalid UTF%-8 in string" },       -- overlong '/'
      { '"\xed\xa0\x80"', "t.json:1:2: invalid UTF%-8 in string" },   -- encoded surrogate
      { '{"a" 1}', "t.json:1:6: unexpected '1' after key %(expected ':'%)" },
      { "{1: 2}", "t.json:1:2: unexpected '1' in object %(expected a key string%)" },
      { "[1 2]", "t.json:1:4: unexpected '2' in array %(expected ',' or '%]'%)" },
      { '{"a": 1 "b": 2}', "t.json:1:9: unexpected '\"' in object %(expected ',' or '}'%)" },
      { "[\1]", "t.json:1:2: unexpected byte 0x01 %(expected a value%)" },
      { string.rep("[", 513) .. string.rep("]", 513),
        "t.json:1:513: nesting deeper than 512 levels %(expected at most 512" },
    }
    for _, c in ipairs(cases) do
      local err = decode_error(c[1])
      assert.matches("^moonshard: json: " .. c[2], err)
    end
  end)

  it("keeps its messages short whatever the input: 100k '[', long keys and numbers", function()
    local t0 = os.clock()
    local err = decode_error(string.rep("[", 100000))
    assert.matches("^moonshard: json: t.json:1:513: nesting deeper than 512 levels", err)
    assert.is_true(os.clock() - t0 < 2)
    local key = string.rep("k", 100000)
    err = decode_error('{"' .. key .. '": 1, "' .. key .. '": 2}')
    assert.equal('moonshard: json: t.json:1:100009: duplicate key "' .. string.rep("k", 64) ..
      '... (100000 bytes)" in object (expected each key once)', err)
    err = decode_error('{"a\\u0000b": 1, "a\\u0000b": 2}')
    assert.matches('duplicate key "a\\0b" in object', err, 1, true)
    err = decode_error("1" .. string.rep("0", 400) .. "e999")
    assert.equal("moonshard: json: t.json:1:1: number " .. string.rep("1", 1) .. string.rep("0", 63) ..
      "... (405 bytes) is out of range (expected a finite double)", err)
    err = select(2, pcall(json.decode, "[" .. string.rep("9", 100) .. "]", "h", { counts = true }))
    assert.equal("moonshard: json: h:1:2: number " .. string.rep("9", 64) .. "... (100 bytes) is not at most 2^53 " ..
      "(expected an integer count from 0 to 2^53)", err)
  end)

  it("reads long exponents alike under both interpreters (LuaJIT's tonumber gives nil past 1e1048575)", function()
    assert.equal(0, json.decode("1e-4294967296"))
    assert.equal(0, json.decode("0e99999999999"))
    assert.equal(125, json.decode("12.5e00001"))
    assert.equal(1, json.decode("0." .. string.rep("0", 20000) .. "1e20001"))
    assert.equal(1e10, json.decode("1" .. string.rep("0", 20000) .. "e-19990"))
    assert.equal(1.7976931348623157e308, json.decode("1.7976931348623157e00308"))
    for _, text in ipairs({ "1e854775808", "-1e2147483647", "1.8e00308", "0.000123e10004" }) do
      assert.equal("moonshard: json: t.json:1:1: number " .. text .. " is out of range (expected a finite double)",
        decode_error(text))
    end
    local v = json.decode("[123451e-26789012345678, 1]")
    assert.equal(0, v[1])
    assert.equal(1, v[2])
  end)

  it("reads counts past 2^53 as too large under both interpreters (LuaJIT rounds 2^53 + 1 down)", function()
    local counts = { counts = true }
    assert.equal(9007199254740992, json.decode("9007199254740992", "c", counts))
    for _, text in ipairs({ "9007199254740993", "9007199254740999", "10000000000000000" }) do
      local ok, err = pcall(json.decode, text, "c", counts)
      assert.is_false(ok)
      assert.equal("moonshard: json: c:1:1: number " .. text .. " is not at most 2^53 (expected an integer count " ..
        "from 0 to 2^53)", err)
    end
  end)

  it("accepts nesting of exactly 512 levels", function()
    local v = json.decode(string.rep("[", 512) .. string.rep("]", 512))
    for _ = 1, 511 do v = v[1] end
    assert.same({}, v)
  end)

  it("names the input when no source is given, and refuses non-strings", function()
    assert.matches("^moonshard: json: input:1:1:", select(2, pcall(json.decode, "x")))
    assert.matches("decode needs a string, got nil", select(2, pcall(json.decode)))
  end)
end)

describe("json.encode", function()
  it("is compact, with keys sorted bytewise", function()
    assert.equal('{"B":2,"a":[1,2.5,"x"],"b":{},"c":[],"d":null,"e":true}',
      json.encode({ a = { 1, 2.5, "x" }, b = {}, c = json.array(), d = json.null, e = true, B = 2 }))
  end)

  it("sorts keys bytewise whatever the collation locale", function()
    local t = { a_b = 1, ab = 2, A = 3, ["a-c"] = 4, ["\u{e9}"] = 5, B = 6 }
    local expected = '{"A":3,"B":6,"a-c":4,"a_b":1,"ab":2,"\u{e9}":5}'
    assert.equal(expected, json.encode(t))
    local saved = os.setlocale(nil, "collate")
    for _, loc in ipairs({ "C.UTF-8", "en_US.UTF-8" }) do
      if os.setlocale(loc, "collate") then assert.equal(expected, json.encode(t)) end
    end
    os.setlocale(saved, "collate")
  end)

  it("keeps json.object order: the given keys, then later ones as assigned", function()
    local o = json.object({ "z", "a", "missing" }, { a = 1, z = 2 })
    o.m = 3
    o.b = 4
    assert.equal('{"z":2,"a":1,"m":3,"b":4}', json.encode(o))
  end)

  it("prints integral numbers as integers and others as the shortest exact digits", function()
    assert.equal("[0,-5,3,9007199254740992,1e+100,0.1,0.3333333333333333,-1.5e-07]",
      json.encode({ 0, -5, 3.0, 9007199254740992, 1e100, 0.1, 1 / 3, -1.5e-7 }))
    if math.maxinteger then assert.equal("9223372036854775807", json.encode(math.maxinteger)) end
    for _, x in ipairs({ 0.1, 1 / 3, 2 / 3, 1e-300, 123.456, 5e-324 }) do
      assert.equal(x, json.decode(json.encode(x)))
    end
  end)

  it("escapes strings per RFC 8259", function()
    assert.equal([["q\"b\\s/\b\f\n\r\t\u0001\u001f"]], json.encode('q"b\\s/\b\f\n\r\t\1\31'))
    assert.equal('"h\u{e9}\u{1F600}"', json.encode("h\u{e9}\u{1F600}"))
  end)

  it("has a stable pretty layout", function()
    local v = json.object({ "name", "shape", "empty", "obj" },
      { name = "w", shape = { 10, 4 }, empty = json.array(), obj = { k = false } })
    assert.equal(table.concat({
      "{",
      '  "name": "w",',
      '  "shape": [',
      "    10,",
      "    4",
      "  ],",
      '  "empty": [],',
      '  "obj": {',
      '    "k": false',
      "  }",
      "}" }, "\n"), json.encode(v, { indent = 2 }))
  end)

  it("is deterministic and round-trips", function()
    local text = '{"a":{"b":"\\n","x":[1,2,{"y":null}]},"e":[],"o":{},"z":-0.25}'
    local v = json.decode(text)
    assert.equal(text, json.encode(v))
    local pretty = json.encode(v, { indent = 4 })
    for _ = 1, 3 do assert.equal(pretty, json.encode(json.decode(pretty), { indent = 4 })) end
    assert.equal(text, json.encode(json.decode(pretty)))
  end)

  it("refuses what JSON cannot say, naming where", function()
    local function encode_error(v, opts)
      local ok, err = pcall(json.encode, v, opts)
      assert.is_false(ok)
      return err
    end
    assert.matches("^moonshard: json: encode: cannot encode NaN at %$%.a%[1%]", encode_error({ a = { 1, 0 / 0 } }))
    assert.matches("cannot encode an infinity at %$%[\"odd key\"%]", encode_error({ ["odd key"] = math.huge }))
    assert.matches("cannot encode a function at %$%.f", encode_error({ f = print }))
    assert.matches("keys are strings at %$%.t", encode_error({ t = { 1, 2, x = 3 } }))
    assert.matches("keys are strings at %$", encode_error({ [1] = 1, [3] = 3 }))
    assert.matches("array has keys other than 1..n at %$", encode_error(json.array({ 1, x = 2 })))
    local loop = {}
    loop.self = loop
    assert.matches("table contains itself at %$%.self", encode_error(loop))
    assert.matches("string is not valid UTF%-8 at %$%[0%]", encode_error({ "\xff" }))
    assert.matches("opts.indent must be an integer >= 0", encode_error({}, { indent = -1 }))
  end)
end)
