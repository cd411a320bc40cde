"""The test command cannot pass with a whole category of tests missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("processes", [[], ["-n", "2"]], ids=["one process", "two (pytest-xdist)"])
def test_the_suite_fails_when_a_required_category_did_not_run(processes):
    r = pytest_run("tests/unit/test_cli.py", "--require-markers=engine,slurm", *processes)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "required test categories did not run: no 'engine' test passed; no 'slurm' test passed" in r.stdout


def test_ci_clears_variables_that_would_narrow_the_suite_and_make_test_requires_both_categories():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "unset PYTEST_ARGS PYTEST_ADDOPTS" in ci and "make test" in ci
    makefile = (ROOT / "Makefile").read_text()
    # the suite in two processes, then the tests that run alone: both must have both categories
    assert 'pytest -n 2 --dist loadgroup -m "not serial" --require-markers=engine,slurm $(PYTEST_ARGS)' in makefile
    assert "pytest -m serial --require-markers=engine,slurm $(PYTEST_ARGS)" in makefile
