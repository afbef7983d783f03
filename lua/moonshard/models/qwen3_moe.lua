-- moonshard.models.qwen3_moe: Qwen3MoeForCausalLM.  Attention with per-head RMSNorms on q
-- and k (q_norm, k_norm [head_dim]); layer i is MoE unless it is in mlp_only_layers or
-- (i + 1) is not a multiple of decoder_sparse_step, as in transformers; other layers have a
-- dense MLP of intermediate_size.  No shared experts.

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims()
  local dtype = cfg:dtype()
  local attention_bias = cfg:bool("attention_bias", false)
  local moe = { experts = cfg:int("num_experts", nil, 0), top_k = cfg:int("num_experts_per_tok"),
    hidden = d.hidden, inter = cfg:int("moe_intermediate_size"), dtype = dtype }
  local step = cfg:int("decoder_sparse_step", 1)
  local dense_only = {}
  for _, i in ipairs(cfg:ints("mlp_only_layers", {})) do dense_only[i] = true end
  local dense_inter = cfg:int("intermediate_size")
  local root, _, layers = C.causal_lm(cfg, "Qwen3MoeModel", d.vocab, d.hidden, dtype)
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
