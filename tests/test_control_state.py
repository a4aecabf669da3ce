"""The control plane's state machines without sockets: the ranks' group and the node registry."""

from __future__ import annotations

import base64

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.control.group import RankGroup, gather_reply_bytes, json_bytes, process_text
from pytest_msrun.control.registry import NodeRegistry


def deliveries(sends) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for ranks, msg in sends:
        for rank in ranks:
            out.setdefault(rank, []).append(msg)
    return out


def test_the_group_forms_when_every_rank_joined_and_a_late_rejoin_is_ready_at_once():
    group = RankGroup(3)
    assert group.join(0) == [] and group.join(2) == []
    sends = group.join(1)
    assert sends == [([0, 1, 2], {"t": "ready", "world": 3})] and group.ready
    group.left(1, "connection closed")
    assert group.join(1) == [([1], {"t": "ready", "world": 3})]


def test_a_rank_that_exits_before_joining_fails_the_waiting_ranks_and_later_joiners():
    group = RankGroup(3)
    group.join(0)
    sends = group.exited(2, "exited with code 3")
    assert sends == [
        (
            [0],
            {
                "t": "error",
                "seq": -1,
                "reason": "rank 2 exited without joining the group: its process exited with code 3",
            },
        )
    ]
    assert deliveries(group.join(1))[1][0]["t"] == "error" and 1 not in group.connected


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.randoms(use_true_random=False))
def test_collectives_complete_once_for_every_rank_in_any_arrival_order(world, count, rnd):
    group = RankGroup(world)
    for rank in range(world):
        group.join(rank)
    ops = [rnd.choice(["barrier", "gather", "bcast"]) for _ in range(count)]
    srcs = [rnd.randrange(world) for _ in range(count)]
    # Each rank enters its collectives in order, the next once the last returned (cluster.py's
    # lock); the ranks interleave in any order.
    got: dict[int, list[dict]] = {rank: [] for rank in range(world)}
    entered = dict.fromkeys(range(world), 0)
    while True:
        free = [r for r in range(world) if entered[r] == len(got[r]) and entered[r] < count]
        if not free:
            break
        rank = rnd.choice(free)
        entered[rank] = seq = entered[rank] + 1
        op, src = ops[seq - 1], srcs[seq - 1]
        data = f"{rank}:{seq}" if op == "gather" or (op == "bcast" and rank == src) else None
        for who, msgs in deliveries(group.contribute(rank, op, seq, src, data)).items():
            got[who] += msgs
    for rank in range(world):
        assert sorted(m["seq"] for m in got[rank]) == list(range(1, count + 1))
        for msg in got[rank]:
            op, src = ops[msg["seq"] - 1], srcs[msg["seq"] - 1]
            assert msg["t"] == "coll"
            if op == "gather":
                assert msg["data"] == [f"{r}:{msg['seq']}" for r in range(world)]
            elif op == "bcast":
                assert msg["data"] == f"{src}:{msg['seq']}"
    assert not group.collectives


def test_a_rank_leaving_during_a_collective_fails_it_for_those_waiting_naming_how():
    group = RankGroup(3)
    for rank in range(3):
        group.join(rank)
    assert group.contribute(0, "barrier", 1, 0, None) == []
    group.exited(2, "killed by SIGSEGV (exit status 139)")  # its agent saw the exit first
    sends = group.left(2, "connection closed")
    assert sends == [
        (
            [0],
            {
                "t": "error",
                "seq": 1,
                "reason": "barrier #1 cannot complete: "
                "rank 2 left the job (its process killed by SIGSEGV (exit status 139))",
            },
        )
    ]
    later = deliveries(group.contribute(1, "barrier", 2, 0, None))
    assert "cannot complete: rank 2 left the job" in later[1][0]["reason"]


