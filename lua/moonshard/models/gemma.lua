-- moonshard.models.gemma: Gemma2ForCausalLM and Gemma3ForCausalLM (Gemma 3's text model,
-- model_type gemma3_text), as transformers' models/gemma2/modeling_gemma2.py and
-- models/gemma3/modeling_gemma3.py build them: each layer adds pre_feedforward_layernorm and
-- post_feedforward_layernorm to Llama's two norms; Gemma3Attention adds q_norm and k_norm
-- [head_dim]; attention_bias puts biases on all four projections; head_dim is 256 when absent
-- (Gemma2Config's and Gemma3TextConfig's default) and the head is tied unless
-- tie_word_embeddings is false.  The embedding's scale (embed_scale) is a buffer, not a
-- parameter.  A multimodal Gemma 3 config (Gemma3ForConditionalGeneration, with a
-- text_config) is not this architecture.

local C = require "moonshard.models.common"

-- The builder of Gemma `version` (2 or 3): gemma2.lua and gemma3.lua are those.
return function(version)
  return function(cfg)
    if cfg:get("text_config") ~= nil then
      cfg:fail("config key 'text_config' is there: this builds the text model only; give a config of " ..
        "text_config's keys with model_type gemma3_text")
    end
    local d = cfg:gqa_dims({ head_dim = 256 })
    local dtype = cfg:dtype()
    local inter = cfg:int("intermediate_size")
    local bias = cfg:bool("attention_bias", false)
    local prefix = "Gemma" .. version
    local root, _, layers = C.causal_lm(cfg, version == 3 and "Gemma3TextModel" or "Gemma2Model", d.vocab,
      d.hidden, dtype, true)
    C.decoder_layers(layers, d.layers, prefix .. "DecoderLayer", d.hidden, dtype, function(layer)
      C.attention(layer, prefix .. "Attention", d, dtype, bias, { qk_norm = version == 3 })
      C.mlp(layer, "mlp", prefix .. "MLP", d.hidden, inter, dtype)
    end, { "pre_feedforward_layernorm", "post_feedforward_layernorm" })
    -- Gemma's RMSNorm scales by (1 + weight) in f32 and casts back at the end: it keeps its
    -- normalized input in f32, where Llama's keeps it in the input's dtype (plan_activations)
    for _, nm in ipairs(root:named_modules()) do
      if nm[2].type == "RMSNorm" then nm[2].attrs.scale_in_f32 = true end
    end
    return root
  end
end
