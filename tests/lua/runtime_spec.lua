-- runtime_spec.lua: plans made real: the inkling2 plan of a tiny config with uneven shards
-- materialised on every rank, gathered and reduced, checked on every rank against values
-- computed in the script, with the bytes each rank allocated against the planner's; and
-- the same plan with its units offloaded to the host, run one step.
local S = require "support"

-- The start of the scripts below: moonshard, and the tiny inkling2 config as `config`.
local TINY_CONFIG = [[
  local ms = require "moonshard"
  local json = require "moonshard.json"
  local f = assert(io.open("tests/lua/configs/inkling2_tiny.json"))
  local config = json.decode(f:read("a"))
  f:close()
]]

describe("materialised plans", function()
  -- dp_shard=3 leaves rank 2 without rows of the 4-expert tensors (torch.chunk: 2, 2, 0)
  -- ep = 2: the experts of each of the 2 layers are a unit of their own on ep_shard = 2 (17
  -- units); ep = 4: ep_shard = 1, so the runtime adds an ep-local unit per layer (15 + 2).
  for _, case in ipairs({ { 4, "dp_shard=4", 15 }, { 4, "dp_replicate=2,dp_shard=2", 15 }, { 3, "dp_shard=3", 15 },
    { 4, "dp_shard=4,ep=2", 17 }, { 4, "dp_shard=4,ep=4", 17 } }) do
    local n, mesh, units = case[1], case[2], case[3]
    it("gather, reduce and allocate as planned on " .. mesh, function()
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/units.lua", mesh })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        assert.matches("rank " .. rank .. ": units ok %(" .. units .. " units, gradient max diff 0,", r.out)
      end
    end)
  end

  -- pack_islands: each layer's FP32 islands (mlp_query, mlp.gate; attn's on layer 1) and the
  -- root's output_query live in their layer's (the root's) unit: 5 units, 7 with ep = 2
  for _, case in ipairs({ { "dp_shard=4", 5 }, { "dp_replicate=2,dp_shard=2", 5 }, { "dp_shard=4,ep=2", 7 } }) do
    it("gather, reduce and allocate as planned with the FP32 islands packed on " .. case[1], function()
      local r = S.run({ "-n", "4", "tests/lua/scripts/units.lua", case[1], "tests/lua/configs/inkling2_tiny.json",
        "packed" })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, 3 do
        assert.matches("rank " .. rank .. ": units ok %(" .. case[2] .. " units, gradient max diff 0,", r.out)
      end
    end)
  end

  it("gather, reduce and allocate as planned with every unit offloaded (dp_shard=4,ep=2)", function()
    local r = S.run({ "-n", "4", "tests/lua/scripts/units.lua", "dp_shard=4,ep=2", "tests/lua/configs/inkling2_tiny.json",
      "offload" })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    for rank = 0, 3 do assert.matches("rank " .. rank .. ": units ok %(17 units, gradient max diff 0,", r.out) end
  end)

  -- The inkling2 plan with every unit offloaded (offload_policy "cpu"), made real and run
  -- one step (gather, gradients of ones, reduce, AdamW); on the threads backend the buffers
  -- are on the host either way, so the units must accept the offload and hold the bytes the
  -- planner counted, offloaded and in all.
  local OFFLOAD_STEP = TINY_CONFIG .. [[
    local tree = require("moonshard.models").from_config(config, "inkling2_tiny")
    local mesh = require("moonshard.mesh_context").new(arg[1])
    local policy = require("moonshard.policy").load("policies/inkling2")
    local plan = require("moonshard.plan").plan(tree, mesh, policy.shard_units,
      { optimizer = arg[2], options = { offload_policy = "cpu" } })
    local state = require("moonshard.runtime").materialize(plan)
    local frozen, strip = {}, require("moonshard.module").strip_checkpoint -- e_score_correction_bias
    for _, np in ipairs(tree:named_parameters()) do frozen[strip(np[1])] = not np[2].requires_grad end
    local moved = 0
    for _, u in ipairs(state.units) do
      u:unshard()
      u:wait()
      for i = 0, u:count() - 1 do
        local g = not frozen[strip(u:fqn(i))] and u:grad_full(i)
        if g then g:fill_(1) end
      end
      u:reduce_grads()
      u:wait()
      u:adamw_step({ lr = 0.01, step = 1 })
      for i = 0, u:count() - 1 do
        for _, v in ipairs(u:param_shard(i):totable()) do if v ~= 0 then moved = moved + 1 end end
      end
    end
    local planned, held, offloaded = plan.memory.per_rank[ms.rank() + 1], state:bytes(), 0
    for i, pu in ipairs(plan.units) do
      if pu.offload then
        local b = state.units[i]:bytes()
        offloaded = offloaded + b.params + b.grads + b.optimizer
      end
    end
    print(string.format("rank %d: moved %s, offloaded %d of %d planned, params %d of %d, grads %d of %d, " ..
      "optimizer %d of %d", ms.rank(), tostring(moved > 0), offloaded, planned.offloaded, held.params, planned.params,
      held.grads, planned.grads, held.optimizer, planned.optimizer))
  ]]
  -- torch_adamw: AdamW's moments in the stored dtype (bf16 here), no master weights
  for _, case in ipairs({ { 3, "dp_shard=3" }, { 4, "dp_replicate=2,dp_shard=2" }, { 4, "dp_shard=4,ep=4" },
    { 4, "dp_shard=4,ep=2", "torch_adamw" } }) do
    local n, mesh, optimizer = case[1], case[2], case[3]
    local name = "offload to the host as planned and train a step on " .. mesh .. (optimizer and ", " .. optimizer or "")
    it(name, function()
      local r = S.run({ "-n", tostring(n), "-e", OFFLOAD_STEP, mesh, optimizer })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        local line = r.out:match("rank " .. rank .. ": [^\n]*")
        assert.is_string(line)
        assert.matches("moved true", line)
        for _, what in ipairs({ "offloaded", "params", "grads", "optimizer" }) do
          local held, planned = line:match(what .. " (%d+) of (%d+)")
          assert.equal(planned, held, line)
        end
        assert.is_nil(line:match("offloaded 0 "), line)
      end
    end)
  end

  -- A unit's gather is queued on the rank's communication thread; a collective the script
  -- calls on the same group meanwhile (a loss all_reduce during prefetch) queues behind it,
  -- so every rank's group sees gather, then all_reduce, whichever thread gets there first.
  -- two layers of one [9, 6] f32 weight, planned on dp_shard=2 by the policy table P and
  -- materialised: `units`, in plan order
  local function two_layers(policy)
    return [[
    local ms = require "moonshard"
    local module = require "moonshard.module"
    local root = module.new("Model")
    local layers = root:add("layers", module.new("ModuleList"))
    for i = 0, 1 do layers:add(tostring(i), module.new("Layer")):param("w", { 9, 6 }, "f32") end
    local plan = require("moonshard.plan").plan(root, require("moonshard.mesh_context").new("dp_shard=2"), ]] ..
      policy .. [[)
    local units = require("moonshard.runtime").materialize(plan).units
]]
  end

  local PENDING = two_layers([[{ parallelize = function(ctx)
        ctx:fully_shard("layers.0", { mp_policy = { param_dtype = "bf16" } })
        ctx:fully_shard(ctx.model)
      end }]]) .. [[
    local v = {}
    for i = 1, 54 do v[i] = i end
    units[1]:load_full(0, ms.from_table(v, "f32", { 9, 6 }))
    local g = ms.mesh({ { "dp_shard", 2 } }):group("dp_shard") -- a new mesh: the units' group
    for step = 1, 20 do
      units[1]:unshard()
      local t = ms.from_table({ ms.rank() + step, 1 })
      g:all_reduce(t, "sum")
      units[1]:wait()
      local full = units[1]:param_full(0):totable()
      assert(t:totable()[1] == 1 + 2 * step and t:totable()[2] == 2, "all_reduce " .. step)
      assert(full[1] == 1 and full[54] == 54, "gather " .. step)
      units[1]:reshard()
    end
    print("rank " .. ms.rank() .. ": 20 steps ok")
  ]]

  it("queue a script's collective on a unit's group behind the unit's pending one", function()
    local r = S.run({ "-n", "2", "-e", PENDING })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    for rank = 0, 1 do assert.matches("rank " .. rank .. ": 20 steps ok", r.out, 1, true) end
  end)

  it("refuse ranks that gather different units of the same layout, naming both", function()
    local r = S.run({ "-n", "2", "-e", two_layers([[{ parallelize = function(ctx)
        ctx:fully_shard("layers.0")
        ctx:fully_shard("layers.1")
      end }]]) .. [[
      local u = units[ms.rank() + 1]
      u:unshard()
      u:wait()
    ]] })
    assert.equal(1, r.code)
    for rank = 0, 1 do
      assert.matches("[rank " .. rank .. "] (command line):13: moonshard mismatch error: unit 'layers." .. rank ..
        "': unshard: ", r.err, 1, true)
    end
    assert.matches("all_gather on group [0 1]: ranks disagree: rank 0: in 30 x f32 for unit layers.0; " ..
      "rank 1: in 30 x f32 for unit layers.1", r.err, 1, true)
  end)

  it("gathers a unit with frozen parameters of other dtypes as bytes, as planned", function()
    -- frozen bf16 base [8,4] and i64 ids [6] around a trainable f32 adapter [2,4]: FSDP2's
    -- uint8 all-gather of 2 ranks x (32 + 8 + 24) bytes: 4 rows of base and 1 of lora_a in bf16
    -- (param_dtype), 3 ids in i64 (never cast); the plan's bus bytes are half of it
    local r = S.run_code(2, [[
      local ms = require "moonshard"
      local module = require "moonshard.module"
      local root = module.new("Toy")
      local a = root:add("a", module.new("Lora"))
      a:param("base", { 8, 4 }, "bf16").requires_grad = false
      a:param("lora_a", { 2, 4 }, "f32")
      a:param("ids", { 6 }, "i64")
      local plan = require("moonshard.plan").plan(root, require("moonshard.mesh_context").new("dp_shard=2"),
        { parallelize = function(ctx)
          ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" } })
        end })
      local u = require("moonshard.runtime").materialize(plan).units[1]
      local values = {}
      for i, e in ipairs(plan.units[1].entries) do
        local n, v = 1, {}
        for _, d in ipairs(e.shape) do n = n * d end
        for k = 1, n do v[k] = (i == 3) and (k * 1000003 - 7) or (k % 9) / 4 - i end
        values[i] = v
        u:load_full(i - 1, ms.from_table(v, e.param.dtype, e.shape))
      end
      u:unshard()
      u:wait()
      for i, e in ipairs(plan.units[1].entries) do
        local got = u:param_full(i - 1)
        assert(got:dtype() == (i == 3 and "i64" or "bf16"), got:dtype())
        local t = got:totable()
        for k = 1, #values[i] do assert(t[k] == values[i][k], e.fqn .. "[" .. k .. "]") end
      end
      local rec = u:records()[1]
      assert(rec.dtype == "u8" and rec.bytes == 2 * (32 + 8 + 24), rec.dtype .. " " .. rec.bytes)
      assert(plan.units[1].all_gather_bytes == 64, plan.units[1].all_gather_bytes)
      print("rank " .. ms.rank() .. " gathered " .. rec.bytes .. " bytes as u8, exact")
    ]])
    assert.equal("", r.err)
    assert.equal(0, r.code)
    assert.matches("rank 0 gathered 128 bytes as u8, exact", r.out, 1, true)
    assert.matches("rank 1 gathered 128 bytes as u8, exact", r.out, 1, true)
  end)

  it("refuses to run a plan on the wrong number of ranks", function()
    local r = S.run({ "-n", "2", "tests/lua/scripts/units.lua", "dp_shard=4" })
    assert.equal(1, r.code)
    assert.matches("the plan is for 4 ranks but 2 are running (moonshard -n 4, or a world of 4 ranks in a host)",
      r.err, 1, true)
  end)

  -- A pipeline (pp=2,dp_shard=2): ranks 0 and 1 make stage 0's units, ranks 2 and 3 stage
  -- 1's, every unit gathering over its stage's dp_shard group of 2; a plan of virtual stages
  -- (Interleaved1F1B: 2 stages a rank) is refused on every rank.
  local PIPELINE = TINY_CONFIG .. [[
    config.num_hidden_layers = tonumber(arg[2]) -- 4 for 2 stages a rank
    local tree = require("moonshard.models").from_config(config, "inkling2_tiny")
    local mesh = require("moonshard.mesh_context").new("pp=2,dp_shard=2")
    local policy = require("moonshard.policy").load("policies/inkling2")
    local plan = require("moonshard.plan").plan(tree, mesh, policy.shard_units,
      { options = { ["pipeline.schedule"] = arg[1] } })
    local ok, state = pcall(require("moonshard.runtime").materialize, plan)
    if not ok then print("rank " .. ms.rank() .. ": " .. state) return end
    local names, planned, sizes = {}, {}, {}
    for _, u in ipairs(plan.units) do
      if u.stage == state.stage then planned[#planned + 1] = u.name end
    end
    for _, u in ipairs(state.units) do
      names[#names + 1] = u:name()
      u:unshard()
      u:wait()
      for _, rec in ipairs(u:records()) do sizes[rec.group_size] = true end
      u:reshard()
    end
    local groups = {}
    for n in pairs(sizes) do groups[#groups + 1] = n end
    print(string.format("rank %d: stage %d, %d units, as planned for it: %s, groups of %s", ms.rank(), state.stage,
      #names, tostring(table.concat(names, " ") == table.concat(planned, " ")), table.concat(groups, " ")))
  ]]

  it("makes each rank's own pipeline stage on pp=2,dp_shard=2, and refuses virtual stages", function()
    local r = S.run({ "-n", "4", "-e", PIPELINE, "1F1B", "2" })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    local counts = {}
    for rank = 0, 3 do
      local stage, n = r.out:match("rank " .. rank .. ": stage (%d), (%d+) units, as planned for it: true, groups " ..
        "of 2\n")
      assert.equal(rank < 2 and "0" or "1", stage, r.out)
      counts[#counts + 1] = tonumber(n)
    end
    assert.equal(counts[1], counts[2])
    assert.equal(counts[3], counts[4])
    assert.is_true(counts[1] > 0 and counts[3] > 0)
    r = S.run({ "-n", "4", "-e", PIPELINE, "Interleaved1F1B", "4" })
    assert.equal(0, r.code)
    for rank = 0, 3 do
      assert.matches("rank " .. rank .. ": moonshard: runtime: materialize: the plan is a pipeline of 4 stages over " ..
        "pp = 2, 2 a rank (schedule Interleaved1F1B)", r.out, 1, true)
    end
  end)

  -- materialize is collective: plans that differ across ranks (rank 1's mesh, rank 2's
  -- optimizer) are refused on every rank before any unit gathers, naming the ranks
  it("refuses plans that differ across ranks, on every rank", function()
    local r = S.run({ "-n", "4", "-e", TINY_CONFIG .. [[
      local tree = require("moonshard.models").from_config(config, "inkling2_tiny")
      local mesh = require("moonshard.mesh_context").new(ms.rank() == 1 and "dp_replicate=2,dp_shard=2" or "dp_shard=4")
      local policy = require("moonshard.policy").load("policies/inkling2")
      local plan = require("moonshard.plan").plan(tree, mesh, policy.shard_units,
        { optimizer = ms.rank() == 2 and "none" or "adamw" })
      local ok, err = pcall(require("moonshard.runtime").materialize, plan)
      print("rank " .. ms.rank() .. ": " .. tostring(ok) .. ": " .. tostring(err))
    ]] })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    for rank = 0, 3 do
      local line = ("\n" .. r.out):match("\n(rank " .. rank .. ": [^\n]*)")
      assert.matches("^rank %d: false: moonshard: runtime: materialize: %d of the 4 ranks planned differently from " ..
        "rank %d %(15 units, fingerprint %d+/%d+; rank %d: 15 units, fingerprint", line)
      assert.matches("every rank must plan the same model on the same mesh with the same policy$", line)
      -- ranks 0 and 3 agree: 2 others differ; ranks 1 and 2 differ from 3 others
      local n = tonumber(line:match("materialize: (%d+) of"))
      assert.equal((rank == 1 or rank == 2) and 3 or 2, n, line)
    end
  end)
end)
