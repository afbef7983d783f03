-- moonshard.checkpoint_hf: a Hugging Face checkpoint (safetensors) loaded into a rank's shard
-- units, each rank reading only the bytes of what it holds.
--
--   local hf = require "moonshard.checkpoint_hf"
--   local state = require("moonshard.runtime").materialize(plan)
--   local report = hf.load_hf(state, "path/to/model_dir", { })
--
-- load_hf(target, path, opts?) -> report
--   target  the rank state materialize returns (its units, ep-local units, replicate buckets,
--           Megatron-FSDP buckets and its plan), or a plain list of units (no plan: every
--           parameter is read as its checkpoint tensor, whole on dim 0 of the experts).
--   path    a .safetensors file, a model.safetensors.index.json, or a directory holding one
--           of them (the index first, then model.safetensors, then its only *.safetensors).
--   opts    strict (default true): checkpoint tensors that no parameter takes are errors;
--           false lists them in report.unexpected instead.
--           ignore: a list of Lua patterns of checkpoint names left alone (never unexpected).
--   report  {tensors = checkpoint tensors the rank read from, params = the parameter shards
--           written, bytes_read = the bytes this rank read (one pread a region), reads = the
--           number of preads, data_bytes = the bytes of every tensor of the checkpoint,
--           unexpected = {...} (strict = false), skipped = {buffers the checkpoint holds,
--           which units do not}, files = {the .safetensors files}}.
--
-- What it does, as Automodel's checkpoint loading with its state-dict adapters does:
--   * A parameter named in the checkpoint is read as its rows of the shard's dim (the unit's
--     param_offset), cast from the checkpoint dtype to the unit's stored dtype with moonshard's
--     casts (bit for bit torch's .to()).  Under tensor parallelism a rank's unit holds its tp
--     coordinate's piece, cut as torch.chunk cuts it (M.tp_offsets), so its box starts that
--     piece's rows further on the split dim.
--   * Grouped experts (`<p>.experts.gate_and_up_projs` [E, H, 2I], `<p>.experts.down_projs`
--     [E, I, H]) from Hugging Face's per-expert tensors `<p>.experts.{e}.gate_proj.weight`,
--     `up_proj.weight` [I, H] and `down_proj.weight` [H, I], as Automodel's
--     _from_hf_w_merged_experts builds them: gate_and_up_projs[e] = cat(gate^T, up^T, dim=-1),
--     down_projs[e] = down^T; without gate_proj tensors (a non-gated MoE) gate_and_up_projs[e]
--     = up^T.  Under expert parallelism a rank reads only its ep-local experts (ep coordinate
--     c of ep: experts [c E/ep, (c+1) E/ep)).
--   * Tied weights (lm_head.weight and model.embed_tokens.weight one parameter) are read once,
--     from whichever name the checkpoint holds; the other name is not unexpected.
--   * Every missing, unexpected or mis-shaped tensor is named, all of them in one error,
--     before anything is written into a unit.  Every rank checks the whole checkpoint against
--     the whole plan, so all ranks fail alike.
--   * A unit that has stepped (its f32 master weights exist) gets them loaded too, from the
--     checkpoint values, as load_full does.

local ms = require "moonshard"
local R = require "moonshard.raw"
local st = require "moonshard.safetensors"
local module = require "moonshard.module"
local util = require "moonshard.util"

local M = {}

local format = string.format

local function fail(msg) error("moonshard: checkpoint_hf: " .. msg, 0) end

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

--- resolve(path) -> the file to read headers from (an index or a .safetensors file).
function M.resolve(path)
  if type(path) ~= "string" or path == "" then fail("path: expected a file or directory name, got " .. tostring(path)) end
  local stat = util.file_stat_fn()
  if stat and stat(path) == "directory" then
    local dir = path:gsub("/+$", "")
    for _, name in ipairs({ "model.safetensors.index.json", "model.safetensors" }) do
      if util.exists(dir .. "/" .. name) then return dir .. "/" .. name end
    end
    for _, name in ipairs({ "checkpoint.json", "latest" }) do
      if util.exists(dir .. "/" .. name) then
        fail(format("%s is a moonshard checkpoint (it holds %s), not a Hugging Face one: load it with " ..
          "checkpoint.load (the trainer's --resume), or export it first: moonshard checkpoint export %s --to OUT",
          path, name, path))
      end
    end
    fail(format("%s: a directory without model.safetensors.index.json or model.safetensors (name the index or " ..
      "the .safetensors file)", path))
  end
  return path
end

--- read_tensors(path) -> {name -> {name, dtype, shape, file, offset (absolute byte of its
-- data)}}, the list of files, the total data bytes.  Headers only.
function M.read_tensors(path)
  local file = M.resolve(path)
  local list
  if file:match("%.json$") then list = st.read_index(file) else list = st.read_header(file) end
  local by_name, seen, files, total = {}, {}, {}, 0
  for _, t in ipairs(list) do
    if not seen[t.file] then
      seen[t.file] = true
      files[#files + 1] = t.file
    end
    by_name[t.name] = { name = t.name, dtype = t.dtype, shape = t.shape, file = t.file,
      offset = t.data_start + t.data_offsets[1] }
    total = total + (t.data_offsets[2] - t.data_offsets[1])
  end
  return by_name, files, total
end

-- ---------------------------------------------------------------- what the rank holds

--- tp_offsets(plan, rank) -> {fqn -> {dim, off}}: under tensor parallelism each parameter
-- split over tp holds its tp coordinate's piece, cut as torch.chunk cuts it (the plan's
-- local_shapes per coordinate), so the piece is a box of the global tensor offset on the split
-- dim by the rows of the coordinates before it.  Empty when the plan has no tp.
function M.tp_offsets(plan, rank)
  local out = {}
  local mc = plan.mesh
  local tpp = plan.tensor_parallel and mc:size("tp") > 1 and plan.tensor_parallel.params
  if not tpp then return out end
  local c = mc:coord("tp", rank)
  for _, pu in ipairs(plan.units) do
    for _, e in ipairs(pu.entries or {}) do
      local t = tpp[e.param]
      if t and t.dim then
        local at = 0
        for k = 1, c do at = at + t.local_shapes[k][t.dim + 1] end
        out[e.fqn] = { dim = t.dim, off = at }
      end
    end
  end
  return out
end

-- The parameters the target holds: slots {fqn (checkpoint name), global shape (nil: unknown),
-- ep_offset (first expert of the rank), write(kind, fn)}; and the full list of expected
-- parameters {fqn -> global shape} (from the plan; the units' own when there is none), the
-- tied aliases {name -> the planned name} and the buffer names.
local function collect(target)
  local slots, expected, order, aliases, buffers = {}, {}, {}, {}, {}
  local function expect(fqn, shape)
    fqn = module.strip_checkpoint(fqn)
    if not expected[fqn] then order[#order + 1] = fqn end
    expected[fqn] = shape
    return fqn
  end
  local is_state = type(target) == "table" and type(target.units) == "table"
  local units = is_state and target.units or target
  if type(units) ~= "table" then
    fail("load_hf: expected a rank state (require('moonshard.runtime').materialize(plan)) or a list of units, got " ..
      tostring(target))
  end
  local plan = is_state and target.plan or nil
  local global, local_shape, tpoff = {}, {}, {}
  local ep_coord = 0
  if plan then
    tpoff = M.tp_offsets(plan, ms.rank())
    ep_coord = plan.mesh:coord("ep", ms.rank())
    for _, pu in ipairs(plan.units) do
      for _, e in ipairs(pu.entries or {}) do global[module.strip_checkpoint(e.fqn)] = e.param.shape end
      if pu.megatron then
        for _, it in ipairs(pu.megatron.items) do global[module.strip_checkpoint(it.fqn)] = it.shape end
      end
      for _, b in ipairs(pu.buckets or {}) do
        for i, p in ipairs(b.params or {}) do global[module.strip_checkpoint(b.fqns[i])] = p.shape end
      end
    end
    for _, o in ipairs(plan.owned or {}) do
      global[module.strip_checkpoint(o.fqn)] = o.shape
      local_shape[module.strip_checkpoint(o.fqn)] = o.local_shape
    end
    -- every planned parameter, whatever stage or rank holds it; tied names; buffers
    local tree = plan.model_tree
    if tree then
      local first = {}
      for _, nm in ipairs(tree:named_modules()) do
        local mname, m = nm[1], nm[2]
        for _, pname in ipairs(m.param_order) do
          local p = m.params[pname]
          local fqn = module.strip_checkpoint(mname == "" and pname or mname .. "." .. pname)
          if first[p] then aliases[fqn] = first[p] else first[p] = fqn end
        end
      end
      for _, b in ipairs(tree:named_buffers()) do buffers[module.strip_checkpoint(b[1])] = true end
    end
    for _, fqn in ipairs(util.sorted_keys(global)) do
      if not expected[fqn] then expect(fqn, global[fqn]) end
    end
  end
  local zero_units = {}
  for _, bk in ipairs(is_state and target.buckets or {}) do zero_units[bk.unit] = true end
  for _, u in ipairs(units) do
    if not zero_units[u] then
      for i = 0, u:count() - 1 do
        local fqn = module.strip_checkpoint(u:fqn(i))
        local shard = u:param_shard(i)
        local offset, rows, dim = u:param_offset(i)
        local ls = util.copy(shard:shape())
        ls[dim + 1] = nil
        local g = global[fqn]
        -- the unit-level (ep-local) shape: the plan's, else the shard's with dim whole
        local lshape = local_shape[fqn] or g
        local ep_offset = 0
        if g and lshape and lshape[1] ~= g[1] then ep_offset = ep_coord * lshape[1] end
        if not plan then expect(fqn, nil) end
        slots[#slots + 1] = { fqn = fqn, unit = u, index = i, shard = shard, dim = dim, offset = offset, rows = rows,
          global = g, ep_offset = ep_offset, tp = tpoff[u:fqn(i)], master = u:adamw_state(i, "master") }
      end
    end
  end
  -- Megatron-FSDP buckets: under ZeRO-3 (optim_grads_params) the rank holds its piece
  -- [a, b) of the flattened parameter, its f32 main weights too; under ZeRO-0..2 the whole
  -- parameter (read whole, as one box) and the piece's main weights
  for _, bk in ipairs(is_state and target.buckets or {}) do
    for i = 0, bk:count() - 1 do
      local fqn = module.strip_checkpoint(bk:fqn(i))
      local a, b = bk:piece(i)
      if bk.strategy == "optim_grads_params" then
        slots[#slots + 1] = { fqn = fqn, flat = true, start = a, stop = b, shard = bk:piece_tensor(i, "param"),
          master = bk:piece_tensor(i, "main"), global = global[fqn], ep_offset = 0 }
      else
        local full = bk:param(i)
        local shape = full:shape()
        slots[#slots + 1] = { fqn = fqn, shard = full, dim = 0, offset = 0, rows = shape[1] or 1, global = global[fqn],
          ep_offset = 0 }
        local main = bk:piece_tensor(i, "main")
        if main then
          slots[#slots + 1] = { fqn = fqn, flat = true, start = a, stop = b, shard = main, global = global[fqn],
            ep_offset = 0, extra = true }
        end
      end
      if not plan then expect(fqn, nil) end
    end
  end
  return slots, expected, order, aliases, buffers
end

-- ---------------------------------------------------------------- matching the checkpoint

--- expert_parts(fqn, shape, gated) -> nil when fqn is not a grouped expert tensor
-- (`<p>.experts.gate_and_up_projs` [E, H, X] or `<p>.experts.down_projs` [E, I, H]); else the
-- prefix `<p>.experts`, the per-expert parts {{proj = "gate_proj"|"up_proj"|"down_proj",
-- shape = the Hugging Face shape, col = its first column in grouped[e]}}, I and the kind
-- ("gate_and_up" or "down").  Expert e's tensor `<p>.experts.e.proj.weight` is the transpose
-- of grouped[e][:, col:col + shape[1]], as Automodel's state-dict adapters map them:
-- gate_and_up_projs[e] = cat(gate^T, up^T, dim=-1) (up^T alone when not gated), down_projs[e]
-- = down^T.  The loader below reads by this rule, checkpoint.export_dir writes by it.
function M.expert_parts(fqn, shape, gated)
  if not shape or #shape ~= 3 then return nil end
  local prefix = fqn:match("^(.*%.experts)%.gate_and_up_projs$")
  if not prefix then
    prefix = fqn:match("^(.*%.experts)%.down_projs$")
    if not prefix then return nil end
    local I, H = shape[2], shape[3]
    return prefix, { { proj = "down_proj", shape = { H, I }, col = 0 } }, I, "down"
  end
  local H = shape[2]
  local I = gated and shape[3] / 2 or shape[3]
  if gated then
    return prefix, { { proj = "gate_proj", shape = { I, H }, col = 0 }, { proj = "up_proj", shape = { I, H }, col = I } },
      I, "gate_and_up"
  end
  return prefix, { { proj = "up_proj", shape = { I, H }, col = 0 } }, I, "gate_and_up"
end


-- How each expected parameter comes from the checkpoint: {kind = "direct", t = tensor} or
-- {kind = "gate_and_up"|"down", gated, experts = {e -> {gate=, up=, down=}}, inter}.
-- Appends to missing, misshaped; marks used names.
local function match(expected, order, tensors, aliases, missing, misshaped, used)
  local sources = {}
  local alias_of = {} -- planned name -> the checkpoint names that may hold it
  for a, p in pairs(aliases) do
    alias_of[p] = alias_of[p] or {}
    table.insert(alias_of[p], a)
  end
  for _, list in pairs(alias_of) do table.sort(list) end
  for _, fqn in ipairs(order) do
    local shape = expected[fqn]
    local t = tensors[fqn]
    local name = fqn
    if not t then
      for _, a in ipairs(alias_of[fqn] or {}) do
        if tensors[a] then t, name = tensors[a], a break end
      end
    end
    local prefix = shape and #shape == 3 and (fqn:match("^(.*%.experts)%.gate_and_up_projs$") or
      fqn:match("^(.*%.experts)%.down_projs$"))
    if t then
      used[name] = true
      for _, a in ipairs(alias_of[fqn] or {}) do if tensors[a] then used[a] = true end end
      if tensors[fqn] then used[fqn] = true end
      if shape and not same_shape(shape, t.shape) then
        misshaped[#misshaped + 1] = format("%s: %s in the checkpoint, %s planned", name, shape_str(t.shape),
          shape_str(shape))
      end
      sources[fqn] = { kind = "direct", t = t }
    elseif prefix and shape and #shape == 3 then
      -- Hugging Face's per-expert tensors
      local E = shape[1]
      local gated = false
      for e = 0, E - 1 do
        if tensors[format("%s.%d.gate_proj.weight", prefix, e)] then gated = true end
      end
      local _, parts, I, kind = M.expert_parts(fqn, shape, gated)
      local src = { kind = kind, gated = gated, experts = {}, inter = I }
      for e = 0, E - 1 do
        src.experts[e] = {}
        for _, part in ipairs(parts) do
          local n = format("%s.%d.%s.weight", prefix, e, part.proj)
          local pt = tensors[n]
          if not pt then
            missing[#missing + 1] = n
          else
            used[n] = true
            if not same_shape(pt.shape, part.shape) then
              misshaped[#misshaped + 1] = format("%s: %s in the checkpoint, %s for %s %s", n, shape_str(pt.shape),
                shape_str(part.shape), fqn, shape_str(shape))
            end
            src.experts[e][part.proj:match("^(%a+)_")] = pt
          end
        end
      end
      sources[fqn] = src
    else
      missing[#missing + 1] = fqn
    end
  end
  return sources
end

local function listing(label, list)
  local shown = {}
  for i = 1, math.min(#list, 20) do shown[i] = list[i] end
  return format("%d %s: %s%s", #list, label, table.concat(shown, "; "),
    #list > 20 and format(" (and %d more)", #list - 20) or "")
end

-- ---------------------------------------------------------------- reading

local function reader(report)
  return function(t, start, perm, dst)
    local n, err = R.file_read_region(t.file, t.offset, R.dtype_code(t.dtype), t.shape, start, perm, dst)
    if not n then fail(t.name .. " " .. table.concat(t.shape, "x") .. " -> " .. table.concat(dst:shape(), "x") .. ": " .. tostring(err)) end
    report.bytes_read = report.bytes_read + n
    report.reads = report.reads + 1
    report.read_from[t.name] = true
  end
end

-- Writes one slot's values into dst (its shard, or its master weights).
local function fill_slot(read, slot, src, dst)
  if slot.flat then
    if slot.stop <= slot.start then return end
    if src.kind ~= "direct" then
      fail(format("%s: grouped experts in a Megatron-FSDP bucket are not loaded from per-expert tensors yet", slot.fqn))
    end
    -- the flat piece of a row-major tensor: its boxes in flat order (at most 2 x dims - 1)
    for _, b in ipairs(require("moonshard.checkpoint").flat_boxes(src.t.shape, slot.start, slot.stop)) do
      read(src.t, b.off, nil, dst:narrow(0, b.start - slot.start, b.n):view(b.shape))
    end
    return
  end
  if src.kind == "direct" then
    local t = src.t
    -- the box's start in the checkpoint tensor: the shard's rows of its dim, and on dim 0
    -- the rank's first expert under expert parallelism (the box's sizes are dst's)
    if #t.shape == 0 then return read(t, {}, nil, dst) end
    if slot.rows == 0 then return end
    local lo = {}
    for d = 1, #t.shape do lo[d] = 0 end
    lo[slot.dim + 1] = slot.offset
    lo[1] = lo[1] + slot.ep_offset
    if slot.tp then lo[slot.tp.dim + 1] = lo[slot.tp.dim + 1] + slot.tp.off end
    return read(t, lo, nil, dst)
  end
  -- grouped experts: dst is [e_rows, a, b] of [E_l, H, X] (gate_and_up) or [E_l, I, H] (down)
  local shape = dst:shape()
  local lo = { 0, 0, 0 }
  lo[slot.dim + 1] = slot.offset
  if slot.tp then lo[slot.tp.dim + 1] = lo[slot.tp.dim + 1] + slot.tp.off end
  if slot.rows == 0 then return end
  for k = 0, shape[1] - 1 do
    local e = slot.ep_offset + lo[1] + k
    local de = dst:narrow(0, k, 1):view({ shape[2], shape[3] })
    local parts = src.experts[e]
    if src.kind == "down" then
      -- down_projs[e][i, h] = down[h, i]
      read(parts.down, { lo[3], lo[2] }, { 1, 0 }, de)
    else
      local I = src.inter
      local x0, x1 = lo[3], lo[3] + shape[3]
      local function part(t, c0, c1, base)
        if c1 > c0 then read(t, { c0 - base, lo[2] }, { 1, 0 }, de:narrow(1, c0 - x0, c1 - c0)) end
      end
      if src.gated then
        part(parts.gate, math.max(x0, 0), math.min(x1, I), 0)
        part(parts.up, math.max(x0, I), math.min(x1, 2 * I), I)
      else
        part(parts.up, x0, x1, 0)
      end
    end
  end
end

local F32_EXACT = { f32 = true, bf16 = true, f16 = true, f8e4m3 = true, f8e5m2 = true }

-- Whether every checkpoint tensor a source reads is of a dtype f32 holds exactly.
local function exact_in_f32(src)
  if src.kind == "direct" then return F32_EXACT[src.t.dtype] == true end
  for _, parts in pairs(src.experts) do
    for _, t in pairs(parts) do if not F32_EXACT[t.dtype] then return false end end
  end
  return true
end

--- load_hf(target, path, opts?) -> report (see the top of this file).
function M.load_hf(target, path, opts)
  opts = opts or {}
  if type(opts) ~= "table" then fail("load_hf: opts must be a table, got " .. type(opts)) end
  local strict = opts.strict ~= false
  local tensors, files, total = M.read_tensors(path)
  local slots, expected, order, aliases, buffers = collect(target)
  local missing, misshaped, used = {}, {}, {}
  local sources = match(expected, order, tensors, aliases, missing, misshaped, used)
  local unexpected, skipped = {}, {}
  for _, name in ipairs(util.sorted_keys(tensors)) do
    local ignored = buffers[name] or aliases[name] ~= nil
    for _, pat in ipairs(opts.ignore or {}) do if name:match(pat) then ignored = true end end
    if buffers[name] then skipped[#skipped + 1] = name end
    if not used[name] and not ignored then unexpected[#unexpected + 1] = name end
  end
  -- each slot's shard shape against the source (the plan agreed; a plain unit list is checked here)
  for _, s in ipairs(slots) do
    local src = sources[s.fqn]
    if src and src.kind == "direct" and not s.flat and not s.global then
      local want = util.copy(src.t.shape)
      want[s.dim + 1] = s.rows
      local have = s.shard:shape()
      if not same_shape(want, have) or s.offset + s.rows > (src.t.shape[s.dim + 1] or 0) then
        misshaped[#misshaped + 1] = format("%s: %s in the checkpoint, the unit's shard is %s at rows [%d, %d) of dim %d",
          s.fqn, shape_str(src.t.shape), shape_str(have), s.offset, s.offset + s.rows, s.dim)
      end
    end
  end
  local problems = {}
  if #missing > 0 then problems[#problems + 1] = listing("missing", missing) end
  if #misshaped > 0 then problems[#problems + 1] = listing("mis-shaped", misshaped) end
  if #unexpected > 0 and strict then problems[#problems + 1] = listing("unexpected", unexpected) end
  if #problems > 0 then
    fail(format("%s: the checkpoint does not fit the %s. %s. Nothing was loaded", path,
      target.plan and "plan" or "units", table.concat(problems, ". ")))
  end
  local report = { bytes_read = 0, reads = 0, read_from = {}, params = 0, data_bytes = total, files = files,
    unexpected = unexpected, skipped = skipped }
  local read = reader(report)
  for _, s in ipairs(slots) do
    local src = sources[s.fqn]
    -- the f32 master weights of a unit that keeps them (flat, in master mode): cast from the
    -- checkpoint's values.  A checkpoint dtype that f32 holds exactly is read once, into the
    -- master weights, and the shard is their cast (the same bits as the checkpoint's cast);
    -- another (f64) is read twice.
    local master = s.master
    if master and not s.flat and master:numel() ~= s.shard:numel() then
      fail(format("%s: master weights of %d elements for a shard of %d", s.fqn, master:numel(), s.shard:numel()))
    end
    if master and master:ndim() ~= s.shard:ndim() then master = master:view(s.shard:shape()) end
    if master and exact_in_f32(src) and master:dtype() == "f32" then
      fill_slot(read, s, src, master)
      s.shard:copy_(master)
    else
      fill_slot(read, s, src, s.shard)
      if master then fill_slot(read, s, src, master) end
    end
    if not s.extra then report.params = report.params + 1 end
  end
  local n = 0
  for _ in pairs(report.read_from) do n = n + 1 end
  report.tensors = n
  return report
end

return M
