-- trainer_support.lua: what the moe_trainer specs (trainer_spec.lua, trainer_pp_spec.lua)
-- share: running the trainer, a small model config, and reading what it prints and saves.
local S = require "support"
local safetensors = require "moonshard.safetensors"
local assert = require "luassert" -- busted's, which a required module does not see as a global

local M = {}

M.TRAINER = os.getenv("MOONSHARD_TRAINER") or "build/moe_trainer"

--- trainer(args, env?) -> support.run_with's result for the moe_trainer binary
function M.trainer(args, env)
  return S.run_with(M.TRAINER, args, env)
end

-- A small model (H=32, I=32, T=32, 47,816 parameters): a spec of it takes seconds on 2
-- cores (half a minute under AddressSanitizer).
M.SMALL = { hidden_size = 32, expert_dim = 32, seq_len = 32, num_experts = 4 }
M.small_config = S.write_file(os.tmpname(), string.format(
  "# trainer_spec: a small model\nhidden_size = %d\nexpert_dim = %d\nseq_len = %d\nnum_experts = %d\n",
  M.SMALL.hidden_size, M.SMALL.expert_dim, M.SMALL.seq_len, M.SMALL.num_experts))

--- {step -> loss} from "step K loss L" lines
function M.losses(out)
  local t = {}
  for k, l in out:gmatch("step (%d+) loss (%S+)") do t[tonumber(k)] = tonumber(l) end
  return t
end

--- {unit name -> list of {kind, dtype, n, bytes}} from --records lines
function M.records(out)
  local t = {}
  for unit, kind, dtype, n, bytes in out:gmatch("unit (%S+) (%S+) (%S+) n=(%d+) bytes=(%d+)") do
    t[unit] = t[unit] or {}
    table.insert(t[unit], { kind = kind, dtype = dtype, n = tonumber(n), bytes = tonumber(bytes) })
  end
  return t
end

-- An f32 from its little-endian bytes (Lua 5.4 and LuaJIT alike).
local function f32(b1, b2, b3, b4)
  local sign = b4 >= 128 and -1 or 1
  local exp = (b4 % 128) * 2 + math.floor(b3 / 128)
  local mant = ((b3 % 128) * 256 + b2) * 256 + b1
  if exp == 255 then return mant == 0 and sign * math.huge or 0 / 0 end
  if exp == 0 then return sign * mant * 2.0 ^ -149 end
  return sign * (1 + mant / 2.0 ^ 23) * 2.0 ^ (exp - 127)
end

--- {name -> {shape, values}} of a --save file: the header checked by moonshard's own
-- reader, then the data.
function M.read_params(path)
  local tensors = safetensors.read_header(path)
  local f = assert(io.open(path, "rb"))
  local bytes = f:read("a")
  f:close()
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
  local out = {}
  for _, t in ipairs(tensors) do
    assert.equal("f32", t.dtype)
    local values = {}
    for at = 8 + n + t.data_offsets[1], 8 + n + t.data_offsets[2] - 1, 4 do
      values[#values + 1] = f32(bytes:byte(at + 1, at + 4))
    end
    out[t.name] = { shape = t.shape, values = values }
  end
  return out
end

--- How far run {losses, params} is from ref: the largest relative difference of a step's
-- loss (over ref's steps), the largest absolute difference of a parameter element and the
-- tensor it is in, the elements differing by more than 1e-6, and the elements compared.
-- Every tensor of ref must be in run with the same shape.
function M.compare(ref, run, label)
  local loss_diff = 0
  for k, l in ipairs(ref.losses) do
    assert.is_truthy(run.losses[k], label .. ": no loss at step " .. k)
    loss_diff = math.max(loss_diff, math.abs(run.losses[k] - l) / l)
  end
  local max_diff, where, loose, count = 0, nil, 0, 0
  for name, t in pairs(ref.params) do
    local other = run.params[name]
    assert.is_truthy(other, name .. " missing from the " .. label .. " file")
    assert.same(t.shape, other.shape)
    for j, v in ipairs(t.values) do
      local d = math.abs(v - other.values[j])
      if d > max_diff then max_diff, where = d, name end
      if d > 1e-6 then loose = loose + 1 end
      count = count + 1
    end
  end
  return loss_diff, max_diff, where, loose, count
end

return M
