"""fsdp2_sync_off.py: what FSDP2 (torch 2.15) does with gradients accumulated while
gradient sync is off, for the dtype rules tests/c/test_unit.c checks the shard units by:
each case a parameter of shape (2, 4) in one fully_shard unit on 2 gloo ranks, three
backwards of loss = sum(w * G) (the gradient is G, cast to the compute dtype by
cast_forward_inputs), sync off for the first two and on for the third; recorded: each
rank's G per backward and its gradient shard after the third.  The values are chosen where
the rules part: rounded to the reduce dtype each backward or once, reduced in param_dtype or
in the stored dtype when reduce_dtype is unset (torch 2.15 reduces in the stored dtype).

Records (refdata.py's format): case.<name> i64 [stored, param_dtype, reduce_dtype] with
0 f32, 1 bf16, 2 f16, -1 unset; g.<name>.r<rank>.b<k> f64 [8] (row-major (2, 4));
grad.<name>.r<rank> f64 [4] (the rank's row of the gradient, in the stored dtype).
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from refdata import Writer

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CODE = {F32: 0, BF16: 1, F16: 2, None: -1}
# name, stored, param_dtype, reduce_dtype
CASES = [
    ("f32_f16reduce", F32, None, F16),
    ("f32_bf16_unset", F32, BF16, None),
    ("f32_bf16_f32", F32, BF16, F32),
    ("f32_bf16_bf16", F32, BF16, BF16),
    ("bf16_f32_unset", BF16, F32, None),
    ("bf16_f32reduce", BF16, None, F32),
]
S = 2 ** -9


def grads(rank, k):
    """G of backward k on `rank`: 1s, then values that round differently in f16 and bf16
    than in f32, then a third small step; rank 1 twice rank 0's (the average is exact)."""
    base = [
        [1.0] * 8,
        [S, 2 ** -11 + 2 ** -23, 3 * 2 ** -10, -S, 2 ** -12 + 2 ** -20, 5 * 2 ** -11, 2 ** -8 + 2 ** -16, -3 * S],
        [2 ** -10, -2 ** -13, S + 2 ** -14, 0.25, -2 ** -11, 2 ** -9 + 2 ** -21, 7 * 2 ** -12, 2 ** -7],
    ][k]
    return [v * (rank + 1) for v in base]


class Lin(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 4, dtype=dtype))

    def forward(self, g):
        return (self.w * g).sum()


def worker(rank, store, out):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    res = {}
    for name, stored, pd, rd in CASES:
        m = Lin(stored)
        fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd))
        for k in range(3):
            m.set_requires_gradient_sync(k == 2)
            g = torch.tensor(grads(rank, k), dtype=F32).reshape(2, 4)
            m(g).backward()
        res[name] = [float(v) for v in m.w.grad.to_local().reshape(-1).tolist()]
    torch.save(res, out)
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, "r%d.pt" % r) for r in range(2)]
        procs = [mp.get_context("spawn").Process(target=worker, args=(r, store, outs[r])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                sys.exit("a rank failed")
        res = [torch.load(o) for o in outs]
    about = "FSDP2's gradient accumulation with sync off, 6 dtype cases on 2 gloo ranks (see the script)"
    w = Writer("tests/reference/data/fsdp2_sync_off.txt", "fsdp2_sync_off.py", about)
    for name, stored, pd, rd in CASES:
        w.rec("case." + name, "i64", [CODE[stored], CODE[pd], CODE[rd]])
        for r in range(2):
            for k in range(3):
                w.rec("g.%s.r%d.b%d" % (name, r, k), "f64", grads(r, k))
            w.rec("grad.%s.r%d" % (name, r), "f64", res[r][name])
    w.close()


if __name__ == "__main__":
    main()
