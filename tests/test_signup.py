"""Sign-ups with double opt-in and single-recipient writes: the datasource's
sign-up settings, the public form and its answers (the same for every
address), confirmation links, the statuses everywhere, erasure, and the
worker's clean-up of sign-ups never confirmed."""

import base64
import datetime
import hashlib
import hmac
import threading
import time

import pytest

import campaignapi
from conftest import Api
from helpers import (assert_error, confirm_path, database, import_csv, keyed_client,
                     make_campaign, make_signup_list, recipients, scalar)

CONFIRM_HTML = "<p>Hi {{first}}</p><p><a href='{{confirm_url}}'>confirm</a></p>"
CONFIRM_TEXT = "Hi {{first}}, confirm: {{confirm_url}}"


@pytest.fixture
def events():
    return []


@pytest.fixture
def app(db, events):
    return campaignapi.create_app(db, public_url="https://lists.example.com/email",
                                  on_event=lambda kind, payload: events.append((kind, payload)))


def signup_json(client, ds, status=200, **values):
    response = client.post_json(f"/v1/subscribe/{ds}", values, expect_errors=True)
    assert response.status_int == status, response.text
    return response


def outbox(db, kind="signup"):
    with database(db) as conn:
        return [dict(row) for row in conn.execute(
            "SELECT * FROM outbox WHERE kind = ? ORDER BY id", (kind,))]


def status_of(api, ds, address):
    return recipients(api, ds)[address]["status"]


def set_status(db, address, status, reason=None):
    """A recipient made unsubscribed, bounced or complained the way the product does it."""
    with database(db) as conn, campaignapi.transaction(conn):
        campaignapi.suppress(conn, 1, address, reason or status)


# --- settings ----------------------------------------------------------------------------------

def test_sign_up_settings_default_off_and_are_in_the_record(api):
    ds = api.put("/datasource/0", name="plain")["id"]
    record = api.get(f"/datasource/{ds}")["datasource"]
    assert (record["signup"], record["doubleoptin"]) == ("0", "1")
    assert record["confirmmessage"] is record["welcomemessage"] is record["fromprofile"] is None


def test_sign_up_settings_are_checked(api, stranger_api):
    profile = int(api.put("/accountprofile/0", name="p", fromaddress="a@shop.example")["id"])
    good = int(api.put("/message/0", name="c", subject="s", html=CONFIRM_HTML,
                       text=CONFIRM_TEXT)["id"])
    text_only = int(api.put("/message/0", name="t", subject="s", text=CONFIRM_TEXT)["id"])
    half = int(api.put("/message/0", name="h", subject="s", html=CONFIRM_HTML, text="no tag")["id"])
    gone = int(api.put("/message/0", name="g", subject="s", text=CONFIRM_TEXT)["id"])
    api.delete(f"/message/{gone}", id=gone)
    theirs = int(stranger_api.put("/message/0", name="x", text=CONFIRM_TEXT)["id"])
    # A reference like any other: missing (or another account's) 404, deleted 409; a
    # message without {{confirm_url}} 409 (what is stored forbids it).
    for message, status in ((half, 409), (gone, 409), (theirs, 404), (999, 404)):
        data = api.put("/datasource/0", status=status, name="d", confirmmessage=message)
        assert data["field"] == "confirmmessage"
    assert api.put("/datasource/0", status=404, name="d", welcomemessage=999)["field"] == \
        "welcomemessage"
    assert api.put("/datasource/0", status=404, name="d", fromprofile=999)["field"] == "fromprofile"
    # Sign-ups need a sender profile: 409, on create and on change.
    assert api.put("/datasource/0", status=409, name="d", signup=1)["error"] == "conflict"
    ds = api.put("/datasource/0", name="d", signup="1", fromprofile=profile,
                 confirmmessage=text_only, welcomemessage=str(good))["id"]
    assert api.post(f"/datasource/{ds}", status=409, fromprofile="")["error"] == "conflict"
    api.post(f"/datasource/{ds}", signup=0, fromprofile=None, confirmmessage="",
             doubleoptin="0")
    record = api.get(f"/datasource/{ds}")["datasource"]
    assert (record["signup"], record["doubleoptin"], record["fromprofile"],
            record["confirmmessage"], record["welcomemessage"]) == ("0", "0", None, None, str(good))
    assert api.post(f"/datasource/{ds}", status=409, signup=1)["field"] == "signup"


