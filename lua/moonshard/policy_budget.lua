-- moonshard.policy_budget: the budget every call into policy code runs under (see
-- moonshard.policy).  A count hook limits the instructions and checks the memory in use;
-- work in C, where the hook never runs, is charged before it runs (patterns by their worst
-- case, results against the memory cap); a wall clock the hook checks bounds the rest
-- (`..` copying long strings).  Where moonshard's counting allocator runs the state, the
-- memory cap is also a hard limit on what Lua may allocate during a call.

local B = {}

-- LuaJIT's compiled traces never call the hook: the budget's own functions (the pattern
-- bounds) stay interpreted, so their work is counted.
if rawget(_G, "jit") then rawget(_G, "jit").off(true, true) end

B.DEFAULT_INSTRUCTIONS = 200000000
B.DEFAULT_MEMORY_MB = 256
-- Wall-clock seconds per call: a bound on what the instruction count cannot see.
B.DEFAULT_SECONDS = 60
-- The hook runs every STEP instructions at most (see step_for): rarely enough to cost
-- little, often enough that a loop cannot allocate much between two memory checks.
local STEP = 1000
-- `..` builds strings in C where the hook cannot see it.  One instruction makes a string no
-- longer than its operands together, and each operand takes an instruction to load, so the
-- longest string grows at most 1.32 times an instruction (3 operands in 4 instructions).
local GROWTH = math.log(1.32)

-- Captured now: the sandbox swaps the string metatable's __index during policy calls.
local byte, find, format, match, sub = string.byte, string.find, string.format, string.match, string.sub
local concat = table.concat
local unpack = table.unpack or unpack
local jit = rawget(_G, "jit")

-- The hard memory cap: memory_cap(bytes) lets Lua allocate `bytes` more than it holds now
-- and refuses more ("not enough memory"), memory_cap(nil) lifts it; both return false when
-- the state does not run on moonshard's counting allocator (lua/ms_alloc.c).  memory_refused()
-- says the cap refused an allocation since it was set.  States moonshard makes (both
-- executables, embedding hosts) keep them in the registry; a stock lua5.4 loading core.so
-- has core.memory_cap, which answers false; a stock luajit has neither.
local memory_cap, memory_refused
local registry = debug.getregistry()
if type(registry["moonshard.memory_cap"]) == "function" and registry["moonshard.memory_cap"](nil) then
  -- a state moonshard made (ms_alloc.c), under Lua 5.4 or LuaJIT
  memory_cap, memory_refused = registry["moonshard.memory_cap"], registry["moonshard.memory_refused"]
elseif _VERSION == "Lua 5.4" and not jit then
  local ok, core = pcall(require, "moonshard.core")
  if ok and type(core) == "table" and type(core.memory_cap) == "function" and core.memory_cap(nil) then
    memory_cap, memory_refused = core.memory_cap, core.memory_refused
  end
end

local function pack(...) return { n = select("#", ...), ... } end

-- Lua's xpcall, not a wrapper a host put in its place (the moonshard executable wraps it
-- for os.exit): a wrapper's Lua frames would run, hooked, between a policy call's return
-- and finish(), where the budget must not raise.
local raw_xpcall = debug.getregistry()["moonshard.raw_xpcall"] or xpcall

-- "@path" (the chunk name) of every policy file loaded so far: how the budget finds the
-- policy line to blame, and how results tell policy functions (wrapped) from host ones.
local policy_sources = {}
-- Their names as Lua's error positions show them (debug's short_src: a long path shortened)
local policy_short_src = {}

--- Records chunk, compiled from a policy file, as policy code.
function B.add_source(chunk)
  local info = debug.getinfo(chunk, "S")
  policy_sources[info.source] = true
  policy_short_src[info.short_src] = true
end

--- The limits of one load (and the wrappers and pattern shapes it keeps).
function B.config(path, instructions, memory_mb, seconds)
  return { instructions = instructions, step = math.min(STEP, instructions), seconds = seconds,
           memory_mb = memory_mb, memory_kb = memory_mb * 1024,
           wrappers = setmetatable({}, { __mode = "k" }), unwrapped = setmetatable({}, { __mode = "k" }),
           shapes = { anchored = {}, unanchored = {}, count = 0 }, path = path, roots = {} }
