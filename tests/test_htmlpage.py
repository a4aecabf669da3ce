"""The HTML session report (pytest_msrun.plugin.reports.htmlpage): pure rendering checks, and real
headless-Chromium loads (the ``browser`` tier) that run its script and prove it requests nothing."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from browser import open_page
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_msrun.plugin.reports.htmlpage import render_page, render_test

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
T0 = 1_700_000_000.0
EVIL = "<script>alert('x')</script>"


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if (tag is None or child.tag == tag) and (cls is None or cls in child.classes()):
                found.append(child)
            found += child.all(tag, cls)
        return found

    def one(self, tag: str | None = None, cls: str | None = None) -> Node:
        (node,) = self.all(tag, cls)
        return node

    def content(self) -> str:
        return "".join(self.text) + "".join(c.content() for c in self.children)


class Tree(HTMLParser):
    """Parses a document into Nodes; raises on any mis-nested or unclosed element."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]
        self.feed(page)
        self.close()
        assert self.stack == [self.root], f"unclosed: {[n.tag for n in self.stack[1:]]}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        assert tag not in VOID and self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].text.append(data)


def span(name: str, start: float, end: float, outcome: str = "passed", **extra: Any) -> dict[str, Any]:
    kind = "phase" if name in ("setup", "call", "teardown") else "collective"
    return {"name": name, "kind": kind, "start": T0 + start, "end": T0 + end, "outcome": outcome, **extra}


def rank(r: int, spans: list[dict[str, Any]], outcome: str = "passed", output: str = "") -> dict[str, Any]:
    return {
        "rank": r,
        "host": "node-a" if r < 2 else "node-b",
        "pid": 4100 + r,
        "log": f"/var/log/msrun/worker_{r}.log",
        "outcome": outcome,
        "output": output or f"rank {r} ready\n",
        "spans": spans,
        "marks": [{"name": "checkpoint", "at": T0 + 0.9, "text": "saved step 10"}] if r == 0 else [],
    }


def sample_session() -> dict[str, Any]:
    passing = {
        "nodeid": "tests/test_allreduce.py::test_sum[4]",
        "outcome": "passed",
        "duration": 2.4,
        "worker_num": 4,
        "mode": "warm",
        "reproduce": "pmsrun --worker_num=4 -m pytest 'tests/test_allreduce.py::test_sum[4]'",
        "t0": T0,
        "t1": T0 + 2.4,
        "ranks": [
            rank(
                r,
                [
                    span("setup", 0.0, 0.3 + 0.05 * r),
                    span("barrier #1", 0.5, 0.7, waited_for=[3]),
                    span("all_reduce #2", 0.9, 1.6 + 0.1 * r),
                    span("call", 0.35 + 0.05 * r, 2.0),
                    span("teardown", 2.05, 2.35),
                ],
            )
            for r in range(4)
        ],
    }
    failing = {
        "nodeid": "tests/test_allreduce.py::test_broadcast[4-<fp16>]",
        "outcome": "failed",
        "duration": 3.1,
        "worker_num": 4,
        "mode": "fresh",
        "message": "AssertionError: rank 1 got tensor([0., 1.]) & expected tensor([1., 1.])",
        "reproduce": "pmsrun --worker_num=4 -m pytest 'tests/test_allreduce.py::test_broadcast[4-<fp16>]'",
        "longrepr": "def test_broadcast(world):\n>       assert got == expected\nE       AssertionError\n" * 20,
        "hang": "ranks 0,2-3 (3): barrier() at test_allreduce.py:41 <- test_broadcast() at test_allreduce.py:40",
        "first_failure": {"rank": 1, "phase": "call", "error": "AssertionError: got tensor([0., 1.])", "at": T0 + 1.2},
        "t0": T0,
        "t1": T0 + 3.1,
        "ranks": [
            rank(
                r,
                [
                    span("setup", 0.0, 0.3),
                    span("call", 0.35, 1.2 if r == 1 else 3.0, "failed"),
                    *([] if r == 1 else [span("barrier #3", 1.0 + 0.1 * r, 3.0, waited_for=[1])]),
                ],
                "failed",
                f"{EVIL}\nTraceback (most recent call last):\n" if r == 1 else "",
            )
            for r in range(4)
        ],
    }
    skipped = {"nodeid": "tests/test_allreduce.py::test_nccl", "outcome": "skipped", "message": "needs 8 GPUs"}
    return {
        "title": "msrun session report",
        "generated": "2024-05-01 12:00:03",
        "command": "pytest -q tests/test_allreduce.py",
        "summary": {
            "tests": 3,
            "outcomes": {"passed": 1, "failed": 1, "skipped": 1},
            "worlds_started": 2,
            "phase_seconds": {"setup": 1.2, "call": 9.5, "teardown": 1.1},
            "duration": 6.4,
        },
        "tests": [passing, failing, skipped],
    }


