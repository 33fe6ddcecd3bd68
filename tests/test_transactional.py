"""Transactional email (API.md section 19): one message to one address now,
with merge values from ``data``, the sender rule, a template, tracking; not
bulk mail (no List-Unsubscribe), so it reaches addresses that unsubscribed
from campaigns, and an address known as bounced or complained is refused
with nothing sent.  Delivered to a real SMTP server (aiosmtpd), before every
waiting campaign email; its record follows its outbox email (queued, sent,
failed, bounced, opened, clicked)."""

import re
import threading

import pytest

import campaignapi
from helpers import (account_id, assert_error, database, import_csv, make_campaign,
                     make_datasource, open_url_in, scalar, send, wait_for)

PUBLIC = "http://mail.example/api"
HTML = ("<html><head><style>p{color:#333}</style></head><body><p>Hi {{name}},</p>"
        "<p><a href='{{reset_url}}'>Reset your password</a> for {{email}}.</p></body></html>")
TEXT = "Hi {{name}},\nReset your password: {{reset_url}}\n({{email}})"


@pytest.fixture
def app(db):
    return campaignapi.create_app(db, public_url=PUBLIC)


@pytest.fixture
def reset(api):
    """A sender profile and a password-reset message without a sender of its own."""
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="no-reply@shop.example", replyto="help@shop.example")["id"]
    message = api.put("/message/0", name="Reset", subject="Reset your password, {{name}}",
                      html=HTML, text=TEXT)["id"]
    return {"profile": int(profile), "message": int(message)}


def send_reset(api, reset, to="ann@example.org", status=200, **options):
    return api.put("/transactional/0", status=status, to=to, message=reset["message"],
                   accountprofile=reset["profile"],
                   data={"name": "Ann", "reset_url": "https://shop.example/reset/abc"},
                   **options)


def test_a_transactional_email_arrives_filled_and_without_bulk_headers(api, reset, db,
                                                                       smtp_sink):
    sent = send_reset(api, reset)
    record = api.get(f"/transactional/{sent['id']}")["transactional"]
    assert record["status"] == "queued" and record["to"] == "ann@example.org"
    assert record["message"] == str(reset["message"]) and record["sent"] is None
    counts = campaignapi.deliver(db, smtp_sink.address)
    assert counts["sent"] == 1
    email = smtp_sink.parsed()["ann@example.org"]
    assert email["Subject"] == "Reset your password, Ann"
    assert email["From"] == "The Shop <no-reply@shop.example>"
    assert email["Reply-To"] == "help@shop.example"
    # Not bulk mail: no unsubscribe header, no list.
    assert email["List-Unsubscribe"] is None and email["List-Id"] is None
    text = email.get_body(("plain",)).get_content()
    assert "Hi Ann," in text and "https://shop.example/reset/abc" in text
    assert "(ann@example.org)" in text
    html = email.get_body(("html",)).get_content()
    # Untracked: the link goes straight to the site; the CSS was inlined.
    assert "href='https://shop.example/reset/abc'" in html or \
        'href="https://shop.example/reset/abc"' in html
    assert "/v1/click/" not in html and "/v1/open/" not in html
    assert re.search(r"<p style=\"color: ?#333;?\"", html), html
    record = api.get(f"/transactional/{sent['id']}")["transactional"]
    assert record["status"] == "sent" and record["sent"] and record["error"] is None
    assert record["opened"] is None and record["clicked"] is None


def test_it_reaches_unsubscribed_addresses_and_refuses_bounced_and_complained(api, reset, db,
                                                                             smtp_sink):
    account = account_id(db, "owner@example.com")
    with database(db) as conn, campaignapi.transaction(conn):
        for address, reason in [("gone@example.org", "unsubscribed"),
                                ("dead@example.org", "bounced"),
                                ("angry@example.org", "complained")]:
            campaignapi.suppress(conn, account, address, reason)
    send_reset(api, reset, to="gone@example.org")
    for address in ("dead@example.org", "angry@example.org"):
        outbox = scalar(db, "SELECT count(*) FROM outbox")
        data = send_reset(api, reset, to=address, status=409)
        assert data["error"] == "conflict" and data["field"] == "to"
        assert scalar(db, "SELECT count(*) FROM outbox") == outbox
        assert scalar(db, "SELECT count(*) FROM transactional") == 1
    campaignapi.deliver(db, smtp_sink.address)
    assert set(smtp_sink.parsed()) == {"gone@example.org"}


