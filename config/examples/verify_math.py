"""The verifier of rejection-sampling.yaml: is a sample's final answer the gold one?

A Python step (config/README.md, "Python steps") calls ``check`` once per row the draft step made (one
per sample), in the worker processes of a CPU job. It reads two columns, ``generation`` (the sample)
and ``answer`` (the input's gold answer: LaTeX without ``$``, as in MATH, or a plain number), and
returns the step's ``function.columns``:

- ``correct``: the answer math-verify reads from the sample (a ``\\boxed{}`` one first, else the last
  expression) equals the gold one as a number or expression (``0.5``, ``1/2`` and ``\\frac{1}{2}`` are
  equal; two different boxed answers are a set, and wrong);
- ``predicted``: that answer as math-verify reads it (LaTeX text), null when the sample has none.

A sample without an answer, or one math-verify cannot parse, is ``correct: False``, not an error.
math-verify limits each parse and comparison to 5 s itself (a SIGALRM: it must run in a process's main
thread, as the step's workers and the preflight call it). Needs ``pip install shardgen[verify]``.
"""

from math_verify import parse, verify


def check(row: dict) -> dict:
    generation = row.get("generation") or ""
    gold = "" if row.get("answer") is None else str(row["answer"])
    # Gold answers are LaTeX without delimiters: in $...$ math-verify reads \frac{\sqrt{3}}{2} too.
    expected = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
    predicted = parse(generation)
    correct = bool(expected and predicted and verify(expected, predicted))
    return {"correct": correct, "predicted": str(predicted[-1]) if predicted else None}
