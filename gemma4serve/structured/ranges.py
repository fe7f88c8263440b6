"""EBNF (xgrammar's dialect) for the numbers between two bounds, as JSON writes them: integers
without leading zeros, decimals `-?INT(.FRACTION)?` without an exponent, of at most DIGITS
integer digits (so every number converts to a finite JSON number) and FRACTION_DIGITS fraction
digits (so every such decimal is exact in the default decimal context's 28 digits).

Integer ranges are exact. A decimal range is exact over the decimals of at most FRACTION_DIGITS
fraction digits; a float bound becomes the nearest such decimal inside it, found so that every
decimal the grammar writes, read as a float (as JSON readers do), satisfies the bound.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal

DIGITS = 16
FRACTION_DIGITS = 12
LARGEST_INTEGER = 10**DIGITS - 1
_STEP = Decimal(1).scaleb(-FRACTION_DIGITS)  # the smallest fraction a grammar writes
LARGEST_DECIMAL = Decimal(10**DIGITS) - _STEP
_BEYOND = Decimal(10**DIGITS)  # a bound past every number a grammar writes


def integer_at_least(bound: float, exclusive: bool) -> int:
    """The least integer >= bound (> bound when exclusive)."""
    exact = Decimal(bound)  # a float's exact binary value
    return math.floor(exact) + 1 if exclusive else math.ceil(exact)


def integer_at_most(bound: float, exclusive: bool) -> int:
    return -integer_at_least(-bound, exclusive)


def decimal_at_least(bound: float, exclusive: bool) -> Decimal:
    """The least decimal of FRACTION_DIGITS fraction digits from which on every decimal, read as
    a float, is >= bound (> bound when exclusive); past the largest decimal written when none is."""
    if bound > LARGEST_DECIMAL:
        return _BEYOND
    if bound < -LARGEST_DECIMAL:
        return -LARGEST_DECIMAL
    value = float(bound)
    # the float to reach: a float compares exactly with an int, and rounding is monotonic, so
    # every decimal >= this float's shortest spelling reads as a float >= it
    while value < bound or (exclusive and value == bound):
        value = math.nextafter(value, math.inf)
    return Decimal(repr(value)).quantize(_STEP, rounding=ROUND_CEILING)


def decimal_at_most(bound: float, exclusive: bool) -> Decimal:
    return -decimal_at_least(-bound, exclusive)


def integers(least: int, most: int) -> str:
    """The integers least..most (least <= most, both within +-LARGEST_INTEGER)."""
    alternatives = []
    if least < 0:
        alternatives.append(f'"-" {_naturals(max(-most, 1), -least)}')
    if most >= 0:
        alternatives.append(_naturals(max(least, 0), most))
    return "(" + " | ".join(alternatives) + ")"


def decimals(least: Decimal, most: Decimal) -> str:
    """The decimals least..most (least <= most, both within the decimals a grammar writes)."""
    alternatives = []
    if least < 0:
        # "-0" is 0: written only where 0 is in the range
        alternatives.append(f'"-" {_magnitudes(max(-most, Decimal(0)), -least)}')
    if most >= 0:
        alternatives.append(_magnitudes(max(least, Decimal(0)), most))
    return "(" + " | ".join(alternatives) + ")"


def _magnitudes(least: Decimal, most: Decimal) -> str:
    """Unsigned decimals least..most."""
    whole_least, whole_most = int(least), int(most)
    fraction_least, fraction_most = _fraction_digits(least), _fraction_digits(most)
    zeros, nines = "0" * FRACTION_DIGITS, "9" * FRACTION_DIGITS
    if whole_least == whole_most:
        return f'("{whole_least}" {_fraction(fraction_least, fraction_most)})'
    alternatives = [f'"{whole_least}" {_fraction(fraction_least, nines)}']
    if whole_least + 1 < whole_most:
        between = _naturals(whole_least + 1, whole_most - 1)
        alternatives.append(f'{between} ("." [0-9]{{1,{FRACTION_DIGITS}}})?')
    alternatives.append(f'"{whole_most}" {_fraction(zeros, fraction_most)}')
    return "(" + " | ".join(alternatives) + ")"


def _fraction_digits(value: Decimal) -> str:
    """The FRACTION_DIGITS digits after the point of a non-negative decimal."""
    return format(value, f".{FRACTION_DIGITS}f").split(".")[1]


def _fraction(least: str, most: str) -> str:
    """An optional `.DIGITS` whose value is least..most (FRACTION_DIGITS-digit strings); none
    is 0."""
    written = f'"." {_digits(least, most, shortest=1)}'
    return f"({written})?" if int(least) == 0 else f"({written})"


def _naturals(least: int, most: int) -> str:
    """The integers least..most (0 <= least <= most), without leading zeros."""
    alternatives = []
    for length in range(len(str(least)), len(str(most)) + 1):
        low = max(least, 10 ** (length - 1) if length > 1 else 0)
        high = min(most, 10**length - 1)
        alternatives.append(_digits(str(low), str(high), shortest=length))
    return "(" + " | ".join(alternatives) + ")"


def _digits(low: str, high: str, shortest: int) -> str:
    """Digit strings of `shortest` to len(low) digits that, padded with zeros to len(low), lie
    between low and high (equal-length digit strings, low <= high)."""
    width = len(low)
    if width == 0:
        return '""'
    zeros, nines = "0" * width, "9" * width
    if low == zeros and high == nines:
        return f"[0-9]{{{shortest},{width}}}"
    # a string may end here when its padding (zeros) is >= low
    alternatives = ['""'] if shortest == 0 and low == zeros else []
    rest = max(shortest - 1, 0)
    first, last = int(low[0]), int(high[0])
    if first == last:
        alternatives.append(f'"{first}" {_digits(low[1:], high[1:], rest)}')
    else:
        alternatives.append(f'"{first}" {_digits(low[1:], nines[1:], rest)}')
        if first + 1 < last:
            middle = _digits(zeros[1:], nines[1:], rest)
            alternatives.append(f"[{first + 1}-{last - 1}] {middle}")
        alternatives.append(f'"{last}" {_digits(zeros[1:], high[1:], rest)}')
    return "(" + " | ".join(alternatives) + ")"
