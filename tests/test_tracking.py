"""Tracking and statistics (issue 15): the campaign's tracking flag, tracked
delivery over a real SMTP sink, the public open and click routes, opaque
unsubscribe links, the archive figures by SQL, and the archive page in the
real browser.  End to end over real HTTP (waitress) and SMTP."""

import json
import urllib.error
import urllib.request
import pathlib
import re
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import campaignapi
from helpers import (account_id, b64, browse, database, http, import_csv, later,
                     make_datasource, open_url_in, scalar, screenshot)

ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"

HTML = ("<html><body><p>Hi {{first}}</p>"
        "<p><a href='https://shop.example/sale?who={{first}}&amp;x=1'>Sale</a> "
        '<a href="https://blog.example/post">Blog</a> <a href="mailto:help@shop.example">mail</a>'
        ' <a href="{{unsubscribe_url}}">unsubscribe</a></p></body></html>')
TEXT = "Hi {{first}}\nSale: https://shop.example/sale\nUnsubscribe: {{unsubscribe_url}}"
PEOPLE = "email,first\nann@example.com,Ann Lee\nbob@example.com,Bob\ncid@example.com,Cid\n"


def tracked_campaign(api, tracking="1", html=HTML):
    """A campaign with tracking to three people; its ids."""
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, PEOPLE)
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    message = api.put("/message/0", name="Sale", subject="Hello {{first}}", html=html,
                      text=TEXT)["id"]
    segment = api.put("/segment/0", name="all", datasources=[ds])["id"]
    campaign = api.put("/campaign/0", name="Winter sale", accountprofile=int(profile),
                       tracking=tracking)["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    return {"datasource": ds, "campaign": campaign, "message": message}


def send_now(api, db, sink, campaign):
    """Send the campaign now: the batch made and delivered to the sink; its id."""
    batch = api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")["id"]
    campaignapi.process_due(db)
    counts = campaignapi.deliver(db, sink.address)
    assert counts["sent"] >= 3 and not counts["error"], counts   # and the import notice
    return batch


def html_of(message):
    return message.get_body(("html",)).get_content()


def hrefs(html_text):
    return re.findall(r'href="([^"]*)"|href=\'([^\']*)\'', html_text)


def links_in(html_text):
    return [a or b for a, b in hrefs(html_text)]


def path_of(url):
    return urllib.parse.urlsplit(url).path


def archive(api, campaign):
    return api.get(f"/campaign/{campaign}/archive/{campaign}")["archive"]


def events(db):
    with database(db) as conn:
        return [tuple(row) for row in conn.execute(
            "SELECT kind, outbox, email, link FROM event ORDER BY id")]


# --- the campaign's flag ------------------------------------------------------------------

def test_tracking_is_off_unless_asked_and_takes_only_a_flag(api):
    profile = api.put("/accountprofile/0", name="p", fromaddress="a@example.com")["id"]
    plain = api.put("/campaign/0", name="a", accountprofile=int(profile))["id"]
    assert api.get(f"/campaign/{plain}")["emt_campaign"][0]["tracking"] == "0"
    api.post(f"/campaign/{plain}", tracking=True)
    assert api.get(f"/campaign/{plain}")["emt_campaign"][0]["tracking"] == "1"
    error = api.post(f"/campaign/{plain}", status=400, tracking="yes")
    assert error["error"] == "invalid_parameter" and error["field"] == "tracking"
    assert api.get(f"/campaign/{plain}")["emt_campaign"][0]["tracking"] == "1"


# --- delivery -------------------------------------------------------------------------------

def test_tracked_email_links_point_to_click_urls_and_carry_the_open_image(api, db, smtp_sink):
    ids = tracked_campaign(api)
    batch = send_now(api, db, smtp_sink, ids["campaign"])
    received = smtp_sink.parsed()
    ann, bob = html_of(received["ann@example.com"]), html_of(received["bob@example.com"])
    ann_links = links_in(ann)
    assert [path_of(u).split("/")[2] for u in ann_links[:2]] == ["click", "click"]
    assert ann_links[2] == "mailto:help@shop.example"
    unsubscribe = ann_links[3]
    assert path_of(unsubscribe).startswith("/v1/unsubscribe/")   # never rewritten
    token = path_of(unsubscribe).rsplit("/", 1)[1]
    assert "." not in token and len(token) <= 24                    # opaque and short
    for url in ann_links[:2] + [open_url_in(ann), unsubscribe]:
        assert "ann" not in urllib.parse.unquote(url).lower()
    # Per recipient only the tokens differ; the message was rewritten once.
    assert set(ann_links[:2]).isdisjoint(links_in(bob)[:2]) and open_url_in(ann) != open_url_in(bob)
    assert re.sub(r"/v1/\w+/[\w-]+", "", ann).replace("Ann Lee", "Bob") == \
        re.sub(r"/v1/\w+/[\w-]+", "", bob)
    assert ann.count("/v1/open/") == 1
    # The text body and the List-Unsubscribe header are as without tracking.
    text = received["ann@example.com"].get_body(("plain",)).get_content()
    assert "Sale: https://shop.example/sale" in text and unsubscribe in text
    assert received["ann@example.com"]["List-Unsubscribe"] == f"<{unsubscribe}>"
    with database(db) as conn:
        assert [tuple(r) for r in conn.execute(
            "SELECT link, url FROM batch_link WHERE batch = ? ORDER BY link", (batch,))] == [
            (0, "https://shop.example/sale?who={{first}}&x=1"), (1, "https://blog.example/post")]


def test_without_tracking_the_html_is_sent_as_written(api, db, smtp_sink):
    ids = tracked_campaign(api, tracking="0")
    send_now(api, db, smtp_sink, ids["campaign"])
    ann = html_of(smtp_sink.parsed()["ann@example.com"])
    assert "/v1/click/" not in ann and "/v1/open/" not in ann
    assert "https://shop.example/sale?who=Ann Lee&amp;x=1" in ann
    assert scalar(db, "SELECT count(*) FROM batch_link") == 0


def test_tracking_is_fixed_when_the_batch_is_made(api, db, smtp_sink):
    ids = tracked_campaign(api)
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)
    api.post(f"/campaign/{ids['campaign']}", tracking="0")   # too late for this batch
    campaignapi.deliver(db, smtp_sink.address)
    assert "/v1/click/" in html_of(smtp_sink.parsed()["cid@example.com"])


