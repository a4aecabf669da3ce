"""The fork server preloads the frameworks the marked tests import (``--msrun-preload``).

Frameworks here are modules in a directory outside the project on ``PYTHONPATH`` - installed code,
as torch is (the torch tier runs the real one: tests/test_torch_tier.py). Each writes the pid that
imported it to a file, so a test sees who imported it: the session, the fork server, or a rank.
"""

from __future__ import annotations

import os
import textwrap

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pytest_msrun.engine import preloadrule
from pytest_msrun.plugin.controller.frameworks import PreloadSpecError, chosen, parse_spec

RECORD = """
import os
with open(os.path.join(os.environ["IMPORTS_DIR"], "{name}"), "a") as fh:
    fh.write(f"{{os.getpid()}}\\n")
"""
# modules whose import a template must not keep, and the reason the summary gives
REFUSED = {
    "readsrank": ("RANK = os.environ.get('RANK')", "its import reads RANK (a rank's own values)"),
    "readsms": ("MODE = 'MS_ROLE' in os.environ", "its import reads MS_ROLE"),
    "readsdevices": ("DEV = os.getenv('CUDA_VISIBLE_DEVICES')", "its import reads CUDA_VISIBLE_DEVICES"),
    "copiesenv": ("ENV = dict(os.environ)", "its import lists the environment"),
    "opensdevice": ("DEVICE = open('/dev/zero', 'rb')", "its import opened a device (/dev/zero)"),
    "startsthread": (
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()",
        "its import started a thread that a fork does not stop",
    ),
}


@pytest.fixture
def libs(pytester, monkeypatch):
    """A directory of installed code on ``PYTHONPATH`` (outside the project), and where its
    modules record who imported them."""
    lib = pytester.path.parent / f"{pytester.path.name}-libs"
    imports = pytester.path.parent / f"{pytester.path.name}-imports"
    lib.mkdir()
    imports.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(lib), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("IMPORTS_DIR", str(imports))

    def write(name: str, body: str = "") -> None:
        (lib / f"{name}.py").write_text(RECORD.format(name=name) + textwrap.dedent(body) + "\n")

    write.imports = imports  # type: ignore[attr-defined]
    return write


def _importers(libs, name: str) -> list[int]:
    path = libs.imports / name
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _run(pytester, *args: str):
    base = pytester.path / f"bt{len(list(pytester.path.glob('bt*')))}"
    result = pytester.runpytest_subprocess(f"--basetemp={base}", "-p", "no:cacheprovider", *args, timeout=240)
    return result, (base / "msrun-fork-server.log").read_text()


def test_the_frameworks_marked_tests_import_are_imported_once_before_the_ranks_fork(pytester, libs, tracked):
    libs("fwone")
    libs("fwtwo", "class Thing:\n    pass")
    libs("fwplain")
    pytester.makepyfile(
        test_marked="""
        import os
        import pytest
        import fwone
        from fwtwo import Thing

        @pytest.mark.msrun(worker_num=2)
        def test_ranks(rank):
            with open(os.path.join(os.environ["IMPORTS_DIR"], f"rank{rank}"), "w") as fh:
                fh.write(str(os.getpid()))
        """,
        test_plain="import fwplain\n\ndef test_plain():\n    pass\n",
    )
    result, log = _run(pytester)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["msrun: ranks start with fwone, fwtwo imported (the marked tests import them; *"])
    assert "frameworks: fwone, fwtwo" in log
    ranks = {int((libs.imports / f"rank{r}").read_text()) for r in (0, 1)}
    for name in ("fwone", "fwtwo"):
        importers = _importers(libs, name)
        assert len(importers) == 2 and not set(importers) & ranks, importers  # the session's, the template's
    assert len(_importers(libs, "fwplain")) == 1  # the session's only: no marked test imports it


def test_a_test_file_s_frameworks_are_imported_by_the_template_while_the_session_imports_the_file(
    pytester, libs, tracked
):
    """No cache to say what the last session had: the file's text says it uses the marker, so the
    template imports what it imports (``fwone``) as the session collects it - the session's own
    import of the file waits here until the template has imported ``fwone``."""
    libs("fwone")
    pytester.makepyfile(
        test_early="""
        import os, time
        import pytest

        if "RANK_ID" not in os.environ:  # the session: the template imports fwone meanwhile
            record = os.path.join(os.environ["IMPORTS_DIR"], "fwone")
            deadline = time.monotonic() + 60
            while not (os.path.exists(record) and open(record).read().strip()):
                assert time.monotonic() < deadline, "the template did not import fwone while the file was collected"
                time.sleep(0.01)

        import fwone

        @pytest.mark.msrun(worker_num=1)
        def test_rank(rank):
            pass
        """
    )
    result, log = _run(pytester)
    result.assert_outcomes(passed=1)
    assert log.splitlines()[-1].endswith("frameworks: fwone"), log
    assert len(set(_importers(libs, "fwone"))) == 2  # the template's first, then the session's