end

-- The budget of the outermost policy call in progress, nil when none.  A policy function
-- called while one is in progress (a sibling, a callback) runs under the caller's budget.
-- Once tripped it stays tripped until that outermost call returns: the sandbox's pcall and
-- xpcall rethrow it and the hook raises it again, so a policy cannot catch its own end.
local budget = nil

local run, finish -- the hook leaves their frames alone (see hook)
local c_depth, leave_c -- string.gsub's nesting (see C_DEPTH)

-- A call's memory is what the heap gained since it began, and garbage in the heap then
-- would hide as much growth once collected.  So a call begins with a full collection when
-- the heap gained over a quarter of the cap since the last one, or the last call did.
local swept_kb = -math.huge

-- The innermost policy frame at stack `level` or above: file, line.  A tail call leaves no
-- frame of its caller; then the file of the function the budget was entered for, no line.
local function policy_position(level)
  local info = debug.getinfo(level + 1, "Sl")
  while info do
    if policy_sources[info.source] then return sub(info.source, 2), info.currentline end
    level = level + 1
    info = debug.getinfo(level + 1, "Sl")
  end
  return budget and budget.file or "?"
end

-- Trips the budget; returns the message.
local function trip(what)
  local file, line = policy_position(2)
  budget.tripped = format("moonshard: policy %s: %s", file, what) .. (line and " at line " .. line or "")
  return budget.tripped
end

-- The hook's next step: shorter as the call's memory nears its cap, so that `..` cannot
-- take the longest string far past the cap between two checks.  That string is taken to be
-- no longer than what the call has added (or 1 KiB), and 1.32^step times it must stay under
-- OVERSHOOT times the cap.  Strings the policy kept from an earlier call, or garbage the
-- collector frees during this one, escape that guess: finish() checks the memory again as
-- the call returns.
local log, floor = math.log, math.floor
local OVERSHOOT = 4
local function step_for(cfg, grown_kb)
  local s = floor(log(OVERSHOOT * cfg.memory_kb / (grown_kb > 1 and grown_kb or 1)) / GROWTH)
  if s > cfg.step then return cfg.step end
  return s > 1 and s or 1
end

-- The hook is set to come about every SLICE seconds of CPU time at most.
local SLICE = 0.05
local clock, os_time = os.clock, os.time

local function hook()
  local b = budget
  -- No budget: a Lua 5.4 coroutine created during a call inherited the hook and runs now.
  if not b then return end
  if not b.tripped then
    b.used = b.used + b.step
    local grown = collectgarbage("count") - b.base_kb
    -- Work in C that the count cannot see (`..` copying long strings, LuaJIT interning them)
    -- makes a step slow: then the hook comes sooner, so that the time limit holds.
    local now = clock()
    local took = now - b.clock
    b.clock = now
    if took > SLICE then
      b.time_step = math.max(1, floor(b.time_step * SLICE / took))
    elseif took < SLICE / 4 and b.time_step < b.cfg.step then
      b.time_step = math.min(b.cfg.step, b.time_step * 2)
    end
    if b.used >= b.cfg.instructions then
      trip(format("instruction budget of %d exceeded (an infinite loop?)", b.cfg.instructions))
    elseif os_time() - b.started > b.cfg.seconds then
      trip(format("time limit of %g s exceeded (work in C that the instruction budget does not count, such as " ..
                  "`..` of long strings, in a loop?)", b.cfg.seconds))
    elseif grown > b.cfg.memory_kb then
      -- the count includes garbage not yet swept: only what is still live counts
      collectgarbage("collect")
      grown = collectgarbage("count") - b.base_kb
      if grown > b.cfg.memory_kb then
        trip(format("memory cap of %g MiB exceeded", b.cfg.memory_mb))
      end
    end
    -- Set again even when unchanged: Lua 5.4 counts the hook's own instructions against
    -- the next step, and setting restarts the count (LuaJIT does not count them).  But
    -- Lua 5.4's sethook walks every frame of the stack (settraps): on a stack deeper than
    -- 64 frames it is set only when the step changes, and the hook's own instructions
    -- count there (a policy recursing 200,000 deep took 20 times longer otherwise).
    if not b.tripped then
      local step = math.min(b.hard and b.cfg.step or step_for(b.cfg, grown), b.time_step)
      if step ~= b.step or not debug.getinfo(64, "l") then
        b.step = step
        debug.sethook(hook, "", step)
      end
    end
  end
  -- Never from run's or finish's own frame: an error between the policy's return and the
  -- restore of the previous hook would leave this hook installed.
  if b.tripped then
    local running = debug.getinfo(2, "f").func
    if running ~= run and running ~= finish then error(b.tripped, 0) end
  end