# --- open and click -------------------------------------------------------------------------

@pytest.fixture
def sent(api, db, smtp_sink):
    """A tracked campaign delivered to three people: ids, and the html each received."""
    ids = tracked_campaign(api)
    ids["batch"] = send_now(api, db, smtp_sink, ids["campaign"])
    ids["html"] = {to: html_of(message) for to, message in smtp_sink.parsed().items()
                   if to != "owner@example.com"}  # not the import notice
    return ids


def test_the_open_image_is_a_gif_not_cached_and_counts(client, db, sent):
    url = open_url_in(sent["html"]["ann@example.com"])
    for _ in range(2):
        response = client.get(path_of(url))
        # internal: the open image's exact bytes
        assert response.status_int == 200 and response.body == campaignapi._GIF_PIXEL
        assert response.content_type == "image/gif"
        assert "no-store" in response.headers["Cache-Control"]
    # A link checker's HEAD gets the same answer and counts nothing.
    assert client.head(path_of(url)).status_int == 200
    assert client.head(path_of(links_in(sent["html"]["ann@example.com"])[0])).status_int == 302
    assert [kind for kind, *_ in events(db)] == ["open", "open"]
    assert events(db)[0][2] == "ann@example.com"


@pytest.mark.parametrize("token", [
    "", "x", "AAAAAAAAAAAAAAAAAAAA", "a" * 300, "%00", "..", "é", "AA.BB"])
def test_any_open_token_gets_the_same_gif_and_counts_nothing(client, db, sent, token):
    response = client.get(f"/v1/open/{urllib.parse.quote(token)}", expect_errors=True)
    if token == "":
        assert response.status_int == 404       # no token: no route
    else:
        # internal: the open image's exact bytes
        assert response.status_int == 200 and response.body == campaignapi._GIF_PIXEL
    assert events(db) == []


def test_a_click_redirects_to_the_stored_url_with_the_recipients_values(client, db, sent):
    sale, blog = links_in(sent["html"]["ann@example.com"])[:2]
    response = client.get(path_of(sale))
    assert response.status_int == 302
    assert response.headers["Location"] == "https://shop.example/sale?who=Ann%20Lee&x=1"
    assert client.get(path_of(blog)).headers["Location"] == "https://blog.example/post"
    bob_sale = links_in(sent["html"]["bob@example.com"])[0]
    assert client.get(path_of(bob_sale)).headers["Location"].endswith("who=Bob&x=1")
    assert [(kind, email, link) for kind, _, email, link in events(db)] == [
        ("click", "ann@example.com", 0), ("click", "ann@example.com", 1),
        ("click", "bob@example.com", 0)]


