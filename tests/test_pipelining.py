"""Delivery to a relay that offers PIPELINING: MAIL, RCPT and DATA go in one
write, and every kind of refusal is still read and recorded right."""

import smtplib

import pytest

import campaignapi
from smtp_sink import PipeliningSink


@pytest.fixture
def sink():
    sink = PipeliningSink().start()
    yield sink
    sink.stop()


def statuses(db):
    conn = campaignapi.connect(db)
    try:
        return [(r["to_addr"], r["status"], (r["error"] or "")[:3])
                for r in conn.execute("SELECT * FROM outbox ORDER BY id")]
    finally:
        conn.close()


def test_the_commands_of_an_email_go_in_one_write(sink):
    writes = []
    smtp = smtplib.SMTP(*campaignapi.smtp_address(sink.address))
    smtp.ehlo()
    send = smtp.send
    smtp.send = lambda data: (writes.append(data), send(data))
    assert campaignapi._transact(smtp, "a@example.com", "b@example.com",
                                 b"Subject: x\r\n\r\nhi\r\n") is None
    assert writes == ["MAIL FROM:<a@example.com>\r\nRCPT TO:<b@example.com>\r\nDATA\r\n",
                      b"Subject: x\r\n\r\nhi\r\n.\r\n"]
    smtp.quit()
    assert sink.count() == 1


def test_refusals_retries_bounces_and_421_over_a_pipelining_relay(db, sink, seed_campaign):
    seed_campaign([("busy@example.org", "B"), ("gone@example.org", "G"),
                   ("spam@example.org", "S"), ("closing@example.org", "C"),
                   ("ok@example.org", "O")])
    sink.replies["busy@example.org"] = ["451 4.3.0 try later"]
    sink.always["gone@example.org"] = "550 5.1.1 no such user"
    sink.after_data["spam@example.org"] = "554 5.7.1 looks like spam"
    sink.replies["closing@example.org"] = ["421 4.3.2 shutting down"]
    counts = campaignapi.deliver(db, sink.address)
    assert (counts["sent"], counts["retried"], counts["failed"], counts["bounced"]) == (1, 2, 2, 1)
    assert statuses(db) == [
        ("busy@example.org", "queued", "451"), ("gone@example.org", "failed", "550"),
        ("spam@example.org", "failed", "554"), ("closing@example.org", "queued", "421"),
        ("ok@example.org", "sent", "")]
    assert list(sink.parsed()) == ["ok@example.org"]
