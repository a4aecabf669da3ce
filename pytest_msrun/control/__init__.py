"""The control plane: its wire format, the builtin scheduler process, the in-rank API and observers.

Below the engine: it imports only the base modules (``pytest_msrun.netaddr``) and the standard
library, so the scheduler starts fast (``python -S -m pytest_msrun.control.scheduler``).
"""
