-- NeMo Automodel's examples/llm_finetune/llama3_1/llama3_1_8b_hellaswag_fp8.yaml: full
-- fine-tuning of Llama-3.1-8B with torchao's tensorwise fp8 linears, the FSDP all-gather in
-- fp8 with the scales precomputed once a step, the head left in bf16.  dp_size there is none
-- (the world size); 8 ranks here.
--
--   moonshard plan --config examples/configs/llama3.1_8b.json \
--       --recipe examples/recipes/llama3_1_8b_hellaswag_fp8.lua --seq-len 8192 --device h100-80gb
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, defer_fsdp_grad_sync = false,
    sequence_parallel = false },
  fp8 = {
    enabled = true,
    enable_fsdp_float8_all_gather = true,
    precompute_float8_dynamic_scale_for_fsdp = true,
    force_recompute_fp8_weight_in_bwd = true,
    filter_fqns = { "lm_head" },
    emulate = false,
  },
}
