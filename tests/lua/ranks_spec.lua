-- ranks_spec.lua: the moonshard executable running SPMD scripts on ranks as threads:
-- collectives checked on every rank, failures reported once per rank, no hangs.
local S = require "support"

local function busy_wait(seconds)
  return string.format("local t = os.time(); while os.time() - t < %d do end", seconds)
end

describe("moonshard -n N", function()
  for _, n in ipairs({ 1, 2, 3, 4 }) do
    it("checks every collective, dtype and op on every one of " .. n .. " ranks", function()
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/collectives.lua" })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do
        assert.matches("rank " .. rank .. ": %d+ checks ok", r.out)
      end
    end)
  end

  it("gives each rank its rank, the world size, the backend and its arguments", function()
    local r = S.run({ "-n", "3", "-e", "print(require('moonshard').rank(), require('moonshard').world_size(), " ..
      "require('moonshard').backend(), ...)", "x", "y" })
    assert.equal(0, r.code)
    for rank = 0, 2 do assert.matches(rank .. "\t3\tthreads\tx\ty\n", r.out, 1, true) end
  end)

  it("prints one failing rank's error once, prefixed by the rank, and exits 1", function()
    local r = S.run_code(4, [[
      local ms = require "moonshard"
      if ms.rank() == 2 then error("boom on purpose") end
    ]])
    assert.equal(1, r.code)
    assert.matches("%[rank 2%] %(command line%):2: boom on purpose", r.err)
    assert.matches("%[rank 2%] stack traceback:", r.err)
    local _, count = r.err:gsub("boom on purpose", "")
    assert.equal(1, count)
  end)

  it("prints the rank that failed first, before the ranks that failed because of it", function()
    local r = S.run_code(3, [[
      local ms = require "moonshard"
      if ms.rank() == 2 then error("rank two is broken") end
      ms.mesh({{"w", 3}}):group("w"):barrier()
    ]])
    assert.equal(1, r.code)
    assert.matches("^%[rank 2%] %(command line%):2: rank two is broken\n", r.err)
    assert.matches("%[ranks 0,1%] .*peer_failed", r.err)
  end)

  it("turns a rank that skips a collective into a timeout naming the missing rank", function()
    local r = S.run_code(4, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"dp", 4}}):group("dp")
      if ms.rank() == 2 then ]] .. busy_wait(30) .. [[ else g:all_reduce(ms.tensor({8})) end
    ]], { MOONSHARD_TIMEOUT = "2" })
    assert.equal(1, r.code)
    assert.matches("%[ranks 0,1,3%] .*moonshard timeout error: all_reduce on group %[0 1 2 3%].*timed out after 2 s.*rank.* 2", r.err)
    assert.matches("%[rank 2%] still running 3 s after another rank failed; abandoned", r.err)
    -- the 2 s timeout must have passed (os.time counts whole seconds: at least 1 apart);
    -- the upper bound only tells a hang from the expected 2 + 3 s on a loaded machine
    assert.is_true(r.seconds >= 1 and r.seconds <= 2 + 3 + 45, "took " .. r.seconds .. " s")
  end)

  it("fails at once when a rank ends without joining the collective", function()
    local r = S.run_code(4, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"dp", 4}}):group("dp")
      if ms.rank() ~= 3 then g:barrier() end
    ]], { MOONSHARD_TIMEOUT = "60" })
    assert.equal(1, r.code)
    assert.matches("rank 3 finished its script without joining barrier", r.err)
    assert.is_true(r.seconds < 10, "took " .. r.seconds .. " s")
  end)

  it("reports ranks that disagree on a collective on every rank", function()
    local r = S.run_code(2, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"dp", 2}}):group("dp")
      g:all_reduce(ms.tensor({ms.rank() == 0 and 16 or 8}))
    ]])
    assert.equal(1, r.code)
    assert.matches("%[ranks 0,1%] .*moonshard mismatch error: all_reduce on group %[0 1%]: ranks disagree", r.err)
    assert.matches("rank 0: 16 x f32 sum", r.err, 1, true)
    assert.matches("rank 1: 8 x f32 sum", r.err, 1, true)
  end)
end)

