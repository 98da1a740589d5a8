"""Sample: alignment and value validation, status consistency, and the lossless JSON round trip."""

from __future__ import annotations

import array
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv import Sample, SampleError, Status


def make(**overrides: Any) -> Sample:
    """A valid completed sample, with ``overrides`` applied."""
    fields: dict[str, Any] = {"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "reward": 1.0}
    fields.update(overrides)
    return Sample(**fields)


def minimal_dict(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"prompt_ids": [1, 2], "completion_ids": [3], "reward": 0.5}
    data.update(overrides)
    return data


# -- construction and alignment ------------------------------------------------------


def test_defaults() -> None:
    s = make()
    assert list(s.loss_mask or ()) == [1, 1, 1]
    assert s.rollout_logprobs is None
    assert s.status is Status.COMPLETED
    assert s.reason is None
    assert s.error_type is None
    assert s.weight_versions == []
    assert s.metadata == {}
    assert s.group_id is None
    assert s.role is None


def test_default_containers_are_not_shared() -> None:
    a, b = make(), make()
    assert a.loss_mask is not b.loss_mask
    a.metadata["x"] = 1
    a.weight_versions.append("v1")
    assert b.metadata == {}
    assert b.weight_versions == []


def test_empty_completion_gets_empty_mask() -> None:
    s = make(completion_ids=[])
    assert list(s.loss_mask or ()) == []
    assert s.num_generated == 0


@pytest.mark.parametrize("mask", [[1, 1], [1, 0, 1, 1], []])
def test_loss_mask_length_must_match_and_message_names_both(mask: list[int]) -> None:
    with pytest.raises(SampleError, match=rf"loss_mask has {len(mask)} .*completion_ids has 3"):
        make(loss_mask=mask)


@pytest.mark.parametrize("logprobs", [[-0.1, -0.2], [-0.1] * 4, []])
def test_logprobs_length_must_match_and_message_names_both(logprobs: list[float]) -> None:
    with pytest.raises(
        SampleError, match=rf"rollout_logprobs has {len(logprobs)} .*completion_ids has 3"
    ):
        make(rollout_logprobs=logprobs)


@pytest.mark.parametrize("bad", [2, -1, 256, 1.0, 0.5, "1", None])
def test_loss_mask_values_only_int_zero_or_one(bad: Any) -> None:
    with pytest.raises(SampleError, match="loss_mask must contain only"):
        make(loss_mask=[1, bad, 0])


@pytest.mark.parametrize("mask", [[0, 1, 0], (0, 1, 0), [False, True, False], b"\x00\x01\x00"])
def test_loss_mask_of_zeros_and_ones_is_kept(mask: Any) -> None:
    s = make(loss_mask=mask)
    assert isinstance(s.loss_mask, array.array) and s.loss_mask.typecode == "B"
    assert list(s.loss_mask) == [0, 1, 0]
    assert s.to_dict()["loss_mask"] == [0, 1, 0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_logprobs_must_be_finite(bad: float) -> None:
    with pytest.raises(SampleError, match="finite"):
        make(rollout_logprobs=[-0.5, bad, 0.0])


@pytest.mark.parametrize("bad", ["0.1", None, [0.5]])
def test_logprobs_must_be_numbers(bad: Any) -> None:
    with pytest.raises(SampleError, match="rollout_logprobs must be numbers"):
        make(rollout_logprobs=[-0.5, bad, 0.0])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (math.nan, "finite"),
        (math.inf, "finite"),
        (-math.inf, "finite"),
        (10**400, "finite"),  # an int too large for a float
        ("1", "must be a float, got str"),
        (True, "must be a float, got bool"),
        (None, "must be a float, got NoneType"),
        ([1.0], "must be a float, got list"),
    ],
)
def test_reward_must_be_a_finite_number(bad: Any, message: str) -> None:
    with pytest.raises(SampleError, match=message):
        make(reward=bad)


def test_int_reward_becomes_float() -> None:
    s = make(reward=3)
    assert s.reward == 3.0
    assert type(s.reward) is float


@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids"])
@pytest.mark.parametrize("bad", [-1, 2**32, 1.0, "7", None])
def test_token_ids_must_be_non_negative_ints(field: str, bad: Any) -> None:
    with pytest.raises(SampleError, match=f"{field} must contain non-negative ints.*{bad!r}"):
        make(**{field: [5, bad, 6]})


