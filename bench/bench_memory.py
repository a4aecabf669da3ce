"""The memory watch's cost per test in a warm world (target: <= 2 ms).

    python bench/bench_memory.py [--calls 20000] [--rounds 7] [--tests 20] [--runs 5]

* in one process, what a rank adds to each test: a :class:`~pytest_msrun.plugin.rankmemory.Watch`
  made at the test's start and ended after it (two reads of ``/proc/self/statm``, a look for an
  initialised ``torch.cuda``), with one first import inside it (two more reads) - timed over
  ``--calls`` tests per round, interleaved rounds, with a small heap and with 512 MiB resident
  (the read costs the same whatever the heap);
* end to end: ``--tests`` trivial 2-rank tests in one warm world with the watch on (the defaults)
  and off (``--msrun-leak-rss=0``), shuffled sessions; the difference per test (noisier: two
  whole sessions' spread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_env, interleaved, machine, ms, quartiles  # noqa: E402

sys.path.insert(0, str(REPO))
from pytest_msrun.plugin import rankmemory  # noqa: E402

BOUND = 100 << 20


def one_test() -> None:
    watch = rankmemory.Watch()
    watch.enter()  # a first import during the test
    watch.exit()
    watch.end(BOUND)


def per_call(calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        one_test()
    return (time.perf_counter() - t0) / calls


def us(values: list[float]) -> str:
    """``median [p25-p75] us``."""
    lo, mid, hi = quartiles(values)
    return f"{mid * 1e6:8.1f} us [{lo * 1e6:.1f}-{hi * 1e6:.1f}]"


def marked(n: int) -> str:
    return "import pytest\n\n" + "".join(
        f"@pytest.mark.msrun(worker_num=2)\ndef test_{i}(rank):\n    assert rank in (0, 1)\n\n" for i in range(n)
    )


def session(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]  # the plugin: its entry point
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pytest {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tests", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(machine())
    print(f"rank side: {args.calls} tests per round, {args.rounds} interleaved rounds; end to end: {args.tests} ")
    print(f"2-rank tests in one warm world, {args.runs} shuffled rounds of sessions (watch on, off)\n")
    heap: list[bytearray] = []

    def small(i: int) -> float:
        heap.clear()
        return per_call(args.calls)

    def large(i: int) -> float:
        heap[:] = [bytearray(b"h") * (512 << 20)]  # written: resident
        try:
            return per_call(args.calls)
        finally:
            heap.clear()

    rank = interleaved(args.rounds, {"small": small, "large": large})
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        d = Path(tmp)
        env = bench_env(d)
        (d / "test_marked.py").write_text(marked(args.tests))
        contenders = {
            "on": lambda i: session(["test_marked.py"], d, env),
            "off": lambda i: session(["test_marked.py", "--msrun-leak-rss=0"], d, env),
        }
        interleaved(1, contenders)  # warm caches
        t = interleaved(args.runs, contenders)
    per_test = [(on - off) / args.tests for on, off in zip(t["on"], t["off"])]
    rows = [
        ("rank side, per test, small heap", us(rank["small"])),
        ("rank side, per test, 512 MiB resident", us(rank["large"])),
        (f"session of {args.tests} warm tests, watch on", ms(t["on"])),
        (f"session of {args.tests} warm tests, watch off", ms(t["off"])),
        ("end to end, per test (on - off)", ms(per_test)),
    ]
    for what, value in rows:
        print(f"  {what:<50} {value}")
    worst = max(statistics.median(rank["small"]), statistics.median(rank["large"]))
    ok = worst <= 0.002
    print(f"\ntarget: the memory check costs <= 2 ms per test (rank side): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.pop("PYTEST_ADDOPTS", None)
    sys.exit(main())
