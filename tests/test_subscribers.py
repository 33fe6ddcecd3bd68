"""Internal subscribers of events: emit() hands each event to the handlers
the module registered for its kind, inside the transaction of the change
that raises it, so what a handler writes commits or rolls back with that
change.  (An automation that starts when a recipient is confirmed hooks in
here.)

These tests register through ``campaignapi._subscribe`` on purpose: the
registry is the module's own extension point and has no public face; each
test takes its handlers out again."""

import pytest
import webtest

import campaignapi
from conftest import Api
from helpers import (build_world, confirm_path, database, import_csv, make_datasource,
                     make_signup_list, scalar, snapshot)


@pytest.fixture
def subscribe():
    """``subscribe(kind, handler)`` for the length of one test."""
    added = []

    def add(kind, handler):
        # internal: the registry of subscribers has no public face (see the docstring)
        added.append((kind, campaignapi._subscribe(kind, handler)))

    yield add
    for kind, handler in added:
        # internal: takes the test's handlers out of that registry again
        campaignapi._SUBSCRIBERS[kind].remove(handler)


@pytest.fixture
def writes(subscribe):
    """A subscriber of every kind that writes a row in the transaction of the
    event (``setting`` "subscriber N" = kind) and notes what it saw there."""
    seen = []

    def handler(conn, account, payload, pending):
        seen.append((payload["type"], account, payload))
        conn.execute("INSERT INTO setting (name, value) VALUES (?, ?)",
                     (f"subscriber {len(seen):03}", payload["type"]))

    for kind in campaignapi.EVENT_KINDS:
        subscribe(kind, handler)
    return seen


def written(db):
    """The kinds the subscriber's committed rows name, in order."""
    with database(db) as conn:
        return [row[0] for row in conn.execute(
            "SELECT value FROM setting WHERE name LIKE 'subscriber %' ORDER BY name")]


@pytest.fixture
def public(db):
    """An app that builds links (sign-up confirmations) and records on_event."""
    events = []
    app = campaignapi.create_app(db, public_url="https://lists.example.com/email",
                                 on_event=lambda kind, payload: events.append(kind))
    return webtest.TestApp(app), events


def test_a_subscriber_sees_every_kind_of_event_in_its_transaction(
        db, make_key, public, writes, smtp_sink):
    client, events = public
    api = Api(client, make_key())
    account = scalar(db, "SELECT id FROM account")
    ids = build_world(api)                          # import.finished, export.finished
    ds = ids["datasource"]
    api.put(f"/datasource/{ds}/recipient/0", email="cat@example.com")   # recipient.subscribed
    cat = str(scalar(db, "SELECT id FROM recipient WHERE email = 'cat@example.com'"))
    automation = api.put("/automation/0", name="by hand", datasource=int(ds),
                         trigger={"type": "api"}, accountprofile=int(ids["profile"]),
                         steps=[{"send": int(ids["message"])}], enabled="1")["id"]
    run = api.put(f"/automation/{automation}/run/0", recipient=int(cat))["id"]   # started
    api.delete(f"/automation/{automation}/run/{run}")                          # finished
    api.call("POST", f"/datasource/{ds}/recipient/{cat}", {"status": "unsubscribed"})
    api.post("/bounce", email="ann@example.com", type="hard")
    api.post("/bounce", email="bob@example.com", type="complaint")
    signups = make_signup_list(api)
    client.post_json(f"/v1/subscribe/{signups}", {"email": "dan@example.com"})

    def confirmed(conn, account, payload, pending):
        # The change is there in the transaction, and not yet outside it.
        recipient = int(payload["data"]["id"])
        inside = conn.execute("SELECT status FROM recipient WHERE id = ?",
                              (recipient,)).fetchone()[0]
        with database(db) as other:
            outside = other.execute("SELECT status FROM recipient WHERE id = ?",
                                    (recipient,)).fetchone()[0]
        seen_confirm.append((inside, outside))

    seen_confirm = []
    # internal: the registry of subscribers has no public face (see the docstring)
    campaignapi._subscribe("recipient.confirmed", confirmed)
    try:
        body = scalar(db, "SELECT body FROM outbox WHERE kind = 'signup'")
        assert client.post(confirm_path(body)).status_int == 200
    finally:
        # internal: takes the handler out of that registry again
        campaignapi._SUBSCRIBERS["recipient.confirmed"].remove(confirmed)
    assert seen_confirm == [("active", "unconfirmed")]
    campaignapi.process_due(db)                     # batch.started
    campaignapi.deliver(db, smtp_sink.address)
    campaignapi.process_due(db)                     # batch.sent
    kinds = ["import.finished", "export.finished", "recipient.subscribed",
             "automation.started", "automation.finished", "recipient.unsubscribed", "recipient.bounced", "recipient.complained",
             "recipient.subscribed", "recipient.confirmed", "batch.started", "batch.sent"]
    assert sorted(set(kinds)) == sorted(campaignapi.EVENT_KINDS)
    assert [kind for kind, _, _ in writes] == kinds
    assert {owner for _, owner, _ in writes} == {account}
    # Each handler's row committed with its change; webhooks and on_event as before.
    assert written(db) == kinds
    assert [payload for kind, _, payload in writes if kind == "recipient.bounced"][0][
        "data"]["email"] == "ann@example.com"
    assert events == kinds[:-2]    # the worker's own calls were given no callback


