"""adamw.py: torch.optim.AdamW on the CPU, the reference for moonshard's AdamW
(core/src/unit_math.h) read by tests/c/test_adamw_torch.c.  Writes data/adamw.txt.

Each case: a parameter dtype (f32, f64, bf16, f16), a state mode, hyper-parameters, and two
parameters of one group: `a` (200 elements) has a gradient at every step, `b` (56 elements)
has none at steps 2 and 4 (its grad is None, so torch skips it and its state['step'] does
not advance).  Five steps.  Recorded as bits: the initial values (in the stored dtype), each
step's gradients (stored dtype), and after the last step the parameters, exp_avg,
exp_avg_sq, the f32 master weights (master mode) and state['step'].

Modes:
  torch   torch.optim.AdamW on the parameters themselves (state in their dtype);
  master  (bf16, f16) torch.optim.AdamW on an f32 copy of the parameters with the
          gradients widened to f32, the stored parameter being the copy rounded back after
          every step: what a unit with f32 master weights computes.

Each case runs twice, in two processes, and both results are recorded:
  torch/...  torch.optim.AdamW exactly as shipped, on this machine's defaults.  Its f32 and
             f64 CPU Tensor.sqrt is Intel MKL's (the PyPI wheel's), whatever
             ATEN_CPU_CAPABILITY says, and MKL's AVX-512 code is not always correctly
             rounded: 0.65% of random f32 values come out 1 ulp off.
  avx2/...   the same with MKL_ENABLE_INSTRUCTIONS=AVX2 (and ATEN_CPU_CAPABILITY=avx2),
             whose f32 sqrt is correctly rounded (0 of 2^20 random values off): torch's own
             kernels for every op.  MKL's f64 sqrt is not correctly rounded on either
             dispatch (15,153 of 2^20 values 1 ulp off under AVX2, 7,668 under AVX-512), so
             here, for f64 tensors only, Tensor.sqrt is numpy's IEEE one.  These are the
             bits moonshard reproduces (its sqrt is correctly rounded, as CUDA's is).
"""
import os
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))

CASES = [
    # name, lr, beta1, beta2, eps, weight_decay
    ("h1", 1e-3, 0.9, 0.95, 1e-8, 0.1),
    ("h2", 1e-1, 0.3, 0.99, 1e-8, 0.5),   # beta1 < 0.5: the lerp's other branch
    ("h3", 1e-3, 0.9, 0.999, 1e-3, 0.0),  # large eps, no decay
    ("h4", 2e-2, 0.8, 0.9, 0.25, 0.01),   # eps larger than most sqrt(v)
    ("h5", 1e-2, 0.9, 0.999, 0.1, 0.05),  # eps near sqrt(v): its rounding to a 16-bit dtype shows
]
DTYPES = ["f32", "f64", "bf16", "f16"]
STEPS = 5
SKIP_B = (2, 4)
NA, NB = 200, 56


def optimize(torch, w0, grads, dtype, mode, hyper):
    """Runs torch.optim.AdamW over the steps; returns (the parameters in the stored dtype,
    the optimizer's parameters, its state)."""
    _, lr, b1, b2, eps, wd = hyper
    odt = torch.float32 if mode == "master" else dtype
    params = {k: torch.nn.Parameter(w0[k].to(odt).clone()) for k in ("a", "b")}
    opt = torch.optim.AdamW([params["a"], params["b"]], lr=lr, betas=(b1, b2), eps=eps,
                            weight_decay=wd, foreach=False)
    for s in range(1, STEPS + 1):
        for k in ("a", "b"):
            skip = k == "b" and s in SKIP_B
            params[k].grad = None if skip else grads[s - 1][k].to(odt).clone()
        opt.step()
    stored = {k: params[k].detach().to(dtype) for k in ("a", "b")}
    return stored, params, opt.state


