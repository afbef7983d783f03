-- a.lua: requires b, which requires this file back while both load.
return require "b"
