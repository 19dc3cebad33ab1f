"""Tests of norm_optim._kernels: accuracy per slot, dtypes, edge cases, storage and memory bounds."""

from __future__ import annotations

import os
import re

import pytest
import torch

from norm_optim._kernels import DeviceIndices, SumOfSquaresPlan
from norm_optim._kernels.rows import ROW
from tests.support.dispatch import host_made


def _reference(tensors, slots, num_slots):
    """Exact-enough float64 sums of squares, computed in bounded float64 chunks."""
    out = torch.zeros(num_slots, dtype=torch.float64)
    for t, slot in zip(tensors, slots):
        for chunk in t.detach().reshape(-1).split(1 << 20):
            out[slot] += chunk.double().square().sum()
    return out


def _bf16_valued(n, generator=None):
    """fp32 values that are exactly bf16: the worst case for fp32 accumulation."""
    return torch.randn(n, generator=generator).bfloat16().float()


def _assert_close(got, want, rtol=2e-7):
    assert got.dtype == torch.float64
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=rtol, atol=0), (got - want).abs() / want.abs()


@pytest.mark.parametrize(
    "shapes",
    [
        [(1,)],
        [(3, 5), (7,), (1,)],
        [(255,), (256,), (257,), (4096,), (65535,), (65536,), (65537,)],
        [(1024, 1000), (333, 777), (5, 123457)],
    ],
    ids=["one", "tiny", "around-thresholds", "matrices"],
)
def test_accuracy_per_slot_fp32(shapes):
    g = torch.Generator().manual_seed(0)
    tensors = [_bf16_valued(torch.Size(s).numel(), g).view(s) for s in shapes]
    slots = list(range(len(tensors)))
    plan = SumOfSquaresPlan(tensors, slots, len(tensors))
    _assert_close(plan(), _reference(tensors, slots, len(tensors)))


def test_accuracy_many_small_tensors_sharing_slots():
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 70_000, (120,), generator=g).tolist()
    tensors = [_bf16_valued(n, g) for n in sizes]
    slots = [i % 7 for i in range(len(tensors))]
    plan = SumOfSquaresPlan(tensors, slots, 9)  # slots 7 and 8 stay empty
    got, want = plan(), _reference(tensors, slots, 9)
    _assert_close(got[:7], want[:7])
    assert got[7:].eq(0).all()


def test_accuracy_large_tensor():
    # Whole-tensor fp32 reductions on CPU are ~1e-2 off at this size on bf16-valued data.
    big = _bf16_valued(20_000_003, torch.Generator().manual_seed(2))
    small = torch.randn(1000)
    plan = SumOfSquaresPlan([big, small], [0, 1], 2)
    _assert_close(plan(), _reference([big, small], [0, 1], 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes(dtype):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g).to(dtype) for n in (10, 5000, 300_001)]
    tensors.append(torch.randn(300, 200, generator=g).to(dtype).t())  # non-contiguous
    slots = [0, 1, 1, 2]
    plan = SumOfSquaresPlan(tensors, slots, 3)
    _assert_close(plan(), _reference(tensors, slots, 3))


def test_mixed_dtypes_one_slot():
    tensors = [torch.randn(70_000), torch.randn(1000).bfloat16(), torch.randn(10).half()]
    plan = SumOfSquaresPlan(tensors, [0, 0, 0], 1)
    _assert_close(plan(), _reference(tensors, [0, 0, 0], 1))
    assert set(plan.backends) == {(torch.device("cpu"), t.dtype) for t in tensors}


def test_non_contiguous_fp32():
    g = torch.Generator().manual_seed(4)
    base = _bf16_valued(600 * 700, g).view(600, 700)
    tensors = [base.t(), base[:, ::3], base[::2, 1:]]
    plan = SumOfSquaresPlan(tensors, [0, 1, 2], 3)
    _assert_close(plan(), _reference(tensors, [0, 1, 2], 3))


def test_empty_list():
    plan = SumOfSquaresPlan([], [], 4)
    out = plan()
    assert out.dtype == torch.float64 and out.device.type == "cpu"
    assert out.tolist() == [0.0] * 4
    assert plan.num_tensors == 0 and plan.numel == 0 and plan.nbytes == 0
    assert plan.backends == {}


