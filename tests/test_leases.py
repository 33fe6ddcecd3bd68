"""Claims are leases: a worker killed with SIGKILL during delivery leaves
its claimed emails to the live workers within a minute (the one it was
sending is failed, never sent again); a live worker keeps its claims however
long its chunk takes.  Real worker processes, a real SMTP sink, both engines."""

import datetime
import signal
import time

import pytest

import campaignapi
from helpers import check_delivered_once, database, scalar, start_worker, stop_process, wait_for

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def test_a_killed_workers_claims_go_to_the_other_within_a_minute(db, smtp_sink, seed_campaign):
    addresses = [f"lease{i}@example.org" for i in range(600)]
    seed_campaign([(address, f"L{i}") for i, address in enumerate(addresses)])
    doomed = start_worker(db, smtp_sink.address)
    survivor = None
    try:
        wait_for(lambda: len(smtp_sink.messages) >= 100, timeout=60, what="delivery to start",
                 interval=0.01)
        survivor = start_worker(db, smtp_sink.address)
        # Killed while it holds claims (a chunk of 100 being sent).
        wait_for(lambda: scalar(db, "SELECT count(*) FROM outbox WHERE status = 'sending' "
                                    "AND claimed_by LIKE ?", f"%:{doomed.pid}") > 1,
                 timeout=60, what="the doomed worker to hold claims", interval=0.01)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
        killed = time.monotonic()
        stuck = scalar(db, "SELECT count(*) FROM outbox WHERE status = 'sending' "
                           "AND claimed_by LIKE ?", f"%:{doomed.pid}")
        assert stuck > 0
        _, failed = check_delivered_once(db, smtp_sink, addresses, killed + 60)
        print(f"\n{stuck} claims of the killed worker taken back after "
              f"{time.monotonic() - killed:.1f}s; {len(failed)} failed in flight")
        if failed:
            with database(db) as conn:
                assert conn.execute("SELECT error FROM outbox WHERE status = 'failed'"
                                    ).fetchone()[0].startswith("the worker stopped during the SMTP")
        output = stop_process(survivor)
        assert "Traceback" not in output and "deadlock" not in output, output[-3000:]
    finally:
        stop_process(doomed)
        if survivor is not None:
            stop_process(survivor)


def test_a_slow_live_worker_keeps_its_claims(db, smtp_sink, seed_campaign, monkeypatch):
    """Its lease is renewed while it works: with a lease shorter than the
    chunk takes, another worker looking for dead claims takes nothing."""
    # internal: renew the lease every 0.2 s, so that a short test sees renewals
    monkeypatch.setattr(campaignapi, "_CLAIM_RENEW", 0.2)
    addresses = [f"slow{i}@example.org" for i in range(30)]
    seed_campaign([(address, "S") for address in addresses])
    lease = datetime.timedelta(seconds=1)
    looked = []

    def look_for_dead(*_):
        # Another worker's deliver() between this one's SMTP attempts.
        time.sleep(0.1)
        looked.append(campaignapi.deliver(db, "127.0.0.1:9", stale_claim=lease, now=None))

    # internal: another worker looks exactly between two of this one's SMTP attempts
    courier = campaignapi._Courier
    real_send = courier.send
    monkeypatch.setattr(courier, "send",
                        lambda self, *args: (look_for_dead(), real_send(self, *args))[1])
    counts = campaignapi.deliver(db, smtp_sink.address, stale_claim=lease)
    assert counts["sent"] == len(addresses)
    assert sum(look["sent"] + look["requeued"] + look["failed"] for look in looked) == 0
    assert sorted(rcpts[0] for _, rcpts, _ in smtp_sink.messages) == sorted(addresses)
