"""Done when: a receiver built with the Standard Webhooks library gets every
event of an import, a send and an unsubscribe, verified, in order, through a
worker crash -- the worker being ``python campaignapi.py worker`` killed with
SIGKILL while it posts an event."""

import os
import signal
import subprocess
import sys
import threading
import urllib.parse

import pytest

from conftest import Api
from helpers import (EventReceiver, database, import_csv, keyed_client, make_campaign,
                     make_datasource, make_webhook, wait_for)

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "campaignapi.py")


def start_worker(db, smtp, log):
    return subprocess.Popen([sys.executable, SCRIPT, "worker", "--db", db, "--smtp", smtp,
                             "--webhook-allow-private"], stdout=log, stderr=subprocess.STDOUT)


def test_import_send_and_unsubscribe_events_arrive_verified_in_order_through_a_crash(
        db, tmp_path, smtp_sink):
    client, auth = keyed_client(db, webhook_allow_private=True)
    api = Api(client, auth)
    held = threading.Event()

    def plan(call):
        # The first post of batch.sent arrives, and is never answered: the
        # worker is killed while it waits.
        if call["payload"] and call["payload"]["type"] == "batch.sent" and not held.is_set():
            held.set()
            return lambda handler: receiver.release.wait(30)
        return 204

    log_path = tmp_path / "worker.log"
    with EventReceiver(plan) as receiver, open(log_path, "wb") as log:
        make_webhook(api, receiver)
        ds = make_datasource(api, fields=[{"name": "first", "type": "text"}])
        import_csv(api, ds, "email,first\nann@example.com,Ann\nbob@example.com,Bob\n")
        campaign = make_campaign(api, [ds])["campaign"]
        api.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")

        worker = start_worker(db, smtp_sink.address, log)
        try:
            wait_for(held.is_set, timeout=30, what="the worker posting batch.sent")
            with database(db) as conn:
                claimed = conn.execute("SELECT count(*) FROM hook_delivery WHERE claimed_by "
                                       "IS NOT NULL AND status = 'pending'").fetchone()[0]
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(30)
        receiver.release.set()
        assert claimed == 1, log_path.read_text()
        assert len(receiver.acknowledged()) == 2     # the import's and batch.started

        # While no worker runs, Ann unsubscribes with the link of her email.
        emails = smtp_sink.parsed()
        assert {"ann@example.com", "bob@example.com"} <= set(emails)   # and the import notice
        link = emails["ann@example.com"]["List-Unsubscribe"].strip("<>")
        response = client.post(urllib.parse.urlsplit(link).path, "List-Unsubscribe=One-Click",
                               content_type="application/x-www-form-urlencoded")
        assert response.status_int == 200

        # A minute passes (HOOK_LEASE, tested on its own in test_webhooks.py):
        # the dead worker's claim is that old.
        with database(db) as conn:
            conn.execute("UPDATE hook_delivery SET claimed_at = '2000-01-01 00:00:00' "
                         "WHERE claimed_by IS NOT NULL")
        worker = start_worker(db, smtp_sink.address, log)
        try:
            wait_for(lambda: len(receiver.acknowledged()) == 4, timeout=30,
                     what="every event acknowledged")
        finally:
            worker.terminate()
            worker.wait(30)

    assert all(call["error"] is None for call in receiver.calls), receiver.calls
    acknowledged = receiver.acknowledged()
    assert [payload["type"] for payload in acknowledged] == [
        "import.finished", "batch.started", "batch.sent", "recipient.unsubscribed"]
    assert acknowledged[0]["data"]["inserted"] == "2"
    assert acknowledged[2]["data"]["sent"] == "2"
    assert acknowledged[3]["data"]["email"] == "ann@example.com"
    # The post the crash interrupted was sent again, the same id and body.
    interrupted = [call for call in receiver.calls if call["status"] is None]
    assert len(interrupted) == 1
    again = [call for call in receiver.calls if call["id"] == interrupted[0]["id"]]
    assert len(again) == 2 and again[0]["body"] == again[1]["body"]
    # Nothing lost: every stored event delivered, each acknowledged once.
    with database(db) as conn:
        stored = [f"msg_{row[0]}" for row in conn.execute("SELECT id FROM hook_event ORDER BY id")]
        statuses = {row[0] for row in conn.execute("SELECT status FROM hook_delivery")}
    acknowledged_ids = [call["id"] for call in receiver.calls if call["status"] == 204]
    assert acknowledged_ids == stored and statuses == {"delivered"}
