"""Links the service puts in emails and pages come from ``public_url``, or from
a request's Host (or X-Forwarded-Host) only when ``allowed_hosts`` allows it;
any other host is 400 invalid_host and changes nothing (API.md sections 1, 2
and 16, README "Links in emails")."""

import os

import pytest
import webtest

import campaignapi
from clihelpers import served
from conftest import Api
from helpers import (assert_error, database, http, import_csv, make_campaign, make_datasource,
                     make_signup_list, scalar, snapshot)

EVIL = {"Host": "evil.example"}
FORWARDED_EVIL = {"Host": "localhost:80", "X-Forwarded-Host": "evil.example"}


def api_of(db, host="localhost:80", **config):
    """An Api over a new app with ``config`` and a full-access key; its
    requests name ``host`` unless they say otherwise."""
    client = webtest.TestApp(campaignapi.create_app(db, **config),
                             extra_environ={"HTTP_HOST": host})
    return Api(client, {"Host": host, "Authorization": "Bearer " + campaignapi.create_key(
        db, "owner@example.com")})


def sign_up(api, ds, headers, address="ann@example.org"):
    return api.client.post_json(f"/v1/subscribe/{ds}", {"email": address}, headers=headers,
                                expect_errors=True)


def mailed(db, kind="signup"):
    """The bodies of the queued emails of ``kind``."""
    with database(db) as conn:
        return [row["body"] for row in conn.execute(
            "SELECT body FROM outbox WHERE kind = ? ORDER BY id", (kind,))]


def batch_bases(db):
    with database(db) as conn:
        return [row[0] for row in conn.execute("SELECT base_url FROM batch ORDER BY id")]


# --- the sign-up: a public route that mails a link ----------------------------------------------

@pytest.mark.parametrize("headers", [EVIL, FORWARDED_EVIL], ids=["Host", "X-Forwarded-Host"])
def test_a_sign_up_naming_another_host_is_refused_and_changes_nothing(db, headers):
    api = api_of(db)            # no public_url, no allowed_hosts
    ds = make_signup_list(api)
    before = snapshot(db)
    response = sign_up(api, ds, headers)
    assert_error(response, 400, "invalid_host")
    assert "evil.example" in response.json["data"]["message"]
    assert "public_url" in response.json["data"]["message"]
    assert snapshot(db) == before and mailed(db) == []


def test_without_settings_this_machine_builds_the_links(db):
    # What a development app (and WebTest's localhost:80) needs: the loopback names.
    api = api_of(db)
    ds = make_signup_list(api)
    for number, host in enumerate(("localhost:80", "127.0.0.1:8080", "[::1]:8080",
                                   "app.localhost")):
        assert sign_up(api, ds, {"Host": host}, f"p{number}@example.org").status_int == 200
    bodies = mailed(db)
    assert [body.split("/v1/confirm/")[0].rsplit("\n", 1)[1] for body in bodies] == [
        "http://localhost:80", "http://127.0.0.1:8080", "http://[::1]:8080",
        "http://app.localhost"]


def test_an_allowed_host_builds_the_link(db):
    api = api_of(db, allowed_hosts=["news.example.com", ".lists.example"])
    ds = make_signup_list(api)
    assert sign_up(api, ds, {"Host": "news.example.com:8443"}).status_int == 200
    assert "\nhttp://news.example.com:8443/v1/confirm/" in mailed(db)[0]
    # X-Forwarded-Host and -Proto, as a proxy in front sets them; a name of the domain.
    response = sign_up(api, ds, {"Host": "127.0.0.1:8080", "X-Forwarded-Host": "a.lists.example",
                                 "X-Forwarded-Proto": "https"}, "bob@example.org")
    assert response.status_int == 200
    assert "\nhttps://a.lists.example/v1/confirm/" in mailed(db)[1]
    # Set explicitly, the list replaces the loopback names; neighbours of a domain are not in it.
    before = snapshot(db)
    for headers in ({"Host": "localhost:80"}, {"Host": "notnews.example.com"},
                    {"Host": "lists.example.evil.example"}, {"Host": "xlists.example"},
                    {"Host": "news.example.com", "X-Forwarded-Host": "evil.example"},
                    {"Host": "news.example.com", "X-Forwarded-Proto": "javascript"}):
        assert_error(sign_up(api, ds, headers, "cid@example.org"), 400, "invalid_host")
    assert snapshot(db) == before


def test_any_host_is_still_a_host_name(db):
    api = api_of(db, allowed_hosts=["*"])
    ds = make_signup_list(api)
    assert sign_up(api, ds, {"Host": "Anything.Example"}).status_int == 200
    assert "\nhttp://anything.example/v1/confirm/" in mailed(db)[0]
    before = snapshot(db)
    for host in ("evil.example/phish?", "evil.example@x", "a b", "evil.example:80:80",
                 "évil.example"):
        assert_error(sign_up(api, ds, {"X-Forwarded-Host": host}, "bob@example.org"),
                     400, "invalid_host")
    assert snapshot(db) == before


