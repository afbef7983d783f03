"""fsdp2_adamw.py: real FSDP2 (fully_shard) with torch.optim.AdamW on gloo, written down
for tests/lua/reference_adamw_spec.lua (tests/lua/scripts/reference_adamw.lua replays it
through moonshard's shard units and compares every value bit for bit).

Three runs, each launched here with torch.multiprocessing (spawn, a FileStore):
  fsdp2  2 processes, fully_shard on a 1-D mesh of 2
  fsdp4  4 processes, fully_shard on a 1-D mesh of 4
  hsdp   4 processes, HSDP on a (dp_replicate=2, dp_shard=2) mesh
The model: eight modules, each fully_shard-ed on its own (one FSDP parameter group each,
so one moonshard unit each), under a root fully_shard without parameters (MODULES below):
bf16, f16, f32 with param_dtype bf16 and reduce_dtype f32, and plain f32 ones in the
optimizer, and two probes outside it.
Dim 0 of every parameter is uneven on 4 ranks, some leave ranks without rows (torch.chunk:
9 rows on 4 ranks are 3, 3, 3, 0; 2 rows are 1, 1, 0, 0).

The gradients are exactly controlled: the loss is sum over the parameters p used in a step
of (p * G).sum(), so each rank's unsharded gradient of p is G, generated from (config,
rank, step, parameter, element) by gen() below, which tests/lua/scripts/reference_adamw.lua
repeats.  G is chosen so that every partial sum of the reductions is exact in the reduce
dtype: gloo sums 16-bit floats in their dtype, rounding every partial sum, in an order that
depends on the rank's chunk (ring), while moonshard rounds once from an f32 sum; on exact
partial sums both are the exact sum.  What is tested is then FSDP2's divide factors and
AdamW.  The probe P (f16, outside the optimizer) has gradients near f16's overflow (65504)
and in its subnormals, whose reduced bits depend on FSDP2's pre/post divide split
(_get_gradient_divide_factors: pre 2 / post 2 for a factor of 4, pre 2 / post 1 for 2); the
script checks that the other splits would give other bits.  The probe Q (bf16) has
subnormal gradients, which FSDP2 averages in the collectives (ReduceOp.AVG): the script
checks that f16's split would give other bits.

Recorded per config, rank and step (1..STEPS): the local shard of every parameter's
gradient before optimizer.step() (absent when torch has none: a skipped parameter), and
after it the local shard of every parameter, exp_avg and exp_avg_sq (bits), state['step'],
and the optimizer's bytes on the rank.  After step RESTORE_AFTER the model and the
optimizer are restored into new ones (local shards and optimizer.state_dict(), cloned) and
the run continues on those; the script checks against a run that was not restored.

Run through tests/reference/make.sh (MOONSHARD_REF_VENV names the environment):
    bash tests/reference/make.sh fsdp2_adamw
"""
import os

# torch's f32 sqrt on the CPU is MKL's vsSqrt (VML), whatever ATEN_CPU_CAPABILITY says, and
# MKL's AVX-512 code for it is not always correctly rounded (about 0.6% of values 1 ulp
# off; moonshard's sqrtf is correctly rounded): the reference runs MKL's AVX2 code, whose
# sqrt is, and ATen's AVX2 kernels.  The header records both, and how many values the
# machine's default (AVX-512 for both on an AVX-512 machine) changes.
# (The spawned ranks run this again: the comparison run marks itself for them.)
if os.environ.get("FSDP2_ADAMW_DEFAULTS") != "1":
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import math  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from refdata import Writer  # noqa: E402

OUT = "tests/reference/data/fsdp2_adamw.txt"
STEPS = 6
RESTORE_AFTER = 3
# name, world size, (dp_replicate, dp_shard)
CONFIGS = [("fsdp2", 2, (1, 2)), ("fsdp4", 4, (1, 4)), ("hsdp", 4, (2, 2))]

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPE_CODE = {F32: 0, BF16: 1, F16: 2, None: -1}

# AdamW's two parameter groups: (lr, beta1, beta2, eps, weight_decay).  Group 1 has a large
# eps (0.3: 0.30078125 in bf16, 0.30004883 in f16) and beta1 < 0.5 (the lerp's other
# branch: weight 1 - beta1 >= 0.5).
GROUPS = [(1e-2, 0.9, 0.999, 1e-8, 0.1), (3e-3, 0.3, 0.9, 0.3, 0.02)]

