-- hf_cache_spec.lua: `moonshard plan --model ORG/NAME` and moonshard.hf_cache: a model's
-- config.json (or, with --checkpoint, its safetensors headers) found in a local Hugging Face
-- cache, here a fake one built in a temporary folder with huggingface_hub's layout
-- (models--ORG--NAME/{refs/main, snapshots/<rev>/, blobs/}, snapshot files linked to blobs).
local hf = require "moonshard.hf_cache"
local S = require "support"

local POLICY = "policies/fsdp2_default.lua"
local tmpdir

local function sh(cmd) assert(os.execute(cmd), cmd) end
local function lit(s) return (s:gsub("%p", "%%%0")) end

-- A cache folder holding model id's snapshots: revs = {rev = {file = text or a table of
-- safetensors tensors}}, ref = what refs/main holds (none when nil); files are blobs that
-- the snapshot links to, as huggingface_hub stores them.
local function make_model(cache, id, revs, ref)
  local repo = cache .. "/models--" .. id:gsub("/", "--")
  sh("mkdir -p " .. S.quote(repo .. "/blobs") .. " " .. S.quote(repo .. "/refs"))
  local n = 0
  for rev, files in pairs(revs) do
    local dir = repo .. "/snapshots/" .. rev
    sh("mkdir -p " .. S.quote(dir))
    for name, content in pairs(files) do
      n = n + 1
      local blob = repo .. "/blobs/" .. rev .. n
      if type(content) == "table" then S.write_safetensors(blob, content) else S.write_file(blob, content) end
      sh("ln -s " .. S.quote("../../blobs/" .. rev .. n) .. " " .. S.quote(dir .. "/" .. name))
    end
  end
  if ref then S.write_file(repo .. "/refs/main", ref) end
  return repo
end

local function config_of(path) return S.read_file(path) end

