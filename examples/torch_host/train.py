"""Fine-tune a small model sharded by a moonshard policy, with PyTorch's FSDP2 on CPU (gloo).

    torchrun --nproc_per_node 4 examples/torch_host/train.py --policy policies/inkling2 --model islands
    torchrun --nproc_per_node 4 examples/torch_host/train.py --policy policies/fsdp2_default.lua --model llama \
        --mesh dp_replicate=2,dp_shard=2

Each process describes the model to moonshard (through libmoonshard_embed), plans it with the
policy on the mesh, applies the plan with fully_shard and checks the result against the plan
(every parameter's local shape and placements, every unit's parameters, mesh and precision,
the bytes each rank holds), then trains --steps steps of AdamW on seeded random tokens and
prints "step K loss L" (the mean over the whole batch).  --reference trains the same model
unsharded in one process on the whole batch, for comparison.  --plan FILE applies a plan
written before (`moonshard plan --json`, or --write-plan), refused when the model or the mesh
differ.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import models  # noqa: E402
import moonshard_torch as mt  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", help="a moonshard policy file or directory (e.g. policies/inkling2)")
    ap.add_argument("--model", default="llama", choices=["llama", "islands"],
                    help="llama: a tiny transformers Llama (vocab 67, tied embeddings); islands: a small decoder "
                         "with Inkling2's FP32 modules and grouped experts (default llama)")
    ap.add_argument("--untied", action="store_true", help="llama: separate lm_head and embedding weights")
    ap.add_argument("--mesh", help="e.g. dp_replicate=2,dp_shard=2 (default dp_shard=WORLD)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a policy option (as moonshard plan --set), repeatable")
    ap.add_argument("--freeze", action="append", default=[], metavar="SUBSTRING",
                    help="parameters whose names contain it do not train (requires_grad=False), repeatable")
    ap.add_argument("--plan", metavar="FILE", help="apply this plan (JSON) instead of planning")
    ap.add_argument("--write-plan", metavar="FILE", help="rank 0 writes the plan it applies (JSON)")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (default 1e-2)")
    ap.add_argument("--batch", type=int, default=8, help="rows a step, split over the data-parallel ranks (default 8)")
    ap.add_argument("--seq", type=int, default=16, help="tokens a row (default 16)")
    ap.add_argument("--reference", action="store_true",
                    help="no sharding, one process, the whole batch: the losses to compare with")
    a = ap.parse_args(argv)
    if a.reference:
        given = [f for f, v in (("--policy", a.policy), ("--mesh", a.mesh), ("--plan", a.plan), ("--set", a.set),
                                ("--write-plan", a.write_plan)) if v]
        if given:
            ap.error("--reference trains the model unsharded in one process: %s do not apply" % ", ".join(given))
    elif a.plan:
        if a.policy or a.set:
            ap.error("--plan applies a plan as it was made: --policy and --set are for planning (give them to "
                     "moonshard plan, or plan here without --plan)")
    elif not a.policy:
        ap.error("--policy (or --plan) is required unless --reference")
    if a.steps < 1:
        ap.error("--steps %d: expected at least 1" % a.steps)
    if a.batch < 1 or a.seq < 2:
        ap.error("--batch and --seq: expected at least 1 row of at least 2 tokens")
    if a.untied and a.model != "llama":
        ap.error("--untied is for --model llama (the islands model's head is its own)")
    if a.write_plan:
        d = os.path.dirname(os.path.abspath(a.write_plan))
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            ap.error("--write-plan %s: cannot write in %s" % (a.write_plan, d))
    if not a.reference and "RANK" not in os.environ:
        ap.error("run it under torchrun (python -m torch.distributed.run --nproc_per_node N %s ...), or with "
                 "--reference for the unsharded run" % sys.argv[0])
    return a


def batch(step, rows, seq, vocab):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, seq), generator=g)


def train(model, args, rows_of, all_mean):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    vocab = model.lm_head.weight.shape[0]
    losses = []
    for step in range(1, args.steps + 1):
        ids = rows_of(batch(step, args.batch, args.seq, vocab))
        out = model(input_ids=ids, labels=ids)  # (models.llama has no KV cache: use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(all_mean(out.loss.detach().float()))
    return losses


def main(argv=None):
    args = parse_args(argv)
    model = models.build(args.model, tied=not args.untied)
    for f in args.freeze:
        if not any(f in n for n, _ in model.named_parameters()):
            print("train.py: --freeze %s: no parameter of the %s model has it in its name" % (f, args.model),
                  file=sys.stderr)
            return 2
    for n, p in model.named_parameters():
        if any(s in n for s in args.freeze):
            p.requires_grad_(False)
    if args.reference:
        losses = train(model, args, lambda b: b, lambda x: x.item())
        for k, l in enumerate(losses, 1):
            print("step %d loss %.9g" % (k, l))
        return 0

    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = args.mesh or "dp_shard=%d" % world
        if args.plan:
            plan = mt.load_plan(args.plan, model, mesh)
        else:
            plan = mt.plan_model(model, mesh, args.policy, options=args.set)
        if rank == 0:
            print("# moonshard_torch: %s on %s (%d processes), %d units: %s" % (
                args.plan or args.policy, mesh, world, len(plan["units"]),
                ", ".join(u["name"] or "<root>" for u in plan["units"])), flush=True)
            for w in plan.get("warnings", []):
                print("# plan warning: %s" % w, flush=True)
            if args.write_plan:
                with open(args.write_plan, "w") as f:
                    json.dump(plan, f)
        # the data-parallel ranks split the batch's rows; the tp ranks of one share its rows
        # (the mesh's ranks are row-major over pp, dp_replicate, dp_shard, cp, tp)
        size = {a["name"]: a["size"] for a in plan["mesh"]["axes"]}
        dp = size["dp_replicate"] * size["dp_shard"]
        dp_index = (rank // (size["cp"] * size["tp"])) % dp
        per = args.batch // dp
        if per * dp != args.batch:
            raise mt.MoonshardError("invalid_argument", "--batch %d does not split over %d data-parallel ranks"
                                    % (args.batch, dp))
        mt.apply_plan(model, plan)
        report = mt.check_plan(model, plan)
        print("rank %d: check ok: %d parameters in %d units as planned, %d parameter bytes held (the plan's)" % (
            rank, report["params"], report["units"], report["bytes"]), flush=True)

        def all_mean(x):
            dist.all_reduce(x)
            return x.item() / world

        losses = train(model, args, lambda b: b[dp_index * per:(dp_index + 1) * per], all_mean)
        if rank == 0:
            for k, l in enumerate(losses, 1):
                print("step %d loss %.9g" % (k, l), flush=True)
        dist.barrier()
    except mt.MoonshardError as e:
        # (one write a rank, so that the ranks' lines do not run into each other)
        msg = str(e)
        if not msg.startswith("rank %d:" % rank):
            msg = "rank %d: %s" % (rank, msg)
        sys.stderr.write("moonshard_torch: %s\n" % msg)
        sys.stderr.flush()
        dist.destroy_process_group()
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
