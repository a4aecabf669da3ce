"""The launch engine: flags -> config -> plan (pure) -> agent (processes, supervision) -> result.

Imports go one way: the engine uses the control plane's wire format, binding and the base
modules (``pytest_msrun.cpulist``, ``pytest_msrun.netaddr``); it never imports the pytest plugin.
"""
