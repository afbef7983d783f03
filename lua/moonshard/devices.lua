-- moonshard.devices: device profiles for the step-time estimate (moonshard.plan_time) and
-- the memory a rank has (memory.per_rank[r].capacity, .overhead).
--
-- A profile is a flat table of figures, one GPU's, with the node it sits in:
--   memory_bytes          the device memory CUDA (or ROCm) reports, bytes
--   bf16_flops            peak dense BF16/FP16 tensor FLOP/s (dense: without 2:4 sparsity)
--   fp8_flops             peak dense FP8 tensor FLOP/s; nil where the device has no FP8
--   fp32_flops            peak FP32 FLOP/s without tensor cores (PyTorch's default for an
--                         f32 matmul: torch.backends.cuda.matmul.allow_tf32 is False)
--   hbm_bytes_per_s       memory bandwidth
--   gpus_per_node         GPUs a node holds (its NVLink/xGMI domain)
--   intra_node_bytes_per_s  bus bandwidth per GPU inside a node, one direction
--   inter_node_bytes_per_s  network bandwidth per GPU between nodes, one direction
--   intra_node_latency_s, inter_node_latency_s  the fixed cost of one collective call
--   cuda_context_bytes    device memory the CUDA/ROCm context and the libraries' workspaces
--                         (cuBLAS, cuDNN) take outside PyTorch's allocator
--   nccl_buffer_bytes     device memory NCCL/RCCL communicators take outside it
--   fragmentation         the fraction of what PyTorch's caching allocator holds that it
--                         reserves beyond what tensors use (segments split and not reused)
--   name, source          the profile's name and where its figures come from
--
-- Figures of the built-in profiles and their sources (vendors' datasheets; the GPU memory as
-- NVML reports it):
--   FLOP/s and bandwidths: NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 TFLOPS and
--   FP8 3,958 TFLOPS "with sparsity", so 989.4 and 1,978.9 dense; FP32 67 TFLOPS; HBM3 3.35
--   TB/s; NVLink 900 GB/s, both directions together); NVIDIA H200 datasheet (the same
--   compute; HBM3e 4.8 TB/s; NVLink 900 GB/s); NVIDIA HGX B200 / DGX B200 datasheets (8
--   GPUs: FP8 72 PFLOPS and FP16/BF16 36 PFLOPS with sparsity, so 4.5 and 2.25 PFLOPS dense
--   per GPU; FP32 600 TFLOPS for 8, 75 per GPU; HBM3e 8 TB/s; NVLink 5 1.8 TB/s both
--   directions); NVIDIA A100 datasheet (SXM4 80GB: BF16 312 TFLOPS dense, 624 sparse; no
--   FP8; FP32 19.5 TFLOPS; HBM2e 2,039 GB/s; NVLink 600 GB/s both directions); AMD Instinct
--   MI300X datasheet (BF16 1,307.4 TFLOPS dense, 2,614.9 with sparsity; FP8 2,614.9 dense;
--   FP32 163.4 TFLOPS; HBM3 5.3 TB/s; 192 GB; Infinity Fabric 896 GB/s over 7 links, both
--   directions).  The bus bandwidth one direction is half the datasheet's two-direction
--   figure.
--   Memory: NVML's total (nvidia-smi) for H100 80GB 81,559 MiB, H200 143,771 MiB, A100 80GB
--   81,920 MiB (published by Modal, "Why does an NVIDIA H100 80GB card offer 85.52 GB?");
--   B200 183,359 MiB (nvidia-smi on an HGX B200; DGX B200's datasheet gives 1,440 GB for 8
--   GPUs); MI300X 192 GiB, its datasheet's 192 GB taken as 8 stacks of 24 GiB.
--   Inter-node: the reference nodes' one NIC per GPU: DGX H100/H200 and DGX B200 8 x
--   ConnectX-7 400 Gb/s (50 GB/s a GPU), DGX A100 8 x ConnectX-6 200 Gb/s (25 GB/s), MI300X
--   platforms 8 x 400 Gb/s NICs (50 GB/s).
--   Latency: per collective call, intra-node 10 us and inter-node 25 us: the order of
--   nccl-tests' small-message times on 8 GPUs of a node and across nodes, an estimate, not
--   a datasheet figure.
--   Overheads: CUDA context and library workspaces 0.5 GiB (an idle PyTorch process with
--   cuBLAS initialised shows about 500 MiB in nvidia-smi on Hopper), NCCL buffers 1 GiB (a
--   communicator's channels each keep NCCL_BUFFSIZE, 4 MiB by default, per protocol and
--   peer; a training job holds several: dp, tp, ep, pp), fragmentation 5% of what the
--   allocator holds: estimates, not datasheet figures.  A user profile sets its own.

