"""Webhooks and callbacks: the webhook record, events stored with the change
that causes them, delivery by the worker to real receivers on loopback
(verified with the Standard Webhooks library), retries, ordering, leases,
and the on_event callback."""

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import campaignapi
from clihelpers import served
from conftest import Api
from helpers import (EventReceiver, assert_error, build_world, database, http, import_csv,
                     keyed_client, later, make_datasource, make_webhook, scalar, send, snapshot,
                     wait_for)
from signedhelpers import answer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV = "email,first\nann@example.com,Ann\nbob@example.com,Bob\n"


@pytest.fixture
def events():
    """What the app's on_event callback was called with: (kind, payload)."""
    return []


@pytest.fixture
def hooks(db, events):
    """An Api on an app that allows loopback webhooks and records on_event calls."""
    client, auth = keyed_client(db, webhook_allow_private=True,
                                on_event=lambda kind, payload: events.append((kind, payload)))
    return Api(client, auth)


def deliver(db, **options):
    """The worker's webhook step once, allowed to call loopback."""
    return campaignapi.deliver_webhooks(db, allow_private=True, **options)


def deliveries(db):
    with database(db) as conn:
        return [dict(row) for row in conn.execute(
            "SELECT d.*, e.kind FROM hook_delivery d JOIN hook_event e ON e.id = d.event "
            "ORDER BY d.id")]


def webhook(api, webhook_id):
    return api.get(f"/webhook/{webhook_id}")["webhook"]


# --- the record -----------------------------------------------------------------------------

def test_create_answers_the_secret_once_and_records_never_show_it(hooks, db):
    with EventReceiver() as receiver:
        made = hooks.put("/webhook/0", url=receiver.url(), events=["import.finished"])
    assert made["secret"].startswith("whsec_") and made["id"] == "1"
    record = webhook(hooks, 1)
    assert record == {"id": "1", "owner": record["owner"], "url": receiver.url(),
                      "events": ["import.finished"], "enabled": "1", "lastattempt": None,
                      "lasterror": None, "failures": "0", "created": record["created"],
                      "deleted": "0"}
    listing = hooks.get("/webhook/all")
    assert listing["webhook"] == [record] and listing["total"] == "1"
    assert made["secret"] not in json.dumps(listing) + json.dumps(record)
    assert scalar(db, "SELECT secret FROM webhook WHERE id = 1") == made["secret"]
    # Another webhook gets another secret; change and delete answer true.
    assert hooks.put("/webhook/0", url=receiver.url())["secret"] != made["secret"]
    assert hooks.post("/webhook/1", url=receiver.url("/other"), events=[], enabled=0) is True
    assert webhook(hooks, 1)["events"] == [] and webhook(hooks, 1)["enabled"] == "0"
    assert hooks.delete("/webhook/1") is True
    assert webhook(hooks, 1)["deleted"] == "1"
    assert [r["id"] for r in hooks.get("/webhook/all")["webhook"]] == ["2"]
    assert hooks.post("/webhook/1", status=409, enabled=1)["error"] == "conflict"


@pytest.mark.parametrize("url,phrase", [
    ("http://127.0.0.1:9/hook", "a loopback address"),
    ("http://10.1.2.3/hook", "a private address"),
    ("http://[::1]/hook", "a loopback address"),
    ("http://169.254.10.10/hook", "a link-local address"),
    ("http://169.254.169.254/latest/meta-data", "a cloud metadata address"),
    ("ftp://example.com/hook", "http:// or https://"),
    ("https://user:pw@example.com/hook", "user name or password"),
])
def test_urls_to_private_addresses_are_refused_at_create_and_change(api, db, url, phrase):
    made = api.put("/webhook/0", url="https://1.1.1.1/hook")
    before = snapshot(db)
    for method, path in (("PUT", "/webhook/0"), ("POST", f"/webhook/{made['id']}")):
        data = api.call(method, path, {"url": url}, status=400)
        assert data["error"] == "invalid_parameter" and data["field"] == "url"
        assert phrase in data["message"]
    assert snapshot(db) == before


