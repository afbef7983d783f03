-- checkpoint_export_hf_spec.lua: checkpoint.export_hf with expert_names (and the CLI's
-- export --per-expert): grouped experts written as Hugging Face's per-expert tensors.  The
-- tiny Qwen3-MoE checkpoint (tests/reference/data/hf_checkpoints) loaded by checkpoint_hf,
-- exported, loaded again into fresh units bit for bit, every exported tensor the original's
-- bytes (tests/lua/scripts/ckpt_export_experts.lua); and, with the venv, transformers'
-- from_pretrained loading the export with the original's tensors.
local S = require "support"

local SCRIPT = "tests/lua/scripts/ckpt_export_experts.lua"
local QWEN = "tests/reference/data/hf_checkpoints/qwen3_moe_tiny"
local PY = S.PYTHON

local function tmpdir()
  local p = os.tmpname()
  os.remove(p)
  assert(os.execute("mkdir -p " .. S.quote(p)))
  return p
end

local function export(n, mesh, out)
  local r = S.run({ "-n", tostring(n), SCRIPT, mesh, out })
  assert.equal("", r.err)
  assert.equal(0, r.code)
  for rank = 0, n - 1 do
    assert.matches("rank " .. rank .. ": round trip %d+ params, 0 differing elements", r.out)
  end
  assert.matches("export: 35 tensors, 35 same bytes as the original, names equal true", r.out)
end

describe("export_hf with per-expert names", function()
  local root
  setup(function() root = tmpdir() end)
  teardown(function() S.run_with("rm", { "-rf", root }) end)

  for _, case in ipairs({ { 1, "dp_shard=1" }, { 2, "dp_shard=2,ep=2" }, { 4, "dp_shard=4" }, { 4, "dp_shard=4,ep=2" } }) do
    it("round-trips through load_hf bit for bit and gives the original's bytes on " .. case[2], function()
      export(case[1], case[2], root .. "/" .. case[2]:gsub("[^%w]", "_"))
    end)
  end

  it("the CLI's export --per-expert writes the per-expert names", function()
    local saved, out = root .. "/saved", root .. "/cli"
    local code = [[
      local QWEN = "tests/reference/data/hf_checkpoints/qwen3_moe_tiny"
      local json = require "moonshard.json"
      local f = assert(io.open(QWEN .. "/config.json"))
      local config = json.decode(f:read("a"))
      f:close()
      local tree = require("moonshard.models").from_config(config, QWEN .. "/config.json")
      local policy = require("moonshard.policy")
      local loaded = policy.load("policies/fsdp2_default.lua", { modules = policy.host_modules() })
      local plan = require("moonshard.plan").plan(tree, require("moonshard.mesh_context").new("dp_shard=2"),
        policy.entry_point(loaded, "policies/fsdp2_default.lua"))
      local state = require("moonshard.runtime").materialize(plan)
      require("moonshard.checkpoint_hf").load_hf(state, QWEN)
      require("moonshard.checkpoint").save(state, arg[1], { step = 1, progress = false })
    ]]
    local r = S.run({ "-n", "2", "-e", code, saved })
    assert.equal(0, r.code)
    r = S.run({ "checkpoint", "export", saved, "--to", out, "--per-expert" })
    assert.equal(0, r.code)
    local names = {}
    for _, t in ipairs(require("moonshard.safetensors").read_header(out .. "/model.safetensors")) do names[t.name] = t end
    assert.same({ 20, 12 }, names["model.layers.1.mlp.experts.3.down_proj.weight"].shape)
    assert.same({ 12, 20 }, names["model.layers.1.mlp.experts.0.gate_proj.weight"].shape)
    assert.is_nil(names["model.layers.1.mlp.experts.gate_and_up_projs"])
    r = S.run({ "checkpoint", "--help" })
    assert.matches("%-%-per%-expert", r.out)
  end)

  it("is loaded by transformers' from_pretrained with the original's tensors", function()
    local py, why = S.python_with("transformers, torch")
    if not py then
      pending(why)
      return
    end
    local out = root .. "/for_transformers"
    export(4, "dp_shard=4,ep=2", out)
    assert.equal(0, S.run_with("cp", { QWEN .. "/config.json", out .. "/config.json" }).code)
    local code = [[
import sys, torch
from transformers import AutoModelForCausalLM
a = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
b, info = AutoModelForCausalLM.from_pretrained(sys.argv[2], torch_dtype=torch.bfloat16, output_loading_info=True)
assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
sa, sb = a.state_dict(), b.state_dict()
assert sa.keys() == sb.keys(), set(sa) ^ set(sb)
bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
print("transformers loaded", len(sa), "tensors,", len(bad), "differ")
]]
    local r = S.run_with(PY, { "-c", code, QWEN, out })
    assert.equal(0, r.code)
    assert.matches("transformers loaded %d+ tensors, 0 differ", r.out)
  end)
end)