def sections(page: str) -> dict[str, Node]:
    return {s.attrs["data-nodeid"]: s for s in Tree(page).root.all("section", "msrun-test")}


FAILING = "tests/test_allreduce.py::test_broadcast[4-<fp16>]"


def test_page_references_nothing_outside_itself() -> None:
    page = render_page(sample_session())
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:)?//""", page, re.I)
    assert not re.search(r"url\s*\(|@import|https?:", page, re.I)
    assert "<link" not in page and "<img" not in page and "<iframe" not in page
    tree = Tree(page).root
    assert [s.attrs for s in tree.all("script")] == [{}]  # one inline script, no src
    assert len(tree.all("style")) == 1


def test_everything_from_the_record_is_escaped() -> None:
    session = sample_session()
    test = session["tests"][1]
    test["nodeid"] = f'test_x.py::test["{EVIL}"]'
    test["reproduce"] += f" && echo {EVIL}"
    test["first_failure"]["error"] = EVIL
    test["ranks"][2]["host"] = EVIL
    test["ranks"][2]["spans"][2]["name"] = EVIL  # barrier #3
    session["title"] = session["command"] = EVIL
    page = render_page(session)
    assert page.count("<script") == 1 and "alert('x')</script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    section = sections(page)[test["nodeid"]]  # the attribute round-trips exactly
    assert section.one("pre", "reproduce").content() == test["reproduce"]
    assert EVIL in section.one("g", "first-failure").one("title").content()
    output = [d for d in section.all("details", "rank-output") if d.attrs["data-rank"] == "1"]
    assert EVIL in output[0].one("pre").content()


def test_header_summary_and_filters() -> None:
    tree = Tree(render_page(sample_session())).root
    header = tree.one("header", "page")
    text = " ".join(header.content().split())
    for part in ("1 passed", "1 failed", "1 skipped", "worlds started", "setup 1.20 s", "call 9.50 s"):
        assert part in text
    assert "pytest -q tests/test_allreduce.py" in text and "2024-05-01 12:00:03" in text
    buttons = {b.attrs["data-outcome"]: b.content() for b in tree.all("button", "filter")}
    assert buttons == {"*": "all", "failed": "failed (1)", "skipped": "skipped (1)", "passed": "passed (1)"}
    tests = tree.all("section", "msrun-test")
    assert [s.attrs["data-outcome"] for s in tests] == ["passed", "failed", "skipped"]
    assert not any("hidden" in s.attrs for s in tests)  # everything shows without JS


def test_lanes_first_failure_and_collectives() -> None:
    by_id = sections(render_page(sample_session()))
    failing = by_id[FAILING]
    lanes = failing.one("svg", "timeline").all("g", "lane")
    assert [lane.attrs["data-rank"] for lane in lanes] == ["0", "1", "2", "3"]
    assert [lane.attrs["data-rank"] for lane in lanes if "failing" in lane.classes()] == ["1"]
    assert lanes[1].one("text", "label").content() == "rank 1 (node-a, 4101)"
    marker = failing.one("g", "first-failure")
    assert marker.one("title").content() == "AssertionError: got tensor([0., 1.])"
    line = failing.one("p", "first-failure-text").content()
    assert line == "first failure: rank 1 in call: AssertionError: got tensor([0., 1.])"
    tips = [r.one("title").content() for r in lanes[0].all("rect", "coll")]
    assert tips == ["barrier #3: 2.00 s, waited for rank 1"]
    assert not lanes[1].all("rect", "coll")  # rank 1 never reached the barrier
    assert {r.attrs["class"] for r in lanes[1].all("rect", "phase")} == {"bar phase passed", "bar phase failed"}
    assert "barrier()" in failing.one("pre", "hang").content()
    assert "AssertionError" in failing.one("details", "longrepr").content()
    assert [d.attrs["data-rank"] for d in failing.all("details", "rank-output")] == ["0", "1", "2", "3"]
    assert "/var/log/msrun/worker_2.log" in failing.all("details", "rank-output")[2].content()
    passing = by_id["tests/test_allreduce.py::test_sum[4]"]
    late = [lane.attrs["data-rank"] for lane in passing.all("g", "lane") if lane.all("rect", "late")]
    assert late == ["3"]  # barrier #1 waited for rank 3: its bar stands out
    assert not passing.all("g", "first-failure") and not passing.all(cls="failing")
    axis = [t.one("text").content() for t in passing.all("g", "tick")]
    assert axis[0] == "0 s" and "2 s" in axis
    assert passing.one("g", "mark").one("title").content() == "checkpoint: saved step 10"
    skipped = by_id["tests/test_allreduce.py::test_nccl"]
    assert not skipped.all("svg") and "no ranks launched" in skipped.content()


