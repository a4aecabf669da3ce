"""``--msrun-report=FILE.html``: one self-contained page of the marked tests, checked in a real
browser (headless Chromium), and ``--msrun-trace=DIR``.

``MSRUN_SCREENSHOT=docs/html-report.png python -m pytest tests/test_html_report.py -k browser``
refreshes the README's screenshot from this very test.
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
from browser import open_page

REPO = Path(__file__).resolve().parents[1]

TESTS = """
import pytest

@pytest.mark.msrun(worker_num=4)
def test_all_ranks_agree(rank, msrun):
    msrun.barrier()
    assert msrun.all_gather(rank) == [0, 1, 2, 3]
    print(f"rank {rank} agrees", flush=True)

@pytest.mark.msrun(worker_num=4)
def test_rank_two_disagrees(rank, msrun):
    msrun.barrier()
    value = msrun.broadcast(41 if rank == 0 else None, src=0)
    if rank == 2:
        print("rank 2 is about to fail <script>alert(1)</script>", flush=True)
        assert value == 42, "rank 2 expected the answer"
"""


class _Sections(html.parser.HTMLParser):
    """The page's test sections and their lanes, as the DOM has them."""

    def __init__(self) -> None:
        super().__init__()
        self.tests: list[dict[str, str]] = []
        self.lanes: list[list[str]] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "section" and "msrun-test" in classes:
            self.tests.append({k: v or "" for k, v in a.items()})
            self.lanes.append([])
        elif tag == "g" and "lane" in classes and self.lanes:
            self.lanes[-1].append(a.get("data-rank") or "")
        elif tag == "script" and a.get("src"):
            self.scripts += 1


def _session(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, Path]:
    pytester.makepyfile(test_agree=TESTS)
    page = pytester.path / "report.html"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--msrun-report={page}", *args)
    result.assert_outcomes(passed=1, failed=1)
    assert page.exists(), result.stdout.str()
    result.stdout.fnmatch_lines([f"*msrun: HTML report of 2 marked test(s): {page}*"])
    return result, page


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_the_page_has_every_test_rank_and_the_failure(pytester: pytest.Pytester, worlds: str) -> None:
    _, page = _session(pytester, f"--msrun-worlds={worlds}")
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "nothing fetched from the network"
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    parsed = _Sections()
    parsed.feed(text)
    assert [t["data-nodeid"] for t in parsed.tests] == [
        "test_agree.py::test_all_ranks_agree",
        "test_agree.py::test_rank_two_disagrees",
    ]
    assert [t["data-outcome"] for t in parsed.tests] == ["passed", "failed"]
    assert parsed.lanes == [["0", "1", "2", "3"]] * 2 and parsed.scripts == 0
    assert "first failure: rank 2 in call" in text and "rank 2 expected the answer" in text
    for name in ("barrier", "gather", "bcast"):  # numbered in the world's order (warm worlds go on counting)
        assert re.search(rf"\b{name} #\d+", text), name
    assert "pmsrun" in text or "python -m pytest_msrun" in text, "the reproduce command"


@pytest.mark.browser
def test_the_page_in_a_real_browser(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, page = _session(pytester)
    out = tmp_path_factory.mktemp("browser")
    shot = out / "report.png"
    seen = open_page(page, out, screenshot=shot)
    assert seen.requests == 0, f"the page made network requests: {seen.lines}"
    dom = seen.dom
    assert 'data-ready="1"' in dom, "the page's script ran"
    parsed = _Sections()
    parsed.feed(dom)
    assert [t["data-outcome"] for t in parsed.tests] == ["passed", "failed"]
    assert parsed.lanes == [["0", "1", "2", "3"]] * 2
    assert "test_all_ranks_agree" in dom and "test_rank_two_disagrees" in dom
    assert "first failure: rank 2 in call" in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    target = os.environ.get("MSRUN_SCREENSHOT")
    if target:  # refresh the README's screenshot from this run
        shutil.copyfile(shot, REPO / target)


TWO_RANKS = """

@pytest.mark.msrun(worker_num=2)
def test_two_ranks(rank, msrun):
    msrun.barrier()
"""


def test_trace_dir_keeps_each_jobs_trace(pytester: pytest.Pytester) -> None:
    # Each job's trace, named after its first test: here one world per shape (the tests of a shape
    # share it, each in processes of its own).
    pytester.makepyfile(test_agree=TESTS + TWO_RANKS)
    traces = pytester.path / "traces"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--msrun-trace={traces}", "--msrun-worlds=fresh")
    result.assert_outcomes(passed=2, failed=1)
    files = sorted(traces.glob("*.trace.json"))
    assert [f.name.split("-msrun-")[0] for f in files] == ["test_all_ranks_agree", "test_two_ranks"]
    for path, ranks in zip(files, (4, 2)):
        events = json.loads(path.read_text())["traceEvents"]
        lanes = {e["pid"] for e in events if e["name"] == "process_name" and e["pid"] >= 1000}
        assert len(lanes) == ranks


def test_report_values_are_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_agree=TESTS)
    result = pytester.runpytest_subprocess("--msrun-report=report.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--msrun-report=report.txt: name an HTML file*"])
    result = pytester.runpytest_subprocess("--msrun-report=all", "--collect-only")
    assert result.ret == 0, "first/all still set the failure detail, as before"


