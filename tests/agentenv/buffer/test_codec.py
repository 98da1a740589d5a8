"""The binary encoding of samples: bit-exact, and validated like the constructor."""

from __future__ import annotations

import json
import math
import struct

import pytest

from agentenv import Sample, SampleError
from agentenv.buffer._codec import decode_sample, decode_samples, encode_sample
from tests.agentenv.buffer._groups import encode_samples, group


def test_codec_round_trip_is_bit_exact() -> None:
    tiny = 5e-324  # a denormal: survives only a bit-exact encoding
    samples = [
        Sample(
            prompt_ids=[0, 2**32 - 1],
            completion_ids=[5, 6, 7],
            reward=-0.0,
            loss_mask=[1, 0, 1],
            rollout_logprobs=[-tiny, 0.0, -math.pi],
            metadata={"nested": {"a": [1, 2.5, None]}, "s": "\u2603"},
            weight_versions=["3", "4"],
            role="red",
            episode=0,
        ),
        Sample(prompt_ids=[1], completion_ids=[], reward=2, group_id="g"),
        group("f", [1, 0], failed=[1])[1],
    ]
    for sample in samples:
        back = decode_sample(encode_sample(sample))
        assert back == sample
        assert struct.pack(
            f"{len(back.rollout_logprobs or [])}d", *(back.rollout_logprobs or [])
        ) == (
            struct.pack(f"{len(sample.rollout_logprobs or [])}d", *(sample.rollout_logprobs or []))
        )
        assert type(back.reward) is float and math.copysign(1, back.reward) == math.copysign(
            1, float(sample.reward)
        )
    assert decode_samples(encode_samples(samples)) == samples
    with pytest.raises(SampleError, match="below 2\\*\\*32"):
        encode_sample(Sample(prompt_ids=[2**32], completion_ids=[], reward=0.0))


def test_codec_validates_like_the_constructor() -> None:
    good = encode_sample(group("a", [1.0])[0])
    (n,) = struct.unpack_from("<I", good)
    header = json.loads(good[4 : 4 + n])

    def with_header(**changes: object) -> bytes:
        fields = ["reward", "group_id", "role", "id", "task_id", "episode", "weight_versions"]
        fields += ["status", "reason", "error_type", "metadata"]
        h = list(header)
        for key, value in changes.items():
            h[fields.index(key)] = value
        text = json.dumps(h).encode()
        return struct.pack("<I", len(text)) + text + good[4 + n :]

    for changes, message in [
        ({"group_id": 5}, "group_id must be a string"),
        ({"weight_versions": "3"}, "weight_versions must be a list of strings"),
        ({"metadata": [1]}, "metadata must be a JSON object"),
        ({"reward": True}, "reward must be a float"),
        ({"reward": "1"}, "reward must be a float"),
        ({"status": "done"}, "status must be one of"),
        ({"status": "truncated"}, "needs a reason"),
        ({"episode": -1}, "episode must be a non-negative int"),
    ]:
        with pytest.raises(SampleError, match=message):
            decode_sample(with_header(**changes))
    nan = bytearray(good)
    nan[-8:] = struct.pack("<d", float("nan"))
    with pytest.raises(SampleError, match="finite"):
        decode_sample(bytes(nan))
    for broken in (good[:3], good[:-1], good + b"\0", b"\x02\0\0\0[]", b"\x04\0\0\0{}{}"):
        with pytest.raises(SampleError, match="malformed"):
            decode_sample(broken)


def test_split_frames_refuses_an_empty_frame_at_once() -> None:
    from agentenv.buffer._codec import split_frames

    # Zero bytes read as frames of length 0: refused at the first, not split into millions.
    with pytest.raises(SampleError, match=r"group 0 \(at byte 0\) has length 0"):
        split_frames(b"\0" * (64 * 1024 * 1024), what="put_groups body", item="group")
    good = encode_samples(group("a", [1, 0]))
    with pytest.raises(SampleError, match=r"sample 2 \(at byte \d+\) has length 0"):
        split_frames(good + b"\0" * 4)


def test_split_frames_stops_past_its_limit() -> None:
    from agentenv.buffer._codec import FrameLimitError, split_frames

    data = encode_samples(group("a", [1.0] * 5))
    assert len(split_frames(data, limit=5)) == 5
    with pytest.raises(FrameLimitError, match="more than 4 samples"):
        split_frames(data, limit=4)


def test_a_deeply_nested_header_is_a_sample_error() -> None:
    header = json.dumps(
        [0.0, "a", None, None, None, None, [], "completed", None, None, {"x": 0}, 1, 0, False, True]
    ).encode()
    header = header.replace(b'{"x": 0}', b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    blob = struct.pack("<I", len(header)) + header + struct.pack("<I", 7)
    with pytest.raises(SampleError, match="nested too deeply"):
        decode_sample(blob)


def test_a_header_with_nan_metadata_is_refused_naming_the_key() -> None:
    header = json.dumps(
        [0.0, "a", None, None, None, None, [], "completed", None, None, {"x": 0}, 1, 0, False, True]
    ).encode()
    blob_header = header.replace(b'{"x": 0}', b'{"x": NaN}')
    blob = struct.pack("<I", len(blob_header)) + blob_header + struct.pack("<I", 7)
    with pytest.raises(SampleError, match=r"metadata\['x'\] is nan"):
        decode_sample(blob)


def test_advantage_scale_round_trips_and_an_older_record_reads_as_one() -> None:
    s = Sample(prompt_ids=[1, 2], completion_ids=[3], reward=1.0, advantage_scale=0.5)
    assert decode_sample(encode_sample(s)) == s
    blob = encode_sample(Sample(prompt_ids=[1, 2], completion_ids=[3], reward=1.0))
    (n,) = struct.unpack_from("<I", blob, 0)
    header = json.loads(blob[4 : 4 + n])
    old = json.dumps(header[:15], separators=(",", ":")).encode()  # before the field
    decoded = decode_sample(struct.pack("<I", len(old)) + old + blob[4 + n :])
    assert decoded.advantage_scale == 1.0 and decoded.prompt_ids == s.prompt_ids
