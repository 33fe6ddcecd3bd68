"""Fixtures: an app on a temporary SQLite file, a WebTest client, keys."""

import contextlib
import http.server
import os
import shutil
import signal
import threading
import time

import pytest
import webtest

import campaignapi
from helpers import account_id, later, send


@pytest.fixture
def db(tmp_path, request):
    """The database of one test: a new SQLite file, or with
    CAMPAIGNAPI_TEST_ENGINE=postgresql the URL of a new database that has the
    schema and no rows (see pg_schema_db)."""
    if TEST_ENGINE == "postgresql":
        yield request.getfixturevalue("pg_schema_db")
    else:
        yield str(tmp_path / "campaignapi.db")


@pytest.fixture
def app(db):
    return campaignapi.create_app(db)


@pytest.fixture
def client(app):
    return webtest.TestApp(app)


@pytest.fixture
def make_key(db, app):
    """Issue a key: ``make_key(levels=..., email=...)`` -> Authorization headers."""

    def make(levels=campaignapi.LEVELS, email="owner@example.com", **options):
        secret = campaignapi.create_key(db, email, levels, **options)
        return {"Authorization": f"Bearer {secret}"}

    return make


@pytest.fixture
def auth(make_key):
    """Headers of a full-access key of the account owner@example.com."""
    return make_key()


@pytest.fixture
def other(make_key):
    """Headers of a full-access key of another account."""
    return make_key(email="stranger@example.org")


class Api:
    """Small helpers over the client: ``api.put("/campaign/0", name=...)``."""

    def __init__(self, client, headers):
        self.client, self.headers = client, headers

    def call(self, method, path, params=None, status=200, headers=None):
        response = send(self.client, method, "/v1" + path, {**self.headers, **(headers or {})},
                        params)
        assert response.status_int == status, (response.status, response.text)
        return response.json["data"]

    def get(self, path, status=200, **params):
        return self.call("GET", path, params or None, status)

    def put(self, path, status=200, **params):
        return self.call("PUT", path, params, status)

    def post(self, path, status=200, **params):
        return self.call("POST", path, params, status)

    def delete(self, path, status=200, **params):
        return self.call("DELETE", path, params or None, status)


@pytest.fixture
def api(client, auth):
    return Api(client, auth)


@pytest.fixture
def stranger_api(client, other):
    return Api(client, other)


# -- Real servers and a real browser (reusable by any test) --



@contextlib.contextmanager
def serving(wsgi_app, threads=4):
    """Serve ``wsgi_app`` with waitress on a free loopback port in a thread;
    yields the base URL, e.g. ``http://127.0.0.1:40123``."""
    import waitress

    from waitress import wasyncore

    server = waitress.create_server(wsgi_app, host="127.0.0.1", port=0, threads=threads)
    stop = threading.Event()

    def run():
        # The loop closes the server itself: closing its sockets from another
        # thread while it sits in select() fails with EBADF.
        while not stop.is_set():
            wasyncore.loop(timeout=0.05, map=server._map, count=1)
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        stop.set()
        thread.join(5)


@pytest.fixture
def serve():
    """``with serve(wsgi_app) as url:`` runs any WSGI app under waitress."""
    return serving


