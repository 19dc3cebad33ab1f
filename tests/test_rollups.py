"""The per-layer / per-expert keys of layout-independent names, and the log-line field.

Pure functions, one process. The rollups' values on real layouts are checked in the loop tests
(``test_megatron_lm.py``, ``test_megatron_bridge.py``) against the oracle.
"""

from __future__ import annotations

import pytest

from norm_optim.integrations._logged_values import LoggedParamsNorm
from norm_optim._megatron.naming import expert_of, layer_of, natural_key


@pytest.mark.parametrize(
    "name, layer, expert",
    [
        ("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", "3", "3.5"),
        ("decoder.layers.12.mlp.experts.linear_fc2.weight17", "12", "12.17"),  # TE grouped GEMM
        ("decoder.layers.12.mlp.experts.linear_fc1.bias3", "12", "12.3"),
        ("decoder.layers.0.mlp.experts.weight1", "0", None),  # legacy GroupedMLP: all experts
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "1", None),
        ("decoder.layers.1.mlp.router.weight", "1", None),
        ("decoder.layers.10.self_attention.linear_qkv.weight", "10", None),
        ("embedding.word_embeddings.weight", None, None),
        ("decoder.final_layernorm.weight", None, None),
        ("output_layer.weight", None, None),
        ("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", "mtp.0", None),
        ("vision_model.decoder.layers.2.mlp.linear_fc1.weight", "vision_model.decoder.2", None),
    ],
)
def test_layer_and_expert_of_a_global_name(
    name: str, layer: str | None, expert: str | None
) -> None:
    assert layer_of(name) == layer
    assert expert_of(name) == expert


def test_natural_order() -> None:
    keys = ["10", "2", "3.12", "3.2", "mtp.0", "1"]
    assert sorted(keys, key=natural_key) == ["1", "2", "3.2", "3.12", "10", "mtp.0"]


def test_logged_value_formats_the_fields_it_has() -> None:
    growing = [("decoder.layers.1.mlp.linear_fc1.weight", 1.01234), ("output_layer.weight", 1.0)]
    assert f"{LoggedParamsNorm(5.0):.3f}" == "5.000"
    assert f"{LoggedParamsNorm(5.0, growing=growing):.3f}" == (
        "5.000 | fastest-growing params: decoder.layers.1.mlp.linear_fc1.weight x1.0123, "
        "output_layer.weight x1.0000"
    )
    value = LoggedParamsNorm(5.0, 3.0, 4.0, growing[:1])
    assert float(value) == 5.0
    assert f"{value:.2f}" == (
        "5.00 | params norm dense: 3.00 | params norm expert: 4.00 | "
        "fastest-growing params: decoder.layers.1.mlp.linear_fc1.weight "
        "x1.0123"
    )
