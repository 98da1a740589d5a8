"""The megatron backend's rank management through Ray actors (ray_launcher), with a
stand-in worker on CPU (megatron-core does not import here): every method reaches every
rank, rank 0 answers, and each rank writes its checkpoint shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentenv import ConfigError
from tests.trainer.distributed.workers import FakeMegatronRank
from tests.trainer.megatron.tiny import TINY
from trainer.distributed import Placement, RankGroup
from trainer.megatron import MegatronBackend, MegatronOptions


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_megatron_backend_drives_its_ranks_as_ray_actors(
    ray_cluster: Any, tmp_path: Path
) -> None:
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    placed = Placement(actor_num_gpus_per_node=2).place(ray_cluster, timeout=30)

    def launch(options: MegatronOptions) -> Any:  # ray_launcher's, with the stand-in worker
        return RankGroup(FakeMegatronRank, options, placed, device="cpu", release=True)

    backend = MegatronBackend(model, device="cpu", num_gpus=2, launcher=launch)
    try:
        samples: Any = ["s0", "s1"]
        assert backend.train_step(samples, [1.0, -1.0]) == {"ranks": 2.0, "rank": 0.0}
        assert backend.steps == 1
        with pytest.raises(ConfigError, match="2 samples but the advantages differ"):
            backend.train_step(samples, [1.0])
        assert backend.logprobs(samples)[0].tolist() == [0.0, 0.0]  # rank 0's
        assert backend.state_dict()["w"].tolist() == [0.0]
        backend.save_checkpoint(tmp_path / "ckpt", {"step": 1})
        shards = sorted(p.name for p in (tmp_path / "ckpt").glob("model_rank*.pt"))
        assert shards == ["model_rank0.pt", "model_rank1.pt"]
        assert backend.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    finally:
        backend.close()
