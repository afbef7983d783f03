-- trainer_support.lua: what the moe_trainer specs share (trainer_spec.lua, trainer_tp_spec.lua,
-- trainer_pp_spec.lua): running the trainer (as threads or under mpirun), its small config,
-- reading its output and saved parameters, and comparing runs.
local S = require "support"
local safetensors = require "moonshard.safetensors"
local assert = require "luassert"

local TS = {}

local TRAINER = os.getenv("MOONSHARD_TRAINER") or "build/moe_trainer"
TS.TRAINER = TRAINER

--- trainer(args, env?) -> support.run_with's result for the moe_trainer binary
function TS.trainer(args, env)
  return S.run_with(TRAINER, args, env)
end

--- run_ok(args) -> the result of a trainer run that must succeed with nothing on stderr
function TS.run_ok(args)
  local r = TS.trainer(args)
  assert.equal("", r.err)
  assert.equal(0, r.code)
  return r
end

-- The trainer under mpirun, one rank a process (as tests/mpi/run.sh launches moonshard); nil
-- when there is no mpirun.
TS.MPIRUN = os.getenv("MPIEXEC") or "mpirun"

-- MOONSHARD_TEST_QUICK=1: tools/test.sh sets it for the sanitizer builds, which run after
-- the Release build has checked every case's numerics.  There a sweep keeps only the cases at
-- the indices given (default: the last, the most composite mesh), so that each code path
-- still runs once under AddressSanitizer and UBSan; elsewhere it keeps them all.
TS.QUICK = os.getenv("MOONSHARD_TEST_QUICK") == "1"
function TS.quick(cases, ...)
  if not TS.QUICK then return cases end
  local keep, out = { ... }, {}
  if #keep == 0 then keep = { #cases } end
  for _, i in ipairs(keep) do out[#out + 1] = assert(cases[i], "TS.quick: no case " .. i) end
  return out
end
local found = os.execute("command -v " .. S.quote(TS.MPIRUN) .. " >/dev/null 2>&1")
if found ~= true and found ~= 0 then TS.MPIRUN = nil end -- Lua 5.4 or LuaJIT
function TS.mpirun(np, args)
  local all = { "--allow-run-as-root", "--oversubscribe", "-np", tostring(np), TRAINER }
  for _, a in ipairs(args) do all[#all + 1] = a end
  return S.run_with(TS.MPIRUN, all)
end

-- A small model (H=32, I=32, T=32, 47,816 parameters): the whole spec takes seconds on 2
-- cores (half a minute under AddressSanitizer).
TS.SMALL = { hidden_size = 32, expert_dim = 32, seq_len = 32, num_experts = 4 }
TS.small_config = S.write_file(os.tmpname(), string.format(
  "# trainer_spec: a small model\nhidden_size = %d\nexpert_dim = %d\nseq_len = %d\nnum_experts = %d\n",
  TS.SMALL.hidden_size, TS.SMALL.expert_dim, TS.SMALL.seq_len, TS.SMALL.num_experts))

function TS.losses(out)
  local t = {}
  for k, l in out:gmatch("step (%d+) loss (%S+)") do t[tonumber(k)] = tonumber(l) end
  return t
end

-- {unit name -> list of {kind, dtype, n, bytes}} from --records lines
function TS.records(out)
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

-- {name -> {shape, values, raw}}: the header checked by moonshard's own reader, then the data
-- (raw: the tensor's bytes).
function TS.read_params(path)
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
    out[t.name] = { shape = t.shape, values = values,
      raw = bytes:sub(8 + n + t.data_offsets[1] + 1, 8 + n + t.data_offsets[2]) }
  end
  return out
end

--- How far run {losses, params} is from ref: the largest relative difference of a step's
-- loss (over ref's steps), the largest absolute difference of a parameter element and the
-- tensor it is in, the elements differing by more than 1e-6, and the elements compared.
-- Every tensor of ref must be in run with the same shape.
function TS.compare(ref, run, label)
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

-- Parity: each mesh's run against the 1-rank run of the same global batch.  The figures
-- docs/verification.md and examples/moe_trainer/README.md state for these runs (measured: the order of
-- the f32 sums is all that differs), and the test holds each run to twice them: `loss`, the
-- largest relative difference of a step's loss; `param`, the largest absolute difference
-- of a parameter element after the last step; `loose`, the elements differing by more
-- than 1e-6 (of 47,816).  AdamW's update lr*m/(sqrt(v)+eps) has slope lr/eps in a gradient
-- near zero, so an element whose gradient is at the level of the f32 rounding of its sum
-- moves by ~1e-6 more on one mesh than on another: those are the loose ones.
-- One parity case run: its losses and saved parameters.
local function parity_run(flags, case)
  local save = os.tmpname()
  local args = { "-n", tostring(case.n), "--mesh", case.mesh, "--policy", "policies/full_fp32.lua",
    "--steps", "20", "--seed", "7", "--config", TS.small_config, "--save", save }
  for _, f in ipairs(flags) do args[#args + 1] = f end
  for _, f in ipairs(case.flags or {}) do args[#args + 1] = f end -- this mesh's own
  local r = case.mpirun and TS.mpirun(case.n, args) or TS.trainer(args) -- case.mpirun: under mpirun
  assert.equal("", r.err)
  assert.equal(0, r.code)
  local run = { case = case, losses = TS.losses(r.out), params = TS.read_params(save) }
  os.remove(save)
  return run
end

-- The first case, the reference, is run once per flags and kept for the next call; under
-- TS.QUICK only the reference and the last case run.
local references = {}
function TS.parity(label, flags, stated)
  stated = TS.quick(stated, 1, #stated)
  local key = table.concat(flags, " ") .. "|" .. stated[1].mesh .. "|" .. table.concat(stated[1].flags or {}, " ")
  references[key] = references[key] or parity_run(flags, stated[1])
  local runs = { references[key] }
  for i = 2, #stated do runs[i] = parity_run(flags, stated[i]) end
  local ref = runs[1]
  assert.equal(20, #ref.losses)
  local names = 0
  for _ in pairs(ref.params) do names = names + 1 end
  assert.equal(24, names) -- embed, 10 per layer, norm, output_query, lm_head
  for i = 2, #runs do
    local run, want = runs[i], runs[i].case
    local loss_diff, max_diff, where, loose, count = TS.compare(ref, run, want.mesh)
    io.stderr:write(string.format("\n  parity (%s) %s vs dp_shard=1: loss max rel diff %.3g (stated %.2g), parameter " ..
      "max abs diff %.3g (stated %.2g; %s), %d of %d elements differ by more than 1e-6 (stated %d)\n", label,
      want.label or want.mesh, loss_diff, want.loss, max_diff, want.param, where, loose, count, want.loose))
    assert.equal(47816, count)
    assert.is_true(loss_diff <= 2 * want.loss,
      string.format("%s %s: losses differ by %g (relative), twice the stated figure is %g", label, want.mesh,
        loss_diff, 2 * want.loss))
    assert.is_true(max_diff <= 2 * want.param,
      string.format("%s %s: %s differs by %g, twice the stated figure is %g", label, want.mesh, where, max_diff,
        2 * want.param))
    assert.is_true(loose <= 2 * want.loose + 2,
      string.format("%s %s: %d elements differ by more than 1e-6, stated %d", label, want.mesh, loose, want.loose))
  end
end

--- The --memory lines of a run: allocated, planned and books equal on every rank and
-- category; returns how many lines there were.
function TS.check_memory(out, label)
  local seen = 0
  -- allocated: counted where the units' memory is allocated and freed, not from their books
  for rank, cat, alloc, planned, books in out:gmatch("memory rank (%d+) (%S+) allocated=(%d+) planned=(%d+) books=(%d+)") do
    assert.is_true(tonumber(planned) > 0, cat)
    assert.equal(planned, alloc, string.format("%s rank %s %s: bytes allocated against planned", label, rank, cat))
    assert.equal(planned, books, string.format("%s rank %s %s: the units' books against planned", label, rank, cat))
    seen = seen + 1
  end
  return seen
end

return TS