def test_allowing_private_addresses_never_allows_metadata_ones(hooks):
    assert hooks.put("/webhook/0", url="http://127.0.0.1:9/hook")["id"] == "1"
    assert hooks.put("/webhook/0", url="http://10.0.0.1/hook")["id"] == "2"
    for url in ("http://169.254.169.254/", "http://[fd00:ec2::254]/", "http://100.100.100.200/"):
        data = hooks.put("/webhook/0", status=400, url=url)
        assert "a cloud metadata address" in data["message"]


SCOPED = ["http://[fe80::1%25lo]/", "http://[fe80::1%lo]/hook", "http://[::1%251]:8080/",
          "https://[2001:db8::1%25eth0]/hook", "http://[fe80::1%25no-such-interface]/"]


@pytest.mark.parametrize("url", SCOPED)
def test_a_scoped_ipv6_address_is_refused_like_any_bad_url(api, hooks, db, url):
    """A zone names an interface of the sending machine: refused, the private
    setting on or off (an unknown zone once escaped as a 500)."""
    for app in (api, hooks):
        made = app.put("/webhook/0", url="https://1.1.1.1/hook")
        before = snapshot(db)
        for method, path in (("PUT", "/webhook/0"), ("POST", f"/webhook/{made['id']}")):
            data = app.call(method, path, {"url": url}, status=400)
            assert data["error"] == "invalid_parameter" and data["field"] == "url"
            assert "IPv6 zone" in data["message"]
        assert snapshot(db) == before


def test_a_scoped_address_stored_earlier_fails_its_delivery_quietly(hooks, db):
    with EventReceiver() as receiver:
        make_webhook(hooks, receiver)
    with database(db) as conn:   # as a version that took it left it
        conn.execute("UPDATE webhook SET url = ?", (SCOPED[0],))
    import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
    assert deliver(db)["retried"] == 1
    assert "IPv6 zone" in webhook(hooks, 1)["lasterror"]
    for allow_private in (False, True):
        # internal: one signed post, the delivery's own call, to a test receiver
        status, error = campaignapi._post_webhook(SCOPED[-1], {}, b"{}",
                                                 allow_private=allow_private)
        assert status is None and "IPv6 zone" in error
    # The resolver itself answers an address it cannot use as the URL's fault.
    with pytest.raises(ValueError, match="cannot be used"):
        # internal: its guard for a name that resolves to such an address (no DNS here)
        campaignapi._resolve("fe80::1%no-such-interface", 80, time.monotonic() + 5)


@pytest.mark.parametrize("params,field", [
    ({"events": ["import.finished", "nope"]}, "events"),
    ({"events": "import.finished"}, "events"),
    ({"events": [{"kind": "batch.sent"}]}, "events"),
    ({"enabled": "maybe"}, "enabled"),
    ({"url": ["http://x"]}, "url"),
    ({"url": "https://1.1.1.1/\nx"}, "url"),
])
def test_bad_parameters_are_refused_and_change_nothing(api, client, auth, db, params, field):
    before = snapshot(db)
    response = send(client, "PUT", "/v1/webhook/0", auth, {"url": "https://1.1.1.1/h", **params})
    data = assert_error(response, 400, "invalid_parameter")
    assert data["field"] == field
    assert snapshot(db) == before


def test_a_url_is_required_and_another_accounts_webhook_is_not_found(api, stranger_api):
    assert api.put("/webhook/0", status=400)["error"] == "missing_parameter"
    api.put("/webhook/0", url="https://1.1.1.1/hook")
    assert stranger_api.get("/webhook/1", status=404)["error"] == "not_found"
    assert stranger_api.post("/webhook/1", status=404, enabled=0)["error"] == "not_found"
    assert stranger_api.delete("/webhook/1", status=404)["error"] == "not_found"
    assert stranger_api.put("/webhook/1", status=409, url="https://1.1.1.1/x")["error"] == "conflict"
    assert stranger_api.get("/webhook/all")["webhook"] == []


# --- events and delivery --------------------------------------------------------------------

