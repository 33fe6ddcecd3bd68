"""Crash recovery: processes killed with SIGKILL at the worst moment lose nothing
and repeat nothing -- a worker killed while queueing a big batch, an import
killed mid-way, a delivery killed mid-chunk."""

import base64
import collections
import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import campaignapi
from conftest import Api
from helpers import build_world, bulk_recipients, scalar, spelled, wait_for

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(code, *args):
    """A Python child process running ``code`` with this checkout's module."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when(process, ready, timeout=60):
    """SIGKILL ``process`` as soon as ``ready()`` holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if ready():
            process.send_signal(signal.SIGKILL)
            process.wait(30)
            return True
        time.sleep(0.002)
    process.kill()
    raise AssertionError("the child never reached the point to kill it at")


def wal_size(db):
    """How much the database has written: SQLite's WAL, or on PostgreSQL the
    database's size (uncommitted rows take room too)."""
    if db.startswith("postgresql://"):
        return scalar(db, "SELECT pg_database_size(current_database())")
    try:
        return os.path.getsize(db + "-wal")
    except OSError:
        return 0


# --- a worker killed while queueing ---------------------------------------------------------

BIG = 200_000


def test_process_due_killed_mid_queue_then_rerun_queues_everyone_once(db, api):
    ids = build_world(api)
    bulk_recipients(db, int(ids["datasource"]), BIG)
    expected = BIG + 2
    start = wal_size(db)
    worker = child("import sys, campaignapi; campaignapi.process_due(sys.argv[1])", db)
    # Killed once the queueing transaction is writing (the WAL grows), long
    # before it could have committed 200k rows.
    killed = kill_when(worker, lambda: wal_size(db) > start + 1_000_000)
    assert killed, worker.communicate()
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == 0
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", int(ids["batch"])) == "scheduled"
    assert campaignapi.process_due(db) == 1
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == expected
    assert scalar(db, "SELECT count(DISTINCT lower(to_addr)) FROM outbox "
                      "WHERE kind = 'campaign'") == expected
    assert scalar(db, "SELECT count(*) FROM batch_message") == 1
    assert campaignapi.process_due(db) == 0
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == expected


# --- an import killed mid-way ---------------------------------------------------------------

IMPORT_CHILD = """
import json, sys, webtest, campaignapi
db, secret, body = sys.argv[1], sys.argv[2], sys.argv[3]
client = webtest.TestApp(campaignapi.create_app(db))
with open(body, "rb") as f:
    data = f.read()
client.put("/v1/datasource/1/import/0", data, headers={"Authorization": "Bearer " + secret,
           "Content-Type": "application/json"}, expect_errors=True)
"""


def running_import(db):
    """(status, inserted, recipients it stored) of the one import, or None."""
    if not scalar(db, "SELECT count(*) FROM import"):
        return None
    return (scalar(db, "SELECT status FROM import"), scalar(db, "SELECT inserted FROM import"),
            scalar(db, "SELECT count(*) FROM recipient WHERE import IS NOT NULL"))


def test_an_import_killed_mid_way_is_failed_at_the_next_start_and_completed_again(
        db, tmp_path, make_key):
    """API.md section 5: the chunks committed before the kill stay, counted by
    the record; the next start marks it 'failed' (not before: while its
    process lives, a start elsewhere leaves it running); importing the same
    data again completes it."""
    auth = make_key()
    secret = auth["Authorization"].split()[1]
    from webtest import TestApp
    api = Api(TestApp(campaignapi.create_app(db)), auth)
    api.put("/datasource/0", name="d")
    count = 300_000
    rows = "email,first,city\n" + "".join(f"p{i}@example.com,P{i},C{i % 97}\n"
                                           for i in range(count))
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"name": "big", "originalfile": "big.csv",
                                "__uploadtype__": "base64",
                                "__uploaddata__": base64.b64encode(rows.encode()).decode()}))
    importer = child(IMPORT_CHILD, db, secret, str(body))
    seen = []

    def committed():
        figures = running_import(db)
        if figures and figures[1] > 0 and not seen:
            # A start while the importing process lives does not fail it.
            campaignapi.create_app(db)
            seen.append(running_import(db)[0])
        return bool(seen)

    assert kill_when(importer, committed), importer.communicate()
    assert seen == ["running"]
    status, inserted, stored = running_import(db)
    assert status == "running" and 0 < inserted == stored < count
    assert scalar(db, "SELECT count(*) FROM outbox") == 0   # no "finished" mail
    if db.startswith("postgresql"):
        # The server ends the dead process's session (and its lock) once it
        # has stored the COPY data already sent: only then is the process gone.
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_locks WHERE locktype = "
                                    "'advisory' AND granted") == 0,
                 what="the killed importer's session to end")
    campaignapi.create_app(db)   # the next start
    assert running_import(db) == ("failed", inserted, stored)
    assert scalar(db, "SELECT finished FROM import") is not None
    # The datasource is usable at once, and importing again completes it.
    assert api.get("/datasource/1")["datasource"]["recipients"] == str(stored)
    again = api.put("/datasource/1/import/0", **json.loads(body.read_text()))["id"]
    record = api.get(f"/datasource/1/import/{again}")["import"]
    assert (record["status"], record["inserted"], record["updated"]) == \
        ("finished", str(count - stored), str(stored))
    assert api.get("/datasource/1")["datasource"]["recipients"] == str(count)
    assert scalar(db, "SELECT count(*) FROM field WHERE name IN ('first', 'city')") == 2