# Gradient kinds (gen): 0 k * 2^e, |k| <= 15, e in [lo, hi] per element, the same on every
# rank (sums of 4 need 6 bits: exact in bf16 and f16); 1 k * 2^(e + d), |k| <= 255, d in
# [0, 6] per rank (exact in f32, not in bf16: a bf16 reduction would round them);
# 2 the f16 divide probe; 3 the bf16 one (subnormals, whose average FSDP2 takes in the
# collective: bf16 is not split like f16).
# Modules: name, stored dtype, param_dtype, reduce_dtype, optimizer group (None: not in
# the optimizer), [(param, shape, gradient kind, lo, hi, steps it has no gradient in)],
# steps the whole module has no gradient in (not called in forward).  F names its
# reduce_dtype: torch 2.15 with reduce_dtype None reduces in the parameter's dtype (f32 here),
# as a moonshard unit with reduce_dtype unset does, where earlier versions reduce in
# param_dtype; naming it keeps the reference the same for either.  f16 gradients are at least 2^-4 in magnitude: 0.001 * g^2 must not underflow
# f16 (group 0's eps 1e-8 is 0 in f16, so a zero exp_avg_sq would divide 0 by 0).
MODULES = [
    ("A1", BF16, None, None, 0, [("w", (37, 8), 0, -14, 2, ()), ("b", (2,), 0, -14, 2, ()),
                                 ("s", (5, 6), 0, -14, 2, (2, 4))], ()),
    ("A2", BF16, None, None, 1, [("w", (9, 20), 0, -14, 2, ()), ("b", (3,), 0, -14, 2, ())], ()),
    ("H1", F16, None, None, 0, [("w", (29, 8), 0, -4, 2, ()), ("b", (5,), 0, -4, 2, ()),
                                ("s", (3, 8), 0, -4, 2, (3,))], ()),
    ("H2", F16, None, None, 1, [("w", (11, 16), 0, -4, 2, ()), ("b", (1,), 0, -4, 2, ())], ()),
    ("F", F32, BF16, F32, 0, [("w", (13, 16), 1, -12, 0, ()), ("b", (2,), 1, -12, 0, ())], (5,)),
    ("F2", F32, None, None, 1, [("w", (6, 16), 1, -12, 0, ()), ("b", (3,), 1, -12, 0, (2,))], ()),
    ("P", F16, None, None, None, [("w", (8, 8), 2, 0, 0, ())], ()),
    ("Q", BF16, None, None, None, [("w", (6, 8), 3, 0, 0, ())], ()),
]


def params_in_order():
    """(global index, module, param name, shape, kind, lo, hi, skipped steps)"""
    out, k = [], 0
    for mname, _, _, _, _, plist, mskip in MODULES:
        for pname, shape, kind, lo, hi, skip in plist:
            out.append((k, mname, pname, shape, kind, lo, hi, set(skip) | set(mskip)))
            k += 1
    return out


M = 65521


def mix(*vals):
    """A small integer hash (every intermediate below 2^33: tests/lua/scripts/reference_adamw.lua
    computes the same in Lua 5.4 and LuaJIT)."""
    x = 1
    for v in vals:
        x = (x * 263 + v + 71) % M
        x = (x * x + 17) % M
    return x