def test_a_click_of_an_erased_recipient_goes_to_the_link_without_their_values(client, db, sent):
    with database(db) as conn, campaignapi.transaction(conn):   # erased: the row is gone
        conn.execute("DELETE FROM recipient WHERE email = 'cid@example.com'")
    sale = links_in(sent["html"]["cid@example.com"])[0]
    assert client.get(path_of(sale)).headers["Location"] == "https://shop.example/sale?who=&x=1"


def test_forged_or_altered_click_tokens_are_a_404_page_and_count_nothing(client, db, app, sent):
    secret = app.config["campaignapi.service"].secret
    good = path_of(links_in(sent["html"]["ann@example.com"])[0]).rsplit("/", 1)[1]
    outbox, index = campaignapi.read_token(secret, "click", good)
    forged = [
        good[:-1] + ("A" if good[-1] != "A" else "B"), good[:-2], good + "A",
        campaignapi.sign_token("another secret", "click", outbox, index),
        campaignapi.sign_token(secret, "open", outbox, index),         # another purpose
        campaignapi.sign_token(secret, "click", outbox, 7),            # no such link
        campaignapi.sign_token(secret, "click", 999999, 0),            # no such email
        campaignapi.sign_token(secret, "click", outbox),               # one number short
        campaignapi.sign_token(secret, "click", 2**70, 2**70),         # beyond any id
        "https:evil.example", "x", "..",
    ]
    for token in forged:
        response = client.get(f"/v1/click/{token}", expect_errors=True)
        assert response.status_int == 404, token
        assert response.content_type == "text/html" and "not valid" in response.text
        assert "Location" not in response.headers
    assert events(db) == []


@settings(deadline=None, database=None, derandomize=True, max_examples=150,
          suppress_health_check=list(HealthCheck))
@given(token=st.text(min_size=1, max_size=120) | st.binary(min_size=1, max_size=60).map(
    b64))
def test_open_and_click_never_answer_5xx(client_for_fuzz, token):
    quoted = urllib.parse.quote(token, safe="")
    for route in ("open", "click"):
        response = client_for_fuzz.get(f"/v1/{route}/{quoted}", expect_errors=True)
        assert response.status_int < 500, (route, token, response.status)
        if route == "open" and response.status_int == 200:
            # internal: the open image's exact bytes
            assert response.body == campaignapi._GIF_PIXEL
        if route == "click":
            assert response.status_int in (404, 400), (token, response.status)


@pytest.fixture(scope="module")
def client_for_fuzz(tmp_path_factory):
    import webtest

    db = str(tmp_path_factory.mktemp("tracking-fuzz") / "campaignapi.db")
    return webtest.TestApp(campaignapi.create_app(db))


# --- unsubscribe ----------------------------------------------------------------------------

def test_an_opaque_unsubscribe_link_counts_for_its_batch(client, db, api, sent):
    link = links_in(sent["html"]["bob@example.com"])[3]
    page = client.get(path_of(link))
    assert "bob@example.com" in page.text and page.forms[0].method.lower() == "post"
    page.forms[0].submit()
    assert [kind for kind, *_ in events(db)] == ["unsubscribe"]
    with database(db) as conn:
        row = conn.execute("SELECT campaign, batch, outbox FROM event").fetchone()
        outbox = conn.execute("SELECT id FROM outbox WHERE to_addr = 'bob@example.com'").fetchone()[0]
    assert tuple(row) == (int(sent["campaign"]), int(sent["batch"]), outbox)
    # Clicked again: it says so instead of asking again.
    again = client.get(path_of(link))
    assert "Already unsubscribed" in again.text and not again.forms
    assert archive(api, sent["campaign"])["unsubscribed"] == "1"


