"""Sending end to end: over real HTTP against `python campaignapi.py
serve --smtp ...`, build a campaign, send it now, every recipient gets exactly
one correct email at a real SMTP server; one click unsubscribes and the next
send skips that address.  And the unsubscribe page clicked in a real browser."""

import base64
import json
import os
import subprocess
import sys
import time

import pytest

import campaignapi
from helpers import answers, free_port, http, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CSV = ("email,first name,city\n"
       "ann@example.com,Ann <b>&amp;,Oslo\n"
       "bob@example.com,Bob,Porto\n"
       "Ann@EXAMPLE.com,Ann again,Oslo\n"
       "cid@example.com,Cid,Nantes\n")


@pytest.fixture
def server(tmp_path, smtp_sink):
    """`python campaignapi.py serve --smtp` as a real process: (base URL, secret)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "campaignapi.py"), "serve", "--db",
         str(tmp_path / "e2e.db"), "--port", str(port), "--smtp", smtp_sink.address,
         "--email", "owner@example.com", "--mail-from", "system@shop.example"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        secret = None
        for line in process.stdout:
            if line.startswith("cak_"):
                secret = line.strip()
            if "serving" in line:
                break
        assert secret, "serve printed no secret on a new database"
        wait_for(lambda: answers(base), what="the server to answer")
        yield base, secret
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_send_over_http_every_recipient_once_then_one_click_unsubscribe(server, smtp_sink):
    base, secret = server

    def api(method, path, **params):
        status, _, body = http(base + "/v1" + path, method, params,
                               {"Authorization": f"Bearer {secret}"})
        envelope = json.loads(body)
        assert status == 200 and envelope["success"], (method, path, status, envelope)
        return envelope["data"]

    ds = api("PUT", "/datasource/0", name="customers")["id"]
    api("PUT", f"/datasource/{ds}/import/0", name="list", originalfile="list.csv",
        __uploadtype__="base64", __uploaddata__=base64.b64encode(CSV.encode()).decode())
    profile = api("PUT", "/accountprofile/0", name="Shop", fromname="The Shop",
                  fromaddress="news@shop.example")["id"]
    message = api("PUT", "/message/0", name="Launch", subject="Hello {{first name}}",
                  html="<p>Hi {{first name}} from {{city}}</p>"
                       "<a href='{{unsubscribe_url}}'>unsubscribe</a>",
                  text="Hi {{first name}} from {{city}}\nUnsubscribe: {{unsubscribe_url}}")["id"]
    segment = api("PUT", "/segment/0", name="everyone", datasources=[int(ds)])["id"]
    campaign = api("PUT", "/campaign/0", name="Launch", accountprofile=int(profile),
                   archiveemail="archive@shop.example")["id"]
    api("PUT", f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    assert api("GET", f"/campaign/{campaign}/verify/0")["verify"]["passed"] == "1"

    first = api("PUT", f"/campaign/{campaign}/send/0", timestamp=int(time.time()))["id"]

    def campaign_mail():
        return [(rcpts[0], raw) for sender, rcpts, raw in smtp_sink.messages
                if sender == "news@shop.example"]

    wait_for(lambda: len(campaign_mail()) >= 3, what="three campaign emails")
    wait_for(lambda: api("GET", f"/campaign/{campaign}/batcharchive/{first}")["batcharchive"]
             ["status"] == "sent", what="the batch to finish")
    received = smtp_sink.parsed()
    # The last row of one address wins, its spelling too.
    assert sorted(to for to, _ in campaign_mail()) == [
        "Ann@example.com", "bob@example.com", "cid@example.com"]
    ann = received["Ann@example.com"]
    assert ann["From"] == "The Shop <news@shop.example>"
    assert ann["Subject"] == "Hello Ann again"   # the last row of one address wins
    assert ann["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert ann["Message-ID"] and ann["Date"] and ann["List-Id"]
    assert ann.get_content_type() == "multipart/alternative"
    link = ann["List-Unsubscribe"].strip("<>")
    assert link.startswith(base + "/v1/unsubscribe/")
    bob_html = received["bob@example.com"].get_body(("html",)).get_content()
    assert "Hi Bob from Porto" in bob_html and link not in bob_html
    # The archive copy and the import notification went out too.
    assert "archive@shop.example" in received
    assert "owner@example.com" in received

    # One click (RFC 8058) from Ann's List-Unsubscribe header, no key.
    status, _, _ = http(link, "POST", b"List-Unsubscribe=One-Click",
                        {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200
    recipients = api("GET", f"/datasource/{ds}/recipient/all")["recipient"]
    assert {r["email"]: r["status"] for r in recipients}["Ann@example.com"] == "unsubscribed"

    before = len(campaign_mail())
    second = api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")["id"]
    wait_for(lambda: api("GET", f"/campaign/{campaign}/batcharchive/{second}")["batcharchive"]
             ["status"] == "sent", what="the second batch to finish")
    again = [to for to, _ in campaign_mail()[before:]]
    assert sorted(again) == ["bob@example.com", "cid@example.com"]
    archive = api("GET", f"/campaign/{campaign}/archive/{campaign}")["archive"]
    assert (archive["sent"], archive["failed"], archive["unsubscribed"]) == ("5", "0", "1")


def test_unsubscribe_button_in_a_real_browser(app, db, api, live_server, page):
    ds = api.put("/datasource/0", name="list")["id"]
    api.put(f"/datasource/{ds}/import/0", name="l", originalfile="l.csv", __uploadtype__="csv",
            __uploaddata__="email\ndora@example.com\n")
    conn = campaignapi.connect(db)
    account = conn.execute("SELECT owner FROM datasource WHERE id = ?", (ds,)).fetchone()[0]
    secret = app.config["campaignapi.service"].secret
    conn.close()
    # internal: the first-release link, as those emails carry it
    link = campaignapi._unsubscribe_url(secret, live_server, account, "dora@example.com")

    page.goto(link)
    assert "dora@example.com" in page.content()
    # Opening the page changed nothing: only the button does.
    assert api.get(f"/datasource/{ds}/recipient/all")["recipient"][0]["status"] == "active"
    page.click("button")
    page.wait_for_load_state()
    assert "will receive no more" in page.content()
    assert api.get(f"/datasource/{ds}/recipient/all")["recipient"][0]["status"] == "unsubscribed"