end

-- Wraps every function reachable from value (tables, their metatables, nested tables) so
-- that the host's later calls run under a budget: the policy's own, and host functions it
-- stored (parallelize = error runs for the policy too).  Tables are changed in place; keys
-- are left as they are.  The walk runs between calls, outside any budget: it visits at most
-- WRAP_LIMIT entries, with a stack of its own (a table nested 300,000 deep is no recursion).
local WRAP_LIMIT = 1000000
local function wrap_fn(cfg, f)
  if cfg.unwrapped[f] then return f end -- one of ours already
  local w = cfg.wrappers[f]
  if not w then
    w = function(...) return run(cfg, f, ...) end
    cfg.wrappers[f], cfg.unwrapped[w] = w, f
  end
  return w
end

local function wrap_all(cfg, value, seen, file)
  local t = type(value)
  if t == "function" then return wrap_fn(cfg, value) end
  if t ~= "table" then return value end
  local todo, visited = { value }, 0
  while #todo > 0 do
    local tbl = todo[#todo]
    todo[#todo] = nil
    if not seen[tbl] then
      seen[tbl] = true
      for k, v in next, tbl do
        visited = visited + 1
        if visited > WRAP_LIMIT then
          error(format("moonshard: policy %s: what it returned holds more than %d table entries; a policy returns " ..
                       "its functions and small data", file, WRAP_LIMIT), 0)
        end
        local tv = type(v)
        if tv == "function" then
          local w = wrap_fn(cfg, v)
          if w ~= v then rawset(tbl, k, w) end
        elseif tv == "table" then
          todo[#todo + 1] = v
        end
      end
      local mt = debug.getmetatable(tbl)
      if type(mt) == "table" then todo[#todo + 1] = mt end
    end
  end
  return value
end

-- An error object that is not a string, as the message says it: its scalar fields.
local function describe_error(e)
  local t = type(e)
  if t ~= "table" then return tostring(e) end
  local keys, fields = {}, {}
  for k in next, e do
    if #keys == 8 then keys.more = true break end
    keys[#keys + 1] = k
  end
  table.sort(keys, function(x, y)
    if type(x) ~= type(y) then return type(x) < type(y) end
    return (type(x) == "string" or type(x) == "number") and x < y
  end)
  for i, k in ipairs(keys) do
    local v = rawget(e, k)
    if type(v) == "string" then
      v = format("%q", #v > 40 and sub(v, 1, 40) .. "..." or v)
    elseif type(v) == "number" or type(v) == "boolean" then
      v = tostring(v)
    else
      v = type(v)
    end
    fields[i] = (type(k) == "string" and k or "[" .. (type(k) == "number" and tostring(k) or type(k)) .. "]")
                .. " = " .. v
  end
  return "{" .. concat(fields, ", ") .. (keys.more and ", ..." or "") .. "}"
end

-- The message starts with a policy file's position, as Lua writes it ("file:line: ...").
local function names_policy(e)
  local src = match(e, "^(.-):%d+: ")
  return src ~= nil and policy_short_src[src] == true
end

-- The error was raised by policy code: the first Lua frame from the raiser (stack level
-- `level`: error() or a C function it called, or the policy line itself) is the policy's,
-- or is run's own: then the raiser was the function run called, or one it tail-called
-- (LuaJIT keeps no frame of a policy's `return error(...)`).
local function raised_by_policy(level)
  local info = debug.getinfo(level + 1, "Sf")
  while info and info.what == "C" do
    level = level + 1
    info = debug.getinfo(level + 1, "Sf")
  end
  return info ~= nil and (policy_sources[info.source] == true or info.func == run)
end

-- The message handler of a policy call.  The host reads errors as strings (a table is
-- "(error object is not a string)" in C), so an error object that is not one becomes one,
-- naming the policy line that raised it while the stack still shows it.  A __tostring is
-- policy code: it runs here, under the budget, protected.
local function stringify(e)
  local b = budget
  -- A string names the policy line already, or is the library's own ("moonshard: ..."),
  -- or it gets the policy line that led there: raised in the library or in C on the
  -- policy's behalf ("C stack overflow" in table.sort), by error(msg, 0), or by a policy
  -- that writes "moonshard: config ..." to pass its error off as the library's.
  local keep = type(e) == "string" and (names_policy(e) or sub(e, 1, 9) == "moonshard" and not raised_by_policy(2))
  if type(e) == "string" and b and not b.tripped and not keep then
    local file, line = policy_position(1)
    e = format("moonshard: policy %s%s: %s", file, line and ":" .. line or "", e)
  elseif type(e) ~= "string" and not (b and b.tripped) then
    local file, line = policy_position(1)
    local where = format("moonshard: policy %s%s: ", file, line and ":" .. line or "")
    local mt = debug.getmetatable(e)
    if type(mt) == "table" and rawget(mt, "__tostring") ~= nil then
      local ok, s = pcall(tostring, e)
      -- LuaJIT's tostring passes on whatever __tostring returns
      if ok and type(s) ~= "string" then ok, s = false, "'__tostring' must return a string" end
      if ok then
        e = where .. s
      else
        e = where .. format("error object (a %s) whose __tostring failed: %s", type(e),
                            type(s) == "string" and s or describe_error(s))
      end
    elseif e == nil then
      e = where .. "error object is nil (error() without a message)"
    else
      e = where .. format("error object (a %s) is not a string: %s", type(e), describe_error(e))
    end
  end
  if b then b.raised = e end
  return e
end

function finish(b, saved, ok, ...)
  -- the hard cap first: what follows must not run into it
  local refused = b.hard and memory_refused()
  if b.hard then memory_cap(nil) end
  if type(saved.hook) == "function" then
    debug.sethook(saved.hook, saved.mask, saved.count)
  else
    debug.sethook()
  end
  saved.string_mt.__index = saved.string_index
  budget = nil
  local grown = collectgarbage("count") - b.base_kb
  if grown > b.cfg.memory_kb / 4 then swept_kb = -math.huge end
  -- `..` in the call's last steps built strings no hook has seen (the results are live here)
  if not b.tripped and grown > b.cfg.memory_kb then
    collectgarbage("collect")
    grown = collectgarbage("count") - b.base_kb
    if grown > b.cfg.memory_kb then
      b.tripped = format("moonshard: policy %s: memory cap of %g MiB exceeded (%.0f MiB more in use as the call returned)",
                         b.file, b.cfg.memory_mb, grown / 1024)
    end
  end
  -- the hard cap refused an allocation, and Lua raised (no message handler runs for it,
  -- so no line is known).  A refusal that Lua's emergency collection then made room for
  -- raised nothing: hence both.
  if not b.tripped and not ok and refused and ... == "not enough memory" then b.tripped = b.cap_error end
  if b.tripped then error(b.tripped, 0) end
  if not ok then
    local e = ...
    if e == b.raised then error(e, 0) end
    -- past the message handler: Lua's own "not enough memory" (or an error in the handler)
    if e == "not enough memory" then
      e = format("out of memory (not enough memory; the call's cap is %g MiB)", b.cfg.memory_mb)
    end
    error(format("moonshard: policy %s: %s", b.file, tostring(e)), 0)
  end
  -- what the call returned, and again what the policy's files returned: the call may have
  -- put a function of its own into one of their tables, for the host to call later
  local seen = {}
  local results = pack(...)
  for i = 1, results.n do results[i] = wrap_all(b.cfg, results[i], seen, b.file) end
  for _, root in ipairs(b.cfg.roots) do wrap_all(b.cfg, root, seen, b.file) end
  return unpack(results, 1, results.n)
end

-- Calls fn(...) under a fresh budget unless one is in progress.  String errors keep their
-- message (policy errors carry "file:line:", host errors their own); other error objects
-- and Lua's out of memory become messages naming the policy; budget errors replace them.
function run(cfg, fn, ...)
  if budget then return fn(...) end
  local old_hook, old_mask, old_count = debug.gethook()
  local string_mt = debug.getmetatable("")
  local saved = { hook = old_hook, mask = old_mask, count = old_count,
                  string_mt = string_mt, string_index = string_mt.__index }
  local base_kb = collectgarbage("count")
  if base_kb - swept_kb > cfg.memory_kb / 4 then
    collectgarbage("collect")
    base_kb = collectgarbage("count")
    swept_kb = base_kb
  elseif base_kb < swept_kb then
    swept_kb = base_kb
  end
  -- a host function the policy handed over (parallelize = error) runs for the policy too
  local src = type(fn) == "function" and debug.getinfo(fn, "S").source
  local b = { cfg = cfg, file = policy_sources[src] and sub(src, 2) or cfg.path, used = 0, base_kb = base_kb,
              started = os_time(), clock = clock(), time_step = cfg.step }
  budget = b
  c_depth = 0
  -- ("x"):rep(n) must find the sandbox's capped rep, not the host's
  string_mt.__index = cfg.string_methods
  if memory_cap then
    -- built now: under the cap, there may be no memory to build it when it is needed
    b.cap_error = format("moonshard: policy %s: memory cap of %g MiB exceeded", b.file, cfg.memory_mb)
    -- LuaJIT raises at once when its allocator refuses, where Lua 5.4 first collects and
    -- asks again: there the hard limit is twice the cap, so garbage the collector has not
    -- reached yet does not end a call, and the hook (which collects) enforces the cap itself
    b.hard = memory_cap(cfg.memory_kb * 1024 * (jit and 2 or 1))
  end
  -- with the hard cap, `..` cannot take a string past it between two checks
  b.step = b.hard and cfg.step or step_for(cfg, 0)
  debug.sethook(hook, "", b.step)
  return finish(b, saved, raw_xpcall(fn, stringify, ...))
end

-- ---------------------------------------------------------------- errors at the policy's line

-- Raises "moonshard: policy path:line: ..." naming the policy line that called the sandbox
-- function (or ran into the metamethod) that calls this.
local function sandbox_error(fmt, ...)
  local file, line = policy_position(2)
  error(format("moonshard: policy %s%s: " .. fmt, file, line and ":" .. line or "", ...), 0)
end

-- Rethrows a tripped budget that a policy's pcall/xpcall caught, and trips it when they
-- caught the hard cap's refusal; otherwise passes results.
local function rethrow_budget(depth, ok, ...)
  c_depth = depth
  local b = budget
  if b then
    if not b.tripped and not ok and b.hard and ... == "not enough memory" and memory_refused() then
      b.tripped = b.cap_error
    end
    if b.tripped then error(b.tripped, 0) end
  end
  return ok, ...
end

-- ---------------------------------------------------------------- what runs in C

-- The length of a string or number argument, 0 for anything else (the C function raises).
local function len(v)
  local t = type(v)
  return (t == "string" or t == "number") and #tostring(v) or 0
end

-- Refuses a C function (named by what) whose result of up to `bytes` would take the call
-- past its memory cap: C allocates it where the hook never runs.
local function reserve(cfg, bytes, what)
  local b = budget
  local base = b and b.base_kb or math.huge
  -- (garbage in the base, once collected, makes the call's growth look negative)
  if bytes / 1024 + math.max(collectgarbage("count") - base, 0) <= cfg.memory_kb then return end
  collectgarbage("collect")
  if bytes / 1024 + math.max(collectgarbage("count") - base, 0) <= cfg.memory_kb then return end
  local msg = format("memory cap of %g MiB exceeded (%s of %.0f bytes)", cfg.memory_mb, what, bytes)
  if b then error(trip(msg), 0) end
  sandbox_error("%s", msg)
end

-- Charges `steps` of work in C to the budget, refusing at once what it cannot pay; the
-- error says why (format(fmt, ...)).
local function charge(cfg, steps, fmt, ...)
  local b = budget
  if not b then return end
  if steps > cfg.instructions - b.used then
    error(trip(format("instruction budget of %d exceeded (" .. fmt .. ")", cfg.instructions, ...)), 0)
  end
  b.used = b.used + steps
end

-- The most string.gsub(s, p, repl) can build, nil when repl is a function (policy code,
-- which the hook sees).  Matches are at most n+1; a %0-%9 in repl expands to a capture
-- (all of them together at most n bytes) or a position (20 digits).
local function gsub_bytes(n, repl, max_n)
  local matches = n + 1
  if type(max_n) == "number" and max_n >= 0 and max_n < matches then matches = max_n end
  local t = type(repl)
  if t == "string" or t == "number" then
    repl = tostring(repl)
    local refs, at = 0, 1
    while true do
      at = find(repl, "%", at, true)
      if not at then break end
      refs, at = refs + 1, at + 2
    end
    return n + matches * (#repl + 20 * refs) + refs * n
  elseif t == "table" then
    -- the longest value in repl or the tables its __index chain leads to
    local longest, seen = 0, {}
    while type(repl) == "table" and not seen[repl] do
      seen[repl] = true
      for _, v in next, repl do longest = math.max(longest, len(v)) end
      local mt = debug.getmetatable(repl)
      repl = type(mt) == "table" and rawget(mt, "__index") or nil
    end
    return n + matches * longest
  end
end

-- The most string.format(fmt, ...) can build: %q escapes a byte in up to 4, %s pads to 99,
-- a number takes at most 512 (%99.99f of 1e308).  A table's __tostring is policy code.
local function format_bytes(fmt, ...)
  local bytes, at, k = len(fmt), 1, 0
  if bytes == 0 then return 0 end -- format raises
  fmt = tostring(fmt)
  while true do
    at = find(fmt, "%", at, true)
    if not at then return bytes end
    local _, e, conv = find(fmt, "^[-+ #0]*%d*%.?%d*(.)", at + 1)
    if not e then return bytes end
    if conv ~= "%" then
      k = k + 1
      local v = select(k, ...)
      if conv == "q" then
        bytes = bytes + 4 * len(v) + 2
      elseif conv == "s" then
        bytes = bytes + len(v) + 99
      else
        bytes = bytes + 512
      end
    end
    at = e + 1
  end
end

-- Pattern matching runs in C too, and a pattern that backtracks can take hours on a short
-- subject (("a*"):rep(30) .. "b" on 30 a's).  So every pattern function first bounds its
-- work and charges that to the budget, refusing at once what the budget cannot pay.  The
-- bound, in steps of about an instruction, follows lstrlib's match(), a backtracking search.
-- An item quantified with *, + or - tries each length it can match (up to n+1, n the
-- subject's length), one with ? two, and a search not anchored with ^ (gmatch always) each
-- of n+1 starts; each try runs the items up to the next such branch.  The tries at a branch
-- are the ways to reach it times its own; and they are distinct ways to split the subject:
-- with u branches of n+1 and q of 2 before it, at most C(n+u, u) * 2^q.  Only the tries that
-- pass the item after the branch reach the next one: 1 when that is the closing $, and
-- when it is a literal character, at most as many as the subject holds of it.  So
--   steps = sum over branches of tries * (items it runs + 1), * (n + 1) with %b or a back
--           reference (%1) anywhere, as they compare up to n bytes each time; + n + 1
-- A quantified item followed only by items that cannot fail (captures, other *, - or ?)
-- does not branch: its first try succeeds.  A plain find is m literal items.  On names:
-- "%.weight$" is (n+1) * 10 + 1, "^(.-)%.(.-)$" about (n+1) * (6 + 4 * dots); and
-- ("a*"):rep(30) .. "b" on 30 a's ~1e18.

-- The end of the single-character class at p[i] (one past it), nil when malformed.
local function class_end(p, i)
  local c = byte(p, i)
  if c == 37 then -- %x
    return i + 1 <= #p and i + 2 or nil
  elseif c ~= 91 then
    return i + 1
  end
  local j = i + 1 -- [set]: the first character, even ']', belongs to the set
  if byte(p, j) == 94 then j = j + 1 end
  repeat
    if j > #p then return nil end
    local e = byte(p, j)
    j = j + 1
    if e == 37 then j = j + 1 end
  until byte(p, j) == 93
  return j + 1
end

-- The items of pattern p from i: per item its quantifier ("u" for *, + and -, "?" or false),
-- whether it can fail, and what a branch before it may count on: ends for the closing $,
-- follow for a literal (its character) or a capture ("(", looked through).  A malformed rest
-- is one item (lstrlib raises when the search first gets there); scans: %b or a back
-- reference.
local function pattern_items(p, i)
  local m, items, scans = #p, {}, false
  while i <= m do
    local c, d = byte(p, i), byte(p, i + 1)
    local item = { quantifier = false, can_fail = true }
    if c == 40 then -- ( or ()
      item.can_fail, item.follow = false, "("
      i = i + (d == 41 and 2 or 1)
    elseif c == 41 then
      item.can_fail, item.follow = false, "("
      i = i + 1
    elseif c == 36 and i == m then -- $ at the end
      item.ends = true
      i = i + 1
    elseif c == 37 and d == 98 then -- %bxy
      scans = true
      i = i + 4
    elseif c == 37 and d == 102 then -- %f[set]
      i = byte(p, i + 2) == 91 and class_end(p, i + 2) or m + 1
    elseif c == 37 and d and d >= 48 and d <= 57 then -- %1
      scans = true
      i = i + 2
    else
      local e = class_end(p, i) or m + 1
      -- a literal: a plain character or an escaped punctuation mark
      if e == i + 1 and c ~= 46 or e == i + 2 and c == 37 and not find(sub(p, i + 1, i + 1), "^%w") then
        item.follow = sub(p, e - 1, e - 1)
      end
      i = e
      local suffix = byte(p, i)
      if suffix == 42 or suffix == 45 or suffix == 43 then -- * - +
        item.quantifier, item.can_fail = "u", suffix == 43
        if suffix ~= 43 then item.follow = nil end
        i = i + 1
      elseif suffix == 63 then -- ?
        item.quantifier, item.can_fail, item.follow = "?", false, nil
        i = i + 1
      end
    end
    items[#items + 1] = item
  end
  return items, scans
end

-- The shape of pattern p: its branches in order, each with kind ("u", "?"), the items a try
-- runs and the follow it may count on; the items before the first; scans.
local function pattern_shape(p, anchor)
  local anchored = anchor and byte(p, 1) == 94
  local items, scans = pattern_items(p, anchored and 2 or 1)
  local safe = true -- only items that cannot fail follow
  for k = #items, 1, -1 do
    items[k].branch = items[k].quantifier and not safe
    safe = safe and not items[k].can_fail
  end
  local branches, head, current = {}, 0, nil
  if not anchored then current = { kind = "u", items = 0, at = 0 } branches[1] = current end -- the start
  for k, item in ipairs(items) do
    if item.branch then
      current = { kind = item.quantifier, items = 0, at = k }
      branches[#branches + 1] = current
    end
    if current then current.items = current.items + 1 else head = head + 1 end
  end
  for _, branch in ipairs(branches) do
    local k = branch.at + 1
    while items[k] and items[k].follow == "(" do k = k + 1 end
    branch.follow, branch.ends = items[k] and items[k].follow, items[k] and items[k].ends
  end
  return { head = head, branches = branches, scans = scans }
end

-- How many times character c is in s; nil past most
local function occurrences(s, c, most)
  local at, k = 1, 0
  while true do
    at = find(s, c, at, true)
    if not at then return k end
    if k == most then return nil end
    k, at = k + 1, at + 1
  end
end

local function pattern_steps(shape, s)
  local n = #s
  local steps, reach, splits, u, q = shape.head + 1, 1, 1, 0, 0
  for _, branch in ipairs(shape.branches) do
    local own = n + 1
    if branch.kind == "?" then
      own, q = 2, q + 1
    else
      u = u + 1
      splits = splits * (n + u) / u
    end
    local most = splits * 2 ^ q
    local tries = math.min(reach * own, most)
    steps = steps + tries * (branch.items + 1)
    local pass = own
    if branch.ends then
      pass = 1
    elseif branch.follow then
      pass = math.min(own, occurrences(s, branch.follow, 64) or own)
    end
    reach = math.min(reach * pass, most)
    if steps > 1e300 then return math.huge end
  end
  return steps * (shape.scans and n + 1 or 1) + n + 1
end

-- Charges string.<what>(s, p) to the budget (a plain search when plain).  Shapes are kept
-- per load, a few hundred patterns at most.
local function charge_pattern(cfg, what, s, p, anchor, plain)
  local ts, tp = type(s), type(p)
  if not budget or (ts ~= "string" and ts ~= "number") or (tp ~= "string" and tp ~= "number") then return end
  p = tostring(p)
  local shape
  if plain then
    shape = { head = 0, branches = { { kind = "u", items = #p } }, scans = false }
  else
    local kind = anchor and "anchored" or "unanchored"
    shape = cfg.shapes[kind][p]
    if not shape then
      if cfg.shapes.count == 256 then cfg.shapes = { anchored = {}, unanchored = {}, count = 0 } end
      shape = pattern_shape(p, anchor)
      cfg.shapes[kind][p], cfg.shapes.count = shape, cfg.shapes.count + 1
    end
  end
  s = tostring(s)
  local steps = pattern_steps(shape, s)
  charge(cfg, steps, "string.%s: the pattern %s could take %.3g steps on a subject of %d bytes;"
         .. " each *, +, - or ? that can backtrack multiplies the work", what,
         #p > 40 and format("%q...", sub(p, 1, 40)) or format("%q", p), steps, #s)
end

-- LuaJIT's gsub calls its replacement (a function, or a table's __index) from C with no
-- limit on how deep such calls nest: a policy recursing through it overflows the C stack
-- and the process dies (SIGSEGV; Lua 5.4 stops at about 200 with "C stack overflow").  The
-- sandbox stops both at C_DEPTH.  An error unwinds past leave_c: run() starts every call at
-- 0, and the sandbox's pcall and xpcall put back the depth they were called at.
local C_DEPTH = 100
c_depth = 0
function leave_c(...)
  c_depth = c_depth - 1
  return ...
end

--- The policy line running now, "file:line", while a policy call is in progress (so that
-- the host's errors can say which policy line called them); nil otherwise.
function B.position()
  if not budget then return nil end
  local file, line = policy_position(2)
  if not line then return nil end
  return file .. ":" .. line
end

--- The message of the budget of the call in progress once tripped; nil otherwise.
function B.tripped()
  return budget and budget.tripped
end

--- The depth of string.gsub's nesting (see C_DEPTH); enter_c counts one more, refusing
-- past C_DEPTH; leave_c(...) counts one less and returns its arguments.
function B.c_depth() return c_depth end
function B.enter_c()
  if c_depth >= C_DEPTH then
    sandbox_error("string.gsub: replacements nest more than %d deep (a replacement that calls string.gsub " ..
                  "again, recursively?)", C_DEPTH)
  end
  c_depth = c_depth + 1
end
B.leave_c = leave_c

B.run, B.wrap_all, B.rethrow, B.policy_error = run, wrap_all, rethrow_budget, sandbox_error
B.len, B.reserve, B.charge, B.charge_pattern = len, reserve, charge, charge_pattern
B.gsub_bytes, B.format_bytes = gsub_bytes, format_bytes

return B
