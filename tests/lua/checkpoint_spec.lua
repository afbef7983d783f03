-- checkpoint_spec.lua: moonshard.checkpoint (docs/checkpoints.md).  The C primitives against
-- CRC32C's test vectors and a file Python's safetensors wrote; the tiny inkling2 plan trained
-- by tests/lua/scripts/ckpt_units.lua: saved on 4 ranks and loaded bit for bit on 4, on
-- 3, on HSDP 2x2, on 1 and with other ep, training continued to the bytes of the uninterrupted
-- run; a corrupted byte named by verify and load; a save killed with SIGKILL leaving the
-- previous checkpoint whole; keep_last; every file written read by Python's safetensors when
-- the venv is there.
local S = require "support"

local SCRIPT = "tests/lua/scripts/ckpt_units.lua"
local PY = S.PYTHON

local function tmpdir()
  local p = os.tmpname()
  os.remove(p)
  assert(os.execute("mkdir -p " .. S.quote(p)))
  return p
end

local function sh(cmd) return S.run_with("bash", { "-c", cmd }) end

local function run(n, ...)
  local r = S.run({ "-n", tostring(n), SCRIPT, ... })
  assert.equal("", r.err)
  assert.equal(0, r.code)
  return r
end

-- every safetensors file under dir, concatenated in name order
local function export_bytes(dir)
  local r = sh("cat " .. S.quote(dir) .. "/*.safetensors | od -An -tx1 | md5sum")
  assert.equal(0, r.code)
  return r.out
end

describe("checkpoint primitives", function()
  local R = require "moonshard.raw"
  it("CRC32C gives the published check values", function()
    assert.equal(0xE3069283, R.crc32c("123456789"))
    assert.equal(0x8A9136AA, R.crc32c(string.rep("\0", 32)))
    assert.equal(0x62A8AB43, R.crc32c(string.rep("\255", 32)))
    assert.equal(R.crc32c("123456789"), R.crc32c("6789", R.crc32c("12345")))
    assert.truthy(R.crc32c_impl() == "sse4.2" or R.crc32c_impl() == "table")
  end)

  it("reads a file written by Python's safetensors, tensor by tensor with pread", function()
    local ms = require "moonshard"
    local path = "tests/data/checkpoint/python_written.safetensors"
    local tensors = require("moonshard.safetensors").read_header(path)
    local f = assert(io.open(path, "rb"))
    local b = f:read(8)
    f:close()
    local hlen = 0
    for i = 8, 1, -1 do hlen = hlen * 256 + b:byte(i) end
    local fd = assert(R.ckpt_open(path, false))
    local got = {}
    for _, t in ipairs(tensors) do
      local out = ms.tensor(t.shape, t.dtype)
      local zero = {}
      for d = 1, #t.shape do zero[d] = 0 end
      assert(R.ckpt_read_box(fd, 8 + hlen + t.data_offsets[1], t.shape, zero, out))
      got[t.name] = out:totable()
    end
    R.ckpt_close(fd, false)
    assert.same({ 0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1, 1.125, 1.25, 1.375 }, got.a)
    assert.same({ -2.5, -1.5, -0.5, 0.5, 1.5, 2.5 }, got.b)
    assert.same({ 1, -2, 3 }, got.c)
  end)
end)

