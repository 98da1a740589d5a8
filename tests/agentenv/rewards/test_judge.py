"""``JudgeRubric`` with a scripted judge: the prompt, the verdict parsers, one call for
answers asked together or before, and unreadable verdicts and timeouts as failed
samples."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    Completion,
    ConfigError,
    FinishReason,
    RewardError,
    SamplingParams,
    ScriptedModel,
    SingleTurnEnv,
    Status,
    Task,
    run,
)
from agentenv.rewards import JudgeRubric, label_verdict, score_verdict

pytestmark = pytest.mark.timeout(60)

TASK = Task(id="q", prompt="What is the capital of France?", answer="Paris")


def grader(ctx: Any) -> str:
    """A judge that compares the answer with the reference, as the template lays them out."""
    text = ctx.text
    reference = re.search(r"Reference answer:\n(.*)\n\nAnswer to grade", text, re.S)
    answer = re.search(r"Answer to grade:\n(.*)\n\nIs the answer", text, re.S)
    assert reference and answer
    if answer.group(1) == "garbage":
        return "I cannot decide."
    return "CORRECT" if reference.group(1).lower() in answer.group(1).lower() else "INCORRECT"


class CountingJudge:
    """A scripted judge that counts its calls and can hold them until released."""

    def __init__(self, tokenizer: ChatTokenizer, *, hold: bool = False, hang: bool = False):
        self.inner = ScriptedModel(tokenizer, grader)
        self.tokenizer = tokenizer
        self.calls = 0
        self.rids: list[str | None] = []
        self.release = anyio.Event()
        self.hold, self.hang = hold, hang

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        self.calls += 1
        self.rids.append(rid)
        if self.hang:
            await anyio.sleep_forever()
        if self.hold:
            await self.release.wait()
        return await self.inner.generate(input_ids, params, rid=rid)


def judged_env(rubric: JudgeRubric) -> SingleTurnEnv:
    class Env(SingleTurnEnv):
        pass

    env = Env()
    env.rubric = rubric
    return env


def test_a_group_is_judged_and_repeated_answers_cost_one_call(smollm2: ChatTokenizer) -> None:
    judge = CountingJudge(smollm2)
    rubric = JudgeRubric(judge)
    replies = iter(["Paris", "<think>hmm</think>Paris", "Lyon", "It is  Paris", "Lyon"])
    policy = ScriptedModel(smollm2, lambda ctx: next(replies))
    samples = run(judged_env(rubric), policy, tasks=[TASK], n_samples_per_prompt=5,
                  concurrency=1).samples  # fmt: skip
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert samples[0].metadata["rewards"] == {"judge": 1.0}
    # "Paris" twice (the thinking is not judged), "Lyon" twice: 3 distinct answers.
    assert judge.calls == 3
    stats = rubric.stats()
    assert (stats.judgements, stats.hits, stats.calls, stats.failures) == (5, 2, 3, 0)
    assert stats.hit_rate == pytest.approx(0.4)


def test_judging_the_extracted_answer_makes_rewordings_one_judgement(
    smollm2: ChatTokenizer,
) -> None:
    judge = CountingJudge(smollm2)
    rubric = JudgeRubric(judge, extract=lambda reply: reply.split()[-1].strip(".") or None)
    replies = iter(["It is Paris.", "Surely Paris", "Lyon", "The capital is Paris"])
    policy = ScriptedModel(smollm2, lambda ctx: next(replies))
    samples = run(judged_env(rubric), policy, tasks=[TASK], n_samples_per_prompt=4,
                  concurrency=1).samples  # fmt: skip
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 1.0]
    assert judge.calls == 2 and rubric.stats().hit_rate == 0.5


@pytest.mark.anyio
async def test_answers_asked_together_share_one_call_in_flight(smollm2: ChatTokenizer) -> None:
    judge = CountingJudge(smollm2, hold=True)
    rubric = JudgeRubric(judge)
    results: list[float] = []

    async def ask(reply: str) -> None:
        results.append(await rubric.score_answer(TASK, reply))

    async with anyio.create_task_group() as tg:
        for reply in ["Paris", "Paris", "Paris", "Lyon"]:
            tg.start_soon(ask, reply)
        while rubric.stats().judgements < 4:  # every episode has asked
            await anyio.lowlevel.checkpoint()
        judge.release.set()
    assert sorted(results) == [0.0, 1.0, 1.0, 1.0]
    assert judge.calls == 2
    # Calls in flight together have their own request ids, also across judges of one engine.
    other = JudgeRubric(judge, max_concurrency=1)
    async with anyio.create_task_group() as tg:
        for reply in ["Rome", "Oslo"]:
            tg.start_soon(other.score_answer, TASK, reply)
    assert len(set(judge.rids)) == len(judge.rids) == 4


def test_an_unreadable_verdict_fails_the_sample_with_the_reason(smollm2: ChatTokenizer) -> None:
    rubric = JudgeRubric(CountingJudge(smollm2))
    samples = run(judged_env(rubric), ScriptedModel(smollm2, [], default="garbage"),
                  tasks=[TASK]).samples  # fmt: skip
    assert samples[0].status is Status.FAILED
    assert "judge verdict 'I cannot decide." in str(samples[0].reason)
    assert "has none of the labels ['correct', 'incorrect']" in str(samples[0].reason)
    assert rubric.stats().failures == 1


@pytest.mark.anyio
async def test_a_judge_timeout_is_a_failure_and_not_cached(smollm2: ChatTokenizer) -> None:
    judge = CountingJudge(smollm2, hang=True)
    rubric = JudgeRubric(judge, timeout_s=0.2)
    for _ in range(2):
        with pytest.raises(RewardError, match=r"the judge did not answer in 0\.2 s"):
            await rubric.score_answer(TASK, "Paris")
    assert judge.calls == 2 and rubric.stats().failures == 2


@pytest.mark.anyio
async def test_a_judge_that_fails_or_aborts_is_a_failure(smollm2: ChatTokenizer) -> None:
    class Broken:
        tokenizer = smollm2

        def __init__(self, abort: bool) -> None:
            self.abort = abort

        async def generate(self, ids: Sequence[int], params: SamplingParams, *,
                           rid: str | None = None) -> Completion:  # fmt: skip
            if self.abort:
                return Completion(output_ids=[], logprobs=None,
                                  finish_reason=FinishReason("abort", message="gone"))  # fmt: skip
            raise ConnectionError("refused")

    with pytest.raises(RewardError, match="the judge failed: ConnectionError: refused"):
        await JudgeRubric(Broken(False)).score_answer(TASK, "Paris")
    with pytest.raises(RewardError, match="the judge aborted: gone"):
        await JudgeRubric(Broken(True)).score_answer(TASK, "Paris")


def test_the_prompt_holds_question_answer_and_reference(smollm2: ChatTokenizer) -> None:
    rubric = JudgeRubric(CountingJudge(smollm2), template="Q={question} A={answer} R={reference}")
    text = smollm2.decode(rubric.prompt_ids(TASK, "Lyon"))
    assert "Q=What is the capital of France? A=Lyon R=Paris" in text
    chat = Task(id="c", prompt=[{"role": "system", "content": "x"},
                                {"role": "user", "content": "2+2?"}], answer=4)  # fmt: skip
    assert "Q=2+2? A=4 R=4" in smollm2.decode(rubric.prompt_ids(chat, "4"))


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("no fields", "must contain {question}"),
        ("{question} {answer} {other}", "fields are {question}, {answer} and {reference}"),
    ],
)
def test_a_bad_template_is_refused(smollm2: ChatTokenizer, template: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        JudgeRubric(CountingJudge(smollm2), template=template)


@pytest.mark.parametrize(
    ("reply", "value"),
    [
        ("CORRECT", 1.0),
        ("incorrect.", 0.0),  # INCORRECT is not read as CORRECT
        ("It is correct... no, INCORRECT", 0.0),  # the last label counts
        ("<think>correct?</think> INCORRECT", 0.0),  # not the thinking
    ],
)
def test_label_verdicts(reply: str, value: float) -> None:
    assert label_verdict()(reply) == value


@pytest.mark.parametrize(
    ("reply", "value"),
    [("Score: 7", 0.7), ("7/10", 0.7), ("3 out of 4: 3/4", 0.75), ("10", 1.0), ("0", 0.0)],
)
def test_score_verdicts(reply: str, value: float) -> None:
    assert score_verdict(10)(reply) == pytest.approx(value)


@pytest.mark.parametrize(
    ("reply", "message"),
    [("great answer", "has no score"), ("Score: 11", "score 11 is not in [0, 10]"),
     ("-1", "score -1 is not in")],
)  # fmt: skip
def test_score_verdicts_that_are_garbage(reply: str, message: str) -> None:
    with pytest.raises(RewardError, match=re.escape(message)):
        score_verdict(10)(reply)
