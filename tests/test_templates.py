"""Templates, previews and test sends (issue 14): the template record kind,
defaulttemplate as a record or a file of templates_dir, rendering once per
batch, the preview that equals what arrives, and test sends, end to end with
the real SMTP sink."""

import json
import os

import pytest

import campaignapi
from clihelpers import served
from conftest import Api
from helpers import (app_secret, assert_error, database, http, import_csv, keyed_client,
                     make_campaign, scalar, send, snapshot, wait_for)

LAYOUT_HTML = """<!doctype html><html><head><style>
.frame { border: 1px solid #cccccc; padding: 8px; }
p { color: #333333; }
</style></head><body><div class="frame"><h1>The Shop News</h1>
{{content}}
<p class="foot">The Shop, 1 Main Street. <a href="{{unsubscribe_url}}">Leave</a></p>
</div></body></html>
"""
LAYOUT_TEXT = "THE SHOP NEWS\n\n{{content}}\n--\nThe Shop, 1 Main Street\n"


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "templates"
    path.mkdir()
    (path / "news.html").write_text(LAYOUT_HTML, encoding="utf-8")
    (path / "news.txt").write_text(LAYOUT_TEXT, encoding="utf-8")
    return path


@pytest.fixture
def tapi(db, folder):
    """An Api over an app whose templates_dir is ``folder``."""
    client, auth = keyed_client(db, templates_dir=str(folder))
    return Api(client, auth)


@pytest.fixture
def shop(tapi):
    """A sendable campaign to Ann and Bob (make_campaign: Hello {{first}})."""
    ds = tapi.put("/datasource/0", name="customers",
                  fields=[{"name": "first", "type": "text"}])["id"]
    import_csv(tapi, ds, "email,first\nann@example.com,Ann <A&B>\nbob@example.com,Bob\n")
    ids = make_campaign(tapi, [int(ds)])
    ids["link"] = tapi.get(f"/campaign/{ids['campaign']}/message/all")["message"][0]["id"]
    return ids


def checks_of(api, campaign):
    record = api.get(f"/campaign/{campaign}/verify/0")["verify"]
    return {check["check"]: check for check in record["checks"]}


def deliver(db, sink, folder=None):
    """Make due batches, deliver to the sink; what arrived by address, but
    for the import notifications to the account holder."""
    campaignapi.process_due(db, templates_dir=str(folder or ""))
    counts = campaignapi.deliver(db, sink.address)
    assert counts["failed"] == 0, counts
    return {to: message for to, message in sink.parsed().items() if to != "owner@example.com"}


def bodies(message):
    """(subject, html, text) of a parsed email, after MIME decoding."""
    html_part, text_part = message.get_body(("html",)), message.get_body(("plain",))
    return (str(message["Subject"]), html_part.get_content() if html_part else "",
            text_part.get_content() if text_part else "")


# --- the template record ---------------------------------------------------------------------

def test_template_records_get_create_change_and_soft_delete(tapi):
    created = tapi.put("/template/0", name="Layout", html="<div>{{content}}</div>",
                       text="{{ Content }}\n--\nbye")
    record = tapi.get(f"/template/{created['id']}")["template"]
    assert record == {**record, "id": created["id"], "name": "Layout",
                      "html": "<div>{{content}}</div>", "text": "{{ Content }}\n--\nbye",
                      "deleted": "0"}
    assert set(record) == {"id", "owner", "name", "html", "text", "created", "deleted"}
    assert tapi.post(f"/template/{created['id']}", name="Renamed", text="") is True
    assert tapi.get(f"/template/{created['id']}")["template"]["text"] == ""
    tapi.put("/template/0", html="{{content}}")
    assert tapi.get("/template/all")["total"] == "2"
    assert tapi.delete(f"/template/{created['id']}", id=int(created["id"])) is True
    assert tapi.get(f"/template/{created['id']}")["template"]["deleted"] == "1"
    assert tapi.get("/template/all")["total"] == "1"
    assert tapi.post(f"/template/{created['id']}", status=409, name="x")["error"] == "conflict"


