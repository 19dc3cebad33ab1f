"""Step norms of megatron's precision-aware optimizer against the test's own snapshots.

``use_precision_aware_optimizer`` hands the distributed optimizer's bf16 shards to Transformer
Engine's ``FusedAdam`` with master weights: the fp32 masters live in its state (whole, or as
int16 remainders beside the bf16 shard with ``store_param_remainders``), the grads arrive as
``decoupled_grad`` (the ``main_grad`` shard: fp32, or bf16 with ``--main-grads-dtype bf16``),
and its moments may be bf16. TE needs CUDA: the CPU ranks run
:class:`~tests.support.precision_aware_standin.PrecisionAwareAdamStandIn` (TE's class name,
flags, state layout and kernel math, read from its sources) inside the real megatron-core
distributed optimizer.

Each case trains one plain step (the masters and moments exist), arms the next and runs it
through a probe that, right before ``step()``, copies every master this rank's inner optimizer
steps (decoded from the remainders where it keeps them) and the grads (``main_grad``, before
megatron clips), and after it reads the masters again and the moments in their dtype directly.
The oracle is the sum over ranks of those snapshots (every distributed-optimizer shard counts;
TP duplicates on TP rank 0 only): independent of the registry. The update is derived from what
the step reads, so it matches the stored difference within one ulp of each weight (and a few
2^-24 of the update per param), as docs/step-norms.md states for every derived rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer
from norm_optim._versions import megatron_at_least
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, train_step
from tests.support.layouts import SMALL
from tests.support.arming import assert_training_unchanged, train_armed
from tests.support.step_oracle import differences, reduced_norms, sum_of_squares, ulps

SEED = 7
REL = 1e-6
UPDATE_ROUNDING = 8 * 2.0**-24
QUANTITIES = ("weights", "grads", "updates", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Case:
    world: int = 2
    tp: int = 1
    moments: torch.dtype = torch.float32  # exp_avg_dtype and exp_avg_sq_dtype
    bf16_grads: bool = False  # --main-grads-dtype bf16 (DDP reduces in bf16)
    remainders: bool = False
    decoupled: bool = True  # adam_w_mode
    bias_correction: bool = True
    clip_grad: float = 1.0


CASES = {
    "dp2-fp32-moments": Case(),
    "dp2-bf16-moments": Case(moments=torch.bfloat16),
    "tp2-dp2-bf16-moments-bf16-grads": Case(4, tp=2, moments=torch.bfloat16, bf16_grads=True),
    "dp2-remainders-bf16-moments-clipping": Case(
        moments=torch.bfloat16, remainders=True, clip_grad=0.05
    ),
    "dp2-l2-no-bias-correction-bf16-moments": Case(
        moments=torch.bfloat16, decoupled=False, bias_correction=False
    ),
}


def _build(case: Case) -> tuple[list, Any]:
    from tests.support.precision_aware_standin import build_precision_aware_optimizer

    init_parallel(tp=case.tp)
    chunks = build_model(
        SMALL, use_distributed_optimizer=True, seed=SEED, grad_reduce_in_fp32=not case.bf16_grads
    )
    fields: dict[str, Any] = dict(clip_grad=case.clip_grad, weight_decay=0.1)
    if case.moments != torch.float32:
        fields.update(exp_avg_dtype=case.moments, exp_avg_sq_dtype=case.moments)
    if case.bf16_grads:
        fields["main_grads_dtype"] = torch.bfloat16
    if megatron_at_least(0, 15):  # 0.14 has no decoupled_weight_decay: always adam_w_mode
        fields["decoupled_weight_decay"] = case.decoupled
    inner = build_precision_aware_optimizer(
        chunks, store_param_remainders=case.remainders, **fields
    )
    for leaf in inner.chained_optimizers:
        for group in leaf.optimizer.param_groups:
            group["bias_correction"] = case.bias_correction
    return chunks, inner


class Probe:
    """Stands in for the optimizer in ``train_step``: snapshots around the real ``step()``."""

    def __init__(self, optimizer: Any, inner: Any) -> None:
        self.optimizer, self.inner = optimizer, inner
        self.sums = [0.0] * 6
        self.dtypes: set[str] = set()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> Any:
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        before = []
        for leaf in self.inner.chained_optimizers:
            te = leaf.optimizer
            for models, shards in zip(leaf.model_float16_groups, leaf.shard_float16_groups):
                for param, shard in zip(models, shards):
                    if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
                        continue  # a TP duplicate: TP rank 0's copy counts
                    r = leaf._get_model_param_range_map(param)["param"]
                    grad = param.main_grad.detach().reshape(-1)[r.start : r.end].double()
                    master = te.get_unscaled_state(shard, "master_param").clone()
                    before.append((te, shard, master, grad))
        self.result = self.optimizer.step()
        for te, shard, old, grad in before:
            new = te.get_unscaled_state(shard, "master_param")
            state = te.state[shard]
            self.dtypes.update(str(state[k].dtype) for k in ("exp_avg", "exp_avg_sq"))
            values = [
                sum_of_squares([new]),
                sum_of_squares([grad]),
                sum_of_squares(differences([new], [old])),
                sum_of_squares([state["exp_avg"]]),
                sum_of_squares([state["exp_avg_sq"]]),
                sum_of_squares(ulps([new])),
            ]
            for i, v in enumerate(values):
                self.sums[i] += v
        return self.result

    def oracle(self) -> list[float]:
        return reduced_norms(self.sums)


def _measured(case: Case) -> dict:
    chunks, inner = _build(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)  # the masters and moments exist
    optimizer.measure_next_step(per_param=True)
    probe = Probe(optimizer, inner)
    ok, grad_norm, _ = train_step(chunks, probe, seed=1)
    s = optimizer.step_norms()
    grads = {
        str(getattr(p, "decoupled_grad").dtype)
        for leaf in inner.chained_optimizers
        for g in leaf.optimizer.param_groups
        for p in g["params"]
        if getattr(p, "decoupled_grad", None) is not None
    }
    return {
        "ok": ok,
        "grad_norm": grad_norm,
        "got": [float(getattr(s, q).total) for q in QUANTITIES],
        "oracle": probe.oracle(),
        "moment_dtypes": sorted(probe.dtypes),
        "grad_dtypes": sorted(grads),
        "remainders": any(
            s.get("master_param") is not None and s["master_param"].dtype == torch.int16
            for leaf in inner.chained_optimizers
            for s in leaf.optimizer.state.values()
        ),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_precision_aware_step_norms_against_the_snapshots(name: str) -> None:
    case = CASES[name]
    if not case.decoupled and not megatron_at_least(0, 15):
        pytest.skip("megatron-core 0.14 has no decoupled_weight_decay: its FusedAdam is AdamW")
    results = run_ranks(_measured, case.world, case)
    for rank, result in enumerate(results):
        assert result["ok"]
        assert result["moment_dtypes"] == [str(case.moments)], "the case must keep these moments"
        assert result["grad_dtypes"] == [str(torch.bfloat16 if case.bf16_grads else torch.float32)]
        assert result["remainders"] is case.remainders
        got, oracle = result["got"], result["oracle"]
        # Megatron's own grad norm: its CPU fallback (torch.norm per tensor, no apex / TE)
        # rounds each bf16 grad's norm to bf16 (7e-4 off the snapshots here, where ours is
        # within 1e-8); with fp32 grads it agrees to fp32 summation.
        megatron_rel = 2.0**-8 if case.bf16_grads else REL
        assert got[1] == pytest.approx(result["grad_norm"], rel=megatron_rel), "Megatron's norm"
        if case.clip_grad < 1.0:
            assert result["grad_norm"] > case.clip_grad, "the case must clip"
        for i, q in enumerate(QUANTITIES):
            if q == "updates":
                bound = oracle[5] + UPDATE_ROUNDING * oracle[2]
                assert abs(got[i] - oracle[i]) <= bound, (rank, got, oracle)
            else:
                assert got[i] == pytest.approx(oracle[i], rel=REL), (rank, q, got[i], oracle[i])


def _training(case: Case, armed: bool) -> dict:
    chunks, inner = _build(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    # The first step creates the masters the registry then holds.
    returns = train_armed(chunks, optimizer, armed, first_armed=1)
    leaves = [leaf.optimizer for leaf in inner.chained_optimizers]
    return {
        "returns": returns,
        "params": [p.detach().clone() for c in chunks for p in c.parameters()],
        "state": [t.clone() for o in leaves for s in o.state.values() for t in s.values()],
        "own": [sorted(vars(o)) for o in leaves],
    }


def test_arming_changes_no_training_bit() -> None:
    case = CASES["dp2-remainders-bf16-moments-clipping"]
    plain = run_ranks(_training, case.world, case, False)
    armed = run_ranks(_training, case.world, case, True)
    assert_training_unchanged(plain, armed, "the step's wrapper was left behind")