@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids"])
@pytest.mark.parametrize("bad", ["123", b"12", 7, {"a": 1}])
def test_token_ids_must_be_a_sequence(field: str, bad: Any) -> None:
    with pytest.raises(SampleError, match=f"{field} must be a sequence of token ids"):
        make(**{field: bad})


@pytest.mark.parametrize(
    "ids", [[1, 2, 3], (1, 2, 3), range(1, 4), array.array("q", [1, 2, 3]), np.arange(1, 4)]
)
def test_token_ids_become_a_compact_array(ids: Any) -> None:
    s = make(completion_ids=ids)
    assert type(s.completion_ids) is array.array and s.completion_ids.typecode == "I"
    assert list(s.completion_ids) == [1, 2, 3]
    assert np.frombuffer(s.completion_ids, np.uint32).tolist() == [1, 2, 3]


def test_an_id_array_is_kept_without_a_copy() -> None:
    ids = array.array("I", [1, 2, 3])
    assert make(completion_ids=ids).completion_ids is ids


def test_logprobs_become_a_float64_array() -> None:
    s = make(rollout_logprobs=np.array([-0.5, -1, 0], dtype=np.float32))
    assert type(s.rollout_logprobs) is array.array and s.rollout_logprobs.typecode == "d"
    assert list(s.rollout_logprobs) == [-0.5, -1.0, 0.0]


# -- status consistency ---------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.TRUNCATED, Status.ABORTED, Status.FAILED])
def test_non_completed_needs_a_reason(status: Status) -> None:
    extra = {"error_type": "RuntimeError"} if status is Status.FAILED else {}
    with pytest.raises(SampleError, match=f"a {status.value} sample needs a reason"):
        make(status=status, **extra)
    with pytest.raises(SampleError, match="needs a reason"):
        make(status=status, reason="", **extra)


def test_failed_needs_error_type() -> None:
    with pytest.raises(SampleError, match="needs an error_type"):
        make(status=Status.FAILED, reason="boom")


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.TRUNCATED, Status.ABORTED])
def test_error_type_only_for_failed(status: Status) -> None:
    with pytest.raises(SampleError, match="error_type is only for failed samples"):
        make(status=status, reason="r", error_type="ValueError")


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.TRUNCATED, Status.ABORTED])
def test_non_failed_needs_prompt_ids(status: Status) -> None:
    with pytest.raises(SampleError, match=f"a {status.value} sample needs prompt_ids"):
        make(prompt_ids=[], status=status, reason="r")


def test_failed_sample_may_have_no_tokens() -> None:
    s = Sample(
        prompt_ids=[],
        completion_ids=[],
        reward=0.0,
        status=Status.FAILED,
        reason="sandbox died",
        error_type="TimeoutError",
    )
    assert not s.trainable
    assert list(s.ids) == []


def test_status_given_as_string_becomes_enum() -> None:
    s = make(status="truncated", reason="max_turns")
    assert s.status is Status.TRUNCATED


def test_bad_status_in_constructor_is_a_sample_error() -> None:
    with pytest.raises(SampleError, match=r"status must be one of \['completed'.*got 'done'"):
        make(status="done")


# -- views -----------------------------------------------------------------------------


def test_ids_is_prompt_then_completion() -> None:
    s = make(prompt_ids=[7, 8], completion_ids=[9, 10])
    assert list(s.ids) == [7, 8, 9, 10]
    s.ids.append(11)  # a fresh array: the sample is not changed through it
    assert list(s.ids) == [7, 8, 9, 10]


def test_num_generated_counts_mask_ones() -> None:
    assert make(loss_mask=[1, 0, 1]).num_generated == 2
    assert make().num_generated == 3


@pytest.mark.parametrize(
    ("overrides", "trainable"),
    [
        ({}, True),
        ({"loss_mask": [0, 1, 0]}, True),
        ({"loss_mask": [0, 0, 0]}, False),
        ({"completion_ids": []}, False),
        ({"status": Status.TRUNCATED, "reason": "length"}, True),
        ({"status": Status.ABORTED, "reason": "weight update"}, True),
        ({"status": Status.FAILED, "reason": "boom", "error_type": "ValueError"}, False),
    ],
)
def test_trainable(overrides: dict[str, Any], trainable: bool) -> None:
    assert make(**overrides).trainable is trainable


