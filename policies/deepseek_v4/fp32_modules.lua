-- fp32_modules.lua: the modules DeepSeek-V4 keeps in FP32, each its own shard unit.
--
-- NeMo Automodel's _DSV4_FP32_MODULE_SUFFIXES (components/models/deepseek_v4/fsdp.py).  A
-- module matches when its dotted name equals an entry or ends with "." .. entry
-- (fsdp.py _matches_suffix), with every "_checkpoint_wrapped_module" segment removed; it
-- becomes an FP32 unit when all its floating parameters are stored in f32
-- (_iter_dsv4_fp32_modules), sharded before the block or model around it.  Edit this list
-- and re-run `moonshard plan`: nothing is rebuilt.
return {
  "attn_hc",                                -- hyper-connection mixer before attention
  "ffn_hc",                                 -- hyper-connection mixer before the MoE block
  "hc_head",                                -- the final hyper-connection collapse
  "lm_head",                                -- the output projection (f32 storage)
  "self_attn.sinks_param",                  -- attention sinks (a DeepseekV4FP32Parameter)
  "self_attn.compressor.wkv",
  "self_attn.compressor.wgate",
  "self_attn.compressor.ape_param",         -- a DeepseekV4FP32Parameter
  "self_attn.compressor.indexer.wkv",
  "self_attn.compressor.indexer.wgate",
  "self_attn.compressor.indexer.ape_param", -- a DeepseekV4FP32Parameter
}