@pytest.mark.parametrize(
    "session",
    [
        {},
        {"tests": None, "summary": None},
        {"tests": [{"nodeid": "a", "outcome": "weird"}]},
        {"tests": [{"nodeid": "a", "outcome": "failed", "first_failure": {}, "ranks": [{}]}]},
        {"tests": [{"nodeid": "a", "outcome": "passed", "t0": T0, "t1": T0, "ranks": [{"rank": 0, "spans": []}]}]},
        {"tests": [{"nodeid": "a", "outcome": "passed", "t0": T0, "t1": T0 - 5, "ranks": [{"spans": [{}]}]}]},
        {"tests": [{"nodeid": "a", "outcome": "error", "ranks": [{"rank": 0, "spans": [{"end": 3.0}, {"start": 1}]}]}]},
        {
            "tests": [
                {"nodeid": "a", "outcome": "passed", "ranks": [{"rank": 0, "spans": [{"start": "x", "end": None}]}]}
            ]
        },
        {
            "tests": [
                {"nodeid": "a", "outcome": "failed", "first_failure": {"rank": 9, "at": None}, "ranks": [{"rank": 0}]}
            ]
        },
    ],
)
def test_robust_to_missing_and_odd_values(session: dict[str, Any]) -> None:
    tree = Tree(render_page(session)).root
    tests = session.get("tests") or []
    assert len(tree.all("section", "msrun-test")) == len(tests)
    ranks = sum(len(t.get("ranks") or []) for t in tests)
    assert len(tree.all("g", "lane")) == ranks


def test_one_test_alone_as_a_fragment_with_scoped_style() -> None:
    failing = sample_session()["tests"][1]
    fragment = render_test(failing)
    tree = Tree(fragment).root
    (wrapper,) = tree.children
    assert wrapper.tag == "div" and wrapper.classes() == {"msrun"} and not tree.all("script")
    assert wrapper.one("section", "msrun-test").attrs["data-nodeid"] == FAILING
    assert len(wrapper.one("svg", "timeline").all("g", "lane")) == 4
    css = wrapper.one("style").content()
    selectors = [sel.strip() for rule in css.split("}") if rule.strip() for sel in rule.split("{")[0].split(",")]
    assert selectors and all(sel == ".msrun" or sel.startswith(".msrun ") for sel in selectors)


def test_collective_tooltip_names_the_awaited_ranks() -> None:
    coll = {"name": "all_gather #7", "kind": "collective", "start": T0, "end": T0 + 0.25, "waited_for": [5, 2, 0, 1]}
    test = {"nodeid": "t", "outcome": "failed", "ranks": [{"rank": 3, "spans": [coll]}]}
    rect = Tree(render_page({"tests": [test]})).root.one("rect", "coll")
    assert rect.one("title").content() == "all_gather #7: 250 ms, waited for rank 0-2,5"


def test_window_derived_from_spans_when_t0_t1_are_missing() -> None:
    session = sample_session()
    failing = session["tests"][1]
    del failing["t0"], failing["t1"]
    section = sections(render_page(session))[FAILING]
    axis = [t.one("text").content() for t in section.all("g", "tick")]
    assert axis[0] == "0 s" and "3 s" in axis  # spans run from T0 to T0 + 3.0
    setup = section.all("g", "lane")[0].all("rect", "phase")[0]
    assert float(setup.attrs["x"]) == 200.0  # the earliest span starts at the lane's left edge


