"""Flag values of ``qaccel bench quant`` shared by its two studies (throughput in ``quant.py``, error in ``_quant_error.py``)."""

from __future__ import annotations

__all__ = ["QuantInputError", "parse_bits", "parse_int_list"]


class QuantInputError(ValueError):
    """Bad ``qaccel bench quant`` input: one line on stderr, exit status 2."""


def parse_int_list(name: str, text: str, allow_all: bool = False) -> list[int | str]:
    """``--<name>``: comma-separated integers (and ``all`` where ``allow_all``)."""
    values: list[int | str] = []
    for item in text.split(","):
        item = item.strip()
        if allow_all and item == "all":
            values.append(item)
            continue
        try:
            values.append(int(item))
        except ValueError:
            raise QuantInputError(f"--{name}={text!r}: expected comma-separated integers{' or all' if allow_all else ''}") from None
    return values


def parse_bits(text: str) -> list[int]:
    """``--bits``: comma-separated code widths, each in [2, 8]."""
    bits_list = [int(bits) for bits in parse_int_list("bits", text)]
    if any(not 2 <= bits <= 8 for bits in bits_list):
        raise QuantInputError(f"--bits={text!r}: every value must be in [2, 8]")
    return bits_list
