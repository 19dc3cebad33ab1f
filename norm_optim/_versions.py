"""Which megatron-core releases norm_optim was tested on, and which one is installed.

norm_optim reads megatron-core internals (all of them in :mod:`norm_optim._megatron`); a release
we have not run may have moved them. Such a release still works where its layout is unchanged,
but it warns once, and every "cannot read this" error names the installed version so a report
says where to look.
"""

from __future__ import annotations

import functools
import re
import warnings
from importlib import metadata

TESTED_MEGATRON_CORE = ((0, 14, 0), (0, 15, 3), (0, 16, 1), (0, 17, 1), (0, 18, 2), (0, 19, 2))
"""The releases CI runs: the newest patch of every minor line from 0.14 on (0.14-0.16 on Python
3.11, 0.17-0.19 on Python 3.12; the README's support table says what each leg runs)."""

TESTED_MEGATRON_CORE_MAIN = "0.20.0.dev20260822"
"""The build of megatron-core main (Megatron-LM ``d98e8a64dd``) CI runs the suite on when it has
the wheel (``make test-main``); main moves, so any other build of the 0.20 line still warns."""


class UntestedMegatronWarning(UserWarning):
    """The installed megatron-core is outside the releases norm_optim was tested on."""


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
    the installed megatron-core is older or newer than every tested release (the tested build
    of main excepted)."""
    version = megatron_core_version()
    if not version or distribution_version("megatron-core") == TESTED_MEGATRON_CORE_MAIN:
        return
    if version[:2] < min(TESTED_MEGATRON_CORE)[:2]:
        where = "older"
    elif version[:2] > max(TESTED_MEGATRON_CORE)[:2]:
        where = "newer"
    else:
        return
    tested = ", ".join(".".join(map(str, v)) for v in TESTED_MEGATRON_CORE)
    warnings.warn(
        f"{megatron_core_version_string()} is {where} than the releases norm_optim was tested "
        f"on ({tested}, and main's {TESTED_MEGATRON_CORE_MAIN}); the norm is refused with a "
        "clear error where its internals moved, but please report any problem",
        UntestedMegatronWarning,
        stacklevel=3,
    )