@pytest.fixture
def live_server(app):
    """The ``app`` fixture served by waitress: its base URL."""
    with serving(app) as url:
        yield url


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="session")
def browser():
    """Debian's headless Chromium driven by Playwright.  Skipped where it is
    missing, except in CI (the CI variable set), where that is a failure."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing; .ci/run installs it")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    """A fresh browser tab (own cookies) for one test."""
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def smtp_sink():
    """A recording SMTP server on loopback (tests/smtp_sink.py)."""
    from smtp_sink import SmtpSink

    sink = SmtpSink().start()
    yield sink
    sink.stop()


@pytest.fixture
def seed_campaign(db):
    """Queue campaign emails with plain SQL (the queueing half makes them in
    the product): ``seed_campaign(recipients=[(email, name)], ...)`` -> ids.

    Makes a datasource with a ``name`` field, the recipients, a sender profile,
    a message, a campaign, a batch and one outbox row per recipient.
    """
    campaignapi.init_db(db)

    def seed(recipients, *, owner="owner@example.com", subject="Hello {{name}}",
             html='<p>Dear {{name}}</p><p><a href="{{unsubscribe_url}}">unsubscribe</a></p>',
             text="Dear {{name}}\nUnsubscribe: {{unsubscribe_url}}", fromname="",
             fromaddress="", replyto="", base_url="https://lists.example.com/email"):
        account, now = account_id(db, owner), later()
        conn = campaignapi.connect(db)
        try:
            with campaignapi.transaction(conn):
                ds = conn.execute("INSERT INTO datasource (owner, name, created) VALUES (?, 'list', ?)",
                                  (account, now)).lastrowid
                conn.execute("INSERT INTO field (datasource, name, type) VALUES (?, 'email', 'email')",
                             (ds,))
                name_field = conn.execute("INSERT INTO field (datasource, name, type) "
                                          "VALUES (?, 'name', 'text')", (ds,)).lastrowid
                profile = conn.execute(
                    "INSERT INTO accountprofile (owner, name, fromname, fromaddress, replyto) "
                    "VALUES (?, 'p', 'Profile Sender', 'news@sender.example', '')",
                    (account,)).lastrowid
                message = conn.execute(
                    "INSERT INTO message (owner, name, subject, fromname, fromaddress, replyto, "
                    "html, text) VALUES (?, 'm', ?, ?, ?, ?, ?, ?)",
                    (account, subject, fromname, fromaddress, replyto, html, text)).lastrowid
                campaign = conn.execute("INSERT INTO campaign (owner, accountprofile, name) "
                                        "VALUES (?, ?, 'c')", (account, profile)).lastrowid
                batch = conn.execute("INSERT INTO batch (campaign, timestamp, status, base_url) "
                                     "VALUES (?, ?, 'sending', ?)", (campaign, now, base_url)).lastrowid
                outbox = []
                for address, name in recipients:
                    recipient = conn.execute(
                        "INSERT INTO recipient (datasource, email, data) VALUES (?, ?, ?)",
                        (ds, address, campaignapi.json.dumps({str(name_field): name}))).lastrowid
                    outbox.append(conn.execute(
                        "INSERT INTO outbox (account, kind, batch, message, recipient, to_addr, "
                        "created, next_try) VALUES (?, 'campaign', ?, ?, ?, ?, ?, ?)",
                        (account, batch, message, recipient, address, now, now)).lastrowid)
        finally:
            conn.close()
        return {"account": account, "datasource": ds, "campaign": campaign, "batch": batch,
                "message": message, "outbox": outbox}

    return seed


@pytest.fixture(scope="session")
def dovecot_server():
    """One throwaway dovecot IMAP server for the session (tests/dovecot.py).
    Skipped where dovecot is not installed, except in CI, where that fails."""
    from dovecot import DOVECOT, IMAP_BINARY, Dovecot

    for path in (DOVECOT, IMAP_BINARY):
        if not os.path.exists(path):
            if os.environ.get("CI"):
                pytest.fail(f"{path} is missing; .ci/run installs dovecot-imapd")
            pytest.skip(f"{path} is missing (apt-get install dovecot-imapd)")
    with Dovecot() as server:
        yield server


@pytest.fixture
def dovecot(dovecot_server):
    """The session's IMAP server with an empty INBOX."""
    dovecot_server.empty()
    return dovecot_server


# -- Engines: CAMPAIGNAPI_TEST_ENGINE=sqlite (default) or postgresql (issue 12) --

