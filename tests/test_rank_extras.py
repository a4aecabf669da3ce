"""What a rank's pytest session records beyond pass and fail reaches the user: warnings, subtests,
user properties, captured output in report files, plugins' report attributes, pytest-benchmark's
measurements - in fresh jobs, warm worlds, isolated (forked) tests and suites."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest
from conftest import job_args
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.plugin.reports.extras import carried_attributes, group_warnings, merge_properties, merge_subtests

MODES = ["fresh", "warm", "isolated"]
# pytest's own subtests (the fixture, and unittest's subTest as reports) came with pytest 9
needs_subtests = pytest.mark.skipif(not hasattr(pytest, "Subtests"), reason="pytest < 9 has no subtests of its own")

WARNS = """
import warnings
import pytest

class Careful(UserWarning):
    pass

@pytest.mark.msrun(worker_num=2)
def test_warns(msrun):
    warnings.warn(DeprecationWarning("old api"))
    warnings.warn(Careful(f"rank {msrun.rank} says careful"))

@pytest.mark.msrun(worker_num=2)
def test_quiet(msrun):
    pass
"""


def _run(pytester: pytest.Pytester, source: str, mode: str, *args: str) -> pytest.RunResult:
    if mode == "isolated":
        source = source.replace("@pytest.mark.msrun(", "@pytest.mark.msrun(isolated=True, ")
    pytester.makepyfile(test_extras=source)
    worlds = "fresh" if mode == "fresh" else "warm"
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", f"--msrun-worlds={worlds}", *args
    )


@pytest.mark.parametrize("mode", MODES)
def test_warnings_of_ranks_reach_the_summary_once_labelled(pytester: pytest.Pytester, mode: str) -> None:
    result = _run(pytester, WARNS, mode)
    result.assert_outcomes(passed=2, warnings=3)
    text = result.stdout.str()
    summary = text[text.index("warnings summary") :]
    assert summary.count("DeprecationWarning: [ranks 0, 1] old api") == 1, summary
    assert "Careful: [rank 0] rank 0 says careful" in summary and "Careful: [rank 1] rank 1 says careful" in summary
    assert "test_extras.py::test_quiet" not in summary  # each warning on the test that raised it
    assert re.search(r"test_extras.py::test_warns\n\s+\S*test_extras.py:\d+: DeprecationWarning", summary), summary


def test_warning_filters_act_in_the_ranks_as_in_pytest(pytester: pytest.Pytester) -> None:
    """``-W ignore`` drops them where they are raised; ``-W error`` fails the test on its ranks."""
    result = _run(pytester, WARNS, "warm", "-W", "ignore::DeprecationWarning")
    result.assert_outcomes(passed=2, warnings=2)
    assert "old api" not in result.stdout.str()
    failed = _run(pytester, WARNS, "warm", "-W", "error::DeprecationWarning")
    failed.assert_outcomes(passed=1, failed=1)
    assert "DeprecationWarning: old api" in failed.stdout.str()


SUBTESTS = """
import unittest
import pytest

@pytest.mark.msrun(worker_num=2)
def test_cases(msrun, subtests):
    print("body of", msrun.rank)
    for i in range(3):
        with subtests.test(msg="case", i=i):
            print("case", i, "on", msrun.rank)
            assert not (i == 1 and msrun.rank == 1), "one bad case"

@pytest.mark.msrun(worker_num=2)
def test_all_pass(msrun, subtests):
    for i in range(2):
        with subtests.test(i=i):
            pass
"""


@needs_subtests
@pytest.mark.parametrize("mode", MODES)
def test_subtests_are_pytests_own_lines_and_counts(pytester: pytest.Pytester, mode: str) -> None:
    result = _run(pytester, SUBTESTS, mode, "-vv", "-rA")
    text = result.stdout.str()
    # one line per subtest, failed where any rank failed it, with that rank's failure
    assert len(re.findall(r"test_cases SUBPASSED\[case\] \(i=0\)", text)) == 1, text
    assert len(re.findall(r"test_cases SUBFAILED\[case\] \(i=1\)", text)) == 1, text
    assert len(re.findall(r"test_all_pass SUBPASSED\(i=\d\)", text)) == 2, text
    assert re.search(r"SUBFAILED\[case\] \(i=1\) test_extras.py::test_cases - \[rank 1\] AssertionError: one bad", text)
    outcomes = result.parseoutcomes()
    assert outcomes.get("subtests") == 4 and outcomes.get("passed") == 1, outcomes  # "4 subtests passed"
    # no stray progress letter in a rank's captured output; each subtest's own output, labelled
    assert not re.search(r"Captured stdout call \[rank 1\] -+\n\[rank 1\] u\b", text), text
    assert "[rank 1] case 1 on 1" in text


@needs_subtests
def test_unittest_subtests_of_a_marked_test_case(pytester: pytest.Pytester) -> None:
    source = """
