"""wire.jsonwire: orjson's speed, the standard library's meaning."""

import json
import math

import pytest
from hypothesis import given, strategies as st

from wire import jsonwire

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@given(values)
def test_reads_and_writes_what_the_standard_library_does(value):
    text = json.dumps(value)
    assert jsonwire.loads(text.encode()) == json.loads(text)
    assert json.loads(jsonwire.dumps(value)) == value  # integers of any size included


def test_what_orjson_refuses_takes_the_standard_librarys_path():
    for big in (2 ** 64, -(2 ** 63) - 1, 123456789012345678901234567890):
        assert jsonwire.loads(b'{"x": %d}' % big) == {"x": big}  # orjson: a float
    assert jsonwire.loads(b'{"x": "%d"}' % 2 ** 64) == {"x": str(2 ** 64)}
    assert math.isnan(jsonwire.loads(b'[NaN]')[0]) and jsonwire.loads(b'[Infinity]') == [math.inf]
    assert jsonwire.loads(b'"a\\ud800"') == "a\ud800"
    assert jsonwire.loads('{"k": "\u00e9"}'.encode("utf-16")) == {"k": "\u00e9"}
    assert jsonwire.dumps({"x": 2 ** 70}) == b'{"x":1180591620717411303424}'
    assert jsonwire.dumps(["a\ud800"]) == b'["a\\ud800"]'
    assert jsonwire.dumps([math.inf, math.nan]) == b"[null,null]"  # json: Infinity, NaN


def test_writes_compact_utf8_and_bad_input_raises_json_errors():
    assert jsonwire.dumps({"a": [1, "\u00e9"]}) == '{"a":[1,"\u00e9"]}'.encode()
    with pytest.raises(json.JSONDecodeError, match=r"Expecting ',' delimiter: line 1 column 9 \(char 8\)"):
        jsonwire.loads(b'{"a": 1 "b": 2}')
    with pytest.raises(json.JSONDecodeError, match="Expecting value: line 1 column 1"):
        jsonwire.loads(b"")
