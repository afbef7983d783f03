-- p2p.lua: sends and receives (g:send, g:recv, g:batch_p2p) on every rank, each rank
-- checking what it received against the values its peers sent, computed here.
-- Run as: moonshard -n N p2p.lua   (prints "rank R: N p2p checks ok" per rank; any backend,
-- the tensors on ms.device() and, staged on nccl, on the cpu)
--
--   1. a ring in every dtype, 2-D and empty: each rank sends to the next and receives from
--      the previous in one batch, the odd ranks listing the receive first;
--   2. a pipeline of blocking calls: rank 0 sends, every other rank receives from the one
--      before and sends it on;
--   3. pairs (0 1), (2 3), ...: two tensors each way, tags 1 and 2, the sends and receives
--      interleaved differently on the two sides;
--   4. every rank with every other in one batch, in an order of its own;
--   5. with an even world of 4 or more, the "pp" groups of a 2 x n/2 mesh: a ping-pong by
--      group ranks;
--   6. the argument checks, on any number of ranks (a rank cannot send to itself).
local ms = require "moonshard"

local rank, world = ms.rank(), ms.world_size()
local device = ms.device()
local checks, wrong = 0, {}

-- The value that rank q sends at flat index i in test s: small integers, exact in every dtype.
local function f(q, i, s, dtype)
  if dtype == "bool" then return ((q + i + s) % 3 == 0) and 1 or 0 end
  if dtype == "u8" then return (q * 7 + i * 3 + s) % 11 end
  return (q * 7 + i * 3 + s) % 11 - 5
end

-- What rank q sends in test s: n values of dtype, shaped (a list) or flat, on dev.
local function sent(q, n, s, dtype, shape, dev)
  local vals = {}
  for i = 0, n - 1 do vals[#vals + 1] = f(q, i, s, dtype) end
  return ms.from_table(vals, dtype, shape):to(dev or device)
end

local function check(what, got, q, s)
  checks = checks + 1
  local vals, dtype, bad = got:totable(), got:dtype(), 0
  for i = 0, #vals - 1 do
    if vals[i + 1] ~= f(q, i, s, dtype) then bad = bad + 1 end
  end
  if bad > 0 then wrong[#wrong + 1] = string.format("%s: %d of %d elements wrong", what, bad, #vals) end
end

local function expect_error(what, pattern, fn, ...)
  checks = checks + 1
  local ok, e = pcall(fn, ...)
  if ok or not tostring(e):find(pattern, 1, true) then
    wrong[#wrong + 1] = string.format("%s: expected an error with '%s', got %s", what, pattern, tostring(e))
  end
end

local g = ms.mesh({ { "world", world } }):group("world")
local next, prev = (rank + 1) % world, (rank + world - 1) % world

-- 6. argument checks (each refused on this rank before it joins: the group stays usable)
local t = ms.tensor({ 4 }, "f32", device)
expect_error("send to itself", "peer " .. rank .. " is this rank (a rank cannot send to itself)", g.send, g, t, rank)
expect_error("peer out of range", "recv on group", g.recv, g, t, world)
if world > 1 then expect_error("negative tag", "tag -1 is negative", g.send, g, t, next, -1) end
expect_error("bad op", 'batch_p2p: ops[1][1] is "put", expected "send" or "recv"', g.batch_p2p, g, { { "put", t, 0 } })
expect_error("no tensor", "batch_p2p: ops[1][2] is nil, expected a tensor", g.batch_p2p, g, { { "send" } })
expect_error("bad peer", "batch_p2p: ops[1][3] (the peer) is string, expected an integer", g.batch_p2p, g,
  { { "send", t, "one" } })
expect_error("ops", "bad argument #1 to 'batch_p2p' (table expected, got number)", function() g:batch_p2p(3) end)
g:batch_p2p({}) -- nothing to do

if world > 1 then
  -- 1. the ring
  local s = 0
  for _, dtype in ipairs(ms.dtypes) do
    for _, shape in ipairs({ { 5 }, { 2, 3 }, { 0 } }) do
      for _, dev in ipairs(device == "cpu" and { "cpu" } or { device, "cpu" }) do
        s = s + 1
        local n = shape[1] * (shape[2] or 1)
        local out, got = sent(rank, n, s, dtype, shape, dev), ms.tensor(shape, dtype, dev)
        local ops = { { "send", out, next, 7 }, { "recv", got, prev, 7 } }
        if rank % 2 == 1 then ops[1], ops[2] = ops[2], ops[1] end
        g:batch_p2p(ops)
        check(string.format("ring %s %s on %s", dtype, table.concat(shape, "x"), dev), got, prev, s)
      end
    end
  end

  -- 2. the pipeline
  local buf = ms.tensor({ 4, 6 }, "bf16", device)
  if rank == 0 then
    g:send(sent(0, 24, 100, "bf16", { 4, 6 }), 1, 3)
  else
    assert(g:recv(buf, rank - 1, 3) == buf)
    check("pipeline", buf, 0, 100)
    if rank + 1 < world then g:send(buf, rank + 1, 3) end
  end

  -- 3. pairs
  local partner = rank % 2 == 0 and rank + 1 or rank - 1
  if partner < world then
    local a, b = sent(rank, 35, 201, "f32", { 5, 7 }), sent(rank, 3, 202, "i64")
    local ga, gb = ms.tensor({ 5, 7 }, "f32", device), ms.tensor({ 3 }, "i64", device)
    if rank % 2 == 0 then
      g:batch_p2p({ { "send", a, partner, 1 }, { "send", b, partner, 2 }, { "recv", ga, partner, 1 },
        { "recv", gb, partner, 2 } })
    else
      g:batch_p2p({ { "recv", ga, partner, 1 }, { "send", a, partner, 1 }, { "recv", gb, partner, 2 },
        { "send", b, partner, 2 } })
    end
    check("pair, tag 1", ga, partner, 201)
    check("pair, tag 2", gb, partner, 202)
  end

  -- 4. every peer at once
  local mine, got, ops = sent(rank, 9, 300, "f16"), {}, {}
  for i = 1, world - 1 do
    local to, from = (rank + i) % world, (rank + world - i) % world
    got[from] = ms.tensor({ 9 }, "f16", device)
    ops[#ops + 1] = { "send", mine, to }
    ops[#ops + 1] = { "recv", got[from], from }
  end
  g:batch_p2p(ops)
  for from, tensor in pairs(got) do check("every peer, from " .. from, tensor, from, 300) end

  -- 5. mesh groups
  if world % 2 == 0 and world >= 4 then
    local pp = ms.mesh({ { "pp", 2 }, { "dp", math.floor(world / 2) } }):group("pp")
    local x = ms.tensor({ 6 }, "i32", device)
    if pp:rank() == 0 then
      pp:send(sent(rank, 6, 400, "i32"), 1, 4)
      pp:recv(x, 1, 5)
      check("ping-pong on " .. tostring(pp), x, pp:ranks()[2], 401)
    else
      pp:recv(x, 0, 4)
      check("ping-pong on " .. tostring(pp), x, pp:ranks()[1], 400)
      pp:send(sent(rank, 6, 401, "i32"), 0, 5)
    end
  end
end

if #wrong > 0 then
  error(string.format("rank %d: %d of %d p2p checks failed:\n  %s", rank, #wrong, checks,
    table.concat(wrong, "\n  ")), 0)
end
print(string.format("rank %d: %d p2p checks ok", rank, checks))