import unittest
import pytest

@pytest.mark.msrun(worker_num=2)
class TestCase(unittest.TestCase):
    def test_sub(self):
        import os
        rank = int(os.environ["RANK_ID"])
        for i in range(2):
            with self.subTest(i=i):
                self.assertFalse(i == 1 and rank == 0)
"""
    result = _run(pytester, source, "warm", "-vv", "-rA")
    text = result.stdout.str()
    assert len(re.findall(r"test_sub SUBFAILED\(i=1\)", text)) == 1, text
    assert len(re.findall(r"test_sub SUBPASSED\(i=0\)", text)) == 1, text
    assert re.search(r"SUBFAILED\(i=1\) test_extras.py::TestCase::test_sub - \[rank 0\] AssertionError", text), text


PROPS = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_props(msrun, record_property):
    record_property("same", "everywhere")
    record_property("rank_seen", msrun.rank)
    print("hello from", msrun.rank)
    assert msrun.rank == 0, "failed first"
"""


@pytest.mark.parametrize("mode", ["fresh", "warm"])
def test_junit_has_every_ranks_properties_and_labelled_output(pytester: pytest.Pytester, mode: str) -> None:
    result = _run(pytester, PROPS, mode, "--junitxml=out.xml", "-o", "junit_logging=system-out")
    result.assert_outcomes(failed=1)
    case = ET.parse(pytester.path / "out.xml").getroot().find(".//testcase")
    assert case is not None
    props = [(p.get("name"), p.get("value")) for p in case.iter("property")]
    assert ("same", "everywhere") in props and props.count(("same", "everywhere")) == 1, props
    assert ("rank_seen [rank 0]", "0") in props and ("rank_seen [rank 1]", "1") in props, props
    out = "".join(e.text or "" for e in case.iter("system-out"))
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out, out


def test_without_junitxml_recording_properties_warns_of_nothing(pytester: pytest.Pytester) -> None:
    """As in plain pytest: junitxml's family warnings only when the session writes junitxml."""
    result = _run(pytester, JUNIT_RECORDS.replace("record_xml_attribute", "record_property"), "warm")
    result.assert_outcomes(passed=1)
    assert "warning" not in result.stdout.str().lower()


PLAIN_SUBTEST = """

def test_plain(subtests):
    for i in range(3):
        with subtests.test(msg="case", i=i):
            assert i != 1, "one bad case"
"""


@needs_subtests
def test_xdist_keeps_the_failures_one_line(pytester: pytest.Pytester) -> None:
    source = PROPS + SUBTESTS.split("import pytest", 1)[1] + PLAIN_SUBTEST
    result = _run(pytester, source, "warm", "-n", "2", "-rA", "-vv")
    text = result.stdout.str()
    assert "FAILED test_extras.py::test_props - [rank 1] AssertionError: failed first" in text, text
    # the subtest as pytest itself says it under xdist, unmarked (pytest 9.2 quotes its i='1' there)
    plain = re.search(r"SUBFAILED(\[case\] \(i='?1'?\)) test_extras.py::test_plain - ", text)
    assert plain, text
    assert f"SUBFAILED{plain[1]} test_extras.py::test_cases - [rank 1] AssertionError" in text, text


HTML_EXTRAS = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_pictures(msrun, extras):
    import pytest_html
    extras.append(pytest_html.extras.text(f"made by {msrun.rank}", name="note"))