def test_a_pytest_plugin_s_distribution_is_each_rank_s_own_import(pytester, libs, tracked):
    """hypothesis is a pytest plugin's distribution: pytest rewrites its asserts as each rank imports
    it, which a module the template imported before cannot have (-W error: no "cannot be rewritten")."""
    pytest.importorskip("hypothesis")
    libs("fwone")
    pytester.makepyfile(
        test_both="""
        import pytest
        import fwone
        from hypothesis import given, settings, strategies as st

        @pytest.mark.msrun(worker_num=2)
        @settings(max_examples=3, deadline=None)
        @given(st.integers())
        def test_marked(x):
            pass
        """
    )
    result, log = _run(pytester, "-W", "error")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["msrun: ranks start with fwone imported (the marked tests import it; *"])
    assert log.splitlines()[-1].endswith("frameworks: fwone"), log


def test_a_module_a_template_may_not_keep_is_each_rank_s_own_import(pytester, libs, tracked):
    """Each kind of refusal, said in the summary; the others are preloaded, and the ranks fork."""
    libs("fwgood")
    for name, (body, _) in REFUSED.items():
        libs(name, body)
    imports = "\n".join(
        f"try:\n    import {name}\nexcept ImportError:\n    {name} = None" for name in ["fwgood", *REFUSED]
    )
    pytester.makepyfile(
        test_refused=imports
        + """
import os
import pytest

@pytest.mark.msrun(worker_num=2)
def test_ranks(rank):
    assert readsrank.RANK == str(rank)  # the rank's own import read the rank's own value
    assert "pytest_msrun.engine.template" in __import__("sys").modules  # forked, all the same
"""
    )
    result, log = _run(pytester)
    result.assert_outcomes(passed=1)
    for name, (_, why) in REFUSED.items():
        result.stdout.fnmatch_lines([f"msrun: ranks import {name} themselves (not preloaded: {why}*"])
    assert ": started over; " in log and log.splitlines()[-1].endswith("frameworks: fwgood")
    assert len(set(_importers(libs, "fwgood"))) == 2  # the session and the template (again at each start over)


def test_the_preload_option_adds_and_takes_out(pytester, libs, tracked):
    libs("fwone")
    libs("fwextra")
    pytester.makepyfile(
        test_one="import pytest\nimport fwone\n\n@pytest.mark.msrun(worker_num=1)\ndef test_r(rank):\n    pass\n"
    )
    result, log = _run(pytester, "--msrun-preload=-fwone,fwextra")
    result.assert_outcomes(passed=1)
    assert "frameworks: fwextra" in log and "fwone" not in log
    assert len(_importers(libs, "fwone")) == 2  # the session's, the rank's
    result, log = _run(pytester, "--msrun-preload=none")
    result.assert_outcomes(passed=1)
    assert "frameworks" not in log and "ranks start with" not in result.stdout.str()
    result, log = _run(pytester, "--msrun-preload=nosuchmodule")  # named, but not there
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["msrun: ranks import nosuchmodule themselves (not preloaded: its import failed (ModuleNotFoundError: *"]
    )
    bad = pytester.runpytest_subprocess("--msrun-preload=torch,no such", timeout=240)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--msrun-preload: 'no such' is not auto, none, NAME or -NAME*"])


def test_a_forked_worker_whose_framework_read_a_variable_it_sets_otherwise_starts_anew(pytester, libs, tracked):
    """A marker's ``env`` sets a variable the preloaded import read: that job's ranks are started
    as new processes (their import reads their value); the rest fork."""
    libs("fwsetting", "SETTING = os.environ.get('FW_SETTING', 'unset')")
    pytester.makepyfile(
        test_env="""
        import pytest, sys
        import fwsetting

        def _forked():
            return "pytest_msrun.engine.template" in sys.modules

        @pytest.mark.msrun(worker_num=1)
        def test_default(rank):
            assert fwsetting.SETTING == "unset" and _forked()

        @pytest.mark.msrun(worker_num=1, env={"FW_SETTING": "mine"})
        def test_set(rank):
            assert fwsetting.SETTING == "mine" and not _forked()
        """
    )
    result, _ = _run(pytester)
    result.assert_outcomes(passed=2)


