"""Imports commit in chunks (API.md section 5, issue 31): while a big import
runs over real HTTP, a write with a key and a public write answer without
waiting for it, the import record says 'running' with figures that count
exactly the rows stored so far, a running import cannot be deleted and is
not taken for an interrupted one by another start; at its end it is
'finished' with every row.  On both engines."""

import threading
import time

import pytest

import campaignapi
from helpers import HttpApi, database, http, make_datasource, make_signup_list, scalar, wait_for

ROWS = 240_000


@pytest.fixture
def chunks(monkeypatch):
    """Commits every 20,000 rows instead of 50,000: a test-sized import has twelve."""
    # internal: the commit size, smaller so that a quarter of a million rows make many chunks
    monkeypatch.setattr(campaignapi, "_COMMIT_ROWS", 20_000)


def people(count, start=0):
    return "email,first\n" + "".join(f"p{i}@example.com,P{i}\n"
                                     for i in range(start, start + count))


class Importing(threading.Thread):
    """A PUT of an import over HTTP in a thread of its own: its status and data."""

    def __init__(self, api, ds, text):
        super().__init__(daemon=True)
        self.api, self.ds, self.text, self.answer = api, ds, text, None

    def run(self):
        self.answer = self.api.call("PUT", f"/datasource/{self.ds}/import/0", {
            "name": "big", "originalfile": "big.csv", "__uploadtype__": "csv",
            "__uploaddata__": self.text})


def figures(db):
    """The running import's record figures and the recipients it has stored,
    read by one statement (one snapshot): (status, rows, inserted, stored)."""
    with database(db) as conn:
        row = conn.execute("SELECT i.status, i.rows, i.inserted, "
                           "(SELECT count(*) FROM recipient r WHERE r.import = i.id) "
                           "FROM import i ORDER BY i.id DESC LIMIT 1").fetchone()
    return None if row is None else tuple(row)


def test_writes_answer_while_an_import_commits_in_chunks(db, app, serve, auth, chunks):
    secret = auth["Authorization"].split()[1]
    with serve(app) as base:
        api = HttpApi(base, secret)
        ds = make_datasource(api)
        signups = make_signup_list(api)
        importing = Importing(api, ds, people(ROWS))
        importing.start()
        # The record appears with the first commit, 'running', its figures live.
        wait_for(lambda: (figures(db) or (None, 0))[1] > 0, timeout=120,
                 what="the import's first chunk committed", interval=0.01)
        status, rows, inserted, stored = figures(db)
        assert status == "running" and 0 < inserted < ROWS and inserted == stored
        assert rows >= inserted
        record = api.get(f"/datasource/{ds}/import/all")["import"][0]
        assert record["status"] == "running" and record["finished"] is None
        assert 0 < int(record["inserted"]) < ROWS

        # A write with a key and a public write go through now, not after the import.
        campaign = api.put("/campaign/0", name="During", accountprofile=1)["id"]
        status, _, body = http(f"{base}/v1/subscribe/{signups}", "POST",
                               {"email": "ann@example.com", "first": "Ann"})
        assert status == 200, body
        assert figures(db)[0] == "running", "the import ended before the writes were answered"
        assert api.get(f"/campaign/{campaign}")["emt_campaign"][0]["name"] == "During"

        # Still running: not deletable, and another start does not fail it.
        running = record["id"]
        assert api.call("DELETE", f"/datasource/{ds}/import/{running}",
                        {"id": running}, status=409)["error"] == "conflict"
        campaignapi.create_app(db)
        assert figures(db)[0] == "running"

        importing.join(300)
        assert not importing.is_alive()
        assert importing.answer == {"id": running}
        done = api.get(f"/datasource/{ds}/import/{running}")["import"]
        assert (done["status"], done["rows"], done["inserted"], done["skipped"]) == \
            ("finished", str(ROWS), str(ROWS), "0")
        assert done["finished"] is not None
        assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == str(ROWS)
        wait_for(lambda: scalar(db, "SELECT count(*) FROM recipient WHERE email = ?",
                                "ann@example.com") == 1, what="the sign-up applied")
        # One notification, once the import has finished.
        assert scalar(db, "SELECT count(*) FROM outbox WHERE subject LIKE 'Import %'") == 1