def test_links_of_the_first_release_keep_working(client, db, app, api, sent):
    secret = app.config["campaignapi.service"].secret
    account = scalar(db, "SELECT owner FROM campaign")
    # internal: the first-release link, as those emails carry it
    old = campaignapi._unsubscribe_url(secret, "http://x", account, "cid@example.com",
                                      int(sent["campaign"]))
    assert client.post(path_of(old)).status_int == 200
    assert scalar(db, "SELECT status FROM recipient WHERE email = 'cid@example.com'") == \
        "unsubscribed"
    # No batch known: the campaign counts it, no batch does.
    record = archive(api, sent["campaign"])
    assert record["unsubscribed"] == "1" and record["batches"][0]["unsubscribed"] == "0"


# --- statistics -----------------------------------------------------------------------------

def test_the_archive_counts_what_happened(client, db, api, sent):
    ann, bob = sent["html"]["ann@example.com"], sent["html"]["bob@example.com"]
    for _ in range(3):
        client.get(path_of(open_url_in(ann)))
    client.get(path_of(links_in(ann)[0]))
    client.get(path_of(links_in(ann)[0]))
    client.get(path_of(links_in(bob)[1]))            # a click without the image: opened too
    account = scalar(db, "SELECT owner FROM campaign")
    cid = scalar(db, "SELECT id FROM outbox WHERE to_addr = 'cid@example.com'")
    with database(db) as conn, campaignapi.transaction(conn):
        campaignapi.suppress(conn, account, "cid@example.com", "complained",
                             int(sent["campaign"]), batch=int(sent["batch"]), outbox=cid)
    record = archive(api, sent["campaign"])
    # internal: the statistics' own list of figures
    figures = {name: record[name] for name in campaignapi._STATISTICS}
    assert figures == {"recipients": "3", "sent": "3", "failed": "0", "bounced": "0",
                       "complained": "1", "unsubscribed": "0", "opened": "2", "opens": "3",
                       "clicked": "2", "clicks": "3"}
    assert record["links"] == [
        {"url": "https://shop.example/sale?who={{first}}&x=1", "clicks": "2", "clicked": "1"},
        {"url": "https://blog.example/post", "clicks": "1", "clicked": "1"}]
    hour = later()[:13] + ":00:00"
    assert record["timeline"] == [{"hour": hour, "opens": "3", "clicks": "3"}]
    one = api.get(f"/campaign/{sent['campaign']}/batcharchive/{sent['batch']}")["batcharchive"]
    # internal: the statistics' own list of figures
    assert {name: one[name] for name in campaignapi._STATISTICS} == figures
    assert one["links"] == record["links"] and one["timeline"] == record["timeline"]
    assert record["batches"][0]["opened"] == "2"


def test_a_campaign_sums_its_batches(client, db, api, smtp_sink, sent):
    second = send_now(api, db, smtp_sink, sent["campaign"])
    first_open = open_url_in(sent["html"]["ann@example.com"])
    client.get(path_of(first_open))
    # parsed() keeps the last email of each address: the second batch's.
    client.get(path_of(open_url_in(html_of(smtp_sink.parsed()["ann@example.com"]))))
    record = archive(api, sent["campaign"])
    assert (record["recipients"], record["sent"], record["opened"], record["opens"]) == \
        ("6", "6", "2", "2")
    assert [b["opened"] for b in record["batches"]] == ["1", "1"]
    assert [b["id"] for b in record["batches"]] == [sent["batch"], second]
    assert record["links"][1] == {"url": "https://blog.example/post", "clicks": "0",
                                  "clicked": "0"}


