-- moonshard.models.common: what the model builders share.
--
-- Config access whose errors name the key, the architecture and the config file; the stored
-- dtype from dtype or torch_dtype; and the modules several architectures are made of (Linear,
-- RMSNorm, gated MLP, grouped-query attention, the MoE block, the causal-LM skeleton), so
-- that each builder file reads as the list of what is particular to its architecture.

local module = require "moonshard.module"
local json = require "moonshard.json"
local util = require "moonshard.util"

-- A config value as an error shows it: its JSON, at most 80 bytes of it, control bytes
-- escaped (a config may hold a megabyte string where a size should be).
local function shown(v)
  local ok, text = pcall(json.encode, v)
  return util.short_name(ok and text or tostring(v))
end

local C = {}

local Config = {}
Config.__index = Config

--- A reader of the config table `raw`, loaded from `source`, for architecture `arch`.
function C.config(raw, source, arch)
  return setmetatable({ raw = raw, source = source, arch = arch }, Config)
end

function Config:fail(fmt, ...)
  error(string.format("moonshard: models: %s: %s: ", self.source, self.arch) .. string.format(fmt, ...), 0)
end

-- The value at key; nil when absent or JSON null.
function Config:get(key)
  local v = self.raw[key]
  if v == json.null then return nil end
  return v
end

-- The largest integer a config key may hold: the builders multiply at most two keys and
-- a small factor (4 * 2^30 * 2^30 = 2^62), so no shape wraps in Lua 5.4; a parameter past
-- 2^53 elements is refused by name afterwards (models.from_config).
C.MAX_INT = 2 ^ 30
-- Layers are modules built one by one, some 20 modules and parameters each, which planning
-- names and walks again: more than this is a typo or a hostile config, not a model (the
-- deepest open models have 126; 65,536 layers took 15 s and 3 GiB to build alone).
C.MAX_LAYERS = 1024

--- An integer in min (default 1) .. max (default MAX_INT); `default` when absent (an error
-- when there is none).
function Config:int(key, default, min, max)
  local v = self:get(key)
  if v == nil then
    if default == nil then self:fail("config key '%s' is missing", key) end
    return default
  end
  min, max = min or 1, max or C.MAX_INT
  if type(v) ~= "number" or v ~= math.floor(v) or v < min or v > max then
    self:fail("config key '%s' is %s; expected an integer in %d..%d", key, shown(v), min, max)
  end
  return math.floor(v)  -- an integer in 5.4 even when the config wrote 4096.0
end

--- Like int, but the key must be present and null means "none": returns nil then.
function Config:int_or_null(key, min)
  if self.raw[key] == nil then self:fail("config key '%s' is missing (null if unused)", key) end
  if self.raw[key] == json.null then return nil end
  return self:int(key, nil, min)
end

--- A boolean; `default` when absent.
function Config:bool(key, default)
  local v = self:get(key)
  if v == nil then return default end
  if type(v) ~= "boolean" then self:fail("config key '%s' is %s; expected true or false", key, shown(v)) end
  return v
end

--- A list of integers >= 0; `default` when absent.
function Config:ints(key, default)
  local v = self:get(key)
  if v == nil then return default end
  if type(v) ~= "table" then self:fail("config key '%s' is %s; expected a list of integers", key, shown(v)) end
  for i, x in ipairs(v) do
    if type(x) ~= "number" or x ~= math.floor(x) or x < 0 then
      self:fail("config key '%s'[%d] is %s; expected an integer >= 0", key, i - 1, shown(x))
    end
  end
  return v
end

local torch_dtypes = { bfloat16 = "bf16", float16 = "f16", half = "f16", float32 = "f32",
  float = "f32", float64 = "f64", double = "f64" }

--- The stored dtype of the model, read as transformers 5 reads it: "dtype" (the key it
-- writes), else "torch_dtype" (the key older versions wrote), else f32, the dtype torch
-- makes parameters in when the config names none.
function Config:dtype()
  local key = self:get("dtype") ~= nil and "dtype" or "torch_dtype"
  local v = self:get(key)
  if v == nil then return "f32" end
  local dt = torch_dtypes[v]
  if not dt then
    self:fail("config key '%s' is %s; expected one of bfloat16, float16, float32, float64", key, shown(v))
  end
  return dt
