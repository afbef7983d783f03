-- LoRA on moe_trainer's Linear modules (examples/moe_trainer/README.md, "LoRA"):
--
--   build/moe_trainer -n 4 --mesh dp_shard=4 --policy policies/full_fp32.lua \
--       --recipe examples/recipes/moe_trainer_lora.lua --steps 100 --seed 7
--
-- NeMo Automodel's peft section (PeftConfig, docs/recipes.md): adapters of rank 8, alpha 16,
-- on every shared expert's gate_proj, up_proj and down_proj and on lm_head; every other
-- parameter is frozen, so only the adapters train.
return {
  peft = {
    target_modules = { "*.shared_experts.*_proj", "lm_head" },
    dim = 8,
    alpha = 16,
    lora_A_init = "xavier",
  },
}
