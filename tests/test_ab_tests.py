"""A/B tests (API.md section 18): variants on campaign messages, the
campaign's test settings, batches that test a share and send the winner to
the rest, by the worker or by hand, the test in the batch archive and on the
archive page, verify's checks.  Over a real database and a real SMTP sink;
the opens are real requests to the open route."""

import collections
import urllib.parse

import pytest

import campaignapi
from conftest import Api
from helpers import (bulk_recipients, database, import_csv, make_datasource, open_url_in, scalar,
                     snapshot)

HTML = "<p>Hi</p><p><a href='https://shop.example/a'>Shop</a> <a href='{{unsubscribe_url}}'>u</a></p>"
TEXT = "Hi\nUnsubscribe: {{unsubscribe_url}}"


def message(api, subject, **params):
    return int(api.put("/message/0", name=subject, subject=subject, html=HTML, text=TEXT,
                       **params)["id"])


def ab_campaign(api, db, people=100, variants=1, **settings):
    """A tracked campaign whose one link tests ``variants`` other messages on
    ``people`` recipients (r1@bulk.example ...); its ids."""
    ds = make_datasource(api)
    bulk_recipients(db, ds, people)
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    versions = [message(api, f"Subject {chr(65 + index)}") for index in range(variants + 1)]
    segment = int(api.put("/segment/0", name="all", datasources=[ds])["id"])
    campaign = int(api.put("/campaign/0", name="Test", accountprofile=int(profile),
                           tracking="1", **settings)["id"])
    link = int(api.put(f"/campaign/{campaign}/message/0", segment=segment,
                       message=versions[0], variants=versions[1:])["id"])
    return {"datasource": ds, "campaign": campaign, "versions": versions, "link": link,
            "segment": segment}


def send(api, ids):
    return int(api.put(f"/campaign/{ids['campaign']}/send/0",
                       timestamp="2000-01-01 00:00:00")["id"])


def rows(db, batch):
    """{to_addr: (status, message)} of the batch's emails."""
    with database(db) as conn:
        return {row[0]: (row[1], row[2]) for row in conn.execute(
            "SELECT to_addr, status, message FROM outbox WHERE batch = ?", (batch,))}


def time_passes(db, batch):
    """The test's wait is over (testwait is at least a minute: the test moves
    the choice's due time instead of waiting for it)."""
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE batch_test SET due = '2000-01-01 00:00:00' WHERE batch = ?", (batch,))


def batch_record(api, ids, batch):
    return api.get(f"/campaign/{ids['campaign']}/batcharchive/{batch}")["batcharchive"]


def open_path(raw_email):
    text = raw_email.decode("utf-8", "replace").replace("=\r\n", "").replace("=3D", "=")
    return urllib.parse.urlsplit(open_url_in(text)).path


# --- the settings and the variants ---------------------------------------------------------

def test_campaign_test_settings_default_and_range(api, db):
    profile = api.put("/accountprofile/0", name="p", fromaddress="a@example.com")["id"]
    campaign = api.put("/campaign/0", name="c", accountprofile=int(profile))["id"]
    record = api.get(f"/campaign/{campaign}")["emt_campaign"][0]
    assert (record["testsize"], record["testmetric"], record["testwait"]) == ("20", "opens", "14400")
    before = snapshot(db)
    for name, value in (("testsize", 9), ("testsize", "51"), ("testwait", 59),
                        ("testwait", 604801), ("testmetric", "views"), ("testsize", "x")):
        error = api.post(f"/campaign/{campaign}", status=400, **{name: value})
        assert error["error"] == "invalid_parameter" and error["field"] == name, error
    assert snapshot(db) == before
    api.post(f"/campaign/{campaign}", testsize="50", testmetric="clicks", testwait=60)
    record = api.get(f"/campaign/{campaign}")["emt_campaign"][0]
    assert (record["testsize"], record["testmetric"], record["testwait"]) == ("50", "clicks", "60")
    made = api.put("/campaign/0", name="d", accountprofile=int(profile), testsize=10,
                   testwait="604800")["id"]
    assert api.get(f"/campaign/{made}")["emt_campaign"][0]["testwait"] == "604800"


