"""The settings of a training run: one validated tree, :class:`TrainConfig`, whose groups
are the objects the components take (``config.rollout`` is the loop's
:class:`~trainer.GRPOConfig`, ``config.algorithm`` the loss's :class:`~trainer.LossConfig`,
``config.optimizer`` the backends' :class:`~trainer.OptimConfig`, ...). Each field
declares its slime flag once (:func:`~trainer.config._settings.setting`); ``agentenv train``'s
flags and the flat form of ``--config`` files are generated from those declarations.

Each rule is checked once, in the group that owns the settings it reads; the rules across
groups (the learning-rate decay spans the run, a NCCL server needs a GPU of its own, ...)
in :class:`TrainConfig`'s validator. Each setting is held once: the rollouts' temperature
(that of the trainer's log-probs too) is ``rollout.sampling.temperature`` alone.
Everything here is light: the tree validates before anything heavy loads.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

import pydantic

from agentenv import ConfigError
from trainer.config import Flag, Group, GRPOConfig, LossConfig, OptimConfig, flags, nest, setting

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelismConfig",
    "PlacementConfig",
    "TrainConfig",
    "flag_table",
]


class ModelConfig(Group):
    """The model that trains, its reference and the trainer's device (``config.model``)."""

    hf_checkpoint: str = setting(
        "--hf-checkpoint", "smollm2-135m", "model name or HF directory", metavar="MODEL"
    )
    ref_load: str | None = setting(
        "--ref-load", None, "--backend megatron: the KL reference checkpoint (default: the "
        "starting model, the only one supported yet with a KL weight; torch: leave it out)",
        metavar="MODEL",
    )  # fmt: skip
    device: str = setting("--device", "cpu", "cpu, cuda or cuda:N", metavar="DEVICE")


