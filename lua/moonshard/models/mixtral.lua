-- moonshard.models.mixtral: MixtralForCausalLM.  Llama attention; every layer's MLP is the MoE
-- block "block_sparse_moe" of num_local_experts experts of intermediate_size, in Automodel's
-- grouped-experts layout (the checkpoint's per-expert w1/w2/w3 are converted on load).

local C = require "moonshard.models.common"

return function(cfg)
  local d = cfg:gqa_dims()
  local dtype = cfg:dtype()
  local moe = { experts = cfg:int("num_local_experts"), top_k = cfg:int("num_experts_per_tok"),
    hidden = d.hidden, inter = cfg:int("intermediate_size"), dtype = dtype }
  local root, _, layers = C.causal_lm(cfg, "MixtralModel", d.vocab, d.hidden, dtype)
  root.attrs.convention = "Mixtral's checkpoints (MoE block block_sparse_moe; transformers 5 names it mlp), " ..
    "experts grouped as NeMo Automodel groups them"
  C.decoder_layers(layers, d.layers, "MixtralDecoderLayer", d.hidden, dtype, function(layer)
    C.attention(layer, "MixtralAttention", d, dtype, false)
    C.moe(layer, "block_sparse_moe", moe)
  end)
  return root
end
