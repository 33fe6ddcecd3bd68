"""Bounces and complaints applied: the rules (hard, soft in a row, complaint),
which account a report belongs to, VERP and signed Message-IDs through the
real SMTP sink, POST /v1/bounce (raw and JSON), the provider routes signed
and forged, bad input and fuzzing of every bounce route."""

import base64
import email
import json

import pytest
import webtest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import campaignapi
from campaignapi import message_id_for, process_due, read_message_id, read_verp, verp_address
from helpers import (app_secret, assert_envelope, assert_error, import_csv, later, make_campaign,
                     make_datasource, recipients, scalar, send, snapshot, database, http)
from test_bounces import CORPUS, EXPECTED, SECRET, dsn
from test_provider_callbacks import (AUTH, CREDENTIALS, MAILGUN_FAILED, MAILGUN_KEY, POSTMARK_BOUNCE,
                                     SENDGRID_PUBLIC, SES_BOUNCE, TOPIC, Sns, mailgun, sendgrid)

BOUNCE_DOMAIN = "bounces.example.com"
RAW = {"Content-Type": "message/rfc822"}


def post_raw(client, auth, raw, status=200):
    response = client.post("/v1/bounce", raw, headers={**auth, **RAW}, expect_errors=True)
    assert response.status_int == status, response.text
    return response.json["data"]


def status_of(db, address):
    """The statuses of the recipient rows with ``address``, sorted."""
    with database(db) as conn:
        return sorted(row[0] for row in conn.execute(
            "SELECT status FROM recipient WHERE email = ?", (address,)))


def events(db, kind=None):
    with database(db) as conn:
        return [dict(row) for row in conn.execute(
            "SELECT account, kind, campaign, batch, outbox, email FROM event"
            + (" WHERE kind = ?" if kind else "") + " ORDER BY id", (kind,) if kind else ())]


def mark_sent(db, outbox_ids, days_ago=0):
    with database(db) as conn, campaignapi.transaction(conn):
        moment = later(-days_ago * 86400)
        for outbox in outbox_ids:
            conn.execute("UPDATE outbox SET status = 'sent', sent = ?, created = ? WHERE id = ?",
                         (moment, moment, outbox))


# --- VERP and the signed Message-ID through the real SMTP sink, then the bounce -----------

@pytest.fixture
def sent_campaign(api, db, smtp_sink):
    """A campaign of three recipients delivered through the SMTP sink with VERP."""
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, "email,first\nann@example.org,Ann\nbob@example.org,Bob\n"
                        "cy@example.org,Cy\n")
    ids = make_campaign(api, [ds])
    batch = api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2000-01-01 00:00:00")["id"]
    process_due(db)
    counts = campaignapi.deliver(db, smtp_sink.address, bounce_domain=BOUNCE_DOMAIN)
    assert counts["sent"] == 4      # and the import's notification
    with database(db) as conn:
        outbox = {row["to_addr"]: row["id"] for row in conn.execute(
            "SELECT id, to_addr FROM outbox WHERE batch = ?", (int(batch),))}
    secret = app_secret(db)
    return {**ids, "datasource": ds, "batch": batch, "outbox": outbox, "secret": secret}


def test_each_campaign_email_has_its_verp_sender_and_signed_message_id(sent_campaign, smtp_sink):
    secret, outbox = sent_campaign["secret"], sent_campaign["outbox"]
    parsed = smtp_sink.parsed()
    for mail_from, (to,), _ in smtp_sink.messages:
        if to not in outbox:   # the import's notification: not a campaign email, no VERP
            assert read_verp(secret, mail_from) is None
            continue
        assert mail_from == verp_address(secret, outbox[to], BOUNCE_DOMAIN)
        assert read_verp(secret, mail_from) == outbox[to]
        # The From header stays the sender's; only the envelope changes.
        assert parsed[to]["From"] == "The Shop <news@shop.example>"
        assert parsed[to]["Message-ID"] == message_id_for(secret, outbox[to], "shop.example")
        assert read_message_id(secret, parsed[to]["Message-ID"]) == outbox[to]
    assert read_message_id("another secret", parsed["ann@example.org"]["Message-ID"]) is None


