"""Security: every route x every kind of bad credential and every missing
access level gets the API's answer; another account's records are 404
everywhere and stay untouched; secrets are never stored or logged in clear;
download tokens are unguessable, expire and refuse forgeries; no error body
shows SQL or a traceback."""

import datetime
import logging
import math
import re
import sqlite3
import subprocess
import sys
import urllib.parse

import pytest

import campaignapi
from conftest import Api
from helpers import (KEYED_ROUTES, assert_error, b64, build_world, filled, route_id, send,
                     snapshot, unb64)

LEAKS = ("SELECT", "INSERT", "UPDATE ", "sqlite", "Traceback", 'File "', "campaignapi.py",
         "Error:", "cak_")


def assert_no_leak(body):
    for word in LEAKS:
        assert word not in body, (word, body)


def assert_clean_error(response, status, code):
    assert_error(response, status, code)
    assert_no_leak(response.text)


# --- no key, expired, revoked, each missing level -----------------------------------------

@pytest.fixture
def bad_keys(db, app, make_key):
    """Authorization headers that must be refused: (name, headers)."""
    yesterday = datetime.datetime.now(datetime.timezone.utc).date() - datetime.timedelta(days=1)
    revoked = make_key(name="revoked")
    conn = campaignapi.connect(db)
    conn.execute("UPDATE apikey SET revoked = 1 WHERE name = 'revoked'")
    conn.close()
    return [("none", {}), ("expired", make_key(expires=yesterday.isoformat())),
            ("revoked", revoked), ("garbled", {"Authorization": "Bearer cak_" + "A" * 43})]


