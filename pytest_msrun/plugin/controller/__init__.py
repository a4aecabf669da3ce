"""The controller's side: code that runs in the pytest session driving marked tests - the runner and
its attempts, worlds and jobs, the fork server, the debugger's door, the reports it logs.

It imports :mod:`..rule`, :mod:`..reports` and the plugin's shared modules; never :mod:`..rank`.
"""