describe("sends and receives on ranks as threads", function()
  for _, n in ipairs({ 1, 2, 3, 4 }) do
    it("move the right values on every one of " .. n .. " ranks", function()
      local r = S.run({ "-n", tostring(n), "tests/lua/scripts/p2p.lua" })
      assert.equal("", r.err)
      assert.equal(0, r.code)
      for rank = 0, n - 1 do assert.matches("rank " .. rank .. ": %d+ p2p checks ok", r.out) end
    end)
  end

  it("report a disagreement on both ranks, naming what differed, and move nothing", function()
    local r = S.run_code(2, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"pp", 2}}):group("pp")
      local t = ms.from_table({ 1, 2, 3, 4 }, ms.rank() == 0 and "f32" or "bf16", { 2, 2 })
      local ok, e = pcall(ms.rank() == 0 and g.send or g.recv, g, t, 1 - ms.rank(), 5)
      assert(not ok)
      assert(t:totable()[4] == 4, "a mismatch moves nothing")
      error(e, 0)
    ]])
    assert.equal(1, r.code)
    assert.matches("[ranks 0,1] moonshard mismatch error: send/recv on group [0 1] between rank 0 and rank 1: the " ..
      "sides disagree: tensor 1 of 1 from rank 0 to rank 1: sent as tag 5 [2, 2] f32, received as tag 5 [2, 2] bf16 " ..
      "(the dtype differs)", r.err, 1, true)
  end)

  it("turn two ranks that both send first into a mismatch, not a deadlock", function()
    local r = S.run_code(2, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"pp", 2}}):group("pp")
      g:send(ms.tensor({ 3 }), 1 - ms.rank())
      g:recv(ms.tensor({ 3 }), 1 - ms.rank())
    ]], { MOONSHARD_TIMEOUT = "60" })
    assert.equal(1, r.code)
    assert.matches("[ranks 0,1] (command line):3: moonshard mismatch error: send/recv on group [0 1] between rank 0 " ..
      "and rank 1: the sides disagree: rank 0 sends 1 tensor to rank 1, which receives 0 from it; rank 1 sends 1 " ..
      "tensor to rank 0, which receives 0 from it (both send first: post each rank's send and receive in one batch)",
      r.err, 1, true)
    assert.is_true(r.seconds < 10, "took " .. r.seconds .. " s")
  end)

  it("turn a peer that never comes into a timeout naming it, and one that finished into peer_failed", function()
    local r = S.run_code(3, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"pp", 3}}):group("pp")
      if ms.rank() == 0 then g:send(ms.tensor({ 8 }), 2) elseif ms.rank() == 2 then ]] .. busy_wait(30) .. [[ end
    ]], { MOONSHARD_TIMEOUT = "2" })
    assert.equal(1, r.code)
    assert.matches("[rank 0] (command line):3: moonshard timeout error: send/recv on group [0 1 2] between rank 0 " ..
      "and rank 2 timed out after 2 s: rank 2 did not arrive (MOONSHARD_TIMEOUT=2)", r.err, 1, true)
    r = S.run_code(2, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"pp", 2}}):group("pp")
      if ms.rank() == 0 then g:batch_p2p({ { "recv", ms.tensor({ 8 }), 1 } }) end
    ]], { MOONSHARD_TIMEOUT = "60" })
    assert.equal(1, r.code)
    assert.matches("moonshard peer_failed error: send/recv on group [0 1] between rank 0 and rank 1: rank 1 finished " ..
      "its script without joining send/recv", r.err, 1, true)
    assert.is_true(r.seconds < 10, "took " .. r.seconds .. " s")
  end)
end)

