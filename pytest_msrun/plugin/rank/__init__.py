"""The rank's side: code that runs inside a job's ranks - the records a rank's pytest writes, a warm
or forking world's serve loop, a rank's debugger, its clock in a suite.

It imports :mod:`..rule` and the plugin's shared modules; never the controller's side or the reports.
"""
