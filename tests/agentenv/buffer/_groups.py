"""Groups of samples for the Buffer tests, with values that must survive storage exactly."""

from __future__ import annotations

from collections.abc import Sequence

from agentenv import Sample, Status
from agentenv.buffer._codec import encode_sample, join_frames


def encode_samples(samples: Sequence[Sample]) -> bytes:
    """Several samples, each after its u32 length: a put_group body."""
    return join_frames(encode_sample(s) for s in samples)


def group(
    gid: str,
    rewards: Sequence[float],
    *,
    tokens: int = 6,
    version: int = 0,
    failed: Sequence[int] = (),
    role: str | None = None,
) -> list[Sample]:
    out = []
    for i, r in enumerate(rewards):
        if i in failed:
            out.append(
                Sample(
                    prompt_ids=[1],
                    completion_ids=[],
                    reward=0.0,
                    group_id=gid,
                    episode=i,
                    id=f"{gid}/{i}/{role}",
                    task_id=gid.split("@")[0],
                    status=Status.FAILED,
                    reason="boom",
                    error_type="ValueError",
                )
            )
            continue
        out.append(
            Sample(
                prompt_ids=[7, 8, 9],
                completion_ids=[100 + k for k in range(tokens)],
                reward=r,
                loss_mask=[1, 0] * (tokens // 2) + [1] * (tokens % 2),
                # Values with no short decimal form: the wire must keep every bit.
                rollout_logprobs=[-(k + 1) / 3 if k % 2 == 0 else 0.0 for k in range(tokens)],
                group_id=gid,
                episode=i,
                id=f"{gid}/{i}/{role}",
                role=role,
                task_id=gid.split("@")[0],
                weight_versions=[str(version)],
                metadata={"turns": i, "note": "é"},
            )
        )
    return out