"""


def test_pytest_html_extras_of_every_rank_reach_the_report(pytester: pytest.Pytester) -> None:
    result = _run(pytester, HTML_EXTRAS, "warm", "--html=page.html", "--self-contained-html")
    result.assert_outcomes(passed=1)
    page = (pytester.path / "page.html").read_text()
    assert "note [rank 0]" in page and "note [rank 1]" in page


BENCH = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_sum(msrun, benchmark):
    assert benchmark(sum, range(50 * (msrun.rank + 1))) >= 0
"""


@pytest.mark.parametrize("mode", ["warm"])
def test_benchmarks_are_one_row_per_rank_in_the_table_and_the_json(pytester: pytest.Pytester, mode: str) -> None:
    args = ("--benchmark-json=bench.json", "--benchmark-max-time=0.05", "--benchmark-autosave")
    result = _run(pytester, BENCH, mode, *args)
    result.assert_outcomes(passed=1)
    text = result.stdout.str()
    assert re.search(r"^test_sum \[rank 0\]\s+\d", text, re.M) and re.search(r"^test_sum \[rank 1\]\s+\d", text, re.M)
    data = json.loads((pytester.path / "bench.json").read_text())
    rows = {b["name"]: b for b in data["benchmarks"]}
    assert set(rows) == {"test_sum [rank 0]", "test_sum [rank 1]"}, rows
    assert all(b["stats"]["rounds"] == len(b["stats"]["data"]) > 0 for b in rows.values())
    assert rows["test_sum [rank 1]"]["extra_info"]["msrun_rank"] == 1
    saved = list((pytester.path / ".benchmarks").rglob("*.json"))
    assert len(saved) == 1, saved  # the session's, not one per rank


def test_a_plugin_whose_rank_data_is_lost_is_named_at_the_start(pytester: pytest.Pytester) -> None:
    result = _run(pytester, BENCH, "warm", "--benchmark-cprofile=tottime", "--benchmark-max-time=0.05")
    header = result.stdout.str().split("collected", 1)[0]
    assert "msrun: pytest-benchmark's cProfile tables of marked tests are not brought back" in header


@needs_subtests
def test_a_suites_table_shows_warnings_and_subtests(msrun) -> None:
    msrun.script("test_extras.py", WARNS + SUBTESTS.split("import pytest", 1)[1])
    job = msrun.run(job_args(2, "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_extras.py"))
    table = job.stdout[job.stdout.index("msrun: pytest results of 2 rank(s)") :]
    assert "msrun: warnings (3):" in table, table
    assert re.search(r"test_extras.py::test_warns \[ranks 0, 1\]: \S+:\d+: DeprecationWarning: old api", table)
    assert "msrun: subtests: 4 passed, 1 failed" in table, table


# ---------------------------------------------------------------------------- the rules, against oracles
names = st.sampled_from(["a", "b", "c"])
values = st.one_of(st.integers(0, 2), st.sampled_from(["x", "y"]))
pairs = st.lists(st.tuples(names, values), max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 5), pairs, min_size=1, max_size=4))
def test_merged_properties_lose_and_misattribute_nothing(per_rank: dict[int, list[tuple[str, Any]]]) -> None:
    merged = merge_properties(per_rank)
    shared = [p for p in merged if not p[0].endswith("]")]
    # oracle: a pair stays unlabelled exactly when every rank recorded it
    everywhere = {p for p in per_rank[min(per_rank)] if all(p in v for v in per_rank.values())}
    assert set(shared) == everywhere and len(shared) == len(set(shared))
    for rank, recorded in per_rank.items():
        for name, value in recorded:
            assert (name, value) in everywhere or (f"{name} [rank {rank}]", value) in merged
    for name, value in merged:
        m = re.fullmatch(r"(.*) \[rank (\d+)\]", name)
        if m:
            assert (m.group(1), value) in per_rank[int(m.group(2))]


