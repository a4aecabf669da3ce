"""``msrun_status.json``: what any JSON reader gets back is exactly what msrun wrote."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from pytest_msrun.engine.status import encode_status

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=8)
process = st.dictionaries(st.text(), values, max_size=6)
docs = st.dictionaries(st.text(), values, max_size=8).flatmap(
    lambda doc: st.one_of(st.just(doc), st.lists(process, max_size=5).map(lambda ps: {**doc, "processes": ps}))
)


@given(docs)
def test_status_encoding_reads_back_as_written(doc):
    text = encode_status(doc)
    assert json.loads(text) == doc == json.loads(json.dumps(doc))  # the oracle: json's own round trip
    assert text.endswith("}\n")


def test_status_file_puts_one_process_per_line():
    doc = {"state": "running", "processes": [{"rank": 0, "pid": 10}, {"rank": 1, "pid": 11}], "updated": 1.5}
    lines = encode_status(doc).splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    assert [line.strip().rstrip(",") for line in lines if '"rank"' in line] == [
        '{"rank": 0, "pid": 10}',
        '{"rank": 1, "pid": 11}',
    ]
