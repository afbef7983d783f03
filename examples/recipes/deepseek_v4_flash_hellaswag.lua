-- NeMo Automodel's examples/llm_finetune/deepseek_v4/deepseek_v4_flash_hellaswag.yaml: full
-- fine-tuning of DeepSeek-V4-Flash, a pipeline of 4 (Interleaved 1F1B, 2 layers a stage),
-- expert parallelism over 32, FSDP2 over 32 (128 ranks), with the DeepSeek-V4 policy (its
-- FP32 parameters as their own units).
--
--   moonshard plan --config examples/configs/deepseek_v4_flash.json \
--       --recipe examples/recipes/deepseek_v4_flash_hellaswag.lua --policy policies/deepseek_v4
return {
  distributed = {
    strategy = "fsdp2", dp_size = 32, tp_size = 1, cp_size = 1, pp_size = 4, ep_size = 32,
    sequence_parallel = false, activation_checkpointing = false,
    pipeline = { pp_schedule = "interleaved1f1b", pp_microbatch_size = 1, layers_per_stage = 2,
      round_virtual_stages_to_pp_multiple = "down", scale_grads_in_schedule = false, patch_inner_model = false,
      patch_causal_lm_model = false },
    moe = { reshard_after_forward = false, wrap_outer_model = false },
  },
}
