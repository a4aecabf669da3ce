"""The launch path's data classes behave as dataclasses do for what the package uses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.record import FrozenInstanceError, asdict, field, fields, record, replace


@record(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()
    note: str = field(default="", compare=False, repr=False)


@record
class Bag:
    items: list[int] = field(default_factory=list)
    inner: Point | None = None
    seen: int = 0

    def __post_init__(self) -> None:
        self.seen += 1


@dataclasses.dataclass(frozen=True)
class RefPoint:
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()
    note: str = dataclasses.field(default="", compare=False, repr=False)


def test_like_a_frozen_dataclass():
    p, ref = Point(1, tags=("a",), note="hidden"), RefPoint(1, tags=("a",), note="hidden")
    assert repr(p).replace("Point", "") == repr(ref).replace("RefPoint", "")
    assert p == Point(1, tags=("a",), note="other") and p != Point(2)
    assert hash(p) == hash(Point(1, tags=("a",)))
    assert p != ref and (p == ref) is False
    with pytest.raises(FrozenInstanceError):
        p.x = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.y  # type: ignore[misc]
    assert fields(p) == fields(Point) == ("x", "y", "tags", "note")


def test_mutable_records_have_fresh_defaults_and_post_init():
    a, b = Bag(), Bag()
    a.items.append(1)
    assert b.items == [] and a.seen == 1
    with pytest.raises(TypeError):
        hash(a)
    assert Bag([1]) == Bag([1]) and Bag([1]) != Bag([2])


def test_replace_and_asdict():
    p = Point(1, 2)
    q = replace(p, y=5)
    assert (q.x, q.y) == (1, 5) and p.y == 2
    with pytest.raises(TypeError):
        replace(p, z=1)
    assert asdict(Bag([1], Point(3, tags=("t",)))) == {
        "items": [1],
        "inner": {"x": 3, "y": 0, "tags": ("t",), "note": ""},
        "seen": 1,
    }


def test_definition_errors():
    with pytest.raises(TypeError):

        @record
        class Bad:
            a: int = 0
            b: int

    with pytest.raises(ValueError):

        @record
        class Shared:
            a: list[int] = []  # noqa: RUF012

    with pytest.raises(ValueError):
        field(default=1, default_factory=list)


def test_inherited_fields_come_first():
    @record
    class Base:
        a: int

    @record
    class Derived(Base):
        b: int = 2

    assert fields(Derived) == ("a", "b") and Derived(1).b == 2


def test_constructor_errors_name_the_argument():
    with pytest.raises(TypeError, match="missing 1 required argument.*'x'"):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        Point(1, z=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        Point(1, x=2)  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 4 positional arguments but 5"):
        Point(1, 2, (), "", 5)  # type: ignore[call-arg]


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["required", "default", "factory"]), max_size=5).map(
        lambda ks: sorted(ks, key=lambda k: k != "required")
    ),
    positional=st.integers(0, 6),
    keywords=st.sets(st.sampled_from(["f0", "f1", "f2", "f3", "f4", "zz"])),
)
def test_construction_agrees_with_dataclasses(kinds, positional, keywords):
    """Any record class built from required, defaulted and factory fields accepts exactly the
    calls the same dataclass accepts, and stores the same values (the oracle: ``dataclasses``)."""
    spec = {f"f{i}": kind for i, kind in enumerate(kinds)}

    def build(make, fld):
        namespace: dict = {"__annotations__": {name: "int" for name in spec}}
        for name, kind in spec.items():
            if kind == "default":
                namespace[name] = -1
            elif kind == "factory":
                namespace[name] = fld(default_factory=lambda: -2)
        return make(type("C", (), namespace))

    ours, theirs = build(record, field), build(dataclasses.dataclass, dataclasses.field)
    args = tuple(range(positional))
    kwargs = {name: 100 + len(name) for name in keywords}

    def outcome(cls):
        try:
            obj = cls(*args, **kwargs)
        except TypeError:
            return "TypeError"
        return tuple(getattr(obj, name) for name in spec)

    assert outcome(ours) == outcome(theirs)
