"""Sums of squares over a fixed list of tensors, accurate and with bounded memory.

- :mod:`.plan` — :class:`SumOfSquaresPlan`, the one entry point: groups tensors by (device,
  dtype) once, then one reduction per group per call.
- :mod:`.rows` — CPU: short fp32 row norms summed in float64, small tensors packed in blocks.
- :mod:`.segments` — segments of flat buffers (Megatron DDP's grad buffers), per slot, in a fixed
  number of ops per call.
- :mod:`.packed` — a plan built once (the weights'): small CPU tensors copied into one flat
  buffer, views of one storage read in place, both by segments.
- :mod:`.fused` — accelerators: apex / Transformer Engine / torch fused multi-tensor norms.
- :mod:`.remainders` — Transformer Engine's bf16 + int16 encoding of fp32 masters.
- :mod:`.indices` — index tensors kept on the device, so rebuilt plans do not stall the host.
"""

from .indices import DeviceIndices
from .plan import SumOfSquaresPlan
from .remainders import RemainderMaster, Summand

__all__ = ["DeviceIndices", "RemainderMaster", "SumOfSquaresPlan", "Summand"]
