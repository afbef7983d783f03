-- moonshard.recipe: NeMo Automodel's infrastructure steps, applied to a model tree in its order.
--
-- A recipe is a Lua file returning a table of Automodel's config sections, with its field
-- names (the YAML recipes' `distributed:`, `peft:`, `quantization:`, `fp8:`, `qat:`, ...):
--
--   return {
--     distributed = { strategy = "fsdp2", tp_size = 1, activation_checkpointing = true },
--     peft = { target_modules = "*_proj", dim = 16, alpha = 32 },
--     quantization = { load_in_4bit = true, bnb_4bit_use_double_quant = true },
--   }
--
-- apply() makes a copy of the model and runs the steps on it in the order Automodel's
-- apply_model_infrastructure runs them (nemo_automodel/_transformers/infrastructure.py):
--
--   1. quantization  the checkpoint loads quantized (transformers' BitsAndBytesConfig, in
--                    from_pretrained, before anything else): every Linear but the output
--                    head stores a 4-bit NF4 weight, packed two codes a byte in the storage
--                    dtype, beside its block absmax (transformers integrations/bitsandbytes.py)
--   2. peft          LoRA (_peft/lora.py apply_lora_to_linear_modules): matched Linear
--                    modules gain lora_A [dim, in] and lora_B [out, dim]; matched
--                    GroupedExperts gain lora_gate_and_up_A/B and lora_down_A/B
--                    (_peft/lora_experts.py); after sharding every parameter whose name has
--                    no "lora_" is frozen (infrastructure.py), so the plan freezes them
--   3. fp8           torchao's convert_to_float8_training (quantization/fp8.py
--                    apply_fp8_to_model): Linear modules whose weight dims divide by 16 and
--                    whose name holds none of filter_fqns; with enable_fsdp_float8_all_gather
--                    (tensorwise) their weights are gathered as e4m3 bytes
--   4. qat           torchao's QAT quantizers (quantization/qat.py): refused unless every
--                    parameter is bf16; Linear modules whose in_features suit the group size
--                    run fake-quantized
--   5. shard         the policy (the manager's shipped policy unless one is given): FSDP2,
--                    DDP or Megatron-FSDP, pipeline or EP + FSDP
--
-- Every step records the modules it changed; the plan shows them (plan_report).  The file is
-- untrusted: it loads in the policy sandbox (moonshard.policy, with its budget and memory
-- cap), its tables are read raw (no metamethod of theirs runs), and fp8.module_filter, the
-- one function a recipe may hand back, runs under the same budget on every call.

local util = require "moonshard.util"
local module = require "moonshard.module"

local R = {}

local function fail(where, msg) error("moonshard: recipe " .. where .. ": " .. msg, 0) end

local function shown(v)
  local t = type(v)
  if t == "string" then return "'" .. util.short_name(v, 60) .. "'" end
  if t == "number" and v ~= v then return "nan" end
  if t == "number" or t == "boolean" then return tostring(v) end
  return "a " .. t
end

-- ---------------------------------------------------------------- the sections

-- Automodel's dtype spellings (torch names, and its short ones) -> moonshard's.
local DTYPES = { bfloat16 = "bf16", bf16 = "bf16", float16 = "f16", half = "f16", fp16 = "f16", f16 = "f16",
  float32 = "f32", float = "f32", fp32 = "f32", f32 = "f32" }
R.DTYPES = DTYPES

-- kinds: what a field's value may be, and what the error says was expected
local EXPECT = {
  boolean = "true or false",
  string = "a string",
  dtype = "a dtype (bfloat16, float16 or float32; bf16, f16, f32)",
  storage = "a storage dtype (uint8, bfloat16, float16 or float32)",
  size = "a whole number >= 1",
  dp = "a whole number >= 1 or \"none\"",
  count = "a whole number >= 0",
  positive = "a whole number >= 1",
  number = "a number >= 0",
  names = "a string or a list of strings",
  ac = "true, false, \"full\", \"every:K\" or a list of layer positions",
  ["function"] = "a function(fqn, info) returning true or false",
  table = "a table of fields",
  any = "a value",
}

-- Each section: field -> spec.  spec.kind checks the value; spec.opt names the policy
-- option it sets; spec.mesh the mesh axis it sizes; spec.note says why it changes no plan
-- (a runtime switch); spec.refuse says why moonshard does not plan it; spec.default is
-- Automodel's default (a field at its default that the policy has no option for is fine).
local SECTIONS = {
  distributed = {
    doc = "Automodel's distributed section (DistributedSetup and the FSDP2Config, DDPConfig or " ..
      "MegatronFSDPConfig of its strategy)",
    fields = {
      strategy = { kind = "string", values = { "fsdp2", "megatron_fsdp", "ddp" } },
      manager = { kind = "string", values = { "fsdp2", "megatron_fsdp", "ddp" } },
      dp_size = { kind = "dp", mesh = "dp_shard" },
      dp_replicate_size = { kind = "dp", mesh = "dp_replicate" },
      tp_size = { kind = "size", mesh = "tp" },
      cp_size = { kind = "size", mesh = "cp" },
      pp_size = { kind = "size", mesh = "pp" },
      ep_size = { kind = "size", mesh = "ep" },
      sequence_parallel = { kind = "boolean", opt = "sequence_parallel", default = false },
      activation_checkpointing = { kind = "ac", opt = "activation_checkpointing", default = false },
      activation_checkpointing_scope = { kind = "any", default = "all",
        refuse = "only \"all\" (every decoder layer) is planned" },
      reshard_after_forward = { kind = "any", opt = "reshard_after_forward" },
      enable_fsdp2_prefetch = { kind = "boolean", opt = "prefetch.explicit", default = false },
      fsdp2_forward_prefetch_depth = { kind = "count", opt = "prefetch.forward", default = 1 },
      fsdp2_backward_prefetch_depth = { kind = "count", opt = "prefetch.backward", default = 2 },
      offload_policy = { kind = "string", opt = "offload_policy" },
      tp_plan = { kind = "string", opt = "tp_plan" },
      mp_policy = { kind = "any", refuse = "the policy sets mixed precision: edit or pick the policy" },
      -- DDPConfig
      bucket_cap_mb = { kind = "number", opt = "bucket_cap_mb" },
      find_unused_parameters = { kind = "boolean", opt = "find_unused_parameters", default = false },
      gradient_as_bucket_view = { kind = "boolean", opt = "gradient_as_bucket_view", default = false },
      static_graph = { kind = "boolean", opt = "static_graph", default = false },
      broadcast_buffers = { kind = "boolean", opt = "broadcast_buffers", default = false },
      -- MegatronFSDPConfig
      zero_dp_strategy = { kind = "any", opt = "zero_dp_strategy" },
      megatron_fsdp_unit_modules = { kind = "names", opt = "megatron_fsdp_unit_modules" },
      grad_reduce_in_fp32 = { kind = "boolean", opt = "grad_reduce_in_fp32", default = false },
      preserve_fp32_weights = { kind = "boolean", opt = "preserve_fp32_weights", default = false },
      disable_bucketing = { kind = "boolean", opt = "disable_bucketing", default = false },
      fsdp_double_buffer = { kind = "boolean", opt = "fsdp_double_buffer", default = false },
      overlap_grad_reduce = { kind = "boolean", opt = "overlap_grad_reduce", default = true },
      overlap_param_gather = { kind = "boolean", opt = "overlap_param_gather", default = true },
      average_in_collective = { kind = "boolean", note = "where the mean's division happens, not what moves" },
      init_fsdp_with_meta_device = { kind = "boolean", note = "how parameters are initialised" },
      check_for_nan_in_grad = { kind = "boolean", note = "a runtime check" },
      report_nan_in_param_grad = { kind = "boolean", note = "a runtime check" },
      calculate_per_token_loss = { kind = "boolean", note = "how the loss is averaged" },
      keep_fp8_transpose_cache = { kind = "boolean", note = "Transformer Engine's cache, outside the plan" },
      nccl_ub = { kind = "boolean", note = "NCCL user buffers: where, not how much" },
      -- runtime switches of every strategy
      defer_fsdp_grad_sync = { kind = "boolean", note = "gradient sync across micro-batches is counted per step" },
      enable_async_tensor_parallel = { kind = "boolean", note = "overlap only" },
      enable_compile = { kind = "boolean", note = "compilation" },
      patch_is_packed_sequence = { kind = "boolean", note = "packed sequences" },
      autocast_dtype = { kind = "any", note = "autocast of the forward (the plan's compute dtype is the policy's)" },
      timeout_minutes = { kind = "number", note = "the process group's timeout" },
      _target_ = { kind = "string", note = "a Python class path" },
      -- Automodel's YAML nests these two sections in distributed
      pipeline = { kind = "table", nested = true },
      moe = { kind = "table", nested = true },
    },
  },
  pipeline = {
    doc = "Automodel's PipelineConfig",
    fields = {
      pp_schedule = { kind = "string", opt = "pipeline.schedule" },
      layers_per_stage = { kind = "positive", opt = "pipeline.layers_per_stage" },
      round_virtual_stages_to_pp_multiple = { kind = "string", opt = "pipeline.round" },
      pp_schedule_csv = { kind = "string", refuse = "a schedule from a CSV file is not planned" },
      module_fqns_per_model_part = { kind = "any", refuse = "explicit stage module lists are not planned; " ..
        "set layers_per_stage or the policy's pipeline.split" },
      pp_microbatch_size = { kind = "positive", note = "the batch is given with --seq-len/--micro-batch" },
      pp_batch_size = { kind = "positive", note = "the batch is given with --seq-len/--global-batch" },
      patch_inner_model = { kind = "boolean", note = "a forward patch" },
      patch_causal_lm_model = { kind = "boolean", note = "a forward patch" },
      patch_stage_backward_maybe_with_nosync = { kind = "boolean", note = "a backward patch" },
      dtype = { kind = "any", note = "the stages' activation dtype" },
      scale_grads_in_schedule = { kind = "boolean", note = "where gradients are scaled" },
      loss_fn = { kind = "any", note = "the loss" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
  moe = {
    doc = "Automodel's MoEParallelizerConfig",
    fields = {
      ignore_router_for_ac = { kind = "boolean", note = "the router's outputs are saved, not recomputed" },
      reshard_after_forward = { kind = "boolean", opt = "reshard_after_forward", default = false },
      lm_head_precision = { kind = "dtype", opt = "lm_head_precision" },
      wrap_outer_model = { kind = "boolean", opt = "wrap_outer_model", default = true },
      mp_policy = { kind = "any", refuse = "the policy sets mixed precision: edit or pick the policy" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
  peft = {
    doc = "Automodel's PeftConfig (_peft/lora.py)",
    fields = {
      target_modules = { kind = "names" },
      exclude_modules = { kind = "names" },
      match_all_linear = { kind = "boolean" },
      dim = { kind = "positive" },
      alpha = { kind = "number" },
      dropout = { kind = "number", note = "dropout keeps no parameter" },
      dropout_position = { kind = "string", values = { "pre", "post" }, note = "dropout keeps no parameter" },
      lora_A_init = { kind = "string", values = { "xavier", "uniform" }, note = "initial values" },
      lora_dtype = { kind = "dtype" },
      use_dora = { kind = "boolean", default = false, refuse = "DoRA is not planned" },
      use_memory_efficient_lora = { kind = "boolean", note = "a fused kernel" },
      use_triton = { kind = "boolean", note = "a kernel choice" },
      moe_rank_scaling = { kind = "boolean" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
  quantization = {
    doc = "Automodel's quantization section (transformers' BitsAndBytesConfig, quantization/qlora.py)",
    fields = {
      load_in_4bit = { kind = "boolean" },
      load_in_8bit = { kind = "boolean", default = false, refuse = "8-bit (LLM.int8) weights are not planned" },
      bnb_4bit_compute_dtype = { kind = "dtype" },
      bnb_4bit_use_double_quant = { kind = "boolean" },
      bnb_4bit_quant_type = { kind = "string", values = { "nf4", "fp4" } },
      bnb_4bit_quant_storage = { kind = "storage" },
      llm_int8_skip_modules = { kind = "names" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
  fp8 = {
    doc = "Automodel's FP8Config (quantization/fp8.py)",
    fields = {
      enabled = { kind = "boolean" },
      recipe_name = { kind = "string", values = { "tensorwise", "rowwise", "rowwise_with_gw_hp" } },
      enable_fsdp_float8_all_gather = { kind = "boolean" },
      precompute_float8_dynamic_scale_for_fsdp = { kind = "boolean" },
      force_recompute_fp8_weight_in_bwd = { kind = "boolean", note = "recomputation in backward" },
      filter_fqns = { kind = "names" },
      emulate = { kind = "boolean", note = "emulated fp8 matmuls" },
      module_filter = { kind = "function" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
  qat = {
    doc = "Automodel's qat section (quantization/qat.py QATConfig, with its qat_config nested or flat)",
    fields = {
      enabled = { kind = "boolean" },
      fake_quant_after_n_steps = { kind = "count", note = "when fake quantisation starts" },
      quantizer_type = { kind = "string", values = { "int8_dynact_int4weight", "int4_weight_only" } },
      groupsize = { kind = "positive" },
      padding_allowed = { kind = "boolean" },
      inner_k_tiles = { kind = "positive" },
      precision = { kind = "dtype", note = "the fake-quantised linear's compute dtype" },
      scales_precision = { kind = "dtype", note = "the scales' dtype" },
      qat_config = { kind = "table" },
      _target_ = { kind = "string", note = "a Python class path" },
    },
  },
}
R.SECTIONS = SECTIONS
-- activation_checkpointing is a section of its own too (DistributedSetup's field)
R.SECTION_ORDER = { "distributed", "pipeline", "moe", "peft", "quantization", "fp8", "qat", "activation_checkpointing" }

-- ---------------------------------------------------------------- checking

local function raw_list(v, where)
  -- a list read raw: 1..n, nothing else
  local out, n = {}, 0
  for k in next, v do
    n = n + 1
    if type(k) ~= "number" or k ~= math.floor(k) or k < 1 then return nil end
  end
  for i = 1, n do
    local x = rawget(v, i)
    if x == nil then return nil end
    out[i] = x
  end
  if n > 100000 then fail(where, "a list of more than 100000 entries") end
  return out
end

local function valid(kind, v, where)
  if kind == "any" then return v end
  if kind == "boolean" then
    if type(v) == "boolean" then return v, true end
    return nil
  end
  if kind == "string" then return type(v) == "string" and #v <= 1000 and v or nil end
  -- Automodel's dtype_from_str takes "torch.bfloat16" too
  if kind == "dtype" then return type(v) == "string" and DTYPES[(v:lower():gsub("^torch%.", ""))] or nil end
  if kind == "storage" then
    if type(v) ~= "string" then return nil end
    local l = v:lower():gsub("^torch%.", "")
    return (l == "uint8" or l == "u8") and "u8" or DTYPES[l]
  end
  if kind == "function" then return type(v) == "function" and v or nil end
  if kind == "table" then return type(v) == "table" and v or nil end
  if kind == "names" then
    if type(v) == "string" then return { v } end
    if type(v) ~= "table" then return nil end
    local l = raw_list(v, where)
    if not l then return nil end
    for i, s in ipairs(l) do
      if type(s) ~= "string" or #s > 1000 then
        fail(where, string.format("[%d] is %s; expected a string (of at most 1000 bytes)", i, shown(s)))
      end
    end
    if #l > 1000 then fail(where, string.format("has %d entries; at most 1000", #l)) end
    return l
  end
  if kind == "ac" then
    if type(v) == "boolean" then return v, true end
    -- Automodel's ActivationCheckpointingMode: "full" is true; "selective" is not planned
    if v == "full" then return true end
    if v == "selective" then
      fail(where, "is 'selective': selective activation checkpointing (some ops of a layer) is not planned; give " ..
        "true or \"full\" (whole layers), \"every:K\" or a list of layer positions")
    end
    if type(v) == "string" and v:match("^every:%d+$") then return v end
    if type(v) == "table" then
      local l = raw_list(v, where)
      if not l then return nil end
      for _, x in ipairs(l) do if not util.is_int(x) or x < 0 then return nil end end
      return l
    end
    return nil
  end
  if kind == "dp" and v == "none" then return "none" end
  if type(v) ~= "number" or v ~= v or v == math.huge then return nil end
  if kind == "number" then return v >= 0 and v or nil end
  if not util.is_int(v) then return nil end
  if kind == "count" then return v >= 0 and v or nil end
  if v < 1 or v > 2 ^ 31 then return nil end
  return v -- size, dp, positive
end

local function known_list(fields)
  local names = util.sorted_keys(fields)
  return table.concat(names, ", ")
end

-- A section's table checked: field -> value (normalised), and the notes of fields that
-- change no plan.
local function check_section(name, t, file)
  local sec = SECTIONS[name]
  local where = string.format("%s: %s", file, name)
  if type(t) ~= "table" then fail(where, "is " .. shown(t) .. "; expected " .. EXPECT.table) end
  local out, notes = {}, {}
  local n = 0
  for k, v in next, t do
    n = n + 1
    if n > 200 then fail(where, "has more than 200 fields") end
    local spec = type(k) == "string" and sec.fields[k]
    if not spec then
      fail(where, string.format("unknown field %s (%s's fields: %s)", shown(k), name, known_list(sec.fields)))
    end
    local val, ok = valid(spec.kind, v, where .. "." .. k)
    if val == nil and not ok then
      fail(where .. "." .. k, string.format("is %s; expected %s", shown(v), EXPECT[spec.kind]))
    end
    if spec.values and type(val) == "string" then
      local okv = false
      for _, x in ipairs(spec.values) do if x == val or (name == "pipeline" and x:lower() == val:lower()) then okv = true end end
      if not okv then
        fail(where .. "." .. k, string.format("is %s; expected one of %s", shown(v), table.concat(spec.values, ", ")))
      end
    end
    if spec.refuse and val ~= spec.default then fail(where .. "." .. k, string.format("is %s: %s", shown(v), spec.refuse)) end
    out[k] = val
    if spec.note then notes[#notes + 1] = string.format("%s.%s (%s)", name, k, spec.note) end
  end
  table.sort(notes)
  return out, notes
end

--- check(t, file) -> a recipe: the sections of t checked and normalised, with its file name,
-- the manager, the notes on fields that change no plan.  Errors name the file, the section
-- and the field, and list the known ones.
function R.check(t, file)
  file = file or "recipe"
  if type(t) ~= "table" then fail(file, "returned " .. shown(t) .. "; expected a table of sections") end
  local r = { file = file, notes = {} }
  local n = 0
  for k, v in next, t do
    n = n + 1
    if n > 64 then fail(file, "has more than 64 sections") end
    if k == "activation_checkpointing" then
      local val, ok = valid("ac", v, file)
      if val == nil and not ok then
        fail(file .. ": activation_checkpointing", string.format("is %s; expected %s", shown(v), EXPECT.ac))
      end
      r.activation_checkpointing = val
    elseif type(k) == "string" and SECTIONS[k] then
      local sec, notes = check_section(k, v, file)
      r[k] = sec
      for _, x in ipairs(notes) do r.notes[#r.notes + 1] = x end
      -- distributed.pipeline and distributed.moe (Automodel's YAML) are the sections
      for _, inner in ipairs({ "pipeline", "moe" }) do
        if k == "distributed" and sec[inner] ~= nil then
          local isec, inotes = check_section(inner, sec[inner], file .. ": distributed")
          sec[inner] = nil
          if r["distributed." .. inner] then fail(file, "distributed." .. inner .. " given twice") end
          r["distributed." .. inner] = isec
          for _, x in ipairs(inotes) do r.notes[#r.notes + 1] = "distributed." .. x end
        end
      end
    else
      fail(file, string.format("unknown section %s (sections: %s)", shown(k), table.concat(R.SECTION_ORDER, ", ")))
    end
  end
  for _, inner in ipairs({ "pipeline", "moe" }) do
    local nested = r["distributed." .. inner]
    if nested then
      if r[inner] then
        fail(file, string.format("%s is given twice, as a section and as distributed.%s", inner, inner))
      end
      r[inner], r["distributed." .. inner] = nested, nil
    end
  end
  table.sort(r.notes)
  local d = r.distributed or {}
  if d.strategy and d.manager and d.strategy ~= d.manager then
    fail(file .. ": distributed", string.format("strategy %s and manager %s disagree (they name the same thing; " ..
      "give one)", d.strategy, d.manager))
  end
  r.manager = d.manager or d.strategy or "fsdp2"
  local ac = r.activation_checkpointing
  if ac ~= nil and d.activation_checkpointing ~= nil then
    fail(file, "activation_checkpointing is given twice, as a section and as distributed.activation_checkpointing")
  end
  if r.qat and r.qat.qat_config then
    -- Automodel's YAML nests the quantizer's fields under qat_config
    local inner = check_section("qat", r.qat.qat_config, file .. ": qat.qat_config")
    inner.qat_config = nil
    for k, v in pairs(inner) do
      if r.qat[k] ~= nil and k ~= "qat_config" then
        fail(file .. ": qat." .. k, "is given both in qat and in qat.qat_config")
      end
      r.qat[k] = v
    end
    r.qat.qat_config = nil
  end
  local p = r.peft
  if p then
    local tm, em = p.target_modules or {}, p.exclude_modules or {}
    -- ModuleMatcher's __post_init__ (_peft/module_matcher.py)
    if #tm > 0 and #em > 0 then
      fail(file .. ": peft", "target_modules and exclude_modules are mutually exclusive (Automodel's " ..
        "ModuleMatcher); give one")
    end
    if p.match_all_linear and (#tm > 0 or #em > 0) then
      fail(file .. ": peft", "match_all_linear goes without target_modules and exclude_modules (Automodel's " ..
        "ModuleMatcher)")
    end
  end
  return r
end

--- load(path, limits?) -> a recipe: the file run in the policy sandbox (limits: instructions,
-- memory_mb, seconds, as for a policy), then checked (R.check).
function R.load(path, limits)
  if type(path) ~= "string" or path == "" then fail("", "expected a .lua file name") end
  local stat = util.file_stat_fn()
  if stat and stat(path) == "directory" then fail(path, "is a directory; expected a .lua file returning a table") end
  local t = require("moonshard.policy").load_data(path, "recipe", limits)
  return R.check(t, path)
end

-- ---------------------------------------------------------------- the mesh and the options

--- The mesh sizes the recipe's distributed section gives: axis -> size.  As Automodel's
-- mesh (distributed/mesh_utils.py): dp_size is the whole data-parallel size, replicate x
-- shard, so dp_shard = dp_size / dp_replicate_size (dp_shard nil when dp_size is none: the
-- world decides).
function R.mesh_sizes(r)
  local d = r.distributed or {}
  local out = {}
  for field, spec in pairs(SECTIONS.distributed.fields) do
    local v = d[field]
    if spec.mesh and spec.mesh ~= "dp_shard" and v ~= nil and v ~= "none" then out[spec.mesh] = v end
  end
  local rep = out.dp_replicate or 1
  if d.dp_size ~= nil and d.dp_size ~= "none" then
    if d.dp_size % rep ~= 0 then
      fail(r.file, string.format("distributed.dp_size = %d is not a multiple of dp_replicate_size = %d (Automodel: " ..
        "\"dp_size must be a multiple of dp_replicate_size\")", d.dp_size, rep))
    end
    if rep >= d.dp_size and rep ~= 1 then
      fail(r.file, string.format("distributed.dp_replicate_size = %d must be less than dp_size = %d (Automodel: " ..
        "\"DDP usecase is not supported by FSDP2\")", rep, d.dp_size))
    end
    out.dp_shard = util.idiv(d.dp_size, rep)
  end
  return out
end

--- Checks the recipe's sizes against a mesh (mesh:size(axis)); an error names each
-- disagreement.
function R.check_mesh(r, mesh)
  local d = r.distributed or {}
  local bad = {}
  for field, spec in pairs(SECTIONS.distributed.fields) do
    local v = d[field]
    if spec.mesh and spec.mesh ~= "dp_shard" and v ~= nil and v ~= "none" and mesh:size(spec.mesh) ~= v then
      bad[#bad + 1] = string.format("distributed.%s = %d but the mesh has %s = %d", field, v, spec.mesh,
        mesh:size(spec.mesh))
    end
  end
  local dp = mesh:size("dp_replicate") * mesh:size("dp_shard")
  if d.dp_size ~= nil and d.dp_size ~= "none" and d.dp_size ~= dp then
    bad[#bad + 1] = string.format("distributed.dp_size = %d but the mesh has dp_replicate x dp_shard = %d x %d = %d",
      d.dp_size, mesh:size("dp_replicate"), mesh:size("dp_shard"), dp)
  end
  table.sort(bad)
  if #bad > 0 then fail(r.file, table.concat(bad, "; ") .. " (give the mesh the recipe describes, or change it)") end
end

--- The shipped policy of each manager.
R.POLICIES = { fsdp2 = "fsdp2_default.lua", ddp = "ddp.lua", megatron_fsdp = "megatron_fsdp.lua" }

--- The policy options the recipe sets, given the policy's declared options (name -> decl):
-- name -> value.  ep: the mesh's ep size (moe.reshard_after_forward is the MoE path's).
-- A field for an option the policy does not declare is an error unless it holds
-- Automodel's default.
function R.policy_options(r, decl_list, policy_name, ep, pp)
  local out, from, decl, notes = {}, {}, {}, {}
  for _, e in ipairs(decl_list) do decl[e.name] = e end
  local function set(section, field, value)
    local spec = SECTIONS[section] and SECTIONS[section].fields[field]
    local opt = spec and spec.opt or field
    if not decl[opt] then
      if spec and spec.default ~= nil and value == spec.default then return end
      local names = util.sorted_keys(decl)
      fail(r.file, string.format("%s%s = %s sets the option %s, which the policy %s does not declare (its " ..
        "options: %s)", section ~= "" and section .. "." or "", field, shown(value), opt, policy_name or "",
        #names > 0 and table.concat(names, ", ") or "none"))
    end
    if spec and spec.kind == "names" and type(value) == "table" then value = table.concat(value, ",") end
    if from[opt] and out[opt] ~= value then
      fail(r.file, string.format("%s and %s both set the option %s, to different values", from[opt],
        (section ~= "" and section .. "." or "") .. field, opt))
    end
    out[opt], from[opt] = value, (section ~= "" and section .. "." or "") .. field
  end
  for _, section in ipairs({ "distributed", "pipeline", "moe" }) do
    local s = r[section]
    if s then
      for _, field in ipairs(util.sorted_keys(s)) do
        local spec = SECTIONS[section].fields[field]
        local skip = section == "moe" and field == "reshard_after_forward" and ep <= 1
          or section == "distributed" and field == "reshard_after_forward" and ep > 1 and r.moe
            and r.moe.reshard_after_forward ~= nil
        if skip then
          notes[#notes + 1] = section == "moe" and "moe.reshard_after_forward (the expert-parallel path's; ep = 1)" or
            "distributed.reshard_after_forward (ep > 1: moe.reshard_after_forward decides)"
        elseif section == "pipeline" and (pp or 1) <= 1 and spec.opt then
          notes[#notes + 1] = string.format("pipeline.%s (pp = 1: no pipeline)", field)
        end
        if spec.opt and not skip then
          set(section, field, s[field])
        end
      end
    end
  end
  if r.activation_checkpointing ~= nil then set("", "activation_checkpointing", r.activation_checkpointing) end
  return out, notes
end

-- ---------------------------------------------------------------- the model's copy

--- A deep copy of a module tree: new modules and parameters, a parameter shared by two
-- modules (tied weights) still shared.  Buffers and attrs are shared (steps never change them).
function R.clone(root)
  local params = {}
  local function copy_param(p)
    if params[p] then return params[p] end
    local c = setmetatable({}, getmetatable(p))
    for k, v in pairs(p) do c[k] = v end
    c.shape = util.copy(p.shape)
    params[p] = c
    return c
  end
  local function walk(m)
    local c = module.new(m.type, m.attrs)
    for _, name in ipairs(m.param_order) do
      c.params[name] = copy_param(m.params[name])
      c.param_order[#c.param_order + 1] = name
    end
    for _, name in ipairs(m.buffer_order or {}) do
      c.buffers[name] = m.buffers[name]
      c.buffer_order[#c.buffer_order + 1] = name
    end
    for _, name in ipairs(m.child_order) do
      c.children[name] = walk(m.children[name])
      c.child_order[#c.child_order + 1] = name
    end
    return c
  end
  return walk(root)
end

-- ---------------------------------------------------------------- matching (module_matcher.py)

-- wildcard_match's regex as a Lua function: Automodel turns a '*' not after '.' into ".*",
-- then every ".*" into "(.*)", and matches the whole name with Python's re.  The patterns it
-- makes are literal text, "." (any character) and ".*"; other regex syntax in a pattern is
-- refused.
-- Matching work is bounded: every step of every match counts against budget.left (a table
-- shared by a section's patterns), and an exhausted budget is an error naming the field.
R.MATCH_STEPS = 2e7

local function compile_pattern(pat, where, budget)
  budget = budget or { left = R.MATCH_STEPS }
  if pat:find("[%[%]%(%)%+%?%^%$|\\{}]") then
    fail(where, string.format("pattern '%s' holds regular-expression syntax beyond '*' and '.'; moonshard " ..
      "matches Automodel's wildcard patterns (literal names, '.', '*')", util.short_name(pat, 80)))
  end
  -- tokens: "*" (any run) and "." (any character); "*" after "." is the same ".*"
  local toks = {}
  local i = 1
  while i <= #pat do
    local c = pat:sub(i, i)
    local star = (c == "." and pat:sub(i + 1, i + 1) == "*") and 2 or c == "*" and 1 or nil
    if star then
      if toks[#toks] ~= "*" then toks[#toks + 1] = "*" end
      i = i + star
    elseif c == "." then toks[#toks + 1] = "?" i = i + 1
    else toks[#toks + 1] = c i = i + 1 end
  end
  -- the classic two-pointer glob match: on a mismatch, go back to the last "*" and let it
  -- take one character more; O(#name x #tokens) at worst, whatever the pattern
  local function match(s)
    local si, ti, star, mark = 1, 1, nil, 1
    local ns, nt = #s, #toks
    while si <= ns do
      budget.left = budget.left - 1
      if budget.left < 0 then
        fail(where, string.format("matching the patterns took more than %d steps (many '*' in long patterns); " ..
          "simplify them", R.MATCH_STEPS))
      end
      local t = toks[ti]
      if t == "*" then
        star, mark, ti = ti, si, ti + 1
      elseif t ~= nil and (t == "?" or t == s:sub(si, si)) then
        si, ti = si + 1, ti + 1
      elseif star then
        mark = mark + 1
        si, ti = mark, star + 1
      else
        return false
      end
    end
    while toks[ti] == "*" do ti = ti + 1 end
    return ti > nt
  end
  return match
end
R.compile_pattern = compile_pattern

local function matcher(p, where)
  local tm, em = p.target_modules or {}, p.exclude_modules or {}
  if not p.match_all_linear and #tm == 0 and #em == 0 then tm = { "*_proj" } end -- Automodel's default
  local tms, ems, budget = {}, {}, { left = R.MATCH_STEPS }
  for i, s in ipairs(tm) do tms[i] = { s, compile_pattern(s, where .. ".target_modules", budget) } end
  for i, s in ipairs(em) do ems[i] = { s, compile_pattern(s, where .. ".exclude_modules", budget) } end
  -- ModuleMatcher.match(m, name): name is the full dotted name
  return function(m, name)
    local linear = m.type == "Linear"
    if p.match_all_linear and linear then return true end
    if #tms > 0 then
      for _, t in ipairs(tms) do
        if name == t[1] or t[2](name) then return true end
      end
      return false
    end
    if p.match_all_linear then return false end
    for _, e in ipairs(ems) do
      if name == e[1] or e[2](name) then return false end
    end
    return linear
  end
end

-- ---------------------------------------------------------------- the steps

local function weight_dims(m)
  local w = m.params.weight
  if not w then return nil end
  local shape = w.quant and w.quant.shape or w.shape
  if #shape ~= 2 then return nil end
  return shape[1], shape[2]
end

-- bitsandbytes' 4-bit layout: numel / 2 bytes of codes, in quant_storage elements of
-- [n, 1]; the absmax of every blocksize-64 block (f32, or with double quantisation one byte
-- each plus an f32 absmax and offset per 256 of them).  transformers' Linear4bit keeps the
-- quant state outside the parameters: it is counted per module (R.quant_state_bytes).
R.NF4_BLOCKSIZE = 64
R.NF4_NESTED_BLOCKSIZE = 256

function R.quant_state_bytes(numel, double_quant)
  local blocks = util.ceil_div(numel, R.NF4_BLOCKSIZE)
  if not double_quant then return blocks * 4 end
  local nested = util.ceil_div(blocks, R.NF4_NESTED_BLOCKSIZE)
  -- the 8-bit absmax codes, the nested f32 absmax, the f32 offset and the 256-entry code map
  return blocks + nested * 4 + 4 + 256 * 4
end

local function step_quantization(r, model, rec)
  local q = r.quantization
  if not q or not q.load_in_4bit then return end
  local storage = q.bnb_4bit_quant_storage or "bf16"
  local double = q.bnb_4bit_use_double_quant ~= false
  local skip = {}
  for _, s in ipairs(q.llm_int8_skip_modules or {}) do skip[s] = true end
  local head = model:get("lm_head")
  local state = 0
  for _, nm in ipairs(model:named_modules()) do
    local name, m = nm[1], nm[2]
    local leaf = name:match("([^.]+)$") or name
    local out_f, in_f = weight_dims(m)
    -- transformers' replace_with_bnb_linear: every nn.Linear but the output embedding and the
    -- modules named in llm_int8_skip_modules
    if m.type == "Linear" and out_f and m ~= head and not skip[leaf] and not skip[name] then
      local w = m.params.weight
      local numel = out_f * in_f
      -- two codes a byte, the bytes viewed as storage elements (bitsandbytes quantize_4bit)
      local per = require("moonshard").dtype_size(storage)
      local p = module.param({ util.ceil_div(util.ceil_div(numel, 2), per), 1 }, storage, { requires_grad = false })
      p.quant = { type = q.bnb_4bit_quant_type or "nf4", shape = { out_f, in_f }, dtype = w.dtype,
        double_quant = double, state_bytes = R.quant_state_bytes(numel, double),
        compute = q.bnb_4bit_compute_dtype or "f32" }
      state = state + p.quant.state_bytes
      m.params.weight = p
      -- the quant state lives beside the weight, whole on every rank (FSDP2 shards parameters
      -- only): planned as a buffer of its bytes
      m:buffer("weight_quant_state", { p.quant.state_bytes }, "u8")
      rec.changed[#rec.changed + 1] = name
    end
  end
  rec.summary = string.format("%d Linear modules store 4-bit %s weights (%s storage, blocksize %d%s); quant state " ..
    "%s on every rank", #rec.changed, q.bnb_4bit_quant_type or "nf4", storage, R.NF4_BLOCKSIZE,
    double and ", double quantisation" or "", util.bytes(state))
  rec.quant_state_bytes = state
  return true
end

local function step_peft(r, model, rec)
  local p = r.peft
  if not p then return end
  local dim, where = p.dim or 8, r.file .. ": peft"
  local match = matcher(p, where)
  local lora_dtype = p.lora_dtype
  if r.quantization and r.quantization.load_in_4bit and not lora_dtype then
    lora_dtype = r.quantization.bnb_4bit_compute_dtype or "bf16" -- _extract_base_dtype
  end
  local parent_of = {}
  local list = model:named_modules()
  for _, nm in ipairs(list) do
    for _, c in ipairs(nm[2].child_order) do parent_of[nm[2].children[c]] = nm[2] end
  end
  local added = 0
  for _, nm in ipairs(list) do
    local name, m = nm[1], nm[2]
    if m.type == "GroupedExperts" and match(m, name) then
      local gu, dn = m.params.gate_and_up_projs, m.params.down_projs
      if not (gu and dn and #gu.shape == 3 and #dn.shape == 3) then
        fail(where, name .. " is GroupedExperts without gate_and_up_projs and down_projs [experts, in, out]")
      end
      local rdim = dim
      if p.moe_rank_scaling then
        local k = parent_of[m] and parent_of[m].attrs.top_k
        if not util.is_int(k) then fail(where, "moe_rank_scaling: " .. name .. "'s MoE block gives no top_k") end
        rdim = util.idiv(dim, k)
        if rdim < 1 then
          fail(where, string.format("moe_rank_scaling: dim=%d // n_activated_experts=%d gives rank %d. Increase dim " ..
            "to at least n_activated_experts.", dim, k, rdim))
        end
      end
      local E, H, U, I = gu.shape[1], gu.shape[2], gu.shape[3], dn.shape[2]
      local dt = lora_dtype or gu.dtype
      for _, pn in ipairs(m.param_order) do m.params[pn].requires_grad = false end
      m:param("lora_gate_and_up_A", { E, H, rdim }, dt)
      m:param("lora_gate_and_up_B", { E, rdim, U }, dt)
      m:param("lora_down_A", { E, I, rdim }, dt)
      m:param("lora_down_B", { E, rdim, H }, dt)
      added = added + E * (H * rdim + rdim * U + I * rdim + rdim * H)
      m.attrs = util.copy(m.attrs)
      m.attrs.lora = { dim = rdim, alpha = p.alpha or 32, dropout = p.dropout or 0,
        dropout_position = p.dropout_position or "post", init = p.lora_A_init or "xavier" }
      rec.changed[#rec.changed + 1] = name
    elseif m.type == "Linear" and match(m, name) then
      local out_f, in_f = weight_dims(m)
      if not out_f then fail(where, name .. " is a Linear module without a 2-d weight") end
      local w = m.params.weight
      local dt = lora_dtype or w.dtype
      local A = m:add("lora_A", module.new("Linear"))
      A:param("weight", { dim, in_f }, dt)
      local B = m:add("lora_B", module.new("Linear"))
      B:param("weight", { out_f, dim }, dt)
      added = added + dim * (in_f + out_f)
      m.attrs = util.copy(m.attrs)
      m.attrs.lora = { dim = dim, alpha = p.alpha or 32, dropout = p.dropout or 0,
        dropout_position = p.dropout_position or "post", init = p.lora_A_init or "xavier" }
      rec.changed[#rec.changed + 1] = name
    end
  end
  if #rec.changed == 0 then
    fail(where, "matched no module (LoRA goes on Linear modules and GroupedExperts; a pattern matches the whole " ..
      "dotted name, as Automodel's: '*.q_proj' or '*_proj', not 'q_proj')")
  end
  -- after sharding Automodel freezes every parameter whose name has no "lora_"
  -- (infrastructure.py, "Freeze parameters after checkpoint loading and parallelization")
  local frozen = 0
  for _, np in ipairs(model:named_parameters()) do
    if not np[1]:find("lora_", 1, true) and np[2].requires_grad then
      np[2].requires_grad = false
      frozen = frozen + 1
    end
  end
  rec.summary = string.format("LoRA dim %d, alpha %s on %d modules: %s adapter parameters%s; every other " ..
    "parameter frozen", dim, tostring(p.alpha or 32), #rec.changed, util.thousands(added),
    lora_dtype and " in " .. lora_dtype or "")
  rec.adapter_params = added
  return true
end

-- torchao's convert_to_float8_training with Automodel's _module_filter_fn: Linear modules,
-- both weight dims divisible by 16, no filter_fqns substring in the name; then the user's
-- module_filter(fqn, info) when the recipe gives one.
local function step_fp8(r, model, rec)
  local f = r.fp8
  if not f or not f.enabled then return end
  if r.quantization and r.quantization.load_in_4bit then
    fail(r.file .. ": fp8", "goes without 4-bit quantization: torchao would swap bitsandbytes' Linear4bit " ..
      "modules (nn.Linear subclasses) for Float8Linear, whose weight cannot be a packed 4-bit tensor")
  end
  if r.peft then
    fail(r.file .. ": fp8", "goes without peft: torchao's convert_to_float8_training swaps every nn.Linear for a " ..
      "Float8Linear, LoRA's patched linears too, which drops their adapters (Automodel applies fp8 after LoRA)")
  end
  local recipe = f.recipe_name or "tensorwise"
  -- torchao's float8 all-gather is FSDP2's (fsdp_pre_all_gather), for the tensorwise recipe
  -- only, and the precomputed scales go with it (Automodel's apply_fp8_to_model)
  local fp8_gather = f.enable_fsdp_float8_all_gather == true and recipe == "tensorwise" and r.manager == "fsdp2"
  local precompute = f.precompute_float8_dynamic_scale_for_fsdp == true and fp8_gather
  local function note(field, why) rec.notes[#rec.notes + 1] = string.format("fp8.%s (%s)", field, why) end
  if f.enable_fsdp_float8_all_gather and not fp8_gather then
    note("enable_fsdp_float8_all_gather", recipe ~= "tensorwise" and "the " .. recipe .. " recipe gathers in the " ..
      "parameter dtype: torchao's float8 all-gather is tensorwise only" or "FSDP2's all-gather; the " .. r.manager ..
      " manager's collectives move the parameter dtype")
  end
  if f.precompute_float8_dynamic_scale_for_fsdp and not precompute then
    note("precompute_float8_dynamic_scale_for_fsdp", "it goes with the tensorwise float8 all-gather under FSDP2")
  end
  local skipped = 0
  for _, nm in ipairs(model:named_modules()) do
    local name, m = nm[1], nm[2]
    if m.type == "Linear" then
      local ok = true
      for _, s in ipairs(f.filter_fqns or {}) do
        if name:find(s, 1, true) then ok = false end
      end
      local out_f, in_f = weight_dims(m)
      if ok and (not out_f or out_f % 16 ~= 0 or in_f % 16 ~= 0) then ok = false end
      if ok and f.module_filter then
        local w = m.params.weight
        local okc, v = pcall(f.module_filter, name, { type = m.type, shape = util.copy(w.shape), dtype = w.dtype })
        if not okc then
          -- the sandbox's messages name "policy FILE"; here the function is a recipe's
          local msg = tostring(v):gsub("^moonshard: ", ""):gsub("^policy [^\n]-%.lua: ", "")
          fail(r.file .. ": fp8.module_filter", string.format("failed for %s: %s", name, msg))
        end
        if type(v) ~= "boolean" then
          fail(r.file .. ": fp8.module_filter", string.format("returned %s for %s; expected true or false", shown(v), name))
        end
        ok = v
      end
      if ok then
        m.attrs = util.copy(m.attrs)
        m.attrs.fp8 = { recipe = recipe }
        if fp8_gather then m.params.weight.fp8_gather = { scaling = "tensorwise", precompute = precompute } end
        rec.changed[#rec.changed + 1] = name
      else
        skipped = skipped + 1
      end
    end
  end
  rec.summary = string.format("%d Linear modules run %s fp8 matmuls (%d left out)%s", #rec.changed, recipe, skipped,
    fp8_gather and string.format("; their weights all-gather as e4m3 bytes, the amax all-reduced %s",
      precompute and "once a step for all of them (precompute_float8_dynamic_scale_for_fsdp)" or "before each gather")
      or "")
  rec.fp8_gather, rec.precompute = fp8_gather, precompute
  return true
end

-- torchao's QAT quantizers (torchao 0.18, quantization/qat/linear.py and
-- linear_quant_modules.py):
--   int8_dynact_int4weight: every Linear whose in_features is a multiple of groupsize
--     (_check_linear_int4_k), or any Linear with padding_allowed;
--   int4_weight_only: every Linear without a bias (prepare passes padding_allowed=True), and
--     Int4WeightOnlyQATLinear refuses in_features that are not a multiple of groupsize and of
--     inner_k_tiles x 16 ("Padding for QAT 4w is not supported yet"): prepare fails.
local function step_qat(r, model, rec)
  local q = r.qat
  -- Automodel runs QAT only when the section says enabled (train_ft.py: cfg_qat.get("enabled", False))
  if not q or q.enabled ~= true then return end
  if r.fp8 and r.fp8.enabled then
    fail(r.file .. ": qat", "goes without fp8: torchao's QAT quantizers swap every matching nn.Linear, and " ..
      "Float8Linear is one, so QAT would replace the fp8 linears (Automodel applies QAT after fp8)")
  end
  if r.quantization and r.quantization.load_in_4bit then
    fail(r.file .. ": qat", "goes without 4-bit quantization: fake-quantising a base that is already stored in 4 " ..
      "bits has no bf16 weight to quantise")
  end
  if r.peft then
    fail(r.file .. ": qat", "goes without peft: torchao's QAT quantizers swap every matching nn.Linear, LoRA's " ..
      "patched linears too, which drops their adapters (Automodel applies QAT after LoRA)")
  end
  for _, np in ipairs(model:named_parameters()) do
    if np[2].dtype ~= "bf16" then
      fail(r.file .. ": qat", string.format("needs every parameter in bf16, as Automodel (\"QAT is only supported " ..
        "for bfloat16 models\"); %s is %s", np[1], np[2].dtype))
    end
  end
  local kind = q.quantizer_type or "int8_dynact_int4weight"
  local groupsize = q.groupsize or 256
  local w4 = kind == "int4_weight_only"
  local tiles = w4 and (q.inner_k_tiles or 8) or nil
  local skipped = 0
  for _, nm in ipairs(model:named_modules()) do
    local name, m = nm[1], nm[2]
    if m.type == "Linear" then
      local _, in_f = weight_dims(m)
      local fits = in_f and in_f % groupsize == 0 and (not tiles or in_f % (tiles * 16) == 0)
      local ok
      if w4 then
        ok = m.params.bias == nil
        if ok and not fits then
          fail(r.file .. ": qat", string.format("int4_weight_only: %s has in_features %s, not a multiple of the group " ..
            "size %d and of inner_k_tiles x 16 = %d: torchao's Int4WeightOnlyQATQuantizer refuses it (\"Padding " ..
            "for QAT 4w is not supported yet\"); pick a group size that divides it", name, tostring(in_f), groupsize,
            tiles * 16))
        end
      else
        ok = in_f and (fits or q.padding_allowed)
      end
      if ok then
        m.attrs = util.copy(m.attrs)
        m.attrs.qat = { quantizer = kind, groupsize = groupsize }
        rec.changed[#rec.changed + 1] = name
      else
        skipped = skipped + 1
      end
    end
  end
  rec.summary = string.format("%d Linear modules fake-quantised (%s, group size %d; %d left out: %s)", #rec.changed,
    kind, groupsize, skipped, w4 and "those with a bias" or "in_features not a multiple of the group size")
  return true
end

R.STEPS = {
  { name = "quantization", run = step_quantization },
  { name = "peft", run = step_peft },
  { name = "fp8", run = step_fp8 },
  { name = "qat", run = step_qat },
}

--- apply(r, model) -> model', steps, notes: a copy of the model with the recipe's steps
-- applied in Automodel's order; steps lists those that ran: {name, changed = {module names},
-- summary, ...}; notes the recipe's fields that change no plan (its own and the steps').
function R.apply(r, model)
  local copy = R.clone(model)
  local steps, notes = {}, util.copy(r.notes)
  for _, s in ipairs(R.STEPS) do
    local rec = { name = s.name, changed = {}, notes = {} }
    if s.run(r, copy, rec) then steps[#steps + 1] = rec end
    for _, x in ipairs(rec.notes) do notes[#notes + 1] = x end
  end
  table.sort(notes)
  return copy, steps, notes
end

return R