# --- the public form ---------------------------------------------------------------------------

def test_the_form_is_plain_html_with_a_label_for_every_field(api, client):
    ds = make_signup_list(api, fields=[{"name": "first", "type": "text"},
                                       {"name": "age", "type": "integer"},
                                       {"name": "vip", "type": "boolean"},
                                       {"name": "born", "type": "date"}])
    response = client.get(f"/v1/subscribe/{ds}?utm_source=newsletter")
    assert response.status_int == 200 and response.content_type == "text/html"
    page = response.html
    assert "<script" not in response.text
    assert page.find("meta", attrs={"name": "viewport"})
    form = page.find("form")
    assert form["method"] == "post" and not form.get("action")
    inputs = form.find_all("input")
    names = [field["name"] for field in inputs]
    assert names == ["email", "first", "age", "vip", "born", "_website"]
    for field in inputs:
        assert page.find("label", attrs={"for": field["id"]}), field
    assert form.find("input", attrs={"name": "email"})["type"] == "email"
    assert form.find("input", attrs={"name": "email"}).has_attr("required")
    assert form.find("input", attrs={"name": "born"})["type"] == "date"
    assert form.find("input", attrs={"name": "vip"})["type"] == "checkbox"
    assert "Access-Control-Allow-Origin" not in response.headers


@pytest.mark.parametrize("case", ["unknown", "deleted", "closed", "word"])
def test_no_form_for_unknown_deleted_or_closed_datasources(api, client, case):
    ds = make_signup_list(api)
    if case == "deleted":
        api.delete(f"/datasource/{ds}", id=ds)
    elif case == "closed":
        api.post(f"/datasource/{ds}", signup=0)
    path = {"unknown": "/v1/subscribe/99", "word": "/v1/subscribe/x%20y"}.get(
        case, f"/v1/subscribe/{ds}")
    page = client.get(path, expect_errors=True)
    assert page.status_int == 404 and page.content_type == "text/html"
    assert "does not exist" in page.text
    assert_error(client.post_json(path, {"email": "a@example.com"}, expect_errors=True), 404,
                 "not_found")
    form = client.post(path, {"email": "a@example.com"}, expect_errors=True)
    assert form.status_int == 404 and form.content_type == "text/html"
    assert scalar(client.app.config["campaignapi.service"].db,
                  "SELECT count(*) FROM recipient") == 0


def test_the_answer_is_the_same_whatever_the_address(api, client, db):
    ds = make_signup_list(api)
    signup_json(client, ds, email="pending@example.com")
    signup_json(client, ds, email="active@example.com")
    api.call("POST", f"/datasource/{ds}/recipient/2", {"status": "active"})
    api.put(f"/datasource/{ds}/recipient/0", email="left@example.com")
    set_status(db, "left@example.com", "unsubscribed")
    api.put(f"/datasource/{ds}/recipient/0", email="erased@example.com")
    api.delete(f"/datasource/{ds}/recipient/4")
    datas, pages = [], []
    for address in ("new@example.com", "pending@example.com", "active@example.com",
                    "left@example.com", "erased@example.com"):
        datas.append(signup_json(client, ds, email=address).json["data"])
        pages.append(client.post(f"/v1/subscribe/{ds}", {"email": address}).text)
    assert datas == [{"status": "pending"}] * 5
    assert len(set(pages)) == 1 and "check your email" in pages[0]
    api.post(f"/datasource/{ds}", doubleoptin=0)
    assert signup_json(client, ds, email="left@example.com").json["data"] == {
        "status": "subscribed"}
    assert signup_json(client, ds, email="other@example.com").json["data"] == {
        "status": "subscribed"}


