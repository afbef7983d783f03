-- moonshard.models.inkling2: Inkling2ForCausalLM, the reference architecture moonshard's Inkling2 parallelizer shards
-- ("The inkling2 reference architecture"), reconstructed from the public NeMo Automodel
-- documentation: its code is not public, so this file is where a user corrects it.
--
-- Residual queries, the q and rel L2 clips and the router are stored in FP32 whatever the
-- torch_dtype (the parallelizer's FP32 islands); everything else in torch_dtype.  A tied
-- head is built when the config asks for one (root.attrs.tie_word_embeddings): rejecting it
-- is the policy's prepare_model's job, not the builder's.

local module = require "moonshard.module"
local C = require "moonshard.models.common"

local function residual_query(parent, name, hidden)
  parent:add(name, module.new("ResidualQuery")):param("query", { hidden }, "f32")
end

local function short_conv(parent, name, channels, kernel, dtype)
  parent:add(name, module.new("ShortConv")):param("weight", { channels, 1, kernel }, dtype)
end

local function l2_clip(parent, name, n, dtype)
  parent:add(name, module.new("L2Clip")):param("scale", { n }, dtype)
end

return function(cfg)
  local vocab, hidden = cfg:int("vocab_size"), cfg:int("hidden_size")
  local n_layers = cfg:int("num_hidden_layers", nil, 1, C.MAX_LAYERS)
  local heads, kv_heads = cfg:int("num_attention_heads"), cfg:int("num_key_value_heads")
  cfg:check_gqa(heads, kv_heads)
  local head_dim = cfg:int("head_dim")
  local kernel = cfg:int("short_conv_kernel")
  local max_rel = cfg:int("max_relative_position")
  local dtype = cfg:dtype()
  local inter = cfg:int("moe_intermediate_size")
  local moe = { experts = cfg:int("n_routed_experts"), top_k = cfg:int("num_experts_per_tok"),
    hidden = hidden, inter = inter, dtype = dtype, gate_dtype = "f32", correction_bias = true,
    shared_inter = inter * cfg:int("n_shared_experts", nil, 0) }
  local q_dim, kv_dim = heads * head_dim, kv_heads * head_dim

  local root, model, layers = C.causal_lm(cfg, "Inkling2Model", vocab, hidden, dtype)
  for i = 0, n_layers - 1 do
    local layer = layers:add(tostring(i), module.new("Inkling2DecoderLayer"))
    if i > 0 then residual_query(layer, "attn_query", hidden) end
    C.norm(layer, "attn_norms", hidden, dtype)
    short_conv(layer, "attn_sconv", hidden, kernel, dtype)
    local attn = layer:add("self_attn", module.new("Inkling2Attention"))
    attn:param("relative_table", { 2 * max_rel + 1, heads }, dtype)
    C.linear(attn, "qkvr", 2 * q_dim + 2 * kv_dim, hidden, dtype)  -- q, k, v, relative
    l2_clip(attn, "q_l2_clip", q_dim, "f32")
    l2_clip(attn, "k_l2_clip", kv_dim, dtype)
    l2_clip(attn, "rel_l2_clip", q_dim, "f32")
    short_conv(attn, "k_sconv", kv_dim, kernel, dtype)
    short_conv(attn, "v_sconv", kv_dim, kernel, dtype)
    C.norm(attn, "value_norm", head_dim, dtype)
    C.linear(attn, "wo_ud", hidden, q_dim, dtype)
    residual_query(layer, "mlp_query", hidden)
    C.norm(layer, "mlp_norm", hidden, dtype)
    short_conv(layer, "mlp_sconv", hidden, kernel, dtype)
    C.moe(layer, "mlp", moe)
  end
  residual_query(model, "output_query", hidden)
  return root
end
