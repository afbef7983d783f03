-- inputs_spec.lua: what moonshard reads from files is bounded.  Configs, indexes, policies and
-- safetensors headers must be regular files (a FIFO is refused before an open could wait on
-- it, /dev/zero before a read could never end), of at most util.READ_LIMITS bytes; tensor
-- and parameter names at most module.MAX_NAME_BYTES long and MAX_NAME_DEPTH parts deep, so
-- that a module tree costs time and memory in proportion to its header.
local json = require "moonshard.json"
local util = require "moonshard.util"
local module = require "moonshard.module"
local st = require "moonshard.safetensors"
local S = require "support"

local tmpdir, fifo
local function tmp(name) return tmpdir .. "/" .. name end
local function lit(s) return (s:gsub("%p", "%%%0")) end

local write = S.write_file

-- A regular file of `size` bytes that takes no room (a hole, then one byte).
local function sparse(path, size)
  local f = assert(io.open(path, "wb"))
  f:seek("set", size - 1)
  f:write("}")
  f:close()
  return path
end

-- A header holding one F32 tensor of shape [1] named `name`.
local function one_tensor(path, name)
  return S.write_raw(path, '{"' .. name .. '":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4)
end

setup(function()
  tmpdir = os.tmpname()
  os.remove(tmpdir)
  assert(os.execute("mkdir -p " .. tmpdir))
  fifo = tmp("fifo.json") -- no one ever writes to it: an open for reading would wait forever
  assert(os.execute("mkfifo " .. S.quote(fifo)))
end)

teardown(function() os.execute("rm -rf " .. S.quote(tmpdir)) end)

describe("file_stat (the core, through this interpreter's binding)", function()
  it("tells what a path names without opening it", function()
    local stat = util.file_stat_fn()
    assert.is_function(stat)
    local kind, size = stat(write(tmp("five"), "12345"))
    assert.equal("regular file", kind)
    assert.equal(5, size)
    assert.same({ "directory", 0 }, { stat(tmpdir) })
    assert.same({ "FIFO (named pipe)", 0 }, { stat(fifo) })
    assert.same({ "character device", 0 }, { stat("/dev/zero") })
    assert.same({ nil, tmp("missing") .. ": No such file or directory" }, { stat(tmp("missing")) })
    assert.same({ nil, tmp("five") .. ": the path holds a NUL byte" }, { stat(tmp("five") .. "\0x") })
  end)
end)

describe("util.read_file", function()
  it("refuses what is no regular file before opening it, by what it is", function()
    for path, what in pairs({ ["/dev/zero"] = "a character device", [tmpdir] = "a directory",
                              [fifo] = "a FIFO (named pipe)" }) do
      local text, err, opened = util.read_file(path, "json")
      assert.is_nil(text)
      assert.equal("is " .. what .. ", not a regular file", err)
      assert.is_true(opened) -- the reason alone: io.open's own messages start with the path
    end
    assert.same({ nil, "the path holds a NUL byte", true }, { util.read_file(fifo .. "\0.x") })
    local text, err, opened = util.read_file(tmp("missing"))
    assert.is_nil(text)
    assert.equal(tmp("missing") .. ": No such file or directory", err)
    assert.is_false(opened)
  end)

  it("refuses files over the limit of their kind by their size, without reading them", function()
    assert.equal(64 * 1024 * 1024, util.READ_LIMITS.json)
    assert.equal(16 * 1024 * 1024, util.READ_LIMITS.policy)
    local big = sparse(tmp("big.json"), 100 * 1024 * 1024)
    local t0 = os.clock()
    assert.same({ nil, "is 100.0 MiB (104857600 bytes), more than the 64.0 MiB limit for a JSON file", true },
      { util.read_file(big, "json") })
    local policy = sparse(tmp("big.lua"), 16 * 1024 * 1024 + 1)
    assert.same({ nil, "is 16.0 MiB (16777217 bytes), more than the 16.0 MiB limit for a policy file", true },
      { util.read_file(policy) })
    assert.is_true(os.clock() - t0 < 1)
    assert.equal(16 * 1024 * 1024, #util.read_file(sparse(tmp("just.lua"), 16 * 1024 * 1024)))
    assert.has_error(function() util.read_file(big, "yaml") end,
      "moonshard: read_file: unknown kind 'yaml' (json or policy)")
  end)

  it("without the core, reads in chunks up to the limit", function()
    local stat_fn, limit = util.file_stat_fn, util.READ_LIMITS.policy
    util.file_stat_fn = function() return false end
    util.READ_LIMITS.policy = 10
    local ok, err = pcall(function()
      assert.equal("0123456789", util.read_file(write(tmp("ten"), "0123456789")))
      assert.same({ nil, "is more than the 10 B limit for a policy file", true },
        { util.read_file(write(tmp("eleven"), "0123456789a")) })
      assert.same({ nil, "is more than the 10 B limit for a policy file", true }, { util.read_file("/dev/zero") })
      local text, rerr, opened = util.read_file(tmpdir) -- a directory opens, then cannot be read
      assert.is_nil(text)
      assert.matches("Is a directory", rerr)
      assert.is_true(opened)
    end)
    util.file_stat_fn, util.READ_LIMITS.policy = stat_fn, limit
    assert(ok, err)
  end)
end)

describe("module tree names", function()
  it("are at most 1024 bytes and 64 dotted parts", function()
    assert.equal(1024, module.MAX_NAME_BYTES)
    assert.equal(64, module.MAX_NAME_DEPTH)
    -- DeepSeek-V3's longest tensor name is far below both
    assert.is_nil(module.name_limit_error("model.layers.60.mlp.experts.255.gate_proj.weight_scale_inv"))
  end)

  it("a 60- and a 64-part name make trees of that depth", function()
    for _, parts in ipairs({ 60, 64 }) do
      local path = one_tensor(tmp("deep" .. parts .. ".safetensors"), string.rep("a.", parts - 1) .. "w")
      local tree = st.tree_from_safetensors(path)
      local m, depth = tree, 0
      while m.children.a do m, depth = m.children.a, depth + 1 end
      assert.equal(parts - 1, depth)
      assert.equal(1, m.params.w.numel)
    end
  end)

  it("refuses a deeper or longer name, naming the file, the name (shortened) and the limit", function()
    local path = one_tensor(tmp("deep65.safetensors"), string.rep("a.", 64) .. "w")
    local ok, err = pcall(st.tree_from_safetensors, path)
    assert.is_false(ok)
    assert.equal("moonshard: safetensors: " .. path .. ": tensor name '" .. string.rep("a.", 40) .. "... (129 bytes)' " ..
      "has 65 dotted parts, more than the 64-part limit on names", err)
    path = one_tensor(tmp("long.safetensors"), string.rep("n", 1025))
    ok, err = pcall(st.tree_from_safetensors, path)
    assert.is_false(ok)
    assert.matches(": tensor name 'n+%.%.%. %(1025 bytes%)' is 1025 bytes, more than the 1024%-byte limit on names$", err)
  end)

  it("refuses a 100 KB name of 50,000 parts at once (it took 33 s and 2.5 GB)", function()
    local path = one_tensor(tmp("deep50k.safetensors"), string.rep("a.", 50000) .. "w")
    local t0 = os.clock()
    local ok, err = pcall(st.tree_from_safetensors, path)
    assert.is_true(os.clock() - t0 < 2)
    assert.is_false(ok)
    assert.matches("tensor name 'a%.a%..-%.%.%. %(100001 bytes%)' is 100001 bytes, more than the 1024%-byte limit", err)
    assert.is_true(#err < 300)
  end)

  it("shows names with control bytes escaped", function()
    local path = S.write_raw(tmp("nul.safetensors"), '{"a\\u0000b":{"dtype":"X","shape":[1],"data_offsets":[0,4]}}', 4)
    local ok, err = pcall(st.read_header, path)
    assert.is_false(ok)
    assert.matches("tensor 'a\\x00b': dtype 'X' is not supported", err, 1, true)
    assert.is_nil(err:find("\0", 1, true))
  end)

  it("bounds the embedding API's names too", function()
    local embed = require "moonshard.embed"
    local ok, err = pcall(embed.add_param, string.rep("p.", 64) .. "w", { 2 }, "f32", true)
    assert.is_false(ok)
    assert.matches("^moonshard: embed: parameter name 'p%.p%..-' has 65 dotted parts, more than the 64%-part limit", err)
  end)
end)

describe("safetensors files that are no regular files", function()
  it("are refused by name, as a header and as a shard of an index", function()
    local ok, err = pcall(st.read_header, fifo)
    assert.is_false(ok)
    assert.equal("moonshard: safetensors: " .. fifo .. ": cannot read: is a FIFO (named pipe), not a regular file", err)
    assert(os.execute("mkfifo " .. S.quote(tmp("shard.safetensors"))))
    local index = write(tmp("model.safetensors.index.json"),
      json.encode({ weight_map = { w = "shard.safetensors" } }))
    ok, err = pcall(st.tree_from_safetensors, index)
    assert.is_false(ok)
    assert.equal("moonshard: safetensors: " .. index .. ": weight_map puts 'w' in shard 'shard.safetensors', which " ..
      "cannot be opened: is a FIFO (named pipe), not a regular file", err)
    ok, err = pcall(st.tree_from_safetensors, sparse(tmp("huge.index.json"), 65 * 1024 * 1024))
    assert.is_false(ok)
    assert.matches("huge%.index%.json: cannot read: is 65%.0 MiB %(68157440 bytes%), more than the 64%.0 MiB limit", err)
  end)
end)

describe("moonshard plan", function()
  -- under timeout(1): a run that waits on a FIFO fails the spec instead of hanging it
  local function plan(args)
    local full = { "20", S.bin, "plan", "--mesh", "dp_shard=2" }
    for _, a in ipairs(args) do full[#full + 1] = a end
    local r = S.run_with("timeout", full)
    assert.are_not.equal(124, r.code, "timed out: " .. table.concat(args, " "))
    assert.is_true(r.seconds < 10)
    return r
  end

  it("refuses /dev/zero, a FIFO and a directory as --config at once, by what they are", function()
    for path, what in pairs({ ["/dev/zero"] = "a character device", [fifo] = "a FIFO %(named pipe%)",
                              [tmpdir] = "a directory" }) do
      local r = plan({ "--config", path, "--policy", "policies/fsdp2_default.lua" })
      assert.equal(1, r.code)
      assert.equal("", r.out)
      assert.matches("^moonshard plan: error: cannot read " .. lit(path) .. ": is " .. what .. ", not a regular file\n$",
        r.err)
    end
  end)

  it("refuses a FIFO as --safetensors and as --policy", function()
    local r = plan({ "--safetensors", fifo, "--policy", "policies/fsdp2_default.lua" })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: safetensors: " .. fifo .. ": cannot read: is a FIFO (named pipe), not a " ..
      "regular file\n", r.err)
    r = plan({ "--config", "examples/configs/llama3.1_8b.json", "--policy", fifo })
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: policy " .. fifo .. ": cannot read: is a FIFO (named pipe), not a regular " ..
      "file\n", r.err)
  end)

  it("hands policies moonshard.util without its file functions (policies run without io)", function()
    local policy = write(tmp("peek.lua"), [[
local util = require "moonshard.util"
return { parallelize = function(ctx)
  error(string.format("read_file %s, file_stat_fn %s, exists %s, bytes %s", type(util.read_file),
    type(util.file_stat_fn), type(util.exists), type(util.bytes)))
end }
]])
    local r = plan({ "--config", "examples/configs/llama3.1_8b.json", "--policy", policy })
    assert.equal(1, r.code)
    assert.matches("read_file nil, file_stat_fn nil, exists nil, bytes function", r.err, 1, true)
  end)

  it("refuses a checkpoint whose one name is 100 KB deep in well under a second", function()
    local path = one_tensor(tmp("plan_deep.safetensors"), string.rep("a.", 50000) .. "w")
    local r = plan({ "--safetensors", path, "--policy", "policies/fsdp2_default.lua" })
    assert.equal(1, r.code)
    assert.matches("tensor name 'a%.a%..-' is 100001 bytes, more than the 1024%-byte limit on names\n$", r.err)
  end)
end)
