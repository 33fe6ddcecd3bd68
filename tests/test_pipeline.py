"""The request pipeline: the envelope, parameters, identifiers and every error
code that the pipeline itself produces, on a real SQLite file."""

import io
import json
import logging
import sys

import pytest
import webtest

import campaignapi
from helpers import assert_envelope, assert_error, send

MAX_ID = 2**63 - 1


# --- the envelope --------------------------------------------------------------------------

def test_success_envelope_and_unique_response_ids(client, auth):
    first = send(client, "GET", "/v1/campaign/all", auth)
    second = send(client, "GET", "/v1/campaign/all", auth)
    assert assert_envelope(first, True, 200) == {"emt_campaign": [], "total": "0",
                                                 "limit": "100", "offset": "0"}
    assert_envelope(second, True, 200)
    assert first.json["responseId"] != second.json["responseId"]


def test_error_envelope_from_a_handler(client, auth):
    assert_error(send(client, "GET", "/v1/campaign/7", auth), 404, "not_found")


@pytest.mark.parametrize("path", ["/nowhere", "/v1/nothing/1", "/v1/campaign/1/2/3"])
def test_bottle_404_is_an_envelope(client, path):
    response = client.get(path, expect_errors=True)
    data = assert_error(response, 404, "not_found")
    assert path in data["message"]


def test_bottle_405_is_an_envelope_with_allow(client, auth):
    response = send(client, "PATCH", "/v1/campaign/1", auth)
    assert_error(response, 405, "method_not_allowed")
    allowed = {m.strip() for m in response.headers["Allow"].split(",")}
    assert {"GET", "PUT", "POST", "DELETE"} <= allowed
    assert "PATCH" not in allowed


def test_head_is_answered_like_get(client, auth):
    response = client.head("/v1/campaign/all", headers=auth)
    assert response.status_int == 200
    assert response.headers["X-Response-Id"]


def test_browser_gets_an_html_page(client, auth):
    accept = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    response = client.get("/v1/campaign/all", headers={**auth, "Accept": accept})
    assert response.status_int == 200
    assert response.content_type == "text/html"
    assert "<pre" in response.text and "&quot;success&quot;: true" in response.text
    assert response.headers["X-Response-Id"] in response.text
    error = client.get("/v1/campaign/all", headers={"Accept": accept}, expect_errors=True)
    assert error.status_int == 401 and error.content_type == "text/html"
    assert "unauthorized" in error.text


@pytest.mark.parametrize("accept", ["", "*/*", "application/json", "text/html;q=0.5,*/*",
                                    "application/json,text/html;q=0.9"])
def test_non_browsers_get_json(client, auth, accept):
    response = client.get("/v1/campaign/all", headers={**auth, "Accept": accept})
    assert_envelope(response, True, 200)


def test_response_id_is_in_the_log_line(client, auth, caplog):
    with caplog.at_level(logging.INFO, logger="campaignapi"):
        response = send(client, "GET", "/v1/campaign/3", auth)
    assert any(response.json["responseId"] in record.getMessage() for record in caplog.records)


def _raising_route(monkeypatch, handler, method="PUT", writes=None):
    """The real pipeline with one extra route whose handler we choose."""
    route = campaignapi.Route(method, "/test/{id}", "read", handler, "name:str", writes=writes)
    monkeypatch.setattr(campaignapi, "ROUTES", campaignapi.ROUTES + [route])


def test_internal_error_hides_the_traceback(monkeypatch, db, make_key, caplog):
    def broken(call, id):
        raise RuntimeError("SELECT secret FROM somewhere")

    _raising_route(monkeypatch, broken)
    client = webtest.TestApp(campaignapi.create_app(db))
    with caplog.at_level(logging.INFO, logger="campaignapi"):
        response = send(client, "PUT", "/v1/test/1", make_key(["read"]))
    data = assert_error(response, 500, "internal_error")
    assert "SELECT" not in response.text and "Traceback" not in response.text
    assert response.json["responseId"] in data["message"]
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "SELECT secret" in caplog.text or "SELECT secret" in logged
    assert response.json["responseId"] in logged


