"""Byte sizes written the way people write them: ``6GiB``, ``24GB``, ``512MiB``, ``"1.5 GiB"``
or a plain number of bytes. The one parser behind every budget (``wrap(host_budget=...)``,

Design notes: docs/modules.md, sizes.py."""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from typing import Union

Size = Union[int, float, str]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
    "P": 2**50,
}
_NUMBER = re.compile(
    r"\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"\s*([A-Za-z]*)\s*"
)
_EXAMPLES = (
    "write a whole number of bytes or a number with a unit, e.g. 6GiB, 24GB, 512MiB, "
    "'1.5 GiB' (KB/MB/GB/TB: powers of 1000; KiB/MiB/GiB/TiB: powers of 1024)"
)


def parse_size(value: Size, what: str = "size", minimum: int = 0) -> int:
    """``value`` in bytes, as an int: an int, a float holding a whole number (``6e9``) or a
    string (see the module doc; fractions of a byte are dropped, ``"1.1GiB"`` included).
    Raises ValueError naming ``what``, the value and how to write it when it is not a size or
    is below ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"infinity: {what}={value!r} is not a size; {_EXAMPLES}")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real):
        f = float(value)
        if not math.isfinite(f) or f != int(f):
            raise ValueError(
                f"infinity: {what}={value!r} is not a whole number of bytes; {_EXAMPLES}"
            )
        n = int(f)
    elif isinstance(value, str):
        m = _NUMBER.fullmatch(value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"infinity: {what}={value!r} is not a size; {_EXAMPLES}")
        number = Decimal(m.group(1))
        if number.adjusted() > 30:  # keeps int() below from building a huge number
            raise ValueError(
                f"infinity: {what}={value!r} is far too large to be a size; {_EXAMPLES}"
            )
        n = int(number * _UNITS[unit])  # exact: no float rounding
    else:
        raise ValueError(
            f"infinity: {what}={value!r} is not a size (a {type(value).__name__}); {_EXAMPLES}"
        )
    if n < 0:
        raise ValueError(
            f"infinity: {what}={value!r} is negative; a size is a number of bytes "
            f">= {minimum} ({_EXAMPLES})"
        )
    if n < minimum:
        raise ValueError(
            f"infinity: {what}={value!r} is {n:,} bytes; it must be at least "
            f"{minimum:,} ({_EXAMPLES})"
        )
    return n


def parse_budget(value: Size, what: str = "budget") -> int:
    """A byte budget: a size of at least one byte."""
    return parse_size(value, what, minimum=1)
