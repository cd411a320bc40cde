"""config/examples/verify_math.py, the verifier of config/examples/rejection-sampling.yaml (math-verify,
in the dev extra): loaded as the example's Python step loads it, from the example's own `function`
section, it tells a correct final answer from a wrong or a missing one, and passes the preflight."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from shardgen.config import RunConfig
from shardgen.features import functions, steps
from tests.conftest import ROOT

EXAMPLES = ROOT / "config" / "examples"


@pytest.fixture(scope="module")
def spec() -> dict:
    """The example's verify step's `function` section, its path resolved as a run resolves it."""
    config = RunConfig.load(EXAMPLES / "rejection-sampling.yaml")
    (verify,) = [c for c in steps.step_configs(config.raw) if c["task"] == "function"]
    return verify["function"]


def test_the_examples_function_path_is_the_verifier_beside_it(spec):
    assert Path(spec["path"]) == EXAMPLES / "verify_math.py"
    assert spec["columns"] == {"correct": "bool", "predicted": "string"}


@pytest.mark.parametrize(
    ("generation", "gold", "correct", "predicted"),
    [
        ("2 + 2 = 4, so the answer is \\boxed{4}.", "4", True, "4"),
        ("2 + 2 = 5, so the answer is \\boxed{5}.", "4", False, "5"),
        ("I could not work this one out.", "4", False, None),  # no answer: wrong, not an error
        ("", "4", False, None),
        ("Half of them: \\boxed{0.5}", "\\frac{1}{2}", True, "\\frac{1}{2}"),  # a decimal, a fraction
        ("So the answer is $\\frac{1}{2}$.", "0.5", True, "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True, "\\frac{\\sqrt{3}}{2}"),  # gold without $
        ("The answer is 12.", 12, True, "12"),  # a gold column of integers
    ],
)
def test_the_verifier_tells_a_correct_answer_from_a_wrong_or_missing_one(spec, generation, gold, correct, predicted):
    check = functions.load_function(spec)
    row = {"problem": "a problem", "answer": gold, "sample_index": 0, "generation": generation}
    out = check(row)
    assert out == {"correct": correct, "predicted": predicted}
    assert functions.typed_row(out, spec["columns"]) == out  # of the declared columns and types


def test_the_preflight_accepts_the_verifier_on_sampled_rows_and_a_later_steps_without_calling_it(spec):
    schema = pa.schema([("problem", pa.string()), ("answer", pa.string()), ("sample_index", pa.int64()),
                        ("generation", pa.string())])  # fmt: skip
    row = {"problem": "1 + 1?", "answer": "2", "sample_index": 3, "generation": "\\boxed{2}"}
    assert functions.check_rows(spec, [(0, row)], schema) == ([], [], 1)  # one call, in a worker process
    assert functions.check_rows(spec, [], schema) == ([], [], 0)  # before the draft step made its rows: imported
