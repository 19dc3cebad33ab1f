"""What an ``install()`` checks before it patches anything: that the loop has what it patches,
and that the deferred norm stands for the loop's own model."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


def is_loop_model(model: Any, chunks: Optional[list[Any]]) -> bool:
    """Whether ``model`` (a chunk or a list of them) is exactly the loop's model ``chunks``:
    the deferred norm stands for the wrapped optimizer's model, and no other."""
    given = model if isinstance(model, list) else [model]
    return (
        chunks is not None
        and len(given) == len(chunks)
        and all(a is b for a, b in zip(given, chunks))
    )


def missing_parameters(label: str, function: Callable[..., Any], names: Sequence[str]) -> list[str]:
    """``label(name=...)`` for each of ``names`` that ``function`` does not take."""
    params = inspect.signature(function).parameters
    return [f"{label}({name}=...)" for name in names if name not in params]


def missing_hooks(
    prefix: str, module: ModuleType, names: Sequence[str], log_params: Sequence[str] = ()
) -> list[str]:
    """What a loop's ``module`` lacks of what an integration patches: ``<prefix><name>`` for
    each of ``names`` it has no function of, else ``<prefix>training_log(<param>=...)`` for
    each of ``log_params`` its ``training_log`` does not take."""
    missing = [f"{prefix}{name}" for name in names if not callable(getattr(module, name, None))]
    if not missing and log_params:
        missing = missing_parameters(f"{prefix}training_log", module.training_log, log_params)
    return missing
