"""The compatibility matrix's cases: the most-downloaded pytest plugins, each with a test module that
uses it, run once unmarked and once with every test marked ``msrun(worker_num=2)``.

Source of the choice: hugovk/top-pypi-packages, ``top-pypi-packages-30-days.min.json`` of 2026-04-01
(30-day downloads from PyPI's BigQuery data): the 34 most downloaded distributions that install a
pytest plugin (a ``pytest11`` entry point), in that order, leaving out pytest-runner (no plugin) and
those that need what CI cannot give them - a browser download (pytest-playwright), a database server
(pytest-postgresql), recorded network traffic (pytest-recording) - and pytest-forked (1.7.5 fails
every forked test under pytest 9.2, marked or not); then four further down that keep files or
decide on other tests' results: pytest-retry, pytest-snapshot, pytest-dependency, pytest-regressions.
``rank`` is the distribution's place among all of PyPI's.

A case is equivalent when both runs end with the same exit status, the same outcome counts, the same
assertion lines of each failure, and the same facts of the plugin's own artifacts (``facts``): what a
user would compare. Where a plugin cannot be (fully) supported, ``message`` is what msrun says of it
at session start, and the case checks that message too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARK = "import pytest\npytestmark = pytest.mark.msrun(worker_num=2)"


@dataclass(frozen=True)
class Case:
    dist: str  # the distribution on PyPI
    rank: int  # its place in the downloads list (0: not in its top 5000)
    plugin: str  # what ``-p`` loads (its pytest11 entry point's module)
    test: str  # the test module (``MARK`` is appended to it for the marked run)
    args: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)  # more files of the run's directory
    facts: Callable[[Path], Any] | None = None  # what the plugin left in the run's directory
    runs: int = 1  # how many times the session runs (state carried from one to the next)
    needs: tuple[str, ...] = ()  # modules the test imports besides the plugin (and their distributions: .ci/compat.txt)
    uses: str = ""  # what the test exercises (the docs' table)
    # where a plugin is not (fully) supported: the start of what msrun says at session start, and
    # whether the runs are still equivalent (with the args the message asks for)
    message: str = ""
    equivalent: bool = True
    same_failure_lines: bool = True  # whether a failure's ``E`` lines are compared
    note: str = ""  # what differs by design (the docs' table)


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _json_report(d: Path) -> Any:
    report = _json(d / "report.json")
    tests = sorted((t["nodeid"], t["outcome"], "stdout" in t.get("call", {})) for t in report["tests"])
    return report["summary"], tests


def _ctrf(d: Path) -> Any:
    results = _json(d / "ctrf.json")["results"]
    summary = {k: v for k, v in results["summary"].items() if k not in ("start", "stop", "duration")}
    return summary, sorted((t["name"], t["status"]) for t in results["tests"])


def _allure(d: Path) -> Any:
    found = [_json(p) for p in sorted((d / "allure").glob("*-result.json"))]
    return sorted((r["fullName"], r.get("status"), r.get("historyId")) for r in found)


def _snapshots(d: Path) -> Any:
    return sorted((p.relative_to(d).as_posix(), p.read_text()) for p in (d / "__snapshots__").rglob("*.ambr"))


def _snapshot_dir(d: Path) -> Any:
    return sorted((p.relative_to(d).as_posix(), p.read_text()) for p in (d / "snaps").rglob("*") if p.is_file())


def _regressions(d: Path) -> Any:
    return sorted((p.relative_to(d).as_posix(), p.read_text()) for p in (d / "test_case").rglob("*.yml"))


def _coverage(d: Path) -> Any:
    files = _json(d / "cov.json")["files"]
    return {name: sorted(data["executed_lines"]) for name, data in files.items() if name.endswith("covered.py")}


def _html(d: Path) -> Any:
    text = (d / "report.html").read_text(encoding="utf-8")
    return sorted(re.findall(r"&#34;result&#34;: &#34;(\w+)&#34;", text))


def _benchmarks(d: Path) -> Any:
    # a marked test's measurements are a row per rank (``test_bench [rank 1]``): the same test's
    return sorted({b["fullname"].split(" [rank ")[0] for b in _json(d / "bench.json")["benchmarks"]})


COVERED = "def f(x):\n    if x:\n        return 2\n    return 3\n"
FAILS_ONCE = """
{decorator}
def test_fails_once(request):
    mark = request.config.rootpath / ("ran-" + os.environ.get("RANK", "0"))  # each rank's own first run
    first = not mark.exists()
    mark.touch()
    assert not first
