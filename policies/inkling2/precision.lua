-- precision.lua: the two mixed-precision policies of the Inkling2 parallelizer.
--
-- compute: Automodel's FSDP2Config default for the body of the model: gather in bf16,
--   reduce gradients in fp32, outputs in bf16, floating inputs cast to bf16.
-- fp32: the FP32 islands: gather, reduce and output in fp32, and no input cast
--   (cast_forward_inputs = false): the model owns its casts, because a cast at a nested
--   boundary can make an activation-checkpoint recompute disagree with the original forward.
return {
  compute = { param_dtype = "bf16", reduce_dtype = "f32", output_dtype = "bf16", cast_forward_inputs = true },
  fp32 = { param_dtype = "f32", reduce_dtype = "f32", output_dtype = "f32", cast_forward_inputs = false },
}