def test_a_mismatched_collective_fails_for_the_ranks_in_it():
    group = RankGroup(2)
    group.join(0), group.join(1)
    group.contribute(0, "barrier", 1, 0, None)
    sends = group.contribute(1, "bcast", 1, 1, "x")
    assert (
        sends[0][0] == [0, 1]
        and "mismatch: rank 1 called bcast(src=1), another rank called barrier" in sends[0][1]["reason"]
    )


def test_ranks_that_finished_their_test_release_the_ones_waiting_for_them():
    group = RankGroup(3)
    for rank in range(3):
        group.join(rank)
    group.contribute(0, "barrier", 1, 0, None)
    sends = group.finished([1, 2], "finished its test")
    reason = "barrier #1 cannot complete: rank 1 left the test (finished its test)"
    assert sends == [([0], {"t": "error", "seq": 1, "reason": reason})]
    snap = group.snapshot()
    assert snap["ready"] and snap["collectives"] == [] and snap["last"] == {"0": "barrier #1"}


def _formed(world: int) -> RankGroup:
    group = RankGroup(world)
    for rank in range(world):
        group.join(rank)
    return group


def test_a_collective_of_a_call_fails_once_every_missing_rank_left_that_call():
    group = _formed(3)
    assert group.contribute(0, "gather", 1, 0, "a", ("t.py::test_x", "call")) == []
    assert group.call_notice(1, "out", "t.py::test_x", "passed") == []  # rank 2 may still come
    sends = group.call_notice(2, "out", "t.py::test_x", "raised AssertionError")
    reason = (
        "all_gather #1 cannot complete: rank 1 has left test_x's call (passed); "
        "rank 2 has left test_x's call (raised AssertionError)"
    )
    assert sends == [([0], {"t": "error", "seq": 1, "reason": reason, "rewind": 0})]  # they never entered #1
    # entered after they left: failed at once, naming where they are now
    group.call_notice(1, "in", "t.py::test_y", "")
    later = deliveries(group.contribute(0, "barrier", 2, 0, None, ("t.py::test_x", "call")))
    assert later[0][0]["reason"].startswith(
        "barrier #2 cannot complete: rank 1 has left test_x's call (passed) and is in test_y's call; rank 2"
    )


def test_left_calls_are_per_test_and_entering_a_call_again_forgets_leaving_it():
    group = _formed(2)
    group.call_notice(1, "out", "t.py::test_x", "passed")
    group.call_notice(1, "in", "t.py::test_x", "")  # the same test again (a warm world)
    assert group.contribute(0, "barrier", 1, 0, None, ("t.py::test_x", "call")) == []
    group.call_notice(1, "out", "t.py::test_other", "passed")  # another test: no news for this one
    assert 1 in group.collectives
    assert deliveries(group.contribute(1, "barrier", 1, 0, None, ("t.py::test_x", "call")))[0][0]["t"] == "coll"


def test_a_rank_that_finalized_in_one_test_may_init_again_in_a_later_tests_collective():
    """finalize() in test_x's call: test_y's collective waits for the rank (a warm world's or a
    suite's rank init()s again; it failed at once, "rank 1 left the job", a race), fails if the rank
    leaves test_y's call without it, and test_x's own collectives fail at once as before."""
    group = _formed(2)
    group.call_notice(1, "in", "t.py::test_x", "")
    # rank 0 is already in test_y's barrier when rank 1 finalizes in test_x: it is not failed
    assert group.contribute(0, "barrier", 1, 0, None, ("t.py::test_y", "call")) == []
    assert group.bye(1, "t.py::test_x") == []
    group.call_notice(1, "out", "t.py::test_x", "passed")
    group.call_notice(1, "in", "t.py::test_y", "")
    assert group.join(1) == [([1], {"t": "ready", "world": 2})]  # init() again
    assert deliveries(group.contribute(1, "barrier", 1, 0, None, ("t.py::test_y", "call")))[0][0]["t"] == "coll"
    # finalized in test_y and never back: test_z's collective fails once it left test_z's call
    assert group.bye(1, "t.py::test_y") == []
    assert group.contribute(0, "barrier", 2, 0, None, ("t.py::test_z", "call")) == []
    assert group.call_notice(1, "in", "t.py::test_z", "") == []
    (peers, msg), *_ = group.call_notice(1, "out", "t.py::test_z", "passed")
    assert peers == [0] and "rank 1 has left test_z's call (passed)" in msg["reason"]
    # a collective of the test it finalized in, or outside any test: failed at once, as in a job
    for test, where in (("t.py::test_w", ("t.py::test_w", "call")), (None, None)):
        group = _formed(2)
        group.bye(1, test)
        (peers, msg), *_ = group.contribute(0, "barrier", 1, 0, None, where)
        assert peers == [0] and "rank 1 left the job (it called finalize())" in msg["reason"]