def gen(cid, factor, r, s, p, i, kind, lo, hi):
    """Rank r's gradient element i of parameter p at step s (a float64 exact in the gather dtype)."""
    if kind == 2:  # the f16 divide probe: 4 sorts of element
        sub = i % 4
        if sub == 0:  # near overflow: the sum of `factor` overflows, the sum of halves does not
            v = 16 * (1024 + mix(cid, s, p, i, 4) % 1023) * (4 // factor)
            return v * (1 if mix(cid, s, p, i, 5) % 2 else -1)
        if sub == 1:  # subnormal, 1 to 3 units of 2^-24, varying by rank
            return (1 + mix(cid, r, s, p, i, 6) % 3) * 2.0 ** -24
        if sub == 2:  # subnormal, 2 or 4 units, the same on every rank
            return 2 * (1 + mix(cid, s, p, i, 7) % 2) * 2.0 ** -24
        kind, lo, hi = 0, -6, 4
    if kind == 3:  # the bf16 probe: subnormals of 1 to 3 units of 2^-133 varying by rank, or normal
        if i % 2 == 0:
            return (1 + mix(cid, r, s, p, i, 8) % 3) * 2.0 ** -133
        kind, lo, hi = 0, -6, 4
    k = mix(cid, r, s, p, i, 2)
    if kind == 0:
        e = lo + mix(cid, s, p, i, 1) % (hi - lo + 1)
        k %= 30
        return (k % 15 + 1) * (-1 if k < 15 else 1) * 2.0 ** e
    e = lo + mix(cid, s, p, i, 1) % (hi - lo + 1) + mix(cid, r, s, p, i, 3) % 7
    k %= 510
    return (k % 255 + 1) * (-1 if k < 255 else 1) * 2.0 ** e


def init_values(p, shape, dtype):
    g = torch.Generator().manual_seed(1000 + p)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.5).to(dtype)


class Bag(torch.nn.Module):
    def __init__(self, plist, dtype, base):
        super().__init__()
        for j, (pname, shape, *_rest) in enumerate(plist):
            self.register_parameter(pname, torch.nn.Parameter(init_values(base + j, shape, dtype)))

    def forward(self, gs):
        loss = None
        for pname, g in gs.items():
            term = (getattr(self, pname) * g).sum().float()
            loss = term if loss is None else loss + term
        return loss


class Root(torch.nn.Module):
    def __init__(self):
        super().__init__()
        base = 0
        for mname, dtype, _, _, _, plist, _ in MODULES:
            self.add_module(mname, Bag(plist, dtype, base))
            base += len(plist)

    def forward(self, gs):
        loss = None
        for mname, g in gs.items():
            term = getattr(self, mname)(g)
            loss = term if loss is None else loss + term
        return loss


def build(mesh):
    torch.manual_seed(0)
    model = Root()
    for mname, _, pd, rd, _, _, _ in MODULES:
        fully_shard(getattr(model, mname), mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd))
    fully_shard(model, mesh=mesh)
    groups = [[] for _ in GROUPS]
    for mname, _, _, _, grp, _, _ in MODULES:
        if grp is not None:
            groups[grp] += list(getattr(model, mname).parameters())
    opt = torch.optim.AdamW([{"params": ps, "lr": h[0], "betas": (h[1], h[2]), "eps": h[3], "weight_decay": h[4]}
                             for ps, h in zip(groups, GROUPS)])
    return model, opt


def step_inputs(cid, factor, rank, s):
    """The forward's argument: {module: {param: G}} for the parameters with a gradient at s."""
    gs = {}
    for p, mname, pname, shape, kind, lo, hi, skip in params_in_order():
        if s in skip:
            continue
        n = math.prod(shape)
        mod = next(m for m in MODULES if m[0] == mname)
        gather = mod[2] or mod[1]
        vals = torch.tensor([gen(cid, factor, rank, s, p, i, kind, lo, hi) for i in range(n)], dtype=torch.float64)
        g = vals.to(gather)
        assert torch.equal(g.double(), vals), (mname, pname, "G not exact in", gather)
        gs.setdefault(mname, {})[pname] = g.reshape(shape)
    return gs


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_bytes(opt):
    moments, steps = 0, 0
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            moments += local(st[key]).numel() * local(st[key]).element_size()
        steps += 1
    return moments, steps


def restore(model, opt, mesh):
    """A new model and optimizer from model's local shards and a clone of opt.state_dict()."""
    new_model, new_opt = build(mesh)
    with torch.no_grad():
        for (n1, p1), (n2, p2) in zip(model.named_parameters(), new_model.named_parameters()):
            assert n1 == n2
            local(p2).copy_(local(p1))
    sd = opt.state_dict()
    cloned = {"param_groups": [dict(g) for g in sd["param_groups"]],
              "state": {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in sd["state"].items()}}
    new_opt.load_state_dict(cloned)
    return new_model, new_opt


def bits_list(t):
    t = local(t).detach().contiguous().reshape(-1)
    size = t.element_size()
    ints = {2: torch.int16, 4: torch.int32}[size]
    mask = (1 << (8 * size)) - 1
    return "x%d" % (8 * size), [v & mask for v in t.view(ints).tolist()]


