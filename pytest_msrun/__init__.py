"""pytest-msrun: an orphan-free msrun launcher and a pytest plugin for multi-rank tests.

The package root stays import-light: the ``msrun`` launcher imports only what it needs,
so nothing heavy (pytest, psutil, NVML) is loaded on the launch path.
"""

from __future__ import annotations

__version__ = "0.2.0"
