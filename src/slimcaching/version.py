"""The installed version of the package, read without importing the rest of it."""

from __future__ import annotations


def package_version() -> str:
    """The installed version ("unknown" when run from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version  # start-up: only --version needs it

    try:
        return version("slimcaching")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"
