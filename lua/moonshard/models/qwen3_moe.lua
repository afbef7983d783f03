-- moonshard.models.qwen3_moe: Qwen3MoeForCausalLM.  Attention with per-head RMSNorms on q
-- and k (q_norm, k_norm [head_dim]); layer i is MoE unless it is in mlp_only_layers or
-- (i + 1) is not a multiple of decoder_sparse_step, as in transformers; other layers have a
-- dense MLP of intermediate_size.  No shared experts.  The expert count is num_experts, or
-- num_local_experts, the name transformers 5 writes; 0 makes every layer dense, as in
-- transformers.

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims()
  local dtype = cfg:dtype()
  local attention_bias = cfg:bool("attention_bias", false)
  local experts_key = cfg:get("num_experts") ~= nil and "num_experts" or "num_local_experts"
  if cfg:get(experts_key) == nil then
    cfg:fail("config key 'num_experts' is missing (nor is there 'num_local_experts', as transformers 5 calls it)")
  end
  local moe = { experts = cfg:int(experts_key, nil, 0), hidden = d.hidden, dtype = dtype }
  if moe.experts > 0 then  -- what an all-dense model does not need
    moe.top_k, moe.inter = cfg:int("num_experts_per_tok"), cfg:int("moe_intermediate_size")
  end
  local step = cfg:int("decoder_sparse_step", 1)
  local dense_only = {}
  for _, i in ipairs(cfg:ints("mlp_only_layers", {})) do dense_only[i] = true end
  local dense_inter = cfg:int("intermediate_size")
  local root, _, layers = C.causal_lm(cfg, "Qwen3MoeModel", d.vocab, d.hidden, dtype)
  root.attrs.convention = "NeMo Automodel's Qwen3MoeForCausalLM (grouped experts, the router before them; " ..
    "transformers 5 registers the experts first)"
  C.decoder_layers(layers, d.layers, "Qwen3MoeDecoderLayer", d.hidden, dtype, function(layer, i)
    local attn = C.attention(layer, "Qwen3MoeAttention", d, dtype, attention_bias)
    C.norm(attn, "q_norm", d.head_dim, dtype)
    C.norm(attn, "k_norm", d.head_dim, dtype)
    if not dense_only[i] and moe.experts > 0 and (i + 1) % step == 0 then
      C.moe(layer, "mlp", moe)
    else
      C.mlp(layer, "mlp", "Qwen3MoeMLP", d.hidden, dense_inter, dtype)
    end
  end)
  return root
end