def test_a_form_post_gets_a_page_and_a_json_post_the_envelope(api, client):
    ds = make_signup_list(api, doubleoptin=0)
    page = client.post(f"/v1/subscribe/{ds}", {"email": "ann@example.com", "first": "Ann",
                                               "_website": ""})
    assert page.content_type == "text/html" and "You are subscribed" in page.text
    envelope = signup_json(client, ds, email="bob@example.com", first="Bob")
    assert envelope.content_type == "application/json"
    assert envelope.json["data"] == {"status": "subscribed"}
    people = recipients(api, ds)
    assert {a: (r["status"], r["fields"]["first"]) for a, r in people.items()} == {
        "ann@example.com": ("active", "Ann"), "bob@example.com": ("active", "Bob")}


def test_bad_sign_ups_are_refused_and_store_nothing(api, client, db):
    ds = make_signup_list(api, fields=[{"name": "age", "type": "integer"}])
    for values, code, field in (({"email": "not an address"}, "invalid_parameter", "email"),
                                ({"email": "a@b"}, "invalid_parameter", "email"),
                                ({}, "missing_parameter", "email"),
                                ({"email": ""}, "missing_parameter", "email"),
                                ({"email": 5}, "invalid_parameter", "email"),
                                ({"email": "a@example.com", "age": "old"}, "invalid_parameter",
                                 "age"),
                                ({"email": "a@example.com", "age": [1]}, "invalid_parameter",
                                 "age"),
                                ({"email": "a@example.com", "agee": "4"}, "unknown_parameter",
                                 ["agee"]),
                                ({"email": "a@example.com", "EMAIL": "b@example.com"},
                                 "unknown_parameter", ["EMAIL"])):
        data = assert_error(signup_json(client, ds, 400, **values), 400, code)
        assert data["field"] == field
    page = client.post(f"/v1/subscribe/{ds}", {"email": "nope", "age": "12"}, expect_errors=True)
    assert page.status_int == 400 and page.content_type == "text/html"
    assert page.html.find(attrs={"role": "alert"}).text == "This is not a valid email address."
    assert page.html.find("input", attrs={"name": "age"})["value"] == "12"  # kept for the fix
    for raw, content_type in ((b"email=%FF%FE", "application/x-www-form-urlencoded"),
                              (b"email=a%40example.com&email=b%40example.com",
                               "application/x-www-form-urlencoded"),
                              (b"{not json", "application/json"), (b"[1]", "application/json"),
                              (b'{"email": "\\ud800@example.com"}', "application/json"),
                              (b"email=a@example.com", "text/plain")):
        response = client.post(f"/v1/subscribe/{ds}", raw, content_type=content_type,
                               expect_errors=True)
        assert response.status_int in (400, 415), (raw, response.text)
    assert scalar(db, "SELECT count(*) FROM recipient") == 0
    assert outbox(db) == []


def test_a_filled_honeypot_does_nothing_and_answers_the_same(api, client, db):
    ds = make_signup_list(api)
    bot = client.post(f"/v1/subscribe/{ds}", {"email": "bot@example.com", "first": "x",
                                               "_website": "http://spam.example"})
    person = client.post(f"/v1/subscribe/{ds}", {"email": "ann@example.com", "_website": ""})
    assert bot.status_int == person.status_int == 200 and bot.text == person.text
    assert signup_json(client, ds, email="bot2@example.com", _website="x").json["data"] == \
        {"status": "pending"}
    assert list(recipients(api, ds)) == ["ann@example.com"]
    assert [row["to_addr"] for row in outbox(db)] == ["ann@example.com"]


