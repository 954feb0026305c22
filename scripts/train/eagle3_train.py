"""TTT loss and the teacher-free acceptance estimate for an EAGLE-3 drafter (docs/eagle3-drafter.md).

Loss of step k: soft cross-entropy against the target's distribution over the draft vocabulary
(its logits at the rows `used`, renormalised), at the positions whose target argmax is in the draft
vocabulary; total = Σ_k decay^k · loss_k (the reference's 0.8).
"""
from __future__ import annotations

import numpy as np
import torch

from eagle3_data import Sequence
from eagle3_model import Drafter


def collate(seqs: list[Sequence], t2d: np.ndarray, device="cpu") -> dict[str, torch.Tensor]:
    """Right-padded batch: ids [B, n], taps [B, n, nT·H], final [B, n, H], lens [B], in_vocab [B, n]."""
    B, n = len(seqs), max(len(s.ids) for s in seqs)
    ids = np.zeros((B, n), np.int64)
    taps = np.zeros((B, n, seqs[0].taps.shape[1]), np.float32)
    final = np.zeros((B, n, seqs[0].final.shape[1]), np.float32)
    in_vocab = np.zeros((B, n), bool)
    for r, s in enumerate(seqs):
        m = len(s.ids)
        ids[r, :m], taps[r, :m], final[r, :m], in_vocab[r, :m] = s.ids, s.taps, s.final, t2d[s.argmax]
    out = dict(ids=ids, taps=taps, final=final, in_vocab=in_vocab, lens=np.array([len(s.ids) for s in seqs]))
    return {k: torch.from_numpy(v).to(device) for k, v in out.items()}


def ttt_loss(drafter: Drafter, batch: dict, head: torch.Tensor, steps: int, decay: float = 0.8):
    """head [Vd, H]: the target's lm_head rows of the draft vocabulary (frozen). Returns
    (total loss, per-step losses, per-step top-1 agreement with the target), floats for the last two."""
    ids, lens = batch["ids"], batch["lens"]
    logits = drafter.ttt(batch["taps"], ids, steps)
    with torch.no_grad():
        p = torch.softmax(batch["final"] @ head.T, -1)                 # [B, n, Vd]
    n = ids.shape[1]
    t = torch.arange(n - 1, device=ids.device)
    total, losses, accs = 0.0, [], []
    for k, lg in enumerate(logits):
        at = (t + 1 + k).clamp(max=n - 1)                              # the position whose next token step k drafts
        mask = ((t + 1 + k)[None] < lens[:, None]) & batch["in_vocab"][:, at]
        pk = p[:, at]
        ce = -(pk * torch.log_softmax(lg, -1)).sum(-1)
        denom = mask.sum().clamp(min=1)
        loss = (ce * mask).sum() / denom
        total = total + decay ** k * loss
        losses.append(loss.item())
        accs.append((((lg.argmax(-1) == pk.argmax(-1)) & mask).sum() / denom).item())
    return total, losses, accs


@torch.no_grad()
def chain_acceptance(drafter: Drafter, seqs: list[Sequence], used: np.ndarray, t2d: np.ndarray, depth: int = 6,
                     batch: int = 8, device="cpu") -> dict:
    """Greedy chain drafting of `depth` tokens against the target's greedy continuation. While the
    drafts match they ARE the ground-truth tokens, so the teacher-forced TTT unroll gives exactly a
    free-running chain's accepted count (its leading matches). Two averages: over every generated
    position (per-depth rates), and over rounds walked as the runtime does (root -> accept a drafts
    + the bonus -> next root a+1 further), which is what acceptance_length means there."""
    drafter.eval()
    used_t = torch.from_numpy(used).to(device)
    per_position, rounds, accepted_in_rounds = [], 0, 0
    for s in range(0, len(seqs), batch):
        group = seqs[s: s + batch]
        b = collate(group, t2d, device)
        drafts = torch.stack([used_t[lg.argmax(-1)] for lg in drafter.ttt(b["taps"], b["ids"], depth)])  # [D, B, T]
        drafts = drafts.cpu().numpy()
        for r, q in enumerate(group):
            n = len(q.ids)

            def accepted(t):  # root q.ids[t+1]; drafts of row t predict q.ids[t+2 ...]
                truth = q.ids[t + 2: t + 2 + depth]
                return int(np.cumprod(drafts[: len(truth), r, t] == truth).sum())
            first = max(q.prompt_len - 1, 0)                      # the first root is the first generated token
            per_position += [accepted(t) for t in range(first, n - 1 - depth)]
            t = first
            while t + 2 <= n - 1:
                a = accepted(t)
                rounds, accepted_in_rounds, t = rounds + 1, accepted_in_rounds + a, t + a + 1
    drafter.train()
    a = np.array(per_position)
    if not rounds:
        return {"positions": 0, "rounds": 0}
    reach = [float((a > k).mean()) if len(a) else 0.0 for k in range(depth)]
    return {"depth": depth, "rounds": rounds, "mean_acceptance_length": (accepted_in_rounds + rounds) / rounds,
            "positions": int(len(a)), "accept_rate_at_depth": reach,
            "conditional_accept": [reach[0]] + [reach[k] / reach[k - 1] if reach[k - 1] else 0.0
                                                for k in range(1, depth)],
            "per_position_mean_acceptance_length": float(1 + a.mean()) if len(a) else None}
