-- moonshard.checkpoint: distributed checkpoints of shard units (docs/checkpoints.md).
--
-- save(units, root, {step=, extra=, keep_last=}) is collective: every rank describes the
-- boxes it holds (which rows of which tensor: parameters, AdamW's moments and master weights),
-- the descriptions are all-gathered, and of the ranks holding the same box only the lowest
-- writes it (replicas, as DCP deduplicates them).  Each writing rank writes one safetensors
-- file; rank 0 then writes checkpoint.json (every box's global offsets, dtype, file, byte
-- offset and CRC32C, the mesh, the step, the caller's extra state).  Everything goes into
-- ROOT/.tmp-step_N, every file fsynced, then renamed to ROOT/step_N (the parent fsynced), then
-- ROOT/latest is replaced atomically and old checkpoints beyond keep_last are removed.
--
-- load(units, path) reads a checkpoint on any world size or mesh: each rank computes the
-- global box of each of its shards and reads, with pread, only the overlapping parts of the
-- saved boxes.  Every saved box is checksummed by one rank at least (those a rank reads whole,
-- and the rest round-robin), and a mismatch names the tensor and the file on every rank.

local ms = require "moonshard"
local R = require "moonshard.raw"
local json = require "moonshard.json"

local M = {}

local format = string.format
local unpack = table.unpack or unpack

M.INDEX = "checkpoint.json"
M.LATEST = "latest"
M.FORMAT = "moonshard.checkpoint"
M.VERSION = 1

local KINDS = { "param", "exp_avg", "exp_avg_sq", "master" }

local function fail(fmt, ...) error("moonshard: checkpoint: " .. format(fmt, ...), 0) end

local function check(v, err)
  if v == nil then error("moonshard: checkpoint: " .. tostring(err), 0) end
  return v
end

-- ---------------------------------------------------------------- files and directories

local function join(a, b) return a:sub(-1) == "/" and a .. b or a .. "/" .. b end

local function stat(path) return R.file_stat(path) end

local function is_dir(path) return stat(path) == "directory" end

local function is_file(path) return stat(path) == "regular file" end

local function read_text(path)
  local f, err = io.open(path, "rb")
  if not f then fail("cannot open %s: %s", path, tostring(err)) end
  local s = f:read("a")
  f:close()
  return s
end

-- A small file written in full and fsynced (then renamed into place by the caller).
local function write_text(path, text)
  local fd = check(R.ckpt_open(path, true))
  local okw, err = R.ckpt_write(fd, text)
  local okc, errc = R.ckpt_close(fd, true)
  if not okw then fail("%s: %s", path, err) end
  if not okc then fail("%s: %s", path, errc) end
end

local function remove_tree(path)
  if is_dir(path) then
    for _, name in ipairs(check(R.ckpt_list_dir(path))) do remove_tree(join(path, name)) end
  end
  local ok, err = os.remove(path)
  if not ok then fail("cannot remove %s: %s", path, tostring(err)) end
end

-- ---------------------------------------------------------------- progress (a terminal only)

local function human(b)
  local units = { "B", "KiB", "MiB", "GiB", "TiB" }
  local u = 1
  while b >= 1024 and u < #units do
    b, u = b / 1024, u + 1
  end
  return u == 1 and format("%d B", b) or format("%.1f %s", b, units[u])
end
M.human = human

-- progress(label, total, on): update(bytes done), finish().  Shown on stderr when it is a
-- terminal and the work has taken more than a second.
local function progress(label, total, on)
  local start, shown = os.time(), false
  local p = {}
  function p.update(done)
    if not on then return end
    local dt = os.difftime(os.time(), start)
    if dt < 1 then return end
    shown = true
    io.stderr:write(format("\rcheckpoint: %s %s of %s (%s/s)   ", label, human(done), human(total), human(done / dt)))
  end
  function p.finish()
    if shown then io.stderr:write("\n") end
  end
  return p
end

local function progress_on(opts)
  if opts.progress ~= nil then return opts.progress and true or false end
  return ms.rank() == 0 and R.stderr_isatty()
end

-- ---------------------------------------------------------------- agreement between ranks

local world_group
local function world()
  world_group = world_group or ms.mesh({ { "world", ms.world_size() } }):group("world")
  return world_group
end

-- Every rank's string, all-gathered (lengths, then the bytes padded to the longest).
local function all_gather_strings(s)
  local n = ms.world_size()
  if n == 1 then return { s } end
  local g = world()
  local lens = ms.tensor({ n }, "i64")
  g:all_gather(lens, ms.from_table({ #s }, "i64"))
  local lv = lens:totable()
  local max = 0
  for _, l in ipairs(lv) do max = math.max(max, l) end
  if max == 0 then
    local out = {}
    for r = 1, n do out[r] = "" end
    return out
  end
  local bytes = {}
  for i = 1, max do bytes[i] = i <= #s and s:byte(i) or 0 end
  local all = ms.tensor({ n * max }, "u8")
  g:all_gather(all, ms.from_table(bytes, "u8"))
  local v = all:totable()
  local out = {}
  for r = 0, n - 1 do
    local parts = {}
    for i = 1, lv[r + 1], 4096 do
      parts[#parts + 1] = string.char(unpack(v, r * max + i, r * max + math.min(i + 4095, lv[r + 1])))
    end
    out[r + 1] = table.concat(parts)
  end
  return out
end

-- agree(ok, value_or_error) -> the list of every rank's value; raises on every rank, naming
-- each failed rank, when any failed.
local function agree(ok, value)
  local mine = json.encode(ok and { ok = true, value = value } or { ok = false, err = tostring(value) })
  local all = all_gather_strings(mine)
  local values, errs = {}, {}
  for r, s in ipairs(all) do
    local v = json.decode(s)
    if v.ok then values[r] = v.value else errs[#errs + 1] = format("rank %d: %s", r - 1, v.err) end
  end
  if #errs > 0 then
    if ms.world_size() == 1 then error(errs[1]:gsub("^rank 0: ", ""), 0) end
    error(table.concat(errs, "; "), 0)
  end
  return values
end

-- ---------------------------------------------------------------- what a rank holds

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function plain_list(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v end
  return out
end

-- units: a rank state (runtime.materialize), a list of units, or one unit -> list of units and
-- the set of expert units with this rank's ep coordinate and the ep size.
local function units_of(units)
  local list, experts, ep, ep_size, mesh, tpoff, zero, gshape = {}, {}, 0, 1, nil, {}, {}, {}
  if type(units) == "table" and units.units and units.plan then
    local plan = units.plan
    local mc = plan.mesh
    -- tensor parallelism: each tp piece a box of the global tensor (checkpoint_hf.tp_offsets)
    tpoff = require("moonshard.checkpoint_hf").tp_offsets(plan, ms.rank())
    -- every parameter's global shape (the model's), checked against the checkpoint's on load
    for _, pu in ipairs(plan.units) do
      for _, e in ipairs(pu.entries or {}) do
        if e.param and e.param.shape then gshape[e.fqn] = plain_list(e.param.shape) end
      end
    end
    for _, o in ipairs(plan.owned or {}) do
      if o.shape and not gshape[o.fqn] then gshape[o.fqn] = plain_list(o.shape) end
    end
    -- Megatron-FSDP buckets: each bucket's unit handle, with its bucket and the global shape
    -- of each parameter (the plan's items)
    for _, pu in ipairs(plan.units) do
      if pu.kind == "megatron_fsdp" then
        for _, bk in ipairs((units.megatron or {})[pu.name] or {}) do
          local shapes = {}
          for k, i in ipairs(bk.plan_bucket.indices) do shapes[k] = plain_list(pu.megatron.items[i].shape) end
          zero[bk.unit] = { bucket = bk, shapes = shapes }
        end
      end
    end
    ep, ep_size = mc:coord("ep", ms.rank()), mc:size("ep")
    for _, pu in ipairs(plan.units) do
      local axes = pu.mesh_axes
      if pu.kind ~= "replicate" and pu.kind ~= "megatron_fsdp" and axes[#axes] == "ep_shard" then
        local u = units.by_name[pu.name]
        if u then experts[u] = true end
      end
    end
    for _, u in ipairs(units.ep_local or {}) do experts[u] = true end
    list = units.units
    local axes = {}
    for _, a in ipairs(mc:root_axes()) do axes[#axes + 1] = { a.name, a.size } end
    mesh = { axes = axes, ep = ep_size }
  elseif type(units) == "table" and (getmetatable(units) == nil or units[1]) then
    list = units
  else
    list = { units }
  end
  for i, u in ipairs(list) do
    if R.classof(u) ~= "unit" then fail("units[%d] is %s, not a unit", i, type(u)) end
    if R.unit_is_zero(u) and not zero[u] then
      fail("unit %s is a Megatron-FSDP bucket given without its rank state; pass the state " ..
        "(runtime.materialize's), whose plan gives its parameters' shapes", u:name())
    end
  end
  return list, experts, ep, ep_size, mesh, tpoff, zero, gshape
end

-- The elements [a, b) of a row-major tensor of `shape`, flat, as boxes of the tensor in flat
-- order (each a contiguous run): a partial row at each end (recursively, its own partial
-- rows), whole rows between; at most 2 x dims - 1 boxes.  {off, shape, start (flat), n}.
local function flat_boxes(shape, a, b)
  local out, nd = {}, #shape
  local function box(prefix, d, lo, hi, start)
    local off, shp = {}, {}
    for k = 1, nd do
      if k < d then off[k], shp[k] = prefix[k], 1
      elseif k == d then off[k], shp[k] = lo, hi - lo
      else off[k], shp[k] = 0, shape[k] end
    end
    out[#out + 1] = { off = off, shape = shp, start = start, n = numel(shp) }
  end
  -- elements [a, b) of the sub-tensor of dims d.. at index prefix (dims < d), flat0 its start
  local function rec(prefix, d, a0, b0, flat0)
    if a0 >= b0 then return end
    local row = 1
    for k = d + 1, nd do row = row * shape[k] end
    local r0 = math.floor(a0 / row)
    if a0 % row ~= 0 then -- the partial first row
      local stop = math.min(b0, (r0 + 1) * row)
      local p = plain_list(prefix)
      p[d] = r0
      rec(p, d + 1, a0 - r0 * row, stop - r0 * row, flat0 + r0 * row)
      a0, r0 = stop, r0 + 1
    end
    local r1 = math.floor(b0 / row)
    if r1 > r0 then box(prefix, d, r0, r1, flat0 + r0 * row) end
    if b0 > math.max(a0, r1 * row) then -- the partial last row
      local p = plain_list(prefix)
      p[d] = r1
      rec(p, d + 1, 0, b0 - r1 * row, flat0 + r1 * row)
    end
  end
  if nd == 0 then
    if b > a then out[1] = { off = {}, shape = {}, start = 0, n = 1 } end
  else
    rec({}, 1, a, b, 0)
  end
  return out
end
M.flat_boxes = flat_boxes

-- the piece views of a bucket: checkpoint kind -> piece_tensor's name
local ZERO_VIEW = { param = "param", exp_avg = "exp_avg", exp_avg_sq = "exp_avg_sq", master = "main" }

-- The offsets of parameter i of unit u's shard in the (tp-)global tensor: the unit's shard
-- offset on its dim, plus the tp piece's offset on the tp-split dim (tpoff, units_of).  The
-- ep offset of experts is added by the callers.
local function shard_offsets(u, i, shape, tpoff)
  local offset, _, dim = u:param_offset(i)
  local off = {}
  for d = 1, #shape do off[d] = d == dim + 1 and offset or 0 end
  local t = tpoff[u:fqn(i)]
  if t then off[t.dim + 1] = off[t.dim + 1] + t.off end
  return off, dim
end

local function shape_of(t) return plain_list(t:shape()) end

local function contiguous_cpu(t)
  if t:is_contiguous() and t:device() == "cpu" then return t end
  local c = ms.tensor(t:shape(), t:dtype())
  c:copy_(t)
  return c
end

-- The boxes this rank holds: {fqn, kind, tensor, shape (of the box), off (unit-level offsets),
-- expert (dim 0 split over ep), unit, index}.
local function local_boxes(list, experts, with_optimizer, tpoff, zero)
  local boxes, meta = {}, {}
  for _, u in ipairs(list) do
    local has_state = with_optimizer and u:bytes().optimizer > 0
    local z = zero[u]
    -- a Megatron-FSDP bucket: the rank's piece [start, stop) of each parameter, flat, as the
    -- boxes of the parameter it covers (flat_boxes), for the parameters and each state
    for i = 0, z and u:count() - 1 or -1 do
      local fqn, gshape = u:fqn(i), z.shapes[i + 1]
      local s0, s1 = z.bucket:piece(i)
      local trainable = false
      for _, kind in ipairs(KINDS) do
        local t = (kind == "param" or has_state) and z.bucket:piece_tensor(i, ZERO_VIEW[kind])
        if t then
          if kind == "exp_avg" then trainable = true end
          for _, b in ipairs(flat_boxes(gshape, s0, s1)) do
            boxes[#boxes + 1] = { fqn = fqn, kind = kind, tensor = t:narrow(0, b.start - s0, b.n):view(b.shape),
              shape = b.shape, off = b.off, unit = u, index = i, dtype = t:dtype() }
          end
        end
      end
      meta[fqn] = { unit = u:name(), skipped = 0, trainable = trainable, dim = 0 }
    end
    for i = 0, z and -1 or u:count() - 1 do
      local fqn = u:fqn(i)
      local shard = u:param_shard(i)
      local shape = shape_of(shard)
      local off, dim = shard_offsets(u, i, shape, tpoff)
      local function add(kind, t)
        if t then
          boxes[#boxes + 1] = { fqn = fqn, kind = kind, tensor = t, shape = shape, off = off, expert = experts[u],
            unit = u, index = i, dtype = t:dtype() }
        end
      end
      add("param", shard)
      local trainable = false
      if has_state then
        for _, kind in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
          local t = u:adamw_state(i, kind)
          if t then
            if kind ~= "master" then trainable = true end
            add(kind, t:view(shape))
          end
        end
      end
      meta[fqn] = { unit = u:name(), skipped = trainable and u:adamw_skipped(i) or 0, trainable = trainable,
        dim = dim }
    end
  end
  return boxes, meta
end

local function key_of(b, off)
  return b.kind .. "/" .. b.fqn .. "@" .. table.concat(off, ",") .. ":" .. table.concat(b.shape, "x")
end


-- ---------------------------------------------------------------- safetensors

-- moonshard dtype -> safetensors dtype
local ST_DTYPE = {}
for st, v in pairs(require("moonshard.safetensors").dtypes) do ST_DTYPE[v[1]] = st end
M.ST_DTYPE = ST_DTYPE

-- header(entries, metadata) -> text padded to 8 bytes; entries: {name, dtype, shape, nbytes}
-- in data order; sets e.begin (offset in the data area).
local function st_header(entries, metadata)
  local h, pos = {}, 0
  for _, e in ipairs(entries) do
    h[e.name] = { dtype = ST_DTYPE[e.dtype], shape = json.array(plain_list(e.shape)),
      data_offsets = json.array({ pos, pos + e.nbytes }) }
    e.begin = pos
    pos = pos + e.nbytes
  end
  if metadata then h.__metadata__ = metadata end
  local text = json.encode(h)
  return text .. string.rep(" ", (8 - #text % 8) % 8)
end

local function le64(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(b)
end

-- Writes a safetensors file: entries {name, dtype, shape, nbytes, get = function -> tensor};
-- returns the header length; sets e.crc, e.file_offset.  prog: progress or nil.
local function write_safetensors(path, entries, metadata, prog, done)
  local header = st_header(entries, metadata)
  local fd = check(R.ckpt_open(path, true))
  local ok, err = pcall(function()
    check(R.ckpt_write(fd, le64(#header) .. header))
    for _, e in ipairs(entries) do
      local t = e.get()
      e.crc = check(R.ckpt_write_tensor(fd, t))
      e.file_offset = 8 + #header + e.begin
      done = done + e.nbytes
      if prog then prog.update(done) end
    end
  end)
  local okc, errc = R.ckpt_close(fd, true)
  if not ok then error(err, 0) end
  if not okc then fail("%s: %s", path, errc) end
  return done
end

-- ---------------------------------------------------------------- save

local function step_name(step) return format("step_%08d", step) end

-- Writes the checkpoint of `units` into final (through final's .tmp- sibling); collective.
-- Returns the index (on every rank).
local function write_checkpoint(units, root, name, opts)
  local list, experts, ep, ep_size, mesh, tpoff, zero = units_of(units)
  local rank, n = ms.rank(), ms.world_size()
  local boxes, meta = local_boxes(list, experts, not opts.params_only, tpoff, zero)
  -- describe, gather, decide who writes what
  local desc = {}
  for i, b in ipairs(boxes) do
    desc[i] = { f = b.fqn, k = b.kind, d = b.dtype, s = b.shape, o = b.off, x = b.expert and ep or json.null }
  end
  local all = agree(true, { boxes = desc, meta = meta, ep_size = ep_size })
  -- local extent of expert tensors on dim 0 (per ep coordinate), then global offsets
  local e_local = {}
  for _, r in ipairs(all) do
    for _, d in ipairs(r.boxes) do
      if d.x ~= json.null then e_local[d.f] = math.max(e_local[d.f] or 0, d.o[1] + d.s[1]) end
    end
  end
  local tensors, writer, order = {}, {}, {}
  for r0, r in ipairs(all) do
    for bi, d in ipairs(r.boxes) do
      local off = plain_list(d.o)
      if d.x ~= json.null then off[1] = off[1] + d.x * e_local[d.f] end
      local t = tensors[d.f]
      if not t then
        local m = r.meta[d.f]
        t = { shape = {}, dtype = d.d, skipped = m.skipped, unit = m.unit, kinds = {} }
        tensors[d.f] = t
      end
      if d.k == "param" then t.dtype = d.d end
      if r.meta[d.f].trainable then t.skipped = r.meta[d.f].skipped end
      t.kinds[d.k] = true
      for i = 1, #d.s do t.shape[i] = math.max(t.shape[i] or 0, off[i] + d.s[i]) end
      local key = d.k .. "/" .. d.f .. "@" .. table.concat(off, ",") .. ":" .. table.concat(plain_list(d.s), "x")
      if numel(d.s) > 0 and not writer[key] then
        writer[key] = { rank = r0 - 1, fqn = d.f, kind = d.k, dtype = d.d, offset = off, shape = plain_list(d.s) }
        order[#order + 1] = key
        if r0 - 1 == rank then writer[key].box = boxes[bi] end
      end
    end
  end
  table.sort(order)
  -- the directory
  local final, tmp = join(root, name), join(root, ".tmp-" .. name)
  agree(pcall(function()
    if rank == 0 then
      check(R.ckpt_mkdir(root, true))
      if stat(final) then
        fail("%s exists already (a checkpoint of step %s); remove it or save another step", final, tostring(opts.step))
      end
      if stat(tmp) then remove_tree(tmp) end
      check(R.ckpt_mkdir(tmp, false))
    end
  end))
  -- this rank's file
  local mine, total = {}, 0
  for _, key in ipairs(order) do
    local w = writer[key]
    if w.rank == rank then
      local b = w.box
      mine[#mine + 1] = { name = key, dtype = w.dtype, shape = w.shape, nbytes = b.tensor:nbytes(), key = key,
        get = function() return contiguous_cpu(b.tensor) end }
      total = total + b.tensor:nbytes()
    end
  end
  local file = format("rank%05d.safetensors", rank)
  local written = agree(pcall(function()
    if #mine == 0 then return {} end
    local prog = progress("saving (rank 0)", total, progress_on(opts))
    write_safetensors(join(tmp, file), mine, { format = "moonshard", rank = tostring(rank) }, prog, 0)
    prog.finish()
    local out = {}
    for _, e in ipairs(mine) do out[e.key] = { e.crc, e.file_offset, e.nbytes } end
    return { file = file, bytes = R.file_stat(join(tmp, file)) and select(2, R.file_stat(join(tmp, file))), boxes = out }
  end))
  -- the index, last
  local files, shards = {}, {}
  for r0, w in ipairs(written) do
    if w.file then files[#files + 1] = { name = w.file, rank = r0 - 1, bytes = w.bytes } end
  end
  for _, key in ipairs(order) do
    local w = writer[key]
    local got = written[w.rank + 1].boxes[key]
    shards[#shards + 1] = { tensor = w.fqn, kind = w.kind, dtype = w.dtype, offset = json.array(w.offset),
      shape = json.array(w.shape), file = format("rank%05d.safetensors", w.rank), key = key,
      file_offset = got[2], nbytes = got[3], crc32c = format("%08x", got[1]) }
  end
  local tlist = {}
  for fqn, t in pairs(tensors) do
    local kinds = {}
    for _, k in ipairs(KINDS) do if t.kinds[k] then kinds[#kinds + 1] = k end end
    tlist[fqn] = { shape = json.array(t.shape), dtype = t.dtype, skipped = t.skipped, unit = t.unit,
      kinds = json.array(kinds) }
  end
  local index = { format = M.FORMAT, version = M.VERSION, step = opts.step, extra = opts.extra,
    world = n, backend = ms.backend(), mesh = mesh and { axes = mesh.axes, ep = mesh.ep } or { axes = { { "world", n } } },
    crc = "crc32c", files = files, tensors = tlist, shards = shards }
  agree(pcall(function()
    if rank == 0 then
      write_text(join(tmp, M.INDEX), json.encode(index, { indent = 1 }) .. "\n")
      check(R.ckpt_fsync_path(tmp))
      check(R.ckpt_rename(tmp, final))
    end
  end))
  return index, final
end

-- Checkpoints under root, oldest first: {name, step}.
local function list_checkpoints(root)
  local out = {}
  if not is_dir(root) then return out end
  for _, name in ipairs(check(R.ckpt_list_dir(root))) do
    local step = name:match("^step_(%d+)$")
    if step and is_file(join(join(root, name), M.INDEX)) then out[#out + 1] = { name = name, step = tonumber(step) } end
  end
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end
M.list = list_checkpoints

--- save(units, root, {step = n, extra = {...}, keep_last = k, progress = bool}) -> path of
-- the new checkpoint (ROOT/step_n).  Collective over the world.
function M.save(units, root, opts)
  opts = opts or {}
  if type(root) ~= "string" or root == "" then fail("save: root directory expected, got %s", tostring(root)) end
  local step = opts.step
  if type(step) ~= "number" or step < 0 or step ~= math.floor(step) then
    fail("save: opts.step must be an integer >= 0, got %s", tostring(step))
  end
  if opts.keep_last ~= nil and (type(opts.keep_last) ~= "number" or opts.keep_last < 1) then
    fail("save: keep_last must be an integer >= 1, got %s", tostring(opts.keep_last))
  end
  if opts.extra ~= nil then
    local ok, err = pcall(json.encode, opts.extra)
    if not ok then fail("save: extra must be a JSON-able table: %s", tostring(err)) end
  end
  local name = step_name(step)
  local _, final = write_checkpoint(units, root, name, opts)
  agree(pcall(function()
    if ms.rank() ~= 0 then return end
    -- the latest pointer, atomically; then old checkpoints (never the new one)
    local tmp = join(root, M.LATEST .. ".tmp")
    write_text(tmp, name .. "\n")
    check(R.ckpt_rename(tmp, join(root, M.LATEST)))
    if opts.keep_last then
      local all = list_checkpoints(root)
      for i = 1, #all - opts.keep_last do
        if all[i].name ~= name then
          local trash = join(root, ".trash-" .. all[i].name)
          check(R.ckpt_rename(join(root, all[i].name), trash))
          remove_tree(trash)
        end
      end
    end
    -- leftovers of saves killed before (another step's .tmp-)
    for _, n2 in ipairs(check(R.ckpt_list_dir(root))) do
      if n2:match("^%.tmp%-") or n2:match("^%.trash%-") then remove_tree(join(root, n2)) end
    end
  end))
  return final
end

-- ---------------------------------------------------------------- reading

--- resolve(path) -> the checkpoint directory: path itself when it holds checkpoint.json,
-- else the one path/latest names.
function M.resolve(path)
  if is_file(join(path, M.INDEX)) then return path end
  local latest = join(path, M.LATEST)
  if is_file(latest) then
    local name = read_text(latest):match("^%s*(.-)%s*$")
    local dir = join(path, name)
    if not is_file(join(dir, M.INDEX)) then fail("%s names %s, which has no %s", latest, dir, M.INDEX) end
    return dir
  end
  local kind = stat(path)
  if not kind then fail("%s: no such file or directory", path) end
  if kind ~= "directory" then
    fail("%s is a %s, not a checkpoint: a checkpoint is a directory holding %s (or a root whose %s names one)", path,
      kind, M.INDEX, M.LATEST)
  end
  for _, hf in ipairs({ "model.safetensors.index.json", "model.safetensors" }) do
    if is_file(join(path, hf)) then
      fail("%s holds a Hugging Face checkpoint (%s), not a moonshard one (%s): load it with checkpoint_hf.load_hf " ..
        "(the trainer's --init-from)", path, hf, M.INDEX)
    end
  end
  fail("%s holds no checkpoint (neither %s nor %s)", path, M.INDEX, M.LATEST)
end

--- read_index(dir) -> the decoded checkpoint.json, checked
function M.read_index(dir)
  local path = join(dir, M.INDEX)
  local index = json.decode(read_text(path), path)
  if type(index) ~= "table" or index.format ~= M.FORMAT then fail("%s is not a moonshard checkpoint index", path) end
  if index.version ~= M.VERSION then fail("%s: version %s; this moonshard reads version %d", path,
      tostring(index.version), M.VERSION) end
  return index
end

-- Open files of one load, by name.
local function file_cache(dir)
  local fds = {}
  local c = {}
  function c.fd(name)
    if not fds[name] then fds[name] = check(R.ckpt_open(join(dir, name), false)) end
    return fds[name]
  end
  function c.close()
    for _, fd in pairs(fds) do R.ckpt_close(fd, false) end
  end
  return c
end

-- The checksum of a saved box's bytes (t: the box, contiguous) against the index.
local function check_crc(dir, s, t)
  local crc = format("%08x", check(R.tensor_crc32c(t)))
  if crc ~= s.crc32c then
    fail("checksum mismatch: %s of tensor %s (box at %s) in %s: crc32c %s, the index says %s", s.kind, s.tensor,
      table.concat(plain_list(s.offset), ","), join(dir, s.file), crc, s.crc32c)
  end
end

-- Reads the part of saved box s starting at `start` (offsets within the box) into out (a
-- contiguous cpu tensor of s's dtype, the part's shape): one pread per contiguous run.
local function read_box(dir, files, s, start, out)
  local ok, err = R.ckpt_read_box(files.fd(s.file), s.file_offset, plain_list(s.shape), start, out)
  if not ok then fail("%s of tensor %s in %s: %s", s.kind, s.tensor, join(dir, s.file), err) end
end

-- The whole saved box s as a tensor (into `into` when given: a contiguous tensor of its shape
-- and dtype), its checksum checked (an error naming the tensor and file otherwise).
local function read_whole(dir, files, s, into)
  local t = into or ms.tensor(plain_list(s.shape), s.dtype)
  local zero = {}
  for i = 1, #s.shape do zero[i] = 0 end
  read_box(dir, files, s, zero, t)
  check_crc(dir, s, t)
  return t
end
M.read_whole = read_whole

--- verify(path) -> list of problems (empty when every checksum matches), bytes checked.
-- One process; every box read whole.
function M.verify(path)
  local dir = M.resolve(path)
  local index = M.read_index(dir)
  local files = file_cache(dir)
  local problems, bytes = {}, 0
  for _, f in ipairs(index.files) do
    local kind, size = stat(join(dir, f.name))
    if kind ~= "regular file" then
      problems[#problems + 1] = format("%s: missing", join(dir, f.name))
    elseif f.bytes and size ~= f.bytes then
      problems[#problems + 1] = format("%s: %d bytes, the index says %d", join(dir, f.name), size, f.bytes)
    end
  end
  -- each file's own safetensors header: it parses (so any safetensors reader opens the file)
  -- and lists the index's boxes of the file, no others, with their dtypes, shapes and places
  if #problems == 0 then
    local st = require "moonshard.safetensors"
    local of_file = {}
    for _, s in ipairs(index.shards) do
      of_file[s.file] = of_file[s.file] or {}
      of_file[s.file][s.key] = s
    end
    for _, f in ipairs(index.files) do
      local path = join(dir, f.name)
      local ok, list = pcall(st.read_header, path)
      if not ok then
        problems[#problems + 1] = format("%s: its safetensors header does not parse: %s", path,
          tostring(list):gsub("^moonshard: safetensors: ", ""))
      else
        local want, seen = of_file[f.name] or {}, {}
        for _, t in ipairs(list) do
          local s, start = want[t.name], t.data_start
          seen[t.name] = true
          if not s then
            problems[#problems + 1] = format("%s: its header lists %s, which the index does not place in it", path, t.name)
          elseif t.dtype ~= s.dtype or table.concat(t.shape, "x") ~= table.concat(plain_list(s.shape), "x") or
              start + t.data_offsets[1] ~= s.file_offset or t.data_offsets[2] - t.data_offsets[1] ~= s.nbytes then
            problems[#problems + 1] = format("%s: its header gives %s as %s %s at bytes [%d, %d), the index %s %s " ..
              "at [%d, %d)", path, t.name, t.dtype, table.concat(t.shape, "x"), start + t.data_offsets[1],
              start + t.data_offsets[2], s.dtype, table.concat(plain_list(s.shape), "x"), s.file_offset,
              s.file_offset + s.nbytes)
          end
        end
        for key in pairs(want) do
          if not seen[key] then problems[#problems + 1] = format("%s: its header lacks %s", path, key) end
        end
      end
    end
  end
  if #problems == 0 then
    for _, s in ipairs(index.shards) do
      local ok, err = pcall(read_whole, dir, files, s)
      if not ok then problems[#problems + 1] = tostring(err):gsub("^moonshard: checkpoint: ", "") end
      bytes = bytes + s.nbytes
    end
  end
  files.close()
  return problems, bytes, dir, index
end

-- Reads, into dst (a tensor of the target box's shape at global offset toff), every part of
-- the saved boxes of (fqn, kind) that overlaps it.  A part lands straight in dst when dst's
-- view of it is contiguous and of the saved dtype (a box cut on dim 0: no buffer, no copy);
-- else it is read into a buffer and copied (cast) in.  A saved box that lies whole inside
-- dst is checksummed when `verify` (in place).  Returns the elements covered and the bytes
-- read.
local function fill_box(dir, files, saved, dst, toff, verify)
  local tshape = shape_of(dst)
  local covered, bytes = 0, 0
  local direct_ok = dst:device() == "cpu"
  for _, s in ipairs(saved) do
    local inter_start, inter_len, empty, whole = {}, {}, false, true
    for d = 1, #tshape do
      local a = math.max(toff[d], s.offset[d])
      local b = math.min(toff[d] + tshape[d], s.offset[d] + s.shape[d])
      if b <= a then empty = true break end
      inter_start[d], inter_len[d] = a, b - a
      if a ~= s.offset[d] or b - a ~= s.shape[d] then whole = false end
    end
    if not empty then
      local view = dst
      for d = 1, #tshape do view = view:narrow(d - 1, inter_start[d] - toff[d], inter_len[d]) end
      local start = {}
      for d = 1, #tshape do start[d] = inter_start[d] - s.offset[d] end
      local into = (direct_ok and view:dtype() == s.dtype and view:is_contiguous()) and view or
        ms.tensor(inter_len, s.dtype)
      read_box(dir, files, s, start, into)
      if whole and verify then check_crc(dir, s, into) end
      if into ~= view then view:copy_(into) end
      local nel = numel(inter_len)
      covered, bytes = covered + nel, bytes + nel * ms.dtype_size(s.dtype)
    end
  end
  return covered, bytes
end

--- load(units, path, {verify = true, progress = bool}) -> step, extra, dir, stats.  Collective.
-- stats.bytes_read: the bytes this rank read from the files (what it loads, and the boxes it
-- verifies that no rank reads whole).
function M.load(units, path, opts)
  opts = opts or {}
  local list, experts, ep, ep_size, _, tpoff, zero, gshape = units_of(units)
  local rank, n = ms.rank(), ms.world_size()
  local dir, index
  agree(pcall(function()
    dir = M.resolve(path)
    index = M.read_index(dir)
  end))
  local by = {} -- fqn -> kind -> saved boxes
  for _, s in ipairs(index.shards) do
    by[s.tensor] = by[s.tensor] or {}
    by[s.tensor][s.kind] = by[s.tensor][s.kind] or {}
    table.insert(by[s.tensor][s.kind], s)
  end
  local files = file_cache(dir)
  local ok, err = pcall(function()
    -- targets: every (unit, parameter) of this rank
    local targets = {}
    local strip, unwrapped = require("moonshard.module").strip_checkpoint, {}
    for name in pairs(index.tensors) do unwrapped[strip(name)] = name end
    for _, u in ipairs(list) do
      local z = zero[u]
      for i = 0, u:count() - 1 do
        local fqn = u:fqn(i)
        -- the checkpoint's name of the tensor: the same, or the same without activation
        -- checkpointing's wrapper (a plan with another policy)
        if not index.tensors[fqn] then fqn = unwrapped[strip(fqn)] or fqn end
        local t = index.tensors[fqn]
        if not t then fail("%s has no tensor %s (unit %s)", dir, u:fqn(i), u:name()) end
        local want = gshape[u:fqn(i)]
        if want and table.concat(want, "x") ~= table.concat(plain_list(t.shape), "x") then
          fail("tensor %s: the model's shape is %s, the checkpoint's %s (in %s)", fqn, table.concat(want, "x"),
            table.concat(plain_list(t.shape), "x"), dir)
        end
        if z then
          -- a bucket: the whole parameter (load_full), then the state of its piece's boxes
          local gshape = z.shapes[i + 1]
          if table.concat(gshape, "x") ~= table.concat(plain_list(t.shape), "x") then
            fail("tensor %s: the bucket holds shape %s, the checkpoint %s", fqn, table.concat(gshape, "x"),
              table.concat(plain_list(t.shape), "x"))
          end
          local zeros = {}
          for d = 1, #gshape do zeros[d] = 0 end
          local s0, s1 = z.bucket:piece(i)
          -- (ZeRO-3 holds the piece of the parameter only: its boxes, not the whole, are read)
          local piece_only = z.bucket.strategy == "optim_grads_params"
          targets[#targets + 1] = { unit = u, index = i, fqn = fqn, shape = gshape, off = zeros, info = t,
            zero = z, kinds = piece_only and {} or { "param" }, pieces = flat_boxes(gshape, s0, s1), start = s0 }
          for _, b in ipairs(targets[#targets].pieces) do
            targets[#targets + 1] = { fqn = fqn, shape = b.shape, off = b.off, kinds = piece_only and
              { "param", "exp_avg", "exp_avg_sq", "master" } or { "exp_avg", "exp_avg_sq", "master" }, plan_only = true }
          end
        else
          local shard = u:param_shard(i)
          local shape = shape_of(shard)
          local off = shard_offsets(u, i, shape, tpoff)
          local unit_shape = {}
          for d = 1, #t.shape do unit_shape[d] = t.shape[d] end
          if experts[u] and ep_size > 1 then
            if t.shape[1] % ep_size ~= 0 then fail("tensor %s: %d experts do not divide over ep = %d", fqn, t.shape[1], ep_size) end
            unit_shape[1] = math.floor(t.shape[1] / ep_size)
            off[1] = off[1] + ep * unit_shape[1]
          end
          if #shape ~= #t.shape then
            fail("tensor %s: the unit holds %d dims, the checkpoint %d (shape %s)", fqn, #shape, #t.shape,
              table.concat(t.shape, "x"))
          end
          for d = 1, #shape do
            if off[d] + shape[d] > t.shape[d] then
              fail("tensor %s: the unit's rows [%d, %d) of dim %d are outside the checkpoint's shape %s", fqn, off[d],
                off[d] + shape[d], d - 1, table.concat(t.shape, "x"))
            end
          end
          targets[#targets + 1] = { unit = u, index = i, fqn = fqn, shape = shape, off = off, info = t }
        end
      end
    end
    -- which saved boxes this rank reads whole (checksummed where they land), and of those no
    -- rank reads whole, the ones it verifies (round-robin over the ranks, before anything is
    -- written into a unit)
    local verify = opts.verify ~= false
    local index_of, seen, whole_here, wanted = {}, {}, {}, 0
    for j, s in ipairs(index.shards) do index_of[s] = j end
    for _, tg in ipairs(targets) do
      for _, kind in ipairs(tg.kinds or KINDS) do
        for _, s in ipairs((by[tg.fqn] or {})[kind] or {}) do
          local inside, overlaps = true, true
          for d = 1, #tg.shape do
            if s.offset[d] < tg.off[d] or s.offset[d] + s.shape[d] > tg.off[d] + tg.shape[d] then inside = false end
            if s.offset[d] >= tg.off[d] + tg.shape[d] or s.offset[d] + s.shape[d] <= tg.off[d] then overlaps = false end
          end
          if inside and not seen[index_of[s]] then
            seen[index_of[s]] = true
            whole_here[#whole_here + 1] = index_of[s]
          end
          if overlaps then wanted = wanted + s.nbytes end
        end
      end
    end
    return { whole_here = whole_here, wanted = wanted, targets = targets, verify = verify }
  end)
  if not ok then files.close() end
  local all = agree(ok, ok and err.whole_here or err)
  local wanted, targets, verify = err.wanted, err.targets, err.verify
  local read_whole_somewhere = {}
  for _, list in ipairs(all) do for _, j in ipairs(list) do read_whole_somewhere[j] = true end end
  local bytes_read = 0
  ok, err = pcall(function()
    local mine, total = {}, wanted
    if verify then
      local k = 0
      for j, s in ipairs(index.shards) do
        if not read_whole_somewhere[j] then
          if k % n == rank then
            mine[#mine + 1] = s
            total = total + s.nbytes
          end
          k = k + 1
        end
      end
    end
    local prog = progress("loading (rank 0)", total, progress_on(opts))
    local done = 0
    for _, s in ipairs(mine) do
      read_whole(dir, files, s)
      done = done + s.nbytes
      prog.update(done)
    end
    -- parameters first (a unit's first adamw_state makes master weights from them), then state
    for pass = 1, 2 do
      for _, tg in ipairs(targets) do
        local u, i, saved = tg.unit, tg.index, by[tg.fqn] or {}
        if tg.plan_only then
          -- (a bucket's state boxes: read with its parameter below)
        elseif tg.zero and pass == 1 and tg.zero.bucket.strategy == "optim_grads_params" then
          -- ZeRO-3: the rank holds its piece of the parameter alone; read its boxes only, and
          -- the piece's main weights take them as load_full gives them
          local bk = tg.zero.bucket
          local piece, got = bk:piece_tensor(i, "param"), 0
          for _, pc in ipairs(tg.pieces) do
            local g, b = fill_box(dir, files, saved.param or {}, piece:narrow(0, pc.start - tg.start, pc.n):view(pc.shape),
              pc.off, verify)
            got, done = got + g, done + b
          end
          if got ~= piece:numel() then
            fail("the checkpoint holds %d of the %d elements of tensor %s this rank needs", got, piece:numel(), tg.fqn)
          end
          local main = bk:piece_tensor(i, "main")
          if main and piece:numel() > 0 then main:copy_(piece) end
        elseif tg.zero and pass == 1 then
          -- ZeRO-0..2: every rank holds the whole parameter
          local full = ms.tensor(tg.shape, tg.zero.bucket:piece_tensor(i, "param"):dtype())
          local got, b = fill_box(dir, files, saved.param or {}, full, tg.off, verify)
          done = done + b
          if got ~= numel(tg.shape) then
            fail("the checkpoint holds %d of the %d elements of tensor %s this rank needs", got, numel(tg.shape), tg.fqn)
          end
          tg.zero.bucket:load_full(i, full)
        elseif tg.zero then
          if saved.exp_avg then
            tg.zero.bucket:make_state()
            for _, kind in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
              local st = tg.zero.bucket:piece_tensor(i, ZERO_VIEW[kind])
              if st and saved[kind] then
                for _, pc in ipairs(tg.pieces) do
                  local _, b = fill_box(dir, files, saved[kind], st:narrow(0, pc.start - tg.start, pc.n):view(pc.shape),
                    pc.off, verify)
                  done = done + b
                end
              end
            end
          end
        elseif pass == 1 then
          local shard = u:param_shard(i)
          local got, b = fill_box(dir, files, saved.param or {}, shard, tg.off, verify)
          done = done + b
          if got ~= numel(tg.shape) then
            fail("the checkpoint holds %d of the %d elements of tensor %s this rank needs", got, numel(tg.shape), tg.fqn)
          end
        elseif saved.exp_avg and numel(tg.shape) >= 0 then
          local ea = u:adamw_state(i, "exp_avg")
          if ea then
            for _, kind in ipairs({ "exp_avg", "exp_avg_sq", "master" }) do
              local st = u:adamw_state(i, kind)
              if st and numel(tg.shape) > 0 then
                local view = st:view(tg.shape)
                if saved[kind] then
                  local _, b = fill_box(dir, files, saved[kind], view, tg.off, verify)
                  done = done + b
                elseif kind == "master" then
                  view:copy_(u:param_shard(i))
                end
              end
            end
            u:set_adamw_skipped(i, tg.info.skipped or 0)
          end
        end
        prog.update(done)
      end
    end
    prog.finish()
    bytes_read = done
  end)
  files.close()
  agree(ok, err)
  local extra = index.extra
  if extra == json.null then extra = nil end
  return index.step, extra, dir, { bytes_read = bytes_read }
end

-- ---------------------------------------------------------------- Hugging Face export

local function parse_size(v)
  if v == nil then return 5 * 1000 ^ 3 end
  if type(v) == "number" then return v end
  local num, unit = tostring(v):match("^%s*([%d%.]+)%s*(%a*)%s*$")
  local mult = { [""] = 1, B = 1, KB = 1e3, MB = 1e6, GB = 1e9, TB = 1e12, KIB = 1024, MIB = 1024 ^ 2,
    GIB = 1024 ^ 3, TIB = 1024 ^ 4 }
  local m = unit and mult[unit:upper()]
  if not num or not m or not tonumber(num) or tonumber(num) * m < 1 then
    fail("max_shard_size '%s': expected a size of at least 1 byte, like 5GB, 500MB or 1073741824", tostring(v))
  end
  return tonumber(num) * m
end
M.parse_size = parse_size

-- Expert e.expert's Hugging Face tensor of a grouped expert tensor (export_dir with
-- expert_names): the transpose of grouped[e][:, col:col + rows] (checkpoint_hf.expert_parts),
-- read from every saved box it overlaps with pread and cast to e.dtype.  The saved boxes of
-- the grouped tensor are checksummed once, the first time one of its experts is read.
local function expert_part(dir, files, e, verified)
  if not verified[e.fqn] then
    for _, s in ipairs(e.saved) do read_whole(dir, files, s) end
    verified[e.fqn] = true
  end
  local rows, cols = e.shape[1], e.shape[2] -- [rows, cols] = grouped[e][:, col:col+rows]^T
  local out = ms.tensor({ 1, rows, cols }, e.dtype)
  local lo, len = { e.expert, 0, e.col }, { 1, cols, rows }
  local covered = 0
  for _, s in ipairs(e.saved) do
    local a, b, empty = {}, {}, false
    for d = 1, 3 do
      a[d] = math.max(lo[d], s.offset[d])
      b[d] = math.min(lo[d] + len[d], s.offset[d] + s.shape[d])
      if b[d] <= a[d] then empty = true end
    end
    if not empty then
      local dst = out:narrow(1, a[3] - e.col, b[3] - a[3]):narrow(2, a[2], b[2] - a[2])
      local start = { a[1] - s.offset[1], a[2] - s.offset[2], a[3] - s.offset[3] }
      local got, err = R.file_read_region(join(dir, s.file), s.file_offset, R.dtype_code(s.dtype), plain_list(s.shape),
        start, { 0, 2, 1 }, dst)
      if not got then fail("export: %s of tensor %s in %s: %s", s.kind, s.tensor, join(dir, s.file), tostring(err)) end
      covered = covered + (b[2] - a[2]) * (b[3] - a[3])
    end
  end
  if covered ~= rows * cols then
    fail("export: the checkpoint holds %d of the %d elements of expert %d of %s", covered, rows * cols, e.expert, e.fqn)
  end
  return out:view({ rows, cols })
end

--- export_dir(checkpoint, out, {dtype=, max_shard_size=, names = function(fqn) -> name,
-- expert_names = bool})
-- -> files written: the parameters of a checkpoint consolidated into Hugging Face safetensors
-- (model.safetensors, or model-0000i-of-0000N.safetensors and model.safetensors.index.json
-- when past max_shard_size, default 5GB).  One process; every box read is checksummed.
-- expert_names: grouped experts (`<p>.experts.gate_and_up_projs`, `down_projs`) written as
-- Hugging Face's per-expert tensors `<p>.experts.{e}.gate_proj.weight`, `up_proj.weight`,
-- `down_proj.weight` (transposed as Automodel's adapters do), which from_pretrained loads.
function M.export_dir(path, out, opts)
  opts = opts or {}
  local dir = M.resolve(path)
  local index = M.read_index(dir)
  local strip = require("moonshard.module").strip_checkpoint
  local rename = opts.names or strip
  local names, by, saved = {}, {}, {}
  local hf = opts.expert_names and require("moonshard.checkpoint_hf")
  local function add(name, e)
    if by[name] then fail("export: %s and %s are both named %s", by[name].fqn, e.fqn, name) end
    by[name] = e
    names[#names + 1] = name
  end
  for fqn, t in pairs(index.tensors) do
    saved[fqn] = {}
    local name = rename(fqn)
    -- grouped experts as Hugging Face's per-expert tensors (checkpoint_hf's rule): gated
    -- when gate_and_up_projs is twice as wide as down_projs is tall (else, without a
    -- down_projs beside it, when its width is even)
    local gated
    if hf and #t.shape == 3 then
      local down = index.tensors[(fqn:gsub("gate_and_up_projs$", "down_projs"))]
      gated = down and #down.shape == 3 and t.shape[3] == 2 * down.shape[2] or (not down and t.shape[3] % 2 == 0)
    end
    local prefix, parts = nil, nil
    if hf then prefix, parts = hf.expert_parts(name, t.shape, gated) end
    if parts then
      for ex = 0, t.shape[1] - 1 do
        for _, part in ipairs(parts) do
          add(format("%s.%d.%s.weight", prefix, ex, part.proj), { fqn = fqn, info = t, dtype = opts.dtype or t.dtype,
            saved = saved[fqn], shape = part.shape, expert = ex, col = part.col })
        end
      end
    else
      add(name, { fqn = fqn, info = t, dtype = opts.dtype or t.dtype, saved = saved[fqn], shape = t.shape })
    end
  end
  table.sort(names)
  for _, s in ipairs(index.shards) do
    if s.kind == "param" then table.insert(saved[s.tensor], s) end
  end
  local limit = parse_size(opts.max_shard_size)
  local shards, cur, size, total = {}, nil, 0, 0
  for _, name in ipairs(names) do
    local e = by[name]
    if not ST_DTYPE[e.dtype] then fail("export: dtype %s has no safetensors name", e.dtype) end
    e.nbytes = numel(e.shape) * ms.dtype_size(e.dtype)
    if not cur or (size + e.nbytes > limit and #cur > 0) then
      cur, size = {}, 0
      shards[#shards + 1] = cur
    end
    cur[#cur + 1] = name
    size, total = size + e.nbytes, total + e.nbytes
  end
  -- never into a checkpoint (ours, or the one exported)
  if is_file(join(out, M.INDEX)) or is_file(join(out, M.LATEST)) then
    fail("export: %s is a moonshard checkpoint (it holds %s); export into another directory", out,
      is_file(join(out, M.INDEX)) and M.INDEX or M.LATEST)
  end
  check(R.ckpt_mkdir(out, true))
  local files = file_cache(dir)
  local written, weight_map, verified = {}, {}, {}
  local tmps = {}
  local prog = progress("exporting", total, opts.progress == nil and R.stderr_isatty() or opts.progress)
  local done = 0
  local ok, err = pcall(function()
    for k, list in ipairs(shards) do
      local fname = #shards == 1 and "model.safetensors" or format("model-%05d-of-%05d.safetensors", k, #shards)
      local entries = {}
      for _, name in ipairs(list) do
        local e = by[name]
        weight_map[name] = fname
        entries[#entries + 1] = { name = name, dtype = e.dtype, shape = plain_list(e.shape), nbytes = e.nbytes,
          get = function()
            if e.expert then return expert_part(dir, files, e, verified) end
            local full = ms.tensor(plain_list(e.info.shape), e.info.dtype)
            local zero = {}
            for d = 1, #e.info.shape do zero[d] = 0 end
            local got = fill_box(dir, files, e.saved, full, zero, true)
            if got ~= numel(e.info.shape) then fail("export: the checkpoint holds %d of the %d elements of %s", got,
                numel(e.info.shape), e.fqn) end
            if e.dtype ~= e.info.dtype then return full:to(e.dtype) end
            return full
          end }
      end
      local tmp = join(out, fname .. ".tmp")
      tmps[#tmps + 1] = tmp
      done = write_safetensors(tmp, entries, { format = "pt" }, prog, done)
      check(R.ckpt_rename(tmp, join(out, fname)))
      written[#written + 1] = fname
    end
    if #shards > 1 then
      local tmp = join(out, "model.safetensors.index.json.tmp")
      tmps[#tmps + 1] = tmp
      write_text(tmp, json.encode({ metadata = { total_size = total }, weight_map = weight_map }, { indent = 1 }) .. "\n")
      check(R.ckpt_rename(tmp, join(out, "model.safetensors.index.json")))
      written[#written + 1] = "model.safetensors.index.json"
    end
  end)
  prog.finish()
  files.close()
  if not ok then
    for _, tmp in ipairs(tmps) do if stat(tmp) then os.remove(tmp) end end
    error(err, 0)
  end
  -- what an earlier export left in OUT and this one did not write goes, as transformers'
  -- save_pretrained cleans its folder: its weight files (model*.safetensors) and index
  local mine = {}
  for _, f in ipairs(written) do mine[f] = true end
  for _, name in ipairs(check(R.ckpt_list_dir(out))) do
    if not mine[name] and (name:match("^model.*%.safetensors$") or name == "model.safetensors.index.json") and
        is_file(join(out, name)) then
      os.remove(join(out, name))
    end
  end
  return written, total
end

--- export_hf(units, out, {dtype=, max_shard_size=, expert_names=}) -> files written: collective; the units'
-- parameters are saved into OUT/.moonshard-export (each rank its boxes, once), rank 0
-- consolidates them into Hugging Face safetensors in OUT, and the temporary checkpoint goes.
function M.export_hf(units, out, opts)
  opts = opts or {}
  if type(out) ~= "string" or out == "" then fail("export_hf: output directory expected") end
  local name = ".moonshard-export"
  agree(pcall(function()
    if ms.rank() == 0 then
      check(R.ckpt_mkdir(out, true))
      if stat(join(out, name)) then remove_tree(join(out, name)) end
    end
  end))
  write_checkpoint(units, out, name, { step = 0, params_only = true, progress = opts.progress })
  local files = agree(pcall(function()
    if ms.rank() ~= 0 then return {} end
    local ok, w = pcall(M.export_dir, join(out, name), out, opts)
    remove_tree(join(out, name))
    if not ok then error(w, 0) end
    return w
  end))
  return files[1]
end

return M
