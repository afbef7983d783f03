-- support.lua: what the busted specs share: running the real moonshard executable.

local S = {}

S.bin = os.getenv("MOONSHARD_BIN") or "build/moonshard"

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  os.remove(path)
  return s
end

local function shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end
S.quote = shell_quote

--- run(args, env?) -> {code = exit status, out = stdout, err = stderr, seconds = wall time}
-- args: a list of arguments to moonshard; env: table of environment variables to set.
function S.run(args, env)
  local parts = {}
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. shell_quote(v) end
  parts[#parts + 1] = shell_quote(S.bin)
  for _, a in ipairs(args) do parts[#parts + 1] = shell_quote(a) end
  local out, err = os.tmpname(), os.tmpname()
  local cmd = table.concat(parts, " ") .. " >" .. out .. " 2>" .. err .. " </dev/null"
  local t0 = os.time()
  local ok, how, code = os.execute("env " .. cmd)
  local r = { out = slurp(out), err = slurp(err), seconds = os.time() - t0 }
  r.code = (how == "exit") and code or 128 + (code or 0)
  if ok == true then r.code = 0 end
  return r
end

--- runs a Lua chunk on n ranks; returns the run() result
function S.run_code(n, code, env)
  return S.run({ "-n", tostring(n), "-e", code }, env)
end

return S
