"""The settings of a training run (:class:`TrainConfig`, slime's flag names), validated
before anything heavy loads; ``agentenv train``'s flags are generated from it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import pydantic

__all__ = ["TrainConfig"]


class TrainConfig(pydantic.BaseModel):
    """Settings of ``agentenv train`` (slime's flag names)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    env: str = pydantic.Field(
        description="registered environment name, package.module:Class or path/file.py:Class"
    )
    env_args: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="JSON object of keyword arguments for the environment"
    )
    hf_checkpoint: str = pydantic.Field("smollm2-135m", description="model name or HF directory")
    prompt_data: Path | None = pydantic.Field(
        None, description="JSONL of training prompts (default: the environment's train split)"
    )
    input_key: str = pydantic.Field("prompt", description="the prompt's key in --prompt-data")
    label_key: str | None = pydantic.Field(
        "label", description="the answer's key in --prompt-data (the reward compares with it)"
    )
    save: Path | None = pydantic.Field(
        None, description="directory for metrics, checkpoints (SAVE/checkpoint) and the model"
    )
    save_interval: int = pydantic.Field(
        10,
        ge=1,
        description="rollout steps between checkpoints (and one after the last; written "
        "in the background)",
    )
    load: Path | None = pydantic.Field(
        None, description="start from this run directory's checkpoint (until --save has one)"
    )
    num_rollout: int = pydantic.Field(10, ge=1, description="rollout steps")
    rollout_batch_size: int = pydantic.Field(8, ge=1, description="prompts per rollout step")
    n_samples_per_prompt: int = pydantic.Field(4, ge=1, description="episodes per prompt")
    global_batch_size: int | None = pydantic.Field(
        None, ge=1, description="samples per optimizer step (default: a whole rollout)"
    )
    num_steps_per_rollout: int = pydantic.Field(1, ge=1, description="optimizer steps per rollout")
    rollout_max_response_len: int = pydantic.Field(128, ge=1, description="tokens per turn")
    rollout_temperature: float = pydantic.Field(1.0, ge=0.0, description="sampling temperature")
    rollout_seed: int = pydantic.Field(0, description="seed of task order and sampling")
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"] = (
        pydantic.Field("grpo", description="advantage estimator")
    )
    eps_clip: float = pydantic.Field(0.2, ge=0.0, description="lower clip of the ratio")
    eps_clip_high: float | None = pydantic.Field(
        None, ge=0.0, description="upper clip of the ratio (default: --eps-clip)"
    )
    entropy_coef: float = pydantic.Field(0.0, ge=0.0, description="entropy bonus weight")
    use_kl_loss: bool = pydantic.Field(
        False, description="penalise KL to the starting model (loads a frozen copy)"
    )
    kl_loss_coef: float = pydantic.Field(0.0, ge=0.0, description="weight of the KL penalty")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = pydantic.Field(
        "low_var_kl", description="KL estimator"
    )
    calculate_per_token_loss: bool = pydantic.Field(
        False, description="average the loss over tokens instead of samples"
    )
    use_tis: bool = pydantic.Field(False, description="truncated importance sampling")
    lr: float = pydantic.Field(1e-6, gt=0.0, description="learning rate")
    weight_decay: float = pydantic.Field(0.0, ge=0.0, description="AdamW weight decay")
    adam_beta1: float = pydantic.Field(0.9, ge=0.0, lt=1.0, description="Adam beta1")
    adam_beta2: float = pydantic.Field(0.98, ge=0.0, lt=1.0, description="Adam beta2")
    clip_grad: float = pydantic.Field(1.0, ge=0.0, description="gradient norm clip (0: off)")
    optimizer: Literal["adam", "sgd"] = pydantic.Field("adam", description="optimizer")
    lr_decay_style: Literal["constant", "linear", "cosine"] = pydantic.Field(
        "constant", description="learning-rate decay from --lr to --min-lr"
    )
    lr_warmup_iters: int = pydantic.Field(0, ge=0, description="optimizer steps of warm-up")
    lr_decay_iters: int | None = pydantic.Field(
        None, ge=1, description="optimizer steps of the decay (default: the whole run)"
    )
    min_lr: float = pydantic.Field(0.0, ge=0.0, description="the decay's final learning rate")
    adam_eps: float = pydantic.Field(1e-8, gt=0.0, description="Adam epsilon")
    use_dynamic_batch_size: bool = pydantic.Field(
        True, description="pack micro-batches by --max-tokens-per-gpu (always on)"
    )
    max_tokens_per_gpu: int = pydantic.Field(4096, ge=1, description="micro-batch token budget")
    backend: Literal["torch", "megatron"] = pydantic.Field("torch", description="trainer backend")
    precision: Literal["fp32", "bf16-autocast", "bf16"] | None = pydantic.Field(
        None,
        description="--backend torch: fp32, bf16-autocast (fp32 weights, bf16 matmuls; the "
        "CUDA default) or bf16 (bf16 weights, fp32 master copies; less activation memory, "
        "learns less per step); default fp32 on CPU. megatron: its --bf16 (always)",
    )
    gradient_checkpointing: bool | None = pydantic.Field(
        None,
        description="--backend torch: recompute each decoder layer in the backward (a "
        "fraction of the activation memory; about a third more training compute, none "
        "measurable with --compile); default on CUDA, off on CPU. megatron: its "
        "--recompute-granularity",
    )
    compile: bool | None = pydantic.Field(
        None,
        description="--backend torch on CUDA: compile each decoder layer with torch.compile "
        "(fused norms, rotary embedding and SwiGLU; the first steps compile, about a minute "
        "for a 135M model); default on CUDA, off on CPU",
    )
    qkv_format: Literal["bshd", "thd"] | None = pydantic.Field(
        None,
        description="--backend megatron: micro-batches as padded rows (bshd) or packed "
        "into one row without padding (thd; bf16; the default where it runs)",
    )
    actor_num_gpus_per_node: int = pydantic.Field(
        1,
        ge=1,
        description="--backend megatron: GPUs to train on (device, device+1, ...); "
        "replicas = GPUs / (TP x PP)",
    )
    schedule: Literal["sync", "one_step_off", "async"] = pydantic.Field(
        "sync", description="sync, one_step_off (rollout overlaps training) or async"
    )
    max_staleness: int = pydantic.Field(
        1, ge=0, description="async: oldest policy version a batch may hold, behind the trainer"
    )
    over_sampling_batch_size: int | None = pydantic.Field(
        None, ge=1, description="prompts started per round (>= --rollout-batch-size)"
    )
    dynamic_sampling_filter_path: str | None = pydantic.Field(
        None,
        description="group filter, module:function or module.function (samples -> keep?); "
        "'agentenv.buffer.RewardStdFilter' drops groups with equal rewards",
    )
    rollout_shuffle: bool = pydantic.Field(True, description="reshuffle tasks at each pass")
    apply_chat_template: bool = pydantic.Field(
        True, description="render prompts with the model's chat template (else raw text)"
    )
    apply_chat_template_kwargs: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description='JSON object of chat-template arguments, e.g. {"enable_thinking": false}',
    )
    rollout_engine: Literal["embedded", "serve", "sglang"] = pydantic.Field(
        "embedded",
        description="embedded (in this process), serve (an agentenv serve process) or "
        "sglang (python -m sglang.launch_server with the --sglang-* flags)",
    )
    rollout_url: str | None = pydantic.Field(
        None, description="use this running server (SGLang or agentenv serve) for rollouts"
    )
    rollout_max_running: int = pydantic.Field(
        128,
        ge=1,
        description="embedded/serve engine: requests decoded in one batch (and episodes in flight)",
    )
    sglang_server_concurrency: int = pydantic.Field(
        512,
        ge=1,
        description="SGLang servers (--rollout-engine sglang, --rollout-url): episodes in "
        "flight per server (slime's flag; behind a router, times its workers)",
    )
    rollout_device: str | None = pydantic.Field(
        None,
        description="the launched/embedded engine's device (default: --device; SGLang: "
        "cuda:N sets --base-gpu-id N)",
    )
    weight_sync: Literal["disk", "distributed"] = pydantic.Field(
        "disk",
        description="how servers get the weights: disk (/update_weights_from_disk, a shared "
        "filesystem) or distributed (broadcast over NCCL on CUDA, gloo on CPU)",
    )
    update_weight_buffer_size: int = pydantic.Field(
        512 << 20, ge=1, description="--weight-sync distributed: bytes per broadcast bucket"
    )
    weight_sync_master_address: str = pydantic.Field(
        "127.0.0.1",
        description="--weight-sync distributed: this machine's address as the servers reach it",
    )
    use_tensorboard: bool = pydantic.Field(
        True, description="write TensorBoard event files to SAVE/tensorboard"
    )
    sglang_args: list[str] = pydantic.Field(
        default_factory=list, description="flags for SGLang (from --sglang-* on the command line)"
    )
    megatron_args: list[str] = pydantic.Field(
        default_factory=list,
        description="megatron's own flags (--tensor-model-parallel-size ...), --backend megatron",
    )
    n_eval: int = pydantic.Field(64, ge=0, description="held-out tasks evaluated before/after")
    eval_interval: int = pydantic.Field(
        0, ge=0, description="also evaluate every N rollout steps (0: only before and after)"
    )
    eval_temperature: float = pydantic.Field(0.0, ge=0.0, description="evaluation sampling")
    device: str = pydantic.Field("cpu", description="cpu, cuda or cuda:N")

    @pydantic.model_validator(mode="after")
    def _clips(self) -> TrainConfig:
        if self.use_kl_loss and self.kl_loss_coef <= 0:
            raise ValueError("--use-kl-loss needs --kl-loss-coef > 0")
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            raise ValueError(
                f"--eps-clip-high ({self.eps_clip_high}) must be >= --eps-clip ({self.eps_clip})"
            )
        if not self.use_dynamic_batch_size:
            raise ValueError(
                "--no-use-dynamic-batch-size: micro-batches are always packed by "
                "--max-tokens-per-gpu (set it to the batch you want)"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        # --sglang-api-key (SGLang's --api-key) is the key of whichever server rolls out.
        others = _without_flag(self.sglang_args, "--api-key")
        if others and self.rollout_engine != "sglang":
            raise ValueError(f"--sglang-* flags ({' '.join(others)}) need --rollout-engine sglang")
        if (
            self.sglang_flag("--api-key") is not None
            and self.rollout_url is None
            and self.rollout_engine == "embedded"
        ):
            raise ValueError(
                "--sglang-api-key is the rollout servers' key: it needs --rollout-engine "
                "serve or sglang, or --rollout-url; the embedded engine takes none"
            )
        if self.megatron_args:
            if self.backend != "megatron":
                raise ValueError(
                    f"megatron flags ({' '.join(self.megatron_args)}) need --backend megatron"
                )
            from trainer.megatron import parse_megatron_flags

            parallel = parse_megatron_flags(self.megatron_args)  # before anything loads
            parallel.data_parallel_size(self.actor_num_gpus_per_node)
        if self.backend == "megatron" and self.gradient_checkpointing:
            raise ValueError(
                "--gradient-checkpointing is the torch backend's; with --backend megatron "
                "pass megatron's --recompute-granularity full --recompute-method uniform"
            )
        if self.backend == "megatron" and self.compile:
            raise ValueError("--compile is the torch backend's; megatron has its own kernels")
        if self.compile and not self.device.startswith("cuda"):
            raise ValueError(
                f"--compile needs --device cuda (torch.compile's GPU kernels), not {self.device!r}"
            )
        if self.backend == "megatron" and self.precision not in (None, "bf16"):
            raise ValueError(
                f"--precision {self.precision}: --backend megatron trains bf16 weights with "
                "fp32 main weights (--precision bf16, or leave it out)"
            )
        if self.qkv_format == "thd" and self.backend != "megatron":
            raise ValueError("--qkv-format thd needs --backend megatron")
        if self.actor_num_gpus_per_node > 1 and self.backend != "megatron":
            raise ValueError(
                "--actor-num-gpus-per-node > 1 needs --backend megatron (the torch backend "
                "trains on one device)"
            )
        url = self.rollout_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"--rollout-url must start with http:// or https://, got {url!r}")
        if self.weight_sync == "distributed":
            self._check_distributed()
        return self

    def _check_distributed(self) -> None:
        if self.rollout_url is None and self.rollout_engine == "embedded":
            raise ValueError(
                "--weight-sync distributed needs servers (--rollout-engine serve or sglang, "
                "or --rollout-url); the embedded engine gets the weights in this process"
            )
        if self.weight_sync_backend() != "nccl" or self.rollout_url is not None:
            return
        # NCCL cannot put two ranks of a group on one GPU: the server needs its own.
        server = self.server_device()
        first = int(_gpu(self.device).removeprefix("cuda:"))
        gpus = self.actor_num_gpus_per_node if self.backend == "megatron" else 1
        trainer = {f"cuda:{first + i}" for i in range(gpus)}
        if server is not None and _gpu(server) in trainer:
            raise ValueError(
                f"--weight-sync distributed over NCCL needs the server on a GPU of its own, "
                f"but the server is on {_gpu(server)}, one of the trainer's "
                f"({', '.join(sorted(trainer))}); set --rollout-device, e.g. "
                f"cuda:{first + gpus}"
            )

    def server_device(self) -> str | None:
        """The launched server's device (``None``: a running server, not known here)."""
        if self.rollout_url is not None:
            return None
        if self.rollout_engine == "sglang":
            # --sglang-base-gpu-id, else --rollout-device's GPU, else SGLang's default 0.
            chosen = self.sglang_base_gpu()
            if chosen is not None:
                return f"cuda:{chosen}"
            return self.rollout_device or "cuda:0"
        return self.rollout_device or self.device

    def sglang_base_gpu(self) -> str | None:
        """``--base-gpu-id`` among the ``--sglang-*`` flags, if given."""
        return self.sglang_flag("--base-gpu-id")

    def sglang_flag(self, flag: str) -> str | None:
        """The value of SGLang's ``flag`` (``--sglang-X`` on the command line), if given."""
        args = self.sglang_args
        for i, arg in enumerate(args):
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
        return None

    def rollout_api_key(self) -> str | None:
        """The rollout servers' API key: ``--sglang-api-key`` (SGLang's ``--api-key``,
        handed to a launched SGLang as usual, to a launched ``agentenv serve`` too, and
        sent to ``--rollout-url``), else ``$AGENTENV_API_KEY``."""
        return self.sglang_flag("--api-key") or os.environ.get("AGENTENV_API_KEY") or None

    def weight_sync_backend(self) -> Literal["nccl", "gloo"]:
        """NCCL when the trainer and the server are both on CUDA, else gloo."""
        server = self.server_device()
        on_cuda = self.device.startswith("cuda") and (server is None or server.startswith("cuda"))
        return "nccl" if on_cuda else "gloo"


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