def test_cors_on_the_sign_up_post_and_its_preflight_only(api, client):
    ds = make_signup_list(api)
    preflight = client.options(f"/v1/subscribe/{ds}", headers={
        "Origin": "https://shop.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"].lower() == "content-type"
    for response in (signup_json(client, ds, email="a@example.com"),
                     signup_json(client, ds, 400, email="bad"),
                     signup_json(client, 99, 404, email="a@example.com")):
        assert response.headers["Access-Control-Allow-Origin"] == "*"
        assert "Access-Control-Allow-Credentials" not in response.headers
    for other in (client.get(f"/v1/subscribe/{ds}"), client.get("/v1/confirm/x", status=404),
                  client.get("/v1/datasource/all", headers=api.headers)):
        assert "Access-Control-Allow-Origin" not in other.headers


def test_sign_ups_of_one_client_are_limited_per_minute(db):
    client, auth = keyed_client(db, signup_rate=3)
    ds = make_signup_list(Api(client, auth))
    for number in range(3):
        signup_json(client, ds, email=f"p{number}@example.com")
    refused = signup_json(client, ds, 429, email="p3@example.com")
    assert_error(refused, 429, "rate_limited")
    assert 1 <= int(refused.headers["Retry-After"]) <= 61
    page = client.post(f"/v1/subscribe/{ds}", {"email": "p4@example.com"}, expect_errors=True)
    assert page.status_int == 429 and page.content_type == "text/html"
    other = client.post_json(f"/v1/subscribe/{ds}", {"email": "p5@example.com"},
                             extra_environ={"REMOTE_ADDR": "192.0.2.7"})
    assert other.json["data"] == {"status": "pending"}
    assert scalar(db, "SELECT count(*) FROM recipient") == 4


# --- double opt-in -----------------------------------------------------------------------------

def test_double_opt_in_from_sign_up_to_welcome(api, client, db, events):
    confirm = int(api.put("/message/0", name="confirm", subject="Confirm, {{first}}",
                          html=CONFIRM_HTML, text=CONFIRM_TEXT)["id"])
    welcome = int(api.put("/message/0", name="welcome", subject="Welcome {{first}}",
                          text="Glad you're here. Leave: {{unsubscribe_url}}")["id"])
    ds = make_signup_list(api, confirmmessage=confirm, welcomemessage=welcome)
    signup_json(client, ds, email="Ann@Example.COM", first="Ann")
    person = recipients(api, ds)["Ann@example.com"]
    assert person["status"] == "unconfirmed" and person["fields"]["first"] == "Ann"
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == "0"
    assert api.get(f"/datasource/{ds}")["datasource"]["origin"] == "api"
    [mail] = outbox(db)
    assert (mail["to_addr"], mail["subject"], mail["fromname"], mail["fromaddress"],
            mail["replyto"]) == ("Ann@example.com", "Confirm, Ann", "The List",
                                 "list@shop.example", "help@shop.example")
    path = confirm_path(mail["body"])
    assert mail["body"].startswith("Hi Ann, confirm: https://lists.example.com/email/v1/confirm/")
    assert path in mail["html"]
    token = path.rsplit("/", 1)[1]
    assert b"ann" not in base64.urlsafe_b64decode(token + "==").lower()
    assert [kind for kind, _ in events] == ["recipient.subscribed"]
    assert events[0][1]["data"]["email"] == "Ann@example.com"

    # GET shows the button and changes nothing (mail scanners open links).
    page = client.get(path)
    assert page.html.find("form")["method"] == "post"
    assert status_of(api, ds, "Ann@example.com") == "unconfirmed"
    done = client.post(path)
    assert "Subscription confirmed" in done.text and done.content_type == "text/html"
    assert status_of(api, ds, "Ann@example.com") == "active"
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == "1"
    assert [kind for kind, _ in events] == ["recipient.subscribed", "recipient.confirmed"]
    [hello] = [row for row in outbox(db) if row["subject"].startswith("Welcome")]
    assert hello["fromaddress"] == "list@shop.example"
    assert "https://lists.example.com/email/v1/unsubscribe/" in hello["body"]
    # Twice is harmless: no second welcome, no second event.
    again = client.post(path)
    assert again.status_int == 200 and "confirmed" in again.text
    assert client.get(path).status_int == 200
    assert len(outbox(db)) == 2 and len(events) == 2
    # Signing up again while active changes nothing and sends nothing.
    signup_json(client, ds, email="ann@example.com")
    assert len(outbox(db)) == 2 and status_of(api, ds, "Ann@example.com") == "active"


def test_the_built_in_confirmation_email(api, client, db):
    ds = make_signup_list(api, name="Weekly <News>")
    signup_json(client, ds, email="ann@example.com")
    [mail] = outbox(db)
    assert mail["subject"] == "Confirm your subscription to Weekly <News>"
    assert confirm_path(mail["body"]) and confirm_path(mail["html"])
    assert "Weekly &lt;News&gt;" in mail["html"]
    assert "7 days" in mail["body"]


def test_at_most_one_confirmation_email_per_ten_minutes(api, client, db):
    ds = make_signup_list(api)
    for _ in range(3):
        signup_json(client, ds, email="ann@example.com")
    assert len(outbox(db)) == 1
    with database(db) as conn:
        conn.execute("UPDATE recipient SET confirm_sent = '2000-01-01 00:00:00'")
    signup_json(client, ds, email="ann@example.com")
    assert len(outbox(db)) == 2


def test_links_that_are_forged_expired_or_used_get_a_page(api, client, db, app):
    ds = make_signup_list(api)
    signup_json(client, ds, email="ann@example.com")
    secret = app.config["campaignapi.service"].secret
    path = confirm_path(outbox(db)[0]["body"])
    token = path.rsplit("/", 1)[1]
    today = int(time.time()) // 86400     # the day number a confirm token expires on
    forged = campaignapi.sign_token("another secret", "confirm", 1, today + 7)
    old = campaignapi.sign_token(secret, "confirm", 1, today - 1)
    wrong_purpose = campaignapi.sign_token(secret, "click", 1, today + 7)
    for bad, words in ((forged, "not valid"), (token[:-2], "not valid"), (wrong_purpose,
                                                                          "not valid"),
                       (old, "expired"), ("x" * 500, "not valid")):
        for method in ("GET", "POST"):
            response = client.request(f"/v1/confirm/{bad}", method=method, expect_errors=True)
            assert response.status_int == 404 and response.content_type == "text/html"
            assert words in response.text
    assert status_of(api, ds, "ann@example.com") == "unconfirmed"
    # Confirmed, then unsubscribed: the old link no longer brings the address back.
    client.post(path)
    set_status(db, "ann@example.com", "unsubscribed")
    used = client.post(path, expect_errors=True)
    assert used.status_int == 404 and "no longer valid" in used.text
    assert status_of(api, ds, "ann@example.com") == "unsubscribed"


@pytest.mark.parametrize("reason", ["unsubscribed", "bounced", "complained"])
def test_a_suppressed_address_comes_back_only_by_confirming(api, client, db, reason):
    ds = make_signup_list(api)
    api.put(f"/datasource/{ds}/recipient/0", email="ann@example.com")
    set_status(db, "ann@example.com", reason)
    signup_json(client, ds, email="ann@example.com")
    assert status_of(api, ds, "ann@example.com") == reason
    client.post(confirm_path(outbox(db)[0]["body"]))
    assert status_of(api, ds, "ann@example.com") == "active"
    assert scalar(db, "SELECT count(*) FROM suppression") == 0


def test_without_double_opt_in_a_suppressed_address_stays_so(api, client, db):
    ds = make_signup_list(api, doubleoptin=0)
    other = make_signup_list(api, name="other", doubleoptin=0)
    api.put(f"/datasource/{ds}/recipient/0", email="ann@example.com")
    set_status(db, "ann@example.com", "unsubscribed")
    assert signup_json(client, ds, email="ann@example.com").json["data"] == {
        "status": "subscribed"}
    assert signup_json(client, other, email="ann@example.com").json["data"] == {
        "status": "subscribed"}
    assert status_of(api, ds, "ann@example.com") == "unsubscribed"
    assert status_of(api, other, "ann@example.com") == "unsubscribed"
    assert outbox(db) == []


def test_the_worker_removes_sign_ups_unconfirmed_for_seven_days(api, client, db):
    ds = make_signup_list(api)
    for number in range(5):
        signup_json(client, ds, email=f"p{number}@example.com")
    api.put(f"/datasource/{ds}/recipient/0", email="kept@example.com")
    eight_days = (datetime.datetime.now(datetime.timezone.utc)
                  - datetime.timedelta(days=8)).strftime("%Y-%m-%d %H:%M:%S")
    with database(db) as conn:
        conn.execute("UPDATE recipient SET updated = ? WHERE email != 'p4@example.com'",
                     (eight_days,))
    # internal: the worker step that removes old sign-ups
    assert campaignapi._remove_unconfirmed(db, limit=2) == 2
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop), daemon=True)
    worker.start()
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=20)
        while len(recipients(api, ds)) > 2 and datetime.datetime.now() < deadline:
            stop.wait(0.1)
    finally:
        stop.set()
        worker.join(10)
    assert sorted(recipients(api, ds)) == ["kept@example.com", "p4@example.com"]


