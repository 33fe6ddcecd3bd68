"""Bad input: hostile and broken input gets a clear 4xx with the API's
code, never a 500 -- wrong types for every parameter of every route, huge
and deeply nested JSON, invalid UTF-8, NUL bytes, line breaks in header
values, ids past 2^63, negative paging."""

import re
import socket

import pytest

import campaignapi
from helpers import (KEYED_ROUTES, assert_error, filled, keyed_client, make_datasource,
                     make_signup_list, recipients, route_id, scalar, send)
from conftest import Api, serving

MAX_ID = campaignapi.MAX_ID


# --- wrong types for every parameter of every route --------------------------------------

#: Values of the wrong type for each parameter type (and a choice) of the route table.
WRONG = {
    "str": [5, ["x"], {"a": 1}, None, "two\nlines", "nul\x00"],
    "text": [5, ["x"], {"a": 1}, None, "nul\x00"],
    "int": ["abc", -1, 1.5, True, None, [1], MAX_ID + 1, str(MAX_ID + 1), "1e3", " 1", "\uff11"],
    "limit": ["abc", -1, 0, 1001, 1.5, True, None, [1], "1e3", " 1"],
    "flag": ["maybe", 2, -1, None, [1], "yes please"],
    "email": [5, "not an address", "a@b", "x@example.com\r\nBcc: y@example.com", ["a@x.com"]],
    "list": ["x", 5, {"a": 1}, None, True],
    "object": ["x", 5, ["a"], None, True],
    "ref": ["abc", -1, 1.5, True, [1], MAX_ID + 1, "1e3"],
    "scalar": [[1], {"a": 1}, None, "two\nlines"],
    "data": [5, None, True, 1.5],
    "time": [[1], {"a": 1}, None, True, "two\nlines", "tomorrow", -1, 1.5],
    "choice": ["no-such-choice", 5, None, ["all"]],
}