@pytest.mark.parametrize("params,field", [
    ({"html": "<div>no slot</div>"}, "html"),
    ({"html": "{{content}}<hr>{{content}}"}, "html"),
    ({"html": "{{content}}", "text": "no slot"}, "text"),
    ({"name": "only a name"}, "html"),
    ({"html": "  ", "text": ""}, "html"),
])
def test_a_template_needs_content_once_in_each_body(tapi, db, params, field):
    before = snapshot(db)
    response = send(tapi.client, "PUT", "/v1/template/0", tapi.headers, params)
    assert assert_error(response, 400, "invalid_parameter")["field"] == field
    assert snapshot(db) == before


def test_changing_the_bodies_is_checked_and_a_refusal_changes_nothing(tapi):
    template = tapi.put("/template/0", html="<b>{{content}}</b>", text="{{content}}")["id"]
    assert tapi.post(f"/template/{template}", status=400, text="gone")["field"] == "text"
    assert tapi.post(f"/template/{template}", status=400, html="", text="")["field"] == "html"
    assert tapi.get(f"/template/{template}")["template"]["text"] == "{{content}}"
    assert tapi.post(f"/template/{template}", html="") is True  # the text body is left


def test_templates_of_another_account_are_not_found(tapi, client, make_key):
    template = tapi.put("/template/0", html="{{content}}")["id"]
    stranger = Api(tapi.client, make_key(email="stranger@example.org"))
    assert stranger.get(f"/template/{template}", status=404)["error"] == "not_found"
    campaign = stranger.put("/campaign/0", name="c", accountprofile=1)["id"]
    assert stranger.post(f"/campaign/{campaign}", status=404,
                         defaulttemplate=template)["error"] == "not_found"


# --- defaulttemplate -------------------------------------------------------------------------

def test_defaulttemplate_takes_none_an_own_live_template_or_a_file_name(tapi, folder):
    campaign = tapi.put("/campaign/0", name="c", accountprofile=1, defaulttemplate="news")["id"]
    template = tapi.put("/template/0", html="{{content}}")["id"]
    for value, stored in (("news.html", "news.html"), (f"00{template}", template),
                          (int(template), template), ("", ""),
                          ("later", "later")):  # a file may come later: verify says so
        assert tapi.post(f"/campaign/{campaign}", defaulttemplate=value) is True
        assert tapi.get(f"/campaign/{campaign}")["emt_campaign"][0]["defaulttemplate"] == stored
    tapi.delete(f"/template/{template}", id=int(template))
    assert tapi.post(f"/campaign/{campaign}", status=409,
                     defaulttemplate=template)["error"] == "conflict"
    assert tapi.post(f"/campaign/{campaign}", status=404, defaulttemplate="999")["error"] \
        == "not_found"
    assert tapi.post(f"/campaign/{campaign}", status=400, defaulttemplate=1.5)["field"] \
        == "defaulttemplate"


@pytest.mark.parametrize("name", ["../news", "sub/news", "sub\\news", "..", "a..b", "/etc/passwd",
                                  "news\x07", "outside", "outside-text"])
def test_a_file_name_that_could_leave_the_folder_is_refused(tapi, db, folder, tmp_path, name):
    (tmp_path / "secret.html").write_text("<p>{{content}} secret</p>")
    (folder / "outside.html").symlink_to(tmp_path / "secret.html")
    (folder / "outside-text.html").write_text("{{content}}")
    (folder / "outside-text.txt").symlink_to(tmp_path / "secret.html")
    before = snapshot(db)
    for method, path, extra in (("PUT", "/v1/campaign/0", {"name": "c", "accountprofile": 1}),
                                ("POST", "/v1/campaign/1", {})):
        response = send(tapi.client, method, path, tapi.headers,
                        {**extra, "defaulttemplate": name})
        if method == "POST" and response.status_int == 404:
            continue  # no campaign 1 yet: the create was refused, as it must be
        assert assert_error(response, 400, "invalid_parameter")["field"] == "defaulttemplate"
    assert snapshot(db) == before


def test_a_symlink_that_stays_inside_the_folder_is_a_template(tapi, folder):
    (folder / "alias.html").symlink_to(folder / "news.html")
    assert tapi.put("/campaign/0", name="c", accountprofile=1, defaulttemplate="alias")


