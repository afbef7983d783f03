-- fp32_modules.lua: the modules Inkling2 keeps in FP32 (the seed's FP32_MODULES).
--
-- A module is an FP32 island when its dotted name, with every "_checkpoint_wrapped_module"
-- segment removed, equals an entry or ends with "." .. entry (dot-bounded: xattn_query does
-- not match attn_query).  Each island becomes its own shard unit with the FP32 policy of
-- precision.lua, sharded before the module around it (with the option pack_islands, it is
-- packed into that module's unit instead, keeping the FP32 policy).  Edit this list and re-run
-- `moonshard plan`: nothing is rebuilt.
--
-- The seed's list is cut after "mlp.gat"; "mlp.gate" (the router) is the reading shipped here.
return {
  "attn_query",   -- ResidualQuery before attention (not on layer 0)
  "mlp_query",    -- ResidualQuery before the MoE block
  "output_query", -- ResidualQuery before the final norm
  "q_l2_clip",    -- L2Clip of the queries
  "rel_l2_clip",  -- L2Clip of the relative keys
  "mlp.gate",     -- the router and its e_score_correction_bias
}