# --- a delivery killed mid-chunk -------------------------------------------------------------

DELIVER_CHILD = """
import sys, campaignapi
campaignapi.deliver(sys.argv[1], sys.argv[2], batch_size=int(sys.argv[3]))
"""


@pytest.mark.skipif(not hasattr(campaignapi, "deliver"), reason="delivery is not merged yet")
@pytest.mark.parametrize("relay", ["plain", "pipelining"])
def test_a_delivery_killed_mid_chunk_sends_nobody_twice_and_the_rest_later(
        db, relay, seed_campaign):
    # Over a relay that offers PIPELINING each email's commands go ahead,
    # with the message before it: they must not make it a second in doubt.
    from smtp_sink import PipeliningSink, SmtpSink

    smtp_sink = (PipeliningSink if relay == "pipelining" else SmtpSink)().start()
    try:
        _killed_mid_chunk(db, smtp_sink, seed_campaign)
    finally:
        smtp_sink.stop()


def _killed_mid_chunk(db, smtp_sink, seed_campaign):
    addresses = [f"user{i}@example.org" for i in range(400)]
    seed_campaign([(address, f"U{i}") for i, address in enumerate(addresses)])
    worker = child(DELIVER_CHILD, db, smtp_sink.address, "100")
    # Killed in the middle of a chunk of 100: some of it sent, none recorded
    # by the chunk's end.
    assert kill_when(worker, lambda: len(smtp_sink.messages) >= 150), worker.communicate()
    first = len(smtp_sink.messages)
    assert first < len(addresses)
    # Restarted before the claims go stale: the dead worker's rows wait.
    campaignapi.deliver(db, smtp_sink.address)
    assert scalar(db, "SELECT count(*) FROM outbox WHERE status = 'sending'") > 0
    # Once they are stale (a short timeout for the test), they are taken back.
    time.sleep(1.1)
    counts = campaignapi.deliver(db, smtp_sink.address, stale_claim=datetime.timedelta(0))
    assert counts["sent"] > 0
    received = collections.Counter(rcpts[0] for _, rcpts, _ in smtp_sink.messages)
    assert max(received.values()) == 1, [a for a, n in received.items() if n > 1]
    assert scalar(db, "SELECT count(*) FROM outbox WHERE status IN ('queued', 'sending')") == 0
    # Everyone got it, but for at most the one email the dead worker was in
    # the middle of sending: it may or may not have arrived, so it is not sent
    # again (at most once) and is marked failed with the reason.
    unsure = scalar(db, "SELECT count(*) FROM outbox WHERE status = 'failed'")
    assert unsure <= 1
    assert len(received) >= len(addresses) - unsure
    assert scalar(db, "SELECT count(*) FROM outbox WHERE status = 'sent'") == len(received) \
        - scalar(db, "SELECT count(*) FROM outbox WHERE status = 'failed' AND to_addr IN "
                     f"({spelled(db, 'json_addresses', array='?')})", json.dumps(list(received)))


# --- a batch cancelled while another process is about to make it -----------------------------

@pytest.mark.skipif(os.environ.get("CAMPAIGNAPI_TEST_ENGINE") == "postgresql",
                    reason="hooks SQLite's BEGIN IMMEDIATE; on PostgreSQL the batch row is "
                           "locked (FOR UPDATE), which test_several_hosts exercises")
def test_a_batch_cancelled_between_the_look_and_the_make_stays_cancelled(db, api):
    """Two processes run process_due: one looks (the batch is due), then the
    campaign's pending send is cancelled before its write lock is granted.
    The batch must stay cancelled, with nothing queued."""
    ids = build_world(api)
    conn = campaignapi.connect(db)
    fired = []

    def cancel_just_before_the_write(statement):
        if statement.startswith("BEGIN IMMEDIATE") and not fired:
            fired.append(statement)
            api.post(f"/campaign/{ids['campaign']}", scheduled=0)

    conn.set_trace_callback(cancel_just_before_the_write)
    try:
        campaignapi.process_due(conn)
    finally:
        conn.close()
    assert fired
    assert scalar(db, "SELECT status FROM batch WHERE id = ?", int(ids["batch"])) == "cancelled"
    assert scalar(db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == 0
