"""``agentenv bench grpo --vs trl``: GRPO training end to end, agentenv against TRL's
``GRPOTrainer``, on one workload.

Both sides train the same model on the same ``--prompts`` prompts per step from
``ArithmeticEnv(max_operand=9)``'s train split, in the same order (no shuffling),
``--samples`` completions each, ``--max-new-tokens`` new tokens at temperature 1, one
optimizer step per rollout (Adam, betas (0.9, 0.98), a constant ``--lr``, no KL term), for
``--steps`` steps, and score completions with the environment's own rubric. Each step
records a hash of its prompts on each side; the run fails unless they are equal.

``agentenv``: what ``agentenv train`` runs (its flags, ``--no-rollout-shuffle``, on CUDA
``--rollout-max-running 512 --max-tokens-per-gpu 16384``; more with ``--agentenv-args``).
``trl``: ``GRPOTrainer`` with the prompts as chat messages (the same chat template), an fp32
model with bf16 autocast on CUDA (TRL's default for an fp32 checkpoint), ``transformers``
generation, no saving, no evaluation. Each side runs in a subprocess of its own.

Reported per side: the steady step (mean of steps 2..N) and its generation / train split,
generated and trained tokens per second, peak GPU memory (``torch.cuda`` reserved and, where
``nvidia-smi`` sees the process, its reading) and the reward per step; then the ratios
agentenv / TRL. ``--quick``: a tiny random Llama with SmolLM2's tokenizer, 2 steps of 4
prompts x 4 samples of 8 tokens, on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv import Episode, Sample, Task
from benchmarks import bench_parser
from environments.arithmetic import ArithmeticEnv

__all__ = ["RecordedArithmeticEnv", "add_parser", "prompt_hash"]

QUICK = "smoke test: tiny random model, CPU, 2 steps of 4 prompts x 4 samples, 8 tokens"

PEERS = ("trl",)
MODULE = "benchmarks.grpo"  # also when run as __main__: the recorded prompts live here
MAX_OPERAND = 9
GIB = 2**30


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "grpo", help="GRPO training end to end (agentenv vs TRL's GRPOTrainer)",
        doc=__doc__, quick=QUICK,
    )  # fmt: skip
    _add_arguments(parser)
    parser.set_defaults(handler=_main)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vs", default="trl", metavar="PEER", help="the peer: trl (default)")
    parser.add_argument(
        "--model", metavar="MODEL", help="model name or HF directory (default: smollm2-135m)"
    )
    parser.add_argument("--device", metavar="DEVICE", help="cuda (default) or cpu")
    parser.add_argument("--steps", type=int, metavar="N", help="training steps (default 8)")
    parser.add_argument("--prompts", type=int, metavar="N", help="prompts per step (default 64)")
    parser.add_argument(
        "--samples", type=int, metavar="N", help="completions per prompt (default 8)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="tokens per completion (default 48)"
    )
    parser.add_argument("--lr", type=float, metavar="LR", default=5e-6, help="learning rate")
    parser.add_argument("--seed", type=int, metavar="N", default=0, help="seed of both sides")
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        metavar="N",
        help="TRL's per_device_train_batch_size (default 64, at most a step's completions); "
        "gradient accumulation makes up one optimizer step per rollout",
    )
    parser.add_argument(
        "--trl-activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's activation checkpointing (default on, as GRPOConfig has it)",
    )
    parser.add_argument(
        "--agentenv-args",
        default="",
        metavar="FLAGS",
        help="more agentenv train flags for the agentenv side (they win), e.g. "
        "--agentenv-args='--rollout-max-running 256'",
    )
    parser.add_argument(
        "--sides",
        default="agentenv,trl",
        metavar="LIST",
        help="which sides to run (default both; one alone gives no ratios)",
    )
    parser.add_argument(
        "--tokenizer-dir", metavar="DIR", help="--quick: where tokenizer.json is (smollm2-135m's)"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What both sides run (written to a file for each side's subprocess)."""

    model: str
    device: str
    steps: int
    prompts: int
    samples: int
    max_new_tokens: int
    lr: float
    seed: int
    trl_micro_batch: int
    trl_activation_checkpointing: bool = True  # TRL's GRPOConfig default
    agentenv_args: tuple[str, ...] = ()

    @property
    def completions_per_step(self) -> int:
        return self.prompts * self.samples


