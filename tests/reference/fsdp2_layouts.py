"""fsdp2_layouts.py: what real PyTorch FSDP2 makes of moonshard's plans, for
tests/lua/reference_layouts_spec.lua.  Writes tests/reference/data/fsdp2_layouts.json.

For every case (a config, a mesh, a shipped policy or, once, a variant of one) moonshard's
planner says which fully_shard calls the policy makes (tests/reference/fsdp2_layouts.lua, run
with build/moonshard: the module tree, the calls with their meshes, mp policies,
reshard_after_forward as given, ignored parameters and shard dims, and what expert
parallelism owns).  `plan --json` has no module tree, ties or ignored parameters, hence the
Lua side; what torch computes from these inputs is the reference, not moonshard's figures.
This script builds that module tree as a torch nn.Module tree (plain parameters on the CPU,
torch's own CheckpointWrapper where the policy wrapped layers, tied weights as one
Parameter, expert-parallel parameters as DTensors Shard(0) on the ep axis of a
(ep_shard, ep) mesh), makes the same calls with torch's fully_shard on a fake process group
(torch.testing._internal.distributed.fake_pg) as each rank in turn, runs one forward and
backward (a forward that sums every parameter, so every unit all-gathers, and every
trainable parameter gets a gradient, reduce-scattered), and one torch.optim.AdamW step.
It records, from torch's objects:

  units      per fully_shard call (an FSDPParamGroup): its parameters in order, its mesh
             (dim names and sizes), its MixedPrecisionPolicy, whether it reshards after
             forward (post_forward_mesh_info), and the collectives it issued (all_gather,
             reduce_scatter, all_reduce: group size, buffer bytes, dtype);
  params     per parameter, in named_parameters() order: the unit it landed in, global
             shape, dtype, requires_grad, the DTensor's mesh dims and placements, the dtype
             FSDP2 gathers it in, FSDP's padded shard and the local (unpadded) shape on
             every rank;
  bytes      per rank: the parameters' storage (padded shards), the gradients' storage after
             backward, AdamW's exp_avg + exp_avg_sq (and its step tensors, apart).

(The model builders against transformers' own classes: tests/reference/model_params.py.)

Runs in about half a minute on two cores (tiny configs: tests/reference/configs/).
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

import refdata

OUT = "tests/reference/data/fsdp2_layouts.json"
BIN = os.environ.get("MOONSHARD_BIN", "build/moonshard")

FSDP2 = "policies/fsdp2_default.lua"
INKLING2 = "policies/inkling2"
LLAMA = "tests/reference/configs/llama_tiny.json"
MIXTRAL = "tests/reference/configs/mixtral_tiny.json"
QWEN3 = "tests/reference/configs/qwen3_moe_tiny.json"
DEEPSEEK = "tests/reference/configs/deepseek_v3_tiny.json"
INK = "tests/lua/configs/inkling2_tiny.json"
LLAMA_TP = "tests/reference/configs/llama_tp_tiny.json"

# name, config, mesh, policy (the optimizer counted is torch_adamw: torch.optim.AdamW's state)
CASES = [
    ("llama_fsdp4", LLAMA, "dp_shard=4", FSDP2),
    ("llama_hsdp2x2", LLAMA, "dp_replicate=2,dp_shard=2", FSDP2),
    ("llama_hsdp2x3", LLAMA, "dp_replicate=2,dp_shard=3", FSDP2),
    ("llama_full_fp32_fsdp4", LLAMA, "dp_shard=4", "policies/full_fp32.lua"),
    ("mixtral_fsdp3", MIXTRAL, "dp_shard=3", FSDP2),
    ("qwen3_moe_fsdp4", QWEN3, "dp_shard=4", FSDP2),
    ("qwen3_moe_hsdp2x2", QWEN3, "dp_replicate=2,dp_shard=2", FSDP2),
    ("qwen3_moe_ep2", QWEN3, "dp_shard=4,ep=2", FSDP2),
    ("deepseek_v3_by_dtype_fsdp4", DEEPSEEK, "dp_shard=4", "policies/by_dtype.lua"),
    ("deepseek_v3_ep2_local", DEEPSEEK, "dp_shard=2,ep=2", FSDP2),
    # a policy that sets param_dtype and no reduce_dtype, the rule torch 2.15 changed
    ("llama_no_reduce_dtype_fsdp4", LLAMA, "dp_shard=4", "tests/reference/policies/fsdp2_no_reduce_dtype.lua"),
    ("inkling2_fsdp4", INK, "dp_shard=4", INKLING2),
    ("inkling2_hsdp2x2", INK, "dp_replicate=2,dp_shard=2", INKLING2),
    ("inkling2_ep2", INK, "dp_shard=4,ep=2", INKLING2),
    ("inkling2_hsdp2x2_ep2", INK, "dp_replicate=2,dp_shard=2,ep=2", INKLING2),
    # tensor parallelism under FSDP2 (tp innermost): the shipped plan, its sequence-parallel
    # variant under HSDP, and FSDP's uneven shards of tp-local tensors
    ("llama_tp2_fsdp2", LLAMA_TP, "dp_shard=2,tp=2", FSDP2),
    ("llama_tp2_sp_hsdp2x2", LLAMA_TP, "dp_replicate=2,dp_shard=2,tp=2",
     "tests/reference/policies/fsdp2_sequence_parallel.lua"),
    ("llama_tp2_fsdp3", LLAMA_TP, "dp_shard=3,tp=2", FSDP2),
    # vocab 67 over tp = 2: the tied embedding and head split 34 / 33, then FSDP's halves
    ("llama_tp2_uneven_fsdp2", LLAMA, "dp_shard=2,tp=2", FSDP2),
]
OPTIMIZER = "torch_adamw"

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
          "i64": torch.int64, "i32": torch.int32, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def dname(dt):
    return None if dt is None else NAMES[dt]


def moonshard_cases():
    """tests/reference/fsdp2_layouts.lua's description of every case, from build/moonshard."""
    cases = [{"name": n, "config": c, "mesh": m, "policy": p, "optimizer": OPTIMIZER} for n, c, m, p in CASES]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
    try:
        out = subprocess.run([BIN, "tests/reference/fsdp2_layouts.lua", f.name], check=True, capture_output=True,
                             text=True).stdout
    finally:
        os.unlink(f.name)
    return json.loads(out)