# ---------------------------------------------------------------------------------- the rules


def _oracle_job_var(name: str) -> bool:
    """The rule in words: msrun's own variables, MindSpore's and ours by prefix, device lists."""
    from pytest_msrun.engine.childenv import OWNED_VARS

    return (
        name == "*"
        or name in OWNED_VARS
        or name[:3] == "MS_"
        or name[:6] == "MSRUN_"
        or name[-16:] == "_VISIBLE_DEVICES"
    )


NAMES = st.one_of(
    st.sampled_from(["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "RANK_ID", "TORCH_LOGS", "HOME", "*"]),
    st.builds(
        lambda a, b: a + b, st.sampled_from(["MS_", "MSRUN_", "TORCH_", "", "X_"]), st.text("ABCDRANK_", max_size=8)
    ),
    st.builds(lambda a: a + "_VISIBLE_DEVICES", st.sampled_from(["CUDA", "ASCEND_RT", "HIP", ""])),
)


@given(NAMES)
def test_job_variables_are_those_the_rule_names(name):
    assert preloadrule.job_var(name) == _oracle_job_var(name)


@given(
    st.lists(st.sampled_from(["torch", "numpy", "mindspore", "jax"]), max_size=4),
    st.lists(
        st.one_of(st.just("auto"), st.just("none"), st.sampled_from(["torch", "numpy", "scipy", "-torch", "-numpy"])),
        max_size=5,
    ),
)
def test_the_spec_adds_and_takes_out_as_written(found, items):
    spec = ",".join(items)
    auto = "none" not in items
    added = {i for i in items if i not in ("auto", "none") and not i.startswith("-")}
    removed = {i[1:] for i in items if i.startswith("-")}
    assert chosen(found, spec) == sorted(((set(found) if auto else set()) | added) - removed)


@given(st.text(max_size=12))
def test_a_spec_is_read_or_refused_naming_the_option(spec):
    try:
        parse_spec(spec)
    except PreloadSpecError as exc:
        assert str(exc).startswith("--msrun-preload: ")


# ---------------------------------------------------------------------------------- real frameworks

SEES = """
import os, sys

def pytest_configure(config):
    if "RANK_ID" in os.environ:  # a rank, before it collects: what it starts with
        with open(os.path.join(os.environ["IMPORTS_DIR"], f"rank{os.environ['RANK_ID']}"), "a") as fh:
            fh.write(f"{FRAMEWORK in sys.modules}\\n")
"""


@pytest.mark.torch
def test_torch_ranks_start_with_torch_imported_and_their_memory_is_not_a_test_s_growth(pytester, libs, tracked):
    pytester.makeconftest(SEES.replace("FRAMEWORK", "'torch'"))
    pytester.makepyfile(
        test_torch="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.fixture(scope="module")
        def group():
            dist.init_process_group("gloo")
            yield
            dist.destroy_process_group()

        @pytest.mark.msrun(worker_num=2)
        @pytest.mark.parametrize("i", range(3))
        def test_all_reduce(rank, group, i):
            t = torch.tensor([rank + i], dtype=torch.float32)
            dist.all_reduce(t)
            assert t.item() == 1 + 2 * i
        """
    )
    # a test that grew a rank by 50 MiB fails: torch's import (~100s of MiB) is the template's, not a test's
    result, log = _run(pytester, "--msrun-leaks=error", "--msrun-leak-rss=50MiB")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["msrun: ranks start with torch imported*"])
    assert log.splitlines()[-1].endswith("frameworks: torch"), log
    assert [(libs.imports / f"rank{r}").read_text().split() for r in (0, 1)] == [["True"], ["True"]]


@pytest.mark.mindspore
def test_mindspore_is_each_rank_s_own_import_saying_why(pytester, libs, tracked):
    """MindSpore's import reads MS_* variables (a rank's own): not preloaded, and the summary says so."""
    pytester.makeconftest(SEES.replace("FRAMEWORK", "'mindspore'"))
    pytester.makepyfile(
        test_ms="""
        import mindspore
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_rank(rank):
            assert mindspore.__version__
        """
    )
    result, log = _run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["msrun: ranks import mindspore themselves (not preloaded: its import reads MS_*"])
    assert "frameworks: mindspore" not in log
    assert [(libs.imports / f"rank{r}").read_text().split() for r in (0, 1)] == [["False"], ["False"]]