class DataConfig(Group):
    """The environment, its training prompts and how the episodes are scored
    (``config.data``)."""

    env: str | None = setting(
        "--env", None, "registered environment name, package.module:Class or "
        "path/file.py:Class (default with --prompt-data: prompt_data, one answer per "
        "prompt scored by --rm-type or --custom-rm-path)", metavar="NAME",
    )  # fmt: skip
    env_args: dict[str, Any] = setting(
        "--env-args", default_factory=dict,
        doc="JSON object of keyword arguments for the environment",
    )  # fmt: skip
    prompt_data: Path | None = setting(
        "--prompt-data", None, "training prompts: JSONL, .parquet or a datasets "
        "save_to_disk directory (default: the environment's train split; bad rows are "
        "skipped, each reported)", metavar="FILE",
    )  # fmt: skip
    input_key: str = setting(
        "--input-key", "prompt", "the prompt's key in --prompt-data", metavar="KEY"
    )
    label_key: str | None = setting(
        "--label-key", "label", "the answer's key in --prompt-data (the reward compares "
        "with it)", metavar="KEY",
    )  # fmt: skip
    metadata_key: str | None = setting(
        "--metadata-key", "metadata", "--prompt-data: the key of each row's metadata "
        "object, merged into the task's info (a row's own rm_type among it)", metavar="KEY",
    )  # fmt: skip
    apply_chat_template: bool = setting(
        "--apply-chat-template", True,
        "render prompts with the model's chat template (else raw text)",
    )  # fmt: skip
    rm_type: str | None = setting(
        "--rm-type", None, "score each episode's answer by slime's reward type: math, "
        "deepscaler, dapo, f1, remote_rm, or boxed_ before a rule type (replaces the "
        "environment's rubric)", metavar="TYPE",
    )  # fmt: skip
    rm_url: str | None = setting(
        "--rm-url", None, "--rm-type remote_rm: the reward service (POST {prompt, "
        "response, label} -> a number)", metavar="URL",
    )  # fmt: skip
    reward_key: str | None = setting(
        "--reward-key", None, "--rm-type remote_rm: the reward's field when the service "
        "answers an object", metavar="KEY",
    )  # fmt: skip
    rm_timeout: float | None = setting(
        "--rm-timeout", None, "--rm-type remote_rm: seconds one reward may take, retries "
        "included (default 120)", gt=0, metavar="S",
    )  # fmt: skip
    rm_max_response_bytes: int | None = setting(
        "--rm-max-response-bytes", None, "--rm-type remote_rm: the longest answer read; a "
        "longer one fails its sample (default 1048576)", ge=1, metavar="N",
    )  # fmt: skip
    custom_rm_path: str | None = setting(
        "--custom-rm-path", None, "the reward function module:function or "
        "path/file.py:function, (task, state) -> float, sync or async (replaces the "
        "environment's rubric)", metavar="FN",
    )  # fmt: skip
    group_rm: bool = setting(
        "--group-rm", False, "--custom-rm-path's function scores a whole group: "
        "(task, samples) -> one float per sample",
    )  # fmt: skip

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        if self.env is None and self.prompt_data is None:
            raise ConfigError(
                "--env NAME or --prompt-data FILE is required (the environment, or prompts "
                "scored by --rm-type)"
            )
        if self.rm_type is not None:
            from agentenv.rewards import check_rm_type

            check_rm_type(self.rm_type)
        if self.rm_type == "remote_rm" and self.rm_url is None:
            raise ConfigError(
                "--rm-type remote_rm needs --rm-url, the reward service's URL "
                "(e.g. http://127.0.0.1:8000/reward)"
            )
        if self.rm_url is not None and not self.rm_url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url must start with http:// or https://, got {self.rm_url!r}")
        if self.rm_type is not None and self.custom_rm_path is not None:
            raise ConfigError(
                f"--rm-type {self.rm_type} and --custom-rm-path {self.custom_rm_path} both "
                "name the reward: pass one"
            )
        if self.group_rm and self.custom_rm_path is None:
            raise ConfigError(
                "--group-rm scores whole groups with --custom-rm-path's function: pass "
                "--custom-rm-path module:function"
            )
        if self.env is None and self.rm_type is None and self.custom_rm_path is None:
            raise ConfigError(
                "--prompt-data without --env needs a reward: --rm-type (math, deepscaler, "
                "dapo, f1, remote_rm) or --custom-rm-path module:function"
            )
        return self

    @property
    def reward_args(self) -> dict[str, Any]:
        """The reward flags given, as :func:`agentenv.rewards.reward_rubric` takes them
        (empty: the environment's own rubric scores)."""
        args = {
            "rm_type": self.rm_type, "rm_url": self.rm_url, "reward_key": self.reward_key,
            "custom_rm_path": self.custom_rm_path, "rm_timeout": self.rm_timeout,
            "rm_max_response_bytes": self.rm_max_response_bytes,
        }  # fmt: skip
        out: dict[str, Any] = {k: v for k, v in args.items() if v is not None}
        if not (self.rm_type or self.custom_rm_path):
            return {}
        if self.group_rm:
            out["group_rm"] = True
        if self.custom_rm_path and self.prompt_data is not None:
            out["label_key"] = self.label_key  # a TRL function reads the answer by it
        return out


