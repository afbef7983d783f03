-- reference_adamw.lua: real FSDP2 with torch.optim.AdamW on gloo, replayed through the
-- shard units (moonshard -n N reference_adamw.lua CONFIG, CONFIG one of the file's configs:
-- fsdp2 on 2 ranks, fsdp4 and hsdp on 4).  tests/reference/fsdp2_adamw.py ran it and wrote
-- tests/reference/data/fsdp2_adamw.txt: the model (one unit per FSDP parameter group), the
-- optimizer's two parameter groups, which parameters have no gradient in which steps, and
-- after every step on every rank the local shards of the gradients (before the step), the
-- parameters, exp_avg and exp_avg_sq (bits), state['step'] and the optimizer's bytes.
--
-- Here every rank builds the same units on the same mesh (unit:set_adamw("torch"): the
-- state in the stored dtype, as torch.optim.AdamW keeps it), loads the same initial values,
-- and per step: unshards each unit that torch's forward used (the gathered parameters must
-- be the recorded shards of the previous step, all-gathered in the gather dtype), writes the
-- same gradients (gen below, the script's generator), reduces, compares the reduced
-- gradient shards, steps AdamW with the group's hyper-parameters, and compares the shards,
-- the moments, the per-parameter step and the optimizer bytes with torch's, bit for bit.
-- After step `restore_after` the units are replaced by new ones restored from the old ones'
-- shards and adamw_state (as torch's run restored its model and optimizer).
--
-- Prints per rank "rank R: <category> N of M values differ" for every category, the first
-- difference of each in detail, and "rank R: reference_adamw CONFIG ok (...)" when none do;
-- an error (exit 1) otherwise.
local ms = require "moonshard"
local S = require "support"

local config = assert(arg[1], "usage: moonshard -n N reference_adamw.lua CONFIG")
local data_file = arg[2] or "fsdp2_adamw.txt"
local D = S.refdata(data_file)
local rank = ms.rank()

local function rec(name)
  return D[name]
end
local function need(name)
  return assert(D[name], data_file .. ": no record " .. name).values
end

local cfg = need("config." .. config)
local cid, world, R, W = cfg[1], cfg[2], cfg[3], cfg[4]
assert(ms.world_size() == world,
  string.format("config %s is for %d ranks, %d are running", config, world, ms.world_size()))
local factor = R * W
local steps, restore_after = need("steps")[1], need("restore_after")[1]
local DTYPE = { [0] = "f32", [1] = "bf16", [2] = "f16" }

-- ------------------------------------------------------------------ the model
local modules, by_name = {}, {}
for name, r in pairs(D) do
  local m = name:match("^module%.([^.]+)$")
  if m then
    local v = r.values
    local mod = { name = m, stored = DTYPE[v[1]], param_dtype = DTYPE[v[2]], reduce_dtype = DTYPE[v[3]],
      group = v[4] >= 0 and v[4] or nil, params = {} }
    modules[#modules + 1] = mod
    by_name[m] = mod
  end
end
for name, r in pairs(D) do
  local m, p = name:match("^param%.([^.]+)%.([^.]+)$")
  if m then
    local v = r.values
    local shape = {}
    for k = 5, #v do shape[#shape + 1] = v[k] end
    local numel = 1
    for _, s in ipairs(shape) do numel = numel * s end
    local skip = {}
    for _, s in ipairs(need("skip." .. m .. "." .. p)) do skip[s] = true end
    table.insert(assert(by_name[m], "param of no module: " .. name).params,
      { name = p, index = v[1], kind = v[2], lo = v[3], hi = v[4], shape = shape, numel = numel, skip = skip })
  end
end
for _, mod in ipairs(modules) do
  table.sort(mod.params, function(a, b) return a.index < b.index end)
  mod.first = mod.params[1].index
  mod.gather = mod.param_dtype or mod.stored
end
table.sort(modules, function(a, b) return a.first < b.first end)
local groups = {}
for g = 0, 1 do
  local h = need("group." .. g)
  groups[g] = { lr = h[1], betas = { h[2], h[3] }, eps = h[4], weight_decay = h[5] }
end

-- ------------------------------------------------------------------ the gradients
-- fsdp2_adamw.py's mix() and gen(): every intermediate below 2^33, exact in Lua 5.4's
-- integers and in LuaJIT's doubles
local M = 65521
local function mix(...)
  local x = 1
  for _, v in ipairs({ ... }) do
    x = (x * 263 + v + 71) % M
    x = (x * x + 17) % M
  end
  return x
end

local function gen(r, s, p, i, kind, lo, hi)
  if kind == 2 then -- the f16 divide probe
    local sub = i % 4
    if sub == 0 then
      local v = 16 * (1024 + mix(cid, s, p, i, 4) % 1023) * math.floor(4 / factor)
      return mix(cid, s, p, i, 5) % 2 == 1 and v or -v
    elseif sub == 1 then
      return (1 + mix(cid, r, s, p, i, 6) % 3) * 2.0 ^ -24
    elseif sub == 2 then
      return 2 * (1 + mix(cid, s, p, i, 7) % 2) * 2.0 ^ -24
    end
    kind, lo, hi = 0, -6, 4
  elseif kind == 3 then -- the bf16 probe
    if i % 2 == 0 then return (1 + mix(cid, r, s, p, i, 8) % 3) * 2.0 ^ -133 end
    kind, lo, hi = 0, -6, 4
  end
  local k = mix(cid, r, s, p, i, 2)
  if kind == 0 then
    local e = lo + mix(cid, s, p, i, 1) % (hi - lo + 1)
    k = k % 30
    return (k % 15 + 1) * (k < 15 and -1 or 1) * 2.0 ^ e
  end
  local e = lo + mix(cid, s, p, i, 1) % (hi - lo + 1) + mix(cid, r, s, p, i, 3) % 7
  k = k % 510
  return (k % 255 + 1) * (k < 255 and -1 or 1) * 2.0 ^ e
end

-- ------------------------------------------------------------------ bits
-- the value of a bit pattern of dtype (f32, bf16, f16)
local function value_of(b, dtype)
  if dtype == "bf16" then b, dtype = b * 65536, "f32" end
  local ebits, mbits, bias = 8, 23, 127
  if dtype == "f16" then ebits, mbits, bias = 5, 10, 15 end
  local total = 1 + ebits + mbits
  local sign = b >= 2 ^ (total - 1) and -1 or 1
  local e = math.floor(b / 2 ^ mbits) % 2 ^ ebits
  local m = b % 2 ^ mbits
  if e == 2 ^ ebits - 1 then return m == 0 and sign * math.huge or 0 / 0 end
  if e == 0 then return sign * m * 2.0 ^ (1 - bias - mbits) end
  return sign * (m + 2 ^ mbits) * 2.0 ^ (e - bias - mbits)
end

local function hex(b, dtype)
  return string.format(dtype == "f32" and "0x%08x" or "0x%04x", b)
end

-- a tensor of dtype from bit patterns (exact: every pattern's value is an f64)
local function from_bits(bits, dtype, shape)
  local vals = {}
  for j, b in ipairs(bits) do vals[j] = value_of(b, dtype) end
  return ms.from_table(vals, "f64", shape):to(dtype)
end

-- ------------------------------------------------------------------ comparing
local cats = { "gather", "grad", "param", "exp_avg", "exp_avg_sq", "step", "optimizer_bytes" }
local compared, differ, first = {}, {}, {}
for _, c in ipairs(cats) do compared[c], differ[c] = 0, 0 end
local used = {} -- the records of this config and rank that were compared

local function compare(cat, what, got, want, dtype)
  compared[cat] = compared[cat] + #want
  if #got ~= #want then
    differ[cat] = differ[cat] + #want
    first[cat] = first[cat] or string.format("%s: %d values, torch has %d", what, #got, #want)
    return
  end
  for j = 1, #want do
    if got[j] ~= want[j] then
      differ[cat] = differ[cat] + 1
      if not first[cat] then
        if dtype then
          first[cat] = string.format("%s[%d]: moonshard %s (%.9g), torch %s (%.9g)", what, j - 1, hex(got[j], dtype),
            value_of(got[j], dtype), hex(want[j], dtype), value_of(want[j], dtype))
        else
          first[cat] = string.format("%s[%d]: moonshard %s, torch %s", what, j - 1, tostring(got[j]), tostring(want[j]))
        end
      end
    end
  end
end

local function key(r, s, mod, p, what)
  return string.format("%s.r%d.s%d.%s.%s.%s", config, r, s, mod.name, p.name, what)
end

-- ------------------------------------------------------------------ the units
local mesh, shard_group, replicate_group
if R == 1 then
  mesh = ms.mesh({ { "dp_shard", W } })
else
  mesh = ms.mesh({ { "dp_replicate", R }, { "dp_shard", W } })
  replicate_group = mesh:group("dp_replicate")
end
shard_group = mesh:group("dp_shard")
local rep = math.floor(rank / W) -- this rank's replica: its shard group is ranks rep * W .. rep * W + W - 1

local function new_unit(mod)
  local u = ms.unit(mod.name, shard_group, replicate_group, mod.param_dtype, mod.reduce_dtype, true)
  for _, p in ipairs(mod.params) do u:add_param(mod.name .. "." .. p.name, p.shape, mod.stored, 0, true) end
  u:finalize()
  u:set_adamw("torch")
  return u
end

for _, mod in ipairs(modules) do
  mod.unit = new_unit(mod)
  for i, p in ipairs(mod.params) do
    p.init = from_bits(need("init." .. mod.name .. "." .. p.name), mod.stored, p.shape)
    mod.unit:load_full(i - 1, p.init)
  end
end

-- the full parameter from every shard rank's recorded shard of step s (this replica's ranks)
local function gathered_bits(mod, p, s)
  local out = {}
  for q = 0, W - 1 do
    for _, b in ipairs(need(key(rep * W + q, s, mod, p, "param"))) do out[#out + 1] = b end
  end
  return out
end

-- A new unit restored from mod's: the shards (written before the new unit's first step),
-- and the AdamW state of the parameters that have one (torch's optimizer.state_dict() holds
-- the parameters that took a step; adamw_state would make a state for any other)
local function restore(mod, steps_taken)
  local old, u = mod.unit, new_unit(mod)
  for i = 0, #mod.params - 1 do
    u:param_shard(i):copy_(old:param_shard(i))
    if mod.group and old:adamw_skipped(i) < steps_taken then
      for _, which in ipairs({ "exp_avg", "exp_avg_sq" }) do u:adamw_state(i, which):copy_(old:adamw_state(i, which)) end
    end
    u:set_adamw_skipped(i, old:adamw_skipped(i))
  end
  old:release()
  mod.unit = u
end

for s = 1, steps do
  -- forward and backward: the units torch's forward called gather; every used parameter's
  -- gradient is G
  for _, mod in ipairs(modules) do
    local u = mod.unit
    u:zero_grad()
    local any = false
    for _, p in ipairs(mod.params) do any = any or not p.skip[s] end
    if any then
      u:unshard()
      u:wait()
      for i, p in ipairs(mod.params) do
        local want = s == 1 and p.init or from_bits(gathered_bits(mod, p, s - 1), mod.stored, p.shape)
        compare("gather", string.format("step %d %s.%s", s, mod.name, p.name), u:param_full(i - 1):bits(),
          want:to(mod.gather):bits(), mod.gather)
      end
      for i, p in ipairs(mod.params) do
        if not p.skip[s] then
          local vals = {}
          for j = 0, p.numel - 1 do vals[j + 1] = gen(rank, s, p.index, j, p.kind, p.lo, p.hi) end
          local g = ms.from_table(vals, "f64", p.shape)
          local gg = g:to(mod.gather)
          local back = gg:to("f64"):totable()
          for j = 1, #vals do assert(back[j] == vals[j], "G not exact in " .. mod.gather) end
          u:grad_full(i - 1):copy_(gg)
        end
      end
      u:reduce_grads()
      u:wait()
    end
    for i, p in ipairs(mod.params) do
      local k = key(rank, s, mod, p, "grad")
      local r, got = rec(k), u:grad_shard(i - 1)
      if r then
        used[k] = true
        if got then
          compare("grad", k, got:bits(), r.values, mod.stored)
        else
          compared.grad, differ.grad = compared.grad + math.max(r.n, 1), differ.grad + math.max(r.n, 1)
          first.grad = first.grad or (k .. ": moonshard has no gradient, torch has one")
        end
      elseif got then
        compared.grad, differ.grad = compared.grad + 1, differ.grad + 1
        first.grad = first.grad or (k .. ": moonshard has a gradient, torch has none")
      end
    end
  end
  -- the optimizer
  for _, mod in ipairs(modules) do
    if mod.group then
      local h = groups[mod.group]
      mod.unit:adamw_step({ lr = h.lr, betas = h.betas, eps = h.eps, weight_decay = h.weight_decay, step = s })
    end
  end
  local optimizer_bytes = 0
  for _, mod in ipairs(modules) do
    local u = mod.unit
    optimizer_bytes = optimizer_bytes + u:bytes().optimizer
    for i, p in ipairs(mod.params) do
      local k = key(rank, s, mod, p, "param")
      used[k] = true
      compare("param", k, u:param_shard(i - 1):bits(), need(k), mod.stored)
      for _, which in ipairs({ "exp_avg", "exp_avg_sq" }) do
        k = key(rank, s, mod, p, which)
        if rec(k) then
          used[k] = true
          compare(which, k, u:adamw_state(i - 1, which):bits(), need(k), mod.stored)
        end
      end
      k = key(rank, s, mod, p, "step")
      if rec(k) then
        used[k] = true
        compare("step", k, { s - u:adamw_skipped(i - 1) }, need(k))
      end
    end
  end
  local k = string.format("%s.r%d.s%d.optimizer_bytes", config, rank, s)
  used[k] = true
  compare("optimizer_bytes", k, { optimizer_bytes }, { need(k)[1] })
  if s == restore_after then
    for _, mod in ipairs(modules) do restore(mod, s) end
  end
end

-- every record of this config and rank was compared
local prefix = string.format("%s.r%d.", config, rank)
local unused = {}
for name in pairs(D) do
  if name:sub(1, #prefix) == prefix and not used[name] then unused[#unused + 1] = name end
end
table.sort(unused)
if #unused > 0 then
  first.unused = string.format("%d records of %s were not compared: %s", #unused, prefix,
    table.concat(unused, ", ", 1, math.min(4, #unused)))
end

local bad = #unused > 0
local summary = {}
for _, c in ipairs(cats) do
  print(string.format("rank %d: %s %d of %d values differ", rank, c, differ[c], compared[c]))
  if first[c] then print(string.format("rank %d: first %s difference: %s", rank, c, first[c])) end
  bad = bad or differ[c] > 0 or compared[c] == 0
  summary[#summary + 1] = string.format("%s %d", c, compared[c])
end
if bad then
  error(string.format("rank %d: %s differs from torch%s", rank, config, first.unused and (": " .. first.unused) or ""), 0)
end
print(string.format("rank %d: reference_adamw %s ok (%s)", rank, config, table.concat(summary, ", ")))
