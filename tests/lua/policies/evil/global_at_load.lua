-- global_at_load.lua: writes a global while loading.
leaked = 1
return {}
