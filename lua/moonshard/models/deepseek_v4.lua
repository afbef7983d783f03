-- moonshard.models.deepseek_v4: DeepseekV4ForCausalLM as NeMo Automodel builds it
-- (nemo_automodel/components/models/deepseek_v4/: model.py DeepseekV4ForCausalLM,
-- DeepseekV4Model, DeepseekV4Block, DeepseekV4HashGate; layers.py DeepseekV4Attention,
-- DeepseekV4Compressor, DeepseekV4Indexer, DeepseekV4FP32Parameter,
-- DeepseekV4HyperConnection, DeepseekV4HyperHead; mtp.py DeepseekV4MTPBlock; the MoE block
-- from components/moe/layers.py MoE, Gate, MLP and experts.py GroupedExperts), with its
-- parameter names, shapes, registration order and stored dtypes.

local module = require "moonshard.module"
local C = require "moonshard.models.common"

-- nn.Linear(in_f, out_f, bias=False): weight [out_f, in_f].
local function linear(parent, name, out_f, in_f, dtype, type_name)
  local m = parent:add(name, module.new(type_name or "Linear"))
  m:param("weight", { out_f, in_f }, dtype)
  return m
end

local function norm(parent, name, n, dtype)
  parent:add(name, module.new("RMSNorm")):param("weight", { n }, dtype)
end

-- layers.py DeepseekV4FP32Parameter: a module holding one f32 tensor, `weight`.
local function fp32_holder(parent, name, shape)
  parent:add(name, module.new("DeepseekV4FP32Parameter")):param("weight", shape, "f32")
end

-- layers.py DeepseekV4HyperConnection: fn [mix, hc_mult * hidden], base [mix], scale [3],
-- all f32, mix = (2 + hc_mult) * hc_mult.
local function hyper_connection(parent, name, d)
  local m = parent:add(name, module.new("DeepseekV4HyperConnection"))
  local mix = (2 + d.hc_mult) * d.hc_mult
  m:param("fn", { mix, d.hc_mult * d.hidden }, "f32")
  m:param("base", { mix }, "f32")
  m:param("scale", { 3 }, "f32")
end

-- layers.py DeepseekV4HyperHead: hc_fn [hc_mult, hc_mult * hidden], hc_base [hc_mult],
-- hc_scale [1], all f32.
local function hyper_head(parent, name, d)
  local m = parent:add(name, module.new("DeepseekV4HyperHead"))
  m:param("hc_fn", { d.hc_mult, d.hc_mult * d.hidden }, "f32")
  m:param("hc_base", { d.hc_mult }, "f32")
  m:param("hc_scale", { 1 }, "f32")
end

-- layers.py DeepseekV4Attention (with DeepseekV4Compressor when compress_ratio > 0 and its
-- DeepseekV4Indexer when compress_ratio == 4).
local function attention(layer, d, ratio)
  local dt = d.dtype
  local attn = layer:add("self_attn", module.new("DeepseekV4Attention", { model_type = "deepseek_v4" }))
  linear(attn, "wq_a", d.q_lora, d.hidden, dt)
  norm(attn, "q_norm", d.q_lora, dt)
  linear(attn, "wq_b", d.heads * d.head_dim, d.q_lora, dt)
  linear(attn, "wkv", d.head_dim, d.hidden, dt)
  norm(attn, "kv_norm", d.head_dim, dt)
  -- DeepseekV4GroupedLinear(heads * head_dim / o_groups, o_groups * o_lora_rank, o_groups)
  linear(attn, "wo_a", d.o_groups * d.o_lora, math.floor(d.heads * d.head_dim / d.o_groups), dt, "DeepseekV4GroupedLinear")
  linear(attn, "wo_b", d.hidden, d.o_groups * d.o_lora, dt)
  fp32_holder(attn, "sinks_param", { d.heads })
  if ratio > 0 then
    local comp = attn:add("compressor", module.new("DeepseekV4Compressor"))
    local proj = (ratio == 4 and 2 or 1) * d.head_dim -- overlap mode at ratio 4
    linear(comp, "wkv", proj, d.hidden, "f32")
    linear(comp, "wgate", proj, d.hidden, "f32")
    fp32_holder(comp, "ape_param", { ratio, proj })
    norm(comp, "kv_norm", d.head_dim, dt)
    if ratio == 4 then
      local idx = comp:add("indexer", module.new("DeepseekV4Indexer"))
      local iproj = 2 * d.index_head_dim
      linear(idx, "wkv", iproj, d.hidden, "f32")
      linear(idx, "wgate", iproj, d.hidden, "f32")
      fp32_holder(idx, "ape_param", { 4, iproj })
      norm(idx, "kv_norm", d.index_head_dim, dt)
      linear(idx, "wq_b", d.index_heads * d.index_head_dim, d.q_lora, dt)
      linear(idx, "weights_proj", d.index_heads, d.hidden, dt)
    end
  end
end