# --- single recipients -------------------------------------------------------------------------

@pytest.fixture
def ds(api):
    return int(api.put("/datasource/0", name="app", fields=[
        {"name": "first", "type": "text"}, {"name": "age", "type": "integer"},
        {"name": "vip", "type": "boolean"}])["id"])


def test_create_a_recipient(api, ds, events):
    created = api.put(f"/datasource/{ds}/recipient/0", email=" Ann@Example.COM ",
                      fields={"First": "Ann", "age": "42", "vip": True})
    record = api.get(f"/datasource/{ds}/recipient/{created['id']}")["recipient"]
    assert record["email"] == "Ann@example.com" and record["status"] == "active"
    assert record["fields"] == {"email": "Ann@example.com", "first": "Ann", "age": "42",
                                "vip": "1"}
    assert [kind for kind, _ in events] == ["recipient.subscribed"]
    assert api.call("PUT", f"/datasource/{ds}/recipient/7",
                    {"email": "bob@example.com", "status": "unconfirmed"}) == {"id": "7"}
    assert status_of(api, ds, "bob@example.com") == "unconfirmed"
    for params, code, field in (({}, "missing_parameter", ["email"]),
                                ({"email": ""}, "invalid_parameter", "email"),
                                ({"email": "x"}, "invalid_parameter", "email"),
                                ({"email": "c@example.com", "fields": {"nope": 1}},
                                 "invalid_parameter", "fields"),
                                ({"email": "c@example.com", "fields": {"email": "d@x.com"}},
                                 "invalid_parameter", "fields"),
                                ({"email": "c@example.com", "fields": {"age": "old"}},
                                 "invalid_parameter", "fields"),
                                ({"email": "c@example.com", "fields": {"age": {"a": 1}}},
                                 "invalid_parameter", "fields"),
                                ({"email": "c@example.com", "fields": []},
                                 "invalid_parameter", "fields")):
        data = api.put(f"/datasource/{ds}/recipient/0", status=400, **params)
        assert (data["error"], data["field"]) == (code, field)
    data = api.put(f"/datasource/{ds}/recipient/0", status=409, email="ANN@example.com")
    data = api.call("PUT", f"/datasource/{ds}/recipient/0",
                    {"email": "c@example.com", "status": "unsubscribed"}, 400)
    assert (data["error"], data["field"]) == ("invalid_parameter", "status")
    data = api.put(f"/datasource/{ds}/recipient/0", status=409, email="ANN@example.com")
    assert data["error"] == "conflict"
    assert api.put(f"/datasource/{ds}/recipient/7", status=409, email="c@example.com")
    assert sorted(recipients(api, ds)) == ["Ann@example.com", "bob@example.com"]


