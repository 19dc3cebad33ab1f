"""An independent oracle of the resume fingerprint: the hash of ``norm_optim._kernels
.position_hash`` written again in numpy's uint64 (which wraps and shifts logically by itself),
over whole global tensors on one process, with no sharding and no library code."""

from __future__ import annotations

import numpy as np
import torch

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
UNSIGNED = {2: np.uint16, 4: np.uint32}


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * M1
    x = (x ^ (x >> np.uint64(27))) * M2
    return x ^ (x >> np.uint64(31))


def fingerprint(values: torch.Tensor, dtype: torch.dtype) -> int:
    """The fingerprint of a whole global tensor (flattened, element ``i`` at global index ``i``)
    holding ``values`` rounded to ``dtype``."""
    t = values.reshape(-1).to(dtype)
    width = t.element_size()
    bits = t.view({2: torch.int16, 4: torch.int32}[width]).numpy().view(UNSIGNED[width])
    index = np.arange(t.numel(), dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(_mix(index * GOLDEN + np.uint64(CODES[dtype])) ^ bits.astype(np.uint64))
        return int(h.sum(dtype=np.uint64))
