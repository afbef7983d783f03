"""casts.py: what PyTorch's `.to()` gives for the casts moonshard's ms_cast implements, measured
on the CPU, into tests/reference/data/casts.txt (read by tests/c/test_cast.c, part 7 and the
torch lines of part 1).

What is measured, and how it is stored (every record is `name type count values`, refdata.py):

 * f32 -> bf16, f16, e4m3fn, e5m2 on all 2^32 f32 bit patterns, in 256 chunks of 2^24
   inputs (chunk c holds the inputs whose top byte is c, in increasing bit order).  Per
   target a digest of each chunk's output (`f32_<t>_digest`, x64, 256 values), defined as:

       the chunk's output codes o_0 .. o_{n-1} (each the element's bits as an unsigned
       integer), folded h = h * P + o_i (mod 2^64) from h = 0, with P = 0x9E3779B97F4A7C15;

   except that the output for a NaN input, when it is a NaN of the target, is taken as the
   all-ones code (0xffff or 0xff, itself a NaN in each target): moonshard's NaNs keep the
   sign and payload where torch's need not (torch's bf16 NaN is 0xffff for every NaN, its
   e5m2 NaN 0x7f or 0xff), which the README does not claim either way.  P is odd, so P^k is a unit mod 2^64 and a change
   of any one output always changes the digest (by delta * P^k, delta below 2^16 in size).
   Equivalently h = sum_i o_i * P^(n-1-i), which is how numpy computes it here and how the
   C test adds up blocks in any order.
 * for e4m3fn and e5m2 also the exact output, raw bits with no NaN rule, as runs over the
   input bit order: `f32_<t>_run_start` (x32, the first input of each run) and
   `f32_<t>_run_code` (x8): the output is monotone within each sign, so there are only a few
   hundred runs, and a test can name the first input that differs.
 * `f32_<t>_sample_in` / `_out`: inputs around the hard places (every rounding midpoint of the
   fp8 formats and many of bf16/f16, with the f32 neighbours of each, the largest finite
   values, the overflow thresholds, subnormals, zeros, inf, NaNs with payloads) and torch's
   raw output bits, so that a failure can print real values.
 * f64 -> each target (`f64_in` x64, `f64_<t>` raw bits, `f64_<t>_direct` the code that one
   correct rounding of the f64 would give, computed here exactly with fractions): the f64
   inputs include double-rounding cases, where going through f32 differs from rounding once.
 * bf16 and f16 -> f32 on every bit pattern: a digest per chunk of 256 codes
   (`<t>_f32_digest`, 256 values, as above, of the 32-bit outputs, NaN outputs as
   0xffffffff) and torch's raw bits for the NaN codes (`<t>_f32_nan_out`, in code order);
   e4m3fn and e5m2 -> f32: all 256 raw (`<t>_f32`).
 * i64 and i32 -> f32, bf16, f16, e4m3fn, e5m2 and i64 -> i32, i8, u8, bool; f32 and f64 ->
   bool; f32 and f64 in each integer's range -> i64, i32, i8, u8 (truncation).

Everything is the CPU's `.to()`; the header records the versions, the CPU capability torch
dispatched to and how long the sweep took.
"""
import math
import struct
import sys
import time
from fractions import Fraction

import numpy as np
import torch

from refdata import Writer

P = 0x9E3779B97F4A7C15
CHUNK = 1 << 24
NCHUNKS = 256
OUT = "tests/reference/data/casts.txt"

# name -> (torch dtype, ebits, mbits, bias, ieee special values, element bytes)
FORMATS = {
    "bf16": (torch.bfloat16, 8, 7, 127, True, 2),
    "f16": (torch.float16, 5, 10, 15, True, 2),
    "e4m3": (torch.float8_e4m3fn, 4, 3, 7, False, 1),
    "e5m2": (torch.float8_e5m2, 5, 2, 15, True, 1),
}


# ---------------------------------------------------------------- helpers

def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_val(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def f64_val(u):
    return struct.unpack("<d", struct.pack("<Q", u))[0]


def out_bits(t):
    """A tensor's elements as unsigned bit patterns in a numpy array."""
    size = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    nd = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    return t.contiguous().view(ints).numpy().view(nd)


def f32_tensor(bits):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(bits, dtype=np.uint32)).view(np.float32))


def f64_tensor(bits):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(bits, dtype=np.uint64)).view(np.float64))