def test_change_a_recipient(api, ds, db):
    ann = api.put(f"/datasource/{ds}/recipient/0", email="ann@example.com",
                  fields={"first": "Ann", "age": 5})["id"]
    api.put(f"/datasource/{ds}/recipient/0", email="bob@example.com")
    path = f"/datasource/{ds}/recipient/{ann}"
    api.post(path, email="anna@example.com", fields={"age": "6", "vip": "no"})
    record = api.get(path)["recipient"]
    assert record["email"] == "anna@example.com"
    assert record["fields"] == {"email": "anna@example.com", "first": "Ann", "age": "6", "vip": "0"}
    api.post(path, fields={"first": None})
    assert api.get(path)["recipient"]["fields"]["first"] is None
    assert api.post(path, status=409, email="BOB@example.com")["field"] == "email"
    api.call("POST", path, {"status": "unconfirmed"})
    api.call("POST", path, {"status": "active"})
    api.call("POST", path, {"status": "unsubscribed"})
    assert status_of(api, ds, "anna@example.com") == "unsubscribed"
    assert scalar(db, "SELECT reason FROM suppression WHERE email = 'anna@example.com'") == \
        "unsubscribed"
    for status in ("active", "unconfirmed"):
        data = api.call("POST", path, {"status": status}, 409)
        assert (data["error"], data["field"]) == ("conflict", "status")
    set_status(db, "bob@example.com", "complained")
    bob = recipients(api, ds)["bob@example.com"]["id"]
    assert api.call("POST", f"/datasource/{ds}/recipient/{bob}", {"status": "active"},
                    409)["error"] == "conflict"
    api.post(f"/datasource/{ds}/recipient/{bob}", fields={"first": "Bob"})  # fields still change
    assert status_of(api, ds, "bob@example.com") == "complained"
    assert api.post(f"/datasource/{ds}/recipient/99", status=404, fields={})["error"] == \
        "not_found"


