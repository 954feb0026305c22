"""A Qwen3.5 MTP head in torch for training (docs/mtp-drafter.md; the same computation as
export/drafters/mtp.py's graph and export/drafters/mtp_reference.py), with a training-time-test unroll.

Parameters carry the released `mtp.*` names (save_mtp writes them as such); the embedding and
lm_head are the target's, frozen and not saved.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "mtp."


class Norm1p(nn.Module):
    """Qwen3.5's zero-centred x̂·(1+w) (kernels/norms.rmsnorm_1p_ref)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def partial_rope(x, cos, sin, rd: int):
    """x [B, heads, T, hd]; cos/sin [T, rd] (kernels/rope.rope_tables): the first rd dims rotate half."""
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)


class MtpHead(nn.Module):
    def __init__(self, cfg, embed: torch.Tensor, head: torch.Tensor, window: int | None = None):
        """cfg: the target's hybrid_npu ModelConfig (export/checkpoint.read_checkpoint(...).config).
        window: the stable rows a query reads, as the runtime's windowed drafter (runtime/drafters/mtp.py, the
        DRAFT_WINDOW of runtime/drafters/draft_tree.py); None: all of them."""
        super().__init__()
        self.window = window
        H, I = cfg.hidden_size, cfg.intermediate_size
        nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.rd = cfg.rotary_dim
        self.theta = float(cfg.rope_theta)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = Norm1p(H, eps), Norm1p(H, eps), Norm1p(H, eps)
        layer = nn.Module()
        layer.input_layernorm, layer.post_attention_layernorm = Norm1p(H, eps), Norm1p(H, eps)
        attn = nn.Module()
        attn.q_proj, attn.k_proj = nn.Linear(H, 2 * nh * hd, bias=False), nn.Linear(H, nkv * hd, bias=False)
        attn.v_proj, attn.o_proj = nn.Linear(H, nkv * hd, bias=False), nn.Linear(nh * hd, H, bias=False)
        attn.q_norm, attn.k_norm = Norm1p(hd, eps), Norm1p(hd, eps)
        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        mlp.down_proj = nn.Linear(I, H, bias=False)
        layer.self_attn, layer.mlp = attn, mlp
        self.layers = nn.ModuleList([layer])
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("head", head.detach().float(), persistent=False)

    def init_from_target(self, text_model) -> None:
        """Start from the target's last full-attention layer and final norm; fc reads the hidden half."""
        src = [m for m in text_model.layers if hasattr(m, "self_attn")][-1]
        own = self.layers[0]
        with torch.no_grad():
            for name, p in own.named_parameters():
                p.copy_(dict(src.named_parameters())[name])
            self.norm.weight.copy_(text_model.norm.weight)
            H = self.fc.weight.shape[0]
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.weight[:, :H] = torch.randn(H, H) * (0.1 / math.sqrt(H))

    def _rope(self, positions, device):
        from hybrid_npu.kernels.rope import rope_tables

        cos, sin = rope_tables(np.asarray(positions), self.rd, self.theta)
        return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)

    def ttt(self, hidden, ids, steps: int) -> list[torch.Tensor]:
        """hidden [B, n, H] (the target's post-norm hidden), ids [B, n] -> logits of each step, [B, n-1, V].

        Row t of step k pairs token ids[t+1+k] with the hidden of step k-1 (k = 0: the target's at t),
        sits at MTP position t+k and predicts ids[t+2+k]. It attends to the step-0 rows 0..t (the
        stable K/V the runtime keeps; with a window, the last of them the runtime reads) and to its
        own chain's rows of steps 1..k (the tree rows)."""
        B, n, _ = hidden.shape
        T = n - 1
        layer = self.layers[0]
        a = layer.self_attn
        h, out, chain = hidden[:, :T], [], []
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        rep, scale = self.nh // self.nkv, 1.0 / math.sqrt(self.hd)
        for k in range(steps):
            tok = F.pad(ids[:, 1 + k:], (0, k))
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed[tok]), self.pre_fc_norm_hidden(h)], -1))
            y = layer.input_layernorm(x)
            qg = a.q_proj(y).view(B, T, self.nh, 2 * self.hd)
            q, gate = qg[..., : self.hd], qg[..., self.hd:].reshape(B, T, self.nh * self.hd)
            cos, sin = self._rope(np.arange(T) + k, ids.device)
            q = partial_rope(a.q_norm(q).transpose(1, 2), cos, sin, self.rd)
            kk = partial_rope(a.k_norm(a.k_proj(y).view(B, T, self.nkv, self.hd)).transpose(1, 2), cos, sin, self.rd)
            v = a.v_proj(y).view(B, T, self.nkv, self.hd).transpose(1, 2)
            kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)   # query head i: KV head i // rep
            if k == 0:
                k0, v0 = kk, v
                own = []
            else:
                chain.append((kk, v))
                own = chain
            seen = causal
            if self.window:  # as the runtime reads: an observed row sees the window before it and itself
                # (keys t - window .. t), a chained step the last `window` stable rows (t - window + 1 .. t)
                seen = causal.triu(-self.window if k == 0 else 1 - self.window)
            s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
            diag = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in own]
            p = torch.softmax(torch.cat([s0, *diag], -1), -1)
            o = p[..., :T] @ v0
            for j, (_, vj) in enumerate(own):
                o = o + p[..., T + j: T + j + 1] * vj
            o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd) * torch.sigmoid(gate)
            x = x + a.o_proj(o)
            m = layer.post_attention_layernorm(x)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(m)) * layer.mlp.up_proj(m))
            h = self.norm(x)                      # mtp.norm: the logits' input and the next step's hidden
            out.append(h @ self.head.T)
        return out


def save_mtp(head: MtpHead, out_dir, meta: dict) -> Path:
    """out_dir/model.safetensors with the `mtp.*` tensors (what export-hybrid --mtp / --drafter mtp read)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PREFIX + k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={k: str(v) for k, v in meta.items()})
    return out


def load_mtp(head: MtpHead, src_dir) -> None:
    """The `mtp.*` tensors save_mtp wrote into `head` (a continued run: train_mtp.py --init)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(src_dir) / "model.safetensors"))
    head.load_state_dict({k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)})
