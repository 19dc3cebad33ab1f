"""fp32 masters kept as Transformer Engine keeps them with ``store_param_remainders=True``.

TE's FusedAdam stores the low 16 bits of each fp32 master as an int16 remainder and the high 16
bits, rounded, as the bf16 param. These tests pin that bit encoding (the stand-in's
``split_master`` / ``join_master`` against a scalar transcription of TE's kernel, and norm_optim's
decoder against both), then check the sums of squares per slot, the memory bound, and the global
norm of megatron's precision-aware distributed optimizer on real gloo ranks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from norm_optim._kernels import RemainderMaster, SumOfSquaresPlan
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, train_step
from tests.support.precision_aware_standin import (
    build_precision_aware_optimizer,
    join_master,
    split_master,
)

SEED = 3
STEPS = 2
SMALL = TinyGPTConfig(hidden_size=32, num_layers=2, num_attention_heads=4, vocab_size=64)


# ------------------------------------------------------------------------ the bit encoding


def _te_split(bits: int) -> tuple[int, int]:
    """TE's ``adam_functor_master_param_remainder`` store, one fp32 bit pattern as plain ints:
    the int16 halves of the fp32 (a union), the high half incremented when the remainder is
    negative. Returns (bf16 bits, remainder bits), each as an unsigned 16-bit int."""
    high, low = (bits >> 16) & 0xFFFF, bits & 0xFFFF
    if low & 0x8000:  # int16(low) < 0
        high = (high + 1) & 0xFFFF
    return high, low


def _te_join(high: int, low: int) -> int:
    """TE's load: undo the rounding when the remainder is negative, then put the halves together."""
    if low & 0x8000:
        high = (high - 1) & 0xFFFF
    return (high << 16) | low


def _as_fp32(bits: list[int]) -> torch.Tensor:
    signed = [b - (1 << 32) if b & 0x80000000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in t.contiguous().view(torch.int32).tolist()]


def _halves(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in t.view(torch.int16).tolist()]


def _decoded(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    out = torch.full(param.shape, float("nan"))
    return RemainderMaster(param, remainder).decode_into(out)


# Zeros, subnormals, the remainder's sign bit, carries into the exponent, the largest finite value
# (its high half rounds to bf16 inf), infinities and NaNs (whose increment wraps around).
EDGES = [
    0x00000000,
    0x80000000,
    0x00000001,
    0x80000001,
    0x00007FFF,
    0x00008000,
    0x0000FFFF,
    0x807FFFFF,
    0x3F800000,
    0xBF800000,
    0x3F807FFF,
    0x3F808000,
    0x3F808001,
    0x3F80FFFF,
    0xBF80FFFF,
    0x3FFFFFFF,
    0x7F7F8000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7FFF8000,
    0x7FFFFFFF,
    0xFFFFFFFF,
    0xFFFF7FFF,
]


def test_stand_in_encodes_exactly_as_te_does() -> None:
    master = _as_fp32(EDGES)
    high, remainder = split_master(master)
    assert high.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert list(zip(_halves(high), _halves(remainder))) == [_te_split(b) for b in EDGES]
    assert [_te_join(*_te_split(b)) for b in EDGES] == EDGES
    assert _bits(join_master(high, remainder)) == EDGES
    assert _bits(_decoded(high, remainder)) == EDGES


def test_round_trip_is_bit_exact_for_every_kind_of_value() -> None:
    g = torch.Generator().manual_seed(0)
    every_pattern = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=g, dtype=torch.int64)
    # Signed values from subnormal (1e-45) to overflowing magnitudes, and subnormals only.
    wide = torch.randn(1 << 20, generator=g) * torch.logspace(-45, 38, 1 << 20)
    samples = [
        every_pattern.to(torch.int32).view(torch.float32),
        wide,
        torch.randn(1 << 16, generator=g) * 1e-40,
    ]
    for master in samples:
        high, remainder = split_master(master)
        assert torch.equal(join_master(high, remainder).view(torch.int32), master.view(torch.int32))
        assert torch.equal(_decoded(high, remainder).view(torch.int32), master.view(torch.int32))