def test_public_url_wins_whatever_the_host(db):
    api = api_of(db, public_url="https://lists.example.com/email/", allowed_hosts=["evil.example"])
    ds = make_signup_list(api)
    assert sign_up(api, ds, EVIL).status_int == 200
    assert sign_up(api, ds, FORWARDED_EVIL, "bob@example.org").status_int == 200
    for body in mailed(db):
        assert "\nhttps://lists.example.com/email/v1/confirm/" in body
        assert "evil" not in body


# --- routes of a key that build links ------------------------------------------------------------

def test_a_send_records_its_base_only_from_an_allowed_host(db):
    api = api_of(db)
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\nann@example.org,Ann\n")
    campaign = make_campaign(api, [ds])["campaign"]
    path = f"/campaign/{campaign}/send/0"
    for headers in (EVIL, FORWARDED_EVIL):
        before = snapshot(db)
        data = api.call("PUT", path, {"timestamp": 0}, 400, headers)
        assert data["error"] == "invalid_host"
        assert snapshot(db) == before
    api.call("PUT", path, {"timestamp": 0}, 200, {"X-Forwarded-Host": "localhost:8080"})
    assert batch_bases(db) == ["http://localhost:8080"]

    other = api_of(db, public_url="https://news.example.com/m")
    other.call("PUT", path, {"timestamp": 0}, 200, FORWARDED_EVIL)
    assert batch_bases(db) == ["http://localhost:8080", "https://news.example.com/m"]


def test_an_export_is_made_only_for_an_allowed_host(db):
    api = api_of(db, "news.example.com", allowed_hosts=["news.example.com"])
    ds = make_datasource(api)
    import_csv(api, ds, "email\nann@example.org\n")
    before = snapshot(db)
    for headers in ({"Host": "news.example.com", "X-Forwarded-Host": "evil.example"},
                    {"Host": "localhost:80"}):
        data = api.call("GET", f"/datasource/{ds}/export/0", None, 400, headers)
        assert data["error"] == "invalid_host"
    # Nothing made: no record, no notification ...
    assert snapshot(db) == before
    record = api.call("GET", f"/datasource/{ds}/export/0", None, 200,
                      {"Host": "localhost", "X-Forwarded-Host": "news.example.com",
                       "X-Forwarded-Proto": "https"})["export"]
    # ... and no file: the export folder holds the allowed export's alone.
    path = scalar(db, "SELECT path FROM export WHERE id = ?", int(record["id"]))
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert record["url"].startswith("https://news.example.com/v1/download/")
    assert record["url"] in mailed(db, "notification")[-1]
    # An earlier export's link is a link too.
    data = api.call("GET", f"/datasource/{ds}/export/{record['id']}", None, 400, EVIL)
    assert data["error"] == "invalid_host"


def test_the_document_and_the_root_redirect_name_no_other_host(db):
    api = api_of(db)
    assert_error(api.client.get("/v1/openapi.json", headers=EVIL, expect_errors=True),
                 400, "invalid_host")
    assert_error(api.client.get("/", headers=FORWARDED_EVIL, expect_errors=True),
                 400, "invalid_host")
    assert api.client.get("/", status=302).headers["Location"] == "http://localhost:80/v1/"
    # Routes that build no link answer whatever the host.
    assert api.call("GET", "/campaign/all", None, 200, EVIL)["emt_campaign"] == []


def test_the_setting_is_checked(db):
    for wrong in (["news.example.com/x"], ["http://news.example.com"], [""], [7], ["a b"],
                  ["*.example.com"]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            campaignapi.create_app(db, allowed_hosts=wrong)
    # One name alone is a list of one.
    api = api_of(db, allowed_hosts="News.Example.com")
    ds = make_signup_list(api)
    assert sign_up(api, ds, {"Host": "news.example.com"}).status_int == 200


def test_serve_takes_allowed_hosts(db, tmp_path):
    # Without --public-url, --allowed-host makes the links follow the request's host.
    with served("--db", db, "--allowed-host", "news.example.com", "--allowed-host",
                ".lists.example", cwd=tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        headers = {"Authorization": f"Bearer {server.secret}"}
        status, _, body = http(f"{base}/v1/datasource/0", "PUT", {"name": "L"}, headers)
        assert status == 200, body
        status, _, body = http(f"{base}/v1/datasource/1/export/0", "GET", None,
                               {**headers, "Host": "a.lists.example"})
        assert status == 200 and b"http://a.lists.example/v1/download/" in body, body
        status, _, body = http(f"{base}/v1/datasource/1/export/0", "GET", None, headers)
        assert status == 400 and b"invalid_host" in body, body
    # Without it, links use http://HOST:PORT whatever the request says (README, section 9).
    with served("--db", db, cwd=tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        status, _, body = http(f"{base}/v1/datasource/1/export/0", "GET", None,
                               {**headers, "Host": "evil.example"})
        assert status == 200 and f"{base}/v1/download/".encode() in body, body
