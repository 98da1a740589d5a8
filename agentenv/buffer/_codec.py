"""A compact, exact binary encoding of samples, for the durable store and the service.

Layout: ``u32 header length | header JSON | ids (u32 each) | loss mask (u8 each, absent
when it is all ones) | log-probs (f64 each, when present)``. The header holds the scalar
fields; the token arrays are the Sample's own typed arrays as raw little-endian bytes, so
encoding or decoding a 1,000-token sample is a few memory copies, and decoding gives back
the exact ids and float64 log-probs.
"""

from __future__ import annotations

import array
import json
import math
import operator
import struct
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from agentenv._errors import SampleError
from agentenv._sample import Sample, logprob_array, mask_array, token_ids

__all__ = [
    "FrameLimitError",
    "decode_sample",
    "decode_samples",
    "encode_sample",
    "join_frames",
    "split_frames",
]

_HEADER = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"
# One encoder for every header: json.dumps with options builds a new encoder per call.
_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# The header: these fields of the Sample, then the arrays' layout (prompt and completion
# lengths, whether there are log-probs, whether the mask is all ones), then
# advantage_scale (last: older records have none).
_SCALARS = (
    "reward", "group_id", "role", "id", "task_id", "episode", "weight_versions", "status",
    "reason", "error_type", "metadata",
)  # fmt: skip
_scalars = operator.attrgetter(*_SCALARS)


def _raw(values: array.array[Any]) -> bytes:
    if _LITTLE:
        return values.tobytes()
    swapped = array.array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def encode_sample(s: Sample) -> bytes:
    """``s`` as bytes; ``decode_sample(encode_sample(s)) == s``."""
    n = len(s.completion_ids)
    # The Sample constructor made every per-token field a typed array; these calls only
    # convert fields a caller replaced after construction.
    mask = mask_array(s.loss_mask if s.loss_mask is not None else bytes([1]) * n, n).tobytes()
    all_ones = mask.count(1) == n  # the common case: store no mask at all
    lp = s.rollout_logprobs
    layout = (len(s.prompt_ids), n, lp is not None, all_ones)
    header = _dumps([*_scalars(s), *layout, s.advantage_scale]).encode()  # (status: a str)
    parts = [
        _HEADER.pack(len(header)),
        header,
        _raw(token_ids("prompt_ids", s.prompt_ids)),
        _raw(token_ids("completion_ids", s.completion_ids)),
        b"" if all_ones else mask,
    ]
    if lp is not None:
        # Finite since the Sample was built (the decoder checks again).
        parts.append(_raw(logprob_array(lp, n, check=False)))
    return b"".join(parts)


_ONE_ID = array.array("I", [0])
_NO_IDS = array.array("I")
_OPTIONAL_STRINGS = ("group_id", "role", "id", "task_id", "reason", "error_type")