# -- JSON round trip ----------------------------------------------------------------------

AWKWARD_FLOATS = [0.1 + 0.2, -1e-300, 5e-324, -0.0, 1.7976931348623157e308, 1 / 3, 2.0**-1074]


def full_sample(**overrides: Any) -> Sample:
    fields: dict[str, Any] = {
        "prompt_ids": [0, 1, 2],
        "completion_ids": [3, 4, 5, 6],
        "reward": 0.1 + 0.2,
        "loss_mask": [1, 0, 0, 1],
        "rollout_logprobs": [-1e-300, 0.0, 0.0, -(0.1 + 0.2)],
        "group_id": "task-7",
        "role": "guesser",
        "weight_versions": ["v1", "v2"],
        "status": Status.TRUNCATED,
        "reason": "max_turns: reached 3 turns",
        "metadata": {"rewards": {"correct": 1.0, "brevity": 5e-324}, "turns": 3, "é": [None]},
    }
    fields.update(overrides)
    return Sample(**fields)


def test_to_json_is_one_compact_line_of_plain_json() -> None:
    text = full_sample().to_json()
    assert "\n" not in text
    assert ", " not in text
    data = json.loads(text)
    assert data["status"] == "truncated"
    assert data["loss_mask"] == [1, 0, 0, 1]
    assert set(data) == {f for f in Sample.__dataclass_fields__}


@pytest.mark.parametrize("value", AWKWARD_FLOATS)
def test_awkward_floats_round_trip_exactly(value: float) -> None:
    s = full_sample(reward=value, rollout_logprobs=[value, 0.0, 0.0, -value], metadata={"v": value})
    back = Sample.from_json(s.to_json())
    assert back == s
    # == is not enough for floats: compare the bits (this also tells -0.0 from 0.0).
    assert back.reward.hex() == s.reward.hex()
    assert back.rollout_logprobs is not None
    expected = [float(v).hex() for v in [value, 0, 0, -value]]
    assert [v.hex() for v in back.rollout_logprobs] == expected


def test_failed_sample_round_trips() -> None:
    s = Sample(
        prompt_ids=[],
        completion_ids=[],
        reward=0.0,
        status=Status.FAILED,
        reason="boom",
        error_type="RuntimeError",
    )
    assert Sample.from_json(s.to_json()) == s
    assert Sample.from_dict(s.to_dict()) == s


def test_from_json_accepts_bytes() -> None:
    s = full_sample()
    assert Sample.from_json(s.to_json().encode()) == s


def test_to_dict_copies_lists() -> None:
    s = full_sample()
    d = s.to_dict()
    d["prompt_ids"].append(99)
    d["loss_mask"].append(1)
    assert list(s.prompt_ids) == [0, 1, 2]
    assert list(s.loss_mask or ()) == [1, 0, 0, 1]


finite = st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 6))
    status = draw(st.sampled_from(Status))
    token = st.integers(0, 2**31)
    return Sample(
        prompt_ids=draw(st.lists(token, min_size=0 if status is Status.FAILED else 1, max_size=6)),
        completion_ids=draw(st.lists(token, min_size=n, max_size=n)),
        reward=draw(finite | st.integers(-(10**6), 10**6)),
        loss_mask=draw(st.none() | st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
        rollout_logprobs=draw(st.none() | st.lists(finite, min_size=n, max_size=n)),
        group_id=draw(st.none() | st.text(max_size=8)),
        role=draw(st.none() | st.text(max_size=8)),
        weight_versions=draw(st.lists(st.text(max_size=4), max_size=3)),
        status=status,
        reason=draw(
            st.text(min_size=1, max_size=20)
            if status is not Status.COMPLETED
            else st.none() | st.text(max_size=20)
        ),
        error_type=draw(st.text(min_size=1, max_size=10)) if status is Status.FAILED else None,
        metadata=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=4)),
    )


# 50 examples keep this under a second; the strategy covers every field and status.
@settings(max_examples=50, deadline=None)
@given(samples())
def test_json_round_trip_is_lossless(s: Sample) -> None:
    text = s.to_json()
    back = Sample.from_json(text)
    assert back == s
    assert back.to_json() == text  # same bytes, so no float drifted by an ulp
    assert Sample.from_dict(s.to_dict()) == s