def test_a_collective_one_rank_entered_in_a_test_its_peers_left_fails_alone_whichever_comes_first():
    """Rank 0's teardown barrier of test_x and rank 1's barrier in test_y's call share #1: rank 0's
    fails alone (rewound, so its next one is #1 again) and rank 1's waits for rank 0's in test_y
    (it paired with the teardown's: everything passed)."""
    for teardown_first in (True, False):
        group = _formed(2)
        for rank in (0, 1):
            group.call_notice(rank, "in", "t.py::test_x", "")
            group.call_notice(rank, "out", "t.py::test_x", "passed")
        group.call_notice(1, "in", "t.py::test_y", "")
        teardown = (0, "barrier", 1, 0, None, ("t.py::test_x", "teardown"))
        call = (1, "barrier", 1, 0, None, ("t.py::test_y", "call"))
        first, second = (teardown, call) if teardown_first else (call, teardown)
        assert group.contribute(*first) == []
        (peers, msg), *rest = group.contribute(*second)
        assert peers == [0] and msg["rewind"] == 0 and not rest, (teardown_first, msg)
        assert (
            msg["reason"]
            == "barrier #1 cannot complete: rank 1 has left test_x's call (passed) and is in test_y's call"
        )
        group.call_notice(0, "in", "t.py::test_y", "")
        done = deliveries(group.contribute(0, "barrier", 1, 0, None, ("t.py::test_y", "call")))
        assert done[0][0]["t"] == "coll" and done[1][0]["t"] == "coll"
    # neither side left the other's test: both fail (a mismatch)
    group = _formed(2)
    assert group.contribute(0, "barrier", 1, 0, None, ("t.py::test_x", "teardown")) == []
    sends = deliveries(group.contribute(1, "barrier", 1, 0, None, ("t.py::test_y", "call")))
    assert "mismatch" in sends[0][0]["reason"] and "mismatch" in sends[1][0]["reason"]


def test_a_collective_entered_in_an_earlier_test_by_its_place_fails_alone():
    """Without any call notice (rank 1's setup failed: it never entered test_x's call), the tests'
    places in the session say which entry is stale: the one of the earlier test."""
    for stale_first in (True, False):
        group = _formed(2)
        stale = (0, "barrier", 1, 0, None, ("t.py::test_x", "setup"), 1)
        fresh = (1, "barrier", 1, 0, None, ("t.py::test_y", "call"), 3)
        first, second = (stale, fresh) if stale_first else (fresh, stale)
        assert group.contribute(*first) == []
        (peers, msg), *rest = group.contribute(*second)
        assert peers == [0] and msg["rewind"] == 0 and not rest
        assert "rank 1 is past test_x" in msg["reason"]
        done = deliveries(group.contribute(0, "barrier", 1, 0, None, ("t.py::test_y", "call"), 3))
        assert done[0][0]["t"] == "coll" and done[1][0]["t"] == "coll"


def test_collectives_outside_a_call_are_not_failed_for_a_call_left():
    for where in (("t.py::test_x", "teardown"), None):
        group = _formed(2)
        group.call_notice(1, "out", "t.py::test_x", "passed")
        assert group.contribute(0, "barrier", 1, 0, None, where) == [] and 1 in group.collectives


