"""Unsubscribe links: signed tokens, the confirm page, RFC 8058 one-click."""

import urllib.parse

import pytest

import campaignapi
from helpers import account_id, b64, database, unb64


def query(db, sql, args=()):
    with database(db) as conn:
        return [tuple(row) for row in conn.execute(sql, args)]


@pytest.fixture
def secret(app):
    return app.config["campaignapi.service"].secret


@pytest.fixture
def people(seed_campaign):
    """The same address in two lists of one account and in another account."""
    first = seed_campaign([("Pat@Example.org", "Pat"), ("other@example.org", "O")])
    seed_campaign([("pat@example.org", "Pat again")])
    seed_campaign([("pat@example.org", "Pat")], owner="else@example.net")
    return first


def path(secret, account, address, campaign=None):
    # internal: the first-release link, as those emails carry it
    return urllib.parse.urlsplit(campaignapi._unsubscribe_url(
        secret, "http://x", account, address, campaign)).path


def statuses(db):
    return query(db, "SELECT d.owner, r.email, r.status FROM recipient r "
                     "JOIN datasource d ON d.id = r.datasource ORDER BY r.id")


def test_token_round_trip_and_forgeries(secret):
    token = campaignapi.unsubscribe_token(secret, 7, "a:b@example.org", 3)
    assert campaignapi.read_unsubscribe_token(secret, token) == (7, "a:b@example.org", 3)
    assert campaignapi.read_unsubscribe_token("another secret", token) is None
    payload, mac = token.split(".")
    forged = campaignapi.unsubscribe_token(secret, 8, "a:b@example.org", 3).split(".")[0]
    for bad in (f"{forged}.{mac}", f"{payload}.{mac[:-2]}AA", payload, "", "..", "é.é",
                f"{payload}.{mac}.x"):
        assert campaignapi.read_unsubscribe_token(secret, bad) is None, bad


def test_get_shows_a_confirm_page_and_changes_nothing(client, db, secret, people):
    response = client.get(path(secret, people["account"], "pat@example.org", people["campaign"]))
    assert response.status_int == 200 and response.content_type == "text/html"
    assert "pat@example.org" in response.text
    form = response.forms[0]
    assert form.method.lower() == "post" and not form.action  # posts back to the same URL
    assert query(db, "SELECT * FROM suppression") == []
    # The confirm button is a plain form post (no JavaScript, form-encoded body).
    done = form.submit()
    assert done.status_int == 200 and "will receive no more" in done.text
    assert query(db, "SELECT account, email, reason, campaign FROM suppression") == [
        (people["account"], "pat@example.org", "unsubscribed", people["campaign"])]


def test_one_click_post_unsubscribes_every_list_of_the_account(client, db, secret, people):
    response = client.post(path(secret, people["account"], "pat@example.org", people["campaign"]),
                           "List-Unsubscribe=One-Click",
                           content_type="application/x-www-form-urlencoded")
    assert response.status_int == 200
    mine = people["account"]
    assert [(owner == mine, email, status) for owner, email, status in statuses(db)] == [
        (True, "Pat@Example.org", "unsubscribed"), (True, "other@example.org", "active"),
        (True, "pat@example.org", "unsubscribed"), (False, "pat@example.org", "active")]
    # A second click (or a retrying mail client) is harmless.
    assert client.post(path(secret, mine, "pat@example.org")).status_int == 200
    assert query(db, "SELECT reason, campaign FROM suppression") == [
        ("unsubscribed", people["campaign"])]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_forged_or_garbled_tokens_are_refused(client, db, secret, people, method):
    good = path(secret, people["account"], "pat@example.org")
    forged = path("not the secret", people["account"], "pat@example.org")
    for url in (forged, good[:-3] + "AAA", "/v1/unsubscribe/garbage", good + "x"):
        response = client.request(url, method=method, expect_errors=True)
        # A person followed the link: a page that says what to do, not the envelope.
        assert response.status_int == 404, url
        assert response.content_type == "text/html" and "not valid" in response.text
    assert query(db, "SELECT * FROM suppression") == []
    assert {status for _, _, status in statuses(db)} == {"active"}


