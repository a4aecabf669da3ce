"""The fork server: sessions with marked 2-rank tests, ranks forked from the session's template
(``--msrun-fork-server=on``, the default) against new interpreters (``off``), same run.

    python bench/bench_forkserver.py [--runs 5] [--only-this-project]

Interleaved, shuffled rounds of pytest sessions in this checkout's environment (every plugin of the
test extra installed; ``--only-this-project``: ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and ``-p
pytest_msrun.pytest_plugin``, pytest with this plugin alone); per round:

* one marked test against the same test unmarked (target: on ≤ 1.5× the unmarked session with the
  test extra's plugins, ≤ 1.3× with this plugin alone), and a world's start: ``T(1 marked) -
  T(1 plain)``, on against off (target ≤ 0.3×);
* nine 2-rank tests in three shapes differing only in ``env`` against the same nine in one shape
  (target ≤ 1.2×);
* eight ``isolated=True`` tests under ``--msrun-worlds=fresh``: ``(T(8 marked) - T(8 plain)) / 8``.

Figures are medians over rounds with the 25th-75th percentile in brackets; ratios are per round.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, interleaved, machine, ms, quartiles, run_timed  # noqa: E402

SHAPES = """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        shape = getattr(item, "callspec", None) and item.callspec.params.get("shape")
        if shape:
            item.add_marker(pytest.mark.msrun(worker_num=2, env={"SHAPE": shape}))
"""


MODES = ("on", "off")


def _file(n: int, mark: str) -> str:
    return "import pytest\n\n" + "".join(f"{mark}def test_{i}():\n    pass\n\n" for i in range(n))


def _shapes(shapes: list[str]) -> str:
    return (
        "import pytest\n\n"
        f"@pytest.mark.parametrize('shape', {shapes!r})\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_x(shape, i):\n    pass\n"
    )


def stats(values: list[float]) -> str:
    return ms(values).strip()


def ratio(values: list[float]) -> str:
    lo, mid, hi = quartiles(values)
    return f"{mid:.2f}x [{lo:.2f}-{hi:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only-this-project", action="store_true", help="no plugin but this one")
    args = parser.parse_args()
    print(machine())
    alone = ["-p", "pytest_msrun.pytest_plugin"] if args.only_this_project else []
    print("plugins:", "this one alone (autoload off)" if alone else "every installed one (the test extra's)")
    with tempfile.TemporaryDirectory(prefix="bench-forkserver-") as tmp:
        root = Path(tmp)
        env = bench_env(root, **({"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} if alone else {}))
        cases = {
            "plain1": _file(1, ""),
            "marked1": _file(1, "@pytest.mark.msrun(worker_num=2)\n"),
            "plain8": _file(8, ""),
            "isolated8": _file(8, "@pytest.mark.msrun(worker_num=2, isolated=True)\n"),
        }
        for name, text in cases.items():
            (root / name).mkdir()
            (root / name / f"test_{name}.py").write_text(text)
        for name, shapes in (("shapes3", ["a", "b", "c"]), ("shape1", ["a", "a2", "a3"])):
            (root / name).mkdir()
            (root / name / "conftest.py").write_text(
                SHAPES if name == "shapes3" else SHAPES.replace('env={"SHAPE": shape}', 'env={"SHAPE": "a"}')
            )
            (root / name / f"test_{name}.py").write_text(_shapes(shapes))

        def session(case: str, *options: str):
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *alone]
            cmd += options

            def run(i: int) -> float:
                return run_timed([*cmd, f"--basetemp={root}/bt-{case}-{i}"], env, cwd=root / case)

            return run

        contenders = {"plain1": session("plain1"), "plain8": session("plain8")}
        for mode in ("on", "off"):
            flag = f"--msrun-fork-server={mode}"
            contenders[f"marked1 {mode}"] = session("marked1", flag)
            contenders[f"shapes3 {mode}"] = session("shapes3", flag)
            contenders[f"shape1 {mode}"] = session("shape1", flag)
            contenders[f"isolated8 {mode}"] = session("isolated8", flag, "--msrun-worlds=fresh")
        times = interleaved(args.runs, contenders)
    print(f"{args.runs} shuffled rounds; medians [25th-75th percentile]")
    for name, values in times.items():
        print(f"  {name:16s} {stats(values)}")
    n = args.runs
    for mode in ("on", "off"):
        one = [times[f"marked1 {mode}"][i] / times["plain1"][i] for i in range(n)]
        start = [times[f"marked1 {mode}"][i] - times["plain1"][i] for i in range(n)]
        shapes = [times[f"shapes3 {mode}"][i] / times[f"shape1 {mode}"][i] for i in range(n)]
        fresh = [(times[f"isolated8 {mode}"][i] - times["plain8"][i]) / 8 for i in range(n)]
        print(f"fork server {mode}:")
        print(f"  one marked test / unmarked session: {ratio(one)}")
        print(f"  a world's start (1 marked - 1 plain): {stats(start)}")
        print(f"  nine tests, three shapes / one shape: {ratio(shapes)}")
        print(f"  an isolated test (--msrun-worlds=fresh), over unmarked: {stats(fresh)}")
    further: dict[str, list[float]] = {}
    for mode in MODES:
        three, one = times[f"shapes3 {mode}"], times[f"shape1 {mode}"]
        further[mode] = [(three[i] - one[i]) / 2 for i in range(n)]
    for mode in MODES:
        print(f"a further world's start ((three shapes - one shape) / 2), {mode}: {stats(further[mode])}")
    per_round = [a / b for a, b in zip(further["on"], further["off"])]
    print(f"a further world's start, on / off, per round: {ratio(per_round)} (target <= 0.3x)")
    on = [times["marked1 on"][i] - times["plain1"][i] for i in range(n)]
    off = [times["marked1 off"][i] - times["plain1"][i] for i in range(n)]
    print(f"a session's first world's start, on / off, per round: {ratio([a / b for a, b in zip(on, off)])}")


if __name__ == "__main__":
    main()
