-- Standard libraries are not policy files either.
local io = require "io"
return { parallelize = function() error(io.open("/tmp/moonshard_hostile_secret"):read("a")) end }
