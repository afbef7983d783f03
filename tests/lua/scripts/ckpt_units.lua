-- ckpt_units.lua: the tiny inkling2 plan made real, trained, saved and loaded through
-- moonshard.checkpoint (moonshard -n N ckpt_units.lua MESH STEPS [save=K:ROOT]
-- [load=ROOT] [export=DIR] [resave=ROOT]).  Parameters start from values that depend on each
-- element's global position, gradients too (the same on every rank, so the reduced mean is
-- exact on any mesh and AdamW's result is independent of the sharding): a run resumed from a
-- checkpoint on another mesh must export the same bytes as the uninterrupted run.
local ms = require "moonshard"
local json = require "moonshard.json"
local ckpt = require "moonshard.checkpoint"

local mesh_spec, steps = arg[1], tonumber(arg[2])
local opts = {}
for i = 3, #arg do
  local k, v = arg[i]:match("^(%w+)=(.*)$")
  opts[k] = v
end
local f = assert(io.open("tests/lua/configs/inkling2_tiny.json"))
local config = json.decode(f:read("a"))
f:close()
-- heads=Q:KV: other head counts (tp must divide them)
if opts.heads then
  config.num_attention_heads, config.num_key_value_heads = opts.heads:match("^(%d+):(%d+)$")
  config.num_attention_heads, config.num_key_value_heads = tonumber(config.num_attention_heads),
    tonumber(config.num_key_value_heads)
end
local tree = require("moonshard.models").from_config(config, "inkling2_tiny")
local mc = require("moonshard.mesh_context").new(mesh_spec)
-- mfsdp=S: the Megatron-FSDP policy with zero_dp_strategy S (buckets), else inkling2's units
local plan
if opts.mfsdp then
  plan = require("moonshard.plan").plan(tree, mc, require("moonshard.policy").load("policies/megatron_fsdp.lua").main,
    { set = { "zero_dp_strategy=" .. opts.mfsdp } })
else
  plan = require("moonshard.plan").plan(tree, mc, require("moonshard.policy").load("policies/inkling2").shard_units)
end
local state = require("moonshard.runtime").materialize(plan)

local strip = require("moonshard.module").strip_checkpoint
local global, kof = {}, {}
for k, np in ipairs(tree:named_parameters()) do
  global[strip(np[1])] = np[2].shape
  kof[strip(np[1])] = k
