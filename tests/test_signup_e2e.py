"""Sign-ups for real: a person fills the served form in Debian's Chromium,
the confirmation email arrives at a real SMTP server, the link from it is
opened and confirmed, a campaign reaches the person, and the unsubscribe
link lets them leave; an application does the same through the API; and a
burst of 1,000 sign-ups over real HTTP leaves the API answering."""

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time

import campaignapi
from conftest import Api, serving
from helpers import (answers, free_port, http, keyed_client, make_campaign, make_signup_list,
                     recipients, scalar, wait_for)

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "artifacts")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shot(page, name):
    """A screenshot of the page into tests/artifacts/ (not committed), to look at."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, f"signup-{name}.png"), full_page=True)


def mail_to(smtp_sink, address):
    """The text body and the whole parsed email that the sink got for ``address`` last."""
    message = smtp_sink.parsed()[address]
    return message.get_body(("plain",)).get_content(), message


def link_in(text, kind):
    return re.search(rf"http://\S+/v1/{kind}/[A-Za-z0-9_.-]+", text).group(0)


def test_a_person_joins_confirms_receives_a_campaign_and_leaves(
        api, db, live_server, page, smtp_sink):
    welcome = api.put("/message/0", name="welcome", subject="Welcome, {{first}}",
                      text="Glad you joined.\nLeave any time: {{unsubscribe_url}}")["id"]
    ds = make_signup_list(api, name="Garden news", welcomemessage=int(welcome),
                          fields=[{"name": "first", "type": "text"},
                                  {"name": "newsletter day", "type": "date"}])
    api.post(f"/datasource/{ds}", description="Tips for your garden, once a month.")

    # The form, on a phone-sized screen: a bad address first, then a good one.
    page.set_viewport_size({"width": 390, "height": 740})
    response = page.goto(f"{live_server}/v1/subscribe/{ds}")
    assert response.status == 200 and page.title() == "Subscribe to Garden news"
    assert page.locator("#hp").bounding_box()["x"] < 0          # the honeypot is off-screen
    assert page.get_by_label("Email address").is_visible()
    width = page.get_by_label("Email address").bounding_box()["width"]
    assert 300 <= width <= 390                                  # fills a phone's width
    shot(page, "1-form-phone")
    page.get_by_label("Email address").fill("ann@localhost")    # the browser lets it through
    page.get_by_label("first").fill("Ann")
    page.get_by_role("button", name="Subscribe").click()
    assert page.get_by_role("alert").inner_text() == "This is not a valid email address."
    assert page.get_by_label("Email address").get_attribute("aria-invalid") == "true"
    assert page.get_by_label("first").input_value() == "Ann"
    shot(page, "2-form-error")
    page.get_by_label("Email address").fill("ann@example.com")
    page.get_by_role("button", name="Subscribe").click()
    assert page.locator("h1").inner_text() == "Almost done: check your email"
    shot(page, "3-check-your-email")
    assert recipients(api, ds)["ann@example.com"]["status"] == "unconfirmed"

    # The email arrives, sent as the datasource's sender profile.
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 1
    text, message = mail_to(smtp_sink, "ann@example.com")
    assert message["From"] == "The List <list@shop.example>"
    assert message["Reply-To"] == "help@shop.example"
    assert "ann@example.com" not in link_in(text, "confirm")
    page.set_viewport_size({"width": 1000, "height": 700})
    page.goto(link_in(text, "confirm"))
    assert recipients(api, ds)["ann@example.com"]["status"] == "unconfirmed"
    shot(page, "4-confirm")
    page.get_by_role("button", name="Yes, subscribe me").click()
    assert page.locator("h1").inner_text() == "Subscription confirmed"
    shot(page, "5-confirmed")
    assert recipients(api, ds)["ann@example.com"]["status"] == "active"
    page.goto(link_in(text, "confirm")[:-3] + "abc")
    assert page.locator("h1").inner_text() == "This link is not valid"
    shot(page, "6-invalid-link")
    page.goto(f"{live_server}/v1/subscribe/999")
    shot(page, "7-no-form")

    # The welcome message, then a campaign; its unsubscribe link lets Ann leave.
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 1
    assert mail_to(smtp_sink, "ann@example.com")[1]["Subject"] == "Welcome, Ann"
    ids = make_campaign(api, [ds])
    # Sent over HTTP, so that the batch's links point at the served app.
    assert http(f"{live_server}/v1/campaign/{ids['campaign']}/send/0", "PUT",
                {"timestamp": "2000-01-01 00:00:00"}, api.headers)[0] == 200
    campaignapi.process_due(db)
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 1
    text, message = mail_to(smtp_sink, "ann@example.com")
    assert message["Subject"] == "Hello Ann"
    page.goto(link_in(text, "unsubscribe"))
    page.get_by_role("button", name="Unsubscribe").click()
    assert page.locator("h1").inner_text() == "Unsubscribed"
    assert recipients(api, ds)["ann@example.com"]["status"] == "unsubscribed"
    assert api.get(f"/segment/{ids['segment']}")["segment"]["size"] == "0"  # no one to send to


def test_an_application_does_the_same_through_the_api(api, db, smtp_sink):
    ds = int(api.put("/datasource/0", name="app users",
                     fields=[{"name": "first", "type": "text"}])["id"])
    ann = api.call("PUT", f"/datasource/{ds}/recipient/0",
                   {"email": "ann@example.com", "fields": {"first": "Ann"},
                    "status": "unconfirmed"})["id"]
    path = f"/datasource/{ds}/recipient/{ann}"
    ids = make_campaign(api, [ds])
    assert api.get(f"/segment/{ids['segment']}")["segment"]["size"] == "0"
    api.call("POST", path, {"status": "active"})          # the application confirmed Ann
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)
    assert campaignapi.deliver(db, smtp_sink.address)["sent"] == 1
    assert mail_to(smtp_sink, "ann@example.com")[1]["Subject"] == "Hello Ann"
    api.call("POST", path, {"status": "unsubscribed"})    # Ann leaves
    assert api.call("POST", path, {"status": "active"}, 409)["error"] == "conflict"
    api.delete(path)                                       # and asks to be forgotten
    again = api.put(f"/datasource/{ds}/recipient/0", email="ann@example.com")["id"]
    assert api.get(f"/datasource/{ds}/recipient/{again}")["recipient"]["status"] == \
        "unsubscribed"
    assert api.get(f"/segment/{ids['segment']}")["segment"]["size"] == "0"


def test_a_burst_of_1000_sign_ups_over_http_and_the_api_keeps_answering(tmp_path):
    db = str(tmp_path / "burst.db")
    client, auth = keyed_client(db, signup_rate=0)
    api = Api(client, auth)
    ds = make_signup_list(api)
    campaign = api.put("/campaign/0", name="c", accountprofile=1)["id"]
    with serving(client.app, threads=8) as base:
        done, reads = threading.Event(), []

        def read():
            while not done.is_set():
                started = time.perf_counter()
                status = http(f"{base}/v1/campaign/{campaign}", headers=auth)[0]
                reads.append((status, time.perf_counter() - started))

        def sign_up(number):
            return http(f"{base}/v1/subscribe/{ds}", "POST",
                        {"email": f"person{number}@example.com"})[0]

        reader = threading.Thread(target=read)
        reader.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(sign_up, range(1000)))
        finally:
            done.set()
            reader.join(30)
    assert statuses.count(200) == 1000, sorted(set(statuses))
    assert reads and all(status == 200 for status, _ in reads)
    assert len(recipients(api, ds)) == 1000
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'signup'") == 1000


def test_serve_takes_the_per_client_sign_up_limit(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "campaignapi.py"), "serve", "--db",
         str(tmp_path / "s.db"), "--port", str(port), "--signup-rate", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        secret = next(line.strip() for line in process.stdout if line.startswith("cak_"))
        wait_for(lambda: answers(base), what="the server to answer")
        key = {"Authorization": f"Bearer {secret}"}
        http(f"{base}/v1/accountprofile/0", "PUT", {"name": "p", "fromaddress": "l@x.example"},
             key)
        assert http(f"{base}/v1/datasource/0", "PUT", {"name": "d", "signup": 1,
                                                       "fromprofile": 1}, key)[0] == 200
        statuses = [http(f"{base}/v1/subscribe/1", "POST", {"email": f"p{n}@example.com"})[0]
                    for n in range(3)]
        assert statuses == [200, 200, 429]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_one_address_signed_up_many_times_at_once_is_stored_and_mailed_once(api, db,
                                                                            live_server):
    ds = make_signup_list(api)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers_ = list(pool.map(lambda _: http(f"{live_server}/v1/subscribe/{ds}", "POST",
                                                {"email": "ann@example.com"}), range(20)))
    assert all(status == 200 and b'"pending"' in body for status, _, body in answers_)
    assert list(recipients(api, ds)) == ["ann@example.com"]
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'signup'") == 1