def test_a_receiver_using_the_library_verifies_an_import_event(hooks, db, events):
    with EventReceiver() as receiver:
        make_webhook(hooks, receiver)
        ds = make_datasource(hooks, fields=[{"name": "first", "type": "text"}])
        import_id = import_csv(hooks, ds, CSV)["id"]
        assert deliver(db) == {"delivered": 1, "retried": 0, "failed": 0}
    [call] = receiver.calls
    assert call["error"] is None, call["error"]
    record = hooks.get(f"/datasource/{ds}/import/{import_id}")["import"]
    assert call["payload"]["type"] == "import.finished"
    assert call["payload"]["data"] == record
    assert call["id"] == f"msg_{scalar(db, 'SELECT id FROM hook_event')}"
    assert call["headers"]["Content-Type"] == "application/json"
    # The callback got the same payload, after the commit.
    assert events == [("import.finished", call["payload"])]
    [row] = deliveries(db)
    assert (row["status"], row["attempts"], row["claimed_by"]) == ("delivered", 1, None)
    record = webhook(hooks, 1)
    assert record["lastattempt"] and record["lasterror"] is None and record["failures"] == "0"
    # Nothing more to send.
    assert deliver(db) == {"delivered": 0, "retried": 0, "failed": 0}


def test_a_webhook_gets_only_the_kinds_it_asks_for(hooks, db):
    with EventReceiver() as wanted, EventReceiver() as other:
        make_webhook(hooks, wanted, events=["import.finished"])
        make_webhook(hooks, other, events=["batch.sent"])
        ds = make_datasource(hooks, fields=[{"name": "first", "type": "text"}])
        import_csv(hooks, ds, CSV)
        hooks.get(f"/datasource/{ds}/export/0")
        deliver(db)
    assert [p["type"] for p in wanted.acknowledged()] == ["import.finished"]
    assert other.calls == []
    # export.finished was raised, but no webhook wanted it: nothing stored for it.
    assert scalar(db, "SELECT count(*) FROM hook_event") == 1


def test_export_and_batch_events_carry_their_records(hooks, db, events, smtp_sink):
    with EventReceiver() as receiver:
        make_webhook(hooks, receiver)
        ids = build_world(hooks)
        campaignapi.process_due(db)
        campaignapi.deliver(db, smtp_sink.address)
        campaignapi.process_due(db)
        deliver(db)
    kinds = [p["type"] for p in receiver.acknowledged()]
    assert kinds == ["import.finished", "export.finished", "batch.started", "batch.sent"]
    export, started, sent = receiver.acknowledged()[1:]
    assert export["data"]["status"] == "finished" and export["data"]["rows"] == "2"
    batch = hooks.get(f"/campaign/{ids['campaign']}/batcharchive/{ids['batch']}")["batcharchive"]
    # An event carries no report link: a stored event would keep a key to the page.
    assert sent["data"] == {key: value for key, value in batch.items()
                            if key not in ("messages", "reporturl")}
    assert started["data"]["status"] == "sending" and started["data"]["queued"] == "2"
    assert sent["data"]["status"] == "sent" and sent["data"]["sent"] == "2"
    # Raised by the API: the callback; raised by the worker: no callback given there.
    assert [kind for kind, _ in events] == ["import.finished", "export.finished"]


def test_a_failing_receiver_is_retried_with_the_same_id_and_body(hooks, db):
    answers = [500, 503, 200]
    with EventReceiver(lambda call: answers.pop(0)) as receiver:
        make_webhook(hooks, receiver)
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        assert deliver(db)["retried"] == 1
        [row] = deliveries(db)
        record = webhook(hooks, 1)
        assert record["lasterror"] == "the receiver answered 500"
        # The first retry within a minute; then twice as long.
        first = datetime.datetime.fromisoformat(row["next_try"]) - \
            datetime.datetime.fromisoformat(record["lastattempt"])
        # internal: webhook retries shortened for the test
        assert first == datetime.timedelta(seconds=campaignapi._HOOK_RETRY_BASE) and \
            first <= datetime.timedelta(seconds=60)
        # Not due yet: nothing is sent again.
        assert deliver(db) == {"delivered": 0, "retried": 0, "failed": 0}
        assert deliver(db, now=row["next_try"])["retried"] == 1
        [again] = deliveries(db)
        second = datetime.datetime.fromisoformat(again["next_try"]) - \
            datetime.datetime.fromisoformat(row["next_try"])
        assert webhook(hooks, 1)["lasterror"] == "the receiver answered 503"
        assert deliver(db, now=again["next_try"])["delivered"] == 1
    assert second == 2 * first
    assert [call["status"] for call in receiver.calls] == [500, 503, 200]
    assert len({call["id"] for call in receiver.calls}) == 1
    assert len({call["body"] for call in receiver.calls}) == 1
    assert all(call["error"] is None for call in receiver.calls)
    assert deliveries(db)[0]["status"] == "delivered" and deliveries(db)[0]["attempts"] == 3
    assert webhook(hooks, 1)["lasterror"] is None and webhook(hooks, 1)["failures"] == "0"