def test_ranks_waiting_in_different_collectives_each_name_the_other():
    group = _formed(2)
    group.contribute(0, "barrier", 1, 0, None)
    group.contribute(1, "barrier", 1, 0, None)
    assert group.contribute(0, "barrier", 2, 0, None) == []
    got = deliveries(group.contribute(1, "gather", 3, 0, "x"))
    assert got[0][0]["reason"] == "barrier #2 cannot complete: rank 1 is in all_gather #3"
    assert got[1][0]["reason"] == "all_gather #3 cannot complete: rank 0 is in barrier #2"
    assert not group.collectives


def test_one_collective_entered_in_two_tests_calls_is_a_mismatch():
    group = _formed(2)
    group.contribute(0, "barrier", 1, 0, None, ("t.py::test_x", "call"))
    got = deliveries(group.contribute(1, "barrier", 1, 0, None, ("t.py::test_y", "call")))
    assert (
        "barrier #1 mismatch: rank 1 entered it in test_y's call, another rank in test_x's call" in got[0][0]["reason"]
    )


# Ranks in one test's call: each step a rank enters its next collective (once its last returned),
# skips one (a collective only it entered, whose error it caught) or leaves the call. The oracle:
# a collective fails exactly when the control plane can know it cannot complete - each missing
# rank has left the call, waits in another collective or entered a later one - and completes
# when all entered it.
steps = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["enter", "enter", "leave", "skip"])), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4), steps)
def test_a_collective_fails_exactly_when_it_cannot_complete(world, plan):
    group = _formed(world)
    test = ("t.py::test_p", "call")
    seq = dict.fromkeys(range(world), 0)
    high = dict.fromkeys(range(world), 0)  # the last seq each rank entered
    waiting: dict[int, int] = {}  # rank -> the seq it waits in
    gone: set[int] = set()  # ranks that left the call

    def hopeless(s: int) -> bool:
        outside = [r for r in range(world) if waiting.get(r) != s]
        return bool(outside) and all(r in gone or r in waiting or high[r] > s for r in outside)

    for who, action in plan:
        rank = who % world
        if rank in gone or rank in waiting:
            continue
        if action == "skip":
            seq[rank] += 1
            continue
        if action == "leave":
            gone.add(rank)
            sends = group.call_notice(rank, "out", test[0], "passed")
        else:
            high[rank] = seq[rank] + 1
            seq[rank] += 1
            waiting[rank] = seq[rank]
            sends = group.contribute(rank, "barrier", seq[rank], 0, None, test)
        doomed = {s for s in set(waiting.values()) if hopeless(s)}
        complete = {s for s in set(waiting.values()) if all(waiting.get(r) == s for r in range(world))}
        got = deliveries(sends)
        answered = {(peer, msg["seq"], msg["t"]) for peer, msgs in got.items() for msg in msgs}
        for peer, msgs in got.items():  # a collective no missing rank entered counts for no one
            seq[peer] = next((m["rewind"] for m in msgs if "rewind" in m), seq[peer])
        expected = {(r, s, "error") for r, s in waiting.items() if s in doomed}
        expected |= {(r, s, "coll") for r, s in waiting.items() if s in complete}
        assert answered == expected
        for peer, _, _ in answered:
            del waiting[peer]


