"""Data classes for the launch path, without the start-up cost of :mod:`dataclasses`.

``dataclasses`` imports ``inspect`` (and with it ``ast``, ``dis``, ``tokenize``) and compiles
each generated method separately: together about a quarter of msrun's start-up before its
first worker. :func:`record` compiles nothing: ``__init__`` is a closure over the class's fields (defaults,
default factories, ``__post_init__``); ``__repr__``, ``__eq__`` and, for ``frozen=True``, immutability and
``__hash__`` are shared functions reading the class's fields. :func:`replace`, :func:`asdict` and
:func:`fields` work as their ``dataclasses`` namesakes do for these classes.

Supported: annotated fields in definition order (inherited fields first), ``field(default=...,
default_factory=..., repr=..., compare=...)``; not: ``ClassVar``, ``init=False`` fields, ``InitVar``, slots.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    from typing_extensions import dataclass_transform

    T = TypeVar("T")
else:

    def dataclass_transform(**_kw):
        return lambda f: f


_MISSING = object()
FIELDS = "__record_fields__"


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a ``frozen=True`` record."""


class Field:
    __slots__ = ("name", "default", "default_factory", "repr", "compare")

    def __init__(self, default: Any, default_factory: Any, repr: bool, compare: bool) -> None:
        self.name = ""
        self.default = default
        self.default_factory = default_factory
        self.repr = repr
        self.compare = compare


def field(
    *,
    default: Any = _MISSING,
    default_factory: Callable[[], Any] | Any = _MISSING,
    repr: bool = True,
    compare: bool = True,
) -> Any:
    """A field with a default factory, or hidden from ``repr``/``==``."""
    if default is not _MISSING and default_factory is not _MISSING:
        raise ValueError("cannot specify both default and default_factory")
    return Field(default, default_factory, repr, compare)


def _collect(cls: type) -> list[Field]:
    found: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        for f in getattr(base, FIELDS, ()):
            found[f.name] = f
    for name in cls.__dict__.get("__annotations__", {}):
        value = cls.__dict__.get(name, _MISSING)
        if isinstance(value, Field):
            f = value
            if f.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        else:
            f = Field(value, _MISSING, True, True)
            if isinstance(value, (list, dict, set)):
                raise ValueError(f"{cls.__name__}.{name}: mutable default {type(value).__name__}; use default_factory")
        f.name = name
        found[name] = f
    return list(found.values())


def _repr(self: Any) -> str:
    shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in getattr(self, FIELDS) if f.repr)
    return f"{type(self).__qualname__}({shown})"


def _key(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, f.name) for f in getattr(self, FIELDS) if f.compare)


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    return hash(_key(self))


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _initializer(qualname: str, fields: tuple[Field, ...], post_init: bool) -> Callable[..., None]:
    """One ``__init__`` for a record class: a closure over its fields, not generated source -
    compiling one costs ~1M instructions a class, a quarter of msrun's own start-up. The values
    go into the instance's ``__dict__`` at once (frozen or not: no field has a descriptor)."""
    names = tuple(f.name for f in fields)
    known = frozenset(names)
    defaults = {f.name: f.default for f in fields if f.default is not _MISSING}
    factories = tuple((f.name, f.default_factory) for f in fields if f.default_factory is not _MISSING)
    limit = len(names)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            if len(args) > limit:
                raise TypeError(f"{qualname}() takes {limit} positional arguments but {len(args)} were given")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"{qualname}() got multiple values for argument {name!r}")
                kwargs[name] = value
        if not known.issuperset(kwargs):
            unknown = sorted(set(kwargs) - known)
            raise TypeError(f"{qualname}() got an unexpected keyword argument {unknown[0]!r}")
        values = {**defaults, **kwargs}
        for name, factory in factories:
            if name not in kwargs:
                values[name] = factory()
        if len(values) < limit:
            missing = ", ".join(repr(n) for n in names if n not in values)
            raise TypeError(f"{qualname}() missing {limit - len(values)} required argument(s): {missing}")
        self.__dict__.update({name: values[name] for name in names})  # in field order, as dataclasses set them
        if post_init:
            self.__post_init__()

    __init__.__qualname__ = f"{qualname}.__init__"
    return __init__


def _build(cls: type, frozen: bool, eq: bool) -> type:
    fields = _collect(cls)
    seen_default = False
    for f in fields:
        if f.default is not _MISSING or f.default_factory is not _MISSING:
            seen_default = True
        elif seen_default:
            raise TypeError(f"{cls.__name__}: non-default field {f.name!r} follows a default field")
    # Only __init__ is specific to the class (its fields); the other methods are shared.
    init = _initializer(cls.__qualname__, tuple(fields), hasattr(cls, "__post_init__"))
    methods: dict[str, Any] = {"__init__": init, "__repr__": _repr}
    if eq:
        methods["__eq__"] = _eq
        methods["__hash__"] = _hash if frozen else None  # mutable and compared by value: unhashable
    if frozen:
        methods["__setattr__"] = _frozen_setattr
        methods["__delattr__"] = _frozen_delattr
    for name, value in methods.items():
        if name not in cls.__dict__ or name == "__init__":  # a method the class defines stays
            setattr(cls, name, value)
    setattr(cls, FIELDS, tuple(fields))
    return cls


@dataclass_transform(field_specifiers=(field,))
def record(cls: Any = None, *, frozen: bool = False, eq: bool = True) -> Any:
    """``@record`` / ``@record(frozen=True, eq=False)``: like ``@dataclasses.dataclass``."""
    return (lambda c: _build(c, frozen, eq)) if cls is None else _build(cls, frozen, eq)


def fields(obj: Any) -> tuple[str, ...]:
    """The field names of a record class or instance, in order."""
    return tuple(f.name for f in getattr(obj, FIELDS))


def replace(obj: T, **changes: Any) -> T:
    """A copy of ``obj`` with some fields changed (the others shared, not copied)."""
    return type(obj)(**{**{name: getattr(obj, name) for name in fields(obj)}, **changes})  # __init__ refuses others


def asdict(obj: Any) -> Any:
    """A record as plain data: records become dicts, lists/tuples/dicts are converted inside."""
    if hasattr(type(obj), FIELDS):
        return {name: asdict(getattr(obj, name)) for name in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(asdict(v) for v in obj)
    if isinstance(obj, dict):
        return {k: asdict(v) for k, v in obj.items()}
    return obj