def sizes_of(mesh):
    s = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    for item in mesh.split(","):
        k, v = item.split("=")
        s[k] = int(v)
    assert s["pp"] == s["cp"] == 1, "this reference makes no pp or cp meshes"
    world = s["dp_replicate"] * s["dp_shard"] * s["tp"]
    s["ep_shard"] = world // s["ep"]
    return s, world


# ------------------------------------------------------------------ the module tree

class Node(nn.Module):
    """A module of moonshard's tree: its own parameters and children, and a forward that adds
    up every parameter (each unit is all-gathered, each trainable parameter gets a gradient)."""

    def __init__(self, type_name):
        super().__init__()
        self.type_name = type_name

    def forward(self, x):
        acc = x
        for child in self.children():
            acc = acc + child(x).to(acc.dtype)
        for p in self._parameters.values():
            t = p.to_local() if isinstance(p, DTensor) else p
            if t.is_floating_point():
                acc = acc + t.sum().to(acc.dtype)
        return acc


def build(desc):
    """The torch tree of a description (tests/reference/fsdp2_layouts.lua's `tree`)."""
    made = {}

    def walk(d, name):
        m = Node(d["type"])
        for p in d["params"]:
            fqn = name + p["name"]
            if p["same_as"] is not None:
                param = made[p["same_as"]]
            else:
                t = torch.zeros(p["shape"], dtype=DTYPES[p["dtype"]])
                param = nn.Parameter(t, requires_grad=p["requires_grad"])
            made.setdefault(fqn, param)
            m.register_parameter(p["name"], param)
        for b in d.get("buffers", []):
            m.register_buffer(b["name"], torch.zeros(b["shape"], dtype=DTYPES[b["dtype"]]), persistent=b["persistent"])
        for cname, c in d["children"]:
            if c["type"] == "CheckpointWrapper":
                (inner_name, inner), = c["children"]
                assert inner_name == "_checkpoint_wrapped_module" and not c["params"], cname
                # torch's own wrapper: its names gain _checkpoint_wrapped_module as torch makes them
                m.add_module(cname, checkpoint_wrapper(walk(inner, name + cname + "." + inner_name + ".")))
            else:
                m.add_module(cname, walk(c, name + cname + "."))
        return m

    return walk(desc, "")


