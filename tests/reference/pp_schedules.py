"""pp_schedules.py: NeMo Automodel's pipeline stage split and PyTorch's pipeline schedules,
measured from their own code, for tests/lua/pp_rules_spec.lua.

Writes tests/reference/data/pp_schedules.json:
  splits     for a grid of (layers L, pp, schedule, layers_per_stage, round): what Automodel's
             calculate_virtual_stages and generate_hf_model_fqn_per_model_part give (the
             number of stages, stages per rank, each stage's modules) and which stages each
             pp rank holds (stage_ids_this_rank with Automodel's style: "v" for
             ZBVZeroBubble, else "loop"), or the error they raise;
  in_flight  for a grid of (schedule, pp, micro-batches n, stages per rank v): each rank's
             peak of live stage-chunk activations, walking torch's own action lists
             (torch.distributed.pipelining._schedule_visualizer.get_schedule_ops): a
             (stage, micro-batch) activation is live from its forward until its full
             backward, or until its weight backward where the schedule splits it
             (torch's analyze_pipeline_activation_liveness convention); or torch's error.
             1F1B is left out: its action list (for visualisation only) is off by one on the
             last rank, where the executor's warm-up, min(n, pp - r), holds.

Needs Automodel's source on PYTHONPATH (AUTOMODEL_SRC, default /tmp/automodel_src: e.g.
`git -C <Automodel clone> archive HEAD nemo_automodel | tar -x -C /tmp/automodel_src`), at the
commit AUTOMODEL_COMMIT records.  Runs in a few seconds.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("AUTOMODEL_SRC", "/tmp/automodel_src"))

import refdata  # noqa: E402
from torch.distributed.pipelining import _schedule_visualizer as viz  # noqa: E402
from torch.distributed.pipelining.schedules import _ComputationType as C  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle  # noqa: E402

import nemo_automodel.components.distributed.pipelining.functional as am  # noqa: E402

AUTOMODEL_COMMIT = os.environ.get("AUTOMODEL_COMMIT", "36044ad3d139363fb6c73c24af2e7c6b65ec52f6")
OUT = "tests/reference/data/pp_schedules.json"
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def split(L, pp, schedule, lps, rnd):
    cls = get_schedule_class(schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    try:
        num_stages, per_rank = am.calculate_virtual_stages(L, lps, pp, single, rnd)
        parts = am.generate_hf_model_fqn_per_model_part(num_stages, L)
        style = "v" if schedule == "ZBVZeroBubble" else "loop"
        ranks = [list(am.stage_ids_this_rank(r, pp, num_stages, style=style)) for r in range(pp)]
    except (ValueError, AssertionError) as e:
        return {"error": str(e)}
    return {"num_stages": num_stages, "stages_per_rank": per_rank, "parts": parts, "ranks": ranks}


def in_flight(schedule, pp, n, v):
    try:
        ops = viz.get_schedule_ops(schedule, pp, n, v)
    except Exception as e:  # torch's own refusal (ValueError, or an assertion)
        return {"error": "%s: %s" % (type(e).__name__, e)}
    split_w = any(a is not None and a.computation_type == C.BACKWARD_WEIGHT for rank in ops for a in rank)
    peaks = []
    for rank in ops:
        live, peak = set(), 0
        for a in rank:
            if a is None:
                continue
            key = (a.stage_index, a.microbatch_index)
            t = a.computation_type
            if t == C.FORWARD:
                live.add(key)
                peak = max(peak, len(live))
            elif t == C.FULL_BACKWARD or (t == C.BACKWARD_WEIGHT and split_w):
                live.discard(key)
        peaks.append(peak)
    return {"peaks": peaks}


def main():
    splits = []
    for L in (7, 8, 30, 32, 61):
        for pp in (2, 4):
            for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
                for lps in (None, 3, 5, 16):
                    for rnd in (None, "up", "down"):
                        if lps is None and rnd is not None:
                            continue
                        rec = {"layers": L, "pp": pp, "schedule": schedule, "layers_per_stage": lps, "round": rnd}
                        rec.update(split(L, pp, schedule, lps, rnd))
                        splits.append(rec)
    flights = []
    for schedule in SCHEDULES:
        if schedule == "1F1B":
            continue
        single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
        for pp in (2, 3, 4, 8):
            for n in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 2, 3 * pp}):
                if n < 1:
                    continue
                for v in ((1,) if single else (2, 3, 4)):
                    if schedule in ("ZBVZeroBubble", "DualPipeV") and v != 2:
                        continue
                    rec = {"schedule": schedule, "pp": pp, "microbatches": n, "stages_per_rank": v}
                    rec.update(in_flight(schedule, pp, n, v))
                    flights.append(rec)
    out = {"made_by": "tests/reference/pp_schedules.py (tests/reference/make.sh pp_schedules); do not edit",
           "versions": refdata.versions() + ["automodel " + AUTOMODEL_COMMIT], "splits": splits,
           "in_flight": flights}
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print("pp_schedules: %d splits, %d schedules; wrote %s" % (len(splits), len(flights), OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