local util = require "moonshard.util"

local M = {}

local GiB, MiB = 1024 ^ 3, 1024 ^ 2
local OVERHEAD = { cuda_context_bytes = 0.5 * GiB, nccl_buffer_bytes = 1 * GiB, fragmentation = 0.05 }
local LATENCY = { intra_node_latency_s = 10e-6, inter_node_latency_s = 25e-6 }

local function profile(t)
  for k, v in pairs(OVERHEAD) do t[k] = v end
  for k, v in pairs(LATENCY) do t[k] = v end
  return t
end

M.PROFILES = {
  ["h100-80gb"] = profile { name = "h100-80gb", source = "NVIDIA H100 SXM5 80GB datasheet; DGX H100 (8 GPUs, 8 x 400 Gb/s)",
    memory_bytes = 81559 * MiB, bf16_flops = 989.4e12, fp8_flops = 1978.9e12, fp32_flops = 66.9e12,
    hbm_bytes_per_s = 3.35e12, gpus_per_node = 8, intra_node_bytes_per_s = 450e9, inter_node_bytes_per_s = 50e9 },
  ["h200-141gb"] = profile { name = "h200-141gb", source = "NVIDIA H200 SXM 141GB datasheet; DGX H200 (8 GPUs, 8 x 400 Gb/s)",
    memory_bytes = 143771 * MiB, bf16_flops = 989.4e12, fp8_flops = 1978.9e12, fp32_flops = 66.9e12,
    hbm_bytes_per_s = 4.8e12, gpus_per_node = 8, intra_node_bytes_per_s = 450e9, inter_node_bytes_per_s = 50e9 },
  ["b200-192gb"] = profile { name = "b200-192gb", source = "NVIDIA HGX B200 / DGX B200 datasheets (8 GPUs, 8 x 400 Gb/s)",
    memory_bytes = 183359 * MiB, bf16_flops = 2.25e15, fp8_flops = 4.5e15, fp32_flops = 75e12,
    hbm_bytes_per_s = 8e12, gpus_per_node = 8, intra_node_bytes_per_s = 900e9, inter_node_bytes_per_s = 50e9 },
  ["a100-80gb"] = profile { name = "a100-80gb", source = "NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8 GPUs, 8 x 200 Gb/s)",
    memory_bytes = 81920 * MiB, bf16_flops = 312e12, fp8_flops = nil, fp32_flops = 19.5e12,
    hbm_bytes_per_s = 2.039e12, gpus_per_node = 8, intra_node_bytes_per_s = 300e9, inter_node_bytes_per_s = 25e9 },
  ["mi300x-192gb"] = profile { name = "mi300x-192gb", source = "AMD Instinct MI300X datasheet (8 GPUs a platform, 8 x 400 Gb/s)",
    memory_bytes = 192 * GiB, bf16_flops = 1307.4e12, fp8_flops = 2614.9e12, fp32_flops = 163.4e12,
    hbm_bytes_per_s = 5.3e12, gpus_per_node = 8, intra_node_bytes_per_s = 448e9, inter_node_bytes_per_s = 50e9 },
}
M.NAMES = { "h100-80gb", "h200-141gb", "b200-192gb", "a100-80gb", "mi300x-192gb" }

