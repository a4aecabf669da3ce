"""What a report shows of a rank's log and stacks (plugin/reports/excerpts.py), against small oracles."""

from __future__ import annotations

import inspect
import os
import sysconfig

from hypothesis import given
from hypothesis import strategies as st

import pytest_msrun
from pytest_msrun.plugin.links import Channel
from pytest_msrun.plugin.rank import serve
from pytest_msrun.plugin.reports.excerpts import stack_excerpt, trim, without_session_header
from pytest_msrun.plugin.reports.hang import idle

PACKAGE = os.path.dirname(os.path.abspath(pytest_msrun.__file__))
STDLIB = sysconfig.get_paths()["stdlib"]
SITE = os.path.join(STDLIB, "site-packages")
HEADER = [
    "============================= test session starts ==============================",
    "platform linux -- Python 3.11.7, pytest-9.0.3, pluggy-1.6.0",
    "rootdir: /tmp/x",
    "plugins: msrun-0.2.0, xdist-3.8.0",
    "collected 2 items",
]

# ---------------------------------------------------------------- the session header
prose = st.text(st.characters(whitelist_categories=("L", "N", "Zs")), max_size=20).filter(
    lambda s: not s.startswith("collected")
)


@given(st.lists(st.one_of(prose.map(lambda s: [s]), st.just(HEADER)), max_size=12))
def test_only_the_session_headers_go(chunks: list[list[str]]) -> None:
    text = "\n".join(line for chunk in chunks for line in chunk)
    kept = [line for chunk in chunks if chunk is not HEADER for line in chunk]
    while kept and not kept[0].strip():
        kept.pop(0)
    assert without_session_header(text) == "\n".join(kept)


def test_a_header_whose_collection_never_ended_goes_to_the_end() -> None:
    assert without_session_header("\n".join(["before", *HEADER[:3]])) == "before"


# ---------------------------------------------------------------- the frames that matter
KINDS = {
    "user": ("/home/you/proj/test_x.py", "test_x"),
    "lib": (os.path.join(SITE, "torch", "distributed.py"), "wait"),
    "stdlib": (os.path.join(STDLIB, "threading.py"), "wait"),
    "api": (os.path.join(PACKAGE, "plugin", "fixtures.py"), "barrier"),
    "internal": (os.path.join(PACKAGE, "control", "wire.py"), "recv"),
    "harness": (os.path.join(SITE, "_pytest", "runner.py"), "call_and_report"),
    "pluggy": (os.path.join(SITE, "pluggy", "_callers.py"), "_multicall"),
    "serve": (serve.__file__, "_run"),
    "runpy": ("<frozen runpy>", "_run_code"),
}
CODE = ("user", "lib")


def frames_of(kinds: list[str]) -> list[tuple[str, int, str]]:
    return [(KINDS[k][0], i + 1, KINDS[k][1]) for i, k in enumerate(kinds)]


@given(
    st.lists(st.sampled_from(["internal", "api", "stdlib"]), max_size=4),
    st.lists(st.sampled_from(["user", "lib", "stdlib", "api", "internal", "harness"]), max_size=6),
    st.lists(st.sampled_from(["harness", "pluggy", "serve", "runpy"]), max_size=10),
)
def test_the_kept_frames_are_the_tests_code_and_the_call_it_waits_in(
    inner: list[str], code: list[str], outer: list[str]
) -> None:
    kinds = inner + code + outer  # innermost first, as faulthandler lists them
    frames = frames_of(kinds)
    kept, hidden = trim(frames)
    kept_frames = [f for f, _ in kept]
    assert len(kept) + sum(n for _, n in kept) + hidden == len(frames)  # every frame kept or counted
    assert kept_frames == [f for f in frames if f in kept_frames]  # in order
    code_at = [i for i, k in enumerate(kinds) if k in CODE]
    if code_at:
        last = code_at[-1]
        # the oracle: every frame of the test's code up to the outermost one, no harness frame, and
        # of each run of msrun frames only the outermost (the call the code made)
        want = [
            f
            for i, (f, k) in enumerate(zip(frames, kinds))
            if i <= last
            and k not in ("harness", "pluggy", "serve", "runpy")
            and not (k in ("api", "internal") and kinds[i + 1] in ("api", "internal"))
        ]
        assert kept_frames == want


def test_an_idle_rank_is_said_in_words() -> None:
    # where the code is, read from it (a module moved or renamed must not leave the words behind)
    receive = (inspect.getsourcefile(Channel.receive), 335, "receive")
    teardown = (inspect.getsourcefile(serve.WorldServer.pytest_runtest_teardown), 508, "pytest_runtest_teardown")
    loop = (inspect.getsourcefile(serve.WorldServer.pytest_runtestloop), 330, "pytest_runtestloop")
    outer = frames_of(["pluggy", "harness", "runpy"])
    assert "before its teardown" in (idle([receive, teardown, *outer]) or "")
    assert "next one" in (idle([receive, loop, *outer]) or "")
    assert idle(frames_of(["user", "pluggy"])) is None
    dump = "Current thread 0x00007f (most recent call first):\n" + "".join(
        f'  File "{p}", line {n} in {f}\n' for p, n, f in [receive, teardown, *outer]
    )
    text = stack_excerpt(dump, 0x7F, "/x/pytest_rank1.stacks")
    assert text.startswith("finished the test's call; waits for the other ranks before its teardown")
    assert "5 frames hidden" in text and "/x/pytest_rank1.stacks" in text and "serve.py" not in text


def test_a_dump_it_cannot_read_is_shown_as_it_is() -> None:
    assert stack_excerpt("Fatal Python error: Aborted\n", None) == "Fatal Python error: Aborted"