end

--- Grouped-query attention shares each key/value head among a whole group of query heads
-- (transformers' repeat_kv by num_attention_heads // num_key_value_heads): a config whose
-- heads do not divide into groups builds no working model.
function Config:check_gqa(heads, kv_heads)
  if heads % kv_heads ~= 0 then
    self:fail("num_attention_heads %d is not a multiple of num_key_value_heads %d (each key/value head serves " ..
      "a whole group of query heads)", heads, kv_heads)
  end
end

--- The sizes of a grouped-query-attention decoder: vocab, hidden, layers, heads, kv_heads
-- (default heads) and head_dim (default hidden / heads, as transformers does).  defaults
-- (optional) holds the defaults of the architecture's transformers config class where they
-- differ: head_dim (Qwen3Config 128, Gemma2Config 256) when the key is absent or null, and
-- kv_heads when the key is absent (MistralConfig: 8; null still means heads).
function Config:gqa_dims(defaults)
  defaults = defaults or {}
  local d = { vocab = self:int("vocab_size"), hidden = self:int("hidden_size"),
    layers = self:int("num_hidden_layers", nil, 1, C.MAX_LAYERS), heads = self:int("num_attention_heads") }
  local kv_default = d.heads
  if self.raw.num_key_value_heads == nil and defaults.kv_heads then kv_default = defaults.kv_heads end
  d.kv_heads = self:int("num_key_value_heads", kv_default)
  self:check_gqa(d.heads, d.kv_heads)
  if self:get("head_dim") == nil and not defaults.head_dim and d.hidden % d.heads ~= 0 then
    self:fail("hidden_size %d is not a multiple of num_attention_heads %d; give head_dim", d.hidden, d.heads)
  end
  d.head_dim = self:int("head_dim", defaults.head_dim or math.floor(d.hidden / d.heads))
  return d
end

-- ---------------------------------------------------------------- modules

--- parent.name = Linear(in_f -> out_f): weight [out_f, in_f], bias [out_f] when asked.
function C.linear(parent, name, out_f, in_f, dtype, bias)
  local m = parent:add(name, module.new("Linear"))
  m:param("weight", { out_f, in_f }, dtype)
  if bias then m:param("bias", { out_f }, dtype) end
  return m
end

--- parent.name = RMSNorm: weight [n].
function C.norm(parent, name, n, dtype)
  local m = parent:add(name, module.new("RMSNorm"))
  m:param("weight", { n }, dtype)
  return m
end

--- parent.name = a SwiGLU MLP of the given type: gate_proj, up_proj [inter, hidden], down_proj
-- [hidden, inter].
function C.mlp(parent, name, type_name, hidden, inter, dtype, bias)
  local m = parent:add(name, module.new(type_name))
  C.linear(m, "gate_proj", inter, hidden, dtype, bias)
  C.linear(m, "up_proj", inter, hidden, dtype, bias)
  C.linear(m, "down_proj", hidden, inter, dtype, bias)
  return m
end

--- parent.self_attn = grouped-query attention of the given type with q/k/v/o_proj.  bias:
-- true for biases on all four projections, "qkv" for q, k and v only (Qwen2), false or nil
-- for none.  With o.qk_norm, q_norm and k_norm (RMSNorm [head_dim], Qwen3 and Gemma3) follow
-- o_proj, in transformers' registration order.  attrs heads, kv_heads and head_dim give the
-- shapes attention keeps for backward (moonshard.plan_activations).
function C.attention(parent, type_name, d, dtype, bias, o)
  local m = parent:add("self_attn", module.new(type_name, { heads = d.heads, kv_heads = d.kv_heads,
    head_dim = d.head_dim }))
  local qkv_bias = bias == true or bias == "qkv"
  C.linear(m, "q_proj", d.heads * d.head_dim, d.hidden, dtype, qkv_bias)
  C.linear(m, "k_proj", d.kv_heads * d.head_dim, d.hidden, dtype, qkv_bias)
  C.linear(m, "v_proj", d.kv_heads * d.head_dim, d.hidden, dtype, qkv_bias)
  C.linear(m, "o_proj", d.hidden, d.heads * d.head_dim, dtype, bias == true)
  if o and o.qk_norm then
    C.norm(m, "q_norm", d.head_dim, dtype)
    C.norm(m, "k_norm", d.head_dim, dtype)
  end
  return m
end

--- parent.name = an MoE block in Automodel's layout: gate (router), experts (grouped
-- [experts, in, out] tensors) and, when o.shared_inter > 0, shared_experts (one fused MLP).
-- o: experts, top_k, hidden, inter, dtype; gate_dtype (default dtype); correction_bias (the
-- gate's e_score_correction_bias [experts]: an f32 buffer whatever the model's dtype, as
-- Automodel's Gate registers it (components/moe/layers.py) and DeepSeek-V3's checkpoints store
-- it: it only shifts the top-k choice, is updated outside the optimizer, and FSDP2 leaves it
-- whole on every rank; Automodel's MoE parallelizer replicates it over the FSDP mesh);
-- n_group and topk_group (group-limited routing, attrs of the block; default 1).
function C.moe(parent, name, o)
  local block = parent:add(name, module.new("MoE", { n_experts = o.experts, top_k = o.top_k,
    n_group = o.n_group, topk_group = o.topk_group }))
  local gate = block:add("gate", module.new("Gate"))
  gate:param("weight", { o.experts, o.hidden }, o.gate_dtype or o.dtype)
  if o.correction_bias then
    gate:buffer("e_score_correction_bias", { o.experts }, "f32")
  end
  local experts = block:add("experts", module.new("GroupedExperts"))
  experts:param("gate_and_up_projs", { o.experts, o.hidden, 2 * o.inter }, o.dtype)
  experts:param("down_projs", { o.experts, o.inter, o.hidden }, o.dtype)
  if o.shared_inter and o.shared_inter > 0 then
    C.mlp(block, "shared_experts", "MLP", o.hidden, o.shared_inter, o.dtype)
  end
  return block
end

--- The causal-LM skeleton: root (type = the architecture) with model {embed_tokens, layers,
-- norm} and lm_head, whose weight is the embedding's own parameter object when
-- tie_word_embeddings is true (so it is counted once, as in PyTorch; when the key is absent,
-- tie_default, the architecture's config class default: false unless given).  Returns root,
-- model, layers; the builder fills layers.
function C.causal_lm(cfg, model_type, vocab, hidden, dtype, tie_default)
  local tied = cfg:bool("tie_word_embeddings", tie_default or false)
  local root = module.new(cfg.arch, { architecture = cfg.arch, dtype = dtype,
    tie_word_embeddings = tied, config = cfg.raw, source = cfg.source })
  local model = root:add("model", module.new(model_type))
  local embed = model:add("embed_tokens", module.new("Embedding"))
  local weight = embed:param("weight", { vocab, hidden }, dtype)
  local layers = model:add("layers", module.new("ModuleList"))
  C.norm(model, "norm", hidden, dtype)
  local head = root:add("lm_head", module.new("Linear"))
  if tied then head:param("weight", weight) else head:param("weight", { vocab, hidden }, dtype) end
  return root, model, layers
end

--- Adds n Hugging Face decoder layers "0".."n-1" of the given type: fill(layer, i) adds
-- self_attn and the MLP, then come input_layernorm and post_attention_layernorm, the
-- registration order of the transformers classes, and the norms named in extra_norms (a
-- list, optional: Gemma's pre_feedforward_layernorm and post_feedforward_layernorm).
function C.decoder_layers(layers, n, type_name, hidden, dtype, fill, extra_norms)
  for i = 0, n - 1 do
    local layer = layers:add(tostring(i), module.new(type_name))
    fill(layer, i)
    C.norm(layer, "input_layernorm", hidden, dtype)
    C.norm(layer, "post_attention_layernorm", hidden, dtype)
    for _, norm in ipairs(extra_norms or {}) do C.norm(layer, norm, hidden, dtype) end
  end
end

return C
