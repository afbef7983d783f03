"""quant.py: the lower-precision references, run on the CPU with the real libraries, read by
tests/lua/quant_spec.lua (moonshard's core/src/quant.c).  Writes data/quant.txt.

NF4 (bitsandbytes): bitsandbytes.functional.quantize_4bit(x, blocksize, quant_type="nf4",
compress_statistics=dq) and dequantize_4bit(codes, state).  Each case `nf4_<c>_*`:
  cfg     i64 [x dtype (0 f32, 1 bf16, 2 f16), blocksize, double quant (0/1)]
  shape   i64, x (its bits), codes (x8, packed as bitsandbytes packs them),
  absmax  x32 (without double quant), or qabsmax (x8), absmax2 (x32, state2.absmax) and
          offset (x32, one value);
  out     the dequantized tensor's bits (in x's dtype).
Also nf4_table / dynamic_map (x32): bitsandbytes' NF4 table and 8-bit dynamic map.

Float8 (torchao.float8): tensor_to_amax, amax_to_scale, hp_tensor_and_scale_to_float8 and
to_original_precision.  Each case `fp8_<c>_*`:
  cfg     i64 [x dtype (0 f32, 1 bf16), rowwise (0/1), fp8 (0 e4m3fn, 1 e5m2), power-of-2
          scales (0/1), amax given (0/1), dequantized dtype (0 f32, 1 bf16)]
  shape, x, amax (x32: the amax used; a given one, else tensor_to_amax's), scale (x32),
  data (x8: the fp8 bits), dq (the dequantized bits).
  Rowwise is axiswise_dim=-1; its amax and scale have one value per row.
fp8_scalefn_amax (x32) and fp8_scalefn_<e4m3|e5m2>_<plain|pow2> (x32): amax_to_scale over
a list of amax values, edges included (0, denormals, inf, NaN, near powers of two).

QAT (torchao.quantization.qat, the legacy quantizers): the fake quantizers the prepared
linear layers of Int4WeightOnlyQATQuantizer and Int8DynActInt4WeightQATQuantizer hold,
applied to x.  Each case `qat_<c>_*`:
  cfg     i64 [x dtype (0 f32, 1 bf16), scheme (0 int4 weight-only, 1 8da4w weight,
          2 8da4w activation), group size, scales precision (0 f32, 1 bf16)]
  shape, x, out (x's dtype).
"""
import os
import sys

import torch

import refdata

here = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(here, "data", "quant.txt")

DT = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DT_ID = {v: k for k, v in DT.items()}


def bits(t):
    t = t.detach().contiguous().reshape(-1)
    size = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
    mask = (1 << (8 * size)) - 1
    return "x%d" % (8 * size), [v & mask for v in t.view(ints).tolist()]


def rec_bits(w, name, t):
    typ, vals = bits(t)
    w.rec(name, typ, vals)


