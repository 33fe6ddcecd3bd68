"""The served OpenAPI document and the server agree: schemathesis generates
requests from the document, valid ones and ones that break it, for every
operation, and runs all of its checks on the answers (the status is one the
document lists, the answer fits its schema, valid data is accepted and
invalid data refused, no server error ...)."""

import pytest
import schemathesis
from schemathesis import GenerationMode

from helpers import build_world

#: Per operation and mode: enough to find a disagreement, few enough for CI.
EXAMPLES = 8


@pytest.fixture
def document_under_test(app, api):
    # One record of every kind at id 1, so that generated requests that
    # name id 1 get past the 404 to the checks of their parameters.
    build_world(api)
    schema = schemathesis.openapi.from_wsgi("/v1/openapi.json", app)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True)
    return schema


schema = schemathesis.pytest.from_fixture("document_under_test")


@schema.parametrize()
def test_the_server_does_what_the_document_says(case, auth):
    case.call_and_validate(headers=auth)