def test_pytest_html_rows_carry_each_marked_tests_timeline(pytester: pytest.Pytester) -> None:
    """With pytest-html, each marked test's row has its timeline (an extra), its page stays whole."""
    pytest.importorskip("pytest_html")
    pytester.makepyfile(test_agree=TESTS)
    page = pytester.path / "pytest-html.html"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--html={page}", "--self-contained-html")
    result.assert_outcomes(passed=1, failed=1)
    text = page.read_text()
    # pytest-html keeps its rows as JSON in the page: our fragment is in each marked test's extras
    assert text.count("msrun-test") >= 2 and "first failure: rank 2 in call" in text


class _Links(html.parser.HTMLParser):
    """Every link of the page (by class), the environment block's facts, the search box."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str]] = []
        self.env: dict[str, str] = {}
        self.search = False
        self._in_env = False
        self._dt = ""
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "a":
            self.links.append(a)
        elif tag == "details" and "environment" in a.get("class", "").split():
            self._in_env = True
        elif tag == "input" and a.get("id") == "msrun-search" and a.get("type") == "search":
            self.search = True
        self._text = []

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        text = "".join(self._text).strip()
        if self._in_env and tag == "dt":
            self._dt = text
        elif self._in_env and tag == "dd":
            self.env[self._dt] = text
        elif tag == "details":
            self._in_env = False


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_the_page_links_logs_and_traces_and_shows_the_environment(pytester: pytest.Pytester, worlds: str) -> None:
    """Each test links its ranks' logs and its job's trace relative to the page: the page's folder
    can be moved and opened from disk. The environment and a search box are on the page."""
    pytester.makepyfile(test_agree=TESTS)
    (pytester.path / "out").mkdir()
    args = ["-p", "no:cacheprovider", "-p", "randomly", "--randomly-seed=1234", f"--msrun-worlds={worlds}"]
    result = pytester.runpytest_subprocess(*args, "--msrun-report=out/report.html")
    result.assert_outcomes(passed=1, failed=1)
    moved = pytester.path / "moved"
    shutil.move(pytester.path / "out", moved)
    page = moved / "report.html"
    parsed = _Links()
    parsed.feed(page.read_text())
    logs = [a for a in parsed.links if a.get("class") == "log-link"]
    traces = [a for a in parsed.links if a.get("class") == "trace-link"]
    assert sorted(a["data-rank"] for a in logs) == sorted("01230123"), logs
    assert len(traces) == 2, parsed.links
    for link in logs + traces:
        href = link["href"]
        assert not href.startswith("/") and ":" not in href, href
        assert (page.parent / href).is_file(), f"{href} is not beside the moved page"
    names = set()
    for link in traces:  # each links the trace its test is in
        events = json.loads((page.parent / link["href"]).read_text())["traceEvents"]
        names |= {ev["args"]["nodeid"].split("::")[-1] for ev in events if ev["pid"] == 3 and ev["ph"] != "M"}
    assert names == {"test_all_ranks_agree", "test_rank_two_disagrees"}
    agreeing = [a for a in logs if a["href"].split("/")[-2].endswith("test_all_ranks_agree")]
    assert len(agreeing) == 4 and "PASSED" in (page.parent / agreeing[0]["href"]).read_text() or agreeing
    env = parsed.env
    import platform

    assert platform.python_version() in env["python"] and env["pytest"] == pytest.__version__
    assert env["pytest-msrun"] == __import__("pytest_msrun").__version__
    assert "pytest-randomly" in env["plugins"] and env["random seed"].startswith("1234")
    assert "--msrun-report=out/report.html" in env["command"] and env["hostname"] == socket.gethostname()
    assert parsed.search and 'data-search="test_agree.py::test_rank_two_disagrees failed' in page.read_text()


@pytest.mark.browser
def test_typing_in_the_search_box_hides_the_tests_that_do_not_match(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from browser import type_into

    _, page = _session(pytester)
    probe = (
        'JSON.stringify([...document.querySelectorAll("section.msrun-test")].map(s => [s.dataset.nodeid, s.hidden])'
        '.concat([[document.getElementById("msrun-shown").textContent]]))'
    )
    out = tmp_path_factory.mktemp("browser")
    seen, requests = type_into(page, out, "#msrun-search", "expected THE answer", probe)
    # (the browser's own update checks may reach the proxy; --dump-dom above checks the page makes none)
    assert [r for r in requests if "gvt1.com" not in r and "google" not in r] == [], "the page made requests"
    assert json.loads(str(seen)) == [
        ["test_agree.py::test_all_ranks_agree", True],
        ["test_agree.py::test_rank_two_disagrees", False],
        ["1 of 2 shown"],
    ]
    seen, _ = type_into(page, out, "#msrun-search", "passed", probe)
    assert json.loads(str(seen))[-1] == ["1 of 2 shown"] and json.loads(str(seen))[0][1] is False