"""
PASS_FAIL = """
def test_passes():
    assert [1, 2] == [1, 2]

def test_fails():
    assert [1, 2, 3] == [1, 2, 4]
"""

CASES = [
    Case("anyio", 28, "anyio.pytest_plugin", """
import anyio
import pytest

@pytest.mark.anyio
async def test_sleeps(anyio_backend):
    await anyio.sleep(0)
    assert anyio_backend == "asyncio"
""", uses="`@pytest.mark.anyio` async test"),
    Case("pytest-cov", 175, "pytest_cov.plugin", """
import covered

def test_covers():
    assert covered.f(1) == 2
""", args=("--cov=covered", "--cov-report=json:cov.json"), files={"covered.py": COVERED},
         facts=_coverage, uses="lines measured (`--cov-report=json`)"),
    Case("pytest-asyncio", 195, "pytest_asyncio.plugin", """
import asyncio
import pytest

@pytest.mark.asyncio
async def test_sleeps():
    await asyncio.sleep(0)

@pytest.mark.asyncio
async def test_fails():
    await asyncio.sleep(0)
    assert {"a": 1} == {"a": 2}
""", uses="`@pytest.mark.asyncio` tests"),
    Case("pytest-xdist", 267, "xdist.plugin", "import pytest\n" + PASS_FAIL, args=("-n", "2"), uses="`-n 2`"),
    Case("pytest-mock", 302, "pytest_mock", """
import os

def test_patches(mocker):
    mocker.patch("os.getcwd", return_value="/nowhere")
    assert os.getcwd() == "/nowhere"

def test_spy_fails(mocker):
    spy = mocker.spy(os.path, "join")
    os.path.join("a", "b")
    spy.assert_called_once_with("a", "c")
""", uses="`mocker.patch`, `mocker.spy`"),
    Case("pytest-json-ctrf", 381, "ctrf.main", "import pytest\n" + PASS_FAIL, args=("--ctrf", "ctrf.json"), facts=_ctrf,
         uses="`--ctrf` report"),
    Case("pytest-timeout", 453, "pytest_timeout", """
import time
import pytest

@pytest.mark.timeout(2)
def test_sleeps_too_long():
    time.sleep(30)

def test_quick():
    pass
""", args=("--timeout=60",), uses="`@pytest.mark.timeout` over `--timeout`", same_failure_lines=False,
         note="a marked test's timeout reads as msrun's: where each rank was, and its stack"),
    Case("pytest-rerunfailures", 637, "pytest_rerunfailures", "import os\n" + FAILS_ONCE.format(decorator=""),
         args=("--reruns", "1"), uses="`--reruns 1`"),
    Case("hypothesis", 671, "_hypothesis_pytestplugin", """
from hypothesis import given, settings, strategies as st

@settings(database=None)
@given(st.integers())
def test_holds(x):
    assert x + 0 == x

@settings(database=None, derandomize=True)
@given(st.integers())
def test_falsified(x):
    assert x < 10
""", needs=("hypothesis",), uses="`@given` passing and falsified"),
    Case("pytest-metadata", 672, "pytest_metadata.plugin", """
def test_metadata(metadata):
    assert metadata["team"] == "msrun"
