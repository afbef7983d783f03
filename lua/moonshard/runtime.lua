-- moonshard.runtime: a plan made real on this rank.
--
-- materialize(plan) builds the meshes of the plan's MeshContext on the running world (the
-- root mesh (pp, dp_replicate, dp_shard, cp, tp) and the MoE mesh (pp, ep_shard, ep)),
-- then one shard unit per planned unit, in plan order, over the groups of its mesh axes,
-- with the unit's precision and reshard rule and its parameters in plan order.

local ms = require "moonshard"

local M = {}

local function fail(msg) error("moonshard: runtime: " .. msg, 0) end

-- Flattened axes are groups over several root axes.
local FLATTENED = {
  dp = { "dp_replicate", "dp_shard" },
  dp_shard_cp = { "dp_shard", "cp" },
  dp_cp = { "dp_replicate", "dp_shard", "cp" },
}

local Rank = {}
Rank.__index = Rank

-- What a rank's plan makes: its mesh, optimizer and units (names, meshes, precision,
-- resharding, parameters with shapes and dtypes), as text.
local function plan_text(plan, mc)
  local out = {}
  for _, a in ipairs(mc:root_axes()) do out[#out + 1] = a.name .. "=" .. a.size end
  out[#out + 1] = "ep=" .. mc:size("ep") .. ";" .. tostring(plan.optimizer)
  for _, u in ipairs(plan.units) do
    out[#out + 1] = table.concat({ u.name, table.concat(u.mesh_axes, ","), tostring(u.mp.param_dtype),
      tostring(u.mp.reduce_dtype), tostring(u.reshard), tostring(u.offload) }, "|")
    for _, e in ipairs(u.entries) do
      out[#out + 1] = e.fqn .. ":" .. table.concat(e.shape, "x") .. ":" .. e.param.dtype .. ":" .. e.dim
    end
  end
  for _, o in ipairs(plan.owned) do out[#out + 1] = o.fqn .. "@" .. tostring(o.unit) end
  return table.concat(out, "\n")
end

-- Two 31-bit polynomial hashes of s (exact in doubles under both interpreters).
local function fingerprint(s)
  local a, b = 0, 0
  for i = 1, #s do
    local c = s:byte(i)
    a = (a * 31 + c) % 2147483647
    b = (b * 131 + c) % 2147483629
  end
  return a, b
end

-- materialize is collective: every rank must have made the same plan.  One all_gather over
-- the world of (units, fingerprints) before any unit's collective; a peer that planned
-- differently is named here instead of at the first collective that happens to differ, and
-- a peer that never materialises makes this one time out.
local function check_agreement(plan, mc, world)
  local n = ms.world_size()
  local a, b = fingerprint(plan_text(plan, mc))
  local mine = ms.from_table({ #plan.units, a, b }, "f64")
  local all = ms.tensor({ 3 * n }, "f64")
  world:all_gather(all, mine)
  local v = all:totable()
  local differ = {}
  for r = 0, n - 1 do
    if v[3 * r + 1] ~= #plan.units or v[3 * r + 2] ~= a or v[3 * r + 3] ~= b then differ[#differ + 1] = r end
  end
  if #differ > 0 then
    local shown = {}
    for i = 1, math.min(#differ, 4) do
      local r = differ[i]
      shown[i] = string.format("rank %d: %d units, fingerprint %d/%d", r, v[3 * r + 1], v[3 * r + 2], v[3 * r + 3])
    end
    fail(string.format("materialize: %d of the %d ranks planned differently from rank %d (%d units, fingerprint " ..
      "%d/%d; %s%s): every rank must plan the same model on the same mesh with the same policy", #differ, n,
      ms.rank(), #plan.units, a, b, table.concat(shown, "; "), #differ > 4 and "; ..." or ""))
  end
end

--- The buckets (moonshard.zero) of a planned megatron_fsdp unit pu over the dp group `dp`
-- (its axis's group; the plan's dp size), in plan order, each with its plan bucket as
-- .plan_bucket; optimizer: the plan's ("torch_adamw" keeps AdamW's moments in the stored dtype).
function M.megatron_buckets(pu, dp, optimizer)
  local m, list = pu.megatron, {}
  for _, b in ipairs(m.buckets) do
    local bk = require("moonshard.zero").zero_bucket(string.format("%s[bucket %d]", pu.name, b.index), dp,
      { strategy = m.strategy, dtype = b.dtype, requires_grad = b.requires_grad, grad_dtype = b.grad_dtype,
        main_f32 = m.preserve_fp32_weights })
    for k, i in ipairs(b.indices) do bk:add_param(m.items[i].fqn, m.items[i].shape, b.offsets[k]) end
    bk:finalize(b.size)
    if optimizer == "torch_adamw" then bk:set_adamw("torch") end
    bk.plan_bucket = b
    list[#list + 1] = bk
  end
  return list
end

--- materialize(plan) -> rank state {units = {...} (the plan's, a replicate unit's as one per
-- bucket, a megatron_fsdp unit's as one per bucket (state.buckets), then the ep-local ones),
-- by_name = {}, ep_local = {the ep-local units}, replicas = {replicate unit name -> its
-- runtime units}, stage = this rank's pipeline stage (nil without a pipeline)}.  Under a pipeline the units are those of the rank's stage, in plan order.
function M.materialize(plan)
  local mc = type(plan) == "table" and plan.mesh
  if type(mc) ~= "table" or type(mc.root_axes) ~= "function" or type(plan.units) ~= "table" then
    fail("materialize: expected a plan made by require('moonshard.plan').plan(model, mesh, policy), got " ..
      (type(plan) == "table" and "a table without its mesh (a decoded plan JSON cannot be materialised)" or
        tostring(plan)))
  end
  -- A pipeline: this rank makes the units of its own stage only, on the groups of its pp
  -- coordinate (pp is the outermost axis of both meshes, so every group below is within
  -- the stage).  One stage a rank: the multi-stage schedules (virtual stages) and expert
  -- parallelism under a pipeline are refused.
  local pipeline, my_stage = plan.pipeline, nil
  if pipeline then
    if pipeline.stages_per_rank ~= 1 then
      fail(string.format("materialize: the plan is a pipeline of %d stages over pp = %d, %d a rank (schedule %s); " ..
        "the runtime makes one stage a rank (schedules GPipe and 1F1B), not virtual stages", #pipeline.stages,
        mc:size("pp"), pipeline.stages_per_rank, pipeline.schedule))
    end
    if mc:size("ep") > 1 then
      fail(string.format("materialize: the plan is a pipeline over pp = %d with ep = %d; expert parallelism under " ..
        "a pipeline is not made real (plan ep = 1 or pp = 1)", mc:size("pp"), mc:size("ep")))
    end
    local p = mc:coord("pp", ms.rank())
    for _, s in ipairs(pipeline.stages) do
      if s.pp_rank == p then my_stage = s.index end
    end
  end
  if ms.world_size() ~= mc.world then
    local how = ms.backend() == "threads" and "moonshard -n %d, or a world of %d ranks in a host" or
      "mpirun -np %d, or a world of %d ranks in a host"
    fail(string.format("the plan is for %d ranks but %d are running (" .. how .. ")", mc.world, ms.world_size(),
      mc.world, mc.world))
  end
  local axes, names = {}, {}
  for _, a in ipairs(mc:root_axes()) do
    axes[#axes + 1] = { a.name, a.size }
    names[#names + 1] = a.name
  end
  local root = ms.mesh(axes)
  check_agreement(plan, mc, root:group(names))
  local moe = ms.mesh({ { "pp", mc:size("pp") }, { "ep_shard", mc:size("ep_shard") }, { "ep", mc:size("ep") } })
  local function group(axis)
    if axis == "ep_shard" or axis == "ep" then return moe:group(axis) end
    return root:group(FLATTENED[axis] or axis)
  end
  local state = setmetatable({ units = {}, by_name = {}, ep_local = {}, mesh = root, moe_mesh = moe,
    plan = plan, stage = my_stage }, Rank)
  -- Expert parallelism: an expert parameter holds the experts of this rank's ep coordinate
  -- (Shard(0) over ep; the host moves tokens to them with all_to_all on the ep group).  Its
  -- gradient on a rank already sums the contributions of every rank of the ep group, so the
  -- unit that reduces it over ep_shard divides by the whole data-parallel size
  -- (ep_shard * ep), not by ep_shard alone: the result is the gradient of the mean loss, as
  -- for the dense units.
  local dp = mc:size("ep_shard") * mc:size("ep")
  -- A unit planned with offload_policy "cpu" keeps its shards, gradient shards and optimizer
  -- state in host memory (ms_unit_set_cpu_offload; on the threads and MPI backends
  -- everything is there already).
  -- A packed unit (the planner's islands packed into their module's unit) holds parameters
  -- of several stored dtypes, each island's with the island's own policy (p.mp).
  local function add_unit(name, shard, replicate, param_dtype, reduce_dtype, reshard, params, factor, offload, packed)
    local u = ms.unit(name, shard, replicate, param_dtype, reduce_dtype, reshard)
    -- where the shards live is fixed before the first parameter is allocated
    if offload then u:set_cpu_offload(true) end
    if packed then u:set_packed(true) end
    for i, p in ipairs(params) do
      u:add_param(p.fqn, p.shape, p.dtype, p.dim, p.requires_grad)
      if p.mp then u:set_param_policy(i - 1, p.mp.param_dtype, p.mp.reduce_dtype) end
      -- a recipe's fp8 step with the float8 all-gather: gathered as e4m3 (unit_fp8.c)
      if p.fp8 then u:set_fp8_all_gather(i - 1) end
    end
    u:finalize()
    if factor then u:set_gradient_divide_factor(factor) end
    -- the plan's optimizer: torch_adamw keeps AdamW's state in the stored dtype
    if plan.optimizer == "torch_adamw" then u:set_adamw("torch") end
    state.units[#state.units + 1] = u
    state.by_name[name] = u
    return u
  end
  -- A tensor-parallel parameter holds this rank's tp piece; where tp splits a dim unevenly,
  -- the pieces differ between tp ranks (the plan's entries are tp rank 0's).
  local tp = plan.tensor_parallel and plan.tensor_parallel.params
  local tp_coord = mc:coord("tp", ms.rank())
  -- A replicate unit (DDP) runs as one unit per bucket of the plan, in the order DDP reduces
  -- them, named "<unit>[bucket i]": HSDP units whose shard group is this rank alone (nothing
  -- is gathered: the parameters stay whole) and whose replicate group is the unit's axis, so
  -- that reduce_grads is the bucket's one all_reduce, in the stored dtype, each gradient
  -- divided by the group's size before the sum (torch's Reducer multiplies it by 1/size:
  -- the same for a power of two).  Frozen parameters, in no bucket, are a unit
  -- "<unit>[frozen]" that never reduces.  state.replicas[name] lists a unit's runtime units.
  state.replicas = {}
  local one_rank
  local function add_replicate(pu)
    one_rank = one_rank or ms.mesh({ { "replicas", ms.world_size() }, { "self", 1 } }):group("self")
    local axis = pu.mesh_axes[1]
    local size = mc:size(axis)
    local list = {}
    local function entry(p, fqn)
      if #p.shape == 0 then
        fail(string.format("materialize: replicate unit %s: parameter %s is 0-dim; a runtime unit holds tensors of 1 " ..
          "to 8 dims", pu.name == "" and "<root>" or pu.name, fqn))
      end
      return { fqn = fqn, shape = p.shape, dtype = p.dtype, dim = 0, requires_grad = p.requires_grad }
    end
    local fqn_of, in_bucket = {}, {}
    for _, e in ipairs(pu.entries) do fqn_of[e.param] = e.fqn end
    for _, b in ipairs(pu.buckets) do
      local params = {}
      for i, p in ipairs(b.params) do
        params[i] = entry(p, b.fqns[i])
        in_bucket[p] = true
      end
      list[#list + 1] = add_unit(string.format("%s[bucket %d]", pu.name, b.index), one_rank,
        size > 1 and group(axis) or nil, nil, nil, false, params, size > 1 and size or nil)
    end
    local frozen = {}
    for _, e in ipairs(pu.entries) do
      if not in_bucket[e.param] then frozen[#frozen + 1] = entry(e.param, e.fqn) end
    end
    if #frozen > 0 then list[#list + 1] = add_unit(pu.name .. "[frozen]", one_rank, nil, nil, nil, false, frozen) end
    state.replicas[pu.name] = list
  end
  local mine = plan.units
  if pipeline then
    mine = {}
    for _, pu in ipairs(plan.units) do
      if pu.stage == my_stage then mine[#mine + 1] = pu end
    end
  end
  -- A Megatron-FSDP unit (moonshard.plan_megatron) runs as one bucket a plan bucket
  -- (moonshard.zero), in plan order, named "<unit>[bucket i]", over the group of its dp axis:
  -- the plan's offsets and padded size, its strategy, gradient dtype and main weights.
  -- state.units gets each bucket's unit handle (so the rank's bytes, allocations and records
  -- count them, and an embedding host gets them as units: ms_unit_zero_*), state.buckets the
  -- buckets, state.megatron[name] a unit's buckets.
  state.buckets, state.megatron = {}, {}
  local function add_megatron(pu)
    local list = M.megatron_buckets(pu, group(pu.mesh_axes[1]), plan.optimizer)
    for _, bk in ipairs(list) do
      state.buckets[#state.buckets + 1] = bk
      state.units[#state.units + 1] = bk.unit
      state.by_name[bk:name()] = bk.unit
    end
    state.megatron[pu.name] = list
  end
  for _, pu in ipairs(mine) do
    if pu.kind == "replicate" then
      add_replicate(pu)
    elseif pu.kind == "megatron_fsdp" then
      add_megatron(pu)
    else
      local axes_u = pu.mesh_axes
      local params = {}
      for _, e in ipairs(pu.entries) do
        local t = tp and tp[e.param]
        params[#params + 1] = { fqn = e.fqn, shape = t and t.local_shapes[tp_coord + 1] or e.shape, dtype = e.param.dtype,
          dim = e.dim, requires_grad = e.param.requires_grad, fp8 = e.param.fp8_gather ~= nil,
          mp = pu.param_mp and pu.param_mp[e.param] or nil }
      end
      local experts = axes_u[#axes_u] == "ep_shard" and dp > 1
      add_unit(pu.name, group(axes_u[#axes_u]), #axes_u == 2 and group(axes_u[1]) or nil, pu.mp.param_dtype,
        pu.mp.reduce_dtype, pu.reshard, params, experts and dp or nil, pu.offload == "cpu", pu.packed)
    end
  end
  -- ep-local units: the unsharded expert parameters of each module, in plan order.  Expert
  -- parameters that no planned unit holds (ep_shard = 1) are not sharded at all; they still
  -- need gradients and optimizer state, so each experts module gets an "ep-local" unit on the
  -- one-rank ep_shard group, named "<module>[ep]", holding them in their stored dtype (what a
  -- parameter outside FSDP computes in), with the same divide factor.  Its collectives are
  -- one-rank copies that move no bytes between ranks.  The ep-local units never offload:
  -- their parameters are outside FSDP, where CPUOffloadPolicy does not reach, and the plan
  -- counts them on the device.
  local modules, by_module = {}, {}
  for _, o in ipairs(plan.owned) do
    if not o.unit then
      local module = o.fqn:match("^(.*)%.[^.]+$") or ""
      if not by_module[module] then
        by_module[module] = {}
        modules[#modules + 1] = module
      end
      table.insert(by_module[module], { fqn = o.fqn, shape = o.local_shape, dtype = o.dtype, dim = 0,
        requires_grad = o.requires_grad })
    end
  end
  for _, module in ipairs(modules) do
    local params = by_module[module]
    local u = add_unit(module .. "[ep]", group("ep_shard"), nil, params[1].dtype, params[1].dtype, true, params, dp)
    state.ep_local[#state.ep_local + 1] = u
  end
  return state
end

--- Bytes this rank holds in every unit and local parameter, by category.
function Rank:bytes()
  local total = { params = 0, grads = 0, optimizer = 0, unsharded = 0, cached = 0 }
  for _, u in ipairs(self.units) do
    for k, v in pairs(u:bytes()) do total[k] = total[k] + v end
  end
  return total
end

--- The memory allocated for this rank's units, counted at the allocator rather than from
-- their books: {params=, grads=, optimizer=, unsharded=} (unsharded: the transient buffers,
-- the cached ones included). Zeros for a rank without units.
function Rank:allocated()
  local u = self.units[1]
  return u and u:rank_allocated() or { params = 0, grads = 0, optimizer = 0, unsharded = 0 }
end

--- Every collective the units issued: a list of {unit=, kind=, dtype=, group_size=, bytes=}.
function Rank:records()
  local out = {}
  for _, u in ipairs(self.units) do
    for _, r in ipairs(u:records()) do
      r.unit = u:name()
      out[#out + 1] = r
    end
  end
  return out
end

return M
