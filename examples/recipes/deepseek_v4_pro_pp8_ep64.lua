-- NeMo Automodel's examples/llm_finetune/deepseek_v4/
-- deepseek_v4_pro_hellaswag_all_tilelang_pp8_ep64_20steps.yaml: DeepSeek-V4-Pro in a pipeline
-- of 8 (Interleaved 1F1B, 2 layers a stage), expert parallelism over 64, FSDP2 over 64 (512
-- ranks), activation checkpointing, with the DeepSeek-V4 policy.
--
--   moonshard plan --config examples/configs/deepseek_v4_pro.json \
--       --recipe examples/recipes/deepseek_v4_pro_pp8_ep64.lua --policy policies/deepseek_v4
return {
  distributed = {
    strategy = "fsdp2", dp_size = 64, tp_size = 1, cp_size = 1, pp_size = 8, ep_size = 64,
    sequence_parallel = false, activation_checkpointing = true,
    pipeline = { pp_schedule = "interleaved1f1b", pp_microbatch_size = 1, layers_per_stage = 2,
      round_virtual_stages_to_pp_multiple = "down", scale_grads_in_schedule = false, patch_inner_model = false,
      patch_causal_lm_model = false },
    moe = { ignore_router_for_ac = true, reshard_after_forward = false, wrap_outer_model = false },
  },
}
