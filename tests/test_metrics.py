"""GET /metrics (API.md section 20): the Prometheus text format, read back
with prometheus_client's own parser; the database's figures are the same
from every app of the database, the request figures are each app's own."""

import pytest
import webtest
from prometheus_client.parser import text_string_to_metric_families

import campaignapi
from helpers import assert_error, build_world, database, keyed_client
from conftest import Api
from smtp_sink import SmtpSink

TOKEN = "metrics-token-of-the-test"


def scrape(client, token=TOKEN):
    response = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert response.content_type == "text/plain"
    assert response.headers["Content-Type"] == campaignapi_content_type()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


def campaignapi_content_type():
    from prometheus_client import CONTENT_TYPE_LATEST
    return CONTENT_TYPE_LATEST


def figure(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def test_metrics_count_what_the_database_holds_and_what_each_app_answered(db):
    client, auth = keyed_client(db, metrics=True, metrics_token=TOKEN)
    api = Api(client, auth)
    build_world(api)   # an import, a batch, emails queued
    campaignapi.process_due(db)
    with database(db) as conn:
        queued = conn.execute("SELECT count(*) FROM outbox WHERE kind = 'campaign'").fetchone()[0]
        first = conn.execute("SELECT to_addr FROM outbox WHERE kind = 'campaign' "
                             "ORDER BY id").fetchone()[0]
    sink = SmtpSink().start()
    sink.replies[first] = ["421 4.7.28 Our system has detected an unusual rate of mail"]
    try:
        counts = campaignapi.deliver(db, sink.address, domain_rates={"*": "100/s"})
    finally:
        sink.stop()
    assert counts["retried"] == 1, counts
    samples = scrape(client)
    domain = first.rpartition("@")[2]
    assert figure(samples, "campaignapi_deferrals_total", domain=domain) == 1
    assert figure(samples, "campaignapi_domain_rate", domain=domain) == 50   # halved
    assert figure(samples, "campaignapi_emails", kind="campaign", status="sent") == queued - 1
    assert figure(samples, "campaignapi_emails", kind="campaign", status="queued") == 1
    assert figure(samples, "campaignapi_outbox_queued", status="waiting") == 1
    assert figure(samples, "campaignapi_batches", status="sending") == 1
    assert figure(samples, "campaignapi_imports", status="finished") == 1
    assert not [key for key in samples if key[0] == "campaignapi_runs"]   # no run table yet
    route = "/v1/campaign/{parent_id}/send/{child_id}"
    assert figure(samples, "campaignapi_http_requests_total", method="PUT", route=route,
                  status="200") == 1
    assert figure(samples, "campaignapi_http_request_duration_seconds_count", method="PUT",
                  route=route) == 1
    assert figure(samples, "campaignapi_http_request_duration_seconds_bucket", method="PUT",
                  route=route, le="+Inf") == 1
    client.get("/v1/nowhere", headers=auth, status=404)
    # Another app (another process, host) of the database: the same database figures,
    # its own requests.
    other = webtest.TestApp(campaignapi.create_app(db, metrics=True, metrics_token=TOKEN))
    again, theirs = scrape(client), scrape(other)
    assert figure(again, "campaignapi_http_requests_total", method="GET", route="(no route)",
                  status="404") == 1
    for key, value in again.items():
        if not key[0].startswith(("campaignapi_http", "python_", "process_")):
            assert theirs.get(key) == value, key
    assert not figure(theirs, "campaignapi_http_requests_total", method="PUT", route=route,
                      status="200")


def test_metrics_needs_its_token_and_its_setting(db):
    client, auth = keyed_client(db, metrics=True, metrics_token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, auth):
        response = client.get("/metrics", headers=headers, status=401)
        assert_error(response, 401, "unauthorized")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    open_client = webtest.TestApp(campaignapi.create_app(db, metrics=True))
    assert figure(scrape(open_client, token=""), "campaignapi_batches", status="sent") == 0
    off = webtest.TestApp(campaignapi.create_app(db))
    assert_error(off.get("/metrics", status=404), 404, "not_found")


@pytest.mark.parametrize("engine_figure", ["campaignapi_emails", "campaignapi_webhook_deliveries"])
def test_every_database_family_is_there_on_an_empty_database(db, engine_figure):
    client = webtest.TestApp(campaignapi.create_app(db, metrics=True))
    text = client.get("/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert engine_figure in names and "campaignapi_runs" in names


def test_serve_answers_metrics_with_its_flags(tmp_path):
    from clihelpers import served
    from helpers import http

    db = str(tmp_path / "served.db")
    with served("--db", db, "--metrics", "--metrics-token", TOKEN,
                "--domain-rate", "gmail.com=60/m", cwd=tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {server.secret}"}
        status, _, body = http(f"{base}/v1/deliverability/0", headers=auth)
        assert status == 200
        record = campaignapi.json.loads(body)["data"]["deliverability"]
        assert record["domains"][0]["configured"] == "60/m"
        assert http(f"{base}/metrics")[0] == 401
        status, headers, body = http(f"{base}/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        names = {family.name for family in text_string_to_metric_families(body.decode())}
        assert {"campaignapi_emails", "campaignapi_http_requests"} <= names
