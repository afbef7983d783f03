-- moonshard.hf_cache: a model's files in the local Hugging Face cache, for `moonshard plan
-- --model ORG/NAME`.  Nothing is downloaded: the cache is read where huggingface_hub (and so
-- transformers) keeps it, with the precedence of huggingface_hub's constants.py:
--   $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its older name), else $HF_HOME/hub, else
--   $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub
-- (a leading ~ expanded to $HOME; a variable set to the empty string counts as unset), and
-- its layout: <cache>/models--ORG--NAME/snapshots/<revision>/config.json, with refs/main
-- holding the revision the main branch was at when it was last downloaded.

local util = require "moonshard.util"

local M = {}

--- check_repo_id(id) -> true | nil, reason: whether id is a Hub model id as
-- huggingface_hub's validate_repo_id accepts it: NAME or ORG/NAME, each part 1 to 96 of
-- letters, digits, '-', '_' and '.', starting and ending with a letter, digit or '_'; no
-- "--" or ".." anywhere (the cache folder joins the parts with "--"), not ending in ".git".
function M.check_repo_id(id)
  if type(id) ~= "string" or id == "" then return nil, "is empty" end
  local parts = {}
  for part in (id .. "/"):gmatch("([^/]*)/") do parts[#parts + 1] = part end
  if #parts > 2 then return nil, "has more than one '/'" end
  for _, part in ipairs(parts) do
    if part == "" then return nil, "has an empty part" end
    if #part > 96 then return nil, "has a part longer than 96 characters" end
    if part:find("[^%w_.-]") then return nil, "holds a character other than letters, digits, '-', '_' and '.'" end
    if part:find("^[.-]") or part:find("[.-]$") then return nil, "has a part that starts or ends with '-' or '.'" end
  end
  if id:find("--", 1, true) or id:find("..", 1, true) then return nil, "holds '--' or '..'" end
  if id:sub(-4) == ".git" then return nil, "ends in '.git'" end
  return true
end

local function expand_home(path, home)
  if path == "~" or path:sub(1, 2) == "~/" then
    if not home then return nil end
    return home .. path:sub(2)
  end
  return path
end

--- cache_dir(getenv?) -> dir, how | nil, reason.  The hub cache huggingface_hub would use;
-- how says what chose it ("$HF_HOME/hub, as HF_HUB_CACHE and HUGGINGFACE_HUB_CACHE are unset").
function M.cache_dir(getenv)
  getenv = getenv or os.getenv
  local function env(name)
    local v = getenv(name)
    if v == "" then return nil end
    return v
  end
  local home = env("HOME")
  local unset = {}
  local function pick(value, rel, what)
    local dir = expand_home(value, home)
    if not dir then return nil, what .. " is '" .. util.short_name(value) .. "' and HOME is not set" end
    if rel then dir = dir .. rel end
    local how = what
    if #unset == 1 then how = how .. ", as " .. unset[1] .. " is unset"
    elseif #unset > 1 then
      how = how .. ", as " .. table.concat(unset, ", ", 1, #unset - 1) .. " and " .. unset[#unset] .. " are unset"
    end
    return dir, how
  end
  for _, name in ipairs({ "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE" }) do
    if env(name) then return pick(env(name), nil, "$" .. name) end
    unset[#unset + 1] = name
  end
  if env("HF_HOME") then return pick(env("HF_HOME"), "/hub", "$HF_HOME/hub") end
  unset[#unset + 1] = "HF_HOME"
  if env("XDG_CACHE_HOME") then
    return pick(env("XDG_CACHE_HOME"), "/huggingface/hub", "$XDG_CACHE_HOME/huggingface/hub")
  end
  unset[#unset + 1] = "XDG_CACHE_HOME"
  if not home then return nil, "HOME is not set (nor " .. table.concat(unset, ", ") .. ")" end
  return pick("~/.cache/huggingface/hub", nil, "~/.cache/huggingface/hub")
end

local function is_dir(path)
  local stat = util.file_stat_fn()
  if stat then return stat(path) == "directory" end
  local f = io.open(path .. "/.", "r")
  if f then f:close() end
  return f ~= nil
end

-- The snapshot folders of repo, newest (last modified) first: `ls -t`, as moonshard.policy
-- lists a policy directory (Lua has no directory listing).  Names that are no revision
-- (other than letters, digits, '-', '_', '.') are left out.
local function snapshots(dir)
  if not io.popen then return {} end
  local ls = io.popen("ls -1t -- '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  if not ls then return {} end
  local out = {}
  for name in ls:lines() do
    if name:find("^[%w_.-]+$") and name ~= "." and name ~= ".." and is_dir(dir .. "/" .. name) then
      out[#out + 1] = name
    end
  end
  ls:close()
  return out
end

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

--- snapshot(id, getenv?) -> info | nil, message.  The snapshot folder of model `id` (ORG/NAME)
-- in the cache: info = {dir = snapshot folder, revision, repo = models--ORG--NAME folder,
-- cache, how (what chose the cache), note (why this revision, when refs/main did not say)}.
-- The message names every place looked at.
function M.snapshot(id, getenv)
  local ok, why = M.check_repo_id(id)
  if not ok then return nil, string.format("'%s' is no Hugging Face model id (ORG/NAME): it %s", util.short_name(id), why) end
  local cache, how = M.cache_dir(getenv)
  if not cache then return nil, "cannot find the Hugging Face cache: " .. how end
  local looked = { string.format("the Hugging Face cache %s: %s", cache, how) }
  local function fail(fmt, ...)
    looked[#looked + 1] = string.format(fmt, ...)
    return nil, string.format("%s is not in the local Hugging Face cache (nothing is downloaded); looked at:\n  %s\n" ..
      "(download it with `hf download %s`, or give --config or --safetensors)", id, table.concat(looked, ";\n  "), id)
  end
  local repo = cache .. "/models--" .. id:gsub("/", "--")
  if not is_dir(repo) then return fail("%s: no such folder", repo) end
  local ref = repo .. "/refs/main"
  if util.exists(ref) then
    local text, err, opened = util.read_file(ref, "json")
    if not text then return fail("%s: %s", ref, opened and err or util.io_reason(ref, err)) end
    local rev = trim(text)
    if not rev:find("^[%w_.-]+$") or rev == "." or rev == ".." then
      return fail("%s: holds '%s', not a revision", ref, util.short_name(rev))
    end
    local dir = repo .. "/snapshots/" .. rev
    if not is_dir(dir) then return fail("%s names revision %s; %s: no such folder", ref, rev, dir) end
    return { dir = dir, revision = rev, repo = repo, cache = cache, how = how, looked = looked, from_ref = true }
  end
  local revs = snapshots(repo .. "/snapshots")
  if #revs == 0 then
    return fail("%s: no refs/main; %s/snapshots: no snapshot folder", repo, repo)
  end
  local info = { dir = repo .. "/snapshots/" .. revs[1], revision = revs[1], repo = repo, cache = cache, how = how,
    looked = looked }
  if #revs > 1 then
    info.note = string.format("%s has no refs/main and %d snapshots (%s): using %s, the one modified last", repo, #revs,
      table.concat(revs, ", ", 1, math.min(#revs, 5)) .. (#revs > 5 and ", ..." or ""), revs[1])
  end
  return info
end

--- find(id, file, getenv?) -> path, info | nil, message: `file` (e.g. config.json) of model
-- id's snapshot.
function M.find(id, file, getenv)
  local info, err = M.snapshot(id, getenv)
  if not info then return nil, err end
  local path = info.dir .. "/" .. file
  if not util.exists(path) then
    info.looked[#info.looked + 1] = string.format("revision %s (%s): %s: no such file", info.revision,
      info.from_ref and "refs/main" or "no refs/main: the snapshot modified last", path)
    return nil, string.format("%s is in the local Hugging Face cache without %s (nothing is downloaded); looked at:" ..
      "\n  %s\n(download it with `hf download %s %s`)", id, file, table.concat(info.looked, ";\n  "), id, file)
  end
  return path, info
end

return M