describe("checkpoints of materialised plans", function()
  local root, ref, saved_dir
  setup(function()
    root = tmpdir()
    ref, saved_dir = root .. "/ref", root .. "/ckpt"
    run(4, "dp_shard=4", "4", "export=" .. ref)                    -- the uninterrupted run
    run(4, "dp_shard=4", "2", "save=2:" .. saved_dir)              -- stopped after step 2
  end)
  teardown(function() sh("rm -rf " .. S.quote(root)) end)

  -- loads the checkpoint saved at dir on the same mesh, saves it again: the same boxes, bytes
  -- for bytes (parameters and every kind of AdamW state); returns the first index
  local function round_trip(n, mesh, dir, ...)
    local again = dir .. "_again"
    local r = run(n, mesh, "2", "load=" .. dir, "resave=" .. again, ...)
    local ckpt = require "moonshard.checkpoint"
    local a = ckpt.read_index(ckpt.resolve(dir))
    local b = ckpt.read_index(ckpt.resolve(again))
    local crc = {}
    for _, s in ipairs(a.shards) do crc[s.key] = s.crc32c end
    assert.equal(#a.shards, #b.shards)
    local kinds = {}
    for _, s in ipairs(b.shards) do
      assert.equal(crc[s.key], s.crc32c)
      kinds[s.kind] = true
    end
    assert.same({ param = true, exp_avg = true, exp_avg_sq = true, master = true }, kinds)
    return a, r.out
  end

  -- the bytes every rank of a ckpt_units run read (its "loaded, read N bytes" lines), summed,
  -- and the bytes of every saved box
  local function bytes_read(out, index)
    local sum, ranks, saved = 0, 0, 0
    for b in out:gmatch("loaded, read (%d+) bytes") do sum, ranks = sum + tonumber(b), ranks + 1 end
    for _, s in ipairs(index.shards) do saved = saved + s.nbytes end
    return sum, ranks, saved
  end

  it("round-trips bit for bit on the same 4 ranks (parameters and AdamW state), reading each byte once", function()
    local a, out = round_trip(4, "dp_shard=4", saved_dir)
    local sum, ranks, saved = bytes_read(out, a)
    assert.equal(4, ranks)
    assert.equal(saved, sum)
    assert.same({ note = "resume here", rng = { 1, 2, 3 } }, setmetatable(a.extra, nil))
  end)

  it("saves a pipeline (pp = 2), each stage's ranks their units, and resumes on other meshes", function()
    local pp_dir = root .. "/pp"
    run(4, "pp=2,dp_shard=2", "2", "save=2:" .. pp_dir)
    round_trip(4, "pp=2,dp_shard=2", pp_dir)
    for _, case in ipairs({ { 2, "dp_shard=2" }, { 2, "pp=2,dp_shard=1" } }) do
      local out = root .. "/out_pp_" .. case[2]:gsub("[^%w]", "_")
      run(case[1], case[2], "4", "load=" .. pp_dir, "export=" .. out)
      assert.equal(export_bytes(ref), export_bytes(out))
    end
  end)

  it("saves tensor-parallel pieces (tp = 2, vocab split unevenly) as global boxes and loads on tp 1 and 2", function()
    -- 4 query and 2 key/value heads, so that tp = 2 divides them; lm_head's 67 rows split 34 + 33
    local tp_dir, tref = root .. "/tp", root .. "/tp_ref"
    run(4, "dp_shard=4", "4", "heads=4:2", "export=" .. tref)
    run(4, "tp=2,dp_shard=2", "2", "heads=4:2", "save=2:" .. tp_dir)
    local index = round_trip(4, "tp=2,dp_shard=2", tp_dir, "heads=4:2")
    assert.same({ 67, 24 }, setmetatable(index.tensors["lm_head.weight"].shape, nil))
    for _, case in ipairs({ { 2, "dp_shard=2" }, { 2, "tp=2" } }) do
      local out = root .. "/out_tp_" .. case[2]:gsub("[^%w]", "_")
      run(case[1], case[2], "4", "heads=4:2", "load=" .. tp_dir, "export=" .. out)
      assert.equal(export_bytes(tref), export_bytes(out))
    end
    -- a model of other shapes (the config's 3 and 1 heads) is refused, naming the tensor
    local r = S.run({ "-n", "2", SCRIPT, "dp_shard=2", "4", "load=" .. tp_dir })
    assert.not_equal(0, r.code)
    assert.matches("tensor [%w._]+: the model's shape is [%dx]+, the checkpoint's [%dx]+", r.err)
  end)

  for _, case in ipairs({ { 3, "dp_shard=3" }, { 4, "dp_replicate=2,dp_shard=2" }, { 1, "dp_shard=1" },
    { 2, "dp_shard=2,ep=2" }, { 4, "dp_shard=4,ep=4" } }) do
    it("resumes on " .. case[2] .. " and continues as the uninterrupted run", function()
      local out = root .. "/out_" .. case[1] .. "_" .. case[2]:gsub("[^%w]", "_")
      run(case[1], case[2], "4", "load=" .. saved_dir, "export=" .. out)
      assert.equal(export_bytes(ref), export_bytes(out))
    end)
  end

  it("saves Megatron-FSDP buckets (flat slices as boxes) and loads them on other dp sizes, strategies and units",
    function()
    -- the gradients are multiples of 2^-6, the same on every rank: the buckets' 1/dp-scaled sums
    -- are exact, so Megatron-FSDP on dp 2 and 4 trains to the bytes of the FSDP run
    local m_dir = root .. "/mfsdp"
    run(4, "dp_shard=4", "2", "mfsdp=3", "save=2:" .. m_dir)
    -- ZeRO-3 on the mesh that saved it: each rank reads its own pieces, every byte once
    local index, out = round_trip(4, "dp_shard=4", m_dir, "mfsdp=3")
    local sum, ranks, saved = bytes_read(out, index)
    assert.equal(4, ranks)
    assert.equal(saved, sum)
    for _, case in ipairs({ { 2, "dp_shard=2", "mfsdp=1", m_dir }, { 4, "dp_shard=4", "steps=0", m_dir },
      { 2, "dp_shard=2", "mfsdp=3", saved_dir } }) do
      local out = root .. "/out_mfsdp_" .. case[1] .. case[3]:gsub("[^%w]", "_")
      run(case[1], case[2], "4", case[3], "load=" .. case[4], "export=" .. out)
      assert.equal(export_bytes(ref), export_bytes(out))
    end
  end)

  it("cuts a flat range of a tensor into boxes, in flat order", function()
    local flat_boxes = require("moonshard.checkpoint").flat_boxes
    local got = {}
    for _, b in ipairs(flat_boxes({ 3, 4, 5 }, 7, 53)) do
      got[#got + 1] = table.concat(b.off, ",") .. ":" .. table.concat(b.shape, "x") .. "@" .. b.start .. "+" .. b.n
    end
    assert.same({ "0,1,2:1x1x3@7+3", "0,2,0:1x2x5@10+10", "1,0,0:1x4x5@20+20", "2,0,0:1x2x5@40+10",
      "2,2,0:1x1x3@50+3" }, got)
    assert.same({}, flat_boxes({ 6 }, 4, 4))
    assert.equal(1, #flat_boxes({ 2, 3 }, 0, 6))
  end)

  it("saves under expert parallelism and resumes without it", function()
    local ep_dir, out = root .. "/ep", root .. "/out_from_ep"
    run(4, "dp_shard=4,ep=2", "2", "save=2:" .. ep_dir)
    run(3, "dp_shard=3", "4", "load=" .. ep_dir, "export=" .. out)
    assert.equal(export_bytes(ref), export_bytes(out))
  end)

  it("info and verify describe a good checkpoint; export writes Hugging Face safetensors", function()
    local r = S.run({ "checkpoint", "info", saved_dir })
    assert.equal(0, r.code)
    assert.matches("step       2", r.out)
    assert.matches("written by 4 ranks %(threads%), mesh pp=1,dp_replicate=1,dp_shard=4", r.out)
    assert.matches("lm_head.weight%s+67x24%s+bf16%s+param,exp_avg,exp_avg_sq,master; 4 boxes", r.out)
    r = S.run({ "checkpoint", "verify", saved_dir })
    assert.equal(0, r.code)
    assert.matches(": ok, %d+ boxes of 45 tensors in 4 files", r.out)
    local out = root .. "/cli_export"
    r = S.run({ "checkpoint", "export", saved_dir, "--to", out, "--max-shard-size", "30KB" })
    assert.equal(0, r.code)
    local index = require("moonshard.safetensors").read_index(out .. "/model.safetensors.index.json")
    assert.equal(45, #index)
    r = S.run({ "checkpoint", "--help" })
    assert.equal(0, r.code)
    assert.matches("verify", r.out)
  end)

  it("the CLI: info's extra values and root, export's options checked before it runs, earlier exports replaced, " ..
    "no .tmp left by a failed one, never into a checkpoint", function()
    local r = S.run({ "checkpoint", "info", root .. "/ckpt" })
    assert.equal(0, r.code)
    assert.matches('extra      {"note":"resume here","rng":%[1,2,3%]}', r.out)
    assert.matches("root       .-/ckpt: step_00000002 %(latest%)", r.out)
    -- the columns line up whatever the names' lengths
    local cols = {}
    for line in r.out:gmatch("\n  (%S+%s+)%d") do cols[#line] = true end
    assert.equal(1, (function() local n = 0 for _ in pairs(cols) do n = n + 1 end return n end)())
    for _, case in ipairs({ { { "--to" }, "%-%-to needs a value" }, { { "--to", "x", "--dtype", "int3" },
      "%-%-dtype int3: expected one of bf16" }, { { "--to", "x", "--max-shard-size", "0" },
      "%-%-max%-shard%-size '0': expected a size of at least 1 byte" } }) do
      local a = { "checkpoint", "export", saved_dir }
      for _, x in ipairs(case[1]) do a[#a + 1] = x end
      r = S.run(a)
      assert.equal(2, r.code)
      assert.matches(case[2], r.err)
      assert.is_nil(r.err:match("traceback"))
    end
    r = S.run({ "checkpoint", "info", root .. "/no_such" })
    assert.equal(1, r.code)
    assert.matches("no_such: no such file or directory", r.err)
    -- torch's dtype names; a smaller export replaces a sharded one whole
    local out = root .. "/cli_export2"
    r = S.run({ "checkpoint", "export", saved_dir, "--to", out, "--max-shard-size", "30KB", "--dtype", "float16" })
    assert.equal(0, r.code)
    assert.matches("%d+ files", r.out)
    r = S.run({ "checkpoint", "export", saved_dir, "--to", out })
    assert.equal(0, r.code)
    assert.matches(": 1 file, ", r.out)
    assert.equal("model.safetensors\n", sh("ls " .. S.quote(out)).out)
    -- into a checkpoint: refused; from a corrupt one: no .tmp left behind
    r = S.run({ "checkpoint", "export", saved_dir, "--to", require("moonshard.checkpoint").resolve(saved_dir) })
    assert.equal(1, r.code)
    assert.matches("is a moonshard checkpoint %(it holds checkpoint.json%); export into another directory", r.err)
  end)

  -- a copy of the saved checkpoint as root/name with one byte changed: pick(index) -> the
  -- file, the byte's offset, and a function of the old byte giving the new -> the copy, its
  -- checkpoint directory
  local function corrupted(name, pick)
    local bad = root .. "/" .. name
    assert.equal(0, sh("cp -r " .. S.quote(saved_dir) .. " " .. S.quote(bad)).code)
    local ckpt = require "moonshard.checkpoint"
    local dir = ckpt.resolve(bad)
    local file, at, byte = pick(ckpt.read_index(dir))
    local f = assert(io.open(dir .. "/" .. file, "r+b"))
    f:seek("set", at)
    local c = f:read(1)
    f:seek("set", at)
    f:write(string.char(byte(c:byte())))
    f:close()
    return bad, dir
  end

  it("verify checks each file's safetensors header against the index", function()
    -- byte 20 is inside "__metadata__": the header no longer parses as safetensors
    local bad = corrupted("bad_header", function() return "rank00001.safetensors", 20, function() return 127 end end)
    local r = S.run({ "checkpoint", "verify", bad })
    assert.equal(1, r.code)
    S.assert_has(r.err, "rank00001.safetensors: its safetensors header does not parse")
    local out = root .. "/from_bad"
    r = S.run({ "checkpoint", "export", bad, "--to", out })
    -- (export reads the boxes by the index, whose checksums still hold: the header is verify's)
    assert.equal(0, r.code)
    assert.equal("", sh("ls " .. S.quote(out) .. " | grep tmp || true").out)
    sh("rm -rf " .. S.quote(bad)) -- (no safetensors reader opens it: the Python check below reads the rest)
  end)

  it("names a corrupted tensor and its file in verify and load", function()
    -- one byte in the middle of the last box changed
    local s
    local bad = corrupted("bad", function(index)
      s = index.shards[#index.shards]
      return s.file, s.file_offset + math.floor(s.nbytes / 2), function(c) return (c + 1) % 256 end
    end)
    local r = S.run({ "checkpoint", "verify", bad })
    assert.equal(1, r.code)
    S.assert_has(r.err, "checksum mismatch: " .. s.kind .. " of tensor " .. s.tensor)
    S.assert_has(r.err, s.file)
    r = S.run({ "-n", "3", SCRIPT, "dp_shard=3", "4", "load=" .. bad })
    assert.not_equal(0, r.code)
    S.assert_has(r.err, "checksum mismatch: " .. s.kind .. " of tensor " .. s.tensor)
    S.assert_has(r.err, s.file)
    -- an export of it fails, naming the box, and leaves no .tmp file
    local out = root .. "/export_bad"
    r = S.run({ "checkpoint", "export", bad, "--to", out })
    assert.equal(1, r.code)
    S.assert_has(r.err, "checksum mismatch")
    assert.equal("", sh("ls -A " .. S.quote(out)).out)
  end)

  it("keeps the last checkpoints only, and latest names the newest", function()
    local kroot = root .. "/keep"
    -- ckpt_units saves with keep_last = 2: steps 1, 2, 3 leave 2 and 3
    for step = 1, 3 do
      run(2, "dp_shard=2", tostring(step), step > 1 and ("load=" .. kroot) or "steps=0", "save=" .. step .. ":" .. kroot)
    end
    local r = sh("ls -A " .. S.quote(kroot))
    assert.equal("latest\nstep_00000002\nstep_00000003\n", r.out)
    assert.equal("step_00000003\n", S.read_file(kroot .. "/latest"))
  end)

  it("leaves the previous checkpoint whole when a save is killed with SIGKILL", function()
    local kroot = root .. "/killed"
    -- big units (8 MiB a rank) so that the second save is caught mid-write
    -- one f32 unit of 4096 x 2048 over the ranks
    local unit = [[
      local ms = require "moonshard"
      local ckpt = require "moonshard.checkpoint"
      local g = ms.mesh({ { "dp", ms.world_size() } }):group("dp")
      local u = ms.unit("big", g, nil, nil, nil, true)
      u:add_param("big.weight", { 4096, 2048 }, "f32")
      u:finalize()
    ]]
    local code = unit .. [[
      u:param_shard(0):fill_(ms.rank() + 1)
      for step = 1, 200 do ckpt.save({ u }, arg[1], { step = step, keep_last = 1, progress = false }) end
    ]]
    local script = root .. "/kill.lua"
    S.write_file(script, code)
    local r = sh(string.format([[
      %s -n 4 %s %s & pid=$!
      for i in $(seq 1 2000); do [ -f %s/latest ] && ls -d %s/.tmp-* >/dev/null 2>&1 && break; sleep 0.005; done
      kill -9 $pid; wait $pid; echo killed $?]], S.quote(S.bin), S.quote(script), S.quote(kroot), S.quote(kroot),
      S.quote(kroot)))
    assert.matches("killed 137", r.out)
    r = S.run({ "checkpoint", "verify", kroot })
    assert.equal(0, r.code)
    local check = unit .. [[
      local step = ckpt.load({ u }, arg[1])
      local v = u:param_shard(0):narrow(0, 0, 1):totable()
      print("loaded step " .. step .. " first " .. v[1])
    ]]
    r = S.run({ "-n", "1", "-e", check, kroot })
    assert.equal(0, r.code)
    assert.matches("loaded step %d+ first 1", r.out)
  end)

  it("writes files Python's safetensors reads", function()
    local py, why = S.python_with("safetensors, torch")
    if not py then
      pending(why)
      return
    end
    local code = [[
import sys, glob
from safetensors import safe_open
n = 0
files = sorted(glob.glob(sys.argv[1] + "/**/*.safetensors", recursive=True))
for p in files:
    with safe_open(p, framework="pt") as f:
        for k in f.keys():
            f.get_tensor(k)
            n += 1
print("read", n, "tensors from", len(files), "files")
]]
    local r = S.run_with(PY, { "-c", code, root })
    assert.equal(0, r.code)
    assert.matches("read %d+ tensors from %d+ files", r.out)
  end)
end)
