-- support.lua: what the busted specs share: running the real moonshard executable.

local S = {}

S.bin = os.getenv("MOONSHARD_BIN") or "build/moonshard"

local function readable(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- Both executables, whichever one S.bin is (for specs that compare them): moonshard on
-- Lua 5.4, and moonshard-jit on LuaJIT (nil when it was not built).
S.lua54_bin = os.getenv("MOONSHARD_LUA54_BIN") or "build/moonshard"
S.jit_bin = os.getenv("MOONSHARD_JIT_BIN") or (readable("build/moonshard-jit") and "build/moonshard-jit") or nil

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  os.remove(path)
  return s
end

--- read_file(path) -> the whole file; write_file(path, text) -> path (assert on failure)
function S.read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

function S.write_file(path, text)
  local f = assert(io.open(path, "wb"))
  assert(f:write(text))
  f:close()
  return path
end

--- refdata(file) -> {name = {type = t, n = count, values = {...}}}: a file of
-- tests/reference/data (made by tests/reference/make.sh; format in tests/reference/refdata.py).
-- x8/x16/x32 and i64 values are numbers (i64 exact to 2^53), x64 hexadecimal strings, f64
-- numbers. A missing file is an error that says how to make it. A file named with a "/" is
-- read from that path (a test's altered copy).
function S.refdata(file)
  local path = file:find("/", 1, true) and file or "tests/reference/data/" .. file
  local f, why = io.open(path, "rb")
  if not f then error(path .. ": " .. tostring(why) .. " (run tests/reference/make.sh to make it)", 2) end
  local recs, lineno = {}, 0
  for line in f:lines() do
    lineno = lineno + 1
    if not line:match("^%s*#") and line:match("%S") then
      local name, typ, n, rest = line:match("^(%S+) (%S+) (%d+) ?(.*)$")
      assert(name, path .. ":" .. lineno .. ": expected: name type count values")
      local values = {}
      for tok in rest:gmatch("%S+") do
        if typ == "x64" then values[#values + 1] = tok
        elseif typ:sub(1, 1) == "x" then values[#values + 1] = tonumber(tok, 16)
        else values[#values + 1] = tonumber(tok) end
      end
      assert(#values == tonumber(n), path .. ":" .. lineno .. ": " .. name .. ": count " .. n .. ", " .. #values .. " values")
      recs[name] = { type = typ, n = #values, values = values }
    end
  end
  f:close()
  return recs
end

local function shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end
S.quote = shell_quote

--- run_with(bin, args, env?) -> {code = exit status, out = stdout, err = stderr, seconds = wall time}
-- bin: the executable; args: a list of its arguments; env: table of environment variables to set.
function S.run_with(bin, args, env)
  local parts = {}
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. shell_quote(v) end
  parts[#parts + 1] = shell_quote(bin)
  for _, a in ipairs(args) do parts[#parts + 1] = shell_quote(a) end
  local out, err = os.tmpname(), os.tmpname()
  local cmd = table.concat(parts, " ") .. " >" .. out .. " 2>" .. err .. " </dev/null"
  local t0 = os.time()
  local ok, how, code = os.execute("env " .. cmd)
  local r = { out = slurp(out), err = slurp(err), seconds = os.time() - t0 }
  if type(ok) == "number" then
    -- Lua 5.1 / LuaJIT without 5.2 compatibility: the raw wait status
    r.code = ok % 256 == 0 and math.floor(ok / 256) or 128 + ok % 128
  else
    r.code = (how == "exit") and code or 128 + (code or 0)
    if ok == true then r.code = 0 end
  end
  return r
end

--- run(args, env?): run_with(S.bin, args, env), the moonshard executable under test
function S.run(args, env)
  return S.run_with(S.bin, args, env)
end

--- runs a Lua chunk on n ranks; returns the run() result
function S.run_code(n, code, env)
  return S.run({ "-n", tostring(n), "-e", code }, env)
end

-- A tiny safetensors writer for tests: the header length, the header JSON, then zero
-- bytes for the data.
local function u64le(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(b)
end

-- Writes a raw safetensors file: header (a JSON text or a value to encode) and data_size
-- zero bytes; length overrides the header length field.
function S.write_raw(path, header, data_size, length)
  local text = type(header) == "string" and header or require("moonshard.json").encode(header)
  local f = assert(io.open(path, "wb"))
  f:write(u64le(length or #text), text, string.rep("\0", data_size or 0))
  f:close()
  return path
end

local sizes = { F64 = 8, F32 = 4, BF16 = 2, F16 = 2, I64 = 8, I32 = 4, I8 = 1, U8 = 1, BOOL = 1,
  F8_E4M3 = 1, F8_E5M2 = 1 }

-- Writes a valid file holding tensors {name, dtype, shape} laid out in the given order.
function S.write_safetensors(path, tensors, metadata)
  local header, offset = {}, 0
  for _, t in ipairs(tensors) do
    local n = sizes[t[2]]
    for _, s in ipairs(t[3]) do n = n * s end
    header[t[1]] = { dtype = t[2], shape = require("moonshard.json").array(t[3]), data_offsets = { offset, offset + n } }
    offset = offset + n
  end
  header.__metadata__ = metadata
  return S.write_raw(path, header, offset)
end

-- Bytes per element of the planner's dtypes; nil marks the ones without gradients.
local STORED = { f32 = 4, f16 = 2, bf16 = 2, f8e4m3 = 1, f8e5m2 = 1, f64 = 8, i64 = 8, i32 = 4, i8 = 1, u8 = 1, bool = 1 }
local FLOATING = { f32 = true, f16 = true, bf16 = true, f8e4m3 = true, f8e5m2 = true, f64 = true }

--- offloaded_bytes(plan) -> a list, per rank (1-based), of what the units planned with
-- offload_policy "cpu" keep in host memory, worked out from the units' own entries rather
-- than by the planner's code: every parameter's padded shard and, when it trains, its
-- padded gradient shard (both in the stored dtype) and AdamW's two f32 moments, plus an
-- f32 master weight when it is not stored in f32, for the rows torch.chunk gives the
-- rank's coordinate on the unit's shard axis.
function S.offloaded_bytes(plan)
  local out = {}
  for r = 0, plan.mesh.world - 1 do
    local bytes = 0
    for _, u in ipairs(plan.units) do
      if u.offload == "cpu" then
        local c = plan.mesh:coord(u.mesh_axes[#u.mesh_axes], r)
        for _, e in ipairs(u.entries) do
          local dtype, padded, per_row = e.param.dtype, 1, 1
          for _, s in ipairs(e.padded) do padded = padded * s end
          for d, s in ipairs(e.shape) do if d ~= e.dim + 1 then per_row = per_row * s end end
          bytes = bytes + padded * STORED[dtype]
          if e.param.requires_grad and FLOATING[dtype] then
            local n = e.shape[e.dim + 1]
            local chunk = math.ceil(n / u.shard_size)
            local rows = math.max(0, math.min(chunk, n - c * chunk))
            bytes = bytes + padded * STORED[dtype] + rows * per_row * (dtype == "f32" and 8 or 12)
          end
        end
      end
    end
    out[r + 1] = bytes
  end
  return out
end

--- The message of the error f(...) raises (the call must fail).
--- The Python of the reference venv (MOONSHARD_PYTHON, else /tmp/ref/venv/bin/python) when it
-- exists and imports `modules` (e.g. "safetensors, torch"); else nil and why the check that
-- needs it is skipped (a line for pending()).
S.PYTHON = os.getenv("MOONSHARD_PYTHON") or "/tmp/ref/venv/bin/python"
function S.python_with(modules)
  local f = io.open(S.PYTHON, "rb")
  if not f then return nil, "no Python venv at " .. S.PYTHON .. " (set MOONSHARD_PYTHON): the check is skipped" end
  f:close()
  if S.run_with(S.PYTHON, { "-c", "import " .. modules }).code ~= 0 then
    return nil, "the Python at " .. S.PYTHON .. " has no " .. modules:gsub(", ", "/") .. ": the check is skipped"
  end
  return S.PYTHON
end

function S.errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert(not ok, "expected an error")
  return tostring(err)
end

--- Asserts that text holds part, found as plain text (messages hold parentheses, dots and
-- quotes), showing the text when it does not.
function S.assert_has(text, part)
  assert(text:find(part, 1, true), string.format("expected %q in:\n%s", part, text))
end

return S