def test_each_statistics_statement_reads_one_index_of_the_batch(tmp_path):
    """On SQLite: the statements _batch_statistics() runs, as it runs them,
    search by the batch (never a scan of the table) and read the outbox and
    event rows from covering indexes."""
    db = str(tmp_path / "plan.db")
    account = account_id(db, "owner@example.com")
    with database(db) as conn:
        with campaignapi.transaction(conn):
            conn.execute("INSERT INTO campaign (id, owner, accountprofile, name) "
                         "VALUES (1, ?, 1, 'c')", (account,))
            conn.execute("INSERT INTO batch (id, campaign, timestamp) VALUES (1, 1, 'x')")
        batch, statements = conn.execute("SELECT * FROM batch").fetchone(), []
        conn.set_trace_callback(statements.append)
        # internal: the statements as the statistics run them, on a connection the test traces
        campaignapi._batch_statistics(conn, batch)
        conn.set_trace_callback(None)
        assert len(statements) == 5
        for sql in statements:
            plan = [row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
            assert not any(step.startswith("SCAN") for step in plan), (sql, plan)
            reads = [step for step in plan if " outbox " in step or " event " in step
                     or step.split()[:2] == ["SEARCH", "e"]]
            assert all("COVERING INDEX" in step or "PRIMARY KEY" in step for step in reads), \
                (sql, plan)


# --- pages in the real browser --------------------------------------------------------------

def test_a_browser_sees_the_archive_as_a_page_with_the_chart(client, db, api, auth, sent,
                                                             live_server, page):
    ann = sent["html"]["ann@example.com"]
    for url in (open_url_in(ann), links_in(ann)[0], links_in(ann)[1]):
        client.get(path_of(url))
    earlier = later(-3 * 3600)
    with database(db) as conn, campaignapi.transaction(conn):   # the open three hours ago
        conn.execute("UPDATE event SET created = ? WHERE id = 1", (earlier,))
    path = f"/v1/campaign/{sent['campaign']}/archive/{sent['campaign']}"
    # A JSON client still gets the record.
    assert client.get(path, headers=auth).json["data"]["archive"]["opens"] == "1"
    browse(page, live_server + path, auth)
    assert page.locator("h1").inner_text() == "Winter sale: what happened"
    assert page.locator('[data-figure="sent"]').inner_text() == "3"
    assert page.locator('[data-figure="clicks"]').inner_text() == "2"
    assert page.locator("svg rect.opens").count() >= 2 and page.locator("svg").is_visible()
    assert "https://blog.example/post" in page.locator("td.url").all_inner_texts()
    assert screenshot(page, "tracking-archive.png").stat().st_size > 10_000


def test_unsubscribe_pages_in_the_real_browser(live_server, sent, page):
    link = links_in(sent["html"]["ann@example.com"])[3]
    path = path_of(link)
    page.goto(live_server + path[:-3])                     # cut short when copied
    assert "does not work" in page.locator("h1").inner_text()
    assert "Copy the whole link" in page.content() and "responseId" not in page.content()
    page.goto(live_server + path)
    page.click("button")
    page.wait_for_load_state()
    assert "will receive no more" in page.content()
    page.goto(live_server + path)                           # clicked again later
    assert page.locator("h1").inner_text() == "Already unsubscribed"
    assert page.locator("button").count() == 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tracking-unsubscribed-again.png"))


# --- end to end over real HTTP and SMTP ------------------------------------------------------

def test_end_to_end_send_open_click_over_http_and_smtp(app, db, auth, serve, smtp_sink):
    with serve(app) as base:
        def call(method, path, **params):
            status, _, body = http(base + "/v1" + path, method, params or None, auth)
            envelope = json.loads(body)
            assert status == 200 and envelope["success"], (method, path, envelope)
            return envelope["data"]

        ds = call("PUT", "/datasource/0", name="people",
                  fields=[{"name": "first", "type": "text"}])["id"]
        call("PUT", f"/datasource/{ds}/import/0", name="l", originalfile="l.csv",
             __uploadtype__="csv", __uploaddata__=PEOPLE)
        profile = call("PUT", "/accountprofile/0", name="Shop",
                       fromaddress="news@shop.example")["id"]
        message = call("PUT", "/message/0", name="m", subject="Hi {{first}}", html=HTML,
                       text=TEXT)["id"]
        segment = call("PUT", "/segment/0", name="all", datasources=[int(ds)])["id"]
        campaign = call("PUT", "/campaign/0", name="Live", accountprofile=int(profile),
                        tracking="1")["id"]
        call("PUT", f"/campaign/{campaign}/message/0", segment=int(segment),
             message=int(message))
        call("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
        campaignapi.process_due(db)
        assert campaignapi.deliver(db, smtp_sink.address)["sent"] >= 3
        received = html_of(smtp_sink.parsed()["bob@example.com"])
        opener, sale = open_url_in(received), links_in(received)[0]
        assert opener.startswith(base + "/v1/open/") and sale.startswith(base + "/v1/click/")
        before = call("GET", f"/campaign/{campaign}/archive/{campaign}")["archive"]
        assert (before["opened"], before["clicks"]) == ("0", "0")

        status, headers, body = http(opener)
        # internal: the open image's exact bytes
        assert (status, headers["Content-Type"], body) == (200, "image/gif", campaignapi._GIF_PIXEL)
        assert "no-store" in headers["Cache-Control"]
        request = urllib.request.Request(sale)
        opener_no_redirect = urllib.request.build_opener(NoRedirect)
        try:
            opener_no_redirect.open(request, timeout=30)
            raise AssertionError("no redirect")
        except urllib.error.HTTPError as answer:
            assert answer.code == 302
            assert answer.headers["Location"] == "https://shop.example/sale?who=Bob&x=1"
        assert http(sale[:-2] + "xx")[0] == 404
        after = call("GET", f"/campaign/{campaign}/archive/{campaign}")["archive"]
        assert (after["opened"], after["opens"], after["clicked"], after["clicks"]) == \
            ("1", "1", "1", "1")
        assert after["links"][0]["clicks"] == "1"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


# --- the same SQL on both engines -----------------------------------------------------------

def test_the_statistics_and_token_lookups_run_on_both_engines(engine_db):
    """The statements of the public routes and of the statistics, on SQLite
    and PostgreSQL, over rows made by plain SQL."""
    # internal: the token lookups themselves on both engines in one run, over plain SQL rows
    store_links, campaign_email = campaignapi._store_links, campaignapi._campaign_email
    # internal: the figures of the archive routes themselves, over the same rows
    statistics, event_figures = campaignapi._batch_statistics, campaignapi._event_figures
    account = account_id(engine_db, "owner@example.com")
    conn = campaignapi.connect(engine_db)
    try:
        with campaignapi.transaction(conn):
            campaign = conn.execute("INSERT INTO campaign (owner, accountprofile, name, tracking) "
                                    "VALUES (?, 1, 'c', 1)", (account,)).lastrowid
            batch = conn.execute("INSERT INTO batch (campaign, timestamp, status, recipients, "
                                 "tracking) VALUES (?, '2026-01-01 09:00:00', 'sent', 3, 1)",
                                 (campaign,)).lastrowid
            conn.execute("INSERT INTO batch_message (batch, message, subject, html, text) "
                         "VALUES (?, 1, 's', ?, '')", (batch, HTML))
            store_links(conn, batch)
            emails = [conn.execute(
                "INSERT INTO outbox (account, kind, batch, message, recipient, to_addr, status) "
                "VALUES (?, 'campaign', ?, 1, 0, ?, ?)",
                (account, batch, f"p{i}@example.com", status)).lastrowid
                for i, status in enumerate(("sent", "sent", "failed"))]
        secret = "s" * 64
        token = campaignapi.sign_token(secret, "click", emails[0], 1)
        email, numbers = campaign_email(conn, secret, "click", token, size=2)
        assert (email["url"], email["email"], email["campaign"]) == (
            "https://blog.example/post", "p0@example.com", campaign)
        assert campaign_email(conn, secret, "click",
                              campaignapi.sign_token(secret, "click", 2**70, 0),
                              size=2) == (None, None)
        # internal: events written as the routes and the worker write them
        campaignapi._record_event(conn, "click", email, numbers[1])
        opened, _ = campaign_email(
            conn, secret, "open", campaignapi.sign_token(secret, "open", emails[1]))
        # internal: events written as the routes and the worker write them
        campaignapi._record_event(conn, "open", opened)
        # internal: events written as the routes and the worker write them
        campaignapi._record_event(conn, "open", opened)
        with campaignapi.transaction(conn):
            campaignapi.suppress(conn, account, "p1@example.com", "unsubscribed", campaign,
                                 batch=batch, outbox=emails[1])
        row = conn.execute("SELECT * FROM batch WHERE id = ?", (batch,)).fetchone()
        figures = statistics(conn, row)
        # internal: the record the archive routes answer, made of those figures
        record = campaignapi._statistics_record(figures)
        # internal: the statistics' own list of figures
        assert {name: record[name] for name in campaignapi._STATISTICS} == {
            "recipients": "3", "sent": "2", "failed": "1", "bounced": "0", "complained": "0",
            "unsubscribed": "1", "opened": "2", "opens": "2", "clicked": "1", "clicks": "1"}
        assert record["links"] == [
            {"url": "https://blog.example/post", "clicks": "1", "clicked": "1"},
            {"url": "https://shop.example/sale?who={{first}}&x=1", "clicks": "0",
             "clicked": "0"}]
        assert [point["opens"] for point in record["timeline"]] == ["2"]
        assert event_figures(conn, "campaign = ? AND batch IS NULL",
                             (campaign,))["unsubscribed"] == 0
    finally:
        conn.close()
