-- tests/reference/tp_comm.lua: the tensor-parallel plans tests/reference/tp_comm.py hands to
-- PyTorch, taken from the shipped policies/tp_plans.lua (the input, not the answer).
-- Run as `build/moonshard tests/reference/tp_comm.lua`; prints
-- {"<name>/<sp|nosp>": {pattern: {style, input_layouts, output_layouts, desired_input_layouts,
-- use_local_output}}} on stdout.
package.path = "policies/?.lua;" .. package.path
local json = require "moonshard.json"
local plans = require "tp_plans"
local out = {}
for _, name in ipairs(plans.NAMES) do
  for _, sp in ipairs({ false, true }) do
    local t = {}
    for pattern, v in pairs(plans[name](sp)) do
      if type(v) == "string" then v = { v } end
      t[pattern] = { style = v[1], input_layouts = v.input_layouts, output_layouts = v.output_layouts,
        desired_input_layouts = v.desired_input_layouts, use_local_output = v.use_local_output }
    end
    out[name .. "/" .. (sp and "sp" or "nosp")] = t
  end
end
print(json.encode(out))
