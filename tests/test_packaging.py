"""What installing this project puts on PATH: never a script that another distribution owns."""

from __future__ import annotations

from importlib.metadata import distribution


def test_console_scripts_never_clash_with_mindspore():
    scripts = {ep.name for ep in distribution("pytest-msrun").entry_points if ep.group == "console_scripts"}
    assert "msrun" not in scripts, "msrun is MindSpore's; pip would overwrite it, and uninstalling ours delete it"
    assert {"pmsrun", "msrun-topology", "msrun-gen-bind-json", "msrun-numa-wrap"} <= scripts
    assert {ep.name for ep in distribution("pytest-msrun").entry_points if ep.group == "pytest11"} == {"msrun"}
