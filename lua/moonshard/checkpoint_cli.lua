-- moonshard.checkpoint_cli: `moonshard checkpoint info|verify|export` (lua/ms_main.c runs
-- main with the arguments after "checkpoint").  One process; reads the files of a checkpoint
-- written by moonshard.checkpoint.save (docs/checkpoints.md).
local ckpt = require "moonshard.checkpoint"
local json = require "moonshard.json"
local R = require "moonshard.raw"

local M = {}

local format = string.format

M.usage = [[
usage: moonshard checkpoint info DIR
       moonshard checkpoint verify DIR
       moonshard checkpoint export DIR --to OUT [--dtype DTYPE] [--max-shard-size SIZE] [--per-expert]

DIR is a checkpoint (a directory holding checkpoint.json) or a root of checkpoints (its
'latest' file names the newest).

  info     the step, the mesh and world size that wrote it, the files, and every tensor:
           shape, dtype, what is saved of it (param, exp_avg, exp_avg_sq, master), boxes
  verify   reads every box of every file and checks its CRC32C against the index; exit
           status 1 naming each tensor and file that is wrong (0 when all match)
  export   the parameters consolidated into Hugging Face safetensors in OUT
           (model.safetensors, or model-0000i-of-0000N.safetensors with
           model.safetensors.index.json past --max-shard-size, default 5GB, at least 1
           byte: a tensor larger than it gets a file of its own); --dtype casts them
           (bf16, f16, f32, f64 or torch's names: bfloat16, float16, ...; default: as
           stored); earlier model*.safetensors files and index in OUT that this export
           does not write are removed, as transformers' save_pretrained does; OUT may not
           be a moonshard checkpoint; --per-expert writes grouped experts
           as Hugging Face's per-expert tensors (experts.{e}.gate_proj.weight, up_proj,
           down_proj).  Copy the model's config.json beside them for from_pretrained.

  -h, --help   this help
]]

-- --dtype's spellings: moonshard's names and torch's
local DTYPE_ALIAS = { bfloat16 = "bf16", float16 = "f16", fp16 = "f16", half = "f16", float32 = "f32", fp32 = "f32",
  float = "f32", float64 = "f64", fp64 = "f64", double = "f64", float8_e4m3fn = "f8e4m3", float8_e5m2 = "f8e5m2" }
local DTYPES_SHOWN = "bf16 (bfloat16), f16 (float16, fp16), f32 (float32, fp32), f64 (float64), f8e4m3, f8e5m2"

local function usage_error(msg)
  io.stderr:write("moonshard checkpoint: " .. msg .. "\n(try 'moonshard checkpoint --help')\n")
  return 2
end

