-- options_meta.lua: the options declaration, ctx:set_prefetch, ctx:checkpoint_wrap's choice and
-- ctx:log's values carry metamethods that would loop forever: the planner reads them raw and
-- runs none of them, before, during or after the policy's call.
local spin = { __index = function() while true do end end, __pairs = function() while true do end end,
  __tostring = function() while true do end end, __len = function() while true do end end }
local clean = require "clean"
return {
  options = setmetatable({ knob = setmetatable({ default = 1, doc = "a knob" }, spin) }, spin),
  parallelize = function(ctx)
    ctx:checkpoint_wrap("model.layers", setmetatable({ every = 16 }, spin))
    ctx:set_prefetch(setmetatable({ forward = 2 }, spin))
    ctx:log(setmetatable({ knob = ctx.options.knob }, spin), setmetatable({}, spin))
    clean.parallelize(ctx)
  end,
}
