-- plan_spec.lua: the planner's rules (meshes, FSDP2's layouts and precision) on small trees, with the
-- expected layouts, bytes and errors worked out by hand in the comments.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"

local function policy(fn) return { parallelize = fn } end

local function errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

-- root { a { w [10,4] }, b { w [6] }, p [3] }, all f32
local function small_tree(dtype)
  local root = module.new("Toy")
  root:add("a", module.new("Linear")):param("w", { 10, 4 }, dtype or "f32")
  root:add("b", module.new("Norm")):param("w", { 6 }, dtype or "f32")
  root:param("p", { 3 }, dtype or "f32")
  return root
end

describe("util", function()
  it("formats one decimal as C does (ties to even) under both interpreters", function()
    local util = require "moonshard.util"
    -- exact binary ties: C's printf rounds them to even, LuaJIT's formatter would not
    assert.same({ "512.2", "512.8", "-0.2", "-0.8", "0.1", "3.0" },
      { util.fixed1(512.25), util.fixed1(512.75), util.fixed1(-0.25), util.fixed1(-0.75), util.fixed1(0.05),
        util.fixed1(3) })
    assert.equal("512.2 KiB", util.bytes(512.25 * 1024))
  end)
end)

describe("MeshContext", function()
  it("chooses the FSDP mesh like Automodel", function()
    assert.same({ "dp_shard" }, mesh_context.new("dp_shard=8").fsdp_axes)
    local hsdp = mesh_context.new("dp_replicate=2,dp_shard=4")
    assert.same({ "dp_replicate", "dp_shard" }, hsdp.fsdp_axes)
    assert.equal(8, hsdp.world)
    assert.equal(8, hsdp:size("dp"))
    local cp = mesh_context.new("dp_shard=2,cp=2")
    assert.same({ "dp_shard_cp" }, cp.fsdp_axes)
    assert.equal(4, cp:size("dp_shard_cp"))
    assert.same({ "dp_replicate", "dp_shard_cp" }, mesh_context.new("dp_replicate=2,dp_shard=2,cp=2").fsdp_axes)
    assert.equal(8, mesh_context.new("dp_replicate=2,dp_shard=2,cp=2"):size("dp_cp"))
  end)

  it("splits the MoE mesh into (ep_shard, ep)", function()
    local m = mesh_context.new("dp_shard=8,ep=4")
    assert.equal(2, m:size("ep_shard"))
    assert.equal(1, mesh_context.new("dp_shard=8,ep=8"):size("ep_shard"))
    -- ep over dp_replicate x dp_shard x cp: 2*2*2 = 8 = ep
    assert.equal(1, mesh_context.new("dp_replicate=2,dp_shard=2,cp=2,ep=8"):size("ep_shard"))
  end)

  it("rejects what Automodel rejects", function()
    assert.matches("dp_replicate = 2 needs dp_shard > 1", errmsg(mesh_context.new, "dp_replicate=2"))
    assert.matches("ep = 3 does not divide dp_replicate%*dp_shard%*cp%*tp = 8", errmsg(mesh_context.new, "dp_shard=8,ep=3"))
    assert.matches("ep = 16 is larger than", errmsg(mesh_context.new, "dp_shard=8,ep=16"))
    assert.matches("6 routed experts are not divisible by ep = 4",
      errmsg(mesh_context.new, { dp_shard = 8, ep = 4, n_routed_experts = 6 }))
    assert.matches("unknown axis 'dpx'", errmsg(mesh_context.parse, "dpx=2"))
    assert.matches("'dp_shard' is not name=size", errmsg(mesh_context.parse, "dp_shard"))
    assert.matches("dp_shard = 0; sizes are integers in 1..2147483647", errmsg(mesh_context.new, "dp_shard=0"))
  end)

  it("refuses sizes that are not C ints before anything is sized by them", function()
    local sizes = "sizes are integers in 1%.%.2147483647 %(ranks are C ints%)"
    assert.matches("^moonshard: mesh: dp_shard = 99999999999999999999; " .. sizes,
      errmsg(mesh_context.parse, "dp_shard=99999999999999999999"))
    assert.matches("^moonshard: mesh: dp_shard = 9223372036854775807; " .. sizes,
      errmsg(mesh_context.new, "dp_shard=9223372036854775807"))
    assert.matches("^moonshard: mesh: ep = 1099511627776; " .. sizes, errmsg(mesh_context.new, { ep = 2 ^ 40 }))
    assert.matches("^moonshard: mesh: tp = 1.5; " .. sizes, errmsg(mesh_context.new, { tp = 1.5 }))
    assert.matches("^moonshard: mesh: pp%*dp_replicate%*dp_shard%*cp%*tp = 4294967296 is more than 2147483647 ranks",
      errmsg(mesh_context.new, "dp_replicate=65536,dp_shard=65536"))
    assert.matches("^moonshard: mesh: n_routed_experts = x; expected an integer >= 1",
      errmsg(mesh_context.new, { dp_shard = 2, n_routed_experts = "x" }))
    assert.equal(2147483647, mesh_context.new("dp_shard=2147483647").world)
  end)
end)

