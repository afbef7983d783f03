"""refdata.py: writes the reference data files the tests read (tests/c/refdata.h,
tests/lua/support.lua's S.refdata).

One record a line: `<name> <type> <count> <values...>`, types x8 x16 x32 x64 (hexadecimal
bit patterns), i64 (decimal integers) and f64 (Python's repr of a float).  `#` lines are
comments: every file starts with the script, the command and the versions that made it.
"""
import os
import platform
import sys


def versions():
    """The versions of what made the data, as one comment line each."""
    out = ["python " + platform.python_version(), "machine " + platform.machine()]
    for mod in ("torch", "numpy", "ml_dtypes", "safetensors", "transformers"):
        m = sys.modules.get(mod)
        if m is not None:
            out.append(mod + " " + getattr(m, "__version__", "?"))
    t = sys.modules.get("torch")
    if t is not None:
        out.append("torch cpu capability " + t.backends.cpu.get_cpu_capability())
    for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS"):
        if k in os.environ:
            out.append(k + "=" + os.environ[k])
    return out


class Writer:
    def __init__(self, path, script, about):
        self.path = path
        self.tmp = path + ".tmp"
        self.f = open(self.tmp, "w")
        self.names = set()
        self.comment("made by tests/reference/%s (tests/reference/make.sh); do not edit" % script)
        for line in about.strip().splitlines():
            self.comment(line)
        for v in versions():
            self.comment(v)

    def comment(self, text):
        self.f.write("# " + text + "\n")

    def rec(self, name, typ, values):
        """A record: values is an iterable of ints (x*, i64) or floats (f64)."""
        assert " " not in name and name not in self.names, name
        self.names.add(name)
        values = list(values)
        if typ.startswith("x"):
            bits = int(typ[1:])
            assert all(0 <= int(v) < (1 << bits) for v in values), name
            body = " ".join("%x" % int(v) for v in values)
        elif typ == "i64":
            body = " ".join("%d" % int(v) for v in values)
        elif typ == "f64":
            body = " ".join(repr(float(v)) for v in values)
        else:
            raise ValueError(typ)
        self.f.write("%s %s %d%s%s\n" % (name, typ, len(values), " " if values else "", body))

    def bits(self, name, tensor):
        """A torch tensor's elements as bit patterns (x8/x16/x32/x64 by element size)."""
        import torch
        t = tensor.detach().contiguous().reshape(-1).cpu()
        size = t.element_size()
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        raw = t.view(ints).tolist()
        mask = (1 << (8 * size)) - 1
        self.rec(name, "x%d" % (8 * size), [v & mask for v in raw])

    def close(self):
        self.f.close()
        os.replace(self.tmp, self.path)
