-- sweep_spec.lua: `moonshard sweep` on a tiny MoE (qwen3_moe_tiny: 2 layers, 2 heads, 1
-- key/value head, 4 routed experts) over 8 ranks: every layout counted here by brute force,
-- each rejection's rule recomputed here, the ranking against `moonshard plan` for the same
-- layouts, the memory bound below every planned peak, the JSON and CSV, and the usage errors.
local json = require "moonshard.json"
local S = require "support"
local assert_has = S.assert_has

local CONFIG = "tests/reference/configs/qwen3_moe_tiny.json"
local POLICY = "policies/fsdp2_default.lua"
-- a device between the layouts' peaks: some fit, some cannot (bound), some do not (planned)
local DEVICE = S.write_file(os.tmpname() .. ".lua",
  'return { base = "h100-80gb", name = "small", memory_bytes = 1610680000, gpus_per_node = 4 }')

-- checkpointing the only knob swept, unless `extra` names the knobs
local function sweep(extra)
  local args = { "sweep", "--config", CONFIG, "--world", "8", "--device", DEVICE, "--seq-len", "64",
    "--global-batch", "16", "--policy", POLICY }
  local named = false
  for _, a in ipairs(extra or {}) do named = named or a == "--knobs" end
  if not named then
    args[#args + 1] = "--knobs"
    args[#args + 1] = "activation_checkpointing"
  end
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  return S.run(args)
end

local function mesh_text(c)
  local parts = {}
  for _, a in ipairs({ "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep" }) do
    if c[a] ~= 1 then parts[#parts + 1] = a .. "=" .. c[a] end
  end
  return #parts > 0 and table.concat(parts, ",") or "dp_shard=1"
end

-- Every layout by brute force, with the rule it breaks (nil when none), as the rules read
-- for this model: 2 layers, 2 heads, 1 kv head, 4 experts (dims 20 and 12), untied; 64
-- tokens, 16 a step, micro-batch 1; 4 GPUs a node.
local function brute_force(world)
  local out = {}
  for pp = 1, world do for r = 1, world do for d = 1, world do for cp = 1, world do for tp = 1, world do
    if pp * r * d * cp * tp == world then
      local non_pp = r * d * cp * tp
      for ep = 1, non_pp do
        if non_pp % ep == 0 then
          local c = { pp = pp, dp_replicate = r, dp_shard = d, cp = cp, tp = tp, ep = ep }
          local dp = r * d
          local rule
          local ep_shard = non_pp / ep
          if (r > 1 and d == 1) or 4 % ep ~= 0 then rule = "mesh"
          -- the experts' tensors' dim 1 (hidden 20, moe_intermediate 12: gcd 4) over ep_shard
          elseif ep > 1 and ep_shard > 1 and 4 % ep_shard ~= 0 then rule = "experts on ep_shard"
          elseif ep > 1 and tp > 1 then rule = "tp on the MoE path" -- fsdp2_default's tp_plan is auto
          elseif tp > 4 then rule = "tp spans nodes"
          elseif tp > 1 then rule = "tp heads"
          elseif 64 % cp ~= 0 or 16 % dp ~= 0 then rule = "batch"
          elseif pp > 2 or 16 / dp < pp then rule = "pipeline" end
          out[mesh_text(c)] = { sizes = c, rule = rule or false }
        end
      end
    end
  end end end end end
  return out
end

describe("moonshard sweep", function()
  local r = sweep({ "--json" })
  assert.equal(0, r.code, r.err)
  local res = json.decode(r.out, "sweep JSON")
  local by_mesh = {}
  for _, e in ipairs(res.evaluated) do
    by_mesh[e.mesh] = by_mesh[e.mesh] or {}
    table.insert(by_mesh[e.mesh], e)
  end

  it("enumerates every layout and rejects by the rules", function()
    local expected = brute_force(8)
    local n, pass = 0, 0
    for mesh, x in pairs(expected) do
      n = n + 1
      local got = by_mesh[mesh]
      assert.is_truthy(got, mesh)
      if x.rule then
        assert.equal(1, #got, mesh)
        assert.equal(x.rule, got[1].rule, mesh .. ": " .. tostring(got[1].reason))
        assert.equal("rejected", got[1].status)
      else
        pass = pass + 1
        for _, e in ipairs(got) do assert.is_not.equal("mesh", e.rule) end
      end
    end
    for mesh in pairs(by_mesh) do assert.is_truthy(expected[mesh], mesh) end
    assert.equal(n, res.layouts)
    assert.equal(pass, res.rule_survivors)
    assert.equal(119, n) -- counted by hand once: a change to the enumeration shows here too
  end)

  it("names each rule's reason", function()
    local reasons = {}
    for _, e in ipairs(res.evaluated) do if e.rule ~= json.null then reasons[e.rule] = e.reason end end
    assert_has(reasons["mesh"], "")
    assert_has(reasons["tp heads"], "must be divisible by TP size")
    assert_has(reasons["tp spans nodes"], "cross nodes of 4 GPUs")
    assert_has(reasons["tp on the MoE path"], "MoE parallelizer registers no tensor-parallel plan")
    assert_has(reasons["pipeline"], "cannot exceed number of layers (2)")
    assert_has(reasons["cannot fit"], "cannot fit: needs at least")
    assert_has(reasons["cannot fit"], "of 1.5 GiB")
    assert_has(reasons["does not fit"], "does not fit:")
    local rules = {}
    for _, g in ipairs(res.rejected) do rules[g.rule] = (rules[g.rule] or 0) + g.count end
    local counted = {}
    for _, e in ipairs(res.evaluated) do
      if e.status == "rejected" then counted[e.rule] = (counted[e.rule] or 0) + 1 end
    end
    for k, v in pairs(counted) do assert.equal(v, rules[k], k) end
  end)

  it("ranks what fits as moonshard plan plans it, the bound below every peak", function()
    assert.is_true(res.fits >= 3)
    local fits = {}
    for _, e in ipairs(res.evaluated) do
      if e.status == "fits" then fits[e.rank] = e end
      if e.peak_bytes ~= json.null then assert.is_true(e.lower_bound_bytes <= e.peak_bytes, e.mesh) end
      if e.status == "fits" then assert.is_true(e.peak_bytes <= e.capacity_bytes) end
      if e.status == "rejected" and e.rule == "does not fit" then assert.is_true(e.peak_bytes > e.capacity_bytes) end
      if e.rule == "cannot fit" then assert.is_true(e.lower_bound_bytes > res.capacity_bytes) end
    end
    for i = 2, res.fits do assert.is_true(fits[i - 1].tokens_per_s >= fits[i].tokens_per_s) end
    for _, i in ipairs({ 1, 2, res.fits }) do
      local f = fits[i]
      local p = S.run({ "plan", "--config", CONFIG, "--mesh", f.mesh, "--policy", POLICY, "--seq-len", "64",
        "--global-batch", "16", "--device", DEVICE, "--set", "activation_checkpointing=" ..
        tostring(f.activation_checkpointing), "--json" })
      assert.equal(0, p.code, p.err)
      local plan = json.decode(p.out, "plan JSON")
      assert.is_true(math.abs(plan.time.tokens_per_s - f.tokens_per_s) <= 1e-6 * f.tokens_per_s, f.mesh)
      local peak = 0
      for _, pr in ipairs(plan.memory.per_rank) do peak = math.max(peak, pr.peak) end
      assert.equal(peak, f.peak_bytes, f.mesh)
      assert.equal(plan.memory.fit.worst.peak, f.peak_bytes, f.mesh)
      assert.is_true(plan.memory.fit.fits)
    end
  end)

  it("plans with checkpointing as moonshard plan does (each such plan on a tree of its own)", function()
    local j = json.decode(sweep({ "--set", "activation_checkpointing=true", "--json" }).out, "sweep JSON")
    assert.equal(0, #j.knobs)
    local seen = 0
    for _, e in ipairs(j.evaluated) do
      if e.status == "fits" and e.rank <= 3 then
        local p = S.run({ "plan", "--config", CONFIG, "--mesh", e.mesh, "--policy", POLICY, "--seq-len", "64",
          "--global-batch", "16", "--device", DEVICE, "--set", "activation_checkpointing=true", "--json" })
        local plan = json.decode(p.out, "plan JSON")
        assert.equal(plan.memory.fit.worst.peak, e.peak_bytes, e.mesh)
        assert.is_true(math.abs(plan.time.tokens_per_s - e.tokens_per_s) <= 1e-6 * e.tokens_per_s, e.mesh)
        seen = seen + 1
      end
    end
    assert.equal(3, seen)
  end)

  it("stops at --max-plans and says how many were left", function()
    local t = sweep({ "--max-plans", "3", "--top", "2" })
    assert.equal(0, t.code, t.err)
    assert_has(t.out, "3 planned (at most 3)")
    assert_has(t.out, "left unplanned")
    assert_has(t.out, "unplanned: past --max-plans 3")
    local j = json.decode(sweep({ "--max-plans", "3", "--json" }).out, "sweep JSON")
    assert.equal(3, j.planned)
    assert.is_true(j.unplanned > 0)
    local n = 0
    for _, e in ipairs(j.evaluated) do if e.status == "unplanned" then n = n + 1 end end
    assert.equal(j.unplanned, n)
  end)

  it("writes the table and CSV", function()
    local t = sweep()
    assert.equal(0, t.code, t.err)
    assert_has(t.out, "119 layouts")
    assert_has(t.out, "tokens/s")
    assert_has(t.out, "rejected:")
    local c = sweep({ "--csv" })
    assert.equal(0, c.code, c.err)
    local lines = {}
    for line in c.out:gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.equal("mesh,pp,dp_replicate,dp_shard,cp,tp,ep,activation_checkpointing,reshard_after_forward," ..
      "offload_policy,prefetch_explicit,pack_islands,status,rank,tokens_per_s,step_s,mfu,peak_bytes,capacity_bytes," ..
      "lower_bound_bytes,estimate_s,plan_s,rule,reason", lines[1])
    assert.equal(#res.evaluated + 1, #lines)
    for i = 2, #lines do
      local fields = select(2, lines[i]:gsub('"[^"]*"', "x"):gsub(",", ","))
      assert.equal(23, fields, lines[i])
    end
  end)

  it("sweeps the policy's knobs, keeping only the fits no other fit on the same mesh dominates", function()
    local r = sweep({ "--knobs", "activation_checkpointing,reshard_after_forward,offload_policy", "--json",
      "--max-plans", "60" })
    assert.equal(0, r.code, r.err)
    local j = json.decode(r.out, "sweep JSON")
    assert.same({ "activation_checkpointing", "reshard_after_forward", "offload_policy" }, j.knobs)
    local savers = function(e)
      local n = {}
      if e.activation_checkpointing == true then n.ac = true end
      if e.reshard_after_forward == true then n.reshard = true end
      if e.offload_policy == "cpu" then n.offload = true end
      return n
    end
    local function subset(a, b) -- a's savers a strict subset of b's
      local fewer = false
      for k in pairs(a) do if not b[k] then return false end end
      for k in pairs(b) do if not a[k] then fewer = true end end
      return fewer
    end
    local fits, dominated = {}, 0
    for _, e in ipairs(j.evaluated) do
      if e.status == "fits" then fits[#fits + 1] = e end
      if e.rule == "dominated" then dominated = dominated + 1 end
    end
    assert.is_true(#fits > 0)
    for _, a in ipairs(fits) do
      for _, b in ipairs(fits) do
        if a ~= b and a.mesh == b.mesh then
          assert.is_false(subset(savers(b), savers(a)), a.mesh)
          -- nor, between knob sets neither of which saves less, one no faster and no smaller
          if not subset(savers(a), savers(b)) then
            assert.is_false(b.tokens_per_s >= a.tokens_per_s and b.peak_bytes <= a.peak_bytes, a.mesh)
          end
        end
      end
    end
    -- 2 x 2 x 2 knob values for each layout the bound lets through (a value that cannot fit,
    -- one keeping the state on the device, is rejected before planning)
    local with_knobs = 0
    for _, e in ipairs(j.evaluated) do if e.activation_checkpointing ~= json.null then with_knobs = with_knobs + 1 end end
    assert.equal(0, with_knobs % 8)
    assert.is_true(with_knobs >= j.candidates)
    assert.is_true(dominated > 0)
    local every = sweep({ "--set", "activation_checkpointing=maybe" })
    assert.equal(1, every.code)
    assert_has(every.err, "every plan the sweep made failed; the first: checkpoint_wrap(model.layers): 'maybe'")
    local bad = sweep({ "--knobs", "prefetch" })
    assert.equal(2, bad.code)
    assert_has(bad.err, "--knobs: unknown knob 'prefetch' (knobs: activation_checkpointing, reshard_after_forward, " ..
      "offload_policy, prefetch.explicit, pack_islands; or none)")
    local undeclared = sweep({ "--knobs", "pack_islands" })
    assert.equal(1, undeclared.code)
    assert_has(undeclared.err, "--knobs pack_islands: policy " .. POLICY .. " does not declare that option (its " ..
      "options: activation_checkpointing, ")
  end)

  it("sweeps pack_islands when --knobs names it: each packed fit as moonshard plan --set pack_islands=true plans it",
    function()
      local cfg, policy = "examples/configs/inkling2_small.json", "policies/inkling2"
      local common = { "--device", "h100-80gb", "--seq-len", "256", "--global-batch", "16", "--policy", policy }
      local args = { "sweep", "--config", cfg, "--world", "8", "--knobs", "pack_islands", "--max-plans", "24",
        "--json" }
      for _, a in ipairs(common) do args[#args + 1] = a end
      local r = S.run(args)
      assert.equal(0, r.code, r.err)
      local j = json.decode(r.out, "sweep JSON")
      assert.same({ "pack_islands" }, j.knobs)
      local by_mesh, checked = {}, 0
      for _, e in ipairs(j.evaluated) do
        if e.status == "fits" or e.rule == "dominated" then
          assert.is_true(e.pack_islands == true or e.pack_islands == "default", e.mesh)
          by_mesh[e.mesh] = by_mesh[e.mesh] or {}
          by_mesh[e.mesh][tostring(e.pack_islands)] = e
        end
      end
      for mesh, pair in pairs(by_mesh) do
        local packed, separate = pair["true"], pair["default"]
        if packed and separate and packed.tokens_per_s and separate.tokens_per_s and checked < 2 then
          -- inkling2_small's islands are latency bound: packing is faster, as the plan says
          assert.is_true(packed.tokens_per_s > separate.tokens_per_s, mesh)
          for _, e in ipairs({ packed, separate }) do
            local p = { "plan", "--config", cfg, "--mesh", mesh, "--json" }
            for _, a in ipairs(common) do p[#p + 1] = a end
            if e == packed then p[#p + 1] = "--set" p[#p + 1] = "pack_islands=true" end
            local plan = json.decode(S.run(p).out, "plan JSON")
            assert.equal(e == packed, plan.comm.packing ~= nil and plan.comm.packing.units > 0, mesh)
            assert.equal(plan.memory.fit.worst.peak, e.peak_bytes, mesh)
            -- the plan's JSON writes 6 significant digits
            assert.is_true(math.abs(plan.time.tokens_per_s - e.tokens_per_s) <= 5e-6 * e.tokens_per_s, mesh)
          end
          checked = checked + 1
        end
      end
      assert.equal(2, checked)
    end)

  it("refuses bad usage, naming what was wrong", function()
    local function usage(args, part)
      local u = S.run(args)
      assert.equal(2, u.code, u.err)
      assert_has(u.err, part)
    end
    local base = { "sweep", "--config", CONFIG, "--device", "h100-80gb", "--seq-len", "64", "--global-batch", "16",
      "--policy", POLICY }
    usage(base, "--world is required")
    local function with(...)
      local a = {}
      for _, v in ipairs(base) do a[#a + 1] = v end
      for _, v in ipairs({ ... }) do a[#a + 1] = v end
      return a
    end
    usage(with("--world", "0"), "--world is the number of ranks, a whole number from 1 to 2147483647, not '0'")
    usage(with("--world", "8", "--top", "x"), "--top is a whole number from 1 to 1000000, not 'x'")
    usage(with("--world", "8", "--json", "--csv"), "--json and --csv: give one")
    usage(with("--world", "8", "--bogus"), "unknown option '--bogus'")
    usage({ "sweep", "--config", CONFIG, "--world", "8", "--device", "h1000", "--seq-len", "64", "--global-batch",
      "16", "--policy", POLICY }, "--device 'h1000' is no device profile; expected one of h100-80gb")
    local h = S.run({ "sweep", "--help" })
    assert.equal(0, h.code)
    assert_has(h.out, "usage: moonshard sweep")
  end)
end)
