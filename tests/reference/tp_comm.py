"""tp_comm.py: the activation collectives PyTorch's tensor parallelism issues, for
tests/lua/tp_comm_spec.lua.  Writes tests/reference/data/tp_comm.json.

For every case (a tiny transformers config, tp, one of moonshard's shipped plans with or
without sequence parallel, a batch), the plan is read from policies/tp_plans.lua (through
tests/reference/tp_comm.lua: the input), the transformers model is built from the config in
bf16 with sdpa attention, torch's parallelize_module applies the plan on a fake process group
(rank 0 of tp), and one forward (input_ids of batch x seq_len, no labels) and one backward
(from the sum of the local logits) run under a dispatch mode that records every functional
collective: its kind (all_reduce, all_gather, reduce_scatter, other), the bytes of the whole
buffer (the all-gather's output, the reduce-scatter's input, the all-reduce's tensor) and the
phase (forward, backward).  The loss is outside: the logits come out as the plan leaves them.

Styles, as NeMo Automodel defines them on top of PyTorch's (optimized_tp_plans.py):
colwise = ColwiseParallel, rowwise = RowwiseParallel, vocab_parallel_embedding =
RowwiseParallel on an Embedding (Automodel's subclass only fixes the masked rows locally),
sequence_parallel = SequenceParallel, sequence_parallel_all_gather = SequenceParallel whose
sequence-sharded output is redistributed to Replicate (SequenceParallelAllGatherActivation),
prepare_input = PrepareModuleInput.  Plan patterns that match no module are dropped, as
Automodel's plans name fused projections a model may not have.

Runs in a few seconds on two cores.
"""
import fnmatch
import json
import os
import subprocess

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
import transformers

import refdata

OUT = "tests/reference/data/tp_comm.json"
BIN = os.environ.get("MOONSHARD_BIN", "build/moonshard")

LLAMA = "tests/reference/configs/llama_tp_comm.json"
QWEN3 = "tests/reference/configs/qwen3_tp_tiny.json"
MISTRAL = "tests/reference/configs/mistral_tiny.json"

# name, config, tp, plan, sequence parallel, micro batch, seq_len
CASES = [
    ("llama_tp2", LLAMA, 2, "llama", False, 2, 8),
    ("llama_tp2_sp", LLAMA, 2, "llama", True, 2, 8),
    ("mistral_llama_plan_tp4_sp", MISTRAL, 4, "llama", True, 1, 12),
    ("qwen3_tp2", QWEN3, 2, "qwen", False, 2, 6),
    ("qwen3_tp2_sp", QWEN3, 2, "qwen", True, 2, 6),
    ("mistral_default_tp2", MISTRAL, 2, "default", False, 2, 8),
    ("mistral_default_tp2_sp", MISTRAL, 2, "default", True, 2, 8),
]


def layout(s):
    if s is None:
        return None
    if s == "Replicate()":
        return Replicate()
    return Shard(int(s[len("Shard("):-1]))


class SequenceParallelAllGather(SequenceParallel):
    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        if any(isinstance(p, Shard) for p in outputs.placements):
            outputs = outputs.redistribute(device_mesh=device_mesh, placements=[Replicate()])
        return SequenceParallel._prepare_output_fn(use_local_output, mod, outputs, device_mesh)


def style(spec):
    kw = {}
    for k in ("input_layouts", "output_layouts", "desired_input_layouts"):
        if spec.get(k) is not None:
            kw[k] = layout(spec[k])
    if spec.get("use_local_output") is not None:
        kw["use_local_output"] = spec["use_local_output"]
    name = spec["style"]
    if name == "colwise":
        return ColwiseParallel(**kw)
    if name in ("rowwise", "vocab_parallel_embedding"):
        return RowwiseParallel(**kw)
    if name in ("sequence_parallel", "sequence_parallel_all_gather"):
        cls = SequenceParallel if name == "sequence_parallel" else SequenceParallelAllGather
        return cls(use_local_output=kw.get("use_local_output", False))
    if name == "prepare_input":
        return PrepareModuleInput(input_layouts=(kw["input_layouts"],),
                                  desired_input_layouts=(kw["desired_input_layouts"],),
                                  use_local_output=kw.get("use_local_output", False))
    raise ValueError("tp_comm.py: no torch style for " + name)


KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class Recorder(TorchDispatchMode):
    def __init__(self, log, phase):
        super().__init__()
        self.log, self.phase = log, phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a mode runs before tensor subclasses: hand DTensor's ops back so that DTensor
        # desugars them into collectives on plain tensors first (as CommDebugMode does)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        if ns in ("_c10d_functional", "c10d_functional", "c10d"):
            name = func.__name__.split(".")[0]
            kind = KINDS.get(name, name)
            t = args[0]
            nbytes = t.numel() * t.element_size()
            if kind == "all_gather":
                nbytes *= args[1]
            self.log.append({"phase": self.phase, "kind": kind, "bytes": nbytes})
        return out


def run(case, plans):
    name, config, tp, plan_name, sp, batch, seq = case
    cfg = transformers.AutoConfig.from_pretrained(config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    names = [n for n, _ in model.named_modules()]
    plan = {}
    for pattern, spec in plans[f"{plan_name}/{'sp' if sp else 'nosp'}"].items():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            plan[pattern] = style(spec)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, plan)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    log = []
    with Recorder(log, "forward"):
        out = model(input_ids=ids).logits
    if isinstance(out, DTensor):
        out = out.to_local()
    with Recorder(log, "backward"):
        out.float().sum().backward()
    return {"config": config, "tp": tp, "plan": plan_name, "sequence_parallel": sp, "micro_batch": batch,
            "seq_len": seq, "patterns": sorted(plan), "collectives": log}


def main():
    plans = json.loads(subprocess.run([BIN, "tests/reference/tp_comm.lua"], check=True, capture_output=True,
                                      text=True).stdout)
    out = {"about": __doc__.split("\n\n")[0], "versions": refdata.versions(), "cases": {}}
    for case in CASES:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case[2])
        out["cases"][case[0]] = run(case, plans)
        c = out["cases"][case[0]]["collectives"]
        summary = {}
        for x in c:
            if x["kind"] not in ("all_reduce", "all_gather", "reduce_scatter"):
                continue
            k = (x["phase"], x["kind"])
            summary[k] = summary.get(k, 0) + 1
        print(case[0], summary)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
