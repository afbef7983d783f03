"""recipes.py: what NeMo Automodel's infrastructure steps do to a model, the reference for
moonshard's recipes (lua/moonshard/recipe.lua), read by tests/lua/recipe_spec.lua.  Writes
data/recipes.json.

Every case builds a transformers model from a config (examples/configs, cut to 2 decoder
layers, or a tiny one whose dims are chosen to miss the steps' divisibility rules) on the
meta device and runs the step with the libraries' own code:

- peft: NeMo Automodel's apply_lora_to_linear_modules (its source on AUTOMODEL_SRC, default
  /tmp/automodel_src; its Triton kernels are replaced by stand-ins, which only the forward
  would call), then Automodel's freeze of every parameter whose name holds no "lora_"
  (_transformers/infrastructure.py).  Recorded: the modules that gained lora_A, every
  adapter parameter's name, shape and dtype, the trainable and total parameter counts; and,
  where the case can be written as a PEFT LoraConfig (a list of module leaf names), the
  trainable count huggingface/peft's get_peft_model gives.
- fp8: torchao's convert_to_float8_training with Automodel's _module_filter_fn
  (quantization/fp8.py): the modules that became Float8Linear.
- nf4: bitsandbytes' quantize_4bit (blocksize 64, with and without double quantisation,
  bf16 and uint8 storage): the packed weight's shape and dtype and the quant state's
  tensors, the bytes QLoRA plans.
- qat: torchao's Int8DynActInt4WeightQATQuantizer / Int4WeightOnlyQATQuantizer .prepare on
  the model in bf16, with Automodel's precision defaults (quantization/qat.py): the modules
  swapped for QAT linears, or the error prepare raises (int4 weight-only swaps every
  bias-free Linear, padding_allowed=True, and its QAT linear refuses in_features that are not
  a multiple of the group size and of inner_k_tiles x 16).

Runs in under a minute on two cores.
"""
import copy
import json
import os
import sys
import types
from functools import partial

import torch

import refdata

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
OUT = os.path.join(here, "data", "recipes.json")

sys.path.insert(0, os.environ.get("AUTOMODEL_SRC", "/tmp/automodel_src"))
# lora.py imports its Triton kernels at module level; the planner never runs them
kernels = types.ModuleType("nemo_automodel.components._peft.lora_kernel")
for n in ["lora_forward_wrapper", "lora_da_dx_update_wrapper", "lora_db_update_wrapper"]:
    setattr(kernels, n, lambda *a, **k: None)
sys.modules["nemo_automodel.components._peft.lora_kernel"] = kernels

from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules  # noqa: E402
from nemo_automodel.components.quantization.fp8 import _module_filter_fn  # noqa: E402
import peft  # noqa: E402
import torchao  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.quantization.qat import Int4WeightOnlyQATQuantizer, Int8DynActInt4WeightQATQuantizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

DT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# a tiny Llama whose dims miss the rules: 120 and 24 are not multiples of 16 (fp8), 48 and
# 120 not of 32 or 128 (QAT groups)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48,
        "intermediate_size": 120, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def configs():
    out = {}
    for name in ["llama3.1_8b", "qwen3_8b", "qwen2.5_7b"]:
        with open(os.path.join(root, "examples", "configs", name + ".json")) as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"] = 2
        out[name] = cfg
    out["tiny_llama"] = TINY
    return out


def build(cfg, dtype=None):
    c = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    c.architectures = cfg["architectures"]
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c)
    return m.to(dtype) if dtype else m


PEFT_CASES = [
    ("proj16", {"target_modules": ["*_proj"], "dim": 16, "alpha": 32},
     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("all_linear", {"match_all_linear": True, "dim": 8},
     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]),
    ("default", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("exclude", {"exclude_modules": ["lm_head", "*.down_proj"], "dim": 4},
     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]),
    ("wildcards", {"target_modules": ["model.layers.0.*.q_proj", "*.layers.1.mlp.*"], "dim": 8}, None),
    ("lora_f32", {"target_modules": ["*_proj"], "dim": 8, "lora_dtype": "float32"}, None),
    ("leaf_names", {"target_modules": ["q_proj", "v_proj"], "dim": 8}, None),
]


def peft_case(model, kw):
    m = copy.deepcopy(model)
    n = apply_lora_to_linear_modules(m, PeftConfig(**kw), skip_freeze=True)
    for name, p in m.named_parameters():
        if "lora_" not in name:
            p.requires_grad_(False)
    matched = [name for name, mod in m.named_modules() if hasattr(mod, "lora_A")]
    assert len(matched) == n, (n, len(matched))
    lora = [[name, list(p.shape), DT[p.dtype]] for name, p in m.named_parameters() if "lora_" in name]
    return {"matched": matched, "lora_params": lora,
            "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad),
            "total": sum(p.numel() for p in m.parameters())}


