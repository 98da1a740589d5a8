"""Hand-checked reference cases of each rule-based ``--rm-type``: (response, label,
reward), the known traps among them (units, ``\\frac`` against a decimal, several boxed
answers, answers inside ``<think>``, empty output)."""

from __future__ import annotations

from typing import Any

Case = tuple[str, Any, float]

MATH: list[Case] = [
    ("\\boxed{4}", "4", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # \frac against a decimal
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),  # a rounded decimal is another number
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # units
    ("\\boxed{5\\text{ meters}}", "5", 1.0),
    ("It costs 12 dollars", "12", 1.0),  # no box: the last number
    ("\\boxed{1} or maybe \\boxed{2}", "2", 1.0),  # several boxed: the last counts
    ("\\boxed{1} or maybe \\boxed{2}", "1", 0.0),
    ("<think>the answer is 7</think>The answer is \\boxed{8}", "8", 1.0),
    ("<think>it is \\boxed{7}</think>So \\boxed{8}", "7", 0.0),  # inside <think>: not it
    ("<think>7 is it</think>", "7", 0.0),  # nothing after the thinking
    ("<think>I think \\boxed{7}", "7", 0.0),  # the thinking never closed
    ("", "7", 0.0),  # empty output
    ("I don't know", "7", 0.0),
    ("\\boxed{x=3}", "3", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{-2}", "-2", 1.0),
    ("\\boxed{2}", "-2", 0.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{East}", "east", 1.0),  # a text answer, case ignored
    ("\\boxed{\\text{east}}", "East", 1.0),
    ("The result: 3/4", "0.75", 1.0),
    ("the total is -1,234.5", "-1234.5", 1.0),
    ("\\boxed{7}", "\\boxed{7}", 1.0),  # a boxed label
    ("\\boxed{7}", "", 0.0),  # an empty label
    ("\\boxed{}", "7", 0.0),  # an empty box
    ("\\boxed{2x+1}", "1+2x", 1.0),
    ("\\fbox{6}", "6", 1.0),
    ("so it is \\boxed 5", "5", 1.0),
    ("\\boxed{\\frac{1}{2}} apples", "\\frac12", 1.0),
    ("3 + 4 = 7", "7", 1.0),
    ("\\boxed{42}", 42, 1.0),  # a JSON number label
    ("\\boxed{43}", 42, 0.0),
]

DEEPSCALER: list[Case] = [
    ("<think>2+2</think>\\boxed{4}", "4", 1.0),
    ("\\boxed{4}", "4", 0.0),  # no </think>: not an answer
    ("<think>\\boxed{4}</think>", "4", 0.0),  # the box is inside the thinking
    ("<think>x</think>The answer is 4", "4", 0.0),  # no box
    ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>x</think>\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("<think>x</think>\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("<think>x</think>\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("<think>x</think>\\boxed{1} then \\boxed{2}", "2", 1.0),
    ("<think>x</think>\\boxed{1} then \\boxed{2}", "1", 0.0),
    ("<think>\\boxed{7}</think>so \\boxed{8}", "8", 1.0),
    ("<think>\\boxed{7}</think>so \\boxed{8}", "7", 0.0),
    ("<think>unfinished \\boxed{7}", "7", 0.0),
    ("", "7", 0.0),
    ("###Response \\boxed{9}", "9", 1.0),  # the other marker
    ("###Response 9", "9", 0.0),
    ("<think>a</think><think>b</think>\\boxed{3}", "3", 1.0),  # after the last </think>
    ("<think>x</think>\\boxed{7}", "\\boxed{7}", 1.0),
    ("<think>x</think>\\boxed{7}", "", 0.0),
    ("<think>x</think>\\boxed{}", "7", 0.0),
    ("<think>x</think>\\boxed{x = 3}", "3", 1.0),
    ("<think>x</think>\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("<think>x</think>\\boxed{1,000}", "1000", 1.0),
    ("<think>x</think>\\boxed{-3}", "3", 0.0),
    ("<think>x</think>\\boxed{\\text{Monday}}", "monday", 1.0),
    ("<think>x</think>\\boxed{10}", 10, 1.0),
    ("<think>x</think>\\boxed{3.5}", 3.5, 1.0),
    ("<think>x</think>\\boxed{\\sqrt{4}}", "2", 1.0),
    ("<think>x</think>\\boxed{2\\pi}", "2\\pi", 1.0),
    ("<think>x</think>\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("<think>x</think>\\fbox{12}", "12", 1.0),
]

DAPO: list[Case] = [
    ("Answer: 12", "12", 1.0),
    ("Answer: 12", "13", -1.0),
    ("The result is 12", "12", -1.0),  # no 'Answer:' line
    ("", "12", -1.0),  # empty output
    ("answer: 12", "12", 1.0),  # any case
    ("ANSWER :  12", "12", 1.0),
    ("Answer: 12\nAnswer: 13", "13", 1.0),  # the last line counts
    ("Answer: 12\nAnswer: 13", "12", -1.0),
    ("Answer: 12", "12.0", 1.0),  # the label is an integer
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: $12$", "12", 1.0),
    ("Answer: \\boxed{12}", "12", 1.0),
    ("Answer: x = 12", "12", 1.0),  # the right side of '='
    ("Answer: 12 degrees", "12", 1.0),  # units dropped
    ("Answer: 12 cm", "12", 1.0),
    ("Answer: 12^\\circ", "12", 1.0),
    ("Answer: \\text{12}", "12", 1.0),
    ("Answer: 12 dollars", "12", 1.0),
    ("Answer: 12.5", "12", -1.0),
    ("Answer: 0012", "12", -1.0),  # compared as text after normalisation
    ("Answer: -5", "-5", 1.0),
    ("Answer: 5", "-5", -1.0),
    ("Answer: 12 points", "12", 1.0),
    ("Answer: 12 students", "12", 1.0),
    # One line: the first 'Answer:' takes the rest of it, as DAPO reads it.
    ("<think>Answer: 3</think>Answer: 4", "4", -1.0),
    ("Answer: 7" + " filler" * 60, "7", -1.0),  # beyond the last 300 characters
    ("x" * 400 + "\nAnswer: 7", "7", 1.0),  # within them
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # not an integer label: as text
    ("Answer: \\frac{1}{2}", "\\frac12", 1.0),
    ("Answer: 12", 12, 1.0),  # a JSON number label
    ("Answer:12", "12", 1.0),
    ("Answer: 12 ways", "12", 1.0),
]

F1: list[Case] = [
    ("Paris", "Paris", 1.0),
    ("paris", "Paris", 1.0),  # case
    ("Paris.", "Paris", 1.0),  # punctuation
    ("The Eiffel Tower", "Eiffel Tower", 1.0),  # articles
    ("the cat sat", "cat sat on mat", 2 * (2 / 2) * (2 / 4) / (2 / 2 + 2 / 4)),
    ("London", "Paris", 0.0),
    ("", "Paris", 0.0),  # empty output
    ("yes", "no", 0.0),  # yes/no must match exactly
    ("yes", "yes", 1.0),
    ("no", "no", 1.0),
    ("yes it is", "yes", 0.0),  # a yes label needs exactly yes
    ("yes", "yes it is", 0.0),
    ("noanswer", "Paris", 0.0),
    ("Paris France", "Paris", 2 * 0.5 * 1 / 1.5),
    ("Paris", "Paris France", 2 * 1 * 0.5 / 1.5),
    ("b c d", "b", 2 * (1 / 3) * 1 / (1 / 3 + 1)),
    ("New  York   City", "new york city", 1.0),  # whitespace
    ("Barack Obama", "Obama", 2 * 0.5 * 1 / 1.5),
    ("Obama Obama", "Obama", 2 * 0.5 * 1 / 1.5),  # repeated tokens count once each
    ("1990", "1990", 1.0),
    ("1,990", "1990", 1.0),  # the comma is punctuation
    ("an apple", "apple", 1.0),
    ("apples", "apple", 0.0),
    ("red blue", "blue red", 1.0),  # order does not matter
    ("x y z", "z y x w", 2 * 1 * 0.75 / 1.75),
    ("Mount Everest!", "mount everest", 1.0),
    ("it's", "its", 1.0),  # the apostrophe is punctuation
    ("the", "the", 0.0),  # articles only: no tokens in common
    ("Tokyo", 5, 0.0),  # a non-string label, as text
    ("5", 5, 1.0),
]
