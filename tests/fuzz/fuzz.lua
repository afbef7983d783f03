-- fuzz.lua: the parsers of untrusted input against a fixed corpus and its mutations.
--
--   lua5.4 tests/fuzz/fuzz.lua      (or luajit; run from the source directory, with LUA_PATH
--                                    and LUA_CPATH as for the busted specs: CMakeLists.txt)
--
-- Targets: the JSON module (decode, in counts mode too, and encode's round trip), the
-- safetensors header parser and the module tree it makes, the safetensors index reader, the
-- config.json builders (moonshard.models), and special files as paths (/dev/zero, a FIFO, a
-- directory, ...).  Every input must give a value or a clean moonshard error: a string that
-- starts with "moonshard", at most 4096 bytes, no NUL; anything else (a Lua runtime error, a
-- stack overflow, "not enough memory", an error object that is no string), more than
-- LIMIT_S seconds of CPU or more than LIMIT_MB of Lua memory for one input is a failure.
-- Time and memory are checked by a count hook as the input runs (under LuaJIT only where
-- code is interpreted) and the time again when it returns; a wait in C (an open of a FIFO
-- that a reader failed to refuse) cannot be interrupted from Lua: ctest's TIMEOUT ends the
-- run then, and the last line printed names the target before the one that hung.
--
-- The inputs are fixed: the seeds of tests/fuzz/corpus/, the example configs, hand-made
-- edge cases, and mutations of them (byte flips, inserted tokens, deletions, duplications,
-- splices, truncations, structure-aware value swaps) drawn from a PRNG with a fixed seed,
-- so a run is the same under Lua 5.4 and LuaJIT and from run to run.  Each target stops
-- early (the inputs it ran are still a prefix of the same sequence) when it has used
-- FUZZ_SECONDS of CPU (default 8).  Environment: FUZZ_SEED (default 20240917), FUZZ_SCALE (a
-- factor on every target's input count, default 1), FUZZ_OUT (where failing inputs are
-- written; default a temporary directory), FUZZ_TRACE (a file to list every input's outcome
-- in, to compare two runs).
--
-- Prints a line per target and ends with "fuzz: ok: N inputs ..." (exit 0) or
-- "fuzz: FAILED: ..." (exit 1).

local json = require "moonshard.json"
local util = require "moonshard.util"
local safetensors = require "moonshard.safetensors"
local models = require "moonshard.models"

local format, rep, char, byte, sub = string.format, string.rep, string.char, string.byte, string.sub
local floor = math.floor

local SEED = tonumber(os.getenv("FUZZ_SEED") or "") or 20240917
local SCALE = tonumber(os.getenv("FUZZ_SCALE") or "") or 1
local TARGET_SECONDS = tonumber(os.getenv("FUZZ_SECONDS") or "") or 8
local LIMIT_S = 3        -- CPU seconds one input may take
local LIMIT_MB = 512     -- Lua memory one input may hold (checked every HOOK_STEP instructions)
local HOOK_STEP = 10000
local MAX_MESSAGE = 4096
local interp = type(rawget(_G, "jit")) == "table" and jit.version or _VERSION
-- FUZZ_TRACE=file: one line per input (value or error and its message), to compare runs
local TRACE = os.getenv("FUZZ_TRACE") and os.getenv("FUZZ_TRACE") ~= "" and assert(io.open(os.getenv("FUZZ_TRACE"), "w"))

-- ---------------------------------------------------------------- a PRNG both interpreters agree on

-- Park-Miller (minimal standard, multiplier 48271): every product is below 2^47, exact as a
-- Lua 5.4 integer and as a LuaJIT double.
local Rng = {}
Rng.__index = Rng
local function rng_new(seed) return setmetatable({ x = floor(seed) % 2147483646 + 1 }, Rng) end
function Rng:next()
  self.x = self.x * 48271 % 2147483647
  return self.x
end
function Rng:int(n) return self:next() % n + 1 end -- 1..n
function Rng:range(lo, hi) return lo + self:next() % (hi - lo + 1) end
function Rng:pick(t) return t[self:int(#t)] end
function Rng:chance(p) return self:next() % 1000 < p * 1000 end

-- ---------------------------------------------------------------- files

local S = require "support" -- tests/lua/support.lua: file helpers shared with the specs
local shell_quote, read, write = S.quote, S.read_file, S.write_file

local function mkdir(path) assert(os.execute("mkdir -p " .. shell_quote(path))) end

local TMP = os.tmpname()
os.remove(TMP)
mkdir(TMP)
local OUT = os.getenv("FUZZ_OUT")
if not OUT or OUT == "" then OUT = TMP .. "/failures" end

local function u64le(n)
  local b = {}
  for i = 1, 8 do
    b[i] = char(n % 256)
    n = floor(n / 256)
  end
  return table.concat(b)
end

-- ---------------------------------------------------------------- checking one input

local total, failures, failed_inputs, values = 0, 0, {}, 0
local nul_in_message_ok = false -- while the input is a path with a NUL, which messages name
local mem_base, t0_input

local function budget_hook()
  if os.clock() - t0_input > LIMIT_S then error("fuzz: over the time limit", 2) end
  if collectgarbage("count") > mem_base + LIMIT_MB * 1024 then error("fuzz: over the memory limit", 2) end
end

local function pack(...) return { n = select("#", ...), ... } end

local function clean_error(err)
  if type(err) ~= "string" then return false, "an error that is no string (" .. type(err) .. ")" end
  -- module.lua positions an error at the first caller outside the library: this file
  if err:find("fuzz: over the") then return false, "over the budget" end
  local msg = err:gsub("^[^\n]*fuzz%.lua:%d+: ", "")
  if not msg:find("^moonshard[ :]") then return false, "not a moonshard error" end
  if #msg > MAX_MESSAGE then return false, format("a message of %d bytes", #msg) end
  if msg:find("\0", 1, true) and not nul_in_message_ok then return false, "a NUL byte in the message" end
  return true
end

-- Runs fn(...) on one input; returns ok, the value or the error.  input: what to save on
-- failure (a string, or a table of named strings for a multi-file input).
local function run(target, input, fn, ...)
  total = total + 1
  collectgarbage("collect")
  mem_base = collectgarbage("count")
  t0_input = os.clock()
  debug.sethook(budget_hook, "", HOOK_STEP)
  local res = pack(pcall(fn, ...))
  debug.sethook()
  local dt = os.clock() - t0_input
  local ok, why = res[1], nil
  if ok then values = values + 1 end
  if TRACE then TRACE:write(format("%s-%d %s %s\n", target, total, ok and "value" or "error",
    ok and "" or util.short_name(tostring(res[2]), 200))) end
  if not ok then
    local clean
    clean, why = clean_error(res[2])
    if clean then why = nil end
  end
  if not why and dt > LIMIT_S then why = format("took %.2f s", dt) end
  if why then
    failures = failures + 1
    local id = format("%s-%d", target, total)
    failed_inputs[#failed_inputs + 1] = id
    mkdir(OUT)
    if type(input) == "table" then
      for name, s in pairs(input) do write(OUT .. "/" .. id .. "." .. name, s) end
    else
      write(OUT .. "/" .. id .. ".input", input)
    end
    write(OUT .. "/" .. id .. ".error", tostring(res[2]) .. "\n" .. why .. "\n")
    if failures <= 10 then
      io.write(format("  FAIL %s (%s): %s\n", id, why, util.short_name(tostring(res[2]), 300)))
    end
  end
  return ok, res[2]
end

-- ---------------------------------------------------------------- mutations

local DICT = { '"', '\\', '\\u0000', '\\ud800', '\\udc00', '\\uDBFF\\uDFFF', '\\x', '[', ']', '{', '}', ',', ':',
  '.', '..', '-', '0', '-0', '00', '1e999', '-1e999', '1e-400', '9007199254740992', '9007199254740993',
  '9223372036854775807', '9223372036854775808', '18446744073709551615', '18446744073709551616',
  '-9223372036854775808', '1.5', '0.1', '1e2', '1E+2', '2.0', 'true', 'false', 'null', 'nul', 'NaN',
  'Infinity', '\0', '\255', '\192\128', '\237\160\128', '\244\144\128\128', '\195\40', '\239\187\191',
  ' ', '\t', '\n', '\r', '\11', '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F32"', '"BF16"',
  '"F8_E4M3"', '"I64"', '"BOOL"', '"U16"', '"weight_map"', '"architectures"', '"num_hidden_layers"',
  '"experts"', '.experts.', 'a.b', '[0,0]', '[]', '{}', '""', '"a":1', '"a":1,"a":2' }

local NUMBERS = { 0, 1, 2, 3, 7, 8, 64, 255, 1023, 1024, 1025, 65536, 2 ^ 30, 2 ^ 30 + 1, 2 ^ 31, 2 ^ 32,
  2 ^ 53, 2 ^ 53 + 2, 2 ^ 62, 2 ^ 63, 2 ^ 64, -1, -2 ^ 31, -2 ^ 63, 1.5, 0.5, -0.0, 1e300, 1e-300 }

local function mutate_once(rng, s, others)
  local n = #s
  local op = rng:int(10)
  local pos = rng:range(1, n + 1)
  if op == 1 and n > 0 then -- a byte
    return sub(s, 1, pos - 1) .. char(rng:range(0, 255)) .. sub(s, pos + 1)
  elseif op == 2 and n > 0 then -- a printable byte
    return sub(s, 1, pos - 1) .. char(rng:range(32, 126)) .. sub(s, pos + 1)
  elseif op == 3 or op == 4 then -- a token
    return sub(s, 1, pos - 1) .. rng:pick(DICT) .. sub(s, pos)
  elseif op == 5 then -- delete a range
    return sub(s, 1, pos - 1) .. sub(s, pos + rng:range(1, 64))
  elseif op == 6 and n > 0 then -- duplicate a range elsewhere
    local a = rng:range(1, n)
    local piece = sub(s, a, a + rng:range(0, 64))
    return sub(s, 1, pos - 1) .. piece .. sub(s, pos)
  elseif op == 7 then -- truncate
    return sub(s, 1, pos - 1)
  elseif op == 8 and others and #others > 0 then -- splice with another input
    local o = rng:pick(others)
    return sub(s, 1, pos - 1) .. sub(o, rng:range(1, #o + 1))
  elseif op == 9 then -- a number swapped for another
    local count = select(2, s:gsub("%-?%d+%.?%d*[eE]?[-+]?%d*", ""))
    if count == 0 then return s .. rng:pick(DICT) end
    local k, i = rng:int(count), 0
    return (s:gsub("%-?%d+%.?%d*[eE]?[-+]?%d*", function(num)
      i = i + 1
      if i ~= k then return num end
      local v = rng:pick(NUMBERS)
      return rng:chance(0.5) and rng:pick({ "9223372036854775808", "1e999", "-1", "2.5", "1" .. rep("0", 400),
        "0." .. rep("0", 400) .. "1" }) or (v == floor(v) and v < 2 ^ 63 and v >= -2 ^ 63 and format("%d", v) or
        format("%.17g", v))
    end))
  else -- a run of one token: deep nesting, long strings
    local tok = rng:pick({ "[", "{\"a\":", "a.", ".", "\"", "\\", "0", " ", "\255" })
    return sub(s, 1, pos - 1) .. rep(tok, rng:pick({ 10, 100, 511, 512, 513, 1000, 20000 })) .. sub(s, pos)
  end
end

local function mutate(rng, s, others)
  for _ = 1, rng:range(1, 3) do s = mutate_once(rng, s, others) end
  return s
end

-- ---------------------------------------------------------------- targets

local results = {}

local function target(name, count, body)
  local t0, n0, f0, v0 = os.clock(), total, failures, values
  local stopped = false
  for i = 1, floor(count * SCALE) do
    if os.clock() - t0 > TARGET_SECONDS then
      stopped = true
      break
    end
    body(i)
  end
  local line = format("fuzz: %-12s %6d inputs (%d values, %d errors), %d failed, %.1f s%s", name, total - n0,
    values - v0, total - n0 - (values - v0), failures - f0, os.clock() - t0, stopped and format(" (stopped at the %d s budget)", TARGET_SECONDS) or "")
  results[#results + 1] = line
  io.write(line, "\n")
  io.flush()
end

local function corpus(pattern)
  local out = {}
  local ls = io.popen("ls -1 tests/fuzz/corpus 2>/dev/null")
  for name in ls:lines() do
    if name:match(pattern) then out[#out + 1] = read("tests/fuzz/corpus/" .. name) end
  end
  ls:close()
  table.sort(out)
  return out
end

local CONFIG_FILES = { "examples/configs/deepseek_v3.json", "examples/configs/inkling2_16b.json",
  "examples/configs/inkling2_small.json", "examples/configs/llama3.1_8b.json",
  "examples/configs/mixtral_8x7b.json", "examples/configs/qwen3_30b_a3b.json", "tests/lua/configs/inkling2_tiny.json",
  "examples/configs/qwen2.5_7b.json", "examples/configs/qwen3_8b.json", "examples/configs/mistral_7b_v0.3.json",
  "examples/configs/gemma2_9b.json", "examples/configs/gemma3_1b.json" }
local configs = {}
for i, path in ipairs(CONFIG_FILES) do configs[i] = read(path) end
local json_seeds = corpus("^json_.*%.json$")
local header_seeds = corpus("%.header%.json$")
assert(#json_seeds > 0 and #header_seeds > 0, "fuzz: no corpus in tests/fuzz/corpus (run from the source directory)")
local all_text = {}
for _, list in ipairs({ json_seeds, header_seeds, configs }) do
  for _, s in ipairs(list) do all_text[#all_text + 1] = s end
end

-- JSON: fixed edge cases, then mutations of every JSON text of the corpus.
local JSON_CASES = {
  "", " ", "\239\187\191{}", "{}", "[]", "null", "nul", "-", "-0", "01", "1.", ".5", "1e", "1e+", "0x10",
  "1" .. rep("0", 400), "1e999", "-1e999", "1e-999", "9007199254740993", "18446744073709551616",
  "-9223372036854775809", "\"\\u0000\"", "{\"\\u0000\": 1}", "{\"a\\u0000b\": 1}", "\"\\ud800\"", "\"\\udc00\"",
  "\"\\ud800\\u0041\"", "\"\255\"", "\"\192\128\"", "\"\237\160\128\"", "\"\244\144\128\128\"", "\"\0\"",
  "{\"a\": 1, \"a\": 2}", "{\"a\": 1,}", "[1,]", "[1 2]", "{\"a\" 1}", "{1: 2}", "[\"a\"\"b\"]", "NaN", "Infinity",
  rep("[", 100000), rep("[", 512) .. rep("]", 512), rep("[", 513) .. rep("]", 513),
  rep("{\"a\":", 100000), rep("{\"a\":", 512) .. "0" .. rep("}", 512), "\"" .. rep("a", 1000000) .. "\"",
  "\"" .. rep("\\u00e9", 100000) .. "\"", "{\"" .. rep("k", 200000) .. "\": 1, \"" .. rep("k", 200000) .. "\": 2}",
  "[" .. rep("1,", 100000) .. "1]", rep(" ", 100000) .. "1", "1 2", "{} x", "\"\\",
}

local function json_check(text)
  local v = json.decode(text, "fuzz")
  -- what decodes encodes, and the encoding is a fixed point
  local e1 = json.encode(v)
  local e2 = json.encode(json.decode(e1, "fuzz (re-encoded)"))
  if e1 ~= e2 then error("fuzz: encode(decode(encode(v))) differs from encode(v)", 0) end
  return v
end

local function json_counts(text) return json.decode(text, "fuzz", { counts = true }) end

-- A header file: the length field (by default the header's own length), the header, data.
local function header_file(text, data_size, length_field)
  return (length_field or u64le(#text)) .. text .. rep("\0", data_size or 0)
end

local st_path = TMP .. "/fuzz.safetensors"
local function st_check(bytes)
  write(st_path, bytes)
  return safetensors.tree_from_safetensors(st_path)
end

-- safetensors headers made from parts: names (deep, long, odd bytes), dtypes, shapes and
-- offsets from edge values, usually tiling the data area so that the tree gets built.
local NAME_PARTS = { "model", "layers", "0", "1", "2", "10", "mlp", "experts", "gate_and_up_projs", "down_projs",
  "weight", "bias", "e_score_correction_bias", "self_attn", "q_proj", "gate", "a", "", "\195\169", "x\0y", "\n",
  "9999999999999999999999", "01" }
local DTYPES = { "F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I8", "U8", "BOOL", "U16", "f32", "" }
local DSIZE = { F64 = 8, F32 = 4, F16 = 2, BF16 = 2, F8_E4M3 = 1, F8_E5M2 = 1, I64 = 8, I32 = 4, I8 = 1, U8 = 1, BOOL = 1 }
local SIZES = { 0, 1, 2, 3, 4, 7, 8, 16, 2 ^ 31, 2 ^ 53, 2 ^ 62 }

local function gen_name(rng)
  local r = rng:int(20)
  if r == 1 then return rep("a.", rng:pick({ 62, 63, 64, 100, 5000 })) .. "w" end
  if r == 2 then return rep("n", rng:pick({ 1023, 1024, 1025, 100000 })) end
  local parts = {}
  for i = 1, rng:range(1, 7) do parts[i] = rng:pick(NAME_PARTS) end
  return table.concat(parts, ".")
end

local function gen_header(rng)
  local header, cursor = {}, 0
  for _ = 1, rng:range(0, 6) do
    local dtype = rng:pick(DTYPES)
    local shape = json.array()
    local numel = 1
    for d = 1, rng:range(0, 4) do
      shape[d] = rng:chance(0.85) and rng:range(0, 5) or rng:pick(SIZES)
      numel = numel * shape[d]
    end
    local bytes = numel * (DSIZE[dtype] or 4)
    local offsets = json.array({ cursor, cursor + bytes })
    if rng:chance(0.1) then offsets = json.array({ rng:pick(SIZES), rng:pick(SIZES) }) end
    if rng:chance(0.05) then offsets = rng:pick({ json.array(), json.array({ 0 }), json.array({ 0, 1, 2 }), "x" }) end
    cursor = cursor + bytes
    local entry = { dtype = dtype, shape = shape, data_offsets = offsets }
    if rng:chance(0.05) then entry.shape = rng:pick({ "x", json.null, {}, json.array({ -1 }), json.array({ 1.5 }) }) end
    if rng:chance(0.05) then entry.extra = "ignored" end
    if rng:chance(0.03) then entry = rng:pick({ json.null, 1, "x", json.array() }) end
    header[gen_name(rng)] = entry
  end
  if rng:chance(0.2) then
    header.__metadata__ = rng:pick({ json.null, { format = "pt" }, { n = 1 }, json.array(), "x" })
  end
  return header, cursor
end

local LENGTH_FIELDS = { u64le(0), u64le(1), u64le(2 ^ 32), u64le(2 ^ 53), "\0\0\0\0\0\0\0\128", rep("\255", 8),
  u64le(100 * 1024 * 1024), u64le(100 * 1024 * 1024 + 1), "\1\2\3" }

local function gen_st_file(rng)
  local header, data = gen_header(rng)
  local ok, text = pcall(json.encode, header)
  if not ok then text = "{}" end
  if data > 65536 or rng:chance(0.1) then data = rng:range(0, 64) end
  if rng:chance(0.5) then text = mutate(rng, text, all_text) end
  local length
  if rng:chance(0.1) then length = rng:pick(LENGTH_FIELDS)
  elseif rng:chance(0.05) then length = u64le(#text + rng:range(1, 100)) end
  return header_file(text, data, length)
end

-- Indexes: two or three generated shards and their weight_map, then changes to the map.
local idx_dir = TMP .. "/index"
mkdir(idx_dir)
local function index_input(rng)
  local files, weight_map = {}, {}
  for s = 1, rng:range(1, 3) do
    local header, data = gen_header(rng)
    local ok, text = pcall(json.encode, header)
    if not ok then header, text = {}, "{}" end
    if data > 65536 then data = 0 end
    local name = format("model-%05d-of-00003.safetensors", s)
    files[name] = header_file(text, data)
    for tname in pairs(header) do
      if tname ~= "__metadata__" then weight_map[tname] = name end
    end
  end
  for _ = 1, rng:range(0, 2) do
    local keys = util.sorted_keys(weight_map)
    local r = rng:int(5)
    if r == 1 and #keys > 0 then weight_map[rng:pick(keys)] = nil
    elseif r == 2 and #keys > 0 then
      weight_map[rng:pick(keys)] = rng:pick({ "model-00002-of-00003.safetensors", "", "../index", "/dev/zero",
        "fifo.safetensors", "dir.safetensors", "missing.safetensors", 7, json.null, "a\0b" })
    elseif r == 3 then weight_map[gen_name(rng)] = "model-00001-of-00003.safetensors"
    elseif r == 4 and #keys > 0 then
      local k = rng:pick(keys)
      weight_map[k], weight_map[k .. ".x"] = nil, weight_map[k]
    end
  end
  local index = { weight_map = weight_map }
  local r = rng:int(4)
  if r == 1 then index.metadata = { total_size = 1 } elseif r == 2 then index.metadata = json.null
  elseif r == 3 then index.metadata = "x" end
  if rng:chance(0.05) then index = rng:pick({ json.array(), { weight_map = json.array() }, "x" }) end
  local ok, text = pcall(json.encode, index)
  if not ok then text = "{}" end
  if rng:chance(0.3) then text = mutate(rng, text, all_text) end
  files["model.safetensors.index.json"] = text
  return files
end

local function index_check(files)
  for name, bytes in pairs(files) do write(idx_dir .. "/" .. name, bytes) end
  local ok, res = pcall(safetensors.tree_from_safetensors, idx_dir .. "/model.safetensors.index.json")
  for name in pairs(files) do os.remove(idx_dir .. "/" .. name) end
  if not ok then error(res, 0) end
  return res
end

-- Configs: values swapped for edge values, keys dropped, architectures changed; then the
-- builder through a table, and through text (mutated bytes) now and then.
local CONFIG_VALUES = { 0, 1, 2, 3, 4, 7, 8, 16, 64, 1023, 1024, 1025, 65536, 2 ^ 30, 2 ^ 30 + 1, 2 ^ 31, 2 ^ 53,
  2 ^ 63, -1, -2 ^ 31, 1.5, 0.5, -0.0, 1e308, "", "bfloat16", "float8", "x", true, false, json.null, json.array(),
  {}, json.array({ 1, 2, 3 }), json.array({ -1 }), json.array({ 1.5 }), json.array({ "LlamaForCausalLM" }),
  rep("x", 100000), json.array({ rep("y", 100000) }), { [rep("k", 100000)] = 1 } }
do
  local long = json.array()
  for i = 1, 3000 do long[i] = i end
  CONFIG_VALUES[#CONFIG_VALUES + 1] = long
  local deep = json.array()
  for _ = 1, 300 do deep = json.array({ deep }) end
  CONFIG_VALUES[#CONFIG_VALUES + 1] = deep
end
local ARCHS = { "LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
  "Inkling2ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM",
  "Gemma3ForCausalLM", "GPT2LMHeadModel", "", rep("A", 100000), "a\0b" }

local function config_input(rng)
  local cfg = json.decode(rng:pick(configs), "seed")
  local keys = util.sorted_keys(cfg)
  for _ = 1, rng:range(1, 3) do
    local r = rng:int(10)
    if r <= 6 then cfg[rng:pick(keys)] = rng:pick(CONFIG_VALUES)
    elseif r == 7 then cfg[rng:pick(keys)] = nil
    elseif r == 8 then cfg.architectures = json.array({ rng:pick(ARCHS) })
    elseif r == 9 then cfg.num_hidden_layers = rng:pick({ 1, 2, 61, 200, 1025 })
    else cfg[rng:pick(keys)] = rng:pick(CONFIG_VALUES) cfg[rng:pick(keys)] = rng:pick(CONFIG_VALUES) end
  end
  local ok, text = pcall(json.encode, cfg)
  if not ok then text = "{}" end
  if rng:chance(0.2) then text = mutate(rng, text, configs) end
  return text
end

local function config_check(text)
  local cfg = json.decode(text, "fuzz config")
  return models.from_config(cfg, "fuzz config")
end

-- ---------------------------------------------------------------- the run

io.write(format("fuzz: %s, seed %d, scale %s, failing inputs to %s\n", interp, SEED, tostring(SCALE), OUT))
local t_start = os.clock()
local rng = rng_new(SEED)

target("json", 6000, function(i)
  local text
  if i <= #JSON_CASES then text = JSON_CASES[i]
  elseif i <= #JSON_CASES + #all_text then text = all_text[i - #JSON_CASES]
  else text = mutate(rng, rng:pick(all_text), all_text) end
  run("json", text, json_check, text)
  if i % 4 == 0 then run("json_counts", text, json_counts, text) end
end)

local ST_CASES = {
  "", "\0\0\0", u64le(0), u64le(2) .. "{}", u64le(2) .. "{", u64le(1000) .. "{}", "\0\0\0\0\0\0\0\128{}",
  rep("\255", 8) .. "{}", u64le(4) .. "null", u64le(2) .. "[]", u64le(5) .. "  {}", u64le(2) .. "{}" .. "\0",
  header_file('{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[9007199254740993],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[9223372036854775807],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1e3],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,9007199254740992]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}', 4),
  header_file('{"a\\u0000b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"a.\\u0000":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a.b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8),
  header_file('{"' .. rep("a.", 63) .. 'w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"' .. rep("a.", 64) .. 'w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"' .. rep("a.", 50000) .. 'w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"' .. rep("w", 100000) .. '":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"\255":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
  header_file('{"__metadata__":{"' .. rep("k", 100000) .. '":1}}', 0),
  header_file(rep("[", 100000), 0), header_file("{" .. rep('"a":{', 600) .. rep("}", 601), 0),
}
for _, seed in ipairs(header_seeds) do ST_CASES[#ST_CASES + 1] = header_file(seed, 240) end

target("safetensors", 2500, function(i)
  local bytes
  if i <= #ST_CASES then bytes = ST_CASES[i]
  elseif i % 2 == 0 then bytes = gen_st_file(rng)
  else
    local seed = rng:pick(header_seeds)
    bytes = header_file(mutate(rng, seed, all_text), rng:pick({ 240, 137, 0, 1000 }),
      rng:chance(0.1) and rng:pick(LENGTH_FIELDS) or nil)
    if rng:chance(0.1) then bytes = mutate(rng, bytes) end -- the length field too
  end
  run("safetensors", bytes, st_check, bytes)
end)

-- special files beside the shards: a FIFO, a directory
local have_stat = util.file_stat_fn() ~= false
local _ = have_stat and os.execute("mkfifo " .. shell_quote(idx_dir .. "/fifo.safetensors") .. " 2>/dev/null")
mkdir(idx_dir .. "/dir.safetensors")

target("index", 400, function()
  local files = index_input(rng)
  run("index", files, index_check, files)
end)

target("config", 800, function(i)
  local text = i <= #configs and configs[i] or config_input(rng)
  run("config", text, config_check, text)
end)

-- Special files as paths, to every reader: refused by what they are, never waited on.
local special_dir = TMP .. "/special"
mkdir(special_dir)
local fifo = special_dir .. "/fifo.json"
local made_fifo = have_stat and os.execute("mkfifo " .. shell_quote(fifo) .. " 2>/dev/null")
local sparse = special_dir .. "/sparse.json" -- a regular file past every limit, with no blocks
do
  local f = assert(io.open(sparse, "wb"))
  f:seek("set", 128 * 1024 * 1024)
  f:write("}")
  f:close()
end
local short = write(special_dir .. "/short.safetensors", u64le(1000) .. "{}")
write(special_dir .. "/empty.json", "")
local SPECIAL = {
  { "/dev/zero", "not a regular file" }, { "/dev/null", "not a regular file" }, { special_dir, "not a regular file" },
  { special_dir .. "/missing.json", "No such file" }, { special_dir .. "/empty.json", nil },
  { sparse, "limit", read_header = "does not start with '{'" }, -- a checkpoint has no size limit, its header has
  { short, nil }, { "", nil },
}
if made_fifo then
  SPECIAL[#SPECIAL + 1] = { fifo, "not a regular file" }
  SPECIAL[#SPECIAL + 1] = { fifo .. "\0tail", "NUL" }
end
local READERS = {
  { "read_file", function(p)
    local text, err, opened = util.read_file(p, "json")
    if not text then error("moonshard: " .. (opened and p .. ": " or "") .. tostring(err), 0) end
    return text
  end },
  { "read_file(policy)", function(p)
    local text, err = util.read_file(p)
    if not text then error("moonshard: " .. tostring(err), 0) end
    return text
  end },
  { "read_header", safetensors.read_header }, { "read_index", safetensors.read_index },
  { "tree_from_safetensors", safetensors.tree_from_safetensors }, { "from_config", models.from_config },
}

target("special", #SPECIAL * #READERS / SCALE, function(i)
  local case = SPECIAL[floor((i - 1) / #READERS) % #SPECIAL + 1]
  local reader = READERS[(i - 1) % #READERS + 1]
  nul_in_message_ok = case[1]:find("\0", 1, true) ~= nil
  local ok, err = run("special", case[1], reader[2], case[1])
  nul_in_message_ok = false
  -- the reason, when the core tells what the file is
  local want = case[reader[1]] or case[2]
  if have_stat and want and (ok or type(err) ~= "string" or not err:find(want, 1, true)) then
    failures = failures + 1
    io.write(format("  FAIL special %s(%q): expected an error about '%s', got: %s\n", reader[1], case[1], want,
      ok and "no error" or util.short_name(tostring(err), 300)))
  end
end)
if not have_stat then io.write("fuzz: note: no core loaded (file_stat): FIFOs not tried, refusals by size only\n") end

local elapsed = os.clock() - t_start
os.execute("rm -rf " .. shell_quote(TMP))
if failures > 0 then
  io.write(format("fuzz: FAILED: %d of %d inputs failed (%s; inputs in %s) in %.1f s\n", failures, total, interp,
    OUT, elapsed))
  os.exit(1)
end
io.write(format("fuzz: ok: %d inputs, 0 failed (%s) in %.1f s\n", total, interp, elapsed))