def is_nan_code(name, codes):
    """NaN codes of a format, by its definition (numpy, vectorised)."""
    _, ebits, mbits, _, ieee, size = FORMATS[name]
    mag = codes.astype(np.uint32) & ((1 << (8 * size - 1)) - 1)
    if ieee:
        return mag > (((1 << ebits) - 1) << mbits)
    return mag == (1 << (8 * size - 1)) - 1


_powers = {}


def powers(n):
    """P^(n-1-j) mod 2^64 for j = 0 .. n-1 (numpy's uint64 arithmetic wraps mod 2^64)."""
    if n not in _powers:
        p = np.full(n, P, dtype=np.uint64)
        p[0] = 1
        _powers[n] = np.cumprod(p, dtype=np.uint64)[::-1].copy()
    return _powers[n]


def digest(codes):
    """The digest of output codes (a numpy array of unsigned integers): h = h*P + o_i."""
    return int((codes.astype(np.uint64) * powers(len(codes))).sum(dtype=np.uint64))


def digest_slow(codes):
    h = 0
    for o in codes.tolist():
        h = (h * P + o) % (1 << 64)
    return h


# ---------------------------------------------------------------- exact rounding (f64 inputs)

def value_of(name, code):
    """The value of a code by the format's definition (None for NaN)."""
    _, ebits, mbits, bias, ieee, size = FORMATS[name]
    sign = -1.0 if code >> (8 * size - 1) else 1.0
    c = code & ((1 << (8 * size - 1)) - 1)
    emax = (1 << ebits) - 1
    if ieee and (c >> mbits) == emax:
        return None if c & ((1 << mbits) - 1) else sign * math.inf
    if not ieee and c == (1 << (8 * size - 1)) - 1:
        return None
    e, m = c >> mbits, c & ((1 << mbits) - 1)
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mbits)
    return sign * math.ldexp((1 << mbits) + m, e - bias - mbits)


def max_finite_code(name):
    _, ebits, mbits, bias, ieee, size = FORMATS[name]
    return (((1 << ebits) - 1) << mbits) - 1 if ieee else (1 << (8 * size - 1)) - 2


def direct_round(name, x):
    """The code of x (a finite or infinite Python float) rounded once, to nearest even, into the
    format; past the largest finite value: inf for the IEEE-like formats, the largest finite
    for e4m3fn (which has no inf; torch saturates it), as torch's overflow rules are."""
    _, ebits, mbits, bias, ieee, size = FORMATS[name]
    sign = (1 << (8 * size - 1)) if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    top = max_finite_code(name)
    over = (((1 << ebits) - 1) << mbits) if ieee else top
    if math.isinf(a):
        return sign | over
    if a == 0:
        return sign
    e = math.frexp(a)[1] - 1  # 2^e <= a < 2^(e+1)
    q = Fraction(2) ** (max(e, 1 - bias) - mbits)  # the quantum at a
    k = Fraction(a) / q
    n = math.floor(k)
    if k - n > Fraction(1, 2) or (k - n == Fraction(1, 2) and n % 2):
        n += 1
    v = n * q
    if v > Fraction(value_of(name, top)):  # rounded past the largest finite
        return sign | over
    if v == 0:
        return sign
    ev = math.frexp(float(v))[1] - 1
    if ev < 1 - bias:
        return sign | int(v / Fraction(2) ** (1 - bias - mbits))
    return sign | ((ev + bias) << mbits) | (int(v / Fraction(2) ** (ev - mbits)) - (1 << mbits))


# ---------------------------------------------------------------- the inputs

def midpoints_f32(name, codes):
    """For each positive code c in codes: the f32 bits of the midpoint between c and c + 1 (an
    exact f32 for every format here) and of its two f32 neighbours, and of c's value."""
    out = []
    for c in codes:
        lo, hi = value_of(name, c), value_of(name, c + 1)
        if hi is None:
            continue
        if math.isinf(hi):  # the boundary to inf: the midpoint with the next binade's start
            _, ebits, mbits, bias, _, _ = FORMATS[name]
            hi = math.ldexp(1.0, (1 << ebits) - 1 - bias)
        mid = (lo + hi) / 2
        if mid >= math.ldexp(1.0, 128):
            continue
        m = f32_bits(mid)
        assert f32_val(m) == mid, (name, c)
        out += [f32_bits(lo), m - 1 if m & 0x7FFFFFFF else m, m, m + 1]
    return out