def test_a_failed_write_changes_nothing(monkeypatch, db, make_key):
    """The pipeline's transaction: a handler that writes and then fails leaves no trace."""
    def half(call, id):
        # internal: a record written as Create writes it
        campaignapi._insert_record(call.conn, "campaign", id, {
            "owner": call.account, "name": "half", "accountprofile": 1, "created": "x"})
        raise campaignapi.InvalidParameter("fails after the insert", field="name")

    _raising_route(monkeypatch, half)
    client = webtest.TestApp(campaignapi.create_app(db))
    assert_error(send(client, "PUT", "/v1/test/5", make_key(["read"])), 400, "invalid_parameter")
    conn = campaignapi.connect(db)
    assert conn.execute("SELECT count(*) FROM campaign").fetchone()[0] == 0
    conn.close()


# --- invalid_json, 413, 415 ----------------------------------------------------------------

@pytest.mark.parametrize("body", [b"{", b"{'name': 1}", b"[1, 2]", b'"text"', b"12", b"null",
                                  b'{"name": "\xff\xfe"}', b"\xef\xbb\xbf\xc3", b"[" * 100000,
                                  b'{"name": "\\ud800", "accountprofile": 1}', b'{"\\udfff": 1}'])
def test_invalid_json(client, auth, body):
    response = send(client, "PUT", "/v1/campaign/0", auth, body)
    assert_error(response, 400, "invalid_json")


def test_valid_surrogate_pairs_are_fine(api):
    api.put("/campaign/0", name="\U0001F600 sale", accountprofile=1)
    assert api.get("/campaign/1")["emt_campaign"][0]["name"] == "\U0001F600 sale"


def test_json_with_charset_is_accepted(client, auth):
    response = send(client, "PUT", "/v1/campaign/0", auth, {"name": "x", "accountprofile": 1},
                    content_type="application/json; charset=utf-8")
    assert assert_envelope(response, True, 200) == {"id": "1"}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_non_json_content_type_with_a_body_is_415(client, auth, content_type):
    response = send(client, "PUT", "/v1/campaign/0", auth, b'{"name": "x", "accountprofile": 1}',
                    content_type=content_type)
    assert_error(response, 415, "unsupported_media_type")


class Unreadable(io.RawIOBase):
    """A wsgi.input that fails if the app tries to read the body."""

    def readable(self):
        return True

    def read(self, *args):
        raise AssertionError("the body was read")

    readinto = readline = read


def call_wsgi(app, method, path, environ_extra):
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SERVER_NAME": "localhost",
               "SERVER_PORT": "80", "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr,
               "QUERY_STRING": "", "SCRIPT_NAME": "", "SERVER_PROTOCOL": "HTTP/1.1",
               "wsgi.version": (1, 0), "wsgi.multithread": False, "wsgi.multiprocess": False,
               "wsgi.run_once": False, **environ_extra}
    started = {}

    def start_response(status, headers, exc_info=None):
        started["status"], started["headers"] = status, {k.lower(): v for k, v in headers}

    body = b"".join(app(environ, start_response))
    return started["status"], started["headers"], json.loads(body)


def test_body_over_max_body_is_413_unread(db, make_key):
    app = campaignapi.create_app(db, max_body=100)
    headers = make_key()
    status, response_headers, envelope = call_wsgi(app, "PUT", "/v1/campaign/0", {
        "CONTENT_LENGTH": "101", "CONTENT_TYPE": "application/json", "wsgi.input": Unreadable(),
        "HTTP_AUTHORIZATION": headers["Authorization"]})
    assert status.startswith("413")
    assert envelope["success"] is False and envelope["data"]["error"] == "payload_too_large"
    assert response_headers["x-response-id"] == envelope["responseId"]


def test_chunked_body_over_max_body_is_413(db, make_key):
    app = campaignapi.create_app(db, max_body=100)
    headers = make_key()
    body = io.BytesIO(b'{"name": "' + b"x" * 500 + b'", "accountprofile": 1}')
    status, _, envelope = call_wsgi(app, "PUT", "/v1/campaign/0", {
        "HTTP_TRANSFER_ENCODING": "chunked", "CONTENT_TYPE": "application/json",
        "wsgi.input": body, "HTTP_AUTHORIZATION": headers["Authorization"]})
    assert status.startswith("413") and envelope["data"]["error"] == "payload_too_large"