-- The keys of a profile: what each takes, and whether it must be there.  `base` (a user
-- profile's only) names a built-in profile whose figures the others override.
M.KEYS = {
  { "name", "string" }, { "source", "string" }, { "base", "string" },
  { "memory_bytes", "bytes", true }, { "bf16_flops", "rate", true }, { "fp8_flops", "rate" },
  { "fp32_flops", "rate", true }, { "hbm_bytes_per_s", "rate", true }, { "gpus_per_node", "count", true },
  { "intra_node_bytes_per_s", "rate", true }, { "inter_node_bytes_per_s", "rate", true },
  { "intra_node_latency_s", "seconds", true }, { "inter_node_latency_s", "seconds", true },
  { "cuda_context_bytes", "bytes", true }, { "nccl_buffer_bytes", "bytes", true }, { "fragmentation", "fraction", true },
}
local KIND_OF = {}
for _, k in ipairs(M.KEYS) do KIND_OF[k[1]] = k[2] end
local EXPECTED = {
  string = "a string of at most 200 bytes",
  bytes = "a whole number of bytes from 0 to 2^53",
  rate = "a number > 0 (per second)",
  count = "a whole number from 1 to 2147483647",
  seconds = "a number of seconds from 0 to 1",
  fraction = "a number from 0 to 1 (a fraction)",
}

local function fail(where, msg) error("moonshard: device profile " .. where .. ": " .. msg, 0) end

local function shown(v)
  local t = type(v)
  if t == "string" then return "'" .. util.short_name(v, 60) .. "'" end
  if t == "number" or t == "boolean" then return tostring(v) end
  return "a " .. t
end

local function valid(kind, v)
  if kind == "string" then return type(v) == "string" and #v <= 200 end
  if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then return false end
  if kind == "bytes" then return util.is_int(v) and v >= 0 and v <= 2 ^ 53 end
  if kind == "rate" then return v > 0 end
  if kind == "count" then return util.is_int(v) and v >= 1 and v <= 2147483647 end
  if kind == "seconds" then return v >= 0 and v <= 1 end
  return v >= 0 and v <= 1 -- fraction
end

--- check(t, where) -> a profile: t's figures checked (read raw: no metamethod of a user's
-- runs), a user table's `base` filled in; `where` names it in errors.
function M.check(t, where)
  if type(t) ~= "table" then fail(where, "is " .. shown(t) .. "; expected a table of figures (docs/planning.md)") end
  local out = {}
  local n = 0
  for k, v in next, t do
    n = n + 1
    if n > 64 then fail(where, "has more than 64 keys") end
    local kind = type(k) == "string" and KIND_OF[k]
    if not kind then
      local names = {}
      for i, e in ipairs(M.KEYS) do names[i] = e[1] end
      fail(where, string.format("unknown key %s (keys: %s)", shown(k), table.concat(names, ", ")))
    end
    if not valid(kind, v) then fail(where, string.format("%s is %s; expected %s", k, shown(v), EXPECTED[kind])) end
    out[k] = v
  end
  if out.base ~= nil then
    local base = M.PROFILES[out.base]
    if not base then
      fail(where, string.format("base is %s; expected one of %s", shown(out.base), table.concat(M.NAMES, ", ")))
    end
    for k, v in pairs(base) do
      if out[k] == nil and k ~= "name" and k ~= "source" then out[k] = v end
    end
    out.source = out.source or ("figures of " .. out.base .. " (" .. base.source .. ") with the file's own")
  end
  for _, e in ipairs(M.KEYS) do
    if e[3] and out[e[1]] == nil then
      fail(where, string.format("has no %s (%s); give it, or base = \"h100-80gb\" (a built-in profile) to take " ..
        "the figures not given from", e[1], EXPECTED[e[2]]))
    end
  end
  return out
end

--- get(spec, opts?) -> a profile: a built-in one by name, or a Lua file (spec holds a "/"
-- or ends in ".lua") returning a table, run in the policy sandbox (moonshard.policy: no io,
-- os or load; opts.instructions, memory_mb and seconds as the policy's limits).
function M.get(spec, opts)
  if type(spec) ~= "string" or spec == "" then fail("", "expected a profile name or a .lua file") end
  local p = M.PROFILES[spec]
  if p then
    local out = {}
    for k, v in pairs(p) do out[k] = v end
    return out
  end
  if not (spec:find("/", 1, true) or spec:find("%.lua$")) then
    fail("'" .. util.short_name(spec, 60) .. "'", "no such profile (built in: " .. table.concat(M.NAMES, ", ") ..
      "; or a FILE.lua returning a table)")
  end
  opts = opts or {}
  -- the policy sandbox's errors name "policy FILE"; here it is a device profile
  local value = require("moonshard.policy").load_data(spec, "device profile", opts)
  local out = M.check(value, spec)
  out.name = out.name or spec
  out.source = out.source or spec
  return out
end

--- The peak FLOP/s of a compute dtype on a profile: f8 at fp8_flops (bf16_flops where the
-- device has none), f32 and f64 at fp32_flops, the rest at bf16_flops.
function M.peak(p, dtype)
  if dtype == "f8e4m3" or dtype == "f8e5m2" then return p.fp8_flops or p.bf16_flops end
  if dtype == "f32" or dtype == "f64" then return p.fp32_flops end
  return p.bf16_flops
end

--- The memory outside the framework's allocator and what it loses to fragmentation, for a
-- rank whose allocator holds `held` bytes: {cuda_context, nccl_buffers, fragmentation, total}.
function M.overhead(p, held)
  local frag = math.ceil(held * p.fragmentation)
  return { cuda_context = p.cuda_context_bytes, nccl_buffers = p.nccl_buffer_bytes, fragmentation = frag,
    total = p.cuda_context_bytes + p.nccl_buffer_bytes + frag }
end

return M
