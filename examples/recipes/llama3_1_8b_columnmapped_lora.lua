-- NeMo Automodel's examples/llm_finetune/llama3_1/llama3_1_8b_columnmapped_lora.yaml: LoRA
-- dim 16 on every *_proj of Llama-3.1-8B, FSDP2 over the world (8 ranks here).
--
--   moonshard plan --config examples/configs/llama3.1_8b.json \
--       --recipe examples/recipes/llama3_1_8b_columnmapped_lora.lua
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, sequence_parallel = false },
  peft = { _target_ = "nemo_automodel.components._peft.lora.PeftConfig", target_modules = "*_proj", dim = 16,
    alpha = 32, dropout = 0.1 },
}
