"""An LLM judge as a reward: :class:`JudgeRubric`.

The judge is any :class:`~agentenv.Generator`; each answer goes into a prompt
``template`` with the task and its reference, and a verdict parser
(:func:`label_verdict`, :func:`score_verdict`) reads the reward from the reply. A group's
judge calls are in flight together (an engine batches them); the same (question, answer,
reference) is judged once -- a call in flight is shared, a finished one cached. A verdict
the parser cannot read, or a judge that fails or overruns ``timeout_s``, raises
:class:`~agentenv.RewardError` (a failed sample, not cached). See docs/rewards.md."""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from agentenv._errors import ConfigError, RewardError, at_least
from agentenv._generator import Generator, SamplingParams
from agentenv._rewards import Rubric
from agentenv.rewards._extract import after_thinking

if TYPE_CHECKING:
    from agentenv._environment import Task
    from agentenv._rewards import State
    from agentenv._tokenizer import Tokenizer

__all__ = ["JUDGE_TEMPLATE", "JudgeRubric", "JudgeStats", "label_verdict", "score_verdict"]

JUDGE_TEMPLATE = (
    "You are grading an answer to a question against the reference answer.\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{answer}\n\n"
    "Is the answer to grade correct? Reply with one word: CORRECT or INCORRECT."
)

VerdictParser = Callable[[str], float]


def label_verdict(labels: Mapping[str, float] | None = None) -> VerdictParser:
    """A parser that reads the last of ``labels`` (whole words, any case) in the judge's
    reply after its thinking; default ``CORRECT`` 1, ``INCORRECT`` 0."""
    table = {k.lower(): float(v) for k, v in (labels or {"CORRECT": 1.0, "INCORRECT": 0.0}).items()}
    if not table:
        raise ConfigError("label_verdict needs at least one label")
    # Longest first: INCORRECT is not read as CORRECT.
    pattern = re.compile(
        r"\b(" + "|".join(re.escape(k) for k in sorted(table, key=len, reverse=True)) + r")\b",
        re.IGNORECASE,
    )

    def parse(reply: str) -> float:
        found = pattern.findall(after_thinking(reply) or "")
        if not found:
            raise RewardError(
                f"judge verdict {reply[:120]!r} has none of the labels {sorted(table)}"
            )
        return table[found[-1].lower()]

    return parse


_SCORE = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?")


def score_verdict(max_score: float = 10.0) -> VerdictParser:
    """A parser that reads the last number of the judge's reply (``7``, ``Score: 7``,
    ``7/10``) as a score out of ``max_score``, returned in [0, 1]."""
    if not max_score > 0:
        raise ConfigError(f"max_score must be positive, got {max_score}")

    def parse(reply: str) -> float:
        found = _SCORE.findall(after_thinking(reply) or "")
        if not found:
            raise RewardError(f"judge verdict {reply[:120]!r} has no score")
        value, out_of = found[-1]
        top = float(out_of) if out_of else max_score
        score = float(value)
        if not 0.0 <= score <= top or top <= 0:
            raise RewardError(
                f"judge verdict {reply[:120]!r}: score {value} is not in [0, {top:g}]"
            )
        return score / top

    return parse


@dataclasses.dataclass(frozen=True, slots=True)
class JudgeStats:
    """How the judge was used: the judgements asked for, those answered from the cache
    (``hits``, a call in flight shared included), the judge calls made and failed, and
    the seconds the calls took (summed over calls in flight together)."""

    judgements: int
    hits: int
    calls: int
    failures: int
    call_seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.judgements if self.judgements else 0.0


