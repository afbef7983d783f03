-- big.lua: an all_reduce and a reduce_scatter large enough for the MPI backend's pieces
-- (20 MiB: three 8 MiB pieces, the last one uneven), checked at samples and over the tail.
-- Prints "rank R: big ok" per rank.
local ms = require "moonshard"
local g = ms.mesh({{"dp", ms.world_size()}}):group("dp")
local n, r = g:size(), g:rank()
local N = 5 * 2^20 + 3            -- 20 MiB of f32: 3 pieces of the chunked all_reduce, the last uneven
local t = ms.tensor({N}, "f32"); t:fill_(r + 1)
g:all_reduce(t)
local rs_in = ms.tensor({n * N}, "bf16"); rs_in:fill_(r + 1)
local rs = ms.tensor({N}, "bf16")
g:reduce_scatter(rs, rs_in, "sum")
local want = n * (n + 1) / 2
local bad = 0
for _, i in ipairs({0, 1, math.floor(N / 3), math.floor(N / 2), 2 * 2^20 + 1, N - 2, N - 1}) do
  if t:narrow(0, i, 1):totable()[1] ~= want then bad = bad + 1 end
  if rs:narrow(0, i, 1):totable()[1] ~= want then bad = bad + 1 end
end
local s = 0
for _, v in ipairs(t:narrow(0, N - 1000, 1000):totable()) do s = s + v end
if bad > 0 or s ~= 1000 * want then error(string.format("rank %d: %d wrong samples, tail sum %g", ms.rank(), bad, s), 0) end
print(string.format("rank %d: big ok", ms.rank()))