def test_levels_of_the_recipient_writes(client, make_key, ds, api):
    path = f"/v1/datasource/{ds}/recipient"
    for method, url, level in (("PUT", f"{path}/0", "create"), ("POST", f"{path}/1", "write"),
                               ("DELETE", f"{path}/1", "delete")):
        others = [lv for lv in campaignapi.LEVELS if lv != level]
        response = client.request(url, method=method, headers=make_key(others),
                                  expect_errors=True)
        assert_error(response, 403, "insufficient_access")


def test_delete_erases_the_address_for_the_account(api, ds, db, client, app):
    other = int(api.put("/datasource/0", name="other")["id"])
    ann = api.put(f"/datasource/{ds}/recipient/0", email="Ann@Example.com",
                  fields={"first": "Ann"})["id"]
    api.put(f"/datasource/{other}/recipient/0", email="ann@example.com")
    set_status(db, "ann@example.com", "bounced")
    assert api.delete(f"/datasource/{ds}/recipient/{ann}") is True
    assert api.get(f"/datasource/{ds}/recipient/{ann}", status=404)["error"] == "not_found"
    secret = app.config["campaignapi.service"].secret
    digest = hmac.new(secret.encode(), b"ann@example.com", hashlib.sha256).hexdigest()
    with database(db) as conn:
        assert [tuple(row) for row in conn.execute("SELECT account, hash FROM erasure")] == [
            (1, digest)]
        for table, column in (("suppression", "email"), ("event", "email"),
                              ("outbox", "to_addr")):
            assert conn.execute(f"SELECT count(*) FROM {table} WHERE {column} = "
                                "'ann@example.com'").fetchone()[0] == 0, table
    assert status_of(api, other, "ann@example.com") == "bounced"
    # Stored again by a create or an import: not mailable.
    api.put(f"/datasource/{ds}/recipient/0", email="ANN@example.com")
    assert status_of(api, ds, "ANN@example.com") == "unsubscribed"
    third = int(api.put("/datasource/0", name="third")["id"])
    import_csv(api, third, "email\nann@EXAMPLE.com\nbob@example.com\n")
    assert {a: r["status"] for a, r in recipients(api, third).items()} == {
        "ann@example.com": "unsubscribed", "bob@example.com": "active"}