def failing(subscribe, kind):
    """A subscriber of ``kind`` that writes, then one that fails."""
    def write(conn, account, payload, pending):
        conn.execute("INSERT INTO setting (name, value) VALUES ('subscriber 1', ?)", (kind,))

    def fail(conn, account, payload, pending):
        raise RuntimeError("the subscriber is broken")

    subscribe(kind, write)
    subscribe(kind, fail)


@pytest.mark.parametrize("kind", ["recipient.subscribed", "recipient.confirmed",
                                  "recipient.bounced", "import.finished"])
def test_a_failing_subscriber_fails_the_request_and_its_write_rolls_back(
        db, make_key, public, subscribe, kind):
    client, events = public
    api = Api(client, make_key())
    ds = make_datasource(api)
    import_csv(api, ds, "email\nann@example.com\n")
    signups = make_signup_list(api)
    client.post_json(f"/v1/subscribe/{signups}", {"email": "dan@example.com"})
    events.clear()
    failing(subscribe, kind)
    before = snapshot(db)
    if kind == "recipient.subscribed":
        response = client.put_json(f"/v1/datasource/{ds}/recipient/0",
                                   {"email": "cat@example.com"}, headers=api.headers,
                                   expect_errors=True)
    elif kind == "recipient.confirmed":
        body = scalar(db, "SELECT body FROM outbox WHERE kind = 'signup'")
        response = client.post(confirm_path(body), expect_errors=True)
    elif kind == "recipient.bounced":
        response = client.post_json("/v1/bounce", {"email": "ann@example.com", "type": "hard"},
                                    headers=api.headers, expect_errors=True)
    else:
        response = client.put_json(f"/v1/datasource/{ds}/import/0", {
            "name": "i", "originalfile": "f.csv", "__uploadtype__": "csv",
            "__uploaddata__": "email\nbob@example.com\n"}, headers=api.headers,
            expect_errors=True)
    # A public page's write that fails is logged and left out (_apply_later),
    # the person still gets the page; an API request answers the error.
    assert response.status_int == (200 if kind == "recipient.confirmed" else 500)
    assert snapshot(db) == before and written(db) == [] and events == []


def test_a_failing_subscriber_of_the_worker_leaves_the_batch_to_be_made_again(
        db, api, subscribe):
    ids = build_world(api)
    failing(subscribe, "batch.started")
    with pytest.raises(RuntimeError, match="the subscriber is broken"):
        campaignapi.process_due(db)
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", int(ids["batch"])) == "scheduled"
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == 0
    assert written(db) == []


def test_only_known_kinds_can_be_subscribed():
    with pytest.raises(ValueError, match="unknown event kind"):
        # internal: the registry of subscribers has no public face (see the docstring)
        campaignapi._subscribe("recipient.teleported", lambda *args: None)