def bounce_of(sent_campaign, smtp_sink, to, corpus_file="postfix_user_unknown.eml"):
    """The corpus bounce rewritten as if it came back for our email to ``to``."""
    mail_from = next(m for m, rcpts, _ in smtp_sink.messages if rcpts == [to])
    raw = (CORPUS / corpus_file).read_bytes()
    raw = raw.replace(b"bounces+4711-z6shorsnemisnue4@bounce.example.com", mail_from.encode())
    return raw.replace(b"nobody@example.net", to.encode())


def test_a_bounce_posted_later_bounces_that_recipient_and_counts_in_its_batch(
        sent_campaign, smtp_sink, client, auth, api, db):
    raw = bounce_of(sent_campaign, smtp_sink, "bob@example.org")
    answer = post_raw(client, auth, raw)
    assert answer == {"bounce": {"type": "hard", "email": "bob@example.org",
                                 "campaign": sent_campaign["campaign"],
                                 "batch": sent_campaign["batch"]}}
    listed = recipients(api, sent_campaign["datasource"])
    assert {e: r["status"] for e, r in listed.items()} == {
        "ann@example.org": "active", "bob@example.org": "bounced", "cy@example.org": "active"}
    assert events(db) == [{"account": 1, "kind": "bounce",
                           "campaign": int(sent_campaign["campaign"]),
                           "batch": int(sent_campaign["batch"]),
                           "outbox": sent_campaign["outbox"]["bob@example.org"],
                           "email": "bob@example.org"}]
    # The same bounce again changes nothing more.
    post_raw(client, auth, raw)
    assert len(events(db)) == 1


def test_without_verp_our_message_id_in_the_report_names_the_email(
        sent_campaign, smtp_sink, client, other, db):
    secret, outbox = sent_campaign["secret"], sent_campaign["outbox"]
    message_id = message_id_for(secret, outbox["cy@example.org"], "shop.example")
    raw = dsn("Final-Recipient: rfc822; forwarded@elsewhere.example\nAction: failed\nStatus: 5.1.1",
              original=f"To: cy@example.org\nMessage-ID: {message_id}\n")
    # Posted with a key of another account: the email decides the account.
    answer = post_raw(client, other, raw)["bounce"]
    assert (answer["email"], answer["batch"]) == ("cy@example.org", sent_campaign["batch"])
    assert status_of(db, "cy@example.org") == ["bounced"]
    # A forged mac names nothing: the report's address, in the key's account.
    forged = message_id.replace(message_id.split(".")[1][:4], "aaaa")
    raw = dsn("Final-Recipient: rfc822; ann@example.org\nAction: failed\nStatus: 5.1.1",
              original=f"To: ann@example.org\nMessage-ID: {forged}\n")
    answer = post_raw(client, other, raw)["bounce"]
    assert (answer["email"], answer["campaign"], answer["batch"]) == ("ann@example.org", None, None)
    assert status_of(db, "ann@example.org") == ["active"]
    assert scalar(db, "SELECT account FROM suppression WHERE email = 'ann@example.org'") == 2


# --- the corpus through POST /v1/bounce --------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_corpus_message_is_answered_by_its_classification(tmp_path, name):
    db = str(tmp_path / "corpus.db")
    client = webtest.TestApp(campaignapi.create_app(db, secret=SECRET))
    auth = {"Authorization": "Bearer " + campaignapi.create_key(db, "owner@example.com")}
    before = snapshot(db)
    answer = post_raw(client, auth, (CORPUS / name).read_bytes())["bounce"]
    kind, address = EXPECTED[name][:2]
    assert (answer["type"], answer["email"]) == (kind, address)
    if kind == "none" or address is None:
        # No bounce, or one whose email (VERP 815) is not in this database and
        # that names no address: nothing changes.
        assert snapshot(db) == before
    else:
        reason = "complained" if kind == "complaint" else "bounced"
        expected = [] if kind == "soft" else [(address, reason)]
        with database(db) as conn:
            assert [tuple(r) for r in conn.execute("SELECT email, reason FROM suppression")] == \
                expected
        assert [e["kind"] for e in events(db)] == [
            {"hard": "bounce", "soft": "softbounce", "complaint": "complaint"}[kind]]


# --- the rules --------------------------------------------------------------------------

