"""The app inside other applications and WSGI hosts."""

import json
import wsgiref.util

import bottle
import webtest

import campaignapi
from helpers import http, in_threads


def test_mounted_under_a_prefix_of_a_parent_bottle_app(app, auth):
    parent = bottle.Bottle()

    @parent.get("/")
    def home():
        return "parent"

    parent.mount("/email/", app)
    client = webtest.TestApp(parent)
    assert client.get("/").text == "parent"

    created = client.put_json("/email/v1/campaign/0", {"name": "C", "accountprofile": 1},
                              headers=auth).json
    assert created["success"] is True and created["data"] == {"id": "1"}
    listed = client.get("/email/v1/campaign/all", headers=auth)
    assert listed.json["data"]["emt_campaign"][0]["name"] == "C"
    assert listed.headers["X-Response-Id"] == listed.json["responseId"]

    error = client.get("/email/v1/campaign/x", headers=auth, status=400).json
    assert error["success"] is False and error["data"]["error"] == "invalid_identifier"
    assert client.get("/email/v1/campaign/all", status=401).json["data"]["error"] == "unauthorized"

    # Links the app builds (download, unsubscribe, servers) carry the prefix.
    document = client.get("/email/v1/openapi.json").json
    assert document["servers"] == [{"url": "http://localhost:80/email"}]


def dispatcher(apps):
    """A plain WSGI dispatcher: the first path segment picks the application."""

    def dispatch(environ, start_response):
        environ = dict(environ)
        prefix = wsgiref.util.shift_path_info(environ)
        target = apps.get(prefix)
        if target is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"no such application"]
        return target(environ, start_response)

    return dispatch


def test_under_a_plain_wsgi_dispatcher(app, auth):
    client = webtest.TestApp(dispatcher({"email": app}))
    created = client.put_json("/email/v1/datasource/0", {"name": "L"}, headers=auth).json
    assert created["data"] == {"id": "1"}
    assert client.get("/email/v1/datasource/1", headers=auth).json["data"]["datasource"]["name"] == "L"
    # Our own 404 and 405 envelopes, inside the prefix.
    missing = client.get("/email/v1/nothing", status=404).json
    assert missing["data"]["error"] == "not_found" and "/v1/nothing" in missing["data"]["message"]
    wrong = client.request("/email/v1/openapi.json", method="DELETE", status=405)
    assert wrong.json["data"]["error"] == "method_not_allowed" and wrong.headers["Allow"]
    document = client.get("/email/v1/openapi.json",
                          extra_environ={"SCRIPT_NAME": "/site"}).json
    assert document["servers"] == [{"url": "http://localhost:80/site/email"}]


def test_public_url_wins_over_the_request(db, auth):
    parent = bottle.Bottle()
    parent.mount("/email/", campaignapi.create_app(db, public_url="https://news.example.com/m/"))
    document = webtest.TestApp(parent).get("/email/v1/openapi.json").json
    assert document["servers"] == [{"url": "https://news.example.com/m"}]


def _call(url, method="GET", body=None, headers=None):
    status, _, answer = http(url, method, body, headers)
    return status, json.loads(answer)


def test_waitress_with_many_threads_on_one_database_file(app, auth, serve):
    """Concurrent reads and creates through a real server: none fails, and
    every create gets its own id."""
    workers, rounds = 6, 8
    results, failures = [], []

    def client(number):
        try:
            for i in range(rounds):
                status, answer = _call(f"{url}/v1/campaign/0", "PUT",
                                       {"name": f"c{number}-{i}", "accountprofile": 1}, auth)
                results.append((status, answer))
                status, listing = _call(f"{url}/v1/campaign/all?limit=5", headers=auth)
                results.append((status, listing))
        except Exception as error:  # reported below; a thread cannot fail the test itself
            failures.append(repr(error))

    with serve(app, threads=4) as url:
        in_threads(client, range(workers), timeout=60)
        status, listing = _call(f"{url}/v1/campaign/all?limit=1000", headers=auth)

    assert failures == []
    assert len(results) == 2 * workers * rounds
    assert all(status == 200 and answer["success"] for status, answer in results), \
        [answer for status, answer in results if status != 200][:3]
    ids = [answer["data"]["id"] for _, answer in results if "id" in answer["data"]]
    assert len(ids) == len(set(ids)) == workers * rounds
    assert listing["data"]["total"] == str(workers * rounds)
    assert {c["name"] for c in listing["data"]["emt_campaign"]} == {
        f"c{n}-{i}" for n in range(workers) for i in range(rounds)}