def peft_library_count(model, kw, leaves):
    cfg = peft.LoraConfig(r=kw.get("dim", 8), lora_alpha=kw.get("alpha", 32), target_modules=leaves)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg)
    trainable, _ = pm.get_nb_trainable_parameters()
    return trainable


FP8_CASES = [("lm_head", ["lm_head"]), ("none", []), ("mlp", ["mlp"])]

# bitsandbytes' 4-bit weights (quantize_4bit on the CPU): the packed tensor and the quant
# state's tensors, for QLoRA's planned bytes
NF4_SHAPES = [(96, 64), (4096, 4096), (1024, 4096), (100, 30), (7, 9), (14336, 4096)]


def nf4_case(shape, double, storage):
    import bitsandbytes.functional as F
    w = torch.zeros(shape, dtype=torch.bfloat16)
    q, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type="nf4", quant_storage=storage)
    state = [["absmax", qs.absmax.numel(), str(qs.absmax.dtype)]]
    if double:
        state += [["state2.absmax", qs.state2.absmax.numel(), str(qs.state2.absmax.dtype)],
                  ["state2.code", qs.state2.code.numel(), str(qs.state2.code.dtype)],
                  ["offset", qs.offset.numel(), str(qs.offset.dtype)]]
    size = {"torch.float32": 4, "torch.uint8": 1, "torch.bfloat16": 2}
    return {"shape": list(shape), "double_quant": double, "storage": DT.get(storage, "u8"),
            "packed_shape": list(q.shape), "packed_dtype": DT.get(q.dtype, "u8"), "state": state,
            "state_bytes": sum(n * size[d] for _, n, d in state)}


QAT_CASES = [
    ("8da4w_256", Int8DynActInt4WeightQATQuantizer, {"groupsize": 256}),
    ("8da4w_32", Int8DynActInt4WeightQATQuantizer, {"groupsize": 32}),
    ("8da4w_16", Int8DynActInt4WeightQATQuantizer, {"groupsize": 16}),
    ("4w_32", Int4WeightOnlyQATQuantizer, {"groupsize": 32}),
    ("4w_128", Int4WeightOnlyQATQuantizer, {"groupsize": 128}),
]


def main():
    out = {"about": __doc__.strip().splitlines()[0], "versions": refdata.versions() + [
        "peft " + peft.__version__, "torchao " + torchao.__version__,
        "nemo_automodel source " + os.environ.get("AUTOMODEL_SRC", "/tmp/automodel_src")],
        "configs": configs(), "peft": [], "fp8": [], "qat": [], "nf4": []}
    import bitsandbytes
    out["versions"].append("bitsandbytes " + bitsandbytes.__version__)
    for shape in NF4_SHAPES:
        for double in (True, False):
            for storage in (torch.bfloat16, torch.uint8):
                out["nf4"].append(nf4_case(shape, double, storage))
    for mname, cfg in out["configs"].items():
        model = build(cfg)
        for cname, kw, leaves in PEFT_CASES:
            rec = {"model": mname, "case": cname, "peft": kw}
            rec.update(peft_case(model, kw))
            if leaves:
                rec["peft_library_trainable"] = peft_library_count(model, kw, leaves)
                assert rec["peft_library_trainable"] == rec["trainable"], (mname, cname)
            out["peft"].append(rec)
        for cname, filt in FP8_CASES:
            m = copy.deepcopy(model)
            convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True),
                                       module_filter_fn=partial(_module_filter_fn, filter_fqns=filt))
            conv = [n for n, mod in m.named_modules() if type(mod).__name__ == "Float8Linear"]
            out["fp8"].append({"model": mname, "case": cname, "filter_fqns": filt, "converted": conv})
        bf = build(cfg, torch.bfloat16)
        for cname, cls, kw in QAT_CASES:
            q = cls(precision=torch.bfloat16, scales_precision=torch.bfloat16, **kw)
            rec = {"model": mname, "case": cname, "groupsize": kw["groupsize"],
                   "quantizer_type": "int4_weight_only" if cls is Int4WeightOnlyQATQuantizer else "int8_dynact_int4weight"}
            try:
                m = q.prepare(copy.deepcopy(bf))
                rec["swapped"] = [n for n, mod in m.named_modules() if type(mod).__name__.endswith("QATLinear")]
            except ValueError as e:  # int4 weight-only refuses a bias-free Linear it cannot group
                rec["error"] = str(e)
            out["qat"].append(rec)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", OUT, len(out["peft"]), "peft,", len(out["fp8"]), "fp8,", len(out["qat"]), "qat cases")


if __name__ == "__main__":
    main()
