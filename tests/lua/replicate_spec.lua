-- replicate_spec.lua: replicate units (ctx:replicate, PyTorch's DDP as NeMo Automodel's DDP
-- manager applies it) in the planner: the gradient buckets against PyTorch's own assignment
-- (tests/reference/data/ddp_buckets.json, made by tests/reference/ddp_buckets.py:
-- MOONSHARD_REF_VENV=<venv> bash tests/reference/make.sh ddp_buckets), the policy API's
-- errors, and the memory and communication figures, worked out here by hand.
local module = require "moonshard.module"
local mesh_context = require "moonshard.mesh_context"
local planner = require "moonshard.plan"
local policy = require "moonshard.policy"
local models = require "moonshard.models"
local report = require "moonshard.plan_report"
local json = require "moonshard.json"
local S = require "support"

local DATA = "tests/reference/data/ddp_buckets.json"
local REF = json.decode(S.read_file(DATA), DATA)
local MODELS = json.decode(S.read_file("tests/reference/data/model_params.json"), "model_params.json")
local DDP = "policies/ddp.lua"

local SIZE = { f32 = 4, bf16 = 2, f16 = 2, f64 = 8 }

local function params_of_case(case)
  if case.params then return case.params end
  for _, m in ipairs(MODELS.models) do
    if m.config == case.model then return m.params end
  end
  error("no model " .. tostring(case.model) .. " in model_params.json")
end

