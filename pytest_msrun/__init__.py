"""pytest-msrun: an orphan-free msrun launcher and a pytest plugin for multi-rank tests.

The package root stays import-light: the ``msrun`` launcher imports only what it needs,
so nothing heavy (pytest, psutil, NVML) is loaded on the launch path.

PYTEST_DONT_REWRITE: this package is loaded before pytest starts in a rank forked from the fork
server (``engine/template.py``), so pytest must not expect to rewrite this module's asserts (it has
none); its submodules are rewritten as usual where pytest imports them.
"""

from __future__ import annotations

__version__ = "0.2.0"
