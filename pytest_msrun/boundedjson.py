"""JSON from strangers, parsed by code that can only succeed or raise :class:`Rejected`.

``json.loads`` alone is not total: a few kilobytes of ``[`` raise :class:`RecursionError`, a long
run of digits :class:`ValueError` (or, before Python 3.11, costs quadratic time), ``NaN`` and
``Infinity`` are accepted though they are not JSON, and bytes that are not UTF-8 raise
:class:`UnicodeDecodeError`. :func:`loads` bounds what the text may be before it is parsed -
its nesting, the length of every number - and turns every failure into :class:`Rejected`.

The nesting check is linear in the text and runs in C: strings are cut out, the brackets that
remain are kept, and innermost pairs are removed ``max_depth`` times; any opening bracket left
means deeper nesting (or unbalanced brackets, which the parser would refuse anyway). Text with
no more opening brackets than ``max_depth`` skips it.

Standard library only; :mod:`json` and :mod:`re` are imported at the first call.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_NUMBER_CHARS = 40  # the longest number literal accepted by :func:`loads` with ``strict``


class Rejected(ValueError):
    """The text is not JSON within the bounds asked for; the message says which bound."""


_strings: Any = None  # a compiled pattern: one JSON string, or an unterminated one to the end
_loads: Any = None
_brackets = str.maketrans({c: None for c in map(chr, range(128)) if c not in "[]{}"})


def _load() -> None:
    global _strings, _loads
    import json
    import re

    # Linear: each character matches one alternative only, and an unterminated string runs to
    # the end of the text in one match instead of failing and being retried at every quote.
    _strings = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
    _loads = json.loads


def depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether ``text`` nests arrays and objects deeper than ``max_depth`` (or its brackets,
    outside strings, do not balance)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    if _strings is None:
        _load()
    shape = _strings.sub("", text)
    # Keep the brackets (non-ASCII characters cannot be brackets: drop them too).
    shape = shape.encode("ascii", "ignore").decode("ascii").translate(_brackets)
    shape = shape.replace("{", "[").replace("}", "]")
    for _ in range(max_depth):
        if "[" not in shape:
            return False
        shape = shape.replace("[]", "")
    return "[" in shape


def _reject_constant(name: str) -> Any:
    raise Rejected(f"{name} is not JSON")


def _bounded(kind: type) -> Any:
    def parse(literal: str) -> Any:
        if len(literal) > MAX_NUMBER_CHARS:
            raise Rejected(f"a number of {len(literal)} characters (at most {MAX_NUMBER_CHARS})")
        return kind(literal)

    return parse


_int, _float = _bounded(int), _bounded(float)


def loads(data: bytes | str, *, max_depth: int | None, strict: bool = True) -> Any:
    """The JSON value in ``data`` (UTF-8 when bytes), or :class:`Rejected`.

    ``max_depth`` bounds the nesting of arrays and objects (1: one object of scalars); ``None``
    leaves it to the parser's recursion limit (still :class:`Rejected`, never an exception).
    ``strict`` also bounds number literals to :data:`MAX_NUMBER_CHARS` characters and refuses
    ``NaN`` and ``Infinity``; without it numbers parse at C speed (for trusted peers' messages).
    """
    if _loads is None:
        _load()
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        if max_depth is not None and depth_exceeds(text, max_depth):
            raise Rejected(f"nested deeper than {max_depth} levels")
        if strict:
            return _loads(text, parse_int=_int, parse_float=_float, parse_constant=_reject_constant)
        return _loads(text)
    except Rejected:
        raise
    except UnicodeDecodeError as exc:
        raise Rejected(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:  # json.JSONDecodeError, and int()'s limit on digits
        raise Rejected(f"not JSON ({exc})") from None
    except (RecursionError, MemoryError) as exc:  # a recursion limit set low, or no memory left
        raise Rejected(f"cannot be parsed ({type(exc).__name__})") from None
