"""DistributedSync: the trainer's weights reach a served engine over a process group (gloo
on CPU) in buckets, over a group that lasts from one sync to the next; a refused bucket
or join raises the server's reason without blocking anyone; and
``agentenv train --weight-sync distributed`` -- on a tiny random Llama."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentenv import ChatTokenizer, ClosedResourceError, ConfigError, Sample, SamplingParams
from agentenv.engine import Engine, EngineServer
from agentenv.sglang import SGLangClient, SGLangError
from tests._gpu import gpu_test
from tests.trainer.test_loop import tiny_llama
from trainer import DistributedSync, OptimConfig, TorchBackend, TrainConfig
from trainer.backends._sender import buckets as _buckets

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


class Recording(SGLangClient):
    """Remembers the weight-update calls it makes."""

    def __init__(self, url: str) -> None:
        super().__init__(url, retries=0)
        self.calls: list[tuple[str, Any]] = []

    async def init_weights_update_group(self, *args: Any, **kw: Any) -> dict[str, Any]:
        self.calls.append(("init", args))
        return await super().init_weights_update_group(*args, **kw)

    async def update_weights_from_distributed(
        self, names: Sequence[str], *args: Any, **kw: Any
    ) -> dict[str, Any]:
        self.calls.append(("bucket", (list(names), kw["weight_version"], kw["flush_cache"])))
        return await super().update_weights_from_distributed(names, *args, **kw)

    async def pause(self, mode: Any = "abort") -> None:
        self.calls.append(("pause", mode))
        await super().pause(mode)

    async def resume(self) -> None:
        self.calls.append(("resume", None))
        await super().resume()

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


def nudge(backend: TorchBackend) -> None:
    """New weights, as an optimizer step would make."""
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(0.01 * torch.randn_like(p))


async def same_logprobs(client: SGLangClient, backend: TorchBackend) -> bool:
    c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    sample = Sample(prompt_ids=[1, 2, 3], completion_ids=c.output_ids, reward=0.0)
    mine = backend.logprobs([sample])[0].double()
    return torch.allclose(mine, torch.tensor(c.logprobs, dtype=torch.float64), atol=1e-4)


def test_buckets_keep_the_order_cut_by_size_and_send_tied_weights_once() -> None:
    embed = torch.zeros(4, 8)  # 128 bytes
    tensors = {
        "a": torch.zeros(8),  # 32 bytes
        "embed": embed,
        "b": torch.zeros(2),
        "big": torch.zeros(100),  # over the limit: alone
        "lm_head": embed,  # the same storage: tied, left out
        "c": torch.zeros(1),
    }
    names = [[n for n, _ in b] for b in _buckets(tensors, 160)]
    assert names == [["a", "embed"], ["b"], ["big"], ["c"]]


def test_the_trainers_weights_reach_a_served_engine_in_buckets(model: Path) -> None:
    tokenizer = ChatTokenizer.load(model)
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-2))
    state = backend.state_dict()

    async def go() -> None:
        async with (
            Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as engine,
            EngineServer(engine) as server,
            Recording(server.url) as client,
        ):
            sync = DistributedSync([client], backend="gloo", bucket_bytes=1 << 20, timeout=30)
            for version in (1, 2):  # the second sync reuses the group
                nudge(backend)
                with anyio.fail_after(60):
                    await sync(backend, version)
                assert await client.weight_version() == str(version)
                assert torch.equal(engine.model.norm, state["model.norm.weight"])
                assert torch.equal(engine.model.lm_head, state["lm_head.weight"])
                assert await same_logprobs(client, backend)
            buckets = [args for kind, args in client.calls if kind == "bucket"]
            per_sync = len(buckets) // 2
            assert per_sync > 1  # the vocabulary-sized tensors alone are 6 MiB
            first = [name for names, _, _ in buckets[:per_sync] for name in names]
            assert first == list(state)  # every weight once, in the state dict's order
            assert [v for _, v, _ in buckets] == ["1"] * per_sync + ["2"] * per_sync
            assert [f for _, _, f in buckets[:per_sync]] == [False] * (per_sync - 1) + [True]
            assert client.kinds().count("init") == 1
            assert client.kinds()[:3] == ["init", "pause", "bucket"]
            assert client.kinds()[-1] == "resume"
            assert ("pause", "retract") in client.calls
            # Closed: the group is gone on both ends; the sync refuses to run.
            await sync.aclose()
            with pytest.raises(SGLangError, match="The group to be destroyed does not exist"):
                await client.destroy_weights_update_group()
            with pytest.raises(ClosedResourceError):
                await sync(backend, 3)
            # A new group of the same name forms on the same server.
            async with DistributedSync([client], backend="gloo", timeout=30) as again:
                nudge(backend)
                await again(backend, 3)
                assert await client.weight_version() == "3"
                assert await same_logprobs(client, backend)

    anyio.run(go)


class Wrong:
    """A trainer whose model does not match the server's (a hidden size of 33, not 32)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"model.norm.weight": torch.ones(33)}


