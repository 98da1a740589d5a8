"""A compact, exact binary encoding of samples, for the durable store and the service.

Layout: ``u32 header length | header JSON | ids (u32 each) | loss mask (u8 each) |
log-probs (f64 each, when present)``. The header holds the scalar fields; the token
arrays are raw machine arrays (little-endian), so encoding a 1,000-token sample is a few
memory copies and decoding gives back the exact ids and float64 log-probs.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Sequence

from agentenv._errors import SampleError
from agentenv._sample import Sample, Status

__all__ = ["decode_sample", "decode_samples", "encode_sample", "encode_samples"]

_HEADER = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"


def _ints(values: Sequence[int]) -> bytes:
    a = array.array("I", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _floats(values: Sequence[float]) -> bytes:
    # struct.pack is 3x faster than array("d", list) on a list of Python floats.
    return struct.pack(f"<{len(values)}d", *values)


def encode_sample(s: Sample) -> bytes:
    """``s`` as bytes; ``decode_sample(encode_sample(s)) == s``."""
    header = json.dumps(
        [
            s.reward,
            s.group_id,
            s.role,
            s.id,
            s.task_id,
            s.episode,
            s.weight_versions,
            s.status.value,
            s.reason,
            s.error_type,
            s.metadata,
            len(s.prompt_ids),
            len(s.completion_ids),
            s.rollout_logprobs is not None,
        ],
        separators=(",", ":"),
        allow_nan=False,
    ).encode()
    parts = [
        _HEADER.pack(len(header)),
        header,
        _ints(s.prompt_ids),
        _ints(s.completion_ids),
        bytes(s.loss_mask or ()),
    ]
    if s.rollout_logprobs is not None:
        parts.append(_floats(s.rollout_logprobs))
    return b"".join(parts)


def decode_sample(data: bytes | memoryview) -> Sample:
    """Inverse of :func:`encode_sample`; raises :class:`SampleError` on malformed input."""
    view = memoryview(data)
    try:
        (n,) = _HEADER.unpack_from(view, 0)
        (
            reward,
            group_id,
            role,
            sid,
            task_id,
            episode,
            versions,
            status,
            reason,
            error_type,
            metadata,
            n_prompt,
            n_completion,
            has_lp,
        ) = json.loads(bytes(view[4 : 4 + n]))
        pos = 4 + n
        ids = array.array("I")
        ids.frombytes(view[pos : pos + 4 * (n_prompt + n_completion)])
        pos += 4 * (n_prompt + n_completion)
        mask = list(view[pos : pos + n_completion])
        pos += n_completion
        logprobs = None
        if has_lp:
            lp = array.array("d")
            lp.frombytes(view[pos : pos + 8 * n_completion])
            if not _LITTLE:
                lp.byteswap()
            logprobs = lp.tolist()
            pos += 8 * n_completion
        if not _LITTLE:
            ids.byteswap()
        if pos != len(view) or len(ids) != n_prompt + n_completion or len(mask) != n_completion:
            raise ValueError("length mismatch")
    except (ValueError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise SampleError(f"malformed encoded sample: {e}") from None
    id_list = ids.tolist()
    return Sample(
        prompt_ids=id_list[:n_prompt],
        completion_ids=id_list[n_prompt:],
        reward=reward,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        group_id=group_id,
        role=role,
        id=sid,
        task_id=task_id,
        episode=episode,
        weight_versions=versions,
        status=Status(status),
        reason=reason,
        error_type=error_type,
        metadata=metadata,
    )


def encode_samples(samples: Sequence[Sample]) -> bytes:
    """Several samples, each length-prefixed."""
    out = []
    for s in samples:
        blob = encode_sample(s)
        out.append(_HEADER.pack(len(blob)))
        out.append(blob)
    return b"".join(out)


def decode_samples(data: bytes | memoryview) -> list[Sample]:
    """Inverse of :func:`encode_samples`."""
    view = memoryview(data)
    out = []
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise SampleError("malformed sample stream: truncated length prefix")
        (n,) = _HEADER.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise SampleError("malformed sample stream: truncated sample")
        out.append(decode_sample(view[pos : pos + n]))
        pos += n
    return out
