"""Benchmarks of campaignapi, each against a baseline measured in the same run.

    python bench/bench.py [--rows N] [--emails M] [--only NAME] [--seconds S]
                          [--rounds R] [--sinks K] [--signups S] [--db sqlite|postgresql|URL]
                          [--hosts-recipients H] [--public-rate R]

Prints one line per benchmark with each figure that has a target, its value
and its verdict (met or missed) beside it; then every target of TARGETS on the
engine with its verdict; last, one JSON line with every figure and verdict.
The machines are shared and noisy, so every figure that matters is a ratio to
a baseline that does the same work in the plainest way, on the same machine,
in the same run:

  import   N rows (email + 5 fields, 1% invalid, 1% duplicates) as one base64
           import through the WSGI app, vs sqlite3.executemany of the same
           parsed rows into a table of the same shape and unique index.
           Target: ratio >= 0.5, peak RSS <= 4x the upload.  On PostgreSQL
           (the import goes through COPY) the baseline is a raw COPY of the
           same rows, without repeats, into a table of the same shape:
           target ratio >= 0.6.
  queue    process_due() of a send now to a segment of N recipients, vs one
           INSERT ... SELECT of N rows into an outbox-shaped table.
           Target: <= 10 s, ratio >= 0.3.
  deliver  M emails from the outbox to a local SMTP sink (aiosmtpd in K
           processes sharing the port, offering PIPELINING like real
           relays), vs smtplib sending M pre-built messages over one
           connection to the same sink.  Target: ratio >= 0.8 with one
           connection, >= 1.5 with the pool (4 connections).  Also the
           baseline over 4 connections: what the sink and machine take, and
           two worker processes (one connection each) sharing the outbox.
           Median of R rounds, each ratio taken within its round.  And
           the same over one connection with the campaign's tracking on
           (every link rewritten, the open image, tokens per recipient), vs
           off.  Target: tracked within 10% of untracked (ratio >= 0.9).
           With a template: the same over 1 connection with the messages in
           a template record (a <style> block inlined once per batch).
           Target: within 10% of without (ratio to it >= 0.9).
  api      GET /v1/campaign/{id} with a key through waitress (8 threads),
           the server pinned to CPU 0, under wrk -t1 -c16 --latency pinned
           to CPU 1 (client and server never fight for a core), vs a bare
           Bottle route that returns the same JSON through the same server,
           pinned the same way.  Target: ratio >= 0.6; p50/p99 printed.
           Median of R rounds of (bare, api).  wrk is needed (apt-get
           install wrk).
  archive  GET of a campaign's archive and of its batch archive (the
           statistics by SQL) for a batch of N recipients with 0.3 N events
           (opens, clicks, unsubscribes, bounces, complaints over 48 hours),
           rows made by SQL.  Target: each under 1 s.  Then the pages of
           API.md section 21 over it: a report link's statistics page
           against the archive record it comes from (target <= 1.5x), and
           the public archive's page against the index (target < 0.05 s).
  tracking GET /v1/open/{token} and /v1/click/{token} (valid tokens: each
           request counts an event) through waitress (8 threads) under wrk,
           vs a bare Bottle route answering the same GIF / 302 on the same
           server (server on CPU 0, wrk on CPU 1, as for api).
           Target: ratio >= 0.8.  Then the p99 of GET
           /v1/campaign/{id} alone and while 10,000 opens arrive at once.
  signup   S public sign-ups (double opt-in: each stores a recipient and
           queues its confirmation email) posted by 8 keep-alive clients to
           the app under waitress (8 threads), while one more client keeps
           asking GET /v1/campaign/{id} with a key; that GET's p50/p99 during
           the burst vs the same GET alone just before.  Target: every
           sign-up 200 (no 5xx) and the API answering throughout.
  during-import
           While one --rows import (base64 CSV, one PUT over HTTP) runs on
           a server (waitress, 8 threads), a client fires the five public
           writes: GET open, GET click, POST unsubscribe, POST subscribe
           (sign-up), POST confirm, each at --public-rate a second (20),
           open-loop: a request's latency counts from when it was due, so a
           stall counts whole.  With them, at the same rate, three writes
           with a key (PUT /v1/campaign/0, POST /v1/campaign/{id}, PUT
           /v1/datasource/{id}/recipient/0), whose baseline is the same
           load of them for 3 s alone just before the import.  p50/p99/max
           and errors per route, the import's time, and when the slow ones
           were due.  Then every write answered must be in the database
           within 30 s of the import's end (the intake applies late ones)
           and the import whole.  Target: p99 < 100 ms, no error, every
           effect there.

  transactional
           Seconds from PUT /v1/transactional/0 (in-process app) to the
           acceptance of its email by an aiosmtpd relay, with run_worker()
           running: 20 requests 0.3 s apart with the worker idle, then 30
           requests 0.1 s apart while a campaign of M (--emails) emails is
           being delivered.  Target: idle max < 1 s, under load p99 < 2 s
           (issue 28 asks it at 100,000 emails).  Then 5 alternating rounds
           of 100 PUT /v1/message/0 with a new Idempotency-Key each vs
           without.  Target: keyed >= 0.5 of unkeyed.
  rates    M campaign emails to recipients of 50 domains over one
           connection with per-domain rates on ({"*": "100000/s"}: counted
           in the database, none binding) vs without, in the same round.
           Target: ratio >= 0.8.  Median of R rounds.
  automations
           A date trigger matching N (--rows) recipients: enabling it and
           advance_runs() queueing every first email, vs plain INSERT ...
           SELECTs of the same run and outbox rows (target <= 10 s at 1M on
           SQLite); the worker's idle tick with those N runs waiting, vs
           with none (target < 10 ms); runs advancing through a send step
           vs the outbox draining campaign emails (target ratio >= 0.5).

  hosts    (PostgreSQL only) several hosts on one machine: two API processes
           and two worker processes on one database, H recipients (50,000)
           imported and sent, one worker killed with SIGKILL at a quarter;
           every recipient must get exactly one email (but the one in flight
           at the kill, which is failed).  Also the bytes each sent email
           adds to the growing tables (outbox, event, hook_delivery).

Each benchmark runs in a child process of its own, so peak RSS is its own.
``--db postgresql`` starts a throwaway cluster (tests/pgcluster.py: tuned for
tests, fsync off); ``--db postgresql://...`` uses that server.  Each
benchmark gets a new database there, dropped at its end.
"""

import argparse
import base64
import contextlib
import io
import json
import operator
import os
import random
import resource
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import campaignapi  # noqa: E402

#: The engine of this run: "sqlite", or the URL of a PostgreSQL server's
#: database (each benchmark makes its own database beside it).
DB = "sqlite"
_MADE = []   # the PostgreSQL databases this process made, dropped at its end

#: Where the app of an in-process benchmark is published, as a deployment
#: sets public_url: its links (unsubscribe, tracking, confirm) are built
#: from it.  Without it (and without allowed_hosts) the app builds links only
#: for a request to this machine's own names and answers 400 invalid_host to
#: the rest.  A served app is given the address it listens on instead.
PUBLIC_URL = "https://mail.example"

