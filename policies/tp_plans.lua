-- tp_plans.lua: NeMo Automodel's tensor-parallel plans, for ctx:tensor_parallel.
--
-- Each plan maps module patterns to PyTorch ParallelStyles (components/distributed/
-- optimized_tp_plans.py and parallelizer.py's default base plan), with and without sequence
-- parallel.  M.for_model picks one as Automodel's _get_parallel_plan does.  Copy a plan into
-- your policy to change it: they are plain tables.

local M = {}

local R, S1, SM1 = "Replicate()", "Shard(1)", "Shard(-1)"
local L = "model.layers.*."

-- Adds the entries of `over` to `base` (Python's dict.update).
local function update(base, over)
  for k, v in pairs(over) do base[k] = v end
  return base
end

-- The projections every plan below shards the same way.
local function projections(p, attention, mlp)
  local plan = {}
  for _, name in ipairs(attention) do plan[p .. "self_attn." .. name] = "colwise" end
  plan[p .. "self_attn.o_proj"] = "rowwise"
  for _, name in ipairs(mlp) do plan[p .. "mlp." .. name] = "colwise" end
  plan[p .. "mlp.down_proj"] = "rowwise"
  return plan
end

-- The sequence-parallel entries the Llama and Qwen plans share: norms that all-gather their
-- sequence-sharded output, projections that reduce-scatter theirs, the head that reads a
-- sequence-sharded input.
local function sequence_parallel(p)
  return {
    ["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R, output_layouts = S1,
      use_local_output = false },
    ["model.norm"] = "sequence_parallel",
    [p .. "input_layernorm"] = { "sequence_parallel_all_gather", use_local_output = false },
    [p .. "self_attn.o_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
    [p .. "post_attention_layernorm"] = { "sequence_parallel_all_gather", use_local_output = false },
    [p .. "mlp.down_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
    ["lm_head"] = { "colwise", input_layouts = S1, output_layouts = SM1, use_local_output = false },
  }
end

--- _parallelize_llama: Llama (and Automodel's own Llama).
function M.llama(sp)
  local plan = projections(L, { "q_proj", "k_proj", "v_proj", "qkv_proj" }, { "gate_up_proj", "up_proj", "gate_proj" })
  plan["model.embed_tokens"] = { "rowwise", input_layouts = R }
  plan["lm_head"] = { "colwise", output_layouts = SM1, use_local_output = false }
  if sp then update(plan, sequence_parallel(L)) end
  return plan
end

--- _parallelize_qwen: Qwen2 and Qwen3 (q_norm and k_norm stay out of the plan, replicated).
function M.qwen(sp)
  local plan = projections(L, { "q_proj", "k_proj", "v_proj", "qkv_proj" }, { "up_proj", "gate_proj", "gate_up_proj" })
  plan["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R }
  plan["lm_head"] = { "colwise", output_layouts = SM1, use_local_output = false }
  if sp then
    update(plan, sequence_parallel(L))
    plan[L .. "input_layernorm"] = "sequence_parallel_all_gather"
    plan[L .. "post_attention_layernorm"] = "sequence_parallel_all_gather"
  end
  return plan
end

--- _parallelize_gemma3: Gemma3ForCausalLM (prefix "model"); its sequence-parallel norms are
-- plain SequenceParallel, so each projection gathers its own input.
function M.gemma3(sp)
  local p = "model.layers.*."
  local plan = projections(p, { "q_proj", "k_proj", "v_proj" }, { "up_proj", "gate_proj" })
  plan["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R }
  plan["lm_head"] = { "colwise", output_layouts = SM1, use_local_output = false }
  if sp then
    update(plan, {
      ["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R, output_layouts = S1,
        use_local_output = false },
      ["model.rotary_emb"] = { "rotary_embed_parallel", use_local_output = true },
      ["model.rotary_emb_local"] = { "rotary_embed_parallel", use_local_output = true },
      [p .. "input_layernorm"] = "sequence_parallel",
      [p .. "self_attn.o_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
      [p .. "post_attention_layernorm"] = "sequence_parallel",
      [p .. "pre_feedforward_layernorm"] = "sequence_parallel",
      [p .. "mlp.down_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
      [p .. "post_feedforward_layernorm"] = "sequence_parallel",
      ["model.norm"] = "sequence_parallel",
      ["lm_head"] = { "colwise", input_layouts = S1, output_layouts = SM1, use_local_output = false },
    })
  end
  return plan
end

--- The default base plan (parallelizer.py, _get_parallel_plan's fallback): every model with
-- no plan of its own; the head's logits come out replicated.
function M.default(sp)
  local plan = projections(L, { "q_proj", "k_proj", "v_proj", "qkv_proj" }, { "gate_up_proj", "up_proj", "gate_proj" })
  plan["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R }
  plan["lm_head"] = { "colwise", output_layouts = R }
  if sp then
    update(plan, {
      ["model.embed_tokens"] = { "vocab_parallel_embedding", input_layouts = R, output_layouts = S1,
        use_local_output = false },
      ["model.norm"] = "sequence_parallel",
      [L .. "input_layernorm"] = "sequence_parallel",
      [L .. "post_attention_layernorm"] = "sequence_parallel",
      [L .. "self_attn.o_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
      [L .. "mlp.down_proj"] = { "rowwise", output_layouts = S1, use_local_output = false },
      ["lm_head"] = { "colwise", input_layouts = S1, output_layouts = R },
    })
  end
  return plan
end

--- The inkling2-like MoE model of examples/moe_trainer (no attention; per layer a residual
-- query, RMSNorm, a causal short conv, a router, routed and shared experts).  moe_trainer's
-- kernels implement exactly this plan (examples/moe_trainer/README.md, "Tensor parallelism"):
-- the shared experts Megatron-style (gate_proj and up_proj colwise, down_proj rowwise: one
-- all-reduce of the output per layer), lm_head colwise with its logits all-gathered
-- (Replicate()) before the cross-entropy.  The routed experts, the router and the conv stay
-- replicated over tp.  With sequence parallel the residual stream is Shard(1): the
-- embedding, the queries, the router and the routed experts work on each rank's positions
-- (SequenceParallel: parameters replicated, their gradients partial sums over tp that the
-- host all-reduces), the norms all-gather their output (the conv mixes positions and the
-- colwise projections read every position), down_proj reduce-scatters its output back onto
-- the sequence.
function M.inkling2(sp)
  local plan = {
    [L .. "mlp.shared_experts.gate_proj"] = "colwise",
    [L .. "mlp.shared_experts.up_proj"] = "colwise",
    [L .. "mlp.shared_experts.down_proj"] = "rowwise",
    ["lm_head"] = { "colwise", output_layouts = R },
  }
  if sp then
    update(plan, {
      ["model.embed_tokens"] = { "sequence_parallel", output_layouts = S1 },
      [L .. "mlp_query"] = "sequence_parallel",
      [L .. "mlp_norm"] = { "sequence_parallel_all_gather", output_layouts = R },
      [L .. "mlp_sconv"] = { "sequence_parallel", input_layouts = R },
      [L .. "mlp.gate"] = "sequence_parallel",
      [L .. "mlp.experts"] = "sequence_parallel",
      [L .. "mlp.shared_experts.down_proj"] = { "rowwise", output_layouts = S1 },
      ["model.output_query"] = "sequence_parallel",
      ["model.norm"] = { "sequence_parallel_all_gather", output_layouts = R },
      ["lm_head"] = { "colwise", input_layouts = R, output_layouts = R },
    })
  end
  return plan
end

-- _get_parallel_plan's table (PARALLELIZE_FUNCTIONS) for the architectures moonshard builds;
-- the others (Mistral, Gemma, Gemma 2, Mixtral) take the default base plan, as transformers
-- 5's own plans use style names Automodel's translator refuses.
M.BY_ARCHITECTURE = { LlamaForCausalLM = "llama", Qwen2ForCausalLM = "qwen", Qwen3ForCausalLM = "qwen",
  Gemma3ForCausalLM = "gemma3" }
M.NAMES = { "llama", "qwen", "gemma3", "default" }

--- The plan for `model` (its root's type is the architecture): name "auto" (or nil) as
-- Automodel picks it, else one of M.NAMES.  Returns the plan and its name.
function M.for_model(model, name, sp)
  if name == nil or name == "auto" then name = M.BY_ARCHITECTURE[model.type] or "default" end
  if not M[name] or name == "for_model" then
    error(string.format("tp_plan '%s': expected auto or one of %s", tostring(name), table.concat(M.NAMES, ", ")), 0)
  end
  return M[name](sp), name
end

return M