def probe_codes(name):
    """The positive codes whose rounding midpoints the sample probes."""
    _, ebits, mbits, bias, ieee, size = FORMATS[name]
    top = max_finite_code(name)
    if size == 1:
        return list(range(0, top + 1))
    codes = set(range(0, 24)) | set(range(top - 24, top + 1))
    step = 1 << mbits
    for e in range(0, (1 << ebits) - 1, 1 if ebits <= 5 else 8):
        for d in (-2, -1, 0, 1, 2):
            c = e * step + d
            if 0 <= c <= top:
                codes.add(c)
    rng = np.random.default_rng(1234)
    codes |= set(int(c) for c in rng.integers(0, top + 1, 120))
    return sorted(codes)


SPECIAL_F32 = [
    0x00000000, 0x00000001, 0x00000002, 0x007FFFFF, 0x00800000, 0x00800001,  # zero, f32 subnormals
    0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7FFFFE,  # 1, f32 max
    0x7F800000,  # inf
    0x7F800001, 0x7F800002, 0x7F801FFF, 0x7F802000, 0x7F810000, 0x7FA00000, 0x7FBFFFFF,  # signalling NaNs
    0x7FC00000, 0x7FC00001, 0x7FC02000, 0x7FC10000, 0x7FE00000, 0x7FFFFFFF,  # quiet NaNs
    0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,  # f16: 65519.x, 65520 (-> inf), 65536
    0x476FFFFF, 0x47700000, 0x47700001, 0x47600000,  # e5m2: 61440 (-> inf in torch), 57344
    0x43E80000, 0x43EFFFFF, 0x43F00000, 0x44000000,  # e4m3fn: 464, 480, 512
    0x7F7F8000, 0x7F7F7FFF, 0x7F7F0000,  # bf16: the boundary to inf
    0x4B800000, 0x4B800001, 0x5F000000, 0xDF000000, 0x4F000000,  # 2^24, 2^63, 2^31
]


def sample_inputs(name):
    rng = np.random.default_rng(99)
    pos = midpoints_f32(name, probe_codes(name)) + SPECIAL_F32
    pos += [int(u) for u in rng.integers(0, 0x7F800000, 200)]
    pos = sorted(set(u & 0x7FFFFFFF for u in pos))
    return pos + [u | 0x80000000 for u in pos]


