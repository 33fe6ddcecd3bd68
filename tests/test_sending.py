"""Send, process_due, batch archives and archives (README: Sending)."""


import pytest

import campaignapi
from helpers import HTML, TEXT, import_csv, make_campaign


@pytest.fixture
def build(api):
    """Build a sendable campaign: ``build(csv, segments=[...])`` -> ids."""

    def make(csv_text="email,first\nann@example.com,Ann\nbob@example.com,Bob\n",
             archiveemail=None, extra_datasource_csv=None):
        ds = api.put("/datasource/0", name="customers")["id"]
        import_csv(api, ds, csv_text, name="list", originalfile="list.csv")
        datasources = [int(ds)]
        if extra_datasource_csv:
            ds2 = api.put("/datasource/0", name="more")["id"]
            import_csv(api, ds2, extra_datasource_csv, name="list", originalfile="list.csv")
            datasources.append(int(ds2))
        params = {"archiveemail": archiveemail} if archiveemail else {}
        return {"datasources": datasources, **make_campaign(api, datasources, **params)}

    return make


def outbox(db, kind="campaign"):
    conn = campaignapi.connect(db)
    try:
        return conn.execute("SELECT * FROM outbox WHERE kind = ? ORDER BY id", (kind,)).fetchall()
    finally:
        conn.close()


def campaign_record(api, campaign):
    return api.get(f"/campaign/{campaign}")["emt_campaign"][0]


def test_send_now_queues_one_email_per_address(api, db, build):
    ids = build("email,first\nann@example.com,Ann\nbob@example.com,Bob\nANN@Example.com,Ann2\n")
    batch = api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2000-01-01 00:00:00")["id"]
    assert campaign_record(api, ids["campaign"])["scheduled"] == "1"
    assert campaignapi.process_due(db) == 1
    rows = outbox(db)
    assert sorted(r["to_addr"].lower() for r in rows) == ["ann@example.com", "bob@example.com"]
    assert all(r["batch"] == int(batch) and r["body"] is None for r in rows)
    assert campaign_record(api, ids["campaign"])["scheduled"] == "0"
    record = api.get(f"/campaign/{ids['campaign']}/batcharchive/{batch}")["batcharchive"]
    assert record["status"] == "sending"
    assert record["recipients"] == "2" and record["queued"] == "2"
    assert record["messages"][0]["subject"] == "Hello {{first}}"
    # A second run queues nothing more.
    assert campaignapi.process_due(db) == 0
    assert len(outbox(db)) == 2


def test_address_in_two_datasources_gets_one_email(api, db, build):
    ids = build("email,first\nann@example.com,Ann\n",
                extra_datasource_csv="email,first\nAnn@EXAMPLE.com,Annie\ncid@example.com,Cid\n")
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)
    campaignapi.process_due(db)
    assert sorted(r["to_addr"].lower() for r in outbox(db)) == ["ann@example.com",
                                                                 "cid@example.com"]


def test_segments_in_priority_order_first_one_wins(api, db, build):
    ids = build("email,first\nann@example.com,Ann\nbob@example.com,Bob\n")
    vip = api.put("/segment/0", name="vip", datasources=ids["datasources"],
                  conditions=[{"field": "first", "op": "eq", "value": "Ann"}])["id"]
    special = api.put("/message/0", name="VIP", subject="For you {{first}}", html=HTML,
                      text=TEXT)["id"]
    links = api.get(f"/campaign/{ids['campaign']}/message/all")["message"]
    # The general link goes last, the VIP link first.
    api.post(f"/campaign/{ids['campaign']}/message/{links[0]['id']}",
             segmentmessageid=int(links[0]["id"]), priority=10)
    api.put(f"/campaign/{ids['campaign']}/message/0", segment=int(vip), message=int(special),
            priority=1)
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)
    campaignapi.process_due(db)
    sent = {r["to_addr"]: r["message"] for r in outbox(db)}
    assert sent == {"ann@example.com": int(special), "bob@example.com": int(ids["message"])}


def test_suppressed_addresses_are_skipped(api, db, build):
    ids = build("email,first\nann@example.com,Ann\nbob@example.com,Bob\ncid@example.com,Cid\n")
    conn = campaignapi.connect(db)
    conn.execute("UPDATE recipient SET status = 'bounced' WHERE email = 'bob@example.com'")
    conn.execute("INSERT INTO suppression (account, email, reason) SELECT owner, "
                 "'CID@example.com', 'unsubscribed' FROM campaign")
    conn.close()
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)
    campaignapi.process_due(db)
    assert [r["to_addr"] for r in outbox(db)] == ["ann@example.com"]


def test_rerun_after_a_lost_status_update_queues_nobody_twice(api, db, build):
    ids = build()
    batch = api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)["id"]
    campaignapi.process_due(db)
    conn = campaignapi.connect(db)
    # As if the worker had crashed after queueing but before the batch moved on.
    conn.execute("UPDATE batch SET status = 'scheduled' WHERE id = ?", (batch,))
    conn.close()
    campaignapi.process_due(db)
    assert len(outbox(db)) == 2


