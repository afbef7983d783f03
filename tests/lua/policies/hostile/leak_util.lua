-- The host helper module a policy may require has no function that reads a file.
local util = require "moonshard.util"
return { parallelize = function()
  error("leaked: " .. tostring(util.read_file("/tmp/moonshard_hostile_secret")))
end }
