"""Parsing and printing the quantities operators type: sizes, parameter counts, rates, durations.

Sizes are decimal by default (``GB`` = 10^9 bytes), as storage vendors and the planning figures
quote them (70B parameters x 2 bytes = 140 GB); binary units (``GiB``) are accepted too.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "fmt_bytes",
    "fmt_count",
    "fmt_duration",
    "fmt_rate",
    "parse_count",
    "parse_duration",
    "parse_rate",
    "parse_size",
]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_DURATION_UNITS = {
    "": 1.0,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def _split(
    text: str, what: str, units: dict[str, float] | dict[str, int], example: str
) -> tuple[float, float]:
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if m is None or m.group(2) not in units:
        raise ValueError(f"cannot read {what} {text!r}: write it like {example}")
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ValueError(f"cannot read {what} {text!r}: not a finite number")
    return value, float(units[m.group(2)])


def parse_size(text: str) -> float:
    """Bytes in ``"140GB"``, ``"1.12 TB"``, ``"512MiB"`` or a plain number of bytes.

    Raises:
        ValueError: not a size; the message shows the accepted forms.
    """
    value, unit = _split(text, "size", _SIZE_UNITS, "'140GB', '1.5TB' or '512MiB'")
    return value * unit


def parse_count(text: str) -> float:
    """A parameter count: ``"70B"`` (billion), ``"350M"``, ``"1.5T"``, ``"7e9"``.

    Raises:
        ValueError: not a count.
    """
    value, unit = _split(text, "parameter count", _COUNT_UNITS, "'70B', '350M', '1.5T' or '7e9'")
    if value <= 0:
        raise ValueError(f"the parameter count must be positive, got {text!r}")
    return value * unit


def parse_rate(text: str) -> float:
    """Bytes per second in ``"10GB/s"``, ``"25 GB/s"``, ``"800MiB/s"`` (``/s`` optional).

    Raises:
        ValueError: not a rate, or not positive.
    """
    t = text.strip()
    low = t.lower()
    if low.endswith("/s"):
        t = t[:-2]
    value, unit = _split(t, "bandwidth", _SIZE_UNITS, "'10GB/s' or '800MiB/s'")
    if value <= 0:
        raise ValueError(f"a bandwidth must be positive, got {text!r}")
    return value * unit


def parse_duration(text: str) -> float:
    """Seconds in ``"1h"``, ``"30min"``, ``"90s"``, ``"2d"`` or a plain number of seconds.

    Raises:
        ValueError: not a duration, or not positive.
    """
    value, unit = _split(text, "duration", _DURATION_UNITS, "'1h', '30min', '90s' or '2d'")
    if value <= 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return value * unit


def _sig(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def fmt_bytes(n: float) -> str:
    """``1.12 TB``, ``140 GB``, ``512 B`` (decimal units, three significant digits)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{_sig(n / scale)} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float) -> str:
    """``10 GB/s``."""
    return f"{fmt_bytes(n)}/s"


def fmt_count(n: float) -> str:
    """``70B``, ``350M`` (parameters)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{_sig(n / scale)}{unit}"
    return f"{n:.0f}"


def fmt_duration(s: float) -> str:
    """``12 ms``, ``8.5 s``, ``8.33 min``, ``2.58 h``, ``3 d``."""
    if s < 1:
        return f"{s * 1000:.3g} ms"
    if s < 100:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 2 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} d"