def test_the_retry_schedule_doubles_to_an_hour_and_gives_up_after_a_day(hooks, db):
    with EventReceiver(lambda call: 500) as receiver:
        make_webhook(hooks, receiver)
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        created = datetime.datetime.fromisoformat(deliveries(db)[0]["created"])
        gaps, now, outcome = [], None, None
        for _ in range(60):
            outcome = deliver(db, now=now)
            row = deliveries(db)[0]
            if row["status"] != "pending":
                break
            gaps.append(datetime.datetime.fromisoformat(row["next_try"]) -
                        datetime.datetime.fromisoformat(now or webhook(hooks, 1)["lastattempt"]))
            now = row["next_try"]
    assert outcome == {"delivered": 0, "retried": 0, "failed": 1}
    seconds = [gap.total_seconds() for gap in gaps]
    assert seconds[:8] == [30, 60, 120, 240, 480, 960, 1920, 3600]
    assert max(seconds) == 3600
    # The last try is at the 24 hours, then the delivery fails.
    # internal: webhook give-up time shortened for the test
    assert now == (created + campaignapi._HOOK_GIVE_UP).strftime("%Y-%m-%d %H:%M:%S")
    row = deliveries(db)[0]
    assert row["status"] == "failed" and row["attempts"] == len(receiver.calls) == len(gaps) + 1
    record = webhook(hooks, 1)
    assert record["failures"] == "1" and record["lasterror"] == "the receiver answered 500"
    assert record["lastattempt"] == now


def test_a_hanging_receiver_times_out_and_is_tried_again_later(hooks, db):
    hang = [True]

    def plan(call):
        if hang.pop(0) if hang else False:
            return lambda handler: receiver.release.wait(20)
        return 204

    with EventReceiver(plan) as receiver:
        make_webhook(hooks, receiver)
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        started = time.monotonic()
        assert deliver(db, timeout=0.5)["retried"] == 1
        assert time.monotonic() - started < 3
        assert webhook(hooks, 1)["lasterror"] == "no answer within 0.5 seconds"
        assert deliver(db, now=later(31))["delivered"] == 1
    assert [call["status"] for call in receiver.calls] == [None, 204]
    assert receiver.calls[0]["id"] == receiver.calls[1]["id"]


def test_a_huge_answer_is_not_read(hooks, db):
    huge = b"x" * 30_000_000
    answers = [500, 200]
    with EventReceiver(lambda call: lambda handler: answer(handler, answers.pop(0), huge)) \
            as receiver:
        make_webhook(hooks, receiver)
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        started = time.monotonic()
        assert deliver(db)["retried"] == 1
        assert deliver(db, now=later(31))["delivered"] == 1
        assert time.monotonic() - started < 3
    assert len(receiver.calls) == 2


def test_a_redirect_is_not_followed(hooks, db):
    target = EventReceiver()
    hop = EventReceiver(lambda call: lambda handler: answer(
        handler, 307, headers=[("Location", target.url())]))
    with target, hop:
        make_webhook(hooks, hop)
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        assert deliver(db)["retried"] == 1
    assert len(hop.calls) == 1 and target.calls == []
    assert target.receiver.connections == 0
    assert "redirect" in webhook(hooks, 1)["lasterror"]


def test_private_addresses_are_refused_at_delivery_too(hooks, db):
    with EventReceiver() as receiver:
        make_webhook(hooks, receiver)   # allowed by this app's setting
        import_csv(hooks, make_datasource(hooks), "email\nann@example.com\n")
        # A worker without the setting never calls it.
        assert campaignapi.deliver_webhooks(db)["retried"] == 1
    assert receiver.receiver.connections == 0
    assert "a loopback address" in webhook(hooks, 1)["lasterror"]


