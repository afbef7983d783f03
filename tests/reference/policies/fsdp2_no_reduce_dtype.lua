-- fsdp2_no_reduce_dtype.lua: fsdp2_default with a mixed-precision policy that sets
-- param_dtype (bf16) and no reduce_dtype: the rule PyTorch 2.15 changed (its FSDP2 now
-- reduces such gradients in the parameter's own dtype, as moonshard's plans do; before 2.15,
-- in param_dtype).  For tests/reference/fsdp2_layouts.py, which records what torch does.
local fsdp2_default = require "fsdp2_default"

fsdp2_default.precision = { param_dtype = "bf16", output_dtype = "bf16", cast_forward_inputs = true }

return fsdp2_default