def test_refusals_raise_the_servers_reason_and_block_nobody(model: Path) -> None:
    tokenizer = ChatTokenizer.load(model)
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-2))

    async def go() -> None:
        async with (
            Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as engine,
            EngineServer(engine) as server,
            Recording(server.url) as client,
        ):
            sync = DistributedSync([client], backend="gloo", timeout=30)
            norm = engine.model.norm.clone()
            shape = r"weight model.norm.weight has shape \(33,\), the model's is \(32,\)"
            with anyio.fail_after(30), pytest.raises(SGLangError, match=shape):
                await sync(Wrong(), 1)  # type: ignore[arg-type]
            assert torch.equal(engine.model.norm, norm)
            assert await client.weight_version() == "default"
            assert client.kinds()[-1] == "resume"  # generation goes on after a failed sync
            assert len((await client.generate([1, 2], SamplingParams(max_new_tokens=2))).output_ids)
            # The failed sync left its group; the next call forms a new one.
            await sync(backend, 2)
            assert client.kinds().count("init") == 2 and await same_logprobs(client, backend)
            # A server that refuses to join (the name is taken): raised at once.
            other = DistributedSync([client], backend="gloo", timeout=5)
            taken = "group 'weight_update_group' already exists"
            with anyio.fail_after(60), pytest.raises(SGLangError, match=taken):
                await other(backend, 3)
            await sync(backend, 4)  # the first trainer's group was left alone
            assert await client.weight_version() == "4"
            await sync.aclose()
            with pytest.raises(Exception, match="nccl backend broadcasts CUDA tensors"):
                await DistributedSync([client], backend="nccl")(backend, 5)
            assert client.kinds().count("init") == 3  # refused before asking the server

    anyio.run(go)


@gpu_test(2)
def test_nccl_carries_the_weights_from_one_gpu_to_a_server_on_another(model: Path) -> None:
    tokenizer = ChatTokenizer.load(model)
    backend = TorchBackend(model, device="cuda:0", precision="fp32")

    async def go() -> None:
        async with (
            Engine(model, device="cuda:1", dtype=torch.float32, tokenizer=tokenizer) as engine,
            EngineServer(engine) as server,
            SGLangClient(server.url) as client,
            DistributedSync([client], backend="nccl", bucket_bytes=1 << 20, timeout=60) as sync,
        ):
            for version in (1, 2):
                nudge(backend)
                with anyio.fail_after(120):
                    await sync(backend, version)
                state = {k: v.to("cuda:1") for k, v in backend.state_dict().items()}
                assert torch.equal(engine.model.norm, state["model.norm.weight"])
                assert torch.equal(engine.model.embed, state["model.embed_tokens.weight"])
                assert torch.equal(engine.model.lm_head, state["lm_head.weight"])
                assert await client.weight_version() == str(version)
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
            assert c.weight_version == "2" and len(c.output_ids) == 4

    anyio.run(go)


def test_distributed_weight_sync_needs_servers_and_on_nccl_a_gpu_of_their_own() -> None:
    base = {"env": "arithmetic", "weight_sync": "distributed"}
    with pytest.raises(ConfigError, match="--weight-sync distributed needs servers"):
        TrainConfig(**base)
    own = "needs the server on a GPU of its own, but the server is on cuda:0"
    with pytest.raises(ConfigError, match=own):
        TrainConfig(**base, rollout_engine="serve", device="cuda", rollout_device="cuda:0")
    with pytest.raises(ConfigError, match=own):  # SGLang's default GPU is 0
        TrainConfig(**base, rollout_engine="sglang", device="cuda")
    with pytest.raises(ConfigError, match="server is on cuda:1, one of the trainer"):
        TrainConfig(**base, rollout_engine="serve", device="cuda", rollout_device="cuda:1",
                    backend="megatron", actor_num_gpus_per_node=2)  # fmt: skip
    TrainConfig(**base, rollout_engine="serve", device="cuda", rollout_device="cuda:1")
    TrainConfig(**base, rollout_engine="sglang", device="cuda", sglang_args=["--base-gpu-id", "1"])
    with pytest.raises(ConfigError, match=own):  # SGLang's own flag wins
        TrainConfig(**base, rollout_engine="sglang", device="cuda", rollout_device="cuda:1",
                    sglang_args=["--base-gpu-id=0"])  # fmt: skip
    TrainConfig(**base, rollout_engine="serve")  # gloo on CPU: one machine is fine
    TrainConfig(**base, rollout_url="http://10.0.0.2:30000", device="cuda")
    # A CUDA trainer and a CPU server: gloo, not NCCL.
    mixed = TrainConfig(**base, rollout_engine="serve", device="cuda", rollout_device="cpu")
    assert mixed.weight_sync_backend() == "gloo"


@pytest.mark.slow
def test_agentenv_train_syncs_a_served_engine_over_a_process_group(model: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train",
         "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
         "--rollout-engine", "serve", "--weight-sync", "distributed",
         "--update-weight-buffer-size", "1048576", "--num-rollout", "2",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "4", "--n-eval", "1", "--lr", "1e-2", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "agentenv serve --model-path" in out.stderr
    assert "weight sync: gloo broadcast to the server in buckets of 1 MiB" in out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 2 and summary["time_sync_s"] > 0
    refused = subprocess.run(
        [sys.executable, "-m", "agentenv", "train", "--env", "arithmetic",
         "--weight-sync", "distributed"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--weight-sync distributed needs servers" in refused.stderr


@gpu_test(2)
def test_megatron_on_gpu0_trains_and_syncs_agentenv_serve_on_gpu1_over_nccl(
    model: Path, tmp_path: Path
) -> None:
    """The whole path on two GPUs: the megatron backend on cuda:0, ``agentenv serve`` on
    cuda:1, the weights broadcast over NCCL after every step; the reward rises."""
    pytest.importorskip("megatron.core", exc_type=ImportError)
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train",
         "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
         "--backend", "megatron", "--device", "cuda:0", "--rollout-engine", "serve",
         "--rollout-device", "cuda:1", "--weight-sync", "distributed",
         "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "8", "--n-eval", "4", "--lr", "1e-2",
         "--save", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "weight sync: nccl broadcast to the server" in out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 3 and summary["time_sync_s"] > 0
    assert summary["eval_reward_after"] > summary["eval_reward_before"]
