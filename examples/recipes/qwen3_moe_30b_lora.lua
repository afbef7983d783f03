-- NeMo Automodel's examples/llm_finetune/qwen/qwen3_moe_30b_lora.yaml: LoRA dim 32 on every
-- module of Qwen3-30B-A3B that takes one (target_modules ["*"]: every Linear and the grouped
-- experts, whose adapters expert parallelism places with them), ep 8 over 8 ranks.
--
--   moonshard plan --config examples/configs/qwen3_30b_a3b.json \
--       --recipe examples/recipes/qwen3_moe_30b_lora.lua
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, pp_size = 1, ep_size = 8,
    sequence_parallel = false, activation_checkpointing = true },
  peft = { _target_ = "nemo_automodel.components._peft.lora.PeftConfig", target_modules = { "*" }, dim = 32,
    alpha = 32, dropout = 0.0 },
}
