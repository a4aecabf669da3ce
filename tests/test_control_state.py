"""The control plane's state machines without sockets: the ranks' group and the node registry."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.control.group import RankGroup
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
    arrivals = [(rank, seq) for rank in range(world) for seq in range(1, count + 1)]
    rnd.shuffle(arrivals)
    got: dict[int, list[dict]] = {rank: [] for rank in range(world)}
    for rank, seq in arrivals:
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
            {"t": "error", "seq": 1, "reason": "rank 2 left the job (its process killed by SIGSEGV (exit status 139))"},
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
    assert sends == [([0], {"t": "error", "seq": 1, "reason": "rank 1 left the test (finished its test)"})]
    snap = group.snapshot()
    assert snap["ready"] and snap["collectives"] == [] and snap["last"] == {"0": "barrier #1"}


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