def test_a_hard_bounce_bounces_every_recipient_of_the_address_in_the_account_only(
        api, stranger_api, db):
    mine = [make_datasource(api, name=n) for n in ("a", "b")]
    theirs = make_datasource(stranger_api)
    for ds, who in ((mine[0], api), (mine[1], api), (theirs, stranger_api)):
        import_csv(who, ds, "email\ngone@example.net\nstays@example.net\n")
    answer = api.post("/bounce", email="Gone@EXAMPLE.net", type="hard", reason="550 5.1.1")
    assert answer["bounce"] == {"type": "hard", "email": "Gone@example.net", "campaign": None,
                                "batch": None}
    assert status_of(db, "gone@example.net") == ["active", "bounced", "bounced"]
    assert status_of(db, "stays@example.net") == ["active"] * 3


def test_a_complaint_outranks_a_bounce(api, db):
    ds = make_datasource(api)
    import_csv(api, ds, "email\nangry@example.net\n")
    api.post("/bounce", email="angry@example.net", type="hard")
    api.post("/bounce", email="angry@example.net", type="complaint")
    assert status_of(db, "angry@example.net") == ["complained"]
    api.post("/bounce", email="angry@example.net", type="hard")
    assert status_of(db, "angry@example.net") == ["complained"]
    assert [e["kind"] for e in events(db)] == ["bounce", "complaint"]


@pytest.fixture
def mailed(seed_campaign, db):
    """``mailed(n)``: n more campaign emails sent to soft@example.net: their outbox ids."""
    def mail(count, address="soft@example.net"):
        ids = [seed_campaign([(address, "Soft")])["outbox"][0] for _ in range(count)]
        mark_sent(db, ids)
        return ids
    return mail


def soft_dsn(secret, outbox, address="soft@example.net"):
    return dsn(f"Final-Recipient: rfc822; {address}\nAction: failed\nStatus: 4.2.2",
               to=verp_address(secret, outbox, BOUNCE_DOMAIN))


def test_the_third_soft_bounce_in_a_row_bounces(mailed, client, auth, db):
    secret = app_secret(db)
    first, second, third = mailed(3)
    for outbox in (first, second):
        assert post_raw(client, auth, soft_dsn(secret, outbox))["bounce"]["type"] == "soft"
        # A second report of the same email (a delay warning, then the failure) counts once.
        post_raw(client, auth, soft_dsn(secret, outbox))
    assert len(events(db, "softbounce")) == 2
    assert set(status_of(db, "soft@example.net")) == {"active"}
    post_raw(client, auth, soft_dsn(secret, third))
    assert set(status_of(db, "soft@example.net")) == {"bounced"}
    bounce = events(db, "bounce")
    assert [(e["outbox"], e["email"]) for e in bounce] == [(third, "soft@example.net")]


def test_a_delivery_between_soft_bounces_starts_the_count_again(mailed, client, auth, db):
    secret = app_secret(db)
    first, second, delivered, fourth, fifth = mailed(5)
    for outbox in (first, second, fourth, fifth):
        post_raw(client, auth, soft_dsn(secret, outbox))
    assert set(status_of(db, "soft@example.net")) == {"active"}    # two in a row, not three
    sixth = mailed(1)[0]
    post_raw(client, auth, soft_dsn(secret, sixth))
    assert set(status_of(db, "soft@example.net")) == {"bounced"}


def test_soft_bounces_that_name_no_email_take_the_latest_one(mailed, api, db):
    first = mailed(1)[0]
    api.post("/bounce", email="soft@example.net", type="soft")
    api.post("/bounce", email="soft@example.net", type="soft")     # the same email: once
    assert [e["outbox"] for e in events(db, "softbounce")] == [first]
    mailed(1)
    api.post("/bounce", email="soft@example.net", type="soft")
    assert set(status_of(db, "soft@example.net")) == {"active"}
    mailed(1)
    api.post("/bounce", email="soft@example.net", type="soft")
    assert set(status_of(db, "soft@example.net")) == {"bounced"}


def test_giving_up_on_temporary_smtp_failures_is_a_soft_bounce_of_that_email(
        seed_campaign, smtp_sink, db):
    smtp_sink.always["full@example.net"] = "452 4.2.2 Mailbox full"
    for round_number in range(1, 4):
        seeded = seed_campaign([("full@example.net", "F"), ("fine@example.net", "G")])
        counts = campaignapi.deliver(db, smtp_sink.address, max_attempts=1)
        assert (counts["sent"], counts["failed"], counts["bounced"]) == (1, 1, 0)
        soft = events(db, "softbounce")
        assert len(soft) == round_number
        assert (soft[-1]["batch"], soft[-1]["outbox"]) == (seeded["batch"], seeded["outbox"][0])
        expected = {"bounced"} if round_number == 3 else {"active"}
        assert set(status_of(db, "full@example.net")) == expected
    assert set(status_of(db, "fine@example.net")) == {"active"}


