"""Exceptions the app raises for bad input; the CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class LmtrainError(Exception):
    """A user-facing error: bad flags, a missing file, a config value out of range."""


class OverrideError(LmtrainError, ValueError):
    """A `--set key=value` that names no config field or whose value does not convert to the field's type."""