def ties_of(desc):
    """(fqn, the fqn it is tied to) for every parameter met earlier in the tree."""
    out = []

    def walk(d, name):
        for p in d["params"]:
            if p["same_as"] is not None:
                out.append((name + p["name"], p["same_as"]))
        for cname, c in d["children"]:
            walk(c, name + cname + ".")

    walk(desc, "")
    return out


def set_param(model, fqn, param):
    mod, _, pname = fqn.rpartition(".")
    setattr(model.get_submodule(mod), pname, param)


# ------------------------------------------------------------------ collectives, by unit

class Recorder:
    """Every all_gather / reduce_scatter / all_reduce FSDP2 issues, with the FSDPParamGroup
    whose unshard or post_backward issued it."""

    def __init__(self):
        self.group = None
        self.log = []
        self.saved = []

    def _tag(self, cls, name):
        orig = getattr(cls, name)
        rec = self

        def wrapper(group_self, *a, **k):
            prev, rec.group = rec.group, group_self
            try:
                return orig(group_self, *a, **k)
            finally:
                rec.group = prev

        self.saved.append((cls, name, orig))
        setattr(cls, name, wrapper)

    def _comm(self, name, kind, pick):
        orig = getattr(dist, name)
        rec = self

        def wrapper(*a, **k):
            t, group = pick(*a, **k)
            rec.log.append((rec.group, kind, group.size() if group is not None else dist.get_world_size(), t.numel() * t.element_size(), dname(t.dtype)))
            return orig(*a, **k)

        self.saved.append((dist, name, orig))
        setattr(dist, name, wrapper)

    def __enter__(self):
        self._tag(FSDPParamGroup, "unshard")
        self._tag(FSDPParamGroup, "post_backward")
        # the buffer whose size the bus bytes are computed from: the all-gather's output, the
        # reduce-scatter's input, the all-reduce's tensor
        self._comm("all_gather_single", "all_gather",
                   lambda output_tensor, input_tensor, group=None, async_op=False: (output_tensor, group))
        self._comm("reduce_scatter_single", "reduce_scatter",
                   lambda output, input, op=None, group=None, async_op=False: (input, group))
        self._comm("all_reduce", "all_reduce",
                   lambda tensor, op=None, group=None, async_op=False: (tensor, group))
        return self

    def __exit__(self, *exc):
        for obj, name, orig in reversed(self.saved):
            setattr(obj, name, orig)


# ------------------------------------------------------------------ one rank