-- moe/layers.py MoE: gate (Gate, or model.py DeepseekV4HashGate on a hash layer), experts
-- (GroupedExperts), shared_experts (MLP: up_proj, gate_proj, down_proj, in that order).
--
-- Buffers.  Automodel keeps three kinds of tensors as buffers, not parameters:
-- mlp.gate.e_score_correction_bias ([experts], f32, on the score-routed gates: Gate creates
-- it because gate_bias_update_factor = 1e-3 > 0), mlp.gate.tid2eid ([vocab, top_k], int64,
-- persistent, on the hash gates of the first num_hash_layers layers) and the rotary
-- embeddings' inv_freq (non-persistent).  The first two are buffers here too (whole on
-- every rank, in no unit); inv_freq is not built (no state in a checkpoint, and it lives in
-- model.rotary_emb*, outside every block that fully_shard_by_dtype looks into).
local function moe(layer, d, hash)
  local dt = d.dtype
  local block = layer:add("mlp", module.new("MoE", { n_experts = d.experts, top_k = d.top_k }))
  local gate = block:add("gate", module.new(hash and "DeepseekV4HashGate" or "Gate"))
  gate:param("weight", { d.experts, d.hidden }, dt)
  if hash then
    gate:buffer("tid2eid", { d.vocab, d.top_k }, "i64")
  else
    gate:buffer("e_score_correction_bias", { d.experts }, "f32")
  end
  local experts = block:add("experts", module.new("GroupedExperts"))
  experts:param("gate_and_up_projs", { d.experts, d.hidden, 2 * d.inter }, dt)
  experts:param("down_projs", { d.experts, d.inter, d.hidden }, dt)
  if d.shared > 0 then
    local mlp = block:add("shared_experts", module.new("MLP"))
    linear(mlp, "up_proj", d.shared * d.inter, d.hidden, dt)
    linear(mlp, "gate_proj", d.shared * d.inter, d.hidden, dt)
    linear(mlp, "down_proj", d.hidden, d.shared * d.inter, dt)
  end
end