def test_soft_bounces_of_an_address_never_mailed_count_each(api, db):
    ds = make_datasource(api)
    import_csv(api, ds, "email\nnever@example.net\n")
    for _ in range(2):
        api.post("/bounce", email="never@example.net", type="soft")
    assert status_of(db, "never@example.net") == ["active"]
    api.post("/bounce", email="never@example.net", type="soft")
    assert status_of(db, "never@example.net") == ["bounced"]


def test_a_report_known_by_its_address_applies_to_the_accounts_that_mailed_it_lately(
        seed_campaign, db):
    recent = [seed_campaign([("shared@example.net", "S")], owner=f"o{i}@example.com")
              for i in range(2)]
    old = seed_campaign([("shared@example.net", "S")], owner="old@example.com")
    mark_sent(db, recent[0]["outbox"] + recent[1]["outbox"], days_ago=3)
    mark_sent(db, old["outbox"], days_ago=31)
    with database(db) as conn, campaignapi.transaction(conn):
        answer = campaignapi.apply_bounce(conn, {"type": "complaint", "email": "shared@example.net"})
    assert answer["type"] == "complaint"
    with database(db) as conn:
        rows = [tuple(r) for r in conn.execute(
            "SELECT account, email, reason, campaign FROM suppression ORDER BY account")]
    assert rows == [(seeded["account"], "shared@example.net", "complained", seeded["campaign"])
                    for seeded in recent]
    assert [(e["batch"], e["outbox"]) for e in events(db, "complaint")] == [
        (seeded["batch"], seeded["outbox"][0]) for seeded in recent]


def test_json_bounce_of_a_campaign_counts_in_its_latest_batch(api, db, seed_campaign):
    seeded = seed_campaign([("reader@example.net", "R")])
    mark_sent(db, seeded["outbox"])
    answer = api.post("/bounce", email="reader@example.net", type="hard",
                      campaign=str(seeded["campaign"]))["bounce"]
    assert (answer["campaign"], answer["batch"]) == (str(seeded["campaign"]),
                                                     str(seeded["batch"]))
    assert api.post("/bounce", status=404, email="reader@example.net", type="hard",
                    campaign=999)["error"] == "not_found"


# --- bad input: the contract's errors, nothing changed ------------------------------------

@pytest.mark.parametrize("params, code, field", [
    ({"type": "hard"}, "missing_parameter", ["email"]),
    ({"email": "a@example.com"}, "missing_parameter", ["type"]),
    ({"email": "a@example.com", "type": "none"}, "invalid_parameter", "type"),
    ({"email": "not an address", "type": "hard"}, "invalid_parameter", "email"),
    ({"email": "", "type": "hard"}, "invalid_parameter", "email"),
    ({"email": "a@example.com", "type": "hard", "campaign": "x"}, "invalid_parameter", "campaign"),
    ({"email": "a@example.com", "type": "hard", "extra": 1}, "unknown_parameter", ["extra"]),
])
def test_bad_json_is_refused_and_changes_nothing(client, auth, db, params, code, field):
    before = snapshot(db)
    data = assert_error(send(client, "POST", "/v1/bounce", auth, params), 400, code)
    assert data["field"] == field
    assert snapshot(db) == before


def test_the_json_form_also_takes_the_query_string(api, client, auth, db):
    response = send(client, "POST", "/v1/bounce?email=q@example.net&type=complaint", auth)
    assert assert_envelope(response, True, 200)["bounce"]["type"] == "complaint"


def test_raw_bodies_that_cannot_be_taken(client, auth, db):
    before = snapshot(db)
    assert_error(client.post("/v1/bounce", b"", headers={**auth, **RAW}, expect_errors=True),
                 400, "missing_parameter")
    assert_error(client.post("/v1/bounce?type=hard", b"From: x\n\nhi", headers={**auth, **RAW},
                             expect_errors=True), 400, "invalid_parameter")
    assert_error(send(client, "POST", "/v1/bounce", auth, b"hello", content_type="text/plain"),
                 415, "unsupported_media_type")
    ten_mb = b"\xff garbage \x00" * (1024 * 1024)
    assert_error(client.post("/v1/bounce", ten_mb, headers={**auth, **RAW}, expect_errors=True),
                 413, "payload_too_large")
    assert snapshot(db) == before


