-- A stem of a file that is not Lua source.
return require "moonshard_hostile_secret"
