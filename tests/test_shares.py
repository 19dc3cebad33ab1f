"""``pytest --share I/N`` (``tests/conftest.py``), which CI's in-between release lines use to run
half the subset each: the N shares are disjoint and together are every collected test, and a
malformed share is a usage error, never a silently empty run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ["tests/test_errors.py"]


def _collected(*extra: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + FILES
        + list(extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, [line for line in result.stdout.splitlines() if "::" in line]


def test_the_shares_split_the_tests_between_them() -> None:
    code, everything = _collected()
    assert code == 0 and len(everything) > 10
    halves = []
    for index in range(2):
        code, half = _collected(f"--share={index}/2")
        assert code == 0 and half, half
        halves.append(set(half))
    assert not halves[0] & halves[1]
    assert halves[0] | halves[1] == set(everything)


def test_a_malformed_share_is_a_usage_error() -> None:
    for bad in ("2/2", "a/b"):
        code, collected = _collected(f"--share={bad}")
        assert code == 4 and not collected, bad  # pytest's usage-error exit code
