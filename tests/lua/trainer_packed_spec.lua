-- trainer_packed_spec.lua: moe_trainer with the inkling2 policy's FP32 islands packed into
-- their layers' units (--set pack_islands=true) against the seed's plan (every island a unit
-- of its own), three steps with clipping on: the saved parameters byte for byte, the losses
-- and gradient norms, on FSDP, HSDP, expert parallelism, a pipeline and tensor parallelism;
-- rank 0's collectives (one all-gather of bytes and one f32 reduce-scatter per packed unit);
-- a checkpoint of either plan resumed by the packed one; and, under mpirun, the threads run.
local S = require "support"
local TS = require "trainer_support"

local function run(mesh, packed, extra, mpi)
  local save = os.tmpname()
  local args = { "-n", "4", "--mesh", mesh, "--policy", "policies/inkling2", "--config", TS.small_config,
    "--set", "pack_islands=" .. tostring(packed), "--save", save, "--records" }
  for _, a in ipairs(extra or { "--steps", "3" }) do args[#args + 1] = a end
  local r = mpi and TS.mpirun(4, args) or TS.trainer(args)
  assert.equal("", r.err)
  assert.equal(0, r.code)
  r.params = S.read_file(save)
  os.remove(save)
  r.steps = {}
  for line in r.out:gmatch("step %d+ loss %S+ lr %S+ grad_norm %S+") do r.steps[#r.steps + 1] = line end
  return r
end

-- TS.quick (the sanitizer builds): FSDP and HSDP only
local MESHES = TS.quick({ "dp_shard=4", "dp_replicate=2,dp_shard=2", "dp_shard=4,ep=2", "pp=2,dp_shard=2",
  "dp_shard=2,tp=2" }, 1, 2)

describe("moe_trainer with packed FP32 islands", function()
  for _, mesh in ipairs(MESHES) do
    it(mesh .. ": the separate units' parameters, losses and gradient norms bit for bit, in fewer collectives",
      function()
        local sep, pk = run(mesh, false), run(mesh, true)
        assert.equal(3, #pk.steps)
        assert.same(sep.steps, pk.steps)
        assert.is_true(sep.params == pk.params, mesh .. ": the saved parameters differ")
        assert.matches("# policy: policies/inkling2 (--set pack_islands=true)", pk.out, 1, true)
        local n_sep, n_pk = 0, 0
        for _ in sep.out:gmatch("\nunit ") do n_sep = n_sep + 1 end
        for _ in pk.out:gmatch("\nunit ") do n_pk = n_pk + 1 end
        assert.is_true(n_pk > 0 and n_pk < n_sep, string.format("%d collectives packed, %d separate", n_pk, n_sep))
        io.stderr:write(string.format("\n  %s: rank 0's collectives in step 1: %d packed, %d separate", mesh, n_pk, n_sep))
        -- a layer's unit: its all-gathers move bytes (bf16 weights and f32 islands), its
        -- gradients one f32 reduce-scatter; no island unit is left
        local recs = TS.records(pk.out)
        local layer = recs["model.layers.0"] or recs["model.layers.0._checkpoint_wrapped_module"]
        if layer then
          local kinds = {}
          for _, rec in ipairs(layer) do kinds[rec.kind .. " " .. rec.dtype] = (kinds[rec.kind .. " " .. rec.dtype] or 0) + 1 end
          assert.is_nil(kinds["all_gather bf16"], mesh)
          assert.is_truthy(kinds["all_gather u8"], mesh)
          assert.equal(1, kinds["reduce_scatter f32"], mesh)
        end
        for unit in pairs(recs) do
          assert.is_nil(unit:match("mlp_query$") or unit:match("mlp%.gate$"), unit .. " is still a unit")
        end
      end)
  end

  it("resumes a checkpoint of either plan with the islands packed, bit for bit", function()
    local straight = run("dp_shard=4", true, { "--steps", "4" })
    for _, packed in ipairs({ true, false }) do
      local dir = os.tmpname()
      os.remove(dir)
      TS.run_ok({ "-n", "4", "--mesh", "dp_shard=4", "--policy", "policies/inkling2", "--config", TS.small_config,
        "--steps", "2", "--set", "pack_islands=" .. tostring(packed), "--save-dir", dir })
      local resumed = run("dp_shard=4", true, { "--steps", "4", "--resume", dir })
      assert.is_true(resumed.params == straight.params, "saved with pack_islands=" .. tostring(packed))
      os.execute("rm -rf " .. S.quote(dir))
    end
  end)

  it("gives the threads run's bits with ranks as MPI processes", function()
    if not TS.MPIRUN then
      pending("no mpirun")
      return
    end
    local threads, mpi = run("dp_shard=4", true), run("dp_shard=4", true, nil, true)
    assert.equal(3, #mpi.steps)
    assert.same(threads.steps, mpi.steps)
    assert.is_true(threads.params == mpi.params, "the MPI run's parameters differ")
  end)
end)
