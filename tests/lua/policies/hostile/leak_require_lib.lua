-- Library modules (file readers among them) are not policy files.
local st = require "moonshard.safetensors"
return { parallelize = function() st.tree_from_safetensors("/tmp/moonshard_hostile_secret") end }
