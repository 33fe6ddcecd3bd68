"""Several hosts on one machine: two API processes and two delivery workers
share one PostgreSQL database; one worker is killed with SIGKILL during
delivery and not restarted.  Every recipient gets exactly one email, checked
at a real SMTP sink, except at most the one in flight at the kill, which is
marked failed (it may have arrived; never sent twice)."""

import os
import signal
import time

import pytest

from clihelpers import served
from helpers import (HttpApi, check_delivered_once, import_csv, make_campaign, make_datasource,
                     scalar, start_worker, stop_process, wait_for)

pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL"),
              pytest.mark.skipif(os.environ.get("CAMPAIGNAPI_TEST_ENGINE") != "postgresql",
                                 reason="several hosts share a PostgreSQL database "
                                        "(CAMPAIGNAPI_TEST_ENGINE=postgresql)")]

#: Recipients in CI; the bench runs the same scenario with 50,000.
RECIPIENTS = 2000


def test_two_apis_and_two_workers_one_killed_every_recipient_once(pg_db, smtp_sink, tmp_path):
    addresses = [f"host{i}@example.org" for i in range(RECIPIENTS)]
    # No --smtp: each API process makes due batches (row-locked), workers deliver.
    with served("--db", pg_db, "--email", "owner@example.com", cwd=tmp_path) as first, \
            served("--db", pg_db, cwd=tmp_path) as second:
        one = HttpApi(f"http://127.0.0.1:{first.port}", first.secret)
        two = HttpApi(f"http://127.0.0.1:{second.port}", first.secret)
        ds = make_datasource(one, fields=[{"name": "first", "type": "text"}])
        report = import_csv(two, ds, "email,first\n" + "".join(
            f"{address},H{i}\n" for i, address in enumerate(addresses)))
        assert two.get(f"/datasource/{ds}/import/{report['id']}")["import"]["inserted"] == \
            str(RECIPIENTS)
        campaign = make_campaign(one, [ds])["campaign"]
        two.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
        wait_for(lambda: scalar(pg_db, "SELECT count(*) FROM batch WHERE status = 'sending'")
                 == 1, timeout=30, what="an API process to make the batch")
        assert scalar(pg_db, "SELECT count(*) FROM outbox WHERE kind = 'campaign'") == RECIPIENTS
        doomed = start_worker(pg_db, smtp_sink.address)
        survivor = start_worker(pg_db, smtp_sink.address)
        try:
            wait_for(lambda: len(smtp_sink.messages) >= RECIPIENTS // 4, timeout=60,
                     what="delivery to be under way", interval=0.01)
            doomed.send_signal(signal.SIGKILL)   # not restarted: the survivor takes over
            doomed.wait(30)
            killed = time.monotonic()
            check_delivered_once(pg_db, smtp_sink, addresses, killed + 60)
            wait_for(lambda: one.get(f"/campaign/{campaign}/batcharchive/all")["batcharchive"]
                     [0]["status"] == "sent", timeout=30, what="the batch to be sent")
            # The survivor never failed a step (a deadlock between its own
            # connections once did, and only the leases hid it).
            output = stop_process(survivor)
            assert "Traceback" not in output and "deadlock" not in output, output[-3000:]
        finally:
            stop_process(doomed)
            stop_process(survivor)