def _check_step(side: str, step: int, prompts: Sequence[str], w: Workload) -> None:
    """A step played ``--prompts`` prompts, ``--samples`` times each (the task list may
    hold one prompt text under several task ids: such a text is played a multiple of
    ``--samples`` times)."""
    counts = collections.Counter(prompts)
    if len(prompts) != w.completions_per_step or any(c % w.samples for c in counts.values()):
        raise RuntimeError(
            f"{side} step {step + 1} played {len(prompts)} episodes of {len(counts)} prompt "
            f"texts, expected {w.prompts} prompts x {w.samples}"
        )


def prompt_hash(prompts: Sequence[str]) -> str:
    """A step's prompts as a short hash: the prompt texts with their counts, sorted (the
    order in which a step's episodes start differs between engines; the multiset may not)."""
    text = "\n".join(sorted(prompts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the agentenv side -------------------------------------------------------------------

_PLAYED: list[str] = []  # the prompt of every episode the agentenv side started, in order


class RecordedArithmeticEnv(ArithmeticEnv):
    """``ArithmeticEnv`` that records the prompt of every episode it plays (the check that
    both sides trained on the same prompts)."""

    name = "arithmetic"

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        _PLAYED.append(str(task.prompt))
        return await super().rollout(task, episode)


def _agentenv_argv(w: Workload, save: str) -> list[str]:
    """The ``agentenv train`` flags of this workload (``--agentenv-args`` last: they win).
    The run writes to ``save`` for its per-step metrics (``metrics.jsonl``); its one
    checkpoint comes after the last step's timings."""
    argv = [
        "--env", f"{MODULE}:RecordedArithmeticEnv",
        "--env-args", json.dumps({"max_operand": MAX_OPERAND}),
        "--hf-checkpoint", w.model,
        "--device", w.device,
        "--num-rollout", str(w.steps),
        "--rollout-batch-size", str(w.prompts),
        "--n-samples-per-prompt", str(w.samples),
        "--num-steps-per-rollout", "1",
        "--rollout-max-response-len", str(w.max_new_tokens),
        "--rollout-temperature", "1.0",
        "--lr", repr(w.lr),
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.98",
        "--rollout-seed", str(w.seed),
        "--no-rollout-shuffle",
        "--n-eval", "0",
        "--save", save,
        "--save-interval", str(w.steps),
        "--no-use-tensorboard",
    ]  # fmt: skip
    if w.device.startswith("cuda"):
        argv += ["--rollout-max-running", "512", "--max-tokens-per-gpu", "16384"]
    return argv + list(w.agentenv_args)


def agentenv_config(w: Workload, save: str) -> Any:
    """The :class:`~trainer.TrainConfig` that ``agentenv train`` builds from
    :func:`_agentenv_argv` (its own parser, so every flag it has is accepted)."""
    from trainer import config_from_flags

    return config_from_flags(_agentenv_argv(w, save))


def _run_agentenv(w: Workload) -> dict[str, Any]:
    import torch

    from trainer import train

    cuda = w.device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-run-") as tmp:
        config = agentenv_config(w, str(Path(tmp, "run")))
        started = time.perf_counter()
        train(config)
        wall = time.perf_counter() - started
        save = config.checkpoint.save
        assert save is not None
        lines = (save / "metrics.jsonl").read_text().splitlines()
        history: list[dict[str, float]] = [json.loads(line) for line in lines if line.strip()]
    n = w.completions_per_step
    if len(history) != w.steps or len(_PLAYED) != w.steps * n:
        raise RuntimeError(
            f"the agentenv side ran {len(history)} steps and played {len(_PLAYED)} episodes, "
            f"expected {w.steps} steps x {n}"
        )
    steps = []
    for i, m in enumerate(history):
        _check_step("agentenv", i, _PLAYED[i * n : (i + 1) * n], w)
        train_s = m.get("time_train_s", 0.0)
        steps.append(
            {
                "step_s": m["time_step_s"],
                "generation_s": m["time_rollout_s"],
                "train_s": train_s,
                "generated_tokens": m.get("rollout/completion_tokens", 0.0),
                "trained_tokens": m.get("perf/train_tokens_per_s", 0.0) * train_s,
                # A step whose groups all had equal rewards carries no gradient: the loop
                # does not train it (TRL does), so its step time holds no training.
                "skipped": m.get("train/skipped_no_gradient", 0.0) > 0,
                "reward_mean": m["reward_mean"],
                "prompt_hash": prompt_hash(_PLAYED[i * n : (i + 1) * n]),
                # The step's own memory readings, where the loop reports them.
                **{k: v for k, v in m.items() if "memory" in k},
            }
        )
    out: dict[str, Any] = {
        "steps": steps,
        "wall_s": wall,
        "command": "agentenv train " + shlex.join(_agentenv_argv(w, "RUN")),
        "metrics": history,
    }
    if cuda:
        out["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


# -- the TRL side ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _TextState:
    """What a reward function sees of an episode, from a completion's text alone."""

    task: Any
    completion: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": self.completion}]

    @property
    def turns(self) -> int:
        return 1

    @property
    def info(self) -> dict[str, Any]:
        return {}


def rubric_rewards(env: ArithmeticEnv, tasks: Sequence[Any], texts: Sequence[str]) -> list[float]:
    """``env``'s rubric on each ``(task, completion text)``: the agentenv side's reward."""
    import anyio

    async def score() -> list[float]:
        out = []
        for task, text in zip(tasks, texts, strict=True):
            total, _ = await env.rubric.score(task, _TextState(task, text))  # type: ignore[arg-type]
            out.append(float(total))
        return out

    return anyio.run(score)


def _text(completion: Any) -> str:
    """A TRL completion (messages for a conversational dataset, else text) as text."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def trl_config_kwargs(w: Workload, output_dir: str) -> dict[str, Any]:
    """``trl.GRPOConfig``'s arguments: one generation of ``prompts x samples`` completions
    and one optimizer step per rollout (gradient accumulation over micro-batches)."""
    n = w.completions_per_step
    micro = w.trl_micro_batch
    if micro < 1 or n % micro:
        raise ValueError(
            f"--trl-micro-batch {micro} must divide the step's {n} completions "
            f"(--prompts x --samples)"
        )
    cuda = w.device.startswith("cuda")
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,  # steps_per_generation follows it
        num_generations=w.samples,
        max_completion_length=w.max_new_tokens,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=w.lr,
        adam_beta1=0.9,
        adam_beta2=0.98,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=w.steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=w.seed,
        bf16=cuda,  # an fp32 model under bf16 autocast
        use_cpu=not cuda,
        model_init_kwargs={"dtype": "float32"},
        activation_checkpointing=w.trl_activation_checkpointing,
    )


def _run_trl(w: Workload) -> dict[str, Any]:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    cuda = w.device.startswith("cuda")
    env = ArithmeticEnv(max_operand=MAX_OPERAND)
    tasks = list(env.tasks("train"))
    # The agentenv side takes the train split in order, from the start again after a pass.
    order = [tasks[i % len(tasks)] for i in range(w.steps * w.prompts)]
    by_id = {t.id: t for t in tasks}
    dataset = datasets.Dataset.from_list(
        [{"prompt": env.prompt(t), "task_id": t.id} for t in order]
    )

    def arithmetic_reward(
        completions: list[Any], task_id: list[str], **_: Any
    ) -> list[float | None]:
        texts = [_text(c) for c in completions]
        return list(rubric_rewards(env, [by_id[i] for i in task_id], texts))

    played: dict[int, list[str]] = {}
    generation_s: dict[int, float] = {}
    logged: list[dict[str, float]] = []
    ends: list[float] = []
    memory: list[float] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            sync()
            ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            sync()
            ends.append(time.perf_counter())
            memory.append(torch.cuda.max_memory_reserved() / GIB if cuda else 0.0)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "reward" in logs:
                logged.append({k: float(v) for k, v in logs.items() if _number(v)})

    with tempfile.TemporaryDirectory(prefix="agentenv-bench-trl-") as tmp:
        trainer: Any = GRPOTrainer(
            model=w.model,
            reward_funcs=arithmetic_reward,
            args=GRPOConfig(**_known_fields(GRPOConfig, trl_config_kwargs(w, tmp))),
            train_dataset=dataset,
            callbacks=[Clock()],
        )
        score = trainer._generate_and_score_completions
        generate = trainer._generate

        def recorded_score(inputs: list[dict[str, Any]]) -> Any:
            step = int(trainer.state.global_step)
            played.setdefault(step, []).extend(str(x["prompt"][-1]["content"]) for x in inputs)
            return score(inputs)

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            sync()
            t = time.perf_counter()
            result = generate(*args, **kwargs)
            sync()
            step = int(trainer.state.global_step)
            generation_s[step] = generation_s.get(step, 0.0) + time.perf_counter() - t
            return result

        trainer._generate_and_score_completions = recorded_score
        trainer._generate = timed_generate
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    if len(logged) != w.steps or len(ends) != w.steps + 1:
        raise RuntimeError(
            f"TRL ran {len(ends) - 1} steps with {len(logged)} logged, expected {w.steps}"
        )
    n = w.completions_per_step
    steps = []
    seen = 0.0
    for i, entry in enumerate(logged):
        _check_step("trl", i, played.get(i, []), w)
        step_s = ends[i + 1] - ends[i]
        gen = generation_s.get(i, 0.0)
        total = entry.get("num_tokens", seen)  # prompt + completion tokens seen so far
        steps.append(
            {
                "step_s": step_s,
                "generation_s": gen,
                "train_s": step_s - gen,
                "generated_tokens": entry.get("completions/mean_length", 0.0) * n,
                "trained_tokens": total - seen,
                "skipped": False,
                "reward_mean": entry["reward"],
                "prompt_hash": prompt_hash(played.get(i, [])),
                "peak_memory_reserved_gib": memory[i],
            }
        )
        seen = total
    out: dict[str, Any] = {"steps": steps, "wall_s": wall, "metrics": logged}
    if cuda:
        out["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def _known_fields(config_class: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for this transformers version: before ``activation_checkpointing`` it was
    called ``gradient_checkpointing``."""
    names = {f.name for f in dataclasses.fields(config_class)}
    out = dict(kwargs)
    if "activation_checkpointing" not in names and "activation_checkpointing" in out:
        out["gradient_checkpointing"] = out.pop("activation_checkpointing")
    unknown = sorted(set(out) - names)
    if unknown:
        raise RuntimeError(f"this TRL's GRPOConfig has no {unknown}: install agentenv[bench]")
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# -- the parent: workload, subprocesses, report -------------------------------------------


def _tiny_model(root: Path, tokenizer_dir: str | None) -> Path:
    """A 2-layer random Llama (fp32) with SmolLM2's tokenizer, for ``--quick``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentenv.engine import resolve_model

    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    source = Path(tokenizer_dir) if tokenizer_dir else resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            (root / name).write_bytes((source / name).read_bytes())
    return root


def _workload(args: argparse.Namespace, model: str) -> Workload:
    quick = args.quick
    prompts = args.prompts or (4 if quick else 64)
    samples = args.samples or (4 if quick else 8)
    n = prompts * samples
    return Workload(
        model=model,
        device=args.device or ("cpu" if quick else "cuda"),
        steps=args.steps or (2 if quick else 8),
        prompts=prompts,
        samples=samples,
        max_new_tokens=args.max_new_tokens or (8 if quick else 48),
        lr=args.lr,
        seed=args.seed,
        trl_micro_batch=args.trl_micro_batch or min(64, n),
        trl_activation_checkpointing=args.trl_activation_checkpointing,
        agentenv_args=tuple(shlex.split(args.agentenv_args)),
    )


class _GpuWatch:
    """``nvidia-smi``'s memory reading, sampled while a subprocess runs: the largest for
    its pid (where the pid namespace lets nvidia-smi see it) and for the whole device."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.process_mib: float | None = None
        self.device_mib: float | None = None
        self.baseline_mib = self._device()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _query(self, *flags: str) -> list[str]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *flags, "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return []
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def _device(self) -> float | None:
        rows = self._query("--query-gpu=memory.used")
        try:
            return max(float(r) for r in rows) if rows else None
        except ValueError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for row in self._query("--query-compute-apps=pid,used_memory"):
                pid, _, used = row.partition(",")
                try:
                    if int(pid) == self.pid:
                        self.process_mib = max(self.process_mib or 0.0, float(used))
                except ValueError:
                    continue
            device = self._device()
            if device is not None:
                self.device_mib = max(self.device_mib or 0.0, device)

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        self._thread.join()
        used = None
        if self.device_mib is not None:
            used = (self.device_mib - (self.baseline_mib or 0.0)) / 1024
        return {
            "nvidia_smi_process_gib": None if self.process_mib is None else self.process_mib / 1024,
            "nvidia_smi_device_gib": used,
        }


def _run_side(side: str, w: Workload, tmp: Path) -> dict[str, Any]:
    """One side in a subprocess of its own; its result from the file it writes."""
    spec, result = tmp / f"{side}.workload.json", tmp / f"{side}.result.json"
    spec.write_text(json.dumps(dataclasses.asdict(w)))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # this checkout's packages first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    command = [sys.executable, "-m", MODULE, "--side", side, str(spec), str(result)]
    print(f"bench grpo: {side} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, env=env, stdout=sys.stderr)
    watch = _GpuWatch(proc.pid) if w.device.startswith("cuda") else None
    code = proc.wait()
    smi = watch.stop() if watch is not None else {}
    if code != 0 or not result.exists():
        raise RuntimeError(f"the {side} side failed (exit status {code}); its output is above")
    out: dict[str, Any] = json.loads(result.read_text())
    out.update(smi)
    return out


def _steady(steps: list[dict[str, Any]], key: str) -> float:
    """The mean over steps 2..N (step 1 when there is one)."""
    rows = steps[1:] or steps
    return sum(float(s[key]) for s in rows) / len(rows)


def _summary(side: dict[str, Any]) -> dict[str, Any]:
    steps = side["steps"]
    rows = steps[1:] or steps
    gen = sum(s["generation_s"] for s in rows)
    train = sum(s["train_s"] for s in rows)
    out = {
        "step_s": _steady(steps, "step_s"),
        "generation_s": _steady(steps, "generation_s"),
        "train_s": _steady(steps, "train_s"),
        "generated_tokens_per_s": sum(s["generated_tokens"] for s in rows) / gen if gen else 0.0,
        "trained_tokens_per_s": sum(s["trained_tokens"] for s in rows) / train if train else 0.0,
        "reward": [s["reward_mean"] for s in steps],
        "prompt_hashes": [s["prompt_hash"] for s in steps],
    }
    for key in ("peak_memory_reserved_gib", "nvidia_smi_process_gib", "nvidia_smi_device_gib"):
        out[key] = side.get(key)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return round(a / b, 3)


def _table(result: dict[str, Any], sides: Sequence[str]) -> str:
    def fmt(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    rows = [("", *sides)]
    s = [result[x] for x in sides]
    rows += [
        ("step, steady (s)", *(fmt(x["step_s"]) for x in s)),
        ("  generation (s)", *(fmt(x["generation_s"]) for x in s)),
        ("  train (s)", *(fmt(x["train_s"]) for x in s)),
        ("generated tokens/s", *(fmt(x["generated_tokens_per_s"], ".0f") for x in s)),
        ("trained tokens/s", *(fmt(x["trained_tokens_per_s"], ".0f") for x in s)),
        ("peak reserved (GiB)", *(fmt(x["peak_memory_reserved_gib"], ".2f") for x in s)),
        ("peak nvidia-smi (GiB)", *(fmt(x["nvidia_smi_process_gib"], ".2f") for x in s)),
        ("  device, over idle", *(fmt(x["nvidia_smi_device_gib"], ".2f") for x in s)),
        ("reward, first -> last", *(f"{x['reward'][0]:.3f} -> {x['reward'][-1]:.3f}" for x in s)),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        for r in rows
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides of the comparison; the result (raises on a mismatch of prompts)."""
    if args.vs not in PEERS:
        raise SystemExit(
            f"agentenv bench grpo: error: --vs {args.vs!r}: the only peer is {', '.join(PEERS)}"
        )
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - {"agentenv", args.vs})
    if unknown or not sides:
        raise SystemExit(
            f"agentenv bench grpo: error: --sides {args.sides!r}: expected agentenv and/or "
            f"{args.vs}"
        )
    if args.vs in sides:
        _require_trl()
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-grpo-") as tmp_name:
        tmp = Path(tmp_name)
        if args.quick and args.model is None:
            (tmp / "model").mkdir()
            model = str(_tiny_model(tmp / "model", args.tokenizer_dir))
        else:
            from agentenv.engine import resolve_model

            model = str(resolve_model(args.model or "smollm2-135m"))
        w = _workload(args, model)
        raw = {side: _run_side(side, w, tmp) for side in sides}
    result: dict[str, Any] = {
        "bench": "grpo",
        "vs": args.vs,
        "workload": {
            **dataclasses.asdict(w),
            "model": args.model or ("tiny-random-llama" if args.quick else "smollm2-135m"),
            "env": f"arithmetic(max_operand={MAX_OPERAND})",
            "quick": bool(args.quick),
        },
    }
    # (What the sides saw: this process stays off the GPU, out of nvidia-smi's readings.)
    result["gpu"] = next((d.get("gpu") for d in raw.values() if d.get("gpu")), None)
    result["versions"] = {side: d.get("versions", {}) for side, d in raw.items()}
    for side, data in raw.items():
        result[side] = {**_summary(data), "wall_s": round(data["wall_s"], 2), "raw": data}
        if len(data["steps"]) != w.steps:
            raise RuntimeError(f"the {side} side ran {len(data['steps'])} of {w.steps} steps")
    if len(sides) == 2:
        a, b = result["agentenv"], result[args.vs]
        if a["prompt_hashes"] != b["prompt_hashes"]:
            raise RuntimeError(
                f"the sides trained on different prompts: agentenv {a['prompt_hashes']}, "
                f"{args.vs} {b['prompt_hashes']}"
            )
        result["same_prompts"] = True
        memory = "nvidia_smi_process_gib"
        if a[memory] is None or b[memory] is None:
            memory = "peak_memory_reserved_gib"
        result["ratios"] = {
            "step_s": _ratio(a["step_s"], b["step_s"]),
            "generation_s": _ratio(a["generation_s"], b["generation_s"]),
            "train_s": _ratio(a["train_s"], b["train_s"]),
            "memory": _ratio(a[memory], b[memory]),
            "memory_from": memory,
            "generated_tokens_per_s": _ratio(
                a["generated_tokens_per_s"], b["generated_tokens_per_s"]
            ),
            "trained_tokens_per_s": _ratio(a["trained_tokens_per_s"], b["trained_tokens_per_s"]),
        }
    result["sides"] = sides
    return result


def _require_trl() -> None:
    import importlib.util

    missing = [m for m in ("trl", "accelerate", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"agentenv bench grpo: error: --vs trl needs {', '.join(missing)}: "
            "pip install 'agentenv[bench]'"
        )


def _versions(side: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["agentenv", "torch", "transformers"]
    names += ["trl", "accelerate", "datasets"] if side != "agentenv" else []
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    print(_table(result, result["sides"]), file=sys.stderr)
    for side in result["sides"]:
        r = result[side]["reward"]
        print(f"reward per step, {side}: {' '.join(f'{x:.3f}' for x in r)}", file=sys.stderr)
    if "ratios" in result:
        ratios = result["ratios"]
        print(
            f"agentenv / {result['vs']}: step {ratios['step_s']}, memory {ratios['memory']}, "
            f"trained tokens/s {ratios['trained_tokens_per_s']}",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=None if args.json else 1), flush=True)
    return 0


def _child(side: str, spec: str, result: str) -> int:
    """A subprocess's side: the workload from ``spec``, the measurements to ``result``."""
    raw = json.loads(Path(spec).read_text())
    raw["agentenv_args"] = tuple(raw.get("agentenv_args", ()))
    w = Workload(**raw)
    out = _run_agentenv(w) if side == "agentenv" else _run_trl(w)
    out["versions"] = _versions(side)
    if w.device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name()
    for s in out["steps"]:
        for key in ("step_s", "generation_s", "train_s"):
            if not math.isfinite(s[key]):
                raise RuntimeError(f"{side} step time {key} is {s[key]}")
    Path(result).write_text(json.dumps(out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.grpo [FLAGS]``: the bench without the ``agentenv`` CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--side"]:
        return _child(*argv[1:4])
    parser = bench_parser(None, "grpo", help="", doc=__doc__, quick=QUICK)
    _add_arguments(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    from benchmarks.grpo import main as _main_of_module  # one module: one _PLAYED

    raise SystemExit(_main_of_module())