def test_bad_requests_change_nothing(api, reset, db, stranger_api):
    outbox = scalar(db, "SELECT count(*) FROM outbox")
    assert send_reset(api, reset, to="", status=400)["field"] == "to"
    assert send_reset(api, reset, to="not an address", status=400)["field"] == "to"
    missing = api.put("/transactional/0", status=400, message=reset["message"])
    assert missing["error"] == "missing_parameter" and missing["field"] == ["to"]
    assert api.put("/transactional/0", status=404, to="a@example.org", message=999)["field"] \
        == "message"
    assert send_reset(api, reset, template=999, status=404)["field"] == "template"
    assert send_reset(api, reset, template="layout", status=409)["field"] == "template"
    empty = api.put("/message/0", name="Empty", subject="", text="")["id"]
    assert api.put("/transactional/0", status=409, to="a@example.org",
                   message=int(empty))["field"] == "message"
    api.delete(f"/message/{empty}", id=int(empty))
    assert api.put("/transactional/0", status=409, to="a@example.org",
                   message=int(empty))["field"] == "message"
    # Another account's message is as unknown as one that does not exist.
    theirs = stranger_api.put("/message/0", name="X", subject="s", text="t")["id"]
    assert api.put("/transactional/0", status=404, to="a@example.org",
                   message=int(theirs))["field"] == "message"
    assert scalar(db, "SELECT count(*) FROM outbox") == outbox
    assert scalar(db, "SELECT count(*) FROM transactional") == 0
    # Records of another account are not found either.
    sent = send_reset(api, reset)
    stranger_api.get(f"/transactional/{sent['id']}", status=404)
    assert stranger_api.get("/transactional/all")["total"] == "0"


def test_a_template_wraps_it_and_a_given_id_is_kept(api, reset, db, smtp_sink):
    template = api.put("/template/0", name="frame", html="<div class='frame'>{{content}}</div>",
                       text="{{content}}\n-- The Shop")["id"]
    sent = send_reset(api, reset, template=int(template))
    chosen = api.put("/transactional/500", to="bob@example.org", message=reset["message"],
                     data={"name": "Bob", "reset_url": "https://shop.example/r/b"})
    assert chosen["id"] == "500"
    assert_error(send(api.client, "PUT", "/v1/transactional/500", api.headers,
                      {"to": "bob@example.org", "message": reset["message"]}), 409, "conflict")
    campaignapi.deliver(db, smtp_sink.address)
    emails = smtp_sink.parsed()
    assert "class=\"frame\"" in emails["ann@example.org"].get_body(("html",)).get_content() or \
        "class='frame'" in emails["ann@example.org"].get_body(("html",)).get_content()
    assert emails["ann@example.org"].get_body(("plain",)).get_content().rstrip().endswith(
        "-- The Shop")
    # Without a template, sender profile or data: the message as it is, {{name}} empty.
    assert emails["bob@example.org"]["Subject"] == "Reset your password, Bob"
    assert api.get(f"/transactional/{sent['id']}")["transactional"]["status"] == "sent"


def queue_campaign(api, db, count):
    """A campaign batch of ``count`` emails waiting in the outbox."""
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\n" + "".join(f"c{i}@example.com,C{i}\n"
                                                   for i in range(count)))
    campaign = make_campaign(api, [ds])["campaign"]
    api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)


def test_it_goes_before_every_waiting_campaign_email(api, reset, db, smtp_sink):
    queue_campaign(api, db, 30)
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == 30
    send_reset(api, reset, to="first@example.org")
    campaignapi.deliver(db, smtp_sink.address, batch_size=5)
    # (the account holder's notice of the import is the only other email)
    order = [rcpts[0] for _, rcpts, _ in smtp_sink.messages if rcpts[0] != "owner@example.com"]
    assert len(order) == 31 and order[0] == "first@example.org", order[:3]


