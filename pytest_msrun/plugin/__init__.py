"""The pytest plugin, split where its code runs.

* :mod:`.controller` - the pytest session that runs marked tests: the runner, worlds, jobs, reporting.
* :mod:`.rank` - inside a job's ranks: their records, a world's serve loop, their debugger.
* :mod:`.rule` - pure data and decisions: records, a test's record, the verdict rule (no pytest).
* :mod:`.reports` - how verdicts are shown: merged reports, the suite table, the page, traces.

The modules here are what both sides share: the marker, this process's role (:mod:`.env`), the
options carried into ranks, the links across the process boundary, the fixtures, a marker's env
per test, coverage data, memory rules, the streams. ``tests/test_layout.py`` holds the imports to
these lines.
"""