def test_body_at_max_body_is_read(db, make_key):
    body = json.dumps({"name": "n" * 40, "accountprofile": 1}).encode()
    client = webtest.TestApp(campaignapi.create_app(db, max_body=len(body)))
    response = send(client, "PUT", "/v1/campaign/0", make_key(), body)
    assert assert_envelope(response, True, 200) == {"id": "1"}


def test_unauthenticated_big_body_is_401_unread(db):
    app = campaignapi.create_app(db, max_body=100)
    status, headers, envelope = call_wsgi(app, "PUT", "/v1/campaign/0", {
        "CONTENT_LENGTH": "50", "CONTENT_TYPE": "application/json", "wsgi.input": Unreadable()})
    assert status.startswith("401") and headers["www-authenticate"].startswith("Bearer")


def test_unknown_setting_is_refused(db):
    with pytest.raises(TypeError):
        campaignapi.create_app(db, max_bodies=1)


# --- parameters ----------------------------------------------------------------------------

def test_missing_parameter_names_it(api):
    data = api.put("/campaign/0", status=400, name="x")
    assert data["error"] == "missing_parameter" and "accountprofile" in data["message"]
    data = api.put("/datasource/0", status=400)
    assert data["error"] == "missing_parameter" and "name" in data["message"]


def test_unknown_parameter_names_it(api):
    data = api.put("/campaign/0", status=400, name="x", accountprofile=1, colour="red")
    assert data["error"] == "unknown_parameter" and "colour" in data["message"]
    assert "name" in data["allowed"]
    data = api.get("/campaign/all", status=400, limt=5)
    assert data["error"] == "unknown_parameter" and "limt" in data["message"]


@pytest.mark.parametrize("params,field", [
    ({"accountprofile": "one"}, "accountprofile"),
    ({"accountprofile": 1.5}, "accountprofile"),
    ({"accountprofile": True}, "accountprofile"),
    ({"accountprofile": -1}, "accountprofile"),
    ({"accountprofile": "-1"}, "accountprofile"),
    ({"accountprofile": MAX_ID + 1}, "accountprofile"),
    ({"accountprofile": str(MAX_ID + 1)}, "accountprofile"),
    ({"accountprofile": "1e3"}, "accountprofile"),
    ({"accountprofile": " 1"}, "accountprofile"),
    ({"accountprofile": "\u0661"}, "accountprofile"),       # an Arabic-Indic digit one
    ({"accountprofile": None}, "accountprofile"),
    ({"enabled": "yes"}, "enabled"),
    ({"enabled": 2}, "enabled"),
    ({"enabled": [1]}, "enabled"),
    ({"archiveemail": "not an address"}, "archiveemail"),
    ({"archiveemail": "a@b"}, "archiveemail"),
    ({"archiveemail": 5}, "archiveemail"),
    ({"archiveemail": "a@example.com\r\nBcc: x@example.com"}, "archiveemail"),
    ({"name": 5}, "name"),
    ({"name": ["x"]}, "name"),
    ({"name": None}, "name"),
    ({"name": "a\x00b"}, "name"),
    ({"name": "two\nlines"}, "name"),
    ({"name": "two\rlines"}, "name"),
    ({"description": "nul\x00"}, "description"),
    ({"thumbnail": "a\nb"}, "thumbnail"),
])
def test_invalid_parameter(api, params, field):
    data = api.put("/campaign/0", status=400, **{"name": "x", "accountprofile": 1, **params})
    assert data["error"] == "invalid_parameter", data
    assert data["field"] == field


def test_multi_line_text_is_allowed_where_declared(api):
    api.put("/campaign/0", name="x", accountprofile=1, description="line one\nline two")
    assert api.get("/campaign/1")["emt_campaign"][0]["description"] == "line one\nline two"


