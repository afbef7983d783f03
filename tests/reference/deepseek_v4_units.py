"""deepseek_v4_units.py: the FSDP2 units NeMo Automodel itself makes of DeepSeek-V4, for
tests/lua/deepseek_v4_spec.lua.  Writes tests/reference/data/deepseek_v4_units.json.

Automodel's own DeepseekV4ForCausalLM (components/models/deepseek_v4/model.py) is built from
tests/lua/configs/deepseek_v4_tiny.json on the CPU under local_torch_dtype (as
_transformers/model_init.py builds it), and Automodel's own MoE parallelizer
(components/moe/parallelizer.py parallelize_model: apply_ep, then apply_fsdp with
fully_shard_deepseek_v4 and fully_shard_by_dtype) shards it on a fake process group
(torch.testing._internal.distributed.fake_pg), rank 0 of each mesh.  Every torch fully_shard
call is recorded, in call order: the module's name, the parameters of its FSDP param group,
its mesh (dim names and sizes), MixedPrecisionPolicy and reshard_after_forward (from the
group's post_forward_mesh_info).  Also recorded: the model's parameters and buffers (name,
shape, dtype, requires_grad) as Automodel builds them on the meta device.

Needs Automodel's source on PYTHONPATH (AUTOMODEL_SRC, default /tmp/automodel_src: e.g.
`git -C <NVIDIA-NeMo/Automodel clone> archive HEAD nemo_automodel | tar -x -C /tmp/automodel_src`);
its recorded commit is AUTOMODEL_COMMIT.  Runs in a few seconds.
"""
import json
import os
import sys

sys.path.insert(0, os.environ.get("AUTOMODEL_SRC", "/tmp/automodel_src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import nemo_automodel.components.models.deepseek_v4.fsdp as dsv4_fsdp  # noqa: E402
import nemo_automodel.components.moe.parallelizer as moe_par  # noqa: E402
from nemo_automodel._transformers.model_init import local_torch_dtype  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM  # noqa: E402

import refdata  # noqa: E402

OUT = "tests/reference/data/deepseek_v4_units.json"
CONFIG = "tests/lua/configs/deepseek_v4_tiny.json"
AUTOMODEL_COMMIT = os.environ.get("AUTOMODEL_COMMIT", "36044ad3d139363fb6c73c24af2e7c6b65ec52f6")
# name, moonshard mesh (dp_shard, ep): the MoE parallelizer's fsdp mesh is dp_shard, the
# experts' moe mesh (ep_shard, ep) with ep_shard = world / ep
CASES = [("fsdp4", {"dp_shard": 4, "ep": 1}), ("fsdp4_ep2", {"dp_shard": 4, "ep": 2})]
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64", None: None}


def build():
    raw = json.load(open(CONFIG))
    kw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    cfg = DeepseekV4Config(**kw)
    cfg.architectures = raw["architectures"]
    # the default backend but for the pieces that need CUDA or extra kernels (attention,
    # linear and norm implementations; none changes a parameter's name, shape or dtype)
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                            experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    with local_torch_dtype(torch.bfloat16, DeepseekV4ForCausalLM.__name__):
        return DeepseekV4ForCausalLM(cfg, backend=backend)


def tensors(model):
    return {
        "params": [[n, list(p.shape), NAMES[p.dtype], p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), NAMES[b.dtype]] for n, b in model.named_buffers()],
    }


def run(mesh_sizes):
    world = mesh_sizes["dp_shard"]
    ep = mesh_sizes["ep"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        # mesh_utils.py _create_device_meshes makes the moe mesh only when ep_size > 1, and
        # MeshContext.parallelize_axis_kwargs names its axes only then
        moe_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("ep_shard", "ep")) if ep > 1 else None
        ep_kw = dict(ep_axis_name="ep", ep_shard_axis_names=("ep_shard",)) if ep > 1 else {}
        model = build()
        names = {}
        calls = []
        real = torch.distributed.fsdp.fully_shard

        def recording(module, *a, **k):
            out = real(module, *a, **k)
            calls.append(module)
            return out

        # every fully_shard Automodel's MoE path calls: its own in fsdp.py and parallelizer.py
        dsv4_fsdp.fully_shard = recording
        moe_par.fully_shard = recording
        # apply_fsdp's two runtime patches of FSDPParam (gradient accumulation and reduce
        # dtypes in backward) patch attributes torch 2.15 no longer has; they change no unit
        moe_par._patch_fsdp_accumulated_grad_guard = lambda: None
        moe_par._patch_fsdp_uniform_reduce_dtype = lambda: None
        try:
            moe_par.parallelize_model(model, world_mesh, moe_mesh, dp_axis_names=("dp_shard",), **ep_kw)
        finally:
            dsv4_fsdp.fully_shard = real
            moe_par.fully_shard = real
        names = {m: n for n, m in model.named_modules()}
        units = []
        for module in calls:
            state = _get_module_fsdp_state(module)
            groups = state._fsdp_param_groups
            assert len(groups) <= 1
            mp = state._mp_policy
            u = {"module": names[module], "param_dtype": NAMES[mp.param_dtype], "reduce_dtype": NAMES[mp.reduce_dtype],
                 "output_dtype": NAMES[mp.output_dtype], "cast_forward_inputs": mp.cast_forward_inputs,
                 "params": [], "mesh_dims": None, "mesh_shape": None, "reshard_after_forward": None}
            if groups:
                g = groups[0]
                pf = g.post_forward_mesh_info
                u["reshard_after_forward"] = False if pf is None else (True if pf is g.mesh_info else pf.shard_mesh_size)
                u["mesh_dims"] = list(g.mesh_info.mesh.mesh_dim_names)
                u["mesh_shape"] = list(g.mesh_info.mesh.shape)
                for fp in g.fsdp_params:
                    prefix = names[fp._module_info.module]
                    u["params"].append((prefix + "." if prefix else "") + fp._module_info.param_name)
            units.append(u)
        return units
    finally:
        dist.destroy_process_group()


def main():
    out = {"made_by": "tests/reference/deepseek_v4_units.py (tests/reference/make.sh deepseek_v4_units); do not edit",
           "versions": refdata.versions(), "automodel_commit": AUTOMODEL_COMMIT, "config": CONFIG, "cases": []}
    with torch.device("meta"):
        out["model"] = tensors(build())
    for name, sizes in CASES:
        units = run(sizes)
        mesh = "dp_shard=%d" % sizes["dp_shard"] + (",ep=%d" % sizes["ep"] if sizes["ep"] > 1 else "")
        out["cases"].append({"name": name, "mesh": mesh, "units": units})
        print("deepseek_v4_units: %s: %d units" % (name, len(units)), file=sys.stderr)
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    print("deepseek_v4_units: wrote %s" % OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