def test_future_send_waits_and_cancelled_send_never_goes(api, db, build):
    ids = build()
    api.put(f"/campaign/{ids['campaign']}/send/0", timestamp="2099-01-01T12:00:00+01:00")
    assert campaign_record(api, ids["campaign"])["scheduled"] == "1"
    assert campaignapi.process_due(db) == 0
    assert outbox(db) == []
    assert campaignapi.process_due(db, now="2099-01-01 11:00:00") == 1
    assert len(outbox(db)) == 2

    ids = build()
    batch = api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=4102444800)["id"]
    api.post(f"/campaign/{ids['campaign']}", scheduled="0")
    assert campaign_record(api, ids["campaign"])["scheduled"] == "0"
    assert campaignapi.process_due(db, now="2100-01-02 00:00:00") == 0
    record = api.get(f"/campaign/{ids['campaign']}/batcharchive/{batch}")["batcharchive"]
    assert record["status"] == "cancelled" and record["queued"] == "0"


def test_campaign_disabled_or_deleted_before_due_sends_nothing(api, db, build):
    first, second = build(), build()
    api.put(f"/campaign/{first['campaign']}/send/0", timestamp="2099-01-01 00:00:00")
    api.put(f"/campaign/{second['campaign']}/send/0", timestamp="2099-01-01 00:00:00")
    api.post(f"/campaign/{first['campaign']}", enabled="0")
    api.delete(f"/campaign/{second['campaign']}")
    campaignapi.process_due(db, now="2099-01-02 00:00:00")
    assert outbox(db) == []


def test_send_refused_when_verify_fails(api, db):
    campaign = api.put("/campaign/0", name="Empty", accountprofile=99)["id"]
    data = api.put(f"/campaign/{campaign}/send/0", status=409, timestamp=0)
    assert data["error"] == "verification_failed"
    assert any(check["passed"] == "0" for check in data["checks"])
    assert "sender" in data["message"].lower() or "profile" in data["message"].lower()
    conn = campaignapi.connect(db)
    assert conn.execute("SELECT count(*) FROM batch").fetchone()[0] == 0
    conn.close()


@pytest.mark.parametrize("timestamp", ["tomorrow", "2024-13-01 00:00:00", [], -5, "1.5"])
def test_bad_timestamp_is_400(api, build, timestamp):
    ids = build()
    data = api.put(f"/campaign/{ids['campaign']}/send/0", status=400, timestamp=timestamp)
    assert data["error"] == "invalid_parameter"


def test_send_needs_the_timestamp(api, build):
    ids = build()
    assert api.put(f"/campaign/{ids['campaign']}/send/0", status=400)["error"] == \
        "missing_parameter"


def test_archive_copy_and_archive_record(api, db, build):
    ids = build(archiveemail="archive@shop.example")
    batch = api.put(f"/campaign/{ids['campaign']}/send/0", timestamp=0)["id"]
    campaignapi.process_due(db)
    copies = outbox(db, kind="archive")
    assert [c["to_addr"] for c in copies] == ["archive@shop.example"]
    assert "Hello" in copies[0]["subject"] and "unsubscribe" in copies[0]["html"]
    archive = api.get(f"/campaign/{ids['campaign']}/archive/{ids['campaign']}")["archive"]
    assert archive["campaign"] == ids["campaign"]
    assert [b["id"] for b in archive["batches"]] == [batch]
    assert archive["sent"] == "0" and archive["failed"] == "0"
    # Delivery results show up in the counts.
    conn = campaignapi.connect(db)
    conn.execute("UPDATE outbox SET status = 'sent' WHERE kind = 'campaign' AND to_addr LIKE 'ann%'")
    conn.execute("UPDATE outbox SET status = 'failed' WHERE kind = 'campaign' AND to_addr LIKE 'bob%'")
    conn.close()
    campaignapi.process_due(db)
    record = api.get(f"/campaign/{ids['campaign']}/batcharchive/{batch}")["batcharchive"]
    assert (record["status"], record["sent"], record["failed"]) == ("sent", "1", "1")
    listing = api.get(f"/campaign/{ids['campaign']}/batcharchive/all")
    assert listing["total"] == "1"
    api.get(f"/campaign/{ids['campaign']}/archive/12345", status=404)


def test_foreign_campaign_is_404_for_send_and_archives(api, stranger_api, build):
    ids = build()
    stranger_api.put(f"/campaign/{ids['campaign']}/send/0", status=404, timestamp=0)
    stranger_api.get(f"/campaign/{ids['campaign']}/batcharchive/all", status=404)
    stranger_api.get(f"/campaign/{ids['campaign']}/archive/0", status=404)
