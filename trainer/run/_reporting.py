"""What a training run tells its user: a progress line per step, ``SAVE/metrics.jsonl``,
TensorBoard, the held-out rewards, the plot and the summary it returns."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv import ConfigError

if TYPE_CHECKING:
    from trainer.run._config import TrainConfig

__all__ = ["Reporter", "completed", "plot", "plot_run", "record", "say", "summary"]

#: Where a run records its result, once complete (``SAVE/summary.json``).
SUMMARY = "summary.json"


def say(message: str) -> None:
    """A line for the user, on stderr (stdout is for ``--json``)."""
    print(message, file=sys.stderr, flush=True)


class Reporter:
    """Per step: a progress bar (a line per step when stderr is no terminal), a JSONL line
    and TensorBoard scalars. ``start``: the step the run starts at (a resumed run's, after
    its checkpoint); the lines of the steps from it on, trained after the checkpoint by a
    run that stopped, are dropped -- ``batches.jsonl`` and ``metrics.jsonl`` describe the
    model's lineage."""

    def __init__(self, config: TrainConfig, save: Path | None, start: int) -> None:
        self.total = config.rollout.num_rollout
        self.metrics_file = None
        self.batches_file = None
        self.writer: Any = None
        self.bar: Any = None
        if save is not None:
            self.metrics_file = _lines_before(save / "metrics.jsonl", start)
            self.batches_file = _lines_before(save / "batches.jsonl", start)
            if config.logging.use_tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    say(
                        "no TensorBoard: the tensorboard package is not installed (agentenv[train])"
                    )
                else:
                    self.writer = SummaryWriter(str(save / "tensorboard"))
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="train", unit="step", file=sys.stderr)

    def __call__(self, m: dict[str, float]) -> None:
        step = int(m["step"])
        split = (
            f"rollout {m['time_rollout_s']:.1f}s  train {m['time_train_s']:.1f}s  "
            f"sync {m['time_sync_s']:.2f}s"
        )
        # All groups with equal rewards: every advantage is 0 and the step learns nothing;
        # without a KL or entropy term its optimizer steps were not run at all.
        no_signal = m.get("samples", 0.0) > 0 and m.get("rollout/zero_std_groups", 0.0) == 1.0
        flat = "  no signal: every group's rewards are equal" if no_signal else ""
        if m.get("train/skipped_no_gradient", 0.0) > 0:
            flat += f"  (training skipped: {int(m['train/skipped_no_gradient'])} step(s))"
        if self.bar is not None:
            self.bar.n = step + 1
            self.bar.set_postfix_str(f"reward {m['reward_mean']:.3f}  {split}{flat}")
        else:
            line = f"step {step + 1}/{self.total}  reward {m['reward_mean']:.3f}  {split}{flat}"
            say(line)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(m) + "\n")
            self.metrics_file.flush()
        if self.writer is not None:
            for name, value in m.items():
                if name != "step":
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def backend(self, backend: Any) -> None:
        """Say what makes the first steps slow (the compilation of the decoder layers)."""
        if getattr(backend, "compile", False):
            say(
                "compiling the decoder layers (torch.compile): the first steps take longer "
                "(about a minute for a 135M model); --no-compile skips it"
            )

    def held_out(self, when: str, reward: float | None, n_eval: int) -> None:
        """The held-out reward before or after training (once, when there is none)."""
        if reward is not None:
            say(f"held-out reward {when}: {reward}")
        elif when == "before":
            why = "--n-eval 0" if n_eval == 0 else "the environment has no test tasks"
            say(f"held-out reward: skipped ({why})")

    def batch(self, step: int, batch: Any) -> None:
        """What step ``step`` trained on, once acknowledged: a line of ``batches.jsonl``
        (the batch's id and its groups' ids and sample counts)."""
        if self.batches_file is None:
            return
        groups = [
            {"group": g.group_id, "role": g.role, "samples": len(g.samples)} for g in batch.groups
        ]
        line = {"step": step, "batch": batch.id, "groups": groups}
        self.batches_file.write(json.dumps(line) + "\n")
        self.batches_file.flush()

    def close(self) -> None:
        for thing in (self.bar, self.metrics_file, self.batches_file, self.writer):
            if thing is not None:
                thing.close()


