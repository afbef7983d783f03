-- moonshard.models.mistral: MistralForCausalLM, as transformers'
-- models/mistral/modeling_mistral.py builds it: Llama's layout without biases; head_dim is
-- hidden / heads when the key is absent or null (Mistral-7B) and set by it otherwise
-- (Mistral-Nemo: 128 with hidden 5120 and 32 heads); num_key_value_heads is 8 when absent
-- (MistralConfig's default) and the head count when null.

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims({ kv_heads = 8 })
  local dtype = cfg:dtype()
  local inter = cfg:int("intermediate_size")
  local root, _, layers = C.causal_lm(cfg, "MistralModel", d.vocab, d.hidden, dtype)
  C.decoder_layers(layers, d.layers, "MistralDecoderLayer", d.hidden, dtype, function(layer)
    C.attention(layer, "MistralAttention", d, dtype, false)
    C.mlp(layer, "mlp", "MistralMLP", d.hidden, inter, dtype)
  end)
  return root
end
