"""What each setting accepts (``Rule``), and the one format of every rejection:

    flashoverlap: <where> = <value!r> is not accepted: <name> must be <what is accepted>

``<where>`` is the setting as the user wrote it: ``flashoverlap.min_rows`` (a ``torch.compile`` option),
``min_rows`` (``config.patch``), ``FLASHOVERLAP_RING_ROUNDS`` (the environment);
``<name>`` is the setting's field. Invariants: a rule turns every value it accepts into its field's one type (an int
string such as ``"256"`` into 256, a comma-separated string into a tuple of names, an int into a float, a path into
a str), it is idempotent (a value it returned passes unchanged: a setting checked where it was set is checked again,
unchanged, when the ``Settings`` is built), and it raises nothing but ``ValueError``. Pure: no settings, no
environment, no import of the package (``config`` holds the table of rules, ``config.RULES``).
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_SHORT = reprlib.Repr()  # a value as repr() writes it, cut only when long (a huge list stays one readable line)
_SHORT.maxstring = _SHORT.maxother = 160
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdict = 8


class _Rejected(Exception):
    """Raised inside a rule's ``parse``; ``detail`` (may be empty) is appended to what the rule accepts."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


def rejection(where: str, value: Any, requirement: str) -> str:
    """The message of every rejected setting (module docstring)."""
    return f"flashoverlap: {where} = {_SHORT.repr(value)} is not accepted: {requirement}"


def unknown_name(where: str, value: Any, name: str, known: Sequence[str], prefix: str = "",
                 kind: str = "setting") -> ValueError:
    """The error for a setting name that does not exist: names the closest known one (difflib) and lists all,
    each written as the user writes them (``prefix`` + name)."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    names = ", ".join(prefix + k for k in known)
    return ValueError(rejection(where, value, f"unknown {kind} {prefix + name!r}{hint}; accepted names: {names}"))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class Rule:
    """What one setting accepts. ``parse`` returns the canonical value or raises ``_Rejected``."""

    def describe(self) -> str:
        raise NotImplementedError

    def parse(self, value: Any) -> Any:
        raise NotImplementedError

    def check(self, where: str, name: str, value: Any) -> Any:
        """``value`` in the field's type, or the ValueError naming ``where``, the value and what is accepted."""
        try:
            return self.parse(value)
        except _Rejected as exc:
            raise ValueError(rejection(where, value, f"{name} must be {self.describe()}{exc.detail}")) from None


@dataclass(frozen=True)
class Int(Rule):
    """An int in ``low .. high`` (``high`` None: unbounded); an int string (the environment's) is read as one;
    bools and floats are not ints."""

    low: int
    high: int | None = None

    def describe(self) -> str:
        return f"an int in {self.low} .. {self.high}" if self.high is not None else f"an int >= {self.low}"

    def parse(self, value: Any) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _Rejected() from None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _Rejected()
        value = int(value)
        if value < self.low or (self.high is not None and value > self.high):
            raise _Rejected()
        return value


@dataclass(frozen=True)
class Float(Rule):
    """A finite number in the interval from ``low`` to ``high`` (each end open or closed), as a float; a number
    string is read as one; bools are not numbers."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    unit: str = ""  # written after the interval, e.g. " ms (at most 7 days)"

    def describe(self) -> str:
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"a finite number in {opening}{_number(self.low)}, {_number(self.high)}{closing}{self.unit}"

    def parse(self, value: Any) -> float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise _Rejected() from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Rejected()
        value = float(value)
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if not math.isfinite(value) or below or above:
            raise _Rejected()
        return value


@dataclass(frozen=True)
class Choice(Rule):
    """One of ``options``; a string is compared stripped and in lower case."""

    options: tuple[str, ...]

    def describe(self) -> str:
        return "one of " + ", ".join(map(repr, self.options))

    def parse(self, value: Any) -> str:
        text = value.strip().lower() if isinstance(value, str) else None
        if text not in self.options:
            raise _Rejected()
        return text


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Names(Rule):
    """Names from ``options``: one name, a comma-separated string ("all_reduce,reduce_scatter") or a list, tuple or
    set of names; each item goes through ``item`` first (an alias to its name). ``kind`` tuple keeps the order given
    (a set's items sorted, so equal sets give equal keys); frozenset for unordered ones. Empty is accepted."""

    options: tuple[str, ...]
    kind: type = tuple
    item: Callable[[Any], Any] = _identity

    def describe(self) -> str:
        return "a name, a comma-separated string or a list of names from " + ", ".join(map(repr, self.options))

    def parse(self, value: Any) -> tuple[str, ...] | frozenset[str]:
        if isinstance(value, str):
            items = [self.item(v.strip()) for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = [self.item(v) for v in value]
        else:
            raise _Rejected()
        bad = [v for v in items if not isinstance(v, str) or v not in self.options]
        if bad:
            raise _Rejected(f" (not among them: {', '.join(_SHORT.repr(v) for v in bad)})")
        if isinstance(value, (set, frozenset)):
            items = sorted(items)
        return self.kind(items)


@dataclass(frozen=True)
class Path(Rule):
    """A path: a str or an ``os.PathLike`` (kept as its str). Only the type is checked here; ``used`` says where
    existence is (the setting may name a file that is built or copied later)."""

    used: str

    def describe(self) -> str:
        return f"a path (str or os.PathLike; whether it exists is checked {self.used})"

    def parse(self, value: Any) -> str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _Rejected()
        return value


@dataclass(frozen=True)
class Text(Rule):
    """Any str (a name checked where it is used: ``what`` says what it names)."""

    what: str

    def describe(self) -> str:
        return f"{self.what} (a str)"

    def parse(self, value: Any) -> str:
        if not isinstance(value, str):
            raise _Rejected()
        return value


@dataclass(frozen=True)
class OrNone(Rule):
    """``rule``'s values, or None, which ``meaning`` explains; the strings in ``words`` (compared stripped and in
    lower case: the environment's way to say None) are None too."""

    rule: Rule
    meaning: str
    words: tuple[str, ...] = ("none",)

    def describe(self) -> str:
        words = "".join(f" / {w!r}" for w in self.words if w)
        return f"{self.rule.describe()}, or None{words} ({self.meaning})"

    def parse(self, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in self.words):
            return None
        return self.rule.parse(value)
