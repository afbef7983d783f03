"""The example's models, built from a config in code (no download): a Llama of transformers, and
a small decoder with Inkling2's FP32 modules ("islands", policies/inkling2/fp32_modules.lua):
residual queries before attention and the MLP, L2 clips of the queries and relative keys,
and a router with its e_score_correction_bias (frozen, as in Inkling2)."""
import torch
import torch.nn.functional as F
from torch import nn


def llama(vocab=67, hidden=24, layers=2, tied=True):
    """A tiny transformers LlamaForCausalLM (vocab 67: shards of uneven size)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=40, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=tied,
                      max_position_embeddings=128)
    cfg._attn_implementation = "eager"
    # training, no generation: without a KV cache (activation checkpointing's recompute of a
    # layer would grow it again)
    cfg.use_cache = False
    cfg.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(cfg)


class ResidualQuery(nn.Module):
    """A learned per-channel query of the residual stream (kept in FP32)."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden,), 0.5) + 0.01 * torch.randn(hidden))

    def forward(self, x):
        return x * self.weight.to(x.dtype)


class L2Clip(nn.Module):
    """Rows scaled to at most unit L2 norm, then by a learned scale (kept in FP32)."""

    def __init__(self, hidden):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden) + 0.01 * torch.randn(hidden))

    def forward(self, x):
        n = x.float().norm(dim=-1, keepdim=True).clamp(min=1.0)
        return (x.float() / n * self.scale).to(x.dtype)


class Router(nn.Module):
    """A router: logits over the branches plus a frozen correction bias (kept in FP32)."""

    def __init__(self, hidden, branches):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(branches, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(branches), requires_grad=False)

    def forward(self, x):
        return torch.softmax(F.linear(x.float(), self.weight) + self.e_score_correction_bias, dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_l2_clip = L2Clip(hidden)
        self.rel_l2_clip = L2Clip(hidden)

    def forward(self, x):
        # (an island's output is f32: the units around it compute in their own param dtype)
        x = x.to(self.q_proj.weight.dtype)
        q, k, v = self.q_l2_clip(self.q_proj(x)), self.rel_l2_clip(self.k_proj(x)), self.v_proj(x)
        att = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        t = x.shape[1]
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
        return self.o_proj(torch.softmax(att.float(), dim=-1).to(v.dtype) @ v)


class GroupedExperts(nn.Module):
    """Experts as two grouped tensors, Automodel's layout: gate_and_up_projs [E, H, 2I] and
    down_projs [E, I, H]."""

    def __init__(self, experts, hidden, inter):
        super().__init__()
        self.gate_and_up_projs = nn.Parameter(0.1 * torch.randn(experts, hidden, 2 * inter))
        self.down_projs = nn.Parameter(0.1 * torch.randn(experts, inter, hidden))

    def forward(self, x, weights):
        gate_and_up, down = whole(self.gate_and_up_projs), whole(self.down_projs)
        x = x.to(down.dtype)
        out = 0
        for e in range(down.shape[0]):
            gate, up = (x @ gate_and_up[e].to(x.dtype)).chunk(2, dim=-1)
            out = out + (F.silu(gate) * up) @ down[e].to(x.dtype) * weights[..., e:e + 1].to(x.dtype)
        return out


def whole(w):
    """Expert weights split over expert parallelism (a DTensor, Shard(0) over the ep ranks) as
    the whole tensor on every rank; in backward each rank's gradient is a partial sum
    (Partial()) that DTensor reduce-scatters back to the experts' owners.  (Every expert runs
    on every token here, so gathering the weights computes what dispatching the tokens to the
    experts' ranks would: the example's numerics, not Automodel's all-to-all.)"""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    if not isinstance(w, DTensor):
        return w
    n = w.device_mesh.ndim
    return w.redistribute(placements=[Replicate()] * n).to_local(grad_placements=[Partial()] * n)


class MoE(nn.Module):
    """Every expert on every token, weighted by the router (a dense mixture: small and exact)."""

    def __init__(self, hidden, inter, experts=2):
        super().__init__()
        self.gate = Router(hidden, experts)
        self.experts = GroupedExperts(experts, hidden, inter)

    def forward(self, x):
        return self.experts(x, self.gate(x))


class Layer(nn.Module):
    def __init__(self, hidden, inter, first):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        if not first:
            self.attn_query = ResidualQuery(hidden)
        self.self_attn = Attention(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp_query = ResidualQuery(hidden)
        self.mlp = MoE(hidden, inter)

    def forward(self, x):
        h = self.input_layernorm(x.to(self.input_layernorm.weight.dtype))
        if hasattr(self, "attn_query"):
            h = self.attn_query(h)
        x = x + self.self_attn(h).to(x.dtype)
        h = self.mlp_query(self.post_attention_layernorm(x.to(self.post_attention_layernorm.weight.dtype)))
        return x + self.mlp(h).to(x.dtype)


class IslandBody(nn.Module):
    def __init__(self, vocab, hidden, inter, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, inter, i == 0) for i in range(layers))
        self.output_query = ResidualQuery(hidden)
        self.norm = nn.RMSNorm(hidden)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.output_query(x)
        return self.norm(x.to(self.norm.weight.dtype))


class IslandLM(nn.Module):
    """A causal LM with Inkling2's FP32 island modules, by their names."""

    def __init__(self, vocab=67, hidden=24, inter=40, layers=2):
        super().__init__()
        self.model = IslandBody(vocab, hidden, inter, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids).to(self.lm_head.weight.dtype)).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return type("Out", (), {"logits": logits, "loss": loss})()


def build(name, tied=True):
    torch.manual_seed(0)
    if name == "llama":
        return llama(tied=tied)
    if name == "islands":
        return IslandLM()
    raise SystemExit("--model %s: expected llama or islands" % name)
