"""``agentenv buffer``: serve a durable Data Buffer, and inspect or export one on disk.

    agentenv buffer serve --path runs/exp1/buffer --token-file ~/.agentenv/token \\
        --n-samples-per-prompt 8 --rollout-batch-size 32 --port 8411
    agentenv buffer stats runs/exp1/buffer [--json]
    agentenv buffer export runs/exp1/buffer --format jsonl|parquet [--out FILE] \\
        [--state ready|consumed|dropped|stale|all]

``serve`` runs until Ctrl-C (or SIGTERM); remote workers connect with
``BufferClient(url, token=...)``. It holds the directory's lock: one process per Buffer
directory, so every other process goes through the server. ``stats`` and ``export`` open
the Buffer's files read-only, so they are safe on a Buffer that is being served.
``export`` writes one row per sample: the fields of ``Sample.to_dict()`` plus
``group_seq``, ``group_state``, ``group_step`` and ``group_reason``. Parquet needs
``pyarrow``; its ``metadata`` column holds each sample's metadata as a JSON string.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import signal
import stat
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import anyio
import pydantic

from agentenv._errors import ConfigError
from agentenv.cli._config import add_command, add_model_arguments, build_config

if TYPE_CHECKING:  # the Buffer (numpy, httpx) loads only in the command that uses it
    from agentenv.buffer import StoreReader

__all__ = ["add_parser"]

STATES = ("ready", "consumed", "dropped", "stale")
HISTOGRAM_BINS = 10
GC_THRESHOLD = 50_000  # `serve`: container allocations between young collections
_HEADER = struct.Struct("<I")


class ServeConfig(pydantic.BaseModel):
    """Settings of ``agentenv buffer serve``: where, how, and the Buffer's own settings."""

    model_config = pydantic.ConfigDict(extra="forbid")

    path: Path = pydantic.Field(description="directory of the durable Buffer (created if new)")
    token_file: Path = pydantic.Field(
        description="file holding the shared secret clients send as a bearer token"
    )
    host: str = pydantic.Field("127.0.0.1", description="interface to bind (this machine only)")
    port: int = pydantic.Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one")
    n_samples_per_prompt: int = pydantic.Field(1, ge=1, description="episodes per group")
    min_group_size: int = pydantic.Field(
        1, ge=1, description="fewest surviving episodes for which a group is kept"
    )
    on_failed: Literal["drop_samples", "drop_group"] = pydantic.Field(
        "drop_samples", description="what a failed sample costs: itself, or its group"
    )
    drop_zero_std: bool = pydantic.Field(
        False, description="drop groups whose rewards are all equal (no GRPO signal)"
    )
    capacity: int = pydantic.Field(1024, ge=1, description="ready groups held at most")
    max_staleness: int | None = pydantic.Field(
        None, ge=0, description="policy versions a group may lag its batch (default: unbounded)"
    )
    on_stale: Literal["drop", "recycle"] = pydantic.Field(
        "drop", description="what becomes of a stale group"
    )
    rollout_batch_size: int | None = pydantic.Field(
        None, ge=1, description="groups per batch (get_batch's default)"
    )
    durability: Literal["power", "process"] = pydantic.Field(
        "power", description="a put survives power loss (fsync), or only a process crash"
    )
    lease_s: float = pydantic.Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a handed-out batch stays with a consumer that stops renewing it",
    )
    max_body_mb: int = pydantic.Field(
        128, ge=65, description="largest request body in MiB (413 beyond)"
    )
    max_samples_per_request: int = pydantic.Field(
        65536, ge=8192, description="most samples one put request may carry (413 beyond)"
    )
    max_put_requests: int | None = pydantic.Field(
        None,
        ge=1,
        description="put requests handled at once, 503 beyond (retried by the client); "
        "keeps connections free for consumers (default: half the connection cap)",
    )
    max_sample_header_kb: int = pydantic.Field(
        1024, ge=1, description="largest JSON header (metadata) of one sample in KiB (413 beyond)"
    )
    max_request_header_mb: int = pydantic.Field(
        8, ge=8, description="most JSON header bytes of one put request in MiB (413 beyond)"
    )


