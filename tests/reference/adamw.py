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

Each case runs twice, and both results are recorded:
  torch/...  torch.optim.AdamW exactly as shipped.  Its CPU Tensor.sqrt is not always
             correctly rounded: 6,790 of 2^20 random f32 values (0.65%) come out 1 ulp
             off, the same under ATEN_CPU_CAPABILITY=default, avx2 and avx512 (so it is
             not ATen's own vector code; the PyPI wheel links Intel MKL).
  sqrt/...   the same optimizer code and kernels with Tensor.sqrt replaced by a correctly
             rounded one (f32: the f64 sqrt rounded once, which is exact for f32; f64:
             numpy's IEEE sqrt; 16-bit: torch's own, computed in f32 and rounded to the
             16-bit dtype, where the 1-ulp f32 error almost never shows).  This isolates
             the one deliberate difference: moonshard's sqrt is correctly rounded, as
             PyTorch's CUDA sqrt is.
"""
import os
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


def exact_sqrt(torch, original):
    """A correctly rounded Tensor.sqrt (see the module's docstring)."""
    import numpy as np

    def sqrt(self):
        if self.dtype == torch.float32:
            return original(self.double()).float()
        if self.dtype == torch.float64:
            return torch.from_numpy(np.sqrt(self.detach().numpy()))
        return original(self)
    return sqrt


def optimize(torch, w0, grads, dtype, mode, hyper):
    """Runs torch.optim.AdamW over the steps; returns (stored params, master, state)."""
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


def main():
    import torch
    import refdata
    dt = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}
    t0 = time.time()
    w = refdata.Writer(os.path.join(here, "data", "adamw.txt"), "adamw.py", __doc__.split("\n\n")[0] + "\n" +
                       "cases: %s; steps %d; b skips steps %s" %
                       ("; ".join("%s = lr %g, betas (%g, %g), eps %g, weight_decay %g" % c for c in CASES),
                        STEPS, SKIP_B))
    gen = torch.Generator().manual_seed(2026)
    original_sqrt = torch.Tensor.sqrt
    misrounded = {}
    for dname in DTYPES:
        for mode in (["torch", "master"] if dname in ("bf16", "f16") else ["torch"]):
            for hyper in CASES:
                tag = "%s/%s/%s" % (dname, mode, hyper[0])
                d = dt[dname]
                # initial values in [-1, 1) and gradients of magnitudes 1 to 1e-4 (so eps and
                # the 16-bit roundings of v show), rounded to the stored dtype
                w0 = {"a": (torch.rand(NA, generator=gen, dtype=torch.float64) * 2 - 1).to(d),
                      "b": (torch.rand(NB, generator=gen, dtype=torch.float64) * 2 - 1).to(d)}
                grads = []
                for s in range(1, STEPS + 1):
                    g = {}
                    for k, n in (("a", NA), ("b", NB)):
                        mag = torch.pow(10.0, -torch.randint(0, 5, (n,), generator=gen).double())
                        g[k] = ((torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * mag).to(d)
                    grads.append(g)
                for k in ("a", "b"):
                    w.bits("%s/%s/w0" % (tag, k), w0[k])
                    for s in range(1, STEPS + 1):
                        if not (k == "b" and s in SKIP_B):
                            w.bits("%s/%s/g%d" % (tag, k, s), grads[s - 1][k])
                for variant in ("torch", "sqrt"):
                    torch.Tensor.sqrt = original_sqrt if variant == "torch" else exact_sqrt(torch, original_sqrt)
                    try:
                        stored, params, state = optimize(torch, w0, grads, d, mode, hyper)
                    finally:
                        torch.Tensor.sqrt = original_sqrt
                    for k in ("a", "b"):
                        st = state[params[k]]
                        name = "%s/%s/%s/" % (variant, tag, k)
                        w.bits(name + "w", stored[k])
                        if mode == "master":
                            w.bits(name + "master", params[k].detach())
                        w.bits(name + "exp_avg", st["exp_avg"])
                        w.bits(name + "exp_avg_sq", st["exp_avg_sq"])
                        w.rec(name + "step", "i64", [int(st["step"].item())])
                        if variant == "torch":
                            misrounded[(tag, k)] = stored[k]
                        else:
                            key = dname + "/" + mode
                            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[stored[k].element_size()]
                            same = int((misrounded[(tag, k)].view(bits) != stored[k].view(bits)).sum())
                            misrounded[key] = misrounded.get(key, 0) + same
    for key in sorted(k for k in misrounded if isinstance(k, str)):
        w.comment("%s: %d stored values differ between torch/ and sqrt/" % (key, misrounded[key]))
    w.comment("made in %.1f s" % (time.time() - t0))
    w.close()


if __name__ == "__main__":
    main()