def test_zero_size_tensors():
    tensors = [
        torch.empty(0),
        torch.empty(3, 0),
        torch.ones(4),
        torch.empty(0, dtype=torch.bfloat16),
    ]
    plan = SumOfSquaresPlan(tensors, [0, 1, 1, 2], 3)
    assert plan().tolist() == [0.0, 4.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("n", [7, 5000, 100_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_inf_propagate_to_their_slot_only(bad, n, dtype):
    poisoned = torch.randn(n).to(dtype)
    poisoned[n // 2] = bad
    tensors = [torch.randn(n).to(dtype), poisoned, torch.randn(n).to(dtype)]
    out = SumOfSquaresPlan(tensors, [0, 1, 2], 3)()
    if bad != bad:
        assert out[1].isnan()
    else:
        assert out[1].isposinf()
    assert out[[0, 2]].isfinite().all()


def test_in_place_updates_are_seen():
    t = torch.ones(100_000)
    plan = SumOfSquaresPlan([t], [0], 1)
    assert plan().item() == pytest.approx(100_000, rel=1e-7)
    t.mul_(2)
    assert plan().item() == pytest.approx(400_000, rel=1e-7)


def test_views_share_storage():
    tensors = [torch.randn(n) for n in (5, 70_000, 1_000_000)] + [torch.randn(50, 40).t()]
    plan = SumOfSquaresPlan(tensors, [0, 0, 0, 0], 1)
    pointers = {t.untyped_storage().data_ptr() for t in tensors}
    held = [v for v in plan.views() if v.dtype == torch.float32 and v.numel()]
    zero_pad = {v.untyped_storage().data_ptr() for v in held} - pointers
    assert len(zero_pad) <= 1  # the one shared row of zeros used for padding
    pads = [v for v in held if v.untyped_storage().data_ptr() in zero_pad]
    assert all(not v.any() for v in pads), "padding must be zeros"
    # One row of zeros, however many tensors were padded with it.
    assert {v.untyped_storage().nbytes() for v in pads} <= {ROW * 4}
    assert pointers <= {v.untyped_storage().data_ptr() for v in held}


def test_scratch_is_bounded_by_bookkeeping():
    tensors = [torch.empty(50_000_000), torch.empty(10, dtype=torch.bfloat16)]
    tensors += [torch.empty(n) for n in range(1, 3000, 7)]
    plan = SumOfSquaresPlan(tensors, [0] * len(tensors), 1)
    assert 0 < plan.scratch_bytes <= 1 << 20


def _vm_hwm_kib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))


def _reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")


def test_peak_memory_of_a_call_is_bounded():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    g = torch.Generator().manual_seed(5)
    big = torch.randn(30_000_000, generator=g)  # 120 MB fp32
    bf16 = torch.randn(10_000_000, generator=g).bfloat16()  # a full fp32 copy would be 40 MB
    plan = SumOfSquaresPlan([big, bf16], [0, 1], 2)
    plan()  # warm up allocator and thread pools
    _reset_peak_rss()
    before = _vm_hwm_kib()
    plan()
    grown_mib = (_vm_hwm_kib() - before) / 1024
    assert grown_mib < 16, f"a call raised peak RSS by {grown_mib:.1f} MiB"


def test_validation_errors():
    with pytest.raises(ValueError, match="slots"):
        SumOfSquaresPlan([torch.ones(1)], [0, 1], 2)
    with pytest.raises(ValueError, match="outside"):
        SumOfSquaresPlan([torch.ones(1)], [2], 2)
    with pytest.raises(TypeError, match="floating"):
        SumOfSquaresPlan([torch.ones(1, dtype=torch.int64)], [0], 1)


def test_out_device_and_reporting():
    tensors = [torch.ones(3), torch.ones(2, 2, dtype=torch.bfloat16)]
    plan = SumOfSquaresPlan(tensors, [0, 0], 1, out_device=torch.device("cpu"))
    assert plan.num_tensors == 2 and plan.numel == 7 and plan.nbytes == 3 * 4 + 4 * 2
    assert plan().item() == pytest.approx(7.0, rel=1e-7)
    assert plan.backends == {
        (torch.device("cpu"), torch.float32): "cpu row norms",
        (torch.device("cpu"), torch.bfloat16): "cpu row norms",
    }
    float64 = SumOfSquaresPlan([torch.ones(3, dtype=torch.float64)], [0], 1)
    assert float64.backends == {(torch.device("cpu"), torch.float64): "torch._foreach_norm"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_offloaded_mixed():
    g = torch.Generator().manual_seed(6)
    cpu = [_bf16_valued(n, g) for n in (10, 100_000)]
    cuda = [_bf16_valued(n, g).cuda() for n in (5, 3_000_000)] + [
        torch.randn(1000).bfloat16().cuda()
    ]
    tensors, slots = cpu + cuda, [0, 1, 1, 2, 0]
    plan = SumOfSquaresPlan(tensors, slots, 3)
    out = plan()
    assert out.device.type == "cuda"
    _assert_close(out.cpu(), _reference([t.cpu() for t in tensors], slots, 3), rtol=5e-7)
    cpu_out = SumOfSquaresPlan(tensors, slots, 3, out_device=torch.device("cpu"))()
    _assert_close(cpu_out, out.cpu(), rtol=1e-12)


def test_plans_rebuilt_over_one_layout_share_their_index_tensors():
    """A step's grads are new tensor objects each step, so their plan is rebuilt each step: with
    one ``DeviceIndices`` the rebuilt plan makes no index tensor again (none would be copied to a
    GPU), and its sums stay exact; a new layout makes its own; the oldest are dropped."""
    g = torch.Generator().manual_seed(9)
    shapes = [(3, 5), (70_000,), (1024, 20), (300,)]  # packed, viewed in rows, and their mix
    slots = [0, 1, 1, 2]
    indices = DeviceIndices(capacity=4)

    def build_and_sum():
        tensors = [torch.randn(s, generator=g) for s in shapes]
        sums = SumOfSquaresPlan(tensors, slots, 3, indices=indices)()
        return sums, _reference(tensors, slots, 3)

    (first, want), made = host_made(build_and_sum)
    assert made > 0 and 0 < len(indices) <= 4
    _assert_close(first, want)
    (again, want), made = host_made(build_and_sum)
    assert made == 0, "a plan over the same layout made its index tensors again"
    _assert_close(again, want)
    other = [torch.randn(s, generator=g) for s in [(17,), (5, 5)]]
    _, made = host_made(lambda: SumOfSquaresPlan(other, [2, 0], 3, indices=indices)())
    assert made > 0 and len(indices) <= 4
    values = indices([1, 2, 3], torch.device("cpu"))
    assert indices([1, 2, 3], torch.device("cpu")) is values
    assert values.dtype == torch.long and values.tolist() == [1, 2, 3]
    for n in range(4):  # four newer lists push it out
        indices([n], torch.device("cpu"))
    assert len(indices) == 4 and indices([1, 2, 3], torch.device("cpu")) is not values


def _many_small(count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``count`` fp32 tensors of a hidden-16 GPT layer's sizes (12 a layer), bf16-valued."""
    sizes = [768, 48, 256, 16, 1024, 64, 1024, 16, 16, 16, 16, 16]
    return [_bf16_valued(sizes[i % len(sizes)], generator) for i in range(count)]


def test_packed_plans_ops_do_not_grow_with_the_tensor_count():
    """A packed plan (the weights') over 100, 1,000 and 10,000 small tensors: exact per slot,
    and the same handful of ops, and a few more for each further pack of 2 Mi elements (10,000
    of these tensors fill two), where a plain plan's grow with the tensors."""
    from benchmarks.step_norms import aten_ops

    g = torch.Generator().manual_seed(0)
    ops = {}
    for count in (100, 1000, 10000):
        tensors = _many_small(count, g)
        slots = [i % 97 for i in range(count)]
        plan = SumOfSquaresPlan(tensors, slots, 97, packed=True)
        _assert_close(plan(), _reference(tensors, slots, 97), rtol=1e-6)
        ops[count] = (aten_ops(plan), aten_ops(SumOfSquaresPlan(tensors, slots, 97)))
    assert ops[100][0] == ops[1000][0] and ops[10000][0] <= ops[100][0] + 10, ops
    assert ops[10000][1] > 5 * ops[10000][0], ops


def test_packed_plans_read_views_of_one_storage_in_place_and_see_updates():
    """fp32 views of one flat buffer (a DDP param buffer) are read in place: nothing copied,
    in-place updates seen, a NaN inside one view's own rows in its slot only; overlapping
    views, bf16 and large tensors of their own take the other paths, exactly."""
    g = torch.Generator().manual_seed(1)
    flat = _bf16_valued(300_000, g)
    views = [flat[:100], flat[100:5100], flat[6000:206000], flat[206000:206001]]
    others = [_bf16_valued(40_000, g), _bf16_valued(300, g).bfloat16(), flat[:50]]
    tensors = views + others
    slots = [0, 1, 2, 3, 4, 5, 6]
    plan = SumOfSquaresPlan(tensors, slots, 7, packed=True)
    _assert_close(plan(), _reference(tensors, slots, 7), rtol=1e-6)
    # The overlapping view (flat[:50]) sends its storage to the copied and row paths.
    in_place = SumOfSquaresPlan(views, [0, 1, 2, 3], 4, packed=True)
    assert in_place.kept_bytes < 200_000 * 4 // 10  # no copy of the views
    flat.mul_(2.0)
    _assert_close(in_place(), _reference(views, [0, 1, 2, 3], 4), rtol=1e-6)
    flat[150] = float("nan")
    got = in_place()
    assert got[1].isnan() and not got[[0, 2, 3]].isnan().any(), got