def decode_sample(data: bytes | memoryview) -> Sample:
    """Inverse of :func:`encode_sample`; raises :class:`SampleError` on malformed input.

    Validated like ``Sample(...)``/``Sample.from_dict``, but the token arrays are checked
    at C speed instead of element by element: ids come out of an unsigned array (so they
    are non-negative ints), the loss mask's bytes must all be 0 or 1 and the log-probs'
    sum must be finite (a NaN or infinity anywhere makes it not). The scalar fields go
    through the Sample constructor itself, on a sample without tokens; the arrays are then
    put in place.
    """
    view = memoryview(data)
    try:
        (n,) = _HEADER.unpack_from(view, 0)
        header = json.loads(bytes(view[4 : 4 + n]))
        # 15 fields: written before advantage_scale was one (a durable Buffer's older
        # records), which is then 1.
        if type(header) is not list or len(header) not in (15, 16):
            raise ValueError("the header is not a list of 16 fields")
        advantage_scale = header.pop() if len(header) == 16 else 1.0
        fields = dict(zip(_SCALARS, header, strict=False))
        n_prompt, n_completion, has_lp, all_ones = header[len(_SCALARS) :]
        if not (
            type(n_prompt) is int
            and type(n_completion) is int
            and type(has_lp) is bool
            and type(all_ones) is bool
        ):
            raise ValueError("bad token counts in the header")
        if n_prompt < 0 or n_completion < 0:
            raise ValueError("negative token counts in the header")
        pos = 4 + n
        n_ids = n_prompt + n_completion
        n_mask = 0 if all_ones else n_completion
        size = pos + 4 * n_ids + n_mask + (8 * n_completion if has_lp else 0)
        if size != len(view):
            raise ValueError(f"{len(view)} bytes where the header implies {size}")
        ids = array.array("I")
        ids.frombytes(view[pos : pos + 4 * n_ids])
        pos += 4 * n_ids
        mask = bytes(view[pos : pos + n_mask])
        pos += n_mask
        lp = None
        if has_lp:
            lp = array.array("d")
            lp.frombytes(view[pos:])
    except (ValueError, TypeError, struct.error) as e:  # incl. JSON and Unicode errors
        raise SampleError(f"malformed encoded sample: {e}") from None
    except RecursionError:  # the C decoder's own depth guard: never a crash, a bad input
        raise SampleError(
            "malformed encoded sample: its header is nested too deeply (metadata should be "
            "small, flat JSON)"
        ) from None
    for name in _OPTIONAL_STRINGS:
        if (value := fields[name]) is not None and type(value) is not str:
            raise SampleError(f"{name} must be a string or null, got {type(value).__name__}")
    versions, metadata = fields["weight_versions"], fields["metadata"]
    if type(versions) is not list or not all(type(v) is str for v in versions):
        raise SampleError("weight_versions must be a list of strings")
    if type(metadata) is not dict:
        raise SampleError(f"metadata must be a JSON object, got {type(metadata).__name__}")
    if lp is not None:
        if not _LITTLE:
            lp.byteswap()
        if lp and not np.isfinite(np.frombuffer(lp, np.float64)).all():
            culprit = next(x for x in lp if not math.isfinite(x))
            raise SampleError(f"rollout_logprobs must all be finite, got {culprit}")
    if not _LITTLE:
        ids.byteswap()
    # The constructor checks every scalar rule (reward, status, reason, episode, ...); the
    # prompt placeholder keeps its "needs prompt_ids" rule honest.
    sample = Sample(
        prompt_ids=_ONE_ID if n_prompt else _NO_IDS,
        completion_ids=_NO_IDS,
        advantage_scale=advantage_scale,
        **fields,
    )
    sample.prompt_ids = ids[:n_prompt]
    sample.completion_ids = ids[n_prompt:]
    sample.loss_mask = (
        array.array("B", bytes([1]) * n_completion) if all_ones else mask_array(mask, n_completion)
    )
    sample.rollout_logprobs = lp
    return sample


def join_frames(blobs: Iterable[bytes]) -> bytes:
    """``blobs`` back to back, each after its u32 length."""
    return b"".join(part for blob in blobs for part in (_HEADER.pack(len(blob)), blob))


class FrameLimitError(SampleError):
    """A frame stream holds more frames than its reader accepts (:func:`split_frames`)."""


def split_frames(
    data: bytes | memoryview,
    *,
    what: str = "sample stream",
    item: str = "sample",
    limit: int | None = None,
) -> list[memoryview]:
    """Inverse of :func:`join_frames` (views, no copies); :class:`SampleError` names
    ``what`` when the data is cut short or holds an empty frame (no encoding is empty, so
    one is malformed input, refused before it costs anything), and
    :class:`FrameLimitError` once it holds more than ``limit`` frames. One pass, linear
    in the data; the views take a bounded multiple of it since every frame has a byte."""
    view = memoryview(data)
    out: list[memoryview] = []
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise SampleError(f"malformed {what}: truncated length prefix")
        (n,) = _HEADER.unpack_from(view, pos)
        if n == 0:
            raise SampleError(
                f"malformed {what}: {item} {len(out)} (at byte {pos}) has length 0; "
                f"an empty {item} is never valid"
            )
        pos += 4
        if pos + n > len(view):
            raise SampleError(f"malformed {what}: truncated {item}")
        if limit is not None and len(out) >= limit:
            raise FrameLimitError(f"{what} holds more than {limit} {item}s")
        out.append(view[pos : pos + n])
        pos += n
    return out


def decode_samples(data: bytes | memoryview) -> list[Sample]:
    """Samples each after its u32 length (:func:`join_frames` of their encodings)."""
    return [decode_sample(frame) for frame in split_frames(data)]
