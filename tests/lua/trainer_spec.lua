-- trainer_spec.lua: moe_trainer (examples/moe_trainer/main.c) run for real: N-rank runs
-- against the 1-rank run under the all-fp32 policy (losses and saved parameters), the
-- inkling2 precision audited from the runtime's own records of the collectives, an edited
-- fp32_modules.lua changing those collectives with nothing rebuilt, the bytes every rank
-- allocated against the planner's figures, and usage errors by their message.
local S = require "support"

local TS = require "trainer_support"
local trainer, write_file, losses, records = TS.trainer, S.write_file, TS.losses, TS.records
local SMALL, small_config, parity = TS.SMALL, TS.small_config, TS.parity
local TRAINER, read_params = TS.TRAINER, TS.read_params

describe("moe_trainer", function()
  it("trains the same model on 1 rank, FSDP over 4, HSDP 2x2 and with expert parallelism, all-fp32 policy", function()
    parity("clipped at 1.0", {}, {
      { n = 1, mesh = "dp_shard=1" },
      { n = 4, mesh = "dp_shard=4", loss = 6.1e-8, param = 4.9e-6, loose = 1 },
      { n = 4, mesh = "dp_replicate=2,dp_shard=2", loss = 4.3e-8, param = 4.9e-6, loose = 2 },
      { n = 4, mesh = "dp_shard=4,ep=2", loss = 5.7e-8, param = 3.0e-6, loose = 2 },
      { n = 4, mesh = "dp_shard=4,ep=4", loss = 5.1e-8, param = 7.2e-7, loose = 0 },
      { n = 4, mesh = "dp_replicate=2,dp_shard=2,ep=2", loss = 7.6e-8, param = 3.0e-6, loose = 2 },
    })
  end)

  it("keeps the gradients' scale: the same parity without clipping and with an eps AdamW feels", function()
    -- Clipping (the gradient norm is above 1.0 at every step) and AdamW (m / sqrt(v) is
    -- nearly scale-free) would hide a wrong divide factor; with no clipping and eps = 1e-3,
    -- near the gradients' own size, a gradient twice too large moves every parameter.
    parity("no clipping, eps 1e-3", { "--max-norm", "0", "--eps", "1e-3" }, {
      { n = 1, mesh = "dp_shard=1" },
      { n = 4, mesh = "dp_shard=4", loss = 5.6e-8, param = 1.2e-7, loose = 0 },
      { n = 4, mesh = "dp_replicate=2,dp_shard=2", loss = 5.6e-8, param = 1.2e-7, loose = 0 },
      { n = 4, mesh = "dp_shard=4,ep=2", loss = 5.6e-8, param = 1.2e-7, loose = 0 },
    })
  end)

  -- The inkling2 run: 200 steps on dp_shard=4 (50 under TS.QUICK), its step-1 records kept
  -- for the edit below.
  local inkling2
  local function fp32_island(unit, entries)
    local name = unit:gsub("%._checkpoint_wrapped_module", "")
    for _, e in ipairs(entries) do
      if name == e or name:sub(-(#e + 1)) == "." .. e then return true end
    end
    return false
  end

  it("gathers the FP32 islands in f32 and the rest in bf16, reduces in f32, and the loss falls", function()
    -- TS.QUICK: 50 steps (measured: step 1 5.966, 50 2.796, 100 2.401, 200 1.996)
    local N = TS.QUICK and 50 or 200
    local r = trainer({ "-n", "4", "--mesh", "dp_shard=4", "--policy", "policies/inkling2", "--steps", tostring(N),
      "--seed", "7", "--config", small_config, "--records" })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    inkling2 = records(r.out)
    local entries = dofile("policies/inkling2/fp32_modules.lua")
    local islands, layers, others = 0, 0, 0
    for unit, recs in pairs(inkling2) do
      local island = fp32_island(unit, entries)
      local kinds = {}
      for _, rec in ipairs(recs) do
        kinds[rec.kind] = true
        assert.equal(4, rec.n)
        local want = (island or rec.kind ~= "all_gather") and "f32" or "bf16"
        assert.equal(want, rec.dtype, unit .. " " .. rec.kind)
      end
      assert.is_true(kinds.all_gather and kinds.reduce_scatter, unit .. " gathered and reduced")
      if island then islands = islands + 1
      elseif unit:match("^model%.layers%.%d+$") then layers = layers + 1
      else others = others + 1 end
    end
    -- per layer mlp_query and mlp.gate; output_query; the two layers; embed_tokens, lm_head, root
    assert.same({ 5, 2, 3 }, { islands, layers, others })
    local l = losses(r.out)
    assert.equal(N, #l)
    io.stderr:write(string.format("\n  inkling2 loss: step 1 %.4f, 50 %.4f, %d %.4f\n", l[1], l[50], N, l[N]))
    assert.is_true(l[N] < l[1] - 2, string.format("loss %g at step 1, %g at step %d", l[1], l[N], N))
  end)

  it("follows an edited fp32_modules.lua on the next run, with nothing rebuilt", function()
    assert.is_truthy(inkling2, "the inkling2 run above")
    local dir = os.tmpname()
    os.remove(dir)
    local copied = os.execute("cp -r policies/inkling2 " .. S.quote(dir))
    assert.is_true(copied == true or copied == 0) -- Lua 5.4 or LuaJIT
    local path = dir .. "/fp32_modules.lua"
    local f = assert(io.open(path))
    local text, removed = f:read("a"):gsub('\n%s*"mlp%.gate",[^\n]*', "")
    f:close()
    assert.equal(1, removed)
    write_file(path, text)
    local r = trainer({ "-n", "4", "--mesh", "dp_shard=4", "--policy", dir, "--steps", "1", "--seed", "7",
      "--config", small_config, "--records" })
    os.execute("rm -rf " .. S.quote(dir))
    assert.equal("", r.err)
    assert.equal(0, r.code)
    local edited = records(r.out)
    -- The gate is no island now: its unit is gone, and each layer's unit gathers its weight
    -- (E, H) and bias (E) in bf16, one padded row each per rank, and reduces the weight in f32.
    local W, E, H = 4, SMALL.num_experts, SMALL.hidden_size
    local rows = math.ceil(E / W)
    for unit, recs in pairs(inkling2) do
      if unit:match("%.mlp%.gate$") then
        assert.is_nil(edited[unit], unit .. " is still a unit")
      else
        local layer = unit:match("^model%.layers%.%d+$")
        for i, rec in ipairs(recs) do
          local got = edited[unit][i]
          assert.same({ rec.kind, rec.dtype }, { got.kind, got.dtype })
          local grow = 0
          if layer and rec.kind == "all_gather" then grow = W * rows * (H + 1) * 2 end
          if layer and rec.kind == "reduce_scatter" then grow = W * rows * H * 4 end
          assert.equal(rec.bytes + grow, got.bytes, unit .. " " .. rec.kind .. " bytes")
        end
      end
    end
  end)

  -- TS.quick (the sanitizer builds): one mesh, with experts
  for _, mesh in ipairs(TS.quick({ "dp_shard=4", "dp_shard=4,ep=2", "dp_shard=4,ep=4" }, 2)) do
    it("allocates on every rank what the planner says for parameters, gradients and optimizer state: " .. mesh,
      function()
        local r = trainer({ "-n", "4", "--mesh", mesh, "--policy", "policies/inkling2", "--steps", "1",
          "--seed", "7", "--memory" })
        assert.equal("", r.err)
        assert.equal(0, r.code)
        local seen = 0
        -- allocated: counted where the units' memory is allocated and freed, not from their books
        for rank, cat, alloc, planned, books in
            r.out:gmatch("memory rank (%d+) (%S+) allocated=(%d+) planned=(%d+) books=(%d+)") do
          assert.is_true(tonumber(planned) > 0, cat)
          assert.equal(planned, alloc, string.format("rank %s %s: bytes allocated against planned", rank, cat))
          assert.equal(planned, books, string.format("rank %s %s: the units' books against planned", rank, cat))
          seen = seen + 1
        end
        assert.equal(12, seen)
      end)
  end

  it("runs every plan the planner accepts as planned, and the planner refuses experts left unreduced", function()
    -- experts left to expert parallelism alone: refused with ep_shard = 2 (their replicas'
    -- gradients would be reduced by no one), allocated exactly as planned with ep_shard = 1
    local r = trainer({ "-n", "4", "--mesh", "dp_shard=4,ep=2", "--policy", "tests/lua/policies/ep_alone.lua",
      "--steps", "1", "--seed", "7", "--memory" })
    assert.equal(1, r.code)
    assert.matches("expert parallelism places 4 trainable parameters that no unit shards %(model%.layers%.0%.mlp%.experts" ..
      "%.gate_and_up_projs, .*%), but ep_shard = 2", r.err)
    for _, case in ipairs({ { "dp_shard=4,ep=4", "tests/lua/policies/ep_alone.lua" },
                            { "dp_replicate=2,dp_shard=2,ep=2", "policies/inkling2" },
                            { "dp_shard=4,ep=2", "policies/full_fp32.lua" } }) do
      r = trainer({ "-n", "4", "--mesh", case[1], "--policy", case[2], "--steps", "1", "--seed", "7", "--memory" })
      assert.equal("", r.err)
      local seen = 0
      for rank, cat, alloc, planned, books in
          r.out:gmatch("memory rank (%d+) (%S+) allocated=(%d+) planned=(%d+) books=(%d+)") do
        assert.equal(planned, alloc, string.format("%s %s rank %s %s", case[1], case[2], rank, cat))
        assert.equal(planned, books, string.format("%s %s rank %s %s (books)", case[1], case[2], rank, cat))
        seen = seen + 1
      end
      assert.equal(12, seen)
    end
  end)

  it("keeps each rank's experts on it with expert parallelism: the experts' unit gathers over ep_shard", function()
    -- dp_shard=4, ep=2: experts [0, 2) on ranks 0 and 2, [2, 4) on ranks 1 and 3, each
    -- layer's two expert tensors (2 x H x 2I and 2 x I x H) a bf16 unit over ep_shard = 2.
    local r = trainer({ "-n", "4", "--mesh", "dp_shard=4,ep=2", "--policy", "policies/inkling2", "--steps", "1",
      "--seed", "7", "--records", "--config", small_config })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    local recs = records(r.out)
    local H, I = SMALL.hidden_size, SMALL.expert_dim
    local experts = 2 * (H * 2 * I + I * H)
    for _, l in ipairs({ "0", "1" }) do
      local unit = recs["model.layers." .. l .. "._checkpoint_wrapped_module.mlp.experts"]
      assert.is_truthy(unit, "layer " .. l .. "'s experts unit issued no collective")
      for _, rec in ipairs(unit) do
        assert.equal(2, rec.n)
        assert.equal(rec.kind == "all_gather" and "bf16" or "f32", rec.dtype)
        assert.equal(experts * (rec.kind == "all_gather" and 2 or 4), rec.bytes)
      end
      -- the layer's own unit no longer holds them
      for _, rec in ipairs(recs["model.layers." .. l] or {}) do
        if rec.kind == "all_gather" then assert.is_true(rec.bytes < experts * 2) end
      end
    end
  end)

  describe("errors", function()
    local base = { "--policy", "policies/inkling2", "--steps", "1", "--seed", "1" }
    local function with(extra)
      local args = {}
      for _, a in ipairs(extra) do args[#args + 1] = a end
      for _, a in ipairs(base) do args[#args + 1] = a end
      return args
    end
    local bad_config = write_file(os.tmpname(), "hidden_size = 32\nheads = 4\n")
    local big_config = write_file(os.tmpname(), "# over the cap\nseq_len = 100000000\n")
    local word_config = write_file(os.tmpname(), "seq_len = 32\nnum_layers = two  # a comment\n")
    -- a FIFO no one writes to: opening it for reading would wait forever
    local fifo = os.tmpname()
    os.remove(fifo)
    assert(os.execute("mkfifo " .. S.quote(fifo)))
    local huge_config = write_file(os.tmpname(), "# " .. string.rep("x", 1024 * 1024) .. "\n")
    teardown(function()
      os.remove(fifo)
      os.remove(huge_config)
    end)
    for _, case in ipairs({
      { "no -n", {}, "missing %-n RANKS" },
      { "a mesh of another size", { "-n", "2", "--mesh", "dp_shard=4" }, "%-%-mesh dp_shard=4 has 4 ranks but %-n is 2" },
      { "an ep that does not divide the ranks", { "-n", "4", "--mesh", "dp_shard=4,ep=3" },
        "ep = 3 does not divide the 4 data%-parallel ranks" },
      { "experts that do not split over ep", { "-n", "8", "--mesh", "dp_shard=8,ep=8" },
        "num_experts 4 does not divide over ep = 8" },
      { "cp > 1", { "-n", "4", "--mesh", "dp_shard=2,cp=2" },
        "context parallelism %(cp=2%) is not implemented by moe_trainer; cp may only be 1" },
      { "a size that is no integer", { "-n", "4", "--mesh", "dp_shard=4x" },
        "the size of dp_shard must be an integer 1%.%.64, got '4x'" },
      { "an axis given twice", { "-n", "4", "--mesh", "dp_shard=4,dp_shard=4" }, "axis 'dp_shard' given twice" },
      { "an unknown axis", { "-n", "4", "--mesh", "dp_shard=4,dp=1" }, "unknown axis 'dp'" },
      { "an empty mesh item", { "-n", "4", "--mesh", "dp_shard=4,,ep=2" }, "'' is not AXIS=SIZE" },
      { "dp_replicate without dp_shard", { "-n", "4", "--mesh", "dp_replicate=4" },
        "dp_replicate = 4 needs dp_shard > 1 %(for pure data parallelism use dp_shard=4%)" },
      { "a batch that does not split", { "-n", "3", "--mesh", "dp_shard=3" },
        "batch_size 8 does not divide over the 3 data%-parallel ranks" },
      { "an unknown config key", { "-n", "1", "--mesh", "dp_shard=1", "--config", bad_config }, ":2: unknown key 'heads'" },
      { "a config value over the cap", { "-n", "1", "--mesh", "dp_shard=1", "--config", big_config },
        ":2: seq_len = 100000000 exceeds the limit of 1048576" },
      { "a config value that is no number", { "-n", "1", "--mesh", "dp_shard=1", "--config", word_config },
        ":2: expected 'KEY = N' with N a positive integer, got 'num_layers = two'" },
      { "a --config that is a character device", { "-n", "1", "--mesh", "dp_shard=1", "--config", "/dev/zero" },
        "%-%-config /dev/zero: it is a character device, not a regular file" },
      { "a --config that is a FIFO", { "-n", "1", "--mesh", "dp_shard=1", "--config", fifo },
        "%-%-config " .. fifo:gsub("%p", "%%%0") .. ": it is a FIFO %(named pipe%), not a regular file" },
      { "a --config that is a directory", { "-n", "1", "--mesh", "dp_shard=1", "--config", "." },
        "%-%-config %.: it is a directory" },
      { "a --config over 1 MiB", { "-n", "1", "--mesh", "dp_shard=1", "--config", huge_config },
        "%-%-config " .. huge_config:gsub("%p", "%%%0") .. ": it is 1048579 bytes, more than the limit of 1048576" },
      { "an empty --save", { "-n", "1", "--mesh", "dp_shard=1", "--save", "" }, "%-%-save: expected a file name, got ''" },
      { "an unknown flag", { "-n", "1", "--mesh", "dp_shard=1", "--frobnicate" }, "unexpected argument '%-%-frobnicate'" },
      { "an option given twice", { "-n", "1", "--mesh", "dp_shard=1", "--seed", "2" }, "%-%-seed given twice" },
    }) do
      it("exits 2 on " .. case[1], function()
        local r = trainer(with(case[2]))
        assert.equal(2, r.code)
        assert.matches(case[3], r.err)
        assert.matches("try 'moe_trainer %-%-help'", r.err)
        assert.equal("", r.out) -- refused before any rank trained
      end)
    end

    -- Files that cannot be used: refused before training, without the usage hint.
    local missing_dir = os.tmpname()
    os.remove(missing_dir)
    local short_text = write_file(os.tmpname(), "abc")
    for _, case in ipairs({
      { "--save in a missing directory", { "--save", missing_dir .. "/params.safetensors" },
        "%-%-save " .. missing_dir:gsub("%p", "%%%0") .. "/params.safetensors: cannot create a file in " ..
        missing_dir:gsub("%p", "%%%0") .. ": No such file or directory" },
      { "--save naming a directory", { "--save", "." }, "%-%-save %.: it is a directory, expected a file name" },
      { "--data naming a directory", { "--data", "." }, "dataset: cannot read %.: it is a directory" },
      { "--data naming a character device", { "--data", "/dev/zero" },
        "dataset: cannot read /dev/zero: it is a character device, not a regular file" },
      { "--data naming a FIFO", { "--data", fifo },
        "dataset: cannot read " .. fifo:gsub("%p", "%%%0") .. ": it is a FIFO %(named pipe%), not a regular file" },
      { "a text shorter than a row", { "--data", short_text },
        "dataset: " .. short_text:gsub("%p", "%%%0") .. " has 3 bytes, fewer than seq_len %+ 1 = 65" },
    }) do
      it("exits 2 before training on " .. case[1], function()
        local args = { "-n", "1", "--mesh", "dp_shard=1" }
        for _, a in ipairs(case[2]) do args[#args + 1] = a end
        local r = trainer(with(args))
        assert.equal(2, r.code)
        assert.matches("^moe_trainer: " .. case[3] .. "\n$", r.err)
        assert.equal("", r.out)
      end)
    end

    -- --save FILE: a new directory holding FILE ("old"); after a run, what the directory
    -- lists (nothing but FILE unless a FILE.XXXXXX was left behind) and FILE's text.
    local function save_dir()
      local dir = os.tmpname()
      os.remove(dir)
      local made = os.execute("mkdir " .. S.quote(dir))
      assert.is_true(made == true or made == 0) -- Lua 5.4 or LuaJIT
      return dir, write_file(dir .. "/params.safetensors", "old")
    end
    local function save_dir_state(dir, path)
      local ls = io.popen("ls -A " .. S.quote(dir))
      local listing = ls:read("a")
      ls:close()
      local f = assert(io.open(path, "rb"))
      local text = f:read("a")
      f:close()
      return listing, text
    end
    local save_args = { "--policy", "policies/full_fp32.lua", "--seed", "1", "--config", small_config }

    it("leaves an existing --save file as it was, and nothing beside it, when the run fails", function()
      local dir, path = save_dir()
      local r = trainer({ "-n", "1", "--mesh", "dp_shard=1", "--policy", "no/such/policy", "--steps", "1", "--seed", "1",
        "--save", path })
      local listing, text = save_dir_state(dir, path)
      os.execute("rm -rf " .. S.quote(dir))
      assert.equal(1, r.code)
      assert.matches("rank 0: planning: moonshard io error: policy no/such/policy: No such file or directory", r.err,
        1, true)
      assert.equal("params.safetensors\n", listing)
      assert.equal("old", text)
    end)

    it("leaves no FILE.XXXXXX when killed while training, and a later run saves over FILE", function()
      local dir, path = save_dir()
      -- The shell of io.popen prints its pid and becomes the trainer, which is killed
      -- (SIGKILL: no handler runs) once it has printed step 1 (after the banner's "# "
      -- lines), long before it would save.
      local cmd = { "echo $$; exec", S.quote(TRAINER), "-n", "2", "--mesh", "dp_shard=2", "--steps", "1000000" }
      for _, a in ipairs(save_args) do cmd[#cmd + 1] = S.quote(a) end
      cmd[#cmd + 1] = "--save " .. S.quote(path) .. " 2>/dev/null </dev/null"
      local p = io.popen(table.concat(cmd, " ")) -- run by sh -c
      local pid = p:read("l")
      local first = p:read("l")
      while first and first:match("^# ") do first = p:read("l") end
      if pid and pid:match("^%d+$") then os.execute("kill -KILL " .. pid) end
      p:close()
      local listing, text = save_dir_state(dir, path)
      local args = { "-n", "2", "--mesh", "dp_shard=2", "--steps", "1", "--save", path }
      for _, a in ipairs(save_args) do args[#args + 1] = a end
      local r = trainer(args)
      local listing_after = save_dir_state(dir, path)
      local ok, params = pcall(read_params, path)
      os.execute("rm -rf " .. S.quote(dir))
      assert.matches("^%d+$", pid)
      assert.matches("^step 1 loss ", first)
      assert.equal("params.safetensors\n", listing)
      assert.equal("old", text)
      assert.equal("", r.err)
      assert.equal(0, r.code)
      assert.equal("params.safetensors\n", listing_after)
      assert.is_true(ok, params)
      local names = 0
      for _ in pairs(params) do names = names + 1 end
      assert.equal(24, names)
    end)

    it("removes FILE.XXXXXX and leaves FILE as it was when writing it fails", function()
      local dir, path = save_dir()
      -- Files limited to a few KiB (the parameters take 187 KiB): rank 0's write fails with
      -- EFBIG after the last step (SIGXFSZ ignored, so that it is an error, not a signal).
      local args = { "-c", "trap '' XFSZ; ulimit -f 16; exec \"$0\" \"$@\"", TRAINER, "-n", "1", "--mesh", "dp_shard=1",
        "--steps", "1", "--save", path }
      for _, a in ipairs(save_args) do args[#args + 1] = a end
      local r = S.run_with("sh", args)
      local listing, text = save_dir_state(dir, path)
      os.execute("rm -rf " .. S.quote(dir))
      assert.equal(1, r.code)
      assert.matches("\nstep 1 loss ", r.out)
      assert.matches("rank 0: %-%-save: cannot write " .. path:gsub("%p", "%%%0") .. " %(as [^)]*%): File too large",
        r.err)
      assert.equal("params.safetensors\n", listing)
      assert.equal("old", text)
    end)

    it("accepts pp, cp and tp given as 1", function()
      local r = trainer({ "-n", "2", "--mesh", "pp=1,dp_shard=2,cp=1,tp=1", "--policy", "policies/full_fp32.lua",
        "--steps", "1", "--seed", "1", "--config", small_config })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      assert.matches("\nstep 1 loss %d", r.out)
    end)

    it("exits 1 with the planner's message on a missing policy", function()
      local r = trainer({ "-n", "1", "--mesh", "dp_shard=1", "--policy", "no/such/policy", "--steps", "1", "--seed", "1" })
      assert.equal(1, r.code)
      assert.matches("rank 0: planning: moonshard io error: policy no/such/policy: No such file or directory", r.err,
        1, true)
    end)

    it("tells the truth in --help", function()
      local r = trainer({ "--help" })
      assert.equal(0, r.code)
      assert.matches("usage: moe_trainer %-n RANKS %-%-mesh SPEC %-%-policy PATH %-%-steps N %[%-%-seed S%]", r.out)
      for _, flag in ipairs({ "--config", "--data", "--save", "--records", "--memory" }) do
        assert.matches((flag:gsub("%-", "%%-")), r.out)
      end
    end)
  end)
end)
