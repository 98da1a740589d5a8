"""The end-of-run plot: reward and the key training metrics per rollout step (PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_run"]

PANELS = (
    ("reward_mean", "rollout reward (mean)"),
    ("train/rollout_train_logprob_abs_diff", "|rollout - trainer log-prob|"),
    ("train/entropy", "entropy (per token)"),
    ("train/grad_norm", "gradient norm"),
)


def plot_run(
    history: Sequence[dict[str, float]],
    path: str | Path,
    *,
    title: str = "",
    eval_before: float | None = None,
    eval_after: float | None = None,
) -> Path:
    """Write a 2×2 PNG of ``history`` to ``path`` (needs matplotlib: the ``train`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), constrained_layout=True)
    steps = [int(h["step"]) + 1 for h in history]
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        values = [h.get(key, float("nan")) for h in history]
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(label)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        if key == "reward_mean" and eval_before is not None and eval_after is not None:
            ax.axhline(eval_before, color="grey", linestyle="--", label="held-out before")
            ax.axhline(eval_after, color="green", linestyle="--", label="held-out after")
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
