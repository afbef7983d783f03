-- islands.lua: how the FP32-island policies (inkling2/, deepseek_v4/) recognise the modules
-- of their fp32_modules.lua, shared by both (not a policy itself).

local M = {}

M.CHECKPOINT = "_checkpoint_wrapped_module"

--- A dotted name with every activation-checkpoint segment removed.
function M.strip_checkpoint(name)
  local parts = {}
  for part in name:gmatch("[^.]+") do
    if part ~= M.CHECKPOINT then parts[#parts + 1] = part end
  end
  return table.concat(parts, ".")
end

--- true when `name`, checkpoint segments removed, equals an entry of `entries` or ends with
-- "." .. entry (dot-bounded: xattn_query does not match attn_query).
function M.names_one_of(name, entries)
  local n = M.strip_checkpoint(name)
  for _, entry in ipairs(entries) do
    if n == entry or n:sub(-(#entry + 1)) == "." .. entry then return true end
  end
  return false
end

return M
