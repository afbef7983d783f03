-- moonshard.plan_activations: the activation memory of a plan given a batch (see
-- moonshard.plan and docs/planning.md, "Activation memory"): per layer and micro-batch, the
-- bytes PyTorch eager keeps for backward, from the module tree, as
-- tests/reference/activations.py measures them on transformers models (bf16, sdpa attention).
--
-- What each kind of module keeps (T: the tokens of a micro-batch on the rank, micro_batch x
-- seq_len / cp; c: the bytes of the layer's compute dtype, the dtype its unit's mixed
-- precision gathers the layer's weights in; a tensor counted once even when several
-- operations save it, as autograd keeps one storage):
--
-- * RMSNorm over n features (transformers' LlamaRMSNorm and kin): its input upcast to f32
--   (4n a row: pow and mul save it), the reciprocal root (4 a row), the normalized rows cast
--   back (c n: the weight's mul saves it).  A norm marked scale_in_f32 (Gemma's: it scales
--   by 1 + weight in f32 and casts at the end) keeps the normalized rows in f32 (4n) and its
--   (1 + weight) in f32 (4n once).  Its output is kept only where a Linear reads it: that is
--   the input of the block that follows (below).
-- * A block's input (attention, MLP, MoE): the tensor its first projections read, kept once
--   however many read it (q, k and v; gate and up; the router, the experts and the shared
--   experts), c x hidden a token.
-- * Grouped-query attention (q_proj, k_proj, v_proj, o_proj; attrs heads, kv_heads,
--   head_dim): q_norm and k_norm when present (norms over head_dim, a row per head); the
--   rotated queries and keys (rotary's multiplications save cos and sin, not q and k: the
--   projections' outputs die), v, sdpa's output and its f32 log-sum-exp (4 a head); the
--   output feeds o_proj as a view, so nothing more.  Flash-style sdpa: no scores of
--   sequence x sequence (the math kernel, which sdpa takes on a mask or unequal head widths,
--   is not modelled).
-- * Multi-head latent attention (q_a_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj; attrs
--   heads, rope_dim, v_head_dim): its input; q_a_layernorm and q_b_proj's input (the norm's
--   output); kv_a_layernorm and kv_b_proj's input; the query and key of heads x (nope +
--   rope); kv_b_proj's output whole (the values are a view of it); sdpa's output and
--   log-sum-exp; o_proj's input, a copy (transformers reshapes a transposed output).
-- * Rotary: cos and sin (seq_len / cp x rotary width, c: the positions are one row shared by
--   the batch), made once a forward and saved by the first attention: once per micro-batch.
-- * Gated MLP (gate_proj, up_proj, down_proj): gate's output (the activation saves its
--   input), the activation's output and up's output (the product saves both), the product
--   (down_proj saves its input): 4 c x intermediate a token.
-- * MoE block (a Gate, GroupedExperts, optional shared_experts), as transformers 5's grouped
--   experts run it (integrations/moe.py, grouped_mm_experts_forward) and NeMo Automodel's
--   GroupedExperts alike: the router's input again when the gate computes in another dtype
--   (DeepSeek-V3's transformers router upcasts to f32), its f32 probabilities (4 x experts),
--   top-k indices (8 k) and f32 values (4 k) and their sum (4); with group-limited routing
--   (a gate with e_score_correction_bias) the groups' top-2 indices (16 x n_group), the
--   chosen groups (8 x topk_group) and the mask (a byte an expert).  For the T x k pairs of
--   token and expert: the sort's permutation, the gather's index and the inverse
--   permutation (24 bytes a pair), the dispatched tokens (c x hidden), gate_and_up's output
--   (c x 2 inter), the activation's output and the product (c x inter each), the routing
--   weight (in the gate's dtype) and the experts' output before it is weighted (c x hidden);
--   4 bytes an expert of offsets.  Under expert parallelism a rank receives T x k pairs on
--   average (routing spread evenly), so the same.  Shared experts: a gated MLP on the
--   block's input.
-- * Any other module with parameters (an unknown block): every Linear below it keeps its
--   input, every norm as above; the plan says which layers were counted this way.
-- * Embedding: the ids (8 a token).  Final norm and lm_head's input as above.  Loss
--   (transformers' ForCausalLMLoss): the logits upcast to f32 and log_softmax, which saves
--   its f32 output, 4 x vocab a token (the bf16 logits are returned, alive, but not saved);
--   the shifted labels (a contiguous copy, 8 x T; a view of the padded labels, 8 x (seq_len +
--   1) / cp, for one sequence), and a scalar.
--
-- Activation checkpointing: a checkpointed module (ctx.checkpointed: whole decoder layers,
-- every k-th, or any module a policy wraps) keeps its input only (torch's non-reentrant
-- checkpoint saves its inputs; rotary's cos and sin and the position ids, 8 x seq_len / cp,
-- stay with every checkpointed layer's keyword arguments, once a micro-batch); in backward
-- the recompute restores one layer's whole set (the `transient` term).  Selective
-- checkpointing of operations (torch's checkpoint policies) is not in the policy API.
--
-- Splits: tensor parallelism divides what a colwise module produces by tp (its output
-- features: heads, the intermediate, lm_head's vocabulary when its output stays sharded) and,
-- for sequence-parallel norms, what the norm keeps; a colwise projection's input is the
-- gathered, whole activation.  Context parallelism divides the tokens (T) by cp.  A pipeline
-- rank keeps its own stages' activations for the micro-batches its schedule holds at the
-- peak (plan_pp.in_flight, in stage-sized units: the mean of the rank's stages); without a
-- pipeline, one micro-batch.

local util = require "moonshard.util"

local A = {}

local DTYPE_SIZE, plan

--- Takes the planner's helpers (DTYPE_SIZE, plan); returns A.
function A.bind(h)
  DTYPE_SIZE, plan = h.DTYPE_SIZE, h.plan
  return A
end

local WRAPPED = require("moonshard.module").CHECKPOINT_WRAPPED

local function unwrap(m)
  if m.type == "CheckpointWrapper" and m.children[WRAPPED] then return m.children[WRAPPED], true end
  return m, false
end

local function child(m, name)
  local c = m.children[name]
  return c and (unwrap(c)) or nil
end

local function weight_shape(m) -- {out, in} of a Linear, {n} of a norm
  local w = m and m.params.weight
  -- a 4-bit weight (a recipe's quantization) by its logical shape
  return w and (w.quant and w.quant.shape or w.shape)
end

-- The bytes of a per-token tensor of `width` elements of `size` bytes for T tokens.
local function tok(T, width, size) return T * width * size end

-- The context of one walk: ctx (the planner's), T, tokens, the tp split of each module.
local Walk = {}
Walk.__index = Walk

-- the dtype size a module computes in: its first floating parameter's gathered dtype
function Walk:size_of(m, default)
  for _, nm in ipairs(m:named_parameters()) do
    local p = nm[2]
    if DTYPE_SIZE[p.dtype] and p.dtype ~= "i64" and p.dtype ~= "i32" then
      local u = self.ctx.owner[p]
      return DTYPE_SIZE[self.ctx:compute_dtype(p, u and plan.param_mp(u, p))]
    end
  end
  return default
end

-- the parts tensor parallelism splits a module's output into: tp for a colwise module that
-- leaves it sharded, else 1
function Walk:out_split(m)
  local s = self.tp_style[m]
  if not s or s.style ~= "colwise" or s.spec.output_layouts == "Replicate()" then return 1 end
  return self.tp
end

-- the parts a norm's own rows are split into: sequence parallel divides them by tp
function Walk:seq_split(m)
  local s = self.tp_style[m]
  if s and s.style:find("^sequence_parallel") then return self.tp end
  return 1
end

local function split(n, parts) return util.ceil_div(n, parts) end

-- terms: list of {name, bytes, input (the block's input: what a checkpoint of the block keeps)}
local function term(list, name, bytes, input)
  list[#list + 1] = { name = name, bytes = bytes, input = input }
end

-- An RMSNorm of `rows` rows (tokens, or tokens x heads) over its weight's width.
function Walk:norm(list, name, m, rows, c)
  local n = weight_shape(m)[1]
  rows = split(rows, self:seq_split(m))
  local pre = name and name .. " " or ""
  term(list, pre .. "f32 input", rows * n * 4)
  term(list, pre .. "rstd", rows * 4)
  if m.attrs.scale_in_f32 then
    term(list, pre .. "f32 normalized", rows * n * 4)
    term(list, pre .. "f32 scale", n * 4)
  else
    term(list, pre .. "normalized", rows * n * c)
  end
end

local function linear_in(m) return weight_shape(m)[2] end
local function linear_out(m) return weight_shape(m)[1] end

function Walk:attention(list, m, c)
  local T = self.T
  local a = m.attrs
  local o = child(m, "o_proj")
  local q, k, v = child(m, "q_proj"), child(m, "k_proj"), child(m, "v_proj")
  local qa, kva, kvb = child(m, "q_a_proj"), child(m, "kv_a_proj_with_mqa"), child(m, "kv_b_proj")
  if kva and kvb then -- multi-head latent attention
    local heads = split(a.heads or 1, self:out_split(kvb))
    term(list, "input", tok(T, linear_in(kva), c), true)
    local qb = child(m, "q_b_proj")
    if qa and qb then
      self:norm(list, "q_a_layernorm", child(m, "q_a_layernorm"), T, c)
      term(list, "q_b_proj input", tok(T, linear_in(qb), c))
    end
    local qout = split(linear_out(qb or q), self:out_split(qb or q))
    self:norm(list, "kv_a_layernorm", child(m, "kv_a_layernorm"), T, c)
    term(list, "kv_b_proj input", tok(T, linear_in(kvb), c))
    term(list, "q", tok(T, qout, c))
    term(list, "k", tok(T, qout, c))
    term(list, "kv_b_proj output (v)", tok(T, split(linear_out(kvb), self:out_split(kvb)), c))
    local vw = heads * (a.v_head_dim or 1)
    term(list, "sdpa output", tok(T, vw, c))
    term(list, "sdpa logsumexp", tok(T, heads, 4))
    term(list, "o_proj input", tok(T, vw, c))
    self.rotary = math.max(self.rotary, a.rope_dim or 0)
    return
  end
  local qs = self:out_split(q)
  local qout, kout, vout = split(linear_out(q), qs), split(linear_out(k), self:out_split(k)),
    split(linear_out(v), self:out_split(v))
  local qn, kn = child(m, "q_norm"), child(m, "k_norm")
  local hd = a.head_dim or (qn and weight_shape(qn)[1]) or 128
  local heads = split(a.heads or util.idiv(linear_out(q), hd), qs)
  term(list, "input", tok(T, linear_in(q), c), true)
  if qn then self:norm(list, "q_norm", qn, T * heads, c) end
  if kn then self:norm(list, "k_norm", kn, T * util.idiv(kout, hd), c) end
  term(list, "q rotated", tok(T, qout, c))
  term(list, "k rotated", tok(T, kout, c))
  term(list, "v", tok(T, vout, c))
  term(list, "sdpa output", tok(T, split(linear_in(o), self:out_split(q)), c))
  term(list, "sdpa logsumexp", tok(T, heads, 4))
  self.rotary = math.max(self.rotary, hd)
end

function Walk:mlp(list, m, c, with_input, prefix)
  prefix = prefix or ""
  local g = child(m, "gate_proj")
  local inter = split(linear_out(g), self:out_split(g))
  if with_input then term(list, prefix .. "input", tok(self.T, linear_in(g), c), true) end
  term(list, prefix .. "gate output", tok(self.T, inter, c))
  term(list, prefix .. "activation output", tok(self.T, inter, c))
  term(list, prefix .. "up output", tok(self.T, inter, c))
  term(list, prefix .. "product (down_proj input)", tok(self.T, inter, c))
end

function Walk:moe(list, m, c)
  local T = self.T
  local gate, experts = child(m, "gate"), child(m, "experts")
  -- (a block described without its config, as a host's model may be, has no top_k: the
  -- generic rule counts it)
  local E, k = m.attrs.n_experts or experts.params.gate_and_up_projs.shape[1], m.attrs.top_k
  local hidden = weight_shape(gate)[2]
  local gc = self:size_of(gate, c)
  term(list, "input", tok(T, hidden, c), true)
  if gc ~= c then term(list, "router input", tok(T, hidden, gc)) end
  term(list, "router f32 probabilities", tok(T, E, 4))
  term(list, "top-k indices", tok(T, k, 8))
  term(list, "top-k f32 weights", tok(T, k, 4))
  term(list, "top-k sum", tok(T, 1, 4))
  if gate.buffers.e_score_correction_bias then
    term(list, "group routing", T * (16 * (m.attrs.n_group or 1) + 8 * (m.attrs.topk_group or 1) + E))
  end
  local gu = experts.params.gate_and_up_projs
  local inter = util.idiv(gu.shape[3], 2)
  local P = T * k
  local ep = self.ctx.ep[gu] and self.ctx.ep[gu].local_shape[1] or E
  term(list, "token permutations", P * 24)
  term(list, "expert offsets", ep * 4)
  term(list, "dispatched tokens", tok(P, hidden, c))
  term(list, "gate_and_up output", tok(P, 2 * inter, c))
  term(list, "activation output", tok(P, inter, c))
  term(list, "product (down input)", tok(P, inter, c))
  term(list, "routing weights", P * gc)
  term(list, "expert output", tok(P, hidden, c))
  local shared = child(m, "shared_experts")
  if shared then self:mlp(list, shared, c, false, "shared experts ") end
end

-- an unknown block: every Linear keeps its input, every norm as a norm over T rows
function Walk:generic(list, m, c, name)
  for _, nm in ipairs(m:named_modules()) do
    local x = nm[2]
    if x.type == "Linear" and weight_shape(x) then
      term(list, name .. "." .. nm[1] .. " input", tok(self.T, linear_in(x), c), nm[1] == "")
    elseif x.type == "RMSNorm" and weight_shape(x) then
      self:norm(list, name .. "." .. nm[1], x, self.T, c)
    end
  end
  self.generic_count = self.generic_count + 1
end

local function is_attention(m)
  return m.children.o_proj ~= nil and (m.children.q_proj ~= nil or m.children.q_a_proj ~= nil)
end
local function is_mlp(m)
  return m.children.gate_proj ~= nil and m.children.up_proj ~= nil and m.children.down_proj ~= nil
end

-- The terms of one decoder layer: a list of blocks {name, wrapped, terms, width (of its
-- input, for a wrapped block without an input term)}.
function Walk:layer(layer)
  local inner = unwrap(layer)
  local c = self:size_of(inner, 2)
  self.c_first = self.c_first or c
  local blocks = {}
  for _, name in ipairs(inner.child_order) do
    local m, wrapped = unwrap(inner.children[name])
    local list = {}
    local width = nil
    if m.type == "RMSNorm" and weight_shape(m) then
      self:norm(list, nil, m, self.T, c)
      width = weight_shape(m)[1]
    elseif is_attention(m) then
      self:attention(list, m, c)
    elseif m.type == "MoE" and m.children.gate and m.children.experts and
        m.children.experts.params.gate_and_up_projs and util.is_int(m.attrs.top_k) then
      self:moe(list, m, c)
    elseif is_mlp(m) then
      self:mlp(list, m, c, true)
    elseif next(m.params) or #m.child_order > 0 then
      self:generic(list, m, c, name)
    end
    blocks[#blocks + 1] = { name = name, wrapped = wrapped, terms = list, width = width, c = c }
  end
  return blocks, c
end

local function sum_terms(list)
  local s = 0
  for _, t in ipairs(list) do s = s + t.bytes end
  return s
end

-- What a layer keeps (kept), what its recompute restores in backward (recompute: its whole
-- set when checkpointed, else 0) and its terms as the plan shows them.
function Walk:layer_kept(layer)
  local _, whole = unwrap(layer)
  local blocks, c = self:layer(layer)
  local terms, full = {}, 0
  for _, b in ipairs(blocks) do
    for _, t in ipairs(b.terms) do
      terms[#terms + 1] = { name = b.name .. " " .. t.name, bytes = t.bytes }
      full = full + t.bytes
    end
  end
  if whole then
    -- the layer's input: the residual stream, split by tp under sequence parallelism
    local hidden = self.hidden or 0
    local kept = split(self.T, self.sp and self.tp or 1) * hidden * c
    return kept, full, { { name = "checkpointed layer input", bytes = kept } }, true
  end
  local kept, recompute, shown, partial = 0, 0, {}, false
  for _, b in ipairs(blocks) do
    local sum = sum_terms(b.terms)
    if b.wrapped then
      partial = true
      local keep = 0
      for _, t in ipairs(b.terms) do if t.input then keep = keep + t.bytes end end
      if keep == 0 and b.width then keep = split(self.T, self.sp and self.tp or 1) * b.width * c end
      kept = kept + keep
      recompute = math.max(recompute, sum)
      shown[#shown + 1] = { name = b.name .. " checkpointed input", bytes = keep }
    else
      kept = kept + sum
      for _, t in ipairs(b.terms) do shown[#shown + 1] = { name = b.name .. " " .. t.name, bytes = t.bytes } end
    end
  end
  return kept, partial and recompute or 0, shown, partial
end

-- The decoder layers: the children of every ModuleList (or ModuleDict, as DeepSeek-V4 keeps
-- them) in the tree.
local function layer_lists(model)
  local out = {}
  for _, nm in ipairs(model:named_modules()) do
    if nm[2].type == "ModuleList" or nm[2].type == "ModuleDict" then out[#out + 1] = nm end
  end
  return out
end

--- Activation memory of a plan.  ctx (after the policy ran), model, mesh, tokens ({seq_len,
-- micro_batch, global_batch, accumulation}), in_flight (per pp coordinate, nil without a
-- pipeline).  Returns {by_pp = {[p] = {activations, transient}}, breakdown = {...}}.
function A.plan(ctx, model, mesh, tokens, in_flight)
  local cp, tp = mesh:size("cp"), mesh:size("tp")
  local B, S = tokens.micro_batch, tokens.seq_len
  local T = util.ceil_div(B * S, cp)
  local styles = {}
  local sp = false
  for _, x in ipairs(ctx.tp_modules) do
    styles[x.object] = x
    if x.style:find("^sequence_parallel") then sp = true end
  end
  local w = setmetatable({ ctx = ctx, T = T, tp = tp, tp_style = styles, sp = sp, rotary = 0, generic_count = 0 },
    Walk)
  local embed, head, final_norm
  for _, nm in ipairs(model:named_modules()) do
    local m = nm[2]
    if m.type == "Embedding" and not embed then embed = m end
  end
  -- the head: the root's Linear child; the final norm: a norm that is a sibling of the layers
  for _, name in ipairs(model.child_order) do
    local m = model.children[name]
    if m.type == "Linear" and weight_shape(m) then head = m end
  end
  local hidden = embed and weight_shape(embed) and weight_shape(embed)[2] or (head and linear_in(head)) or 0
  w.hidden = hidden
  local stage_of = ctx.pp and ctx.pp.stage_of or {}
  local nstages = ctx.pp and ctx.pp.count or 1
  local per_stage = {}
  for s = 0, nstages - 1 do per_stage[s] = { kept = 0, recompute = 0, loss_transient = 0 } end
  local function at(m) return stage_of[m] or 0 end
  local kinds, kind_of = {}, {}
  local attention_stages = {}
  local whole, partial, layer_count = 0, 0, 0
  for _, lnm in ipairs(layer_lists(model)) do
    local list = lnm[2]
    if not final_norm then -- the final norm: an RMSNorm next to the first layer list
      local parent = model:get(lnm[1]:match("^(.*)%.[^.]+$") or "")
      for _, sib in ipairs(parent and parent.child_order or {}) do
        if parent.children[sib].type == "RMSNorm" then final_norm = parent.children[sib] end
      end
    end
    for _, cname in ipairs(list.child_order) do
      local layer = list.children[cname]
      local inner, wrapped = unwrap(layer)
      local kept, recompute, shown, checkpointed = w:layer_kept(layer)
      local s = stage_of[layer] or stage_of[inner] or 0
      per_stage[s].kept = per_stage[s].kept + kept
      per_stage[s].recompute = math.max(per_stage[s].recompute, recompute)
      layer_count = layer_count + 1
      if wrapped then whole = whole + 1 elseif checkpointed then partial = partial + 1 end
      for _, n in ipairs(inner.child_order) do
        if is_attention(unwrap(inner.children[n])) then attention_stages[s] = true end
      end
      local key = inner.type .. "|" .. tostring(wrapped) .. "|" .. tostring(checkpointed) .. "|" .. kept .. "|" ..
        recompute
      local k = kind_of[key]
      if not k then
        k = { kind = inner.type, checkpointed = wrapped and "layer" or (checkpointed and "modules" or "none"),
          bytes = kept, recompute = recompute, layers = {}, terms = shown }
        kind_of[key] = k
        kinds[#kinds + 1] = k
      end
      k.layers[#k.layers + 1] = lnm[1] .. "." .. cname
    end
  end
  local other = {}
  local function put(name, m, bytes)
    local s = m and at(m) or 0
    per_stage[s].kept = per_stage[s].kept + bytes
    other[#other + 1] = { name = name, bytes = bytes, stage = s }
  end
  if embed then put("embedding ids", embed, T * 8) end
  -- rotary's cos and sin: once a micro-batch on each stage with attention layers
  local cs = w.c_first or 2
  local positions = util.ceil_div(S, cp) -- rotary's tables are per position, shared by the batch
  if w.rotary > 0 then
    for s in pairs(attention_stages) do
      per_stage[s].kept = per_stage[s].kept + 2 * positions * w.rotary * cs
    end
    other[#other + 1] = { name = "rotary cos and sin", bytes = 2 * positions * w.rotary * cs }
  end
  if whole + partial > 0 then
    local pid = positions * 8
    for s in pairs(attention_stages) do per_stage[s].kept = per_stage[s].kept + pid end
    other[#other + 1] = { name = "position ids (checkpointed layers' arguments)", bytes = pid }
  end
  local loss = 0
  if final_norm then
    local list = {}
    w:norm(list, "final norm", final_norm, T, cs)
    put("final norm", final_norm, sum_terms(list))
  end
  if head then
    local c = w:size_of(head, 2)
    local vocab = split(linear_out(head), w:out_split(head))
    put("lm_head input", head, tok(T, linear_in(head), c))
    -- the labels, shifted: a view of the padded [1, S + 1] for one sequence, else a copy of B x S
    loss = tok(T, vocab, 4) + 8 * (B == 1 and util.ceil_div(S + 1, cp) or T) + 4
    put("loss (f32 log-softmax, labels)", head, loss)
    -- the loss's working set beyond what is kept: the logits (returned, alive) and two f32
    -- tensors of their size in backward (log-softmax's incoming gradient and its result)
    per_stage[at(head)].loss_transient = tok(T, vocab, c) + 2 * tok(T, vocab, 4)
  end
  -- per pp coordinate
  local npp = ctx.pp and mesh:size("pp") or 1
  local by_pp = {}
  for p = 0, npp - 1 do
    local sum, count, transient = 0, 0, 0
    for s = 0, nstages - 1 do
      local st = ctx.pp and ctx.pp.stages[s + 1]
      if not st or st.rank == p then
        sum, count = sum + per_stage[s].kept, count + 1
        transient = math.max(transient, per_stage[s].recompute, per_stage[s].loss_transient)
      end
    end
    local n = in_flight and in_flight[p + 1] or 1
    local per_mb = count > 0 and sum / count or 0
    by_pp[p] = { activations = math.ceil(per_mb * n), transient = transient, per_micro_batch = math.ceil(per_mb),
      in_flight = n }
  end
  local mode = "none"
  if whole == layer_count and layer_count > 0 then mode = "full"
  elseif whole > 0 then mode = "layers"
  elseif partial > 0 then mode = "modules" end
  return { by_pp = by_pp, breakdown = { tokens_per_rank = T, checkpointing = mode, layers = kinds, other = other,
    generic_blocks = w.generic_count, per_pp = by_pp } }
end

-- ---------------------------------------------------------------- output

--- The breakdown as JSON (plan JSON key "activations"); j holds the report's encoders jstr,
-- jnum and jobj.
function A.to_json(b, j)
  local function terms(list)
    local out = {}
    for i, t in ipairs(list) do out[i] = j.jobj({ { "name", j.jstr(t.name) }, { "bytes", j.jnum(t.bytes) } }) end
    return "[" .. table.concat(out, ",") .. "]"
  end
  local kinds = {}
  for i, k in ipairs(b.layers) do
    local names = {}
    for n, l in ipairs(k.layers) do names[n] = j.jstr(l) end
    kinds[i] = "\n  " .. j.jobj({ { "kind", j.jstr(k.kind) }, { "checkpointed", j.jstr(k.checkpointed) },
      { "layers", "[" .. table.concat(names, ",") .. "]" }, { "bytes", j.jnum(k.bytes) },
      { "recompute", j.jnum(k.recompute) }, { "terms", terms(k.terms) } })
  end
  local ranks = {}
  for p = 0, #b.per_pp do
    local x = b.per_pp[p]
    ranks[p + 1] = j.jobj({ { "pp_rank", j.jnum(p) }, { "per_micro_batch", j.jnum(x.per_micro_batch) },
      { "in_flight", j.jnum(x.in_flight) }, { "activations", j.jnum(x.activations) },
      { "transient", j.jnum(x.transient) } })
  end
  return j.jobj({ { "tokens_per_rank", j.jnum(b.tokens_per_rank) }, { "checkpointing", j.jstr(b.checkpointing) },
    { "layers", "[" .. table.concat(kinds, ",") .. "\n ]" }, { "other", terms(b.other) },
    { "generic_blocks", j.jnum(b.generic_blocks) }, { "per_pp_rank", "[" .. table.concat(ranks, ",") .. "]" } })
end

--- The table's lines under memory: what rank 0 keeps, per layer kind, the rest.
function A.lines(plan, bytes)
  local b, m = plan.activations, plan.memory
  if not b then
    return { "  activations: not counted (give the batch, --seq-len, to count what backward keeps)" }
  end
  local x = b.per_pp[0]
  local out = { string.format("  activations (rank 0): %s kept for backward at the peak (%s a micro-batch x %d in " ..
    "flight), transient %s; %d tokens a micro-batch on each rank; checkpointing %s", bytes(m.activations),
    bytes(x.per_micro_batch), x.in_flight, bytes(m.transient), b.tokens_per_rank, b.checkpointing) }
  for _, k in ipairs(b.layers) do
    local top = {}
    for i, t in ipairs(k.terms) do top[i] = t end
    table.sort(top, function(a, c) return a.bytes > c.bytes end)
    local parts = {}
    for i = 1, math.min(3, #top) do parts[i] = string.format("%s %s", top[i].name, bytes(top[i].bytes)) end
    out[#out + 1] = string.format("    %d x %s%s: %s each (%s)%s", #k.layers, k.kind,
      k.checkpointed == "none" and "" or " (checkpointed: " .. k.checkpointed .. ")", bytes(k.bytes),
      table.concat(parts, ", "), k.recompute > 0 and ", recompute " .. bytes(k.recompute) or "")
  end
  local parts = {}
  for i, t in ipairs(b.other) do parts[i] = string.format("%s %s", t.name, bytes(t.bytes)) end
  out[#out + 1] = "    and " .. table.concat(parts, ", ")
  if b.generic_blocks > 0 then
    out[#out + 1] = string.format("    %d blocks of unknown kind counted as their Linear inputs and norms",
      b.generic_blocks)
  end
  return out
end

return A
