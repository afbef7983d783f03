"""activations.py: the bytes PyTorch eager keeps for backward, for tests/lua/activations_spec.lua.
Writes tests/reference/data/activations.json.

For every case (a small transformers config of tests/reference/configs/act_*.json, a batch,
with or without full activation checkpointing of the decoder layers) the transformers model is
built from the config in bf16 with sdpa attention (the CPU), and one `model(input_ids,
labels=input_ids)` runs under `torch.autograd.graph.saved_tensors_hooks`.  Every tensor autograd
saves for backward is counted once by its storage (a view of a saved tensor counts its whole
storage once), and storages of parameters (a parameter's views included: a Linear saves its
weight, an expert loop a slice of the grouped weight) are left out.  The pack hook keeps the
tensor, so no storage dies and is reused at the same address while the forward runs.

Attribution: forward pre-hooks and hooks keep a stack of the modules running; a storage counts
for the innermost module running when it is first saved (the loss: the root, after lm_head;
rotary cos/sin: the first layer's attention, where they are first saved).

Full activation checkpointing wraps every decoder layer in torch's checkpoint_wrapper
(CheckpointImpl.NO_REENTRANT, as NeMo Automodel does).  Non-reentrant checkpointing saves the
layer's inputs through a custom function under the caller's hooks (counted, under the wrapper),
and saves nothing else of the layer: its own saved-tensor hooks keep only placeholders.  Its
recompute in backward runs the layer's forward again under `_recomputation_hook`, whose pack
hook is wrapped here to count, per layer, the storages the recompute keeps (parameters
excluded): `recompute` is the largest of them, the working set one layer's backward restores.

The loss: transformers' ForCausalLMLoss upcasts the logits to f32 and calls cross_entropy;
log_softmax saves its f32 output (tokens x vocab x 4 bytes); the upcast saves nothing, and the
bf16 logits are returned in the output, alive but not saved.  The script records the logits'
bytes as well (`logits_bytes`).

The model runs with use_cache=False, as training does: with a cache, the recompute would append
the layer's keys and values to it a second time.  DeepSeek-V3's config has a value head as wide
as the query head (qk_nope + qk_rope): with unequal widths sdpa leaves the flash kernel for the
math one (f32 scores of sequence x sequence), which no training run on GPUs uses.

Runs in well under a minute on two cores.
"""
import json
import os
import sys

import torch
import torch.utils.checkpoint as tuc
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
import transformers

import refdata

OUT = "tests/reference/data/activations.json"
CFG = "tests/reference/configs/"

# name, config, [(micro batch, seq_len), ...]
MODELS = [
    ("llama", "act_llama.json", [(1, 32), (2, 64), (4, 48)]),
    ("qwen3", "act_qwen3.json", [(1, 32), (2, 64)]),
    ("gemma3", "act_gemma3.json", [(1, 32), (2, 64)]),
    ("mistral", "act_mistral.json", [(1, 32), (2, 64)]),
    ("qwen3_moe", "act_qwen3_moe.json", [(1, 32), (2, 64)]),
    ("mixtral", "act_mixtral.json", [(1, 32), (2, 64)]),
    ("deepseek_v3", "act_deepseek_v3.json", [(1, 32), (2, 64)]),
]

DEBUG = os.environ.get("ACT_DEBUG")


def storage_key(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Counter:
    def __init__(self, model):
        self.params = set()
        for p in model.parameters():
            self.params.add(p.untyped_storage().data_ptr())
        for b in model.buffers():
            self.params.add(b.untyped_storage().data_ptr())
        self.stack = [""]
        self.seen = {}     # storage data_ptr -> (module, bytes)
        self.kept = []     # the packed tensors, alive until the count is done
        self.handles = []
        for name, m in model.named_modules():
            if type(m).__name__ == "CheckpointWrapper":
                self.handles.append(m.register_forward_pre_hook(self.keep_inputs(name), with_kwargs=True))
            self.handles.append(m.register_forward_pre_hook(self.push(name)))
            self.handles.append(m.register_forward_hook(self.pop(name)))

    def push(self, name):
        def hook(*_):
            self.stack.append(name)
        return hook

    def pop(self, name):
        def hook(*_):
            if self.stack[-1] == name:
                self.stack.pop()
        return hook

    def pack(self, t):
        ptr, nbytes = storage_key(t)
        if ptr not in self.params and ptr not in self.seen and nbytes > 0:
            self.seen[ptr] = (self.stack[-1], nbytes)
            if DEBUG:
                print("  save", self.stack[-1], tuple(t.shape), t.dtype, nbytes, file=sys.stderr)
        self.kept.append(t)
        return t

    def by_module(self):
        out = {}
        for module, nbytes in self.seen.values():
            out[module] = out.get(module, 0) + nbytes
        return out

    def keep_inputs(self, name):
        # a checkpointed layer's frame keeps its positional and keyword tensors for the recompute
        def hook(_module, args, kwargs):
            stack = list(args) + list(kwargs.values())
            while stack:
                x = stack.pop()
                if isinstance(x, (tuple, list)):
                    stack.extend(x)
                elif isinstance(x, torch.Tensor):
                    self.stack.append(name)
                    self.pack(x)
                    self.stack.pop()
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


# the recompute's count: each _recomputation_hook (one per checkpointed layer's backward)
# counts the storages its pack hook receives
RECOMPUTE = {"params": set(), "frames": []}
_recompute_init = tuc._recomputation_hook.__init__


def _counting_init(self, target_frame_ref, gid):
    _recompute_init(self, target_frame_ref, gid)
    inner = self.pack_hook
    seen = {}
    RECOMPUTE["frames"].append(seen)

    def pack_hook(x):
        ptr, nbytes = storage_key(x)
        if ptr not in RECOMPUTE["params"] and nbytes > 0 and ptr not in seen:
            seen[ptr] = nbytes
            if DEBUG:
                print("  recompute", tuple(x.shape), x.dtype, nbytes, file=sys.stderr)
        return inner(x)
    self.pack_hook = pack_hook


tuc._recomputation_hook.__init__ = _counting_init


def build(config):
    cfg = transformers.AutoConfig.from_pretrained(config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.train()
    return cfg, model


def run(config, batch, seq, ac):
    cfg, model = build(config)
    if ac:
        layers = model.model.layers
        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    counter = Counter(model)
    RECOMPUTE["params"] = counter.params
    RECOMPUTE["frames"] = []
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    counter.close()
    total = sum(n for _, n in counter.seen.values())
    logits = out.logits
    out.loss.backward()
    res = {"saved": total, "by_module": counter.by_module(),
           "logits_bytes": logits.numel() * logits.element_size(),
           "experts_implementation": getattr(cfg, "_experts_implementation", None)}
    if ac:
        res["recompute"] = [sum(f.values()) for f in RECOMPUTE["frames"]]
    return res


def main():
    only = set(sys.argv[1:])
    out = {"about": __doc__.split("\n\n")[0], "versions": refdata.versions(), "cases": []}
    for name, config, batches in MODELS:
        if only and name not in only:
            continue
        for batch, seq in batches:
            for ac in (False, True):
                r = run(CFG + config, batch, seq, ac)
                case = {"name": "%s_b%d_s%d%s" % (name, batch, seq, "_ac" if ac else ""), "config": CFG + config,
                        "micro_batch": batch, "seq_len": seq, "checkpointing": "full" if ac else "none"}
                case.update(r)
                out["cases"].append(case)
                print(case["name"], case["saved"], case.get("recompute", ""), file=sys.stderr)
    if not only:
        with open(OUT, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