def storages_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if s.nbytes() > 0 and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def placement_str(p):
    """A DTensor placement as moonshard writes it: Shard(d), Replicate(), ... (str() of a
    placement is the short S(0), R in torch 2.15)."""
    if type(p) is Shard:
        return "Shard(%d)" % p.dim
    if isinstance(p, _StridedShard):
        return "_StridedShard(%d, split_factor=%d)" % (p.dim, p.split_factor)
    if isinstance(p, Replicate):
        return "Replicate()"
    return repr(p)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def run_rank(case, desc, rank):
    sizes, world = sizes_of(case["mesh"])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        root_mesh = init_device_mesh("cpu", (sizes["dp_replicate"], sizes["dp_shard"], sizes["tp"]),
                                     mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        moe_mesh = init_device_mesh("cpu", (sizes["ep_shard"], sizes["ep"]), mesh_dim_names=("ep_shard", "ep"))

        def mesh_of(axes):
            axes = tuple(axes)
            if all(a in ("ep_shard", "ep") for a in axes):
                return moe_mesh[axes if len(axes) > 1 else axes[0]]
            return root_mesh[axes if len(axes) > 1 else axes[0]]

        model = build(desc["tree"])
        # tensor parallelism first, as Automodel applies it: each placed module's parameters
        # distributed over tp by the style's own partition function (its activation hooks
        # are left out: the stand-in forward only sums parameters)
        for t in desc["tp"]:
            module = model.get_submodule(t["module"])
            if t["kind"] == "sequence_parallel":
                fn = SequenceParallel()._replicate_module_fn
            else:
                style = ColwiseParallel() if t["kind"] == "colwise" else RowwiseParallel()
                fn = style._partition_embedding_fn if module.type_name == "Embedding" else style._partition_linear_fn
            distribute_module(module, root_mesh["tp"], fn)
        # a tied weight distributed through one module is the other's too again, as
        # Automodel's ensure_tied_lm_head re-ties them after parallelize_module
        if desc["tp"]:
            for fqn, first in ties_of(desc["tree"]):
                set_param(model, fqn, model.get_parameter(first))
        # expert parallelism: each rank holds its ep coordinate's experts (dim 0), as torch
        # splits them
        for e in desc["ep"]:
            p = model.get_parameter(e["fqn"])
            dt = distribute_tensor(p.detach(), moe_mesh["ep"], [Shard(0)], src_data_rank=None)
            set_param(model, e["fqn"], nn.Parameter(dt, requires_grad=p.requires_grad))

        states = []
        for call in desc["calls"]:
            module = model.get_submodule(call["module"])
            mp = call["mp_policy"]
            kwargs = dict(
                mesh=mesh_of(call["mesh"]),
                reshard_after_forward=call["reshard_after_forward"],
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=DTYPES.get(mp["param_dtype"]), reduce_dtype=DTYPES.get(mp["reduce_dtype"]),
                    output_dtype=DTYPES.get(mp["output_dtype"]), cast_forward_inputs=mp["cast_forward_inputs"]),
            )
            if call["ignored_params"]:
                kwargs["ignored_params"] = {model.get_parameter(f) for f in call["ignored_params"]}
            if call["shard_dims"]:
                dims = {id(model.get_parameter(f)): d for f, d in call["shard_dims"].items()}
                kwargs["shard_placement_fn"] = lambda p, dims=dims: Shard(dims[id(p)]) if id(p) in dims else None
            if call["offload_policy"] == "cpu":
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
            fully_shard(module, **kwargs)
            states.append(module._get_fsdp_state())

        with Recorder() as rec:
            out = model(torch.zeros(1))
            out.float().sum().backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, "no gradient for %s" % missing
        opt = torch.optim.AdamW(trainable, lr=1e-3)
        opt.step()

        names = {m: n for n, m in model.named_modules()}

        def fqn_of(fsdp_param):
            info = fsdp_param._module_info
            prefix = names[info.module]
            return (prefix + "." if prefix else "") + info.param_name

        units, in_unit = [], {}
        for call, state in zip(desc["calls"], states):
            groups = state._fsdp_param_groups
            assert len(groups) <= 1, call["module"]
            u = {"module": call["module"], "params": []}
            if groups:
                g = groups[0]
                mesh = g.mesh_info.mesh
                pf = g.post_forward_mesh_info
                if pf is None:
                    raf = False
                elif pf is g.mesh_info:
                    raf = True
                else:
                    raf = pf.shard_mesh_size
                u.update({
                    "mesh_dims": list(mesh.mesh_dim_names), "mesh_shape": list(mesh.shape),
                    "param_dtype": dname(state._mp_policy.param_dtype),
                    "reduce_dtype": dname(state._mp_policy.reduce_dtype),
                    "output_dtype": dname(state._mp_policy.output_dtype),
                    "cast_forward_inputs": state._mp_policy.cast_forward_inputs,
                    "reshard_after_forward": raf,
                    "params": [fqn_of(fp) for fp in g.fsdp_params],
                    "collectives": {k: [[n, b, d] for (grp, kind, n, b, d) in rec.log if grp is g and kind == k]
                                    for k in ("all_gather", "reduce_scatter", "all_reduce")},
                })
                for fp in g.fsdp_params:
                    in_unit[fqn_of(fp)] = (fp, call["module"])
            units.append(u)
        untagged = [x[1:] for x in rec.log if x[0] is None]
        assert not untagged, "collectives outside any unit: %s" % untagged

        params = {}
        for fqn, p in model.named_parameters():
            fp, unit = in_unit.get(fqn, (None, None))
            params[fqn] = {
                "unit": unit,
                "shape": list(p.shape), "dtype": dname(p.dtype), "requires_grad": p.requires_grad,
                "mesh_dims": list(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else [],
                "placements": [placement_str(x) for x in p.placements] if isinstance(p, DTensor) else [],
                "local": list(local(p).shape),
                "padded": list(fp.padded_sharded_param_size) if fp is not None else None,
                # the dtype FSDP2 all-gathers (computes) it in: its param_dtype, clamped
                "gathered": dname(fp.param_dtype or fp.orig_dtype) if fp is not None else None,
            }

        ps = list(model.parameters())
        exp = [t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
        steps = [t for st in opt.state.values() for k, t in st.items() if k == "step"]
        rank_bytes = {
            "params": storages_bytes(local(p) for p in ps),
            "grads": storages_bytes(local(p.grad) for p in ps if p.grad is not None),
            "optimizer": sum(local(t).numel() * local(t).element_size() for t in exp),
            "optimizer_step_tensors": sum(t.numel() * t.element_size() for t in steps),
        }
        return units, params, rank_bytes
    finally:
        dist.destroy_process_group()


def run_case(case, desc):
    _, world = sizes_of(case["mesh"])
    units = params = None
    per_rank_bytes = []
    for rank in range(world):
        u, p, b = run_rank(case, desc, rank)
        per_rank_bytes.append(b)
        if units is None:
            units, params = u, {k: dict(v, fqn=k, local=[v["local"]], padded=[v["padded"]]) for k, v in p.items()}
            continue
        # what is not per rank is the same on every rank
        assert u == units, "%s: rank %d's units differ from rank 0's" % (case["name"], rank)
        assert list(p) == list(params), case["name"]
        for k, v in p.items():
            rec = params[k]
            for field in ("unit", "shape", "dtype", "requires_grad", "mesh_dims", "placements", "gathered"):
                assert v[field] == rec[field], (case["name"], rank, k, field)
            # per rank: under tensor parallelism that splits a dim unevenly, tp ranks pad
            # pieces of different sizes
            rec["local"].append(v["local"])
            rec["padded"].append(v["padded"])
    # parameters in torch's named_parameters() order
    return {"units": units, "params": list(params.values()), "bytes": per_rank_bytes}


def main():
    descs = moonshard_cases()
    out = {"made_by": "tests/reference/fsdp2_layouts.py (tests/reference/make.sh fsdp2_layouts); do not edit",
           "versions": refdata.versions(), "cases": []}
    for name, config, mesh, policy in CASES:
        case = {"name": name, "config": config, "mesh": mesh, "policy": policy, "optimizer": OPTIMIZER}
        d = descs[name]
        rec = run_case(case, d)
        case.update({"world": sizes_of(mesh)[1], "calls": d["calls"], "ep": d["ep"], "tp": d["tp"], "torch": rec})
        out["cases"].append(case)
        n = len(rec["params"])
        print("fsdp2_layouts: %-28s %3d parameters x %d ranks, %d units" % (name, n, case["world"], len(rec["units"])),
              file=sys.stderr)
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=False)
        f.write("\n")
    os.replace(tmp, OUT)
    print("fsdp2_layouts: wrote %s (%d bytes)" % (OUT, os.path.getsize(OUT)), file=sys.stderr)


if __name__ == "__main__":
    main()