def add_parser(sub: Any) -> None:
    parser = add_command(sub, "buffer", "serve, inspect or export a Data Buffer", __doc__)
    actions = parser.add_subparsers(dest="buffer_command", required=True, metavar="ACTION")
    serve = actions.add_parser(
        "serve",
        help="serve a durable Buffer over HTTP",
        description="Serve a durable Buffer to remote rollout workers and trainers.",
    )
    add_model_arguments(
        serve, ServeConfig, metavars={"path": "DIR", "token_file": "FILE", "host": "HOST"}
    )
    serve.set_defaults(handler=run_serve)

    stats = actions.add_parser(
        "stats", help="summarise a Buffer on disk (read-only), or a served one's counters"
    )
    stats.add_argument(
        "path", help="the Buffer's directory (or its buffer.sqlite), or a served Buffer's URL "
        "(agentenv buffer serve, or a run's: SAVE/buffer.json names it)",
    )  # fmt: skip
    stats.add_argument(
        "--token-file", type=Path, metavar="FILE",
        help="a served Buffer's bearer token (default: SAVE/buffer.token beside the URL's "
        "buffer.json, else $AGENTENV_BUFFER_TOKEN)",
    )  # fmt: skip
    stats.add_argument("--json", action="store_true", help="print one JSON object last")
    stats.set_defaults(handler=run_stats)

    export = actions.add_parser("export", help="write a Buffer's samples to JSONL or Parquet")
    export.add_argument("path", type=Path, help="the Buffer's directory (or its buffer.sqlite)")
    export.add_argument(
        "--format", required=True, choices=["jsonl", "parquet"], help="the output's format"
    )
    export.add_argument(
        "--out", type=Path, metavar="FILE", help="output file (jsonl: default standard output)"
    )
    export.add_argument(
        "--state", choices=[*STATES, "all"], default="all",
        help="export only groups in this state (default: all)",
    )  # fmt: skip
    export.set_defaults(handler=run_export)


# -- serve ------------------------------------------------------------------------------------
def read_token(path: Path) -> str:
    """The token in ``path``; :class:`ConfigError` if it is missing or empty."""
    hint = (
        "create one with `python -c 'import secrets; print(secrets.token_urlsafe(32))' "
        f"> {path} && chmod 600 {path}`"
    )
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"token file {str(path)!r} does not exist; {hint}") from None
    except OSError as e:
        raise ConfigError(f"cannot read token file {str(path)!r}: {e.strerror or e}") from None
    if not token:
        raise ConfigError(f"token file {str(path)!r} is empty; {hint}")
    return token


async def serve(cfg: ServeConfig) -> None:
    """Serve the Buffer ``cfg`` describes until SIGINT or SIGTERM."""
    from agentenv.buffer import Buffer, BufferConfig, BufferServer, RewardStdFilter

    token = read_token(cfg.token_file)
    with contextlib.suppress(OSError):
        if stat.S_IMODE(cfg.token_file.stat().st_mode) & 0o077:
            print(
                f"agentenv buffer: warning: {cfg.token_file} is readable by other users; "
                f"chmod 600 {cfg.token_file}",
                file=sys.stderr,
            )
    own = cfg.model_dump(include={f.name for f in dataclasses.fields(BufferConfig)})
    config = BufferConfig(filters=[RewardStdFilter()] if cfg.drop_zero_std else [], **own)
    # This process holds many large, long-lived lists (the samples). With the default
    # threshold (700 new containers) young collections re-walk them every few requests:
    # measured at a quarter of the server's CPU when putting 1,000-token samples.
    threshold, *older = gc.get_threshold()
    gc.set_threshold(max(threshold, GC_THRESHOLD), *older)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            Buffer(config, path=cfg.path) as buffer,
            BufferServer(
                buffer,
                token=token,
                host=cfg.host,
                port=cfg.port,
                max_body_bytes=cfg.max_body_mb * 1024 * 1024,
                max_samples_per_request=cfg.max_samples_per_request,
                lease_s=cfg.lease_s,
                max_put_requests=cfg.max_put_requests,
                max_sample_header_bytes=cfg.max_sample_header_kb * 1024,
                max_header_bytes_per_request=cfg.max_request_header_mb * 1024 * 1024,
            ) as server,
        ):
            stats = await buffer.statistics()
            last = await buffer.position()
            print(
                f"agentenv buffer: serving {cfg.path} at {server.url} "
                f"({stats.ready} ready groups, last step {last}); Ctrl-C stops",
                flush=True,
            )
            async for signum in signals:
                print(f"agentenv buffer: {signal.Signals(signum).name}: stopping", file=sys.stderr)
                break


