"""The documentation's commands run: every fenced shell block of README.md and docs/*.md marked
runnable is a test, so none can rot; the README stays a five-minute page; the site builds strictly.

The marks (docs/testing.md, "The documentation's commands"):

- ```` ```bash {.runnable} ````: run with ``bash -e -o pipefail``; it must exit 0, or the status
  it declares (```` ```bash {.runnable exit=2} ````), within 120 s (``timeout=N``);
- ```` ```python title="demo/test_first.py" ````: a file, written into the scratch directory
  before each runnable block of the same page runs;
- ```` ```bash {.not-runnable} ````: a command this test cannot run (a cluster, a GPU, the
  network, ``pip install``, the whole suite). A shell block marked neither is an error.

Each runnable block runs in its own scratch directory under ``tmp_path`` holding a copy of
``sample_code/`` and ``fixtures/``, with ``TMPDIR`` and ``XDG_CONFIG_HOME`` inside it, so logs,
traces, pytest's temp directories and msrun's secret land there; a process the block left
running fails the test.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import MARK, REPO, wait_gone

README = REPO / "README.md"
DOCS_DIR = REPO / "docs"
GETTING_STARTED = DOCS_DIR / "getting-started.md"
NEWCOMER_PAGES = (README, GETTING_STARTED)  # read by someone who just cloned the repository
PAGES = [README, *sorted(DOCS_DIR.glob("*.md"))]
COPIED = ("sample_code", "fixtures")  # what runnable blocks may use from the repository
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
DEFAULT_TIMEOUT = 120.0
README_MAX_LINES = 250

# A fence opens with 3+ backticks or tildes and an info string without backticks (CommonMark), so
# an inline span such as ```` ```bash {.runnable} ```` at the start of a line opens nothing.
OPEN = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
INFO = re.compile(r"^(?P<lang>[\w#.+-]*)\s*(?:\{(?P<attrs>[^}]*)\})?\s*(?P<rest>.*)$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    end: int  # of the closing fence
    lang: str
    text: str
    classes: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return "runnable" in self.classes


def parse_info(info: str) -> tuple[str, list[str], dict[str, str]]:
    """``bash {.runnable exit=2}``, ``python title="x.py"``, ``{.bash .runnable}`` -> lang, classes, attrs."""
    m = INFO.match(info.strip())
    if m is None:
        return "", [], {}
    lang = m["lang"] or ""
    classes: list[str] = []
    attrs: dict[str, str] = {}
    for token in shlex.split(m["attrs"] or "") + shlex.split(m["rest"] or ""):
        if token.startswith("."):
            classes.append(token[1:])
        elif "=" in token:
            key, _, value = token.partition("=")
            attrs[key] = value
        elif token and not token.startswith("#"):
            classes.append(f"bare word {token}")  # superfences would not render the block: caught below
    if not lang and classes:  # the brace-only form: the first class is the language
        lang = classes.pop(0)
    return lang, classes, attrs


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"^[ ]*{re.escape(fence[0])}{{{len(fence)},}}[ ]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        lang, classes, attrs = parse_info(m["info"])
        out.append(Block(page, i + 1, j + 1, lang, "\n".join(body) + "\n", classes, attrs))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.runnable]


def page_files(page: Path) -> dict[str, str]:
    """The files a page shows (code blocks with a ``title``), by relative path."""
    return {b.attrs["title"]: b.text for b in ALL if b.page == page and "title" in b.attrs}


def block_env(scratch: Path, mark: str) -> dict[str, str]:
    """This environment without a launcher's or a job's variables (the suite itself may run as a
    rank, under srun or under pytest-xdist), with the scratch directory's temp and config dirs."""
    drop_prefixes = ("MS_", "MSRUN_", "SLURM_", "PYTEST_", "OMPI_", "PMI_", "TORCHELASTIC_")
    drop = {"RANK", "RANK_ID", "RANK_SIZE", "LOCAL_RANK", "LOCAL_RANK_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    drop |= {"GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DEVICE_ID", "STRATEGY"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(drop_prefixes)}
    for name in ("tmp", "config"):
        (scratch / name).mkdir()
    env["TMPDIR"] = str(scratch / "tmp")
    env["XDG_CONFIG_HOME"] = str(scratch / "config")  # a multi-node job's secret lands here
    env[MARK] = mark
    # pmsrun and python from the environment running this test, and this checkout's package.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block(block: Block, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name in COPIED:
        shutil.copytree(REPO / name, work / name, ignore=shutil.ignore_patterns("__pycache__", "msrun_log"))
    newcomer = block.page in NEWCOMER_PAGES
    if newcomer:  # a clone: what the walk-through writes (its files, its outputs) is ignored by git
        shutil.copy(REPO / ".gitignore", work / ".gitignore")
        subprocess.run(["git", "init", "-q"], cwd=work, check=True)
        before = git_status(work)
    for rel, text in page_files(block.page).items():
        target = work / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    mark = uuid.uuid4().hex
    expected = int(block.attrs.get("exit", "0"))
    timeout = float(block.attrs.get("timeout", DEFAULT_TIMEOUT))
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=work,
        env=block_env(tmp_path, mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.where} ran past {timeout:.0f} s:\n{block.text}\n{out[-4000:]}")
    finally:
        left = wait_gone(mark, timeout=10.0)
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
    assert proc.returncode == expected, (
        f"{block.where} exited {proc.returncode}, the page says {expected}:\n{block.text}\n--- output:\n{out[-6000:]}"
    )
    assert not left, f"{block.where} left processes running: {[p.pid for p in left]}"
    if newcomer:
        new_paths = sorted(set(git_status(work)) - set(before))
        assert not new_paths, f"{block.where}: git status of a clone shows what it wrote (.gitignore): {new_paths}"


def git_status(work: Path) -> list[str]:
    """``git status --porcelain`` of ``work``, every untracked file listed."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=work, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_every_shell_block_is_marked_runnable_or_not():
    wrong = []
    for b in ALL:
        if b.lang in SHELLS and b.runnable == ("not-runnable" in b.classes):
            wrong.append(f"{b.where}: a {b.lang} block needs exactly one of {{.runnable}}, {{.not-runnable}}")
        if b.runnable and b.lang != "bash":
            wrong.append(f"{b.where}: runnable blocks are bash, not {b.lang!r}")
        unknown = set(b.classes) - {"runnable", "not-runnable"}
        if unknown:
            wrong.append(f"{b.where}: unknown marks {sorted(unknown)} (superfences would not render the block)")
        if not b.runnable and {"exit", "timeout"} & set(b.attrs):
            wrong.append(f"{b.where}: exit=/timeout= on a block that does not run")
        for key in ("exit", "timeout"):
            if key in b.attrs and not b.attrs[key].isdigit():
                wrong.append(f"{b.where}: {key}={b.attrs[key]!r} is not a number")
        title = b.attrs.get("title", "")
        if title and (title.startswith("/") or ".." in Path(title).parts):
            wrong.append(f"{b.where}: title={title!r} must be a path inside the scratch directory")
    for page in PAGES:
        titles = [b.attrs["title"] for b in ALL if b.page == page and "title" in b.attrs]
        dupes = sorted({t for t in titles if titles.count(t) > 1})
        if dupes:
            wrong.append(f"{page.relative_to(REPO)}: two blocks write {dupes}")
    assert not wrong, "\n".join(wrong)


def test_the_docs_have_runnable_commands_and_the_quick_start_is_one():
    assert len(RUNNABLE) >= 10, [b.where for b in RUNNABLE]
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = next(b for b in blocks(README) if b.lang in SHELLS and b.text.strip() in quick)
    assert first.runnable and first.text.startswith("pmsrun "), first.where
    assert any(b.runnable for b in ALL if b.page == README and b.text.startswith("python -m pytest")), (
        "the README's first marked test runs"
    )


def test_readme_is_a_five_minute_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs' toc extension and GitHub make it (for the headings used here)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def prose(page: Path) -> list[str]:
    """The page's lines outside code blocks (a ``#`` there is a comment, a link is code)."""
    code = {n for b in blocks(page) for n in range(b.line, b.end + 1)}
    return [line for n, line in enumerate(page.read_text().split("\n"), 1) if n not in code]


def anchors(page: Path) -> set[str]:
    return {slug(m[1]) for line in prose(page) if (m := re.match(r"^#{1,6}\s+(.*)$", line))}


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_links_resolve():
    """Every relative link of the README and the pages names a file that exists, and an anchor
    that a heading makes (MkDocs checks the pages too; the README is not part of the site)."""
    broken = []
    for page in PAGES:
        for target in LINK.findall("\n".join(prose(page))):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_is_in_the_site_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    missing = [p.name for p in DOCS_DIR.glob("*.md") if f": {p.name}" not in nav]
    assert not missing, f"mkdocs.yml's nav does not list {missing}"


def test_the_site_builds_strictly(tmp_path: Path):
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (pip install -e '.[docs]')"
        if os.environ.get("MSRUN_TEST_REQUIRE"):  # CI (.ci/run) installs the docs extra
            pytest.fail(f"MSRUN_TEST_REQUIRE is set: {reason}", pytrace=False)
        pytest.skip(reason)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
        + ["--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists() and (site / "html-report.png").exists()


def _paragraph_before(page: Path, block: Block) -> str:
    """The prose paragraph just above ``block`` (what a reader sees before it on GitHub)."""
    lines = page.read_text().split("\n")[: block.line - 1]
    while lines and not lines[-1].strip():
        lines.pop()
    para: list[str] = []
    while lines and lines[-1].strip() and not OPEN.match(lines[-1]):
        para.insert(0, lines.pop())
    return " ".join(para)


@pytest.mark.parametrize("page", NEWCOMER_PAGES, ids=lambda p: p.name)
def test_the_files_to_create_are_named_in_prose(page: Path) -> None:
    """GitHub does not show a fence's ``title``: the sentence before a file's block names it."""
    unnamed = [
        f"{b.where}: {b.attrs['title']}"
        for b in blocks(page)
        if "title" in b.attrs and f"`{b.attrs['title']}`" not in _paragraph_before(page, b)
    ]
    assert not unnamed, "file blocks whose file the paragraph before does not name: " + ", ".join(unnamed)


def test_getting_started_is_the_readmes_walk_through() -> None:
    """The site's page shows the README's files and commands, word for word (neither drifts)."""
    readme = blocks(README)
    files = {b.attrs["title"]: b.text for b in readme if "title" in b.attrs}
    commands = {b.text for b in readme if b.lang in SHELLS}
    for b in blocks(GETTING_STARTED):
        if "title" in b.attrs:
            assert files.get(b.attrs["title"]) == b.text, f"{b.where}: not the README's {b.attrs['title']}"
        elif b.lang in SHELLS:
            assert b.text in commands, f"{b.where}: a command the README does not show:\n{b.text}"
    for page in NEWCOMER_PAGES:
        assert "## What msrun is" in page.read_text() or "**What msrun is**" in page.read_text(), page


def test_the_readme_says_how_long_the_suite_takes() -> None:
    test_command = next(b for b in blocks(README) if b.text.strip() == 'python -m pytest -q -m "not slow"')
    assert re.search(r"about \d+ minutes on \d+ CPUs", _paragraph_before(README, test_command))
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "system packages" not in quick and test_command.text not in quick, "the quick start is one job"


def test_plain_tox_skips_missing_interpreters() -> None:
    import configparser

    tox = configparser.ConfigParser()
    tox.read(REPO / "tox.ini")
    assert tox["tox"].get("skip_missing_interpreters") == "true"


def test_the_site_and_the_walk_through_are_ignored_by_git(tmp_path: Path) -> None:
    """``mkdocs build`` writes site/; the README's walk-through writes its files and outputs."""
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    written = [
        "site/index.html",
        "msrun_log/worker_0.log",
        "report.html",
        "report_files/000-test/rank0.log",
        "job.trace.json",
        *page_files(README),
    ]
    for rel in written:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert git_status(tmp_path) == ["?? .gitignore"]
