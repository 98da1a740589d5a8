"""`agentenv serve`'s Anthropic Messages route (``/v1/messages``) without an episode: the
real ``anthropic`` SDK against the engine through the model's chat template, with the
server's API key."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from agentenv import ChatTokenizer
from agentenv.endpoint import serve_chat
from agentenv.engine import Engine, EngineServer, resolve_model

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "Say hi"}]


async def test_serve_answers_anthropic_messages_greedy_as_generate() -> None:
    model_dir = resolve_model("smollm2-135m")
    tok = ChatTokenizer.load(str(model_dir))
    async with Engine(model_dir, context_length=64) as engine:

        def routes(router: Any) -> None:
            serve_chat(router, engine, tok, model="smollm2-135m", context_length=64)

        async with (
            EngineServer(engine, extra_routes=routes, api_key="k") as served,
            anthropic.AsyncAnthropic(base_url=served.url, api_key="k", max_retries=0) as client,
            httpx.AsyncClient(base_url=served.url, timeout=60, trust_env=False) as http,
        ):
            # The SDK's create() has no temperature argument (this version): the body has.
            sampling: dict[str, Any] = {"max_tokens": 4, "extra_body": {"temperature": 0}}
            r = await client.messages.create(model="smollm2-135m", messages=QUESTION, **sampling)
            assert r.model == "smollm2-135m" and r.stop_reason in ("end_turn", "max_tokens")
            prompt = tok.encode(tok.render(QUESTION, add_generation_prompt=True))
            assert r.usage.input_tokens == len(prompt) and 1 <= r.usage.output_tokens <= 4
            g = await http.post(
                "/generate",
                headers={"authorization": "Bearer k"},
                json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                },
            )
            text = tok.decode(g.json()["output_ids"])
            assert r.content[0].type == "text" and text.startswith(r.content[0].text)
            async with client.messages.stream(
                model="smollm2-135m", messages=QUESTION, **sampling
            ) as stream:
                assert await stream.get_final_text() == r.content[0].text
            counted = await client.messages.count_tokens(model="smollm2-135m", messages=QUESTION)
            assert counted.input_tokens == len(prompt)
            # Anthropic's own header carries the key too; a wrong key is refused.
            body = {"model": "m", "messages": QUESTION, "max_tokens": 4}
            ok = await http.post("/v1/messages", headers={"x-api-key": "k"}, json=body)
            assert ok.status_code == 200 and ok.json()["type"] == "message"
            refused = await http.post("/v1/messages", headers={"x-api-key": "no"}, json=body)
            assert refused.status_code == 401
            bad = await http.post("/v1/messages", headers={"x-api-key": "k"}, json=QUESTION[0])
            assert bad.status_code == 400
            assert bad.json()["error"]["message"].startswith("max_tokens:")