def test_without_a_templates_folder_a_file_name_is_refused(api):
    # The server's settings forbid it, not the request: 409.
    data = api.put("/campaign/0", status=409, name="c", accountprofile=1, defaulttemplate="news")
    assert data["field"] == "defaulttemplate" and "templates_dir" in data["message"]


# --- verify ----------------------------------------------------------------------------------

def test_verify_passes_with_a_file_and_with_a_record(tapi, shop):
    campaign = shop["campaign"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate="news")
    assert tapi.get(f"/campaign/{campaign}/verify/0")["verify"]["passed"] == "1"
    template = tapi.put("/template/0", html=LAYOUT_HTML)["id"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate=template)
    checks = checks_of(tapi, campaign)
    assert all(check["passed"] == "1" for check in checks.values()), checks


def test_verify_reports_a_missing_deleted_unreadable_or_slotless_template(tapi, shop, folder):
    campaign = shop["campaign"]

    def failing(defaulttemplate):
        tapi.post(f"/campaign/{campaign}", defaulttemplate=defaulttemplate)
        return {name: check["message"] for name, check in checks_of(tapi, campaign).items()
                if check["passed"] == "0"}

    assert set(failing("nothere")) == {"template_found"}
    assert "nothere.html does not exist" in failing("nothere")["template_found"]
    (folder / "latin.html").write_bytes("<p>{{content}} café</p>".encode("latin-1"))
    assert "not UTF-8" in failing("latin")["template_found"]
    (folder / "dir.html").mkdir()
    assert "cannot be read" in failing("dir")["template_found"]
    (folder / "slotless.html").write_text("<p>no place for the message</p>")
    assert set(failing("slotless")) == {"template_content"}
    (folder / "twice.html").write_text("{{content}}")
    (folder / "twice.txt").write_text("{{content}} {{content}}")
    assert "text must hold {{content}} exactly once" in failing("twice")["template_content"]
    template = tapi.put("/template/0", html="{{content}}")["id"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate=template)
    tapi.delete(f"/template/{template}", id=int(template))
    assert "is deleted" in checks_of(tapi, campaign)["template_found"]["message"]
    # Sending refuses it, with the checks.
    data = tapi.put(f"/campaign/{campaign}/send/0", status=409, timestamp=0)
    assert data["error"] == "verification_failed"


def test_the_unsubscribe_link_may_live_in_the_template(tapi, shop):
    campaign, message = shop["campaign"], shop["message"]
    tapi.post(f"/message/{message}", html="<p>Hi {{first}}</p>", text="Hi {{first}}")
    assert checks_of(tapi, campaign)["unsubscribe_link"]["passed"] == "0"
    template = tapi.put("/template/0", html=LAYOUT_HTML, text="{{content}}\n{{unsubscribe_url}}")
    tapi.post(f"/campaign/{campaign}", defaulttemplate=template["id"])
    assert checks_of(tapi, campaign)["unsubscribe_link"]["passed"] == "1"
    # A merge tag of the template is checked as the message's are.
    tapi.post(f"/template/{template['id']}", text="{{content}} {{unsubscribe_url}} {{nick}}")
    assert "{{nick}}" in checks_of(tapi, campaign)["merge_tags"]["message"]


# --- delivery, end to end --------------------------------------------------------------------

