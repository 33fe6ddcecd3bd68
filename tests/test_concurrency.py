"""Concurrency: two processes on one database file -- this one serving the app
under waitress with 8 threads, and ``python campaignapi.py`` (with its
worker thread making due batches) -- under a bounded mixed load of reads,
creates, imports, sends and process_due from client threads: no 5xx, no
'database is locked', and every acknowledged write is there afterwards."""

import json
import os
import random
import subprocess
import sys
import threading

import webtest

import campaignapi
from conftest import Api, serving
from helpers import answers, build_world, free_port, http, in_threads, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENTS, OPERATIONS = 8, 40


def _up(url, process):
    assert process.poll() is None, process.communicate()
    return answers(url, timeout=5)


class Client:
    """A keyless HTTP client over urllib that records every answer."""

    def __init__(self, secret):
        self.headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        self.answers = []      # (status, method, url, body text)
        self.lock = threading.Lock()

    def call(self, base, method, path, params=None):
        status, _, body = http(base + "/v1" + path, method, params, self.headers, timeout=120)
        text = body.decode()
        with self.lock:
            self.answers.append((status, method, path, text))
        return status, json.loads(text)


def test_two_processes_under_mixed_load_lose_nothing(db, tmp_path):
    secret = campaignapi.create_key(db, "owner@example.com")
    app = campaignapi.create_app(db)
    api = Api(webtest.TestApp(app), {"Authorization": f"Bearer {secret}"})
    ids = build_world(api, send=False)
    datasource, campaign = ids["datasource"], ids["campaign"]
    port = free_port()
    log = open(tmp_path / "second.log", "w+")
    second = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "campaignapi.py"), "--db", db, "--port", str(port),
         "--threads", "8"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    client = Client(secret)
    acknowledged = {"message": {}, "import": {}, "batch": set()}
    ack_lock = threading.Lock()
    try:
        with serving(app, threads=8) as first_url:
            second_url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _up(second_url, second), what=f"{second_url} to come up",
                     interval=0.05)
            bases = [first_url, second_url]

            def work(number):
                rng = random.Random(number)
                for step in range(OPERATIONS):
                    base = rng.choice(bases)
                    kind = rng.choice(["read", "read", "create", "import", "send", "due"])
                    tag = f"{number}-{step}"
                    if kind == "read":
                        client.call(base, "GET", rng.choice([
                            "/datasource/all", f"/campaign/{campaign}", f"/segment/{ids['segment']}",
                            f"/datasource/{datasource}/recipient/all?limit=50",
                            f"/campaign/{campaign}/batcharchive/all"]))
                    elif kind == "create":
                        status, body = client.call(base, "PUT", "/message/0", {
                            "name": f"m{tag}", "subject": "s", "text": "t {{unsubscribe_url}}"})
                        if status == 200:
                            with ack_lock:
                                acknowledged["message"][body["data"]["id"]] = f"m{tag}"
                    elif kind == "import":
                        addresses = [f"c{tag}-{i}@load.example" for i in range(20)]
                        status, body = client.call(base, "PUT", f"/datasource/{datasource}/import/0", {
                            "name": f"i{tag}", "originalfile": "f.csv", "__uploadtype__": "csv",
                            "__uploaddata__": "email,first\n" + "".join(
                                f"{a},F{tag}\n" for a in addresses)})
                        if status == 200:
                            with ack_lock:
                                acknowledged["import"][body["data"]["id"]] = addresses
                    elif kind == "send":
                        status, body = client.call(base, "PUT", f"/campaign/{campaign}/send/0",
                                                   {"timestamp": 0})
                        if status == 200:
                            with ack_lock:
                                acknowledged["batch"].add(int(body["data"]["id"]))
                    else:
                        campaignapi.process_due(db)

            in_threads(work, range(CLIENTS), timeout=300)
    finally:
        second.terminate()
        second.wait(30)
    log.seek(0)
    second_log = log.read()
    log.close()

    due_calls = len(client.answers)  # every operation but process_due answered
    assert 0 < due_calls <= CLIENTS * OPERATIONS
    failures = [a for a in client.answers if a[0] >= 500 or a[0] in (401, 403, 404)]
    assert failures == [], failures[:3]
    for status, method, path, text in client.answers:
        assert "database is locked" not in text and "Traceback" not in text
    assert "database is locked" not in second_log and "Traceback" not in second_log, \
        second_log[-2000:]
    assert acknowledged["message"] and acknowledged["import"] and acknowledged["batch"]

    # Every acknowledged write is there: through the API and in the file.
    for message_id, name in acknowledged["message"].items():
        assert api.get(f"/message/{message_id}")["message"]["name"] == name
    imported = sum(len(a) for a in acknowledged["import"].values())
    assert api.get(f"/datasource/{datasource}")["datasource"]["recipients"] == str(imported + 2)
    conn = campaignapi.connect(db)
    try:
        for import_id, addresses in acknowledged["import"].items():
            record = api.get(f"/datasource/{datasource}/import/{import_id}")["import"]
            assert record["status"] == "finished" and record["inserted"] == "20"
            assert {r[0] for r in conn.execute("SELECT email FROM recipient WHERE import = ?",
                                               (int(import_id),))} == set(addresses)
        assert {str(r[0]) for r in conn.execute("SELECT id FROM message")} >= set(
            acknowledged["message"])
        batches = {r[0]: r[1] for r in conn.execute("SELECT id, status FROM batch")}
        assert acknowledged["batch"] <= set(batches)
        # Every batch is made once all is due, each address queued once per batch.
        campaignapi.process_due(db)
        assert {batches_status for batches_status in (
            r[0] for r in conn.execute("SELECT status FROM batch"))} <= {"sending", "sent"}
        assert conn.execute("SELECT count(*) FROM (SELECT batch, lower(to_addr) FROM outbox "
                            "WHERE kind = 'campaign' GROUP BY 1, 2 HAVING count(*) > 1) AS twice"
                            ).fetchone()[0] == 0
        if conn.engine == "sqlite":
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
