"""A text-level model behind an OpenAI-compatible chat API (a fake one on 127.0.0.1):
evaluated through ``agentenv eval --model openai:URL``, its samples marked not
token-exact, and refused for training."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    GenerationError,
    OpenAIChatModel,
    SamplingParams,
    TextGenerator,
)
from agentenv._http import HTTPError, HTTPServer, Request, Response, Router
from agentenv.cli import main

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
LEGAL = re.compile(r"Legal moves: \[(\d)\]")
REVERSE = f"{ROOT / 'examples' / 'reverse_env.py'}:ReverseEnv"


@contextlib.asynccontextmanager
async def fake_openai(
    models: tuple[str, ...] = ("fake-model",),
    reply: Callable[[str], str] = lambda text: text.strip()[::-1],
) -> AsyncIterator[tuple[HTTPServer, list[dict[str, Any]]]]:
    """An OpenAI-compatible server answering ``reply(last user message)`` (default: it
    reversed); the request bodies it got."""
    router = Router()
    seen: list[dict[str, Any]] = []

    @router.route("GET", "/v1/models")
    async def list_models(request: Request) -> Response:
        return Response.json({"object": "list", "data": [{"id": m} for m in models]})

    @router.route("POST", "/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = request.json()
        seen.append(body)
        if body.get("model") not in models:
            raise HTTPError(404, f"model {body.get('model')!r} does not exist")
        word = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        message = {"role": "assistant", "content": reply(word)}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return Response.json({"id": "c1", "object": "chat.completion", "choices": [choice]})

    async with HTTPServer(router) as server:
        yield server, seen


async def test_eval_against_an_openai_compatible_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "samples.jsonl"
    async with fake_openai() as (server, seen):
        argv = ["eval", "--env", REVERSE, "--model", f"openai:{server.url}/v1", "--n", "4",
                "--max-new-tokens", "16", "--out", str(out), "--json", "--no-progress"]  # fmt: skip
        assert await anyio.to_thread.run_sync(main, argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["reward_mean"] == 1.0 and summary["samples"] == 4
    assert summary["token_exact"] is False
    assert "token-exact        no: a text-level model" in printed
    # The server got the messages (not token ids), with the model its /models named.
    assert len(seen) == 4 and {b["model"] for b in seen} == {"fake-model"}
    assert seen[0]["messages"][0] == {
        "role": "system",
        "content": "Reverse the word. Reply with the reversed word only.",
    }
    assert {b["max_tokens"] for b in seen} == {16}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["metadata"]["token_exact"] for r in rows] == [False] * 4
    assert all(r["rollout_logprobs"] is None for r in rows)


async def test_the_model_is_named_when_the_server_serves_several(smollm2: ChatTokenizer) -> None:
    async with fake_openai(("a", "b")) as (server, _):
        with pytest.raises(ConfigError, match=r"lists 2 models \['a', 'b'\]; name one: "):
            async with OpenAIChatModel(f"{server.url}/v1", tokenizer=smollm2):
                pass
        async with OpenAIChatModel(f"{server.url}/v1", tokenizer=smollm2, model="b") as model:
            assert isinstance(model, TextGenerator)
            c = await model.generate_chat(
                [{"role": "user", "content": "abc"}], SamplingParams(max_new_tokens=8)
            )
            assert smollm2.decode(c.output_ids) == "cba<|im_end|>" and c.logprobs is None
            with pytest.raises(ConfigError, match="text-level: it takes chat messages"):
                await model.generate([1, 2, 3], SamplingParams())
        async with OpenAIChatModel(f"{server.url}/v1", tokenizer=smollm2, model="c") as model:
            with pytest.raises(GenerationError, match=r"answered 404: model 'c' does not exist"):
                await model.generate_chat([{"role": "user", "content": "x"}], SamplingParams())


async def test_training_refuses_a_text_level_policy(smollm2: ChatTokenizer) -> None:
    from trainer import GRPOConfig
    from trainer.run._producer import Producer

    model = OpenAIChatModel("http://127.0.0.1:9/v1", tokenizer=smollm2, model="m")
    with pytest.raises(ConfigError, match=r"text-level model .* no gradient can be computed"):
        Producer(
            None, None, model, smollm2, None, GRPOConfig(),  # type: ignore[arg-type]
            concurrency=1,
        )  # fmt: skip


async def test_a_game_opponent_can_be_a_text_level_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def first_legal(text: str) -> str:
        return "[" + LEGAL.findall(text)[-1] + "]"

    first_legal_script = f"scripted:{ROOT / 'examples' / 'scripts' / 'first_legal_move.py'}"
    async with fake_openai(reply=first_legal) as (server, seen):
        argv = ["eval", "--env", "environments.games.tictactoe:TicTacToeEnv", "--model",
                first_legal_script, "--opponent", f"openai:{server.url}/v1", "--n", "4",
                "--json", "--no-progress"]  # fmt: skip
        assert await anyio.to_thread.run_sync(main, argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen and summary["failed_episodes"] == 0 and summary["forfeits"] == 0
    # The trained seat played token-exact (scripted): its samples are not marked.
    assert "token_exact" not in summary
