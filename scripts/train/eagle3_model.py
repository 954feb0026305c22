"""The EAGLE-3 drafter in torch, for training-time-test (TTT) training, saved in the official /
SpecForge layout that export/drafters/eagle3.py reads (docs/eagle3-drafter.md).

One Llama decoder layer whose attention input is concat(input_layernorm(embed(token)),
hidden_norm(feature)), 2h wide; plain x̂·w RMSNorm, full RoPE, GQA, SwiGLU; `fc` fuses the target's
taps (3H -> h). The token embedding is the target's, frozen and not saved (official checkpoints
omit it; our exporter then copies the target's in, which needs h == H).

TTT (docs/eagle3-drafter.md, the reference's cnets.py and SpecForge): step 0 feeds fc(taps), step k > 0
the drafter's own pre-norm output of step k-1; tokens are the ground truth shifted by k+1. A query
of step k at position t sees the step-0 keys at positions <= t plus the keys of steps 1..k at the
same t (the tree mask at inference), at RoPE position t + k.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybrid_npu.errors import UserError


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int          # h (= target H: the embedding is shared)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int           # target V
    draft_vocab_size: int     # Vd
    target_hidden_size: int   # H
    n_taps: int
    rms_norm_eps: float
    rope_theta: float


def shape_for_target(cfg, draft_vocab: int, n_taps: int = 3) -> DraftShape:
    """Mirror the target's attention and MLP sizes (SpecForge's Qwen drafters do the same)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    return DraftShape(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab,
        target_hidden_size=cfg.hidden_size, n_taps=n_taps, rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))


class RMSNorm(nn.Module):
    """Llama's x̂·w (not Qwen3.5's zero-centred (1+w)); what kernels/norms.emit_rmsnorm computes."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, theta: float):
    """Rotate-half RoPE over the whole head; x [B, heads, T, d], pos [T] (kernels/rope.py's tables)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class Attention(nn.Module):
    def __init__(self, s: DraftShape, window: int | None = None):
        super().__init__()
        h, nh, nkv, hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.window = window  # step-0 keys a query sees (the runtime's DRAFT_WINDOW); None: all
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, s.rope_theta

    def forward(self, x, pos, cache: list):
        """x [B, T, 2h] of TTT step len(cache); cache: earlier steps' (k, v), [B, nKV, T, hd] each,
        appended to. Returns [B, T, h]."""
        B, T, _ = x.shape
        q = rope(self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2), pos, self.theta)
        k = rope(self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2), pos, self.theta)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cache.append((k, v))
        rep = self.nh // self.nkv  # query head i reads KV head i // rep (the runtime's grouping)
        ks = [c[0].repeat_interleave(rep, 1) for c in cache]
        vs = [c[1].repeat_interleave(rep, 1) for c in cache]
        scale = 1.0 / math.sqrt(self.hd)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if self.window:  # as runtime/drafters/draft_tree.py reads: an observed row sees the window before it and
            # itself (keys t - window .. t), a draft level the last `window` stable rows (t - window + 1 .. t)
            causal = causal.triu(-self.window if len(cache) == 1 else 1 - self.window)
        s0 = (q @ ks[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))   # [B, nH, T, T]
        diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in ks[1:]]                 # [B, nH, T, 1] each
        p = torch.softmax(torch.cat([s0, *diag], -1), -1)
        out = p[..., :T] @ vs[0]
        for j, vj in enumerate(vs[1:]):
            out = out + p[..., T + j: T + j + 1] * vj
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: DraftShape, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, window)
        self.mlp = MLP(s)

    def forward(self, e, f, pos, cache):
        """e: token embeddings, f: features, [B, T, h] -> pre-norm x [B, T, h] (docs/eagle3-drafter.md)."""
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(f)], -1)   # embedding first
        x = self.self_attn(x, pos, cache) + f                                 # residual: the raw feature
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, s: DraftShape, embed: torch.Tensor, window: int | None = None):
        super().__init__()
        self.shape = s
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)  # frozen, not saved
        self.fc = nn.Linear(s.n_taps * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s, window)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    def ttt(self, taps, ids, steps: int) -> list[torch.Tensor]:
        """taps [B, n, nT·H], ids [B, n] -> draft logits of each step, [B, n-1, Vd] each.
        Row t of step k pairs token ids[t+1+k] (0 past the end) with its feature and predicts ids[t+2+k]."""
        B, n = ids.shape
        T = n - 1
        f, cache, out = self.fc(taps[:, :T]), [], []
        pos = torch.arange(T, device=ids.device)
        for k in range(steps):
            tok = F.pad(ids[:, 1 + k:], (0, k))                  # ground-truth tokens shifted by k+1
            x = self.midlayer(self.embed[tok], f, pos + k, cache)
            out.append(self.lm_head(self.norm(x)))
            f = x                                                # own pre-norm output feeds the next step
        return out


def init_from_target(drafter: Drafter, target, used: torch.Tensor) -> None:
    """lm_head = the target's head rows of the draft vocabulary, norm = the target's effective final
    norm weight: a drafter whose pre-norm x looks like the target's last residual stream then already
    has the target's logits. (Norm on a ones row = its effective weight, zero-centred or not.)"""
    tn = target.model.norm
    with torch.no_grad():
        eps = getattr(tn, "eps", getattr(tn, "variance_epsilon", 1e-6))
        ones = torch.ones(1, drafter.shape.hidden_size, device=used.device)
        drafter.norm.weight.copy_(tn(ones)[0].float() * math.sqrt(1.0 + eps))
        drafter.lm_head.weight.copy_(target.lm_head.weight[used].float())


def save_checkpoint(drafter: Drafter, used: np.ndarray, target_taps, out_dir) -> Path:
    """Official/SpecForge layout (docs/eagle3-drafter.md): config.json + model.safetensors with midlayer.*,
    fc, norm, lm_head, d2t (target_id = i + d2t[i]), t2d. The taps are written as SpecForge's
    eagle_config ids, "output of layer k" = the stream entering layer k+1; export/drafters/eagle3.py reads
    them back to exactly `target_taps` (the layers entering which the features were recorded)."""
    from safetensors.torch import save_file

    s, out = drafter.shape, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "num_hidden_layers": 1, "max_position_embeddings": 65536, "tie_word_embeddings": False,
           "torch_dtype": "float32", **asdict(s),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(t) - 1 for t in target_taps]}}
    del cfg["n_taps"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    used = np.asarray(used, np.int64)
    t2d = np.zeros(s.vocab_size, bool)
    t2d[used] = True
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in drafter.state_dict().items()}
    tensors["d2t"] = torch.from_numpy(used - np.arange(len(used)))
    tensors["t2d"] = torch.from_numpy(t2d)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def load_checkpoint(drafter: Drafter, used: np.ndarray, path) -> None:
    """Continue from a checkpoint save_checkpoint wrote: its weights into `drafter`. Its draft
    vocabulary must be `used` (the same target and corpus give the same one)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    d2t = tensors.pop("d2t").numpy()
    tensors.pop("t2d", None)
    if len(d2t) != len(used) or not np.array_equal(d2t + np.arange(len(d2t)), np.asarray(used)):
        raise UserError(f"{path}: its draft vocabulary differs from this run's; train it from the start")
    drafter.load_state_dict(tensors, strict=True)
