"""The scalars the integrations write beside the loops' own ``params-norm``, and the tags
they are written under."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .._norms.reducer import NamedNorms, ParamNorms
from .._step.measurement import StepNorms
from .._step.watch import WatchConfig
from ._logged_values import LoggedParamsNorm


TAG = "params-norm"
"""The scalar the loops write themselves; norm_optim's own scalars are named under it."""


def scalars(norms: ParamNorms, breakdown: bool) -> dict[str, float]:
    """The scalars norm_optim writes next to the loop's own ``params-norm``.

    ``params-norm-dense`` / ``params-norm-expert`` with ``breakdown``; with per-param norms,
    ``params-norm/param/<name>`` (layout-independent name), ``params-norm/layer/<layer>`` and
    ``params-norm/expert/<layer>.<expert>`` (:mod:`norm_optim._megatron.naming`). Reads every value in
    one host transfer per mapping.
    """
    out: dict[str, float] = {}
    if breakdown:
        out[f"{TAG}-dense"], out[f"{TAG}-expert"] = float(norms.dense), float(norms.expert)
    out.update(named_scalars(TAG, norms))
    return out


def named_scalars(tag: str, norms: ParamNorms) -> dict[str, float]:
    """``<tag>/param/<name>``, ``<tag>/layer/<layer>`` and ``<tag>/expert/<layer>.<expert>`` of
    the per-param, per-layer and per-expert norms that ``norms`` holds (none without them)."""
    out: dict[str, float] = {}
    for kind, named in (
        ("param", norms.per_param),
        ("layer", norms.per_layer),
        ("expert", norms.per_expert),
    ):
        if named is not None:
            out.update(zip((f"{tag}/{kind}/{name}" for name in named), float_values(named)))
    return out


def float_values(named: Mapping[str, Any]) -> list[float]:
    if isinstance(named, NamedNorms):
        return named.vector.tolist()
    return [float(v) for v in named.values()]


class ParamsNormLog:
    """What a loop integration logs of the params norm, beyond the total: one per integration.

    Args:
        breakdown: the dense / expert norms in the log line and as scalars.
        per_param: per-param, per-layer and per-expert scalars, and the ``top_k`` params whose
            norm grew fastest since the previous read (the previous logged iteration) in the
            log line.
    """

    def __init__(
        self,
        breakdown: bool,
        per_param: bool,
        top_k: int = 3,
        step_norms: bool = False,
        watch: Optional[WatchConfig] = None,
    ) -> None:
        self.breakdown, self.per_param, self.top_k = breakdown, per_param, top_k
        self.step_norms, self.watch = step_norms, watch
        self._previous: Optional[ParamNorms] = None

    @property
    def writes_scalars(self) -> bool:
        return self.breakdown or self.per_param

    def read(self, optimizer: Any) -> ParamNorms:
        """The norms, from every rank alike (one all-reduce)."""
        norms: ParamNorms = optimizer.param_l2_norms(per_param=self.per_param)
        return norms

    def value(self, norms: Optional[ParamNorms]) -> Optional[float]:
        """What a loop's ``training_log`` gets as ``params_norm``: None where it does not read
        it, else the total (a :class:`LoggedParamsNorm` with ``breakdown`` or ``per_param``)."""
        if norms is None:
            return None
        if not self.writes_scalars:
            return float(norms.total)
        growing: list[tuple[str, float]] = []
        if self.per_param:
            if self._previous is not None:
                growing = norms.fastest_growing(self._previous, self.top_k)
            self._previous = norms
        dense, expert = (
            (float(norms.dense), float(norms.expert)) if self.breakdown else (None, None)
        )
        return LoggedParamsNorm(float(norms.total), dense, expert, growing)

    def write(self, norms: ParamNorms, iteration: int, tensorboard: Any, wandb: Any) -> None:
        """:func:`scalars` to the loop's TensorBoard / W&B writers (either may be None)."""
        write_scalars(scalars(norms, self.breakdown), iteration, tensorboard, wandb)


def write_scalars(values: dict[str, float], iteration: int, tensorboard: Any, wandb: Any) -> None:
    """``values`` to the loop's TensorBoard / W&B writers (either may be None)."""
    if tensorboard is not None:
        for tag, value in values.items():
            tensorboard.add_scalar(tag, value, iteration)
    if wandb is not None:
        wandb.log(values, iteration)


STEP_TAGS = {
    "grads": "grads-norm",
    "updates": "updates-norm",
    "exp_avg": "exp-avg-norm",
    "exp_avg_sq": "exp-avg-sq-norm",
}
"""The scalar of each :class:`~norm_optim.StepNorms` quantity (beside Megatron's ``grad-norm``)."""
RATIO_TAG = "update-to-weight"


def step_scalars(step: StepNorms, per_param: bool) -> dict[str, float]:
    """The scalars of one measured step: each quantity's total (``grads-norm`` ...; for the
    grads, that of the main clip group, as Megatron's ``grad-norm``, and ``grads-norm/<group>``
    of each group Megatron clips on its own, e.g. ``grads-norm/mtp``), and with
    ``per_param`` the grads' and updates' per-param / per-layer / per-expert norms and
    ``update-to-weight/layer/<layer>``."""
    out: dict[str, float] = {}
    for field, tag in STEP_TAGS.items():
        norms: Optional[ParamNorms] = getattr(step, field)
        if norms is None:
            continue
        out[tag] = float(norms.total)
        if field == "grads" and step.clip_groups:
            # Megatron's grad-norm is its main group's; each separately clipped group beside it.
            for group, value in step.clip_groups.items():
                out[tag if group == "main" else f"{tag}/{group}"] = float(value)
        if per_param and field in ("grads", "updates"):
            out.update(named_scalars(tag, norms))
    if step.update_to_weight is not None:
        ratios = step.update_to_weight
        out.update(zip((f"{RATIO_TAG}/layer/{n}" for n in ratios), float_values(ratios)))
    return out


def ratio_note(step: StepNorms) -> str:
    """The log line's field: the total update-to-weight ratio, and the layer of the largest."""
    note = f"update/weight: {float(step.update_to_weight_total):.2e}"
    ratios = step.update_to_weight
    if ratios is not None and len(ratios):
        values = float_values(ratios)
        layer, value = max(zip(ratios, values), key=lambda kv: kv[1])
        note += f" (largest: layer {layer} {value:.2e})"
    return note


WATCH_TAG = "watch/alarms"
"""The scalar of the watch: the number of alarms at an iteration (0 at logged iterations)."""


def loop_loss(loss_dict: Any) -> Optional[float]:
    """The loss in a Megatron loop's ``training_log`` ``loss_dict`` (``lm loss`` or its first
    entry; a ``[sum, count]`` pair is divided), or None where this rank has none (every stage
    but the last)."""
    if not isinstance(loss_dict, Mapping) or not loss_dict:
        return None
    value = loss_dict.get("lm loss", next(iter(loss_dict.values())))
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]) / float(value[1])
    if hasattr(value, "numel") and value.numel() == 2:
        return float(value.reshape(-1)[0] / value.reshape(-1)[1])
    return float(value)
