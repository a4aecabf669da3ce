"""The keep/evict policy of warm worlds (:mod:`pytest_msrun.plugin.controller.keeping`) against a tiny oracle: a
session of tests whose worlds start when absent, are kept after a test only if they survive to
their next one, and make room by :func:`victims`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.plugin.controller.keeping import NEVER, Budget, Schedule, default_ranks, survives, victims

SHAPES = {"a": (2, 0), "b": (3, 0), "c": (4, 0), "d": (1, 1), "e": (2, 2)}  # key -> (ranks, devices)


def need(key: str) -> tuple[int, int]:
    return SHAPES[key]


def run(keys: list[str], budget: Budget) -> tuple[dict[str, int], list[int], list[str]]:
    """The oracle session: world starts per key, live ranks after each step, and worlds evicted
    at another's start (each of them a late end: ``world_next`` should have ended it in its test)."""
    schedule = Schedule(keys)
    live: dict[str, tuple[int, int]] = {}
    starts: dict[str, int] = {}
    ranks: list[int] = []
    evicted: list[str] = []
    for i, key in enumerate(keys):
        if key not in live:
            for victim in victims(live, need(key), budget, lambda k, i=i: schedule.next_use(k, i)):
                evicted.append(victim)
                del live[victim]
            live[key] = need(key)
            starts[key] = starts.get(key, 0) + 1
        ranks.append(sum(r for r, _ in live.values()))
        following = schedule.next_use(key, i + 1)
        if following == NEVER or not survives(key, live, need, schedule, i + 1, int(following), budget):
            del live[key]  # ended within its test
    return starts, ranks, evicted


sessions = st.lists(st.sampled_from(sorted(SHAPES)), max_size=40)
budgets = st.builds(Budget, st.integers(1, 14), st.integers(0, 4))


@settings(max_examples=300, deadline=None)
@given(sessions, budgets)
def test_never_more_live_ranks_than_the_budget_unless_one_world_alone_is_larger(keys, budget):
    starts, ranks, _ = run(keys, budget)
    for key, live in zip(keys, ranks):
        assert live <= max(budget.ranks, need(key)[0])


@settings(max_examples=300, deadline=None)
@given(sessions)
def test_a_budget_for_every_shape_starts_each_shape_once(keys):
    starts, _, evicted = run(keys, Budget(sum(r for r, _ in SHAPES.values()), 3))
    assert starts == {key: 1 for key in set(keys)}
    assert not evicted


@settings(max_examples=300, deadline=None)
@given(sessions, budgets)
def test_a_kept_world_is_never_evicted_before_its_next_test(keys, budget):
    # world_next's prediction and the eviction at a world's start agree: no late ends
    assert run(keys, budget)[2] == []


@settings(max_examples=300, deadline=None)
@given(sessions, budgets)
def test_keeping_never_starts_more_worlds_than_ending_each_after_its_test(keys, budget):
    starts, _, _ = run(keys, budget)
    changes = sum(1 for i, key in enumerate(keys) if i == 0 or keys[i - 1] != key)
    assert sum(starts.values()) <= changes


@given(st.lists(st.one_of(st.none(), st.sampled_from("abc")), max_size=30), st.sampled_from("abcz"), st.integers(0, 31))
def test_next_use_is_the_first_position_at_or_after_start(keys, key, start):
    expected = next((i for i in range(start, len(keys)) if keys[i] == key), NEVER)
    assert Schedule(keys).next_use(key, start) == expected


@given(
    st.dictionaries(st.sampled_from(sorted(SHAPES)), st.integers(0, 50)),
    st.sampled_from(sorted(SHAPES)),
    budgets,
)
def test_victims_make_room_farthest_first(uses, new, budget):
    live = {key: need(key) for key in uses if key != new}
    ended = victims(live, need(new), budget, uses.__getitem__)
    rest = [need(key) for key in live if key not in ended]
    assert budget.fits([*rest, need(new)]) or not rest
    kept = [uses[key] for key in live if key not in ended]
    assert all(uses[key] >= max(kept, default=-1) for key in ended)


def test_three_interleaved_shapes_with_room_for_two_start_six_worlds():
    starts, _, evicted = run(list("abc" * 3), Budget(7, 0))
    assert sum(starts.values()) == 6 and not evicted


def test_the_default_budget_is_at_least_one_rank():
    assert default_ranks() >= 1
    assert default_ranks(10**9) == 1