def test_events_of_one_webhook_arrive_in_order_one_at_a_time(hooks, db):
    """The first event fails once: the later ones wait for it, and another
    webhook's events do not wait."""
    fail_first = [500]
    with EventReceiver(lambda call: fail_first.pop() if fail_first else 204) as slow, \
            EventReceiver() as fast:
        make_webhook(hooks, slow)
        make_webhook(hooks, fast)
        ds = make_datasource(hooks)
        for number in range(3):
            import_csv(hooks, ds, f"email\np{number}@example.com\n", name=f"import {number}")
        counts = deliver(db)
        assert len(slow.calls) == 1 and len(fast.calls) == 3
        assert counts == {"delivered": 3, "retried": 1, "failed": 0}
        deliver(db, now=later(31))
    names = [payload["data"]["name"] for payload in slow.acknowledged()]
    assert names == ["import 0", "import 1", "import 2"]
    assert [p["data"]["name"] for p in fast.acknowledged()] == names
    assert [call["status"] for call in slow.calls] == [500, 204, 204, 204]


def test_a_disabled_webhook_waits_and_a_deleted_one_gives_up(hooks, db):
    with EventReceiver() as paused, EventReceiver() as gone:
        make_webhook(hooks, paused)
        make_webhook(hooks, gone)
        ds = make_datasource(hooks)
        import_csv(hooks, ds, "email\na@example.com\n", name="before")
        hooks.post("/webhook/1", enabled=0)
        hooks.delete("/webhook/2")
        import_csv(hooks, ds, "email\nb@example.com\n", name="while off")
        assert deliver(db) == {"delivered": 0, "retried": 0, "failed": 0}
        assert paused.calls == [] and gone.calls == []
        # Off: no new event was stored for either.
        assert [(d["webhook"], d["status"]) for d in deliveries(db)] == [(1, "pending"),
                                                                         (2, "failed")]
        assert deliveries(db)[1]["error"] == "the webhook was deleted"
        hooks.post("/webhook/1", enabled=1)
        assert deliver(db)["delivered"] == 1
    assert [p["data"]["name"] for p in paused.acknowledged()] == ["before"]
    assert gone.calls == [] and webhook(hooks, 2)["failures"] == "0"


def test_an_event_is_never_sent_for_a_change_that_rolled_back(hooks, db, events):
    """The import raises its event, then its notification email fails to be
    queued: the request fails and neither the event nor the callback exist."""
    with EventReceiver() as receiver:
        make_webhook(hooks, receiver)
        ds = make_datasource(hooks)
        with database(db) as conn:
            if conn.engine == "sqlite":
                conn.execute("CREATE TRIGGER refuse_mail BEFORE INSERT ON outbox "
                             "BEGIN SELECT RAISE(ABORT, 'no mail today'); END")
            else:
                conn.run_script(
                    "CREATE FUNCTION refuse_mail() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'no mail today'; END $$; "
                    "CREATE TRIGGER refuse_mail BEFORE INSERT ON outbox "
                    "FOR EACH ROW EXECUTE FUNCTION refuse_mail();")
        response = send(hooks.client, "PUT", f"/v1/datasource/{ds}/import/0", hooks.headers,
                        {"name": "i", "originalfile": "f.csv", "__uploadtype__": "csv",
                         "__uploaddata__": "email\na@example.com\n"})
        assert response.status_int >= 400 and response.json["success"] is False
        assert deliver(db) == {"delivered": 0, "retried": 0, "failed": 0}
        with database(db) as conn:   # the test's database may be used again (PostgreSQL's pool)
            conn.run_script("DROP TRIGGER refuse_mail" + ("" if conn.engine == "sqlite"
                                                          else " ON outbox; DROP FUNCTION refuse_mail()"))
    assert receiver.calls == [] and events == []
    assert scalar(db, "SELECT count(*) FROM hook_event") == 0
    assert scalar(db, "SELECT count(*) FROM import") == 0


# --- the on_event callback ------------------------------------------------------------------

def test_the_callback_runs_after_the_commit_and_its_failure_changes_nothing(db, caplog):
    seen = []

    def callback(kind, payload):
        # Another connection sees the change: it has committed.
        with database(db) as conn:
            seen.append((kind, conn.execute("SELECT status FROM import WHERE id = ?",
                                            (int(payload["data"]["id"]),)).fetchone()[0]))
        raise RuntimeError("the host application is broken")

    client, auth = keyed_client(db, on_event=callback)
    api = Api(client, auth)
    caplog.set_level(logging.ERROR, logger="campaignapi")
    made = import_csv(api, make_datasource(api), "email\nann@example.com\n")
    assert made["id"] == "1"
    assert seen == [("import.finished", "finished")]
    assert "the on_event callback failed for import.finished" in caplog.text
    assert "the host application is broken" in caplog.text
    assert scalar(db, "SELECT count(*) FROM recipient") == 1


