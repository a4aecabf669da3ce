"""The reports: how verdicts and records are shown - merged pytest reports, the suite's table, hang
reports, the HTML page, traces, what ranks recorded beyond their reports.

It imports :mod:`..rule` and the plugin's shared modules; never the controller's or the rank's side.
"""
