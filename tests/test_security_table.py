"""docs/security.md's table of listeners and files, checked against the code so it cannot drift:
every listening socket the package makes goes through the one door, each door has its row, and
the bounds the rows state are the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pytest_msrun.control import door, transport, wire
from pytest_msrun.plugin.controller import debugserver, world

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pytest_msrun"
DOC = REPO / "docs" / "security.md"

# Where a listening socket is made, and who serves it. A new listener elsewhere fails the test
# below until it goes through a Door and has its row in the table.
LISTENERS = {
    "the control plane": ("control/transport.py", "DEFAULT_AUTH_TIMEOUT"),
    "a warm world's door": ("plugin/controller/world.py", "HELLO_TIMEOUT"),
    "the ranks' debugger": ("plugin/controller/debugserver.py", "HELLO_WAIT"),
}
# The helpers that make listening sockets, and the modules that may call them (handing the socket
# to one of the doors above: msrun binds the control plane's port before it starts it).
MAKERS = {"listen_socket": {"netaddr.py", "engine/ports.py", "control/scheduler.py"}, "rank_listener": set()}
MAKERS["rank_listener"] = {"netaddr.py", "plugin/controller/world.py", "plugin/controller/debugserver.py"}


def table(first_header: str) -> dict[str, list[str]]:
    """The rows of the table of docs/security.md whose first header is ``first_header``, by first cell."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows[cells[0]] = cells
    return rows


def _calls(name: str) -> dict[str, int]:
    """Modules of the package (relative paths) calling ``name(...)``, and how often."""
    out: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called == name:
                    rel = str(path.relative_to(PACKAGE))
                    out[rel] = out.get(rel, 0) + 1
    return out


def test_every_listener_goes_through_the_door_and_has_its_row():
    rows = table("listener")
    assert sorted(rows) == sorted(LISTENERS)
    assert sorted(_calls("Door")) == sorted(module for module, _ in LISTENERS.values())
    for maker, allowed in MAKERS.items():
        assert set(_calls(maker)) <= allowed, f"{maker} called outside {sorted(allowed)}: add the listener's row"
    # nothing else listens: no socket.listen / create_server outside the helpers
    assert set(_calls("create_server")) <= {"netaddr.py"}
    assert set(_calls("listen")) <= {"netaddr.py"}


def test_each_rows_bounds_are_the_codes():
    rows = table("listener")
    timeouts = {
        "DEFAULT_AUTH_TIMEOUT": transport.DEFAULT_AUTH_TIMEOUT,
        "HELLO_TIMEOUT": world.HELLO_TIMEOUT,
        "HELLO_WAIT": debugserver.HELLO_WAIT,
    }
    for name, (module, constant) in LISTENERS.items():
        bounds = rows[name][4]
        assert f"{door.PENDING_FLOOR} strangers" in bounds, (name, bounds)
        assert f"each kept {door.GRACE:g} s at least" in bounds, (name, bounds)
        assert f"hello within {timeouts[constant]:g} s" in bounds, (name, bounds)
        assert f"≤ {wire.HELLO_LIMIT // 1024} KiB" in bounds, (name, bounds)
        source = (PACKAGE / module).read_text()
        call = source[source.index("Door(") :]
        call = call[: call.index(")\n")]
        if constant != "DEFAULT_AUTH_TIMEOUT":  # the control plane's comes from MSRUN_AUTH_TIMEOUT, default that
            assert re.search(rf"timeout={constant}\b", call), (module, call)
    assert f"{debugserver.MAX_QUEUED} ranks waiting" in rows["the ranks' debugger"][4]
    assert "2 × `--worker_num`" in rows["the control plane"][4]


# The helpers of fileio.py that write (or make directories), and the raw calls that would bypass them.
WRITERS = {"open_output", "open_output_fd", "write_whole", "WholeFile", "private_dir", "make_dirs"}
# Raw writes left outside fileio.py, and why each is not a path another user controls.
RAW_ALLOWED = {
    "engine/containment.py": "cgroup files and directories (the kernel's, under the job's own cgroup)",
    "engine/earlystart.py": "a cgroup's cgroup.procs",
    "engine/processes.py": "/proc/self/comm",
    "engine/jobtoken.py": "the secret: a new file (O_EXCL) in a checked 0700 directory, linked into place",
    "engine/rankhook/sitecustomize.py": "fileio's rules inlined: the rank hook imports nothing of the package",
}


def _raw_writes() -> dict[str, list[str]]:
    """Calls that write a file or make a directory without fileio's helpers, by module."""
    out: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel == "fileio.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func, text = node.func, ast.unparse(node)
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            modes = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "mode")]
            raw = (
                (name == "open" and isinstance(func, ast.Name) and any(_writes(m) for m in modes))
                or (name == "open" and "os.open" in text and "O_CREAT" in text)
                or name in ("makedirs", "mkdir", "write_text", "write_bytes", "copyfile", "copy2", "mkstemp")
            )
            if raw:
                out.setdefault(rel, []).append(text[:80])
    return out


def _writes(mode: ast.AST) -> bool:
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax+")


def test_every_write_goes_through_fileio_and_every_writer_has_its_row():
    raw = _raw_writes()
    assert set(raw) <= set(RAW_ALLOWED), {m: calls for m, calls in raw.items() if m not in RAW_ALLOWED}
    files = table("file")
    named = {m.strip("` ") for row in files.values() for m in row[3].split(",")}
    writers = {module for helper in WRITERS for module in _calls(helper) if module != "fileio.py"}
    writers |= {m for m in RAW_ALLOWED if m.startswith("engine/jobtoken") or m.endswith("sitecustomize.py")}
    assert writers <= named, f"modules writing files with no row in docs/security.md: {sorted(writers - named)}"
    assert named <= writers | set(RAW_ALLOWED), f"rows naming modules that write nothing: {sorted(named - writers)}"
