-- moonshard.plan_compare: `moonshard compare A.json B.json`: two plans (`moonshard plan
-- --json`) side by side, term by term: what each plans (model, mesh, the options that
-- differ), its units, memory per rank (rank 0's and the largest over the ranks the JSON
-- lists, every numeric term it has), communication per step (each kind's count and bytes)
-- and, where the plans carry them, the pipeline and any numeric figure of `time`.  Terms
-- are read from the JSON as it is, so a term that a newer plan adds shows without a change
-- here; a term one plan lacks shows as "-".

local json = require "moonshard.json"
local util = require "moonshard.util"

local M = {}

M.usage = [[
usage: moonshard compare A.json B.json [--json]

Puts two plans made by `moonshard plan --json` side by side, term by term: the model, the
mesh, the options that differ, the units, memory per rank (rank 0's and the largest over
the ranks each JSON lists), communication per step, the pipeline and the step time where
the plans have them.  Each row gives A, B, B - A and B / A.

options:
  --json     write the comparison as JSON: {"moonshard_compare": 1, "a": {...}, "b": {...},
             "terms": [{"section", "name", "a", "b", "diff", "ratio"}]}
  -h, --help print this help and exit

exit status: 0 when both plans were read (however much they differ), 2 on a usage error or a
file that is not a plan's JSON.
]]

local function usage_error(msg)
  io.stderr:write("moonshard compare: " .. msg .. "\n(try 'moonshard compare --help')\n")
  return 2
end

-- A plan JSON from path, or nil and why.
local function load(path)
  local text, err = util.read_file(path, "json")
  if not text then
    err = tostring(err)
    return nil, err:find(path, 1, true) and err or path .. ": " .. err
  end
  local ok, plan = pcall(json.decode, text, path)
  if not ok then return nil, tostring(plan):gsub("^moonshard: ", "") end
  if type(plan) ~= "table" or plan.moonshard_plan ~= 1 then
    return nil, path .. ": not a plan's JSON (made by moonshard plan --json: its first key is \"moonshard_plan\": 1)"
  end
  for _, key in ipairs({ "model", "mesh", "units", "memory", "comm" }) do
    if type(plan[key]) ~= "table" or plan[key] == json.null then
      return nil, path .. ": a plan's JSON without its \"" .. key .. "\" (an object)"
    end
  end
  for _, key in ipairs({ "time", "pipeline", "options" }) do
    if plan[key] ~= nil and plan[key] ~= json.null and type(plan[key]) ~= "table" then
      return nil, string.format("%s: \"%s\" is a %s; a plan's JSON has an object there", path, key, type(plan[key]))
    end
  end
  return plan
end

local function num(v) return type(v) == "number" and v or nil end

local function mesh_text(mesh)
  local parts = {}
  for _, a in ipairs(type(mesh.axes) == "table" and mesh.axes or {}) do
    if type(a) == "table" and num(a.size) and a.size > 1 then parts[#parts + 1] = tostring(a.name) .. "=" .. a.size end
  end
  if num(mesh.ep) and mesh.ep > 1 then parts[#parts + 1] = "ep=" .. mesh.ep end
  return #parts > 0 and table.concat(parts, ",") or "one rank"
end

local function scalar_text(v)
  if v == nil then return "-" end
  if v == json.null then return "none" end
  if type(v) == "table" then return json.encode(v) end
  return tostring(v)
end

-- The sorted numeric keys of t (a table), skipping `skip`.
local function numeric_keys(t, skip)
  local out = {}
  for k, v in pairs(type(t) == "table" and t or {}) do
    if type(k) == "string" and num(v) and not (skip and skip[k]) then out[#out + 1] = k end
  end
  table.sort(out)
  return out
end

-- The union of numeric keys of two tables, in a stable order (a's first, then b's).
local function union_keys(a, b, skip)
  local out, seen = {}, {}
  for _, list in ipairs({ numeric_keys(a, skip), numeric_keys(b, skip) }) do
    for _, k in ipairs(list) do
      if not seen[k] then
        seen[k] = true
        out[#out + 1] = k
      end
    end
  end
  return out
end

-- Every term of the comparison: {section, name, a, b, kind ("bytes", "count", "seconds",
-- "number" or "text")}.
local function terms(A, B)
  local out = {}
  local function add(section, name, a, b, kind) out[#out + 1] = { section = section, name = name, a = a, b = b, kind = kind } end
  add("plan", "model", A.model.name, B.model.name, "text")
  add("plan", "architecture", A.model.architecture, B.model.architecture, "text")
  add("plan", "params", num(A.model.params), num(B.model.params), "count")
  add("plan", "mesh", mesh_text(A.mesh), mesh_text(B.mesh), "text")
  add("plan", "world", num(A.mesh.world), num(B.mesh.world), "count")
  add("plan", "optimizer", A.optimizer, B.optimizer, "text")
  -- the options both plans name, where they differ, and those only one has
  local oa, ob = type(A.options) == "table" and A.options or {}, type(B.options) == "table" and B.options or {}
  local names, seen = {}, {}
  for _, t in ipairs({ oa, ob }) do
    for k in pairs(t) do
      if type(k) == "string" and not seen[k] then
        seen[k] = true
        names[#names + 1] = k
      end
    end
  end
  table.sort(names)
  for _, k in ipairs(names) do
    local a, b = scalar_text(oa[k]), scalar_text(ob[k])
    if a ~= b then add("options that differ", k, a, b, "text") end
  end
  -- the units, by kind
  local kinds, by = {}, { {}, {} }
  for i, P in ipairs({ A, B }) do
    for _, u in ipairs(P.units) do
      local k = type(u) == "table" and tostring(u.kind) or "?"
      if by[1][k] == nil and by[2][k] == nil then kinds[#kinds + 1] = k end
      by[i][k] = (by[i][k] or 0) + 1
    end
  end
  add("units", "units", #A.units, #B.units, "count")
  for _, k in ipairs(kinds) do add("units", k, by[1][k] or 0, by[2][k] or 0, "count") end
  -- packed units (fully_shard's islands), where either plan has one
  local packed = { 0, 0 }
  for i, P in ipairs({ A, B }) do
    for _, u in ipairs(P.units) do
      if type(u) == "table" and type(u.packed) == "table" then packed[i] = packed[i] + 1 end
    end
  end
  if packed[1] + packed[2] > 0 then add("units", "packed", packed[1], packed[2], "count") end
  -- memory per rank: rank 0's, then the largest over the listed ranks, every numeric term
  local ra, rb = A.memory.per_rank or {}, B.memory.per_rank or {}
  local skip = { rank = true }
  local keys = union_keys(ra[1], rb[1], skip)
  for _, k in ipairs(keys) do
    add("memory per rank (rank 0)", k, num((ra[1] or {})[k]), num((rb[1] or {})[k]), "bytes")
  end
  local function largest(list, k)
    local m
    for _, r in ipairs(list) do
      local v = type(r) == "table" and num(r[k])
      if v and (not m or v > m) then m = v end
    end
    return m
  end
  for _, k in ipairs(keys) do
    add("memory per rank (largest of the ranks listed)", k, largest(ra, k), largest(rb, k), "bytes")
  end
  -- communication per step
  local ca, cb = A.comm.per_step or {}, B.comm.per_step or {}
  local cnames, cseen = {}, {}
  for _, t in ipairs({ ca, cb }) do
    for k, v in pairs(t) do
      if type(k) == "string" and type(v) == "table" and not cseen[k] then
        cseen[k] = true
        cnames[#cnames + 1] = k
      end
    end
  end
  table.sort(cnames)
  for _, k in ipairs(cnames) do
    local a, b = ca[k] or {}, cb[k] or {}
    add("communication per step (rank 0)", k .. " count", num(a.count), num(b.count), "count")
    add("communication per step (rank 0)", k .. " bytes", num(a.bytes), num(b.bytes), "bytes")
  end
  -- what packed units saved a step, where either plan has them
  local ka, kb = type(A.comm.packing) == "table" and A.comm.packing, type(B.comm.packing) == "table" and B.comm.packing
  if ka or kb then
    add("communication per step (rank 0)", "collectives saved by packing", num((ka or {}).collectives_saved or 0),
      num((kb or {}).collectives_saved or 0), "count")
  end
  -- the pipeline, where either has one
  local pa, pb = type(A.pipeline) == "table" and A.pipeline or nil, type(B.pipeline) == "table" and B.pipeline or nil
  if pa or pb then
    pa, pb = pa or {}, pb or {}
    add("pipeline", "schedule", pa.schedule, pb.schedule, "text")
    add("pipeline", "stages", pa.stages and #pa.stages or nil, pb.stages and #pb.stages or nil, "count")
    add("pipeline", "split", pa.split, pb.split, "text")
    add("pipeline", "microbatches", num(pa.microbatches), num(pb.microbatches), "count")
  end
  -- any numeric figure of time (an estimate, where the plans were given a device)
  if type(A.time) == "table" or type(B.time) == "table" then
    for _, k in ipairs(union_keys(A.time, B.time)) do
      add("time per step (estimate)", k, num((A.time or {})[k]), num((B.time or {})[k]),
        (k:find("_s$") and not k:find("_per_s$")) and "seconds" or "number")
    end
  end
  return out
end

local function fmt(v, kind)
  if v == nil then return "-" end
  if kind == "text" then return tostring(v) end
  if kind == "bytes" then return util.bytes(v) end
  if kind == "count" then return util.thousands(v) end
  if kind == "seconds" then return string.format("%.4g s", v) end
  return string.format("%.4g", v)
end

local function diff_of(t)
  if type(t.a) ~= "number" or type(t.b) ~= "number" then return nil, nil end
  return t.b - t.a, t.a ~= 0 and t.b / t.a or nil
end

local function signed(d, kind)
  if d == 0 then return "0" end
  local s = fmt(math.abs(d), kind)
  return (d > 0 and "+" or "-") .. s
end

--- The comparison as text.
function M.text(A, B, pa, pb)
  local lines = {}
  local function line(s) lines[#lines + 1] = s end
  line(string.format("A  %s: %s on %s", pa, tostring(A.model.name), mesh_text(A.mesh)))
  line(string.format("B  %s: %s on %s", pb, tostring(B.model.name), mesh_text(B.mesh)))
  local list = terms(A, B)
  -- the value columns as wide as their widest entry (at least 12, at most 40)
  local w = 12
  for _, t in ipairs(list) do w = math.max(w, #fmt(t.a, t.kind), #fmt(t.b, t.kind)) end
  w = math.min(w, 40)
  local row = "  %-42s %" .. w .. "s %" .. w .. "s %14s %8s"
  local section
  for _, t in ipairs(list) do
    if t.section ~= section then
      section = t.section
      line("")
      line(string.format("%-44s %" .. w .. "s %" .. w .. "s %14s %8s", section, "A", "B", "B - A", "B / A"))
    end
    local d, r = diff_of(t)
    local same = t.kind == "text" and t.a == t.b
    line(string.format(row, util.short_name(t.name, 42), util.short_name(fmt(t.a, t.kind), w),
      util.short_name(fmt(t.b, t.kind), w), d and signed(d, t.kind) or (same and "same" or ""),
      r and string.format("%.3f", r) or ""))
  end
  return table.concat(lines, "\n") .. "\n"
end

--- The comparison as JSON.
function M.to_json(A, B, pa, pb)
  local list = json.array()
  for i, t in ipairs(terms(A, B)) do
    local d, r = diff_of(t)
    local function v(x) if x == nil then return json.null end return x end
    list[i] = json.object({ "section", "name", "a", "b", "diff", "ratio" },
      { section = t.section, name = t.name, a = v(t.a), b = v(t.b), diff = v(d), ratio = v(r) })
  end
  local function side(P, path)
    return json.object({ "path", "model", "mesh" }, { path = path, model = tostring(P.model.name), mesh = mesh_text(P.mesh) })
  end
  return json.encode(json.object({ "moonshard_compare", "a", "b", "terms" },
    { moonshard_compare = 1, a = side(A, pa), b = side(B, pb), terms = list })) .. "\n"
end

function M.main(args)
  local files, as_json = {}, false
  for _, a in ipairs(args) do
    if a == "-h" or a == "--help" then
      io.stdout:write(M.usage)
      return 0
    elseif a == "--json" then
      as_json = true
    elseif a:sub(1, 2) == "--" then
      return usage_error("unknown option '" .. util.short_name(a) .. "'")
    else
      files[#files + 1] = a
    end
  end
  if #files ~= 2 then
    return usage_error(string.format("expected two plan JSON files (A.json B.json), got %d", #files))
  end
  local plans = {}
  for i, path in ipairs(files) do
    local p, why = load(path)
    if not p then return usage_error(why) end
    plans[i] = p
  end
  io.stdout:write((as_json and M.to_json or M.text)(plans[1], plans[2], files[1], files[2]))
  return 0
end

return M
