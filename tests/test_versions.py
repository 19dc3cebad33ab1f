"""The tested megatron-core range: what is installed, and the warning outside it."""

from __future__ import annotations

import warnings

import pytest

from norm_optim import _versions as versions


def test_installed_release_is_read_and_tested() -> None:
    installed = versions.megatron_core_version()
    if versions.distribution_version("megatron-core") == versions.TESTED_MEGATRON_CORE_MAIN:
        assert installed[:2] > max(versions.TESTED_MEGATRON_CORE)[:2]  # main: the next line
    else:
        assert installed in versions.TESTED_MEGATRON_CORE
    assert versions.megatron_core_version_string() == "megatron-core " + ".".join(
        map(str, installed)
    )
    assert versions.megatron_at_least(*installed) and not versions.megatron_at_least(99)


@pytest.mark.parametrize(
    "release,text,warns",
    [
        ((0, 13, 1), "0.13.1", "older"),
        ((0, 14, 0), "0.14.0", None),
        ((0, 16, 1), "0.16.1", None),
        ((0, 19, 9), "0.19.9", None),
        ((0, 20, 0), "0.20.0", "newer"),
        ((0, 20, 0), "0.20.0.dev20261001", "newer"),
        ((0, 20, 0), versions.TESTED_MEGATRON_CORE_MAIN, None),
        ((), "unknown", None),
    ],
)
def test_an_untested_release_warns(
    monkeypatch: pytest.MonkeyPatch, release: tuple[int, ...], text: str, warns: str | None
) -> None:
    monkeypatch.setattr(versions, "megatron_core_version", lambda: release)
    monkeypatch.setattr(versions, "distribution_version", lambda name: text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_untested()
    untested = [w for w in caught if issubclass(w.category, versions.UntestedMegatronWarning)]
    assert len(untested) == int(warns is not None)
    if warns:
        shown = ".".join(map(str, release))
        assert f"megatron-core {shown} is {warns} than" in str(untested[0].message)