@pytest.mark.parametrize("route", KEYED_ROUTES, ids=route_id)
def test_every_route_refuses_missing_expired_revoked_and_unknown_keys(client, bad_keys, route):
    for name, headers in bad_keys:
        response = send(client, route.method, filled(route), headers, {"name": "x"})
        assert_clean_error(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"].startswith("Bearer"), name


@pytest.mark.parametrize("route", KEYED_ROUTES, ids=route_id)
def test_access_level_of_every_route(client, make_key, route):
    """A key lacking the route's level gets 403 naming it -- with any one
    other level and with all the others; a key with only that level gets past."""
    assert route.level in campaignapi.LEVELS
    others = [level for level in campaignapi.LEVELS if level != route.level]
    for levels in [[level] for level in others] + [others]:
        response = send(client, route.method, filled(route), make_key(levels), {"name": "x"})
        assert_clean_error(response, 403, "insufficient_access")
        assert f"'{route.level}'" in response.json["data"]["message"]
    response = send(client, route.method, filled(route), make_key([route.level]))
    assert response.status_int not in (401, 403), response.text
    assert response.json["success"] in (True, False)


# --- another account's records ------------------------------------------------------------

#: Valid parameters for each route, so that only ownership can refuse the call.
VALID = {
    ("POST", "/datasource/{id}"): {"name": "taken over"},
    ("DELETE", "/datasource/{id}"): {"id": 1},
    ("GET", "/datasource/{parent_id}/modify/{child_id:name}"): {"new": "x", "type": "text"},
    ("PUT", "/datasource/{parent_id}/import/{child_id}"): {
        "name": "i", "originalfile": "f.csv", "__uploadtype__": "csv",
        "__uploaddata__": "email\nintruder@example.org\n"},
    ("PUT", "/datasource/{parent_id}/recipient/{child_id}"): {"email": "intruder@example.org"},
    ("POST", "/datasource/{parent_id}/recipient/{child_id}"): {"status": "unsubscribed"},
    ("POST", "/datasource/{parent_id}/import/{child_id}"): {"id": 1, "name": "x"},
    ("DELETE", "/datasource/{parent_id}/import/{child_id}"): {"id": 1},
    ("PUT", "/datasource/{parent_id}/organize/{child_id}"): {"item": 1, "folder": "x",
                                                             "sortorder": 2},
    ("POST", "/datasource/{parent_id}/organize/{child_id}"): {"id": 1, "folder": "x"},
    ("POST", "/message/{id}"): {"name": "x"}, ("DELETE", "/message/{id}"): {"id": 1},
    ("POST", "/segment/{id}"): {"name": "x"}, ("DELETE", "/segment/{id}"): {"id": 1},
    ("POST", "/accountprofile/{id}"): {"name": "x"}, ("DELETE", "/accountprofile/{id}"): {"id": 1},
    ("POST", "/campaign/{id}"): {"name": "x"},
    ("PUT", "/campaign/{parent_id}/message/{child_id}"): {"segment": 1, "message": 1},
    ("POST", "/campaign/{parent_id}/message/{child_id}"): {"segmentmessageid": 1, "priority": 5},
    ("DELETE", "/campaign/{parent_id}/message/{child_id}"): {"segmentmessagehack": 1},
    ("PUT", "/campaign/{parent_id}/send/{child_id}"): {"timestamp": 0},
    ("POST", "/webhook/{id}"): {"url": "https://1.1.1.1/taken-over", "enabled": 1},
    ("POST", "/template/{id}"): {"name": "x"}, ("DELETE", "/template/{id}"): {"id": 1},
    ("POST", "/bounce"): {"email": "ann@example.com", "type": "hard", "campaign": 1},
    ("POST", "/campaign/{parent_id}/winner/{child_id}"): {"link": 1, "message": 1},
    ("POST", "/automation/{id}"): {"name": "x"},
    ("PUT", "/automation/{parent_id}/run/{child_id}"): {"recipient": 1},
}

#: A public address literal: valid without webhook_allow_private, no DNS, never called here.
WEBHOOK_URL = "https://1.1.1.1/hook"

#: Top-level creates name a new id: at another account's id they are 409 (ids are global).
CREATES = [r for r in KEYED_ROUTES if r.method == "PUT" and r.path.count("{") == 1]
NAMING = [r for r in KEYED_ROUTES if r not in CREATES]


@pytest.fixture
def world(api, db):
    ids = build_world(api)
    ids["webhook"] = api.put("/webhook/0", url=WEBHOOK_URL)["id"]
    ids["transactional"] = api.put("/transactional/0", to="ann@example.com",
                                   message=int(ids["message"]))["id"]
    ids["automation"] = api.put("/automation/0", name="a", datasource=1, accountprofile=1,
                                trigger={"type": "api"}, steps=[{"send": 1}], enabled="1")["id"]
    ids["run"] = api.put("/automation/1/run/0", recipient=1)["id"]
    campaignapi.process_due(db)
    assert set(ids.values()) == {"1"}
    return ids


def child_values(route):
    """The child ids to try: the record itself, and 0 (create) and all where taken."""
    if route.path.count("{") == 1:
        return ["1", "all"] if "all" in route.path else ["1"]
    if ":name" in route.path:
        return ["first"]
    values = ["1"]
    if "all" in route.path:
        values.append("all")
    if route.method in ("PUT", "GET") and route.path.endswith(("{child_id}", "export/{child_id}")):
        values.append("0")
    return values


@pytest.mark.parametrize("route", NAMING, ids=route_id)
def test_another_accounts_records_are_404_on_every_route_and_unchanged(
        client, other, world, db, route):
    before = snapshot(db)
    for child in child_values(route):
        path = "/v1" + re.sub(r"\{[^}]*\}$", child, re.sub(r"\{[^}]*\}", "1", route.path, 1)) \
            if route.path.count("{") == 2 else filled(route, child)
        if child == "all" and route.path.count("{") == 1:
            response = send(client, route.method, path, other)
            assert response.status_int == 200, response.text  # their own (empty) listing
            assert response.json["data"][next(iter(response.json["data"]))] == []
            continue
        response = send(client, route.method, path, other,
                        VALID.get((route.method, route.path)))
        assert_clean_error(response, 404, "not_found")
    assert snapshot(db) == before


@pytest.mark.parametrize("route", CREATES, ids=route_id)
def test_create_at_another_accounts_id_is_409_and_changes_nothing(client, other, world, db,
                                                                  route):
    params = {"name": "x", "accountprofile": 1} if "campaign" in route.path else \
        {"url": WEBHOOK_URL} if "webhook" in route.path else {"name": "x"}
    if "template" in route.path:
        params["html"] = "{{content}}"
    if "transactional" in route.path:   # an email of their own message
        params = {"to": "a@example.org", "message": int(Api(client, other).put(
            "/message/0", name="x", subject="s", text="t")["id"])}
    if "automation" in route.path:   # what it names must be the stranger's own
        own = Api(client, other)
        params.update(datasource=int(own.put("/datasource/0", name="d")["id"]),
                      accountprofile=int(own.put("/accountprofile/0", name="p")["id"]),
                      steps=[{"send": int(own.put("/message/0", name="m")["id"])}],
                      trigger={"type": "api"})
    before = snapshot(db)
    response = send(client, route.method, filled(route), other, params)
    assert_clean_error(response, 409, "conflict")
    assert snapshot(db) == before


def test_another_accounts_records_cannot_be_used_in_ones_own(client, other, world, db):
    stranger = Api(client, other)
    # A segment over their datasource, a link to their segment and message.
    assert stranger.put("/segment/0", status=404, name="s", datasources=[1])["error"] == "not_found"
    campaign = stranger.put("/campaign/0", name="mine", accountprofile=1)["id"]
    assert stranger.put(f"/campaign/{campaign}/message/0", status=404, segment=1,
                        message=1)["error"] == "not_found"
    # Their sender profile does not count as this account's.
    checks = stranger.get(f"/campaign/{campaign}/verify/0")["verify"]["checks"]
    profile = [c for c in checks if "profile" in c["check"]]
    assert profile and profile[0]["passed"] == "0"
    # Their organize item is not theirs to file.
    own = stranger.put("/datasource/0", name="own")["id"]
    assert stranger.put(f"/datasource/{own}/organize/0", status=409, item=1, folder="x",
                        sortorder=1)["error"] == "conflict"


# --- secrets --------------------------------------------------------------------------------

def test_secrets_are_never_stored_in_clear(db, app, client, caplog):
    caplog.set_level(logging.DEBUG)
    secret = campaignapi.create_key(db, "owner@example.com")
    client.get("/v1/campaign/all", headers={"Authorization": f"Bearer {secret}"})
    client.get("/v1/campaign/all", headers={"Authorization": "Bearer " + secret[:-1]},
               expect_errors=True)
    if db.startswith("postgresql://"):   # no file to read: every stored value instead
        raw, suffixes = repr(snapshot(db, skip=())).encode(), ()
    else:
        with open(db, "rb") as file:
            raw, suffixes = file.read(), ("-wal",)
    for suffix in suffixes:
        try:
            with open(db + suffix, "rb") as file:
                raw += file.read()
        except FileNotFoundError:
            pass
    assert secret.encode() not in raw and secret[4:].encode() not in raw
    conn = campaignapi.connect(db)
    hashes = [row[0] for row in conn.execute("SELECT hash FROM apikey")]
    conn.close()
    assert campaignapi.hashlib.sha256(secret.encode()).hexdigest() in hashes
    assert secret not in caplog.text and secret[:-1] not in caplog.text


def test_the_cli_prints_the_secret_once_and_logs_it_nowhere(tmp_path):
    db = str(tmp_path / "cli.db")
    module = campaignapi.__file__
    created = subprocess.run([sys.executable, module, "key", "create", "--email", "a@example.com",
                              "--db", db], capture_output=True, text=True, timeout=60, check=True)
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("cak_")
    assert (created.stdout + created.stderr).count(secret) == 1
    listed = subprocess.run([sys.executable, module, "key", "list", "--db", db],
                            capture_output=True, text=True, timeout=60, check=True)
    assert secret not in listed.stdout + listed.stderr
    assert secret[4:12] not in listed.stdout + listed.stderr


def test_secrets_and_tokens_are_not_in_the_log(client, auth, api, caplog):
    caplog.set_level(logging.DEBUG)
    ds = api.put("/datasource/0", name="d")["id"]
    url = api.get(f"/datasource/{ds}/export/0")["export"]["url"]
    token = url.rsplit("/", 1)[1]
    client.get(urllib.parse.urlsplit(url).path)
    client.get(urllib.parse.urlsplit(url).path + "x", expect_errors=True)
    assert token not in caplog.text
    assert auth["Authorization"].split()[1] not in caplog.text


# --- download tokens ------------------------------------------------------------------------

def test_download_tokens_are_unguessable(api, db):
    ds = api.put("/datasource/0", name="d")["id"]
    tokens = [api.get(f"/datasource/{ds}/export/0")["export"]["url"].rsplit("/", 1)[1]
              for _ in range(20)]
    assert len(set(tokens)) == len(tokens)
    for token in tokens:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
        assert len(token) * math.log2(64) >= 128 + 64  # >= 32 random bytes as base64url
    # The database keeps the same token (no derived, guessable form).
    conn = campaignapi.connect(db)
    stored = {row[0] for row in conn.execute("SELECT token FROM export")}
    conn.close()
    assert stored == set(tokens)


def test_download_links_expire_after_seven_days(api, client, db):
    ds = api.put("/datasource/0", name="d")["id"]
    export = api.get(f"/datasource/{ds}/export/0")["export"]
    expires = datetime.datetime.strptime(export["expires"], "%Y-%m-%d %H:%M:%S")
    now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    assert datetime.timedelta(days=6, hours=23) < expires - now <= datetime.timedelta(days=7)
    path = urllib.parse.urlsplit(export["url"]).path
    assert client.get(path).status_int == 200
    conn = campaignapi.connect(db)
    conn.execute("UPDATE export SET expires = '2000-01-01 00:00:00'")
    conn.close()
    assert_clean_error(client.get(path, expect_errors=True), 404, "not_found")
    assert api.get(f"/datasource/{ds}/export/{export['id']}")["export"]["url"] is None


def test_forged_and_garbled_download_tokens_are_refused(api, client):
    ds = api.put("/datasource/0", name="d")["id"]
    token = api.get(f"/datasource/{ds}/export/0")["export"]["url"].rsplit("/", 1)[1]
    forged = [token[:-1], token + "A", token.upper() if token.upper() != token else token.lower(),
              token[::-1], "A" * len(token), "", "%00", "..%2F..%2Fetc%2Fpasswd",
              "../campaignapi.db", token[:10], "1", "%FF" + token]
    for bad in forged:
        response = client.get(f"/v1/download/{bad}", expect_errors=True)
        assert response.status_int == 404, (bad, response.status)
        assert response.json["data"]["error"] == "not_found"
        assert_no_leak(response.text)


# --- no SQL or traceback in any error body ---------------------------------------------------

def test_no_error_body_shows_sql_or_a_traceback(client, auth, api, monkeypatch):
    bodies = []
    for route in KEYED_ROUTES:
        for params in (None, {"name": "'; DROP TABLE campaign; --"}, {"unknown": 1},
                       {"id": "1 OR 1=1"}):
            bodies.append(send(client, route.method, filled(route), auth, params).text)
    # A real internal error: the handler's exception must stay in the log.
    def broken(call, **ids):
        raise sqlite3.OperationalError("near SELECT: syntax error in SELECT * FROM x")
    monkeypatch.setattr(campaignapi.ROUTES[0], "handler", broken)
    response = client.get("/v1/datasource/all", headers=auth, expect_errors=True)
    assert response.status_int == 500
    bodies.append(response.text)
    for body in bodies:
        assert_no_leak(body)
    assert api.get("/campaign/all")["emt_campaign"] == []


# --- unsubscribe tokens ----------------------------------------------------------------------

def test_unsubscribe_tokens_are_signed_and_forgeries_refused(client, api, db, app):
    ids = build_world(api)
    account = int(api.get(f"/datasource/{ids['datasource']}")["datasource"]["owner"])
    secret = app.config["campaignapi.service"].secret
    good = campaignapi.unsubscribe_token(secret, account, "ann@example.com", 1)
    payload, mac = good.split(".")
    assert len(unb64(mac)) * 8 >= 128
    other_payload = b64(f"{account}::bob@example.com".encode())
    forged = [
        f"{other_payload}.{mac}",                                       # another address, old MAC
        campaignapi.unsubscribe_token("not-the-secret", account, "bob@example.com"),
        f"{payload}.{mac[:-2]}", f"{payload}.", f".{mac}", payload, good + ".x",
        good[:-1] + ("A" if good[-1] != "A" else "B"), "A" * len(good), "..", "%2E",
        b64(b"\xff\xfe:1:x") + "." + mac,
    ]
    before = snapshot(db)
    for token in forged:
        for method in ("GET", "POST"):
            response = client.request(f"/v1/unsubscribe/{token}", method=method,
                                      expect_errors=True)
            assert response.status_int == 404, (token, method, response.status)
            assert_no_leak(response.text)
    assert snapshot(db) == before
    # The genuine link still works, for its own address only.
    assert client.post(f"/v1/unsubscribe/{good}").status_int == 200
    statuses = {r["email"]: r["status"] for r in api.get(
        f"/datasource/{ids['datasource']}/recipient/all")["recipient"]}
    assert statuses == {"ann@example.com": "unsubscribed", "bob@example.com": "active"}


# --- public routes: CORS only where a cross-origin sign-up needs it -------------------------

#: The routes a web page of another origin may call: the sign-up post and its
#: preflight.  (The OpenAPI document is readable by any API tool: its answer
#: has the header too, and is not this test's business.)
CORS_ROUTES = {("POST", "/subscribe/{id:name}"), ("OPTIONS", "/subscribe/{id:name}")}


@pytest.mark.parametrize("route", campaignapi.ROUTES, ids=route_id)
def test_cors_headers_only_on_the_sign_up_routes(client, auth, api, route):
    api.put("/accountprofile/0", name="p", fromaddress="list@shop.example")
    api.put("/datasource/0", name="d", signup=1, fromprofile=1)
    for body in (None, {"email": "a@example.com"}, {"email": "bad"}):
        response = send(client, route.method, filled(route), {**auth,
                                                              "Origin": "https://evil.example"},
                        body)
        if route.path != "/openapi.json":
            assert ("Access-Control-Allow-Origin" in response.headers) == (
                (route.method, route.path) in CORS_ROUTES), response.headers
        assert "Access-Control-Allow-Credentials" not in response.headers
        assert response.status_int < 500


@pytest.mark.parametrize("route", [r for r in campaignapi.ROUTES if not r.level], ids=route_id)
def test_public_routes_leak_nothing_and_need_no_key(client, route):
    response = send(client, route.method, filled(route, "x%FFy"), None, b"\x00{")
    assert response.status_int < 500
    assert_no_leak(response.text)
