"""Plan a torch nn.Module with a moonshard Lua policy, apply the plan with PyTorch's FSDP2, and
check the result against the plan.

    plan = moonshard_torch.plan_model(model, "dp_shard=4", "policies/fsdp2_default.lua")
    moonshard_torch.apply_plan(model, plan)          # fully_shard per unit, in the plan's order
    report = moonshard_torch.check_plan(model, plan)  # every parameter, unit and byte, or an error

The policy is the single source of truth: the plan names each unit (a module), its mesh
axes, its MixedPrecisionPolicy, reshard_after_forward, offload policy, each parameter's
placement and the modules wrapped for activation checkpointing; apply_plan calls torch's own
APIs with exactly those, and check_plan compares what FSDP2 built with the plan on this rank.
"""
import json
import math
import re

import torch

from ._embed import Interp, MoonshardError

CHECKPOINT = "_checkpoint_wrapped_module"

TORCH_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
               torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_DTYPE[torch.float8_e4m3fn] = "f8e4m3"
    TORCH_DTYPE[torch.float8_e5m2] = "f8e5m2"
MS_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}


def strip_checkpoint(name):
    """A dotted name without activation checkpointing's wrapper segments."""
    return ".".join(p for p in name.split(".") if p != CHECKPOINT)


def _dtype_of(p, fqn):
    if p.dtype not in TORCH_DTYPE:
        raise MoonshardError("dtype", "parameter %s: torch dtype %s has no moonshard dtype" % (fqn, p.dtype))
    return TORCH_DTYPE[p.dtype]


def model_description(model):
    """What describe() gives the interpreter: [(fqn, shape, dtype, requires_grad)] in
    named_parameters order (each parameter once), ties [(second name, first name)], and the
    type of every module that holds a parameter below it."""
    params, ties, first = [], [], {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((fqn, first[id(p)]))
            continue
        first[id(p)] = fqn
        params.append((fqn, list(p.shape), _dtype_of(p, fqn), bool(p.requires_grad)))
    holders = {""}
    for fqn, _, _, _ in params + [(t[0], None, None, None) for t in ties]:
        parts = fqn.split(".")
        for i in range(1, len(parts)):
            holders.add(".".join(parts[:i]))
    types = [(name, type(m).__name__) for name, m in model.named_modules() if name in holders]
    return params, ties, types


def describe(model, interp):
    """Describes model to the interpreter: its parameters (names, shapes, dtypes,
    requires_grad), tied parameters (one parameter, a second name) and module types."""
    params, ties, types = model_description(model)
    for fqn, shape, dtype, rg in params:
        interp.add_param(fqn, shape, dtype, rg)
    for fqn, target in ties:
        interp.tie(fqn, target)
    for name, t in types:
        interp.module_type(name, t)
    return params, ties


def plan_model(model, mesh, policy, options=(), optimizer=None):
    """The plan (a dict, the JSON of `moonshard plan --json`) of model on mesh ("dp_shard=4",
    "dp_replicate=2,dp_shard=2") with the policy file or directory; options are the policy's
    NAME=VALUE settings (moonshard plan --set).  The same on every rank: each plans alone."""
    if not isinstance(model, torch.nn.Module):
        raise MoonshardError("invalid_argument", "plan_model: model must be a torch.nn.Module, got %s" % type(model).__name__)
    for name, value in (("mesh", mesh), ("policy", policy)):
        if not isinstance(value, str) or not value:
            raise MoonshardError("invalid_argument", "plan_model: %s must be a non-empty string (%s), got %r" % (
                name, "e.g. \"dp_shard=4\"" if name == "mesh" else "a policy file or directory", value))
    if isinstance(options, str):
        options = [options]
    if next(model.parameters(), None) is None:
        raise MoonshardError("invalid_argument", "plan_model: the model (%s) has no parameters: nothing to shard"
                             % type(model).__name__)
    with Interp() as interp:
        describe(model, interp)
        if optimizer:
            interp.set_optimizer(optimizer)
        for o in options:
            interp.set_option(o)
        interp.plan(mesh, policy)
        plan = interp.plan_json()
    plan["host"] = {"mesh": mesh, "policy": policy, "options": list(options)}
    return plan


def parse_mesh(spec):
    """"dp_replicate=2,dp_shard=2" -> {"dp_replicate": 2, "dp_shard": 2}."""
    out = {}
    for item in spec.split(","):
        m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\d+)\s*", item)
        if not m:
            raise MoonshardError("invalid_argument", "mesh %r: expected AXIS=SIZE items like dp_shard=4" % spec)
        out[m.group(1)] = int(m.group(2))
    return out


