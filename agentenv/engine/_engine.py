"""The embedded engine: continuous batching over :class:`~agentenv.engine._model.LlamaModel`.

:class:`Engine` is a :class:`~agentenv.Generator` with SGLang's semantics that runs
in-process on CPU or CUDA. Each step prefills the requests that arrived (batched, each
yielding its first token), then advances every running request by one token in one batched
forward (a replayed CUDA graph on CUDA); a finished request leaves at once. All model work
runs on one thread of the engine's own (``_thread.py``), so the event loop stays free for
the HTTP server and the environments. What it does for an RL loop (abort, pause, weight
updates, admission, retraction, the prefix cache): docs/inference.md, "The embedded
engine". ::

    async with Engine("smollm2-135m") as engine:
        completion = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentenv._errors import ClosedResourceError, ConfigError, ContextLengthError, GenerationError
from agentenv._generator import Completion, CompletionBuilder, FinishReason, SamplingParams
from agentenv.engine._memory import release_freed_memory
from agentenv.engine._model import (
    KEY_BLOCK,
    MIN_ROWS,
    LlamaModel,
    Prefill,
    read_safetensors,
    round_up,
)
from agentenv.engine._models import resolve_model
from agentenv.engine._pool import KVPool, bytes_per_token
from agentenv.engine._radix import Node, RadixCache
from agentenv.engine._sampler import SampleRow, sample
from agentenv.engine._thread import ModelThread
from agentenv.engine._threads import use_torch_threads

__all__ = ["CPU_POOL_TOKENS", "Engine", "EngineChunk"]

# The key/value pool on CPU when no budget is given: SmolLM2-135M's context, 360 MiB at
# float32 (its pages are touched, and count in the RSS, only as tokens are written).
CPU_POOL_TOKENS = 8192
# Admission keeps free this fraction of each running request's remaining tokens; it decays
# by the step while nothing is retracted and rises by a step on each retraction.
NEW_TOKEN_RATIO = 0.7
MIN_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
NEW_TOKEN_RATIO_STEP = 0.2

T = TypeVar("T")

log = logging.getLogger("agentenv.engine")


@dataclasses.dataclass(slots=True)
class EngineChunk:
    """Tokens one step added to a request (the last chunk has ``finish_reason``)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    weight_version: str
    cached_tokens: int = 0  # prompt tokens whose keys and values were copied, not computed
    error: str | None = None  # the engine failed on this request (the last chunk)


@dataclasses.dataclass(eq=False, slots=True)
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    seed: int
    out: MemoryObjectSendStream[EngineChunk]
    output: list[int] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    aborted: str | None = None
    # Tokens produced in the current step, not yet delivered.
    new_ids: list[int] = dataclasses.field(default_factory=list)
    new_lps: list[float] = dataclasses.field(default_factory=list)
    # False: the caller wants the whole completion only; chunks are held until it ends
    # (one per weight version), sparing a wake-up per token.
    streaming: bool = True
    held: list[EngineChunk] = dataclasses.field(default_factory=list)
    cached: int = 0
    error: str | None = None
    # Pool slots of the positions whose keys and values are in the pool (all but the
    # last token's while it runs; one reference each), and the prefix-cache node it locks.
    slots: list[int] = dataclasses.field(default_factory=list)
    node: Node | None = None
    tree: RadixCache | None = None
    admitted: bool = False  # prefilled once (a retracted request resumes without sampling)
    ready: int = 0  # leading positions whose keys and values were in the pool at admission
    copy_of: _Request | None = None  # the same prompt admitted in the same step

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def kv_tokens(self) -> list[int]:
        """The tokens whose keys and values the pool must hold before its next step."""
        if not self.admitted:
            return self.prompt
        return (self.prompt + self.output)[:-1]


