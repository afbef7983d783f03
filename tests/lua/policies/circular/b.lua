-- b.lua: see a.lua.
return require "a"
