"""slime's rule-based reward types (``--rm-type`` ``math``, ``deepscaler``, ``dapo``, ``f1``
and the ``boxed_`` prefix), each a function of the response text and the label that
returns a :class:`Verdict`; what each reads and compares: docs/rewards.md."""

from __future__ import annotations

import contextlib
import re
import string
from collections import Counter

from agentenv._sample import JSONValue
from agentenv.rewards._extract import after_thinking, last_boxed, last_number, normalize_text
from agentenv.rewards._verdict import Verdict
from agentenv.rewards._verifier import Equivalence, MathVerifier

__all__ = ["dapo", "deepscaler", "f1", "math"]


def _label_text(label: JSONValue) -> str:
    """The label as a string; a boxed label gives its content."""
    text = "" if label is None else str(label)
    boxed = last_boxed(text) if "\\boxed" in text else None
    return (boxed if boxed is not None else text).strip()


def _judge(answer: str, label: str, verifier: MathVerifier) -> Verdict:
    if normalize_text(answer) == normalize_text(label):
        return Verdict(1.0, answer)
    result = verifier.equivalent(label, answer)
    if result is Equivalence.EQUAL:
        return Verdict(1.0, answer)
    if result is Equivalence.DIFFERENT:
        return Verdict(0.0, answer)
    return Verdict(0.0, answer, result.value)


def math(response: str, label: JSONValue, verifier: MathVerifier) -> Verdict:
    """``--rm-type math`` (see the module docstring). Blocking: call it from a thread."""
    gold = _label_text(label)
    if not gold:
        return Verdict(0.0, None, "empty label")
    text = after_thinking(response)
    if text is None:
        return Verdict(0.0, None, "no answer: <think> is never closed")
    answer = last_boxed(text)
    if answer is None:
        answer = last_number(text)
    if answer is None or not answer.strip():
        return Verdict(0.0, None, "no answer: no \\boxed{} and no number")
    return _judge(answer.strip(), gold, verifier)


def deepscaler(response: str, label: JSONValue, verifier: MathVerifier) -> Verdict:
    """``--rm-type deepscaler``: only a boxed answer after the thinking counts."""
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return Verdict(0.0, None, "no answer: no </think> or ###Response before it")
    answer = last_boxed(solution)
    if answer is None or not answer.strip():
        return Verdict(0.0, None, "no answer: no \\boxed{} after the thinking")
    gold = _label_text(label)
    if not gold:
        return Verdict(0.0, answer, "empty label")
    return _judge(answer.strip(), gold, verifier)


# Minerva's normalisation of final answers (Lewkowycz et al. 2022), as DAPO scores them.
_REPLACED = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_DROPPED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)  # fmt: skip
_UNWRAPPED = ("text", "textbf", "overline")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL = 300  # characters of the response read (MATH-500's longest answer is 159)


def minerva_normalize(answer: str) -> str:
    """A final answer as DAPO compares it: the right side of an ``=``, units and TeX
    decoration dropped, ``\\fracab`` as ``\\frac{a}{b}``, ``1,000`` as ``1000``."""
    out = answer.split("=")[-1]
    for old, new in _REPLACED:
        out = out.replace(old, new)
    for dropped in _DROPPED:
        out = out.replace(dropped, "")
    out = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", out)  # the first $...$ only
    for command in _UNWRAPPED:
        out = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", out)
    out = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", out)
    out = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", out)
    out = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", out)
    out = out.replace("$", "")
    if out.replace(",", "").isdigit():
        out = out.replace(",", "")
    return out.strip()


def dapo(response: str, label: JSONValue) -> Verdict:
    """``--rm-type dapo``: 1 for the right ``Answer:`` line, -1 otherwise (``acc`` and
    ``pred`` in the verdict's extras)."""
    found = _ANSWER_LINE.findall(response[-_DAPO_TAIL:])
    gold = minerva_normalize(str(label))
    # DAPO's answers are integers ("12.0" and "12" are one); another is compared as text.
    with contextlib.suppress(ValueError):
        gold = str(int(float(gold)))
    if not found:
        extra: dict[str, JSONValue] = {"acc": False, "pred": None}
        return Verdict(-1.0, None, "no answer: no 'Answer:' line in the last 300 characters",
                       extra)  # fmt: skip
    pred = minerva_normalize(found[-1])
    right = pred == gold
    return Verdict(1.0 if right else -1.0, pred, None, {"acc": right, "pred": pred})


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_CLOSED = ("yes", "no", "noanswer")


def _squad_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def f1(response: str, label: JSONValue) -> Verdict:
    """``--rm-type f1``: token F1 of the response against the label (0 when either is
    yes/no/noanswer and they differ)."""
    pred, gold = _squad_tokens(response), _squad_tokens("" if label is None else str(label))
    joined_pred, joined_gold = " ".join(pred), " ".join(gold)
    if (joined_pred in _CLOSED or joined_gold in _CLOSED) and joined_pred != joined_gold:
        return Verdict(0.0, joined_pred)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return Verdict(0.0, joined_pred, None if pred else "empty response")
    precision, recall = same / len(pred), same / len(gold)
    return Verdict(2 * precision * recall / (precision + recall), joined_pred)
