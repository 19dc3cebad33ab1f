"""The own-loop resume example, ``examples/resume_check.py``, end to end on CPU gloo ranks: a
real save and load through the optimizer's state dicts (the resumed run starts from another
init, so only a faithful load gives 0), and a swap of two moment elements named."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resume_check.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("resume_check", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_faithful_load_is_proven_and_a_swap_is_named() -> None:
    example = _example()
    faithful = example.main([])
    assert all(line == faithful[0] for line in faithful), "ranks disagree"
    assert faithful[0].startswith("norm_optim resume (iteration 2): 0 mismatches: every weight")
    swapped = example.main(["--corrupt"])
    assert swapped[0].startswith("norm_optim resume (iteration 2): 1 mismatches: ")
    assert "[exp_avg] (norm saved" in swapped[0]
    assert "the weights are as saved, but mains or moments differ" in swapped[0]
