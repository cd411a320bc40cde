"""The test command cannot pass with a whole category of tests missing."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_suite_fails_when_a_required_category_did_not_run():
    r = pytest_run("tests/unit/test_cli.py", "--require-markers=engine,slurm")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "required test categories did not run: no 'engine' test passed; no 'slurm' test passed" in r.stdout


def test_ci_clears_variables_that_would_narrow_the_suite_and_make_test_requires_both_categories():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "unset PYTEST_ARGS PYTEST_ADDOPTS" in ci and "make test" in ci
    makefile = (ROOT / "Makefile").read_text()
    assert "pytest --require-markers=engine,slurm $(PYTEST_ARGS)" in makefile
