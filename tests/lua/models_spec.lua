-- models_spec.lua: the builders against parameter counts worked out by hand from the public
-- configs, the names and shapes the checkpoints use, and their errors.
local models = require "moonshard.models"
local json = require "moonshard.json"

local CONFIGS = "examples/configs/"

local function load_config(name)
  local f = assert(io.open(CONFIGS .. name, "rb"))
  local cfg = json.decode(f:read("a"), name)
  f:close()
  return cfg
end

-- fqn -> param of a tree
local function params_of(tree)
  local out = {}
  for _, np in ipairs(tree:named_parameters()) do out[np[1]] = np[2] end
  return out
end

local function build_error(config, source)
  local ok, err = pcall(models.from_config, config, source)
  assert.is_false(ok)
  return err
end

describe("Llama-3.1-8B", function()
  local tree = models.from_config(CONFIGS .. "llama3.1_8b.json")

  it("counts 8,030,261,248 parameters", function()
    local V, H, L, I = 128256, 4096, 32, 14336
    local q, kv = 32 * 128, 8 * 128                 -- 32 query heads, 8 kv heads of 128
    local attn = H * q + 2 * H * kv + q * H          -- q, k, v, o projections
    local mlp = 3 * H * I                            -- gate, up, down
    local layer = attn + mlp + 2 * H                 -- + input/post-attention norms
    local total = V * H + L * layer + H + V * H      -- embed, layers, final norm, lm_head
    assert.equal(8030261248, total)
    assert.equal(total, tree:param_count())
  end)

  it("lists parameters in PyTorch's order with the checkpoint names", function()
    local names = {}
    for i, np in ipairs(tree:named_parameters()) do names[i] = np[1] end
    assert.same({
      "model.embed_tokens.weight",
      "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
      "model.layers.1.self_attn.q_proj.weight",
    }, { table.unpack(names, 1, 11) })
    assert.equal("model.norm.weight", names[#names - 1])
    assert.equal("lm_head.weight", names[#names])
    assert.equal(2 + 32 * 9 + 1, #names)
  end)

  it("has the module types and shapes of the convention", function()
    local p = params_of(tree)
    assert.same({ 1024, 4096 }, p["model.layers.3.self_attn.k_proj.weight"].shape)
    assert.same({ 4096, 14336 }, p["model.layers.31.mlp.down_proj.weight"].shape)
    assert.same({ 128256, 4096 }, p["lm_head.weight"].shape)
    assert.equal("bf16", p["model.norm.weight"].dtype)
    assert.equal("LlamaForCausalLM", tree.type)
    assert.equal("LlamaModel", tree:get("model").type)
    assert.equal("Embedding", tree:get("model.embed_tokens").type)
    assert.equal("ModuleList", tree:get("model.layers").type)
    assert.equal("LlamaDecoderLayer", tree:get("model.layers.0").type)
    assert.equal("RMSNorm", tree:get("model.norm").type)
    assert.equal("Linear", tree:get("lm_head").type)
    assert.is_false(tree.attrs.tie_word_embeddings)
  end)

  it("counts tied embeddings once, as PyTorch does", function()
    local cfg = load_config("llama3.1_8b.json")
    cfg.tie_word_embeddings = true
    local tied = models.from_config(cfg)
    assert.equal(8030261248 - 128256 * 4096, tied:param_count())
    assert.equal(tied:get("model.embed_tokens").params.weight, tied:get("lm_head").params.weight)
    assert.is_nil(params_of(tied)["lm_head.weight"])
    assert.is_true(tied.attrs.tie_word_embeddings)
  end)

  it("adds biases for attention_bias and mlp_bias", function()
    local cfg = load_config("llama3.1_8b.json")
    cfg.attention_bias, cfg.mlp_bias, cfg.num_hidden_layers = true, true, 1
    local p = params_of(models.from_config(cfg))
    assert.same({ 1024 }, p["model.layers.0.self_attn.v_proj.bias"].shape)
    assert.same({ 4096 }, p["model.layers.0.self_attn.o_proj.bias"].shape)
    assert.same({ 14336 }, p["model.layers.0.mlp.up_proj.bias"].shape)
  end)
end)

describe("Mixtral-8x7B", function()
  local tree = models.from_config(CONFIGS .. "mixtral_8x7b.json")

  it("counts 46,702,792,704 parameters", function()
    local V, H, L, I, E = 32000, 4096, 32, 14336, 8
    local attn = H * 4096 + 2 * H * 1024 + 4096 * H  -- 32 q heads, 8 kv heads of 128
    local moe = E * H + E * 3 * H * I                -- router + 8 experts (gate/up, down)
    local layer = attn + moe + 2 * H
    local total = V * H + L * layer + H + V * H
    assert.equal(46702792704, total)
    assert.equal(total, tree:param_count())
  end)

  it("has the MoE block in Automodel's grouped layout", function()
    local block = tree:get("model.layers.5.block_sparse_moe")
    assert.equal("MoE", block.type)
    assert.equal(8, block.attrs.n_experts)
    assert.equal(2, block.attrs.top_k)
    assert.same({ "gate", "experts" }, block.child_order)
    assert.equal("Gate", block.children.gate.type)
    assert.same({ "weight" }, block.children.gate.param_order)
    assert.equal("GroupedExperts", block.children.experts.type)
    assert.same({ 8, 4096, 2 * 14336 }, block.children.experts.params.gate_and_up_projs.shape)
    assert.same({ 8, 14336, 4096 }, block.children.experts.params.down_projs.shape)
  end)
end)

describe("Qwen3-30B-A3B", function()
  local tree = models.from_config(CONFIGS .. "qwen3_30b_a3b.json")

  it("counts 30,532,122,624 parameters", function()
    local V, H, L, E, I, d = 151936, 2048, 48, 128, 768, 128
    local q, kv = 32 * d, 4 * d
    local attn = H * q + 2 * H * kv + q * H + 2 * d  -- q, k, v, o + q_norm, k_norm [head_dim]
    local moe = E * H + E * 3 * H * I                -- router + 128 experts, no shared expert
    local layer = attn + moe + 2 * H
    local total = V * H + L * layer + H + V * H
    assert.equal(30532122624, total)                 -- the HF index's total_size / 2 bytes
    assert.equal(total, tree:param_count())
  end)

  it("has per-head q/k norms and MoE in every layer", function()
    local p = params_of(tree)
    assert.same({ 128 }, p["model.layers.0.self_attn.q_norm.weight"].shape)
    assert.same({ 128 }, p["model.layers.47.self_attn.k_norm.weight"].shape)
    assert.same({ 128, 2048 }, p["model.layers.47.mlp.gate.weight"].shape)
    assert.equal(128, tree:get("model.layers.0.mlp").attrs.n_experts)
    assert.is_nil(tree:get("model.layers.0.mlp.shared_experts"))
    assert.is_nil(tree:get("model.layers.0.mlp").children.gate.params.e_score_correction_bias)
  end)

  it("makes dense the mlp_only_layers and the layers decoder_sparse_step skips", function()
    local cfg = load_config("qwen3_30b_a3b.json")
    cfg.num_hidden_layers, cfg.decoder_sparse_step, cfg.mlp_only_layers = 6, 2, json.array({ 3 })
    local t = models.from_config(cfg)
    local kinds = {}
    for i = 0, 5 do kinds[i + 1] = t:get("model.layers." .. i .. ".mlp").type end
    assert.same({ "Qwen3MoeMLP", "MoE", "Qwen3MoeMLP", "Qwen3MoeMLP", "Qwen3MoeMLP", "MoE" }, kinds)
    assert.same({ 6144, 2048 }, t:get("model.layers.0.mlp.up_proj").params.weight.shape)
  end)

  it("reads num_local_experts, transformers 5's name, when num_experts is absent", function()
    local cfg = load_config("qwen3_30b_a3b.json")
    cfg.num_experts, cfg.num_local_experts = nil, 128
    local t = models.from_config(cfg)
    assert.equal(128, t:get("model.layers.0.mlp").attrs.n_experts)
    assert.equal(30532122624, t:param_count())
    -- both: num_experts, as transformers 5 reads a config written by transformers 4
    cfg.num_experts, cfg.num_local_experts = 64, 32
    assert.same({ 64, 2048 }, params_of(models.from_config(cfg))["model.layers.0.mlp.gate.weight"].shape)
    cfg.num_experts, cfg.num_local_experts = json.null, 32
    assert.same({ 32, 2048 }, params_of(models.from_config(cfg))["model.layers.0.mlp.gate.weight"].shape)
    cfg.num_experts, cfg.num_local_experts = nil, nil
    assert.matches("Qwen3MoeForCausalLM: config key 'num_experts' is missing %(nor is there 'num_local_experts'",
      build_error(cfg))
  end)

  it("makes every layer dense when num_experts is 0, as transformers does", function()
    local cfg = load_config("qwen3_30b_a3b.json")
    cfg.num_hidden_layers, cfg.num_experts = 3, 0
    cfg.num_experts_per_tok, cfg.moe_intermediate_size = nil, nil -- unused then
    local t = models.from_config(cfg)
    for i = 0, 2 do assert.equal("Qwen3MoeMLP", t:get("model.layers." .. i .. ".mlp").type) end
    assert.same({ 6144, 2048 }, t:get("model.layers.2.mlp.up_proj").params.weight.shape)
    assert.is_nil(models.routed_experts(t))
    assert.equal(128, models.routed_experts(tree))
  end)
end)

describe("DeepSeek-V3", function()
  local tree = models.from_config(CONFIGS .. "deepseek_v3.json")

  it("counts 671,026,404,352 parameters without the MTP module (the 58 routers' correction biases are buffers)", function()
    local V, H, L, dense_layers = 129280, 7168, 61, 3
    local nh, q_lora, kv_lora, nope, rope, vd = 128, 1536, 512, 128, 64, 128
    local attn = H * q_lora + q_lora                 -- q_a_proj, q_a_layernorm
      + q_lora * nh * (nope + rope)                  -- q_b_proj
      + H * (kv_lora + rope) + kv_lora               -- kv_a_proj_with_mqa, kv_a_layernorm
      + kv_lora * nh * (nope + vd)                   -- kv_b_proj
      + nh * vd * H                                  -- o_proj
    local dense_mlp = 3 * H * 18432
    local E, I, shared = 256, 2048, 1
    local moe = E * H                                -- router weight (e_score_correction_bias: a buffer)
      + E * 3 * H * I                                -- routed experts
      + 3 * H * (I * shared)                         -- the shared expert
    local norms = 2 * H
    local total = V * H + dense_layers * (attn + dense_mlp + norms)
      + (L - dense_layers) * (attn + moe + norms) + H + V * H
    assert.equal(671026404352, total)
    assert.equal(total, tree:param_count())
  end)

  it("has MLA attention, three dense layers, then MoE with shared experts", function()
    local p = params_of(tree)
    assert.same({ 1536, 7168 }, p["model.layers.0.self_attn.q_a_proj.weight"].shape)
    assert.same({ 1536 }, p["model.layers.0.self_attn.q_a_layernorm.weight"].shape)
    assert.same({ 128 * 192, 1536 }, p["model.layers.0.self_attn.q_b_proj.weight"].shape)
    assert.same({ 576, 7168 }, p["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape)
    assert.same({ 512 }, p["model.layers.0.self_attn.kv_a_layernorm.weight"].shape)
    assert.same({ 128 * 256, 512 }, p["model.layers.0.self_attn.kv_b_proj.weight"].shape)
    assert.same({ 7168, 128 * 128 }, p["model.layers.0.self_attn.o_proj.weight"].shape)
    assert.equal("DeepseekV3MLP", tree:get("model.layers.2.mlp").type)
    assert.same({ 18432, 7168 }, p["model.layers.2.mlp.gate_proj.weight"].shape)
    assert.equal("MoE", tree:get("model.layers.3.mlp").type)
    assert.same({ "gate", "experts", "shared_experts" }, tree:get("model.layers.3.mlp").child_order)
    -- as deepseek-ai's checkpoints store them: a bf16 router, an f32 correction bias, which
    -- only shifts the top-k choice: a buffer, as in Automodel's Gate and transformers' router
    assert.equal("bf16", p["model.layers.3.mlp.gate.weight"].dtype)
    assert.is_true(p["model.layers.3.mlp.gate.weight"].requires_grad)
    assert.is_nil(p["model.layers.3.mlp.gate.e_score_correction_bias"])
    local bias = tree:get("model.layers.3.mlp.gate").buffers.e_score_correction_bias
    assert.same({ { 256 }, "f32", true }, { bias.shape, bias.dtype, bias.persistent })
    assert.equal(58, #tree:named_buffers())
    assert.same({ "e_score_correction_bias" }, tree.attrs.keep_in_fp32_strict)
    assert.equal("MLP", tree:get("model.layers.60.mlp.shared_experts").type)
    assert.same({ 7168, 2048 }, p["model.layers.60.mlp.shared_experts.down_proj.weight"].shape)
    assert.is_nil(tree:get("model.layers.61"))
  end)

  it("uses one q_proj when q_lora_rank is null", function()
    local cfg = load_config("deepseek_v3.json")
    cfg.q_lora_rank, cfg.num_hidden_layers = json.null, 1
    local attn = models.from_config(cfg):get("model.layers.0.self_attn")
    assert.same({ "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj" }, attn.child_order)
    assert.same({ 128 * 192, 7168 }, attn.children.q_proj.params.weight.shape)
  end)
end)

describe("Inkling2", function()
  local tree = models.from_config(CONFIGS .. "inkling2_small.json")

  it("counts the small model by its parameter list", function()
    local V, H, L, nh, nkv, d, E, I, Is, K, max_rel = 1024, 256, 4, 8, 2, 32, 16, 128, 128, 4, 64
    local attn = (2 * nh + 2 * nkv) * d * H          -- qkvr
      + nh * d + nkv * d + nh * d                    -- q/k/rel L2 clips
      + 2 * nkv * d * K                              -- k_sconv, v_sconv
      + (2 * max_rel + 1) * nh                       -- relative_table
      + d                                            -- value_norm
      + H * nh * d                                   -- wo_ud
    local moe = E * H                                -- router (e_score_correction_bias: a buffer)
      + E * H * 2 * I + E * I * H                    -- grouped experts
      + 3 * Is * H                                   -- shared experts
    local layer = H + H * K                          -- attn_norms, attn_sconv
      + attn
      + H + H + H * K                                -- mlp_query, mlp_norm, mlp_sconv
      + moe
    local total = V * H + L * layer + (L - 1) * H    -- attn_query on layers 1..L-1
      + H + H + V * H                                -- norm, output_query, lm_head
    assert.equal(8164000, total)
    assert.equal(total, tree:param_count())
  end)

  it("has exactly the parameters of the Inkling2 layout, with the FP32 ones in f32", function()
    local got = {}
    local tensors = tree:named_parameters()
    for _, nb in ipairs(tree:named_buffers()) do tensors[#tensors + 1] = nb end
    for _, np in ipairs(tensors) do
      local name = np[1]:gsub("^model%.layers%.1%.", "L.")
      if not name:match("^model%.layers%.") then
        got[#got + 1] = name .. " " .. np[2].dtype .. " [" .. table.concat(np[2].shape, ",") .. "]"
      end
    end
    table.sort(got)
    assert.same({
      "L.attn_norms.weight bf16 [256]",
      "L.attn_query.query f32 [256]",
      "L.attn_sconv.weight bf16 [256,1,4]",
      "L.mlp.experts.down_projs bf16 [16,128,256]",
      "L.mlp.experts.gate_and_up_projs bf16 [16,256,256]",
      "L.mlp.gate.e_score_correction_bias f32 [16]",
      "L.mlp.gate.weight f32 [16,256]",
      "L.mlp.shared_experts.down_proj.weight bf16 [256,128]",
      "L.mlp.shared_experts.gate_proj.weight bf16 [128,256]",
      "L.mlp.shared_experts.up_proj.weight bf16 [128,256]",
      "L.mlp_norm.weight bf16 [256]",
      "L.mlp_query.query f32 [256]",
      "L.mlp_sconv.weight bf16 [256,1,4]",
      "L.self_attn.k_l2_clip.scale bf16 [64]",
      "L.self_attn.k_sconv.weight bf16 [64,1,4]",
      "L.self_attn.q_l2_clip.scale f32 [256]",
      "L.self_attn.qkvr.weight bf16 [640,256]",
      "L.self_attn.rel_l2_clip.scale f32 [256]",
      "L.self_attn.relative_table bf16 [129,8]",
      "L.self_attn.v_sconv.weight bf16 [64,1,4]",
      "L.self_attn.value_norm.weight bf16 [32]",
      "L.self_attn.wo_ud.weight bf16 [256,256]",
      "lm_head.weight bf16 [1024,256]",
      "model.embed_tokens.weight bf16 [1024,256]",
      "model.norm.weight bf16 [256]",
      "model.output_query.query f32 [256]",
    }, got)
  end)

  it("has no attn_query on layer 0 and the module types of the convention", function()
    assert.is_nil(tree:get("model.layers.0.attn_query"))
    assert.is_not_nil(tree:get("model.layers.0.attn_norms"))
    local types = {
      ["model.layers.1.attn_query"] = "ResidualQuery", ["model.layers.1.mlp_query"] = "ResidualQuery",
      ["model.output_query"] = "ResidualQuery", ["model.layers.0.attn_norms"] = "RMSNorm",
      ["model.layers.0.attn_sconv"] = "ShortConv", ["model.layers.0.mlp_sconv"] = "ShortConv",
      ["model.layers.0.self_attn"] = "Inkling2Attention", ["model.layers.0.self_attn.qkvr"] = "Linear",
      ["model.layers.0.self_attn.k_sconv"] = "ShortConv", ["model.layers.0.self_attn.q_l2_clip"] = "L2Clip",
      ["model.layers.0.self_attn.k_l2_clip"] = "L2Clip", ["model.layers.0.self_attn.rel_l2_clip"] = "L2Clip",
      ["model.layers.0.self_attn.value_norm"] = "RMSNorm", ["model.layers.0.self_attn.wo_ud"] = "Linear",
      ["model.layers.0.mlp_norm"] = "RMSNorm", ["model.layers.0.mlp"] = "MoE",
      ["model.layers.0.mlp.gate"] = "Gate", ["model.layers.0.mlp.experts"] = "GroupedExperts",
      ["model.layers.0.mlp.shared_experts"] = "MLP", ["model.norm"] = "RMSNorm",
      ["model.layers"] = "ModuleList", [""] = "Inkling2ForCausalLM",
    }
    for name, ty in pairs(types) do assert.equal(ty, tree:get(name).type, name) end
    assert.same({ "embed_tokens", "layers", "norm", "output_query" }, tree:get("model").child_order)
    assert.equal(16, tree:get("model.layers.3.mlp").attrs.n_experts)
  end)

  it("keeps the router's correction bias as an f32 buffer, as transformers' Inkling2 router does", function()
    assert.is_nil(params_of(tree)["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert.equal("f32", tree:get("model.layers.1.mlp.gate").buffers.e_score_correction_bias.dtype)
    assert.is_true(params_of(tree)["model.layers.1.mlp.gate.weight"].requires_grad)
  end)

  it("stores in torch_dtype all but the FP32 parameters", function()
    local cfg = load_config("inkling2_small.json")
    cfg.torch_dtype = "float16"
    local p = params_of(models.from_config(cfg))
    assert.equal("f16", p["model.layers.2.self_attn.k_l2_clip.scale"].dtype)
    assert.equal("f32", p["model.layers.2.self_attn.rel_l2_clip.scale"].dtype)
    assert.equal("f16", p["lm_head.weight"].dtype)
    -- transformers 5 reads dtype before torch_dtype, and builds f32 when there is neither
    cfg.dtype = "bfloat16"
    assert.equal("bf16", params_of(models.from_config(cfg))["lm_head.weight"].dtype)
    cfg.dtype = json.null
    assert.equal("f16", params_of(models.from_config(cfg))["lm_head.weight"].dtype)
    cfg.torch_dtype, cfg.dtype = nil, nil
    assert.equal("f32", params_of(models.from_config(cfg))["lm_head.weight"].dtype)
  end)

  it("builds a tied head when the config asks, and records it", function()
    local cfg = load_config("inkling2_small.json")
    cfg.tie_word_embeddings = true
    local tied = models.from_config(cfg)
    assert.is_true(tied.attrs.tie_word_embeddings)
    assert.equal(8164000 - 1024 * 256, tied:param_count())
  end)

  it("builds the realistic example config", function()
    local t = models.from_config(CONFIGS .. "inkling2_16b.json")
    assert.equal(16939339712, t:param_count()) -- 28 x 64 correction biases are buffers
    assert.same({ 64, 2048, 2 * 1408 }, t:get("model.layers.27.mlp.experts").params.gate_and_up_projs.shape)
    assert.same({ 2 * 1408, 2048 }, t:get("model.layers.27.mlp.shared_experts.up_proj").params.weight.shape)
  end)
end)

describe("the dense builders of transformers 5's Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3", function()
  -- a decoder's count: embed + layers * (attention + 3 * H * I MLP + norms) + final norm + head
  local function count(V, H, L, I, heads, kv, hd, o)
    local attn = H * heads * hd + 2 * H * kv * hd + heads * hd * H
    attn = attn + (o.qkv_bias and (heads + 2 * kv) * hd or 0) + (o.qk_norm and 2 * hd or 0)
    return V * H + L * (attn + 3 * H * I + o.norms * H) + H + (o.tied and 0 or V * H)
  end

  it("count the published sizes of Qwen2.5-7B, Qwen3-8B, Mistral-7B-v0.3, gemma-2-9b and gemma-3-1b", function()
    local cases = {
      { "qwen2.5_7b.json", 7615616512, count(152064, 3584, 28, 18944, 28, 4, 128, { qkv_bias = true, norms = 2 }) },
      { "qwen3_8b.json", 8190735360, count(151936, 4096, 36, 12288, 32, 8, 128, { qk_norm = true, norms = 2 }) },
      { "mistral_7b_v0.3.json", 7248023552, count(32768, 4096, 32, 14336, 32, 8, 128, { norms = 2 }) },
      { "gemma2_9b.json", 9241705984, count(256000, 3584, 42, 14336, 16, 8, 256, { norms = 4, tied = true }) },
      { "gemma3_1b.json", 999885952, count(262144, 1152, 26, 6912, 4, 1, 256, { qk_norm = true, norms = 4, tied = true }) },
    }
    for _, c in ipairs(cases) do
      assert.equal(c[2], c[3], c[1])
      assert.equal(c[2], models.from_config(CONFIGS .. c[1]):param_count(), c[1])
    end
  end)

  it("store what the config says: gemma-2-9b in f32 (torch_dtype), its head tied by default", function()
    local g = models.from_config(CONFIGS .. "gemma2_9b.json")
    assert.equal("f32", g:get("model.norm").params.weight.dtype)
    assert.equal(g:get("model.embed_tokens").params.weight, g:get("lm_head").params.weight)
    local p = params_of(g)
    assert.same({ 3584 }, p["model.layers.41.pre_feedforward_layernorm.weight"].shape)
    assert.same({ 3584 }, p["model.layers.41.post_feedforward_layernorm.weight"].shape)
    local cfg = load_config("gemma3_1b.json")
    cfg.tie_word_embeddings, cfg.dtype = false, "float32"
    local t = models.from_config(cfg)
    assert.is_false(t.attrs.tie_word_embeddings)
    assert.equal("f32", t:get("lm_head").params.weight.dtype)
    assert.same({ 256 }, params_of(t)["model.layers.0.self_attn.k_norm.weight"].shape)
    -- Qwen2's biases are on q, k and v only
    local q = params_of(models.from_config(CONFIGS .. "qwen2.5_7b.json"))
    assert.same({ 512 }, q["model.layers.0.self_attn.k_proj.bias"].shape)
    assert.is_nil(q["model.layers.0.self_attn.o_proj.bias"])
  end)

  it("refuse a multimodal Gemma 3 config (text_config) by what to give instead", function()
    local cfg = load_config("gemma3_1b.json")
    cfg.text_config = { hidden_size = 1152 }
    assert.matches("Gemma3ForCausalLM: config key 'text_config' is there: this builds the text model only; give a " ..
      "config of text_config's keys with model_type gemma3_text", build_error(cfg), 1, true)
  end)
end)

describe("models.from_config errors", function()
  it("names an unknown architecture, the config, the builders there are and --safetensors", function()
    local err = build_error({ architectures = { "GPT2LMHeadModel" } }, "gpt2/config.json")
    assert.equal("moonshard: models: gpt2/config.json: unknown architecture 'GPT2LMHeadModel' " ..
      "(known: DeepseekV3ForCausalLM, DeepseekV4ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Inkling2ForCausalLM, " ..
      "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, " ..
      "Qwen3MoeForCausalLM); plan from the checkpoint instead: --safetensors FILE|INDEX|DIR takes the names, " ..
      "shapes and dtypes from its safetensors headers", err)
    -- the multimodal Gemma 3 is another architecture; its text model is Gemma3ForCausalLM
    assert.matches("unknown architecture 'Gemma3ForConditionalGeneration' (known: ",
      build_error({ architectures = { "Gemma3ForConditionalGeneration" } }), 1, true)
    assert.matches("^moonshard: models: config table: config key 'architectures' is missing",
      build_error({ hidden_size = 4 }))
  end)

  it("names a missing or malformed key, the architecture and the config file", function()
    local cfg = load_config("llama3.1_8b.json")
    cfg.hidden_size = nil
    assert.equal("moonshard: models: my.json: LlamaForCausalLM: config key 'hidden_size' is missing",
      build_error(cfg, "my.json"))
    cfg = load_config("inkling2_small.json")
    cfg.short_conv_kernel = nil
    assert.matches("Inkling2ForCausalLM: config key 'short_conv_kernel' is missing", build_error(cfg))
    cfg = load_config("deepseek_v3.json")
    cfg.q_lora_rank = nil
    assert.matches("DeepseekV3ForCausalLM: config key 'q_lora_rank' is missing %(null if unused%)", build_error(cfg))
    -- grouped-query attention: the query heads split into whole groups per key/value head
    for _, name in ipairs { "llama3.1_8b.json", "inkling2_small.json", "qwen3_30b_a3b.json" } do
      cfg = load_config(name)
      cfg.num_key_value_heads = math.floor(cfg.num_attention_heads / 2) + 1 -- 17 of 32, 5 of 8
      assert.matches(("num_attention_heads %d is not a multiple of num_key_value_heads %d (each key/value head " ..
        "serves a whole group of query heads)"):format(cfg.num_attention_heads, cfg.num_key_value_heads),
        build_error(cfg), 1, true)
    end
    cfg = load_config("mixtral_8x7b.json")
    cfg.num_local_experts = 2.5
    assert.matches("config key 'num_local_experts' is 2.5; expected an integer in 1..1073741824", build_error(cfg))
    -- sizes no builder product can wrap, layers a tree can hold, parameters the planner counts
    cfg = load_config("llama3.1_8b.json")
    cfg.hidden_size = 2 ^ 40
    assert.matches("config key 'hidden_size' is 1099511627776; expected an integer in 1..1073741824",
      build_error(cfg))
    cfg = load_config("llama3.1_8b.json")
    cfg.num_hidden_layers = 1000000000
    assert.matches("config key 'num_hidden_layers' is 1000000000; expected an integer in 1..1024", build_error(cfg))
    cfg.num_hidden_layers = 1025
    assert.matches("config key 'num_hidden_layers' is 1025; expected an integer in 1..1024", build_error(cfg))
    cfg = load_config("llama3.1_8b.json")
    cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 2 ^ 30, 2 ^ 30, 1, 1
    assert.equal("moonshard: models: big.json: LlamaForCausalLM: parameter model.embed_tokens.weight of shape " ..
      "[1073741824, 1073741824] has more than 2^53 elements", build_error(cfg, "big.json"))
    cfg = load_config("mixtral_8x7b.json")
    cfg.torch_dtype = "int8"
    assert.matches("config key 'torch_dtype' is \"int8\"; expected one of bfloat16, float16, float32, float64",
      build_error(cfg))
    cfg.dtype = "float8"
    assert.matches("config key 'dtype' is \"float8\"; expected one of bfloat16", build_error(cfg))
  end)

  it("keeps messages short whatever a config holds: values shown in at most 80 bytes, control bytes escaped", function()
    local cfg = load_config("llama3.1_8b.json")
    cfg.hidden_size = string.rep("x", 100000)
    assert.equal("moonshard: models: big.json: LlamaForCausalLM: config key 'hidden_size' is \"" ..
      string.rep("x", 79) .. "... (100002 bytes); expected an integer in 1..1073741824", build_error(cfg, "big.json"))
    cfg = load_config("llama3.1_8b.json")
    cfg.architectures = json.array({ "a\0b" })
    assert.matches("unknown architecture 'a\\x00b' (known: ", build_error(cfg, "c.json"), 1, true)
  end)

  it("names the file it cannot read or parse", function()
    assert.matches("^moonshard: models: nonexistent/config.json: cannot open the config",
      build_error("nonexistent/config.json"))
    assert.equal("moonshard: models: examples: cannot read the config: is a directory, not a regular file",
      build_error("examples"))
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write('{"architectures": ["LlamaForCausalLM"],}')
    f:close()
    local err = build_error(path)
    os.remove(path)
    assert.matches("^moonshard: json: " .. path:gsub("%p", "%%%0") .. ":1:40: trailing comma in object", err)
  end)
end)
