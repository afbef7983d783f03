-- checkpoint_hf.lua: a Hugging Face checkpoint loaded into the units of a plan, every rank's
-- shards checked bit for bit against the tensors read whole (here, in plain Lua, from the
-- file's bytes: nothing of moonshard's reading or casting is used to make the expected values).
--
--   moonshard -n N checkpoint_hf.lua CONFIG MESH CHECKPOINT [DTYPE [REFERENCE [POLICY [SET]]]]
--
-- CONFIG: a config.json (its model is planned); MESH: "dp_shard=4", ...; CHECKPOINT: what
-- load_hf reads (a directory, an index, a file); DTYPE: the model's dtype for the plan
-- (default the config's: "float32", "bfloat16"), so the units store another dtype than the
-- checkpoint; REFERENCE: a .safetensors file holding the expected values in the units' dtype
-- (torch's cast), default the checkpoint itself; POLICY: default policies/fsdp2_default.lua;
-- SET: KEY=VALUE options for the policy, space-separated ("zero_dp_strategy=optim
-- preserve_fp32_weights=true"); f32 main weights are compared with the checkpoint's values.  A Megatron-FSDP bucket's
-- whole parameter is compared where the rank holds it whole (ZeRO-0..2), else its piece.
-- Prints per rank "rank R: ok P params, N elements, max diff X, read B of D bytes (K reads)"
-- and on rank 0 "total read T bytes of D".
local ms = require "moonshard"
local json = require "moonshard.json"
local st = require "moonshard.safetensors"

local config_path, mesh_spec, ckpt = arg[1], arg[2], arg[3]
local dtype, ref_path, policy_path = arg[4], arg[5], arg[6] and arg[6] ~= "" and arg[6] or "policies/fsdp2_default.lua"
local set = {}
for kv in (arg[7] or ""):gmatch("%S+") do set[#set + 1] = kv end
local f = assert(io.open(config_path))
local config = json.decode(f:read("a"))
f:close()
if dtype and dtype ~= "" then config.dtype = dtype config.torch_dtype = nil end
local tree = require("moonshard.models").from_config(config, config_path)
local mesh = require("moonshard.mesh_context").new(mesh_spec)
local policy = require("moonshard.policy")
local loaded = policy.load(policy_path, { modules = policy.host_modules() })
local plan = require("moonshard.plan").plan(tree, mesh, policy.entry_point(loaded, policy_path), { set = set })
local state = require("moonshard.runtime").materialize(plan)
local report = require("moonshard.checkpoint_hf").load_hf(state, ckpt)

-- ---------------------------------------------------------------- the expected values
local function dir_of(p) return p:match("^(.*)/[^/]*$") or "." end
local function resolve(p)
  if ms.file_stat(p) == "directory" then
    local idx = p .. "/model.safetensors.index.json"
    if io.open(idx) then return idx end
    return p .. "/model.safetensors"
  end
  return p
end
-- name -> {dtype, shape, bits = function(flat index) -> bit pattern}
local whole = {}
local function load_whole(path)
  path = resolve(path)
  local list
  if path:match("%.json$") then list = st.read_index(path) else list = st.read_header(path) end
  local files = {}
  local out = {}
  for _, t in ipairs(list) do
    if not files[t.file] then
      local h = assert(io.open(t.file, "rb"))
      local bytes = h:read("a")
      h:close()
      local n = 0
      for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
      files[t.file] = { bytes = bytes, start = 8 + n }
    end
    local fl = files[t.file]
    local size = ({ f32 = 4, bf16 = 2 })[t.dtype]
    assert(size, "the test reads f32 and bf16 only: " .. t.name)
    local base = fl.start + t.data_offsets[1]
    out[t.name] = { dtype = t.dtype, shape = t.shape, bits = function(i)
      local v = 0
      for b = size, 1, -1 do v = v * 256 + fl.bytes:byte(base + i * size + b) end
      return v
    end }
  end
  return out
end
whole = load_whole(ref_path and ref_path ~= "" and ref_path or ckpt)
local whole_ckpt = load_whole(ckpt) -- the f32 main weights take the checkpoint's own values

local function value_of(bits, dt)
  if dt == "bf16" then bits = bits * 65536 end
  local s = bits >= 2147483648 and -1 or 1
  local e = math.floor(bits / 8388608) % 256
  local m = bits % 8388608
  if e == 0 then return s * m * 2.0 ^ -149 end
  return s * (1 + m / 8388608) * 2.0 ^ (e - 127)
end

local function flat(shape, idx) -- 0-based indices
  local i = 0
  for d = 1, #shape do i = i * shape[d] + idx[d] end
  return i
end

-- every planned name that is tied: lm_head.weight -> model.embed_tokens.weight, and back
local function tensor_named(name)
  if whole[name] then return whole[name] end
  if name == "model.embed_tokens.weight" then return whole["lm_head.weight"] end
  if name == "lm_head.weight" then return whole["model.embed_tokens.weight"] end
end

local owned = {}
for _, o in ipairs(plan.owned) do owned[o.fqn] = o end
local ep_coord = mesh:coord("ep", ms.rank())
-- tensor parallelism: fqn -> {dim, off}, the tp piece's first row as torch.chunk cuts a dim of
-- n rows into tp pieces (ceil(n / tp) rows each, the last fewer), from the global shape alone
local tp_at = {}
local tp_size, tp_coord = mesh:size("tp"), mesh:coord("tp", ms.rank())
local tpp = plan.tensor_parallel and plan.tensor_parallel.params or {}
for _, pu in ipairs(plan.units) do
  for _, e in ipairs(pu.entries or {}) do
    local t = tpp[e.param]
    if t and t.dim and tp_size > 1 then
      local rows = e.param.shape[t.dim + 1]
      local chunk = math.ceil(rows / tp_size)
      tp_at[e.fqn] = { dim = t.dim, off = math.min(tp_coord * chunk, rows) }
    end
  end
end

-- expected (bits in the ref's dtype, and that dtype) of element idx (0-based, unit-level) of fqn
local function expected(fqn, g)
  local prefix, which = fqn:match("^(.*%.experts)%.([%w_]+)$")
  if which == "gate_and_up_projs" then
    local I = tensor_named(prefix .. ".0.up_proj.weight").shape[1]
    local e, h, x = g[1], g[2], g[3]
    local t = x < I and tensor_named(string.format("%s.%d.gate_proj.weight", prefix, e)) or
      tensor_named(string.format("%s.%d.up_proj.weight", prefix, e))
    return t.bits(flat(t.shape, { x % I, h })), t.dtype
  elseif which == "down_projs" then
    local t = tensor_named(string.format("%s.%d.down_proj.weight", prefix, g[1]))
    return t.bits(flat(t.shape, { g[3], g[2] })), t.dtype
  end
  local t = assert(tensor_named(fqn), "no reference tensor " .. fqn)
  return t.bits(flat(t.shape, g)), t.dtype
end

local elements, max_diff, wrong = 0, 0, {}
local function compare(fqn, shard, to_global, nelem)
  local bits = shard:bits()
  local dt = shard:dtype()
  for k = 0, nelem - 1 do
    local want, wdt = expected(fqn, to_global(k))
    local have = bits[k + 1]
    local want_bits = want
    if wdt == "bf16" and dt == "f32" then want_bits = want * 65536
    elseif wdt ~= dt then error(string.format("%s: reference %s, unit %s", fqn, wdt, dt)) end
    local d = math.abs(value_of(have, dt) - value_of(want_bits, dt))
    if d > max_diff then max_diff = d end
    if have ~= want_bits and #wrong < 5 then
      wrong[#wrong + 1] = string.format("%s[%d]: 0x%x, expected 0x%x", fqn, k, have, want_bits)
    end
    elements = elements + 1
  end
end

local params = 0
local zero = {}
for _, bk in ipairs(state.buckets or {}) do zero[bk.unit] = true end
for _, u in ipairs(state.units) do
  if not zero[u] then
    for i = 0, u:count() - 1 do
      local fqn = u:fqn(i)
      local shard = u:param_shard(i)
      local off, _, dim = u:param_offset(i)
      local shape = shard:shape()
      local o = owned[fqn]
      local eo = (o and o.local_shape[1] ~= o.shape[1]) and ep_coord * o.local_shape[1] or 0
      compare(fqn, shard, function(k)
        local idx = {}
        for d = #shape, 1, -1 do idx[d] = k % shape[d] k = math.floor(k / shape[d]) end
        idx[dim + 1] = idx[dim + 1] + off
        idx[1] = idx[1] + eo
        local tpo = tp_at[fqn]
        if tpo then idx[tpo.dim + 1] = idx[tpo.dim + 1] + tpo.off end
        return idx
      end, shard:numel())
      params = params + 1
    end
  end
end
for _, bk in ipairs(state.buckets or {}) do
  for i = 0, bk:count() - 1 do
    local fqn = bk:fqn(i)
    local a, b = bk:piece(i)
    local t = tensor_named(fqn)
    local main = bk:piece_tensor(i, "main")
    local function at(first)
      return function(k)
        local idx, n = {}, first + k
        for d = #t.shape, 1, -1 do idx[d] = n % t.shape[d] n = math.floor(n / t.shape[d]) end
        return idx
      end
    end
    if main and b > a then
      local saved = whole
      whole = whole_ckpt
      compare(fqn, main, at(a), b - a)
      whole = saved
    end
    if bk.strategy ~= "optim_grads_params" then a, b = 0, bk:param(i):numel() end
    local values = bk.strategy ~= "optim_grads_params" and bk:param(i):view({ b }) or bk:piece_tensor(i, "param")
    compare(fqn, values, at(a), b - a)
    params = params + 1
  end
end

local n = ms.world_size()
local world = ms.mesh({ { "world", n } }):group("world")
local all = ms.tensor({ n }, "f64")
world:all_gather(all, ms.from_table({ report.bytes_read }, "f64"))
if #wrong > 0 then
  error(string.format("rank %d: %s", ms.rank(), table.concat(wrong, "; ")))
end
print(string.format("rank %d: ok %d params, %d elements, max diff %g, read %d of %d bytes (%d reads, %d tensors)",
  ms.rank(), params, elements, max_diff, report.bytes_read, report.data_bytes, report.reads, report.tensors))
if ms.rank() == 0 then
  local total = 0
  for _, v in ipairs(all:totable()) do total = total + v end
  print(string.format("total read %d bytes of %d", total, report.data_bytes))
end