def _lines_before(path: Path, start: int) -> Any:
    """``path`` open for appending, holding only its whole lines of steps before
    ``start`` (rewritten atomically; a line cut short by a kill is dropped too)."""
    kept: list[str] = []
    if start > 0 and path.exists():
        for line in path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if line.endswith("\n") and step < start:
                kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    return path.open("a")


def plot(
    config: TrainConfig, history: list[dict[str, float]], before: float | None, after: float | None
) -> str | None:
    """``SAVE/metrics.png`` (``None`` without ``--save``, steps or matplotlib)."""
    save = config.checkpoint.save
    if save is None or not history:
        return None
    try:
        path = str(
            plot_run(
                history, save / "metrics.png", title=f"GRPO on {config.data.env or 'prompt_data'}",
                eval_before=before, eval_after=after,
            )
        )  # fmt: skip
    except ImportError:
        say("no plot: matplotlib is not installed (agentenv[train])")
        return None
    say(f"plot: {path}")
    return path


def summary(
    config: TrainConfig,
    history: list[dict[str, float]],
    *,
    precision: str,
    eval_tasks: int,
    before: float | None,
    after: float | None,
    wall_s: float,
    plot: str | None,
) -> dict[str, Any]:
    """The run in one JSON object: rewards before and after, first and last, timings."""
    return {
        "env": config.data.env or "prompt_data",
        "steps": config.rollout.num_rollout,
        "schedule": config.rollout.schedule,
        "precision": precision,
        "eval_tasks": eval_tasks,
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_gain": None if before is None or after is None else after - before,
        "train_reward_first": history[0]["reward_mean"] if history else None,
        "train_reward_last": history[-1]["reward_mean"] if history else None,
        "time_rollout_s": round(sum(h["time_rollout_s"] for h in history), 1),
        "time_train_s": round(sum(h["time_train_s"] for h in history), 1),
        "time_sync_s": round(sum(h["time_sync_s"] for h in history), 2),
        "wall_s": round(wall_s, 1),
        "plot": plot,
    }


def record(config: TrainConfig, result: dict[str, Any]) -> None:
    """``result`` (the summary) into ``SAVE/summary.json``, atomically: the run is complete."""
    save = config.checkpoint.save
    if save is None:
        return
    tmp = save / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(save / SUMMARY)


def completed(config: TrainConfig) -> dict[str, Any] | None:
    """The recorded result of the run in ``--save`` if it is complete for ``config`` (it
    trained ``--num-rollout`` steps or more), after saying so; ``None``: there is work to
    do (no run there, or one that stopped early or is asked for more steps)."""
    save = config.checkpoint.save
    if save is None:
        return None
    path = save / SUMMARY
    try:
        result: dict[str, Any] = json.loads(path.read_text())
        steps = int(result["steps"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{str(path)!r} does not hold a run's result ({e}): remove it, or pass another "
            "--save for a new run"
        ) from None
    want = config.rollout.num_rollout
    if steps < want:
        if not (save / "checkpoint" / "checkpoint.json").is_file():
            raise ConfigError(
                f"the run in {str(save)!r} completed {steps} steps and kept no checkpoint "
                f"to continue from (--keep-checkpoints 0): it cannot train on to {want}; "
                "pass another --save for a new run"
            )
        return None
    before, after = result.get("eval_reward_before"), result.get("eval_reward_after")
    held_out = f"; held-out reward {before} -> {after}" if after is not None else ""
    say(
        f"the run in {save} is complete: {steps} steps trained{held_out}; nothing to do "
        f"(its result: {path}). A larger --num-rollout continues it; another --save "
        "starts a new run."
    )
    return result


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
