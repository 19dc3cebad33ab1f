"""Reversible attribute patches: the one patching mechanism of norm_optim.

The loop integrations (:mod:`norm_optim.integrations`) replace functions of Megatron-LM's and
Megatron-Bridge's loops with it, the adapter sets an optimizer's methods for one step with it
(:func:`attributes_set`), and every test-only shim of :mod:`norm_optim.testing` and the
benchmarks' counters are made of it. A :class:`Patch` replaces one attribute and can put it back; a :class:`PatchSet` applies
a list of them and restores them in reverse order (``uninstall()``, or ``with``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Patch:
    """``setattr(target, name, value)``, undone by :meth:`revert`.

    What is put back is what the target itself held (its own ``vars()``): a name it only
    inherited (from its class, or a base class) is deleted again at the revert, so that the
    inherited attribute shows through instead of a copy of it shadowing it (on an instance, a
    bound method of the original that would outlive the patch).
    """

    target: Any
    name: str
    value: Any
    had_original: bool = False
    original: Any = None

    def apply(self) -> None:
        own = getattr(self.target, "__dict__", None)
        on_type = inspect.getattr_static(type(self.target), self.name, None)
        if own is None or hasattr(type(on_type), "__set__"):
            # No namespace of its own (``__slots__``), or a data descriptor of its type (a
            # property): the value it shows is its own, put back through the descriptor.
            self.had_original = hasattr(self.target, self.name)
            self.original = getattr(self.target, self.name, None)
        else:
            self.had_original = self.name in own
            self.original = own.get(self.name)
        setattr(self.target, self.name, self.value)

    def revert(self) -> None:
        if self.had_original:
            setattr(self.target, self.name, self.original)
        else:
            delattr(self.target, self.name)


class PatchSet:
    """Handle of applied patches; :meth:`uninstall` restores every patched attribute."""

    def __init__(self, patches: list[Patch]) -> None:
        self._patches = patches

    @classmethod
    def apply(cls, patches: Sequence[Patch]) -> "PatchSet":
        """Apply ``patches`` in order (reverting the applied ones if one fails)."""
        applied: list[Patch] = []
        try:
            for patch in patches:
                patch.apply()
                applied.append(patch)
        except BaseException:
            for patch in reversed(applied):
                patch.revert()
            raise
        return cls(applied)

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def uninstall(self) -> None:
        """Restore the originals (in reverse order). Safe to call twice."""
        while self._patches:
            self._patches.pop().revert()

    def __enter__(self) -> "PatchSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


@contextlib.contextmanager
def patches_applied(patches: Sequence[Patch]) -> Iterator[None]:
    """Apply ``patches`` in order; revert them in reverse order on exit."""
    with PatchSet.apply(patches):
        yield


def attributes_set(target: Any, **values: Any) -> contextlib.AbstractContextManager[None]:
    """``target.<name> = value`` for each keyword during the ``with`` block, then reverted:
    nothing of ours is left on ``target`` (an instance's shadowing attribute is deleted)."""
    return patches_applied([Patch(target, name, value) for name, value in values.items()])
