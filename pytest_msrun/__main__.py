"""``python -m pytest_msrun`` is the ``msrun`` command."""

from __future__ import annotations

from pytest_msrun.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
