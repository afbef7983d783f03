-- NeMo Automodel's examples/llm_finetune/llama3_1/llama3_1_8b_hellaswag_pp.yaml: full
-- fine-tuning of Llama-3.1-8B in a pipeline of 2 (Interleaved 1F1B), FSDP2 over the rest
-- (dp_size none there: 4 here, 8 ranks in all).
--
--   moonshard plan --config examples/configs/llama3.1_8b.json \
--       --recipe examples/recipes/llama3_1_8b_hellaswag_pp.lua --seq-len 1024 --micro-batch 4 --global-batch 32
return {
  distributed = {
    strategy = "fsdp2", dp_size = 4, dp_replicate_size = "none", tp_size = 1, cp_size = 1, pp_size = 2, ep_size = 1,
    pipeline = { pp_schedule = "interleaved1f1b", pp_microbatch_size = 4, scale_grads_in_schedule = false },
  },
}
