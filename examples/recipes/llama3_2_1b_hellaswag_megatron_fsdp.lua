-- NeMo Automodel's examples/llm_finetune/llama3_2/llama3_2_1b_hellaswag_megatron_fsdp.yaml:
-- Llama-3.2-1B under the Megatron-FSDP manager (its default strategy, optim_grads_params:
-- ZeRO-3) over the world (8 ranks here).
--
--   moonshard plan --config examples/configs/llama3.2_1b.json \
--       --recipe examples/recipes/llama3_2_1b_hellaswag_megatron_fsdp.lua
return {
  distributed = { strategy = "megatron_fsdp", dp_size = 8, tp_size = 1, cp_size = 1 },
}
