"""The served OpenAPI document and the server agree: schemathesis generates
requests from the document, valid ones and ones that break it, for every
operation, and runs all of its checks on the answers (the status is one the
document lists, the answer fits its schema, valid data is accepted and
invalid data refused, no server error ...)."""

import ipaddress
import socket

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from conftest import Api
from helpers import build_world, keyed_client, new_idempotency_key

#: Per operation and mode: enough to find a disagreement, few enough for CI.
EXAMPLES = 8


@pytest.fixture
def document_under_test(db, monkeypatch):
    # Generated webhook URLs name random hosts: answer their look-up at once
    # (the test machine has no DNS to wait for; a name that does not resolve
    # is answered 409, as documented).
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **options):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return real(host, *args, **options)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    # The default settings: the document types the webhook URLs whose host is
    # a refused literal address (loopback, private ...), and names do not
    # resolve here, so no URL reaches the refusal of what DNS says.
    client, auth = keyed_client(db)
    # One record of every kind at id 1, so that generated requests that
    # name id 1 get past the 404 to the checks of their parameters.
    build_world(Api(client, auth))
    schema = schemathesis.openapi.from_wsgi("/v1/openapi.json", client.app)
    schema.auth_headers = auth
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True)
    return schema


schema = schemathesis.pytest.from_fixture("document_under_test")


def unreadable_upload(case, response):
    """An import whose upload the document can only type as a string, and
    whose bytes cannot be read as one (not base64, no email column): 422
    invalid_data, as the API says for data that cannot be read at all, with
    the rule in the parameter's words, not in a schema."""
    return (case.method == "PUT" and case.operation.path.endswith("/import/{child_id}")
            and response.status_code == 422
            and response.json()["data"]["error"] == "invalid_data")


@schema.parametrize()
def test_the_server_does_what_the_document_says(case, document_under_test):
    case, headers = new_idempotency_key(case), document_under_test.auth_headers
    response = case.call(headers=headers)
    excluded = [positive_data_acceptance] if unreadable_upload(case, response) else []
    case.validate_response(response, headers=headers, excluded_checks=excluded,
                           transport_kwargs={"headers": dict(headers)})