def test_variants_are_other_messages_of_the_account(api, stranger_api, db):
    ids = ab_campaign(api, db, people=3)
    path = f"/campaign/{ids['campaign']}/message/{ids['link']}"
    record = api.get(path)["message"]
    assert record["variants"] == [str(ids["versions"][1])]
    more = [message(api, f"M{i}") for i in range(4)]
    theirs = int(stranger_api.put("/message/0", name="x", subject="x", html=HTML)["id"])
    before = snapshot(db)
    for variants, status in (([*more, ids["versions"][1]], 400), ([more[0], more[0]], 400),
                             ([ids["versions"][0]], 400), ([theirs], 404), ([999999], 404),
                             ("7", 400)):
        api.post(path, status=status, segmentmessageid=ids["link"], variants=variants)
    assert snapshot(db) == before
    api.post(path, segmentmessageid=ids["link"], variants=more)
    assert api.get(path)["message"]["variants"] == [str(m) for m in more]
    api.post(path, segmentmessageid=ids["link"], variants=[])
    assert api.get(path)["message"]["variants"] == []
    # A plain link lists no variants.
    assert api.get(f"/campaign/{ids['campaign']}/message/all")["message"][0]["variants"] == []


def test_verify_wants_tracking_and_checks_every_variant(api, db):
    ids = ab_campaign(api, db, people=3)
    campaign, variant = ids["campaign"], ids["versions"][1]

    def failing():
        report = api.get(f"/campaign/{campaign}/verify/0")["verify"]
        return {check["check"] for check in report["checks"] if check["passed"] == "0"}

    assert failing() == set()
    api.post(f"/campaign/{campaign}", tracking="0")
    assert failing() == {"variants"}
    api.post(f"/campaign/{campaign}", tracking="1")
    api.post(f"/message/{variant}", subject="", text="no link", html="")
    assert failing() == {"message_subject", "unsubscribe_link"}
    api.post(f"/message/{variant}", subject="B {{nosuchfield}}", text=TEXT)
    assert failing() == {"merge_tags"}
    api.delete(f"/message/{variant}")
    assert "links_in_use" in failing()
    # A version tested by one link and sent by another is refused.
    other = message(api, "Other")
    api.post(f"/campaign/{campaign}/message/{ids['link']}", segmentmessageid=ids["link"],
             variants=[other])
    second = api.put("/segment/0", name="again", datasources=[ids["datasource"]])["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(second), message=other)
    assert failing() == {"variants"}
    error = api.put(f"/campaign/{campaign}/send/0", status=409, timestamp="2000-01-01 00:00:00")
    assert error["error"] == "verification_failed"


# --- the split -------------------------------------------------------------------------------

def test_the_test_share_is_split_equally_and_the_rest_waits(api, db):
    ids = ab_campaign(api, db, people=1000, variants=2, testsize=30)
    batch = send(api, ids)
    campaignapi.process_due(db)
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "testing"
    emails = rows(db, batch)
    assert len(emails) == 1000
    queued = collections.Counter(m for status, m in emails.values() if status == "queued")
    assert queued == {version: 100 for version in ids["versions"]}
    waiting = [m for status, m in emails.values() if status == "waiting"]
    assert len(waiting) == 700 and set(waiting) == {ids["versions"][0]}
    # The share is spread over the list, not its first or last rows.
    tested = sorted(int(a[1:a.index("@")]) for a, (s, _) in emails.items() if s == "queued")
    assert tested[0] < 50 and tested[-1] > 950 and sum(1 for n in tested if n <= 500) in range(120, 181)
    record = batch_record(api, ids, batch)
    assert record["status"] == "testing" and record["recipients"] == "1000"
    test = record["tests"][0]
    assert test["link"] == str(ids["link"]) and test["test"]["winner"] == ""
    assert test["test"]["decided"] == "" and test["test"]["decidedat"] == ""
    assert [(v["message"], v["subject"], v["sent"], v["rate"]) for v in test["test"]["versions"]] \
        == [(str(m), f"Subject {c}", "0", "0.0000") for m, c in zip(ids["versions"], "ABC")]
    # A worker that makes the batch again (its first try rolled back by a
    # crash) makes the same split.
    with database(db) as conn, campaignapi.transaction(conn):
        for table in ("outbox", "batch_test", "batch_message", "batch_link"):
            conn.execute(f"DELETE FROM {table} WHERE batch = ?", (batch,))
        conn.execute("UPDATE batch SET status = 'scheduled' WHERE id = ?", (batch,))
    campaignapi.process_due(db)
    assert rows(db, batch) == emails


def test_priority_and_one_email_an_address_come_before_the_split(api, db):
    ids = ab_campaign(api, db, people=200)
    # r1@, r10@..r19@, r100@..r199@: 111 addresses in a segment sent first.
    first = api.put("/segment/0", name="r1", datasources=[ids["datasource"]],
                    conditions=[{"field": "email", "op": "startswith", "value": "r1"}])["id"]
    plain = message(api, "Plain")
    api.post(f"/campaign/{ids['campaign']}/message/{ids['link']}", segmentmessageid=ids["link"],
             priority=5)
    api.put(f"/campaign/{ids['campaign']}/message/0", segment=int(first), message=plain,
            priority=0)
    batch = send(api, ids)
    campaignapi.process_due(db)
    emails = rows(db, batch)
    assert len(emails) == 200
    assert {a for a, (_, m) in emails.items() if m == plain} == {
        f"r{n}@bulk.example" for n in range(1, 201) if str(n).startswith("1")}
    tested = [m for s, m in emails.values() if s == "queued" and m != plain]
    assert sorted(collections.Counter(tested).values()) == [9, 9]     # 20 % of 89, rounded


def test_a_segment_too_small_for_a_test_gets_the_first_version_at_once(api, db):
    ids = ab_campaign(api, db, people=2, variants=2)     # 20 % of 2 rounds to 0
    batch = send(api, ids)
    campaignapi.process_due(db)
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "sending"
    assert set(rows(db, batch).values()) == {("queued", ids["versions"][0])}
    test = batch_record(api, ids, batch)["tests"][0]["test"]
    assert test["winner"] == str(ids["versions"][0]) and test["decided"] == "auto"


# --- the choice ------------------------------------------------------------------------------

def deliver(db, sink):
    counts = campaignapi.deliver(db, sink.address)
    assert not counts["error"], counts
    return counts


def test_the_worker_picks_the_version_opened_most_and_sends_it_to_the_rest(
        api, db, client, smtp_sink):
    ids = ab_campaign(api, db, people=100, testwait=3600)
    a, b = ids["versions"]
    batch = send(api, ids)
    campaignapi.process_due(db)
    deliver(db, smtp_sink)
    assert smtp_sink.count() == 20
    by_version = collections.defaultdict(list)
    for _, rcpts, raw in smtp_sink.messages:
        by_version[b if b"Subject: Subject B" in raw else a].append(raw)
    assert {m: len(v) for m, v in by_version.items()} == {a: 10, b: 10}
    for raw in by_version[b][:3]:          # 3 of B's 10 open, one of them twice
        client.get(open_path(raw))
    client.get(open_path(by_version[b][0]))
    client.get(open_path(by_version[a][0]))
    # Not before its time.
    campaignapi.process_due(db)
    assert scalar(db, "SELECT count(*) FROM outbox WHERE status = 'waiting'") == 80
    time_passes(db, batch)
    campaignapi.process_due(db)
    record = batch_record(api, ids, batch)
    test = record["tests"][0]["test"]
    assert record["status"] == "sending"
    assert test["winner"] == str(b) and test["decided"] == "auto" and test["decidedat"]
    assert [(v["sent"], v["opened"], v["rate"]) for v in test["versions"]] == [
        ("10", "1", "0.1000"), ("10", "3", "0.3000")]
    deliver(db, smtp_sink)
    campaignapi.process_due(db)
    received = collections.Counter(rcpts[0] for _, rcpts, _ in smtp_sink.messages)
    assert len(received) == 100 and set(received.values()) == {1}
    assert sum(b"Subject: Subject B" in raw for _, _, raw in smtp_sink.messages) == 90
    record = batch_record(api, ids, batch)
    assert record["status"] == "sent" and record["sent"] == "100"
    # The figures stay as they were at the choice.
    assert record["tests"][0]["test"]["versions"][1]["sent"] == "10"
    page = client.get(f"/v1/campaign/{ids['campaign']}/archive/{ids['campaign']}",
                      headers={**api.headers, "Accept": "text/html"}).text
    assert "A/B tests" in page and "Subject B <strong>(winner)</strong>" in page
    assert "0.3000" in page and "chosen automatically" in page


def test_a_tie_goes_to_the_earlier_version_and_clicks_can_choose(api, db, smtp_sink):
    ids = ab_campaign(api, db, people=50, variants=1, testmetric="clicks")
    batch = send(api, ids)
    campaignapi.process_due(db)
    deliver(db, smtp_sink)
    time_passes(db, batch)
    campaignapi.process_due(db)
    assert batch_record(api, ids, batch)["tests"][0]["test"]["winner"] == str(ids["versions"][0])
    assert scalar(db, "SELECT count(*) FROM outbox WHERE batch = ? AND message = ?",
                  batch, ids["versions"][0]) == 45


def test_the_winner_by_hand(api, db, make_key, client, stranger_api, smtp_sink):
    ids = ab_campaign(api, db, people=40, variants=2)
    batch = send(api, ids)
    campaignapi.process_due(db)
    path = f"/campaign/{ids['campaign']}/winner/{batch}"
    c = ids["versions"][2]
    reader = make_key(levels=["read"])
    other = message(api, "Not a version")
    before = snapshot(db)
    Api(client, reader).post(path, status=403, link=ids["link"], message=c)
    stranger_api.post(path, status=404, link=ids["link"], message=c)
    api.post(path, status=404, link=ids["link"] + 1, message=c)
    api.post(path, status=400, link=ids["link"])
    api.post(f"/campaign/{ids['campaign']}/winner/{batch + 1}", status=404, link=ids["link"],
             message=c)
    assert api.post(path, status=409, link=ids["link"], message=other)["error"] == "conflict"
    assert snapshot(db) == before
    assert api.post(path, link=ids["link"], message=c) is True
    test = batch_record(api, ids, batch)["tests"][0]["test"]
    assert test["winner"] == str(c) and test["decided"] == "manual"
    assert api.post(path, status=409, link=ids["link"], message=c)["error"] == "conflict"
    time_passes(db, batch)
    campaignapi.process_due(db)     # the worker leaves the choice alone
    assert batch_record(api, ids, batch)["tests"][0]["test"]["decided"] == "manual"
    deliver(db, smtp_sink)
    received = collections.Counter(rcpts[0] for _, rcpts, _ in smtp_sink.messages)
    assert len(received) == 40 and set(received.values()) == {1}
    assert scalar(db, "SELECT count(*) FROM outbox WHERE batch = ? AND message = ?", batch, c) \
        == 40 - 8 + 2       # the rest (40 less a test of 8: 3, 3, 2), and C's 2


# --- who is not mailed later -----------------------------------------------------------------

def test_who_leaves_during_the_test_is_not_mailed_later(api, db, smtp_sink):
    ids = ab_campaign(api, db, people=30)
    batch = send(api, ids)
    campaignapi.process_due(db)
    deliver(db, smtp_sink)
    waiting = sorted(a for a, (s, _) in rows(db, batch).items() if s == "waiting")
    gone = waiting[:3]
    account = scalar(db, "SELECT owner FROM campaign")
    with database(db) as conn, campaignapi.transaction(conn):
        for address, reason in zip(gone, ("unsubscribed", "bounced", "complained")):
            campaignapi.suppress(conn, account, address, reason, ids["campaign"])
    time_passes(db, batch)
    campaignapi.process_due(db)
    deliver(db, smtp_sink)
    received = {rcpts[0] for _, rcpts, _ in smtp_sink.messages}
    assert len(received) == 27 and not received & set(gone)
    assert {rows(db, batch)[a][0] for a in gone} == {"skipped"}


def test_cancelling_a_testing_batch_cancels_the_rest(api, db, smtp_sink):
    ids = ab_campaign(api, db, people=30)
    batch = send(api, ids)
    campaignapi.process_due(db)
    api.post(f"/campaign/{ids['campaign']}", scheduled=0)
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "cancelled"
    deliver(db, smtp_sink)
    time_passes(db, batch)
    campaignapi.process_due(db)
    deliver(db, smtp_sink)
    assert smtp_sink.count() == 6     # the test's own emails, nobody else
    assert collections.Counter(s for s, _ in rows(db, batch).values()) == {"sent": 6,
                                                                           "skipped": 24}
    path = f"/campaign/{ids['campaign']}/winner/{batch}"
    api.post(path, status=409, link=ids["link"], message=ids["versions"][1])


def test_a_test_send_sends_every_version(api, db, smtp_sink):
    ids = ab_campaign(api, db, people=3, variants=2)
    api.put(f"/campaign/{ids['campaign']}/send/0", test=["me@example.com"])
    deliver(db, smtp_sink)
    subjects = sorted(raw.split(b"Subject: ")[1].split(b"\r\n")[0].decode()
                      for _, _, raw in smtp_sink.messages)
    assert subjects == ["[Test] Subject A", "[Test] Subject B", "[Test] Subject C"]
