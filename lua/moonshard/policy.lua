-- moonshard.policy: loads user policies (plain Lua that returns data and functions) in a
-- sandbox with a budget, the way Redis runs scripts.
--
-- A policy is a directory of .lua files or a single .lua file.  Every file runs in an
-- environment holding only safe globals (moonshard.policy_sandbox); reading or writing any
-- other global is an error naming the file and line.  Files reach each other through a
-- `require` limited to the files of the same policy and to the host modules the caller
-- lists in opts.modules.  Loading a file, and every later call of a function a policy
-- returned, runs under a fresh budget (moonshard.policy_budget), so a runaway policy ends
-- with an error that names its file instead of hanging or exhausting the host.  An error
-- leaves a call as a string naming the policy file.  Runs under Lua 5.4 and LuaJIT and
-- needs nothing from the C binding.

local M = {}

-- LuaJIT's compiled traces never call the hook: the loader's functions that run in a
-- policy call (its require) stay interpreted, so their work is counted.
if rawget(_G, "jit") then rawget(_G, "jit").off(true, true) end

local budget = require "moonshard.policy_budget"
local sandbox = require "moonshard.policy_sandbox"
local run, wrap_all, sandbox_error, SANDBOX = budget.run, budget.wrap_all, budget.policy_error, sandbox.SANDBOX

local byte, find, format, sub = string.byte, string.find, string.format, string.sub
-- LuaJIT has no rawlen, but its # on a table never calls a metamethod.
local rawlen = rawlen or function(v) return #v end
local jit = rawget(_G, "jit")

