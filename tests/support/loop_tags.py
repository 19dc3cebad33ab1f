"""The oracle's value of every scalar the loop integrations write with ``install(per_param=True)``
(shared by the Megatron-LM and Megatron-Bridge loop tests)."""

from __future__ import annotations

import math
import re

# Grouped here from GPTModel's names, apart from norm_optim._megatron.naming (the code under test).
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")


def oracle_tags(sums: dict[str, float]) -> dict[str, float]:
    """The norm of every per-param scalar by tag, from the oracle's sums of squares: each
    param, and each layer's and expert's params summed."""
    groups: dict[str, list[float]] = {}
    for name, value in sums.items():
        groups[f"params-norm/param/{name}"] = [value]
        if (layer := _LAYER.match(name)) is not None:
            groups.setdefault(f"params-norm/layer/{layer.group(1)}", []).append(value)
        if (expert := _EXPERT.match(name)) is not None:
            tag = f"params-norm/expert/{expert.group(1)}.{expert.group(2)}"
            groups.setdefault(tag, []).append(value)
    return {tag: math.sqrt(math.fsum(values)) for tag, values in groups.items()}