def load_plan(path, model, mesh=None):
    """A plan written by `moonshard plan --json` (or json.dump of plan_model's), checked
    against model and, when given, the mesh spec: every parameter's name, shape and dtype,
    the count of trainable parameters, and the mesh's axis sizes.  A difference is a
    MoonshardError listing each."""
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise MoonshardError("invalid_argument", "load_plan: a path to a plan's JSON file expected, got %s (a plan "
                             "already in hand is applied as it is: apply_plan(model, plan))" % type(path).__name__)
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError as e:
        raise MoonshardError("io", "%s: cannot read the plan: %s" % (path, e.strerror or e))
    except ValueError as e:
        raise MoonshardError("invalid_argument", "%s: not JSON (%s); a plan is what `moonshard plan --json` writes"
                             % (path, e))
    mesh_ok = isinstance(plan, dict) and isinstance(plan.get("mesh"), dict) and \
        isinstance(plan["mesh"].get("axes"), list) and "world" in plan["mesh"]
    if not isinstance(plan, dict) or not isinstance(plan.get("units"), list) or not mesh_ok:
        raise MoonshardError("invalid_argument", "%s: not a moonshard plan (it needs units and a mesh with axes and "
                             "world, as `moonshard plan --json` writes)" % path)
    problems = []
    planned = {}
    for u in plan["units"]:
        for p in u.get("params", []):
            planned[strip_checkpoint(p["fqn"])] = (list(p["shape"]), p["dtype"])
    for o in plan.get("owned") or []:
        planned[strip_checkpoint(o["fqn"])] = (list(o["shape"]), o.get("dtype"))
    params, ties, _ = model_description(model)
    have = {fqn: (shape, dtype) for fqn, shape, dtype, _ in params}
    for fqn in sorted(set(planned) - set(have)):
        problems.append("%s is in the plan, not in the model" % fqn)
    for fqn in sorted(set(have) - set(planned)):
        problems.append("%s is in the model, not in the plan" % fqn)
    for fqn in sorted(set(have) & set(planned)):
        ps, pd = planned[fqn]
        ms, md = have[fqn]
        if ps != ms or (pd and pd != md):
            problems.append("%s: the model's is %s %s, the plan's %s %s" % (fqn, "x".join(map(str, ms)), md,
                                                                              "x".join(map(str, ps)), pd))
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)
    planned_trainable = (plan.get("model") or {}).get("trainable_params")
    if planned_trainable is not None and planned_trainable != trainable:
        problems.append("the plan was made for %d trainable parameters, the model has %d (other parameters frozen: "
                        "the plan's gradient and optimizer figures would not hold)" % (planned_trainable, trainable))
    if mesh is not None:
        want = parse_mesh(mesh)
        got = {a["name"]: a["size"] for a in plan["mesh"]["axes"]}
        if plan["mesh"].get("ep", 1) != 1:
            got["ep"] = plan["mesh"]["ep"]
        for axis in sorted(set(want) | set(got)):
            if want.get(axis, 1) != got.get(axis, 1):
                problems.append("mesh axis %s: %d in the plan, %d asked for" % (axis, got.get(axis, 1), want.get(axis, 1)))
    if problems:
        shown = problems[:20] + (["... and %d more" % (len(problems) - 20)] if len(problems) > 20 else [])
        raise MoonshardError("invalid_argument", "%s does not fit this model and mesh (%d problem%s): %s"
                             % (path, len(problems), "" if len(problems) == 1 else "s", "; ".join(shown)))
    return plan


# ---------------------------------------------------------------- applying