local function copy(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

local util = require "moonshard.util"
local sorted_keys, read_file = util.sorted_keys, util.read_file

-- A regular file (asked without opening it where the core is loaded: an open of a FIFO
-- would block).
local function is_file(path)
  local stat = util.file_stat_fn()
  if stat then return stat(path) == "regular file" end
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- What M.load made, for entry_point: policy -> {cfg, main (a single file's value)}
local records = setmetatable({}, { __mode = "k" })

-- Source text only: bytecode could crash the VM.
local function compile(path, env)
  local src, err, opened = read_file(path)
  if not src then
    -- "io error": the embedding API's MS_ERR_IO
    error(opened and format("moonshard io error: policy %s: cannot read: %s", path, err) or
      "moonshard io error: policy " .. err, 0)
  end
  if byte(src, 1) == 27 then
    error(format("moonshard: policy %s: is precompiled bytecode; policies load from Lua source only", path), 0)
  end
  local chunk, msg = load(src, "@" .. path, "t", env)
  if not chunk then error("moonshard: policy " .. msg, 0) end
  -- LuaJIT's compiled traces never call the hook: policy code stays interpreted
  if jit then jit.off(chunk, true) end
  budget.add_source(chunk)
  return chunk
end

-- ---------------------------------------------------------------- loading

-- The shipped policies: policies/ of the source tree (lua/moonshard/ -> policies/), or
-- share/moonshard/policies of an install (share/lua/5.4/moonshard/ -> share/moonshard/).
local HERE = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local shipped_dir = false
function M.shipped_dir()
  if shipped_dir == false then
    shipped_dir = nil
    for _, d in ipairs({ HERE .. "/../../policies", HERE .. "/../../../moonshard/policies" }) do
      if is_file(d .. "/fsdp2_default.lua") then
        shipped_dir = d
        break
      end
    end
  end
  return shipped_dir
end

--- The host modules a policy may require: a copy of moonshard.util's pure helpers (no
-- function that reads a file).  The CLI and the embedding API pass these.
function M.host_modules()
  return { ["moonshard.util"] = util.pure() }
end

-- Opens only when path is a directory (POSIX).
local function is_directory(path)
  local f = io.open(path .. "/.", "rb")
  if f then f:close() end
  return f ~= nil
end

-- The .lua files of dir, sorted; names starting with "." (editor files) are skipped.
local function lua_files(dir, names)
  if not names then
    if not io.popen then
      error(format("moonshard: policy %s: cannot list a directory without io.popen; pass opts.files", dir), 0)
    end
    local ls = io.popen("ls -1 -- '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
    names = {}
    for name in ls:lines() do names[#names + 1] = name end
    ls:close()
  end
  local files = {}
  for _, name in ipairs(names) do
    if name:match("^[^.].*%.lua$") then files[#files + 1] = name end
  end
  table.sort(files)
  return files
end

-- The smallest limits: a policy needs some memory to load at all, and the wall clock is
-- read in whole seconds (os.time), so a limit below 1 s would stop calls at random.
local MIN = { memory_mb = 1, seconds = 1 }
M.MIN_LIMITS = MIN

local function option(opts, name, default)
  local v = opts[name]
  if v == nil then return default end
  if type(v) ~= "number" or v <= 0 then
    error(format("moonshard: policy.load: opts.%s must be a positive number, got %s", name, tostring(v)), 3)
  end
  if MIN[name] and v < MIN[name] then
    error(format("moonshard: policy.load: opts.%s is %s; the least is %d (%s)", name, tostring(v), MIN[name],
      name == "seconds" and "the clock is read in whole seconds" or "a policy needs at least 1 MiB to load"), 3)
  end
  return v
end

local function count(n, word)
  return format("%d %s%s", n, word, n == 1 and "" or "s")
end

-- A key as describe() shows it, with no metamethod run: describe() runs outside any policy
-- call, so a policy's __tostring must not run there.
local function key_text(k)
  local t = type(k)
  if t == "string" or t == "number" or t == "boolean" then return tostring(k) end
  return t
end

-- What describe() says of a value: its type, a list's length and element type, a table's
-- keys (and, depth levels down, theirs).
local function kind(v, depth)
  if type(v) ~= "table" then return type(v) end
  local keys = {}
  for k in next, v do keys[#keys + 1] = k end
  local n = rawlen(v)
  if #keys == 0 then return "empty table" end
  if #keys == n then
    local elem = type(rawget(v, 1))
    for i = 2, n do
      if type(rawget(v, i)) ~= elem then elem = "value" break end
    end
    return "list of " .. count(n, elem)
  end
  if depth == 0 then return "table of " .. count(#keys, "key") end
  table.sort(keys, function(a, b) return key_text(a) < key_text(b) end)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = key_text(k) .. " = " .. kind(rawget(v, k), depth - 1) end
  return "table {" .. table.concat(parts, ", ") .. "}"
end

--- The policy line running now, "file:line", while a policy call is in progress (so that
-- the host's errors can say which policy line called them); nil otherwise.
M.position = budget.position

--- The table of a policy that has parallelize(ctx): the single file's, or shard_units.lua's,
-- or the only file that has one.  For a policy M.load made, what the planner gets is a table
-- of the host's: parallelize calls the policy's function under the policy's budget whatever
-- the function is (one a later file put there, a host function), and prefetch and options
-- (its declared knobs) are the policy's values, which the planner reads raw.  Everything is read raw: an __index of the
-- policy's would run here, outside any policy call.
function M.entry_point(policy, path)
  local rec = records[policy]
  local function has(v) return type(v) == "table" and type(rawget(v, "parallelize")) == "function" end
  local found
  if rec and rec.main ~= nil then
    found = has(rec.main) and rec.main or nil
  elseif has(rawget(policy, "shard_units")) then
    found = rawget(policy, "shard_units")
  elseif not rec and has(rawget(policy, "main")) then
    found = rawget(policy, "main")
  else
    local with = {} -- the stems of the files that have it, named in the error
    for k, v in next, policy do
      if has(v) then
        with[#with + 1] = type(k) == "string" and k .. ".lua" or "?"
        found = found or v
      end
    end
    if #with > 1 then
      table.sort(with)
      error("moonshard: policy " .. path .. ": more than one file has parallelize(ctx) (" .. table.concat(with, ", ") ..
        "): name one with --policy, or make it shard_units.lua", 0)
    end
  end
  if not found then
    error("moonshard: policy " .. path .. ": no file returns a table with parallelize(ctx) " ..
      "(shard_units.lua usually does)", 0)
  end
  if not rec then return found end
  local fn = rawget(found, "parallelize")
  fn = rec.cfg.unwrapped[fn] or fn
  return { prefetch = rawget(found, "prefetch"), options = rawget(found, "options"),
    parallelize = function(ctx) return run(rec.cfg, fn, ctx) end }
end

--- describe(policy) -> text: the policy's path and, per file, the kind of value it returned.
function M.describe(p)
  return p.describe()
end

--- load(path, opts?) -> policy
-- path: a directory of .lua files (each loaded, sorted by name) or one .lua file.  The
-- policy maps each file's stem to the value the file returned; policy.main is that value
-- for a single file, policy.describe() lists the files (a file named like one of these
-- fields shadows it).  opts: instructions (per call, default 200e6), memory_mb (per call,
-- default 256), seconds (wall clock per call, default 60), modules (name -> module value
-- the policy may require), files (the names in the directory, where io.popen is missing).
-- Loads again from disk on every call.
function M.load(path, opts)
  opts = opts or {}
  if type(path) ~= "string" or path == "" then
    error("moonshard: policy.load: path must be a file or directory name, got " .. tostring(path), 2)
  end
  path = path:gsub("(.)/+$", "%1")
  local instructions = math.floor(option(opts, "instructions", budget.DEFAULT_INSTRUCTIONS))
  local memory_mb = option(opts, "memory_mb", budget.DEFAULT_MEMORY_MB)
  local cfg = budget.config(path, instructions, memory_mb, option(opts, "seconds", budget.DEFAULT_SECONDS))
  cfg.string, cfg.string_methods = sandbox.string(cfg)

  local stems, file_of = {}, {}
  local dir = is_directory(path)
  local home = dir and path or path:match("^(.*)/[^/]*$") or "."
  if dir then
    for _, name in ipairs(lua_files(path, opts.files)) do
      local stem = name:sub(1, -5)
      stems[#stems + 1] = stem
      file_of[stem] = path .. "/" .. name
    end
    if #stems == 0 then error(format("moonshard: policy %s: directory has no .lua files", path), 0) end
  else
    local stem = path:match("([^/]+)$"):gsub("%.lua$", "")
    stems[1], file_of[stem] = stem, path
  end
  -- The file `require name` loads: a file of the policy's directory (a single file's
  -- directory: policies/fsdp2_default.lua requires by_dtype), else a shipped policy file
  -- (require "fsdp2_default" from anywhere).  Names are stems, nothing that could reach
  -- another directory or a file that is not Lua source.
  local function sibling(name)
    if file_of[name] then return file_of[name] end
    local dirs = dir and {} or { home }
    local shipped = M.shipped_dir()
    if shipped then dirs[#dirs + 1] = shipped end
    for _, d in ipairs(dirs) do
      local file = d .. "/" .. name .. ".lua"
      if is_file(file) then
        file_of[name] = file
        return file
      end
    end
  end

  local modules = {}
  for name, m in pairs(opts.modules or {}) do
    modules[name] = type(m) == "table" and copy(m) or m
  end

  local loaded, loading = {}, {}
  collectgarbage("collect")
  local load_base_kb = collectgarbage("count")
  local env
  local function load_file(stem)
    if loaded[stem] ~= nil then return loaded[stem] end
    local file = file_of[stem]
    if loading[stem] then
      error(format("moonshard: policy %s: circular require of '%s' while it loads", file, stem), 0)
    end
    loading[stem] = true
    local ran, value = pcall(run, cfg, compile(file, env))
    if not ran then
      -- `return require("x").with{...}` is a tail call: the policy's line is gone from the
      -- stack when with() refuses, so its error names this file instead of derive.lua
      local msg = type(value) == "string" and value:match("^moonshard: policy [^\n]-/derive%.lua:%d+: (with: .*)$")
      error(msg and format("moonshard: policy %s: %s", file, msg) or value, 0)
    end
    loading[stem] = nil
    if value == nil then
      error(format("moonshard: policy %s: returned nothing (a policy file returns its data or functions)", file), 0)
    end
    loaded[stem] = value
    cfg.roots[#cfg.roots + 1] = value
    -- A call's cap counts what it adds; what the files keep counts together, or K files
    -- could keep K times the cap.
    if collectgarbage("count") - load_base_kb > cfg.memory_kb then
      collectgarbage("collect")
      local kept = collectgarbage("count") - load_base_kb
      if kept > cfg.memory_kb then
        error(format("moonshard: policy %s: the policy's files keep %.0f MiB once loaded, more than the memory cap " ..
                     "of %g MiB", file, kept / 1024, cfg.memory_mb), 0)
      end
    end
    return value
  end
  env = sandbox.env(cfg, function(name)
    if type(name) == "string" and modules[name] ~= nil then return modules[name] end
    local allowed = next(modules) and table.concat(sorted_keys(modules), ", ") or "none"
    if type(name) ~= "string" or not find(name, "^[%a_][%w_%-]*$") or #name > 200 then
      sandbox_error("require %s: not a policy file's name (the stem of a .lua file: letters, digits, '_' " ..
                    "and '-') nor an allowed module (%s); %s",
                    type(name) == "string" and format("%q", #name > 60 and sub(name, 1, 60) .. "..." or name)
                      or "of a " .. type(name), allowed, SANDBOX)
    end
    if sibling(name) then return load_file(name) end
    sandbox_error("require '%s': no %s.lua in %s%s and not an allowed module (%s); %s", name, name,
                  dir and "the policy directory " .. path or home,
                  M.shipped_dir() and " or the shipped policies" or "", allowed, SANDBOX)
  end)

  local p, files = {}, {}
  for i, stem in ipairs(stems) do
    p[stem] = wrap_all(cfg, load_file(stem), {}, file_of[stem])
    files[i] = file_of[stem]
  end
  local fields = { path = path, files = files, main = not dir and p[stems[1]] or nil }
  records[p] = { cfg = cfg, main = fields.main }
  function fields.describe()
    local lines = { format("policy %s: %s", path, count(#stems, "file")) }
    for i, stem in ipairs(stems) do
      lines[i + 1] = format("  %s: %s", files[i]:match("([^/]+)$"), kind(p[stem], 1))
    end
    return table.concat(lines, "\n")
  end
  return setmetatable(p, { __index = fields })
end

--- load_data(path, what, limits?) -> the value a single data file returns (a device profile,
-- a recipe), loaded like a policy file (the sandbox, limits: instructions, memory_mb,
-- seconds), and the loaded policy; errors name the file as `what` ("device profile FILE:
-- ...") instead of "policy FILE"; an io error keeps its status.
function M.load_data(path, what, limits)
  limits = limits or {}
  local ok, loaded = pcall(M.load, path, { instructions = limits.instructions, memory_mb = limits.memory_mb,
    seconds = limits.seconds, modules = {} })
  if not ok then
    local msg = tostring(loaded)
    if msg:find("^moonshard io error: ") then error((msg:gsub("^(moonshard io error: )policy ", "%1" .. what .. " ")), 0) end
    msg = msg:gsub("^moonshard: ", ""):gsub("^policy ", "")
    error("moonshard: " .. what .. " " .. msg, 0)
  end
  local stem = path:gsub("/+$", ""):match("([^/]+)$"):gsub("%.lua$", "")
  return rawget(loaded, stem), loaded
end

return M
