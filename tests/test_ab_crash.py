"""A/B tests across crashes and several workers (API.md section 18): every
recipient of a tested batch gets exactly one version, once, when a worker
process is killed with SIGKILL during the test and again during the sending
of the winner, and when two workers run through the whole batch together.
Real worker processes, a real SMTP sink, both engines."""

import collections
import re
import signal
import time

import pytest

import campaignapi
from helpers import (bulk_recipients, database, make_datasource, scalar, start_worker,
                     stop_process, wait_for)

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

PEOPLE = 600
HTML = "<p>Hi</p><p><a href='https://shop.example/a'>Shop</a> <a href='{{unsubscribe_url}}'>u</a></p>"


def ab_batch(api, db):
    """A tracked campaign testing two subjects on half of PEOPLE recipients,
    sent now; (batch id, {message id: subject})."""
    ds = make_datasource(api)
    bulk_recipients(db, ds, PEOPLE)
    profile = api.put("/accountprofile/0", name="Shop", fromaddress="news@shop.example")["id"]
    subjects = {}
    for subject in ("Version A", "Version B"):
        subjects[int(api.put("/message/0", name=subject, subject=subject, html=HTML,
                             text="Hi {{unsubscribe_url}}")["id"])] = subject
    segment = api.put("/segment/0", name="all", datasources=[ds])["id"]
    campaign = api.put("/campaign/0", name="Crash", accountprofile=int(profile), tracking="1",
                       testsize="50", testwait="60")["id"]
    a, b = subjects
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=a, variants=[b])
    batch = int(api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")["id"])
    return batch, subjects


def count(db, where, *args):
    return scalar(db, f"SELECT count(*) FROM outbox WHERE kind = 'campaign' AND {where}", *args)


def choose_now(db, batch):
    """The test's minute is over (the test moves the choice's due time)."""
    with database(db) as conn, campaignapi.transaction(conn):
        conn.execute("UPDATE batch_test SET due = '2000-01-01 00:00:00' WHERE batch = ?", (batch,))


def kill_while_sending(db, worker, sink, at_least):
    """SIGKILL ``worker`` once the sink has ``at_least`` emails and the worker
    holds claims (emails it is sending)."""
    wait_for(lambda: sink.count() >= at_least and count(
        db, "status = 'sending' AND claimed_by LIKE ?", f"%:{worker.pid}") > 0,
        timeout=120, what="the worker to be sending", interval=0.005)
    worker.send_signal(signal.SIGKILL)
    worker.wait(30)


def check_one_version_each(db, sink, batch, subjects, kills):
    """Every recipient got one email, of the version its outbox row names,
    none twice; at most one failed (in flight) per kill."""
    received = collections.defaultdict(list)
    for _, rcpts, raw in list(sink.messages):
        subject = re.search(rb"^Subject: (.*?)\r?$", raw, re.M)[1].decode()
        received[rcpts[0]].append(subject)
    twice = {address: got for address, got in received.items() if len(got) > 1}
    assert not twice, list(twice.items())[:5]
    with database(db) as conn:
        emails = {row[0]: (row[1], row[2]) for row in conn.execute(
            "SELECT to_addr, status, message FROM outbox WHERE batch = ?", (batch,))}
    assert len(emails) == PEOPLE
    failed = [address for address, (status, _) in emails.items() if status == "failed"]
    assert len(failed) <= kills, failed
    assert {status for status, _ in emails.values()} <= {"sent", "failed"}
    for address, (status, message) in emails.items():
        if status == "sent":
            assert received[address] == [subjects[message]], (address, received.get(address))
    assert len(received) >= PEOPLE - len(failed)
    return collections.Counter(subjects[message] for _, message in emails.values())


def test_a_worker_killed_during_the_test_and_during_the_winner(api, db, smtp_sink):
    batch, subjects = ab_batch(api, db)
    workers = [start_worker(db, smtp_sink.address, "--rate", "300")]
    try:
        # During the test: the batch is made (one transaction), half of it
        # goes out in two versions, and the worker dies mid-delivery.
        kill_while_sending(db, workers[-1], smtp_sink, 60)
        assert scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "testing"
        assert count(db, "status = 'waiting'") == PEOPLE // 2
        workers.append(start_worker(db, smtp_sink.address, "--rate", "300"))
        # Its claims come back after the stale time (30 s); the test finishes.
        wait_for(lambda: count(db, "status IN ('queued', 'sending')") == 0, timeout=120,
                 what="the test to be delivered", interval=0.2)
        tested = smtp_sink.count()
        assert tested >= PEOPLE // 2 - 1 and count(db, "status = 'waiting'") == PEOPLE // 2
        # The choice, then a kill while the winner goes to the rest.
        choose_now(db, batch)
        kill_while_sending(db, workers[-1], smtp_sink, tested + 60)
        assert scalar(db, "SELECT decided FROM batch_test WHERE batch = ?", batch) == "auto"
        workers.append(start_worker(db, smtp_sink.address, "--rate", "300"))
        wait_for(lambda: scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "sent",
                 timeout=120, what="the batch to be sent", interval=0.2)
        versions = check_one_version_each(db, smtp_sink, batch, subjects, kills=2)
        # No opens: a tie, so the first version went to the rest.
        assert versions == {"Version A": PEOPLE // 4 + PEOPLE // 2, "Version B": PEOPLE // 4}
        output = stop_process(workers[-1])
        assert "Traceback" not in output, output[-3000:]
    finally:
        for worker in workers:
            stop_process(worker)


def test_two_workers_through_a_whole_test(api, db, smtp_sink):
    batch, subjects = ab_batch(api, db)
    workers = [start_worker(db, smtp_sink.address) for _ in range(2)]
    try:
        wait_for(lambda: scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "testing"
                 and count(db, "status IN ('queued', 'sending')") == 0, timeout=120,
                 what="the test to be delivered", interval=0.1)
        assert smtp_sink.count() == PEOPLE // 2
        choose_now(db, batch)
        wait_for(lambda: scalar(db, "SELECT status FROM batch WHERE id = ?", batch) == "sent",
                 timeout=120, what="the batch to be sent", interval=0.1)
        versions = check_one_version_each(db, smtp_sink, batch, subjects, kills=0)
        assert sum(versions.values()) == PEOPLE and smtp_sink.count() == PEOPLE
        assert scalar(db, "SELECT count(*) FROM batch_test WHERE decided = 'auto'") == 1
        for worker in workers:
            output = stop_process(worker)
            assert "Traceback" not in output and "deadlock" not in output, output[-3000:]
    finally:
        for worker in workers:
            stop_process(worker)