-- The trainable parameters of a case as the planner's bucketing takes them.
local function trainable(list)
  local out = {}
  for _, p in ipairs(list) do
    if p[4] then
      local n = 1
      for _, s in ipairs(p[2]) do n = n * s end
      out[#out + 1] = { fqn = p[1], bytes = n * SIZE[p[3]], dtype = p[3] }
    end
  end
  return out
end

local function cap_of(case)
  if case.bucket_cap_mb == json.null then return nil end
  return case.bucket_cap_mb
end

describe("DDP's buckets", function()
  it("are PyTorch's, bucket by bucket, for every recorded model, cap and mode", function()
    local cases, buckets, multi, dtypes, checked = 0, 0, 0, 0, 0
    for _, case in ipairs(REF.cases) do
      local list = trainable(params_of_case(case))
      local got, limits = planner.ddp_buckets(list, { bucket_cap_mb = cap_of(case),
        find_unused_parameters = case.find_unused_parameters })
      local what = (case.model or case.name) .. " cap " .. tostring(case.bucket_cap_mb) .. " find_unused " ..
        tostring(case.find_unused_parameters)
      assert.same(case.limits, limits, what)
      assert.equal(#case.buckets, #got, what)
      local seen = {}
      for i, b in ipairs(case.buckets) do
        local positions = {}
        for j, k in ipairs(got[i].indices) do positions[j] = k - 1 end
        assert.same(b.params, positions, what .. " bucket " .. (i - 1))
        assert.equal(b.bytes, got[i].bytes, what .. " bucket " .. (i - 1))
        assert.equal(b.dtype, got[i].dtype, what .. " bucket " .. (i - 1))
        seen[b.dtype] = true
      end
      cases, buckets = cases + 1, buckets + #got
      if #got > 1 then multi = multi + 1 end
      if next(seen, next(seen)) then dtypes = dtypes + 1 end
      if case.checked_by_ddp then checked = checked + 1 end
    end
    -- the data covers what the rules are about: many cases, split buckets, mixed dtypes,
    -- and buckets read back from a real DDP
    assert.is_true(cases >= 190, cases)
    assert.is_true(multi >= 150, multi)
    assert.is_true(dtypes >= 10, dtypes)
    assert.is_true(checked >= 60, checked)
    assert.is_true(buckets > 10000, buckets)
  end)

  it("are the replicate unit's when policies/ddp.lua plans a model of the same config", function()
    local planned = 0
    for _, case in ipairs(REF.cases) do
      local ref_params = case.model and case.model:find("/reference/") and params_of_case(case)
      local tree = ref_params and models.from_config(case.model, "spec")
      local names = {}
      if tree then
        for i, np in ipairs(tree:named_parameters()) do names[i] = np[1] end
      end
      local list = ref_params and trainable(ref_params)
      local same = list and #names == #list
      for i = 1, same and #list or 0 do same = same and names[i] == list[i].fqn end
      if same then
        local plan = planner.plan(tree, mesh_context.new("dp_shard=2"), policy.load(DDP).main,
          { options = { bucket_cap_mb = cap_of(case), find_unused_parameters = case.find_unused_parameters } })
        local u = plan.units[1]
        assert.equal("replicate", u.kind)
        assert.equal(#case.buckets, #u.buckets, case.model)
        for i, b in ipairs(case.buckets) do
          local fqns = {}
          for j, k in ipairs(b.params) do fqns[j] = list[k + 1].fqn end
          assert.same(fqns, u.buckets[i].fqns, case.model .. " bucket " .. (i - 1))
          assert.equal(b.bytes, u.buckets[i].bytes)
        end
        planned = planned + 1
      end
    end
    assert.is_true(planned >= 40, planned)
  end)
end)

-- root { p [3], a { w [10, 4] }, b { w [6] } }, all f32: named_parameters order p, a.w, b.w
local function tree()
  local root = module.new("Toy")
  root:param("p", { 3 }, "f32")
  root:add("a", module.new("Linear")):param("w", { 10, 4 }, "f32")
  root:add("b", module.new("Norm")):param("w", { 6 }, "f32")
  return root
end

local function plan(fn, mesh, opts)
  return planner.plan(tree(), mesh_context.new(mesh or "dp_shard=4"), { parallelize = fn }, opts)
end

describe("a replicate unit", function()
  it("holds everything whole on every rank and all-reduces one bucket at a time", function()
    -- cap 0.0001 MiB = 104 bytes (int(0.0001 * 2^20)), the first bucket too (a cap given);
    -- reverse registration: b.w 24 B, then a.w 160 B reaches 184 >= 104 and closes bucket 0;
    -- p 12 B stays open: bucket 1
    local p = plan(function(ctx) ctx:replicate(ctx.model, { bucket_cap_mb = 0.0001 }) end)
    local u = p.units[1]
    assert.same({ "dp_shard" }, u.mesh_axes)
    assert.equal(2, #u.buckets)
    assert.same({ "b.w", "a.w" }, u.buckets[1].fqns)
    assert.same({ "p" }, u.buckets[2].fqns)
    assert.same({ 184, 12 }, { u.buckets[1].bytes, u.buckets[2].bytes })
    -- params (3 + 40 + 6) x 4 = 196 B; grads 196 B and the buckets' copy 196 B; AdamW on f32:
    -- 8 B a element, 392 B; nothing gathered
    local m = p.memory
    assert.same({ 196, 392, 392, 0 }, { m.params, m.grads, m.optimizer, m.peak_unsharded })
    assert.equal(196 + 392 + 392, m.total)
    -- one all_reduce per bucket over 4 ranks: 2S(n-1)/n = 276 and 18 bus bytes
    assert.same({ count = 2, bytes = 294 }, { count = p.comm.all_reduce.count, bytes = p.comm.all_reduce.bytes })
    assert.same({ 0, 0 }, { p.comm.all_gather.count, p.comm.reduce_scatter.count })
    -- every rank alike
    assert.equal(1, #p.memory.runs)
  end)

  it("keeps the buckets as the gradients' storage with gradient_as_bucket_view", function()
    local p = plan(function(ctx) ctx:replicate(ctx.model, { gradient_as_bucket_view = true }) end)
    assert.equal(196, p.memory.grads)
    -- PyTorch's default cap: one bucket of everything, all_reduce 2 x 196 x 3/4 = 294
    assert.equal(1, #p.units[1].buckets)
    assert.equal(294, p.comm.all_reduce.bytes)
  end)

  it("leaves frozen parameters out of the buckets but holds them", function()
    local t = tree()
    t.children.b.params.w.requires_grad = false
    local p = planner.plan(t, mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
      ctx:replicate(ctx.model) end })
    assert.same({ "a.w", "p" }, p.units[1].buckets[1].fqns)
    assert.equal(196, p.memory.params)
    -- gradients and the bucket copy of the 43 trainable elements, AdamW for them
    assert.same({ 344, 344 }, { p.memory.grads, p.memory.optimizer })
  end)

  it("takes parameters of several dtypes, which its buckets keep apart", function()
    local t = tree()
    t.children.a.params.w.dtype = "bf16"
    local p = planner.plan(t, mesh_context.new("dp_shard=2"), { parallelize = function(ctx)
      ctx:replicate(ctx.model, { bucket_cap_mb = 0.0001 }) end })
    -- reverse order: b.w f32 24 B (open), a.w bf16 80 B (open), p f32 36 B closes none:
    -- the open buckets, the dtype seen last first
    local got = {}
    for i, b in ipairs(p.units[1].buckets) do got[i] = { b.dtype, b.bytes, table.concat(b.fqns, " ") } end
    assert.same({ { "bf16", 80, "a.w" }, { "f32", 36, "b.w p" } }, got)
    assert.equal(80 + 36, p.memory.params)
  end)

  it("reduces over the whole data-parallel group by default, and costs nothing on one rank", function()
    local p = plan(function(ctx) ctx:replicate(ctx.model) end, "dp_replicate=2,dp_shard=2")
    assert.same({ "dp" }, p.units[1].mesh_axes)
    p = plan(function(ctx) ctx:replicate(ctx.model) end, "dp_shard=2,cp=2")
    assert.same({ "dp_shard_cp" }, p.units[1].mesh_axes)
    p = plan(function(ctx) ctx:replicate(ctx.model) end, "dp_shard=1")
    assert.same({ 0, 0 }, { p.comm.all_reduce.count, p.comm.all_reduce.bytes })
  end)

  it("composes with a fully_shard of an ancestor, which leaves it its parameters (FSDP2's rule)", function()
    local p = plan(function(ctx)
      ctx:replicate("a")
      ctx:fully_shard(ctx.model)
    end)
    assert.equal("replicate", p.units[1].kind)
    assert.equal(40, p.units[1].numel)
    assert.equal(9, p.units[2].numel) -- p and b.w
    -- the root unit's params: 3 and 6 elements, dim 0 over 4: padded [1] and [2], 12 B;
    -- the replicate unit 160 B
    assert.equal(160 + 12, p.memory.params)
  end)

  it("shows its buckets in the table, the JSON, the audit and the rank view", function()
    local p = plan(function(ctx) ctx:replicate(ctx.model, { bucket_cap_mb = 0.0001 }) end)
    local text = report.to_text(p)
    S.assert_has(text, "replicate unit <root> (DDP) over dp_shard=4: 2 buckets")
    S.assert_has(text, "all_reduce          2 x")
    local j = json.decode(report.to_json(p, { audit = true, rank = 3 }))
    local u = j.units[1]
    assert.equal("replicate", u.kind)
    assert.same({ { index = 0, params = { "b.w", "a.w" }, bytes = 184, dtype = "f32" },
      { index = 1, params = { "p" }, bytes = 12, dtype = "f32" } }, u.buckets)
    assert.same({ 104, 104 }, u.ddp.bucket_limits)
    assert.equal("Replicate()", u.params[2].placement)
    assert.same({ 10, 4 }, j.rank_view.params["a.w"].local_shape)
    assert.same({ "Replicate()" }, j.rank_view.params["a.w"].placements)
    assert.equal("f32", j.audit[2].reduced)
    assert.equal("replicate", j.audit[2].kind)
  end)
end)

describe("ctx:replicate refuses", function()
  local function refused(fn, mesh) return S.errmsg(plan, fn, mesh) end

  it("a module already in a unit, and a fully_shard of a replicated module", function()
    -- {first call, second call, the error}
    local cases = {
      { "fully_shard", "a", "replicate", "a", "replicate(a): the module is already a fully_shard unit" },
      { "replicate", "a", "replicate", "a", "replicate(a): the module is already a replicate unit" },
      { "replicate", "a", "fully_shard", "a", "fully_shard(a): the module is a replicate unit" },
      { "fully_shard", "a", "replicate", "", "replicate(<root>): parameter a.w is already in the fully_shard unit a" },
    }
    for _, c in ipairs(cases) do
      S.assert_has(refused(function(ctx)
        ctx[c[1]](ctx, c[2])
        ctx[c[3]](ctx, c[4] == "" and ctx.model or c[4])
      end), c[5])
    end
  end)

  it("options it does not take, or of the wrong type", function()
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { bucket_cap = 1 }) end),
      "replicate(<root>): unknown option 'bucket_cap' (options: mesh, bucket_cap_mb")
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { bucket_cap_mb = 0 }) end),
      "replicate(<root>): bucket_cap_mb is 0; expected a number of MiB > 0")
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { bucket_cap_mb = "25" }) end),
      "bucket_cap_mb is 25; expected a number")
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { find_unused_parameters = 1 }) end),
      "replicate(<root>): find_unused_parameters is 1; expected true or false")
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { mesh = { "dp_replicate", "dp_shard" } }) end),
      "replicate(<root>): mesh has 2 axes; a replicate unit takes one axis")
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, "fast") end),
      "replicate(<root>): the options are a string; expected a table")
  end)

  it("a mesh that leaves replicas unreduced", function()
    S.assert_has(refused(function(ctx) ctx:replicate(ctx.model, { mesh = "dp_replicate" }) end,
      "dp_replicate=2,dp_shard=2"), "unit <root> reduces the gradient of p over 2 ranks (mesh {dp_replicate})")
  end)

  it("expert- and tensor-parallel parameters (DDP takes neither)", function()
    local t = module.new("M")
    local e = t:add("experts", module.new("GroupedExperts"))
    e:param("w", { 4, 2, 2 }, "f32")
    local msg = S.errmsg(planner.plan, t, mesh_context.new("dp_shard=2,ep=2"), { parallelize = function(ctx)
      ctx:expert_parallel("experts")
      ctx:replicate(ctx.model)
    end })
    S.assert_has(msg, "replicate(<root>): parameter experts.w is placed by expert parallelism; DDP takes none")
  end)