def test_the_worker_hands_its_events_to_the_callback(hooks, db, smtp_sink):
    build_world(hooks)
    got = []

    def callback(kind, payload):
        got.append((kind, payload["data"]["status"]))
        raise ValueError("ignored")

    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop),
                              kwargs={"smtp": smtp_sink.address, "on_event": callback,
                                      "interval": 0.1})
    worker.start()
    try:
        wait_for(lambda: ("batch.sent", "sent") in got, timeout=30, what="batch.sent")
    finally:
        stop.set()
        worker.join(30)
    assert got == [("batch.started", "sending"), ("batch.sent", "sent")]


def test_a_hard_bounce_in_delivery_reaches_the_callback(db, smtp_sink, seed_campaign):
    ids = seed_campaign([("gone@example.org", "G")])
    smtp_sink.always["gone@example.org"] = "550 5.1.1 no such user"
    got = []
    counts = campaignapi.deliver(db, smtp_sink.address,
                                 on_event=lambda kind, payload: got.append((kind, payload)))
    assert counts["bounced"] == 1
    [(kind, payload)] = got
    assert kind == "recipient.bounced"
    assert payload["data"]["email"] == "gone@example.org"
    assert payload["data"]["batch"] == str(ids["batch"])


# --- a dead worker's claims ------------------------------------------------------------------

DELIVER_CHILD = """
import sys, campaignapi
campaignapi.deliver_webhooks(sys.argv[1], allow_private=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_killed_workers_claim_comes_back_after_the_lease(hooks, db):
    hold = [True]

    def plan(call):
        if hold and hold.pop():
            return lambda handler: receiver.release.wait(20)   # got it, never answers
        return 204

    with EventReceiver(plan) as receiver:
        make_webhook(hooks, receiver)
        ds = make_datasource(hooks)
        import_csv(hooks, ds, "email\na@example.com\n", name="first")
        import_csv(hooks, ds, "email\nb@example.com\n", name="second")
        child = subprocess.Popen([sys.executable, "-c", DELIVER_CHILD, db], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: receiver.calls, timeout=30, what="the child's first post")
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        claimed = deliveries(db)[0]
        assert claimed["claimed_by"] and claimed["status"] == "pending"
        # The claim is fresh: a live worker leaves it alone, and the later
        # event waits behind it.
        assert deliver(db) == {"delivered": 0, "retried": 0, "failed": 0}
        assert len(receiver.calls) == 1
        # Once the lease has run out it is taken back and sent again (times
        # are stored to the second: one more second makes sure).
        time.sleep(3.1)
        counts = deliver(db, lease=datetime.timedelta(seconds=2), timeout=1)
    assert counts == {"delivered": 2, "retried": 0, "failed": 0}
    first, again, _second = receiver.calls
    assert (first["id"], first["body"]) == (again["id"], again["body"])
    assert [p["data"]["name"] for p in receiver.acknowledged()] == ["first", "second"]
    assert all(call["error"] is None for call in receiver.calls)


def test_the_lease_must_outlast_one_post(db):
    campaignapi.init_db(db)
    with pytest.raises(ValueError, match="lease"):
        campaignapi.deliver_webhooks(db, timeout=60)


# --- the command line -----------------------------------------------------------------------

@pytest.mark.parametrize("allowed", [False, True])
def test_serve_allows_loopback_webhooks_only_with_the_flag(tmp_path, allowed):
    flags = ["--webhook-allow-private"] if allowed else []
    with served("--db", str(tmp_path / "cli.db"), *flags, cwd=tmp_path) as server:
        status, _, body = http(f"http://127.0.0.1:{server.port}/v1/webhook/0", "PUT",
                               {"url": "http://127.0.0.1:9/hook"},
                               {"Authorization": f"Bearer {server.secret}"})
    data = json.loads(body)["data"]
    if allowed:
        assert status == 200 and data["secret"].startswith("whsec_")
    else:
        assert status == 400 and "a loopback address" in data["message"]