def test_param_is_the_master_rounded_to_nearest() -> None:
    """Away from ties and NaNs, the high half is what a bf16 cast gives (TE rounds ties up in
    magnitude, torch to even)."""
    master = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    master = master[(master.view(torch.int32) & 0xFFFF) != 0x8000]
    high, remainder = split_master(master)
    assert torch.equal(high.view(torch.int16), master.bfloat16().view(torch.int16))
    assert bool((remainder != 0).any()) and bool((remainder < 0).any())


def test_remainder_master_checks_what_it_pairs() -> None:
    param, remainder = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int16)
    with pytest.raises(TypeError, match="bfloat16 param with an int16 remainder"):
        RemainderMaster(param.float(), remainder)
    with pytest.raises(TypeError, match="bfloat16 param with an int16 remainder"):
        RemainderMaster(param, remainder.int())
    with pytest.raises(ValueError, match="must match"):
        RemainderMaster(param, remainder[:4])
    with pytest.raises(ValueError, match="contiguous"):
        RemainderMaster(param.view(2, 4).t(), remainder.view(2, 4).t())
    master = RemainderMaster(param.view(2, 4), remainder.view(2, 4))
    assert (master.numel(), master.shape, master.dtype) == (8, torch.Size([2, 4]), torch.float32)
    assert master.device == param.device


# ------------------------------------------------------------------------ sums of squares


def _split_all(masters: list[torch.Tensor]) -> list[RemainderMaster]:
    return [RemainderMaster(*split_master(m)) for m in masters]


def _reference(masters: list[torch.Tensor], slots: list[int], num_slots: int) -> torch.Tensor:
    out = torch.zeros(num_slots, dtype=torch.float64)
    for master, slot in zip(masters, slots):
        out[slot] += master.double().square().sum()
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-7) -> None:
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=rel, atol=0), ((got - want).abs() / want.abs()).max()


