-- precision.lua: the mixed-precision policies of the DeepSeek-V4 parallelizer.
--
-- compute: the policy NeMo Automodel's MoE parallelizer uses when the recipe gives none
--   (components/moe/parallelizer.py apply_fsdp): gather in bf16, reduce gradients in fp32,
--   outputs in bf16, floating inputs cast to bf16.  Every other policy derives from it:
-- fp32_of(policy): fsdp.py _fp32_mp_policy, the policy of an FP32 unit that
--   fully_shard_deepseek_v4 makes itself (hc_head under the model, lm_head): gather, reduce
--   and output in fp32, cast_forward_inputs as the caller's policy has it.
-- pinned_fp32_of(policy): parallelizer_utils.py _mp_policy_with_param_dtype(policy, f32), the
--   policy of the FP32 units that fully_shard_by_dtype splits off a block before
--   fully_shard_deepseek_v4 sees it: fp32 everywhere and no input cast (the FP32 module owns
--   its casts).  _fp32_mp_policy then keeps that cast_forward_inputs = false.
local M = {}

M.compute = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true }

function M.fp32_of(policy)
  return { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32",
    cast_forward_inputs = policy.cast_forward_inputs ~= false }
end

function M.pinned_fp32_of(policy)
  local _ = policy
  return { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false }
end

return M
