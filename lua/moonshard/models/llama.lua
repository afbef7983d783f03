-- moonshard.models.llama: LlamaForCausalLM (Llama 2 and 3), with the parameter names of the
-- Hugging Face checkpoints.  attention_bias adds q/k/v/o biases, mlp_bias the MLP's.

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims()
  local dtype = cfg:dtype()
  local inter = cfg:int("intermediate_size")
  local attention_bias = cfg:bool("attention_bias", false)
  local mlp_bias = cfg:bool("mlp_bias", false)
  local root, _, layers = C.causal_lm(cfg, "LlamaModel", d.vocab, d.hidden, dtype)
  C.decoder_layers(layers, d.layers, "LlamaDecoderLayer", d.hidden, dtype, function(layer)
    C.attention(layer, "LlamaAttention", d, dtype, attention_bias)
    C.mlp(layer, "mlp", "LlamaMLP", d.hidden, inter, dtype, mlp_bias)
  end)
  return root
end
