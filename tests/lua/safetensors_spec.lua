-- safetensors_spec.lua: headers read strictly, index files merged and checked, module trees
-- built from what is on disk.  The files are written by the tiny writer in support.lua.
local json = require "moonshard.json"
local st = require "moonshard.safetensors"

local S = require "support"
local write_raw, write_tensors = S.write_raw, S.write_safetensors


local tmpdir
local function tmp(name) return tmpdir .. "/" .. name end

-- A path as a Lua pattern that matches it literally.
local function lit(s) return (s:gsub("%p", "%%%0")) end

local function read_error(path)
  local ok, err = pcall(st.read_header, path)
  assert.is_false(ok)
  return err
end

setup(function()
  tmpdir = os.tmpname()
  os.remove(tmpdir)
  assert(os.execute("mkdir -p " .. tmpdir))
end)

teardown(function() os.execute("rm -rf " .. tmpdir) end)

describe("safetensors.read_header", function()
  it("lists tensors by data offset with moonshard dtypes, and the metadata", function()
    local path = write_tensors(tmp("ok.safetensors"), {
      { "b.weight", "BF16", { 4, 3 } },
      { "a.scale", "F32", {} },
      { "c.empty", "I64", { 0, 5 } },
      { "d.mask", "BOOL", { 7 } },
      { "e.q", "F8_E4M3", { 2, 2 } },
    }, { format = "pt" })
    local tensors, meta = st.read_header(path)
    assert.same({ format = "pt" }, meta)
    local got = {}
    for i, t in ipairs(tensors) do got[i] = { t.name, t.dtype, t.shape, t.data_offsets } end
    assert.same({
      { "b.weight", "bf16", { 4, 3 }, { 0, 24 } },
      { "a.scale", "f32", {}, { 24, 28 } },
      { "c.empty", "i64", { 0, 5 }, { 28, 28 } },
      { "d.mask", "bool", { 7 }, { 28, 35 } },
      { "e.q", "f8e4m3", { 2, 2 }, { 35, 39 } },
    }, got)
    assert.equal(path, tensors[1].file)
  end)

  it("accepts an empty file and space padding after the header", function()
    local tensors, meta = st.read_header(write_raw(tmp("empty.safetensors"), "{}      "))
    assert.same({}, tensors)
    assert.same({}, meta)
  end)

  it("refuses bad header lengths", function()
    local p = tmp("bad.safetensors")
    write_raw(p, "{}", 0, 200 * 1024 * 1024)
    assert.matches("^moonshard: safetensors: " .. lit(p) .. ": header length 209715200 exceeds the 104857600%-byte limit",
      read_error(p))
    write_raw(p, "{}", 0, 2 ^ 63 + 2 ^ 62)
    assert.matches("header length 13835058055282163712 exceeds", read_error(p))
    write_raw(p, "{}", 0, 50)
    assert.matches(lit(p) .. ": header length 50 goes beyond the end of the file %(10 bytes%)", read_error(p))
    local f = assert(io.open(p, "wb"))
    f:write("abc")
    f:close()
    assert.matches("file is 3 bytes, too short for the 8%-byte header length", read_error(p))
    assert.matches("cannot open", read_error(tmp("nonexistent.safetensors")))
  end)

  it("refuses malformed headers, naming the file and the tensor", function()
    local p = tmp("bad.safetensors")
    local function check(header, data_size, pattern)
      write_raw(p, header, data_size)
      local err = read_error(p)
      assert.matches(pattern, err)
      assert.matches(lit(p), err)
    end
    local function entry(dtype, shape, offsets, extra)
      local e = { dtype = dtype, shape = json.array(shape), data_offsets = json.array(offsets) }
      for k, v in pairs(extra or {}) do e[k] = v end
      return e
    end
    check('{"a": 1,}', 0, "^moonshard: json: " .. lit(p) .. " header:1:9: trailing comma in object")
    check('{"a": {}, "a": {}}', 0, 'duplicate key "a"')
    check("[]", 0, "the header does not start with '{' %(not a safetensors file%?%)")
    check(" []", 0, "the header does not start with '{'")
    check("", 0, "the header does not start with '{'")
    check({ w = entry("I16", { 2 }, { 0, 4 }) }, 4,
      "tensor 'w': dtype 'I16' is not supported %(supported: BF16 BOOL F16 F32 F64 F8_E4M3 F8_E5M2 I32 I64 I8 U8%)")
    check({ w = entry("Q4", { 2 }, { 0, 4 }) }, 4, "tensor 'w': dtype 'Q4' is not supported")
    check({ w = { shape = json.array({ 2 }), data_offsets = { 0, 4 } } }, 4, "tensor 'w': dtype is missing")
    -- numbers are integer counts up to 2^53, and so are the element and byte counts they make
    check('{"w": {"dtype": "F16", "shape": [1.0], "data_offsets": [0, 2]}}', 2,
      "header:1:34: number 1%.0 is not an integer >= 0 %(expected an integer count from 0 to 2%^53%)")
    check('{"w": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2e0]}}', 2, "number 2e0 is not an integer >= 0")
    check('{"w": {"dtype": "F16", "shape": [18446744073709551615], "data_offsets": [0, 2]}}', 2,
      "number 18446744073709551615 is not at most 2%^53")
    check('{"w": {"dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}}', 2, "number %-1 is not an integer >= 0")
    check({ w = entry("F32", { 4294967296, 4294967296 }, { 0, 0 }) }, 0,
      "tensor 'w': shape %[4294967296, 4294967296%] of F32 is more than 2%^53 bytes")
    check({ w = entry("F32", { 4503599627370496 }, { 0, 0 }) }, 0, "shape %[4503599627370496%] of F32 is more than 2%^53")
    check({ w = 5 }, 0, "tensor 'w': entry is not an object")
    check({ w = entry("F16", { 2, "3" }, { 0, 12 }) }, 12, "tensor 'w': shape%[1%] is \"3\"; sizes are integers >= 0")
    check({ w = { dtype = "F16", data_offsets = { 0, 4 } } }, 4, "tensor 'w': shape is missing or not an array")
    check({ w = entry("F16", { 2 }, { 4, 0 }) }, 4, "tensor 'w': data_offsets must be %[begin, end%] with 0 <= begin <= end, got %[4,0%]")
    check({ w = entry("F16", { 2 }, { 0 }) }, 4, "tensor 'w': data_offsets must be")
    check({ w = entry("F16", { 2, 3 }, { 0, 10 }) }, 10,
      "tensor 'w': data_offsets %[0, 10%] hold 10 bytes but shape %[2, 3%] of F16 needs 12")
    check({ w = entry("F16", { 2 }, { 0, 4 }) }, 2, "tensor 'w': data_offsets %[0, 4%] go beyond the data area %(2 bytes%)")
    check({ a = entry("F32", { 2 }, { 0, 8 }), b = entry("F32", { 1 }, { 4, 8 }) }, 8,
      "tensors 'a' %[0, 8%] and 'b' %[4, 8%] overlap")
    check({ a = entry("F32", { 2 }, { 0, 8 }), b = entry("F32", { 1 }, { 12, 16 }) }, 16,
      "bytes %[8, 12%) of the data area belong to no tensor %(a hole before 'b'%)")
    check({ a = entry("F32", { 1 }, { 4, 8 }) }, 8, "bytes %[0, 4%) of the data area belong to no tensor %(a hole before 'a'%)")
    check({ a = entry("F32", { 2 }, { 0, 8 }) }, 12, "bytes %[8, 12%) of the data area belong to no tensor %(after the last one%)")
    check({ __metadata__ = { format = 1 } }, 0, '__metadata__%["format"%] is 1; metadata values are strings')
    check({ __metadata__ = json.array() }, 0, "__metadata__ is not an object of strings")
  end)

  it("takes what the reference loader takes: leading whitespace, extra entry keys, null metadata", function()
    local p = tmp("lenient.safetensors")
    write_raw(p, ' \n{"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4], "note": "x"}, ' ..
      '"__metadata__": null}', 4)
    local tensors, metadata = st.read_header(p)
    assert.equal(1, #tensors)
    assert.same({ "w", "f16", 2, 0, 4 }, { tensors[1].name, tensors[1].dtype, tensors[1].shape[1],
      tensors[1].data_offsets[1], tensors[1].data_offsets[2] })
    assert.same({}, metadata)
  end)
end)

describe("safetensors.read_index", function()
  local index

  before_each(function()
    write_tensors(tmp("model-00001-of-00002.safetensors"), {
      { "model.embed_tokens.weight", "BF16", { 8, 4 } },
      { "model.layers.0.mlp.weight", "BF16", { 4, 4 } },
    })
    write_tensors(tmp("model-00002-of-00002.safetensors"), {
      { "lm_head.weight", "BF16", { 8, 4 } },
      { "model.layers.1.mlp.weight", "F32", { 4, 4 } },
    })
    index = {
      metadata = { total_size = 160 },
      weight_map = {
        ["model.embed_tokens.weight"] = "model-00001-of-00002.safetensors",
        ["model.layers.0.mlp.weight"] = "model-00001-of-00002.safetensors",
        ["lm_head.weight"] = "model-00002-of-00002.safetensors",
        ["model.layers.1.mlp.weight"] = "model-00002-of-00002.safetensors",
      },
    }
  end)

  local function write_index()
    local path = tmp("model.safetensors.index.json")
    local f = assert(io.open(path, "w"))
    f:write(json.encode(index, { indent = 2 }))
    f:close()
    return path
  end

  local function index_error()
    local path = write_index()
    local ok, err = pcall(st.read_index, path)
    assert.is_false(ok)
    assert.matches("^moonshard: safetensors: " .. lit(path) .. ": ", err)
    return err
  end

  it("merges the shards in file order, each in offset order", function()
    local tensors, meta = st.read_index(write_index())
    local names = {}
    for i, t in ipairs(tensors) do names[i] = t.name .. " " .. t.dtype end
    assert.same({ "model.embed_tokens.weight bf16", "model.layers.0.mlp.weight bf16",
      "lm_head.weight bf16", "model.layers.1.mlp.weight f32" }, names)
    assert.equal(tmp("model-00002-of-00002.safetensors"), tensors[4].file)
    assert.same({ total_size = 160 }, meta)
    index.metadata = json.null -- as none, like the reference loaders
    assert.same({}, select(2, st.read_index(write_index())))
  end)

  it("refuses a weight_map entry its shard does not hold", function()
    index.weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    assert.matches("weight_map puts tensor 'model.norm.weight' in shard 'model%-00002%-of%-00002.safetensors', which has no such tensor",
      index_error())
  end)

  it("refuses a shard tensor weight_map does not list", function()
    index.weight_map["lm_head.weight"] = nil
    assert.matches("shard 'model%-00002%-of%-00002.safetensors' holds tensor 'lm_head.weight', which weight_map does not list",
      index_error())
  end)

  it("refuses a tensor listed under another shard", function()
    index.weight_map["lm_head.weight"] = "model-00001-of-00002.safetensors"
    assert.matches("weight_map puts tensor 'lm_head.weight' in 'model%-00001%-of%-00002.safetensors', but shard 'model%-00002%-of%-00002.safetensors' holds it",
      index_error())
  end)

  it("refuses a missing shard file", function()
    index.weight_map["model.norm.weight"] = "model-00003-of-00003.safetensors"
    assert.matches("weight_map puts 'model.norm.weight' in shard 'model%-00003%-of%-00003.safetensors', which cannot be opened",
      index_error())
  end)

  it("refuses a malformed index", function()
    index.weight_map = nil
    assert.matches("not a safetensors index: expected an object with a \"weight_map\" object", index_error())
    index.weight_map = { w = 3 }
    assert.matches('weight_map%["w"%] is 3, not a shard file name', index_error())
  end)

  it("makes the module tree of a sharded checkpoint", function()
    local tree = st.tree_from_safetensors(write_index())
    assert.equal("ModuleList", tree:get("model.layers").type)
    assert.equal("f32", tree:get("model.layers.1.mlp").params.weight.dtype)
    assert.equal(8 * 4 * 2 + 4 * 4 * 2, tree:param_count())
  end)
end)

describe("safetensors.tree_from_safetensors", function()
  it("follows the dotted names, with dtypes and shapes as on disk", function()
    local path = write_tensors(tmp("tree.safetensors"), {
      { "lm_head.weight", "BF16", { 10, 4 } },
      { "model.embed_tokens.weight", "BF16", { 10, 4 } },
      { "model.layers.0.self_attn.q_proj.weight", "BF16", { 4, 4 } },
      { "model.layers.1.self_attn.q_proj.weight", "BF16", { 4, 4 } },
      { "model.layers.10.self_attn.q_proj.weight", "BF16", { 4, 4 } },
      { "model.layers.2.self_attn.q_proj.weight", "BF16", { 4, 4 } },
      { "model.layers.2.self_attn.q_proj.bias", "F32", { 4 } },
      { "model.norm.weight", "F32", { 4 } },
    }, { format = "pt" })
    local tree = st.tree_from_safetensors(path)
    local names = {}
    for i, np in ipairs(tree:named_parameters()) do
      names[i] = np[1] .. " " .. np[2].dtype .. " [" .. table.concat(np[2].shape, ",") .. "]"
    end
    assert.same({
      "lm_head.weight bf16 [10,4]",
      "model.embed_tokens.weight bf16 [10,4]",
      "model.layers.0.self_attn.q_proj.weight bf16 [4,4]",
      "model.layers.1.self_attn.q_proj.weight bf16 [4,4]",
      "model.layers.2.self_attn.q_proj.weight bf16 [4,4]",
      "model.layers.2.self_attn.q_proj.bias f32 [4]",
      "model.layers.10.self_attn.q_proj.weight bf16 [4,4]",
      "model.norm.weight f32 [4]",
    }, names)
    assert.equal("ModuleList", tree:get("model.layers").type)
    assert.same({ "0", "1", "2", "10" }, tree:get("model.layers").child_order)
    assert.equal("Module", tree:get("model").type)
    assert.equal("Module", tree:get("model.layers.2.self_attn").type)
    assert.same({ format = "pt" }, tree.attrs.metadata)
  end)

  it("types Automodel's grouped experts, and only them, as GroupedExperts", function()
    local tree = st.tree({
      { name = "a.mlp.experts.gate_and_up_projs", dtype = "bf16", shape = { 8, 4, 6 } },
      { name = "a.mlp.experts.down_projs", dtype = "bf16", shape = { 8, 3, 4 } },
      { name = "b.experts.w", dtype = "bf16", shape = { 8, 4 } },          -- 2-D, top-level name
      { name = "c.experts.up", dtype = "bf16", shape = { 8, 4, 6 } },      -- expert counts differ
      { name = "c.experts.down", dtype = "bf16", shape = { 4, 3, 4 } },
      { name = "d.experts.bias", dtype = "f32", shape = { 8 } },           -- 1-D
      { name = "e.experts.0.w1.weight", dtype = "bf16", shape = { 6, 4 } }, -- per-expert modules
      { name = "e.experts.1.w1.weight", dtype = "bf16", shape = { 6, 4 } },
      { name = "f.shared_experts.w", dtype = "bf16", shape = { 8, 4 } },   -- not named experts
    })
    assert.equal("GroupedExperts", tree:get("a.mlp.experts").type)
    assert.equal("GroupedExperts", tree:get("b.experts").type)
    assert.equal("Module", tree:get("c.experts").type)
    assert.equal("Module", tree:get("d.experts").type)
    assert.equal("ModuleList", tree:get("e.experts").type)
    assert.equal("Module", tree:get("f.shared_experts").type)
    assert.equal("Module", tree:get("a.mlp").type)
  end)

  it("makes buffers of the tensors models keep as buffers, freezes integer ones, records dtypes", function()
    local tensors = {
      { name = "mlp.gate.weight", dtype = "bf16", shape = { 8, 4 } },
      { name = "mlp.gate.e_score_correction_bias", dtype = "f32", shape = { 8 } },
      { name = "mlp.gate.tokens_per_expert", dtype = "i64", shape = { 8 } },
    }
    local gate = st.tree(tensors):get("mlp.gate")
    assert.is_true(gate.params.weight.requires_grad)
    assert.equal("bf16", gate.params.weight.checkpoint_dtype)
    assert.is_nil(gate.params.e_score_correction_bias)
    assert.same({ { 8 }, "f32", "f32" }, { gate.buffers.e_score_correction_bias.shape,
      gate.buffers.e_score_correction_bias.dtype, gate.buffers.e_score_correction_bias.checkpoint_dtype })
    assert.is_false(gate.params.tokens_per_expert.requires_grad)
    -- a host's parameters (the embedding API) are all parameters, and no checkpoint's
    local host = st.tree(tensors, "host model", { host = true }):get("mlp.gate")
    assert.equal("f32", host.params.e_score_correction_bias.dtype)
    assert.is_nil(host.params.weight.checkpoint_dtype)
    assert.same({}, host.buffer_order)
  end)

  it("refuses names that are both a parameter and a module, or have empty segments", function()
    local p = write_tensors(tmp("clash.safetensors"), { { "a.b", "F32", { 1 } }, { "a.b.c", "F32", { 1 } } })
    assert.matches("^moonshard: safetensors: " .. lit(p) .. ": 'a.b' is both a parameter and a module %(tensor 'a.b.c'%)",
      select(2, pcall(st.tree_from_safetensors, p)))
    p = write_tensors(tmp("clash.safetensors"), { { "a.b.c", "F32", { 1 } }, { "a.b", "F32", { 1 } } })
    assert.matches("'a.b' is both a parameter and a module %(tensor 'a.b'%)",
      select(2, pcall(st.tree_from_safetensors, p)))
    p = write_tensors(tmp("empty_segment.safetensors"), { { "a..b", "F32", { 1 } } })
    assert.matches("tensor name 'a..b' has an empty segment", select(2, pcall(st.tree_from_safetensors, p)))
  end)
end)