def test_a_transactional_email_queued_during_a_chunk_goes_next(api, reset, db, smtp_sink):
    # A courier that claimed a long chunk of campaign emails looks for
    # transactional ones as it goes, and sends them before the rest.
    queue_campaign(api, db, 200)
    queued = threading.Event()

    def queue_when_delivery_started():
        wait_for(lambda: smtp_sink.count() >= 3, timeout=60, interval=0.005,
                 what="delivery to start")
        send_reset(api, reset, to="urgent@example.org")
        queued.set()

    thread = threading.Thread(target=queue_when_delivery_started)
    thread.start()
    campaignapi.deliver(db, smtp_sink.address, batch_size=200, rate=50)
    thread.join(60)
    assert queued.is_set()
    campaignapi.deliver(db, smtp_sink.address)
    order = [rcpts[0] for _, rcpts, _ in smtp_sink.messages]
    position = order.index("urgent@example.org")
    # At 50 a second and a look every 0.2 s: within about 10 emails of its
    # queueing, never after the chunk's 200.
    assert position < 40, position


def test_tracking_counts_opens_and_clicks_and_a_hard_bounce_shows(api, reset, db, smtp_sink,
                                                                  client):
    # A link holding a merge tag is filled at the click (a link that is only
    # a merge tag is not tracked, as in campaigns).
    tracked = api.put("/message/0", name="Tracked", subject="Reset",
                      html="<p><a href='https://shop.example/reset?t={{token}}'>Reset</a></p>",
                      text="https://shop.example/reset?t={{token}}")["id"]
    sent = api.put("/transactional/0", to="ann@example.org", message=int(tracked),
                   data={"token": "abc"}, tracking=1)
    smtp_sink.always["dead@example.org"] = "550 5.1.1 no such user"
    failed = send_reset(api, reset, to="dead@example.org")
    campaignapi.deliver(db, smtp_sink.address)
    html = smtp_sink.parsed()["ann@example.org"].get_body(("html",)).get_content()
    links = re.findall(r"href=['\"]([^'\"]+)['\"]", html)
    clicks = [link for link in links if "/v1/click/" in link]
    opens = [open_url_in(html)]
    assert clicks and opens and all(link.startswith(PUBLIC) for link in clicks + opens), html
    record = api.get(f"/transactional/{sent['id']}")["transactional"]
    assert record["opened"] is None and record["clicked"] is None
    client.get(opens[0].removeprefix(PUBLIC))
    answer = client.get(clicks[0].removeprefix(PUBLIC))
    assert answer.status_int == 302
    assert answer.headers["Location"] == "https://shop.example/reset?t=abc"
    wait_for(lambda: api.get(f"/transactional/{sent['id']}")["transactional"]["clicked"],
             timeout=10, what="the click to be counted")
    record = api.get(f"/transactional/{sent['id']}")["transactional"]
    assert record["opened"] and record["clicked"] and record["status"] == "sent"
    bounced = api.get(f"/transactional/{failed['id']}")["transactional"]
    assert bounced["status"] == "bounced" and bounced["error"].startswith("550")
    # Known as bounced now: the next one is refused.
    send_reset(api, reset, to="dead@example.org", status=409)
    # The listing, filtered.
    assert api.get("/transactional/all")["total"] == "2"
    page = api.call("GET", "/transactional/all?status=bounced")
    assert [r["id"] for r in page["transactional"]] == [failed["id"]]
    page = api.call("GET", "/transactional/all?to=ANN@example.org")
    assert [r["id"] for r in page["transactional"]] == [sent["id"]]


def test_a_retried_send_with_a_key_sends_once(api, reset, db, smtp_sink):
    body = {"to": "ann@example.org", "message": reset["message"], "data": {"name": "Ann"}}
    headers = {**api.headers, "Idempotency-Key": "reset-ann-1"}
    first = send(api.client, "PUT", "/v1/transactional/0", headers, body)
    again = send(api.client, "PUT", "/v1/transactional/0", headers, body)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["data"] == first.json["data"]
    campaignapi.deliver(db, smtp_sink.address)
    assert smtp_sink.count() == 1


def test_a_running_worker_delivers_it(db, smtp_sink, reset, api):
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop, smtp_sink.address))
    worker.start()
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM outbox WHERE status = 'queued'") == 0,
                 timeout=30, what="the worker to start")
        sent = send_reset(api, reset)
        wait_for(lambda: smtp_sink.count() == 1, timeout=30, interval=0.01,
                 what="the email at the relay")
        wait_for(lambda: api.get(f"/transactional/{sent['id']}")["transactional"]["status"]
                 == "sent", timeout=30, what="the record to say sent")
    finally:
        stop.set()
        worker.join(30)
