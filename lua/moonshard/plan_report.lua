-- moonshard.plan_report: a plan as a person reads it (a table), as a machine reads it (the
-- plan JSON, version 1 (docs/planning.md)), as a dtype audit, and as an SVG picture.

local plan_mod = require "moonshard.plan"
local util = require "moonshard.util"
local activations = require "moonshard.plan_activations"
local plan_memory = require "moonshard.plan_memory"
local FLOATING = require("moonshard.module").FLOATING

local M = {}

-- The collectives tensor and context parallelism's breakdowns count (plan_comm), in order.
local TP_KINDS = { "all_reduce", "all_gather", "reduce_scatter" }
local CP_KINDS = { "all_gather", "all_to_all" }

-- The plan JSON lists every rank (memory.per_rank) and every coordinate of each unit's
-- shard axis (local_shapes): it grows with the mesh, and a plan whose JSON would pass this
-- many bytes is refused instead of written (building it takes several times as much memory).
M.JSON_LIMIT = 256 * 1024 * 1024

-- ---------------------------------------------------------------- JSON (version 1)

local ESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n", ["\r"] = "\\r",
  ["\t"] = "\\t" }
local function jstr(s)
  if s == nil then return "null" end
  return '"' .. tostring(s):gsub('[%c"\\]', function(c)
    return ESC[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end
local function jnum(n)
  if n ~= n or n == math.huge or n == -math.huge then error("moonshard: plan JSON: non-finite number", 0) end
  if n == math.floor(n) and math.abs(n) < 2 ^ 63 then return string.format("%d", n) end
  return string.format("%.17g", n)
end
local function jbool(b) return b and "true" or "false" end
local function jints(list)
  local parts = {}
  for i, v in ipairs(list) do parts[i] = jnum(v) end
  return "[" .. table.concat(parts, ",") .. "]"
end
local function jstrs(list)
  local parts = {}
  for i, v in ipairs(list) do parts[i] = jstr(v) end
  return "[" .. table.concat(parts, ",") .. "]"
end
-- An object from {key, encoded value} pairs, in order.
local function jobj(pairs_list)
  local parts = {}
  for i, kv in ipairs(pairs_list) do parts[i] = jstr(kv[1]) .. ":" .. kv[2] end
  return "{" .. table.concat(parts, ",") .. "}"
end
M.jstr, M.jnum, M.jobj = jstr, jnum, jobj

-- Local shapes of every coordinate of the shard axis: torch.chunk gives full chunks, at most
-- one partial chunk, then empty ones, so the list is built from three repeated strings.
local function local_shapes_json(shape, dim, W)
  local n = shape[dim + 1]
  local c = util.ceil_div(n, W)
  local function with(len)
    local s = util.copy(shape)
    s[dim + 1] = len
    return jints(s)
  end
  if n % W == 0 then
    return "[" .. string.rep(with(util.idiv(n, W)), W, ",") .. "]"
  end
  local full = util.idiv(n, c)
  local rest = n - full * c
  local parts = {}
  if full > 0 then parts[#parts + 1] = string.rep(with(c), full, ",") end
  local used = full
  if rest > 0 then
    parts[#parts + 1] = with(rest)
    used = used + 1
  end
  if W - used > 0 then parts[#parts + 1] = string.rep(with(0), W - used, ",") end
  return "[" .. table.concat(parts, ",") .. "]"
end
M.local_shapes_json = local_shapes_json

local function unit_json(u, plan)
  local params = {}
  local tp = plan.tensor_parallel and plan.tensor_parallel.params
  for i, e in ipairs(u.entries) do
    local placements, axes = plan_mod.placements(plan.mesh, tp, u, e.param, e.dim)
    local fields = {
      { "fqn", jstr(e.fqn) }, { "shape", jints(e.shape) }, { "dtype", jstr(e.param.dtype) },
      { "placement", jstr(u.kind == "replicate" and "Replicate()" or string.format("Shard(%d)", e.dim)) },
      { "padded_shard_shape", jints(e.padded) },
      { "local_shapes", local_shapes_json(e.shape, e.dim, u.shard_size) },
      { "placements", jstrs(placements) }, { "placement_axes", jstrs(axes) },
      -- the effective dtypes (a packed unit's island parameters have their own): gathered in,
      -- and the gradient reduced in (null for a frozen or non-floating parameter)
      { "gather_dtype", jstr(e.gather) },
      { "reduce_dtype", jstr((e.param.requires_grad and FLOATING[e.param.dtype]) and e.reduce or nil) },
    }
    local t = tp and tp[e.param]
    if t then
      fields[#fields + 1] = { "tp", jobj({ { "style", jstr(t.style) }, { "module", jstr(t.module) },
        { "placement", jstr(t.dim and string.format("Shard(%d)", t.dim) or "Replicate()") },
        { "global_shape", jints(e.param.shape) } }) }
    end
    params[i] = "      " .. jobj(fields)
  end
  local raf = u.reshard
  local fields = {
    jstr("name") .. ":" .. jstr(u.name),
    jstr("kind") .. ":" .. jstr(u.kind),
    jstr("mesh_axes") .. ":" .. jstrs(u.mesh_axes),
    jstr("param_dtype") .. ":" .. jstr(u.mp.param_dtype),
    jstr("reduce_dtype") .. ":" .. jstr(u.mp.reduce_dtype),
    jstr("output_dtype") .. ":" .. jstr(u.mp.output_dtype),
    jstr("cast_forward_inputs") .. ":" .. jbool(u.mp.cast_forward_inputs),
    jstr("reshard_after_forward") .. ":" .. (type(raf) == "boolean" and jbool(raf) or jnum(raf)),
  }
  -- only offloading units carry the key, so plans without offload read as before
  if u.offload then fields[#fields + 1] = jstr("offload_policy") .. ":" .. jstr(u.offload) end
  -- under a pipeline, the stage the unit lies in
  if u.stage then fields[#fields + 1] = jstr("stage") .. ":" .. jnum(u.stage) end
  -- only packed units carry the key: their islands' policies, and what packing saved a step
  if u.packed then fields[#fields + 1] = jstr("packed") .. ":" .. M.packed_json(u, plan) end
  fields[#fields + 1] = jstr("params") .. ":[" ..
    (#params > 0 and "\n" .. table.concat(params, ",\n") .. "\n    " or "") .. "]"
  fields[#fields + 1] = jstr("all_gather_bytes") .. ":" .. jnum(u.all_gather_bytes)
  fields[#fields + 1] = jstr("reduce_scatter_bytes") .. ":" .. jnum(u.reduce_scatter_bytes)
  fields[#fields + 1] = jstr("all_reduce_bytes") .. ":" .. jnum(u.all_reduce_bytes)
  if u.kind == "replicate" then -- DDP's options and its buckets, in the order they are reduced
    local d = u.ddp
    fields[#fields + 1] = jstr("ddp") .. ":" .. jobj({ { "bucket_cap_mb", d.bucket_cap_mb and jnum(d.bucket_cap_mb) or
      "null" }, { "bucket_limits", jints(d.limits) }, { "find_unused_parameters", jbool(d.find_unused_parameters) },
      { "gradient_as_bucket_view", jbool(d.gradient_as_bucket_view) }, { "static_graph", jbool(d.static_graph) },
      { "broadcast_buffers", jbool(d.broadcast_buffers) } })
    local buckets = {}
    for i, b in ipairs(u.buckets) do
      buckets[i] = "      " .. jobj({ { "index", jnum(b.index) }, { "params", jstrs(b.fqns) }, { "bytes", jnum(b.bytes) },
        { "dtype", jstr(b.dtype) } })
    end
    fields[#fields + 1] = jstr("buckets") .. ":[" .. (#buckets > 0 and "\n" .. table.concat(buckets, ",\n") ..
      "\n    " or "") .. "]"
  end
  if u.kind == "megatron_fsdp" then -- its strategy, buffers and buckets (moonshard.plan_megatron)
    fields[#fields + 1] = require("moonshard.plan_megatron").json(u, { jstr = jstr, jnum = jnum, jbool = jbool,
      jstrs = jstrs, jobj = jobj })
  end
  return "    {" .. table.concat(fields, ",") .. "}"
end

--- A packed unit's "packed" value: {islands: [{name, param_dtype, reduce_dtype, output_dtype,
-- cast_forward_inputs}], reduce_dtypes: [one reduce-scatter each], collectives_saved:
-- {all_gather, reduce_scatter, all_reduce}} (a step, all-gathers once per gather as the
-- communication per step counts them).
function M.packed_json(u, plan)
  local islands = {}
  for i, isl in ipairs(u.islands) do
    islands[i] = jobj({ { "name", jstr(isl.name) }, { "param_dtype", jstr(isl.mp.param_dtype) },
      { "reduce_dtype", jstr(isl.mp.reduce_dtype) }, { "output_dtype", jstr(isl.mp.output_dtype) },
      { "cast_forward_inputs", jbool(isl.mp.cast_forward_inputs) } })
  end
  local s, g = u.packing, plan.comm.gathers or 1
  return jobj({ { "islands", "[" .. table.concat(islands, ",") .. "]" }, { "reduce_dtypes", jstrs(u.reduce_dtypes or {}) },
    { "collectives_saved", jobj({ { "all_gather", jnum(s.all_gather * g) }, { "reduce_scatter", jnum(s.reduce_scatter) },
      { "all_reduce", jnum(s.all_reduce) } }) } })
end

local function jopt(n) return n and jnum(n) or "null" end

-- What follows '{"rank":r' in memory.per_rank for the ranks of a run.
local function rank_tail(m, run)
  return "," .. table.concat({ jstr("params") .. ":" .. jnum(run.params or m.params),
    jstr("grads") .. ":" .. jnum(run.grads or m.grads), jstr("optimizer") .. ":" .. jnum(run.optimizer),
    jstr("peak_unsharded") .. ":" .. jnum(run.peak_unsharded or m.peak_unsharded),
    jstr("buffers") .. ":" .. jnum(run.buffers or m.buffers), jstr("total") .. ":" .. jnum(run.total), jstr("offloaded") .. ":" .. jnum(run.offloaded),
    jstr("activations") .. ":" .. jopt(run.activations or m.activations),
    jstr("transient") .. ":" .. jopt(run.transient or m.transient), jstr("peak") .. ":" .. jopt(run.peak) }, ",") ..
    -- with a device profile (moonshard.plan_time)
    (m.capacity and "," .. jstr("overhead") .. ":" .. jnum(run.overhead) .. "," .. jstr("capacity") .. ":" .. jnum(m.capacity) or "") .. "}"
end

-- About the bytes the per-rank and per-coordinate lists take (at most: every rank
-- number and local shape counted at its longest).
local function json_lists_size(plan)
  local digits = #string.format("%d", plan.mesh.world)
  local bytes = 0
  for _, run in ipairs(plan.memory.runs) do
    bytes = bytes + run.count * (#'{"rank":' + digits + #rank_tail(plan.memory, run) + #",\n    ")
  end
  for _, u in ipairs(plan.units) do
    for _, e in ipairs(u.entries) do bytes = bytes + u.shard_size * (#jints(e.padded) + 1) end
  end
  return bytes
end

--- The plan JSON (version 1, docs/planning.md), with "audit" added when opts.audit is set
-- and "rank_view" when opts.rank is a rank.
function M.to_json(plan, opts)
  opts = opts or {}
  local mesh = plan.mesh
  local size = json_lists_size(plan)
  if size > M.JSON_LIMIT then
    error(string.format("moonshard: plan JSON: for %d ranks its lists would take up to %s (memory.per_rank has " ..
      "every rank, local_shapes every coordinate of each unit's shard axis), more than the %s it is written up " ..
      "to: plan a smaller mesh, or read the table", mesh.world, util.bytes(size), util.bytes(M.JSON_LIMIT)), 0)
  end
  local out = {}
  local function add(s) out[#out + 1] = s end
  add('{"moonshard_plan":1,\n')
  add(' "model":' .. jobj({ { "name", jstr(plan.model.name) }, { "architecture", jstr(plan.model.architecture) },
    { "params", jnum(plan.model.params) }, { "trainable_params", jnum(plan.model.trainable_params) },
    { "bytes", jnum(plan.model.bytes) },
    { "convention", plan.model.convention and jstr(plan.model.convention) or "null" } }) .. ",\n")
  local axes = {}
  for i, a in ipairs(mesh:root_axes()) do axes[i] = jobj({ { "name", jstr(a.name) }, { "size", jnum(a.size) } }) end
  add(' "mesh":' .. jobj({ { "world", jnum(mesh.world) }, { "axes", "[" .. table.concat(axes, ",") .. "]" },
    { "ep", jnum(mesh:size("ep")) }, { "ep_shard", jnum(mesh:size("ep_shard")) },
    { "fsdp_axes", jstrs(mesh.fsdp_axes) } }) .. ",\n")
  add(' "manager":' .. jstr(plan.manager or "fsdp2") .. ",\n")
  add(' "optimizer":' .. jstr(plan.optimizer or "adamw") .. ",\n")
  add(' "recipe":' .. M.recipe_json(plan) .. ",\n")
  -- the policy's options as used (flat, dotted names; none is null), which were set, the
  -- prefetch depths and the modules wrapped for activation checkpointing
  local options, set = {}, {}
  for i, op in ipairs(plan.options or {}) do
    local v = op.value
    options[i] = { op.name, v == nil and "null" or type(v) == "boolean" and jbool(v) or type(v) == "number" and jnum(v)
      or type(v) == "table" and jints(v) or jstr(v) }
    if op.set then set[#set + 1] = op.name end
  end
  add(' "options":' .. jobj(options) .. ",\n")
  add(' "options_set":' .. jstrs(set) .. ",\n")
  if plan.prefetch then
    add(' "prefetch":' .. jobj({ { "forward", jnum(plan.prefetch.forward) }, { "backward", jnum(plan.prefetch.backward) } }) ..
      ",\n")
  end
  add(' "checkpointed":' .. jstrs(plan.checkpointed or {}) .. ",\n")
  -- only plans given a batch carry the key
  local tk = plan.tokens
  if tk then
    add(' "tokens":' .. jobj({ { "seq_len", jnum(tk.seq_len) }, { "micro_batch", jnum(tk.micro_batch) },
      { "global_batch", jnum(tk.global_batch) }, { "accumulation", jnum(tk.accumulation) } }) .. ",\n")
  end
  -- only plans with tensor parallelism carry the key
  local tp = plan.tensor_parallel
  if tp then
    local rows = {}
    for i, r in ipairs(tp.plan) do
      rows[i] = jobj({ { "pattern", jstr(r.pattern) }, { "style", jstr(r.style) }, { "modules", jnum(r.modules) } })
    end
    add(' "tensor_parallel":' .. jobj({ { "size", jnum(tp.size) }, { "sequence_parallel", jbool(tp.sequence_parallel) },
      { "params", jnum(tp.count) }, { "plan", "[" .. table.concat(rows, ",") .. "]" } }) .. ",\n")
  end
  -- only plans with a pipeline carry the key
  local pl = plan.pipeline
  if pl then
    local stages = {}
    for i, s in ipairs(pl.stages) do
      stages[i] = "    " .. jobj({ { "index", jnum(s.index) }, { "pp_rank", jnum(s.pp_rank) }, { "ranks", jints(s.ranks) },
        { "layers", jobj({ { "first", jnum(s.layers.first) }, { "count", jnum(s.layers.count) } }) },
        { "modules", jstrs(s.modules) }, { "params", jnum(s.params) }, { "memory", jnum(s.memory) },
        { "cost", jnum(s.cost) } })
    end
    local fields = { { "schedule", jstr(pl.schedule) }, { "placement", jstr(pl.placement) },
      { "split", jstr(pl.split) }, { "cost_metric", jstr(pl.metric) },
      { "automodel_max_cost", jnum(pl.automodel_max) },
      { "balanced_max_cost", pl.balanced_max and jnum(pl.balanced_max) or "null" },
      { "stages_per_rank", jnum(pl.stages_per_rank) }, { "microbatches", pl.microbatches and jnum(pl.microbatches) or "null" },
      { "in_flight", pl.in_flight and jints(pl.in_flight) or "null" } }
    fields[#fields + 1] = { "stages", "[\n" .. table.concat(stages, ",\n") .. "\n ]" }
    add(' "pipeline":' .. jobj(fields) .. ",\n")
  end
  local units = {}
  for i, u in ipairs(plan.units) do units[i] = unit_json(u, plan) end
  add(' "units":[\n' .. table.concat(units, ",\n") .. "\n ],\n")
  local owned = {}
  for i, o in ipairs(plan.owned) do
    owned[i] = "    " .. jobj({ { "fqn", jstr(o.fqn) }, { "by", jstr(o.by) }, { "shape", jints(o.shape) },
      { "dtype", jstr(o.dtype) }, { "placements", jstrs(o.placements) }, { "local_shape", jints(o.local_shape) },
      { "unit", jstr(o.unit) } })
  end
  add(' "owned":[' .. (#owned > 0 and "\n" .. table.concat(owned, ",\n") .. "\n " or "") .. "],\n")
  -- ranks with the same figures (a run) share one encoded tail
  local m, ranks = plan.memory, {}
  for _, run in ipairs(m.runs) do
    local tail = rank_tail(m, run)
    for r = run.first, run.first + run.count - 1 do ranks[r + 1] = '{"rank":' .. jnum(r) .. tail end
  end
  local function jprefetch(pf)
    return jobj({ { "forward", jnum(pf.forward) }, { "backward", jnum(pf.backward) } })
  end
  local other = m.peak_unsharded_other
  -- with a batch and a device: whether every rank fits (plan_memory.peaks)
  local fit = ""
  if m.fit then
    local w = m.fit.worst
    fit = ',"fit":' .. jobj({ { "fits", jbool(m.fit.fits) }, { "ranks_over", jnum(m.fit.over) },
      { "worst", jobj({ { "rank", jnum(w.rank) }, { "peak", jnum(w.peak) }, { "headroom", jnum(w.headroom) },
        { "largest_term", jobj({ { "name", jstr(w.largest.name) }, { "bytes", jnum(w.largest.bytes) } }) } }) } })
  end
  add(' "memory":{"prefetch":' .. jprefetch(plan.prefetch) .. ',"peak_unsharded_other":' ..
    jobj({ { "prefetch", jprefetch(other.prefetch) }, { "bytes", jnum(other.bytes) } }) .. fit ..
    ',\n  "per_rank":[\n    ' .. table.concat(ranks, ",\n    ") .. "\n ]},\n")
  if plan.activations then
    add(' "activations":' .. activations.to_json(plan.activations, { jstr = jstr, jnum = jnum, jobj = jobj }) .. ",\n")
  end
  local comm = {}
  for i, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    comm[i] = jstr(k) .. ":" .. jobj({ { "count", jnum(plan.comm[k].count) }, { "bytes", jnum(plan.comm[k].bytes) } })
  end
  if plan.comm.send_recv then
    comm[#comm + 1] = jstr("send_recv") .. ":" .. jobj({ { "count", jnum(plan.comm.send_recv.count) },
      { "bytes", jnum(plan.comm.send_recv.bytes) } })
  end
  -- a breakdown's {forward, backward} of {kind: {count, bytes}}, for the given kinds
  local function per_micro_batch(t, kinds)
    local phases = {}
    for i, ph in ipairs({ "forward", "backward" }) do
      local out = {}
      for j, k in ipairs(kinds) do
        out[j] = { k, jobj({ { "count", jnum(t[ph][k].count) }, { "bytes", jnum(t[ph][k].bytes) } }) }
      end
      phases[i] = { ph, jobj(out) }
    end
    return jobj(phases)
  end
  local tpc = plan.comm.tensor_parallel
  local tp_json = ""
  if tpc then
    tp_json = ',"tensor_parallel":' .. jobj({ { "size", jnum(tpc.size) },
      { "per_micro_batch", per_micro_batch(tpc, TP_KINDS) },
      { "norm_grads", jobj({ { "count", jnum(tpc.norm_grads.count) }, { "bytes", jnum(tpc.norm_grads.bytes) } }) },
      { "notes", jstrs(tpc.notes) } })
  end
  local cpc = plan.comm.context_parallel
  if cpc then
    tp_json = tp_json .. ',"context_parallel":' .. jobj({ { "size", jnum(cpc.size) }, { "rotate", jstr(cpc.rotate) },
      { "layers", jnum(cpc.layers) }, { "uncounted_layers", jnum(cpc.skipped) },
      { "per_micro_batch", per_micro_batch(cpc, CP_KINDS) } })
  end
  local amax = plan.comm.fp8_amax
  if amax then
    tp_json = tp_json .. ',"fp8_amax":' .. jobj({ { "count", jnum(amax.count) }, { "bytes", jnum(amax.bytes) },
      { "precompute", jbool(amax.precompute) } })
  end
  local pk = plan.comm.packing
  if pk then
    tp_json = tp_json .. ',"packing":' .. jobj({ { "units", jnum(pk.units) }, { "islands", jnum(pk.islands) },
      { "collectives_saved", jnum(pk.collectives_saved) }, { "all_gather", jnum(pk.all_gather) },
      { "reduce_scatter", jnum(pk.reduce_scatter) }, { "all_reduce", jnum(pk.all_reduce) } })
  end
  add(' "comm":{"per_step":{' .. table.concat(comm, ",") .. "}" .. tp_json .. "},\n")
  add(require("moonshard.plan_time").json(plan, jstr, jobj))
  if opts.audit then
    local rows = {}
    for i, a in ipairs(plan_mod.audit(plan)) do
      rows[i] = "    " .. jobj({ { "fqn", jstr(a.fqn) }, { "unit", jstr(a.unit) }, { "kind", jstr(a.kind) },
        { "stored", jstr(a.stored) }, { "gathered", jstr(a.gathered) }, { "reduced", jstr(a.reduced) },
        { "recipe", jstrs(a.steps or {}) }, { "island", jstr(a.island) } })
    end
    add(' "audit":[\n' .. table.concat(rows, ",\n") .. "\n ],\n")
  end
  if opts.rank ~= nil then add(' "rank_view":' .. M.rank_json(M.rank_view(plan, opts.rank)) .. ",\n") end
  add(' "warnings":' .. jstrs(plan.warnings) .. "\n}\n")
  return table.concat(out)
end

-- ---------------------------------------------------------------- the table

local function pad(s, w, right)
  s = tostring(s)
  if #s >= w then return s end
  return right and string.rep(" ", w - #s) .. s or s .. string.rep(" ", w - #s)
end

local function dtypes_str(u)
  local g, r = u.gather_dtype or "-", u.reduce_dtype_eff or "-"
  -- a packed unit reducing in several dtypes: one reduce-scatter each
  if u.reduce_dtypes and #u.reduce_dtypes > 1 then r = table.concat(u.reduce_dtypes, "+") end
  return g, r
end

--- A replicate unit's buckets as lines, each given to add: DDP's options, then per bucket
-- (in the order DDP all-reduces them) its bytes, dtype and parameters (the first 32 buckets).
function M.bucket_lines(u, mesh, add)
  local d, axis = u.ddp, u.mesh_axes[1]
  add("")
  add(string.format("replicate unit %s (DDP) over %s=%d: %d bucket%s, one all_reduce each, in this order; cap %s%s%s",
    u.name == "" and "<root>" or u.name, axis, mesh:size(axis), #u.buckets, #u.buckets == 1 and "" or "s",
    util.bytes(d.limits[#d.limits]), d.limits[1] < d.limits[#d.limits] and ", first bucket " .. util.bytes(d.limits[1])
      or "", d.find_unused_parameters and "; find_unused_parameters: the constructor's buckets" or
      "; rebuilt after the first step in gradient order (taken as the reverse of the registration order)"))
  if u.bucket_buffer_bytes > 0 then
    add(string.format("  the buckets hold a second copy of the gradients (%s; gradient_as_bucket_view false), " ..
      "counted in grads", util.bytes(u.bucket_buffer_bytes)))
  end
  for i, b in ipairs(u.buckets) do
    if i > 32 then
      add(string.format("  ... and %d more buckets (--json lists them)", #u.buckets - 32))
      break
    end
    add(string.format("  %4d %10s %-5s %4d param%s  %s%s", b.index, util.bytes(b.bytes), b.dtype, #b.fqns,
      #b.fqns == 1 and " " or "s", b.fqns[1], #b.fqns > 1 and " .. " .. b.fqns[#b.fqns] or ""))
  end
end

-- A packed unit's island parameters' gather and reduce dtypes, each list joined with "+"
-- ("-" for a reduce when none has a gradient).
local function island_dtypes(u)
  local entry_of = {}
  for _, e in ipairs(u.entries) do entry_of[e.param] = e end
  local g, r, gs, rs = {}, {}, {}, {}
  for _, isl in ipairs(u.islands) do
    for _, p in ipairs(isl.params) do
      local e = entry_of[p]
      if not g[e.gather] then g[e.gather], gs[#gs + 1] = true, e.gather end
      local red = (p.requires_grad and FLOATING[p.dtype]) and e.reduce or nil
      if red and not r[red] then r[red], rs[#rs + 1] = true, red end
    end
  end
  return table.concat(gs, "+"), #rs > 0 and table.concat(rs, "+") or "-"
end

--- The packed units (fully_shard's islands): a line each (the first 8), their islands and
-- policy and what packing saved a step, then the total.
function M.packed_lines(plan, add)
  local pk = plan.comm.packing
  local list = {}
  for _, u in ipairs(plan.units) do
    if u.packed then list[#list + 1] = u end
  end
  if #list == 0 then return end
  local g = plan.comm.gathers or 1
  local n = 0
  for _, u in ipairs(list) do n = n + #u.islands end
  add("")
  -- (under a pipeline every stage's are listed; the total below and comm.packing are pp rank 0's)
  add(string.format("packed units%s: %d hold%s %d FP32 island%s%s, each island parameter with its own policy; one " ..
    "all-gather a gather, one reduce-scatter per reduce dtype", plan.pipeline and " (every stage)" or "", #list,
    #list == 1 and "s" or "", n, n == 1 and "" or "s", plan.pipeline and pk and
      string.format(" (pp rank 0's stages: %d, with %d)", pk.units, pk.islands) or ""))
  for i, u in ipairs(list) do
    if i > 8 then
      add(string.format("  ... and %d more packed units (--json lists them)", #list - 8))
      break
    end
    local names, prefix = {}, u.name == "" and "" or u.name .. "."
    for k, isl in ipairs(u.islands) do
      if k > 4 then names[#names + 1] = string.format("and %d more", #u.islands - 4) break end
      local n = isl.name:sub(1, #prefix) == prefix and isl.name:sub(#prefix + 1) or isl.name
      names[k] = (n:gsub("_checkpoint_wrapped_module%.", ""))
    end
    -- the islands' parameters' effective dtypes (FSDP2's rules on the island policy: an
    -- unset param_dtype gathers as stored, an unset reduce_dtype reduces as stored)
    local gathers, reduces = island_dtypes(u)
    local s = u.packing
    add(string.format("  %s: %d island%s (%s), gather %s, reduce %s; saves %d all-gather%s, %d reduce-scatter%s%s a step",
      u.name == "" and "<root>" or u.name, #u.islands, #u.islands == 1 and "" or "s", table.concat(names, ", "),
      gathers, reduces, s.all_gather * g, s.all_gather * g == 1 and "" or "s",
      s.reduce_scatter, s.reduce_scatter == 1 and "" or "s",
      s.all_reduce > 0 and string.format(", %d all-reduce%s", s.all_reduce, s.all_reduce == 1 and "" or "s") or ""))
  end
  if pk then
    add(string.format("  packing saves %d collectives a step%s: %d all-gathers, %d reduce-scatters, %d all-reduces " ..
      "(against a unit per island)", pk.collectives_saved, plan.pipeline and " on pp rank 0" or "", pk.all_gather,
      pk.reduce_scatter, pk.all_reduce))
  end
end

--- The peak per rank and, with a device, the verdict (memory.peak, memory.fit).
function M.peak_lines(plan, add)
  local m = plan.memory
  if not m.peak then return end
  local fit = m.fit
  local run = m.runs[1]
  if fit then
    for _, r in ipairs(m.runs) do
      if r.first == fit.worst.rank then run = r end
    end
  end
  local t = plan_memory.terms_of(m, run)
  local parts = {}
  for _, k in ipairs(plan_memory.PEAK_TERMS) do
    if (t[k] or 0) > 0 then parts[#parts + 1] = k:gsub("_", " ") .. " " .. util.bytes(t[k]) end
  end
  if (run.offloaded or 0) > 0 then parts[#parts + 1] = "less " .. util.bytes(run.offloaded) .. " offloaded" end
  if not fit then
    add(string.format("peak per rank (rank 0, estimate): %s = %s; give --device to check it against a GPU's memory",
      util.bytes(run.peak), table.concat(parts, " + ")))
    return
  end
  local w = fit.worst
  if fit.fits then
    add(string.format("fits (estimate): every rank; the fullest, rank %d, peaks at %s of %s (%s headroom)", w.rank,
      util.bytes(w.peak), util.bytes(m.capacity), util.bytes(w.headroom)))
  else
    add(string.format("does not fit (estimate): %d of %d ranks need more than %s; the fullest, rank %d, peaks at %s, " ..
      "over by %s; its largest term: %s, %s", fit.over, plan.mesh.world, util.bytes(m.capacity), w.rank,
      util.bytes(w.peak), util.bytes(-w.headroom), w.largest.name:gsub("_", " "), util.bytes(w.largest.bytes)))
  end
  add("  rank " .. w.rank .. ": " .. table.concat(parts, " + "))
end

--- The plan as text: units, expert parallelism, memory per rank, communication, warnings.
--- The recipe's steps, in the order they ran, with the modules each changed (the first few
-- named; --json lists all).
function M.recipe_lines(plan, add)
  local r = plan.recipe
  if not r then return end
  add(string.format("recipe  %s: %d step%s, then the %s manager shards", r.file, #r.steps, #r.steps == 1 and "" or "s",
    r.manager))
  for i, st in ipairs(r.steps) do
    local names = {}
    for k = 1, math.min(#st.changed, 3) do names[k] = st.changed[k] end
    add(string.format("  %d. %-12s %s", i, st.name, st.summary or ""))
    if #st.changed > 0 then
      add(string.format("     changed %s%s", table.concat(names, ", "),
        #st.changed > 3 and string.format(" and %d more", #st.changed - 3) or ""))
    end
  end
  if #r.notes > 0 then
    add("  fields that change no plan: " .. table.concat(r.notes, "; "))
  end
end

--- The recipe as JSON (null without one).
function M.recipe_json(plan)
  local r = plan.recipe
  if not r then return "null" end
  local steps = {}
  for i, st in ipairs(r.steps) do
    steps[i] = jobj({ { "name", jstr(st.name) }, { "summary", jstr(st.summary or "") }, { "changed", jstrs(st.changed) } })
  end
  return jobj({ { "file", jstr(r.file) }, { "manager", jstr(r.manager) }, { "steps", "[" .. table.concat(steps, ",") .. "]" },
    { "notes", jstrs(r.notes) } })
end

function M.to_text(plan, opts)
  opts = opts or {}
  local out = {}
  local function add(s) out[#out + 1] = s end
  local mesh = plan.mesh
  add(string.format("model   %s (%s): %s params, %s", plan.model.name, plan.model.architecture,
    util.thousands(plan.model.params), util.bytes(plan.model.bytes)))
  if plan.model.convention then add("        built as " .. plan.model.convention) end
  -- what shards over the data-parallel axes is the manager's; experts only where there are
  local over = ({ ddp = "DDP replicas over", megatron_fsdp = "Megatron-FSDP over" })[plan.manager] or "FSDP over"
  add(string.format("mesh    %s (world %d); %s %s%s", mesh:describe(), mesh.world, over,
    table.concat(mesh.fsdp_axes, " x "), (mesh:size("ep") > 1 or #plan.owned > 0) and
    string.format("; experts over ep=%d, ep_shard=%d", mesh:size("ep"), mesh:size("ep_shard")) or ""))
  if plan.manager and plan.manager ~= "fsdp2" then add("manager " .. plan.manager) end
  if opts.policy then add("policy  " .. opts.policy) end
  M.recipe_lines(plan, add)
  if plan.options and #plan.options > 0 then
    local parts = {}
    for i, op in ipairs(plan.options) do
      parts[i] = op.name .. "=" .. plan_mod.option_text(op.value) .. (op.set and " (set)" or "")
    end
    add("options " .. table.concat(parts, ", "))
  end
  if plan.prefetch then
    add(string.format("prefetch forward %d, backward %d", plan.prefetch.forward, plan.prefetch.backward))
  end
  local tk = plan.tokens
  if tk then
    add(string.format("batch   seq_len %d, micro-batch %d, global batch %d: %d micro-batch%s a step on each " ..
      "data-parallel rank", tk.seq_len, tk.micro_batch, tk.global_batch, tk.accumulation,
      tk.accumulation == 1 and "" or "es"))
  end
  local tp = plan.tensor_parallel
  if tp then
    local matched, unmatched = 0, {}
    for _, r in ipairs(tp.plan) do
      if r.modules > 0 then matched = matched + 1 else unmatched[#unmatched + 1] = r.pattern end
    end
    add(string.format("tensor parallel tp=%d%s: %d parameters placed by %d of %d patterns%s; the units below " ..
      "hold each tp rank's slice", tp.size, tp.sequence_parallel and ", sequence parallel" or "", tp.count, matched,
      #tp.plan, #unmatched > 0 and " (matching nothing: " .. table.concat(unmatched, ", ") .. ")" or ""))
  end
  local pl = plan.pipeline
  if pl then
    add(string.format("pipeline %s over pp=%d: %d stages (%d a rank, %s placement)%s", pl.schedule,
      mesh:size("pp"), #pl.stages, pl.stages_per_rank, pl.placement, pl.microbatches and
      string.format(", %d micro-batches a step", pl.microbatches) or ""))
    local function cost(v)
      return pl.metric == "memory" and util.thousands(math.floor(v + 0.5)) .. " params" or
        string.format("%.3g GFLOP a token", v / 1e9)
    end
    if pl.split == "automodel" then
      add(string.format("  split as NeMo Automodel splits (layers evenly, the remainder to the first stages): the " ..
        "costliest stage %s forward; balanced (pipeline split \"compute\") it would be %s", cost(pl.max_cost),
        cost(pl.balanced_max)))
    else
      add(string.format("  split balanced by %s, the embeddings and head weighed in: the costliest stage %s%s; " ..
        "NeMo Automodel's split: %s", pl.metric, cost(pl.max_cost), pl.metric == "compute" and " forward" or "",
        cost(pl.automodel_max)))
    end
    for _, s in ipairs(pl.stages) do
      local extra = {}
      for _, name in ipairs(s.modules) do
        if not name:match("^model%.layers%.%d+$") then extra[#extra + 1] = name end
      end
      add(string.format("  stage %d on pp rank %d: layers %s%s; %s params%s; %s a rank%s", s.index, s.pp_rank,
        s.layers.count > 0 and string.format("%d-%d", s.layers.first, s.layers.first + s.layers.count - 1) or "none",
        #extra > 0 and " + " .. table.concat(extra, ", ") or "", util.thousands(s.params),
        pl.metric == "compute" and string.format(", %.3g GFLOP a token", s.cost / 1e9) or "", util.bytes(s.memory),
        pl.in_flight and string.format("; %d micro-batch activations kept at the peak", pl.in_flight[s.pp_rank + 1]) or ""))
    end
  end
  if plan.checkpointed and #plan.checkpointed > 0 then
    local c = plan.checkpointed
    add(string.format("activation checkpointing: %d module%s: %s", #c, #c == 1 and "" or "s",
      table.concat(c, ", ", 1, math.min(#c, 16)) .. (#c > 16 and string.format(" (and %d more)", #c - 16) or "")))
  end
  add("")
  local nw, mw, offload, replicated = 12, 4, false, false
  for _, u in ipairs(plan.units) do
    nw = math.max(nw, #(u.name == "" and "<root>" or u.name))
    mw = math.max(mw, #table.concat(u.mesh_axes, ","))
    offload = offload or u.offload ~= nil
    replicated = replicated or u.all_reduce_bytes > 0
  end
  -- the all_reduce (HSDP) and offload columns only when some unit has them, so other plans
  -- read as before
  local staged = plan.pipeline ~= nil
  -- the kind column fits the longest kind (megatron_fsdp)
  local kw = 11
  for _, u in ipairs(plan.units) do kw = math.max(kw, #u.kind) end
  add(string.format("%4s  %s  %s %s %12s %6s %6s %-7s %10s %10s", "#", pad("unit", nw), pad("kind", kw), pad("mesh", mw),
    "params", "gather", "reduce", "reshard", "AG/step", "RS/step") .. (replicated and string.format(" %10s", "AR/step")
    or "") .. (offload and "  offload" or "") .. (staged and "  stage" or ""))
  for i, u in ipairs(plan.units) do
    local g, r = dtypes_str(u)
    local raf = u.reshard
    add(string.format("%4d  %s  %s %s %12s %6s %6s %-7s %10s %10s", i, pad(u.name == "" and "<root>" or u.name, nw),
      pad(u.kind, kw), pad(table.concat(u.mesh_axes, ","), mw), util.thousands(u.numel), g, r,
      (u.kind == "replicate" or u.kind == "megatron_fsdp") and "-" or tostring(raf), util.bytes(u.all_gather_bytes),
      util.bytes(u.reduce_scatter_bytes)) .. (replicated and string.format(" %10s", util.bytes(u.all_reduce_bytes))
      or "") .. (offload and "  " .. (u.offload or "-") or "") .. (staged and string.format("  %5d", u.stage) or ""))
  end
  M.packed_lines(plan, add)
  for _, u in ipairs(plan.units) do
    if u.kind == "replicate" then M.bucket_lines(u, plan.mesh, add) end
    if u.kind == "megatron_fsdp" then require("moonshard.plan_megatron").lines(u, plan.mesh, add) end
  end
  if #plan.owned > 0 then
    local n, bytes = 0, 0
    for _, o in ipairs(plan.owned) do
      local k = 1
      for _, s in ipairs(o.shape) do k = k * s end
      n, bytes = n + k, bytes + k * plan_mod.DTYPE_SIZE[o.dtype]
    end
    add("")
    add(string.format("expert parallelism owns %d parameters (%s params, %s): %s over ep=%d, e.g. %s -> [%s] per rank",
      #plan.owned, util.thousands(n), util.bytes(bytes), table.concat(plan.owned[1].placements, ","), mesh:size("ep"),
      plan.owned[1].fqn, table.concat(plan.owned[1].local_shape, ", ")))
  end
  local m = plan.memory
  local lo, hi = m.optimizer, m.optimizer
  for _, r in ipairs(m.runs) do lo, hi = math.min(lo, r.optimizer), math.max(hi, r.optimizer) end
  add("")
  add(string.format("memory per rank (%s): params %s, grads %s, optimizer %s (%s), peak unsharded %s, total %s",
    lo == hi and #m.runs == 1 and "every rank alike" or "rank 0; ranks differ", util.bytes(m.params), util.bytes(m.grads),
    util.bytes(m.optimizer), plan.optimizer or "adamw", util.bytes(m.peak_unsharded), util.bytes(m.total)))
  local pf, other = plan.prefetch, m.peak_unsharded_other
  add(string.format("  peak unsharded with prefetch forward %d, backward %d: %s; with forward %d, backward %d " ..
    "(%s): %s", pf.forward, pf.backward, util.bytes(m.peak_unsharded), other.prefetch.forward,
    other.prefetch.backward, other.prefetch.backward == 2 and "Automodel's enable_fsdp2_prefetch" or
    "FSDP2's implicit prefetch", util.bytes(other.bytes)))
  if m.buffers > 0 then
    add(string.format("  buffers on every rank (never sharded): %s", util.bytes(m.buffers)))
  end
  if lo ~= hi then
    add(string.format("  optimizer state differs across ranks by %s: from %s to %s bytes (AdamW keeps the rows " ..
      "a rank holds)", util.bytes(hi - lo), util.thousands(lo), util.thousands(hi)))
  end
  if m.offloaded > 0 then
    add(string.format("  offloaded to host memory (offload_policy cpu): %s of the params, grads and optimizer " ..
      "state; on the device: %s", util.bytes(m.offloaded), util.bytes(m.total - m.offloaded)))
  end
  for _, line in ipairs(activations.lines(plan, util.bytes)) do add(line) end
  M.peak_lines(plan, add)
  add("communication per step and rank (bus bytes):")
  local tp_note = plan.comm.all_reduce.uncounted_tp and string.format("  (+ tensor parallelism's activations over " ..
    "tp = %d: give the batch, --seq-len, to count them)", plan.comm.all_reduce.uncounted_tp)
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    local c = plan.comm[k]
    add(string.format("  %-15s %5d x  %s%s", k, c.count, util.bytes(c.bytes),
      c.uncounted_ep and string.format("  (+ expert parallelism's tokens over ep = %d, not counted)",
        c.uncounted_ep) or (k == "all_reduce" and tp_note) or (c.uncounted_cp and string.format("  (+ context " ..
        "parallelism's keys and values over cp = %d: give the batch, --seq-len, to count them)", c.uncounted_cp)) or ""))
  end
  -- a breakdown's phases as "forward 5 all_reduce (3.8 KiB); backward ..."
  local function phases_text(t, kinds)
    local parts = {}
    for _, ph in ipairs({ "forward", "backward" }) do
      local q = {}
      for _, k in ipairs(kinds) do
        local c = t[ph][k]
        if c.count > 0 then q[#q + 1] = string.format("%d %s (%s)", c.count, k, util.bytes(c.bytes)) end
      end
      parts[#parts + 1] = ph .. " " .. (q[1] and table.concat(q, ", ") or "none")
    end
    return table.concat(parts, "; ")
  end
  local tpc = plan.comm.tensor_parallel
  if tpc then
    add(string.format("  of which tensor parallelism's activations over tp = %d, per micro-batch: %s", tpc.size,
      phases_text(tpc, TP_KINDS)))
    if tpc.norm_grads.count > 0 then
      add(string.format("    and once a step, the all_reduce of %d sequence-parallel norm gradients (%s)",
        tpc.norm_grads.count, util.bytes(tpc.norm_grads.bytes)))
    end
    add("    not counted: " .. table.concat(tpc.notes, "; "))
  end
  local cpc = plan.comm.context_parallel
  if cpc then
    add(string.format("  of which context parallelism's keys and values over cp = %d (%s, %d attention layers), per " ..
      "micro-batch: %s%s", cpc.size, cpc.rotate, cpc.layers, phases_text(cpc, CP_KINDS),
      cpc.skipped > 0 and string.format("; %d attention layers without k_proj and v_proj not counted", cpc.skipped) or ""))
  end
  if plan.comm.send_recv then
    add(string.format("  %-15s %5d x  %s  (sent to the neighbouring stages: activations, then their gradients)",
      "send_recv", plan.comm.send_recv.count, util.bytes(plan.comm.send_recv.bytes)))
  elseif pl then
    add("  send_recv           (the pipeline's activations between stages: give the batch, --seq-len, to count them)")
  end
  require("moonshard.plan_time").text(plan, add)
  if #plan.warnings > 0 then
    add("")
    add("warnings:")
    for _, w in ipairs(plan.warnings) do add("  - " .. w) end
  end
  return table.concat(out, "\n") .. "\n"
end

--- The dtype audit as text: every parameter's stored, gathered and reduced dtype.
function M.audit_text(plan)
  local rows = plan_mod.audit(plan)
  local w = 10
  for _, a in ipairs(rows) do w = math.max(w, #a.fqn) end
  local tagged = plan.recipe ~= nil
  local out = { string.format("%s  %-6s %-8s %-8s %-11s %s%s", pad("parameter", w), "stored", "gathered", "reduced",
    "kind", "unit", tagged and "  [recipe steps]" or "") }
  local counts = {}
  for _, a in ipairs(rows) do
    -- (an island packed into a unit: "island", its own dtypes beside the unit's)
    out[#out + 1] = string.format("%s  %-6s %-8s %-8s %-11s %s%s", pad(a.fqn, w), a.stored, a.gathered, a.reduced or "-",
      a.island and "island" or a.kind, a.unit and (a.unit == "" and "<root>" or a.unit) or "-",
      tagged and #a.steps > 0 and "  [" .. table.concat(a.steps, ", ") .. "]" or "")
    if a.reduced then counts[a.reduced] = (counts[a.reduced] or 0) + 1 end
  end
  local keys = {}
  for k in pairs(counts) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = string.format("%d in %s", counts[k], k) end
  out[#out + 1] = "gradients reduced: " .. table.concat(parts, ", ")
  return table.concat(out, "\n") .. "\n"
end

-- ---------------------------------------------------------------- one rank

-- The axes a rank has a coordinate on: the root mesh's, then with ep > 1 the MoE mesh's.
local VIEW_AXES = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }

--- What rank r holds: {rank, coords = {{axis, coordinate}...}, params = {{fqn, local_shape,
-- placements, axes, unit}...} in named_parameters() order, memory = its run of
-- memory.per_rank}.  A parameter in a unit holds its torch.chunk piece along the unit's
-- shard axis (of the shape FSDP shards: tp- or ep-local); one expert parallelism owns and no
-- unit shards, its experts; any other, its whole (tp-local) shape, as a plain tensor.
function M.rank_view(plan, r)
  local mesh = plan.mesh
  if not util.is_int(r) or r < 0 or r >= mesh.world then
    error(string.format("moonshard: plan: --rank %s: expected a rank 0..%d of the world of %d", tostring(r),
      mesh.world - 1, mesh.world), 0)
  end
  local coords = {}
  for _, a in ipairs(VIEW_AXES) do coords[#coords + 1] = { a, mesh:coord(a, r) } end
  if mesh:size("ep") > 1 then
    coords[#coords + 1] = { "ep_shard", mesh:coord("ep_shard", r) }
    coords[#coords + 1] = { "ep", mesh:coord("ep", r) }
  end
  local in_unit, owned = {}, {}
  for _, u in ipairs(plan.units) do
    for _, e in ipairs(u.entries) do in_unit[e.param] = { unit = u, entry = e } end
  end
  for _, o in ipairs(plan.owned) do owned[o.fqn] = o end
  local tp = plan.tensor_parallel and plan.tensor_parallel.params
  -- under a pipeline, the rank holds its own stages' parameters only
  local stages, mine
  if plan.pipeline then
    stages, mine = {}, {}
    local pr = mesh:coord("pp", r)
    for _, st in ipairs(plan.pipeline.stages) do
      if st.pp_rank == pr then
        stages[#stages + 1] = st.index
        for _, name in ipairs(st.modules) do mine[#mine + 1] = name end
      end
    end
  end
  local function held(fqn)
    if not mine then return true end
    for _, name in ipairs(mine) do
      if fqn:sub(1, #name + 1) == name .. "." then return true end
    end
    return false
  end
  local params = {}
  for _, np in ipairs(plan.params) do
    local fqn, p = np[1], np[2]
    local iu, o, t = in_unit[p], owned[fqn], tp and tp[p]
    if held(fqn) then
    local shape, placements, axes, unit
    local padded, gather, reduce, packed
    if iu then
      local u, e = iu.unit, iu.entry
      -- (a replicate unit's one shard rank: every rank holds coordinate 0's, the whole)
      local W, c = u.shard_size, u.kind == "replicate" and 0 or mesh:coord(u.mesh_axes[#u.mesh_axes], r)
      -- the shape FSDP shards on this rank: its tp coordinate's piece of a tensor-parallel one
      local base = t and t.local_shapes[mesh:coord("tp", r) + 1] or e.shape
      local n = base[e.dim + 1]
      local chunk = util.ceil_div(n, W)
      local start = math.min(n, c * chunk)
      shape = util.copy(base)
      shape[e.dim + 1] = math.max(0, math.min(n, start + chunk) - start)
      padded = util.copy(base)
      padded[e.dim + 1] = chunk
      placements, axes = plan_mod.placements(mesh, tp, u, p, e.dim)
      unit = u.name
      gather, reduce, packed = e.gather, (p.requires_grad and FLOATING[p.dtype]) and e.reduce or nil, u.packed
    elseif o then
      shape, placements, axes = util.copy(o.local_shape), {}, {}
    elseif t then
      shape, placements, axes = util.copy(t.local_shapes[mesh:coord("tp", r) + 1]),
        { t.dim and string.format("Shard(%d)", t.dim) or "Replicate()" }, { "tp" }
    else
      shape, placements, axes = util.copy(p.shape), {}, {}
    end
    if o then -- expert parallelism's split over ep, innermost
      for _, pl in ipairs(o.placements) do placements[#placements + 1] = pl end
      axes[#axes + 1] = "ep"
    end
    params[#params + 1] = { fqn = fqn, local_shape = shape, padded = padded, placements = placements, axes = axes,
      unit = unit, gather = gather, reduce = reduce, packed = packed }
    end
  end
  local memory
  for _, run in ipairs(plan.memory.runs) do
    if r >= run.first and r < run.first + run.count then memory = run end
  end
  return { rank = r, coords = coords, params = params, memory = memory, stages = stages }
end

--- The rank view as text.
function M.rank_text(plan, view)
  local out, parts = {}, {}
  for i, c in ipairs(view.coords) do parts[i] = c[1] .. "=" .. c[2] end
  local m = plan.memory
  out[1] = string.format("rank %d: %s%s", view.rank, table.concat(parts, ", "), view.stages and
    string.format("; pipeline stage%s %s (their parameters only)", #view.stages == 1 and "" or "s",
      table.concat(view.stages, ", ")) or "")
  local run = view.memory
  out[2] = string.format("  holds params %s, grads %s, optimizer %s, peak unsharded %s, total %s",
    util.bytes(run.params or m.params), util.bytes(run.grads or m.grads), util.bytes(run.optimizer),
    util.bytes(run.peak_unsharded or m.peak_unsharded), util.bytes(run.total))
  local fw = 9
  for _, p in ipairs(view.params) do fw = math.max(fw, #p.fqn) end
  out[3] = string.format("  %s  %-20s %s", pad("parameter", fw), "local shape", "placements (axes), unit")
  for _, p in ipairs(view.params) do
    local pl = {}
    for i, x in ipairs(p.placements) do pl[i] = x .. " " .. p.axes[i] end
    out[#out + 1] = string.format("  %s  %-20s %s%s", pad(p.fqn, fw), "[" .. table.concat(p.local_shape, ", ") .. "]",
      #pl > 0 and table.concat(pl, ", ") or "whole", p.unit and "; unit " .. (p.unit == "" and "<root>" or p.unit) or "") ..
      -- in a packed unit each parameter has its own dtypes
      (p.packed and string.format(" (packed: gathers %s, reduces %s)", p.gather, p.reduce or "-") or "")
  end
  return table.concat(out, "\n") .. "\n"
end

--- The rank view as the plan JSON's "rank_view" value.
function M.rank_json(view)
  local coords, params = {}, {}
  for i, c in ipairs(view.coords) do coords[i] = { c[1], jnum(c[2]) } end
  for i, p in ipairs(view.params) do
    params[i] = { p.fqn, jobj({ { "local_shape", jints(p.local_shape) },
      { "padded_shard_shape", p.padded and jints(p.padded) or "null" }, { "placements", jstrs(p.placements) },
      { "placement_axes", jstrs(p.axes) }, { "unit", p.unit and jstr(p.unit) or "null" },
      { "gather_dtype", jstr(p.gather) }, { "reduce_dtype", jstr(p.reduce) } }) }
  end
  local fields = { { "rank", jnum(view.rank) }, { "coords", jobj(coords) } }
  if view.stages then fields[#fields + 1] = { "stages", jints(view.stages) } end
  fields[#fields + 1] = { "params", jobj(params) }
  return jobj(fields)
end

return M