def test_invalid_choice_and_list(api):
    data = api.put("/datasource/0", status=400, name="d", origin="elsewhere")
    assert data["error"] == "invalid_parameter" and data["allowed"] == ["import", "signup", "api"]
    data = api.put("/datasource/0", status=400, name="d", fields="email")
    assert data["error"] == "invalid_parameter" and data["field"] == "fields"
    data = api.put("/datasource/0", status=400, name="d", fields={"name": "x"})
    assert data["error"] == "invalid_parameter"


@pytest.mark.parametrize("flag,stored", [("1", "1"), (1, "1"), (True, "1"), ("true", "1"),
                                         ("0", "0"), (0, "0"), (False, "0"), ("false", "0")])
def test_flag_spellings(api, flag, stored):
    api.put("/campaign/0", name="x", accountprofile="7", enabled=flag)
    record = api.get("/campaign/1")["emt_campaign"][0]
    assert record["enabled"] == stored and record["accountprofile"] == "7"


def test_params_from_the_query_string(client, auth):
    response = send(client, "PUT", "/v1/campaign/0?name=From%20query&accountprofile=3&enabled=0",
                    auth)
    assert assert_envelope(response, True, 200) == {"id": "1"}
    record = send(client, "GET", "/v1/campaign/1", auth).json["data"]["emt_campaign"][0]
    assert (record["name"], record["accountprofile"], record["enabled"]) == ("From query", "3", "0")


def test_body_wins_over_query(client, auth):
    response = send(client, "PUT", "/v1/campaign/0?name=from+query&accountprofile=2", auth,
                    {"name": "from body"})
    assert_envelope(response, True, 200)
    record = send(client, "GET", "/v1/campaign/1", auth).json["data"]["emt_campaign"][0]
    assert (record["name"], record["accountprofile"]) == ("from body", "2")


def test_query_parameter_given_twice_is_refused(client, auth):
    response = send(client, "GET", "/v1/campaign/all?limit=1&limit=2", auth)
    assert assert_error(response, 400, "invalid_parameter")["field"] == "limit"


def test_query_string_that_is_not_utf8(client, auth):
    response = send(client, "GET", "/v1/campaign/all?limit=%FF", auth)
    assert_error(response, 400, "invalid_parameter")


def test_get_with_a_json_body(api):
    for number in range(3):
        api.put("/campaign/0", name=f"c{number}", accountprofile=1)
    data = api.get("/campaign/all", limit=1, offset=1)
    assert [c["name"] for c in data["emt_campaign"]] == ["c1"]
    assert (data["total"], data["limit"], data["offset"]) == ("3", "1", "1")


def test_delete_with_params_in_the_query(client, auth, api):
    api.put("/datasource/0", name="d")
    response = send(client, "DELETE", "/v1/datasource/1?id=1", auth)
    assert assert_envelope(response, True, 200) is True


def test_empty_body_and_whitespace_body_are_no_params(client, auth):
    for body in (b"", b"  \n"):
        response = client.request("/v1/campaign/all", method="GET", headers=auth, body=body,
                                  expect_errors=True)
        assert_envelope(response, True, 200)


# --- identifiers ---------------------------------------------------------------------------

@pytest.mark.parametrize("method,path", [
    ("GET", "/campaign/abc"), ("GET", "/campaign/-1"), ("GET", "/campaign/1.0"),
    ("GET", "/campaign/import"), ("GET", f"/campaign/{MAX_ID + 1}"),
    ("GET", "/campaign/99999999999999999999999"), ("GET", "/campaign/%D9%A1"),
    ("GET", "/campaign/ALL"), ("GET", "/datasource/abc"), ("GET", "/datasource/0x1"),
    ("PUT", "/campaign/all"), ("POST", "/campaign/all"), ("DELETE", "/campaign/all"),
    ("PUT", "/campaign/abc"), ("PUT", "/datasource/all"), ("PUT", "/datasource/import"),
    ("POST", "/datasource/import"), ("DELETE", "/datasource/all"), ("POST", "/datasource/-5"),
])
def test_invalid_identifier(client, auth, method, path):
    data = assert_error(send(client, method, "/v1" + path, auth), 400, "invalid_identifier")
    assert data["field"] == "id"


