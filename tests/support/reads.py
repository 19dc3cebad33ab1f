"""What the data-parallel-mode tests (Megatron-FSDP v1 / v2, torch FSDP2) read and check on each
rank: the norms through the wrapper with the collectives they took, and the unparallel oracle."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model
from norm_optim.testing.oracle import global_param_shapes, oracle_sum_of_squares

MAIN_SCALE = 1.0 + 2.0**-10
"""What the tests scale the fp32 mains by (not representable in bf16): a norm read from the
bf16 weights instead of the mains is then off by far more than ``REL``."""
REL = 1e-6


def read_norms(optimizer: Any, counting: Any) -> dict[str, Any]:
    """Total, split and per-param norms; the collectives they took, per call (``counting``
    counts the wrapper's all-reduces)."""
    counting.all_reduces = 0
    total = float(optimizer.param_l2_norm())
    split = optimizer.param_l2_norms()
    per_param = optimizer.param_l2_norms(per_param=True)
    return {
        "total": total,
        "dense": float(split.dense),
        "expert": float(split.expert),
        "per_param": {k: float(v) for k, v in per_param.per_param.items()},
        "collectives": counting.all_reduces / 3,
    }


def check_read(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """A :func:`read_norms` result against the oracle: total, split, every per-param norm and
    its name, and one all-reduce per call."""
    assert got["total"] == pytest.approx(expected["total"], rel=REL), what
    assert got["expert"] == pytest.approx(expected["expert"], rel=REL, abs=1e-12), what
    assert got["dense"] ** 2 + got["expert"] ** 2 == pytest.approx(
        expected["total"] ** 2, rel=REL
    ), what
    assert set(got["per_param"]) == set(expected["per_param"]), f"{what}: per-param names"
    for name, value in got["per_param"].items():
        assert value == pytest.approx(expected["per_param"][name], rel=REL), f"{what}: {name}"
    assert got["collectives"] == 1, f"{what}: one all-reduce per call, breakdowns included"


def unparallel_shapes(cfg: TinyGPTConfig, freeze: tuple[str, ...]) -> dict[str, dict]:
    """Rank body: the same model on one rank, no parallelism, plain DDP (the oracle's shapes)."""
    init_parallel()
    chunks = build_model(cfg, freeze=freeze)
    return {
        "all": global_param_shapes(chunks, trainable_only=False),
        "trainable": global_param_shapes(chunks, trainable_only=True),
    }


@functools.lru_cache(maxsize=None)
def unparallel_oracle(cfg: TinyGPTConfig, freeze: tuple[str, ...], seed: int) -> dict[str, Any]:
    """The exact norms of the unparallel build's weights at ``seed``, trainable mains scaled by
    :data:`MAIN_SCALE` (frozen params are not)."""
    shapes = run_ranks(unparallel_shapes, 1, cfg, freeze)[0]
    sums = oracle_sum_of_squares(shapes["all"], seed)
    trainable = set(shapes["trainable"])
    scaled = {n: s * (MAIN_SCALE**2 if n in trainable else 1.0) for n, s in sums.items()}
    return {
        "shapes": shapes["all"],
        "total": math.sqrt(math.fsum(scaled.values())),
        "expert": math.sqrt(math.fsum(s for n, s in scaled.items() if ".experts." in n)),
        "trainable": math.sqrt(math.fsum(s for n, s in scaled.items() if n in trainable)),
        "per_param": {n: math.sqrt(s) for n, s in scaled.items()},
    }
