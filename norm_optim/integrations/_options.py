"""What both loops' ``install()`` take: :class:`InstallOptions`."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Mapping, Optional

from .._step.watch import WatchConfig
from .._wrapper import NormAwareOptimizer
from ._audit_schedule import check_audit_options


@dataclasses.dataclass(frozen=True)
class InstallOptions:
    """What a loop integration's ``install()`` does beyond serving the total params norm: the
    same options for Megatron-LM's (:func:`norm_optim.integrations.megatron_lm.install`) and
    Megatron-Bridge's (:func:`norm_optim.integrations.megatron_bridge.install`) loop, given
    whole, by field name, or both (``install(breakdown=True)``).

    Each field, what it logs and what it costs: docs/megatron-lm.md, "The options".
    """

    breakdown: bool = False
    per_param: bool = False
    step_norms: bool = False
    audit_interval: int = 0
    audit_action: str = "warn"
    checkpoint_parity: Optional[bool] = None
    resume_proof: bool = True
    watch: "bool | dict[str, Any] | WatchConfig | None" = False
    wrapper_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.checkpoint_parity is not None:
            warnings.warn(
                "install(checkpoint_parity=...) is now install(resume_proof=...); the old name "
                "is removed in 0.6.0",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "resume_proof", bool(self.checkpoint_parity))
            object.__setattr__(self, "checkpoint_parity", None)
        # Bad values fail here, before install() patches anything.
        check_audit_options(self.audit_interval, self.audit_action)
        WatchConfig.of(self.watch)
        unknown = sorted(set(self.wrapper_options) - set(_WRAPPER_KEYWORDS))
        if unknown:
            raise TypeError(
                f"install() got unknown options {unknown}: it takes "
                f"{[f.name for f in dataclasses.fields(self)]} and NormAwareOptimizer's "
                f"{list(_WRAPPER_KEYWORDS)}"
            )
        object.__setattr__(self, "wrapper_options", dict(self.wrapper_options))

    @classmethod
    def of(cls, options: Optional["InstallOptions"], kwargs: Mapping[str, Any]) -> "InstallOptions":
        """What ``install(options, **kwargs)`` was given, as one value: ``options`` (default:
        every default) with the fields that ``kwargs`` names replaced, and its other names added
        to ``wrapper_options``."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an InstallOptions, got {type(options).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        own = {k: v for k, v in kwargs.items() if k in fields}
        wrapper = {k: v for k, v in kwargs.items() if k not in fields}
        if wrapper:
            own["wrapper_options"] = {
                **own.get("wrapper_options", options.wrapper_options),
                **wrapper,
            }
        return dataclasses.replace(options, **own) if own else options

    @property
    def watch_config(self) -> Optional[WatchConfig]:
        """:attr:`watch` as a :class:`~norm_optim.WatchConfig` (None: no watch)."""
        return WatchConfig.of(self.watch)

    @property
    def arms_steps(self) -> bool:
        """Whether the loop's step function is patched: to arm steps (step norms, a watch's
        aftermath)."""
        return self.step_norms or self.watch_config is not None


# NormAwareOptimizer's keyword arguments: what install() passes on to it.
_WRAPPER_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(NormAwareOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
