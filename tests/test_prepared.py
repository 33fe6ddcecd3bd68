"""Prepared messages: a campaign-grade email outside a batch (an automation's
step, a transactional email) is built from a message prepared once
(template, CSS inlined, tracked html and links, sender, List-Id, base URL,
bulk or not) and queued through enqueue() naming it.  Delivered to a real
SMTP server; its open, click and unsubscribe links work through the app and
its events count for the prepared message."""

import email.utils
import re
import urllib.parse

import pytest

import campaignapi
from helpers import account_id, database, import_csv, make_datasource, open_url_in, scalar

HTML = ("<html><head><style>p{color:red}</style></head><body><p>Hi {{first}}</p>"
        "<p><a href='https://shop.example/sale?who={{first}}'>Sale</a> "
        '<a href="https://blog.example/post">Blog</a>'
        ' <a href="{{unsubscribe_url}}">unsubscribe</a></p></body></html>')
TEXT = "Hi {{first}}\nUnsubscribe: {{unsubscribe_url}}"
BASE = "http://mail.example/api"


def html_of(message):
    return message.get_body(("html",)).get_content()


def links_in(html_text):
    return [a or b for a, b in re.findall(r'href="([^"]*)"|href=\'([^\']*)\'', html_text)]


def path_of(url):
    return urllib.parse.urlsplit(url).path


@pytest.fixture
def world(api, db):
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\nann@example.com,Ann Lee\nbob@example.com,Bob\n")
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example", replyto="help@shop.example")["id"]
    message = api.put("/message/0", name="Welcome", subject="Hello {{first}}", html=HTML,
                      text=TEXT)["id"]
    account = account_id(db, "owner@example.com")
    with database(db) as conn:
        ids = {row["email"]: row["id"] for row in conn.execute("SELECT id, email FROM recipient")}
    return {"account": account, "profile": int(profile), "message": int(message),
            "recipients": ids}


def prepare(db, world, scope="automation:7:0", **options):
    with database(db) as conn, campaignapi.transaction(conn):
        message = conn.execute("SELECT * FROM message WHERE id = ?",
                               (world["message"],)).fetchone()
        owner = {"owner": world["account"], "accountprofile": world["profile"]}
        # internal: the sender rule every campaign-grade email uses
        sender = campaignapi._campaign_sender(conn, owner, message)
        # internal: the List-Id of an automation's emails
        options.setdefault("list_id", campaignapi._list_id("automation", 7, world["account"]))
        # internal: the preparation that automations and transactional email build on
        return campaignapi._prepared(conn, world["account"], scope, message, sender,
                                     base_url=BASE, **options)


def queue(db, world, prepared, to_addr, **options):
    with database(db) as conn, campaignapi.transaction(conn):
        return campaignapi.enqueue(conn, world["account"], options.pop("kind", "automation"),
                                   to_addr, prepared=prepared, **options)


def test_a_prepared_message_is_made_once_for_the_same_inputs(db, world, api):
    first = prepare(db, world, tracking=True)
    assert prepare(db, world, tracking=True) == first
    assert prepare(db, world, tracking=False) != first          # another input: another
    assert prepare(db, world, "automation:7:1", tracking=True) != first   # another scope
    api.post(f"/message/{world['message']}", subject="Changed {{first}}")
    changed = prepare(db, world, tracking=True)
    assert changed != first
    with database(db) as conn:
        row = conn.execute("SELECT * FROM prepared WHERE id = ?", (first,)).fetchone()
        assert row["subject"] == "Hello {{first}}" and "{{click_url_1}}" in row["tracked"]
        assert 'style="color: red' in row["html"]       # CSS inlined once, here
        assert [tuple(r) for r in conn.execute(
            "SELECT link, url FROM prepared_link WHERE prepared = ? ORDER BY link", (first,))] == [
            (0, "https://shop.example/sale?who={{first}}"), (1, "https://blog.example/post")]


