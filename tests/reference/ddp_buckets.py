"""ddp_buckets.py: DistributedDataParallel's gradient buckets, as PyTorch assigns them, the
reference for the buckets of moonshard's replicate units (lua/moonshard/plan_replicate.lua)
read by tests/lua/ddp_buckets_spec.lua.  Writes data/ddp_buckets.json.

PyTorch 2.15's DDP (torch/nn/parallel/distributed.py, _ddp_init_helper) takes the trainable
parameters in named_modules() order (each module's own, shared ones once:
_build_params_for_reducer), asks _BucketCapacityConfig.compute_bucket_size_limits for the
limits and calls dist._compute_bucket_assignment_by_size, then hands the buckets to the
Reducer reversed.  With find_unused_parameters=False (the default, and Automodel's DDPConfig
default) that first assignment is a single bucket per dtype (limit sys.maxsize), and after the
first iteration the Reducer rebuilds them (Reducer::rebuild_buckets) in the order the
gradients became ready, with the limits [first bucket cap, bucket cap], without sorting
(tensor_indices given).  A plan cannot run backward, so the ready order it assumes is the
reverse of the registration order (the order the Reducer's initial buckets approximate too);
the `rebuilt` cases are that call.  With find_unused_parameters=True the buckets are never
rebuilt: the `initial` cases are the constructor's own call.

Cases: every model of data/model_params.json (transformers' own parameter lists: the tiny
configs and the real-size ones) with several bucket_cap_mb values, in both modes, and a few
synthetic parameter lists (mixed dtypes, frozen parameters, a parameter larger than the cap,
buckets that reach their cap exactly).
A bucket lists its parameters as 0-based positions in the list of trainable parameters.
For the tiny models, the `initial` buckets are also read back from a real DDP (gloo, one
process) built on materialised parameters, and the script stops if they differ from the
call's.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _BucketCapacityConfig

import refdata

here = os.path.dirname(os.path.abspath(__file__))
DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}

SYNTHETIC = [
    ("mixed_dtypes", [["a.weight", [300, 200], "f32", True], ["a.bias", [300], "f32", True],
                      ["b.weight", [256, 300], "bf16", True], ["b.bias", [256], "bf16", True],
                      ["c.weight", [512, 256], "f32", True], ["d.weight", [512, 512], "bf16", True],
                      ["e.weight", [100, 512], "f16", True], ["f.weight", [64, 100], "f32", True]]),
    ("frozen", [["embed.weight", [1000, 64], "f32", False], ["l0.weight", [64, 64], "f32", True],
                ["l0.bias", [64], "f32", False], ["l1.weight", [256, 64], "f32", True],
                ["l1.bias", [256], "f32", True], ["head.weight", [1000, 256], "f32", True]]),
    ("exact_cap", [["a.weight", [256, 256], "f32", True], ["b.weight", [128, 256], "f32", True],
                   ["c.weight", [128, 256], "f32", True], ["d.weight", [512, 128], "bf16", True],
                   ["e.bias", [10], "f32", True]]),
    ("over_cap", [["small.weight", [8, 8], "f32", True], ["huge.weight", [2048, 1024], "f32", True],
                  ["mid.weight", [300, 300], "f32", True], ["tiny.bias", [7], "f32", True]]),
]
TINY_CAPS = [None, 0.0005, 0.002, 0.01]
REAL_CAPS = [None, 25, 100, 5.5]
SYNTHETIC_CAPS = [None, 0.05, 0.125, 0.25, 0.3, 0.5, 1, 2.5]  # 0.125, 0.25, 0.5: buckets that reach the cap exactly


def params_of(spec):
    """Meta tensors of the trainable parameters (DDP drops frozen ones) and their names."""
    names, tensors = [], []
    for fqn, shape, dtype, trainable in spec:
        if trainable:
            names.append(fqn)
            tensors.append(torch.empty(shape, dtype=DTYPE[dtype], device="meta"))
    return names, tensors


def assign(tensors, cap_mb, find_unused):
    """The buckets DDP reduces in, as lists of parameter positions, in reduction order."""
    config = _BucketCapacityConfig.create(bucket_cap_mb=cap_mb, bucket_cap_mb_list=None, use_python_reducer=False)
    n = len(tensors)
    if find_unused:
        limits, _ = config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=True)
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * n)
        return [list(b) for b in reversed(buckets)], limits
    # Reducer::rebuild_buckets: [first_bucket_bytes_cap, bucket_bytes_cap], the ready order
    # (here: reverse registration), tensor_indices given
    limits = [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    order = list(reversed(range(n)))
    buckets, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [False] * n, order)
    return [list(b) for b in buckets], limits


def ddp_initial(spec, cap_mb):
    """The initial buckets of a real DDP(find_unused_parameters=True) on a one-process gloo
    group, as lists of parameter names in reduction order."""
    root = torch.nn.Module()
    for fqn, shape, dtype, trainable in spec:
        parts = fqn.split(".")
        m = root
        for p in parts[:-1]:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(parts[-1], torch.nn.Parameter(torch.zeros(shape, dtype=DTYPE[dtype]),
                                                           requires_grad=trainable))
    ddp = torch.nn.parallel.DistributedDataParallel(root, bucket_cap_mb=cap_mb, find_unused_parameters=True)
    name_of = {id(p): n for n, p in root.named_parameters()}
    return [[name_of[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    models = json.load(open(os.path.join(here, "data", "model_params.json")))["models"]
    cases, checked = [], 0
    sources = [(m["config"], None, m["params"], TINY_CAPS if "/reference/" in m["config"] else REAL_CAPS)
               for m in models]
    sources += [(None, name, spec, SYNTHETIC_CAPS) for name, spec in SYNTHETIC]
    for config, name, spec, caps in sources:
        names, tensors = params_of(spec)
        for cap in caps:
            for find_unused in (False, True):
                buckets, limits = assign(tensors, cap, find_unused)
                case = {"model": config} if config else {"name": name, "params": spec}
                case.update({"bucket_cap_mb": cap, "find_unused_parameters": find_unused, "limits": limits,
                             "buckets": [{"params": b,
                                          "bytes": sum(tensors[i].numel() * tensors[i].element_size() for i in b),
                                          "dtype": next(k for k, v in DTYPE.items() if v == tensors[b[0]].dtype)}
                                         for b in buckets]})
                if find_unused and (name or "/reference/" in config):
                    real = ddp_initial(spec, cap)
                    if real != [[names[i] for i in b["params"]] for b in case["buckets"]]:
                        sys.exit("ddp_buckets.py: DDP's own buckets differ from the call's for %s cap %s: %r" %
                                 (config or name, cap, real))
                    case["checked_by_ddp"] = True
                    checked += 1
                cases.append(case)
    dist.destroy_process_group()
    out = os.path.join(here, "data", "ddp_buckets.json")
    with open(out + ".tmp", "w") as f:
        f.write('{"made_by":"tests/reference/ddp_buckets.py (tests/reference/make.sh ddp_buckets); do not edit",\n')
        f.write('"versions":%s,\n' % json.dumps(refdata.versions()))
        f.write('"first_bucket_bytes":%d,\n' % dist._DEFAULT_FIRST_BUCKET_BYTES)
        f.write('"cases":[\n' + ",\n".join(json.dumps(c, separators=(",", ":")) for c in cases) + "\n]}\n")
    os.replace(out + ".tmp", out)
    print("ddp_buckets.py: %d cases, %d read back from DDP" % (len(cases), checked), file=sys.stderr)


if __name__ == "__main__":
    main()
