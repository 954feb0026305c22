"""Training curves of the embedded model and its drafter, from the two train_log.json files, as one
PNG: the target's training and held-out loss, the drafter's TTT loss per unrolled step, and the
drafter's top-1 agreement with the target per unrolled step.

    python scripts/train/plot_training.py TARGET_DIR DRAFTER_DIR OUT.png      (needs the plot extra)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def smooth(y, k=25):
    y = np.asarray(y, dtype=float)
    if len(y) < k:
        return y
    return np.convolve(y, np.ones(k) / k, mode="valid")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("drafter", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = json.loads((args.target / "train_log.json").read_text())
    d = json.loads((args.drafter / "train_log.json").read_text())
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    ax[0].plot(t["steps"], t["loss"], alpha=0.3, label="train (batch)")
    ax[0].plot(t["steps"][len(t["steps"]) - len(smooth(t["loss"], 5)):], smooth(t["loss"], 5), label="train (smoothed)")
    ax[0].plot(t["val_steps"], t["val_loss"], "o-", label="held-out (16 windows)")
    ax[0].set(title=f"target: {t['params'] / 1e6:.1f}M params, held-out ppl {t['held_out_perplexity']:.1f}",
              xlabel="step", ylabel="cross-entropy (nats)")
    ax[0].legend()
    per_step = np.asarray(d["loss_per_ttt_step"])
    top1 = np.asarray(d["top1_per_ttt_step"])
    steps = np.asarray(d["steps"])
    for k in range(per_step.shape[1]):
        s = smooth(per_step[:, k])
        ax[1].plot(steps[len(steps) - len(s):], s, label=f"TTT step {k}")
        s = smooth(top1[:, k])
        ax[2].plot(steps[len(steps) - len(s):], s, label=f"TTT step {k}")
    ax[1].set(title="drafter: soft cross-entropy per unrolled step", xlabel="step", ylabel="nats")
    rt = d.get("eval_runtime", {})
    ax[2].set(title=f"drafter: top-1 agreement; held-out acceptance length {rt.get('mean_acceptance_length', 0):.2f}",
              xlabel="step", ylabel="fraction")
    ax[1].legend(fontsize=7)
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
