-- forbidden.lua: one function per thing the sandbox leaves out.  Results go through a
-- local where the spec checks the line: a tail call leaves no frame to name.
return {
  os_execute = function() return os.execute("touch /tmp/moonshard-policy-pwned") end,
  io_open = function() return io.open("/etc/passwd") end,
  require_os = function() local os = require "os" return os end,
  require_os_tail = function() return require "os" end,
  load = function() return load("return 1") end,
  loadstring = function() return loadstring("return 1") end,
  dofile = function() return dofile("/etc/passwd") end,
  string_dump = function() return string.dump(function() end) end,
  debug_getinfo = function() return debug.getinfo(1) end,
  collectgarbage = function() return collectgarbage("count") end,
  package = function() return package.loaded end,
  set_global = function() leaked = true end,
  string_metatable = function() return getmetatable(""), getmetatable(string) end,
  gc_metamethod = function() local t = setmetatable({}, { __gc = function() end }) return t end,
}
