-- os_at_load.lua: reaches for os while loading.
local ok = true
os.execute("touch /tmp/moonshard-policy-pwned")
return ok
