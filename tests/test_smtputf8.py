"""Addresses with non-ASCII characters: sent with SMTPUTF8 (RFC 6531) when
the relay offers it, else failed one by one with a clear error that the
batch counts; verify warns about them beforehand."""

import email
import email.policy

import pytest

import campaignapi
from helpers import database, import_csv, make_campaign, make_datasource
from smtp_sink import SmtpSink

WIDE = "jörg.müller@example.org"


@pytest.fixture
def campaign(api, db):
    ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
    import_csv(api, ds, f"email,first\nann@example.org,Ann\n{WIDE},Jörg\n")
    return make_campaign(api, [ds])["campaign"]


def send(api, db, campaign, relay):
    batch = api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")["id"]
    campaignapi.process_due(db)
    counts = campaignapi.deliver(db, relay.address)
    return counts, api.get(f"/campaign/{campaign}/batcharchive/{batch}")["batcharchive"]


def check(api, campaign, name):
    report = api.get(f"/campaign/{campaign}/verify/0")["verify"]
    return report["passed"], next(c for c in report["checks"] if c["check"] == name)


def test_verify_warns_and_still_passes(api, campaign):
    passed, found = check(api, campaign, "non_ascii_addresses")
    assert passed == "1" and found["passed"] == "1"
    assert found["message"].startswith("Warning: Segment 1 ('all') holds 1 address(es) with "
                                       f"non-ASCII characters (such as {WIDE}).")
    assert "SMTPUTF8" in found["message"]


def test_verify_says_nothing_of_ascii_segments(api):
    ds = make_datasource(api)
    import_csv(api, ds, "email\nann@example.org\n")
    _, found = check(api, make_campaign(api, [ds])["campaign"], "non_ascii_addresses")
    assert found == {"check": "non_ascii_addresses", "passed": "1",
                     "message": "No segment holds an address with non-ASCII characters."}


def test_a_relay_with_smtputf8_gets_them(api, db, campaign):
    relay = SmtpSink(enable_SMTPUTF8=True).start()
    try:
        counts, batch = send(api, db, campaign, relay)
    finally:
        relay.stop()
    assert (counts["sent"], counts["failed"]) == (3, 0)   # and the import's notification
    assert (batch["sent"], batch["failed"]) == ("2", "0")
    received = {rcpts[0]: raw for _, rcpts, raw in relay.messages}
    assert set(received) == {"ann@example.org", WIDE, "owner@example.com"}
    assert received["ann@example.org"].isascii()    # ASCII ones are sent as before
    message = email.message_from_bytes(received[WIDE], policy=email.policy.default)
    assert message["To"] == WIDE
    assert "Hi Jörg" in message.get_body(("plain",)).get_content()


def test_a_relay_without_smtputf8_fails_them_one_by_one(api, db, campaign):
    relay = SmtpSink(enable_SMTPUTF8=False).start()      # aiosmtpd offers it by default
    try:
        counts, batch = send(api, db, campaign, relay)
    finally:
        relay.stop()
    assert (counts["sent"], counts["failed"]) == (2, 1)   # and the import's notification
    assert (batch["sent"], batch["failed"], batch["queued"]) == ("1", "1", "2")
    assert [rcpts for _, rcpts, _ in relay.messages if rcpts != ["owner@example.com"]] == [
        ["ann@example.org"]]
    with database(db) as conn:
        status, error = conn.execute("SELECT status, error FROM outbox WHERE to_addr = ?",
                                     (WIDE,)).fetchone()
    assert status == "failed"
    assert error == ("the address has non-ASCII characters, and the SMTP relay does not offer "
                     "SMTPUTF8 to carry them")