class EngineConfig(Group):
    """Where the episodes are generated and how the new weights reach it
    (``config.engine``)."""

    rollout_engine: Literal["embedded", "serve", "sglang"] = setting(
        "--rollout-engine", "embedded", "embedded (in this process), serve (an agentenv "
        "serve process) or sglang (python -m sglang.launch_server with the --sglang-* flags)",
    )  # fmt: skip
    rollout_url: str | None = setting(
        "--rollout-url", None, "use this running server (SGLang or agentenv serve) for "
        "rollouts", metavar="URL",
    )  # fmt: skip
    rollout_max_running: int = setting(
        "--rollout-max-running", 128,
        "embedded/serve engine: requests decoded in one batch (and episodes in flight)", ge=1,
    )  # fmt: skip
    sglang_server_concurrency: int = setting(
        "--sglang-server-concurrency", 512, "SGLang servers (--rollout-engine sglang, "
        "--rollout-url): episodes in flight per server (behind a router, times its workers)",
        ge=1,
    )  # fmt: skip
    rollout_device: str | None = setting(
        "--rollout-device", None, "the launched/embedded engine's device (default: --device; "
        "SGLang: cuda:N sets --base-gpu-id N)", metavar="DEVICE",
    )  # fmt: skip
    rollout_num_gpus_per_engine: int = setting(
        "--rollout-num-gpus-per-engine", 1, "--rollout-engine sglang: GPUs of the launched "
        "server (its --tp-size)", ge=1,
    )  # fmt: skip
    weight_sync: Literal["disk", "distributed", "tensor"] = setting(
        "--weight-sync", "disk", "how servers get the weights: disk "
        "(/update_weights_from_disk, a shared filesystem), distributed (broadcast over "
        "NCCL on CUDA, gloo on CPU) or tensor (handed over by handle to servers on the "
        "trainer's own GPU, /update_weights_from_tensor: with --colocate)",
    )  # fmt: skip
    update_weight_buffer_size: int = setting(
        "--update-weight-buffer-size", 512 << 20,
        "--weight-sync distributed: bytes per broadcast bucket", ge=1,
    )  # fmt: skip
    weight_sync_master_address: str = setting(
        "--weight-sync-master-address", "127.0.0.1",
        "--weight-sync distributed: this machine's address as the servers reach it",
        metavar="HOST",
    )  # fmt: skip
    sglang_args: list[str] = setting(
        None, default_factory=list, doc="SGLang's flags (--sglang-X on the command line)",
        flat=True,
    )  # fmt: skip
    router_args: list[str] = setting(
        None, default_factory=list,
        doc="sglang-router's flags (--router-X on the command line), for the router before "
        "engines on Ray (--rollout-num-gpus)",
        flat=True,
    )  # fmt: skip

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        # --sglang-api-key (SGLang's --api-key) is the key of whichever server rolls out.
        others = _without_flag(self.sglang_args, "--api-key")
        if others and self.rollout_engine != "sglang":
            raise ConfigError(f"--sglang-* flags ({' '.join(others)}) need --rollout-engine sglang")
        if self.sglang_flag("--api-key") is not None and self.embedded:
            raise ConfigError(
                "--sglang-api-key is the rollout servers' key: it needs --rollout-engine "
                "serve or sglang, or --rollout-url; the embedded engine takes none"
            )
        url = self.rollout_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(f"--rollout-url must start with http:// or https://, got {url!r}")
        if self.weight_sync != "disk" and self.embedded:
            raise ConfigError(
                f"--weight-sync {self.weight_sync} needs servers (--rollout-engine serve or "
                "sglang, or --rollout-url); the embedded engine gets the weights in this "
                "process"
            )
        gpus = self.rollout_num_gpus_per_engine
        if gpus > 1 and (self.rollout_engine != "sglang" or url is not None):
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {gpus} needs --rollout-engine sglang without "
                "--rollout-url (the embedded engine and agentenv serve run on one device; a "
                "running server has its own)"
            )
        if gpus > 1 and self.sglang_flag("--tp-size") not in (None, str(gpus)):
            raise ConfigError(
                f"--rollout-num-gpus-per-engine {gpus} is the server's --tp-size, but "
                f"--sglang-tp-size {self.sglang_flag('--tp-size')} says otherwise: pass one"
            )
        return self

    def sglang_flag(self, flag: str) -> str | None:
        """The value of SGLang's ``flag`` (``--sglang-X`` on the command line), if given."""
        args = self.sglang_args
        for i, arg in enumerate(args):
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
        return None

    @property
    def embedded(self) -> bool:
        """Whether the rollouts run on the embedded engine (this process's)."""
        return self.rollout_url is None and self.rollout_engine == "embedded"

    def sglang_command_args(self) -> list[str]:
        """The flags of a launched SGLang server: the ``--sglang-*`` ones, the GPU that
        ``--rollout-device`` names and the GPUs of ``--rollout-num-gpus-per-engine``."""
        extra = list(self.sglang_args)
        gpu = self.rollout_device or ""
        if gpu.startswith("cuda:") and self.sglang_flag("--base-gpu-id") is None:
            extra += ["--base-gpu-id", gpu.removeprefix("cuda:")]  # SGLang's GPU choice
        if self.rollout_num_gpus_per_engine > 1 and self.sglang_flag("--tp-size") is None:
            extra += ["--tp-size", str(self.rollout_num_gpus_per_engine)]
        return extra

    def api_key(self) -> str | None:
        """The rollout servers' API key: ``--sglang-api-key`` (SGLang's ``--api-key``,
        handed to a launched SGLang as usual, to a launched ``agentenv serve`` too, and
        sent to ``--rollout-url``), else ``$AGENTENV_API_KEY``."""
        return self.sglang_flag("--api-key") or os.environ.get("AGENTENV_API_KEY") or None


