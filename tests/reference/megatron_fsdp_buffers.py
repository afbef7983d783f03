"""Megatron-FSDP's own buffer layout, measured (tests/reference/data/megatron_fsdp_buffers.json).

Runs megatron_fsdp 0.5.0's layout code on CPU (the release NeMo Automodel pins; no GPU, no
process group: both functions are pure index arithmetic): _get_parameter_groups groups and
orders a module's parameters into buckets with their chunk_size_factor, and
build_data_parallel_buffer_index places each parameter in its bucket's flat buffer and pads
it.  The modules are built on the meta device from parameter shapes: a Llama-3.1-8B, the
tiny Llama the specs plan (its config's sizes, in bf16 and without its biases), and a synthetic module of odd shapes (fragments, remainders that
pair, mixed dtypes, frozen and expert parameters).  tests/lua/megatron_fsdp_spec.lua reads
the result.

    MOONSHARD_REF_VENV=<venv> bash tests/reference/make.sh megatron_fsdp_buffers
    (requirements.txt pins megatron-fsdp==0.5.0)
"""
import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")
from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig  # noqa: E402
from megatron_fsdp.param_and_grad_buffer import (  # noqa: E402
    BucketingPolicy,
    _get_parameter_groups,
    build_data_parallel_buffer_index,
)

DT = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}


class Layer(torch.nn.Module):
    """The FSDP unit module class."""


def build(spec):
    """spec: list of (fqn, shape, dtype, requires_grad); modules named '<...>layers.<i>' are Layers."""
    root = torch.nn.Module()
    for fqn, shape, dtype, rg in spec:
        parts = fqn.split(".")
        m = root
        for i, name in enumerate(parts[:-1]):
            if not hasattr(m, name):
                is_layer = i > 0 and parts[i - 1] == "layers"
                m.add_module(name, Layer() if is_layer else torch.nn.Module())
            m = getattr(m, name)
        p = torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype), device="meta"), requires_grad=rg)
        m.register_parameter(parts[-1], p)
    return root


def llama(hidden, inter, layers, vocab, kv, head_dim, tie=False):
    spec = [("model.embed_tokens.weight", [vocab, hidden], "bfloat16", True)]
    for i in range(layers):
        pre = f"model.layers.{i}."
        spec += [
            (pre + "self_attn.q_proj.weight", [hidden, hidden], "bfloat16", True),
            (pre + "self_attn.k_proj.weight", [kv * head_dim, hidden], "bfloat16", True),
            (pre + "self_attn.v_proj.weight", [kv * head_dim, hidden], "bfloat16", True),
            (pre + "self_attn.o_proj.weight", [hidden, hidden], "bfloat16", True),
            (pre + "mlp.gate_proj.weight", [inter, hidden], "bfloat16", True),
            (pre + "mlp.up_proj.weight", [inter, hidden], "bfloat16", True),
            (pre + "mlp.down_proj.weight", [hidden, inter], "bfloat16", True),
            (pre + "input_layernorm.weight", [hidden], "bfloat16", True),
            (pre + "post_attention_layernorm.weight", [hidden], "bfloat16", True),
        ]
    spec.append(("model.norm.weight", [hidden], "bfloat16", True))
    if not tie:
        spec.append(("lm_head.weight", [vocab, hidden], "bfloat16", True))
    return spec


ODD = [
    ("model.embed.weight", [37, 12], "bfloat16", True),
    ("model.layers.0.a.weight", [20, 6], "bfloat16", True),
    ("model.layers.0.b.weight", [7, 10], "bfloat16", True),
    ("model.layers.0.c.bias", [5], "bfloat16", True),
    ("model.layers.0.d.bias", [3], "bfloat16", True),
    ("model.layers.0.e.weight", [9, 4], "float32", True),
    ("model.layers.0.f.weight", [11, 4], "bfloat16", False),
    ("model.layers.1.experts.w", [3, 5, 7], "bfloat16", True),
    ("model.layers.1.g.weight", [13, 12], "bfloat16", True),
    ("model.layers.1.h.bias", [13], "bfloat16", True),
    ("model.layers.1.i.weight", [6, 8], "bfloat16", True),
    ("model.head.weight", [41, 12], "bfloat16", True),
    ("model.scale", [], "float32", True),
]

CASES = {
    "llama3.1_8b": llama(4096, 14336, 32, 128256, 8, 128),
    "llama_tiny": None,  # filled from tests/reference/configs/llama_tiny.json
    "odd": ODD,
}


def main():
    root = os.path.dirname(os.path.abspath(__file__))
    cfg = json.load(open(os.path.join(root, "configs", "llama_tiny.json")))
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    CASES["llama_tiny"] = llama(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                                cfg["vocab_size"], cfg["num_key_value_heads"], hd, cfg.get("tie_word_embeddings", False))
    out = {"megatron_fsdp": "0.5.0", "torch": torch.__version__, "cases": []}
    for name, spec in CASES.items():
        module = build(spec)
        fqn_of = {p: n for n, p in module.named_parameters()}
        for strategy in ["no_shard", "optim", "optim_grads_params"]:
            policy = BucketingPolicy(suggested_bucket_size=None, fsdp_unit_modules=[Layer],
                                     data_parallel_sharding_strategy=strategy)
            groups, _, _ = _get_parameter_groups(module, policy, {})
            for dp in [1, 2, 3, 8]:
                cfgd = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
                buckets = []
                for gid, g in enumerate(groups):
                    items, bidx, _ = build_data_parallel_buffer_index(
                        [p.shape for p in g.params], 0, dp, True, cfgd, bucket_id=gid,
                        chunk_size_factor=g.chunk_size_factor)
                    buckets.append({
                        "params": [fqn_of[p] for p in g.params],
                        "dtype": DT[g.dtype], "requires_grad": bool(g.requires_grad),
                        "expert": bool(g.is_expert_param), "fsdp_unit_id": g.fsdp_unit_id,
                        "chunk_size_factor": g.chunk_size_factor,
                        "offsets": [items[i].global_data_index for i in range(len(g.params))],
                        "size": bidx.size,
                    })
                out["cases"].append({"model": name, "strategy": strategy, "dp": dp, "buckets": buckets})
        # in named_parameters() order (a module's own parameters before its children's)
        out.setdefault("params", {})[name] = [[n, list(p.shape), DT[p.dtype], p.requires_grad]
                                              for n, p in module.named_parameters()]
    path = os.path.join(root, "data", "megatron_fsdp_buffers.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(path, len(out["cases"]), "cases")


if __name__ == "__main__":
    main()