local function plan(args, cache)
  local full = { "plan", "--mesh", "dp_shard=2", "--policy", POLICY }
  for _, a in ipairs(args) do full[#full + 1] = a end
  return S.run(full, { HF_HUB_CACHE = cache })
end

setup(function()
  tmpdir = os.tmpname()
  os.remove(tmpdir)
  sh("mkdir -p " .. S.quote(tmpdir))
end)

teardown(function() os.execute("rm -rf " .. S.quote(tmpdir)) end)

describe("hf_cache.check_repo_id", function()
  it("accepts the Hub's ids, NAME or ORG/NAME, as huggingface_hub's validate_repo_id does", function()
    for _, id in ipairs({ "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "google/gemma-3-1b-it", "gpt2",
      "mistralai/Mistral-7B-v0.3", "a_b/c.d", "Qwen/Qwen2.5-7B" }) do
      assert.is_true(hf.check_repo_id(id), id)
    end
  end)

  it("refuses the others and says why", function()
    for id, why in pairs({ [""] = "is empty", ["a/b/c"] = "has more than one '/'", ["/b"] = "has an empty part",
      ["a/"] = "has an empty part", ["a/b c"] = "holds a character other than",
      ["../etc"] = "has a part that starts or ends with", ["a/-b"] = "has a part that starts or ends with",
      ["a/b."] = "has a part that starts or ends with", ["a--b/c"] = "holds '--' or '..'",
      ["a/b..c"] = "holds '--' or '..'", ["a/b.git"] = "ends in '.git'", [string.rep("x", 97)] = "longer than 96",
      ["a\0b"] = "holds a character other than" }) do
      local ok, reason = hf.check_repo_id(id)
      assert.is_nil(ok, id)
      assert.matches(why, reason, 1, true)
    end
  end)
end)

describe("hf_cache.cache_dir", function()
  local function env(t) return function(k) return t[k] end end

  it("takes huggingface_hub's precedence: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, ~", function()
    local all = { HF_HUB_CACHE = "/a", HUGGINGFACE_HUB_CACHE = "/b", HF_HOME = "/c", XDG_CACHE_HOME = "/d", HOME = "/h" }
    assert.same({ "/a", "$HF_HUB_CACHE" }, { hf.cache_dir(env(all)) })
    all.HF_HUB_CACHE = nil
    assert.same({ "/b", "$HUGGINGFACE_HUB_CACHE, as HF_HUB_CACHE is unset" }, { hf.cache_dir(env(all)) })
    all.HUGGINGFACE_HUB_CACHE = ""  -- empty counts as unset
    assert.same({ "/c/hub", "$HF_HOME/hub, as HF_HUB_CACHE and HUGGINGFACE_HUB_CACHE are unset" },
      { hf.cache_dir(env(all)) })
    all.HF_HOME = nil
    assert.same({ "/d/huggingface/hub",
      "$XDG_CACHE_HOME/huggingface/hub, as HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE and HF_HOME are unset" },
      { hf.cache_dir(env(all)) })
    all.XDG_CACHE_HOME = nil
    assert.equal("/h/.cache/huggingface/hub", (hf.cache_dir(env(all))))
    assert.equal("/h/x/hub", (hf.cache_dir(env({ HF_HOME = "~/x", HOME = "/h" }))))
    assert.equal("/h/y", (hf.cache_dir(env({ HF_HUB_CACHE = "~/y", HOME = "/h" }))))
    assert.same({ nil, "HOME is not set (nor HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)" },
      { hf.cache_dir(env({})) })
    assert.same({ nil, "$HF_HOME/hub is '~/x' and HOME is not set" }, { hf.cache_dir(env({ HF_HOME = "~/x" })) })
  end)
end)

describe("moonshard plan --model ORG/NAME", function()
  it("plans from the config.json of the revision refs/main names, named ORG/NAME", function()
    local cache = tmpdir .. "/hub1"
    make_model(cache, "Qwen/Qwen3-8B", {
      aaaa = { ["config.json"] = config_of("examples/configs/qwen3_8b.json") },
      bbbb = { ["config.json"] = config_of("examples/configs/mistral_7b_v0.3.json") },
    }, "aaaa\n")
    local r = plan({ "--model", "Qwen/Qwen3-8B" }, cache)
    assert.equal(0, r.code, r.err)
    assert.matches("model   Qwen/Qwen3-8B (Qwen3ForCausalLM): 8,190,735,360 params", r.out, 1, true)
    assert.equal("", r.err)
    -- as --config gives it
    local c = S.run({ "plan", "--mesh", "dp_shard=2", "--policy", POLICY, "--config", "examples/configs/qwen3_8b.json",
      "--name", "Qwen/Qwen3-8B" })
    assert.equal(c.out, r.out)
    r = plan({ "--model=Qwen/Qwen3-8B", "--name", "mine", "--json" }, cache)
    assert.equal(0, r.code, r.err)
    assert.matches('"name":"mine"', r.out, 1, true)
  end)

  it("takes the only snapshot when there is no refs/main, else the one modified last, and says so", function()
    local cache = tmpdir .. "/hub2"
    local repo = make_model(cache, "mistralai/Mistral-7B-v0.3",
      { old = { ["config.json"] = config_of("examples/configs/qwen3_8b.json") } })
    local r = plan({ "--model", "mistralai/Mistral-7B-v0.3" }, cache)
    assert.equal(0, r.code, r.err)
    assert.matches("(Qwen3ForCausalLM)", r.out, 1, true)
    assert.equal("", r.err)
    make_model(cache, "mistralai/Mistral-7B-v0.3",
      { new = { ["config.json"] = config_of("examples/configs/mistral_7b_v0.3.json") } })
    sh("touch -h -d '2020-01-01' " .. S.quote(repo .. "/snapshots/old"))
    sh("touch -h -d '2024-01-01' " .. S.quote(repo .. "/snapshots/new"))
    r = plan({ "--model", "mistralai/Mistral-7B-v0.3" }, cache)
    assert.equal(0, r.code, r.err)
    assert.matches("(MistralForCausalLM)", r.out, 1, true)
    assert.equal("moonshard plan: note: " .. repo .. " has no refs/main and 2 snapshots (new, old): using new, " ..
      "the one modified last\n", r.err)
  end)

  it("says every place it looked when the model is not there", function()
    local cache = tmpdir .. "/hub3"
    sh("mkdir -p " .. S.quote(cache))
    local r = plan({ "--model", "google/gemma-3-1b-it" }, cache)
    assert.equal(1, r.code)
    assert.equal("moonshard plan: error: google/gemma-3-1b-it is not in the local Hugging Face cache (nothing is " ..
      "downloaded); looked at:\n  the Hugging Face cache " .. cache .. ": $HF_HUB_CACHE;\n  " .. cache ..
      "/models--google--gemma-3-1b-it: no such folder\n(download it with `hf download google/gemma-3-1b-it`, or " ..
      "give --config or --safetensors)\n", r.err)
    assert.equal("", r.out)
    -- refs/main names a revision that is not there: no other snapshot is taken instead
    local repo = make_model(cache, "a/b", { x = { ["config.json"] = "{}" } }, "y")
    r = plan({ "--model", "a/b" }, cache)
    assert.equal(1, r.code)
    assert.matches("looked at:\n  the Hugging Face cache " .. lit(cache) .. ": %$HF_HUB_CACHE;\n  " .. lit(repo) ..
      "/refs/main names revision y; " .. lit(repo) .. "/snapshots/y: no such folder\n", r.err)
    -- a snapshot without config.json
    repo = make_model(cache, "c/d", { z = { ["tokenizer.json"] = "{}" } }, "z")
    r = plan({ "--model", "c/d" }, cache)
    assert.equal(1, r.code)
    assert.matches("c/d is in the local Hugging Face cache without config.json (nothing is downloaded); looked at:\n" ..
      "  the Hugging Face cache " .. cache .. ": $HF_HUB_CACHE;\n  revision z (refs/main): " .. repo ..
      "/snapshots/z/config.json: no such file\n(download it with `hf download c/d config.json`)", r.err, 1, true)
    -- no snapshot at all
    sh("mkdir -p " .. S.quote(cache .. "/models--e--f/snapshots"))
    r = plan({ "--model", "e/f" }, cache)
    assert.equal(1, r.code)
    assert.matches("models--e--f: no refs/main; " .. cache .. "/models--e--f/snapshots: no snapshot folder", r.err, 1,
      true)
  end)

  it("reads the cache's files as any input: regular files only, within the limits", function()
    local cache = tmpdir .. "/hub4"
    local repo = make_model(cache, "f/g", { r1 = {} }, "r1")
    sh("mkfifo " .. S.quote(repo .. "/snapshots/r1/config.json"))
    local r = plan({ "--model", "f/g" }, cache)
    assert.equal(1, r.code)
    assert.matches("config.json: is a FIFO (named pipe), not a regular file", r.err, 1, true)
    repo = make_model(cache, "h/i", { r1 = {} }, "r1")
    sh("ln -s /dev/zero " .. S.quote(repo .. "/snapshots/r1/config.json"))
    r = plan({ "--model", "h/i" }, cache)
    assert.equal(1, r.code)
    assert.matches("is a character device, not a regular file", r.err, 1, true)
    -- refs/main must hold a revision, not a path
    make_model(cache, "j/k", { r1 = { ["config.json"] = "{}" } }, "../../../etc")
    r = plan({ "--model", "j/k" }, cache)
    assert.equal(1, r.code)
    assert.matches("refs/main: holds '../../../etc', not a revision", r.err, 1, true)
  end)

  it("plans from the snapshot's safetensors headers with --checkpoint", function()
    local cache = tmpdir .. "/hub5"
    make_model(cache, "tiny/ckpt", { r1 = {
      ["config.json"] = config_of("examples/configs/qwen3_8b.json"),
      ["model.safetensors"] = { { "model.embed_tokens.weight", "BF16", { 16, 8 } }, { "model.layers.0.mlp.down_proj.weight", "BF16", { 8, 8 } },
        { "model.norm.weight", "BF16", { 8 } },
        { "lm_head.weight", "BF16", { 16, 8 } } },
    } }, "r1")
    local r = plan({ "--model", "tiny/ckpt", "--checkpoint" }, cache)
    assert.equal(0, r.code, r.err)
    assert.matches("model   tiny/ckpt", r.out, 1, true)
    assert.matches("328 params", r.out, 1, true)
    make_model(cache, "tiny/nockpt", { r1 = { ["config.json"] = "{}" } }, "r1")
    r = plan({ "--model", "tiny/nockpt", "--checkpoint" }, cache)
    assert.equal(1, r.code)
    assert.matches("tiny/nockpt: revision r1 (" .. cache .. "/models--tiny--nockpt/snapshots/r1) has neither " ..
      "model.safetensors.index.json nor model.safetensors", r.err, 1, true)
  end)

  it("refuses a malformed id, a second model and --checkpoint alone as usage errors; --help documents it", function()
    local r = plan({ "--model", "a/b/c" }, tmpdir)
    assert.equal(2, r.code)
    assert.matches("--model 'a/b/c' is no Hugging Face model id (ORG/NAME, e.g. Qwen/Qwen3-8B): it has more than one '/'",
      r.err, 1, true)
    r = plan({ "--model", "../x" }, tmpdir)
    assert.equal(2, r.code)
    r = plan({ "--model", "a/b", "--config", "examples/configs/qwen3_8b.json" }, tmpdir)
    assert.equal(2, r.code)
    assert.matches("exactly one of --config FILE, --safetensors PATH or --model ORG/NAME", r.err, 1, true)
    r = plan({ "--checkpoint", "--config", "examples/configs/qwen3_8b.json" }, tmpdir)
    assert.equal(2, r.code)
    assert.matches("--checkpoint goes with --model ORG/NAME", r.err, 1, true)
    r = S.run({ "plan", "--help" })
    assert.equal(0, r.code)
    assert.matches("--model ORG/NAME", r.out, 1, true)
    assert.matches("$HF_HUB_CACHE, else", r.out, 1, true)
    assert.matches("--checkpoint", r.out, 1, true)
  end)
end)