-- The builder.  Stored dtypes: Automodel builds the model under local_torch_dtype(dtype)
-- (_transformers/model_init.py), dtype = the config's dtype, else torch_dtype, else bfloat16
-- (config.py DeepseekV4Config.__init__: unlike transformers, an absent dtype is bf16).  In
-- f32 whatever that dtype: the hyper-connection mixers attn_hc / ffn_hc (fn, base, scale) and
-- hc_head (hc_fn, hc_base, hc_scale), the attention sinks (self_attn.sinks_param.weight), the
-- compressor's and the indexer's wkv, wgate and ape_param.weight, and lm_head (built with
-- dtype=torch.float32).  Everything else in the model dtype, the norms and the routers
-- included (Float32RMSNorm computes in f32 but stores dtype; Gate.weight is config.dtype).
return function(cfg)
  -- config.py: dtype, else torch_dtype, else bfloat16
  local dtype = (cfg:get("dtype") == nil and cfg:get("torch_dtype") == nil) and "bf16" or cfg:dtype()
  -- The defaults are Automodel's config.py defaults, DeepSeek-V4-Flash's sizes (vocab
  -- 129280, hidden 4096, 43 layers, 64 heads, head_dim 512, q_lora_rank 1024, o_lora_rank
  -- 1024, o_groups 8, 256 routed experts + 1 shared of 2048, top-6, hc_mult 4,
  -- num_hash_layers 3, index 64 heads of 128, one MTP layer), as its docs
  -- (docs/guides/llm/dsv4-flash.md, docs/model-coverage/llm/deepseek-ai/dsv4-flash.mdx: 43
  -- layers, 256 + 1 experts, top-6, hc_mult 4) say; Pro's are 384 routed + 1 shared, top-6
  -- (dsv4-pro.mdx).  The example configs (examples/configs/deepseek_v4_flash.json and
  -- deepseek_v4_pro.json) take their values from there.  Neither repository file holds the
  -- per-layer compress_ratios nor Pro's other sizes (the recipes read them from the Hub):
  -- those are the published config.json files of deepseek-ai/DeepSeek-V4-Flash and
  -- DeepSeek-V4-Pro, as quoted by other projects' tests (Flash: 0, 0, then 4 and 128
  -- alternating, 0 for the MTP layer; Pro: hidden 7168, 61 layers, 128 heads, q_lora_rank
  -- 1536, o_groups 16, 3072 per expert, 128, 128, then 4 and 128 alternating, 0 for MTP).
  local d = {
    dtype = dtype,
    vocab = cfg:int("vocab_size", 129280), hidden = cfg:int("hidden_size", 4096),
    layers = cfg:int("num_hidden_layers", 43, 1, C.MAX_LAYERS),
    heads = cfg:int("num_attention_heads", 64), head_dim = cfg:int("head_dim", 512),
    q_lora = cfg:int("q_lora_rank", 1024), o_lora = cfg:int("o_lora_rank", 1024), o_groups = cfg:int("o_groups", 8),
    experts = cfg:int("n_routed_experts", 256), shared = cfg:int("n_shared_experts", 1, 0),
    top_k = cfg:int("num_experts_per_tok", 6), inter = cfg:int("moe_intermediate_size", 2048),
    hc_mult = cfg:int("hc_mult", 4), hash_layers = cfg:int("num_hash_layers", 3, 0),
    index_heads = cfg:int("index_n_heads", 64), index_head_dim = cfg:int("index_head_dim", 128),
    mtp = cfg:int("num_nextn_predict_layers", 1, 0, C.MAX_LAYERS),
  }
  if (d.heads * d.head_dim) % d.o_groups ~= 0 then
    cfg:fail("num_attention_heads * head_dim = %d is not a multiple of o_groups %d", d.heads * d.head_dim, d.o_groups)
  end
  if cfg:bool("tie_word_embeddings", false) then
    -- model.py: reject_unsupported_tie_word_embeddings (TieSupport.UNTIED_ONLY)
    cfg:fail("tie_word_embeddings is true; Automodel's DeepseekV4ForCausalLM supports untied embeddings only")
  end
  -- DeepseekV4Attention: compress_ratios[layer] when the list is not empty, else 0; the MTP
  -- blocks (layer num_hidden_layers + depth) read past its end as 0 (mtp.py)
  local ratios = cfg:ints("compress_ratios", {})
  local function ratio(i, mtp)
    if #ratios == 0 then return 0 end
    local r = ratios[i + 1]
    if r == nil then
      if mtp then return 0 end
      cfg:fail("compress_ratios has %d entries; layer %d needs one", #ratios, i)
    end
    return r
  end

  local root = module.new(cfg.arch, { architecture = cfg.arch, dtype = dtype, tie_word_embeddings = false,
    config = cfg.raw, source = cfg.source, model_type = "deepseek_v4" })
  -- model.py DeepseekV4ForCausalLM._keep_in_fp32_modules_strict: the names (substrings of a
  -- tensor's name) Automodel's fully_shard_by_dtype computes in f32
  root.attrs.keep_in_fp32_strict = { "attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base",
    "ffn_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale", "self_attn.sinks",
    "self_attn.compressor.wkv", "self_attn.compressor.wgate", "self_attn.compressor.ape",
    "self_attn.compressor.indexer.wkv", "self_attn.compressor.indexer.wgate", "self_attn.compressor.indexer.ape",
    "e_score_correction_bias", "lm_head", "rotary_emb" }
  root.attrs.convention = "NeMo Automodel's DeepseekV4ForCausalLM"
  local model = root:add("model", module.new("DeepseekV4Model", { model_type = "deepseek_v4" }))
  model:add("embed_tokens", module.new("Embedding")):param("weight", { d.vocab, d.hidden }, dtype)
  local layers = model:add("layers", module.new("ModuleDict"))
  for i = 0, d.layers - 1 do
    local layer = layers:add(tostring(i), module.new("DeepseekV4Block"))
    attention(layer, d, ratio(i))
    moe(layer, d, i < d.hash_layers)
    norm(layer, "input_layernorm", d.hidden, dtype)
    norm(layer, "post_attention_layernorm", d.hidden, dtype)
    hyper_connection(layer, "attn_hc", d)
    hyper_connection(layer, "ffn_hc", d)
  end
  hyper_head(model, "hc_head", d)
  norm(model, "norm", d.hidden, dtype)
  linear(root, "lm_head", d.vocab, d.hidden, "f32")
  -- Multi-token prediction: num_nextn_predict_layers (default 1, as config.py and the
  -- released Flash and Pro configs) DeepseekV4MTPBlock modules under mtp.layers.<depth> are
  -- built, because Automodel builds them (DeepseekV4ForCausalLM.__init__,
  -- build_mtp_config_from_hf) and its MoE parallelizer shards them like decoder blocks
  -- (parallelizer.py _iter_moe_blocks, apply_fsdp).  The example recipes set
  -- num_nextn_predict_layers to 0; so may a config.
  if d.mtp > 0 then
    local mtp = root:add("mtp", module.new("DeepseekV4MTPModule"))
    local mlayers = mtp:add("layers", module.new("ModuleList"))
    for depth = 0, d.mtp - 1 do
      local b = mlayers:add(tostring(depth), module.new("DeepseekV4MTPBlock", { model_type = "deepseek_v4" }))
      linear(b, "e_proj", d.hidden, d.hidden, dtype)
      linear(b, "h_proj", d.hidden, d.hidden, dtype)
      norm(b, "enorm", d.hidden, dtype)
      norm(b, "hnorm", d.hidden, dtype)
      attention(b, d, ratio(d.layers + depth, true))
      moe(b, d, false)
      norm(b, "input_layernorm", d.hidden, dtype)
      norm(b, "post_attention_layernorm", d.hidden, dtype)
      hyper_connection(b, "attn_hc", d)
      hyper_connection(b, "ffn_hc", d)
      hyper_head(b, "hc_head", d)
      norm(b, "norm", d.hidden, dtype)
    end
  end
  return root
end