def worker(rank, world, cid, store_path, out_path):
    name, _, (R, W) = CONFIGS[cid]
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank, world_size=world)
    if R == 1:
        mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (R, W), mesh_dim_names=("dp_replicate", "dp_shard"))
    factor = R * W
    model, opt = build(mesh)
    plain_model, plain_opt = build(mesh)  # never restored: the check of the restore
    recs = []
    pre = "%s.r%d" % (name, rank)
    for s in range(1, STEPS + 1):
        gs = step_inputs(cid, factor, rank, s)
        for m, o in ((model, opt), (plain_model, plain_opt)):
            m.zero_grad(set_to_none=True)  # the probe's gradient too (it is not in the optimizer)
            m(gs).backward()
        for pn, p in model.named_parameters():
            key = "%s.s%d.%s" % (pre, s, pn)
            if p.grad is not None:
                recs.append((key + ".grad",) + bits_list(p.grad))
        opt.step()
        plain_opt.step()
        for (pn, p), (_, q) in zip(model.named_parameters(), plain_model.named_parameters()):
            key = "%s.s%d.%s" % (pre, s, pn)
            recs.append((key + ".param",) + bits_list(p))
            assert torch.equal(local(p).view(torch.int16 if p.element_size() == 2 else torch.int32),
                               local(q).view(torch.int16 if p.element_size() == 2 else torch.int32)), key
            st = opt.state.get(p)
            if st:
                recs.append((key + ".exp_avg",) + bits_list(st["exp_avg"]))
                recs.append((key + ".exp_avg_sq",) + bits_list(st["exp_avg_sq"]))
                recs.append((key + ".step", "i64", [int(st["step"].item())]))
                qs = plain_opt.state[q]
                for kk in ("exp_avg", "exp_avg_sq"):
                    assert bits_list(st[kk]) == bits_list(qs[kk]), (key, kk)
        recs.append(("%s.s%d.optimizer_bytes" % (pre, s), "i64", list(optimizer_bytes(opt))))
        if s == RESTORE_AFTER:
            model, opt = restore(model, opt, mesh)
    if (R, W) == (1, 4):
        # how gloo sums f16: (1, 2^-11, 2^-11, 0) from ranks 0..3, whose sum 1 + 2^-10 is
        # exact in f16, reduce-scattered: each rank's chunk is summed in its own order,
        # rounding every partial sum to f16 (1 + 2^-11 rounds to 1)
        x = torch.full((4,), (1.0, 2.0 ** -11, 2.0 ** -11, 0.0)[rank], dtype=F16)
        out = torch.empty(1, dtype=F16)
        dist.reduce_scatter_tensor(out, x)
        recs.append(("gloo_f16_sum.r%d" % rank, "f64", [out.item()]))
    recs.append(("%s.capability" % pre, "i64",
                 [{"DEFAULT": 0, "AVX2": 2, "AVX512": 5}.get(torch.backends.cpu.get_cpu_capability(), -1)]))
    dist.barrier()
    dist.destroy_process_group()
    with open(out_path, "wb") as f:
        pickle.dump(recs, f)