class ParallelismConfig(Group):
    """The trainer backend and its layout (``config.parallel``): megatron's own flags
    (``--tensor-model-parallel-size`` ...) pass through under their names."""

    backend: Literal["torch", "megatron"] = setting("--backend", "torch", "trainer backend")
    actor_num_gpus_per_node: int = setting(
        "--actor-num-gpus-per-node", 1, "trainer ranks per node (one GPU each; more than "
        "one runs on Ray); megatron: replicas = GPUs / (TP x PP x CP), torch: data-parallel "
        "replicas", ge=1,
    )  # fmt: skip
    max_tokens_per_gpu: int | None = setting(
        "--max-tokens-per-gpu", None, "micro-batch token budget (prompt and completion "
        "tokens); default 4096 on CUDA, 1024 on CPU (where a step's memory follows it and "
        "its time does not)", ge=1,
    )  # fmt: skip
    precision: Literal["fp32", "bf16-autocast", "bf16"] | None = setting(
        "--precision", None,
        "--backend torch: fp32, bf16-autocast (fp32 weights, bf16 matmuls; the CUDA "
        "default) or bf16 (bf16 weights, fp32 master copies; less activation memory, "
        "learns less per step); default fp32 on CPU. megatron: its --bf16 (always)",
    )  # fmt: skip
    gradient_checkpointing: bool | None = setting(
        "--gradient-checkpointing", None,
        "--backend torch: recompute each decoder layer in the backward (a fraction of the "
        "activation memory for a few percent more step time on CPU, none measurable with "
        "--compile on CUDA); default on. megatron: its --recompute-granularity",
    )  # fmt: skip
    compile: bool | None = setting(
        "--compile", None,
        "--backend torch on CUDA: compile each decoder layer with torch.compile (fused "
        "norms, rotary embedding and SwiGLU; the first steps compile, about a minute for "
        "a 135M model); default on CUDA, off on CPU",
    )  # fmt: skip
    qkv_format: Literal["bshd", "thd"] | None = setting(
        "--qkv-format", None, "--backend megatron: micro-batches as padded rows (bshd) or "
        "packed into one row without padding (thd; bf16; the default where it runs)",
    )  # fmt: skip
    megatron_args: list[str] = setting(
        None, default_factory=list,
        doc="megatron's own flags (--tensor-model-parallel-size ...), --backend megatron",
        flat=True,
    )  # fmt: skip

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        megatron = self.backend == "megatron"
        if self.megatron_args and not megatron:
            raise ConfigError(
                f"megatron flags ({' '.join(self.megatron_args)}) need --backend megatron"
            )
        if megatron and self.gradient_checkpointing:
            raise ConfigError(
                "--gradient-checkpointing is the torch backend's; with --backend megatron "
                "pass megatron's --recompute-granularity full --recompute-method uniform"
            )
        if megatron and self.compile:
            raise ConfigError("--compile is the torch backend's; megatron has its own kernels")
        if megatron and self.precision not in (None, "bf16"):
            raise ConfigError(
                f"--precision {self.precision}: --backend megatron trains bf16 weights with "
                "fp32 main weights (--precision bf16, or leave it out)"
            )
        if self.qkv_format == "thd" and not megatron:
            raise ConfigError("--qkv-format thd needs --backend megatron")
        return self

    def megatron_parallel(self) -> Any:
        """megatron's flags as a :class:`trainer.megatron.ParallelConfig`."""
        from trainer.megatron import parse_megatron_flags

        return parse_megatron_flags(self.megatron_args)