outcome = st.sampled_from(["passed", "failed", "skipped", "xfailed"])
subtest = st.tuples(st.integers(0, 3), outcome)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 4), st.lists(subtest, max_size=5), min_size=1, max_size=4))
def test_a_subtest_is_shown_passed_only_if_no_rank_failed_it(per_rank: dict[int, list[tuple[int, str]]]) -> None:
    def report(i: int, o: str) -> dict:
        data: dict = {"_subtest.context": {"msg": None, "kwargs": {"i": i}}, "outcome": o}
        if o == "xfailed":  # as pytest serializes an xfailed subtest
            data.update(outcome="skipped", wasxfail="")
        return data

    data = {r: [report(i, o) for i, o in subs] for r, subs in per_rank.items()}
    merged = merge_subtests(data)
    # oracle: per case, the first report of each rank
    firsts: dict[int, dict[int, str]] = {}
    for r, subs in per_rank.items():
        for i, o in subs:
            firsts.setdefault(i, {}).setdefault(r, o)
    assert len(merged) == len(firsts)
    for entry in merged:
        i = entry.reports[entry.shown]["_subtest.context"]["kwargs"]["i"]
        seen = firsts[i]
        if "failed" in seen.values():
            assert entry.outcome == "failed" and entry.failed == sorted(r for r, o in seen.items() if o == "failed")
            assert entry.shown == entry.failed[0]
        elif "xfailed" in seen.values():
            assert entry.outcome == "xfailed" and seen[entry.shown] == "xfailed"
        elif set(seen.values()) == {"skipped"}:
            assert entry.outcome == "skipped"
        else:
            assert entry.outcome == "passed" and seen[entry.shown] == "passed"


warning = st.fixed_dictionaries(
    {"module": st.just("builtins"), "category": st.sampled_from(["UserWarning", "DeprecationWarning"]),
     "message": st.sampled_from(["m1", "m2"]), "filename": st.just("f.py"), "lineno": st.integers(1, 2)}
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 4), st.lists(warning, max_size=4), min_size=1, max_size=4))
def test_each_distinct_warning_once_with_exactly_the_ranks_that_raised_it(per_rank: dict[int, list[dict]]) -> None:
    groups = group_warnings(per_rank)
    key = ("module", "category", "message", "filename", "lineno")
    keys = [tuple(rec[k] for k in key) for _, rec in groups]
    assert len(keys) == len(set(keys))
    for ranks, rec in groups:
        k = tuple(rec[x] for x in key)
        assert ranks == sorted(r for r, ws in per_rank.items() if any(tuple(w[x] for x in key) == k for w in ws))
    assert set(keys) == {tuple(w[k] for k in key) for ws in per_rank.values() for w in ws}


def test_plugins_report_attributes_come_from_the_shown_rank_and_extras_from_all() -> None:
    per_rank = {
        0: {"outcome": "passed", "stat": "zero", "extras": [{"name": "n", "content": "a"}]},
        1: {"outcome": "failed", "stat": "one", "extras": [{"content": "b"}], "duration": 3},
    }
    carried = carried_attributes(per_rank, 1)
    assert carried["stat"] == "one" and "duration" not in carried and "outcome" not in carried
    assert [e["name"] for e in carried["extras"]] == ["n [rank 0]", "rank 1"]
    assert carried_attributes(per_rank, 7)["stat"] == "zero"  # a shown rank without a report: the lowest


JUNIT_RECORDS = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_recorded(msrun, record_testsuite_property, record_xml_attribute):
    record_testsuite_property("build", "42")
    record_testsuite_property("host", f"node{msrun.rank}")
    record_xml_attribute("owner", "same")
    record_xml_attribute("shard", str(msrun.rank))
"""


@pytest.mark.parametrize("mode", ["fresh", "warm"])
def test_junit_suite_properties_and_attributes_from_ranks(pytester: pytest.Pytester, mode: str) -> None:
    result = _run(pytester, JUNIT_RECORDS, mode, "--junitxml=out.xml", "-o", "junit_family=xunit1")
    result.assert_outcomes(passed=1)
    root = ET.parse(pytester.path / "out.xml").getroot()
    suite = root.find("testsuite")
    assert suite is not None
    props = [(p.get("name"), p.get("value")) for p in suite.findall("properties/property")]
    assert props == [("build", "42"), ("host [rank 0]", "node0"), ("host [rank 1]", "node1")], props
    case = root.find(".//testcase")
    assert case is not None and case.get("owner") == "same", case.attrib
    assert case.get("shard_rank0") == "0" and case.get("shard_rank1") == "1", case.attrib