describe("a large mesh", function()
  local function plan_on(mesh)
    return planner.plan(small_tree(), mesh_context.new(mesh), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard(ctx.model)
    end))
  end

  it("is planned in runs of ranks with equal memory, not a table per rank", function()
    -- over 10^6 ranks: a.w [10,4] gives ranks 0-9 a row (4 x 8 B of AdamW state), p [3]
    -- ranks 0-2 one element, b.w [6] ranks 0-5 one: four runs
    local m = plan_on("dp_shard=1000000").memory
    local got = {}
    for i, r in ipairs(m.runs) do got[i] = { r.first, r.count, r.optimizer } end
    assert.same({ { 0, 3, 48 }, { 3, 3, 40 }, { 6, 4, 32 }, { 10, 999990, 0 } }, got)
    assert.equal(48, m.optimizer)
    -- every C int of ranks plans at once; per_rank and the JSON, which list every rank, refuse
    local big = plan_on("dp_shard=2147483647")
    assert.equal(4, #big.memory.runs)
    assert.matches("^moonshard: plan: memory.per_rank makes a table for each of the 2147483647 ranks and is " ..
      "built for at most 1048576; memory.runs has", errmsg(function() return big.memory.per_rank end))
    assert.matches("^moonshard: plan JSON: for 2147483647 ranks its lists would take up to [%d.]+ GiB %(" ..
      "memory.per_rank has every rank, local_shapes every coordinate of each unit's shard axis%), more than the " ..
      "256.0 MiB it is written up to", errmsg(require("moonshard.plan_report").to_json, big))
    -- a small mesh builds per_rank from the runs when it is read: rows 3,3,3,1 of a.w, 1,1,1,0
    -- of p, 2,2,2,0 of b.w
    local small = plan_on("dp_shard=4").memory
    assert.equal(2, #small.runs)
    local got4 = {}
    for i, r in ipairs(small.per_rank) do got4[i] = { r.rank, r.optimizer, r.total - small.total } end
    assert.same({ { 0, 120, 0 }, { 1, 120, 0 }, { 2, 120, 0 }, { 3, 32, -88 } }, got4)
  end)
end)

describe("counts past 2^53", function()
  local EXACT = "would be more than 2%^53 = 9007199254740992, where the planner's counts stop being exact"
  local function plan_one(shape, dtype, mesh)
    local root = module.new("Toy")
    root:add("big", module.new("Linear")):param("w", shape, dtype or "f32")
    return planner.plan(root, mesh_context.new(mesh or "dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
    end))
  end

  it("refuse a parameter whose elements or bytes pass 2^53, by name, under both interpreters", function()
    assert.matches("^moonshard: plan: parameter big.w of shape %[4611686018427387904, 2%] has more than 2%^53 = " ..
      "9007199254740992 elements, where the planner's counts stop being exact", errmsg(plan_one, { 2 ^ 62, 2 }))
    -- INT64_MAX: Lua 5.4 keeps the integer, LuaJIT's double rounds it
    assert.matches("^moonshard: plan: parameter big.w of shape %[9[.%d]+e?%+?%d*, 4%] has more than 2%^53",
      errmsg(plan_one, { 9223372036854775807, 4 }))
    assert.matches("^moonshard: plan: the bytes of parameter big.w of shape %[1125899906842624, 4%] in f32 " .. EXACT,
      errmsg(plan_one, { 2 ^ 50, 4 }))
  end)

  it("refuse gathered, optimizer and model totals that pass 2^53", function()
    assert.matches("^moonshard: plan: the elements of parameter big.w gathered over the 1048576 ranks of unit " ..
      "<root> " .. EXACT, errmsg(plan_one, { 1, 2 ^ 49 }, "f32", "dp_shard=1048576"))
    -- bf16: 2^53 bytes, but 12 bytes of AdamW state per element
    assert.matches("^moonshard: plan: the optimizer state bytes of parameter big.w " .. EXACT,
      errmsg(plan_one, { 2 ^ 51, 2 }, "bf16"))
    local root = module.new("Toy")
    for i = 1, 3 do root:add("m" .. i, module.new("L")):param("w", { 2 ^ 50 }, "f32") end
    assert.matches("^moonshard: plan: the model's parameter bytes " .. EXACT, errmsg(planner.plan, root,
      mesh_context.new("dp_shard=2"), policy(function(ctx) ctx:fully_shard(ctx.model) end)))
  end)
end)

describe("shard units", function()
  it("nest: a child sharded first is excluded from its parent", function()
    local tree = small_tree()
    local plan = planner.plan(tree, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard(ctx.model)
    end), { optimizer = "adamw" })
    assert.equal(2, #plan.units)
    local a, root = plan.units[1], plan.units[2]
    assert.equal("a", a.name)
    assert.equal("module", a.kind)
    assert.equal("root", root.kind)
    -- a.w [10,4] over 4: ceil(10/4) = 3 rows padded; chunks 3,3,3,1
    assert.same({ 3, 4 }, a.entries[1].padded)
    assert.equal("a.w", a.entries[1].fqn)
    -- root owns b.w [6] -> padded [2]; p [3] -> padded [1]; in FSDP2's order, the
    -- submodules' parameters (post-order) before the module's own
    assert.equal("b.w", root.entries[1].fqn)
    assert.equal("p", root.entries[2].fqn)
    assert.same({ 2 }, root.entries[1].padded)
    assert.same({ 1 }, root.entries[2].padded)
    -- non-root reshards after forward, the root does not
    assert.is_true(a.reshard)
    assert.is_false(root.reshard)
    -- a: S = 4 ranks x 12 elements x 4 B = 192; forward + backward all-gather 144 each;
    -- reduce-scatter 144.  root: S = 4 x 3 x 4 = 48: one all-gather of 36, reduce-scatter 36.
    assert.equal(288, a.all_gather_bytes)
    assert.equal(144, a.reduce_scatter_bytes)
    assert.equal(36, root.all_gather_bytes)
    assert.same({ count = 3, bytes = 324 }, plan.comm.all_gather)
    assert.same({ count = 2, bytes = 180 }, plan.comm.reduce_scatter)
    assert.same({ count = 0, bytes = 0 }, plan.comm.all_reduce)
    -- memory: 15 padded elements: params 60 B, grads 60 B, AdamW moments 8 B/element = 120 B;
    -- peak: backward of a holds its gradient (192) + a (192) + the root around it (48) = 432
    local m = plan.memory
    assert.same({ 60, 60, 120, 432, 672 }, { m.params, m.grads, m.optimizer, m.peak_unsharded, m.total })
    -- AdamW keeps the rows a rank holds: rank 3 has 1 row of a.w (4 elements), none of p or b.w
    assert.equal(4 * 8, m.per_rank[4].optimizer)
    assert.equal(3, m.per_rank[4].rank)
    assert.equal((3 * 4 + 1 + 2) * 8, m.per_rank[2].optimizer)
  end)

  -- the optimizers' state per element of a rank's rows: adamw 8 B (f32 moments) + 4 B of f32
  -- master weights unless stored in f32; torch_adamw two moments of the stored dtype
  it("counts the AdamW state of the optimizer asked for", function()
    local root = module.new("Toy")
    root:add("h", module.new("Linear")):param("w", { 8, 2 }, "bf16")  -- 16 elements, 4 a rank
    root:add("f", module.new("Linear")):param("w", { 4 }, "f32")      -- 1 a rank
    root:add("d", module.new("Linear")):param("w", { 4, 3 }, "f64")   -- 3 a rank
    local function plan_with(optimizer)
      return planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
        for _, name in ipairs({ "h", "f", "d" }) do ctx:fully_shard(name) end
      end), { optimizer = optimizer })
    end
    local want = { adamw = 4 * 12 + 1 * 8 + 3 * 12, torch_adamw = 4 * 4 + 1 * 8 + 3 * 16, none = 0 }
    for optimizer, bytes in pairs(want) do
      local plan = plan_with(optimizer)
      assert.equal(bytes, plan.memory.optimizer, optimizer)
      assert.equal(optimizer, plan.optimizer)
      assert.matches('"optimizer":"' .. optimizer .. '"', require("moonshard.plan_report").to_json(plan), 1, true)
      local warned = table.concat(plan.warnings, "\n"):match("torch_adamw keeps the AdamW moments[^\n]*")
      if optimizer == "torch_adamw" then
        assert.equal("torch_adamw keeps the AdamW moments of 1 trainable bf16 parameters (16 elements) in bf16, " ..
          "with no fp32 master weights: small updates round away in long full-parameter runs; store them in f32, " ..
          "or plan --optimizer adamw (fp32 master weights and moments)", warned)
      else
        assert.is_nil(warned)
      end
    end
    assert.equal(want.adamw, plan_with(nil).memory.optimizer)
    assert.equal("moonshard: plan: optimizer 'sgd': expected adamw, torch_adamw or none",
      errmsg(plan_with, "sgd"))
  end)

  it("writes every coordinate's local shape (torch.chunk) into the JSON", function()
    local report = require "moonshard.plan_report"
    assert.equal("[[3,4],[3,4],[3,4],[1,4]]", report.local_shapes_json({ 10, 4 }, 0, 4))
    assert.equal("[[2],[2],[1],[0]]", report.local_shapes_json({ 5 }, 0, 4))
    assert.equal("[[1,3],[1,3],[0,3],[0,3]]", report.local_shapes_json({ 2, 3 }, 0, 4))
    assert.equal("[[4,2],[4,2]]", report.local_shapes_json({ 4, 4 }, 1, 2))
  end)

  it("own their parameters in FSDP2's order: submodules in post-order, then the module's own", function()
    -- blk { own, c1 { w, g { w } }, own2, c2 { w } }: torch's _get_managed_states gives
    -- c1.g.w, c1.w, c2.w, own, own2
    local root = module.new("Toy")
    local blk = root:add("blk", module.new("Block"))
    blk:param("own", { 2 }, "f32")
    local c1 = blk:add("c1", module.new("Linear"))
    c1:param("w", { 2 }, "f32")
    c1:add("g", module.new("Gate")):param("w", { 2 }, "f32")
    blk:param("own2", { 2 }, "f32")
    blk:add("c2", module.new("Linear")):param("w", { 2 }, "f32")
    local plan = planner.plan(root, mesh_context.new("dp_shard=2"), policy(function(ctx) ctx:fully_shard(ctx.model) end))
    local order = {}
    for i, e in ipairs(plan.units[1].entries) do order[i] = e.fqn end
    assert.same({ "blk.c1.g.w", "blk.c1.w", "blk.c2.w", "blk.own", "blk.own2" }, order)
  end)

  it("are FSDP2 roots when no unit contains them: no reshard after forward by default", function()
    -- root { a { w [10,4] }, b { w [6] } } with units a and b only: both are roots
    local root = module.new("Toy")
    root:add("a", module.new("Linear")):param("w", { 10, 4 }, "f32")
    root:add("b", module.new("Norm")):param("w", { 6 }, "f32")
    local plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard("b")
    end))
    assert.is_false(plan.units[1].reshard)
    assert.is_false(plan.units[2].reshard)
    -- one all-gather each: a 4 x 12 x 4 B = 192 -> 144, b 4 x 2 x 4 B = 32 -> 24
    assert.same({ count = 2, bytes = 168 }, plan.comm.all_gather)
    -- an explicit value still wins; a unit inside another is not a root
    plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("b", { reshard_after_forward = true })
      ctx:fully_shard("a")
    end))
    assert.is_true(plan.units[1].reshard)
    assert.is_false(plan.units[2].reshard)
    local nested = planner.plan(small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard(ctx.model)
    end))
    assert.is_true(nested.units[1].reshard)
    assert.is_false(nested.units[2].reshard)
  end)

  it("leave a nested unit's ignored parameters to no one, as FSDP2 does, and say so", function()
    local msg = errmsg(planner.plan, small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a", { ignored_params = { "a.w" } })
      ctx:fully_shard(ctx.model)
    end))
    assert.equal("moonshard: plan: 1 trainable parameter is left unowned: a.w (a.w is in the ignored_params of " ..
      "unit a, and FSDP2's units around a unit skip its module, ignored parameters included); every trainable " ..
      "parameter must belong to exactly one shard unit or to expert parallelism", msg)
  end)

  it("take a 2-D mesh as (replicate, shard) in the mesh's order only", function()
    local mesh = mesh_context.new("dp_replicate=2,dp_shard=4")
    local msg = errmsg(planner.plan, small_tree(), mesh, policy(function(ctx)
      ctx:fully_shard(ctx.model, { mesh = { "dp_shard", "dp_replicate" } })
    end))
    assert.equal("moonshard: plan: fully_shard(<root>): mesh {dp_shard, dp_replicate}: a 2-D FSDP mesh is " ..
      "(replicate, shard), the replicate axis wholly outside the shard axis in the mesh's order (pp, dp_replicate, " ..
      "dp_shard, cp, tp; or ep_shard, ep)", msg)
    for _, axes in ipairs({ { "dp", "dp_shard" }, { "dp_shard", "dp_shard" }, { "dp_replicate", "ep" } }) do
      assert.matches("a 2-D FSDP mesh is (replicate, shard)", errmsg(planner.plan, small_tree(), mesh,
        policy(function(ctx) ctx:fully_shard(ctx.model, { mesh = axes }) end)), 1, true)
    end
    local ok = planner.plan(small_tree(), mesh, policy(function(ctx)
      ctx:fully_shard(ctx.model, { mesh = { "dp_replicate", "dp_shard" } })
    end))
    assert.equal(4, ok.units[1].shard_size)
    assert.is_true(mesh:outside("dp_replicate", "dp_shard_cp"))
    assert.is_true(mesh:outside("ep_shard", "ep"))
    assert.is_false(mesh:outside("ep", "ep_shard"))
  end)

  it("refuse fully_shard applied twice to one module, naming both calls", function()
    local msg = errmsg(planner.plan, small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard(ctx.model)
      ctx:fully_shard(ctx.model:get("a"))
    end))
    local first, second = msg:match("^moonshard: plan: fully_shard%(a%) is applied twice to the same module: " ..
      "first at .-plan_spec%.lua:(%d+), then at .-plan_spec%.lua:(%d+); a module is one shard unit at most$")
    assert.is_truthy(first, msg)
    assert.equal(2, tonumber(second) - tonumber(first))
  end)

  it("refuse to claim a parameter twice or to shard a parent first", function()
    local msg = errmsg(planner.plan, small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
      ctx:fully_shard("a")
    end))
    assert.matches("parameter a.w is already owned by unit <root>, which is not nested in a", msg)
  end)

  it("refuse a misspelt option instead of planning with its default", function()
    local function shard_with(opts)
      return errmsg(planner.plan, small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
        ctx:fully_shard(ctx.model, opts)
      end))
    end
    assert.matches("fully_shard(<root>): unknown option 'reshard_after_fwd' (options: mesh, mp_policy, " ..
      "reshard_after_forward, ignored_params, shard_placement_fn, offload_policy, kind, stage, islands, islands_mp_policy)",
      shard_with({ reshard_after_fwd = false }), 1, true)
    assert.matches("fully_shard(<root>): unknown mp_policy key 'bogus' (mp_policy keys: param_dtype, reduce_dtype, " ..
      "output_dtype, cast_forward_inputs)", shard_with({ mp_policy = { param_dtype = "f32", bogus = 1 } }), 1, true)
    assert.matches("fully_shard(<root>): mp_policy is bf16; expected a table",
      shard_with({ mp_policy = "bf16" }), 1, true)
    assert.matches("mp_policy.param_dtype of unit <root> is 'i32'; mixed precision takes a floating dtype",
      shard_with({ mp_policy = { param_dtype = "i32" } }), 1, true)
  end)

  it("find every trainable parameter left unowned", function()
    local msg = errmsg(planner.plan, small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a")
    end))
    assert.matches("2 trainable parameters are left unowned: p, b.w", msg)
  end)

  it("demand one stored dtype per unit and name the parameters", function()
    local tree = small_tree()
    tree.children.b.params.w.dtype = "bf16"
    local msg = errmsg(planner.plan, tree, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
    end))
    assert.matches("unit <root> mixes stored dtypes %(bf16: b.w; f32: a.w, p%)", msg)
  end)

  it("ask one stored dtype of the trainable parameters only, and gather mixed dtypes as bytes", function()
    -- a LoRA-like unit: frozen bf16 base [8,4], trainable f32 adapter [2,4], frozen i64 ids [6]
    local root = module.new("Toy")
    local a = root:add("a", module.new("Lora"))
    a:param("base", { 8, 4 }, "bf16").requires_grad = false
    a:param("lora_a", { 2, 4 }, "f32")
    -- integer parameters cannot require gradients (PyTorch refuses them), so never do
    assert.is_false(a:param("ids", { 6 }, "i64").requires_grad)
    assert.matches("a parameter of dtype i64 cannot require gradients; only floating dtypes can",
      errmsg(module.param, { 2 }, "i64", { requires_grad = true }), 1, true)
    local plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" } })
    end))
    local u = plan.units[1]
    -- gathered per rank: base [2,4] bf16 16 B + lora_a [1,4] in bf16 8 B + ids [2] i64 16 B
    -- (not cast: integers) = 40 B, S = 160 B over 4 ranks, bus 120 B; reduced: lora_a's
    -- [1,4] in f32 = 16 B a rank, S = 64 B, bus 48 B
    assert.same({ "bytes", "f32", "f32" }, { u.gather_dtype, u.stored_dtype, u.reduce_dtype_eff })
    assert.same({ "bf16", "bf16", "i64" }, { u.entries[1].gather, u.entries[2].gather, u.entries[3].gather })
    assert.equal(120, u.all_gather_bytes)
    assert.equal(48, u.reduce_scatter_bytes)
    -- params 16 + 16 + 16 = 48 B a rank, grads 16 B
    assert.same({ 48, 16 }, { plan.memory.params, plan.memory.grads })
    assert.matches("<root> +root +dp_shard +46 +bytes +f32 ", require("moonshard.plan_report").to_text(plan))
    -- all frozen, any dtypes: nothing to reduce, nothing refused
    a.params.lora_a.requires_grad = false
    plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx) ctx:fully_shard(ctx.model) end))
    assert.equal(0, plan.units[1].reduce_scatter_bytes)
    -- two trainable dtypes: refused, naming only them
    a.params.lora_a.requires_grad, a.params.base.requires_grad = true, true
    assert.matches("unit <root> mixes stored dtypes (bf16: a.base; f32: a.lora_a)", errmsg(planner.plan, root,
      mesh_context.new("dp_shard=4"), policy(function(ctx) ctx:fully_shard(ctx.model) end)), 1, true)
  end)

  it("warn when param_dtype is set without reduce_dtype, where PyTorch versions differ", function()
    local root = module.new("Toy")
    root:add("a", module.new("Linear")):param("w", { 8, 4 }, "f32")
    root:add("b", module.new("Linear")):param("w", { 8, 4 }, "f32")
    local plan = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a", { mp_policy = { param_dtype = "bf16" } })
      ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" } })
    end))
    -- PyTorch 2.15's rule: in the stored dtype (tests/lua/reference_layouts_spec.lua measures it)
    assert.equal("f32", plan.units[1].reduce_dtype_eff)
    assert.equal("1 unit set param_dtype but not reduce_dtype: planned as PyTorch 2.15's FSDP2 runs it, reducing " ..
      "gradients in the stored dtype; FSDP2 before 2.15 reduced them in param_dtype: set reduce_dtype to pin " ..
      "it: a (f32)", plan.warnings[1])
    assert.matches("^2 units move less than", plan.warnings[2]) -- and nothing else
    assert.equal(2, #plan.warnings)
  end)

  it("check integer reshard_after_forward and run the backward gather over k ranks", function()
    local function with(k)
      return planner.plan(small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
        ctx:fully_shard("a", { reshard_after_forward = k })
        ctx:fully_shard(ctx.model)
      end))
    end
    -- k = 2: backward all-gather of S = 192 over 2 ranks moves 96
    local a = with(2).units[1]
    assert.equal(144 + 96, a.all_gather_bytes)
    assert.equal(2, a.reshard)
    assert.is_false(with(1).units[1].reshard) -- 1 means false
    assert.is_true(with(4).units[1].reshard)  -- W means true
    assert.matches("reshard_after_forward = 3 must divide the shard size 4", errmsg(with, 3))
    assert.matches("reshard_after_forward = 8 must divide", errmsg(with, 8))
  end)

  it("reduce over the replicate axis on a 2-D mesh (HSDP)", function()
    local plan = planner.plan(small_tree(), mesh_context.new("dp_replicate=2,dp_shard=2"), policy(function(ctx)
      ctx:fully_shard("a")
      ctx:fully_shard(ctx.model)
    end))
    local a = plan.units[1]
    assert.same({ "dp_replicate", "dp_shard" }, a.mesh_axes)
    -- a.w over 2: padded [5,4] = 20 elements; S = 2 x 20 x 4 = 160; all-gather 80 twice;
    -- reduce-scatter 80; all-reduce of the 80 B shard over 2 replicas: 2 x 80 x 1/2 = 80
    assert.same({ 5, 4 }, a.entries[1].padded)
    assert.equal(160, a.all_gather_bytes)
    assert.equal(80, a.reduce_scatter_bytes)
    assert.equal(80, a.all_reduce_bytes)
    assert.equal(2, plan.comm.all_reduce.count)
  end)

  it("match the FSDP formula (2 b_param + b_grad) P (n-1)/n when nothing is padded", function()
    local root = module.new("Toy")
    for i = 1, 3 do root:add("l" .. i, module.new("Linear")):param("w", { 64, 32 }, "f32") end
    root:param("b", { 64 }, "f32")
    local mp = { param_dtype = "bf16", reduce_dtype = "f32" }
    local plan = planner.plan(root, mesh_context.new("dp_shard=8"), policy(function(ctx)
      for i = 1, 3 do ctx:fully_shard("l" .. i, { mp_policy = mp }) end
      ctx:fully_shard(ctx.model, { mp_policy = mp, reshard_after_forward = true })
    end))
    local P = 3 * 64 * 32 + 64
    local total = plan.comm.all_gather.bytes + plan.comm.reduce_scatter.bytes
    assert.equal((2 * 2 + 4) * P * 7 / 8, total)
  end)

  it("leave expert parameters to expert parallelism and refuse to shard them again", function()
    local root = module.new("Toy")
    local moe = root:add("moe", module.new("MoE"))
    moe:add("experts", module.new("GroupedExperts")):param("up", { 8, 16, 32 }, "bf16")
    moe:add("gate", module.new("Gate")):param("weight", { 8, 16 }, "f32")
    local mesh = mesh_context.new("dp_shard=4,ep=4")
    local plan = planner.plan(root, mesh, policy(function(ctx)
      local ignored = ctx:expert_parallel("moe.experts")
      ctx:fully_shard("moe.gate")
      ctx:fully_shard(ctx.model, { ignored_params = ignored })
    end))
    assert.equal(1, #plan.owned)
    assert.same({ 2, 16, 32 }, plan.owned[1].local_shape)
    assert.same({ "Shard(0)" }, plan.owned[1].placements)
    -- memory: gate [8,16] f32 padded [2,16] = 32 elements; experts 2x16x32 = 1024 bf16 local
    assert.equal(32 * 4 + 1024 * 2, plan.memory.params)
    -- dp_shard=4, ep=4: ep_shard = 1, each expert on one rank, so its gradient is reduced nowhere
    for _, row in ipairs(planner.audit(plan)) do
      if row.kind == "ep" then assert.is_nil(row.reduced, row.fqn) end
    end
    -- ep_shard = 2 replicas of each expert, whose gradients only a unit on ep_shard reduces:
    -- refused without one (the runtime could not run it as planned), planned with one
    local err = errmsg(planner.plan, root, mesh_context.new("dp_shard=4,ep=2"), policy(function(ctx)
      local ignored = ctx:expert_parallel("moe.experts")
      ctx:fully_shard("moe.gate")
      ctx:fully_shard(ctx.model, { ignored_params = ignored })
    end))
    assert.equal("moonshard: plan: expert parallelism places 1 trainable parameter that no unit shards " ..
      "(moe.experts.up), but ep_shard = 2: each expert is replicated on 2 ranks and its gradients must be reduced " ..
      "across them, which a unit on ep_shard does; shard the experts with ctx:fully_shard(experts, {mesh = " ..
      "{\"ep_shard\"}, ...}) before their layer (as NeMo Automodel's MoE parallelizer does), or choose ep so that " ..
      "ep_shard = 1", err)
    local replicated = planner.plan(root, mesh_context.new("dp_shard=4,ep=2"), policy(function(ctx)
      local ignored = ctx:expert_parallel("moe.experts")
      ctx:fully_shard("moe.experts", { mesh = { "ep_shard" } })
      ctx:fully_shard("moe.gate")
      ctx:fully_shard(ctx.model, { ignored_params = ignored })
    end))
    local reduced = {}
    for _, row in ipairs(planner.audit(replicated)) do reduced[row.fqn] = row.reduced end
    assert.equal("bf16", reduced["moe.experts.up"])
    -- the tokens' all_to_all is not a parameter's: not counted, and said so
    assert.same({ count = 0, bytes = 0, uncounted_ep = 4 }, plan.comm.all_to_all)
    assert.matches("all_to_all counts none of expert parallelism's token traffic %(ep = 4%)",
      plan.warnings[#plan.warnings])
    local no_ep = planner.plan(root, mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("moe.gate")
      ctx:fully_shard(ctx.model)
    end))
    assert.is_nil(no_ep.comm.all_to_all.uncounted_ep)
    for _, w in ipairs(no_ep.warnings) do assert.not_matches("all_to_all", w) end
    -- ep > 1 with nothing placed by expert parallelism: said, not silently ignored
    local unplaced = planner.plan(root, mesh, policy(function(ctx)
      ctx:fully_shard("moe.gate")
      ctx:fully_shard(ctx.model)
    end))
    assert.equal(0, #unplaced.owned)
    assert.equal("ep = 4 but expert parallelism places no parameter (the policy called no expert_parallel, " ..
      "or the model has no grouped experts): the ep axis only divides the ranks", unplaced.warnings[#unplaced.warnings])
    local msg = errmsg(planner.plan, root, mesh, policy(function(ctx)
      ctx:expert_parallel("moe.experts")
      ctx:fully_shard(ctx.model)
    end))
    assert.matches("parameter moe.experts.up is placed by expert parallelism but unit <root> would shard it too", msg)
  end)
end)

describe("the peak of unsharded bytes", function()
  -- Its definition, summed over every unit at every step of forward and backward (O(n^2)):
  -- what the planner's walk must come to.
  local function reference(plan, model, prefetch)
    local pre, name = {}, {}
    for i, nm in ipairs(model:named_modules()) do pre[nm[2]], name[nm[2]] = i, nm[1] end
    local order = {}
    for _, u in ipairs(plan.units) do order[#order + 1] = u end
    table.sort(order, function(a, b)
      if pre[a.module] ~= pre[b.module] then return pre[a.module] < pre[b.module] end
      return a.index < b.index
    end)
    local function contains(a, b)
      local na, nb = name[a.module], name[b.module]
      return a ~= b and (na == "" or nb:sub(1, #na + 1) == na .. ".")
    end
    local function kept(u)
      if u.reshard == false then return u.unsharded_bytes end
      if type(u.reshard) == "number" then return math.floor(u.unsharded_bytes / u.reshard) end
      return 0
    end
    local n, peak = #order, 0
    local function live(t, prefetched)
      local sum = 0
      for i = 1, n do
        if i == t or prefetched(i) or (i < t and contains(order[i], order[t])) then sum = sum + order[i].unsharded_bytes
        elseif i < t then sum = sum + kept(order[i]) end
      end
      return sum
    end
    for t = 1, n do
      peak = math.max(peak, live(t, function(i) return i > t and i <= t + prefetch.forward end))
      peak = math.max(peak, order[t].unsharded_grad_bytes +
        live(t, function(i) return i < t and i >= t - prefetch.backward end))
    end
    return peak
  end

  it("is the sum over every unit at every step, on random trees, units, reshard rules and prefetch depths", function()
    math.randomseed(17)
    local RESHARD = { true, false, 1, 2, 4 }
    for trial = 1, 150 do
      local root = module.new("Root")
      local mods = { { "", root } }
      local function grow(m, prefix, depth)
        for c = 1, math.random(0, depth > 0 and 3 or 0) do
          local child = m:add("m" .. c, module.new("M"))
          local name = prefix == "" and "m" .. c or prefix .. ".m" .. c
          mods[#mods + 1] = { name, child }
          if math.random() < 0.8 then child:param("w", { math.random(1, 9), math.random(1, 5) }, "f32") end
          grow(child, name, depth - 1)
        end
      end
      root:param("b", { math.random(1, 7) }, "f32")
      grow(root, "", 3)
      local prefetch = { forward = math.random(0, 3), backward = math.random(0, 3) }
      local plan = planner.plan(root, mesh_context.new("dp_shard=4"), { prefetch = prefetch, parallelize = function(ctx)
        -- children before parents: the modules in reverse pre-order, some of them
        for i = #mods, 2, -1 do
          if math.random() < 0.5 then
            ctx:fully_shard(mods[i][1], { reshard_after_forward = RESHARD[math.random(1, #RESHARD)],
              mp_policy = math.random() < 0.5 and { param_dtype = "bf16" } or nil })
          end
        end
        ctx:fully_shard(ctx.model)
      end })
      assert.equal(reference(plan, root, prefetch), plan.memory.peak_unsharded, "trial " .. trial)
    end
  end)
end)

describe("the policy's prefetch", function()
  local function plan_with(prefetch)
    return planner.plan(small_tree(), mesh_context.new("dp_shard=2"), { prefetch = prefetch,
      parallelize = function(ctx) ctx:fully_shard(ctx.model) end })
  end

  it("takes integers >= 0 and defaults the missing one to FSDP2's implicit depth, 1", function()
    assert.same({ forward = 0, backward = 1 }, plan_with({ forward = 0 }).prefetch)
    assert.same({ forward = 1, backward = 1 }, plan_with(nil).prefetch)
  end)

  it("refuses other values, naming the key", function()
    local expected = "; expected an integer >= 0 %(units fetched ahead%)$"
    assert.matches("^moonshard: plan: the policy's prefetch.forward is %-3" .. expected,
      errmsg(plan_with, { forward = -3 }))
    assert.matches("^moonshard: plan: the policy's prefetch.backward is 'x'" .. expected,
      errmsg(plan_with, { backward = "x" }))
    assert.matches("^moonshard: plan: the policy's prefetch.forward is 1.5" .. expected,
      errmsg(plan_with, { forward = 1.5 }))
    assert.matches("^moonshard: plan: the policy's prefetch has the key fwd; expected forward and backward only",
      errmsg(plan_with, { fwd = 1 }))
    assert.matches("^moonshard: plan: the policy's prefetch is 3; expected a table {forward = n, backward = n}",
      errmsg(plan_with, 3))
  end)
end)

describe("module trees", function()
  it("report a bad shape at the caller's line, never inside the library", function()
    local msg = errmsg(function()
      local m = module.new("X")
      m:param("w", { 1, -2 })
    end)
    assert.matches("plan_spec%.lua:%d+: moonshard: parameter shape%[2%] is %-2; sizes are integers >= 0$", msg)
    assert.is_nil(msg:find("module.lua", 1, true))
    -- called from the library with no user frame between (a CLI, a host): no position
    assert.equal("moonshard: parameter shape[1] is -1; sizes are integers >= 0",
      errmsg(require("moonshard.safetensors").tree, { { name = "a.w", shape = { -1 }, dtype = "f32" } }))
  end)
end)

describe("shard dims and meshes", function()
  it("shard on another dim only when it divides, with negative dims normalised", function()
    local root = module.new("Toy")
    root:add("a", module.new("Linear")):param("w", { 6, 8 }, "f32")
    local function with(dim, mesh)
      return planner.plan(root, mesh_context.new(mesh or "dp_shard=4"), policy(function(ctx)
        ctx:fully_shard(ctx.model, { shard_placement_fn = function() return dim end })
      end))
    end
    local e = with(-1).units[1].entries[1]
    assert.equal(1, e.dim)
    assert.same({ 6, 2 }, e.padded)
    assert.matches("Shard%(1%) needs size 8 divisible by the shard size 3", errmsg(with, 1, "dp_shard=3"))
    assert.matches("shard dim 2 of parameter a.w is out of range for 2 dims", errmsg(with, 2))
  end)

  it("refuse scalar parameters and meshes of more than two axes", function()
    local root = module.new("Toy")
    root:param("scale", {}, "f32")
    assert.matches("parameter scale of unit <root> is a scalar", errmsg(planner.plan, root,
      mesh_context.new("dp_shard=2"), policy(function(ctx) ctx:fully_shard(ctx.model) end)))
    assert.matches("FSDP takes a 1%-D %(shard%) or 2%-D %(replicate, shard%) mesh, got 3 axes",
      errmsg(planner.plan, small_tree(), mesh_context.new("dp_replicate=2,dp_shard=2,cp=2"), policy(function(ctx)
        ctx:fully_shard(ctx.model, { mesh = { "dp_replicate", "dp_shard", "cp" } })
      end)))
  end)
end)

describe("mixed precision", function()
  it("clamps param_dtype and reduce_dtype like FSDP2", function()
    local e = planner.effective_dtypes
    local mp = { param_dtype = "bf16", reduce_dtype = "f32" }
    assert.same({ "bf16", "f32" }, { e("bf16", mp) })
    assert.same({ "bf16", "f32" }, { e("f32", mp) })
    assert.same({ "f32", "f32" }, { e("f32", { param_dtype = "f32", reduce_dtype = "f32" }) })
    assert.same({ "bf16", "bf16" }, { e("f32", { param_dtype = "bf16", reduce_dtype = "bf16" }) })
    assert.same({ "i64" }, { e("i64", mp) })
    assert.same({ "f32", "f32" }, { e("f32", {}) })
  end)

  it("audits every parameter's stored, gathered and reduced dtype", function()
    local tree = small_tree()
    local plan = planner.plan(tree, mesh_context.new("dp_shard=2"), policy(function(ctx)
      ctx:fully_shard("a", { mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" } })
      ctx:fully_shard(ctx.model, { mp_policy = { param_dtype = "f32", reduce_dtype = "f32" } })
    end))
    local rows = {}
    for _, r in ipairs(planner.audit(plan)) do rows[r.fqn] = r end
    assert.same({ "f32", "bf16", "f32" }, { rows["a.w"].stored, rows["a.w"].gathered, rows["a.w"].reduced })
    assert.same({ "f32", "f32", "f32" }, { rows["p"].stored, rows["p"].gathered, rows["p"].reduced })
  end)
end)

describe("CPU offload (FSDP2's CPUOffloadPolicy)", function()
  local S = require "support"
  local report = require "moonshard.plan_report"
  local json = require "moonshard.json"

  -- a.w [10,4] f32 and b.w [6] bf16 offloaded, the root (p [3] f32) not, on
  -- dp_replicate=2 x dp_shard=4: the dp_shard coordinate of rank r is r % 4
  local function offload_plan(offload)
    local tree = small_tree()
    tree.children.b.params.w.dtype = "bf16"
    return planner.plan(tree, mesh_context.new("dp_replicate=2,dp_shard=4"), policy(function(ctx)
      ctx:fully_shard("a", { offload_policy = offload })
      ctx:fully_shard("b", { offload_policy = offload })
      ctx:fully_shard(ctx.model, { offload_policy = "none" })
    end))
  end

  it("counts the offloaded units' params, grads and optimizer state in host memory, per rank", function()
    local plan = offload_plan("cpu")
    assert.same({ "cpu", "cpu" }, { plan.units[1].offload, plan.units[2].offload })
    assert.is_nil(plan.units[3].offload)
    -- a.w: padded [3,4] = 12 elements: params 48 B, grads 48 B, AdamW 8 B per element held:
    -- rows 3, 3, 3, 1 -> 96, 96, 96, 32.  b.w: padded [2] bf16: params 4 B, grads 4 B,
    -- moments and master weight 12 B per element held: rows 2, 2, 2, 0 -> 24, 24, 24, 0.
    -- Host: 48 + 48 + 96 + 4 + 4 + 24 = 224 on coordinates 0-2, 48 + 48 + 32 + 8 = 136 on 3.
    local want = { 224, 224, 224, 136, 224, 224, 224, 136 }
    local got = {}
    for i, m in ipairs(plan.memory.per_rank) do got[i] = m.offloaded end
    assert.same(want, got)
    assert.same(want, S.offloaded_bytes(plan))
    assert.equal(224, plan.memory.offloaded) -- the summary is rank 0's
    -- the rest of the memory figures count every byte a rank holds, wherever it lives
    local kept = offload_plan(nil)
    for _, k in ipairs({ "params", "grads", "optimizer", "peak_unsharded", "total" }) do
      assert.equal(kept.memory[k], plan.memory[k], k)
      for r = 1, 8 do assert.equal(kept.memory.per_rank[r][k], plan.memory.per_rank[r][k], k) end
    end
    assert.equal(0, kept.memory.offloaded)
    for r = 1, 8 do assert.equal(0, kept.memory.per_rank[r].offloaded) end
  end)

  it("writes offload_policy on offloaded units only, and offloaded per rank, into the JSON", function()
    local text = report.to_json(offload_plan("cpu"))
    local doc = json.decode(text, "plan JSON")
    assert.same({ "cpu", "cpu" }, { doc.units[1].offload_policy, doc.units[2].offload_policy })
    assert.equal(2, select(2, text:gsub('"offload_policy"', "")))
    for r, m in ipairs(doc.memory.per_rank) do assert.equal(r % 4 == 0 and 136 or 224, m.offloaded) end
    local kept = report.to_json(offload_plan(nil))
    assert.is_nil(kept:find('"offload_policy"', 1, true))
    for _, m in ipairs(json.decode(kept, "plan JSON").memory.per_rank) do assert.equal(0, m.offloaded) end
  end)

  it("shows the offloaded units and bytes in the table only when something offloads", function()
    local text = report.to_text(offload_plan("cpu"))
    assert.matches("RS/step    AR/step  offload\n", text)
    assert.matches("\n   1  a .-  cpu\n   2  b .-  cpu\n   3  <root> .-  %-\n", text)
    assert.matches("offloaded to host memory %(offload_policy cpu%): 224 B of the params, grads and optimizer " ..
      "state; on the device: ", text)
    local kept = report.to_text(offload_plan(nil))
    assert.is_nil(kept:find("offload", 1, true))
  end)

  it("refuses an offload_policy other than \"cpu\", \"none\" or nil, naming the unit", function()
    assert.matches([[offload_policy of unit a is 'gpu'; expected "cpu" %(CPUOffloadPolicy%), "none" or nil]],
      errmsg(offload_plan, "gpu"))
    assert.matches("offload_policy of unit a is true; expected", errmsg(offload_plan, true))
  end)
end)

describe("the plan table", function()
  local report = require "moonshard.plan_report"
  local json = require "moonshard.json"

  it("shows reduce_scatter and all_reduce bytes in their own columns, as the JSON has them", function()
    -- HSDP 2 x 4, one unit of 60 padded f32 elements (a.w 12 x 4, b.w 8, p 4): S = 240 B;
    -- all-gather and reduce-scatter 240 * 3/4 = 180 B, all-reduce of the 60 B shard over 2: 60 B
    local plan = planner.plan(small_tree(), mesh_context.new("dp_replicate=2,dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
    end))
    local u = json.decode(report.to_json(plan), "plan JSON").units[1]
    assert.same({ 180, 180, 60 }, { u.all_gather_bytes, u.reduce_scatter_bytes, u.all_reduce_bytes })
    local text = report.to_text(plan)
    assert.matches("AG/step    RS/step    AR/step\n", text, 1, true)
    assert.matches("\n   1  <root> .* 180 B +180 B +60 B\n", text)
    -- without a replicate axis there is no all_reduce, and no column for it
    local flat = planner.plan(small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
    end))
    assert.is_nil(report.to_text(flat):find("AR/step", 1, true))
  end)

  it("gives the spread of optimizer state across ranks in exact bytes", function()
    -- dp_shard=4 over a.w [10,4] (rows 3,3,3,1), b.w [6] (2,2,2,0), p [3] (1,1,1,0):
    -- AdamW 8 B per held element: rank 0 (12 + 2 + 1) * 8 = 120, rank 3 4 * 8 = 32
    local plan = planner.plan(small_tree(), mesh_context.new("dp_shard=4"), policy(function(ctx)
      ctx:fully_shard(ctx.model)
    end))
    assert.matches("optimizer state differs across ranks by 88 B: from 32 to 120 bytes", report.to_text(plan), 1, true)
  end)
end)

describe("the plan's model", function()
  it("counts trainable parameters beside all of them: frozen ones out, a tied weight once", function()
    local mesh_context = require "moonshard.mesh_context"
    local pl = require "moonshard.plan"
    local pol = require "moonshard.policy"
    local mods = require "moonshard.models"
    local rep = require "moonshard.plan_report"
    local js = require "moonshard.json"
    local fsdp2 = pol.entry_point(pol.load("policies/fsdp2_default.lua"), "fsdp2_default")
    local cfg = { architectures = { "LlamaForCausalLM" }, vocab_size = 64, hidden_size = 16, intermediate_size = 24,
      num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, tie_word_embeddings = true,
      torch_dtype = "bfloat16" }
    local model = mods.from_config(cfg, "tied llama")
    local norm = model:get("model.norm").params.weight
    norm.requires_grad = false
    local p = pl.plan(model, mesh_context.new("dp_shard=2"), fsdp2)
    -- by hand: embedding (tied head, once) 64 x 16; per layer q 16x16, k and v 8x16, o 16x16,
    -- gate, up 24x16, down 16x24, two norms of 16; the final norm of 16, frozen
    local layer = 16 * 16 + 2 * 8 * 16 + 16 * 16 + 3 * 24 * 16 + 2 * 16
    local all = 64 * 16 + 2 * layer + 16
    assert.equal(all, p.model.params)
    assert.equal(all - 16, p.model.trainable_params)
    local j = js.decode(rep.to_json(p), "plan JSON")
    assert.equal(all - 16, j.model.trainable_params)
  end)
end)
