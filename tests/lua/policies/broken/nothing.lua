-- nothing.lua: forgets to return its value.
local units = {}
