-- NeMo Automodel's examples/llm_finetune/deepseek_v4/deepseek_v4_flash_hellaswag_lora.yaml:
-- LoRA dim 8 on DeepSeek-V4-Flash's attention projections (wq_a, wq_b, wkv, wo_b), expert
-- parallelism over 32, FSDP2 over 32 ranks, with the DeepSeek-V4 policy.
--
--   moonshard plan --config examples/configs/deepseek_v4_flash.json \
--       --recipe examples/recipes/deepseek_v4_flash_hellaswag_lora.lua --policy policies/deepseek_v4
return {
  distributed = {
    strategy = "fsdp2", dp_size = 32, tp_size = 1, cp_size = 1, pp_size = 1, ep_size = 32,
    sequence_parallel = false, activation_checkpointing = false,
    moe = { reshard_after_forward = false, wrap_outer_model = false },
  },
  peft = { _target_ = "nemo_automodel.components._peft.lora.PeftConfig",
    target_modules = { "*wq_a", "*wq_b", "*wkv", "*wo_b" }, dim = 8, alpha = 32, use_triton = true },
}