def test_the_registry_refuses_extra_nodes_and_taken_node_ranks_and_orders_the_rest():
    reg = NodeRegistry(4, job_id="j")
    reg.register("other", 2, 1, "hx", "10.0.0.8", 9, False)
    assert reg.refusal(2, 1).startswith("--node_rank=2 is already taken by hx")
    reg.lost(reg.nodes[0])
    assert reg.refusal(-1, 5).startswith("extra node: this node's 5 worker(s) would exceed --worker_num=4")
    far = reg.register("far", -1, 1, "h2", "10.0.0.9", 1, False)
    near = reg.register("near", -1, 1, "h1", "10.0.0.2", 2, False)
    sched = reg.register("sched", -1, 1, "h0", "10.0.0.5", 3, True)
    assert reg.refusal(0, 1) == "" and not reg.complete
    pinned = reg.register("pinned", 0, 1, "h3", "10.0.0.7", 4, False)
    assert reg.refusal(-1, 1).startswith("extra node: this node's 1 worker(s) would exceed")
    assert reg.complete
    order = [(node.handle, msg["offset"], msg["node_index"]) for node, msg in reg.assign()]
    assert reg.refusal(-1, 1).startswith("extra node: the job already has all 4 ranks")
    # an explicit node rank first, then the scheduler's host, then by address
    assert order == [("pinned", 0, 0), ("sched", 1, 1), ("near", 2, 2), ("far", 3, 3)]
    assert reg.state == "running" and not reg.done(far) and not reg.done(near) and not reg.done(sched)
    assert reg.lost(far) is False  # done already: its connection may close
    assert reg.done(pinned)


def test_a_node_lost_while_registering_is_forgotten_and_while_running_fails_the_job():
    reg = NodeRegistry(2)
    a = reg.register("a", 1, 1, "h", "10.0.0.1", 1, False)
    assert reg.lost(a) is False and reg.registered() == 0
    assert reg.refusal(1, 1) == ""  # its node rank is free again
    b = reg.register("b", -1, 1, "h", "10.0.0.1", 2, False)
    reg.register("c", -1, 1, "h", "10.0.0.2", 3, False)
    reg.assign()
    assert reg.lost(b) is True


# ---------------------------------------------------------------- one collective at a time (issue 45)
# Each step a rank enters its next collective, the same one again, or one further on - whether or
# not the one it entered last is still pending (a misbehaving rank's flood). The oracle keeps the
# pending collectives as plain sets of ranks and scans all of them (O(n^2)): an entry while in a
# pending collective expels the rank (which fails every pending collective); otherwise a collective
# completes when all entered it, fails at once when a rank is gone, and fails when every rank
# missing from it is gone, in another collective, or past it.
entries = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["next", "next", "again", "jump"])), max_size=60)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4), entries)
def test_a_rank_is_in_one_collective_at_a_time_and_the_rest_agrees_with_a_naive_oracle(world, plan):
    group = _formed(world)
    members: dict[int, set[int]] = {}  # pending seq -> the ranks in it
    seq = dict.fromkeys(range(world), 0)
    high: dict[int, int] = {}
    gone: set[int] = set()

    def blocked(rank: int, s: int) -> bool:
        elsewhere = any(rank in ranks for q, ranks in members.items() if q != s)
        return rank in gone or elsewhere or high.get(rank, s) > s

    for who, how in plan:
        rank = who % world
        if rank in gone:
            continue  # the scheduler dropped its connection
        s = seq[rank] = max(1, seq[rank]) if how == "again" else seq[rank] + (2 if how == "jump" else 1)
        busy = any(rank in ranks for ranks in members.values())
        assert bool(group.entry_refusal(rank, "barrier", s)) == busy
        got = deliveries(group.contribute(rank, "barrier", s, 0, None))
        answered = {(peer, msg["seq"], msg["t"]) for peer, msgs in got.items() for msg in msgs}
        if busy:
            gone.add(rank)
            expected = {(p, q, "error") for q, ranks in members.items() for p in ranks if p != rank}
            members.clear()
        else:
            high[rank] = max(high.get(rank, s), s)
            members.setdefault(s, set()).add(rank)
            if gone or len(members[s]) == world:
                kind = "error" if gone else "coll"
                expected = {(p, s, kind) for p in members.pop(s)}
            else:
                doomed = [q for q, ranks in members.items() if all(blocked(m, q) for m in set(range(world)) - ranks)]
                expected = {(p, q, "error") for q in doomed for p in members[q]}
                for q in doomed:
                    del members[q]
        assert answered == expected
        assert {q: set(c.parts) for q, c in group.collectives.items()} == members
        assert len(group.collectives) <= world