TEST_ENGINE = os.environ.get("CAMPAIGNAPI_TEST_ENGINE", "sqlite")
if TEST_ENGINE not in ("sqlite", "postgresql"):
    raise pytest.UsageError(f"CAMPAIGNAPI_TEST_ENGINE={TEST_ENGINE!r}: use sqlite or postgresql")


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster for the session (tests/pgcluster.py),
    stopped at its end, also when tests fail or are interrupted (Ctrl-C,
    SIGTERM; atexit as the last resort)."""
    from pgcluster import PgCluster, pg_bindir

    if not pg_bindir():
        if os.environ.get("CI") or TEST_ENGINE == "postgresql":
            pytest.fail("PostgreSQL is missing; .ci/run installs it (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # SIGTERM ends Python without finalizers or atexit; as an interrupt
        # it stops the cluster like Ctrl-C does.
        signal.signal(signal.SIGTERM, _interrupted)
    cluster = PgCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def pg_admin(pg_cluster):
    """An autocommit psycopg connection to the cluster's ``postgres`` database."""
    import psycopg

    with psycopg.connect(pg_cluster.url(), autocommit=True) as conn:
        yield conn


@pytest.fixture
def pg_db(pg_cluster):
    """The URL of a new, empty PostgreSQL database, dropped after the test."""
    with pg_cluster.database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def engine_db(request, tmp_path):
    """A new database on each engine, whatever CAMPAIGNAPI_TEST_ENGINE says:
    for the tests of the engine layer itself."""
    if request.param == "postgresql":
        yield request.getfixturevalue("pg_db")
    else:
        yield str(tmp_path / "engine.db")


@pytest.fixture
def same_engine_db(engine_db, request, tmp_path):
    """A second new, empty database on engine_db's engine."""
    if engine_db.startswith("postgresql://"):
        with request.getfixturevalue("pg_cluster").database() as url:
            yield url
    else:
        yield str(tmp_path / "second.db")


@pytest.fixture(scope="session")
def pg_pool(pg_cluster, pg_admin):
    """Databases with the schema and no rows, copies of one that init_db
    made once, emptied after each test for the next (tests/pgcluster.py)."""
    from pgcluster import DatabasePool

    pg_admin.execute("CREATE DATABASE campaignapi_template TEMPLATE template0")
    campaignapi.init_db(pg_cluster.url("campaignapi_template"))
    pool = DatabasePool(pg_cluster, "campaignapi_template")
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def pg_schema_db(pg_cluster, pg_pool):
    """The URL of a PostgreSQL database with the schema and no rows.

    Not a new, empty one, for speed: with other work on the machine copying
    a database costs 15-300 ms and init_db 110 ms more to fill it; emptying a
    used one costs a few.  Tests of schema creation and migration take
    pg_db, which is new and empty."""
    name = pg_pool.take()
    try:
        yield pg_cluster.url(name)
    finally:
        pg_pool.give_back(name)


# --- deliverability checks: the real SpamAssassin, a real HTTP server of links ---------

@pytest.fixture
def spamassassin():
    if not shutil.which("spamassassin"):
        if os.environ.get("CI"):
            pytest.fail("spamassassin is missing; .ci/run installs it")
        pytest.skip("spamassassin is missing (apt-get install spamassassin)")


class _Links(http.server.BaseHTTPRequestHandler):
    """Real HTTP answers for the links check: /ok, /get-only (HEAD 405),
    /missing (404), /hop/N (redirects N more times, then 200), /slow (no
    answer for 8 seconds)."""

    def do_HEAD(self):
        if self.path == "/get-only":
            self.server.seen.append((self.command, self.path))
            self.answer(405)
        else:
            self.do_GET()

    def do_GET(self):
        self.server.seen.append((self.command, self.path))
        if self.path in ("/ok", "/get-only"):
            self.answer(200)
        elif self.path.startswith("/hop/"):
            left = int(self.path.rsplit("/", 1)[1])
            self.answer(200) if left == 0 else self.answer(302, f"/hop/{left - 1}")
        elif self.path == "/slow":
            time.sleep(8)
            self.answer(200)
        else:
            self.answer(404)

    def answer(self, status, location=None):
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def link_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Links)
    server.daemon_threads, server.seen = True, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()