def inputs(torch, gen, d):
    """One case's initial values in [-1, 1) and gradients of magnitudes 1 to 1e-4 (so eps and
    the 16-bit roundings of v show), rounded to the stored dtype d."""
    w0 = {"a": (torch.rand(NA, generator=gen, dtype=torch.float64) * 2 - 1).to(d),
          "b": (torch.rand(NB, generator=gen, dtype=torch.float64) * 2 - 1).to(d)}
    grads = []
    for s in range(1, STEPS + 1):
        g = {}
        for k, n in (("a", NA), ("b", NB)):
            mag = torch.pow(10.0, -torch.randint(0, 5, (n,), generator=gen).double())
            g[k] = ((torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * mag).to(d)
        grads.append(g)
    return w0, grads


def cases(torch):
    dt = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}
    for dname in DTYPES:
        for mode in (["torch", "master"] if dname in ("bf16", "f16") else ["torch"]):
            for hyper in CASES:
                yield "%s/%s/%s" % (dname, mode, hyper[0]), dt[dname], mode, hyper


def run(variant, path):
    """One process: the variant's results (and, for torch/, the inputs) into path."""
    import torch
    import refdata
    w = refdata.Writer(path, "adamw.py", "variant %s" % variant)
    if variant == "torch":  # the setup, for the test to read rather than repeat
        for name, lr, b1, b2, eps, wd in CASES:
            w.rec("hyper/" + name, "f64", [lr, b1, b2, eps, wd])
        w.rec("steps", "i64", [STEPS])
        w.rec("b_skips", "i64", SKIP_B)
    if variant == "avx2":
        import numpy as np
        original = torch.Tensor.sqrt

        def sqrt(self):  # f64 only: numpy's correctly rounded sqrt
            if self.dtype == torch.float64:
                return torch.from_numpy(np.sqrt(self.detach().numpy()))
            return original(self)
        torch.Tensor.sqrt = sqrt
    gen = torch.Generator().manual_seed(2026)
    for tag, d, mode, hyper in cases(torch):
        w0, grads = inputs(torch, gen, d)
        if variant == "torch":
            for k in ("a", "b"):
                w.bits("%s/%s/w0" % (tag, k), w0[k])
                for s in range(1, STEPS + 1):
                    if not (k == "b" and s in SKIP_B):
                        w.bits("%s/%s/g%d" % (tag, k, s), grads[s - 1][k])
        stored, params, state = optimize(torch, w0, grads, d, mode, hyper)
        for k in ("a", "b"):
            st = state[params[k]]
            name = "%s/%s/%s/" % (variant, tag, k)
            w.bits(name + "w", stored[k])
            if mode == "master":
                w.bits(name + "master", params[k].detach())
            w.bits(name + "exp_avg", st["exp_avg"])
            w.bits(name + "exp_avg_sq", st["exp_avg_sq"])
            w.rec(name + "step", "i64", [int(st["step"].item())])
    w.close()


def main():
    import refdata
    t0 = time.time()
    out = os.path.join(here, "data", "adamw.txt")
    parts = {}
    # MKL reads MKL_ENABLE_INSTRUCTIONS when it loads: one process per variant
    for variant, env_set in (("torch", {}), ("avx2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})):
        env = dict(os.environ)
        for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
            env.pop(k, None)
        env.update(env_set)
        parts[variant] = out + "." + variant
        subprocess.run([sys.executable, __file__, variant, parts[variant]], env=env, check=True)
    with open(out + ".tmp", "w") as f:
        f.write("# made by tests/reference/adamw.py (tests/reference/make.sh); do not edit\n")
        for line in __doc__.split("\n\n")[0].splitlines():
            f.write("# " + line + "\n")
        f.write("# cases: %s; steps %d; b skips steps %s\n" %
                ("; ".join("%s = lr %g, betas (%g, %g), eps %g, weight_decay %g" % c for c in CASES),
                 STEPS, SKIP_B))
        for variant, path in parts.items():
            with open(path) as part:
                for line in part:
                    if line.startswith("# made by") or line.startswith("# variant"):
                        continue
                    f.write(line.replace("# ", "# %s: " % variant, 1) if line.startswith("# ") else line)
            os.remove(path)
        f.write("# made in %.1f s\n" % (time.time() - t0))
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        run(sys.argv[1], sys.argv[2])
    else:
        main()