local function info(path)
  local dir = ckpt.resolve(path)
  local index = ckpt.read_index(dir)
  local axes = {}
  for _, a in ipairs(index.mesh.axes or {}) do axes[#axes + 1] = a[1] .. "=" .. a[2] end
  local bytes, data = 0, 0
  for _, f in ipairs(index.files) do bytes = bytes + (f.bytes or 0) end
  for _, s in ipairs(index.shards) do data = data + s.nbytes end
  local out = {}
  out[#out + 1] = format("checkpoint %s", dir)
  out[#out + 1] = format("step       %s", tostring(index.step))
  out[#out + 1] = format("written by %d ranks (%s), mesh %s%s", index.world, tostring(index.backend),
    table.concat(axes, ","), (index.mesh.ep or 1) > 1 and format(", ep=%d", index.mesh.ep) or "")
  out[#out + 1] = format("files      %d, %s on disk (%s of tensor data in %d boxes, crc32c each)", #index.files,
    ckpt.human(bytes), ckpt.human(data), #index.shards)
  if type(index.extra) == "table" then
    local text = json.encode(index.extra)
    out[#out + 1] = format("extra      %s", text == "{}" and "(empty)" or text)
  end
  -- the other checkpoints of the root DIR named (and saves that never finished)
  if dir ~= path then
    local steps, tmps = {}, {}
    for _, c in ipairs(ckpt.list(path)) do steps[#steps + 1] = c.name .. (path .. "/" .. c.name == dir and " (latest)" or "") end
    for _, name in ipairs(R.ckpt_list_dir(path) or {}) do
      if name:match("^%.tmp%-") then tmps[#tmps + 1] = name end
    end
    out[#out + 1] = format("root       %s: %s", path, table.concat(steps, ", "))
    if #tmps > 0 then
      out[#out + 1] = format("unfinished %s (a save that did not complete; the next save removes it)",
        table.concat(tmps, ", "))
    end
  end
  local names, boxes = {}, {}
  for name in pairs(index.tensors) do names[#names + 1] = name end
  table.sort(names)
  for _, s in ipairs(index.shards) do
    if s.kind == "param" then boxes[s.tensor] = (boxes[s.tensor] or 0) + 1 end
  end
  out[#out + 1] = format("tensors    %d", #names)
  local rows, w = {}, { 0, 0, 0 }
  for _, name in ipairs(names) do
    local t = index.tensors[name]
    local shape = {}
    for i, v in ipairs(t.shape) do shape[i] = tostring(v) end
    local kinds = {}
    for i, v in ipairs(t.kinds) do kinds[i] = v end
    local row = { name, table.concat(shape, "x"), t.dtype, format("%s; %d boxes%s", table.concat(kinds, ","),
      boxes[name] or 0, (t.skipped or 0) > 0 and format("; skipped %d steps", t.skipped) or "") }
    for k = 1, 3 do w[k] = math.max(w[k], #row[k]) end
    rows[#rows + 1] = row
  end
  for _, row in ipairs(rows) do
    out[#out + 1] = format("  %-" .. w[1] .. "s  %-" .. w[2] .. "s  %-" .. w[3] .. "s  %s", row[1], row[2], row[3], row[4])
  end
  io.stdout:write(table.concat(out, "\n") .. "\n")
  return 0
end

local function verify(dir)
  local t0 = os.time()
  local problems, bytes, resolved, index = ckpt.verify(dir)
  if #problems > 0 then
    for _, p in ipairs(problems) do io.stderr:write("moonshard checkpoint verify: " .. p .. "\n") end
    io.stderr:write(format("moonshard checkpoint verify: %s: %d problem%s\n", resolved, #problems,
      #problems == 1 and "" or "s"))
    return 1
  end
  io.stdout:write(format("%s: ok, %d boxes of %d tensors in %d files, %s of tensor data checked (crc32c, %ds)\n", resolved,
    #index.shards, (function() local n = 0 for _ in pairs(index.tensors) do n = n + 1 end return n end)(),
    #index.files, ckpt.human(bytes), os.difftime(os.time(), t0)))
  return 0
end

function M.main(args)
  local cmd, dir, opts, i = args[1], nil, {}, 2
  if cmd == nil or cmd == "-h" or cmd == "--help" then
    io.stdout:write(M.usage)
    return cmd == nil and 2 or 0
  end
  while i <= #args do
    local a = args[i]
    local function value()
      i = i + 1
      return args[i]
    end
    if a == "-h" or a == "--help" then
      io.stdout:write(M.usage)
      return 0
    elseif a == "--to" or a == "--dtype" or a == "--max-shard-size" then
      local v = value()
      if v == nil or v == "" then return usage_error(a .. " needs a value") end
      if a == "--to" then opts.to = v
      elseif a == "--dtype" then
        opts.dtype = DTYPE_ALIAS[v:lower()] or v:lower()
        if not ckpt.ST_DTYPE[opts.dtype] then
          return usage_error(format("--dtype %s: expected one of %s", v, DTYPES_SHOWN))
        end
      else
        local ok, err = pcall(ckpt.parse_size, v)
        if not ok then return usage_error((tostring(err):gsub("^moonshard: checkpoint: max_shard_size", "--max-shard-size"))) end
        opts.max_shard_size = v
      end
    elseif a == "--per-expert" then opts.per_expert = true
    elseif a:sub(1, 1) == "-" then return usage_error("unknown option '" .. a .. "'")
    elseif dir then return usage_error("one DIR expected, got '" .. dir .. "' and '" .. a .. "'")
    else dir = a end
    i = i + 1
  end
  if cmd ~= "info" and cmd ~= "verify" and cmd ~= "export" then
    return usage_error("unknown command '" .. tostring(cmd) .. "' (info, verify or export)")
  end
  if not dir then return usage_error(cmd .. ": DIR expected") end
  local ok, code = pcall(function()
    if cmd == "info" then return info(dir) end
    if cmd == "verify" then return verify(dir) end
    if not opts.to then error({ usage = "export: --to OUT expected" }) end
    local files, total = ckpt.export_dir(dir, opts.to, { dtype = opts.dtype, max_shard_size = opts.max_shard_size,
      expert_names = opts.per_expert })
    io.stdout:write(format("%s: %d file%s, %s of parameters: %s\n", opts.to, #files, #files == 1 and "" or "s",
      ckpt.human(total),
      table.concat(files, ", ")))
    return 0
  end)
  if not ok then
    if type(code) == "table" and code.usage then return usage_error(code.usage) end
    io.stderr:write(tostring(code):gsub("^moonshard: checkpoint: ", "moonshard checkpoint: ") .. "\n")
    return 1
  end
  return code
end

return M