def test_a_flood_of_entries_from_one_rank_expels_it_at_the_second_naming_why():
    group = _formed(2)
    assert group.contribute(1, "gather", 1, 0, "QUJD") == []
    reason = group.entry_refusal(1, "gather", 2)
    assert reason.startswith("rank 1 entered all_gather #2 while still in all_gather #1: a rank is in one collective")
    assert group.entry_refusal(1, "barrier", 1).startswith("rank 1 entered barrier #1 again while still in")
    assert group.entry_refusal(0, "gather", 1) == ""
    assert deliveries(group.expel(1, reason)) == {}  # nobody else was in all_gather #1 yet
    assert not group.collectives and 1 not in group.connected  # its part is let go
    got = deliveries(group.contribute(0, "gather", 1, 0, "QUJD"))
    dropped = f"all_gather #1 cannot complete: rank 1 left the job (its connection was dropped: {reason})"
    assert got[0][0]["reason"] == dropped


base64_text = st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(base64_text, st.text(max_size=12)), min_size=1, max_size=4),
    st.integers(0, 1 << 40),
    st.integers(-8, 8),
)
def test_a_gather_completes_exactly_when_its_result_fits_the_message_limit(parts, seq, slack):
    from pytest_msrun.control import wire

    world = len(parts)
    reply = {"t": "coll", "seq": seq, "data": parts}
    actual = len(wire.encode(reply)) - wire.HEADER.size
    plain = all(p.isascii() and p.isprintable() and '"' not in p and "\\" not in p for p in parts)
    estimate = gather_reply_bytes(seq, sum(json_bytes(p) for p in parts), world)
    assert estimate == actual if plain else estimate >= actual  # exact for base64; never below
    group = RankGroup(world, limit=estimate + slack)
    for rank in range(world):
        group.join(rank)
    sends: list = []
    for rank, part in enumerate(parts):
        sends += group.contribute(rank, "gather", seq, 0, part)
    got = deliveries(sends)
    assert sorted(got) == list(range(world)) and not group.collectives
    for msgs in got.values():
        (msg,) = msgs
        if slack >= 0:
            assert msg == reply
        else:
            assert msg["t"] == "error" and msg["reason"] == (
                f"all_gather #{seq} cannot complete: its result, every rank's object together, is a message of "
                f"{estimate} bytes, over the limit of {estimate + slack} bytes (MSRUN_MAX_MESSAGE_BYTES); gather "
                "less, or raise MSRUN_MAX_MESSAGE_BYTES in msrun's environment"
            )


def test_a_rank_taken_twice_names_the_process_holding_it_and_what_probably_happened():
    group = RankGroup(2)
    holder = process_text({"pid": 4242, "host": "node-a"}, "10.0.0.7:5000")
    assert holder == "pid 4242 on host 'node-a' (from 10.0.0.7:5000)"
    group.join(1, f"{holder}, joined at 12:34:56")
    assert group.refusal(0) == ""
    newcomer = process_text({"pid": True, "host": 5}, "10.0.0.8:6000")  # what a hello gets wrong is left out
    assert newcomer == "the process (from 10.0.0.8:6000)"
    assert group.refusal(1, newcomer) == (
        "rank 1 already joined: pid 4242 on host 'node-a' (from 10.0.0.7:5000), joined at 12:34:56 holds it; "
        "this is the process (from 10.0.0.8:6000). Probably two jobs share one MSRUN_JOB_TOKEN and --master_port, "
        "two processes have RANK_ID=1, or rank 1 was restarted while its first process still runs: end that "
        "process, or give this one its own port and token, or its own RANK_ID"
    )