class PlacementConfig(Group):
    """Where the trainer ranks and the engines run on a Ray cluster (``config.placement``;
    slime's flags). Without any of them -- and one trainer rank -- a run stays in one
    process and Ray is not imported."""

    ray_address: str | None = setting(
        "--ray-address", None, "the Ray cluster: auto (the running one), HOST:PORT or "
        "ray://HOST:PORT, or local (start one for this run); default: no Ray unless the "
        "placement needs it, then Ray's own choice (a cluster running here, else a new one)",
        metavar="ADDRESS",
    )  # fmt: skip
    actor_num_nodes: int = setting(
        "--actor-num-nodes", 1, "nodes the trainer ranks span (x --actor-num-gpus-per-node "
        "ranks; more than one runs on Ray)", ge=1,
    )  # fmt: skip
    rollout_num_gpus: int | None = setting(
        "--rollout-num-gpus", None, "GPUs of the rollout engines in all, placed on Ray "
        "(engines = this / --rollout-num-gpus-per-engine); default: none placed, the engine "
        "runs as --rollout-engine says (with --colocate: the trainer's)", ge=1,
    )  # fmt: skip
    colocate: bool = setting(
        "--colocate", False, "the engines share the trainer's GPUs (they release their "
        "memory while training runs); else they get GPUs of their own",
    )  # fmt: skip
    placement_timeout: float = setting(
        "--placement-timeout", 120.0, "seconds to wait for the cluster to have the "
        "placement's resources before the run stops, saying what it asked for and what the "
        "cluster has", gt=0.0,
    )  # fmt: skip
    rollout_num_workers: int = setting(
        "--rollout-num-workers", 0, "rollout workers: CPU-only Ray actors, spread over the "
        "nodes, that run the environments and put their groups into the run's Buffer "
        "(served by the driver); 0: the episodes run in the driver", ge=0,
    )  # fmt: skip
    rollout_num_cpus_per_worker: float = setting(
        "--rollout-num-cpus-per-worker", 1.0, "CPUs each rollout worker asks Ray for", gt=0.0,
    )  # fmt: skip
    rollout_worker_resource: str | None = setting(
        "--rollout-worker-resource", None, "a custom Ray resource every rollout worker also "
        "asks for one of (e.g. sandbox: workers only on the nodes started with "
        "--resources '{\"sandbox\": N}')", metavar="NAME",
    )  # fmt: skip
    rollout_worker_retries: int = setting(
        "--rollout-worker-retries", 2, "times a part of a round is played again on another "
        "worker after its worker died (then its groups are failed samples saying so)", ge=0,
    )  # fmt: skip
    rollout_worker_max_rss_mb: float | None = setting(
        "--rollout-worker-max-rss-mb", None, "a rollout worker whose process grows beyond "
        "this many MB (an environment that leaks) is replaced after the round", gt=0.0,
        metavar="MB",
    )  # fmt: skip

    @pydantic.field_validator("ray_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None or value in ("auto", "local") or value.startswith("ray://"):
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"--ray-address must be auto, local, HOST:PORT or ray://HOST:PORT, got {value!r}"
            )
        return value


class CheckpointConfig(Group):
    """Where the run writes and what it resumes from (``config.checkpoint``)."""

    save: Path | None = setting(
        "--save", None, "directory for metrics, checkpoints (SAVE/checkpoint) and the model",
        metavar="DIR",
    )  # fmt: skip
    load: Path | None = setting(
        "--load", None, "start from this run directory's checkpoint (until --save has one; "
        "--load equal to --save starts fresh while it has none)", metavar="DIR",
    )  # fmt: skip
    save_interval: int = setting(
        "--save-interval", 10, "rollout steps between checkpoints (and one after the last; "
        "the torch backend on CUDA writes them in the background, on CPU and megatron in "
        "the step)", ge=1,
    )  # fmt: skip
    keep_checkpoints: int = setting(
        "--keep-checkpoints", 1, "checkpoints kept: the newest N (a resume needs only the "
        "newest); 0 removes the last once the run is complete and its model saved", ge=0,
    )  # fmt: skip

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        if self.load is not None and self.save is None:
            raise ConfigError("--load needs --save (where the resumed run writes)")
        return self


class EvalConfig(Group):
    """The held-out evaluation (``config.eval``)."""

    n_eval: int = setting("--n-eval", 64, "held-out tasks evaluated before/after", ge=0)
    eval_interval: int = setting(
        "--eval-interval", 0, "also evaluate every N rollout steps (0: only before and after)",
        ge=0,
    )  # fmt: skip
    eval_temperature: float = setting("--eval-temperature", 0.0, "evaluation sampling", ge=0.0)


class LoggingConfig(Group):
    """What the run writes besides ``SAVE/metrics.jsonl`` (``config.logging``)."""

    use_tensorboard: bool = setting(
        "--use-tensorboard", True, "write TensorBoard event files to SAVE/tensorboard"
    )


