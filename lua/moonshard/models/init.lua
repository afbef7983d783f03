-- moonshard.models: module trees from Hugging Face config.json files.
--
-- architectures[0] of the config picks the builder; each builder is a Lua file returning
-- function(cfg) -> tree, where cfg is a moonshard.models.common config reader.  Users add
-- architectures by adding to M.builders (a module name or a function).

local json = require "moonshard.json"
local C = require "moonshard.models.common"
local module = require "moonshard.module"

local M = {}

M.builders = {
  LlamaForCausalLM = "moonshard.models.llama",
  MistralForCausalLM = "moonshard.models.mistral",
  Qwen2ForCausalLM = "moonshard.models.qwen2",
  Qwen3ForCausalLM = "moonshard.models.qwen3",
  Gemma2ForCausalLM = "moonshard.models.gemma2",
  Gemma3ForCausalLM = "moonshard.models.gemma3",
  MixtralForCausalLM = "moonshard.models.mixtral",
  Qwen3MoeForCausalLM = "moonshard.models.qwen3_moe",
  DeepseekV3ForCausalLM = "moonshard.models.deepseek_v3",
  Inkling2ForCausalLM = "moonshard.models.inkling2",
  DeepseekV4ForCausalLM = "moonshard.models.deepseek_v4",
}

local function fail(source, fmt, ...)
  error(string.format("moonshard: models: %s: " .. fmt, source, ...), 0)
end

local function known()
  local names = {}
  for name in pairs(M.builders) do names[#names + 1] = name end
  table.sort(names)
  return table.concat(names, ", ")
end

--- from_config(config, source?) -> module tree.  config: a config table or the path of a
-- config.json; source names it in errors (default: the path, or "config table").
function M.from_config(config, source)
  if type(config) == "string" then
    source = source or config
    local util = require "moonshard.util"
    local text, err, opened = util.read_file(config, "json")
    if not text then
      fail(source, opened and "cannot read the config: %s" or "cannot open the config: %s",
        opened and err or util.io_reason(config, err))
    end
    config = json.decode(text, source)
  end
  source = source or "config table"
  if type(config) ~= "table" or config == json.null or getmetatable(config) == json.array_mt then
    fail(source, "a config is a JSON object, got %s", type(config) == "table" and "an array or null" or type(config))
  end
  local archs = config.architectures
  if type(archs) ~= "table" or type(archs[1]) ~= "string" then
    fail(source, "config key 'architectures' is missing or not a list of names (known: %s)", known())
  end
  local builder = M.builders[archs[1]]
  if not builder then
    fail(source, "unknown architecture '%s' (known: %s); plan from the checkpoint instead: " ..
      "--safetensors FILE|INDEX|DIR takes the names, shapes and dtypes from its safetensors headers",
      require("moonshard.util").short_name(archs[1]), known())
  end
  if type(builder) == "string" then builder = require(builder) end
  local tree = builder(C.config(config, source, archs[1]))
  -- what the planner counts exactly (module.MAX_COUNT): refused here, by name
  for _, np in ipairs(tree:named_parameters()) do
    local p = np[2]
    if p.numel > module.MAX_COUNT then
      local dims = {}
      for i, d in ipairs(p.shape) do dims[i] = string.format("%d", d) end -- each at most 2^62
      fail(source, "%s: parameter %s of shape [%s] has more than 2^53 elements", archs[1], np[1],
        table.concat(dims, ", "))
    end
  end
  return tree
end

--- The routed-expert count of a tree's MoE blocks (attrs.n_experts, which every builder
-- sets from its config's own key), nil when it has none: an all-dense model.
function M.routed_experts(tree)
  for _, nm in ipairs(tree:named_modules()) do
    if nm[2].type == "MoE" and nm[2].attrs.n_experts then return nm[2].attrs.n_experts end
  end
  return nil
end

return M
