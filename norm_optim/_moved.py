"""Public names that moved: importable for one more minor release, with a warning.

Each old name of a module that stays is served by that module's ``__getattr__`` from
:func:`moved_names`. What moved where, and when the old names go, is in ``CHANGELOG.md``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Moved:
    """Where one old public name went.

    Attributes:
        since: the release that moved (or renamed) it.
        until: the release in which the old name stops working.
        replacement: the spelling to use instead, in full (``norm_optim.inspection.ParamRecord``).
        get: returns the object the name stands for now (called at each access, so that the
            module serving it need not import the replacement's module first).
    """

    since: str
    until: str
    replacement: str
    get: Callable[[], Any]


def moved_names(
    module: str, moved: Mapping[str, Moved], *, stacklevel: int = 2
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves old names with a ``DeprecationWarning``.

    Args:
        module: the module's ``__name__`` (for the messages).
        moved: old name -> where it went.
        stacklevel: the frame the warning names: 2 is the code that reads the name when the
            result is the module's ``__getattr__`` itself; one more for each function between.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        entry = moved[name]
        warnings.warn(
            f"{module}.{name} is deprecated since norm_optim {entry.since} and goes away in "
            f"{entry.until}: use {entry.replacement}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return entry.get()

    return __getattr__
