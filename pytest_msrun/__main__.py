"""``python -m pytest_msrun`` is the ``pmsrun`` command (this project's msrun)."""

from __future__ import annotations

from pytest_msrun.entry import run

if __name__ == "__main__":
    run()
