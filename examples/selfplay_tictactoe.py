"""Self-play GRPO on Tic-Tac-Toe: one policy plays both X and O, every turn is a sample.

    .venv/bin/python examples/selfplay_tictactoe.py --steps 3          # CPU, minutes
    .venv/bin/python examples/selfplay_tictactoe.py --device cuda --steps 200 \
        --tasks-per-step 32 --episodes-per-task 8 --max-new-tokens 256

It evaluates against the random player (win/draw/loss per seat and the invalid-move
rate), trains by self-play with the trainer's GRPO loop on the embedded engine, and
evaluates again. Rewards are SPIRAL's role-conditioned advantages: each seat's return
minus a moving average of that seat's returns (``RoleBaseline``), so the seat that moves
second is not pushed down for the first mover's advantage.

What to expect. A few CPU steps with SmolLM2-135M move little: the untrained model
rarely ends its reply with a bracketed cell, so most turns are invalid moves (forfeits),
and the first thing training lowers is the invalid-move rate. A longer GPU run (a
1-2B instruct model, a few hundred steps of 32 x 8 episodes, ``--retries 1``) should
show, in order: the invalid-move rate falling towards zero; then the win rate against
the random player rising from the ~0.3-0.4 of an untrained model towards 0.8-0.9 as X
(~0.6 is random play's own rate as X) and 0.5-0.7 as O; draws rising against the
``optimal`` player (``agentenv eval --env tictactoe --opponent optimal``), which no
policy can beat. If the O seat's rate falls while X's rises, check that the baseline is
per role: GRPO groups keyed by task and role, or ``RoleBaseline`` as here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anyio

from agentenv import ChatTokenizer, ListSink, RoleBaseline, RolloutConfig, SamplingParams
from agentenv import run_rollouts
from agentenv.engine import Engine
from agentenv.games import TallySink
from environments.games.tictactoe import TicTacToeEnv
from trainer import EmbeddedEngine, GRPOConfig, LossConfig, OptimConfig, TorchBackend, run_grpo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model name or HF directory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps")
    p.add_argument("--tasks-per-step", type=int, default=2, help="matches per step")
    p.add_argument("--episodes-per-task", type=int, default=4, help="GRPO group size")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per turn")
    p.add_argument("--retries", type=int, default=1, help="retries after an invalid move")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    p.add_argument("--eval-games", type=int, default=16, help="games against random")
    return p.parse_args()


async def evaluate(engine: Engine, tokenizer: ChatTokenizer, args: argparse.Namespace) -> dict:
    """Win/draw/loss per seat and the invalid-move rate against the random player."""
    env = TicTacToeEnv(opponent="random", retries=args.retries)
    sink = TallySink(ListSink())
    await run_rollouts(
        env,
        env.tasks("test")[: args.eval_games],
        engine,
        tokenizer=tokenizer,
        sink=sink,
        config=RolloutConfig(
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0),
            progress=False,
        ),
    )
    summary = sink.tally.summary()
    keys = ("win_rate", "draw_rate", "loss_rate", "invalid_move_rate")
    return {
        **{k: round(summary[k], 3) for k in keys},
        "seats": {r: {k: round(s[k], 3) for k in keys} for r, s in summary["seats"].items()},
    }


async def main(args: argparse.Namespace) -> None:
    tokenizer = ChatTokenizer.load(args.model)
    env = TicTacToeEnv(retries=args.retries, baseline=RoleBaseline(decay=0.95))
    backend = TorchBackend(
        args.model,
        device=args.device,
        optim=OptimConfig(lr=args.lr, grad_clip=1.0),
        loss=LossConfig(eps_clip=0.2),
    )
    config = GRPOConfig(
        num_rollout=args.steps,
        rollout_batch_size=args.tasks_per_step,
        n_samples_per_prompt=args.episodes_per_task,
        sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
    )

    def report(m: dict[str, float]) -> None:
        print(
            f"step {int(m['step']) + 1}/{args.steps}  reward {m['reward_mean']:+.3f}  "
            f"samples {int(m.get('samples', 0))}  rollout {m['time_rollout_s']:.0f}s  "
            f"train {m['time_train_s']:.0f}s  {env.baseline}",
            file=sys.stderr,
            flush=True,
        )

    dtype, residual = backend.precision.engine_dtypes()  # sample from the trainer's numerics
    async with Engine(
        args.model, device=args.device, dtype=dtype, residual_dtype=residual, tokenizer=tokenizer
    ) as engine:
        before = await evaluate(engine, tokenizer, args)
        print(f"before: {json.dumps(before)}", flush=True)
        started = time.perf_counter()
        await run_grpo(
            env, env.tasks("train"), backend, EmbeddedEngine(engine), tokenizer, config,
            on_step=report,
        )  # fmt: skip
        after = await evaluate(engine, tokenizer, args)
        print(f"after:  {json.dumps(after)}", flush=True)
        print(f"trained {args.steps} steps in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    anyio.run(main, parse_args())
