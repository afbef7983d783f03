-- trainer_ckpt_spec.lua: moe_trainer's checkpoints (--save-dir, --save-every, --keep-last,
-- --resume, --init-from; examples/moe_trainer/save.c over the embedding API's
-- ms_interp_checkpoint_*): a run of 8 steps against the same run resumed from its step-4
-- checkpoint on the same mesh (bit for bit) and on others (within the trainer's parity
-- figures), --init-from an export of a checkpoint, a save killed with SIGKILL, keep-last
-- pruning and the errors by their message.
local S = require "support"
local TS = require "trainer_support"
local trainer, losses, read_params, small_config = TS.trainer, TS.losses, TS.read_params, TS.small_config
local ok_run = TS.run_ok

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  os.execute("mkdir -p " .. S.quote(d))
  return d
end

local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("a")
  p:close()
  return out
end

-- the schedule moves every step (warm-up, then cosine), so a resumed run must continue it
local COMMON = { "--policy", "policies/full_fp32.lua", "--seed", "7", "--config", small_config, "--steps", "8",
  "--warmup-steps", "2", "--min-lr", "1e-3" }

local function args(n, mesh, extra)
  local a = { "-n", tostring(n), "--mesh", mesh }
  for _, x in ipairs(COMMON) do a[#a + 1] = x end
  for _, x in ipairs(extra) do a[#a + 1] = x end
  return a
end

local function step_lines(out)
  local t = {}
  for line in out:gmatch("[^\n]+") do
    if line:match("^step ") then t[#t + 1] = (line:gsub(" time_ms .*$", "")) end
  end
  return t
end

describe("moe_trainer checkpoints", function()
  local root = tmpdir()
  local ckpts = root .. "/ck"
  local ref -- the uninterrupted run on dp_shard=4: {out, losses, params}

  setup(function()
    local save = root .. "/ref.safetensors"
    local r = ok_run(args(4, "dp_shard=4", { "--save-dir", ckpts, "--save-every", "4", "--save", save }))
    ref = { out = r.out, losses = losses(r.out), params = read_params(save) }
  end)

  teardown(function() os.execute("rm -rf " .. S.quote(root)) end)

  it("resumes on the same mesh bit for bit: the losses, lr, grad norms and saved parameters", function()
    assert.equal("latest\nstep_00000004\nstep_00000008\n", sh("ls " .. S.quote(ckpts)))
    local save = root .. "/same.safetensors"
    local r = ok_run(args(4, "dp_shard=4", { "--resume", ckpts .. "/step_00000004", "--save", save }))
    assert.matches("# resume: .-step_00000004 at step 4 %(saved on mesh dp_shard=4, world 4; its lr [%d.e-]+%): steps 5..8",
      r.out)
    local want, got = step_lines(ref.out), step_lines(r.out)
    assert.equal(8, #want)
    assert.same({ want[5], want[6], want[7], want[8] }, got)
    local params = read_params(save)
    for name, t in pairs(ref.params) do assert.equal(t.raw, params[name].raw, name) end
  end)

  it("resumes on other meshes (dp_shard=2, HSDP 2x2, 1 rank, ep=2, tp=2) within the trainer's parity figures", function()
    -- stated for dp_shard=4 against 1 rank over 20 steps (trainer_spec.lua, README.md): loss
    -- 6.1e-8 relative, parameters 4.9e-6, 1 element past 1e-6; held to twice them, as there
    for _, case in ipairs({ { 2, "dp_shard=2" }, { 4, "dp_replicate=2,dp_shard=2" }, { 1, "dp_shard=1" },
      { 2, "dp_shard=2,ep=2" }, { 2, "tp=2" }, { 4, "dp_shard=2,tp=2" } }) do
      local save = root .. "/other.safetensors"
      local r = ok_run(args(case[1], case[2], { "--resume", ckpts .. "/step_00000004", "--save", save }))
      local run = { losses = losses(r.out), params = read_params(save) }
      local loss_diff = 0
      for k = 5, 8 do loss_diff = math.max(loss_diff, math.abs(run.losses[k] - ref.losses[k]) / ref.losses[k]) end
      assert.is_nil(run.losses[4])
      local max_diff, where, loose, count = 0, nil, 0, 0
      for name, t in pairs(ref.params) do
        for j, v in ipairs(t.values) do
          local d = math.abs(v - run.params[name].values[j])
          if d > max_diff then max_diff, where = d, name end
          if d > 1e-6 then loose = loose + 1 end
          count = count + 1
        end
      end
      io.stderr:write(string.format("\n  resume dp_shard=4 step 4 -> %s: loss max rel diff %.3g, parameter max abs " ..
        "diff %.3g (%s), %d of %d elements past 1e-6\n", case[2], loss_diff, max_diff, tostring(where), loose, count))
      assert.equal(47816, count)
      assert.is_true(loss_diff <= 2 * 6.1e-8, case[2] .. ": loss " .. loss_diff)
      assert.is_true(max_diff <= 2 * 4.9e-6, case[2] .. ": parameter " .. max_diff)
      assert.is_true(loose <= 4, case[2] .. ": " .. loose .. " loose elements")
    end
  end)

  it("checkpoints tensor-parallel runs: saved on tp=2, resumed on tp=2 bit for bit", function()
    local d = root .. "/tp"
    local full, res = root .. "/tp_full.safetensors", root .. "/tp_res.safetensors"
    local a = args(2, "tp=2", { "--save-dir", d, "--save-every", "4", "--save", full })
    local r1 = ok_run(a)
    local r2 = ok_run(args(2, "tp=2", { "--resume", d .. "/step_00000004", "--save", res }))
    local want, got = step_lines(r1.out), step_lines(r2.out)
    assert.same({ want[5], want[6], want[7], want[8] }, got)
    local p1, p2 = read_params(full), read_params(res)
    for name, t in pairs(p1) do assert.equal(t.raw, p2[name].raw, name) end
  end)

  it("--init-from an export of a checkpoint gives the checkpoint's parameters bit for bit, on any mesh", function()
    local hf = root .. "/hf"
    local r = S.run({ "checkpoint", "export", ckpts, "--to", hf })
    assert.equal(0, r.code)
    for _, case in ipairs({ { 2, "dp_shard=2,ep=2" }, { 2, "tp=2" }, { 4, "dp_shard=2,tp=2" } }) do
      local save = root .. "/init.safetensors"
      local a = { "-n", tostring(case[1]), "--mesh", case[2], "--policy", "policies/full_fp32.lua", "--seed", "7",
        "--config", small_config, "--steps", "0", "--init-from", hf, "--save", save }
      r = ok_run(a)
      assert.matches("# init: the parameters from " .. hf:gsub("%p", "%%%0"), r.out)
      local params = read_params(save)
      for name, t in pairs(ref.params) do assert.equal(t.raw, params[name].raw, case[2] .. ": " .. name) end
    end
  end)

  it("keeps the newest --keep-last checkpoints, and a save killed with SIGKILL leaves the previous one resumable", function()
    local kdir = root .. "/killed"
    local a = args(2, "dp_shard=2", { "--save-dir", kdir, "--save-every", "1", "--keep-last", "2" })
    for i, x in ipairs(a) do if x == "8" and a[i - 1] == "--steps" then a[i] = "100000" end end
    local quoted = {}
    for i, x in ipairs(a) do quoted[i] = S.quote(x) end
    local out = sh(string.format([[
      %s %s >/dev/null 2>&1 & pid=$!
      seen=0
      for i in $(seq 1 4000); do
        if [ -f %s/latest ] && ls -d %s/.tmp-* >/dev/null 2>&1; then seen=1; break; fi
        sleep 0.002
      done
      kill -9 $pid; wait $pid; echo "killed $? seen $seen"]], S.quote(TS.TRAINER), table.concat(quoted, " "),
      S.quote(kdir), S.quote(kdir)))
    assert.matches("killed 137", out)
    io.stderr:write("\n  kill -9 of a trainer saving every step: " .. out:match("seen %d") .. " (1: killed while a " ..
      ".tmp- directory was being written)\n")
    -- at most the newest two whole checkpoints (keep-last 2; a third only between a save and its pruning)
    local listing = sh("ls " .. S.quote(kdir))
    local whole = 0
    for _ in listing:gmatch("step_%d+") do whole = whole + 1 end
    assert.is_true(whole >= 1 and whole <= 3, listing)
    local r = S.run({ "checkpoint", "verify", kdir })
    assert.equal(0, r.code)
    local latest = tonumber(S.read_file(kdir .. "/latest"):match("step_(%d+)"))
    local b = args(2, "dp_shard=2", { "--resume", kdir })
    for i, x in ipairs(b) do if x == "8" and b[i - 1] == "--steps" then b[i] = tostring(latest + 2) end end
    r = ok_run(b)
    assert.matches(string.format("steps %d..%d run here", latest + 1, latest + 2), r.out)
    assert.equal(2, #step_lines(r.out))
    -- keep-last alone: 5 steps saved every step, keep 2
    local kept = root .. "/kept"
    local c = args(2, "dp_shard=2", { "--save-dir", kept, "--save-every", "1", "--keep-last", "2" })
    for i, x in ipairs(c) do if x == "8" and c[i - 1] == "--steps" then c[i] = "5" end end
    ok_run(c)
    assert.equal("latest\nstep_00000004\nstep_00000005\n", sh("ls " .. S.quote(kept)))
    assert.equal("step_00000005\n", S.read_file(kept .. "/latest"))
  end)

  it("names what is wrong: a missing directory, another model, another seed, a step past --steps", function()
    local r = trainer(args(2, "dp_shard=2", { "--resume", root .. "/no_such_dir" }))
    assert.equal(2, r.code)
    assert.matches("--resume .-no_such_dir: No such file or directory", r.err)
    r = trainer(args(2, "dp_shard=2", { "--resume", root }))
    assert.equal(2, r.code)
    assert.matches("no checkpoint there %(neither checkpoint.json nor latest%)", r.err)
    r = trainer(args(2, "dp_shard=2", { "--resume", small_config }))
    assert.equal(2, r.code)
    assert.matches("a file; %-%-resume takes a checkpoint directory", r.err)
    local big = S.write_file(os.tmpname(), "hidden_size = 48\nexpert_dim = 32\nseq_len = 32\nnum_experts = 4\n")
    local a = args(2, "dp_shard=2", { "--resume", ckpts })
    for i, x in ipairs(a) do if a[i - 1] == "--config" then a[i] = big end end
    r = trainer(a)
    os.remove(big)
    assert.equal(1, r.code)
    assert.matches("the checkpoint's model differs from this run's: hidden_size 32 %(this run 48%)", r.err)
    a = args(2, "dp_shard=2", { "--resume", ckpts })
    for i, x in ipairs(a) do if a[i - 1] == "--seed" then a[i] = "8" end end
    r = trainer(a)
    assert.equal(1, r.code)
    assert.matches("trained with %-%-seed 7, this run has %-%-seed 8", r.err)
    a = args(2, "dp_shard=2", { "--resume", ckpts })
    for i, x in ipairs(a) do if a[i - 1] == "--steps" then a[i] = "6" end end
    r = trainer(a)
    assert.equal(1, r.code)
    assert.matches("at step 8, past %-%-steps 6", r.err)
    r = trainer(args(2, "dp_shard=2", { "--init-from", ckpts }))
    assert.equal(1, r.code)
    assert.matches("is a moonshard checkpoint %(it holds latest%), not a Hugging Face one: load it with checkpoint.load " ..
      "%(the trainer's %-%-resume%), or export it first", r.err)
    r = trainer(args(2, "dp_shard=2", { "--resume", ckpts, "--init-from", ckpts }))
    assert.equal(2, r.code)
    assert.matches("give one", r.err)
    r = trainer(args(2, "dp_shard=2", { "--keep-last", "2" }))
    assert.equal(2, r.code)
    assert.matches("%-%-keep%-last is for %-%-save%-dir", r.err)
  end)

  it("--save-dir: made with its parents, refused before training when it cannot be made or holds another run's " ..
    "checkpoints; a resumed run at the last step runs none and says so", function()
    local deep = root .. "/x/y/z"
    local r = ok_run(args(1, "dp_shard=1", { "--save-dir", deep, "--save-every", "4" }))
    assert.matches("# saved: " .. deep:gsub("%p", "%%%0") .. "/step_00000004 %(step 4%) in [%d.]+ s", r.out)
    assert.equal("latest\nstep_00000004\nstep_00000008\n", sh("ls " .. S.quote(deep)))
    -- a fresh run into it: refused, exit 2, before any step
    r = trainer(args(1, "dp_shard=1", { "--save-dir", deep }))
    assert.equal(2, r.code)
    assert.matches("holds 2 checkpoints %(step_00000004 %.%. step_00000008%) of another run", r.err)
    assert.is_nil(r.out:match("\nstep "))
    -- resumed at step 4 into it: step 8 is past its step, refused
    r = trainer(args(1, "dp_shard=1", { "--resume", deep .. "/step_00000004", "--save-dir", deep }))
    assert.equal(1, r.code)
    assert.matches("holds 1 checkpoint past step 4, where this run resumes %(step_00000008%)", r.err)
    -- resumed from its latest (step 8 = --steps): nothing to run, nothing saved
    r = ok_run(args(1, "dp_shard=1", { "--resume", deep, "--save-dir", deep }))
    assert.matches("%-%-steps 8 is the total, so no step runs here", r.out)
    assert.matches("# checkpoints: .-: none %(no step runs here%)", r.out)
    assert.matches("# done: 0 steps", r.out)
    -- another batch size: a note
    local cfg = S.write_file(os.tmpname(), S.read_file(small_config) .. "\nbatch_size = 4\n")
    local a = args(1, "dp_shard=1", { "--resume", deep .. "/step_00000004" })
    for i in ipairs(a) do if a[i - 1] == "--config" then a[i] = cfg end end
    r = ok_run(a)
    os.remove(cfg)
    assert.matches("# resume: note: the saved run drew its batches from .- %(batch_size 8%); this run's .- %(batch_size 4%)",
      r.out)
    -- a file where the directory should go, and a path under a file
    r = trainer(args(1, "dp_shard=1", { "--save-dir", small_config .. "/sub" }))
    assert.equal(2, r.code)
    assert.matches("%-%-save%-dir .-/sub: cannot make it: Not a directory", r.err)
  end)
end)
