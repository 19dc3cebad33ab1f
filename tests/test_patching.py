"""The one patching mechanism (``norm_optim._patching``): a revert leaves the target as it was."""

from __future__ import annotations

import pytest

from norm_optim._patching import Patch, PatchSet, attributes_set


class _Base:
    def step(self) -> str:
        return "base"


class _Leaf(_Base):
    pass


def test_a_revert_on_an_instance_removes_the_shadowing_attribute() -> None:
    leaf = _Leaf()
    patch = Patch(leaf, "step", lambda: "patched")
    patch.apply()
    assert leaf.step() == "patched"
    patch.revert()
    assert "step" not in vars(leaf)  # no bound original left behind
    with attributes_set(_Base, step=lambda self: "changed"):
        assert leaf.step() == "changed"  # the class's method shows through again
    assert leaf.step() == "base"


def test_a_revert_puts_back_what_the_target_itself_held() -> None:
    leaf = _Leaf()
    own = lambda: "own"  # noqa: E731
    leaf.step = own  # type: ignore[method-assign]
    with PatchSet.apply([Patch(leaf, "step", lambda: "patched")]):
        assert leaf.step() == "patched"
    assert vars(leaf)["step"] is own


def test_a_revert_on_a_class_removes_what_it_only_inherited() -> None:
    with attributes_set(_Leaf, step=lambda self: "patched"):
        assert _Leaf().step() == "patched"
    assert "step" not in vars(_Leaf)
    assert _Leaf().step() == "base"


def test_a_name_that_was_absent_is_deleted_again() -> None:
    leaf = _Leaf()
    with attributes_set(leaf, extra=1):
        assert leaf.extra == 1  # type: ignore[attr-defined]
    assert not hasattr(leaf, "extra")


def test_a_failed_apply_reverts_what_was_applied() -> None:
    leaf = _Leaf()

    class _NoSet:
        __slots__ = ()

    with pytest.raises(AttributeError):
        PatchSet.apply([Patch(leaf, "step", lambda: "patched"), Patch(_NoSet(), "x", 1)])
    assert "step" not in vars(leaf)


def test_a_property_of_the_instance_is_set_back_through_the_property() -> None:
    class _Process:
        def __init__(self) -> None:
            self._daemon = False

        @property
        def daemon(self) -> bool:
            return self._daemon

        @daemon.setter
        def daemon(self, value: bool) -> None:
            self._daemon = value

    process = _Process()
    with attributes_set(process, daemon=True):
        assert process.daemon
    assert process.daemon is False
