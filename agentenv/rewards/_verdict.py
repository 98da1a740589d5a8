"""What a rule-based reward says about one response."""

from __future__ import annotations

import dataclasses

from agentenv._sample import JSONValue

__all__ = ["Verdict"]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The reward of one response and why.

    Args:
        reward: the number the response scores.
        answer: the answer as read from the response (``None``: none was found).
        reason: why the answer could not be judged (no answer found, not parseable, a
            verifier timeout, an empty label); ``None`` when it was judged, right or wrong.
        extra: further JSON facts (dapo's ``acc``), kept in the sample's metadata.
    """

    reward: float
    answer: str | None = None
    reason: str | None = None
    extra: dict[str, JSONValue] = dataclasses.field(default_factory=dict)

    def metadata(self) -> dict[str, JSONValue]:
        """The verdict as sample metadata: ``rm_answer``, ``rm_reason`` and ``extra``."""
        out: dict[str, JSONValue] = {"rm_answer": self.answer, "rm_reason": self.reason}
        out.update(self.extra)
        return out