def _world_mesh(plan, device_type):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        raise MoonshardError("state", "apply_plan: torch.distributed is not initialised (torchrun, then "
                             "dist.init_process_group)")
    axes = plan["mesh"]["axes"]
    world = plan["mesh"]["world"]
    if dist.get_world_size() != world:
        raise MoonshardError("invalid_argument", "apply_plan: the plan's mesh is %s, a world of %d; this job has %d "
                             "processes" % (",".join("%s=%d" % (a["name"], a["size"]) for a in axes if a["size"] > 1),
                                            world, dist.get_world_size()))
    for a in axes:
        if a["name"] in ("pp", "cp") and a["size"] > 1:
            raise MoonshardError("not_built", "apply_plan: %s = %d: moonshard_torch applies data, tensor and expert "
                                 "parallelism; pipelines and context parallelism are not applied yet"
                                 % (a["name"], a["size"]))
    tp = plan.get("tensor_parallel") or {}
    if tp.get("sequence_parallel"):
        raise MoonshardError("not_built", "apply_plan: sequence_parallel: the TP plan's sequence-parallel variant is "
                             "not applied by moonshard_torch yet")
    dense = init_device_mesh(device_type, tuple(a["size"] for a in axes), mesh_dim_names=tuple(a["name"] for a in axes))
    ep = plan["mesh"].get("ep", 1)
    moe = None
    if ep > 1:
        # Automodel's MoE mesh: (ep_shard, ep), ep innermost (groups of ep consecutive ranks)
        moe = init_device_mesh(device_type, (plan["mesh"]["ep_shard"], ep), mesh_dim_names=("ep_shard", "ep"))
    return dense, moe


def _unit_mesh(u, dense, moe):
    axes = tuple(u["mesh_axes"])
    mesh = moe if moe is not None and set(axes) <= {"ep_shard", "ep"} else dense
    if axes[0] not in (mesh.mesh_dim_names or ()):
        raise MoonshardError("not_built", "unit %s: mesh axes %s: moonshard_torch makes units on the axes of the "
                             "world mesh or of the MoE mesh (ep_shard, ep)" % (u["name"], list(axes)))
    return mesh[axes[0]] if len(axes) == 1 else mesh[axes]


TP_STYLES = ("colwise", "rowwise")


def _tensor_parallel(model, plan, dense):
    """The plan's TP plan through parallelize_module on the tp axis: each pattern's style as
    torch's ColwiseParallel / RowwiseParallel (the embedding rowwise takes replicated token ids,
    lm_head colwise gives replicated logits, so an ordinary loss runs on every tp rank)."""
    tp = plan.get("tensor_parallel") or {}
    if not tp or tp.get("size", 1) <= 1:
        return
    _, ties, _ = model_description(model)
    if ties:
        raise MoonshardError("not_built", "apply_plan: tensor parallelism with tied parameters (%s): "
                             "parallelize_module gives each module its own DTensor, which unties them; give the "
                             "model untied weights" % ", ".join("%s = %s" % t for t in ties))
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {}
    for entry in tp.get("plan") or []:
        if entry.get("modules", 0) == 0:
            continue
        style = entry["style"]
        if style not in TP_STYLES:
            raise MoonshardError("not_built", "tensor_parallel: pattern %s has style %s; moonshard_torch applies %s"
                                 % (entry["pattern"], style, " and ".join(TP_STYLES)))
        if style == "colwise":
            styles[entry["pattern"]] = ColwiseParallel(output_layouts=Replicate()) \
                if entry["pattern"] == "lm_head" else ColwiseParallel()
        else:
            styles[entry["pattern"]] = RowwiseParallel(input_layouts=Replicate()) \
                if entry["pattern"].endswith("embed_tokens") else RowwiseParallel()
    parallelize_module(model, dense["tp"], styles)


def _distribute_owned(model, plan, moe):
    """Expert parallelism's parameters (the plan's owned, by ep): each a DTensor on the MoE
    mesh's ep axis with its placements (Shard(0): the rank's experts), as Automodel's
    apply_ep leaves them; the units around them ignore them, or an ep_shard unit shards them
    further."""
    from torch.distributed.tensor import Shard, distribute_tensor
    for o in plan.get("owned") or []:
        if o.get("by") != "ep":
            raise MoonshardError("not_built", "parameter %s is owned by %s; moonshard_torch applies expert "
                                 "parallelism's ownership only" % (o["fqn"], o.get("by")))
        dims = [_placement_dim(t) for t in o["placements"]]
        if moe is None or None in dims or len(dims) != 1:
            raise MoonshardError("not_built", "parameter %s: placements %s on the ep axis expected as [Shard(d)]"
                                 % (o["fqn"], o["placements"]))
        parent_name, _, leaf = o["fqn"].rpartition(".")
        parent = _module(model, parent_name)
        p = getattr(parent, leaf)
        dt = distribute_tensor(p.detach(), moe["ep"], [Shard(dims[0])])
        setattr(parent, leaf, torch.nn.Parameter(dt, requires_grad=p.requires_grad))


