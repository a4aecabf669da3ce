"""What simulated ranks hold, side by side; sizes and budgets as users write them.

The table's invariant: every rank that recorded its holdings is a row or counted in the line for
the others, never both; at most ``ROWS`` rows; the largest and the smallest are rows; a rank left
out is no farther from the median than any row shown for its distance, nor than the line says.
"""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.engine import holdings
from pytest_msrun.sizes import format_size

held = st.builds(
    lambda rank, p, g, o, n: holdings.Held(rank, ("dp", "tp"), (rank // 8, rank % 8), p, g, o, (("all_gather", n, p),)),
    st.integers(0, 4095),
    st.integers(0, 1 << 34),
    st.integers(0, 1 << 34),
    st.integers(0, 1 << 35),
    st.integers(0, 100),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(held, min_size=1, max_size=60, unique_by=lambda h: h.rank))
def test_every_rank_is_a_row_or_counted_and_the_ends_are_rows(ranks):
    lines = holdings.table(ranks, 4096, budget=1 << 30)
    rows = [line.split()[0] for line in lines[1:-1] if not line.startswith("... ")]
    shown = {int(r) for r in rows}
    assert len(rows) == len(shown) and shown <= {h.rank for h in ranks}
    others = [line for line in lines if line.startswith("... ")]
    counted = int(others[0].split()[1]) if others else 0
    assert len(shown) + counted == len(ranks)  # each rank once: a row, or counted
    if len(ranks) <= holdings.ROWS:
        assert not others and rows == [str(h.rank) for h in sorted(ranks, key=lambda h: h.rank)]
    totals = sorted(h.total for h in ranks)
    assert {h.rank for h in ranks if h.total in (totals[0], totals[-1])} & shown  # the ends
    assert max(h.total for h in ranks if h.rank in shown) == totals[-1]
    assert min(h.total for h in ranks if h.rank in shown) == totals[0]
    assert len(shown) <= holdings.ROWS
    median = statistics.median_low(totals)
    by_total = sorted(sorted(ranks, key=lambda h: h.rank), key=lambda h: h.total)  # as the table breaks ties
    ends = {h.rank for h in by_total[: holdings.ENDS] + by_total[-holdings.ENDS :]}
    far = [abs(h.total - median) for h in ranks if h.rank in shown - ends]
    left = [abs(h.total - median) for h in ranks if h.rank not in shown]
    if left:
        assert not far or max(left) <= min(far)
        said = others[0].split("each within ")[1].removesuffix(" of the median")
        assert said == format_size(max(left))
    assert lines[-1].startswith(f"{len(ranks)} of 4096 ranks: most rank ") and lines[-1].endswith("budget 1.0 GiB")


def test_a_record_a_rank_wrote_badly_is_no_row(tmp_path):
    bad = tmp_path / "bad.json"
    bad_ones = ("", "[]", '{"params": "x"}', '{"collectives": {"a": 1}}', "{" * 5000, "[" * 100_000)
    for text in (*bad_ones, '{"params": 1e999}', '{"params": NaN}'):
        bad.write_text(text)
        assert holdings.compact(str(bad), 3) is None
    assert holdings.compact(str(tmp_path / "none.json"), 3) is None
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"params": 10, "mesh": {"dims": ["dp"], "coordinate": [2]}, "collectives": {}}))
    assert holdings.compact(str(good), 3) == holdings.Held(3, ("dp",), (2,), 10, 0, 0, ())


@pytest.mark.parametrize(
    "args,says",
    [
        ('sim_budget="2GiB"', "msrun(sim_budget='2GiB'): needs sim_level"),
        ('sim_level=1, sim_budget="lots"', "msrun(sim_budget='lots'): 'lots' is not a size: use a size such as 200MB"),
        ("sim_level=1, sim_budget=True", "msrun(sim_budget=True): needs sim_level, and is bytes"),
    ],
)
def test_a_bad_budget_on_the_marker_is_said_at_collection(pytester, args, says):
    pytester.makepyfile(f"import pytest\n@pytest.mark.msrun(worker_num=8, {args})\ndef test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0 and says in result.stdout.str(), result.stdout.str()


@pytest.mark.parametrize(
    "args,says",
    [
        (["--sim_budget=1GiB"], "--sim_budget: needs --sim_level"),
        (["--sim_level=1", "--sim_budget=lots"], "--sim_budget: 'lots' is not a size: use a size such as 200MB"),
    ],
)
def test_a_bad_budget_is_a_usage_error(msrun, args, says):
    msrun.script("t.py", "print('ran')\n")
    job = msrun.run(["--worker_num=2", "--local_worker_num=2", *args, "--join=True", "t.py"])
    assert job.returncode == 2 and says in job.stderr, job.stderr
    assert "ran" not in job.stdout and "Start worker" not in job.stdout  # nothing started