end)

describe("policies/ddp.lua", function()
  it("is Automodel's DDP manager: the whole model one replicate unit over dp_shard", function()
    local p = planner.plan(models.from_config("tests/reference/configs/llama_tiny.json", "spec"),
      mesh_context.new("dp_shard=4"), policy.load(DDP).main)
    assert.equal(1, #p.units)
    assert.same({ "", "replicate", "dp_shard" }, { p.units[1].name, p.units[1].kind, p.units[1].mesh_axes[1] })
    assert.equal(p.model.params, p.units[1].numel)
  end)

  it("declares Automodel's DDPConfig defaults as its options, and warns of what it does not count", function()
    local d = {}
    for _, o in ipairs(planner.declared_options(policy.load(DDP).main)) do
      d[o.name] = o.default == nil and "none" or o.default
    end
    assert.same({ bucket_cap_mb = "none", find_unused_parameters = false, gradient_as_bucket_view = false,
      static_graph = false, broadcast_buffers = false, activation_checkpointing = false }, d)
    local p = planner.plan(models.from_config("tests/reference/configs/llama_tiny.json", "spec"),
      mesh_context.new("dp_shard=2"), policy.load(DDP).main, { set = { "broadcast_buffers=true" } })
    S.assert_has(table.concat(p.warnings, "\n"), "broadcast_buffers: DDP broadcasts the module's buffers")
  end)

  it("refuses what Automodel's DDPConfig does not take", function()
    for _, mesh in ipairs({ "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "pp=2,dp_shard=2", "dp_shard=2,cp=2" }) do
      local msg = S.errmsg(planner.plan, models.from_config("tests/reference/configs/llama_tiny.json", "spec"),
        mesh_context.new(mesh), policy.load(DDP).main)
      S.assert_has(msg, "DDP replicates the model over the data-parallel ranks only")
    end
  end)

  it("plans from the command line", function()
    local r = S.run({ "plan", "--config", "tests/reference/configs/llama_tiny.json", "--mesh", "dp_shard=2",
      "--policy", DDP, "--set", "bucket_cap_mb=0.002" })
    assert.equal(0, r.code, r.err)
    S.assert_has(r.out, "replicate unit <root> (DDP) over dp_shard=2: 13 buckets")
  end)
end)

describe("a materialised replicate unit", function()
  -- tests/lua/scripts/ddp_units.lua: f32 and bf16 parameters, buckets of at most 104 bytes;
  -- every rank checks its whole parameters, the mean of the gradients, one all_reduce per
  -- bucket, AdamW's step and the bytes it allocated
  for _, case in ipairs({ { 4, "dp_shard=4" }, { 2, "dp_shard=2" }, { 1, "dp_shard=1" }, { 4, "dp_shard=4", "frozen" },
    { 4, "dp_replicate=2,dp_shard=2" } }) do
    local n, mesh, extra = case[1], case[2], case[3]
    it("runs on " .. mesh .. (extra and " with a frozen parameter" or ""), function()
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/ddp_units.lua", mesh, "0.0001", extra })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        assert.matches("rank " .. rank .. ": replicate ok %(3 buckets, gradient max diff 0,", r.out)
      end
    end)
  end
end)
