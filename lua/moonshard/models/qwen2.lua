-- moonshard.models.qwen2: Qwen2ForCausalLM (Qwen2, Qwen2.5), as transformers'
-- models/qwen2/modeling_qwen2.py builds it: Llama's layout, but Qwen2Attention always has
-- biases on q_proj, k_proj and v_proj and none on o_proj (the config has no key for them).

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims()
  local dtype = cfg:dtype()
  local inter = cfg:int("intermediate_size")
  local root, _, layers = C.causal_lm(cfg, "Qwen2Model", d.vocab, d.hidden, dtype)
  C.decoder_layers(layers, d.layers, "Qwen2DecoderLayer", d.hidden, dtype, function(layer)
    C.attention(layer, "Qwen2Attention", d, dtype, "qkv")
    C.mlp(layer, "mlp", "Qwen2MLP", d.hidden, inter, dtype)
  end)
  return root
end