FIELDS = ("first", "last", "city", "age", "score")
CITIES = ("Berlin", "Lisboa", "Oslo", "Québec", "Kraków", "Zürich", "Nantes", "Porto")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def peak_rss_mb():
    """This process's peak RSS in MB.  VmHWM, because ru_maxrss carries the
    parent's peak over through fork and exec."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def wsgi_call(app, method, path, body=b"", headers=None, body_file=None, raw=False):
    """Call the WSGI app directly, as a server would; returns (status, json),
    or (status, bytes) with ``raw`` (a page)."""
    environ = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
        "SERVER_NAME": "bench", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr, "wsgi.version": (1, 0),
        "wsgi.multithread": False, "wsgi.multiprocess": False, "wsgi.run_once": False,
        "CONTENT_TYPE": "application/json",
    }
    if body_file is not None:
        environ["wsgi.input"] = body_file
        environ["CONTENT_LENGTH"] = str(os.fstat(body_file.fileno()).st_size)
    else:
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    status = []
    out = b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    return int(status[0].split()[0]), out if raw else json.loads(out)


class Client:
    """The API through the WSGI app, asserting success."""

    def __init__(self, app, secret):
        self.app, self.headers = app, {"Authorization": f"Bearer {secret}"}

    def __call__(self, method, path, **params):
        body = json.dumps(params).encode() if params else b""
        status, envelope = wsgi_call(self.app, method, "/v1" + path, body, self.headers)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {envelope}")
        return envelope["data"]


def iter_rows(n, seed=7):
    """N CSV rows, one at a time: 1% invalid emails, 1% repeated addresses
    (other case)."""
    rng = random.Random(seed)
    for i in range(n):
        roll = rng.random()
        if roll < 0.01:
            email = f"broken-{i}-at-example.com"
        elif roll < 0.02 and i > 0:
            email = f"User{rng.randrange(i)}@Example.COM"
        else:
            email = f"user{i}@example.com"
        yield (email, f"First{i}", f"Last{i % 977}", CITIES[i % len(CITIES)],
               str(18 + i % 70), f"{rng.random() * 100:.2f}")


def make_rows(n, seed=7):
    return list(iter_rows(n, seed))


def write_import_body(path, n):
    """The JSON body of an import of N rows (iter_rows, base64) streamed to
    ``path``, so that ten million rows never sit in memory; the upload's
    size in MB as sent (the body, as the import benchmark counts it: peak
    RSS is compared with it)."""
    chunk = io.BytesIO()
    with open(path, "wb") as out:
        out.write(b'{"name": "bench", "originalfile": "bench.csv", "__uploadtype__": "base64", '
                  b'"__uploaddata__": "')

        def flush(final=False):
            data = chunk.getvalue()
            cut = len(data) if final else len(data) - len(data) % 3  # whole base64 groups
            out.write(base64.b64encode(data[:cut]))
            chunk.seek(0)
            chunk.truncate()
            chunk.write(data[cut:])

        for line in _csv_lines(iter_rows(n)):
            chunk.write(line)
            if chunk.tell() >= 3 << 18:
                flush()
        flush(final=True)
        out.write(b'"}')
    return os.path.getsize(path) / 2**20


def _csv_lines(rows):
    yield ("email," + ",".join(FIELDS) + "\n").encode("utf-8")
    for row in rows:
        yield (",".join(row) + "\n").encode("utf-8")


def rows_csv(rows):
    return b"".join(_csv_lines(rows))


def new_db(tmp, name="bench"):
    """A new, empty database: a file in ``tmp`` or a database on the server."""
    if DB == "sqlite":
        return os.path.join(tmp, f"{name}.db")
    import psycopg

    database = f"bench_{os.getpid()}_{len(_MADE)}"
    with psycopg.connect(DB, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    _MADE.append(database)
    return DB.rsplit("/", 1)[0] + "/" + database


def drop_made():
    import psycopg

    with psycopg.connect(DB, autocommit=True) as admin:
        for database in _MADE:
            admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def new_service(tmp, **config):
    """A new database with a key and the app on it, published at PUBLIC_URL:
    (db, app, Client)."""
    db = new_db(tmp)
    app = campaignapi.create_app(db, **{"public_url": PUBLIC_URL, **config})
    secret = campaignapi.create_key(db, "bench@example.com")
    return db, app, Client(app, secret)


def fill_recipients(db, datasource, n, prefix="user", status="active", data="{}"):
    """N recipients (PREFIX{i}@example.com) straight into the table (setup,
    not measured); unconfirmed ones as if their confirmation email had gone.

    :param data: their field values as stored (JSON by field id)."""
    conn = campaignapi.connect(db)
    with campaignapi.transaction(conn):
        now = conn.sql["now"]
        conn.executemany(
            "INSERT INTO recipient (datasource, email, data, status, confirm_sent, created, "
            f"updated) VALUES (?, ?, ?, ?, CASE WHEN ? = 'unconfirmed' THEN {now} END, "
            f"{now}, {now})",
            ((datasource, f"{prefix}{i}@example.com", data, status, status) for i in range(n)))
        ids = [row[0] for row in conn.execute(
            "SELECT id FROM recipient WHERE datasource = ? ORDER BY id", (datasource,))]
    conn.close()
    return ids


def plain_inserts(conn, copies, inserts):
    """Seconds one transaction takes to run ``inserts`` (SQL; ``{now}`` the
    engine's time) into empty copies ``TABLE_copy`` of the tables of
    ``copies`` (``{table: [CREATE INDEX on the copy]}``): a baseline."""
    for table, indexes in copies.items():
        conn.execute(f"CREATE TABLE {table}_copy AS SELECT * FROM {table} WHERE (1 = 0)")
        for index in indexes:
            conn.execute(index)
    now = conn.sql["now"]
    started = time.perf_counter()
    with campaignapi.transaction(conn):
        for sql in inserts:
            conn.execute(sql.format(now=now))
    return time.perf_counter() - started


#: A newsletter's html: three links to track, the unsubscribe link not.
LINKS_HTML = ("<html><body><p>Hello {{email}}</p><p><a href='https://shop.example/sale'>Sale</a> "
              "<a href='https://shop.example/new?who={{email}}'>New</a> "
              "<a href='https://blog.example/post'>Blog</a></p>"
              "<a href='{{unsubscribe_url}}'>x</a></body></html>")


def build_campaign(api, datasource, html="<p>Hello {{email}}</p><a href='{{unsubscribe_url}}'>x</a>",
                   text="Hello {{email}} {{unsubscribe_url}}", tracking=0):
    profile = api("PUT", "/accountprofile/0", name="bench", fromname="Bench",
                  fromaddress="bench@example.com")["id"]
    message = api("PUT", "/message/0", name="m", subject="Hello {{email}}",
                  fromaddress="bench@example.com", html=html, text=text)["id"]
    segment = api("PUT", "/segment/0", name="everyone", datasources=[int(datasource)])["id"]
    campaign = api("PUT", "/campaign/0", name="bench", accountprofile=int(profile),
                   tracking=tracking)["id"]
    api("PUT", f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    return campaign


# ---------------------------------------------------------------------------
# The benchmarks (each runs in a child process)
# ---------------------------------------------------------------------------

def bench_import(args, tmp):
    rows = make_rows(args.rows)
    upload = rows_csv(rows)
    encoded = base64.b64encode(upload).decode("ascii")
    body = json.dumps({"name": "bench", "originalfile": "bench.csv",
                       "__uploadtype__": "base64", "__uploaddata__": encoded}).encode()
    del encoded
    # Baseline: the same rows, parsed in advance, in one executemany into a
    # table of the same shape with the same unique index.
    parsed = []
    for email, *values in rows:
        address = campaignapi._normalize_email(email)
        if address:
            parsed.append((1, address, json.dumps(dict(zip(map(str, range(2, 7)), values)))))
    del rows
    if DB != "sqlite":
        baseline = _copy_baseline(tmp, parsed)
    else:
        baseline = _sqlite_baseline(tmp, parsed)
    n_parsed = len(parsed)
    del parsed

    body_path = os.path.join(tmp, "body.json")
    with open(body_path, "wb") as f:
        f.write(body)
    del body, upload
    # The import itself in a fresh process: its peak RSS is the request's,
    # not that of the rows generated here.
    measured = _child("import-api", args, body=body_path)
    return {
        "rows": args.rows, "seconds": measured["seconds"],
        "rows_per_s": round(args.rows / measured["seconds"]),
        "baseline_seconds": round(baseline, 2), "baseline_rows_per_s": round(n_parsed / baseline),
        "ratio": round(baseline / measured["seconds"], 2),
        **{name: measured[name] for name in ("inserted", "skipped", "upload_mb", "peak_rss_mb",
                                             "rss_before_mb", "rss_ratio")},
    }


def _copy_baseline(tmp, parsed):
    """Seconds of a raw COPY of the rows (repeats left out in advance) into a
    table of the same shape and unique index as recipient."""
    import psycopg

    unique = list({row[1].lower(): row for row in parsed}.values())
    with psycopg.connect(new_db(tmp, "baseline"), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS citext")
        conn.execute("CREATE TABLE recipient (id BIGINT GENERATED BY DEFAULT AS IDENTITY "
                     "PRIMARY KEY, datasource BIGINT NOT NULL, email citext NOT NULL, "
                     "data TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'active', created TEXT, "
                     "updated TEXT, UNIQUE (datasource, email))")
        now = campaignapi._now()
        started = time.perf_counter()
        with conn.transaction(), conn.cursor().copy(
                "COPY recipient (datasource, email, data, created, updated) FROM STDIN") as copy:
            for datasource, email, data in unique:
                copy.write_row((datasource, email, data, now, now))
        return time.perf_counter() - started


def _sqlite_baseline(tmp, parsed):
    base = sqlite3.connect(os.path.join(tmp, "baseline.db"), isolation_level=None)
    base.execute("PRAGMA journal_mode=WAL")
    base.execute("PRAGMA synchronous=NORMAL")
    base.execute("CREATE TABLE recipient (id INTEGER PRIMARY KEY, datasource INTEGER NOT NULL, "
                 "email TEXT NOT NULL COLLATE NOCASE, data TEXT NOT NULL, status TEXT NOT NULL "
                 "DEFAULT 'active', created TEXT, updated TEXT, UNIQUE (datasource, email))")
    started = time.perf_counter()
    base.execute("BEGIN")
    base.executemany("INSERT INTO recipient (datasource, email, data, created, updated) "
                     "VALUES (?, ?, ?, datetime('now'), datetime('now')) "
                     "ON CONFLICT (datasource, email) DO UPDATE SET data = excluded.data", parsed)
    base.execute("COMMIT")
    baseline = time.perf_counter() - started
    base.close()
    return baseline


def bench_import_api(args, tmp):
    """The measured half of the import benchmark: one PUT of the body file."""
    upload_mb = os.path.getsize(args.body) / 2**20
    db, app, api = new_service(tmp, max_body=2**31)
    datasource = api("PUT", "/datasource/0", name="bench")["id"]
    rss_before = peak_rss_mb()
    with open(args.body, "rb") as f:  # a file, as waitress hands a large body over
        started = time.perf_counter()
        status, envelope = wsgi_call(app, "PUT", f"/v1/datasource/{datasource}/import/0",
                                     headers=api.headers, body_file=f)
        elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"import failed: {status} {envelope}")
    peak = peak_rss_mb()
    record = api("GET", f"/datasource/{datasource}/import/{envelope['data']['id']}")["import"]
    return {"seconds": round(elapsed, 2), "inserted": int(record["inserted"]),
            "skipped": int(record["skipped"]), "upload_mb": round(upload_mb, 1),
            "peak_rss_mb": round(peak, 1), "rss_before_mb": round(rss_before, 1),
            "rss_ratio": round(peak / upload_mb, 2)}


def bench_queue(args, tmp):
    db, app, api = new_service(tmp)
    datasource = api("PUT", "/datasource/0", name="bench")["id"]
    fill_recipients(db, int(datasource), args.rows)
    campaign = build_campaign(api, datasource)
    api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
    started = time.perf_counter()
    campaignapi.process_due(db)
    elapsed = time.perf_counter() - started
    conn = campaignapi.connect(db)
    queued = conn.execute("SELECT count(*) FROM outbox WHERE kind = 'campaign'").fetchone()[0]
    # Baseline: one INSERT ... SELECT of the same rows into an outbox-shaped table.
    baseline = plain_inserts(conn, {"outbox": [
        "CREATE UNIQUE INDEX outbox_copy_once ON outbox_copy(batch, to_addr)"]}, [
        "INSERT INTO outbox_copy (account, kind, batch, message, recipient, to_addr, status, "
        "created, next_try) SELECT 1, 'campaign', 1, 1, id, email, 'queued', {now}, {now} "
        "FROM recipient"])
    conn.close()
    return {"recipients": args.rows, "queued": queued, "seconds": round(elapsed, 2),
            "baseline_seconds": round(baseline, 2), "ratio": round(baseline / elapsed, 2),
            "peak_rss_mb": round(peak_rss_mb(), 1)}


#: The deliver benchmark's template: a layout with a <style> block, as a
#: real campaign's (inlined once per batch, then filled per recipient).
TEMPLATE_HTML = """<!doctype html><html><head><meta charset="utf-8"><style>
body { margin: 0; background: #f4f1ec; font-family: Georgia, serif; color: #2b2b2b; }
.wrap { max-width: 600px; margin: 0 auto; background: #ffffff; padding: 24px; }
h1 { font-size: 24px; color: #5a3e2b; } p { font-size: 16px; line-height: 1.5; }
.footer { font-size: 12px; color: #666666; border-top: 1px solid #dddddd; }
</style></head><body><div class="wrap"><h1>Bench News</h1>{{content}}
<div class="footer"><p>Bench Ltd, 1 Main Street. <a href="{{unsubscribe_url}}">Unsubscribe</a>
</p></div></div></body></html>"""
TEMPLATE_TEXT = "Bench News\n\n{{content}}\n--\nBench Ltd, 1 Main Street\n"


SINK = """
import asyncio, sys
from aiosmtpd.smtp import SMTP
class Sink:
    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        # Offer PIPELINING as real relays (Postfix, Exim, the mail APIs) do;
        # aiosmtpd reads pipelined commands fine but does not announce it.
        session.host_name = hostname
        return responses[:-1] + ['250-PIPELINING', responses[-1]]
    async def handle_DATA(self, server, session, envelope):
        return '250 OK'
loop = asyncio.new_event_loop()
# reuse_port: several sink processes share the port, the kernel spreads
# the connections over them.
loop.run_until_complete(loop.create_server(lambda: SMTP(Sink(), loop=loop), '127.0.0.1',
                                           int(sys.argv[1]), reuse_port=True))
print('ready', flush=True)
loop.run_forever()
"""


@contextlib.contextmanager
def sink_port(count):
    """The port of ``count`` SMTP sink processes sharing it (SO_REUSEPORT), so
    that a pool's connections are not all served by one Python process."""
    port = free_port()
    sinks = [subprocess.Popen([sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE,
                              text=True) for _ in range(count)]
    try:
        for sink in sinks:
            sink.stdout.readline()
        wait_port(port)
        yield port
    finally:
        for sink in sinks:
            sink.terminate()
            sink.wait(timeout=10)


def timed_delivery(db, port, emails, **options):
    """Seconds deliver() takes to send the ``emails`` queued to the sink at ``port``."""
    started = time.perf_counter()
    counts = campaignapi.deliver(db, smtp=f"127.0.0.1:{port}", **options)
    elapsed = time.perf_counter() - started
    if counts["sent"] != emails:
        raise RuntimeError(f"deliver sent {counts}")
    return elapsed


def bench_deliver(args, tmp):
    with sink_port(args.sinks) as port:
        import smtplib
        from email.message import EmailMessage
        # Baseline: M pre-built messages over one connection.
        messages = []
        for i in range(args.emails):
            m = EmailMessage()
            m["From"], m["To"], m["Subject"] = "bench@example.com", f"user{i}@example.com", "Hi"
            m.set_content(f"Hello user{i}@example.com")
            m.add_alternative(f"<p>Hello user{i}@example.com</p>", subtype="html")
            messages.append((f"user{i}@example.com", m.as_bytes()))

        def baseline(connections):
            """Seconds to send the pre-built messages over ``connections``
            (threads, as deliver's pool)."""
            def send(share):
                with smtplib.SMTP("127.0.0.1", port) as smtp:
                    for to, data in share:
                        smtp.sendmail("bench@example.com", [to], data)

            threads = [threading.Thread(target=send, args=(messages[i::connections],))
                       for i in range(connections)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return time.perf_counter() - started

        def deliver(connections, folder, template=False, workers=1, **campaign_options):
            """Seconds deliver() takes for M queued campaign emails (in a
            template record with ``template``; in ``workers`` processes side
            by side, when more than one)."""
            os.makedirs(folder)
            db, app, api = new_service(folder)
            datasource = api("PUT", "/datasource/0", name="bench")["id"]
            fill_recipients(db, int(datasource), args.emails)
            campaign = build_campaign(api, datasource, **campaign_options)
            if template:
                layout = api("PUT", "/template/0", name="layout", html=TEMPLATE_HTML,
                             text=TEMPLATE_TEXT)["id"]
                api("POST", f"/campaign/{campaign}", defaulttemplate=layout)
            api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
            campaignapi.process_due(db)
            if workers > 1:
                code = ("import sys, json, campaignapi; print(json.dumps(campaignapi.deliver("
                        "sys.argv[1], sys.argv[2])))")
                started = time.perf_counter()
                children = [subprocess.Popen([sys.executable, "-c", code, db, f"127.0.0.1:{port}"],
                                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
                            for _ in range(workers)]
                sent = sum(json.loads(child.communicate()[0])["sent"] for child in children)
                elapsed = time.perf_counter() - started
                if sent != args.emails:
                    raise RuntimeError(f"{workers} workers sent {sent}")
                return elapsed
            return timed_delivery(db, port, args.emails, connections=connections)

        # Rounds of (baseline, 1 connection, 4 connections, baseline over 4):
        # the load of a shared machine changes within seconds, so each ratio
        # is taken within one round and the median round is reported.
        rounds = []
        for number in range(args.rounds):
            times = {"base": baseline(1), "c1": deliver(1, os.path.join(tmp, f"{number}c1")),
                     "c1t": deliver(1, os.path.join(tmp, f"{number}c1t"), template=True),
                     "c4": deliver(4, os.path.join(tmp, f"{number}c4")), "base4": baseline(4),
                     "w2": deliver(1, os.path.join(tmp, f"{number}w2"), workers=2),
                     "links": deliver(1, os.path.join(tmp, f"{number}l"), html=LINKS_HTML),
                     "tracked": deliver(1, os.path.join(tmp, f"{number}t"), html=LINKS_HTML,
                                        tracking=1)}
            rounds.append(times)
        rounds.sort(key=lambda t: t["base"] / t["c1"])
        times = rounds[len(rounds) // 2]
        figures = {"emails": args.emails, "rounds": args.rounds, "sinks": args.sinks,
                   "baseline_seconds": round(times["base"], 2),
                   "baseline_per_s": round(args.emails / times["base"]),
                   "sink_4_connections_per_s": round(args.emails / times["base4"]),
                   "c1_ratios": [round(t["base"] / t["c1"], 2) for t in rounds],
                   "c4_ratios": sorted(round(t["base"] / t["c4"], 2) for t in rounds),
                   "template_ratios": [round(t["c1"] / t["c1t"], 2) for t in rounds]}
        for name in ("c1", "c1t", "c4", "w2"):
            figures[f"{name}_seconds"] = round(times[name], 2)
            figures[f"{name}_per_s"] = round(args.emails / times[name])
            figures[f"{name}_ratio"] = round(times["base"] / times[name], 2)
        figures["tracked_seconds"] = round(times["tracked"], 2)
        figures["untracked_seconds"] = round(times["links"], 2)
        figures["tracked_ratios"] = sorted(round(t["links"] / t["tracked"], 2) for t in rounds)
        figures["tracked_ratio"] = round(times["links"] / times["tracked"], 2)
        # With a template against without, in the same round.
        figures["template_ratio"] = round(times["c1"] / times["c1t"], 2)
        figures["peak_rss_mb"] = round(peak_rss_mb(), 1)
        return figures


#: The rates benchmark's domains, and a rate per domain no delivery reaches.
RATE_DOMAINS, UNBINDING_RATE = 50, "100000/s"


def bench_rates(args, tmp):
    """M campaign emails to recipients of 50 domains delivered over one
    connection with per-domain rates on (every domain's rate far above what
    is sent: none binds) vs without, the same work in the same round."""
    with sink_port(args.sinks) as port:
        def deliver(folder, **pace):
            os.makedirs(folder)
            db, app, api = new_service(folder)
            datasource = int(api("PUT", "/datasource/0", name="bench")["id"])
            conn = campaignapi.connect(db)
            with campaignapi.transaction(conn):
                conn.executemany(
                    "INSERT INTO recipient (datasource, email, data) VALUES (?, ?, '{}')",
                    ((datasource, f"user{i}@d{i % RATE_DOMAINS}.example")
                     for i in range(args.emails)))
            conn.close()
            campaign = build_campaign(api, datasource)
            api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
            campaignapi.process_due(db)
            return timed_delivery(db, port, args.emails, **pace)

        rounds = []
        for number in range(args.rounds):
            rounds.append({"off": deliver(os.path.join(tmp, f"{number}off")),
                           "on": deliver(os.path.join(tmp, f"{number}on"),
                                         domain_rates={"*": UNBINDING_RATE})})
        rounds.sort(key=lambda t: t["off"] / t["on"])
        times = rounds[len(rounds) // 2]
        return {"emails": args.emails, "domains": RATE_DOMAINS, "rounds": args.rounds,
                "off_seconds": round(times["off"], 2), "on_seconds": round(times["on"], 2),
                "off_per_s": round(args.emails / times["off"]),
                "on_per_s": round(args.emails / times["on"]),
                "ratio": round(times["off"] / times["on"], 2),
                "ratios": [round(t["off"] / t["on"], 2) for t in rounds],
                "peak_rss_mb": round(peak_rss_mb(), 1)}


def bench_automations(args, tmp):
    """The three scale figures of automations (issue 26), each against a
    baseline of the same run:

    - a date trigger matching N recipients: enabling it (verify, N runs
      started) and the worker's advance_runs() queueing every first email,
      vs one INSERT ... SELECT of N rows into a run-shaped and N into an
      outbox-shaped table.  Target (at 1M, SQLite): <= 10 s.
    - the worker's idle tick (advance_runs() as the worker calls it) with
      those N runs waiting and not due, vs the same tick on the same
      database before any run existed.  Target: < 10 ms.
    - runs advancing through a send step (runs/s of the first figure's
      advance) vs the outbox draining campaign emails to an SMTP sink
      (deliver() of min(N, --emails) emails over one connection).
      Target: ratio >= 0.5.
    """
    db, app, api = new_service(tmp)
    datasource = api("PUT", "/datasource/0", name="bench",
                     fields=[{"name": "joined", "type": "date"}])["id"]
    conn = campaignapi.connect(db)
    field = conn.execute("SELECT id FROM field WHERE name = 'joined'").fetchone()[0]
    conn.close()
    today = time.strftime("%Y-%m-%d", time.gmtime())
    fill_recipients(db, int(datasource), args.rows, data=json.dumps({str(field): today}))
    profile = api("PUT", "/accountprofile/0", name="bench", fromaddress="bench@example.com")["id"]
    messages = [api("PUT", "/message/0", name=f"m{n}", subject=f"Hello {n} {{{{email}}}}",
                    text="Hello {{email}} {{unsubscribe_url}}")["id"] for n in (1, 2)]
    automation = api("PUT", "/automation/0", name="bench", datasource=int(datasource),
                     accountprofile=int(profile),
                     trigger={"type": "date", "field": "joined", "days": 0},
                     steps=[{"send": int(messages[0])}, {"wait": "1d"},
                            {"send": int(messages[1])}])["id"]

    def ticks(count=50):
        """Milliseconds of the worker's idle tick: the median of ``count``."""
        times = []
        for _ in range(count):
            started = time.perf_counter()
            if campaignapi.advance_runs(db):
                raise RuntimeError("the idle tick found due runs")
            times.append((time.perf_counter() - started) * 1000)
        return round(sorted(times)[len(times) // 2], 3)

    idle_empty_ms = ticks()
    started = time.perf_counter()
    api("POST", f"/automation/{automation}", enabled="1")
    enabled = time.perf_counter() - started
    started = time.perf_counter()
    advanced = campaignapi.advance_runs(db, rounds=10_000)
    advance = time.perf_counter() - started
    conn = campaignapi.connect(db)
    queued = conn.execute("SELECT count(*) FROM outbox WHERE kind = 'automation'").fetchone()[0]
    waiting = conn.execute("SELECT count(*) FROM automation_run WHERE status = 'waiting' "
                           "AND step = 2").fetchone()[0]
    if queued != args.rows or waiting != args.rows:
        raise RuntimeError(f"{queued} emails queued, {waiting} runs waiting of {args.rows}")
    idle_ms = ticks()
    # Baseline: the rows the trigger and its first step must write, written plainly.
    baseline = plain_inserts(conn, {"automation_run": [], "outbox": []}, [
        "INSERT INTO automation_run_copy (automation, recipient, step, status, due, paused, "
        "started, history) SELECT 1, id, 2, 'waiting', {now}, 0, {now}, '[]' FROM recipient",
        "INSERT INTO outbox_copy (account, kind, prepared, recipient, to_addr, status, created, "
        "next_try) SELECT 1, 'automation', 1, id, email, 'queued', {now}, {now} FROM recipient"])
    conn.close()
    # The outbox draining campaign emails, as the deliver benchmark sends them.
    emails = min(args.rows, args.emails)
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE,
                            text=True)
    try:
        sink.stdout.readline()
        wait_port(port)
        folder = os.path.join(tmp, "drain")
        os.makedirs(folder)
        drain_db, _, drain_api = new_service(folder)
        people = drain_api("PUT", "/datasource/0", name="drain")["id"]
        fill_recipients(drain_db, int(people), emails)
        campaign = build_campaign(drain_api, people)
        drain_api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
        campaignapi.process_due(drain_db)
        started = time.perf_counter()
        counts = campaignapi.deliver(drain_db, smtp=f"127.0.0.1:{port}")
        drain = time.perf_counter() - started
        if counts["sent"] != emails:
            raise RuntimeError(f"deliver sent {counts}")
    finally:
        sink.terminate()
        sink.wait(timeout=10)
    runs_per_s = args.rows / advance
    return {"rows": args.rows, "recipients": args.rows, "runs_advanced": advanced,
            "enable_seconds": round(enabled, 2), "advance_seconds": round(advance, 2),
            "seconds": round(enabled + advance, 2), "baseline_seconds": round(baseline, 2),
            "ratio": round(baseline / (enabled + advance), 2),
            "idle_tick_ms": idle_ms, "idle_tick_empty_ms": idle_empty_ms,
            "runs_per_s": round(runs_per_s), "drain_emails": emails,
            "drain_per_s": round(emails / drain),
            "advance_ratio": round(runs_per_s / (emails / drain), 2),
            "peak_rss_mb": round(peak_rss_mb(), 1)}


SERVER = """
import sys, json, logging, bottle, waitress
sys.path.insert(0, sys.argv[4])
logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # "Task queue depth" per request
import campaignapi
mode, db, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode in ("api", "signup", "public"):
    # Published where it listens, as `serve` sets public_url.  The sign-up
    # burst comes from one client address: no per-client limit.  "public":
    # the during-import server, which takes a big import's body.
    app = campaignapi.create_app(db, public_url=f"http://127.0.0.1:{port}", **(
        {"signup_rate": 0} if mode == "signup" else {}), **(
        {"signup_rate": 0, "max_body": 2**31} if mode == "public" else {}))
else:
    # The same JSON the API answers, from a bare route.
    body = open(sys.argv[5], "rb").read()
    app = bottle.Bottle()
    @app.get("/v1/campaign/<id>")
    def campaign(id):
        bottle.response.content_type = "application/json"
        return body
waitress.serve(app, host="127.0.0.1", port=port, threads=8, _quiet=True)
"""


#: The CPUs of a load run: the server on one, wrk on the other, so that the
#: client never takes the server's core (with a Python client on two shared
#: cores the API measured 0.42 of bare; the client was half the load).
SERVER_CPU, CLIENT_CPU = 0, 1
WRK_MISSING = ("wrk is needed for this benchmark (Debian/Ubuntu: apt-get install wrk); "
               "it is the load client of the api and tracking benchmarks")


def pinned(cpu, command):
    """``command`` run on ``cpu`` alone (taskset), where there are two CPUs
    to pin to; unpinned otherwise."""
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2:
        return ["taskset", "-c", str(cpu)] + command
    return command


def start_server(script, *argv):
    """A WSGI server process (``script`` run with ``argv``), pinned to the
    server's CPU, its log quiet."""
    return subprocess.Popen(pinned(SERVER_CPU, [sys.executable, "-c", script, *map(str, argv)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _processes_under(parent):
    """The pids whose parent is ``parent`` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # "pid (name) state ppid ...": the name may hold spaces.
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent:
                    children.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return children


class database_pinned:
    """On PostgreSQL with a local server: its processes on the server's CPU
    while the load runs (the server side is the app and its database, as
    SQLite's is in the app's process), so that they do not take wrk's core;
    back on every CPU after.  Nothing on SQLite or a server elsewhere."""

    def __enter__(self):
        self.pids = []
        if DB == "sqlite" or not pinned(SERVER_CPU, []):
            return self
        conn = campaignapi.connect(DB)
        try:
            data = conn.execute("SHOW data_directory").fetchone()[0]
            with open(os.path.join(data, "postmaster.pid")) as f:
                postmaster = int(f.readline())
        except (OSError, ValueError, RuntimeError):
            return self   # not on this machine: nothing to pin
        finally:
            conn.close()
        self.pids = [postmaster, *_processes_under(postmaster)]
        self._set({SERVER_CPU})
        return self

    def _set(self, cpus):
        for pid in self.pids:
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError:   # ended meanwhile
                pass

    def __exit__(self, *exc):
        self._set(os.sched_getaffinity(0))


_DURATION = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text):
    """Milliseconds of a wrk duration (``850.00us``, ``3.85ms``, ``1.02s``, ``2.00m``)."""
    number = text.rstrip("umsh")
    return float(number) * _DURATION[text[len(number):]]


def parse_wrk(text):
    """The figures of ``wrk --latency`` output: requests/s, p50 and p99 in
    ms, requests, and errors (non-2xx/3xx answers plus socket errors:
    connect, read, write, timeout)."""
    import re

    if "requests in" not in text:
        raise RuntimeError(f"wrk gave no figures: {text.strip()[:300]}")
    figures = {"rps": round(float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))),
               "requests": int(re.search(r"(\d+) requests in", text).group(1))}
    for percent in (50, 99):
        figures[f"p{percent}_ms"] = round(_ms(re.search(
            rf"^\s+{percent}%\s+(\S+)", text, re.M).group(1)), 2)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                        text)
    figures["non_2xx"] = int(non_2xx.group(1)) if non_2xx else 0
    figures["socket_errors"] = sum(map(int, sockets.groups())) if sockets else 0
    figures["errors"] = figures["non_2xx"] + figures["socket_errors"]
    return figures


def _load(url, headers, seconds, connections=16):
    """``wrk -t1 -c16 --latency`` on the client's CPU against ``url``: its
    figures (parse_wrk)."""
    if not shutil.which("wrk"):
        raise RuntimeError(WRK_MISSING)
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"]
    for name, value in headers.items():
        command += ["-H", f"{name}: {value}"]
    done = subprocess.run(pinned(CLIENT_CPU, command + [url]), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"wrk failed: {done.stdout[-300:]} {done.stderr[-300:]}")
    return parse_wrk(done.stdout)


def bench_api(args, tmp):
    db, app, api = new_service(tmp)
    campaign = api("PUT", "/campaign/0", name="bench", accountprofile=1)["id"]
    status, envelope = wsgi_call(app, "GET", f"/v1/campaign/{campaign}", headers=api.headers)
    answer = os.path.join(tmp, "campaign.json")
    with open(answer, "w") as f:
        json.dump(envelope, f, separators=(",", ":"))
    servers, urls = [], {}
    try:
        for mode in ("bare", "api"):
            port = free_port()
            servers.append(start_server(SERVER, mode, db, port, ROOT, answer))
            wait_port(port)
            urls[mode] = f"http://127.0.0.1:{port}/v1/campaign/{campaign}"
            _load(urls[mode], api.headers, 1)  # warm up
        # Rounds of (bare, api), as for deliver: the ratio is taken within a
        # round, and the median round is reported.
        with database_pinned() as pin:
            rounds = [{mode: _load(urls[mode], api.headers, args.seconds) for mode in urls}
                      for _ in range(args.rounds)]
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)
    rounds.sort(key=lambda r: r["api"]["rps"] / r["bare"]["rps"])
    figures = rounds[len(rounds) // 2]
    return {"rps": figures["api"]["rps"], "baseline_rps": figures["bare"]["rps"],
            "ratio": round(figures["api"]["rps"] / figures["bare"]["rps"], 2),
            "ratios": [round(r["api"]["rps"] / r["bare"]["rps"], 2) for r in rounds],
            "p50_ms": figures["api"]["p50_ms"], "p99_ms": figures["api"]["p99_ms"],
            "baseline_p50_ms": figures["bare"]["p50_ms"],
            "baseline_p99_ms": figures["bare"]["p99_ms"],
            "errors": figures["api"]["errors"], "baseline_errors": figures["bare"]["errors"],
            "pinned": pinned(0, []) != [], "database_pinned": bool(pin.pids)}


def tracked_batch(db, recipients, events, campaign=None):
    """A sent, tracked batch of ``recipients`` emails with ``events``
    statistics events over 48 hours, all made by SQL (setup, not measured):
    ``(campaign, batch)``.  Of the events 70% are opens and 20% clicks on
    five links; the rest unsubscribes, bounces and complaints."""
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):
            account = campaignapi._account_for(conn, "bench@example.com")
            if campaign is None:
                campaign = conn.execute("INSERT INTO campaign (owner, accountprofile, name, "
                                        "tracking) VALUES (?, 1, 'bench', 1)", (account,)).lastrowid
            batch = conn.execute(
                "INSERT INTO batch (campaign, timestamp, status, recipients, tracking) "
                "VALUES (?, '2026-01-01 09:00:00', 'sent', ?, 1)", (campaign, recipients)).lastrowid
            conn.execute("INSERT INTO batch_message (batch, message, subject, html, text) "
                         "VALUES (?, 1, 's', ?, '')", (batch, LINKS_HTML))
            conn.executemany("INSERT INTO batch_link (batch, message, link, url) VALUES (?, 1, ?, ?)",
                             [(batch, i, f"https://shop.example/{i}") for i in range(5)])
            first = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM outbox").fetchone()[0]
            # Spread over 48 hours, as text in the one format of both engines.
            when = ("datetime('2026-01-01 09:00:00', '+' || (i % 48) || ' hours', "
                    "'+' || (i % 3600) || ' seconds')" if DB == "sqlite" else
                    "to_char(timestamp '2026-01-01 09:00:00' + (i % 48) * interval '1 hour' "
                    "+ (i % 3600) * interval '1 second', 'YYYY-MM-DD HH24:MI:SS')")
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ? - 1) "
                "INSERT INTO outbox (id, account, kind, batch, message, recipient, to_addr, status, "
                "created, next_try, sent) SELECT ? + i, ?, 'campaign', ?, 1, i, "
                "'user' || i || '@example.com', CASE WHEN i % 100 = 0 THEN 'failed' ELSE 'sent' "
                "END, '2026-01-01 09:00:00', '2026-01-01 09:00:00', '2026-01-01 09:00:00' FROM n",
                (recipients, first, account, batch))
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 0 WHERE ? > 0 UNION ALL SELECT i + 1 FROM n "
                "WHERE i < ? - 1) INSERT INTO event (account, kind, campaign, batch, outbox, email, link, created) "
                "SELECT ?, CASE WHEN i % 10 < 7 THEN 'open' WHEN i % 10 < 9 THEN 'click' "
                "WHEN i % 30 = 9 THEN 'unsubscribe' WHEN i % 30 = 19 THEN 'bounce' "
                "ELSE 'complaint' END, ?, ?, ? + (CAST(i AS BIGINT) * 7919) % ?, "
                "'user' || ((CAST(i AS BIGINT) * 7919) % ?) || '@example.com', "
                "CASE WHEN i % 10 IN (7, 8) THEN i % 5 END, "
                f"{when} FROM n",
                (events, events, account, campaign, batch, first, recipients, recipients))
        conn.execute("ANALYZE")
        return campaign, batch
    finally:
        conn.close()


def bench_archive(args, tmp):
    db, app, api = new_service(tmp)
    recipients, events = args.rows, int(args.rows * 0.3)
    started = time.perf_counter()
    campaign, batch = tracked_batch(db, recipients, events)
    setup = time.perf_counter() - started
    figures = {"recipients": recipients, "events": events, "setup_seconds": round(setup, 1)}
    for name, path in (("archive", f"/campaign/{campaign}/archive/{campaign}"),
                       ("batcharchive", f"/campaign/{campaign}/batcharchive/{batch}")):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            record = api("GET", path)[name]
            times.append(time.perf_counter() - started)
        if int(record["recipients"]) != recipients or int(record["opens"]) != events * 7 // 10:
            raise RuntimeError(f"wrong figures: {record}")
        figures[f"{name}_seconds"] = round(sorted(times)[1], 3)   # the median of three
    figures["opened"], figures["clicks"] = record["opened"], record["clicks"]
    figures["timeline_hours"] = len(record["timeline"])
    figures.update(public_pages(db, app, api, campaign, batch))
    figures["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return figures


def public_pages(db, app, api, campaign, batch):
    """The pages of section 21 over the big batch, each against a baseline of
    the same run: a report link's statistics page (no key) against the
    archive record it is read from (the same figures), and the public
    archive's page of a datasource the batch mailed against the index (the
    cheapest answer): it reads batch_datasource, not the batch's outbox."""
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):
            owner = conn.execute("SELECT owner FROM campaign WHERE id = ?", (campaign,)).fetchone()[0]
            datasource = conn.execute("INSERT INTO datasource (owner, name, signup, fromprofile) "
                                      "VALUES (?, 'bench', 1, 1)", (owner,)).lastrowid
            conn.execute("UPDATE campaign SET public = 1 WHERE id = ?", (campaign,))
            conn.execute("INSERT INTO batch_datasource (datasource, batch) VALUES (?, ?)",
                         (datasource, batch))
    finally:
        conn.close()
    report = urllib.parse.urlsplit(api("GET", f"/campaign/{campaign}/archive/{campaign}")
                                   ["archive"]["reporturl"]).path

    def median(method, path, headers=None):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            status, _ = wsgi_call(app, method, path, headers=headers, raw=True)
            times.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"{path}: {status}")
        return round(sorted(times)[1], 5)

    figures = {"report_seconds": median("GET", report),
               "report_baseline_seconds": median("GET", f"/v1/campaign/{campaign}/archive/"
                                                 f"{campaign}", api.headers),
               "public_archive_seconds": median("GET", f"/v1/archive/{datasource}"),
               "public_archive_baseline_seconds": median("GET", "/v1/")}
    figures["report_ratio"] = round(figures["report_seconds"]
                                    / max(figures["report_baseline_seconds"], 1e-6), 2)
    return figures


TRACKING_SERVER = """
import sys, logging, signal, bottle, waitress
sys.path.insert(0, sys.argv[3])
logging.getLogger("waitress.queue").setLevel(logging.ERROR)
# SIGTERM as a normal exit, as README's Decisions ask of an embedding server:
# the opens and clicks held behind their answers are written at the exit.
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
import campaignapi
db, port = sys.argv[1], int(sys.argv[2])
# One server: the API mounted beside bare routes that answer the same GIF and
# the same redirect with nothing behind them; the API published where it is mounted.
app = bottle.Bottle()
app.mount("/api/", campaignapi.create_app(db, public_url=f"http://127.0.0.1:{port}/api"))
@app.get("/bare/open/<token>")
def bare_open(token):
    return bottle.HTTPResponse(campaignapi._GIF_PIXEL, 200, {
        "Content-Type": "image/gif", "Cache-Control": "no-store, max-age=0"})
@app.get("/bare/click/<token>")
def bare_click(token):
    return bottle.HTTPResponse(status=302, headers={"Location": "https://shop.example/0"})
waitress.serve(app, host="127.0.0.1", port=port, threads=8, _quiet=True)
"""


def _fire(url, count, connections=4):
    """Send ``count`` GETs of ``url`` over keep-alive connections; seconds taken."""
    import http.client
    host, port = url.split("/")[2].split(":")
    path = "/" + url.split("/", 3)[3]

    def send(share):
        conn = http.client.HTTPConnection(host, int(port))
        for _ in range(share):
            conn.request("GET", path)
            conn.getresponse().read()
        conn.close()

    threads = [threading.Thread(target=send, args=(count // connections,))
               for _ in range(connections)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def bench_tracking(args, tmp):
    db, app, api = new_service(tmp)
    campaign = api("PUT", "/campaign/0", name="bench", accountprofile=1)["id"]
    _, batch = tracked_batch(db, 1000, 0, campaign=int(campaign))
    conn = campaignapi.connect(db)
    secret = campaignapi._stored_secret(conn)
    email = conn.execute("SELECT min(id) FROM outbox WHERE batch = ?", (batch,)).fetchone()[0]
    conn.close()
    port = free_port()
    server = start_server(TRACKING_SERVER, db, port, ROOT)
    base = f"http://127.0.0.1:{port}"
    urls = {"open": f"{base}/api/v1/open/{campaignapi.sign_token(secret, 'open', email)}",
            "click": f"{base}/api/v1/click/{campaignapi.sign_token(secret, 'click', email, 0)}",
            "bare_open": f"{base}/bare/open/x", "bare_click": f"{base}/bare/click/x",
            "campaign": f"{base}/api/v1/campaign/{campaign}"}
    figures = {}
    pin = database_pinned().__enter__()   # the whole load: see database_pinned
    try:
        wait_port(port)
        for url in urls.values():
            _load(url, api.headers, 1)  # warm up
        for kind in ("open", "click"):
            rounds = []
            for _ in range(args.rounds):
                rounds.append({"bare": _load(urls["bare_" + kind], {}, args.seconds),
                               "api": _load(urls[kind], {}, args.seconds)})
            rounds.sort(key=lambda r: r["api"]["rps"] / r["bare"]["rps"])
            middle = rounds[len(rounds) // 2]
            figures[f"{kind}_rps"] = middle["api"]["rps"]
            figures[f"{kind}_baseline_rps"] = middle["bare"]["rps"]
            figures[f"{kind}_p50_ms"] = middle["api"]["p50_ms"]
            figures[f"{kind}_p99_ms"] = middle["api"]["p99_ms"]
            figures[f"{kind}_baseline_p50_ms"] = middle["bare"]["p50_ms"]
            figures[f"{kind}_baseline_p99_ms"] = middle["bare"]["p99_ms"]
            figures[f"{kind}_ratios"] = [round(r["api"]["rps"] / r["bare"]["rps"], 2)
                                         for r in rounds]
            figures[f"{kind}_ratio"] = round(middle["api"]["rps"] / middle["bare"]["rps"], 2)
            figures[f"{kind}_errors"] = middle["api"]["errors"]
        # The API's p99 alone, then while 10,000 opens arrive as fast as
        # four connections send them.
        figures["api_p99_ms_alone"] = _load(urls["campaign"], api.headers, args.seconds)["p99_ms"]
        opens = {}
        thread = threading.Thread(target=lambda: opens.update(
            seconds=_fire(urls["open"], 10_000)))
        thread.start()
        during = _load(urls["campaign"], api.headers, args.seconds)
        thread.join()
        figures["api_p99_ms_during_opens"] = during["p99_ms"]
        figures["api_rps_during_opens"] = during["rps"]
        figures["opens_seconds"] = round(opens["seconds"], 2)
        figures["database_pinned"] = bool(pin.pids)
    finally:
        pin.__exit__()
        server.terminate()
        server.wait(timeout=10)
    # Counted after the server stopped: opens written behind their answers
    # are in by then (the interpreter's exit writes what an app holds).
    conn = campaignapi.connect(db)
    figures["opens_counted"] = conn.execute(
        "SELECT count(*) FROM event WHERE kind = 'open'").fetchone()[0]
    conn.close()
    return figures


def percentile(values, percent):
    """The nearest-rank percentile of ``values`` (the smallest value with at
    least ``percent`` % of them at or below it); None of none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, -(-len(ordered) * percent // 100) - 1)]


def _latencies(seconds_list):
    return {f"p{p}_ms": round(percentile(seconds_list, p) * 1000, 2) for p in (50, 99)}


def bench_signup(args, tmp):
    import http.client
    db, app, api = new_service(tmp)
    profile = api("PUT", "/accountprofile/0", name="list", fromaddress="list@example.com")["id"]
    datasource = api("PUT", "/datasource/0", name="list", signup=1, fromprofile=int(profile),
                     fields=[{"name": "first", "type": "text"}])["id"]
    campaign = api("PUT", "/campaign/0", name="bench", accountprofile=int(profile))["id"]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, "signup", db, str(port), ROOT])
    try:
        wait_port(port)

        def reads(stop):
            conn, seen, statuses = http.client.HTTPConnection("127.0.0.1", port), [], []
            while not stop.is_set():
                started = time.perf_counter()
                conn.request("GET", f"/v1/campaign/{campaign}", headers=api.headers)
                response = conn.getresponse()
                response.read()
                seen.append(time.perf_counter() - started)
                statuses.append(response.status)
            return seen, statuses

        def timed_reads(seconds):
            stop = threading.Event()
            timer = threading.Timer(seconds, stop.set)
            timer.start()
            return reads(stop)

        timed_reads(1)  # warm up
        alone, _ = timed_reads(3)
        results, statuses, lock = {}, [], threading.Lock()
        stop = threading.Event()
        reader = threading.Thread(target=lambda: results.update(during=reads(stop)))
        numbers = iter(range(args.signups))

        def sign_up():
            conn, mine = http.client.HTTPConnection("127.0.0.1", port), []
            while True:
                with lock:
                    number = next(numbers, None)
                if number is None:
                    break
                conn.request("POST", f"/v1/subscribe/{datasource}", body=json.dumps(
                    {"email": f"person{number}@example.com", "first": f"P{number}"}),
                    headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                mine.append(response.status)
            with lock:
                statuses.extend(mine)

        clients = [threading.Thread(target=sign_up) for _ in range(8)]
        reader.start()
        started = time.perf_counter()
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        seconds = time.perf_counter() - started
        stop.set()
        reader.join()
    finally:
        server.terminate()
        server.wait(timeout=10)
    during, read_statuses = results["during"]
    stored = campaignapi.connect(db).execute(
        "SELECT count(*) FROM recipient WHERE status = 'unconfirmed'").fetchone()[0]
    return {"signups": args.signups, "seconds": round(seconds, 2),
            "signups_per_s": round(args.signups / seconds), "stored": stored,
            "errors": sum(status != 200 for status in statuses),
            "server_errors": sum(status >= 500 for status in statuses + read_statuses),
            "reads": len(during), **_latencies(during),
            **{f"alone_{k}": v for k, v in _latencies(alone).items()}}


# Transactional email: from the request to the relay, idle and under load ----

def bench_transactional(args, tmp):
    """Seconds from PUT /v1/transactional/0 to the relay's acceptance of its
    email, with a worker running: idle, then while a campaign of --emails
    emails is being delivered.  And a create with an Idempotency-Key vs
    without, in alternating rounds."""
    from aiosmtpd.controller import Controller

    accepted, lock = {}, threading.Lock()

    class Sink:
        async def handle_DATA(self, server, session, envelope):
            with lock:
                for address in envelope.rcpt_tos:
                    accepted[address] = time.perf_counter()
            return "250 OK"

    def campaign_accepted():
        # Under the sink's lock: its thread adds addresses while this counts.
        with lock:
            return sum(a.startswith("user") for a in accepted)

    port = free_port()
    sink = Controller(Sink(), hostname="127.0.0.1", port=port)
    sink.start()
    db, app, api = new_service(tmp)
    message = api("PUT", "/message/0", name="reset", subject="Reset your password, {{name}}",
                  fromaddress="shop@example.com",
                  text="Hi {{name}}, reset it at {{reset_url}}")["id"]
    datasource = api("PUT", "/datasource/0", name="bench")["id"]
    fill_recipients(db, int(datasource), args.emails)
    campaign = build_campaign(api, datasource)
    stop = threading.Event()
    worker = threading.Thread(target=campaignapi.run_worker, args=(db, stop, f"127.0.0.1:{port}"),
                              daemon=True)
    worker.start()

    def latencies(label, count, pause):
        """Send ``count`` transactional emails ``pause`` seconds apart; the
        seconds each took to reach the relay."""
        sent = {}
        for number in range(count):
            address = f"{label}{number}@example.org"
            sent[address] = time.perf_counter()
            api("PUT", "/transactional/0", to=address, message=int(message),
                data={"name": f"N{number}", "reset_url": "https://shop.example/r"})
            time.sleep(pause)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(a in accepted for a in sent):
            time.sleep(0.005)
        with lock:
            return [accepted[a] - t for a, t in sent.items() if a in accepted], \
                sum(a not in accepted for a in sent)

    try:
        time.sleep(1)   # the worker's threads are up and idle
        idle, idle_lost = latencies("idle", 20, 0.3)
        api("PUT", f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
        campaignapi.process_due(db)
        wait_until = time.monotonic() + 60
        while time.monotonic() < wait_until and not campaign_accepted():
            time.sleep(0.01)
        campaign_started = campaign_accepted()
        loaded, loaded_lost = latencies("load", 30, 0.1)
        campaign_done_at_end = campaign_accepted()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and campaign_accepted() < args.emails:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(60)
        sink.stop()

    # Keyed vs unkeyed creates, alternating rounds of 100.
    headers = dict(api.headers)
    body = json.dumps({"name": "m", "subject": "s", "text": "t"}).encode()
    times = {"plain": 0.0, "keyed": 0.0}
    for round_number in range(5):
        for kind in ("plain", "keyed"):
            started = time.perf_counter()
            for number in range(100):
                extra = {"Idempotency-Key": f"k-{round_number}-{number}"} if kind == "keyed" else {}
                status, _ = wsgi_call(app, "PUT", "/v1/message/0", body, {**headers, **extra})
                if status != 200:
                    raise RuntimeError(f"create answered {status}")
            times[kind] += time.perf_counter() - started
    conn = campaignapi.connect(db)
    kept = conn.execute("SELECT count(*) FROM idempotency_key").fetchone()[0]
    conn.close()
    if kept != 500:
        raise RuntimeError(f"{kept} answers kept for 500 keyed creates")
    return {"emails": args.emails, "small_scale": args.emails < 100_000,
            "idle": {**_latencies(idle), "max_ms": round(max(idle) * 1000, 2),
                     "count": len(idle), "lost": idle_lost},
            "loaded": {**_latencies(loaded), "max_ms": round(max(loaded) * 1000, 2),
                       "count": len(loaded), "lost": loaded_lost},
            "campaign_sent_before": campaign_started, "campaign_sent_after": campaign_done_at_end,
            "campaign_in_flight": campaign_done_at_end < args.emails,
            "keyed_creates_per_s": round(500 / times["keyed"]),
            "plain_creates_per_s": round(500 / times["plain"]),
            "keyed_ratio": round(times["plain"] / times["keyed"], 2)}


# During an import: the public routes, open-loop --------------------------

#: The five public writes a big import must not stall, and what each answers.
PUBLIC_ROUTES = ("open", "click", "unsubscribe", "signup", "confirm")
PUBLIC_EXPECTED = {"open": 200, "click": 302, "unsubscribe": 200, "signup": 200, "confirm": 200}
#: Writes with a key that must wait for one chunk of an import at most (issue 31).
KEYED_ROUTES = ("campaign_create", "campaign_change", "recipient_create")
PUBLIC_EXPECTED.update(dict.fromkeys(KEYED_ROUTES, 200))


def latencies_from_due(dues, ends):
    """Each request's latency counted from when it was DUE, not from when it
    was sent: a client held up by a stalled server (or by its own lateness)
    still counts the whole wait (no coordinated omission)."""
    return [end - due for due, end in zip(dues, ends)]


def latency_figures(seconds):
    """p50, p99 and max of latencies in seconds, in ms."""
    if not seconds:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {**_latencies(seconds), "max_ms": round(max(seconds) * 1000, 2)}


async def _public_request(port, raw, due):
    """One request on a connection of its own: (due, end, status, sent)."""
    import asyncio

    status, sent = None, time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 60)
        try:
            writer.write(raw)
            status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
            await asyncio.wait_for(reader.read(), 60)   # the answer, to the close
        finally:
            writer.close()
    except (OSError, ValueError, IndexError, asyncio.TimeoutError):
        pass
    return due, time.perf_counter(), status, sent


async def _open_loop(port, requests, rate, done):
    """Fire each route's requests at ``rate`` a second each, on a schedule
    that does not wait for answers (open loop), until ``done`` is set;
    {route: [(due, end, status, sent)]}; the start time is ``done.started``."""
    import asyncio

    started = done.started = time.perf_counter()

    async def route(number, name):
        tasks, i = [], 0
        while not done.is_set():
            # The routes take turns within each 1/rate: not all at once.
            due = started + (i + number / len(requests)) / rate
            await asyncio.sleep(max(0, due - time.perf_counter()))
            tasks.append(asyncio.ensure_future(_public_request(port, requests[name](i), due)))
            i += 1
        return name, await asyncio.gather(*tasks)

    return dict(await asyncio.gather(*(route(n, name) for n, name in enumerate(requests))))


async def _warm_up(port, requests):
    for name in requests:
        for i in (-1, -2, -3):
            await _public_request(port, requests[name](i), time.perf_counter())


def _raw(method, path, body=b"", content_type="application/json", auth=None):
    key = f"Authorization: {auth}\r\n" if auth else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{key}"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _keyed_setup(api):
    """Writes with a key that an import must not hold up beyond one chunk
    (issue 31): {route: i -> raw request}, and the ids to count effects by."""
    auth = api.headers["Authorization"]
    profile = api("PUT", "/accountprofile/0", name="keyed", fromaddress="keyed@example.com")["id"]
    keyed = api("PUT", "/datasource/0", name="keyed")["id"]
    changed = api("PUT", "/campaign/0", name="changed", accountprofile=int(profile))["id"]
    body = lambda **params: json.dumps(params).encode()  # noqa: E731
    requests = {
        "campaign_create": lambda i: _raw("PUT", "/v1/campaign/0", body(
            name=f"keyed{i}", accountprofile=int(profile)), auth=auth),
        "campaign_change": lambda i: _raw("POST", f"/v1/campaign/{changed}", body(
            description=f"change {i}"), auth=auth),
        "recipient_create": lambda i: _raw("PUT", f"/v1/datasource/{keyed}/recipient/0", body(
            email=f"keyed{i}@example.net"), auth=auth),
    }
    return requests, {"keyed": int(keyed)}


def _public_setup(db, api):
    """What the public routes need: a tracked, sent batch (opens, clicks),
    recipients to unsubscribe, a sign-up list and unconfirmed sign-ups to
    confirm; {route: i -> raw request} and the ids to count effects by."""
    profile = api("PUT", "/accountprofile/0", name="list", fromaddress="list@example.com")["id"]
    people = api("PUT", "/datasource/0", name="people")["id"]
    signups = api("PUT", "/datasource/0", name="list", signup=1, fromprofile=int(profile))["id"]
    campaign = api("PUT", "/campaign/0", name="news", accountprofile=int(profile),
                   tracking=1)["id"]
    _, batch = tracked_batch(db, 1000, 0, campaign=int(campaign))
    # Enough of each for 15 minutes at 20/s: every write names a row of its own.
    many = 20_000
    readers = fill_recipients(db, int(people), many, prefix="reader")
    waiting = fill_recipients(db, int(signups), many, prefix="waiting", status="unconfirmed")
    conn = campaignapi.connect(db)
    secret = campaignapi._stored_secret(conn)
    emails = [row[0] for row in conn.execute("SELECT id FROM outbox WHERE batch = ? ORDER BY id",
                                             (batch,))]
    conn.close()
    sign, expires = campaignapi.sign_token, campaignapi._today() + campaignapi._CONFIRM_DAYS
    requests = {
        "open": lambda i: _raw("GET", "/v1/open/" + sign(secret, "open", emails[i % 1000])),
        "click": lambda i: _raw("GET", "/v1/click/" + sign(secret, "click", emails[i % 1000],
                                                           i % 5)),
        "unsubscribe": lambda i: _raw("POST", "/v1/unsubscribe/" + sign(
            secret, "unsubscribe", int(campaign), readers[i % many]),
            b"List-Unsubscribe=One-Click", "application/x-www-form-urlencoded"),
        "signup": lambda i: _raw("POST", f"/v1/subscribe/{signups}",
                                 json.dumps({"email": f"signup{i}@example.net"}).encode()),
        "confirm": lambda i: _raw("POST", "/v1/confirm/" + sign(secret, "confirm",
                                                                waiting[i % many], expires)),
    }
    return requests, {"people": int(people), "signups": int(signups), "many": many}


def _public_effects(db, datasource, ids):
    """What the public writes and the import left in the database."""
    conn = campaignapi.connect(db)
    try:
        one = lambda sql, *params: conn.execute(sql, params).fetchone()[0]  # noqa: E731
        return {
            "open": one("SELECT count(*) FROM event WHERE kind = 'open'"),
            "click": one("SELECT count(*) FROM event WHERE kind = 'click'"),
            "unsubscribe": one("SELECT count(*) FROM recipient WHERE datasource = ? "
                               "AND status = 'unsubscribed'", ids["people"]),
            "signup": one("SELECT count(*) FROM recipient WHERE datasource = ? "
                          "AND email LIKE 'signup%'", ids["signups"]),
            "confirm": one("SELECT count(*) FROM recipient WHERE datasource = ? "
                           "AND email LIKE 'waiting%' AND status = 'active'", ids["signups"]),
            "imported": one("SELECT count(*) FROM recipient WHERE datasource = ?", datasource),
            "campaign_create": one("SELECT count(*) FROM campaign WHERE name LIKE 'keyed%'"),
            "recipient_create": one("SELECT count(*) FROM recipient WHERE datasource = ?",
                                    ids["keyed"]),
        }
    finally:
        conn.close()


def expected_effects(answered, many):
    """What the answered requests must have left: each open and click an
    event, each unsubscribe, sign-up and confirm a row of its own (the
    i-th request names row i modulo ``many``).  ``answered``: {route:
    [i of each request answered as expected]}."""
    counts = {name: len(answered.get(name, ())) for name in ("open", "click")}
    for name in ("unsubscribe", "confirm"):
        counts[name] = len({i % many for i in answered.get(name, ())})
    counts["signup"] = len(set(answered.get("signup", ())))
    for name in ("campaign_create", "recipient_create"):
        counts[name] = len(set(answered.get(name, ())))
    return counts


#: The import's upload, in a process of its own: in the client's process its
#: sending took turns at the GIL with the open-loop client, which then sent
#: requests up to 170 ms late.
IMPORT_CLIENT = """
import http.client, json, os, sys, time
port, path, body_path, auth = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600, blocksize=1 << 20)
started = time.perf_counter()
with open(body_path, "rb") as body:
    conn.request("PUT", path, body=body, headers={
        "Authorization": auth, "Content-Type": "application/json",
        "Content-Length": str(os.path.getsize(body_path))})
    answer = conn.getresponse()
    envelope = json.loads(answer.read())
print(json.dumps({"status": answer.status, "seconds": time.perf_counter() - started,
                  "envelope": envelope}))
"""


def _http_import(port, headers, datasource, body_path):
    """One PUT of the import body over HTTP: (seconds, import record id)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_CLIENT, str(port),
                           f"/v1/datasource/{datasource}/import/0", body_path,
                           headers["Authorization"]], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the import client failed: {done.stderr[-2000:]}")
    answer = json.loads(done.stdout)
    if answer["status"] != 200:
        raise RuntimeError(f"the import failed: {answer['status']} {answer['envelope']}")
    return answer["seconds"], answer["envelope"]["data"]["id"]


def bench_during_import(args, tmp):
    """The five public routes at --public-rate each, open-loop, for the whole
    of a --rows import over HTTP; then every write they answered must be in
    the database within 30 s, and the import whole."""
    import asyncio

    body_path = os.path.join(tmp, "body.json")
    upload_mb = write_import_body(body_path, args.rows)
    db, app, api = new_service(tmp)
    datasource = api("PUT", "/datasource/0", name="import")["id"]
    requests, ids = _public_setup(db, api)
    keyed, keyed_ids = _keyed_setup(api)
    ids.update(keyed_ids)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, "public", db, str(port), ROOT],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        # Warm up (the first requests of a process are slow): requests -1 to
        # -3 of each route, which name rows of their own, before the figures.
        asyncio.run(_warm_up(port, {**requests, **keyed}))
        # The baseline of the writes with a key: the same load of them for
        # a few seconds alone, no import (their rows -1000000 on: their own).
        alone = threading.Event()
        threading.Timer(3.0, alone.set).start()
        baseline = asyncio.run(_open_loop(port, {name: (lambda i, make=make: make(i - 1_000_000))
                                                 for name, make in keyed.items()},
                                          args.public_rate, alone))
        requests.update(keyed)
        before = _public_effects(db, int(datasource), ids)
        done, imported = threading.Event(), {}

        def run_import():
            try:
                imported["seconds"], imported["id"] = _http_import(port, api.headers,
                                                                   datasource, body_path)
            except Exception as error:  # reported below, after the load stops
                imported["error"] = error
            finally:
                imported["ended"] = time.perf_counter()
                done.set()

        importer = threading.Thread(target=run_import)
        importer.start()
        results = asyncio.run(_open_loop(port, requests, args.public_rate, done))
        importer.join()
        if "error" in imported:
            raise imported["error"]
        record = api("GET", f"/datasource/{datasource}/import/{imported['id']}")["import"]
        figures = {"rows": args.rows, "upload_mb": round(upload_mb, 1),
                   "import_seconds": round(imported["seconds"], 2),
                   "inserted": int(record["inserted"]), "rate": args.public_rate}
        answered = {}
        for name, outcomes in results.items():
            good = [i for i, (_, _, status, _) in enumerate(outcomes)
                    if status == PUBLIC_EXPECTED[name]]
            answered[name] = good
            latencies = latencies_from_due([o[0] for o in outcomes], [o[1] for o in outcomes])
            worst = max(range(len(outcomes)), key=latencies.__getitem__, default=None)
            figures[name] = {
                "requests": len(outcomes), "errors": len(outcomes) - len(good),
                **latency_figures(latencies),
                # Where the worst one fell (seconds after the import began),
                # and how late the client itself sent any (its own share).
                "worst_at_s": None if worst is None else round(outcomes[worst][0] - done.started, 2),
                "client_late_max_ms": round(max((o[3] - o[0] for o in outcomes), default=0)
                                            * 1000, 2)}
        for name, outcomes in baseline.items():
            figures[name]["alone"] = latency_figures(latencies_from_due(
                [o[0] for o in outcomes], [o[1] for o in outcomes]))
            figures[name]["alone"]["errors"] = sum(
                status != PUBLIC_EXPECTED[name] for _, _, status, _ in outcomes)
        # When the slow ones were due (seconds after the import began): a
        # stall of the server shows as one window across all five routes.
        slow = sorted(round(due - done.started, 2) for outcomes in results.values()
                      for due, end, _, _ in outcomes if end - due > 0.1)
        figures["over_100ms"] = {"count": len(slow), "first_due_s": slow[0] if slow else None,
                                 "last_due_s": slow[-1] if slow else None}
        expected = {name: before[name] + count for name, count in {
            **expected_effects(answered, ids["many"]), "imported": figures["inserted"]}.items()}
        # The intake applies what waited for the import's lock after it:
        # poll up to 30 s from the import's end.
        while True:
            seen = _public_effects(db, int(datasource), ids)
            waited = time.perf_counter() - imported["ended"]
            if seen == expected or waited > 30:
                break
            time.sleep(0.5)
        figures.update(effects_expected=expected, effects_seen=seen,
                       effects_ok=seen == expected, effects_seconds=round(waited, 1))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return figures


def bench_hosts(args, tmp):
    """Two ``serve`` and two ``worker`` processes on one PostgreSQL database,
    one worker SIGKILLed at a quarter of the send (not restarted)."""
    import collections
    import signal

    from aiosmtpd.controller import Controller

    if DB == "sqlite":
        raise RuntimeError("the hosts benchmark needs --db postgresql")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from clihelpers import served
    from helpers import HttpApi, start_worker, stop_process

    received, total = collections.Counter(), [0]

    class Counting:
        async def handle_DATA(self, server, session, envelope):
            received.update(envelope.rcpt_tos)   # in the sink's one thread
            total[0] += 1
            return "250 OK"

    port = free_port()
    sink = Controller(Counting(), hostname="127.0.0.1", port=port)
    sink.start()
    n = args.hosts_recipients
    addresses = [f"host{i}@example.org" for i in range(n)]
    db = new_db(tmp)
    # Two hosts behind one address, as a deployment publishes them: the
    # servers and the workers build their links from the same public URL.
    public = ("--public-url", PUBLIC_URL)
    try:
        with served("--db", db, "--email", "bench@example.com", *public, cwd=tmp) as first, \
                served("--db", db, *public, cwd=tmp) as second:
            one = HttpApi(f"http://127.0.0.1:{first.port}", first.secret)
            two = HttpApi(f"http://127.0.0.1:{second.port}", first.secret)
            ds = one.put("/datasource/0", name="hosts")["id"]
            started = time.perf_counter()
            two.put(f"/datasource/{ds}/import/0", name="i", originalfile="i.csv",
                    __uploadtype__="csv", __uploaddata__="email\n" + "\n".join(addresses))
            imported = time.perf_counter() - started
            api = lambda method, path, **params: one.call(method, path, params or None)  # noqa
            campaign = build_campaign(api, ds)
            started = time.perf_counter()
            two.put(f"/campaign/{campaign}/send/0", timestamp="2000-01-01 00:00:00")
            workers = [start_worker(db, f"127.0.0.1:{port}", *public) for _ in range(2)]
            try:
                while total[0] < n // 4:
                    time.sleep(0.01)
                workers[0].send_signal(signal.SIGKILL)
                workers[0].wait(30)
                killed = time.perf_counter()
                conn = campaignapi.connect(db)
                try:
                    while conn.execute("SELECT count(*) FROM outbox WHERE status IN "
                                       "('queued', 'sending')").fetchone()[0]:
                        if time.perf_counter() - killed > 600:
                            raise RuntimeError("the outbox did not drain")
                        time.sleep(0.2)
                    done = time.perf_counter()
                    failed = conn.execute("SELECT count(*) FROM outbox WHERE status = 'failed'"
                                          ).fetchone()[0]
                    sizes = {table: conn.execute("SELECT pg_total_relation_size(?)",
                                                 (table,)).fetchone()[0]
                             for table in ("outbox", "event", "hook_delivery", "recipient")}
                finally:
                    conn.close()
            finally:
                for worker in workers:
                    stop_process(worker)
        twice = sum(1 for count in received.values() if count > 1)
        lost = n - len(set(received) & set(addresses)) - failed
        if twice or lost > 0 or failed > 1:
            raise RuntimeError(f"hosts: {twice} got two emails, {lost} none, {failed} failed")
        return {"recipients": n, "import_seconds": round(imported, 2),
                "send_seconds": round(done - started, 2),
                "emails_per_s": round(n / (done - started)),
                "drained_after_kill_seconds": round(done - killed, 1),
                "twice": twice, "lost": max(lost, 0), "failed_in_flight": failed,
                "bytes_per_email": {table: round(size / n) for table, size in sizes.items()}}
    finally:
        sink.stop()


# Scale: each step at N/10 and N, how it grows -------------------------------

SCALE_STEPS = ("import", "segment", "structure", "verify", "queue", "archive")
#: Faster than this growth over x10 rows, a step's statements and plans are printed.
GROWTH_LIMIT = 12.5


def growth(small, large):
    """large / small (x10 rows: 10 is linear, less is better); None where
    either is missing or the small one took no measurable time."""
    if small is None or large is None or small <= 0:
        return None
    return round(large / small, 1)


class StatementTimes:
    """Seconds each SQL statement spends in execute, while on; the ones in
    flight (a step that does not finish is stuck in one)."""

    def __init__(self):
        self.totals, self.running, self.lock = {}, {}, threading.Lock()

    def install(self):
        """Wrap the connections' execute and executemany, both engines."""
        for cls in (campaignapi._SqliteConnection, campaignapi._PgCursor):
            for method in ("execute", "executemany"):
                setattr(cls, method, self._timed(getattr(cls, method), method == "execute"))

    def _timed(self, original, keep_params):
        def timed(this, sql, params=()):
            key = threading.get_ident()
            started = time.perf_counter()
            # executemany's rows are not kept: its plan is not explained.
            shown = params if keep_params else None
            self.running[key] = (sql, shown, started)
            try:
                return original(this, sql, params)
            finally:
                del self.running[key]
                with self.lock:
                    calls, seconds, _ = self.totals.get(sql, (0, 0.0, None))
                    self.totals[sql] = (calls + 1, seconds + time.perf_counter() - started, shown)
        return timed

    def top(self, db, count=3):
        """The statements that took longest (those in flight first), each
        with its plan on a connection of its own."""
        now = time.perf_counter()
        rows = [{"sql": sql, "params": params, "calls": 1, "seconds": now - started,
                 "in_flight": True} for sql, params, started in list(self.running.values())]
        with self.lock:
            ordered = sorted(self.totals.items(), key=lambda item: -item[1][1])
        rows += [{"sql": sql, "params": params, "calls": calls, "seconds": seconds,
                  "in_flight": False} for sql, (calls, seconds, params) in ordered[:count]]
        conn = campaignapi.connect(db)
        try:
            for row in rows:
                row["plan"] = explain(conn, row["sql"], row.pop("params"))
                row["seconds"] = round(row["seconds"], 3)
                row["sql"] = " ".join(row["sql"].split())[:600]
        finally:
            conn.close()
        return rows


def explain(conn, sql, params):
    """The plan of a statement as lines: EXPLAIN QUERY PLAN (SQLite) or
    EXPLAIN (PostgreSQL)."""
    if params is None or not sql.lstrip().upper().startswith(
            ("SELECT", "WITH", "INSERT", "UPDATE", "DELETE")):
        return []
    try:
        if conn.engine == "sqlite":
            return [f"{row[1]}->{row[0]} {row[3]}" for row in
                    conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
        return [row[0] for row in conn.execute("EXPLAIN " + sql, params)]
    except Exception as error:  # a plan that cannot be had is said, not fatal
        return [f"(no plan: {str(error).splitlines()[0][:200]})"]


def _scale_step_parts(name, db, state, rows, body):
    """(setup, measured) of one scale step: callables; ``measured`` returns
    {figure: seconds} and may set more in ``state``."""
    app = campaignapi.create_app(db, max_body=2**31, public_url=PUBLIC_URL)
    api = Client(app, state["secret"]) if "secret" in state else None

    def timed(method, path):
        started = time.perf_counter()
        api(method, path)
        return time.perf_counter() - started

    if name == "import":
        def setup():
            state["secret"] = campaignapi.create_key(db, "bench@example.com")
            state["datasource"] = Client(app, state["secret"])(
                "PUT", "/datasource/0", name="bench")["id"]

        def measured():
            client = Client(app, state["secret"])
            with open(body, "rb") as f:
                started = time.perf_counter()
                status, envelope = wsgi_call(app, "PUT", f"/v1/datasource/{state['datasource']}/"
                                             "import/0", headers=client.headers, body_file=f)
                seconds = time.perf_counter() - started
            if status != 200:
                raise RuntimeError(f"import failed: {status} {envelope}")
            return {"seconds": seconds}
        return setup, measured
    if name == "segment":
        def setup():
            ds = [int(state["datasource"])]
            state["everyone"] = api("PUT", "/segment/0", name="everyone", datasources=ds)["id"]
            state["berlin"] = api("PUT", "/segment/0", name="berlin", datasources=ds, conditions=[
                {"field": "city", "op": "eq", "value": "Berlin"}])["id"]
            # The worker's step that makes the index of the condition's field
            # (it runs after a segment is saved; made once, not measured here).
            started = time.perf_counter()
            # internal: the worker's step, run here at once instead of by a worker
            campaignapi._index_conditioned_fields(db)
            state["index_seconds"] = round(time.perf_counter() - started, 2)

        def measured():
            return {"seconds": timed("GET", f"/segment/{state['everyone']}"),
                    "with_condition_seconds": timed("GET", f"/segment/{state['berlin']}"),
                    "index_seconds": state["index_seconds"]}
        return setup, measured
    if name in ("structure", "verify"):
        def setup():
            if "campaign" in state:
                return
            campaign = build_campaign(api, state["datasource"])
            message = api("PUT", "/message/0", name="berlin", subject="Hallo {{email}}",
                          fromaddress="bench@example.com", html="<p>Hallo</p><a href="
                          "'{{unsubscribe_url}}'>x</a>", text="Hallo {{unsubscribe_url}}")["id"]
            api("PUT", f"/campaign/{campaign}/message/0", segment=int(state["berlin"]),
                message=int(message))
            state["campaign"] = campaign

        def measured():
            path = f"/campaign/{state['campaign']}/{name}/0"
            first = timed("GET", path)
            # verify again: the emails' SpamAssassin scores are kept, so this
            # is verify without SpamAssassin's start (a fixed cost of seconds).
            return {"seconds": first, "again_seconds": timed("GET", path)} \
                if name == "verify" else {"seconds": first}
        return setup, measured
    if name == "queue":
        def setup():
            api("PUT", f"/campaign/{state['campaign']}/send/0", timestamp="2000-01-01 00:00:00")

        def measured():
            started = time.perf_counter()
            campaignapi.process_due(db)
            return {"seconds": time.perf_counter() - started}
        return setup, measured
    if name == "archive":
        def setup():
            state["archive"] = tracked_batch(db, rows, int(rows * 0.3))

        def measured():
            campaign, batch = state["archive"]
            whole = timed("GET", f"/campaign/{campaign}/archive/{campaign}")
            return {"seconds": whole, "batch_seconds": timed(
                "GET", f"/campaign/{campaign}/batcharchive/{batch}")}
        return setup, measured
    raise ValueError(name)


def bench_scale_step(args, tmp):
    """One scale step on the scale run's database: its setup, then the
    measured part in a thread given --step-limit seconds; on timeout the
    statements in flight and their plans, and this process ends."""
    with open(args.scale_state) as f:
        state = json.load(f)
    setup, measured = _scale_step_parts(args.step, args.scale_db, state, args.rows, args.body)
    setup()
    rss_before = peak_rss_mb()
    times = StatementTimes()
    times.install()
    outcome = {}

    def run():
        try:
            outcome.update(measured())
        except Exception as error:  # reported as the step's failure
            outcome["error"] = f"{type(error).__name__}: {error}"

    started = time.perf_counter()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(args.step_limit)
    spent = time.perf_counter() - started
    figures = {"rows": args.rows, "peak_rss_mb": round(peak_rss_mb(), 1),
               "rss_before_mb": round(rss_before, 1),
               "finished": not worker.is_alive() and "error" not in outcome,
               "limit": worker.is_alive(),   # stopped by --step-limit
               **{k: round(v, 3) if isinstance(v, float) else v for k, v in outcome.items()}}
    if figures["limit"]:
        figures["seconds"] = round(spent, 1)   # at least this long
        if args.scale_db.startswith("postgresql"):
            _cancel_others(args.scale_db)
    figures["statements"] = times.top(args.scale_db)
    with open(args.scale_state, "w") as f:
        json.dump(state, f)
    if figures["limit"]:
        print("FIGURES " + json.dumps(figures), flush=True)
        os._exit(0)   # the stuck statement's thread cannot be joined
    return figures


def _cancel_others(db):
    """Cancel the statements still running on ``db`` (a step that did not
    finish), so they do not load the machine for the next step."""
    conn = campaignapi.connect(db)
    try:
        conn.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    finally:
        conn.close()


def bench_scale(args, tmp):
    """Every scale step at N/10 then N (a database each), each step in a
    process of its own (its peak RSS its own), each limited to
    --step-limit seconds."""
    sizes = {"small": args.rows // 10, "large": args.rows}
    figures = {"rows": args.rows, "step_limit": args.step_limit}
    for size, rows in sizes.items():
        db = new_db(tmp, f"scale{rows}")
        state_path, body = os.path.join(tmp, f"state{rows}.json"), os.path.join(tmp, "body.json")
        with open(state_path, "w") as f:
            json.dump({}, f)
        upload_mb = write_import_body(body, rows)
        for step in SCALE_STEPS:
            before = figures.get(f"{step}_small")
            if size == "large" and before is not None and before.get("limit"):
                # Ten times the rows will not finish in the time the tenth did not.
                figures[f"{step}_large"] = {"finished": False, "skipped": True, "seconds": None,
                                            "error": "not run: it did not finish at N/10"}
                continue
            started = time.perf_counter()
            try:
                result = _child("scale-step", args, body=body, extra=[
                    "--step", step, "--scale-db", db, "--scale-state", state_path,
                    "--rows", str(rows)], timeout=args.step_limit * 4 + 600)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                result = {"finished": False, "error": str(error)[-500:],
                          "seconds": round(time.perf_counter() - started, 1)}
            if step == "import":
                result["upload_mb"] = round(upload_mb, 1)
                result["rss_ratio"] = round(result.get("peak_rss_mb", 0) / upload_mb, 2)
                os.remove(body)
            figures[f"{step}_{size}"] = result
            print(f"  scale {step:9} {rows:>10,} rows: " + (
                f"{result.get('seconds')} s" if result.get("finished") else
                f"did not finish ({result.get('seconds')} s)" if result.get("limit") else
                f"FAILED after {result.get('seconds')} s") +
                f", peak RSS {result.get('peak_rss_mb')} MB", file=sys.stderr, flush=True)
            if step == "import" and not result.get("finished"):
                break   # nothing to measure on a database without the rows
    for step in SCALE_STEPS:
        small, large = figures.get(f"{step}_small", {}), figures.get(f"{step}_large", {})
        # A step stopped by the limit at N grew at least this much; a failed one: no figure.
        figures[f"{step}_growth"] = growth(
            small.get("seconds") if small.get("finished") else None,
            large.get("seconds") if large.get("finished") or large.get("limit") else None)
        figures[f"{step}_growth_at_least"] = bool(large.get("limit"))
    return figures


def bench_abtest(args, tmp):
    """An A/B test of two subjects on a --rows batch, 20 % tested: the
    winner's queueing to the other 80 % (the worker's choice, one
    transaction) against a plain batch of as many recipients queued in the
    same run; and the choice itself (each version's rate from the event
    table) against the floor: the same counts of emails sent and opened, not
    per version."""
    db, app, api = new_service(tmp)
    datasource = api("PUT", "/datasource/0", name="bench")["id"]
    fill_recipients(db, int(datasource), args.rows)
    plain = build_campaign(api, datasource)
    api("PUT", f"/campaign/{plain}/send/0", timestamp="2000-01-01 00:00:00")
    started = time.perf_counter()
    campaignapi.process_due(db)
    baseline = time.perf_counter() - started
    tested = build_campaign(api, datasource, tracking=1)
    variant = api("PUT", "/message/0", name="b", subject="Hi {{email}}",
                  html="<p>Hi</p><a href='{{unsubscribe_url}}'>x</a>", text="Hi {{unsubscribe_url}}")
    link = api("GET", f"/campaign/{tested}/message/all")["message"][0]
    api("POST", f"/campaign/{tested}/message/{link['id']}", segmentmessageid=int(link["id"]),
        variants=[int(variant["id"])])
    batch = int(api("PUT", f"/campaign/{tested}/send/0", timestamp="2000-01-01 00:00:00")["id"])
    started = time.perf_counter()
    campaignapi.process_due(db)
    make = time.perf_counter() - started
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):   # the test was sent; 25 % of A, 30 % of B open
            conn.execute("UPDATE outbox SET status = 'sent' WHERE batch = ? AND status = 'queued'",
                         (batch,))
            conn.execute(
                "INSERT INTO event (account, kind, campaign, batch, outbox, email, created) "
                "SELECT account, 'open', ?, batch, id, to_addr, created FROM outbox "
                "WHERE batch = ? AND status = 'sent' AND id % 20 < CASE WHEN message = ? "
                "THEN 6 ELSE 5 END", (tested, batch, int(variant["id"])))
            conn.execute("UPDATE batch_test SET due = '2000-01-01 00:00:00' WHERE batch = ?",
                         (batch,))
        conn.execute("ANALYZE")
        versions = json.loads(conn.execute("SELECT versions FROM batch_test WHERE batch = ?",
                                           (batch,)).fetchone()[0])
        choose, count = [], []
        for _ in range(3):   # the median of three of each
            started = time.perf_counter()
            # internal: the choice's own reading of the rates, timed alone
            figures = campaignapi._test_figures(conn, batch, versions, "opens")
            choose.append(time.perf_counter() - started)
            started = time.perf_counter()   # the floor: the same figures, not per version
            conn.execute("SELECT count(*) FROM outbox WHERE batch = ? AND status = 'sent'",
                         (batch,)).fetchone()
            conn.execute("SELECT count(DISTINCT outbox) FROM event WHERE batch = ? "
                         "AND kind IN ('open', 'click')", (batch,)).fetchone()
            count.append(time.perf_counter() - started)
        choose, count = sorted(choose)[1], sorted(count)[1]
        waiting = conn.execute("SELECT count(*) FROM outbox WHERE batch = ? AND status = "
                               "'waiting'", (batch,)).fetchone()[0]
    finally:
        conn.close()
    started = time.perf_counter()
    campaignapi.process_due(db)   # the choice and the winner's queueing, in one transaction
    winner = time.perf_counter() - started
    conn = campaignapi.connect(db)
    try:
        queued, chosen = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'queued'), (SELECT winner FROM batch_test "
            "WHERE batch = ?) FROM outbox WHERE batch = ?", (batch, batch)).fetchone()
    finally:
        conn.close()
    if queued != waiting or chosen != int(variant["id"]):
        raise RuntimeError(f"the winner went wrong: {queued} of {waiting} queued, {chosen} won")
    return {"recipients": args.rows, "tested": sum(f["sent"] for f in figures),
            "rest": waiting, "make_seconds": round(make, 2),
            "winner_seconds": round(winner, 2), "baseline_queue_seconds": round(baseline, 2),
            "winner_ratio": round(baseline / winner, 2), "choose_seconds": round(choose, 3),
            "baseline_count_seconds": round(count, 3),
            "choose_ratio": round(count / choose, 2) if choose else None,
            "peak_rss_mb": round(peak_rss_mb(), 1)}


BENCHES = {"import": bench_import, "queue": bench_queue, "deliver": bench_deliver,
           "api": bench_api, "archive": bench_archive, "tracking": bench_tracking,
           "signup": bench_signup, "hosts": bench_hosts, "during-import": bench_during_import,
           "scale": bench_scale, "transactional": bench_transactional, "abtest": bench_abtest,
           "rates": bench_rates, "automations": bench_automations}
STEPS = {**BENCHES, "import-api": bench_import_api, "scale-step": bench_scale_step}  # what a child process can run

#: Every target, one row a figure: (benchmark, figure, comparison, target,
#: engine, scale, issue).  ``figure`` is the figure's dotted name within its
#: benchmark (as in the JSON line); ``target`` a number, True, or the name of
#: another figure of the benchmark; ``engine`` "sqlite" or "postgresql" when
#: the target is one engine's, else None; ``scale`` (figure, least value) when
#: the target is set at a size (below it the verdict says "small-scale"), else
#: None; ``issue`` the issue that set it.  A benchmark adds its figure's row
#: here and the verdicts, the summary and the JSON line follow.
ONE_MILLION, TEN_MILLION = ("rows", 1_000_000), ("rows", 10_000_000)
TARGETS = [
    ("import", "ratio", ">=", 0.5, "sqlite", ONE_MILLION, 31),
    ("import", "ratio", ">=", 0.6, "postgresql", ONE_MILLION, 31),
    ("import", "rss_ratio", "<=", 4, None, ONE_MILLION, 31),
    ("queue", "seconds", "<=", 10, None, ONE_MILLION, 19),
    ("queue", "ratio", ">=", 0.3, None, None, 19),
    ("deliver", "c1_ratio", ">=", 0.8, None, None, 19),
    ("deliver", "c4_ratio", ">=", 1.5, None, None, 31),
    ("deliver", "tracked_ratio", ">=", 0.9, None, None, 31),
    ("deliver", "template_ratio", ">=", 0.9, None, None, 21),
    ("api", "ratio", ">=", 0.6, "sqlite", None, 19),
    ("api", "ratio", ">=", 0.7, "postgresql", None, 31),
    ("archive", "archive_seconds", "<", 1, None, None, 19),
    ("archive", "batcharchive_seconds", "<", 1, None, None, 19),
    ("archive", "report_ratio", "<=", 1.5, None, None, 21),
    ("archive", "public_archive_seconds", "<", 0.05, None, None, 21),
    *((("tracking", figure, ">=", floor, engine, None, 31) for figure in ("open_ratio",
                                                                           "click_ratio")
       for engine, floor in (("sqlite", 0.8), ("postgresql", 0.6)))),
    ("signup", "errors", "==", 0, None, None, 19),
    ("signup", "server_errors", "==", 0, None, None, 19),
    ("signup", "reads", ">", 0, None, None, 19),
    ("signup", "stored", "==", "signups", None, None, 19),
    *((("during-import", f"{route}.{figure}", op, target, None, ONE_MILLION, 31)
       for route in PUBLIC_ROUTES + KEYED_ROUTES
       for figure, op, target in (("p99_ms", "<", 100), ("errors", "==", 0)))),
    ("during-import", "effects_ok", "==", True, None, ONE_MILLION, 31),
    *((("scale", f"{step}_growth", "<=", GROWTH_LIMIT, "sqlite", TEN_MILLION, 31)
       for step in SCALE_STEPS)),
    ("scale", "import_large.rss_ratio", "<=", 4, "sqlite", TEN_MILLION, 31),
    ("scale", "import_small.rss_ratio", "<=", 4, "sqlite", TEN_MILLION, 31),
    ("scale", "verify_large.seconds", "<", 5, "sqlite", TEN_MILLION, 31),
    ("scale", "segment_large.with_condition_seconds", "<", 2, "sqlite", TEN_MILLION, 31),
    ("hosts", "twice", "==", 0, "postgresql", None, 19),
    ("hosts", "lost", "==", 0, "postgresql", None, 19),
    ("hosts", "failed_in_flight", "<=", 1, "postgresql", None, 19),
    ("transactional", "idle.max_ms", "<", 1000, None, None, 28),
    ("transactional", "idle.lost", "==", 0, None, None, 28),
    ("transactional", "loaded.p99_ms", "<", 2000, None, ("emails", 100_000), 31),
    ("transactional", "loaded.lost", "==", 0, None, None, 28),
    ("transactional", "campaign_in_flight", "==", True, None, None, 28),
    ("transactional", "keyed_ratio", ">=", 0.8, None, None, 31),
    ("abtest", "winner_seconds", "<=", 10, None, ("recipients", 1_000_000), 31),
    ("abtest", "choose_seconds", "<=", 1, None, ("recipients", 1_000_000), 27),
    ("rates", "ratio", ">=", 0.8, None, None, 31),
    ("automations", "seconds", "<=", 10, "sqlite", ONE_MILLION, 31),
    ("automations", "idle_tick_ms", "<", 10, None, ONE_MILLION, 31),
    ("automations", "advance_ratio", ">=", 0.5, None, None, 26),
]

_COMPARE = {"<": operator.lt, "<=": operator.le, "==": operator.eq, ">=": operator.ge,
            ">": operator.gt}


def figure(figures, name):
    """A figure by its dotted name (``loaded.p99_ms``); KeyError when absent."""
    for part in name.split("."):
        figures = figures[part]
    return figures


def engine_targets(engine):
    """The rows of TARGETS that hold on ``engine``."""
    return [row for row in TARGETS if row[4] in (None, engine)]


def verdict(row, figures):
    """``(verdict, value)`` of one target row for a benchmark's figures (None:
    it did not run): 'met' or 'missed' (a benchmark that failed, or a figure
    it could not measure, None, missed), ', small-scale' added below the
    target's size; 'not measured' when it did not run or has no such figure."""
    name, op, target, scale = row[1], row[2], row[3], row[5]
    if figures is None:
        return "not measured", None
    if "error" in figures:
        return "missed", None
    try:
        value = figure(figures, name)
        if isinstance(target, str):
            target = figure(figures, target)
    except KeyError:
        return "not measured", None
    met = value is not None and _COMPARE[op](value, target)
    small = scale is not None and figures.get(scale[0], scale[1]) < scale[1]
    return ("met" if met else "missed") + (", small-scale" if small else ""), value


def verdicts(name, figures, engine):
    """``{figure: (verdict, value)}`` of benchmark ``name``'s targets on ``engine``."""
    return {row[1]: verdict(row, figures) for row in engine_targets(engine) if row[0] == name}


def target_text(row):
    """``deliver.c4_ratio >= 1.5`` (a target as the summary prints it)."""
    return f"{row[0]}.{row[1]} {row[2]} {row[3]}"


def verdict_lines(name, figures, engine, width=100):
    """The lines printed under a benchmark's summary: each figure with a
    target, its value, the target and the verdict."""
    said = [f"{row[1]} {value_text(verdict(row, figures)[1])} ({row[2]} {row[3]}): "
            f"{verdict(row, figures)[0]}"
            for row in engine_targets(engine) if row[0] == name]
    lines, line = [], "         targets:"
    for item in said:
        if len(line) + len(item) + 2 > width and line.strip() != "targets:":
            lines.append(line.rstrip(";"))
            line = "         "
        line += f" {item};"
    return lines + [line.rstrip(";")] if said else []


def value_text(value):
    return "-" if value is None else str(value)


def issue_targets(results, engine):
    """``{"benchmark.figure": verdict}`` of every target on ``engine`` for
    this run's results (``{benchmark: figures}``), as the JSON line keeps them."""
    return {f"{row[0]}.{row[1]}": verdict(row, results.get(row[0]))[0]
            for row in engine_targets(engine)}


def scale_misses(f):
    """What the scale figures miss: a step that did not finish, grew faster
    than GROWTH_LIMIT (linear is 10), used more memory at N than at N/10
    (flat: up to 1.5x + 20 MB; the import up to 4x its upload)."""
    misses = []
    for step in SCALE_STEPS:
        small, large = f.get(f"{step}_small", {}), f.get(f"{step}_large", {})
        if not (small.get("finished") and large.get("finished")):
            failed = small if small.get("error") else large
            misses.append(f"{step} failed" if failed.get("error") and not failed.get("skipped")
                          else f"{step} did not finish" + (" at N/10" if small.get("limit")
                                                           else ""))
            continue
        if f[f"{step}_growth"] is None or f[f"{step}_growth"] > GROWTH_LIMIT:
            misses.append(f"{step} grew x{f[f'{step}_growth']}")
        if step == "import":
            # At every size from 1M rows (issue 31); below, the interpreter's
            # own ~50 MB dwarfs the upload.
            for size, rows in ((small, f.get("rows", 0) // 10), (large, f.get("rows", 0))):
                if rows >= 1_000_000 and size["rss_ratio"] > 4:
                    misses.append(f"import peak RSS {size['rss_ratio']}x the upload at "
                                  f"{rows:,} rows")
        elif large["peak_rss_mb"] > small["peak_rss_mb"] * 1.5 + 20:
            misses.append(f"{step} peak RSS {small['peak_rss_mb']} -> {large['peak_rss_mb']} MB")
    # Issue 31, at ten million rows: the interactive calls in seconds.
    for step, figure, limit in SCALE_SECONDS:
        large = f.get(f"{step}_large", {})
        if f.get("rows", 0) >= 10_000_000 and large.get("finished") and large[figure] >= limit:
            misses.append(f"{step} {figure} {large[figure]} s at {f['rows']:,} rows "
                          f"(target < {limit} s)")
    return misses


#: (step, figure, seconds): what a scale step at ten million rows must stay under.
SCALE_SECONDS = (("verify", "seconds", 5), ("segment", "with_condition_seconds", 2))


def scale_summary(f):
    """A line a step: time at N/10 and N, growth, peak RSS; then the
    statements and plans of the steps that grew too fast or did not finish."""
    lines = [f"scale    {f['rows'] // 10:,} -> {f['rows']:,} rows (x10: linear is 10, less is "
             f"better; step limit {f['step_limit']} s)"]
    slow = []
    for step in SCALE_STEPS:
        small, large = f.get(f"{step}_small", {}), f.get(f"{step}_large", {})

        def shown(r):
            if not r or r.get("skipped"):
                return "not run"
            text = f"{r.get('seconds')} s" + ("" if r.get("finished") else
                                              " DID NOT FINISH" if r.get("limit") else " FAILED")
            extra = {k: r[k] for k in ("with_condition_seconds", "index_seconds",
                                       "again_seconds", "batch_seconds") if k in r}
            return text + (f" {extra}" if extra else "") + f", {r.get('peak_rss_mb')} MB"
        grew = f.get(f"{step}_growth")
        lines.append(f"         {step:9} {shown(small)}  ->  {shown(large)}  growth " + (
            "-" if grew is None else f"x{'>=' if f.get(f'{step}_growth_at_least') else ''}{grew}"))
        if large.get("skipped"):
            slow.append((step, f["rows"] // 10, small))   # stuck at N/10 already
        elif large and (not large.get("finished") or (f.get(f"{step}_growth") or 0) >
                        GROWTH_LIMIT):
            slow.append((step, f["rows"], large))
    for step, rows, large in slow:
        lines.append(f"         {step} at {rows:,} rows: its statements, longest first")
        for statement in large.get("statements", []):
            lines.append(f"           {'IN FLIGHT ' if statement['in_flight'] else ''}"
                         f"{statement['seconds']} s in {statement['calls']} call(s): "
                         f"{statement['sql']}")
            lines += [f"             plan: {line}" for line in statement["plan"]]
        if large.get("error"):
            lines.append(f"           error: {large['error']}")
    misses = scale_misses(f)
    lines.append("         " + ("all steps linear or better, memory flat" if not misses else
                              "missed: " + "; ".join(misses)))
    return "\n".join(lines)


def summary(name, f):
    if name == "scale":
        return scale_summary(f)
    if name == "import":
        return (f"import   {f['rows']:>9,} rows  {f['rows_per_s']:>8,} rows/s  baseline "
                f"{f['baseline_rows_per_s']:,} rows/s  ratio {f['ratio']}  peak RSS "
                f"{f['peak_rss_mb']} MB = {f['rss_ratio']}x upload ({f['upload_mb']} MB)")
    if name == "queue":
        return (f"queue    {f['recipients']:>9,} recipients  {f['seconds']} s  baseline "
                f"{f['baseline_seconds']} s  ratio {f['ratio']}")
    if name == "deliver":
        return (f"deliver  {f['emails']:>9,} emails  1 conn {f['c1_per_s']}/s (ratio "
                f"{f['c1_ratio']})  4 conns {f['c4_per_s']}/s (ratio {f['c4_ratio']})  "
                f"2 workers {f['w2_per_s']}/s  "
                f"baseline {f['baseline_per_s']}/s, over 4 conns "
                f"{f['sink_4_connections_per_s']}/s  tracked {f['tracked_seconds']} s vs "
                f"{f['untracked_seconds']} s (ratio {f['tracked_ratio']})\n"
                f"         with a template, 1 conn {f['c1t_per_s']}/s ({f['template_ratio']} "
                f"of without)")
    if name == "rates":
        return (f"rates    {f['emails']:>9,} emails to {f['domains']} domains, 1 conn: with "
                f"per-domain rates (none binding) {f['on_per_s']}/s, without {f['off_per_s']}/s"
                f"  ratio {f['ratio']} (rounds {f['ratios']}; target >= 0.8)")
    if name == "archive":
        return (f"archive  {f['recipients']:>9,} recipients, {f['events']:,} events  archive "
                f"{f['archive_seconds']} s  batch archive {f['batcharchive_seconds']} s\n"
                f"         report page {f['report_seconds']} s (the record it comes from "
                f"{f['report_baseline_seconds']} s; target <= 1.5x)  public archive page "
                f"{f['public_archive_seconds']} s (index {f['public_archive_baseline_seconds']} "
                f"s; target < 0.05 s)")
    if name == "tracking":
        return (f"tracking open {f['open_rps']:,}/s (bare {f['open_baseline_rps']:,}/s, ratio "
                f"{f['open_ratio']}, p50 {f['open_p50_ms']} ms p99 {f['open_p99_ms']} ms, "
                f"errors {f['open_errors']})  click {f['click_rps']:,}/s (bare "
                f"{f['click_baseline_rps']:,}/s, ratio {f['click_ratio']}, p50 "
                f"{f['click_p50_ms']} ms p99 {f['click_p99_ms']} ms, errors {f['click_errors']})"
                f"\n         API p99 "
                f"{f['api_p99_ms_alone']} ms alone, {f['api_p99_ms_during_opens']} ms while "
                f"10,000 opens arrive (in {f['opens_seconds']} s)")
    if name == "signup":
        return (f"signup   {f['signups']:>9,} sign-ups  {f['signups_per_s']}/s  GET campaign "
                f"during the burst p50 {f['p50_ms']} ms  p99 {f['p99_ms']} ms ({f['reads']} "
                f"reads; alone p50 {f['alone_p50_ms']} ms  p99 {f['alone_p99_ms']} ms)  "
                f"errors {f['errors']}")
    if name == "during-import":
        return "\n".join([
            f"during-import {f['rows']:,} rows imported over HTTP in {f['import_seconds']} s "
            f"({f['inserted']:,} new), meanwhile {f['rate']}/s of each public route, open-loop "
            f"(latency from each request's due time):",
            *(f"         {name:11} {f[name]['requests']:>6} requests  p50 {f[name]['p50_ms']} ms"
              f"  p99 {f[name]['p99_ms']} ms  max {f[name]['max_ms']} ms (at "
              f"{f[name]['worst_at_s']} s; client late <= {f[name]['client_late_max_ms']} ms)  "
              f"errors {f[name]['errors']}" for name in PUBLIC_ROUTES),
            *(f"         {name:16} {f[name]['requests']:>6} requests  p50 {f[name]['p50_ms']} "
              f"ms  p99 {f[name]['p99_ms']} ms  max {f[name]['max_ms']} ms  errors "
              f"{f[name]['errors']}  (alone, no import: p50 {f[name]['alone']['p50_ms']} ms  "
              f"p99 {f[name]['alone']['p99_ms']} ms)" for name in KEYED_ROUTES),
            f"         over 100 ms: {f['over_100ms']['count']} requests, due from "
            f"{f['over_100ms']['first_due_s']} s to {f['over_100ms']['last_due_s']} s after the "
            f"import began",
            f"         effects {'all' if f['effects_ok'] else 'NOT all'} in the database "
            f"{f['effects_seconds']} s after the import: {f['effects_seen']}"
            + ("" if f["effects_ok"] else f" (expected {f['effects_expected']})")])
    if name == "transactional":
        return (f"transactional  request to relay: idle p50 {f['idle']['p50_ms']} ms  p99 "
                f"{f['idle']['p99_ms']} ms  max {f['idle']['max_ms']} ms (target < 1 s); while "
                f"a {f['emails']:,}-email campaign is delivered"
                f"{' (small scale)' if f['small_scale'] else ''} p50 {f['loaded']['p50_ms']} ms"
                f"  p99 {f['loaded']['p99_ms']} ms  max {f['loaded']['max_ms']} ms (target "
                f"p99 < 2 s; campaign {f['campaign_sent_before']:,} -> "
                f"{f['campaign_sent_after']:,} sent meanwhile)\n"
                f"         create with Idempotency-Key {f['keyed_creates_per_s']}/s vs without "
                f"{f['plain_creates_per_s']}/s (ratio {f['keyed_ratio']}; target >= 0.8)")
    if name == "abtest":
        return (f"abtest   {f['recipients']:>9,} recipients, {f['tested']:,} tested  winner to "
                f"the other {f['rest']:,} in {f['winner_seconds']} s (a plain batch of "
                f"{f['recipients']:,} queued in {f['baseline_queue_seconds']} s, ratio "
                f"{f['winner_ratio']}; target <= 10 s at 1M)  choice {f['choose_seconds']} s "
                f"(the same counts not per version {f['baseline_count_seconds']} s; target <= 1 s)  "
                f"test made in {f['make_seconds']} s")
    if name == "automations":
        return (f"automations {f['recipients']:,} recipients of a date trigger: runs started and "
                f"first emails queued in {f['seconds']} s (enable {f['enable_seconds']} s, "
                f"advance {f['advance_seconds']} s; plain inserts {f['baseline_seconds']} s, "
                f"ratio {f['ratio']})\n         idle tick with {f['recipients']:,} waiting runs "
                f"{f['idle_tick_ms']} ms (with none {f['idle_tick_empty_ms']} ms)  runs advance "
                f"{f['runs_per_s']:,}/s vs the outbox draining {f['drain_per_s']:,}/s "
                f"({f['drain_emails']:,} campaign emails, 1 conn): ratio {f['advance_ratio']}")
    if name == "hosts":
        return (f"hosts    {f['recipients']:>9,} recipients  sent in {f['send_seconds']} s "
                f"({f['emails_per_s']}/s) by 2 workers, one killed; drained "
                f"{f['drained_after_kill_seconds']} s after the kill; twice {f['twice']}, "
                f"lost {f['lost']}, failed in flight {f['failed_in_flight']}; bytes per email "
                f"{f['bytes_per_email']}")
    return (f"api      {f['rps']:>9,} req/s  baseline {f['baseline_rps']:,} req/s  ratio "
            f"{f['ratio']} (rounds {f['ratios']})  p50 {f['p50_ms']} ms  p99 {f['p99_ms']} ms "
            f"(bare p50 {f['baseline_p50_ms']} ms  p99 {f['baseline_p99_ms']} ms)  errors "
            f"{f['errors']}  wrk -t1 -c16{'' if f['pinned'] else ', not pinned'}"
            f"{', database on the server CPU' if f.get('database_pinned') else ''}")


def _child(name, args, body=None, extra=(), timeout=None):
    """Run one benchmark (or step) in a process of its own; its figures.
    Its stderr passes through (progress lines), the last 3000 characters
    kept for the error."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name,
               "--rows", str(args.rows), "--emails", str(args.emails),
               "--seconds", str(args.seconds), "--sinks", str(args.sinks),
               "--rounds", str(args.rounds), "--signups", str(args.signups), "--db", DB,
               "--hosts-recipients", str(args.hosts_recipients),
               "--public-rate", str(args.public_rate), "--step-limit", str(args.step_limit)]
    command += (["--body", body] if body else []) + list(extra)
    # The scale benchmark's progress lines (stderr) show as it goes: it is long.
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout,
                          stderr=None if name == "scale" else subprocess.PIPE)
    lines = [l for l in done.stdout.splitlines() if l.startswith("FIGURES ")]
    if done.returncode or not lines:
        said = done.stderr if done.stderr is not None else "(its stderr is above)"
        raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{said[-3000:]}")
    return json.loads(lines[-1][8:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000,
                        help="rows of the import and recipients of the queue benchmark")
    parser.add_argument("--emails", type=int, default=20_000, help="emails of the deliver benchmark")
    parser.add_argument("--seconds", type=int, default=10, help="load time of the api benchmark")
    parser.add_argument("--sinks", type=int, default=2,
                        help="SMTP sink processes of the deliver benchmark")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the deliver and api benchmarks (the median is reported)")
    parser.add_argument("--signups", type=int, default=1000,
                        help="sign-ups of the signup benchmark")
    parser.add_argument("--only", choices=sorted(BENCHES), action="append")
    parser.add_argument("--db", default="sqlite",
                        help="sqlite, postgresql (a throwaway cluster) or a postgresql:// URL")
    parser.add_argument("--hosts-recipients", type=int, default=50_000,
                        help="recipients of the hosts benchmark (PostgreSQL only)")
    parser.add_argument("--public-rate", type=float, default=20,
                        help="requests/s of each public route in the during-import benchmark")
    parser.add_argument("--step-limit", type=float, default=900,
                        help="seconds a scale step may take before it is reported as not "
                             "finished")
    parser.add_argument("--scale", action="store_true",
                        help="the scale benchmark (as --only scale): each step at --rows/10 "
                             "and --rows")
    parser.add_argument("--step", choices=SCALE_STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--scale-db", help=argparse.SUPPRESS)
    parser.add_argument("--scale-state", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--body", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DB
    if args.child:
        DB = args.db
        tmp = tempfile.mkdtemp(prefix=f"campaignapi-bench-{args.child}-")
        try:
            print("FIGURES " + json.dumps(STEPS[args.child](args, tmp)), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if DB != "sqlite":
                drop_made()
        return
    cluster = None
    if args.db == "postgresql":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pgcluster import PgCluster

        cluster = PgCluster().start()
        args.db = cluster.url()
    DB = args.db
    try:
        _run(args)
    finally:
        if cluster is not None:
            cluster.stop()


def default_names(rows, db, scale=False):
    """The benchmarks of a run without --only: all but hosts on SQLite and
    scale; with --scale or ten million rows and more, scale alone (the
    others hold their rows in memory)."""
    if scale or rows >= 10_000_000:
        return ["scale"]
    return [name for name in BENCHES if name != "scale" and (name != "hosts" or db != "sqlite")]


def _run(args):
    results, failed = {}, False
    engine = "sqlite" if DB == "sqlite" else "postgresql"
    names = args.only or default_names(args.rows, DB, args.scale)
    for name in names:
        try:
            figures = _child(name, args)
        except RuntimeError as error:
            print(f"{name:8} FAILED\n{error}", flush=True)
            results[name] = {"error": str(error)[-500:]}
            failed = True
            continue
        figures["target_met"] = all(said.startswith("met") for said, _ in
                                    verdicts(name, figures, engine).values())
        results[name] = figures
        print("\n".join([summary(name, figures), *verdict_lines(name, figures, engine)]),
              flush=True)
    said = issue_targets(results, engine)
    print(f"every target on {engine} (this run), by the issue that set it:")
    for row in engine_targets(engine):
        print(f"  {said[f'{row[0]}.{row[1]}']:22} issue {row[6]}  {target_text(row)}")
    print(json_line({"db": engine, "rows": args.rows, "time": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(), **results,
        "targets": said}), flush=True)
    sys.exit(1 if failed else 0)


def flatten(figures, prefix=""):
    """{'api': {'ratio': 0.68}} -> {'api.ratio': 0.68}: one name a figure.
    The scale steps' statements and plans are printed, not kept here."""
    flat = {}
    for name, value in figures.items():
        if name == "statements":
            continue
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def json_line(figures):
    """The run's last line: every figure by its dotted name, as JSON."""
    return json.dumps(flatten(figures), sort_keys=True)


def read_json_line(text):
    """The figures of a run's output (its last JSON line), to compare runs."""
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def _commit():
    done = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    main()