def test_1024_ranks_keep_the_svg_bounded() -> None:
    session = sample_session()
    failing = session["tests"][1]
    failing["ranks"] = [copy.deepcopy(failing["ranks"][r % 4]) | {"rank": r} for r in range(1024)]
    failing["first_failure"]["rank"] = 777
    page = render_page(session)
    svg = sections(page)[FAILING].one("svg", "timeline")
    lanes = svg.all("g", "lane")
    assert len(lanes) == 1024
    height = float(svg.attrs["viewbox"].split()[3])
    assert height < 1500
    labels = svg.all("text", "label")
    assert 64 <= len(labels) <= 200  # every k-th lane is labelled, and the failing one
    assert any(label.content().startswith("rank 777 ") for label in labels)
    assert len(page) < 4_000_000


finite = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
maybe_time = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False), finite.map(lambda x: T0 + x / 1e6))
span_lists = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.text(max_size=12),
            "kind": st.sampled_from(["phase", "collective", "other"]),
            "start": maybe_time,
            "end": maybe_time,
            "outcome": st.sampled_from(["passed", "failed", "skipped", "<b>", ""]),
            "waited_for": st.lists(st.integers(-3, 40), max_size=5),
        },
    ),
    max_size=6,
)
rank_lists = st.lists(
    st.builds(lambda r, s, h: {"rank": r, "spans": s, "host": h}, st.integers(0, 64), span_lists, st.text(max_size=8)),
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ranks=rank_lists, t0=maybe_time, t1=maybe_time, ff_rank=st.none() | st.integers(0, 64))
def test_any_spans_render_a_well_formed_page(ranks: list[dict[str, Any]], t0: Any, t1: Any, ff_rank: Any) -> None:
    first = None if ff_rank is None else {"rank": ff_rank, "phase": "call", "error": "<boom>", "at": t1}
    test = {"nodeid": "t::<x>", "outcome": "failed", "t0": t0, "t1": t1, "ranks": ranks, "first_failure": first}
    page = render_page({"tests": [test]})
    tree = Tree(page).root
    assert len(tree.all("g", "lane")) == len(ranks) == len(re.findall(r'class="lane[ "]', page))
    assert page.count("<script") == 1
    marked = ff_rank in [r["rank"] for r in ranks]
    assert len(tree.all(cls="failing")) == len(tree.all("g", "first-failure")) == marked
    for rect in tree.all("rect"):
        assert 0 <= float(rect.attrs["x"]) <= 1000 and float(rect.attrs["width"]) >= 0


@pytest.mark.browser
def test_network_detection_sees_a_request(tmp_path: Path) -> None:
    page = tmp_path / "remote.html"
    page.write_text('<!DOCTYPE html><html><body><img src="http://example.invalid/x.png"></body></html>')
    opened = open_page(page, tmp_path / "chromium")
    assert opened.requests >= 1, opened.lines
    assert any("example.invalid" in line for line in opened.lines)


@pytest.mark.browser
def test_report_in_a_real_browser(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render_page(sample_session()), encoding="utf-8")
    shot = tmp_path / "report.png"
    opened = open_page(page, tmp_path / "chromium", screenshot=shot)
    assert opened.requests == 0, f"the page made network requests: {opened.lines}"
    tree = Tree(opened.dom).root
    assert tree.one("body").attrs.get("data-ready") == "1"  # the filter script ran
    by_id = {s.attrs["data-nodeid"]: s for s in tree.all("section", "msrun-test")}
    assert set(by_id) == {"tests/test_allreduce.py::test_sum[4]", FAILING, "tests/test_allreduce.py::test_nccl"}
    failing = by_id[FAILING]
    assert failing.one("p", "first-failure-text").content().startswith("first failure: rank 1 in call")
    assert len(failing.one("svg", "timeline").all("g", "lane")) == 4
    assert [b.attrs["aria-pressed"] for b in tree.all("button", "filter")] == ["true"] * 4
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@pytest.mark.browser
def test_filter_buttons_hide_and_show_sections(tmp_path: Path) -> None:
    click = "<script>document.querySelector('button.filter[data-outcome=\"failed\"]').click()</script>"
    page = tmp_path / "report.html"
    page.write_text(render_page(sample_session()).replace("</body>", click + "</body>"), encoding="utf-8")
    opened = open_page(page, tmp_path / "chromium")
    tree = Tree(opened.dom).root
    hidden = {s.attrs["data-outcome"]: "hidden" in s.attrs for s in tree.all("section", "msrun-test")}
    assert hidden == {"passed": False, "failed": True, "skipped": False}
    pressed = {b.attrs["data-outcome"]: b.attrs["aria-pressed"] for b in tree.all("button", "filter")}
    assert pressed == {"*": "true", "failed": "false", "skipped": "true", "passed": "true"}
