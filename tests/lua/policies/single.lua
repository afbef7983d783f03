-- single.lua: a one-file policy, like policies/fsdp2_default.lua.
return {
  param_dtype = "bf16",
  reduce_dtype = "f32",
  reshard_after_forward = function(index, count) return index < count end,
}
