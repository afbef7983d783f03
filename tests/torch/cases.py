"""tests/torch/cases.py: checks of moonshard_torch that need no training run, under torchrun.

    torchrun --nproc_per_node 2 tests/torch/cases.py divergence
        the plan applied, then check_plan against a copy of the plan with one parameter's
        local shape, one unit's reduce dtype and one unit's parameter list changed: each named
    torchrun --nproc_per_node 2 tests/torch/cases.py refusals
        what apply_plan refuses: a plan for another world size, a pipeline (pp = 2), tied
        weights under tensor parallelism, a model sharded already; check_plan before apply_plan,
        a reshard_after_forward that differs, and a packed unit FSDP2 cannot hold (bf16 weights
        beside fp32 islands: one stored dtype a unit)

Prints "rank R: CASE ok: ..." per rank; exits non-zero on the first failed expectation.
"""
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "examples", "torch_host"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import models  # noqa: E402
import moonshard_torch as mt  # noqa: E402


def expect_error(fn, *needles):
    try:
        fn()
    except mt.MoonshardError as e:
        msg = str(e)
        for n in needles:
            if n not in msg:
                raise AssertionError("the error %r lacks %r" % (msg, n))
        return msg
    raise AssertionError("no error; expected one naming %s" % (needles,))


def divergence(rank, world):
    model = models.build("llama")
    plan = mt.plan_model(model, "dp_shard=%d" % world, os.path.join(REPO, "policies", "fsdp2_default.lua"))
    mt.apply_plan(model, plan)
    mt.check_plan(model, plan)
    bad = copy.deepcopy(plan)
    u0 = bad["units"][0]
    p0 = u0["params"][0]
    p0["local_shapes"][rank] = [s + 1 for s in p0["local_shapes"][rank]]
    u0["reduce_dtype"] = "bf16"
    moved = bad["units"][1]["params"].pop()
    msg = expect_error(lambda: mt.check_plan(model, bad), p0["fqn"] + ": local shape", "reduce_dtype",
                       "unit %s: FSDP2 holds ['%s']" % (bad["units"][1]["name"], moved["fqn"]))
    print("rank %d: divergence ok: %s" % (rank, msg[:160]), flush=True)


def refusals(rank, world):
    model = models.build("llama")
    other = mt.plan_model(model, "dp_shard=%d" % (world * 2), os.path.join(REPO, "policies", "fsdp2_default.lua"))
    expect_error(lambda: mt.apply_plan(model, other), "a world of %d; this job has %d processes" % (world * 2, world))
    pp = mt.plan_model(models.build("llama", tied=False), "pp=%d" % world,
                       os.path.join(REPO, "policies", "fsdp2_default.lua"))
    expect_error(lambda: mt.apply_plan(models.build("llama", tied=False), pp), "pp = %d" % world,
                 "pipelines and context parallelism are not applied yet")
    tied = mt.plan_model(models.build("llama"), "tp=%d" % world, os.path.join(REPO, "policies", "fsdp2_default.lua"))
    expect_error(lambda: mt.apply_plan(models.build("llama"), tied), "tensor parallelism with tied parameters",
                 "lm_head.weight = model.embed_tokens.weight")
    fresh = models.build("llama")
    plain = mt.plan_model(fresh, "dp_shard=%d" % world, os.path.join(REPO, "policies", "fsdp2_default.lua"))
    expect_error(lambda: mt.check_plan(fresh, plain), "is not sharded", "call apply_plan(model, plan) first")
    mt.apply_plan(fresh, plain)
    expect_error(lambda: mt.apply_plan(fresh, plain), "the model is sharded already")
    bad = copy.deepcopy(plain)
    bad["units"][0]["reshard_after_forward"] = not bad["units"][0]["reshard_after_forward"]
    expect_error(lambda: mt.check_plan(fresh, bad), "unit %s: reshard_after_forward" % bad["units"][0]["name"])
    # Inkling2's storage: bf16 weights, the FP32 modules in f32; packing its islands makes units
    # of two stored dtypes, which FSDP2 cannot hold (the all-f32 model packs: run.sh)
    mixed = models.build("islands")
    islands = ("attn_query", "mlp_query", "output_query", "q_l2_clip", "rel_l2_clip", "mlp.gate")
    for name, p in mixed.named_parameters():
        if not any(i + "." in name for i in islands):
            p.data = p.data.to(torch.bfloat16)
    packed = mt.plan_model(mixed, "dp_shard=%d" % world, os.path.join(REPO, "policies", "inkling2"),
                           options=["pack_islands=true"])
    expect_error(lambda: mt.apply_plan(mixed, packed), "apply_plan: unit model.layers.0 is a packed unit",
                 "stored in bf16", "and f32", "FSDP expects uniform original parameter dtype", "pack_islands=false")
    print("rank %d: refusals ok" % rank, flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    {"divergence": divergence, "refusals": refusals}[sys.argv[1]](rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
