-- NeMo Automodel's examples/llm_finetune/llama3_1/llama3_1_8b_squad_qlora.yaml: QLoRA on
-- Llama-3.1-8B, a 4-bit NF4 base (double quantisation, bf16 storage) with LoRA dim 16 on
-- every *_proj, FSDP2.  dp_size there is none (the world size); 8 ranks here.
--
--   moonshard plan --config examples/configs/llama3.1_8b.json \
--       --recipe examples/recipes/llama3_1_8b_squad_qlora.lua
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, sequence_parallel = false },
  peft = { target_modules = "*_proj", dim = 16, alpha = 32, dropout = 0.1 },
  quantization = {
    load_in_4bit = true, load_in_8bit = false,
    bnb_4bit_compute_dtype = "bfloat16", bnb_4bit_use_double_quant = true,
    bnb_4bit_quant_type = "nf4", bnb_4bit_quant_storage = "bfloat16",
  },
}