def test_unsubscribe_replaces_a_bounce_but_not_the_other_way_round(db, people):
    conn = campaignapi.connect(db)
    with campaignapi.transaction(conn):
        campaignapi.suppress(conn, people["account"], "pat@example.org", "bounced")
        campaignapi.suppress(conn, people["account"], "pat@example.org", "unsubscribed")
        campaignapi.suppress(conn, people["account"], "pat@example.org", "bounced")
    conn.close()
    assert query(db, "SELECT reason FROM suppression") == [("unsubscribed",)]
    assert [s for owner, _, s in statuses(db) if owner == people["account"]] == [
        "unsubscribed", "active", "unsubscribed"]


def test_the_link_in_a_delivered_email_unsubscribes(client, db, smtp_sink, seed_campaign):
    ids = seed_campaign([("reader@example.org", "R")], base_url="")
    counts = campaignapi.deliver(db, smtp_sink.address, public_url="http://localhost:80/")
    assert counts["sent"] == 1
    message = smtp_sink.parsed()["reader@example.org"]
    link = message["List-Unsubscribe"].strip("<>")
    assert link.startswith("http://localhost:80/v1/unsubscribe/")
    assert link in message.get_body(("plain",)).get_content()
    # The app and the worker share the secret stored in the database.
    response = client.post(urllib.parse.urlsplit(link).path, "List-Unsubscribe=One-Click",
                           content_type="application/x-www-form-urlencoded")
    assert response.status_int == 200
    assert query(db, "SELECT status FROM recipient") == [("unsubscribed",)]
    # Mail queued before the click is not sent after it.
    conn = campaignapi.connect(db)
    with campaignapi.transaction(conn):
        conn.execute("UPDATE outbox SET status = 'queued' WHERE id = ?", (ids["outbox"][0],))
    conn.close()
    assert campaignapi.deliver(db, smtp_sink.address)["skipped"] == 1
    assert smtp_sink.count() == 1


def test_other_routes_still_refuse_form_bodies(client, auth):
    response = client.put("/v1/campaign/0", "name=x", headers=auth, expect_errors=True,
                          content_type="application/x-www-form-urlencoded")
    assert response.status_int == 415


def test_a_token_has_one_spelling_only(db):
    # The last character of 16 bytes in base64 carries 2 bits; the 4 unused
    # bits must not give the same MAC several spellings (nor may stray
    # characters, which base64 decoding would skip).
    secret = "s" * 64
    good = campaignapi.unsubscribe_token(secret, 1, "ann@example.com")
    assert campaignapi.read_unsubscribe_token(secret, good) == (1, "ann@example.com", None)
    payload, mac = good.split(".")
    last = b64(unb64(mac))[-1]
    same_bits = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
                 if c != last and campaignapi.base64.urlsafe_b64decode(mac[:-1] + c + "==")
                 == campaignapi.base64.urlsafe_b64decode(mac + "==")]
    assert same_bits  # such spellings exist...
    for variant in [f"{payload}.{mac[:-1]}{c}" for c in same_bits] + [f"{payload}.{mac}!",
                                                                       f"{payload}!.{mac}"]:
        assert campaignapi.read_unsubscribe_token(secret, variant) is None  # ...and are refused


def test_suppression_reasons_only_grow_stronger_and_are_recorded_once(db, app):
    """A complaint outranks an unsubscribe, which outranks a bounce; each
    change is one statistics event, a repeat or a weaker reason none."""
    account = account_id(db, "owner@example.com")
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):
            ds = conn.execute("INSERT INTO datasource (owner, name) VALUES (?, 'l')",
                              (account,)).lastrowid
            conn.execute("INSERT INTO recipient (datasource, email) VALUES (?, 'a@example.org')",
                         (ds,))
        steps = [("bounced", True, "bounced"), ("bounced", False, "bounced"),
                 ("unsubscribed", True, "unsubscribed"), ("bounced", False, "unsubscribed"),
                 ("complained", True, "complained"), ("unsubscribed", False, "complained")]
        for reason, changes, status in steps:
            pending = []
            with campaignapi.transaction(conn):
                assert campaignapi.suppress(conn, account, "a@example.org", reason, 7, batch=3,
                                            pending=pending) is changes
            assert [kind for kind, _ in pending] == ([f"recipient.{reason}"] if changes else [])
            assert conn.execute("SELECT status FROM recipient").fetchone()[0] == status
            assert conn.execute("SELECT reason FROM suppression").fetchone()[0] == status
        assert [tuple(row) for row in conn.execute(
            "SELECT kind, campaign, batch FROM event ORDER BY id")] == [
            ("bounce", 7, 3), ("unsubscribe", 7, 3), ("complaint", 7, 3)]
    finally:
        conn.close()