def test_a_file_template_and_a_record_template_send_wrapped_emails_equal_to_the_preview(
        tapi, shop, db, folder, smtp_sink):
    campaign = shop["campaign"]
    record = tapi.put("/template/0", html="<section>{{content}}</section><style>section "
                      "{ margin: 4px; }</style>", text="RECORD\n{{content}}")["id"]
    second = tapi.put("/campaign/0", name="Second", accountprofile=int(shop["profile"]),
                      defaulttemplate=record)["id"]
    tapi.put(f"/campaign/{second}/message/0", segment=int(shop["segment"]),
             message=int(shop["message"]))
    tapi.post(f"/campaign/{campaign}", defaulttemplate="news")
    previews = {}
    for number in (campaign, second):
        link = tapi.get(f"/campaign/{number}/message/all")["message"][0]["id"]
        for address in ("ann@example.com", "bob@example.com"):
            previews[number, address] = tapi.get(f"/campaign/{number}/preview/{link}",
                                                 recipient=address)["preview"]
    # Sent one campaign after the other: the sink keys emails by address.
    arrived = {}
    for number in (campaign, second):
        tapi.put(f"/campaign/{number}/send/0", timestamp="2000-01-01 00:00:00")
        arrived.update({(number, to): message for to, message in
                        deliver(db, smtp_sink, folder).items()})
        smtp_sink.messages.clear()
    assert len(arrived) == 4
    for (number, address), message in arrived.items():
        subject, html_body, text_body = bodies(message)
        assert (subject, html_body, text_body) == tuple(
            previews[number, address][part] for part in ("subject", "html", "text"))
        name = "Ann &lt;A&amp;B&gt;" if address.startswith("ann") else "Bob"
        assert f">Hi {name}</p>" in html_body and "{{" not in html_body + text_body
        if number == campaign:   # the file: CSS inlined, the message in its frame
            assert '<div class="frame" style="border: 1px solid #cccccc;padding: 8px;">' \
                in html_body and "<style>" not in html_body
            assert text_body.startswith("THE SHOP NEWS\n\nHi ") and "1 Main Street" in text_body
        else:
            assert '<section style="margin: 4px;"><p>Hi' in html_body
            assert text_body.startswith("RECORD\nHi ")
    # The batch archive holds the bodies as sent: wrapped, inlined, tags still tags.
    batch = tapi.get(f"/campaign/{campaign}/batcharchive/all")["batcharchive"][0]
    archived = tapi.get(f"/campaign/{campaign}/batcharchive/{batch['id']}")["batcharchive"]
    assert archived["messages"][0]["html"].count("{{first}}") == 1
    assert "The Shop News" in archived["messages"][0]["html"]
    assert 'class="frame" style=' in archived["messages"][0]["html"]


def test_a_template_without_a_text_body_leaves_the_text_message_as_it_is(tapi, shop, db,
                                                                         smtp_sink):
    template = tapi.put("/template/0", html="<main>{{content}}</main>")["id"]
    tapi.post(f"/campaign/{shop['campaign']}", defaulttemplate=template)
    tapi.put(f"/campaign/{shop['campaign']}/send/0", timestamp=0)
    _, html_body, text_body = bodies(deliver(db, smtp_sink)["bob@example.com"])
    assert html_body.startswith("<main><p>Hi Bob</p>")
    assert text_body.startswith("Hi Bob\nUnsubscribe: http")


def test_a_template_file_is_read_afresh_when_it_changes(tapi, shop, folder, db, smtp_sink):
    campaign, link = shop["campaign"], shop["link"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate="news")
    assert tapi.get(f"/campaign/{campaign}/preview/{link}")["preview"]["text"].startswith(
        "THE SHOP NEWS")
    (folder / "news.txt").write_text("EDITED\n{{content}}")
    assert tapi.get(f"/campaign/{campaign}/preview/{link}")["preview"]["text"].startswith(
        "EDITED\nHi Ann")
    (folder / "news.txt").unlink()  # the text file is optional
    assert tapi.get(f"/campaign/{campaign}/preview/{link}")["preview"]["text"].startswith("Hi Ann")
    tapi.put(f"/campaign/{campaign}/send/0", timestamp=0)
    (folder / "news.html").write_text("<div id='v2'>{{content}}</div>")  # after the send
    assert bodies(deliver(db, smtp_sink, folder)["ann@example.com"])[1].startswith(
        "<div id='v2'><p>Hi Ann")


def test_a_batch_whose_template_went_away_is_cancelled_not_sent_bare(tapi, shop, folder, db):
    tapi.post(f"/campaign/{shop['campaign']}", defaulttemplate="news")
    tapi.put(f"/campaign/{shop['campaign']}/send/0", timestamp=0)
    (folder / "news.html").unlink()
    campaignapi.process_due(db, templates_dir=str(folder))
    batch = tapi.get(f"/campaign/{shop['campaign']}/batcharchive/all")["batcharchive"][0]
    assert batch["status"] == "cancelled"
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == 0


# --- preview ---------------------------------------------------------------------------------

