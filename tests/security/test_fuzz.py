"""The fuzz suite: mutated real models give a typed error or an output, never a crash,
a hang, an untyped exception or a file opened outside the model's folder."""

from __future__ import annotations

import os

import pytest

from security.fuzz import run_fuzz

CASES = int(os.environ.get("PLUGRT_FUZZ_CASES", "200"))
SEED = int(os.environ.get("PLUGRT_FUZZ_SEED", "0"))
WORKERS = int(os.environ.get("PLUGRT_FUZZ_WORKERS", "1"))


@pytest.fixture(scope="module")
def summary() -> dict:
    return run_fuzz(CASES, SEED, WORKERS)


def test_every_case_ran_and_the_audit_hook_sees_an_open_outside(summary):
    assert summary["cases"] == CASES
    # the canary opens the secret deliberately: a hook that saw nothing would prove nothing
    assert any(p.endswith("secret.bin") for p in summary["canary_outside"])
    # the corpus exercises both sides of the contract
    assert summary["outcomes"].get("ok", 0) > 0 and summary["outcomes"].get("typed", 0) > 0


def test_no_worker_crashes(summary):
    assert summary["crashes"] == []


def test_no_case_hangs(summary):
    assert summary["hangs"] == []


def test_load_and_run_raise_only_plugrt_errors(summary):
    assert summary["untyped"] == []


def test_no_file_is_opened_outside_the_model_folder(summary):
    assert summary["outside"] == []