def run_serve(args: argparse.Namespace) -> int:
    cfg = build_config(ServeConfig, args)
    anyio.run(serve, cfg)
    return 0


# -- reading a Buffer on disk -----------------------------------------------------------------
def _histogram(values: list[float], bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    if not values:
        return {"bins": [], "counts": []}
    lo, hi = min(values), max(values)
    if lo == hi:
        return {"bins": [lo, hi], "counts": [len(values)]}
    width = (hi - lo) / bins
    edges = [lo + i * width for i in range(bins)] + [hi]
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    return {"bins": edges, "counts": counts}


def summarise(store: StoreReader) -> dict[str, Any]:
    """Counts, staleness and the reward histogram of the Buffer ``store``."""
    db = store.db
    groups = dict.fromkeys(STATES, 0)
    groups.update(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state"))
    reasons: dict[str, dict[str, int]] = {}
    for state, reason, n in db.execute(
        "SELECT state, reason, COUNT(*) FROM groups WHERE reason != '' "
        "GROUP BY state, reason ORDER BY state, COUNT(*) DESC"
    ):
        reasons.setdefault(state, {})[reason] = n
    group_info = {
        seq: (state, step) for seq, state, step in db.execute("SELECT seq, state, step FROM groups")
    }
    status: collections.Counter[str] = collections.Counter()
    rewards: list[float] = []
    prompt_tokens = completion_tokens = 0
    oldest: dict[int, int] = {}  # group seq -> oldest integer weight version
    versions: collections.Counter[str] = collections.Counter()
    integers: set[int] = set()
    non_integer = 0
    for seq, offset, length in db.execute("SELECT seq, offset, length FROM samples"):
        blob = store.blob(offset, length)
        (n,) = _HEADER.unpack_from(blob, 0)
        h = json.loads(blob[4 : 4 + n])  # the sample's scalar fields (see _codec)
        reward, weight_versions, sample_status = h[0], h[6], h[7]
        status[sample_status] += 1
        prompt_tokens += h[11]
        completion_tokens += h[12]
        if sample_status != "failed":
            rewards.append(float(reward))
        for v in weight_versions:
            versions[v] += 1
            try:
                n = int(v)
            except ValueError:
                non_integer += 1
                continue
            integers.add(n)
            oldest[seq] = min(n, oldest.get(seq, n))
    lags: collections.Counter[int] = collections.Counter()
    for seq, version in oldest.items():
        state, step = group_info.get(seq, ("", None))
        if state == "consumed" and step is not None:
            lags[step - version] += 1
    (last_step,) = db.execute("SELECT MAX(step) FROM groups").fetchone()
    n_samples = sum(status.values())
    mean_reward = math.fsum(rewards) / len(rewards) if rewards else None
    return {
        "groups": groups,
        "groups_total": sum(groups.values()),
        "reasons": reasons,
        "samples": n_samples,
        "samples_by_status": dict(status.most_common()),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "last_step": last_step,
        "weight_versions": {
            "min": min(integers, default=None),
            "max": max(integers, default=None),
            "distinct": len(versions),
            "non_integer_tokens": non_integer,
        },
        "staleness": {  # consumed groups: the consuming step minus the oldest version
            "groups": sum(lags.values()),
            "mean": (sum(k * n for k, n in lags.items()) / sum(lags.values()) if lags else None),
            "max": max(lags) if lags else None,
            "counts": {str(k): lags[k] for k in sorted(lags)},
        },
        "reward": {
            "mean": mean_reward,
            "min": min(rewards) if rewards else None,
            "max": max(rewards) if rewards else None,
            "histogram": _histogram(rewards),
        },
    }


def _bar(n: int, most: int, width: int = 40) -> str:
    return "█" * max(1 if n else 0, round(width * n / most)) if most else ""


def render(path: Path, summary: dict[str, Any]) -> str:
    """``summary`` as the text report ``agentenv buffer stats`` prints."""
    out = [f"agentenv buffer stats  {path}"]
    groups = summary["groups"]
    out.append(
        f"  groups     {summary['groups_total']}: "
        + ", ".join(f"{state} {groups[state]}" for state in STATES)
    )
    for state, reasons in summary["reasons"].items():
        out.append(f"  {state:<10} " + ", ".join(f"{reason} {n}" for reason, n in reasons.items()))
    by_status = ", ".join(f"{k} {v}" for k, v in summary["samples_by_status"].items())
    out.append(f"  samples    {summary['samples']}" + (f": {by_status}" if by_status else ""))
    out.append(
        f"  tokens     prompt {summary['prompt_tokens']}, completion {summary['completion_tokens']}"
    )
    out.append(f"  last step  {summary['last_step']}")
    wv = summary["weight_versions"]
    out.append(
        f"  versions   {wv['min']}..{wv['max']} ({wv['distinct']} distinct"
        + (f", {wv['non_integer_tokens']} non-integer" if wv["non_integer_tokens"] else "")
        + ")"
    )
    st = summary["staleness"]
    if st["groups"]:
        out.append(
            f"  staleness  consumed groups' step - oldest version: mean {st['mean']:.2f}, "
            f"max {st['max']}"
        )
        most = max(st["counts"].values())
        for lag, n in st["counts"].items():
            out.append(f"    {lag:>6}  {n:>8}  {_bar(n, most)}")
    reward = summary["reward"]
    if reward["mean"] is not None:
        out.append(
            f"  reward     mean {reward['mean']:.4f}, min {reward['min']:.4g}, "
            f"max {reward['max']:.4g}"
        )
        hist = reward["histogram"]
        most = max(hist["counts"])
        edges = hist["bins"]
        for i, n in enumerate(hist["counts"]):
            close = "]" if i == len(hist["counts"]) - 1 else ")"
            label = f"[{edges[i]:.3g}, {edges[i + 1]:.3g}{close}"
            out.append(f"    {label:>20}  {n:>8}  {_bar(n, most)}")
    return "\n".join(out)


def run_stats(args: argparse.Namespace) -> int:
    from agentenv.buffer import open_readonly

    if str(args.path).startswith(("http://", "https://")):
        return _served_stats(str(args.path), args)
    path = Path(args.path)
    if path.name == "buffer.json" and path.is_file():  # a run's served Buffer
        info = json.loads(path.read_text())
        if args.token_file is None:
            args.token_file = path.with_name("buffer.token")
        return _served_stats(str(info["url"]), args)
    store = open_readonly(path)
    try:
        summary = summarise(store)
    finally:
        store.close()
    print(render(path, summary))
    if args.json:
        print(json.dumps(summary, separators=(",", ":")))
    return 0


def _served_stats(url: str, args: argparse.Namespace) -> int:
    """A served Buffer's counters (:class:`~agentenv.buffer.BufferStats`), live."""
    from agentenv.buffer import BufferClient

    if args.token_file is not None:
        token = read_token(args.token_file)
    else:
        token = os.environ.get("AGENTENV_BUFFER_TOKEN", "")
        if not token:
            raise ConfigError(
                f"{url} is a served Buffer: pass --token-file FILE (its bearer token) or set "
                "$AGENTENV_BUFFER_TOKEN"
            )

    async def fetch() -> dict[str, Any]:
        async with BufferClient(url, token=token) as client:
            return (await client.statistics()).to_dict()

    stats = anyio.run(fetch)
    print(f"agentenv buffer stats  {url}  (served, live)")
    for key, value in stats.items():
        print(f"  {key:<24} {value}")
    if args.json:
        print(json.dumps(stats, separators=(",", ":")))
    return 0


# -- export -----------------------------------------------------------------------------------
def rows(store: StoreReader, state: str) -> Iterator[dict[str, Any]]:
    """One dict per sample, in put order: ``Sample.to_dict()`` plus its group's fields."""
    from agentenv.buffer import decode_sample

    query = (
        "SELECT g.seq, g.state, g.step, g.reason, s.offset, s.length FROM groups g "
        "JOIN samples s ON s.seq = g.seq"
    )
    params: tuple[str, ...] = ()
    if state != "all":
        query += " WHERE g.state = ?"
        params = (state,)
    for seq, group_state, step, reason, offset, length in store.db.execute(
        query + " ORDER BY g.seq, s.pos", params
    ):
        row = decode_sample(store.blob(offset, length)).to_dict()
        row.update(group_seq=seq, group_state=group_state, group_step=step, group_reason=reason)
        yield row


def export_jsonl(store: StoreReader, state: str, out: IO[str]) -> int:
    n = 0
    for row in rows(store, state):
        out.write(json.dumps(row, separators=(",", ":"), allow_nan=False))
        out.write("\n")
        n += 1
    return n


def export_parquet(store: StoreReader, state: str, out: Path, chunk: int = 4096) -> int:
    try:
        import pyarrow as pa  # type: ignore[import-untyped, import-not-found, unused-ignore]
        import pyarrow.parquet as pq  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise ConfigError(
            "--format parquet needs pyarrow: pip install pyarrow (or use --format jsonl)"
        ) from None
    schema = pa.schema(
        [
            ("prompt_ids", pa.list_(pa.int64())),
            ("completion_ids", pa.list_(pa.int64())),
            ("reward", pa.float64()),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float64())),
            ("group_id", pa.string()),
            ("role", pa.string()),
            ("id", pa.string()),
            ("task_id", pa.string()),
            ("episode", pa.int64()),
            ("weight_versions", pa.list_(pa.string())),
            ("status", pa.string()),
            ("reason", pa.string()),
            ("error_type", pa.string()),
            ("advantage_scale", pa.float64()),
            ("metadata", pa.string()),  # JSON: samples' metadata differ in shape
            ("group_seq", pa.int64()),
            ("group_state", pa.string()),
            ("group_step", pa.int64()),
            ("group_reason", pa.string()),
        ]
    )
    n = 0
    tmp = out.with_name(out.name + ".partial")
    todo = rows(store, state)
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            while batch := list(itertools.islice(todo, chunk)):
                for row in batch:
                    row["metadata"] = json.dumps(row["metadata"], separators=(",", ":"))
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n += len(batch)
        os.replace(tmp, out)  # a reader never sees half a file
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return n


def run_export(args: argparse.Namespace) -> int:
    if args.format == "parquet" and args.out is None:
        raise ConfigError("--format parquet writes a binary file: give it --out FILE")
    from agentenv.buffer import open_readonly

    store = open_readonly(args.path)
    try:
        if args.format == "parquet":
            n = export_parquet(store, args.state, args.out)
        elif args.out is None:
            try:
                n = export_jsonl(store, args.state, sys.stdout)
                sys.stdout.flush()
            except BrokenPipeError:  # `... | head`: the reader has all it wants
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 1
        else:
            with args.out.open("w", encoding="utf-8") as f:
                n = export_jsonl(store, args.state, f)
    finally:
        store.close()
    if args.out is not None:
        print(f"agentenv buffer: exported {n} samples ({args.state}) to {args.out}")
    return 0
