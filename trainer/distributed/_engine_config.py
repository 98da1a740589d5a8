"""An :class:`~trainer.distributed.EngineSpec` from a run's settings (``config.engine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.distributed._engine_actor import EngineSpec

if TYPE_CHECKING:
    import torch

    from trainer._config import TrainConfig

__all__ = ["engine_spec"]


def engine_spec(
    config: TrainConfig, dtypes: tuple[torch.dtype, torch.dtype] | None = None
) -> EngineSpec:
    """What each engine actor of the run starts: ``--rollout-engine serve`` (``agentenv
    serve`` on ``cuda`` when ``--device`` is a GPU -- the actor sees only its own -- with
    ``--rollout-max-running`` and ``dtypes``, the trainer's numerics) or ``sglang`` (the
    ``--sglang-*`` flags; ``--tp-size`` from ``--rollout-num-gpus-per-engine``), each
    on ``--rollout-num-gpus-per-engine`` GPUs. The API key (``--sglang-api-key`` or
    ``$AGENTENV_API_KEY``) reaches ``agentenv serve`` through its environment."""
    from agentenv import ConfigError
    from agentenv.engine import resolve_model
    from trainer._servers import serve_args

    engine = config.engine
    if engine.rollout_engine == "embedded" or engine.rollout_url is not None:
        raise ConfigError(
            "engines as Ray actors need --rollout-engine serve or sglang (not "
            f"{engine.rollout_engine!r}{', with --rollout-url' if engine.rollout_url else ''})"
        )
    model = str(resolve_model(config.model.hf_checkpoint))
    gpus = engine.rollout_num_gpus_per_engine
    key = engine.api_key()
    if engine.rollout_engine == "serve":
        device = "cpu" if config.model.device == "cpu" else "cuda"
        return EngineSpec(
            model, kind="serve", gpus_per_engine=gpus,
            server_args=tuple(serve_args(config, device, dtypes)),
            env={"AGENTENV_API_KEY": key} if key else {},
        )  # fmt: skip
    return EngineSpec(
        model, kind="sglang", gpus_per_engine=gpus, server_args=tuple(engine.sglang_args)
    )