# -- from_dict / from_json validation ----------------------------------------------------


def test_from_dict_minimal() -> None:
    s = Sample.from_dict(minimal_dict())
    assert s == Sample(prompt_ids=[1, 2], completion_ids=[3], reward=0.5)


def test_from_dict_rejects_unknown_fields_and_names_them() -> None:
    with pytest.raises(SampleError, match=r"unknown sample fields \['advantage', 'tokens'\]"):
        Sample.from_dict(minimal_dict(tokens=[1], advantage=0.3))


@pytest.mark.parametrize("missing", ["prompt_ids", "completion_ids", "reward"])
def test_from_dict_rejects_missing_required_fields(missing: str) -> None:
    data = minimal_dict()
    del data[missing]
    with pytest.raises(SampleError, match=f"missing required field '{missing}'"):
        Sample.from_dict(data)


@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids", "loss_mask"])
@pytest.mark.parametrize("bad", [True, False, 1.0, 2.5, "1", None, [1]])
def test_from_dict_rejects_non_int_ids(field: str, bad: Any) -> None:
    data = minimal_dict(completion_ids=[3, 4], loss_mask=[1, 1])
    data[field] = [1, bad]
    with pytest.raises(SampleError, match=f"{field} must be a list of integers"):
        Sample.from_dict(data)


@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids", "loss_mask"])
def test_from_dict_rejects_non_list_ids(field: str) -> None:
    data = minimal_dict(loss_mask=[1])
    data[field] = "123"
    with pytest.raises(SampleError, match=f"{field} must be a list of integers"):
        Sample.from_dict(data)


def test_from_dict_logprobs_accept_ints_as_floats() -> None:
    s = Sample.from_dict(minimal_dict(rollout_logprobs=[0]))
    assert s.rollout_logprobs is not None and list(s.rollout_logprobs) == [0.0]
    assert type(s.rollout_logprobs[0]) is float


@pytest.mark.parametrize("bad", [[True], ["-0.5"], [None], "abc", {"0": -1.0}])
def test_from_dict_rejects_bad_logprobs(bad: Any) -> None:
    with pytest.raises(SampleError, match="rollout_logprobs must be a list of numbers"):
        Sample.from_dict(minimal_dict(rollout_logprobs=bad))


@pytest.mark.parametrize("bad", ["done", "COMPLETED", None, 1])
def test_from_dict_rejects_bad_status_listing_the_choices(bad: Any) -> None:
    with pytest.raises(SampleError) as info:
        Sample.from_dict(minimal_dict(status=bad))
    message = str(info.value)
    assert repr(bad) in message
    for status in Status:
        assert status.value in message


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("weight_versions", "v1", "weight_versions must be a list of strings"),
        ("weight_versions", [1], "weight_versions must be a list of strings"),
        ("metadata", [1, 2], "metadata must be a JSON object, got list"),
        ("group_id", 7, "group_id must be a string or null, got int"),
        ("role", ["a"], "role must be a string or null, got list"),
        ("reason", 1.5, "reason must be a string or null, got float"),
    ],
)
def test_from_dict_checks_the_other_field_types(field: str, bad: Any, message: str) -> None:
    with pytest.raises(SampleError, match=message):
        Sample.from_dict(minimal_dict(**{field: bad}))


@pytest.mark.parametrize("bad", [[1, 2], "sample", 3, None])
def test_from_dict_rejects_non_objects(bad: Any) -> None:
    with pytest.raises(SampleError, match="a sample must be a JSON object"):
        Sample.from_dict(bad)


def test_from_dict_still_runs_the_constructor_checks() -> None:
    with pytest.raises(SampleError, match="loss_mask has 2 entries but completion_ids has 1"):
        Sample.from_dict(minimal_dict(loss_mask=[1, 1]))
    with pytest.raises(SampleError, match="needs a reason"):
        Sample.from_dict(minimal_dict(status="aborted"))


