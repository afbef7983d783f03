-- moonshard.plan_svg: a plan as a picture.  One row per decoder layer (and one for the
-- rest of the model) with a box per shard unit, sized by its parameters and coloured by the
-- dtype it gathers in (FP32 islands stand out), expert-parallel parameters as their own
-- box, each layer's pipeline stage; below, each rank's memory as stacked bars (to its peak
-- with a batch, against the device's memory with one) and the communication per step.

local util = require "moonshard.util"
local numel_of = require("moonshard.plan_layout").numel_of

local M = {}

local W, MARGIN, ROW_H, BAR_H = 1100, 20, 34, 18
local COLOURS = { f32 = "#e8833a", bf16 = "#4a7fc1", f16 = "#6aa84f", f8e4m3 = "#9b59b6", f8e5m2 = "#9b59b6",
  f64 = "#c0392b", ep = "#7f8c8d" }
local MEM = { { "params", "#4a7fc1" }, { "grads", "#6aa84f" }, { "optimizer", "#e8833a" },
  { "peak_unsharded", "#9b59b6" }, { "buffers", "#95a5a6" }, { "activations", "#c0392b" }, { "transient", "#f1948a" },
  { "overhead", "#34495e" } }

-- XML text: the five markup characters escaped, and the control characters XML 1.0 forbids
-- (all below 0x20 but tab, newline and return) shown as U+FFFD
local function esc(s)
  return (tostring(s):gsub("[&<>\"]", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;" })
    :gsub("[%z\1-\8\11\12\14-\31]", "\239\191\189"))
end

local function short(name)
  if name == "" then return "<root>" end
  return (name:gsub("_checkpoint_wrapped_module%.", ""):gsub("^model%.layers%.%d+%.", ""))
end

local function row_of(name)
  local i = name:match("^model%.layers%.(%d+)")
  return i and tonumber(i) or -1
end

--- SVG text for a plan.
function M.render(plan)
  local rows, order = {}, {}
  local function add(row, box)
    if not rows[row] then
      rows[row] = {}
      order[#order + 1] = row
    end
    table.insert(rows[row], box)
  end
  for _, u in ipairs(plan.units) do
    local g = u.entries[1] and u.entries[1].gather or u.mp.param_dtype or "f32"
    local box = { label = short(u.name), size = math.max(u.numel, 1), colour = COLOURS[g] or "#95a5a6",
      tip = string.format("%s: %s params, %s, gather %s, reduce %s", u.name == "" and "<root>" or u.name,
        util.thousands(u.numel), u.kind, g, u.reduce_dtype_eff or "-") ..
        (u.buckets and string.format(", %d DDP buckets all-reduced over %s", #u.buckets, u.mesh_axes[1]) or "") }
    if u.packed then
      -- a packed unit: a segment per gather dtype, by elements (its islands' f32 beside the
      -- layer's bf16), all moved by one all-gather
      local by, dts = {}, {}
      for _, e in ipairs(u.entries) do
        if not by[e.gather] then dts[#dts + 1] = e.gather end
        by[e.gather] = (by[e.gather] or 0) + numel_of(e.shape)
      end
      local total, parts, names = 0, {}, {}
      for _, dt in ipairs(dts) do total = total + by[dt] end
      for i, dt in ipairs(dts) do
        parts[i] = { colour = COLOURS[dt] or "#95a5a6", share = by[dt] / math.max(total, 1), dt = dt, n = by[dt] }
      end
      for i, isl in ipairs(u.islands) do names[i] = short(isl.name) end
      box.parts = parts
      local split = {}
      for i, p in ipairs(parts) do split[i] = string.format("%s %s", util.thousands(p.n), p.dt) end
      box.tip = string.format("%s: %s params, packed (one all-gather): %s; %d FP32 island%s: %s; reduce %s",
        u.name == "" and "<root>" or u.name, util.thousands(u.numel), table.concat(split, ", "), #u.islands,
        #u.islands == 1 and "" or "s", table.concat(names, ", "), table.concat(u.reduce_dtypes or {}, ", "))
    end
    add(row_of(u.name), box)
  end
  local ep_rows = {}
  for _, o in ipairs(plan.owned) do
    local r = row_of(o.fqn)
    local n = 1
    for _, s in ipairs(o.shape) do n = n * s end
    ep_rows[r] = (ep_rows[r] or 0) + n
  end
  for r, n in pairs(ep_rows) do
    add(r, { label = "experts (ep)", size = n, colour = COLOURS.ep,
      tip = string.format("expert parallelism: %s params, Shard(0) over ep", util.thousands(n)) })
  end
  table.sort(order)
  local out = {}
  local function put(s) out[#out + 1] = s end
  local units_h = #order * ROW_H
  local mem_top = 70 + units_h + 40
  local ranks = plan.mesh.world
  local shown = math.min(ranks, 32)
  local height = mem_top + 30 + shown * (BAR_H + 4) + 90
  -- with a step time: one step on a time line (moonshard.plan_time)
  local timeline, timeline_h = require("moonshard.plan_time").svg(plan, height - 30, W, MARGIN, esc)
  height = height + timeline_h
  put(string.format('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" ' ..
    'font-size="11">', W, height))
  put(string.format('<rect width="%d" height="%d" fill="white"/>', W, height))
  put(string.format('<text x="%d" y="24" font-size="16" font-weight="bold">%s (%s): %s params on %s</text>',
    MARGIN, esc(plan.model.name), esc(plan.model.architecture), util.thousands(plan.model.params),
    esc(plan.mesh:describe())))
  -- legend
  local lx = MARGIN
  for _, k in ipairs({ "f32", "bf16", "f16", "ep" }) do
    put(string.format('<rect x="%d" y="36" width="12" height="12" fill="%s"/><text x="%d" y="46">%s</text>', lx,
      COLOURS[k], lx + 16, k == "ep" and "expert parallel" or "gathered in " .. k))
    lx = lx + 130
  end
  -- under a pipeline, each layer's stage
  local stage_of_layer = {}
  for _, s in ipairs(plan.pipeline and plan.pipeline.stages or {}) do
    for i = s.layers.first, s.layers.first + s.layers.count - 1 do stage_of_layer[i] = s.index end
  end
  local label_w = 90
  for ri, r in ipairs(order) do
    local y = 60 + (ri - 1) * ROW_H
    put(string.format('<text x="%d" y="%d">%s</text>', MARGIN, y + 20, r >= 0 and "layer " .. r ..
      (stage_of_layer[r] and " · stage " .. stage_of_layer[r] or "") or "model"))
    local boxes, total = rows[r], 0
    for _, b in ipairs(boxes) do total = total + math.sqrt(b.size) end
    local x, avail = MARGIN + label_w, W - 2 * MARGIN - label_w - 4 * #boxes
    for _, b in ipairs(boxes) do
      local w = math.max(4, avail * math.sqrt(b.size) / total)
      put(string.format('<g><title>%s</title><rect x="%s" y="%d" width="%s" height="%d" fill="%s" rx="3"/>',
        esc(b.tip), util.fixed1(x), y + 4, util.fixed1(w), ROW_H - 8, b.colour))
      if b.parts and #b.parts > 1 then
        -- each dtype's share from the right, at least 3 px so that a small island shows,
        -- the first (the layer's own) filling the rest; a dashed outline marks the unit packed
        local right = x + w
        for i = #b.parts, 2, -1 do
          local pw = math.max(3, w * b.parts[i].share)
          right = math.max(x, right - pw)
          put(string.format('<rect x="%s" y="%d" width="%s" height="%d" fill="%s"/>', util.fixed1(right), y + 4,
            util.fixed1(pw), ROW_H - 8, b.parts[i].colour))
        end
        put(string.format('<rect x="%s" y="%d" width="%s" height="%d" fill="%s"/>', util.fixed1(x), y + 4,
          util.fixed1(right - x), ROW_H - 8, b.parts[1].colour))
        put(string.format('<rect x="%s" y="%d" width="%s" height="%d" fill="none" stroke="black" ' ..
          'stroke-dasharray="3,2" rx="3"/>', util.fixed1(x), y + 4, util.fixed1(w), ROW_H - 8))
      end
      if w > 7 * #b.label then
        put(string.format('<text x="%s" y="%d" fill="white">%s</text>', util.fixed1(x + 4), y + 21, esc(b.label)))
      end
      put("</g>")
      x = x + w + 4
    end
  end
  -- memory per rank: each rank's own figures (its stages, its tensor-parallel pieces, the
  -- optimizer rows it holds), from the runs of equal ranks
  local m = plan.memory
  local function figures(r)
    for _, run in ipairs(m.runs) do
      if r >= run.first and r < run.first + run.count then
        return { params = run.params or m.params, grads = run.grads or m.grads, optimizer = run.optimizer,
          peak_unsharded = run.peak_unsharded or m.peak_unsharded, buffers = run.buffers or m.buffers,
          activations = run.activations or m.activations or 0, transient = run.transient or m.transient or 0,
          overhead = run.overhead or 0, total = (run.peak or run.total) }
      end
    end
  end
  -- each rank's stack: its state, and with a batch its activations, the transient and (with
  -- a device) the overhead, to its peak; the device's capacity a line across
  local peak_total = m.capacity or 0
  for r = 0, shown - 1 do peak_total = math.max(peak_total, figures(r).total) end
  put(string.format('<text x="%d" y="%d" font-size="14" font-weight="bold">memory per rank: %s %s on rank 0%s%s</text>',
    MARGIN, mem_top, util.bytes(m.peak or m.total), m.peak and "at the peak (estimate)" or "total",
    m.capacity and string.format(" of %s%s", util.bytes(m.capacity), m.fit and (m.fit.fits and ": every rank fits" or
      string.format(": %d ranks over", m.fit.over)) or "") or "",
    ranks > shown and string.format(" (the first %d of %d ranks)", shown, ranks) or ""))
  lx = MARGIN
  local rank0 = figures(0)
  for _, c in ipairs(MEM) do
    if (rank0[c[1]] or 0) > 0 or c[1] == "params" then
      put(string.format('<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s %s</text>', lx,
        mem_top + 10, c[2], lx + 16, mem_top + 20, c[1]:gsub("_", " "), util.bytes(rank0[c[1]])))
      lx = lx + 150
    end
  end
  local scale = (W - 2 * MARGIN - 70) / math.max(peak_total, 1)
  for r = 0, shown - 1 do
    local y = mem_top + 30 + r * (BAR_H + 4)
    put(string.format('<text x="%d" y="%d">rank %d</text>', MARGIN, y + 13, r))
    local x = MARGIN + 70
    local f = figures(r)
    for _, c in ipairs(MEM) do
      local w = (f[c[1]] or 0) * scale
      put(string.format('<rect x="%s" y="%d" width="%s" height="%d" fill="%s"/>', util.fixed1(x), y, util.fixed1(w),
        BAR_H, c[2]))
      x = x + w
    end
  end
  if m.capacity then
    local cx = MARGIN + 70 + m.capacity * scale
    put(string.format('<g><title>the device\'s memory: %s</title><line x1="%s" y1="%d" x2="%s" y2="%d" ' ..
      'stroke="#c0392b" stroke-width="2" stroke-dasharray="6,3"/></g>', util.bytes(m.capacity), util.fixed1(cx),
      mem_top + 26, util.fixed1(cx), mem_top + 30 + shown * (BAR_H + 4)))
  end
  local cy = mem_top + 30 + shown * (BAR_H + 4) + 24
  put(string.format('<text x="%d" y="%d" font-size="14" font-weight="bold">communication per step and rank</text>',
    MARGIN, cy))
  local parts = {}
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" }) do
    local c = plan.comm[k]
    parts[#parts + 1] = string.format("%s %d x %s%s", k, c.count, util.bytes(c.bytes),
      c.uncounted_ep and " (+ ep's tokens, not counted)" or "")
  end
  if plan.comm.send_recv then
    parts[#parts + 1] = string.format("send_recv %d x %s", plan.comm.send_recv.count, util.bytes(plan.comm.send_recv.bytes))
  end
  put(string.format('<text x="%d" y="%d">%s</text>', MARGIN, cy + 20, esc(table.concat(parts, "  |  "))))
  if timeline ~= "" then put(timeline) end
  put("</svg>")
  return table.concat(out, "\n") .. "\n"
end

return M