def wrong_cases():
    for route in KEYED_ROUTES:
        for param in route.params.values():
            kind = "choice" if param.choices else param.type
            for value in WRONG[kind]:
                yield pytest.param(route, param.name, value,
                                   id=f"{route_id(route)} {param.name}={value!r}"[:120])


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One app and one full key for the read-only matrices (a fresh app per
    case would make the matrix slow)."""
    db = str(tmp_path_factory.mktemp("input") / "campaignapi.db")
    client, auth = keyed_client(db)
    # Records 1 exist, so that a handler's own checks are reached too.
    send(client, "PUT", "/v1/datasource/1", auth, body={"name": "d"})
    send(client, "PUT", "/v1/campaign/1", auth, body={"name": "c", "accountprofile": 1})
    return client, auth, db


@pytest.mark.parametrize("route,name,value", list(wrong_cases()))
def test_a_wrong_type_for_any_parameter_is_400_naming_it(shared, route, name, value):
    client, auth, db = shared
    response = send(client, route.method, filled(route), auth, body={name: value})
    data = assert_error(response, 400, "invalid_parameter")
    assert data["field"] == name


def test_every_route_parameter_type_has_wrong_values():
    kinds = {"choice" if p.choices else p.type for r in KEYED_ROUTES for p in r.params.values()}
    assert kinds <= set(WRONG)


@pytest.mark.parametrize("route", [r for r in KEYED_ROUTES if "limit" in r.params], ids=route_id)
@pytest.mark.parametrize("params", [{"limit": -1}, {"offset": -1}, {"limit": "-5"},
                                    {"offset": "-0"}, {"limit": 0}, {"limit": 1001},
                                    {"offset": MAX_ID + 1}])
def test_negative_or_out_of_range_paging_is_400(shared, route, params):
    client, auth, db = shared
    query = "&".join(f"{k}={v}" for k, v in params.items())
    path = filled(route, lambda m: "all" if "all" in m.group() else "1")
    response = send(client, route.method, path + "?" + query, auth)
    data = assert_error(response, 400, "invalid_parameter")
    assert data["field"] == next(iter(params))


# --- identifiers past 2^63 ---------------------------------------------------------------

def id_cases():
    for route in KEYED_ROUTES:
        names = re.findall(r"\{(\w+)(?::([\w|]+))?\}", route.path)
        for index, (name, allowed) in enumerate(names):
            if "name" in (allowed or "int").split("|"):
                continue
            for bad in (str(MAX_ID + 1), "1" * 40, "-1", "1.0", "0x10", "%C2%B2"):
                parts = iter(range(len(names)))
                path = "/v1" + re.sub(r"\{[^}]*\}",
                                      lambda m: bad if next(parts) == index else "1", route.path)
                yield pytest.param(route, path, name, id=f"{route_id(route)} {name}={bad}")


@pytest.mark.parametrize("route,path,name", list(id_cases()))
def test_identifiers_that_are_not_int64_are_400(shared, route, path, name):
    client, auth, db = shared
    data = assert_error(send(client, route.method, path, auth), 400, "invalid_identifier")
    assert data["field"] == name


# --- bodies: size, depth, encoding --------------------------------------------------------

@pytest.mark.parametrize("route", KEYED_ROUTES, ids=route_id)
def test_deeply_nested_json_is_400_not_a_crash(shared, route):
    client, auth, db = shared
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        assert_error(send(client, route.method, filled(route), auth, body=raw), 400,
                     "invalid_json")


@pytest.mark.parametrize("route", KEYED_ROUTES, ids=route_id)
def test_a_body_just_over_max_body_is_413(tmp_path, route):
    db = str(tmp_path / "small.db")
    client, auth = keyed_client(db, max_body=1000)
    body = b'{"name": "' + b"x" * 988 + b'"}'
    assert len(body) == 1000
    assert send(client, route.method, filled(route), auth, body=body).status_int != 413
    assert_error(send(client, route.method, filled(route), auth, body=body + b" "), 413,
                 "payload_too_large")


INVALID_BODIES = [
    b'{"name": "\xff\xfe"}',               # not UTF-8
    b'{"name": "\xed\xa0\x80"}',            # an encoded surrogate
    b'{"name": "\\ud800"}',                 # a lone surrogate escape
    b"\xef\xbb\xbf\xef\xbb\xbf{}",          # two BOMs
    b'{"name": "x"} trailing',
    b'{"name": NaN',
    b"\x00{}",
    b'"just a string"', b"[]", b"null", b"42",
]


@pytest.mark.parametrize("route", KEYED_ROUTES, ids=route_id)
def test_invalid_json_bodies_are_400(shared, route):
    client, auth, db = shared
    for raw in INVALID_BODIES:
        response = send(client, route.method, filled(route), auth, body=raw)
        assert_error(response, 400, "invalid_json")


def test_nul_bytes_are_refused_in_every_string_parameter(api):
    data = api.put("/message/0", status=400, name="a\x00b")
    assert data["error"] == "invalid_parameter" and data["field"] == "name"
    assert api.get("/datasource/all", status=400, **{"a\x00": 1})["error"] == "unknown_parameter"


@pytest.mark.parametrize("name", ["name", "subject", "fromname", "fromaddress", "replyto"])
@pytest.mark.parametrize("newline", ["\r\n", "\n", "\r"])
def test_line_breaks_in_values_that_become_email_headers_are_400(api, name, newline):
    value = f"x@example.com{newline}Bcc: victim@example.org"
    data = api.put("/message/0", status=400, **{name: value})
    assert (data["error"], data["field"]) == ("invalid_parameter", name)


def test_line_breaks_in_campaign_and_profile_headers_are_400(api):
    for path, params in (("/accountprofile/0", {"fromname": "A\r\nBcc: b@example.org"}),
                         ("/campaign/0", {"name": "c", "accountprofile": 1,
                                          "archiveemail": "a@example.com\nBcc: b@example.org"})):
        assert api.put(path, status=400, **params)["error"] == "invalid_parameter"


@pytest.mark.parametrize("header", [
    "Bearer abc\r\nX-Injected: 1", "Bearer \xe9\xff", "Bearer caf\xc3", "\x00Bearer x",
    "Bearer " + "x" * 100_000])
def test_odd_authorization_headers_are_401_not_500(client, header):
    response = client.get("/v1/campaign/all", extra_environ={"HTTP_AUTHORIZATION": header},
                          expect_errors=True)
    assert_error(response, 401, "unauthorized")


@pytest.mark.parametrize("accept", ["text/html\xe9\xff", "\xc3", "text/html;q=x\r\n"])
def test_odd_accept_headers_are_answered(client, auth, accept):
    response = client.get("/v1/campaign/all", headers=auth, extra_environ={"HTTP_ACCEPT": accept},
                          expect_errors=True)
    assert response.status_int == 200, response.text


def test_raw_header_injection_on_a_real_server_is_a_4xx(app, auth):
    """A request whose header holds a bare CR or LF never reaches the app as
    two headers: the server refuses it (4xx), it never answers 5xx."""
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        for header in (b"Authorization: Bearer x\rX-Evil: 1", b"X-A: 1\nX-B: 2\x00"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /v1/campaign/all HTTP/1.1\r\nHost: x\r\n" + header +
                             b"\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            status = int(answer.split(b" ", 2)[1])
            assert 400 <= status < 500, answer[:200]


# --- values that overflow or no longer fit -------------------------------------------------

def test_a_huge_json_number_for_an_integer_field_is_skipped_not_a_crash(api):
    ds = make_datasource(api, fields=[{"name": "n", "type": "integer"}])
    answer = api.put(f"/datasource/{ds}/import/0", name="i", originalfile="f.json",
                     __uploadtype__="json", __uploaddata__=[
                         {"email": "big@example.com", "n": 1e300},
                         {"email": "neg@example.com", "n": -1e19},
                         {"email": "ok@example.com", "n": 12.0},
                         {"email": "huge@example.com", "n": 10**30}])
    record = api.get(f"/datasource/{ds}/import/{answer['id']}")["import"]
    assert (record["inserted"], record["skipped"]) == ("1", "3")
    assert recipients(api, ds)["ok@example.com"]["fields"]["n"] == "12"


def test_a_segment_value_that_overflows_an_integer_field_is_409(api):
    # 409: whether a value fits depends on the stored field's type.
    ds = make_datasource(api, fields=[{"name": "n", "type": "integer"}])
    for value in (1e300, 10**30, "1e300"):
        data = api.put("/segment/0", status=409, name="s", datasources=[ds], match="all",
                       conditions=[{"field": "n", "op": "gt", "value": value}])
        assert data["error"] == "conflict"
    created = api.put("/segment/0", name="s", datasources=[ds], match="all",
                      conditions=[{"field": "n", "op": "gt", "value": 5.0}])
    assert api.get(f"/segment/{created['id']}")["segment"]["size"] == "0"


def test_a_segment_whose_field_was_retyped_still_answers(api):
    """A condition stored for a text field stays readable when the field
    later becomes an integer: it matches nothing (ne: everything), never 500."""
    ds = make_datasource(api, fields=[{"name": "t", "type": "text"}])
    api.put(f"/datasource/{ds}/import/0", name="i", originalfile="f.json",
            __uploadtype__="json", __uploaddata__=[{"email": "a@example.com"}])
    eq = api.put("/segment/0", name="eq", datasources=[ds], match="all",
                 conditions=[{"field": "t", "op": "eq", "value": "abc"}])["id"]
    ne = api.put("/segment/0", name="ne", datasources=[ds], match="all",
                 conditions=[{"field": "t", "op": "ne", "value": "abc"}])["id"]
    api.get(f"/datasource/{ds}/modify/t", new="t", type="integer")
    assert api.get(f"/segment/{eq}")["segment"]["size"] == "0"
    assert api.get(f"/segment/{ne}")["segment"]["size"] == "1"
    assert len(api.get("/segment/all")["segment"]) == 2


@pytest.mark.parametrize("path", ["/v1/campaign/%FF1", "/v1/campaign/1%C3", "/v1/datasource/%801"])
def test_a_path_that_is_not_utf8_names_no_record(api, client, auth, path):
    api.put("/campaign/0", name="c", accountprofile=1)
    api.put("/datasource/0", name="d")
    assert_error(client.get(path, headers=auth, expect_errors=True), 404, "not_found")


# --- public routes (no key): hostile input is a 4xx or a page, never a 5xx ------------------

#: The routes anyone can call: the sign-up form and its post, confirm and
#: unsubscribe links, downloads, the OpenAPI document.
PUBLIC_ROUTES = [route for route in campaignapi.ROUTES if not route.level]

FORM, JSON = "application/x-www-form-urlencoded", "application/json"
#: Bodies as a form post or JSON, broken in every way we know.
HOSTILE_BODIES = [(raw, JSON) for raw in INVALID_BODIES] + [
    (b"", None), (b"[" * 100_000 + b"]" * 100_000, JSON),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, JSON),
    (b'{"email": ["a@example.com"]}', JSON), (b'{"email": {"a": 1}}', JSON),
    (b'{"email": "a@example.com", "_website": {"x": [1]}}', JSON),
    (b"email=%FF%FE", FORM), (b"email=" + b"a" * 100_000 + b"%40example.com", FORM),
    (b"%" * 1000, FORM), (b"email=a%40example.com&" * 500, FORM),
    (b"email=a%40example.com%0D%0ABcc%3A+b%40example.com", FORM),
    (b"email=a%40example.com&first=%00", FORM), (b"=&=&&&", FORM),
    (b"email=x" * 20_000, FORM),
    (b"--x\r\nContent-Disposition: form-data; name=email\r\n\r\na@example.com\r\n--x--",
     "multipart/form-data; boundary=x"),
    (b"email=a@example.com", "text/plain"), (b"\xff" * 100, "application/octet-stream"),
]


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """An app whose datasource 1 takes sign-ups (no per-client limit here)."""
    db = str(tmp_path_factory.mktemp("public") / "campaignapi.db")
    client, auth = keyed_client(db, signup_rate=0)
    make_signup_list(Api(client, auth))
    secret = client.app.config["campaignapi.service"].secret
    tokens = {"confirm": campaignapi.sign_token(secret, "confirm", 5, 10**6),
              "unsubscribe": campaignapi.unsubscribe_token(secret, 1, "x@example.com")}
    return client, db, tokens


def public_paths(route, tokens):
    word = route.path.split("/")[1]
    good = {"subscribe": "1", "confirm": tokens["confirm"],
            "unsubscribe": tokens["unsubscribe"], "download": "x"}.get(word, "")
    for value in (good, "0", str(MAX_ID + 1), "1" * 40, "-1", "abc", "%C2%B2", "%FF", "x" * 5000,
                  "..%2F..%2Fetc", "1%00"):
        yield "/v1" + re.sub(r"\{[^}]*\}", value, route.path)


@pytest.mark.parametrize("route", PUBLIC_ROUTES, ids=route_id)
def test_public_routes_never_answer_5xx_to_hostile_input(public, route):
    client, db, tokens = public
    for path in public_paths(route, tokens):
        for raw, content_type in HOSTILE_BODIES:
            response = client.request(path, method=route.method, body=raw,
                                      content_type=content_type, expect_errors=True,
                                      headers={"Accept": "text/html"})
            assert response.status_int < 500, (path[:80], raw[:80], response.text[:300])
    assert scalar(db, "SELECT count(*) FROM recipient") == 0


def test_a_sign_up_body_over_64_kib_is_413(public):
    client, db, tokens = public
    body = b'{"email": "a@example.com", "first": "' + b"x" * 70_000 + b'"}'
    assert_error(client.post("/v1/subscribe/1", body, content_type=JSON, expect_errors=True),
                 413, "payload_too_large")