def test_an_import_that_fails_after_a_commit_is_failed_with_what_it_stored(
        db, app, api, chunks, monkeypatch):
    """An error after the first commit (here: the connection's write of the
    seventh chunk fails) leaves the import 'failed' with the rows and figures
    of the chunks committed; the answer is the error."""
    ds = make_datasource(api)
    # internal: make a write of the import fail halfway, as a lost connection would
    importer = campaignapi._Importer
    flush, calls = importer.flush, []

    def failing(self):
        calls.append(len(self.pending))
        if len(calls) == 30:
            raise RuntimeError("the database went away")
        return flush(self)

    monkeypatch.setattr(importer, "flush", failing)
    # internal: read in this process, so the failing flush is the one that runs
    monkeypatch.setattr(campaignapi, "_CHILD_READS_BYTES", 1 << 40)
    api.put(f"/datasource/{ds}/import/0", status=500, name="x", originalfile="x.csv",
            __uploadtype__="csv", __uploaddata__=people(ROWS))
    status, rows, inserted, stored = figures(db)
    assert status == "failed" and 0 < inserted == stored < ROWS and inserted <= rows < ROWS
    record = api.get(f"/datasource/{ds}/import/all")["import"][0]
    assert record["status"] == "failed" and record["finished"] is not None
    # No notification for an import that did not finish.
    assert scalar(db, "SELECT count(*) FROM outbox") == 0
    # Importing the same data again completes it (an upsert).
    monkeypatch.setattr(importer, "flush", flush)
    again = api.put(f"/datasource/{ds}/import/0", name="again", originalfile="x.csv",
                    __uploadtype__="csv", __uploaddata__=people(ROWS))["id"]
    record = api.get(f"/datasource/{ds}/import/{again}")["import"]
    assert (record["status"], record["inserted"], record["updated"]) == \
        ("finished", str(ROWS - inserted), str(inserted))
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == str(ROWS)


def test_unreadable_data_writes_nothing_and_a_small_import_is_one_commit(db, api):
    ds = make_datasource(api)
    api.put(f"/datasource/{ds}/import/0", status=422, name="x", originalfile="x.csv",
            __uploadtype__="csv", __uploaddata__="name,first\nann,Ann\n")
    assert scalar(db, "SELECT count(*) FROM import") == 0
    assert scalar(db, "SELECT count(*) FROM field WHERE name = 'first'") == 0
    small = api.put(f"/datasource/{ds}/import/0", name="x", originalfile="x.csv",
                    __uploadtype__="csv", __uploaddata__=people(10))["id"]
    assert api.get(f"/datasource/{ds}/import/{small}")["import"]["status"] == "finished"


def test_writers_of_one_process_take_turns_with_a_chunked_writer(db, app):
    """A thread that commits and begins again at once (as an import does
    between chunks) lets a writer that came meanwhile go first; without the
    turns the waiting writer sleeps in SQLite's busy handler and loses the
    lock again and again."""
    hold, done, waited = threading.Event(), threading.Event(), []
    campaignapi.init_db(db)

    def chunked():
        conn = campaignapi.connect(db)
        try:
            with campaignapi.transaction(conn):
                hold.set()
                deadline = time.monotonic() + 20
                while not done.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)   # a chunk's work, the lock held
                    # internal: the commit between an import's chunks
                    campaignapi._next_chunk(conn)
        finally:
            conn.close()

    def writer():
        conn = campaignapi.connect(db)
        try:
            started = time.monotonic()
            with campaignapi.transaction(conn):
                conn.execute("INSERT INTO setting (name, value) VALUES ('turns', '1')")
            waited.append(time.monotonic() - started)
        finally:
            conn.close()
            done.set()

    holder = threading.Thread(target=chunked)
    holder.start()
    hold.wait(10)
    other = threading.Thread(target=writer)
    other.start()
    for thread in (other, holder):
        thread.join(30)
    assert waited and waited[0] < 2, waited
    assert scalar(db, "SELECT value FROM setting WHERE name = 'turns'") == "1"


