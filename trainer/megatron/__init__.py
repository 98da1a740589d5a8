"""The megatron-core backend: Llama- and Qwen2-architecture models on megatron-core, used
as a library (unmodified), with megatron's own parallelism flags.

What works without megatron (pure Python and tensor code, tested on CPU):
:class:`MegatronModelConfig` maps an HF config; :func:`hf_to_megatron` /
:func:`megatron_to_hf` convert weights, sharded for tensor and pipeline parallelism;
:func:`export_hf` writes an HF safetensors directory for ``/update_weights_from_disk``;
:func:`parse_megatron_flags` reads the parallelism flags.

What needs megatron-core (``pip install 'agentenv[megatron]'``; imported lazily, only in
this package): :func:`model_provider`, :func:`load_weights`, :func:`megatron_args` and
:func:`vocab_parallel_logprobs`. Without it they raise
:class:`MegatronNotInstalledError`.

    cfg = MegatronModelConfig.from_hf("path/to/hf", tensor_model_parallel_size=2)
    model = model_provider(cfg, bf16=True, params_dtype=torch.bfloat16)()
    load_weights(model, hf_to_megatron(load_hf_weights("path/to/hf"), cfg, tp_rank=rank))

:class:`MegatronBackend` wires three parts: :func:`resolve_options` (checked
:class:`MegatronOptions`) and the set-up of one rank, :class:`MegatronWorker` (one rank's
step), and the ranks behind the :class:`Ranks` protocol (:class:`LocalRanks`: one GPU, in
this process; :class:`trainer.distributed.RankGroup`: one Ray actor per GPU; another
:data:`Launcher` may run them elsewhere).
"""

from trainer.distributed import LocalRanks, Ranks, Rendezvous
from trainer.megatron._backend import Launcher, MegatronBackend, launch_ranks, ray_launcher
from trainer.megatron._config import SUPPORTED_ARCHITECTURES, MegatronModelConfig, padded_vocab_size
from trainer.megatron._convert import (
    hf_to_megatron,
    hf_to_megatron_shards,
    hf_weight_shapes,
    megatron_to_hf,
    megatron_weight_shapes,
)
from trainer.megatron._errors import EXTRA, MegatronNotInstalledError, WeightShapeError
from trainer.megatron._export import export_hf, load_hf_weights, save_hf_weights
from trainer.megatron._flags import (
    MEGATRON_FLAGS,
    ParallelConfig,
    megatron_args,
    parse_megatron_flags,
)
from trainer.megatron._logprobs import mask_vocab_padding, vocab_parallel_logprobs
from trainer.megatron._provider import (
    default_transformer_impl,
    layer_spec,
    load_weights,
    model_provider,
    require_megatron,
    transformer_config,
)
from trainer.megatron._setup import MegatronOptions, resolve_options
from trainer.megatron._worker import MegatronWorker

__all__ = [
    "EXTRA",
    "MEGATRON_FLAGS",
    "SUPPORTED_ARCHITECTURES",
    "Launcher",
    "LocalRanks",
    "MegatronBackend",
    "MegatronModelConfig",
    "MegatronNotInstalledError",
    "MegatronOptions",
    "MegatronWorker",
    "ParallelConfig",
    "Ranks",
    "Rendezvous",
    "WeightShapeError",
    "default_transformer_impl",
    "export_hf",
    "hf_to_megatron",
    "hf_to_megatron_shards",
    "hf_weight_shapes",
    "launch_ranks",
    "layer_spec",
    "load_hf_weights",
    "load_weights",
    "mask_vocab_padding",
    "megatron_args",
    "megatron_to_hf",
    "megatron_weight_shapes",
    "model_provider",
    "padded_vocab_size",
    "parse_megatron_flags",
    "ray_launcher",
    "require_megatron",
    "resolve_options",
    "save_hf_weights",
    "transformer_config",
    "vocab_parallel_logprobs",
]