def test_a_tracked_prepared_email_is_delivered_campaign_grade(db, world, app, client, smtp_sink):
    secret = app.config["campaignapi.service"].secret
    prepared = prepare(db, world, tracking=True)
    ann = queue(db, world, prepared, "ann@example.com",
                recipient=world["recipients"]["ann@example.com"])
    bob = queue(db, world, prepared, "bob@example.com",
                recipient=world["recipients"]["bob@example.com"])
    counts = campaignapi.deliver(db, smtp_sink.address, bounce_domain="bounces.example")
    assert counts["sent"] >= 2 and not counts["error"], counts
    envelopes = {rcpts[0]: mail_from for mail_from, rcpts, _ in smtp_sink.messages}
    received = smtp_sink.parsed()
    message = received["ann@example.com"]
    # VERP and the signed Message-ID name the outbox email.
    assert campaignapi.read_verp(secret, envelopes["ann@example.com"]) == ann
    assert campaignapi.read_verp(secret, envelopes["bob@example.com"]) == bob
    assert campaignapi.read_message_id(secret, message["Message-ID"]) == ann
    # Sender, subject, List-Id and the one-click unsubscribe headers.
    assert email.utils.parseaddr(message["From"]) == ("The Shop", "news@shop.example")
    assert message["Reply-To"] == "help@shop.example" and message["Subject"] == "Hello Ann Lee"
    assert message["List-Id"] == f"<automation-7.{world['account']}.campaignapi>"
    assert message["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    unsubscribe = message["List-Unsubscribe"].strip("<>")
    assert unsubscribe.startswith(BASE + "/v1/unsubscribe/")
    body = html_of(message)
    sale, blog, in_body = links_in(body)
    assert in_body == unsubscribe and unsubscribe in message.get_body(("plain",)).get_content()
    assert path_of(sale).startswith("/api/v1/click/") and path_of(blog).startswith("/api/v1/click/")
    assert "Ann" not in sale and "ann" not in unsubscribe
    opened = open_url_in(body)
    route = lambda url: path_of(url)[len("/api"):]                      # noqa: E731

    # The click goes to the URL stored for the prepared message, with her values.
    response = client.get(route(sale))
    assert response.status_int == 302
    assert response.headers["Location"] == "https://shop.example/sale?who=Ann%20Lee"
    assert client.get(route(blog)).headers["Location"] == "https://blog.example/post"
    assert client.get(route(opened)).status_int == 200
    # Forged or altered tokens: 404, nothing counted.
    token = route(sale).rsplit("/", 1)[1]
    for forged in (token[:-1] + ("A" if token[-1] != "A" else "B"),
                   campaignapi.sign_token(secret, "click", ann, 5),
                   campaignapi.sign_token("another secret", "click", ann, 0)):
        assert client.get(f"/v1/click/{forged}", expect_errors=True).status_int == 404
    # One-click unsubscribe by the link: Ann is unsubscribed, counted for the message.
    assert client.post(route(unsubscribe), {"List-Unsubscribe": "One-Click"}).status_int == 200
    assert scalar(db, "SELECT status FROM recipient WHERE email = 'ann@example.com'") == \
        "unsubscribed"
    # A hard bounce that names Bob's email by VERP counts for the message too.
    with database(db) as conn, campaignapi.transaction(conn):
        campaignapi.apply_bounce(conn, {"type": "hard", "outbox": campaignapi.read_verp(
            secret, envelopes["bob@example.com"])})
    with database(db) as conn:
        assert sorted(tuple(row) for row in conn.execute(
            "SELECT kind, outbox, link FROM event WHERE prepared = ?", (prepared,))) == sorted([
                ("click", ann, 0), ("click", ann, 1), ("open", ann, None),
                ("unsubscribe", ann, None), ("bounce", bob, None)])
        assert conn.execute("SELECT count(*) FROM event WHERE prepared IS NULL").fetchone()[0] == 0
    # A later email of the prepared message to Ann, who left, is never sent.
    later = queue(db, world, prepared, "ann@example.com",
                  recipient=world["recipients"]["ann@example.com"])
    campaignapi.deliver(db, smtp_sink.address)
    assert scalar(db, "SELECT status FROM outbox WHERE id = ?", later) == "skipped"


def test_an_untracked_prepared_email_keeps_its_links(db, world, smtp_sink):
    prepared = prepare(db, world)
    queue(db, world, prepared, "bob@example.com", recipient=world["recipients"]["bob@example.com"])
    campaignapi.deliver(db, smtp_sink.address)
    body = html_of(smtp_sink.parsed()["bob@example.com"])
    assert "https://shop.example/sale?who=Bob" in body and "/v1/click/" not in body
    assert "/v1/open/" not in body


def test_a_prepared_email_without_a_recipient_row_takes_its_merge_values(db, world, client,
                                                                           smtp_sink):
    prepared = prepare(db, world, "transactional:1", tracking=True, bulk=False, list_id="")
    outbox = queue(db, world, prepared, "zed@example.net", kind="transactional",
                   merge_values={"first": "Zed", "email": "not this"})
    campaignapi.deliver(db, smtp_sink.address)
    message = smtp_sink.parsed()["zed@example.net"]
    assert message["Subject"] == "Hello Zed"
    # Not bulk mail: no List-Unsubscribe, no List-Id, an empty unsubscribe link.
    assert message["List-Unsubscribe"] is None and message["List-Id"] is None
    sale = links_in(html_of(message))[0]
    response = client.get(path_of(sale)[len("/api"):])
    assert response.headers["Location"] == "https://shop.example/sale?who=Zed"
    assert scalar(db, "SELECT count(*) FROM event WHERE prepared = ? AND outbox = ?",
                  prepared, outbox) == 1