end
local experts = {}
for _, pu in ipairs(plan.units) do
  if pu.mesh_axes[#pu.mesh_axes] == "ep_shard" and state.by_name[pu.name] then experts[state.by_name[pu.name]] = true end
end
for _, u in ipairs(state.ep_local) do experts[u] = true end
local ep, ep_size = mc:coord("ep", ms.rank()), mc:size("ep")

-- values of a box (shape at global offset off) of tensor fqn by fn(k, global flat index)
local function box_values(fqn, shape, off, fn)
  local g, k = global[strip(fqn)], kof[strip(fqn)]
  local vals, idx, n = {}, {}, 1
  for d = 1, #shape do idx[d], n = 0, n * shape[d] end
  for j = 1, n do
    local gi = 0
    for d = 1, #shape do gi = gi * g[d] + off[d] + idx[d] end
    vals[j] = fn(k, gi)
    local d = #shape
    while d >= 1 do
      idx[d] = idx[d] + 1
      if idx[d] < shape[d] then break end
      idx[d], d = 0, d - 1
    end
  end
  return ms.from_table(vals, "f64", shape)
end

local function ep_offset(u, fqn)
  if experts[u] and ep_size > 1 then return ep * (global[strip(fqn)][1] / ep_size) end
  return 0
end

-- a tp piece's global offsets: the rows of the tp coordinates before this one on its dim
local tp_at = {}
if plan.tensor_parallel then
  local c = mc:coord("tp", ms.rank())
  for _, pu in ipairs(plan.units) do
    for _, e in ipairs(pu.entries) do
      local t = plan.tensor_parallel.params[e.param]
      if t and t.dim then
        local at = 0
        for k = 1, c do at = at + t.local_shapes[k][t.dim + 1] end
        tp_at[e.fqn] = { t.dim + 1, at }
      end
    end
  end
end
local function global_off(u, fqn, off)
  off[1] = off[1] + ep_offset(u, fqn)
  local t = tp_at[fqn]
  if t then off[t[1]] = off[t[1]] + t[2] end
  return off
end

-- Megatron-FSDP buckets by their unit handles, with each parameter's global shape
local bucket_of = {}
for _, pu in ipairs(plan.units) do
  for _, bk in ipairs(pu.kind == "megatron_fsdp" and state.megatron[pu.name] or {}) do
    local shapes = {}
    for k, i in ipairs(bk.plan_bucket.indices) do shapes[k] = pu.megatron.items[i].shape end
    bucket_of[bk.unit] = { bk = bk, shapes = shapes }
  end
end
local function zeros(n)
  local z = {}
  for d = 1, n do z[d] = 0 end
  return z
end

local dense = {}
for _, u in ipairs(state.units) do
  if not bucket_of[u] then dense[#dense + 1] = u end
end

local first = 1
if opts.load then
  local step, extra, _, stats = ckpt.load(state, opts.load)
  assert(extra.note == "resume here", "extra state")
  print(string.format("rank %d: loaded, read %d bytes", ms.rank(), stats.bytes_read))
  first = step + 1
else
  for _, u in ipairs(state.units) do
    local z = bucket_of[u]
    for i = 0, z and u:count() - 1 or -1 do
      local shape, dtype = z.shapes[i + 1], z.bk:piece_tensor(i, "param"):dtype()
      z.bk:load_full(i, box_values(u:fqn(i), shape, zeros(#shape),
        function(k, gi) return ((k * 131 + gi * 17) % 97) / 97 - 0.5 end):to(dtype))
    end
    for i = 0, z and -1 or u:count() - 1 do
      local sh = u:param_shard(i)
      local shape = sh:shape()
      if sh:numel() > 0 then
        local offset, _, dim = u:param_offset(i)
        local off = {}
        for d = 1, #shape do off[d] = d == dim + 1 and offset or 0 end
        global_off(u, u:fqn(i), off)
        sh:copy_(box_values(u:fqn(i), shape, off, function(k, gi) return ((k * 131 + gi * 17) % 97) / 97 - 0.5 end))
      end
    end
  end
end

for step = first, steps do
  for _, u in ipairs(state.buckets) do
    u:unshard()
    for i = 0, u:count() - 1 do
      local g = u:grad(i)
      if g then
        g:copy_(box_values(u:fqn(i), g:shape(), zeros(g:ndim()),
          function(k, gi) return ((k * 7 + gi * 3 + step) % 64) / 64 - 0.5 end))
      end
    end
    u:reduce_grads()
    u:reshard()
  end
  for _, u in ipairs(dense) do
    u:unshard():wait()
    local handed = false
    for i = 0, u:count() - 1 do
      local g = u:grad_full(i)
      if g then
        local off = {}
        for d = 1, g:ndim() do off[d] = 0 end
        global_off(u, u:fqn(i), off)
        -- an expert's gradient on a rank sums the ep group's contributions (runtime.lua), and
        -- the unit divides by ep_shard x ep: ep x the value gives the same mean on any mesh
        local scale = experts[u] and ep_size or 1
        g:copy_(box_values(u:fqn(i), g:shape(), off,
          function(k, gi) return scale * (((k * 7 + gi * 3 + step) % 64) / 64 - 0.5) end))
        handed = true
      end
    end
    if handed then u:reduce_grads():wait() else u:release_unsharded() end
  end
  for _, u in ipairs(state.units) do
    local z = bucket_of[u]
    if z then z.bk:adamw_step({ lr = 1e-2, step = step }) else u:adamw_step({ lr = 1e-2, step = step }) end
  end
  for _, u in ipairs(state.units) do
    local z = bucket_of[u]
    if z then z.bk:clear_grads() else u:zero_grad() end
  end
  if opts.save and tonumber(opts.save:match("^(%d+):")) == step then
    ckpt.save(state, opts.save:match(":(.*)$"), { step = step, extra = { note = "resume here", rng = { 1, 2, 3 } },
      keep_last = 2 })
  end
end
if opts.resave then ckpt.save(state, opts.resave, { step = steps, extra = { note = "resume here" } }) end
if opts.export then ckpt.export_hf(state, opts.export, { max_shard_size = "20KB" }) end
print(string.format("rank %d: ckpt_units ok (%s, %d units)", ms.rank(), mesh_spec, #state.units))
