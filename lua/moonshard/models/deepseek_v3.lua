-- moonshard.models.deepseek_v3: DeepseekV3ForCausalLM.  Multi-head latent attention (MLA:
-- low-rank q and kv projections with their norms); the first first_k_dense_replace layers
-- have a dense MLP of intermediate_size, the others (every moe_layer_freq-th) an MoE block of
-- n_routed_experts experts of moe_intermediate_size, a gate with e_score_correction_bias (an f32
-- buffer: see common.moe) and n_shared_experts shared experts fused into one MLP.
--
-- The multi-token-prediction modules (num_nextn_predict_layers) are not built: they are not
-- part of the model transformers instantiates (the checkpoint stores the one MTP module of
-- DeepSeek-V3 as model.layers.61, which transformers skips on load).  DeepSeek-V3 therefore
-- counts 671,026,404,352 parameters here, the 671B without MTP (and 58 x 256 f32 correction
-- biases, buffers).

local module = require "moonshard.module"
local C = require "moonshard.models.common"

-- The MLA sizes, read once.
local function mla_dims(cfg, hidden)
  return { hidden = hidden, heads = cfg:int("num_attention_heads"),
    q_lora = cfg:int_or_null("q_lora_rank"), kv_lora = cfg:int("kv_lora_rank"),
    nope = cfg:int("qk_nope_head_dim"), rope = cfg:int("qk_rope_head_dim", nil, 0),
    v_dim = cfg:int("v_head_dim"), bias = cfg:bool("attention_bias", false) }
end

-- layer.self_attn: q through the q_lora_rank bottleneck (or one q_proj when it is null),
-- k and v through the compressed kv_lora_rank latent plus a shared rope key.
local function mla(layer, m, dtype)
  local attn = layer:add("self_attn", module.new("DeepseekV3Attention", { heads = m.heads, rope_dim = m.rope,
    v_head_dim = m.v_dim }))
  local q_out = m.heads * (m.nope + m.rope)
  if m.q_lora then
    C.linear(attn, "q_a_proj", m.q_lora, m.hidden, dtype, m.bias)
    C.norm(attn, "q_a_layernorm", m.q_lora, dtype)
    C.linear(attn, "q_b_proj", q_out, m.q_lora, dtype)
  else
    C.linear(attn, "q_proj", q_out, m.hidden, dtype)
  end
  C.linear(attn, "kv_a_proj_with_mqa", m.kv_lora + m.rope, m.hidden, dtype, m.bias)
  C.norm(attn, "kv_a_layernorm", m.kv_lora, dtype)
  C.linear(attn, "kv_b_proj", m.heads * (m.nope + m.v_dim), m.kv_lora, dtype)
  C.linear(attn, "o_proj", m.hidden, m.heads * m.v_dim, dtype, m.bias)
end

return function(cfg)
  local vocab, hidden = cfg:int("vocab_size"), cfg:int("hidden_size")
  local n_layers = cfg:int("num_hidden_layers", nil, 1, C.MAX_LAYERS)
  local dtype = cfg:dtype()
  local m = mla_dims(cfg, hidden)
  local dense_inter = cfg:int("intermediate_size")
  local first_dense = cfg:int("first_k_dense_replace", nil, 0)
  local freq = cfg:int("moe_layer_freq", 1)
  local inter = cfg:int("moe_intermediate_size")
  local moe = { experts = cfg:int("n_routed_experts"), top_k = cfg:int("num_experts_per_tok"),
    hidden = hidden, inter = inter, dtype = dtype, correction_bias = true,
    shared_inter = inter * cfg:int("n_shared_experts", nil, 0), n_group = cfg:int("n_group", 1),
    topk_group = cfg:int("topk_group", 1) }
  local root, _, layers = C.causal_lm(cfg, "DeepseekV3Model", vocab, hidden, dtype)
  -- Automodel's DeepseekV3ForCausalLM (components/models/deepseek_v3/model.py) pins this name
  -- to fp32 compute (_keep_in_fp32_modules_strict), which its fully_shard_by_dtype reads.
  -- transformers 5's class pins "gate.weight" too and builds the router weight in f32; this
  -- builder follows Automodel's model (router weight in the model's dtype): see convention.
  root.attrs.keep_in_fp32_strict = { "e_score_correction_bias" }
  root.attrs.convention = "NeMo Automodel's DeepseekV3ForCausalLM"
  root.attrs.transformers_fp32 = { "mlp.gate.weight" }
  C.decoder_layers(layers, n_layers, "DeepseekV3DecoderLayer", hidden, dtype, function(layer, i)
    mla(layer, m, dtype)
    if i >= first_dense and i % freq == 0 then
      C.moe(layer, "mlp", moe)
    else
      C.mlp(layer, "mlp", "DeepseekV3MLP", hidden, dense_inter, dtype)
    end
  end)
  return root
end
