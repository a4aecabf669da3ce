"""The pytest plugin, split by role.

* :mod:`.marker` - the ``msrun`` marker, validated.
* :mod:`.controller` - the pytest session that launches a job per marked test and merges.
* :mod:`.job` - one test's job: msrun invocations, timeout, stacks, rank statuses.
* :mod:`.merge` - per-rank records -> one report per phase.
* :mod:`.rank` - inside a job (a rank's pytest): records, inline/skip decisions.
* :mod:`.records` - the per-rank JSON-lines record format (shared by both sides).
* :mod:`.pool` - ports and devices leased across concurrent (xdist) sessions.
* :mod:`.fixtures` - ``rank``, ``world_size``, ``local_rank``, ``msrun``, ``msrun_tmp_path``.
"""