class TrainConfig(Group):
    """The settings of a training run (``agentenv train``; see the module docstring).

    Built from the nested form (``TrainConfig(data=DataConfig(env="arithmetic"),
    rollout=GRPOConfig(...))``, or mappings), the flat form with slime's names
    (``TrainConfig(env="arithmetic", rollout_batch_size=8)``) or a mix.
    """

    model_config = pydantic.ConfigDict(frozen=False)

    model: ModelConfig = pydantic.Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: GRPOConfig = pydantic.Field(default_factory=GRPOConfig)
    engine: EngineConfig = pydantic.Field(default_factory=EngineConfig)
    algorithm: LossConfig = pydantic.Field(default_factory=LossConfig)
    optimizer: OptimConfig = pydantic.Field(default_factory=OptimConfig)
    parallel: ParallelismConfig = pydantic.Field(default_factory=ParallelismConfig)
    placement: PlacementConfig = pydantic.Field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = pydantic.Field(default_factory=CheckpointConfig)
    eval: EvalConfig = pydantic.Field(default_factory=EvalConfig)
    logging: LoggingConfig = pydantic.Field(default_factory=LoggingConfig)

    @classmethod
    def nest(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """Settings in the nested, the flat or a mixed form, as the nested form."""
        nested = nest(values, flag_table(), set(cls.model_fields))
        nested.setdefault("data", {})  # its --env is required: say so by the flag's name
        return nested

    @pydantic.model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        return cls.nest(data) if isinstance(data, Mapping) else data

    @pydantic.model_validator(mode="after")
    def _across_groups(self) -> Self:
        # The learning rate decays over the whole run unless told otherwise.
        if self.optimizer.lr_decay_iters is None:
            steps = self.rollout.num_rollout * self.rollout.num_steps_per_rollout
            self.optimizer = self.optimizer.model_copy(update={"lr_decay_iters": steps})
        ref = self.model.ref_load
        if ref is not None and ref != self.model.hf_checkpoint and self.parallel.backend == "torch":
            raise ConfigError(
                f"--ref-load {ref!r} is a megatron reference checkpoint (--backend megatron); "
                "the torch backend's KL reference is the starting model (--hf-checkpoint "
                f"{self.model.hf_checkpoint!r}): leave --ref-load out, or pass --backend megatron"
            )
        if ref is not None and ref != self.model.hf_checkpoint and self.algorithm.kl_coef > 0:
            raise ConfigError(
                f"--ref-load {ref!r}: a reference other than the starting model "
                f"(--hf-checkpoint {self.model.hf_checkpoint!r}) is not supported yet"
            )
        if self.parallel.compile and not self.model.device.startswith("cuda"):
            raise ConfigError(
                f"--compile needs --device cuda (torch.compile's GPU kernels), "
                f"not {self.model.device!r}"
            )
        self._check_placement()
        self._check_gpus()
        self._check_tensor_sync()
        return self

    def _check_tensor_sync(self) -> None:
        """``--weight-sync tensor`` hands the weights over by handle: every server must be
        on the GPU (or CPU machine) of a trainer rank that holds all the weights."""
        engine, p = self.engine, self.placement
        if engine.weight_sync != "tensor":
            return
        if not self.uses_ray:
            server = self.server_device()
            if server is not None and server != self.model.device:
                raise ConfigError(
                    f"--weight-sync tensor hands the weights to a server on the trainer's "
                    f"device ({self.model.device}), but the server is on {server}: drop "
                    "--rollout-device, or use --weight-sync distributed or disk"
                )
            return
        if not p.colocate:
            raise ConfigError(
                "--weight-sync tensor on Ray hands each engine the weights from the trainer "
                "rank on its GPU: it needs --colocate (engines on GPUs of their own: "
                "--weight-sync distributed or disk)"
            )
        if self.parallel.backend == "megatron":
            raise ConfigError(
                "--weight-sync tensor with --backend megatron: megatron's ranks hold shards "
                "and gather the weights on rank 0, so no rank can hand them to the engine on "
                "its GPU; use --weight-sync distributed or disk"
            )
        rollout = p.rollout_num_gpus if p.rollout_num_gpus is not None else self.trainer_ranks
        if rollout > self.trainer_ranks or engine.rollout_num_gpus_per_engine > 1:
            raise ConfigError(
                f"--weight-sync tensor needs a trainer rank on every engine's GPU, one GPU "
                f"per engine: --rollout-num-gpus {rollout} (per engine "
                f"{engine.rollout_num_gpus_per_engine}) against {self.trainer_ranks} trainer "
                "GPUs; use --weight-sync disk"
            )

    def for_env(self, env: Any) -> TrainConfig:
        """These settings as a run of ``env`` (an :class:`~agentenv.Environment`) uses
        them: its ``sampling`` attribute in place of the sampling flags left at their
        defaults, the flags given winning (one rule: :func:`agentenv.resolve_sampling`,
        which warns where they disagree). What ``--dry-run`` prints and the run trains
        with (its log-probs at the temperature the rollouts then sample at)."""
        return self.model_copy(update={"rollout": self.rollout.for_env(env)})

    @property
    def trainer_ranks(self) -> int:
        """Trainer ranks in all: ``--actor-num-nodes × --actor-num-gpus-per-node``."""
        return self.placement.actor_num_nodes * self.parallel.actor_num_gpus_per_node

    @property
    def uses_ray(self) -> bool:
        """The run places its trainer ranks (and engines) on Ray: ``--ray-address``,
        ``--rollout-num-gpus``, ``--colocate`` or more than one trainer rank."""
        p = self.placement
        return (
            p.ray_address is not None
            or p.rollout_num_gpus is not None
            or p.colocate
            or p.rollout_num_workers > 0
            or self.trainer_ranks > 1
        )

    def _check_placement(self) -> None:
        """The placement flags fit each other, the layout and the engine."""
        p, engine = self.placement, self.engine
        ranks = self.trainer_ranks
        if self.parallel.backend == "megatron":
            nodes = p.actor_num_nodes
            gpus = self.parallel.actor_num_gpus_per_node
            what = f"--actor-num-gpus-per-node {gpus}"
            if nodes > 1:
                what = f"--actor-num-nodes {nodes} x {what} = {ranks} GPUs"
            try:
                self.parallel.megatron_parallel().data_parallel_size(ranks)
            except ConfigError as e:
                raise ConfigError(f"{what}: {e}") from None
        if engine.router_args and p.rollout_num_gpus is None:
            raise ConfigError(
                f"--router-* flags ({' '.join(engine.router_args)}) are for the router before "
                "engines on Ray (--rollout-num-gpus); otherwise agentenv train launches no "
                "router (point --rollout-url at a running one)"
            )
        if self.rollout.offload_rollout and not engine.embedded:
            raise ConfigError(
                "--offload-rollout is for the embedded engine (this process's); engines on "
                "Ray give their memory back with --colocate, other servers keep theirs"
            )
        if not self.uses_ray:
            return
        if p.rollout_num_workers and p.rollout_num_gpus is None and engine.rollout_url is None:
            raise ConfigError(
                f"--rollout-num-workers {p.rollout_num_workers}: the workers generate through "
                "servers they reach over the network -- engines placed on Ray "
                "(--rollout-num-gpus, behind the router) or a running server (--rollout-url)"
            )
        device = self.model.device
        if device.startswith("cuda:"):
            raise ConfigError(
                f"--device {device}: on Ray the placement picks each rank's GPU; pass "
                "--device cuda (or cpu)"
            )
        per_engine = engine.rollout_num_gpus_per_engine
        if p.rollout_num_gpus is not None:
            if p.rollout_num_gpus % per_engine:
                raise ConfigError(
                    f"--rollout-num-gpus {p.rollout_num_gpus} is not a multiple of "
                    f"--rollout-num-gpus-per-engine {per_engine}: each engine takes "
                    f"{per_engine} GPUs; pass a multiple (e.g. "
                    f"{-(-p.rollout_num_gpus // per_engine) * per_engine})"
                )
            if engine.rollout_url is not None:
                raise ConfigError(
                    "--rollout-num-gpus places engines on Ray, but --rollout-url names a "
                    "running server: pass one of them"
                )
            if engine.rollout_engine == "embedded":
                raise ConfigError(
                    "--rollout-num-gpus runs the engines as Ray actors, each a server: pass "
                    "--rollout-engine serve (agentenv serve) or sglang; the embedded engine "
                    "runs in this process"
                )
        if p.colocate and self.rollout.schedule != "sync":
            raise ConfigError(
                f"--colocate with --schedule {self.rollout.schedule}: rollouts would run "
                "while the trainer trains on the same GPUs (colocated engines release their "
                "memory for each training step); pass --schedule sync, or drop --colocate "
                "and give the engines GPUs of their own (--rollout-num-gpus)"
            )
        if p.colocate:
            given = [
                flag for flag, on in (
                    ("--rollout-device", engine.rollout_device is not None),
                    ("--rollout-url", engine.rollout_url is not None),
                    ("--sglang-base-gpu-id", engine.sglang_flag("--base-gpu-id") is not None),
                    ("--weight-sync distributed", engine.weight_sync == "distributed"),
                ) if on
            ]  # fmt: skip
            if given:
                raise ConfigError(
                    f"--colocate puts the engines on the trainer's GPUs, but {', '.join(given)} "
                    f"{'is' if len(given) == 1 else 'are'} for engines on GPUs of their own "
                    "(the weights reach colocated engines on the same GPU): drop "
                    f"{'it' if len(given) == 1 else 'them'} or --colocate"
                )

    def _check_gpus(self) -> None:
        """NCCL cannot put two ranks of a group on one GPU: a server that gets the weights
        by broadcast needs GPUs of its own."""
        engine = self.engine
        if engine.weight_sync != "distributed" or engine.rollout_url is not None:
            return
        if self.weight_sync_backend() != "nccl":
            return
        first = int(_gpu(self.model.device).removeprefix("cuda:"))
        gpus = self.parallel.actor_num_gpus_per_node
        trainer = {f"cuda:{first + i}" for i in range(gpus)}
        server = self.server_device()
        assert server is not None  # launched: known
        base = int(_gpu(server).removeprefix("cuda:"))
        shared = sorted(
            {f"cuda:{base + i}" for i in range(engine.rollout_num_gpus_per_engine)} & trainer
        )
        if shared:
            raise ConfigError(
                f"--weight-sync distributed over NCCL needs the server on a GPU of its own, "
                f"but the server is on {_gpu(server)}, one of the trainer's "
                f"({', '.join(sorted(trainer))}); set --rollout-device, e.g. "
                f"cuda:{first + gpus}"
            )

    def server_device(self) -> str | None:
        """The launched server's (first) device (``None``: a running server, not known
        here)."""
        engine = self.engine
        if engine.rollout_url is not None:
            return None
        if engine.rollout_engine == "sglang":
            # --sglang-base-gpu-id, else --rollout-device's GPU, else SGLang's default 0.
            chosen = engine.sglang_flag("--base-gpu-id")
            if chosen is not None:
                return f"cuda:{chosen}"
            return engine.rollout_device or "cuda:0"
        return engine.rollout_device or self.model.device

    def weight_sync_backend(self) -> Literal["nccl", "gloo"]:
        """NCCL when the trainer and the server are both on CUDA, else gloo."""
        server = self.server_device()
        on_cuda = self.model.device.startswith("cuda") and (
            server is None or server.startswith("cuda")
        )
        return "nccl" if on_cuda else "gloo"

    def flat(self) -> dict[str, Any]:
        """The settings as flat ``{flag key: value}`` (JSON values), slime's names."""
        nested = self.model_dump(mode="json")
        out: dict[str, Any] = {}
        for flag in flag_table().values():
            value: Any = nested
            for part in flag.path:
                value = value[part]
            out[flag.key] = (value == flag.const) if flag.is_switch else value
        return out


@functools.cache
def flag_table() -> dict[str, Flag]:
    """Every flag of :class:`TrainConfig` by its flat key (``eps_clip``)."""
    table: dict[str, Flag] = {}
    for flag in flags(TrainConfig):
        if flag.key in table:
            raise TypeError(f"two settings declare {flag.name}: {flag.path} and "
                            f"{table[flag.key].path}")  # fmt: skip
        table[flag.key] = flag
    return table


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` and its value (``flag V`` or ``flag=V``)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _gpu(device: str) -> str:
    """``cuda`` -> ``cuda:0`` (what a process without ``set_device`` uses)."""
    return "cuda:0" if device == "cuda" else device
