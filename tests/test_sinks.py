"""Learnable attention sinks, counted exactly: the param megatron splits over TP but does not mark.

``TransformerConfig(softmax_type="learnable")`` gives every attention layer a ``softmax_offset``
of ``num_attention_heads / TP`` values per rank, without the ``tensor_model_parallel`` marker;
its ``sharded_state_dict`` declares it split on dim 0 over TP. Counting by the marker counts it on
TP rank 0 only (norm_optim did, and Megatron-LM's ``calc_params_l2_norm`` still does). Each case
builds the real model, optimizer and parallel state on gloo CPU ranks, fills every weight with
its layout-independent values (the oracle gives each TP rank's sink values by their global head
index, so an under-count changes the norm), and compares with the exact norm of the same model
built on one rank. Megatron's own value (megatron-core >= 0.17, which ships
``megatron.training``) is shown wrong in the same run, by exactly the sink values it misses.
Megatron-FSDP models too: their params are DTensor stand-ins, and the model inside the wrapper
declares the split.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import pytest

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer
from norm_optim._versions import megatron_at_least
from norm_optim.testing.oracle import (
    fill_deterministic_,
    global_param_shapes,
    named_global_parameters,
    oracle_sum_of_squares,
)
from tests.support.layouts import HYBRID, MTP, SINKS, SINKS_MOE, Layout

SEED = 11
REL = 1e-6
SINK = "core_attention.softmax_offset"

LAYOUTS = {
    "tp2-dp2": Layout(4, SINKS, tp=2),
    "tp2-ep2": Layout(4, SINKS_MOE, tp=2, ep=2),
    "tp2-pp2": Layout(4, SINKS, tp=2, pp=2),
    # Sinks in the MTP layer too, on a last stage whose sharded_state_dict megatron 0.19.2
    # cannot build (the declarations are then read module by module).
    "mtp-tp2-pp2": Layout(
        4, dataclasses.replace(MTP, num_layers=2, softmax_type="learnable"), tp=2, pp=2
    ),
    "hybrid-tp2-ep2": Layout(
        4, dataclasses.replace(HYBRID, softmax_type="learnable"), tp=2, ep=2, etp=1
    ),
}
# Where Megatron's own function is wrong by the sinks alone (on the MTP stage it also counts
# the unused output weight: too high).
ONLY_SINKS_MISSED = {"tp2-dp2", "tp2-ep2", "tp2-pp2", "hybrid-tp2-ep2"}
# Megatron-FSDP (optim_grads_params): its params are DTensor stand-ins; the model inside it
# declares the split.
FSDP_LAYOUTS = {"tp2-dp2", "tp2-ep2"}
_FSDP_BEFORE_019 = pytest.mark.skipif(
    not megatron_at_least(0, 19),
    reason="before megatron-core 0.19 norm_optim cannot read a "
    "Megatron-FSDP model's declarations (megatron's own would gather its DTensors): the sinks "
    "fall back to the markers there, and the registry notes it on every record",
)
CASES = [
    pytest.param(
        name,
        kind,
        id=f"{name}-{kind}",
        marks=layout.marks() + ([_FSDP_BEFORE_019] if kind == "megatron-fsdp" else []),
    )
    for name, layout in LAYOUTS.items()
    for kind in ("distopt", "fp16opt", "megatron-fsdp")
    if kind != "megatron-fsdp" or name in FSDP_LAYOUTS
]


def _unparallel_shapes(cfg: TinyGPTConfig) -> dict[str, tuple[int, ...]]:
    """Rank body: the same model on one rank (the oracle's shapes, sinks included)."""
    init_parallel()
    return global_param_shapes(build_model(cfg, seed=SEED))


def _megatron_norm(chunks: list, fsdp: bool) -> float | None:
    """Megatron-LM's own ``calc_params_l2_norm`` (None without ``megatron.training``)."""
    try:
        from megatron.training import global_vars
        from megatron.training.utils import calc_params_l2_norm
    except ImportError:
        return None
    global_vars.set_args(types.SimpleNamespace(use_megatron_fsdp=fsdp, bf16=True))
    return float(calc_params_l2_norm(chunks))


def _rank_body(layout: Layout, kind: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.megatron_fsdp import build_fsdp_model

    init_parallel(**layout.parallel())
    fsdp = kind == "megatron-fsdp"
    chunks = (
        build_fsdp_model(layout.cfg, seed=SEED)
        if fsdp
        else build_model(layout.cfg, use_distributed_optimizer=kind == "distopt", seed=SEED)
    )
    inner = build_optimizer(chunks)
    fill_deterministic_(chunks, SEED, optimizer=inner)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    # (Megatron-FSDP's original params have no storage of their own between steps: the DDP
    # cases show the values, the fill is the same.)
    sinks = (
        {}
        if fsdp
        else {
            name: param.detach().double().tolist()
            for name, param in named_global_parameters(chunks)
            if name.endswith(SINK)
        }
    )
    return {
        "norm": float(optimizer.param_l2_norm()),
        "megatron": _megatron_norm(chunks, fsdp),
        "shapes": global_param_shapes(chunks),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "sinks": sinks,
        "sink_records": [
            (r.tp_split, str(r.split_from), r.note)
            for r in optimizer.registry
            if r.name.endswith(SINK)
        ],
    }


@pytest.mark.parametrize("name,kind", CASES)
def test_learnable_sinks_counted_exactly(name: str, kind: str) -> None:
    layout = LAYOUTS[name]
    shapes = run_ranks(_unparallel_shapes, 1, layout.cfg)[0]
    sums = oracle_sum_of_squares(shapes, SEED)
    expected = math.sqrt(math.fsum(sums.values()))
    sink_names = [n for n in shapes if n.endswith(SINK)]
    assert sink_names and all(shapes[n] == (layout.cfg.num_attention_heads,) for n in sink_names)
    # What counting each sink on TP rank 0 only gives: the first num_heads / TP values.
    first_part = (layout.cfg.num_attention_heads // layout.tp,)
    missed = math.fsum(sums[n] for n in sink_names) - math.fsum(
        oracle_sum_of_squares({n: first_part for n in sink_names}, SEED).values()
    )
    assert missed > 0

    results = run_ranks(_rank_body, layout.world, layout, kind, timeout=240)

    by_tp: dict[int, dict[str, list[float]]] = {}
    for rank, got in enumerate(results):
        assert got["shapes"] == shapes, f"rank {rank}: the layout's model differs"
        assert got["norm"] == pytest.approx(expected, rel=REL), f"rank {rank}"
        for split, source, note in got["sink_records"]:
            assert split and source == "declaration" and "declared split on dim 0" in note
        by_tp.setdefault(got["tp_rank"], {}).update(got["sinks"])
        # Under Megatron-FSDP Megatron's function sums DTensors instead (exact on the dense
        # layout, wrong under EP for another reason: printed, not asserted).
        if got["megatron"] is not None and kind != "megatron-fsdp":
            assert got["megatron"] != pytest.approx(expected, rel=10 * REL)
        if got["megatron"] is not None and name in ONLY_SINKS_MISSED and kind != "megatron-fsdp":
            # Megatron's marker-based function misses the sink values of TP ranks > 0.
            assert got["megatron"] == pytest.approx(math.sqrt(expected**2 - missed), rel=REL)
    # The test can fail: each TP rank holds different sink values.
    assert all(by_tp[0][n] != by_tp[1][n] for n in by_tp[0])
    assert by_tp[0] or kind == "megatron-fsdp"
    print(
        f"\n{name} {kind}: norm_optim {results[0]['norm']:.6f}, exact {expected:.6f}, "
        f"Megatron's calc_params_l2_norm {results[0]['megatron']}"
    )