""", args=("--metadata", "team", "msrun"), uses="`metadata` fixture, `--metadata`"),
    Case("pytest-env", 745, "pytest_env.plugin", """
import os

def test_env():
    assert os.environ["FROM_INI"] == "yes"
""", files={"pytest.ini": "[pytest]\nenv =\n    FROM_INI=yes\n"}, uses="`env` in pytest.ini"),
    Case("requests-mock", 794, "requests_mock.contrib._pytest_plugin", """
import requests

def test_mocked(requests_mock):
    requests_mock.get("http://service.invalid/", text="hi")
    assert requests.get("http://service.invalid/").text == "hi"
""", needs=("requests",), uses="`requests_mock` fixture"),
    Case("pytest-html", 814, "pytest_html.plugin", "import pytest\n" + PASS_FAIL,
         args=("--html=report.html", "--self-contained-html"), facts=_html, uses="`--html` report"),
    Case("time-machine", 818, "time_machine", """
import datetime as dt

def test_travels(time_machine):
    time_machine.move_to(dt.datetime(2000, 1, 2, tzinfo=dt.timezone.utc))
    assert dt.date.today().year == 2000
""", uses="`time_machine` fixture"),
    Case("pytest-django", 919, "pytest_django.plugin", """
from django.conf import settings as django_settings

def test_settings(settings):
    settings.FEATURE = "on"
    assert django_settings.FEATURE == "on"
""", args=("--ds=proj_settings",), files={"proj_settings.py": "SECRET_KEY = 'x'\nINSTALLED_APPS = []\n",
                                             "pytest.ini": "[pytest]\npythonpath = .\n"},
         needs=("django",), uses="`settings` fixture, `--ds`"),
    Case("pytest-benchmark", 1062, "pytest_benchmark.plugin", """
def test_bench(benchmark):
    assert benchmark(sum, [1, 2]) == 3
""", args=("--benchmark-json=bench.json", "--benchmark-min-rounds=1", "--benchmark-max-time=0.01"),
         facts=_benchmarks, uses="`benchmark` fixture, `--benchmark-json` (a row per rank)"),
    Case("pytest-split", 1141, "pytest_split.plugin", "import pytest\n" + PASS_FAIL,
         args=("--splits", "2", "--group", "1"),
         uses="`--splits 2 --group 1`"),
    Case("pytest-socket", 1241, "pytest_socket", """
import socket
import pytest
from pytest_socket import SocketBlockedError

def test_blocked():
    with pytest.raises(SocketBlockedError):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)

@pytest.mark.enable_socket
def test_allowed():
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
""", args=("--disable-socket",), uses="`--disable-socket`, `enable_socket`"),
    Case("pytest-repeat", 1274, "pytest_repeat", "import pytest\n" + PASS_FAIL, args=("--count", "2"),
         uses="`--count 2`"),
    Case("pytest-json-report", 1281, "pytest_jsonreport.plugin", """
def test_prints():
    print("out")

def test_fails():
    assert 1 == 2
""", args=("--json-report", "--json-report-file=report.json"), facts=_json_report, uses="`--json-report` file"),
    Case("respx", 1305, "respx.plugin", """
import httpx

def test_mocked(respx_mock):
    respx_mock.get("http://service.invalid/").respond(200, text="hi")
    assert httpx.get("http://service.invalid/").text == "hi"
""", needs=("httpx",), uses="`respx_mock` fixture"),
    Case("syrupy", 1323, "syrupy", """
def test_snapshot(snapshot):
    assert {"a": 1, "b": [2, 3]} == snapshot
""", args=("--snapshot-update", "--snapshot-disable-unused"), runs=2, facts=_snapshots,
         uses="`snapshot` written, then checked", message="syrupy: snapshots that marked tests assert"),
    Case("pytest-unordered", 1372, "pytest_unordered", """
from pytest_unordered import unordered

def test_any_order():
    assert [1, 2, 3] == unordered([3, 1, 2])
