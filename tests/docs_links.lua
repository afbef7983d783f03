-- docs_links.lua: every link of README.md and docs/*.md resolves inside the repository.
--
--   lua5.4 tests/docs_links.lua        (from the repository root; ctest docs_links)
--
-- A markdown link [text](target) whose target is not a URL must name a file or folder of
-- the repository (relative to the document), and its #anchor, when it has one, a heading of
-- the target (GitHub's slugs: lower case, punctuation dropped, spaces to dashes); a path in
-- backticks that starts with a top folder of the repository must exist.  The
-- documents name no design notes kept outside the repository.  Exits 1 listing every
-- problem, with the document and line.

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local text = f:read("a")
  f:close()
  return text
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return os.rename(path, path) ~= nil -- a folder
end

local function slug(heading)
  local s = heading:lower():gsub("`", "")
  s = s:gsub("[^%w%- _]", ""):gsub(" ", "-")
  return s
end

local anchors_of = {}
local function anchors(path)
  if anchors_of[path] then return anchors_of[path] end
  local set, seen = {}, {}
  local text = read(path) or ""
  local fenced = false
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    if line:match("^```") then fenced = not fenced end
    local h = not fenced and line:match("^#+%s+(.-)%s*$")
    if h then
      local s = slug(h)
      local n = seen[s]
      set[n and (s .. "-" .. n) or s] = true
      seen[s] = (n or 0) + 1
    end
  end
  anchors_of[path] = set
  return set
end

local docs = { "README.md" }
local p = io.popen("ls docs/*.md 2>/dev/null")
for name in p:lines() do docs[#docs + 1] = name end
p:close()

local problems, links, paths = {}, 0, 0
-- the repository's top folders: a backticked path starting with one is checked
local ROOTS = { core = true, lua = true, policies = true, examples = true, docs = true, tests = true, bench = true,
  tools = true, cmake = true }
local FORBIDDEN = { "DESIGN.md", "SEMANTICS.md", "PERF.md", "STYLE.md", "../shared" }
for _, doc in ipairs(docs) do
  local text = assert(read(doc), "cannot read " .. doc)
  local dir = doc:match("^(.*)/[^/]*$") or "."
  local n, fenced = 0, false
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    if line:match("^```") then fenced = not fenced end
    for _, word in ipairs(FORBIDDEN) do
      if line:find(word, 1, true) then
        problems[#problems + 1] = string.format("%s:%d: names %s, which is not in the repository", doc, n, word)
      end
    end
    if not fenced then
      -- a repository path in backticks (`policies/fsdp2_default.lua`, `tests/reference/`)
      for code in line:gmatch("`([^`]+)`") do
        local first = code:match("^([%w_.-]+)/")
        if ROOTS[first] and not code:find("[%s*<>${}|]") then
          local path = code:gsub(":%d+$", "")
          paths = paths + 1
          if not exists(path) then
            problems[#problems + 1] = string.format("%s:%d: names %s: no such file in the repository", doc, n, code)
          end
        end
      end
      for target in line:gmatch("%]%(([^)%s]+)%)") do
        if not target:match("^%a[%w+.-]*:") then -- not a URL (https:, mailto:)
          links = links + 1
          local file, anchor = target:match("^([^#]*)#?(.*)$")
          local path = file == "" and doc or (dir .. "/" .. file)
          if not exists(path) then
            problems[#problems + 1] = string.format("%s:%d: link to %s: no such file in the repository", doc, n, target)
          elseif anchor ~= "" and path:match("%.md$") and not anchors(path)[anchor] then
            problems[#problems + 1] = string.format("%s:%d: link to %s: %s has no heading #%s", doc, n, target, path,
              anchor)
          end
        end
      end
    end
  end
end

if #problems > 0 then
  io.stderr:write(table.concat(problems, "\n"), "\n")
  io.stderr:write(string.format("docs_links: %d problem%s in %d documents\n", #problems, #problems == 1 and "" or "s",
    #docs))
  os.exit(1)
end
print(string.format("docs_links: %d documents, %d links and %d repository paths, all resolve", #docs, links, paths))