def _question(task: Task) -> str:
    if isinstance(task.prompt, str):
        return task.prompt
    users = [str(m.get("content", "")) for m in task.prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class JudgeRubric(Rubric):
    """A rubric whose reward is ``judge``'s verdict (see the module docstring).

    Args:
        judge: the judge model (any :class:`~agentenv.Generator`).
        tokenizer: renders the judge's prompt (default: the judge's own, as a policy's).
        template: the judge's prompt, with ``{question}`` (the task's prompt), ``{answer}``
            (the reply after its thinking) and ``{reference}`` (the task's answer).
        parser: reads the verdict (default :func:`label_verdict`).
        extract: what of the reply the judge sees and the cache keys on (default: the
            reply after its thinking; e.g. :func:`~agentenv.rewards.last_number`); a reply
            it finds nothing in is judged as it is.
        sampling: the judge's sampling (default greedy, 16 new tokens).
        max_concurrency: judge calls in flight at once.
        timeout_s: a judge call that takes longer fails its sample.
        cache_size: finished judgements kept.
        weight: the judge's weight in the rubric; ``extra`` are further reward functions
            (or (function, weight) pairs) summed with it.
    """

    def __init__(
        self,
        judge: Generator,
        tokenizer: Tokenizer | None = None,
        *,
        template: str = JUDGE_TEMPLATE,
        parser: VerdictParser | None = None,
        extract: Callable[[str], str | None] | None = None,
        sampling: SamplingParams | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 60.0,
        cache_size: int = 100_000,
        weight: float = 1.0,
        extra: tuple[Any, ...] = (),
    ) -> None:
        for field in ("{question}", "{answer}"):
            if field not in template:
                raise ConfigError(f"the judge template must contain {field}, got {template!r}")
        try:
            template.format(question="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"the judge template's fields are {{question}}, {{answer}} and "
                f"{{reference}} (write {{{{ }}}} for a brace), got {e!r}"
            ) from None
        at_least("max_concurrency", max_concurrency, 1)
        if tokenizer is None:
            from agentenv._runner import policy_tokenizer

            tokenizer = policy_tokenizer(judge)
        self.judge = judge
        self.tokenizer = tokenizer
        self.template = template
        self.parser = parser or label_verdict()
        self.extract = extract
        self.sampling = sampling or SamplingParams(max_new_tokens=16, temperature=0.0)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._limit = anyio.Semaphore(max_concurrency)
        self._done: collections.OrderedDict[tuple[str, str, str], float] = collections.OrderedDict()
        self._in_flight: dict[tuple[str, str, str], _Pending] = {}
        self._counts = {"judgements": 0, "hits": 0, "calls": 0, "failures": 0}
        self._call_seconds = 0.0
        self._rid = 0

        async def judge_reward(task: Task, state: State) -> float:
            return await self.score_answer(task, state.completion)

        judge_reward.__name__ = "judge"
        super().__init__((judge_reward, weight), *extra)

    def stats(self) -> JudgeStats:
        """The counts so far (:class:`JudgeStats`)."""
        c = self._counts
        return JudgeStats(c["judgements"], c["hits"], c["calls"], c["failures"],
                          self._call_seconds)  # fmt: skip

    def prompt_ids(self, task: Task, answer: str) -> list[int]:
        """The judge's prompt for ``answer`` to ``task``, rendered and tokenized."""
        text = self.template.format(
            question=_question(task), answer=answer,
            reference="" if task.answer is None else str(task.answer),
        )  # fmt: skip
        rendered = self.tokenizer.render(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return self.tokenizer.encode(rendered)

    async def score_answer(self, task: Task, reply: str) -> float:
        """The verdict on ``reply`` to ``task`` (cached; see the module docstring)."""
        answer = after_thinking(reply) or ""
        if self.extract is not None:
            answer = self.extract(answer) or answer
        answer = " ".join(answer.split())
        key = (_question(task), answer, "" if task.answer is None else str(task.answer))
        self._counts["judgements"] += 1
        if key in self._done:
            self._counts["hits"] += 1
            self._done.move_to_end(key)
            return self._done[key]
        pending = self._in_flight.get(key)
        if pending is not None:
            self._counts["hits"] += 1
            await pending.done.wait()
            if pending.error is not None:
                raise RewardError(f"the shared judge call failed: {pending.error}")
            return pending.value
        pending = self._in_flight[key] = _Pending()
        try:
            pending.value = value = await self._call(task, answer)
        except BaseException as e:
            self._counts["failures"] += 1
            pending.error = e if isinstance(e, Exception) else RewardError("judge call cancelled")
            raise
        finally:
            del self._in_flight[key]
            pending.done.set()
        self._done[key] = value
        if len(self._done) > self.cache_size:
            self._done.popitem(last=False)
        return value

    async def _call(self, task: Task, answer: str) -> float:
        ids = self.prompt_ids(task, answer)
        self._rid += 1
        rid = f"judge-{id(self):x}/{self._rid}"  # unique across judges on one engine
        async with self._limit:
            self._counts["calls"] += 1
            start = time.perf_counter()
            try:
                with anyio.fail_after(self.timeout_s):
                    completion = await self.judge.generate(ids, self.sampling, rid=rid)
            except TimeoutError:
                raise RewardError(f"the judge did not answer in {self.timeout_s:g} s") from None
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"the judge failed: {type(e).__name__}: {e}") from None
            finally:
                self._call_seconds += time.perf_counter() - start
        if completion.finish_reason.type == "abort":
            raise RewardError(f"the judge aborted: {completion.finish_reason.message}")
        return self.parser(self.tokenizer.decode(completion.output_ids))


@dataclasses.dataclass(slots=True)
class _Pending:
    """A judgement in flight that other episodes wait on: once ``done`` is set, its
    ``value``, or the ``error`` it failed with."""

    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    value: float = 0.0
    error: Exception | None = None
