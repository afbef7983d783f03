-- NeMo Automodel's examples/llm_finetune/llama3_2/llama3_2_1b_squad_qat.yaml: quantisation-aware
-- fine-tuning of Llama-3.2-1B with torchao's int8-dynamic-activation / int4-weight fake
-- quantisation in groups of 256, FSDP2 over the world (8 ranks here).
--
--   moonshard plan --config examples/configs/llama3.2_1b.json \
--       --recipe examples/recipes/llama3_2_1b_squad_qat.lua
return {
  distributed = { strategy = "fsdp2", dp_size = 8, tp_size = 1, cp_size = 1, sequence_parallel = false },
  qat = {
    fake_quant_after_n_steps = 1,
    enabled = true,
    qat_config = { _target_ = "nemo_automodel.components.quantization.qat.QATConfig",
      quantizer_type = "int8_dynact_int4weight", groupsize = 256 },
  },
}