def test_ten_megabytes_of_garbage_over_real_http_get_the_envelope(app, auth, live_server):
    """waitress buffers the body (up to serve's --max-body) before the app
    runs; the app then refuses it from its length, with the envelope."""
    garbage = bytes(range(256)) * (10 * 1024 * 1024 // 256)
    for path, headers, expected in (("/v1/bounce", {**auth, **RAW}, 413),
                                    ("/v1/bounce/ses", {"Content-Type": "application/json"}, 404)):
        status, answer_headers, body = http(live_server + path, "POST", garbage, headers)
        assert status == expected
        assert answer_headers["Content-Type"] == "application/json"
        assert json.loads(body)["success"] is False


def test_a_message_that_is_no_bounce_answers_none_and_changes_nothing(client, auth, db):
    before = snapshot(db)
    answer = post_raw(client, auth, b"From: Ann <ann@example.org>\nSubject: hi\n\nThanks!\n")
    assert answer["bounce"] == {"type": "none", "email": None, "campaign": None, "batch": None}
    assert snapshot(db) == before


# --- provider routes --------------------------------------------------------------------

SENDGRID_KEY_SETTING = SENDGRID_PUBLIC


@pytest.fixture
def sns(tmp_path):
    stand_in = Sns(tmp_path)
    with stand_in.server:
        yield stand_in


@pytest.fixture
def providers(db, sns):
    """An app with every provider route on; SNS certificates from the local stand-in."""
    app = campaignapi.create_app(db, mailgun_signing_key=MAILGUN_KEY,
                                 postmark_credentials=CREDENTIALS,
                                 sendgrid_public_key=SENDGRID_KEY_SETTING, ses_topic_arns=[TOPIC])
    service = app.config["campaignapi.service"]
    service.sns_fetch, service.sns_cert_host = sns.fetch, sns.pattern
    return webtest.TestApp(app)


def provider_calls(sns):
    """(path, body, headers, addresses it reports, kind) of a genuine call of each provider."""
    body, signature, timestamp = sendgrid([{"email": "sg@example.net", "event": "spamreport",
                                            "timestamp": 1513299569}])
    return [
        ("/v1/bounce/ses", json.dumps(sns.message(SES_BOUNCE)).encode(), {},
         ["jane@example.com", "richard@example.com"], "bounced"),
        ("/v1/bounce/mailgun", json.dumps(mailgun(MAILGUN_FAILED)).encode(), {},
         ["alice@example.com"], "bounced"),
        ("/v1/bounce/postmark", json.dumps(POSTMARK_BOUNCE).encode(), {"Authorization": AUTH},
         ["john@example.com"], "bounced"),
        ("/v1/bounce/sendgrid", body, {"X-Twilio-Email-Event-Webhook-Signature": signature,
                                       "X-Twilio-Email-Event-Webhook-Timestamp": timestamp},
         ["sg@example.net"], "complained"),
    ]


def test_signed_provider_calls_apply_to_the_accounts_that_mailed_the_address(
        providers, sns, seed_campaign, db):
    for path, body, headers, addresses, reason in provider_calls(sns):
        seeded = seed_campaign([(address, "X") for address in addresses])
        mark_sent(db, seeded["outbox"])
        response = providers.post(path, body, headers={**headers,
                                                       "Content-Type": "application/json"})
        assert assert_envelope(response, True, 200) == {"received": str(len(addresses))}, path
        for address in addresses:
            assert status_of(db, address) == [reason], (path, address)


def forged(path, body, headers):
    """The call with its authentication broken the provider's way."""
    if path.endswith("postmark"):
        return body, {"Authorization": "Basic " + base64.b64encode(b"postmark:wrong").decode()}
    if path.endswith("sendgrid"):
        return body.replace(b"sg@", b"sh@"), headers
    document = json.loads(body)
    if path.endswith("ses"):
        document["Message"] = document["Message"].replace("jane@", "joan@")
    else:   # Mailgun signs its timestamp and token, not the event
        document["signature"]["token"] = "0" * 50
    return json.dumps(document).encode(), headers


def test_forged_provider_calls_are_401_and_change_nothing(providers, sns, db, seed_campaign):
    seed_campaign([("jane@example.com", "J"), ("alice@example.com", "A")])
    before = snapshot(db)
    for path, body, headers, _, _ in provider_calls(sns):
        body, headers = forged(path, body, headers)
        response = providers.post(path, body, headers={**headers, "Content-Type": "application/json"},
                                  expect_errors=True)
        assert_error(response, 401, "unauthorized")
        unsigned = providers.post(path, body, headers={"Content-Type": "application/json"},
                                  expect_errors=True)
        assert_error(unsigned, 401, "unauthorized")
    assert snapshot(db) == before


def test_malformed_provider_calls_are_400(providers, sns, db):
    before = snapshot(db)
    body, signature, timestamp = sendgrid({"not": "a list"})
    sendgrid_headers = {"X-Twilio-Email-Event-Webhook-Signature": signature,
                        "X-Twilio-Email-Event-Webhook-Timestamp": timestamp}
    for path, raw, headers, code in [
        ("/v1/bounce/postmark", b"{not json", {"Authorization": AUTH}, "invalid_json"),
        ("/v1/bounce/postmark", b'{"RecordType": "Bounce", "Type": "HardBounce"}',
         {"Authorization": AUTH}, "invalid_parameter"),
        ("/v1/bounce/sendgrid", body, sendgrid_headers, "invalid_parameter"),
        ("/v1/bounce/mailgun", json.dumps({**mailgun(MAILGUN_FAILED), "event-data": []}).encode(),
         {}, "invalid_parameter"),
        ("/v1/bounce/ses", b"[]", {}, "invalid_parameter"),
    ]:
        response = providers.post(path, raw, headers={**headers, "Content-Type": "application/json"},
                                  expect_errors=True)
        assert_error(response, 400, code)
    assert snapshot(db) == before


@pytest.mark.parametrize("path", ["/v1/bounce/ses", "/v1/bounce/mailgun", "/v1/bounce/postmark",
                                  "/v1/bounce/sendgrid"])
def test_a_provider_route_without_its_setting_is_404(client, path):
    assert_error(client.post(path, b"{}", headers={"Content-Type": "application/json"},
                             expect_errors=True), 404, "not_found")


def test_the_sns_certificate_comes_only_from_amazon_by_default(db, sns):
    client = webtest.TestApp(campaignapi.create_app(db, ses_topic_arns=TOPIC))
    response = client.post("/v1/bounce/ses", json.dumps(sns.message(SES_BOUNCE)),
                           headers={"Content-Type": "application/json"}, expect_errors=True)
    assert_error(response, 401, "unauthorized")
    assert "not an https URL of Amazon SNS" in response.json["data"]["message"]
    assert not sns.fetched(".pem")


@pytest.mark.parametrize("setting", [
    {"sendgrid_public_key": "not a key"}, {"ses_topic_arns": ["not-an-arn"]},
    {"postmark_credentials": "no-colon"}, {"bounce_domain": "not a domain"}])
def test_bad_settings_fail_at_create_app(db, setting):
    with pytest.raises(ValueError):
        campaignapi.create_app(db, **setting)


# --- fuzzing: any bytes to every bounce route give an answer, never a 5xx -----------------

FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
PATHS = ["/v1/bounce", "/v1/bounce/ses", "/v1/bounce/mailgun", "/v1/bounce/postmark",
         "/v1/bounce/sendgrid"]


@FUZZ
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=2000) | st.sampled_from(
    [(CORPUS / name).read_bytes() for name in sorted(EXPECTED)]),
       content_type=st.sampled_from(["message/rfc822", "application/json", "text/plain", ""]))
def test_any_bytes_to_any_bounce_route_are_answered_without_a_5xx(providers, auth, path, body,
                                                                  content_type):
    headers = {**auth, **({"Content-Type": content_type} if content_type else {}),
               "Authorization": auth["Authorization"] if path == "/v1/bounce" else AUTH}
    response = providers.post(path, body, headers=headers, expect_errors=True)
    assert response.status_int < 500, response.text
    assert_envelope(response, response.status_int == 200, response.status_int)
