-- fp32_modules.lua: the modules kept in FP32, as data.
return { "attn_query", "mlp_query", "output_query", "q_l2_clip", "rel_l2_clip", "gate" }