def _label(name):
    return name or "<root>"


def _module(model, name):
    if name in ("", "<root>"):
        return model
    try:
        return model.get_submodule(name)
    except AttributeError as e:
        raise MoonshardError("invalid_argument", "the plan's unit %s is no module of the model (%s)" % (name, e))


def _wrap_checkpointed(model, names):
    """Wraps each module the plan checkpoints in torch's CheckpointWrapper (its child is
    _checkpoint_wrapped_module, the name the plan's units use)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
    for name in names:
        target = _module(model, name)
        if isinstance(target, CheckpointWrapper):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = _module(model, parent_name)
        setattr(parent, child, checkpoint_wrapper(target))


def _placement_dim(text):
    m = re.fullmatch(r"Shard\((\d+)\)", text)
    return int(m.group(1)) if m else None


def _packed_overrides(u, named, where):
    """A packed unit (moonshard's fully_shard islands: each island parameter with its own
    policy) as FSDP2 can hold it: torch 2.15's MixedPrecisionPolicy.param_dtype_override_fn
    lets a parameter keep its stored dtype (gather in it) instead of the unit's param_dtype,
    but FSDP2 still asks one stored dtype and one reduce dtype of a unit's trainable
    parameters (_init_mp_dtypes: "FSDP expects uniform original parameter dtype").  Returns
    {id(param): torch dtype} for the parameters that gather in their stored dtype ({} for a unit
    that is not packed); raises, naming the unit and the two dtypes, for a packed unit FSDP2
    cannot hold (bf16 weights beside fp32-stored islands: plan without packing)."""
    if not u.get("packed"):
        return {}
    params = [p for p in u["params"] if named.get(p["fqn"]) is None or named[p["fqn"]].requires_grad]

    def two(key):
        seen = {}
        for p in params:
            if p.get(key) is not None:
                seen.setdefault(p[key], p["fqn"])
        return sorted(seen.items())[:2] if len(seen) > 1 else None

    why = None
    pair = two("dtype")
    if pair:
        why = "its trainable parameters are stored in %s (%s) and %s (%s); FSDP2 expects one stored dtype per " \
              "unit (\"FSDP expects uniform original parameter dtype\")" % (pair[0][0], pair[0][1], pair[1][0], pair[1][1])
    elif two("reduce_dtype"):
        pair = two("reduce_dtype")
        why = "its gradients reduce in %s (%s) and %s (%s); FSDP2 reduces a unit's in one dtype" % (
            pair[0][0], pair[0][1], pair[1][0], pair[1][1])
    else:
        odd = [p for p in u["params"] if p.get("gather_dtype") not in (u["param_dtype"] or p["dtype"], p["dtype"])]
        if odd:
            why = "parameter %s gathers in %s, neither the unit's param_dtype %s nor its stored dtype %s (what " \
                  "param_dtype_override_fn may return)" % (odd[0]["fqn"], odd[0]["gather_dtype"], u["param_dtype"],
                                                          odd[0]["dtype"])
    if why:
        raise MoonshardError("not_built", "%s: unit %s is a packed unit (islands packed in it, each with its own "
                             "policy: %s) that FSDP2 cannot hold: %s; plan without packing (the policy's "
                             "pack_islands=false, or no islands in ctx:fully_shard)" % (
                                 where, _label(u["name"]), ", ".join(i["name"] for i in u["packed"]["islands"][:3]),
                                 why))
    return {id(named[p["fqn"]]): MS_DTYPE[p["dtype"]] for p in u["params"]
            if p["fqn"] in named and p.get("gather_dtype") == p["dtype"] and p["dtype"] != u["param_dtype"]
            and u["param_dtype"] is not None}


def _cast_floating(dtype, tree):
    """FSDP2's cast of a module's floating inputs or outputs (_cast_fp_tensor over the tree)."""
    try:
        from torch.distributed.utils import _apply_to_tensors
    except ImportError:  # (torch keeps it private)
        from torch.utils._pytree import tree_map as _apply_to_tensors

    def cast(x):
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or x.dtype == dtype:
            return x
        return x.to(dtype)
    return _apply_to_tensors(cast, tree)


def _island_hooks(model, u):
    """The module-boundary casts FSDP2 gives a unit of its own, on each island of a packed
    unit: its floating inputs cast to its param_dtype when cast_forward_inputs, its floating
    outputs to its output_dtype, so that the forward computes what the islands as units did."""
    for isl in (u.get("packed") or {}).get("islands") or []:
        mod = _module(model, isl["name"])
        pd, od = isl.get("param_dtype"), isl.get("output_dtype")
        if isl.get("cast_forward_inputs") and pd:
            mod.register_forward_pre_hook(
                lambda m, args, kwargs, dt=MS_DTYPE[pd]: _cast_floating(dt, (args, kwargs)), with_kwargs=True)
        if od:
            mod.register_forward_hook(lambda m, args, out, dt=MS_DTYPE[od]: _cast_floating(dt, out))


def apply_plan(model, plan, device_type="cpu"):
    """Applies the plan to model on this rank: its TP plan through parallelize_module on the
    tp axis, activation checkpointing's wrappers for the
    modules it lists, expert parallelism's parameters as DTensors on the MoE mesh's ep axis
    (the rank's experts), then fully_shard for every unit in the plan's order with the unit's mesh
    (a 2-D mesh for HSDP), MixedPrecisionPolicy, reshard_after_forward, offload policy,
    ignored parameters (those inside the module that neither this unit nor an earlier one
    holds) and, where a parameter is sharded on another dim, shard_placement_fn; then the
    prefetch the plan counts.  Returns {unit name: module}."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard
    for name, m in model.named_modules():
        if hasattr(m, "_get_fsdp_state") or type(m).__name__.startswith("FSDP"):
            raise MoonshardError("state", "apply_plan: the model is sharded already (%s has FSDP state): apply a plan "
                                 "to a fresh model, once" % _label(name))
    dense, moe = _world_mesh(plan, device_type)
    _tensor_parallel(model, plan, dense)
    _wrap_checkpointed(model, plan.get("checkpointed") or [])
    _distribute_owned(model, plan, moe)
    named = dict(model.named_parameters())
    overrides = {u["name"]: _packed_overrides(u, named, "apply_plan") for u in plan["units"]}
    managed = set()
    units = {}
    for u in plan["units"]:
        if u["kind"] not in ("module", "fp32_island", "root"):
            raise MoonshardError("not_built", "apply_plan: unit %s is a %s unit; moonshard_torch applies FSDP2 units "
                                 "(fully_shard) only" % (_label(u["name"]), u["kind"]))
        mod = _module(model, u["name"])
        mine = [p["fqn"] for p in u["params"]]
        for fqn in mine:
            if fqn not in named:
                raise MoonshardError("invalid_argument", "unit %s: the plan's parameter %s is not the model's "
                                     "(after activation checkpointing's wrappers)" % (u["name"], fqn))
        mine_ids = {id(named[f]) for f in mine}
        ignored = {p for _, p in mod.named_parameters() if id(p) not in mine_ids and id(p) not in managed}
        dims = {}
        for p in u["params"]:
            d = _placement_dim(p["placement"])
            if d is None:
                raise MoonshardError("not_built", "unit %s: parameter %s is placed %s; moonshard_torch applies "
                                     "Shard(d) placements" % (u["name"], p["fqn"], p["placement"]))
            dims[id(named[p["fqn"]])] = d
        unit_mesh = _unit_mesh(u, dense, moe)
        mp_kwargs = {}
        if overrides[u["name"]]:
            # a packed unit: its islands' parameters gather in their stored dtype (torch 2.15)
            mp_kwargs["param_dtype_override_fn"] = lambda p, o=overrides[u["name"]]: o.get(id(p))
            _island_hooks(model, u)
        mp = MixedPrecisionPolicy(param_dtype=MS_DTYPE[u["param_dtype"]], reduce_dtype=MS_DTYPE[u["reduce_dtype"]],
                                  output_dtype=MS_DTYPE[u["output_dtype"]] if u.get("output_dtype") else None,
                                  cast_forward_inputs=u["cast_forward_inputs"], **mp_kwargs)
        # (pinned host memory needs a GPU: not on a CPU-only job)
        offload = CPUOffloadPolicy(pin_memory=device_type != "cpu") if u.get("offload_policy") == "cpu" else OffloadPolicy()
        kwargs = dict(mesh=unit_mesh, reshard_after_forward=u["reshard_after_forward"], mp_policy=mp,
                      offload_policy=offload)
        if ignored:
            kwargs["ignored_params"] = ignored
        if any(d != 0 for d in dims.values()):
            kwargs["shard_placement_fn"] = lambda p, dims=dims: Shard(dims[id(p)]) if id(p) in dims else None
        fully_shard(mod, **kwargs)
        managed |= mine_ids
        units[u["name"]] = mod
    _prefetch(plan, units)
    return units


def _prefetch(plan, units):
    """FSDP2 prefetches one unit ahead each way by itself; a deeper prefetch in the plan is
    set explicitly over the units in the plan's order (the root, which runs first, aside)."""
    pf = plan.get("prefetch") or {}
    fwd, bwd = pf.get("forward", 1), pf.get("backward", 1)
    if fwd <= 1 and bwd <= 1:
        return
    order = [m for name, m in units.items() if name not in ("", "<root>")]
    for i, m in enumerate(order):
        if fwd > 1:
            m.set_modules_to_forward_prefetch(order[i + 1:i + 1 + fwd])
        if bwd > 1:
            m.set_modules_to_backward_prefetch(list(reversed(order[max(0, i - bwd):i])))


# ---------------------------------------------------------------- checking

def _placement_text(pl):
    name = type(pl).__name__
    if name == "Shard":
        return "Shard(%d)" % pl.dim
    if name == "Replicate":
        return "Replicate()"
    if name == "_StridedShard":
        return "_StridedShard(%d, split_factor=%d)" % (pl.dim, pl.split_factor)
    return str(pl)


def _chunk(n, parts, i):
    """torch.chunk's piece i of n rows in `parts`: (start, rows); ceil(n / parts) each, the
    last ones fewer or none."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, max(0, min(size, n - start))


def _tp_local(p, tp_coord, tp_size, coord, shards):
    """The local and padded shard shapes of a tp-split parameter on tp coordinate tp_coord and
    FSDP shard coordinate coord of `shards`: the tp piece of the global shape, then FSDP2's
    dim-0 chunk of it (padded to the first chunk's rows)."""
    d = int(p["tp"]["placement"][len("Shard("):-1])
    piece = list(p["tp"]["global_shape"])
    piece[d] = _chunk(piece[d], tp_size, tp_coord)[1]
    local, padded = list(piece), list(piece)
    local[0] = _chunk(piece[0], shards, coord)[1]
    padded[0] = -(-piece[0] // shards)
    return local, padded


def _placements_on(dt, axes):
    """A DTensor's placements on the named mesh axes, in DTensor notation."""
    names = list(dt.device_mesh.mesh_dim_names or ())
    out = []
    for a in axes:
        out.append(_placement_text(dt.placements[names.index(a)]) if a in names else "(no axis %s)" % a)
    return out


def _fsdp_group(mod):
    state = mod._get_fsdp_state()
    return state._fsdp_param_group


def check_plan(model, plan, rank=None):
    """Compares what FSDP2 built on this rank with the plan: every parameter's local shape and
    placements (in DTensor notation, on the unit's mesh axes), every unit's parameters, mesh
    axes, mixed-precision policy, offload policy and reshard_after_forward, the modules
    wrapped for activation checkpointing, expert parallelism's parameters outside
    any unit (their experts on this rank), and the parameter bytes this rank holds against the plan's
    memory.per_rank[rank].params.  Returns a summary dict; raises MoonshardError listing every
    difference."""
    import torch.distributed as dist
    if rank is None:
        if not dist.is_initialized():
            raise MoonshardError("state", "check_plan: torch.distributed is not initialised (torchrun, then "
                                 "dist.init_process_group)")
        rank = dist.get_rank()
    named = dict(model.named_parameters())
    fqn_of = {id(p): n for n, p in named.items()}
    problems = []
    checked = 0
    bytes_held = 0
    in_units = set()
    sizes = {a["name"]: a["size"] for a in plan["mesh"]["axes"]}
    tp_size = sizes.get("tp", 1)
    # the rank's tp coordinate: ranks are row-major over (pp, dp_replicate, dp_shard, cp, tp)
    tp_coord = rank % tp_size
    overrides = {u["name"]: _packed_overrides(u, named, "check_plan") for u in plan["units"]}
    for u in plan["units"]:
        mod = _module(model, u["name"])
        if not hasattr(mod, "_get_fsdp_state"):
            raise MoonshardError("state", "check_plan: unit %s is not sharded (its module has no FSDP2 state): call "
                                 "apply_plan(model, plan) first" % _label(u["name"]))
        group = _fsdp_group(mod)
        if group is None:
            problems.append("unit %s: its module holds no FSDP2 parameter group" % _label(u["name"]))
            continue
        # reshard_after_forward: FSDP2 keeps a post-forward mesh (the unit's own for True, a
        # smaller one for an integer) or none (False)
        raf = u["reshard_after_forward"]
        post = group.post_forward_mesh_info
        if raf is True:
            same = post is not None and post == group.mesh_info
        elif raf is False:
            same = post is None
        else:
            same = post is not None and post != group.mesh_info
        if not same:
            problems.append("unit %s: reshard_after_forward %s, the plan's %s" % (
                _label(u["name"]), "False" if post is None else "True" if post == group.mesh_info else "a smaller mesh",
                raf))
        got = {fqn_of.get(id(fp.sharded_param), "?") for fp in group.fsdp_params}
        want = {p["fqn"] for p in u["params"]}
        if got != want:
            problems.append("unit %s: FSDP2 holds %s, the plan %s" % (_label(u["name"]), sorted(got - want) or "-",
                                                                       sorted(want - got) or "-"))
        names = tuple(group.mesh_info.mesh.mesh_dim_names or ())
        if names != tuple(u["mesh_axes"]):
            problems.append("unit %s: mesh %s, the plan's %s" % (_label(u["name"]), names, tuple(u["mesh_axes"])))
        # the policy FSDP2 keeps: the group's (older torch) or each parameter's (torch >= 2.10)
        # (a packed unit's island parameters carry their override: another's is the unit's)
        policies = [getattr(group, "mp_policy", None)] if hasattr(group, "mp_policy") else \
            [fp.mp_policy for fp in group.fsdp_params if id(fp.sharded_param) not in overrides[u["name"]]] or \
            [fp.mp_policy for fp in group.fsdp_params]
        for mp in policies[:1]:
            for field, want_dt in (("param_dtype", u["param_dtype"]), ("reduce_dtype", u["reduce_dtype"]),
                                   ("output_dtype", u.get("output_dtype"))):
                have = getattr(mp, field)
                if (MS_DTYPE.get(want_dt) if want_dt else None) != have:
                    problems.append("unit %s: %s %s, the plan's %s" % (_label(u["name"]), field, have, want_dt))
            if bool(mp.cast_forward_inputs) != bool(u["cast_forward_inputs"]):
                problems.append("unit %s: cast_forward_inputs %s, the plan's %s" % (
                    u["name"], mp.cast_forward_inputs, u["cast_forward_inputs"]))
        offload = u.get("offload_policy") == "cpu"
        wrong = [fqn_of.get(id(fp.sharded_param), "?") for fp in group.fsdp_params
                 if bool(getattr(fp, "offload_to_cpu", False)) != offload]
        if wrong:
            problems.append("unit %s: %s offloaded to the CPU %s, the plan's offload_policy %s" % (
                u["name"], ", ".join(sorted(wrong)), "not" if offload else "but", u.get("offload_policy", "none")))
        mesh = group.mesh_info.mesh
        by_fqn = {fqn_of.get(id(fp.sharded_param)): fp for fp in group.fsdp_params}
        for p in u["params"]:
            fp = by_fqn.get(p["fqn"])
            if fp is None:
                continue
            dt = fp.sharded_param
            in_units.add(p["fqn"])
            # the rank's coordinate on the shard axis (the last of the unit's mesh)
            coord = mesh.get_local_rank(mesh.mesh_dim_names[-1]) if mesh.ndim > 1 else mesh.get_local_rank()
            want_shape = list(p["local_shapes"][coord])
            want_padded = list(p["padded_shard_shape"])
            if p.get("tp") and p["tp"].get("placement", "").startswith("Shard(") and tp_size > 1:
                # the plan's local_shapes are those of tp coordinate 0's piece; another tp
                # coordinate's piece is cut from the global shape as torch.chunk cuts it
                want_shape, want_padded = _tp_local(p, tp_coord, tp_size, coord, mesh.size(mesh.ndim - 1))
            have_shape = list(dt.to_local().shape)
            if have_shape != want_shape:
                problems.append("%s: local shape %s on rank %d, the plan's %s" % (p["fqn"], have_shape, rank, want_shape))
            have_pl = _placements_on(dt, p.get("placement_axes") or u["mesh_axes"])
            if have_pl != list(p["placements"]):
                problems.append("%s: placements %s, the plan's %s" % (p["fqn"], have_pl, p["placements"]))
            # the dtype it gathers in: the policy's param_dtype, clamped to None (its stored
            # dtype) when they agree, or a packed unit's override
            # (FSDPParam.init_dtype_attrs's clamp, which FSDP2 runs lazily at the first forward)
            if p.get("gather_dtype") and hasattr(fp, "mp_policy"):
                stored = dt.dtype
                have_g = fp.mp_policy.param_dtype
                if have_g is None or have_g == stored or not stored.is_floating_point:
                    have_g = stored
                if have_g != MS_DTYPE.get(p["gather_dtype"]):
                    problems.append("%s: gathers in %s, the plan's %s" % (p["fqn"], have_g, p["gather_dtype"]))
            padded = list(fp.padded_sharded_param_size)
            if padded != want_padded:
                problems.append("%s: padded shard %s, the plan's %s" % (p["fqn"], padded, want_padded))
            bytes_held += math.prod(padded) * dt.element_size()
            checked += 1
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    for name in plan.get("checkpointed") or []:
        # (fully_shard makes the wrapper's class an FSDP subclass of it)
        if not isinstance(_module(model, name), CheckpointWrapper):
            problems.append("%s: the plan checkpoints it, the model's is not wrapped" % name)
    owned = {o["fqn"]: o for o in plan.get("owned") or []}
    for fqn, p in named.items():
        if fqn in in_units:
            continue
        o = owned.get(fqn)
        if o is None:
            problems.append("%s: in no unit of the plan (held whole: %s)" % (fqn, type(p).__name__))
            bytes_held += p.numel() * p.element_size()
            continue
        # expert parallelism's, in no unit (ep_shard = 1): its experts on this rank
        local = p.to_local() if hasattr(p, "to_local") else p
        if list(local.shape) != list(o["local_shape"]):
            problems.append("%s: local shape %s on rank %d, the plan's %s" % (fqn, list(local.shape), rank,
                                                                          o["local_shape"]))
        have_pl = _placements_on(p, ["ep"]) if hasattr(p, "placements") else ["(a plain tensor)"]
        if have_pl != list(o["placements"]):
            problems.append("%s: placements %s on ep, the plan's %s" % (fqn, have_pl, o["placements"]))
        bytes_held += local.numel() * local.element_size()
    planned_bytes = None
    per_rank = (plan.get("memory") or {}).get("per_rank") or []
    if rank < len(per_rank):
        planned_bytes = per_rank[rank]["params"]
        if planned_bytes != bytes_held:
            problems.append("rank %d holds %d parameter bytes, the plan %d" % (rank, bytes_held, planned_bytes))
    if problems:
        shown = problems[:20] + (["... and %d more" % (len(problems) - 20)] if len(problems) > 20 else [])
        raise MoonshardError("mismatch", "rank %d: the sharded model differs from the plan (%d difference%s): %s"
                             % (rank, len(problems), "" if len(problems) == 1 else "s", "; ".join(shown)))
    return {"rank": rank, "params": checked, "units": len(plan["units"]), "bytes": bytes_held}
