-- moonshard.models.qwen3: Qwen3ForCausalLM (dense Qwen3), as transformers'
-- models/qwen3/modeling_qwen3.py builds it: Qwen3Attention has q_norm and k_norm
-- (RMSNorm [head_dim]) and, with attention_bias, biases on all four projections; head_dim
-- is 128 when the config does not give it (Qwen3Config's default, not hidden / heads).

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims({ head_dim = 128 })
  local dtype = cfg:dtype()
  local inter = cfg:int("intermediate_size")
  local bias = cfg:bool("attention_bias", false)
  local root, _, layers = C.causal_lm(cfg, "Qwen3Model", d.vocab, d.hidden, dtype)
  C.decoder_layers(layers, d.layers, "Qwen3DecoderLayer", d.hidden, dtype, function(layer)
    C.attention(layer, "Qwen3Attention", d, dtype, bias, { qk_norm = true })
    C.mlp(layer, "mlp", "Qwen3MLP", d.hidden, inter, dtype)
  end)
  return root
end