describe("the moonshard command line", function()
  it("tells the truth in --help and --version", function()
    local r = S.run({ "--help" })
    assert.equal(0, r.code)
    assert.matches("usage: moonshard[%w-]* %[options%] script.lua", r.out) -- moonshard or moonshard-jit
    assert.matches("MOONSHARD_TIMEOUT", r.out)
    r = S.run({ "--version" })
    assert.equal(0, r.code)
    assert.matches("^moonshard[%w-]* %d+%.%d+%.%d+", r.out)
  end)

  it("rejects bad usage with exit status 2", function()
    for _, args in ipairs({ { "-n", "0", "x.lua" }, { "-n" }, { "--frobnicate" }, {}, { "no/such/script.lua" } }) do
      local r = S.run(args)
      assert.equal(2, r.code)
      assert.matches("moonshard: ", r.err)
    end
    assert.matches("bad number of ranks '0'", S.run({ "-n", "0", "x.lua" }).err)
    assert.matches("unknown option '%-%-frobnicate'", S.run({ "--frobnicate" }).err)
    assert.matches("cannot read script 'no/such/script.lua'", S.run({ "no/such/script.lua" }).err)
    assert.matches("unknown backend 'gloo' %(expected threads, mpi or nccl%)", S.run({ "--backend", "gloo", "-e", "" }).err)
    assert.matches("with the nccl backend each process is one rank on one GPU",
      S.run({ "--backend", "nccl", "-n", "2", "-e", "" }).err)
  end)

  it("refuses repeated or out-of-range options and scripts that are no files", function()
    assert.matches("%-e given twice", S.run({ "-e", "1", "-e", "2" }).err)
    local r = S.run({ "--timeout=inf", "-e", "" })
    assert.equal(2, r.code)
    assert.matches("bad timeout 'inf' %(expected a finite number of seconds > 0%)", r.err)
    r = S.run({ "tests" })
    assert.equal(2, r.code)
    assert.matches("cannot read script 'tests': is a directory", r.err)
    r = S.run({ "-n", "2", "plan" })
    assert.equal(2, r.code)
    assert.matches("'plan' is a command only as the first argument", r.err, 1, true)
    r = S.run({ "-e", "" }, { MOONSHARD_TIMEOUT = "abc" })
    assert.equal(2, r.code)
    assert.matches("MOONSHARD_TIMEOUT='abc' is not a finite number of seconds > 0", r.err, 1, true)
    r = S.run({ "plan", "--help" }, { MOONSHARD_LUA_DIR = "/no/such/dir" })
    assert.equal(2, r.code)
    assert.matches("MOONSHARD_LUA_DIR='/no/such/dir' holds no readable moonshard/init.lua", r.err, 1, true)
    r = S.run({ "--ranks=2", "--timeout=5", "-e", "print(require('moonshard').world_size())" })
    assert.equal(0, r.code, r.err)
    assert.equal("2\n2\n", r.out)
  end)

  it("ends a rank's script at os.exit, as a return would, telling its peers at once", function()
    local r = S.run_code(2, [[
      local ms = require "moonshard"
      local g = ms.mesh({{"w", 2}}):group("w")
      if ms.rank() == 1 then pcall(os.exit, 7) end -- not caught by the script's pcall
      g:barrier()
    ]], { MOONSHARD_TIMEOUT = "60" })
    assert.equal(1, r.code)
    assert.matches("rank 1 finished its script without joining barrier", r.err, 1, true)
    assert.is_true(r.seconds < 10, "took " .. r.seconds .. " s")
    assert.equal(7, S.run({ "-e", "os.exit(7)" }).code)
    assert.equal(1, S.run({ "-e", "os.exit(false)" }).code)
    local both = S.run_code(2, "os.exit(require('moonshard').rank() + 3)")
    assert.equal(4, both.code) -- the largest, as for returned statuses
  end)

  it("exits with the integer a script returned, 0 to 255, and 1 for any other", function()
    assert.equal(7, S.run({ "-e", "return 7" }).code)
    for _, v in ipairs({ "256", "-1", "300" }) do
      local r = S.run({ "-e", "return " .. v })
      assert.equal(1, r.code)
      assert.matches("rank 0 returned " .. v .. ", not an exit status (0 to 255): exit status 1", r.err, 1, true)
    end
  end)

  it("fails when the standard output cannot be written", function()
    local f = io.open("/dev/full", "w")
    if not f then return pending("no /dev/full here") end
    f:close()
    local p = io.popen(S.bin .. " -e 'print(1)' 2>&1 >/dev/full; echo \"rc=$?\"")
    local out = p:read("a")
    p:close()
    assert.matches("cannot write the standard output: No space left on device", out, 1, true)
    assert.matches("rc=1", out, 1, true)
  end)

  it("runs on the NCCL backend only where there is a GPU, and says why not", function()
    local core = require "moonshard"
    local r = S.run({ "--backend", "nccl", "-e", "print(require('moonshard').backend())" })
    if core.cuda_device_count() == 0 then
      assert.equal(1, r.code)
      -- built without NCCL, or no device (with the driver's reason)
      assert.is_truthy(r.err:match("built without NCCL") or r.err:match("nccl world: rank 0 has no CUDA device %(.+%)"),
        r.err)
    else
      assert.equal(0, r.code, r.err)
      assert.equal("nccl\n", r.out)
    end
    -- a torchrun-style launch with MASTER_PORT missing: refused before anything waits
    r = S.run({ "--backend", "nccl", "-e", "" }, { RANK = "0", WORLD_SIZE = "2", MASTER_ADDR = "127.0.0.1" })
    assert.equal(1, r.code)
    assert.is_truthy(r.err:match("built without NCCL") or
      r.err:match("MASTER_PORT is not set %(expected the port of rank 0's store"), r.err)
  end)

  it("runs the quickstart on 4 ranks and prints its report", function()
    local r = S.run({ "-n", "4", "examples/quickstart.lua" })
    assert.equal("", r.err)
    assert.equal(0, r.code)
    assert.matches("all%-gather", r.out)
    assert.matches("reduce%-scatter", r.out)
    for rank = 0, 3 do assert.matches("rank " .. rank .. " ok", r.out) end
  end)
end)
