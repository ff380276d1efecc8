"""Schemathesis against the served /openapi.json: no 5xx, no undocumented status, content
type or response shape, for any input it can generate."""

from __future__ import annotations

import os

import pytest
import schemathesis  # noqa: E402  (the test extra installs it: a failure, never a skip)
from conftest import TINY_NAME, running_server, tiny_engine
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tokenmill.server.app import build_app  # noqa: E402

ADMIN = "sk-admin"  # the sleep routes answer only it; the other routes need no key here
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def api_schema(tiny_model):
    # a 64-token context keeps every generated request short
    engine = tiny_engine(tiny_model, max_model_len=64, num_kv_blocks=256)
    app = build_app(engine, [TINY_NAME], enable_sleep_mode=True, admin_api_key=ADMIN)
    with running_server(app) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


# (pytest 9 breaks schemathesis' lazy fixture loader, so operations are driven by hypothesis)
OPERATIONS = [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
    # sleep mode last, /wake_up after /sleep: the routes above run against an awake engine
    ("GET", "/is_sleeping"), ("POST", "/sleep"), ("POST", "/wake_up"),
]


def test_every_route_is_fuzzed(api_schema):
    documented = {(op.method.upper(), op.path) for op in
                  (r.ok() for r in api_schema.get_all_operations())}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_openapi_fuzz(api_schema, method, path):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "25")), deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def fuzz(case):
        case.call_and_validate(checks=CHECKS, headers={"x-api-key": ADMIN})

    fuzz()
