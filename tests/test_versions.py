"""The tested megatron-core range: what is installed, and the warning for a newer release."""

from __future__ import annotations

import warnings

import pytest

from norm_optim import versions


def test_installed_release_is_read_and_tested() -> None:
    installed = versions.megatron_core_version()
    assert installed[:2] in {v[:2] for v in versions.TESTED_MEGATRON_CORE}
    assert versions.megatron_core_version_string() == "megatron-core " + ".".join(
        map(str, installed)
    )
    assert versions.megatron_at_least(*installed) and not versions.megatron_at_least(99)


@pytest.mark.parametrize(
    "release,warns", [((0, 16, 1), False), ((0, 19, 9), False), ((0, 20, 0), True), ((), False)]
)
def test_a_newer_release_warns(
    monkeypatch: pytest.MonkeyPatch, release: tuple[int, ...], warns: bool
) -> None:
    monkeypatch.setattr(versions, "megatron_core_version", lambda: release)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_untested()
    untested = [w for w in caught if issubclass(w.category, versions.UntestedMegatronWarning)]
    assert len(untested) == int(warns)
    if warns:
        assert "megatron-core 0.20.0 is newer" in str(untested[0].message)
