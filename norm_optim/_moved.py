"""Public names that moved: importable for one more minor release, with a warning.

Each old name of a module that stays is served by that module's ``__getattr__`` from
:func:`moved_names`. What moved where, and when the old names go, is in ``CHANGELOG.md``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

# The release in which the names that moved in 0.3.0 stop working.
REMOVAL = "0.5.0"


def _warn(old: str, since: str, replacement: str) -> None:
    warnings.warn(
        f"{old} is deprecated since norm_optim {since} and goes away in {REMOVAL}: "
        f"use {replacement}",
        DeprecationWarning,
        stacklevel=4,
    )


def moved_names(
    module: str, moved: Mapping[str, tuple[str, str, Callable[[], Any]]]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves old names with a warning.

    Args:
        module: the module's ``__name__`` (for the messages).
        moved: old name -> (the release that renamed it, its replacement's name, a function
            returning the object it names now).
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        since, replacement, get = moved[name]
        _warn(f"{module}.{name}", since, f"{module}.{replacement}")
        return get()

    return __getattr__