def test_preview_defaults_to_the_first_recipient_and_takes_an_id_or_address(tapi, shop):
    campaign, link = shop["campaign"], shop["link"]
    first = tapi.get(f"/campaign/{campaign}/preview/{link}")["preview"]
    assert set(first) == {"campaign", "link", "recipient", "subject", "html", "text", "headers"}
    assert (first["campaign"], first["link"]) == (campaign, link)
    assert first["subject"] == "Hello Ann <A&B>"
    headers = first["headers"]
    assert headers["To"] == "ann@example.com" and headers["From"] == "The Shop <news@shop.example>"
    assert headers["Subject"] == first["subject"]
    assert headers["List-Unsubscribe"].startswith("<http://localhost:80/v1/unsubscribe/")
    assert headers["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert headers["List-Unsubscribe"][1:-1] in first["text"]
    bob = tapi.get(f"/campaign/{campaign}/preview/{link}", recipient="BOB@example.com")["preview"]
    assert bob["subject"] == "Hello Bob"
    by_id = tapi.get(f"/campaign/{campaign}/preview/{link}", recipient=int(bob["recipient"]))
    assert by_id["preview"]["subject"] == "Hello Bob"
    assert tapi.get(f"/campaign/{campaign}/preview/{link}", status=404,
                    recipient="carol@example.com")["error"] == "not_found"
    assert tapi.get(f"/campaign/{campaign}/preview/99", status=404)["error"] == "not_found"


def test_preview_of_an_empty_segment_or_an_unusable_template_is_409(tapi, shop, folder):
    campaign, link = shop["campaign"], shop["link"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate="news")
    (folder / "news.html").write_text("no slot")
    assert "{{content}}" in tapi.get(f"/campaign/{campaign}/preview/{link}", status=409)["message"]
    tapi.post(f"/segment/{shop['segment']}", conditions=[
        {"field": "first", "op": "eq", "value": "Nobody"}])
    assert tapi.get(f"/campaign/{campaign}/preview/{link}", status=409)["error"] == "conflict"


# --- test sends ------------------------------------------------------------------------------

def test_a_test_send_reaches_only_its_addresses_now_without_batch_or_schedule(
        tapi, shop, db, folder, smtp_sink):
    campaign = shop["campaign"]
    tapi.post(f"/campaign/{campaign}", defaulttemplate="news")
    preview = tapi.get(f"/campaign/{campaign}/preview/{shop['link']}")["preview"]
    assert tapi.put(f"/campaign/{campaign}/send/0",
                    test=["qa@example.net", "Boss@Example.NET", "qa@EXAMPLE.net"]) == {"id": "0"}
    assert tapi.get(f"/campaign/{campaign}")["emt_campaign"][0]["scheduled"] == "0"
    assert tapi.get(f"/campaign/{campaign}/batcharchive/all")["total"] == "0"
    arrived = deliver(db, smtp_sink)
    assert set(arrived) == {"qa@example.net", "Boss@example.net"}
    message = arrived["qa@example.net"]
    subject, html_body, text_body = bodies(message)
    assert subject == "[Test] " + preview["subject"]          # rendered for Ann, the first
    assert str(message["From"]) == "The Shop <news@shop.example>"
    # The same email as Ann's, but its unsubscribe link is the tester's own.
    link = preview["headers"]["List-Unsubscribe"][1:-1]
    assert html_body.split("/v1/unsubscribe/")[0] == preview["html"].split("/v1/unsubscribe/")[0]
    assert link not in text_body and "/v1/unsubscribe/" in text_body
    token = text_body.split("/v1/unsubscribe/")[1].split()[0]
    assert campaignapi.read_unsubscribe_token(app_secret(db), token)[1] == "qa@example.net"
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'test' AND batch IS NULL") == 2
    assert scalar(db, "SELECT count(*) FROM event") == 0


def test_a_test_send_is_queued_prepared_and_rendered_at_delivery(tapi, shop, db, smtp_sink):
    """A test send queues the campaign's prepared message, its merge tags still
    tags, and delivery renders it with the campaign's own code: nothing is
    built, parsed back and stored as strings when the request is answered."""
    campaign = shop["campaign"]
    tapi.put(f"/campaign/{campaign}/send/0", test=["qa@example.net"])
    with database(db) as conn:
        row = conn.execute("SELECT kind, subject, campaign, base_url, message, recipient "
                           "FROM outbox WHERE to_addr = 'qa@example.net'").fetchone()
    assert row["kind"] == "test" and int(row["campaign"]) == int(campaign)
    assert row["subject"] == "[Test] Hello {{first}}"            # prepared, not rendered
    assert row["base_url"] and row["message"] is not None and row["recipient"] is not None
    message = deliver(db, smtp_sink)["qa@example.net"]
    assert bodies(message)[0] == "[Test] Hello Ann <A&B>"       # rendered at delivery
    assert message["List-Id"] and message["List-Unsubscribe"]   # the campaign's headers


@pytest.mark.parametrize("params,code,field", [
    ({}, "missing_parameter", ["timestamp"]),
    ({"test": []}, "invalid_parameter", "test"),
    ({"test": [f"t{i}@example.com" for i in range(11)]}, "invalid_parameter", "test"),
    ({"test": ["qa@example.net", "not an address"]}, "invalid_parameter", "test"),
    ({"test": [7]}, "invalid_parameter", "test"),
    ({"test": "qa@example.net"}, "invalid_parameter", "test"),
    ({"test": ["qa@example.net"], "timestamp": 0}, "invalid_parameter", "timestamp"),
])
def test_bad_test_sends_are_400_and_change_nothing(tapi, shop, db, params, code, field):
    before = snapshot(db)
    response = send(tapi.client, "PUT", f"/v1/campaign/{shop['campaign']}/send/0", tapi.headers,
                    params or None)
    assert assert_error(response, 400, code)["field"] == field
    assert snapshot(db) == before


def test_a_test_send_of_an_email_that_cannot_be_built_is_refused(tapi, shop, db, smtp_sink):
    tapi.post(f"/message/{shop['message']}", subject=" ")
    data = tapi.put(f"/campaign/{shop['campaign']}/send/0", status=409, test=["qa@example.net"])
    assert data["error"] == "verification_failed"
    # An audience problem is no reason to refuse a test: an empty segment renders blank.
    tapi.post(f"/message/{shop['message']}", subject="Hello {{first}}")
    tapi.post(f"/segment/{shop['segment']}", conditions=[
        {"field": "first", "op": "eq", "value": "Nobody"}])
    assert tapi.put(f"/campaign/{shop['campaign']}/send/0", test=["qa@example.net"])["id"] == "0"
    assert deliver(db, smtp_sink)["qa@example.net"]["Subject"] == "[Test] Hello"


def test_the_command_line_refuses_a_templates_dir_that_is_no_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        campaignapi.main(["worker", "--db", str(tmp_path / "x.db"), "--templates-dir",
                          str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.db")


class HttpApi:
    """The API of a served process over real HTTP, as conftest's Api over WebTest."""

    def __init__(self, port, secret):
        self.base = f"http://127.0.0.1:{port}/v1"
        self.headers = {"Authorization": f"Bearer {secret}"}

    def call(self, method, path, **params):
        status, _, body = http(self.base + path, method, params, self.headers)
        assert status == 200, body
        return json.loads(body)["data"]

    def put(self, path, **params):
        return self.call("PUT", path, **params)


def test_serve_with_templates_dir_sends_a_file_template_through_its_worker(tmp_path, folder,
                                                                           smtp_sink):
    """The flag reaches both halves of ``serve``: the API accepts the file name
    and the worker thread wraps the emails in it."""
    db = str(tmp_path / "served.db")
    with served("--db", db, "--templates-dir", str(folder), "--smtp", smtp_sink.address,
                cwd=tmp_path) as server:
        api = HttpApi(server.port, server.secret)
        ds = api.put("/datasource/0", name="d", fields=[{"name": "first", "type": "text"}])["id"]
        api.put(f"/datasource/{ds}/import/0", name="i", originalfile="f.csv",
                __uploadtype__="csv", __uploaddata__="email,first\nann@example.com,Ann\n")
        ids = make_campaign(api, [int(ds)])
        api.call("POST", f"/campaign/{ids['campaign']}", defaulttemplate="news")
        api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)
        wait_for(lambda: "ann@example.com" in smtp_sink.parsed(), what="Ann's email")
    subject, html_body, text_body = bodies(smtp_sink.parsed()["ann@example.com"])
    assert subject == "Hello Ann" and text_body.startswith("THE SHOP NEWS\n\nHi Ann")
    assert '<div class="frame" style=' in html_body
