-- NeMo Automodel's examples/llm_finetune/qwen/qwen3_moe_30b_hellaswag.yaml: full fine-tuning
-- of Qwen3-30B-A3B with expert parallelism over 8 ranks and activation checkpointing, FSDP2
-- over the same 8 ranks.
--
--   moonshard plan --config examples/configs/qwen3_30b_a3b.json \
--       --recipe examples/recipes/qwen3_moe_30b_hellaswag.lua
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, pp_size = 1, ep_size = 8,
    activation_checkpointing = true, sequence_parallel = false },
}
