"""Reading sizes: the one parser that the command line and plan() share.

A string needs a unit ('24GB', '24GiB', '100GB/s', '400Gb/s'): a bare '24' is refused, since
24 bytes of GPU memory is never what was meant. In Python a number is already bytes (bytes per
second for a bandwidth), as plan()'s defaults 80e9 and 100e9 are.
"""

import math
import numbers
import re

_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE = re.compile(r"((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)")


def parse_size(text, per_second=False):
    """Bytes in `text`: '80GB', '141GiB', '8e10B'; with per_second a rate per second, '100GB/s'
    in bytes or '100Gb/s', '100Gbps', '100Gbit/s' in bits (as NICs are rated: a lowercase b
    is a bit). Raises ValueError naming the text and what to write instead."""
    t = text.strip().replace(" ", "")
    if per_second:
        for suffix in ("/s", "ps"):
            if t.lower().endswith(suffix):
                t = t[:-len(suffix)]
                break
    m = _SIZE.fullmatch(t)
    if m and not m.group(2):
        number = m.group(1)
        fix = f"{number}GB/s (bytes) or {number}Gb/s (bits)" if per_second else f"{number}GB or {number}GiB"
        raise ValueError(f"{text!r} has no unit: write {fix}")
    unit = m.group(2) if m else ""
    bits = per_second and (unit.endswith("b") or unit.lower().endswith("bit"))
    key = (unit[:-3] + "b" if unit.lower().endswith("bit") else unit).lower()
    if not m or key not in _UNITS:
        example = "100GB/s or 400Gb/s" if per_second else "80GB or 141GiB"
        raise ValueError(f"cannot read {text!r} as a size (e.g. {example})")
    value = float(m.group(1)) * _UNITS[key] / (8 if bits else 1)
    if not 0 < value < math.inf:
        raise ValueError(f"{text!r} must be positive and finite")
    return value


def to_bytes(name, value, per_second=False):
    """plan()'s boundary: a number is bytes (per second), a string goes through parse_size.
    Errors start with `name`, the argument at fault."""
    if isinstance(value, str):
        try:
            return parse_size(value, per_second)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        example = "a number of bytes/s or a string like '100GB/s'" if per_second else \
            "a number of bytes or a string like '80GB'"
        raise TypeError(f"{name} must be {example}, got {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name}: {value!r} must be positive and finite")
    return float(value)