def test_largest_identifier_is_valid(api):
    # Any int64 reads; a create chooses at most 2^53 - 1 (tests/test_explicit_ids.py).
    assert api.get(f"/campaign/{MAX_ID}", status=404)["error"] == "not_found"
    largest = campaignapi.MAX_EXPLICIT_ID
    assert api.put(f"/campaign/{largest}", name="last", accountprofile=1) == {"id": str(largest)}
    assert api.get(f"/campaign/{largest}")["emt_campaign"][0]["id"] == str(largest)


def test_leading_zeros_are_the_same_id(api):
    api.put("/campaign/0", name="x", accountprofile=1)
    assert api.get("/campaign/001")["emt_campaign"][0]["id"] == "1"


# --- pagination ----------------------------------------------------------------------------

def test_pagination_limits(api):
    for number in range(5):
        api.put("/datasource/0", name=f"d{number}")
    page = api.get("/datasource/all", limit=2, offset=3)
    assert [d["name"] for d in page["datasource"]] == ["d3", "d4"]
    assert (page["total"], page["limit"], page["offset"]) == ("5", "2", "3")
    assert api.get("/datasource/all", offset=10)["datasource"] == []
    assert api.get("/datasource/all")["limit"] == "100"
    assert api.get("/datasource/all", limit=1000)["limit"] == "1000"
    for bad in (0, 1001, -1, "x"):
        assert api.get("/datasource/all", status=400, limit=bad)["field"] == "limit"
    assert api.get("/datasource/all", status=400, offset=-1)["field"] == "offset"


# --- embedding -------------------------------------------------------------------------------

def _base_url_route(monkeypatch):
    route = campaignapi.Route("GET", "/test/base", "read", lambda call: {"url": call.base_url})
    monkeypatch.setattr(campaignapi, "ROUTES", campaignapi.ROUTES + [route])


def test_mounted_under_a_prefix(monkeypatch, db, make_key):
    import bottle

    _base_url_route(monkeypatch)
    parent = bottle.Bottle()
    parent.route("/hello", callback=lambda: "parent page")
    parent.mount("/email/", campaignapi.create_app(db))
    client = webtest.TestApp(parent)
    headers = make_key()
    assert client.get("/hello").text == "parent page"
    response = client.put_json("/email/v1/campaign/0", {"name": "x", "accountprofile": 1},
                               headers=headers)
    assert assert_envelope(response, True, 200) == {"id": "1"}
    assert client.get("/email/v1/test/base", headers=headers).json["data"]["url"] == \
        "http://localhost:80/email"
    # Bottle merges a mounted app's routes into the parent: our 404 and 405
    # still answer the envelope under the prefix.
    assert_error(client.get("/email/v1/nothing", expect_errors=True), 404, "not_found")
    # The root redirects to the index (GET /v1/).
    assert client.get("/email/", status=302).headers["Location"] == "http://localhost:80/email/v1/"
    assert client.get("/email/v1/" + client.get("/email/v1/").json["data"]["openapi"]).json[
        "openapi"].startswith("3.1")
    response = client.request("/email/v1/campaign/1", method="PATCH", expect_errors=True)
    assert_error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]


def test_plain_wsgi_mount_and_public_url(monkeypatch, db, make_key):
    _base_url_route(monkeypatch)
    inner = campaignapi.create_app(db)

    def host(environ, start_response):      # any WSGI host: /api is the script name
        path = environ["PATH_INFO"]
        assert path.startswith("/api/")
        environ = {**environ, "SCRIPT_NAME": "/api", "PATH_INFO": path[len("/api"):]}
        return inner(environ, start_response)

    client = webtest.TestApp(host)
    headers = make_key()
    assert client.get("/api/v1/test/base", headers=headers).json["data"]["url"] == \
        "http://localhost:80/api"
    assert_error(client.get("/api/v1/nothing", expect_errors=True), 404, "not_found")
    public = webtest.TestApp(campaignapi.create_app(db, public_url="https://mail.example.com/x/"))
    assert public.get("/v1/test/base", headers=headers).json["data"]["url"] == \
        "https://mail.example.com/x"