def sample(shape, dtype, g, spread=2.0):
    """randn scaled per row by exp(spread * randn): values over many binades."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if len(shape) > 1:
        rows = torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64)
        x = x * torch.exp(spread * rows)
    return x.to(dtype)


# ---------------------------------------------------------------- NF4

def nf4_cases(g):
    import bitsandbytes.functional as F
    cases = []
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for bs in (32, 64, 128, 4096):
            cases.append(("%s_b%d" % (str(dt)[6:], bs), sample((24, 40), dt, g), bs, False))
        cases.append(("%s_odd" % str(dt)[6:], sample((7, 33), dt, g), 64, False))
        cases.append(("%s_dq" % str(dt)[6:], sample((260, 32), dt, g, 0.5), 32, True))   # 2 nested blocks
    cases.append(("f32_dq_b256", sample((3, 5, 129), torch.float32, g, 0.5), 256, True))
    cases.append(("bf16_dq_one", sample((1, 2, 300), torch.bfloat16, g, 0.5), 32, True))
    # edges: a zero block, tiny and huge magnitudes, the midpoints of the table exactly (a
    # tie goes to the lower code), values just either side of them, denormals
    tab = F.get_4bit_type("nf4", device="cpu")
    mids = (tab[:-1] + tab[1:]) / 2
    e = torch.zeros(4 * 64)
    e[64:79] = mids
    e[79] = 1.0
    e[80:95] = torch.nextafter(mids, torch.full_like(mids, 2.0))
    e[95:110] = torch.nextafter(mids, torch.full_like(mids, -2.0))
    e[110:128] = -torch.linspace(0, 1, 18)
    e[128:192] = torch.randn(64, generator=g) * 1e-40          # denormal block
    e[192:256] = torch.randn(64, generator=g) * 3e37
    cases.append(("f32_edges", e, 64, False))
    cases.append(("f32_edges_dq", e.clone(), 64, True))
    e = torch.randn(3 * 32, generator=g)
    e[0], e[5], e[40], e[41], e[70] = float("inf"), float("nan"), float("-inf"), 0.0, float("nan")
    cases.append(("f32_naninf", e, 32, False))   # inf absmax: 0 * inf is NaN; NaN: code 15
    out = []
    for name, x, bs, dq in cases:
        q, st = F.quantize_4bit(x, blocksize=bs, quant_type="nf4", compress_statistics=dq)
        y = F.dequantize_4bit(q, st, quant_type="nf4")
        assert y.dtype == x.dtype and y.numel() == x.numel(), name
        y = y.reshape(x.shape)   # a 1-dim x comes back as [1, n]
        r = {"cfg": [DT_ID[x.dtype], bs, int(dq)], "shape": list(x.shape), "x": x,
             "codes": q.view(torch.uint8), "out": y}
        if dq:
            r["qabsmax"] = st.absmax
            r["absmax2"] = st.state2.absmax
            r["offset"] = st.offset.reshape(1).float()
            assert torch.equal(st.state2.code, F.create_dynamic_map()), "the map changed"
        else:
            r["absmax"] = st.absmax
        out.append((name, r))
    return out


# ---------------------------------------------------------------- float8

def fp8_cases(g):
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.config import ScalingGranularity

    fp8s = {0: torch.float8_e4m3fn, 1: torch.float8_e5m2}
    inputs = []
    for dt in (torch.float32, torch.bfloat16):
        nm = str(dt)[6:]
        inputs.append((nm + "_rand", sample((16, 48), dt, g)))
        e = sample((8, 32), torch.float32, g, 4.0)
        e[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])        # zeros, f32 denormals
        e[1] = 0.0                                                   # an all-zero row
        e[2, :3] = torch.tensor([float("inf"), 1.0, -2.0])           # inf: scale 0
        e[3, :3] = torch.tensor([float("nan"), 1.0, -2.0])           # NaN propagates
        e[4, :3] = torch.tensor([3e38, -3e38, 1.0])                  # near f32's max
        e[5] = torch.randn(32, generator=g) * 1e-38                  # denormal-sized row
        e[6, :2] = torch.tensor([float("-inf"), float("inf")])
        inputs.append((nm + "_edges", e.to(dt)))
        inputs.append((nm + "_finite", sample((6, 20), dt, g, 6.0)))
    out = []
    for name, x in inputs:
        for rowwise in (0, 1):
            for f in (0, 1):
                for pow2 in (0, 1):
                    for given in (0, 1):
                        if given and (pow2 or "edges" in name):
                            continue
                        gran = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
                        amax = tensor_to_amax(x, False, None, gran, -1 if rowwise else None)
                        if given:   # another rank's larger amax, or a smaller one: saturation
                            factor = torch.tensor([2.0 if f == 0 else 0.25])
                            amax = (amax.float() * factor).to(x.dtype)
                        scale = amax_to_scale(amax, fp8s[f], round_scales_to_power_of_2=bool(pow2))
                        t = hp_tensor_and_scale_to_float8(x, scale, fp8s[f], axiswise_dim=-1 if rowwise else None)
                        dq = t.to_original_precision()
                        r = {"cfg": [DT_ID[x.dtype], rowwise, f, pow2, given, DT_ID[dq.dtype]],
                             "shape": list(x.shape), "x": x, "amax": amax.float(), "scale": scale,
                             "data": t._data.view(torch.uint8), "dq": dq}
                        out.append(("%s_%s_%s%s%s" % (name, "row" if rowwise else "tensor",
                                                       "e4m3" if f == 0 else "e5m2",
                                                       "_pow2" if pow2 else "", "_given" if given else ""), r))
    return out


def fp8_scalefn():
    from torchao.float8.float8_utils import amax_to_scale
    a = [0.0, 1e-45, 1e-40, 1e-13, 1e-12, 1.0000001e-12, 1e-6, 0.5, 1.0, 3.0, 448.0, 449.0,
         57344.0, 1e30, 3.4e38, float("inf"), float("nan")]
    # amax for which 448 / amax (or 57344 / amax) lands just off a power of two
    for k in range(-20, 30, 3):
        for m in (448.0, 57344.0):
            base = m / 2.0 ** k
            a += [base, float(torch.nextafter(torch.tensor(base), torch.tensor(0.0))),
                  float(torch.nextafter(torch.tensor(base), torch.tensor(1e30)))]
    g = torch.Generator().manual_seed(7)
    a += (torch.exp(torch.randn(64, generator=g, dtype=torch.float64) * 8)).tolist()
    amax = torch.tensor(a, dtype=torch.float32)
    res = {"amax": amax}
    for f, fd in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        res[f + "_plain"] = amax_to_scale(amax, fd, False)
        res[f + "_pow2"] = amax_to_scale(amax, fd, True)
        # one at a time too: a 0-dim tensor takes torch's scalar log2, not the vectorized one
        one = torch.stack([amax_to_scale(v.reshape(()), fd, True) for v in amax])
        assert torch.equal(one.view(torch.int32), res[f + "_pow2"].view(torch.int32)) or \
            torch.isnan(one).sum() == torch.isnan(res[f + "_pow2"]).sum(), f
    return res


# ---------------------------------------------------------------- QAT

def qat_modules(group, precision):
    from torchao.quantization.qat import Int4WeightOnlyQATQuantizer, Int8DynActInt4WeightQATQuantizer
    m4 = torch.nn.Sequential(torch.nn.Linear(256, 8, bias=False))
    m4 = Int4WeightOnlyQATQuantizer(groupsize=group, scales_precision=torch.bfloat16).prepare(m4)
    m8 = torch.nn.Sequential(torch.nn.Linear(256, 8, bias=False))
    m8 = Int8DynActInt4WeightQATQuantizer(groupsize=group, scales_precision=precision).prepare(m8)
    return m4[0].weight_fake_quantizer, m8[0].weight_fake_quantizer, m8[0].activation_fake_quantizer


def qat_cases(g):
    out = []
    for dt in (torch.float32, torch.bfloat16):
        nm = str(dt)[6:]
        for group in (32, 64, 128, 256):
            for prec in (torch.float32, torch.bfloat16):
                w4, w8, act = qat_modules(group, prec)
                x = sample((6, 256), dt, g)
                if prec == torch.bfloat16:   # Int4WeightOnlyQATQuantizer takes bf16 scales only
                    out.append(("%s_int4_g%d" % (nm, group),
                                {"cfg": [DT_ID[dt], 0, group, 1], "shape": [6, 256], "x": x, "out": w4(x)}))
                x = sample((6, 256), dt, g)
                out.append(("%s_8da4w_w_g%d_%s" % (nm, group, str(prec)[6:]),
                            {"cfg": [DT_ID[dt], 1, group, DT_ID[prec]], "shape": [6, 256], "x": x, "out": w8(x)}))
        for shape in ((4, 7, 96), (33, 256)):
            w4, w8, act = qat_modules(32, torch.float32)
            x = sample(shape, dt, g, 3.0)
            if len(shape) == 3:
                x[0, 0] = x[0, 0].abs()          # a row of positives: zero point at the bottom
                x[0, 1] = -x[0, 1].abs()         # and of negatives
                x[1, 2] = 0.0                    # all zero: the scale is eps
            out.append(("%s_8da8_act_%s" % (nm, "x".join(map(str, shape))),
                        {"cfg": [DT_ID[dt], 2, shape[-1], 0], "shape": list(shape), "x": x, "out": act(x)}))
        # edges for the weights: constant groups, a zero group, tiny and huge values
        w4, w8, act = qat_modules(32, torch.bfloat16)
        e = sample((4, 256), torch.float32, g, 5.0)
        e[0, :32] = 0.0
        e[0, 32:64] = 1.5
        e[1, :32] = torch.randn(32, generator=g) * 1e-30
        e[2, :32] = torch.randn(32, generator=g) * 1e30
        e[3, :32] = torch.randn(32, generator=g) * 1e-7
        e = e.to(dt)
        out.append(("%s_int4_edges" % nm, {"cfg": [DT_ID[dt], 0, 32, 1], "shape": [4, 256], "x": e, "out": w4(e)}))
        out.append(("%s_8da4w_w_edges" % nm, {"cfg": [DT_ID[dt], 1, 32, 1], "shape": [4, 256], "x": e, "out": w8(e)}))
    return out


def main():
    import bitsandbytes
    import torchao
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(20261202)
    w = refdata.Writer(OUT, "quant.py", __doc__.split("\n\n")[0].replace("\n", " "))
    w.comment("bitsandbytes " + bitsandbytes.__version__)
    w.comment("torchao " + torchao.__version__)
    import bitsandbytes.functional as F
    w.bits("nf4_table", F.get_4bit_type("nf4", device="cpu"))
    w.bits("dynamic_map", F.create_dynamic_map())
    n = {"nf4": 0, "fp8": 0, "qat": 0}
    with torch.no_grad():
        for kind, cases in (("nf4", nf4_cases(g)), ("fp8", fp8_cases(g)), ("qat", qat_cases(g))):
            for name, r in cases:
                n[kind] += 1
                for k, v in r.items():
                    full = "%s_%s_%s" % (kind, name, k)
                    if isinstance(v, list):
                        w.rec(full, "i64", v)
                    else:
                        rec_bits(w, full, v)
        for k, v in fp8_scalefn().items():
            rec_bits(w, "fp8_scalefn_" + k, v)
    w.close()
    print("quant.py: %d nf4, %d fp8, %d qat cases into %s" % (n["nf4"], n["fp8"], n["qat"], OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
