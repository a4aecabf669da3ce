"""``from pytest_msrun import dryrun``: what a simulated rank of a torch strategy holds and sends.

The implementation lives in the control-plane layer (:mod:`pytest_msrun.control.torchdry`); this
is its public name.
"""

from __future__ import annotations

from pytest_msrun.control.torchdry import *  # noqa: F403 - the public API, re-exported
from pytest_msrun.control.torchdry import __all__  # noqa: F401
