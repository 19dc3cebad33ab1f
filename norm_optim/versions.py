"""Which megatron-core releases norm_optim was tested on, and which one is installed.

norm_optim reads megatron-core internals (all of them in :mod:`norm_optim.megatron`); a release
we have not run may have moved them. Such a release still works where its layout is unchanged,
but it warns once, and every "cannot read this" error names the installed version so a report
says where to look.
"""

from __future__ import annotations

import functools
import re
import warnings
from importlib import metadata

TESTED_MEGATRON_CORE = ((0, 16, 1), (0, 19, 2))
"""The releases CI runs the whole suite on (0.16.1 on Python 3.11, 0.19.2 on Python >= 3.12)."""


class UntestedMegatronWarning(UserWarning):
    """The installed megatron-core is newer than any release norm_optim was tested on."""


def distribution_version(name: str) -> str:
    """The installed version of a distribution (``"0.6.2"``), or ``"unknown"`` (a source
    checkout without package metadata)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> tuple[int, ...]:
    """The installed megatron-core release as a tuple of ints (``(0, 19, 2)``); ``()`` if unknown."""
    try:
        text = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return ()
    # "0.19.2", "0.20.0rc1", "0.17.0.dev0+abc": the leading release numbers.
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def megatron_core_version_string() -> str:
    """``"megatron-core 0.19.2"`` for error messages (``"megatron-core (version unknown)"``)."""
    version = megatron_core_version()
    return "megatron-core " + (".".join(map(str, version)) if version else "(version unknown)")


def megatron_at_least(*release: int) -> bool:
    """True when the installed megatron-core is ``release`` or newer (unknown counts as newest)."""
    version = megatron_core_version()
    return not version or version >= release


def warn_if_untested() -> None:
    """Warn (once per process: Python's default filter shows a warning once per call site) when
    the installed megatron-core is newer than the newest tested release."""
    version = megatron_core_version()
    newest = max(TESTED_MEGATRON_CORE)
    if version and version[:2] > newest[:2]:
        warnings.warn(
            f"{megatron_core_version_string()} is newer than the releases norm_optim was tested "
            f"on ({', '.join('.'.join(map(str, v)) for v in TESTED_MEGATRON_CORE)}); the norm "
            "is refused with a clear error where its internals moved, but please report any "
            "problem",
            UntestedMegatronWarning,
            stacklevel=3,
        )