@pytest.mark.parametrize("text", ["", "{", "not json", b"\x80\x81"])
def test_from_json_rejects_invalid_json(text: str | bytes) -> None:
    with pytest.raises(SampleError, match="sample is not valid JSON"):
        Sample.from_json(text)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_from_json_rejects_non_finite_reward(literal: str) -> None:
    # Python's json accepts these non-standard literals; the Sample must not.
    text = '{"prompt_ids":[1],"completion_ids":[],"reward":%s}' % literal  # noqa: UP031
    with pytest.raises(SampleError, match="reward must be finite"):
        Sample.from_json(text)


def test_from_json_rejects_an_array() -> None:
    with pytest.raises(SampleError, match="got list"):
        Sample.from_json("[1, 2, 3]")


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ({"score": math.nan}, "metadata['score']"),
        ({"a": {"b": [1.0, math.inf]}}, "metadata['a']['b'][1]"),
        ({"t": [0, -math.inf]}, "metadata['t'][1]"),
        ({"n": np.float64("nan")}, "metadata['n']"),
    ],
)
def test_metadata_numbers_must_be_finite_and_the_error_names_the_key(
    metadata: dict[str, Any], where: str
) -> None:
    with pytest.raises(SampleError, match=r"JSON has no NaN or infinity") as info:
        make(metadata=metadata)
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("metadata", "where", "fix"),
    [
        ({"x": np.float32("nan")}, "metadata['x'] is a numpy.float32", "float(x)"),
        ({"x": np.float32(1.5)}, "metadata['x'] is a numpy.float32", "float(x)"),
        ({"x": np.int64(3)}, "metadata['x'] is a numpy.int64", "int(x)"),
        ({"a": [np.array([math.nan])]}, "metadata['a'][0] is a numpy.ndarray", "x.tolist()"),
        ({"s": {1, 2}}, "metadata['s'] is a builtins.set", "list(x)"),
        ({"t": (1, 2)}, "metadata['t'] is a builtins.tuple", "list(x)"),
        ({"b": b"raw"}, "metadata['b'] is a builtins.bytes", "decode"),
        ({"o": object()}, "metadata['o'] is a builtins.object", "convert"),
        ({"d": {1: 2}}, "metadata['d'] has the key 1 (int)", "str(1)"),
        ({2: "x"}, "metadata has the key 2 (int)", "str(2)"),
    ],
)
def test_metadata_must_be_plain_json_and_the_error_names_the_path_type_and_fix(
    metadata: dict[Any, Any], where: str, fix: str
) -> None:
    with pytest.raises(SampleError, match="metadata must be plain JSON") as info:
        make(metadata=metadata)
    assert where in str(info.value) and fix in str(info.value), info.value


def test_plain_json_metadata_round_trips() -> None:
    metadata = {"a": [1, 2.5, True, None, "s", {"b": []}], "n": np.float64(0.5), "e": {}}
    s = make(metadata=metadata)
    assert Sample.from_json(s.to_json()) == s


def test_deeply_nested_metadata_is_checked_without_recursion() -> None:
    deep: Any = math.nan
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(SampleError, match=r"metadata\['x'\]\[0\]\[0\]"):
        make(metadata={"x": deep})


def test_metadata_must_be_a_dict() -> None:
    with pytest.raises(SampleError, match="metadata must be a dict, got list"):
        make(metadata=[1])


def test_from_json_of_too_deep_nesting_is_a_sample_error() -> None:
    with pytest.raises(SampleError, match="nested too deeply"):
        Sample.from_json('{"metadata": ' + "[" * 200_000 + "]" * 200_000 + "}")


def test_advantage_scale_is_a_typed_field_that_round_trips() -> None:
    s = Sample(prompt_ids=[1], completion_ids=[2], reward=1.0, advantage_scale=0.25)
    assert Sample.from_json(s.to_json()).advantage_scale == 0.25
    assert Sample.from_dict({"prompt_ids": [1], "completion_ids": [2], "reward": 0.0}) == Sample(
        prompt_ids=[1], completion_ids=[2], reward=0.0, advantage_scale=1.0
    )
    for bad in (-0.5, math.inf, math.nan):
        with pytest.raises(SampleError, match=r"advantage_scale must be finite and >= 0"):
            Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, advantage_scale=bad)
    with pytest.raises(SampleError, match=r"advantage_scale must be a float, got str"):
        Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, advantage_scale="1")  # type: ignore[arg-type]