def f64_inputs():
    """f64 inputs: for every format, its f32 rounding midpoints (target ties) nudged by less
    than half an f32 ulp, so that f32 rounds back onto the tie and ties to even, where one
    rounding of the f64 goes to the nudged side (the double-rounding cases); nudged by
    exactly half an f32 ulp, and by a little more; f32 ties just inside the f32 range; and
    specials, huge, tiny and random values."""
    out = []
    for name in FORMATS:
        codes = probe_codes(name)
        codes = codes[::max(1, len(codes) // 48)]
        for c in codes:
            lo, hi = value_of(name, c), value_of(name, c + 1)
            if hi is None:
                continue
            if math.isinf(hi):
                _, ebits, _, bias, _, _ = FORMATS[name]
                hi = math.ldexp(1.0, (1 << ebits) - 1 - bias)
            mid = (lo + hi) / 2
            if mid == 0 or mid >= math.ldexp(1.0, 128):
                continue
            ulp32 = math.ldexp(1.0, max(math.frexp(mid)[1] - 1, -126) - 23)
            for d in (ulp32 / 1024, ulp32 / 2, ulp32 * 0.75):
                out += [mid + d, mid - d]
            out.append(mid)
    specials = [0.0, 1.0, 1.5, 0.1, 1 / 3, 65504.0, 65519.999, 65520.0, 57344.0, 61439.99999,
                61440.0, 448.0, 463.9999, 464.0, 464.0001, 480.0, 1e10, 3.4028234663852886e38,
                3.4028235677973362e38, 3.4028235677973366e38, 3.402823567797337e38, 1e39, 1e300,
                math.ldexp(1.0, -149), math.ldexp(1.0, -150), math.ldexp(1.0, -150) * 1.0000001,
                math.ldexp(1.0, -1074), 1e-300, 2.2250738585072014e-308, math.inf]
    out += specials
    rng = np.random.default_rng(7)
    out += [float(v) for v in rng.standard_normal(300)]
    out += [float(v) for v in np.exp(rng.uniform(-110, 90, 300))]
    bits = [f64_bits(v) & 0x7FFFFFFFFFFFFFFF for v in out]
    bits += [0x7FF0000000000001, 0x7FF8000000000000, 0x7FF8000000000001, 0x7FF0000020000000,
             0x7FF4000000000000, 0x7FFFFFFFFFFFFFFF]  # NaNs, signalling and quiet, payloads
    bits = sorted(set(bits))
    return bits + [b | (1 << 63) for b in bits]


INT_VALUES = [0, 1, -1, 2, 7, 100, 255, 256, -128, -129, 127, 128, 300, -300, 448, 449, 464, 465,
              480, 1000, 2047, 2049, 4097, 57344, 61439, 61440, 65504, 65519, 65520, 65536,
              (1 << 24) + 1, (1 << 24) + 3, (1 << 24) + (1 << 16) + 1, (1 << 24) + (1 << 16),
              (1 << 25) + (1 << 17) + 2, (1 << 31) - 1, -(1 << 31), (1 << 31), (1 << 32) + 5,
              (1 << 40) + (1 << 32) + 1, (1 << 53) + 1, (1 << 62) + (1 << 38) + 1,
              (1 << 63) - 1, -(1 << 63), -(1 << 63) + 1, 123456789, -987654321]


# ---------------------------------------------------------------- the sweep

def sweep():
    digests = {n: [] for n in FORMATS}
    runs = {n: ([], []) for n in FORMATS if FORMATS[n][5] == 1}
    last = {n: None for n in runs}
    for c in range(NCHUNKS):
        base = c * CHUNK
        u = np.arange(base, base + CHUNK, dtype=np.uint64).astype(np.uint32)
        x = torch.from_numpy(u.view(np.float32))
        nan_in = np.isnan(u.view(np.float32)) if c in (0x7F, 0xFF) else None
        for name, (dt, _, _, _, _, size) in FORMATS.items():
            y = out_bits(x.to(dt))
            if name in runs:  # the raw output, before the NaN rule
                starts, codes = runs[name]
                change = np.flatnonzero(y[1:] != y[:-1]) + 1
                if last[name] is None or int(y[0]) != last[name]:
                    starts.append(base)
                    codes.append(int(y[0]))
                starts += [base + int(i) for i in change]
                codes += [int(y[i]) for i in change]
                last[name] = int(y[-1])
            if nan_in is not None:
                y = y.copy()
                y[nan_in & is_nan_code(name, y)] = (1 << (8 * size)) - 1
            digests[name].append(digest(y))
        if c % 32 == 31:
            print("casts.py: %d of %d chunks" % (c + 1, NCHUNKS), file=sys.stderr)
    return digests, runs


def main():
    torch.manual_seed(0)
    t0 = time.time()
    # the digest in numpy == the definition, folded one output at a time
    probe = np.random.default_rng(5).integers(0, 1 << 16, 4096).astype(np.uint16)
    assert digest(probe) == digest_slow(probe)
    digests, runs = sweep()
    sweep_s = time.time() - t0
    recs = []  # (name, type, values)
    for name in FORMATS:
        recs.append(("f32_%s_digest" % name, "x64", digests[name]))
    for name, (starts, codes) in runs.items():
        recs.append(("f32_%s_run_start" % name, "x32", starts))
        recs.append(("f32_%s_run_code" % name, "x8", codes))

    # samples around the hard places
    for name, (dt, _, _, _, _, size) in FORMATS.items():
        u = sample_inputs(name)
        recs.append(("f32_%s_sample_in" % name, "x32", u))
        recs.append(("f32_%s_sample_out" % name, "x%d" % (8 * size), out_bits(f32_tensor(u).to(dt)).tolist()))

    # f64 -> each target, and the once-rounded codes
    fb = f64_inputs()
    xf = f64_tensor(fb)
    recs.append(("f64_in", "x64", fb))
    for name, (dt, _, _, _, _, size) in FORMATS.items():
        recs.append(("f64_%s" % name, "x%d" % (8 * size), out_bits(xf.to(dt)).tolist()))
        direct = []
        for b in fb:
            v = f64_val(b)
            direct.append((1 << (8 * size)) - 1 if math.isnan(v) else direct_round(name, v))
        recs.append(("f64_%s_direct" % name, "x%d" % (8 * size), direct))

    # widening, every code
    for name, (dt, _, _, _, _, size) in FORMATS.items():
        ints = {1: torch.uint8, 2: torch.int16}[size]
        codes = np.arange(1 << (8 * size), dtype=np.uint64).astype({1: np.uint8, 2: np.uint16}[size])
        y = out_bits(torch.from_numpy(codes.view({1: np.uint8, 2: np.int16}[size])).view(ints).view(dt).to(torch.float32))
        if size == 1:
            recs.append(("%s_f32" % name, "x32", y.tolist()))
            continue
        nan = is_nan_code(name, codes)
        recs.append(("%s_f32_nan_out" % name, "x32", y[nan].tolist()))
        canon = y.copy()
        canon[nan & np.isnan(y.view(np.float32))] = 0xFFFFFFFF
        recs.append(("%s_f32_digest" % name, "x64", [digest(canon[k:k + 256]) for k in range(0, len(canon), 256)]))

    # integers -> floats and integers; floats -> bool and (in range) integers
    i64 = torch.tensor(INT_VALUES, dtype=torch.int64)
    i32v = [v for v in INT_VALUES if -(1 << 31) <= v < (1 << 31)]
    i32 = torch.tensor(i32v, dtype=torch.int32)
    recs.append(("i64_in", "i64", INT_VALUES))
    recs.append(("i32_in", "i64", i32v))
    for src, t in (("i64", i64), ("i32", i32)):
        recs.append(("%s_f32" % src, "x32", out_bits(t.to(torch.float32)).tolist()))
        for name, (dt, _, _, _, _, size) in FORMATS.items():
            recs.append(("%s_%s" % (src, name), "x%d" % (8 * size), out_bits(t.to(dt)).tolist()))
    for name, dt in (("i32", torch.int32), ("i8", torch.int8), ("u8", torch.uint8), ("bool", torch.bool)):
        recs.append(("i64_%s" % name, "x%d" % (8 * torch.empty(0, dtype=dt).element_size()), out_bits(i64.to(dt)).tolist()))
    fl = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-45, 1e-300, math.inf, -math.inf, math.nan, -math.nan, 3.0, 1e30]
    recs.append(("bool_f64_in", "f64", fl))
    recs.append(("f32_bool", "x8", out_bits(torch.tensor(fl, dtype=torch.float32).to(torch.bool)).tolist()))
    recs.append(("f64_bool", "x8", out_bits(torch.tensor(fl, dtype=torch.float64).to(torch.bool)).tolist()))
    # in range: the truncated value fits the target, so C's cast (and torch's) is defined
    trunc_in = [0.0, -0.0, 0.4, -0.4, 0.99, -0.99, 1.5, -1.5, 2.5, -2.5, 126.9, 127.99, -127.5, -128.99,
                200.5, 255.9, 32767.5, -32768.7, 2147483520.0, -2147483648.0, 1e15 + 0.5, -4.5e18,
                9.2e18, 123456.789]
    recs.append(("trunc_f64_in", "f64", trunc_in))
    for dname, dt, lo, hi in (("i64", torch.int64, -(1 << 63), (1 << 63) - 1), ("i32", torch.int32, -(1 << 31), (1 << 31) - 1),
                              ("i8", torch.int8, -128, 127), ("u8", torch.uint8, 0, 255)):
        ok = [v for v in trunc_in if lo <= math.trunc(v) <= hi and lo <= math.trunc(float(np.float32(v))) <= hi]
        recs.append(("trunc_%s_in" % dname, "f64", ok))
        recs.append(("f32_%s" % dname, "x%d" % (8 * dt.itemsize), out_bits(torch.tensor(ok, dtype=torch.float32).to(dt)).tolist()))
        recs.append(("f64_%s" % dname, "x%d" % (8 * dt.itemsize), out_bits(torch.tensor(ok, dtype=torch.float64).to(dt)).tolist()))
    v = torch.__version__.split("+")[0].split(".")
    recs.append(("torch_version", "i64", [int(v[0]), int(v[1]), int(v[2])]))

    total_s = time.time() - t0
    w = Writer(OUT, "casts.py", """\
PyTorch's .to() on the CPU for the casts of ms_cast; the script's docstring defines every
record and the digest (h = h * 0x9E3779B97F4A7C15 + o mod 2^64 over the output codes o in
input order, NaN outputs for NaN inputs as the all-ones code).
the sweep over all 2^32 f32 inputs took %.0f s (torch threads %d), the whole script %.0f s
""" % (sweep_s, torch.get_num_threads(), total_s))
    for name, typ, values in recs:
        w.rec(name, typ, values)
    w.close()
    print("casts.py: wrote %s (sweep %.0f s, total %.0f s)" % (OUT, sweep_s, total_s), file=sys.stderr)


if __name__ == "__main__":
    main()
