"""``from pytest_msrun import cluster``: the in-rank API, modelled on ``mindspore.communication``.

The implementation lives in the control-plane layer (:mod:`pytest_msrun.control.cluster`); this
is its public name.
"""

from __future__ import annotations

from pytest_msrun.control.cluster import *  # noqa: F403 - the public API, re-exported
from pytest_msrun.control.cluster import __all__  # noqa: F401