def run_config(cid, tmp):
    name, world, _ = CONFIGS[cid]
    store = tempfile.mktemp(prefix="store.%s." % name, dir=tmp)  # a FileStore file is for one run
    outs = [os.path.join(tmp, "%s.%d.pkl" % (name, r)) for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, cid, store, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0, "%s: a rank failed (exit %s)" % (name, p.exitcode)
    recs = []
    for o in outs:
        with open(o, "rb") as f:
            recs += pickle.load(f)
    return recs


def rnd(x, dtype):
    """x (an f64 exact in f32) rounded to dtype, as a float."""
    return float(torch.tensor([x], dtype=torch.float64).to(F32).to(dtype)[0])


def model_reduce(values, scheme, groups, dtype):
    """One element's reduction over the ranks' values, the bits of the result in dtype:
    ("split", pre, post): each value divided by pre, summed within each shard group
    (reduce-scatter) and over the groups (HSDP all-reduce), divided by post; ("avg",): the
    average within each group, then over the groups.  Every sum of the probes' values is
    exact before its one rounding to dtype (the inputs make every partial sum exact unless
    it overflows), as gloo's and moonshard's sums then are."""
    if scheme[0] == "split":
        pre, post = scheme[1:]
        xs = [rnd(rnd(v, dtype) / pre, dtype) for v in values]
        partial = [rnd(sum(xs[r] for r in g), dtype) for g in groups]
        out = rnd(rnd(sum(partial), dtype) / post, dtype)
    else:
        partial = [rnd(sum(rnd(values[r], dtype) for r in g) / len(g), dtype) for g in groups]
        out = rnd(sum(partial) / len(groups), dtype)
    return int(torch.tensor([out], dtype=dtype).view(torch.int16).item()) & 0xFFFF


def show(scheme):
    return "pre %g / post %g" % scheme[1:] if scheme[0] == "split" else "AVG in the collectives"


def check_probes(recs):
    """The recorded probe gradients are what FSDP2's divide factors give, and no other rule
    gives them all: P (f16) is split pre 2 / post F/2 (F the factor, 2 or 4), not pre 1 /
    post F nor pre F / post 1; Q (bf16) is averaged in the collectives, not split like f16.
    Returns comment lines with the counts."""
    byname = {r[0]: r for r in recs}
    lines = []
    for mname, dtype in (("P", F16), ("Q", BF16)):
        p, _, pname, shape, kind, lo, hi, _ = next(x for x in params_in_order() if x[1] == mname)
        n = math.prod(shape)
        for cid, (name, world, (R, W)) in enumerate(CONFIGS):
            factor = R * W
            groups = [list(range(q * W, (q + 1) * W)) for q in range(R)]
            if dtype == F16:
                schemes = [("split", 2, factor / 2)] + [("split", a, factor / a) for a in (1, factor) if a != 2]
            else:
                schemes = [("avg",), ("split", 2, factor / 2)]
            differ = {sc: 0 for sc in schemes}
            total = 0
            for s in range(1, STEPS + 1):
                full = {}
                for rank in range(world):
                    rec = byname["%s.r%d.s%d.%s.%s.grad" % (name, rank, s, mname, pname)]
                    rows, chunk = shape[0], -(-shape[0] // W)
                    per_row = n // rows
                    for j, b in enumerate(rec[2]):
                        full.setdefault((rank % W) * chunk * per_row + j, set()).add(b)
                assert len(full) == n and all(len(v) == 1 for v in full.values()), "probe: ranks disagree"
                for i in range(n):
                    vals = [gen(cid, factor, r, s, p, i, kind, lo, hi) for r in range(world)]
                    got = next(iter(full[i]))
                    total += 1
                    for sc in schemes:
                        differ[sc] += model_reduce(vals, sc, groups, dtype) != got
            assert differ[schemes[0]] == 0, "%s %s: not %s: %d of %d differ" % (
                name, mname, show(schemes[0]), differ[schemes[0]], total)
            for sc in schemes[1:]:
                assert differ[sc] > 0, "%s %s: %s gives the same bits" % (name, mname, show(sc))
            lines.append("probe %s %s (%s, factor %d): FSDP2's %s gives every one of %d reduced values; %s" % (
                name, mname, "f16" if dtype == F16 else "bf16", factor, show(schemes[0]), total,
                ", ".join("%s would differ in %d" % (show(sc), differ[sc]) for sc in schemes[1:])))
    return lines


def main():
    assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT", "AVX512")
    tmp = tempfile.mkdtemp(prefix="fsdp2_adamw.")
    recs = []
    for cid in range(len(CONFIGS)):
        recs += run_config(cid, tmp)
        print("fsdp2_adamw.py: %s done" % CONFIGS[cid][0], file=sys.stderr)
    caps = {r[2][0] for r in recs if r[0].endswith(".capability")}
    recs = [r for r in recs if not r[0].endswith(".capability")]
    probe_lines = check_probes(recs)
    gloo = sorted(r for r in recs if r[0].startswith("gloo_f16_sum."))
    recs = [r for r in recs if not r[0].startswith("gloo_f16_sum.")]
    probe_lines.append("gloo's f16 sums round every partial sum, in an order that depends on the chunk: "
                       "reduce_scatter of (1, 2^-11, 2^-11, 0) from ranks 0..3 (exact sum 1 + 2^-10) gives ranks "
                       "0..3: %s; moonshard rounds once from an f32 sum, so the gradients here make every "
                       "partial sum exact" % ", ".join(repr(r[2][0]) for r in gloo))

    # the same under the default capability of this machine, only to report what it changes
    compare = []
    if os.environ.get("MOONSHARD_REF_COMPARE_DEFAULT", "1") == "1":
        saved = {k: os.environ.pop(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
        os.environ["FSDP2_ADAMW_DEFAULTS"] = "1"
        try:
            other = []
            for cid in range(len(CONFIGS)):
                other += run_config(cid, tmp)
        finally:
            del os.environ["FSDP2_ADAMW_DEFAULTS"]
            os.environ.update(saved)
        ocaps = {r[2][0] for r in other if r[0].endswith(".capability")}
        ob = {r[0]: r for r in other}
        by_dtype = {}
        for r in recs:
            if r[1].startswith("x"):
                o = ob[r[0]]
                d = sum(1 for a, b in zip(r[2], o[2]) if a != b)
                key = ("f32" if r[1] == "x32" else "16-bit") + " " + r[0].rsplit(".", 1)[1]
                c = by_dtype.setdefault(key, [0, 0])
                c[0] += d
                c[1] += len(r[2])
        compare.append("the same run with the machine's defaults (ATen capability %s, MKL's own): %s" % (
            sorted(ocaps), "; ".join("%s %d of %d differ" % (k, v[0], v[1]) for k, v in sorted(by_dtype.items()))))

    about = __doc__.split("\n\n")[0] + "\n"
    about += "ATen capability of the ranks (0 default, 2 AVX2, 5 AVX512): %s; MKL_ENABLE_INSTRUCTIONS=%s\n" % (
        sorted(caps), os.environ.get("MKL_ENABLE_INSTRUCTIONS"))
    about += "configs: " + "; ".join("%s world %d mesh dp_replicate=%d dp_shard=%d" % (n, w, r, s)
                                     for n, w, (r, s) in CONFIGS) + "\n"
    about += "records: config.<c>: index, world, dp_replicate, dp_shard; group.<g>: lr, beta1, beta2, eps, " \
             "weight_decay; module.<m>: stored dtype, param_dtype, reduce_dtype (0 f32, 1 bf16, 2 f16, -1 unset), " \
             "optimizer group (-1 none); param.<m>.<p>: index, gradient kind, lo, hi, shape (gen()); " \
             "skip.<m>.<p>: the steps without a gradient; init.<m>.<p>: the initial values; " \
             "<c>.r<rank>.s<step>.<m>.<p>.{grad,param,exp_avg,exp_avg_sq,step}: the local shards and " \
             "state['step']; <c>.r<rank>.s<step>.optimizer_bytes: the bytes of exp_avg and exp_avg_sq, and " \
             "the parameters with a state (each also holds a 4-byte f32 step tensor)\n"
    about += "\n".join(probe_lines + compare)
    w = Writer(OUT, "fsdp2_adamw.py", about)
    w.rec("steps", "i64", [STEPS])
    w.rec("restore_after", "i64", [RESTORE_AFTER])
    for cid, (name, world, (R, W)) in enumerate(CONFIGS):
        w.rec("config.%s" % name, "i64", [cid, world, R, W])
    for g, h in enumerate(GROUPS):
        w.rec("group.%d" % g, "f64", h)
    for mname, dtype, pd, rd, grp, plist, mskip in MODULES:
        w.rec("module.%s" % mname, "i64", [DTYPE_CODE[dtype], DTYPE_CODE[pd], DTYPE_CODE[rd],
                                           -1 if grp is None else grp])
    for p, mname, pname, shape, kind, lo, hi, skip in params_in_order():
        w.rec("param.%s.%s" % (mname, pname), "i64", [p, kind, lo, hi] + list(shape))
        w.rec("skip.%s.%s" % (mname, pname), "i64", sorted(skip))
        mod = next(m for m in MODULES if m[0] == mname)
        w.bits("init.%s.%s" % (mname, pname), init_values(p, shape, mod[1]))
    for r in sorted(recs, key=lambda r: r[0]):
        w.rec(*r)
    w.close()
    shutil.rmtree(tmp)
    print("fsdp2_adamw.py: wrote %s (%d records)" % (OUT, len(recs)), file=sys.stderr)


if __name__ == "__main__":
    main()
