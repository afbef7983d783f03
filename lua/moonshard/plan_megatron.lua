-- moonshard.plan_megatron: Megatron-FSDP units (ctx:megatron_fsdp, see moonshard.plan), NeMo
-- Automodel's third distributed manager (nemo_automodel/components/distributed/megatron_fsdp.py,
-- MegatronFSDPManager; parallelizer.py, megatron_fsdp_strategy_parallelize; config.py,
-- MegatronFSDPConfig), as megatron-fsdp 0.5.0 (the release Automodel pins; 0.6.1 has the same
-- layout code) lays out its buffers:
--
--   megatron_fsdp/param_and_grad_buffer.py
--     _get_parameter_groups        parameters grouped by (dtype, is_expert_param (".experts."
--                                  in the name), requires_grad, fsdp_unit_id), in
--                                  named_parameters() order, each group one bucket (the
--                                  DDP config's bucket_size is None, so no group is split by
--                                  size); inside a bucket the parameters are sorted by their
--                                  row size shape[1:].numel(), largest first (stable), and the
--                                  bucket's chunk_size_factor is the lcm of the row sizes that
--                                  do not already divide it (step 3)
--     build_data_parallel_buffer_index
--                                  each parameter at a running offset; one whose size is not a
--                                  multiple of chunk_size_factor rounds the offset up to the
--                                  next multiple, the next such parameter whose remainder fits
--                                  ends in the same chunk, and parameters smaller than a chunk
--                                  (fragments) fill the gaps or go last; the bucket is padded
--                                  to a multiple of dp x chunk_size_factor (not for no_shard)
--     _get_dp_buffer_shard_bucket_index
--                                  rank r holds elements [r*S/dp, (r+1)*S/dp) of the padded
--                                  bucket S: one contiguous slice, which cuts parameters
--                                  wherever it falls (whole rows when chunk_size_factor is the
--                                  rows' lcm), unlike FSDP2's dim-0 chunk of every parameter
--     _init_each_parameter_group_buffers
--                                  which buffers are distributed per strategy: no_shard none
--                                  (and no model-weight buffer), optim the main weights (the
--                                  optimizer's), optim_grads also the gradients,
--                                  optim_grads_params also the model weights; the gradient
--                                  buffer in main_grads_dtype (fp32 with Automodel's
--                                  grad_reduce_in_fp32, else the parameter dtype), a main
--                                  weight buffer in fp32 only with preserve_fp32_weights
--                                  (Automodel's MixedPrecisionPolicy: main_params_dtype None
--                                  otherwise, the model weights are the optimizer's)
--     GradReducePipeline._bucket_group_gradient_reduce
--                                  no_shard all-reduces each bucket; every other strategy
--                                  reduce-scatters it (optim too: only the rank's slice of its
--                                  unsharded gradient buffer is reduced), gradients pre-scaled
--                                  by 1/dp and summed
--     AllGatherPipeline, start_param_sync, release_bucket
--                                  optim and optim_grads all-gather every bucket's model
--                                  weights once a step (after the optimizer updated each
--                                  rank's slice); optim_grads_params gathers an FSDP unit's
--                                  buckets before its forward and again before its backward
--                                  (released in between), and the buckets outside any unit
--                                  once a step (kept: "non-unit modules should remain
--                                  persistently allocated")

local util = require "moonshard.util"
local replicate = require "moonshard.plan_replicate"

local G = {}

local fail, add, mul, display, shown, call_site, DTYPE_SIZE, FLOAT

--- Takes the planner's helpers h; returns G.
function G.bind(h)
  fail, add, mul, display, shown, call_site = h.fail, h.add, h.mul, h.display, h.shown, h.call_site
  DTYPE_SIZE, FLOAT = h.DTYPE_SIZE, h.FLOAT
  return G
end

-- megatron_fsdp/fully_shard.py: zero_dp_strategy as a ShardingStrategy number or its name
G.STRATEGIES = { [0] = "no_shard", "optim", "optim_grads", "optim_grads_params" }
G.ZERO = { no_shard = 0, optim = 1, optim_grads = 2, optim_grads_params = 3 }

--- The strategy's name for a number 0..3, its string, or a name; nil when none.
function G.strategy(v)
  if type(v) == "string" and v:match("^%d$") then v = tonumber(v) end
  if type(v) == "number" then return G.STRATEGIES[v] end
  if type(v) == "string" and G.ZERO[v] then return v end
  return nil
end

local function gcd(a, b)
  while b ~= 0 do a, b = b, a % b end
  return a
end
local function lcm(a, b) return util.idiv(a, gcd(a, b)) * b end

--- A shape's shape[1:].numel() (1 for 0-d and 1-d shapes, as torch.Size([])[1:].numel()).
function G.row(shape)
  local n = 1
  for i = 2, #shape do n = n * shape[i] end
  return n
end

local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

--- _get_parameter_groups, steps 1 to 3.  params: in named_parameters() order, each {shape,
-- dtype, requires_grad, unit_id (nil outside every FSDP unit), expert}.  bucket_size: the
-- suggested bucket size in elements (nil: none, Megatron-FSDP's default).  Returns the
-- buckets, each {indices (positions in params, in buffer order), dtype, requires_grad,
-- expert, unit_id, chunk (chunk_size_factor)}.
function G.groups(params, bucket_size)
  local groups = {}
  for i, p in ipairs(params) do
    local found
    for _, g in ipairs(groups) do
      if g.dtype == p.dtype and g.expert == (p.expert == true) and g.requires_grad == (p.requires_grad == true) and
          g.unit_id == p.unit_id then
        found = g
        break
      end
    end
    if not found then
      found = { dtype = p.dtype, expert = p.expert == true, requires_grad = p.requires_grad == true, unit_id = p.unit_id,
        indices = {} }
      groups[#groups + 1] = found
    end
    found.indices[#found.indices + 1] = i
  end
  -- step 2: groups outside FSDP units split when they reach bucket_size elements
  local split = {}
  for _, g in ipairs(groups) do
    local cur, n = {}, 0
    for _, i in ipairs(g.indices) do
      cur[#cur + 1] = i
      n = n + numel_of(params[i].shape)
      if g.unit_id == nil and bucket_size and n >= bucket_size then
        split[#split + 1] = { dtype = g.dtype, expert = g.expert, requires_grad = g.requires_grad, unit_id = g.unit_id,
          indices = cur }
        cur, n = {}, 0
      end
    end
    if #cur > 0 then
      split[#split + 1] = { dtype = g.dtype, expert = g.expert, requires_grad = g.requires_grad, unit_id = g.unit_id,
        indices = cur }
    end
  end
  -- step 3: sorted by row size, largest first (Python's sorted is stable), and the chunk
  -- size factor (the source's remaining_params stays empty: one group per bucket)
  for _, b in ipairs(split) do
    local keyed = {}
    for k, i in ipairs(b.indices) do keyed[k] = { i = i, k = k, row = G.row(params[i].shape) } end
    table.sort(keyed, function(x, y)
      if x.row ~= y.row then return x.row > y.row end
      return x.k < y.k
    end)
    local chunk = keyed[1].row
    for k, x in ipairs(keyed) do
      b.indices[k] = x.i
      local n = numel_of(params[x.i].shape)
      if not (x.row == chunk or (chunk % x.row == 0 and n % chunk == 0) or n < chunk) then chunk = lcm(chunk, x.row) end
    end
    b.chunk = chunk
  end
  return split
end

--- build_data_parallel_buffer_index for item sizes numels (in buffer order), chunk size
-- factor chunk, dp ranks and a strategy: each item's offset (by position), the end of the
-- data and the bucket's size (padded to a multiple of dp x chunk unless no_shard).
function G.buffer_index(numels, chunk, dp, strategy)
  local frags, regular = {}, {}
  for i, n in ipairs(numels) do
    if n < chunk then frags[#frags + 1] = i else regular[#regular + 1] = i end
  end
  -- (the source sorts the fragments by size but drops the result: they keep their order)
  local offset, at = {}, 0
  while #regular > 0 do
    local i = table.remove(regular, 1)
    local n = numels[i]
    offset[i] = at
    if n % chunk == 0 then
      at = at + n
    else
      local gap = at + n
      at = at + (util.idiv(n, chunk) + 1) * chunk
      local remain = n % chunk
      local space = chunk - remain
      for k, j in ipairs(regular) do
        local rr = numels[j] % chunk
        if rr ~= 0 and remain + rr <= chunk then
          table.remove(regular, k)
          offset[j] = at - rr
          space = space - rr
          at = at + util.idiv(numels[j], chunk) * chunk
          break
        end
      end
      local k = 1
      while k <= #frags do
        local j = frags[k]
        if numels[j] <= space then
          offset[j] = gap
          space, gap = space - numels[j], gap + numels[j]
          table.remove(frags, k)
        else
          k = k + 1
        end
      end
    end
  end
  for _, j in ipairs(frags) do
    offset[j] = at
    at = at + numels[j]
  end
  local size = at
  if strategy ~= "no_shard" then size = util.ceil_div(at, dp * chunk) * dp * chunk end
  return offset, at, size
end

--- The part of an item [off, off + n) in rank r's slice of a bucket of `shard` elements a
-- rank: (start, stop) within the item (_get_item_slice_in_shard; empty: start == stop).
function G.slice(off, n, shard, r)
  local lo, hi = r * shard, (r + 1) * shard
  local s, e = math.max(off, lo), math.min(off + n, hi)
  if e <= s then return 0, 0 end
  return s - off, e - off
end

-- ---------------------------------------------------------------- ctx:megatron_fsdp

local OPTIONS = { "mesh", "zero_dp_strategy", "unit_modules", "grad_reduce_in_fp32", "preserve_fp32_weights",
  "overlap_param_gather", "bucket_size" }
local FLAGS = { "grad_reduce_in_fp32", "preserve_fp32_weights", "overlap_param_gather" }

--- ctx:megatron_fsdp(module, opts): see moonshard.plan's Ctx:megatron_fsdp.
function G.megatron_fsdp(ctx, module, opts)
  opts = opts or {}
  module = ctx:module(module)
  local name = ctx:name_of(module)
  local where = "megatron_fsdp(" .. display(name) .. ")"
  replicate.check_options(where, opts, OPTIONS)
  local site = call_site()
  if ctx.pp then fail(string.format("%s: the model is split into pipeline stages; Megatron-FSDP takes none " ..
    "(Automodel's MegatronFSDPConfig: no pp_size)", where)) end
  if ctx.unit_of[module] then
    fail(string.format("%s: the module is already a unit (at %s); a module is one unit at most", where,
      ctx.unit_of[module].site or "?"), true)
  end
  local strategy = G.strategy(opts.zero_dp_strategy == nil and 3 or opts.zero_dp_strategy)
  if not strategy then
    fail(string.format("%s: zero_dp_strategy is %s; expected 0..3 or no_shard, optim, optim_grads, " ..
      "optim_grads_params", where, shown(opts.zero_dp_strategy)))
  end
  for _, k in ipairs(FLAGS) do
    if opts[k] ~= nil and type(opts[k]) ~= "boolean" then
      fail(string.format("%s: %s is %s; expected true or false", where, k, shown(opts[k])))
    end
  end
  local bs = opts.bucket_size
  if bs ~= nil and not (util.is_int(bs) and bs >= 1) then
    fail(string.format("%s: bucket_size is %s; expected a number of elements >= 1 (nil: Megatron-FSDP's " ..
      "default, no split)", where, shown(bs)))
  end
  local classes = {}
  if opts.unit_modules ~= nil then
    if type(opts.unit_modules) ~= "table" then
      fail(string.format("%s: unit_modules is %s; expected a list of module class names", where,
        shown(opts.unit_modules)))
    end
    for _, c in ipairs(opts.unit_modules) do
      if type(c) ~= "string" then fail(string.format("%s: unit_modules holds %s; expected class names", where, shown(c))) end
      classes[c:match("([^%.]+)$")] = true -- a class path's last part
    end
  end
  local axis = opts.mesh
  if type(axis) == "table" then
    if #axis ~= 1 then fail(string.format("%s: mesh has %d axes; Megatron-FSDP shards over one (no HSDP)", where, #axis)) end
    axis = axis[1]
  end
  if axis == nil then axis = replicate.flat_axis(ctx) end
  if type(axis) ~= "string" then fail(string.format("%s: mesh is %s; expected an axis name", where, shown(axis))) end
  ctx.mesh:size(axis)
  -- the FSDP unit modules: the outermost modules of those classes, in modules() order
  local unit_prefix, units = {}, {}
  for _, nm in ipairs(module:named_modules(name)) do
    local mname, m = nm[1], nm[2]
    local inside = false
    for _, u in ipairs(units) do inside = inside or mname:sub(1, #u + 1) == u .. "." end
    if not inside and classes[m.type] then
      units[#units + 1] = mname
      unit_prefix[#units] = mname .. "."
    end
  end
  local params, items = {}, {}
  for _, np in ipairs(ctx:params_of(module)) do
    local fqn, p = np[1], np[2]
    local owner = ctx.owner[p]
    if owner then
      fail(string.format("%s: parameter %s is already in the %s unit %s", where, fqn, owner.kind, display(owner.name)))
    end
    if ctx.ep[p] or ctx.tp[p] then
      fail(string.format("%s: parameter %s is placed by %s parallelism; this plan of Megatron-FSDP takes neither " ..
        "tensor nor expert parallelism", where, fqn, ctx.ep[p] and "expert" or "tensor"))
    end
    local uid
    for i, pre in ipairs(unit_prefix) do
      if fqn:sub(1, #pre) == pre then
        uid = i - 1
        break
      end
    end
    params[#params + 1] = p
    items[#items + 1] = { fqn = fqn, param = p, shape = p.shape, dtype = p.dtype,
      requires_grad = p.requires_grad and FLOAT[p.dtype] and true or false, unit_id = uid,
      expert = fqn:find(".experts.", 1, true) ~= nil }
  end
  local buckets = G.groups(items, bs)
  local unit = {
    name = name, module = module, mesh_axes = { axis }, kind = "megatron_fsdp",
    -- Megatron-FSDP computes in the stored dtypes (no cast policy; main weights are the optimizer's)
    mp = { cast_forward_inputs = false },
    reshard_after_forward = false, raf_explicit = true,
    params = params, ignored = {}, dims = {}, index = #ctx.units + 1, site = site,
    megatron = { strategy = strategy, zero = G.ZERO[strategy], items = items, buckets = buckets, unit_modules = units,
      grad_reduce_in_fp32 = opts.grad_reduce_in_fp32 == true, preserve_fp32_weights = opts.preserve_fp32_weights == true,
      overlap_param_gather = opts.overlap_param_gather ~= false, bucket_size = bs },
  }
  if #units == 0 then
    ctx:warn(string.format("%s: no FSDP unit module (unit_modules matched none): every parameter is in buckets " ..
      "outside units (Automodel refuses this; Megatron-FSDP would divide by zero FSDP modules)", where))
  end
  for _, p in ipairs(params) do ctx.owner[p] = unit end
  ctx.units[#ctx.units + 1] = unit
  ctx.unit_of[module] = unit
  return unit
end

-- ---------------------------------------------------------------- figures

local function bus(S, n) return S - util.ceil_div(S, n) end

--- A megatron_fsdp unit's figures once plan_layout laid it out as a unit of one shard rank
-- over its W ranks: each bucket's index (offsets, padded size, slice), bytes per rank,
-- transient gathered bytes and collectives per step.
function G.finish(unit, W)
  local m = unit.megatron
  local s = m.strategy
  local uname = display(unit.name)
  local params_b, grads_b, main_b = 0, 0, 0
  local ag, rs, ar = {}, nil, nil
  local rs_bytes, rs_count, ar_bytes, ar_count = 0, 0, 0, 0
  local persistent, groups = 0, {} -- ZeRO-3: gathered bytes kept (non-unit), per FSDP unit
  local grad_groups = {}
  for bi, b in ipairs(m.buckets) do
    b.index = bi - 1
    local numels = {}
    for k, i in ipairs(b.indices) do numels[k] = numel_of(m.items[i].shape) end
    local off, data, size = G.buffer_index(numels, b.chunk, W, s)
    b.offsets, b.data, b.size, b.shard = off, data, size, util.idiv(size, W)
    b.numel = 0
    for _, n in ipairs(numels) do b.numel = b.numel + n end
    b.pad = size - b.numel
    local pd = DTYPE_SIZE[b.dtype]
    b.grad_dtype = b.requires_grad and (m.grad_reduce_in_fp32 and "f32" or b.dtype) or nil
    local gd = b.requires_grad and DTYPE_SIZE[b.grad_dtype] or 0
    -- model weights: the parameters themselves under no_shard, else the (sharded) buffer
    b.param_bytes = s == "no_shard" and mul(b.numel, pd, "the bytes of unit %s", uname) or
      mul(m.zero == 3 and b.shard or size, pd, "the bytes of unit %s", uname)
    b.main_bytes = (b.requires_grad and m.preserve_fp32_weights) and
      mul(s == "no_shard" and size or b.shard, 4, "the main weight bytes of unit %s", uname) or 0
    b.grad_bytes = b.requires_grad and mul(m.zero >= 2 and b.shard or size, gd, "the gradient bytes of unit %s", uname) or 0
    params_b = add(add(params_b, b.param_bytes, "the bytes of unit %s", uname), b.main_bytes, "the bytes of unit %s", uname)
    main_b = main_b + b.main_bytes
    grads_b = add(grads_b, b.grad_bytes, "the gradient bytes of unit %s", uname)
    local full_p = mul(size, pd, "the gathered bytes of unit %s", uname)
    local full_g = mul(size, gd, "the gradient bytes of unit %s", uname)
    if W > 1 then
      if b.requires_grad then
        if s == "no_shard" then
          ar_bytes, ar_count = add(ar_bytes, bus(mul(2, full_g, "the all-reduce bytes of unit %s", uname), W),
            "the all-reduce bytes of unit %s", uname), ar_count + 1
        else
          rs_bytes, rs_count = add(rs_bytes, mul(b.shard * gd, W - 1, "the reduce-scatter bytes of unit %s", uname),
            "the reduce-scatter bytes of unit %s", uname), rs_count + 1
        end
      end
      if m.zero == 1 or m.zero == 2 then
        ag[#ag + 1] = { n = W, bytes = bus(full_p, W), once = true, bucket = b.index }
      elseif m.zero == 3 then
        if b.unit_id == nil then
          ag[#ag + 1] = { n = W, bytes = bus(full_p, W), once = true, bucket = b.index }
        else
          ag[#ag + 1] = { n = W, bytes = bus(full_p, W), bucket = b.index }          -- forward
          ag[#ag + 1] = { n = W, bytes = bus(full_p, W), bucket = b.index }          -- backward re-gather
        end
      end
    end
    if m.zero == 3 then
      if b.unit_id == nil then persistent = persistent + full_p
      else groups[b.unit_id + 1] = (groups[b.unit_id + 1] or 0) + full_p end
    end
    if m.zero >= 2 and b.requires_grad then
      local key = b.unit_id == nil and ("b" .. b.index) or b.unit_id
      grad_groups[key] = (grad_groups[key] or 0) + full_g
    end
  end
  -- transient: ZeRO-3's gathered buckets (the non-unit ones kept all step, the FSDP unit
  -- being computed and, with overlap_param_gather, the next one prefetched); ZeRO-2/3's
  -- unsharded gradient bucket group being reduce-scattered (the largest)
  local unit_peak = 0
  for i = 1, #m.unit_modules do
    local here = (groups[i] or 0) + (m.overlap_param_gather and (groups[i + 1] or 0) or 0)
    unit_peak = math.max(unit_peak, here)
  end
  local grad_peak = 0
  for _, v in pairs(grad_groups) do grad_peak = math.max(grad_peak, v) end
  m.gathered_bytes, m.grad_bucket_bytes = (m.zero == 3 and W > 1) and persistent + unit_peak or 0,
    (W > 1) and grad_peak or 0
  unit.unsharded_bytes = m.gathered_bytes
  unit.unsharded_grad_bytes = m.grad_bucket_bytes
  unit.reshard = false
  unit.param_shard_bytes = params_b
  unit.grad_shard_bytes = grads_b
  unit.bucket_buffer_bytes = grads_b -- plan_memory counts a megatron unit's gradients from here
  m.params_bytes, m.main_bytes, m.grads_bytes = params_b, main_b, grads_b
  if rs_count > 0 then rs = { n = W, bytes = rs_bytes, count = rs_count } end
  if ar_count > 0 then ar = { n = W, bytes = ar_bytes, count = ar_count } end
  unit.comm = { all_gather = ag, reduce_scatter = rs, all_reduce = ar }
  unit.all_gather_bytes = 0
  for _, c in ipairs(ag) do unit.all_gather_bytes = add(unit.all_gather_bytes, c.bytes, "the all-gather bytes of %s", uname) end
  unit.reduce_scatter_bytes, unit.all_reduce_bytes = rs and rs.bytes or 0, ar and ar.bytes or 0
  unit.gather_bytes_per_rank = ag[1] and ag[1].bytes or 0
  local padded, numel = 0, 0
  for _, b in ipairs(m.buckets) do padded, numel = padded + b.size, numel + b.numel end
  unit.padded_numel, unit.padding_fraction = padded, padded > 0 and (padded - numel) / padded or 0
  m.world = W
end

--- The optimizer state bytes of each rank r (0-based) of a megatron unit: the elements of
-- its slice of every trainable bucket that belong to a parameter (padding holds no state;
-- the optimizer sees each parameter's piece as a DTensor shard), times state_bytes of the
-- optimizer's dtype (fp32 main weights, else the parameter's); no_shard: every element.
-- Returns a list of W figures.
function G.optimizer_bytes(unit, state_bytes)
  local m = unit.megatron
  local W = m.world
  local out = {}
  for r = 1, W do out[r] = 0 end
  for _, b in ipairs(m.buckets) do
    if b.requires_grad then
      local per = state_bytes(m.preserve_fp32_weights and "f32" or b.dtype)
      for k, i in ipairs(b.indices) do
        local n, off = numel_of(m.items[i].shape), b.offsets[k]
        if m.strategy == "no_shard" then
          for r = 1, W do out[r] = out[r] + n * per end
        elseif n > 0 then
          local r0, r1 = util.idiv(off, b.shard), util.idiv(off + n - 1, b.shard)
          for r = r0, math.min(r1, W - 1) do
            local s, e = G.slice(off, n, b.shard, r)
            out[r + 1] = out[r + 1] + (e - s) * per
          end
        end
      end
    end
  end
  return out
end

--- Adds a megatron unit's optimizer state to plan_memory's events (shard axis -> steps).
function G.optimizer_events(unit, events, state_bytes)
  local per = G.optimizer_bytes(unit, state_bytes)
  local axis = unit.mesh_axes[1]
  local ev = events[axis] or {}
  events[axis] = ev
  local prev = 0
  for r, v in ipairs(per) do
    if v ~= prev then ev[#ev + 1] = { r - 1, v - prev, 0 } end
    prev = v
  end
  if prev ~= 0 then ev[#ev + 1] = { #per, -prev, 0 } end
end

-- ---------------------------------------------------------------- report

local ZERO_NAME = { [0] = "no sharding", "ZeRO-1", "ZeRO-2", "ZeRO-3" }

--- A megatron unit's lines for the plan table: its strategy, buffers and buckets.
function G.lines(u, mesh, add_line)
  local m = u.megatron
  local axis = u.mesh_axes[1]
  add_line(string.format("megatron_fsdp unit %s over %s=%d: zero_dp_strategy %s (%d, %s), %d bucket%s, %d FSDP unit " ..
    "module%s; grads %s%s", u.name == "" and "<root>" or u.name, axis, mesh:size(axis), m.strategy, m.zero,
    ZERO_NAME[m.zero], #m.buckets, #m.buckets == 1 and "" or "s", #m.unit_modules, #m.unit_modules == 1 and "" or "s",
    m.grad_reduce_in_fp32 and "reduced in f32" or "in the param dtype",
    m.preserve_fp32_weights and ", f32 main weights" or ""))
  add_line(string.format("  per rank: params %s%s, grads %s, transient gathered params %s, unsharded grad bucket %s",
    util.bytes(m.params_bytes), m.main_bytes > 0 and string.format(" (of which f32 main weights %s)",
      util.bytes(m.main_bytes)) or "", util.bytes(m.grads_bytes), util.bytes(m.gathered_bytes),
    util.bytes(m.grad_bucket_bytes)))
  for i, b in ipairs(m.buckets) do
    if i > 32 then
      add_line(string.format("  ... and %d more buckets (--json lists them)", #m.buckets - 32))
      break
    end
    add_line(string.format("  bucket %3d  %-28s %-5s %s%3d params %14s elems, chunk %d, padded %s (+%s), %s a rank",
      b.index, util.short_name(b.unit_id and m.unit_modules[b.unit_id + 1] or "(outside units)", 28), b.dtype,
      b.requires_grad and "" or "frozen ", #b.indices, util.thousands(b.numel), b.chunk, util.thousands(b.size),
      util.thousands(b.pad), util.thousands(b.shard)))
  end
end

--- A megatron unit's JSON field (jhelpers: jstr, jnum, jbool, jstrs, jobj from plan_report).
function G.json(u, j)
  local m = u.megatron
  local buckets = {}
  for i, b in ipairs(m.buckets) do
    local fqns, offs = {}, {}
    for k, idx in ipairs(b.indices) do fqns[k], offs[k] = m.items[idx].fqn, j.jnum(b.offsets[k]) end
    buckets[i] = "      " .. j.jobj({ { "index", j.jnum(b.index) }, { "fsdp_unit", j.jstr(b.unit_id and
      m.unit_modules[b.unit_id + 1] or nil) }, { "dtype", j.jstr(b.dtype) }, { "grad_dtype", j.jstr(b.grad_dtype) },
      { "requires_grad", j.jbool(b.requires_grad) }, { "chunk_size_factor", j.jnum(b.chunk) },
      { "params", j.jstrs(fqns) }, { "offsets", "[" .. table.concat(offs, ",") .. "]" }, { "numel", j.jnum(b.numel) },
      { "size", j.jnum(b.size) }, { "padding", j.jnum(b.pad) }, { "shard", j.jnum(b.shard) } })
  end
  return j.jstr("megatron_fsdp") .. ":" .. j.jobj({ { "zero_dp_strategy", j.jstr(m.strategy) },
    { "zero", j.jnum(m.zero) }, { "grad_reduce_in_fp32", j.jbool(m.grad_reduce_in_fp32) },
    { "preserve_fp32_weights", j.jbool(m.preserve_fp32_weights) }, { "params_bytes", j.jnum(m.params_bytes) },
    { "main_weight_bytes", j.jnum(m.main_bytes) }, { "grads_bytes", j.jnum(m.grads_bytes) },
    { "gathered_bytes", j.jnum(m.gathered_bytes) }, { "grad_bucket_bytes", j.jnum(m.grad_bucket_bytes) },
    { "unit_modules", j.jstrs(m.unit_modules) } }) .. "," .. j.jstr("megatron_buckets") .. ":[" ..
    (#buckets > 0 and "\n" .. table.concat(buckets, ",\n") .. "\n    " or "") .. "]"
end

return G
