"""tests/reference/hf_checkpoints.py: tiny Hugging Face checkpoints for moonshard.checkpoint_hf
(tests/lua/checkpoint_hf_spec.lua), written by transformers' own save_pretrained.

  data/hf_checkpoints/llama_tiny/         configs/llama_tiny.json (f32, tied head, MLP biases,
                                          vocab 67): model.safetensors + config.json
  data/hf_checkpoints/llama_tiny_bf16.safetensors
                                          every tensor of llama_tiny cast to bfloat16 by torch
                                          (.to(torch.bfloat16)): what an f32 -> bf16 load must give
  data/hf_checkpoints/qwen3_moe_tiny/     configs/qwen3_moe_tiny.json (bf16, 4 experts in layer 1),
                                          sharded (max_shard_size 8KB): model-0000i-of-0000n.safetensors
                                          + model.safetensors.index.json; the experts per expert
                                          (mlp.experts.{e}.gate_proj/up_proj/down_proj.weight), as
                                          transformers writes them

Every parameter is drawn from N(0, 0.5^2) with a fixed seed (norm weights too, so that no two
tensors are alike).  Run by make.sh (bash tests/reference/make.sh hf_checkpoints).
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "hf_checkpoints")


def model_from(config_name, seed):
    with open(os.path.join(HERE, "configs", config_name + ".json")) as f:
        cfg = json.load(f)
    cfg.pop("_comment", None)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.get("dtype", "float32")))
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32) * 0.5)
    return model


def save(model, name, **kw):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True, **kw)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(d, extra)):
            os.remove(os.path.join(d, extra))
    return d


def main():
    os.makedirs(OUT, exist_ok=True)
    llama = model_from("llama_tiny", 24)
    save(llama, "llama_tiny")
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in llama.state_dict().items()
          if k != "lm_head.weight"}  # tied: saved once, as save_pretrained does
    save_file(sd, os.path.join(OUT, "llama_tiny_bf16.safetensors"))
    qwen = model_from("qwen3_moe_tiny", 25)
    save(qwen, "qwen3_moe_tiny", max_shard_size="8KB")
    for root, _, files in os.walk(OUT):
        for f in sorted(files):
            print(os.path.relpath(os.path.join(root, f), OUT), os.path.getsize(os.path.join(root, f)))


if __name__ == "__main__":
    main()