class Engine:
    """A continuous-batching engine for one Llama-family model.

    Args:
        model: a model name (``smollm2-135m``) or a local Hugging Face model directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: weights and activations; default float32 on CPU, bfloat16 on CUDA.
        residual_dtype: the embeddings, norms and residual stream (default: ``dtype``);
            ``dtype=bfloat16, residual_dtype=float32`` samples from what an fp32 model
            computes under bf16 autocast (:mod:`agentenv.engine._model`).
        max_running: requests in the batch at once; more wait for a free place.
        context_length: longest prompt + completion (default: the model's).
        weight_version: the version reported with every token until the next update.
        tokenizer: for stop strings; default ``tokenizer.json`` beside the weights.
        cuda_graphs: on CUDA, replay captured graphs for decode steps (SGLang's default
            too); ``False`` runs every step eagerly.
        prefill_tokens: prompt tokens per prefill forward (newcomers are packed together).
        max_total_tokens: tokens the key/value pool holds, all requests and the prefix
            cache together (SGLang's ``--max-total-tokens``); default on CPU
            :data:`CPU_POOL_TOKENS`, on CUDA what ``mem_fraction_static`` leaves.
        mem_fraction_static: on CUDA, the fraction of the GPU's memory for the weights and
            the pool together (SGLang's ``--mem-fraction-static``, default 0.88); what is
            in use already at start (weights, another process) counts against it.
        prefix_cache: keep finished requests' keys and values in a radix tree and reuse
            them for prompts that start the same (SGLang's radix cache; on by default).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        residual_dtype: torch.dtype | None = None,
        max_running: int = 128,
        context_length: int | None = None,
        weight_version: str = "default",
        tokenizer: Any = None,
        cuda_graphs: bool = True,
        prefill_tokens: int = 8192,
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        prefix_cache: bool = True,
    ) -> None:
        if max_running < 1:
            raise ConfigError(f"max_running must be at least 1, got {max_running}")
        if max_total_tokens is not None and max_total_tokens < 2:
            raise ConfigError(f"max_total_tokens must be at least 2, got {max_total_tokens}")
        if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
        self.prefix_cache = prefix_cache
        self.model_path = resolve_model(str(model))
        self.device = device
        self.dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        self.residual_dtype = residual_dtype or self.dtype
        self._thread = ModelThread()
        try:
            # First on the model thread: its torch threads, before any work starts their team.
            self._thread.call(use_torch_threads, "engine")
            if torch.device(device).index is not None:  # cuda:N: the model thread's device
                self._thread.call(torch.cuda.set_device, torch.device(device))
            path, dtype, residual = self.model_path, self.dtype, self.residual_dtype
            self.model = self._thread.call(
                lambda: LlamaModel.load(path, dtype=dtype, device=device, residual_dtype=residual)
            )
            config = self.model.config
            context = min(
                context_length or config.max_position_embeddings, config.max_position_embeddings
            )
            per_token = bytes_per_token(config, self.dtype)
            tokens = max_total_tokens
            if tokens is None:  # more than every row at the full context would stay unused
                tokens = min(
                    self._pool_budget(per_token, mem_fraction_static), max_running * context
                )
            if context_length is not None and tokens < context:
                raise ConfigError(
                    f"the key/value pool holds {tokens} tokens ({tokens * per_token / 2**20:.0f} "
                    f"MiB at {per_token} bytes a token), fewer than one request of the context "
                    f"length {context}: raise max_total_tokens (--max-total-tokens) to at least "
                    f"{context}, or lower context_length (--context-length) to {tokens} or less"
                )
            self.context_length = min(context, tokens)
            self.max_total_tokens = tokens
            self._pool_rows = max(max_running, MIN_ROWS)
            self.pool = self._thread.call(self._new_pool)
            self.tree = RadixCache(self.pool)
            self._thread.call(self.model._rope_table, round_up(self.context_length, KEY_BLOCK))
            self.max_running = max_running
            self.weight_version = weight_version
            if tokenizer is None:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_file(str(Path(self.model_path) / "tokenizer.json"))
            self.tokenizer = tokenizer
            if cuda_graphs and self.model.device.type == "cuda":
                from agentenv.engine._graphs import DecodeGraphs

                self.model.graphs = DecodeGraphs(self.model, max_running, self.context_length)
        except BaseException:
            self._thread.close()
            raise
        self.prefill_tokens = prefill_tokens
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._by_rid: dict[str, _Request] = {}
        self._wake = anyio.Event()
        self._step_lock = anyio.Lock()  # a step, or a weight update, at a time
        self._paused = False
        self._resumed = anyio.Event()
        self._closed = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        # Finished on the model thread outside the running batch: sent by `_deliver`.
        self._dropped: list[_Request] = []
        self._looping = False
        self.steps = 0
        self._released: frozenset[str] = frozenset()
        self._graphs_freed = False
        # Admission reserves this fraction of each running request's remaining tokens
        # (SGLang's new_token_ratio: decays while nothing is retracted, rises on a retract).
        self._ratio = NEW_TOKEN_RATIO
        self.retractions = 0
        self._retracted: list[_Request] = []  # out of the batch, back to the queue next
        self.prefill_computed = 0  # prompt tokens whose keys and values were computed
        self.prefill_cached = 0  # prompt tokens taken from the prefix cache or a group copy

    def _pool_budget(self, per_token: int, fraction: float | None) -> int:
        """Tokens of the default pool: :data:`CPU_POOL_TOKENS` on CPU; on CUDA what
        ``fraction`` of the GPU's memory leaves after what is in use."""
        if self.model.device.type != "cuda":
            return CPU_POOL_TOKENS
        free, total = self._thread.call(torch.cuda.mem_get_info, self.model.device)
        fraction = fraction or 0.88
        budget = int(fraction * total) - (total - free)
        tokens = budget // per_token
        if tokens < 2:
            raise ConfigError(
                f"mem_fraction_static {fraction} of the GPU's {total / 2**30:.1f} GiB leaves "
                f"{budget / 2**30:.2f} GiB for the key/value pool with "
                f"{(total - free) / 2**30:.1f} GiB in use: raise mem_fraction_static "
                "(--mem-fraction-static) or set max_total_tokens (--max-total-tokens)"
            )
        return int(tokens)

    def _new_pool(self) -> KVPool:
        return KVPool(
            self.model.config,
            self.max_total_tokens,
            self._pool_rows,
            round_up(self.context_length, KEY_BLOCK),
            self.dtype,
            self.device,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._loop)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort what runs and stop; later calls raise :class:`ClosedResourceError`."""
        if self._closed:
            return
        self._closed = True
        for req in [*self._waiting, *self._running]:
            req.aborted = req.aborted or "engine closed"
        self._finish_aborted(self._waiting)
        self._waiting.clear()
        self._wake.set()
        self._resumed.set()
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        await self._thread.aclose()
        for req in self._running:
            req.aborted = req.aborted or "engine closed"
        self._finish_aborted(self._running)
        self._running.clear()

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1``."""
        return self.model.config.vocab_size

    def check(self, input_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise what :meth:`generate` would raise at once for this prompt and these
        parameters (:class:`ConfigError`, :class:`ContextLengthError`), without running it."""
        ids = input_ids
        if not ids:
            raise ConfigError("input_ids cannot be empty.")
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if type(t) is not int or not 0 <= t < vocab)
            raise ConfigError(f"input_ids must be token ids in [0, {vocab}), got {bad!r}")
        params.verify()
        if any(t >= vocab for t in params.stop_token_ids):
            bad = next(t for t in params.stop_token_ids if t >= vocab)
            raise ConfigError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad}")
        # A context cut to the pool's size says so (the pool holds one request at least).
        pool = (
            f" The key/value pool holds {self.max_total_tokens} tokens in all "
            "(raise --max-total-tokens for longer requests)."
            if self.context_length == self.max_total_tokens
            and self.context_length < self.model.config.max_position_embeddings
            else ""
        )
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens).{pool}"
            )
        if len(ids) + params.max_new_tokens > self.context_length:
            raise ContextLengthError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of "
                f"{len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the input "
                f"messages and {params.max_new_tokens} tokens for the completion.{pool}"
            )

    # -- requests --------------------------------------------------------------------------
    def _submit(
        self, input_ids: Sequence[int], params: SamplingParams, rid: str | None, streaming: bool
    ) -> tuple[_Request, MemoryObjectReceiveStream[EngineChunk]]:
        if self._closed:
            raise ClosedResourceError("the engine is closed")
        if self._tg is None:
            raise ConfigError("use the engine inside `async with Engine(...)`")
        if self._released:
            raise GenerationError(
                f"the engine's memory is released ({', '.join(sorted(self._released))}); "
                "resume it (resume_memory) before generating"
            )
        if not self.model.has_weights:
            raise GenerationError(
                "the engine's weights were released and not loaded again: update its weights "
                "(update_weights, /update_weights_from_disk or _from_tensor) before generating"
            )
        ids = list(input_ids)
        self.check(ids, params)
        rid = rid or uuid.uuid4().hex
        if rid in self._by_rid:
            raise ConfigError(f"request id {rid!r} is already running")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.model.config.eos_token_ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        send, receive = anyio.create_memory_object_stream[EngineChunk](math.inf)
        req = _Request(rid, ids, params, frozenset(stops), seed, send, streaming=streaming)
        self._by_rid[rid] = req
        self._waiting.append(req)
        self._wake.set()
        return req, receive

    async def stream(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> AsyncIterator[EngineChunk]:
        """Generate, yielding the tokens of every step as they come."""
        async for chunk in self._chunks(input_ids, params, rid, streaming=True):
            yield chunk

    async def _chunks(
        self, input_ids: Sequence[int], params: SamplingParams, rid: str | None, streaming: bool
    ) -> AsyncIterator[EngineChunk]:
        req, receive = self._submit(input_ids, params, rid, streaming)
        try:
            async with receive:
                async for chunk in receive:
                    if chunk.error is not None:
                        raise GenerationError(chunk.error)
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        finally:
            if req.finish is None:  # the caller left early: stop generating for it
                req.aborted = "the client went away"
                self._wake.set()

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> Completion:
        """Generate a continuation of ``input_ids`` (the :class:`~agentenv.Generator` call)."""
        parts = CompletionBuilder(self.weight_version)
        finish: FinishReason | None = None
        cached = 0
        async for chunk in self._chunks(input_ids, params, rid, streaming=False):
            parts.add(chunk.output_ids, chunk.logprobs, chunk.weight_version)
            finish, cached = chunk.finish_reason, chunk.cached_tokens
        assert finish is not None
        return parts.build(
            finish, prompt_tokens=len(input_ids), cached_tokens=cached, logprobs=return_logprob
        )

    def abort(self, rid: str | None = None, *, all: bool = False) -> None:
        """Abort ``rid`` (a no-op if unknown), or every request; each returns what it has
        with ``finish_reason.type == "abort"``."""
        if all:
            targets = list(self._by_rid.values())
        else:
            targets = [self._by_rid[rid]] if rid is not None and rid in self._by_rid else []
        for req in targets:
            req.aborted = req.aborted or "Aborted"
        waiting = [r for r in self._waiting if r.aborted]
        if waiting:
            self._waiting = [r for r in self._waiting if not r.aborted]
            for r in waiting:
                r.aborted = "Abort in waiting queue"
            self._finish_aborted(waiting)
        self._wake.set()

    @property
    def healthy(self) -> bool:
        """Whether the scheduler loop runs (inside ``async with``, until closed)."""
        return self._looping and not self._closed

    @property
    def running(self) -> int:
        """Requests generating or waiting to."""
        return len(self._by_rid)

    @property
    def waiting(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self._waiting)

    # -- pause and weights -----------------------------------------------------------------
    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> None:
        """Stop generating. ``abort`` ends every request (partial output, finish abort);
        ``retract`` and ``in_place`` keep them, to continue after :meth:`resume` (this
        engine keeps their cache in both modes)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"mode must be abort, retract or in_place, got {mode!r}")
        self._paused = True
        self._resumed = anyio.Event()
        if mode == "abort":
            self.abort(all=True)
        async with self._step_lock:  # the step in progress finishes first
            if mode == "abort":
                self._finish_aborted(self._running)
                self._compact()

    async def resume(self) -> None:
        """Continue after :meth:`pause`."""
        self._paused = False
        self._resumed.set()
        self._wake.set()

    @property
    def released(self) -> frozenset[str]:
        """The memory given back with :meth:`release_memory` and not yet resumed (empty
        while the engine can generate)."""
        return self._released

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Give memory back while something else (the trainer) uses the device: SGLang's
        ``/release_memory_occupation``, ``tags`` (default: all) of ``kv_cache``,
        ``cuda_graph`` and ``weights`` (kept in place on CUDA, freed on CPU until the next
        full weight update); what each frees and what is refused meanwhile:
        docs/inference.md, "Colocated training". Refused while requests run."""
        chosen = _memory_tags(tags)
        if self._by_rid:
            raise ConfigError(
                f"{len(self._by_rid)} requests are running; memory can be released only when "
                "the engine is idle (pause generation with mode abort, or let them finish)"
            )
        async with self._step_lock:
            await self._on_thread(self._free, chosen)
            self._released = self._released | chosen

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Take back what :meth:`release_memory` gave (``tags``, default all): SGLang's
        ``/resume_memory_occupation``. Resuming what is not released is a no-op."""
        chosen = _memory_tags(tags) & self._released
        async with self._step_lock:
            if chosen:
                await self._on_thread(self._restore, chosen)
            self._released = self._released - chosen

    def _free(self, tags: frozenset[str]) -> None:
        if "kv_cache" in tags and self.pool.kv.numel():
            self._drop_tree()  # the cached keys and values go with the pool
            self.pool.kv = torch.empty(0, dtype=self.dtype, device=self.device)
        if "cuda_graph" in tags and self.model.graphs is not None:
            self.model.graphs = None
            self._graphs_freed = True
        if "weights" in tags and self.model.device.type == "cpu" and self.model.has_weights:
            self.weight_shapes()  # kept: an update is checked against them
            self.model.drop_weights()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()

    def _restore(self, tags: frozenset[str]) -> None:
        if "kv_cache" in tags and not self.pool.kv.numel():
            self.pool = self._new_pool()
            self.tree = RadixCache(self.pool)
        if "cuda_graph" in tags and self._graphs_freed:
            from agentenv.engine._graphs import DecodeGraphs

            self.model.graphs = DecodeGraphs(self.model, self.max_running, self.context_length)
            self._graphs_freed = False

    def _drop_tree(self) -> None:
        """Forget every cached prefix: a new, empty tree (requests that locked nodes of the
        old one unlock them there, and never insert into the new one)."""
        self.tree.drop()
        self.tree = RadixCache(self.pool)

    def _invalidate(self) -> None:
        """After new weights (on the model thread, between steps): no key or value computed
        with the old ones is used again. The prefix cache is dropped, and every running
        request is retracted: it waits at the head of the queue and, resumed, recomputes
        its prompt and output so far with the new weights before its next token."""
        self._drop_tree()
        live = [r for r in self._running if r.finish is None]
        self._retracted.extend(live)
        self._retract(live)

    async def flush_cache(self) -> bool:
        """Drop the prefix cache (SGLang's ``/flush_cache``); refused (``False``) while
        requests run or wait, as SGLang refuses it."""
        async with self._step_lock:
            if self._by_rid:
                return False
            await self._on_thread(self._drop_tree)
            return True

    @property
    def cached_tokens(self) -> int:
        """Tokens the prefix cache holds now."""
        return self.tree.size

    async def update_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None = None,
        partial: bool = False,
    ) -> None:
        """Install HF-named weights between two steps; tokens after it carry the new version.

        ``partial``: ``tensors`` may be any subset of the weights (a bucket of a distributed
        update), the others keep their values; otherwise every weight must be there."""
        install = self.model.update_weights if partial else self.model.set_weights
        async with self._step_lock:
            await self._on_thread(self._install, install, dict(tensors))
            self._requeue()
            if weight_version is not None:
                self.weight_version = weight_version

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF-named weight the model takes, with its shape (to check an update)."""
        if self._shapes is None:  # an update keeps the shapes
            self._shapes = self.model.weight_shapes()
        return self._shapes

    async def update_weights_from_disk(
        self, path: str | Path, *, weight_version: str | None = None
    ) -> None:
        """Load every weight from an HF-format directory (safetensors) between two steps.

        The files are read in a worker thread while generation goes on (regular files only,
        checked whole before any data is read, never mapped: see
        :func:`~agentenv.engine._model.read_safetensors`), then installed at once."""
        directory = Path(path)
        if not await anyio.Path(directory).is_dir():
            raise ConfigError(f"model_path {str(path)!r} is not a directory")
        read = functools.partial(read_safetensors, directory, self.weight_shapes())
        tensors = await anyio.to_thread.run_sync(read)
        await self.update_weights(tensors, weight_version=weight_version)

    def _install(self, install: Callable[[Any], None], weights: Any) -> None:
        try:
            install(weights)
        finally:  # a refused update changed nothing, but a failed one may have
            self._invalidate()

    def _requeue(self) -> None:
        """Retracted requests back at the head of the queue (on the event loop)."""
        if self._retracted:
            back, self._retracted = self._retracted, []
            self._waiting = back + self._waiting
            self._wake.set()

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise ClosedResourceError("the engine is closed")
        return await self._thread.run(fn, *args)

    # -- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        self._looping = True
        try:
            await self._schedule()
        finally:
            self._looping = False

    async def _schedule(self) -> None:
        while not self._closed:
            if self._paused:
                await self._resumed.wait()
                continue
            if not self._waiting and not self._running:
                self._wake = anyio.Event()
                if not self._waiting and not self._running:
                    await self._wake.wait()
                continue
            async with self._step_lock:
                if self._paused:
                    continue
                room = self.max_running - len(self._running)
                candidates, self._waiting = self._waiting[:room], self._waiting[room:]
                try:
                    back = await self._on_thread(self._step, candidates)
                except Exception as e:
                    if self._closed:
                        raise
                    # Not one request's fault, as far as the step could tell: every request
                    # of the step fails, the engine goes on with the next ones.
                    log.exception("an engine step failed; its requests fail")
                    back = [r for r in self._retracted if r.finish is None]
                    self._retracted = []
                    for req in {*candidates, *self._running, *back}:
                        self._fail(req, e)
                    self._dropped.extend(
                        r
                        for r in [*candidates, *back]
                        if r not in self._running and r not in self._dropped
                    )
                    back = []
                self._waiting = back + self._waiting
                self._deliver()
            await anyio.lowlevel.checkpoint()

    def _step(self, candidates: list[_Request]) -> list[_Request]:
        """One scheduler step (on the model thread): admit what the pool has room for,
        prefill it, decode everyone; returns the requests to put back at the head of the
        queue (those not admitted, and those retracted to make room), in order.

        Invariant: a running request's pool slots hold every position but its last
        token's, which the next decode feeds in.
        """
        for r in self._running:
            if r.aborted and r.finish is None:
                r.finish = FinishReason("abort", message=r.aborted)
        gone = [r for r in self._running if r.finish is not None]
        if gone:  # aborted: their memory is free for this step's newcomers
            self._dropped.extend(gone)
            self._remove(set(gone))
        fresh = []
        for req in candidates:
            if req.aborted:
                req.finish = FinishReason("abort", message=req.aborted)
                self._dropped.append(req)
            elif req.params.max_new_tokens == 0:
                req.finish = FinishReason("length", length=0)
                self._dropped.append(req)
            else:
                fresh.append(req)
        admitted, waiting = self._admit(fresh)
        self._prefill_all(admitted)
        self._decode_step()
        self.steps += 1
        back, self._retracted = [*self._retracted, *waiting], []
        return back

    # -- memory ----------------------------------------------------------------------------
    def _reserve(self, req: _Request) -> int:
        """Pool slots kept free for ``req``'s coming tokens when admitting others."""
        left = max(req.params.max_new_tokens - len(req.output), 0)
        return math.ceil(self._ratio * left)

    def _admit(self, fresh: list[_Request]) -> tuple[list[_Request], list[_Request]]:
        """The longest head of ``fresh`` the pool has room for (its prompts' uncached
        tokens, plus a share of every running request's coming tokens); each admitted one
        gets its cached prefix (locked) and pool slots for the rest. The first request
        always goes in when nothing runs: one request of the context length always fits."""
        if not fresh:
            return [], []
        pool, tree = self.pool, self.tree
        reserve = sum(self._reserve(r) for r in self._running if r.finish is None)
        admitted: list[_Request] = []
        firsts: dict[tuple[int, ...], _Request] = {}
        pending = 0
        rest: list[_Request] = []
        for i, req in enumerate(fresh):
            tokens = req.kv_tokens()
            first = None if req.admitted or not self.prefix_cache else firsts.get(tuple(tokens))
            slots: list[int] = []
            node = None
            if first is None and self.prefix_cache:
                slots, node = tree.match(tokens if req.admitted else tokens[:-1])
                tree.lock(node)
            need = 0 if first is not None else len(tokens) - len(slots)
            room = pool.available + tree.evictable - pending
            if (self._running or admitted) and need + reserve + self._reserve(req) > room:
                if node is not None:
                    tree.unlock(node)
                rest = fresh[i:]
                break
            pending += need
            reserve += self._reserve(req)
            if first is None:
                pool.share(slots)
                req.slots, req.node, req.tree = slots, node, tree if node is not None else None
                req.ready = len(slots)
                if not req.admitted:
                    firsts[tuple(tokens)] = req
            req.copy_of = first
            admitted.append(req)
        if pool.available < pending:
            tree.evict(pending - pool.available)
        for req in admitted:
            if req.copy_of is None:
                req.slots = req.slots + pool.alloc(len(req.kv_tokens()) - len(req.slots))
        return admitted, rest

    def _release(self, req: _Request) -> None:
        """``req`` leaves the batch: its keys and values go into the prefix cache (when it
        is on and they were computed with the current weights), its references go."""
        tree = req.tree
        if tree is not None:
            if tree is self.tree and req.error is None and req.slots:
                tree.insert((req.prompt + req.output)[: len(req.slots)], req.slots)
            if req.node is not None:
                tree.unlock(req.node)
        self.pool.release(req.slots)
        req.slots, req.node, req.tree = [], None, None

    def _remove(self, gone: set[_Request]) -> None:
        """Take ``gone`` out of the batch, releasing them; the others keep their order and
        move up to fill the rows (their table rows copied)."""
        keep: list[_Request] = []
        for old, req in enumerate(self._running):
            if req in gone:
                self._release(req)
                continue
            if old != len(keep):
                self.pool.move_row(old, len(keep), len(req.slots))
            keep.append(req)
        self._running[:] = keep

    def _retract(self, reqs: list[_Request]) -> None:
        """Take running ``reqs`` out to wait (their keys and values into the prefix cache,
        where the resumed request will likely find them again)."""
        if reqs:
            self.retractions += len(reqs)
            self._remove(set(reqs))

    # -- prefill and decode ----------------------------------------------------------------
    def _prefill_all(self, admitted: list[_Request]) -> None:
        """Prefill the admitted requests in forwards of at most ``prefill_tokens`` new
        tokens, shortest first; the copies of a prompt (a GRPO group arriving at once)
        share its first request's slots and logits."""
        copies: dict[int, list[_Request]] = {}
        todo: list[_Request] = []
        for req in admitted:
            first = req.copy_of
            if first is not None:
                copies.setdefault(id(first), []).append(req)
            else:
                todo.append(req)
        todo.sort(key=lambda r: len(r.slots) - r.ready)
        while todo:
            take, tokens = 1, len(todo[0].slots) - todo[0].ready
            while take < len(todo):
                more = len(todo[take].slots) - todo[take].ready
                if tokens + more > self.prefill_tokens:
                    break
                tokens += more
                take += 1
            chunk, todo = todo[:take], todo[take:]
            try:
                self._prefill(chunk, copies)
            except Exception as e:
                # Only these prompts were touched; alone, each fails or goes through.
                log.warning("prefilling %d prompts together failed: %r", len(chunk), e)
                for req in chunk:
                    try:
                        self._prefill([req], copies)
                    except Exception as alone:
                        log.exception("prefilling request %r failed; it fails", req.rid)
                        for r in [req, *copies.get(id(req), [])]:
                            self._fail(r, alone)
                            self._release(r)
                            self._dropped.append(r)

    def _prefill(self, chunk: list[_Request], copies: dict[int, list[_Request]]) -> None:
        """Prefill ``chunk`` into new rows of the batch, give each prompt's copies its
        slots and sample everyone's first token (a resumed request samples nothing: its
        next token comes from the decode). On an exception the batch is as it was."""
        model, pool = self.model, self.pool
        first = len(self._running)
        self._running.extend(chunk)
        try:
            seqs = []
            for i, req in enumerate(chunk):
                pool.set_row(first + i, 0, req.slots)
                seqs.append(Prefill(first + i, req.ready, req.kv_tokens()[req.ready :]))
            computing = [q for q in seqs if q.tokens]
            logits = model.prefill(computing, pool) if computing else None
            rows_of = {q.row: j for j, q in enumerate(computing)}
            sampled: list[_Request] = []
            rows: list[int] = []
            for i, req in enumerate(chunk):
                new = len(seqs[i].tokens)
                self.prefill_computed += new
                if not req.admitted:
                    req.cached = seqs[i].start
                    self.prefill_cached += seqs[i].start
                    sampled.append(req)
                    rows.append(rows_of[first + i])
                self._cache_prompt(req, first + i)
                for copy in copies.get(id(req), []):
                    copy.slots = list(req.slots)
                    pool.share(copy.slots)
                    if req.node is not None and req.tree is not None:
                        req.tree.lock(req.node)
                        copy.node, copy.tree = req.node, req.tree
                    copy.cached = len(copy.prompt)
                    self.prefill_cached += len(copy.prompt)
                    pool.set_row(len(self._running), 0, copy.slots)
                    self._running.append(copy)
                    sampled.append(copy)
                    rows.append(rows_of[first + i])
            for req in chunk:
                req.admitted = True
            if sampled:
                assert logits is not None
                self._sample(sampled, logits[rows])
        except Exception:
            for req in self._running[first:]:
                if req not in chunk:  # a copy: it leaves with its prompt's request
                    self._release(req)
            del self._running[first:]
            raise

    def _cache_prompt(self, req: _Request, row: int) -> None:
        """After its prefill, ``req``'s prompt goes into the prefix cache at once, so that
        requests arriving while it runs share it; where the tree had the same tokens
        already, ``req`` takes the tree's slots instead of its own."""
        tree = self.tree
        if not self.prefix_cache or (req.tree is not None and req.tree is not tree):
            return
        tokens = req.kv_tokens()
        have, node = tree.insert(tokens, req.slots)
        if have != req.slots:
            self.pool.share(have)
            self.pool.release(req.slots)
            req.slots = list(have)
            self.pool.set_row(row, 0, req.slots)
        tree.lock(node)
        if req.node is not None and req.tree is not None:
            req.tree.unlock(req.node)
        req.node, req.tree = node, tree

    def _decode_step(self) -> None:
        """Advance every running request by one token: a pool slot each for the token fed
        in (evicting cached prefixes, then retracting the newest requests, when the pool
        is full), then one batched forward."""
        pool = self.pool
        live = [r for r in self._running if r.finish is None]
        if not live:
            return
        if pool.available < len(live):
            self.tree.evict(len(live) - pool.available)
        retracted = []
        while pool.available < len(live) and len(live) > 1:
            victim = live.pop()  # the newest
            retracted.append(victim)
            self._retracted.insert(0, victim)
            # Its keys and values go into the cache: evictable, but likely reused.
            self._retract([victim])
            if pool.available < len(live):
                self.tree.evict(len(live) - pool.available)
        if retracted:
            self._ratio = min(1.0, self._ratio + NEW_TOKEN_RATIO_STEP)
            log.info("pool full: %d requests retracted to wait", len(retracted))
        else:
            self._ratio = max(MIN_TOKEN_RATIO, self._ratio - NEW_TOKEN_RATIO_DECAY)
        new = pool.alloc(len(live))
        given = dict(zip(map(id, live), new, strict=True))
        slots, rows, cols, placed = [], [], [], []
        for row, req in enumerate(self._running):
            slot = given.get(id(req), 0)  # a finished row writes to the spare slot
            if slot:
                req.slots.append(slot)
                rows.append(row)
                cols.append(len(req.slots) - 1)
                placed.append(slot)
            slots.append(slot)
        pool.set_cells(rows, cols, placed)
        try:
            # A row that finished (or failed) in this step's prefill has no token to feed
            # (or one that does not matter): it computes a dummy one, dropped after.
            ids = [r.output[-1] if r.output and r.finish is None else 0 for r in self._running]
            positions = [r.length - 1 if r.finish is None else 0 for r in self._running]
            logits = self.model.decode(ids, positions, slots, pool)
            rows = [i for i, r in enumerate(self._running) if r.finish is None]
            if len(rows) < len(self._running):
                logits = logits[rows]
            self._sample([self._running[i] for i in rows], logits)
        except Exception as e:
            log.exception("a decode step failed; its %d requests fail", len(live))
            for req in live:
                self._fail(req, e)

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        rows = [
            SampleRow(
                r.params,
                r.seed,
                len(r.output),
                sorted(r.stops) if len(r.output) < r.params.min_new_tokens else (),
            )
            for r in reqs
        ]
        try:
            picked: list[tuple[int, float] | None] = list(zip(*sample(logits, rows), strict=True))
        except Exception:
            # One request's parameters broke the batch: sample row by row (the same draws,
            # see _sampler.py), and only the request whose row fails fails.
            picked = []
            for i, (req, row) in enumerate(zip(reqs, rows, strict=True)):
                try:
                    one_ids, one_lps = sample(logits[i : i + 1], [row])
                    picked.append((one_ids[0], one_lps[0]))
                except Exception as e:
                    log.exception("sampling request %r failed; it fails", req.rid)
                    self._fail(req, e)
                    picked.append(None)
        for req, pick in zip(reqs, picked, strict=True):
            if pick is None:
                continue
            token, lp = pick
            req.output.append(token)
            req.new_ids.append(token)
            req.new_lps.append(lp)
            try:
                req.finish = self._finished(req, token)
            except Exception as e:
                log.exception("checking request %r for a stop failed; it fails", req.rid)
                self._fail(req, e)

    def _fail(self, req: _Request, error: BaseException) -> None:
        """End ``req`` with an error (its caller gets :class:`GenerationError`)."""
        if req.finish is not None and req.error is None and req.finish.type != "abort":
            return  # it had finished already: its answer stands
        req.error = f"the engine failed on this request: {type(error).__name__}: {error}"
        req.finish = FinishReason("abort", message=req.error)

    def _finished(self, req: _Request, token: int) -> FinishReason | None:
        p = req.params
        n = len(req.output)
        if n >= p.min_new_tokens:
            if token in req.stops:
                return FinishReason("stop", matched=token)
            if p.stop:
                longest = max(len(s) for s in p.stop)
                # Enough tokens to cover the longest stop string (a token is >= 1 char).
                tail = self.tokenizer.decode(
                    req.output[-(longest + 1) :], skip_special_tokens=False
                )
                for s in p.stop:
                    if s in tail:
                        return FinishReason("stop", matched=s)
        if n >= p.max_new_tokens or req.length >= self.context_length:
            return FinishReason("length", length=n)
        return None

    def _finish_aborted(self, reqs: list[_Request]) -> None:
        for r in reqs:
            if r.finish is None:
                r.finish = FinishReason("abort", message=r.aborted or "Aborted")
                self._send(r)

    def _deliver(self) -> None:
        dropped, self._dropped = self._dropped, []
        for r in dropped:
            self._send(r)
        for r in self._running:
            if r.new_ids or r.finish is not None:
                self._send(r)
        self._compact()

    def _send(self, r: _Request) -> None:
        held = not r.streaming and r.finish is None  # held until it ends (one chunk a version)
        last = r.held[-1] if held and r.held else None
        if last is not None and last.weight_version == self.weight_version:  # in place
            last.output_ids += r.new_ids
            last.logprobs += r.new_lps
            r.new_ids.clear()
            r.new_lps.clear()
            return
        chunk = EngineChunk(
            r.new_ids, r.new_lps, r.finish, self.weight_version, r.cached, error=r.error
        )
        r.new_ids, r.new_lps = [], []
        if held:
            r.held.append(chunk)
            return
        chunks, r.held = [*r.held, chunk], []
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            for c in chunks:
                r.out.send_nowait(c)  # fails only when the caller left
        if r.finish is not None:
            r.out.close()
            self._by_rid.pop(r.rid, None)

    def _compact(self) -> None:
        """Drop finished requests (their memory released); the others move up."""
        gone = {r for r in self._running if r.finish is not None}
        if gone:
            self._remove(gone)


MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})


def _memory_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """``tags`` checked against SGLang's memory tags; ``None``: all of them."""
    if tags is None:
        return MEMORY_TAGS
    chosen = frozenset(tags)
    unknown = sorted(chosen - MEMORY_TAGS)
    if unknown:
        raise ConfigError(
            f"unknown memory tags {unknown}; expected some of {sorted(MEMORY_TAGS)} (or none: all)"
        )
    return chosen