def test_an_erased_address_comes_back_by_confirming_a_sign_up(api, client, db):
    ds = make_signup_list(api)
    api.put(f"/datasource/{ds}/recipient/0", email="ann@example.com")
    api.delete(f"/datasource/{ds}/recipient/1")
    signup_json(client, ds, email="ann@example.com")
    assert status_of(api, ds, "ann@example.com") == "unsubscribed"
    client.post(confirm_path(outbox(db)[0]["body"]))
    assert status_of(api, ds, "ann@example.com") == "active"
    assert scalar(db, "SELECT count(*) FROM erasure") == 0


def test_listing_filters_by_address_and_the_new_statuses(api, ds, db):
    for address, status in (("ann@example.com", "active"), ("bob@example.com", "unconfirmed"),
                            ("cid@example.com", "active")):
        api.call("PUT", f"/datasource/{ds}/recipient/0", {"email": address, "status": status})
    set_status(db, "cid@example.com", "complained")
    assert list(recipients(api, ds, email="ANN@EXAMPLE.COM")) == ["ann@example.com"]
    assert recipients(api, ds, email="nobody@example.com") == {}
    for status, addresses in (("unconfirmed", ["bob@example.com"]),
                              ("complained", ["cid@example.com"]), ("bounced", [])):
        page = api.call("GET", f"/datasource/{ds}/recipient/all", {"status": status})
        assert [r["email"] for r in page["recipient"]] == addresses
    data = api.call("GET", f"/datasource/{ds}/recipient/all", {"status": "gone"}, 400)
    assert data["field"] == "status" and "complained" in data["allowed"]


# --- only active recipients count, export and receive --------------------------------------

def test_only_active_recipients_count_export_and_receive_campaigns(api, ds, db):
    statuses = {"act@example.com": "active", "unc@example.com": "unconfirmed",
                "uns@example.com": "unsubscribed", "bou@example.com": "bounced",
                "com@example.com": "complained"}
    for address, status in statuses.items():
        api.call("PUT", f"/datasource/{ds}/recipient/0", {
            "email": address, "status": "unconfirmed" if status == "unconfirmed" else "active"})
        if status in ("unsubscribed", "bounced", "complained"):
            set_status(db, address, status)
    assert {a: r["status"] for a, r in recipients(api, ds).items()} == statuses
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == "1"
    export = api.get(f"/datasource/{ds}/export/0")["export"]
    assert export["rows"] == "1"
    ids = make_campaign(api, [ds])
    assert api.get(f"/segment/{ids['segment']}")["segment"]["size"] == "1"
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2000-01-01 00:00:00")
    campaignapi.process_due(db)
    with database(db) as conn:
        assert [row[0] for row in conn.execute(
            "SELECT to_addr FROM outbox WHERE kind = 'campaign'")] == ["act@example.com"]


def test_a_broken_form_post_still_gets_a_page(api, client):
    ds = make_signup_list(api)
    for raw in (b"email=%FF%FE", b"email=a%40example.com&email=b%40example.com", b""):
        page = client.post(f"/v1/subscribe/{ds}", raw,
                           content_type="application/x-www-form-urlencoded", expect_errors=True)
        assert page.status_int == 400 and page.content_type == "text/html"
        assert page.html.find(attrs={"role": "alert"})
