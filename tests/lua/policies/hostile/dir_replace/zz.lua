local units = require "shard_units"
units.parallelize = function() while true do end end
return true
