"""Logging through the standard module: a line per request, tracebacks of
500s with their responseId, and never a secret."""

import logging
import re

import pytest
import webtest

import campaignapi


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.DEBUG, logger="campaignapi")
    return caplog


def request_lines(caplog):
    return [r for r in caplog.records if r.name == "campaignapi" and r.levelno == logging.INFO]


def test_one_line_per_request_with_id_method_path_status_and_time(client, auth, records):
    ok = client.get("/v1/campaign/all", headers=auth)
    bad = client.get("/v1/campaign/x", headers=auth, status=400)
    lines = [r.getMessage() for r in request_lines(records)]
    assert len(lines) == 2
    assert re.fullmatch(rf"{ok.json['responseId']} GET /v1/campaign/all 200 \d+\.\dms", lines[0])
    assert re.fullmatch(rf"{bad.json['responseId']} GET /v1/campaign/x 400 \d+\.\dms", lines[1])


def test_unknown_routes_are_logged_too(client, records):
    response = client.get("/v1/nowhere", status=404)
    lines = [r.getMessage() for r in request_lines(records)]
    assert len(lines) == 1
    assert re.fullmatch(rf"{response.json['responseId']} GET /v1/nowhere 404 \d+\.\dms", lines[0])


def test_an_internal_error_logs_its_traceback_with_the_response_id(
        db, auth, records, monkeypatch):
    def broken(call, thing):
        call.conn.execute("SELECT 1")
        raise RuntimeError("disk on fire SELECT secret FROM apikey")

    # A route of the table that fails inside its handler, as no input makes ours fail.
    route = campaignapi.Route("POST", "/probe/{thing:int}", "write", broken)
    monkeypatch.setattr(campaignapi, "ROUTES", [*campaignapi.ROUTES, route])
    client = webtest.TestApp(campaignapi.create_app(db))
    response = client.post_json("/v1/probe/1", {}, headers=auth, status=500)
    envelope = response.json
    assert envelope["success"] is False and envelope["data"]["error"] == "internal_error"
    assert envelope["responseId"] in envelope["data"]["message"]
    # Nothing of the failure leaks to the client ...
    assert "disk on fire" not in response.text and "Traceback" not in response.text
    assert "SELECT" not in response.text
    # ... it is in the log, with the responseId.
    errors = [r for r in records.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert envelope["responseId"] in errors[0].getMessage()
    assert errors[0].exc_info and "disk on fire" in records.text
    assert "Traceback" in records.text
    assert f"{envelope['responseId']} POST /v1/probe/1 500" in records.text


def test_no_secret_reaches_the_log(client, db, records):
    secret = campaignapi.create_key(db, "owner@example.com")
    headers = {"Authorization": f"Bearer {secret}"}
    client.get("/v1/campaign/all", headers=headers)
    client.put_json("/v1/campaign/0", {"name": "C", "accountprofile": 1}, headers=headers)
    client.get("/v1/campaign/all", headers={"Authorization": f"Bearer {secret}x"}, status=401)
    client.get(f"/v1/campaign/all?key={secret}", status=401)
    assert request_lines(records)
    assert secret not in records.text
    assert not any(secret in str(r.args) for r in records.records)


def test_token_placeholders_are_blanked_in_the_log_line(monkeypatch, db, records):
    def page(call, token):
        return {"token": len(token)}

    route = campaignapi.Route("GET", "/probe/{token:name}", None, page)
    monkeypatch.setattr(campaignapi, "ROUTES", [*campaignapi.ROUTES, route])
    client = webtest.TestApp(campaignapi.create_app(db))
    client.get("/v1/probe/s3cr3t-t0ken")
    assert "s3cr3t-t0ken" not in records.text
    assert "GET /v1/probe/*** 200" in records.text


def test_the_cli_prints_the_first_secret_once_and_never_logs_it(tmp_path, capsys, monkeypatch):
    """``serve`` on a new database prints the new key's secret (by design, once)."""
    served = []
    import waitress
    monkeypatch.setattr(waitress, "serve", lambda app, **options: served.append(options))
    db = str(tmp_path / "cli.db")
    campaignapi.main(["serve", "--db", db, "--port", "8999"])
    first = capsys.readouterr().out
    secret = first.splitlines()[2]
    assert secret.startswith("cak_") and first.count(secret) == 1
    campaignapi.main(["serve", "--db", db, "--port", "8999"])
    assert secret not in capsys.readouterr().out
    assert served[0]["port"] == 8999 and len(served) == 2