""", uses="`unordered()`"),
    Case("pytest-base-url", 1453, "pytest_base_url.plugin", """
def test_url(base_url):
    assert base_url == "http://service.invalid"
""", args=("--base-url", "http://service.invalid"), uses="`base_url`"),
    Case("pytest-custom-exit-code", 1594, "pytest_custom_exit_code", "import pytest\n" + PASS_FAIL,
         args=("--suppress-tests-failed-exit-code",), uses="`--suppress-tests-failed-exit-code`"),
    Case("pytest-icdiff", 1645, "pytest_icdiff", "import pytest\n" + PASS_FAIL, uses="assertion diffs"),
    Case("pytest-instafail", 1678, "pytest_instafail", "import pytest\n" + PASS_FAIL, args=("--instafail",),
         uses="`--instafail`"),
    Case("allure-pytest", 1679, "allure_pytest.plugin", "import pytest\n" + PASS_FAIL, args=("--alluredir=allure",),
         facts=_allure, uses="`--alluredir` results"),
    Case("pytest-httpx", 1690, "pytest_httpx", """
import httpx

def test_mocked(httpx_mock):
    httpx_mock.add_response(text="hi")
    assert httpx.get("http://service.invalid/").text == "hi"
""", uses="`httpx_mock` fixture"),
    Case("pytest-randomly", 1696, "pytest_randomly", """
import random

def test_seeded():
    assert 0 <= random.random() < 1
""", uses="random order, seeds"),
    Case("pytest-sugar", 1702, "pytest_sugar", "import pytest\n" + PASS_FAIL, uses="its progress output"),
    Case("pytest-order", 1899, "pytest_order.plugin", """
import pytest

@pytest.mark.order(2)
def test_second():
    pass

@pytest.mark.order(1)
def test_first():
    pass
""", args=("-v",), uses="`@pytest.mark.order`"),
    Case("flaky", 1943, "flaky.flaky_pytest_plugin",
         "import os\nfrom flaky import flaky\n" + FAILS_ONCE.format(decorator="@flaky(max_runs=2)"),
         uses="`@flaky(max_runs=2)`", message="flaky's reruns do not apply to marked tests", equivalent=False),
    Case("pytest-lazy-fixtures", 1957, "pytest_lazy_fixtures.plugin", """
import pytest
from pytest_lazy_fixtures import lf

@pytest.fixture
def one():
    return 1

@pytest.mark.parametrize("value", [lf("one")])
def test_lazy(value):
    assert value == 1
""", uses="`lf()` in `parametrize`"),
    Case("pytest-retry", 2441, "pytest_retry.retry_plugin",
         "import os\nimport pytest\n" + FAILS_ONCE.format(decorator="@pytest.mark.flaky(retries=1)"),
         uses="`@pytest.mark.flaky(retries=1)`"),
    Case("pytest-snapshot", 2944, "pytest_snapshot.plugin", """
def test_snap(snapshot):
    snapshot.snapshot_dir = "snaps"
    snapshot.assert_match("abc\\n", "out.txt")
""", args=("--snapshot-update",), runs=2, facts=_snapshot_dir, uses="`snapshot.assert_match`, written then checked"),
    Case("pytest-regressions", 5349, "pytest_regressions.plugin", """
def test_regression(data_regression):
    data_regression.check({"a": 1, "b": [1, 2]})
""", runs=2, facts=_regressions, uses="`data_regression`, written then checked"),
    Case("pytest-dependency", 3045, "pytest_dependency", """
import pytest

@pytest.mark.dependency()
def test_a_fails():
    assert False

@pytest.mark.dependency()
def test_b_passes():
    pass

@pytest.mark.dependency(depends=["test_a_fails"])
def test_c_needs_a():
    pass

@pytest.mark.dependency(depends=["test_b_passes"])
def test_d_needs_b():
    pass
""", uses="`depends=` on a failed and a passed test"),
]  # fmt: skip