@pytest.mark.parametrize("start", ["app", "worker"])
def test_a_start_marks_a_running_import_that_no_process_runs_failed(db, api, start):
    """A 'running' record that no process holds (its process died) is
    'failed' after the next start of an app or a worker; its rows stay."""
    ds = make_datasource(api)
    done = api.put(f"/datasource/{ds}/import/0", name="x", originalfile="x.csv",
                   __uploadtype__="csv", __uploaddata__=people(3))["id"]
    with database(db) as conn, campaignapi.transaction(conn):
        # What a killed import leaves: its last commit said 'running'.
        conn.execute("UPDATE import SET status = 'running', finished = NULL WHERE id = ?",
                     (int(done),))
    if start == "app":
        campaignapi.create_app(db)
    else:
        stop = threading.Event()
        stop.set()
        worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop))
        worker.start()
        worker.join(60)
        assert not worker.is_alive()
    record = api.get(f"/datasource/{ds}/import/{done}")["import"]
    assert (record["status"], record["inserted"]) == ("failed", "3")
    assert record["finished"] is not None
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == "3"
    # Now it can go, with the recipients it inserted.
    api.delete(f"/datasource/{ds}/import/{done}", id=int(done))
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == "0"


def test_small_chunks_and_commits_count_every_row_once(db, api, monkeypatch):
    """Many commits, each after a few chunks, through every write path (on
    PostgreSQL the streamed COPY with repeats across commits, then the
    staging table): the figures and the rows are those of one transaction."""
    # internal: a chunk every 50 rows and a commit every 120, so a thousand rows make many
    monkeypatch.setattr(campaignapi, "_CHUNK_ROWS", 50)
    # internal: and a commit every 120 rows instead of 50,000
    monkeypatch.setattr(campaignapi, "_COMMIT_ROWS", 120)
    # internal: a COPY segment every 120 rows (PostgreSQL), as commits end them anyway
    monkeypatch.setattr(campaignapi._CopyStream, "SEGMENT_ROWS", 120)
    ds = make_datasource(api)
    # 1,000 rows, every tenth an address of an earlier row in another case.
    rows = [f"P{i - 37}@example.com,again{i}" if i % 10 == 9 and i > 40 else f"p{i}@example.com,P{i}"
            for i in range(1000)]
    first = api.put(f"/datasource/{ds}/import/0", name="a", originalfile="a.csv",
                    __uploadtype__="csv", __uploaddata__="email,first\n" + "\n".join(rows))["id"]
    record = api.get(f"/datasource/{ds}/import/{first}")["import"]
    distinct = {row.split(",")[0].lower() for row in rows}
    assert (record["status"], record["rows"], record["inserted"], record["updated"]) == \
        ("finished", "1000", str(len(distinct)), "0")
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == str(len(distinct))
    assert scalar(db, "SELECT count(*) FROM recipient WHERE data LIKE '%again%'") == \
        sum(1 for i in range(41, 1000) if i % 10 == 9)
    # Again, half known and half new: known ones updated once each, in any chunk.
    more = [f"p{i}@example.com,Q{i}" for i in range(500, 1500)]
    second = api.put(f"/datasource/{ds}/import/0", name="b", originalfile="b.csv",
                     __uploadtype__="csv", __uploaddata__="email,first\n" + "\n".join(more))["id"]
    record = api.get(f"/datasource/{ds}/import/{second}")["import"]
    known = len({f"p{i}@example.com" for i in range(500, 1500)} & distinct)
    assert (record["status"], record["inserted"], record["updated"]) == \
        ("finished", str(1000 - known), str(known))
    assert api.get(f"/datasource/{ds}")["datasource"]["recipients"] == \
        str(len(distinct) + 1000 - known)
