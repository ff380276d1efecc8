"""Closing a schema's objects (server/closed_schema.py): every object that lists properties
and says nothing of others gets `additionalProperties: false`, everywhere it can nest;
what a schema says itself is kept; the input is not changed."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from tokenmill.server.closed_schema import close_objects

NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
        "free": {"type": "object"},  # no properties: a free-form object stays open
        "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
        "ref": {"$ref": "#/$defs/point"},
    },
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
}


def test_every_listed_object_is_closed():
    before = copy.deepcopy(NESTED)
    closed = close_objects(NESTED)
    assert NESTED == before  # a copy
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert closed["$defs"]["point"]["additionalProperties"] is False


@pytest.mark.parametrize(("value", "valid"), [
    ({"city": "Paris", "where": {"lat": 1.0}}, True),
    ({"city": "Paris", "country": "France"}, False),  # a key the schema does not list
    ({"where": {"lat": 1.0, "lon": 2.0}}, False),
    ({"free": {"anything": 1}, "open": {"x": 1, "y": 2}}, True),
    ({"ref": {"x": 1, "y": 2}}, False),
])
def test_closed_schema_refuses_unlisted_keys(value, valid):
    closed = close_objects(NESTED)
    jsonschema.validate(value, NESTED)  # the original allows all of them
    if valid:
        jsonschema.validate(value, closed)
    else:
        with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
            jsonschema.validate(value, closed)