@pytest.mark.parametrize(
    "sizes",
    [[5_000_001], [1, 3, 255, 256, 257], [70_000, 131_072, 131_073, 4096] * 3],
    ids=["large", "tiny", "around-blocks"],
)
def test_sums_per_slot_equal_those_of_the_fp32_masters(sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(2)
    masters = [torch.randn(n, generator=g) * 3 - 1 for n in sizes]  # mostly negative
    slots = list(range(len(masters)))
    plan = SumOfSquaresPlan(_split_all(masters), slots, len(masters))
    _assert_close(plan(), _reference(masters, slots, len(masters)))
    assert plan.scratch_bytes <= 1 << 20
    assert plan.numel == sum(sizes) and plan.nbytes == 4 * sum(sizes)


def test_mixed_with_plain_tensors_in_shared_slots() -> None:
    g = torch.Generator().manual_seed(3)
    masters = [torch.randn(n, generator=g) for n in (100_000, 10, 300)]
    fp32, bf16 = torch.randn(50_000, generator=g), torch.randn(1000, generator=g).bfloat16()
    summands = [fp32, *_split_all(masters), bf16, RemainderMaster(*split_master(torch.empty(0)))]
    slots = [0, 1, 0, 1, 0, 1]
    plan = SumOfSquaresPlan(summands, slots, 2)
    want = _reference([fp32, *masters, bf16.float()], slots[:5], 2)
    _assert_close(plan(), want)
    assert plan.backends == {
        (torch.device("cpu"), torch.float32): "cpu row norms of decoded remainders",
        (torch.device("cpu"), torch.bfloat16): "cpu row norms",
    }


def test_in_place_updates_and_nan_are_seen() -> None:
    master = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    param, remainder = split_master(master)
    plan = SumOfSquaresPlan([RemainderMaster(param, remainder)], [0], 1)
    _assert_close(plan(), _reference([master], [0], 1))
    new_param, new_remainder = split_master(master * 2)  # as the optimizer writes a step
    param.copy_(new_param)
    remainder.copy_(new_remainder)
    _assert_close(plan(), _reference([master * 2], [0], 1))
    param[12345] = float("nan")
    assert plan()[0].isnan()


def test_a_call_allocates_no_copy_of_a_master() -> None:
    """Decoding allocates nothing of its own: every allocation of a call is bounded (the scratch
    block, the row buffer), far below an fp32 copy of the 5e6-element master (20 MB)."""
    from torch.profiler import ProfilerActivity, profile

    masters = [torch.randn(5_000_000), torch.randn(1000)]
    plan = SumOfSquaresPlan(_split_all(masters), [0, 1], 2)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        plan()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= plan.scratch_bytes <= 1 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_beside_fused_fp32() -> None:
    g = torch.Generator().manual_seed(5)
    masters = [torch.randn(n, generator=g) for n in (3_000_001, 10)]
    fp32 = torch.randn(100_000, generator=g)
    summands = [RemainderMaster(*(t.cuda() for t in split_master(m))) for m in masters]
    plan = SumOfSquaresPlan([*summands, fp32.cuda()], [0, 1, 1], 2)
    out = plan()
    assert out.device.type == "cuda"
    _assert_close(out.cpu(), _reference([*masters, fp32], [0, 1, 1], 2), rel=5e-7)
    assert "row norms of decoded remainders" in plan.backends[(summands[0].device, torch.float32)]


# ------------------------------------------------------------------------ megatron, end to end


def _remainder_reference(inner: Any) -> tuple[float, int, float]:
    """(global sum of squares of the fp32 masters, nonzero remainders here, max |master - param|
    here), decoded with the stand-in's ``join_master`` from the optimizer's own state.

    DP only: the ranks' shards partition the model (TP layouts: ``test_optimizer_kinds.py``).
    """
    local, nonzero, gap = torch.zeros(1, dtype=torch.float64), 0, 0.0
    for leaf in inner.chained_optimizers:
        te_adam = leaf.optimizer
        for group in te_adam.param_groups:
            for shard in group["params"]:
                remainder = te_adam.state[shard].get("master_param")
                if remainder is None:  # fp32 shards are their own masters
                    local += shard.double().square().sum()
                    continue
                assert remainder.dtype == torch.int16 and shard.dtype == torch.bfloat16
                master = join_master(shard, remainder)
                local += master.double().square().sum()
                nonzero += int((remainder != 0).sum())
                gap = max(gap, float((master - shard.float()).abs().max()))
    torch.distributed.all_reduce(local)
    return float(local), nonzero, gap


def _end_to_end_body() -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer

    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    inner = build_precision_aware_optimizer(chunks, store_param_remainders=True)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    steps = []
    for step in range(STEPS):
        assert train_step(chunks, optimizer, seed=step)[0]
        squares, nonzero, gap = _remainder_reference(inner)
        steps.append(
            {
                "norm": float(optimizer.param_l2_norm()),
                "nonzero": nonzero,
                "gap": gap,
                "reference": math.sqrt(squares),
            }
        )
    counted = optimizer.registry.counted
    return {
        "steps": steps,
        "sources": sorted({r.source for r in counted}),
        "repr": next(repr(r) for r in counted if r.source == "master-remainder-shard"),
    }


def test_norm_of_remainder_masters_on_real_ranks() -> None:
    results = run_ranks(_end_to_end_body, 2, timeout=120)
    for rank, got in enumerate(results):
        norms = [s["norm"] for s in got["steps"]]
        assert norms == pytest.approx([s["reference"] for s in got["steps"]], rel=1e-6), rank
        assert norms == [s["norm"] for s in results[0]["steps"]], "every rank gets the same number"
        assert len(set(norms)) == STEPS, "in-place updates of params and remainders are seen"
        assert "master-remainder-shard" in got["sources"]
        assert "torch.float32" in got["repr"], "a remainder master reads as the fp32 it encodes"
    # The masters are not the bf16 params: the remainders carry bits the norm must see.
    for step in range(STEPS):
        assert sum(r["steps"][step]["nonzero"] for r in results) > 0
        assert max(r["steps"][step]["gap"] for r in results) > 0
