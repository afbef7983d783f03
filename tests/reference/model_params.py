"""model_params.py: the parameters transformers 5 builds from each config.json moonshard has
a builder for, for tests/lua/reference_models_spec.lua.  Writes
tests/reference/data/model_params.json.

Each config (the tiny ones of tests/reference/configs/ and the real sizes of
examples/configs/) is loaded as transformers loads a checkpoint's config.json
(AutoConfig.from_pretrained on a directory holding it as config.json) and its model built by
AutoModelForCausalLM.from_config on the meta device (no memory, no data), in the dtype the
config gives (transformers reads `dtype`, else `torch_dtype`; f32 when neither).  Recorded
per model, from transformers' objects:

  class      the class built (it must be the config's architectures[0]);
  params     every parameter in named_parameters() order: name, shape, dtype, requires_grad;
  ties       parameters registered under a second name (named_parameters(remove_duplicate=
             False)): [second name, first name], e.g. a tied lm_head.weight;
  buffers    name, shape, dtype (not compared: moonshard plans parameters);
  count      the number of parameter elements, each tied parameter once (as
             sum(p.numel() for p in model.parameters())).

Architectures transformers does not have (inkling2) are not recorded.  Runs in about half a
minute on two cores (DeepSeek-V3 at full size is the slowest, on the meta device too).
"""
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers

import refdata

OUT = "tests/reference/data/model_params.json"

CONFIGS = [
    # tiny configs: every key a builder reads, set and unset
    "tests/reference/configs/qwen2_tiny.json",
    "tests/reference/configs/qwen3_tiny.json",
    "tests/reference/configs/qwen3_tiny_defaults.json",
    "tests/reference/configs/mistral_tiny.json",
    "tests/reference/configs/mistral_tiny_head_dim.json",
    "tests/reference/configs/gemma2_tiny.json",
    "tests/reference/configs/gemma3_tiny.json",
    "tests/reference/configs/gemma3_tiny_tied.json",
    "tests/reference/configs/llama_tiny.json",
    "tests/reference/configs/mixtral_tiny.json",
    "tests/reference/configs/qwen3_moe_tiny.json",
    "tests/reference/configs/deepseek_v3_tiny.json",
    # real sizes, from the checkpoints' config.json
    "examples/configs/qwen2.5_7b.json",
    "examples/configs/qwen3_8b.json",
    "examples/configs/mistral_7b_v0.3.json",
    "examples/configs/gemma2_9b.json",
    "examples/configs/gemma3_1b.json",
    "examples/configs/llama3.1_8b.json",
    "examples/configs/mixtral_8x7b.json",
    "examples/configs/qwen3_30b_a3b.json",
    "examples/configs/deepseek_v3.json",
]

DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}


def build(config_path):
    arch = json.load(open(config_path))["architectures"][0]
    tmp = tempfile.mkdtemp()
    try:
        shutil.copyfile(config_path, os.path.join(tmp, "config.json"))
        cfg = transformers.AutoConfig.from_pretrained(tmp)
    finally:
        shutil.rmtree(tmp)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(m).__name__ == arch, (config_path, type(m).__name__, arch)
    first, ties = {}, []
    for n, p in m.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append([n, first[id(p)]])
        else:
            first[id(p)] = n
    return {
        "config": config_path, "architecture": arch, "class": type(m).__module__ + "." + type(m).__name__,
        "params": [[n, list(p.shape), DTYPES[p.dtype], p.requires_grad] for n, p in m.named_parameters()],
        "ties": ties,
        "buffers": [[n, list(b.shape), DTYPES[b.dtype]] for n, b in m.named_buffers()],
        "count": sum(p.numel() for p in m.parameters()),
    }


def main():
    out = {"made_by": "tests/reference/model_params.py (tests/reference/make.sh model_params); do not edit",
           "versions": refdata.versions(), "models": []}
    for path in CONFIGS:
        start = time.time()
        rec = build(path)
        out["models"].append(rec)
        print("model_params: %-46s %-20s %4d parameters, %d elements (%.1f s)"
              % (path, rec["architecture"], len(rec["params"]), rec["count"], time.time() - start), file=sys.stderr)
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        f.write("{\"made_by\":%s,\n\"versions\":%s,\n\"models\":[\n" % (json.dumps(out["made_by"]),
                                                                         json.dumps(out["versions"])))
        # one line per model, so that a remade file's diff names the models that changed
        f.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in out["models"]))
        f.write("\n]}\n")
    os.replace(tmp, OUT)
    print("model_params: wrote %s (%d bytes)" % (OUT, os.path.getsize(OUT)), file=sys.stderr)


if __name__ == "__main__":
    main()
