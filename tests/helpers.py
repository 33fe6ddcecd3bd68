"""Helpers shared by the test files: the route table as paths, raw requests
(through WSGI and over real HTTP), the error envelope, free ports and
polling, direct database access, and records built through the API."""

import base64
import contextlib
import datetime
import html
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid

import webtest

import campaignapi

# --- the route table -------------------------------------------------------------------------

#: The routes that need a key (all but the public ones).
KEYED_ROUTES = [route for route in campaignapi.ROUTES if route.level]


def route_id(route):
    """A route's test id, e.g. ``GET /campaign/{id}``.

    :param route: a row of ``campaignapi.ROUTES``
    """
    return f"{route.method} {route.path}"


def filled(route, value="1"):
    """The route's path under /v1 with every placeholder replaced by ``value``.

    :param route: a row of ``campaignapi.ROUTES``
    :param value: the text put in place of each placeholder, or (as ``re.sub``
        takes) a function of the placeholder's match that gives it
    """
    return "/v1" + re.sub(r"\{[^}]*\}", value, route.path)


# --- an app of one's own ---------------------------------------------------------------------

def keyed_client(db, **config):
    """A WebTest client of a new app on ``db`` (for fixtures wider than one
    test) and the Authorization headers of a full-access key of owner@example.com.

    :param db: the database file
    :param config: settings for ``campaignapi.create_app``
    """
    client = webtest.TestApp(campaignapi.create_app(db, **config))
    return client, {"Authorization": "Bearer " + campaignapi.create_key(db, "owner@example.com")}


# --- requests --------------------------------------------------------------------------------

def send(client, method, path, headers=None, body=None, content_type="application/json",
         **options):
    """A request through the WebTest ``client``, answered whatever its status.

    :param path: the full path (with /v1 and any query string)
    :param body: bytes sent as they are, None for no body, any other value as JSON
    :param content_type: the body's type (none is sent without a body)
    :param options: more keyword arguments of ``webtest.TestApp.request``
    """
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return client.request(path, method=method, headers=headers or {}, body=body or b"",
                          content_type=content_type if body else None, expect_errors=True,
                          **options)


def http(url, method="GET", body=None, headers=None, timeout=30):
    """A request over real HTTP, answered whatever its status: (status, headers, body bytes).

    :param body: bytes sent as they are, None for no body, any other value as JSON
        (with a JSON Content-Type unless ``headers`` name one)
    :param headers: request headers
    :param timeout: seconds to wait for the answer
    """
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def new_idempotency_key(case):
    """Give a generated schemathesis case a new Idempotency-Key when it has a
    valid one: a client sends a new key with each new request, and generators
    reuse a few short keys for different requests (answered 422, rightly, but
    not what the case means to test).  An invalid key stays as generated."""
    key = (case.headers or {}).get("Idempotency-Key")
    if isinstance(key, str) and re.fullmatch(r"[!-~]{1,255}", key):
        case.headers["Idempotency-Key"] = uuid.uuid4().hex
    return case


# --- answers ---------------------------------------------------------------------------------

def assert_envelope(response, success, status):
    """The response is the API's envelope with this status; its data.

    :param response: a WebTest response
    :param success: the envelope's expected ``success``
    :param status: the expected HTTP status
    """
    assert response.status_int == status, response.text
    assert response.content_type == "application/json"
    body = response.json
    assert set(body) == {"responseId", "version", "success", "data"}
    assert body["version"] == 1
    assert body["success"] is success
    assert isinstance(body["responseId"], str)
    assert re.fullmatch(r"[0-9a-f]{16,}", body["responseId"])
    assert response.headers["X-Response-Id"] == body["responseId"]
    return body["data"]


def assert_error(response, status, code):
    """The response is an error envelope with this status, code and a message; its data.

    :param response: a WebTest response
    :param status: the expected HTTP status
    :param code: the expected error code
    """
    data = assert_envelope(response, False, status)
    assert data["error"] == code, data
    assert isinstance(data["message"], str) and data["message"]
    return data


# --- servers ---------------------------------------------------------------------------------

def free_port():
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(base, timeout=30):
    """Whether the app served at ``base`` answers its OpenAPI document yet.

    :param base: the server's base URL, e.g. ``http://127.0.0.1:40123``
    :param timeout: seconds to wait for the answer
    """
    try:
        return http(base + "/v1/openapi.json", timeout=timeout)[0] == 200
    except OSError:
        return False


def wait_for(condition, timeout=30, what="condition", interval=0.1):
    """Poll ``condition()`` until it holds; fail after ``timeout`` seconds.

    :param what: what is awaited, for the failure message
    :param interval: seconds between polls
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def in_threads(target, arguments, timeout=60):
    """Run ``target(argument)`` for every argument, each in its own thread, all at once.

    :param arguments: one argument per thread
    :param timeout: seconds to wait for each thread; one still running fails the test
    """
    threads = [threading.Thread(target=target, args=(argument,)) for argument in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads)


# --- the database ----------------------------------------------------------------------------

@contextlib.contextmanager
def database(db):
    """A connection to the app's database file, closed on leaving."""
    conn = campaignapi.connect(db)
    try:
        yield conn
    finally:
        conn.close()


def scalar(db, sql, *args):
    """The first column of the first row of a query.

    :param args: the query's ``?`` parameters
    """
    with database(db) as conn:
        return conn.execute(sql, args).fetchone()[0]


def later(seconds=0):
    """The time ``seconds`` from now as the API writes times (API.md: UTC,
    ``YYYY-MM-DD HH:MM:SS``), to compare with stored and returned times."""
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def app_secret(db):
    """The secret an app of ``db`` signs tokens with when create_app() is
    given no ``secret=``: the one stored in the database."""
    return campaignapi.create_app(db).config["campaignapi.service"].secret


def b64(data):
    """``data`` as the tokens spell bytes: URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(text):
    """The bytes of b64() text."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def account_id(db, email):
    """The id of the account with this address, made as create_key() makes it
    if new (the key it issues on the way is not used)."""
    campaignapi.create_key(db, email)
    return scalar(db, "SELECT id FROM account WHERE email = ?", email.lower())


def snapshot(db, skip=("setting",)):
    """Every row of every table, to compare before and after."""
    conn = campaignapi.connect(db)
    try:
        if conn.engine == "postgresql":
            tables = [row[0] for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")]
        else:
            tables = [row[0] for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        return {table: sorted((tuple(row) for row in conn.execute(f"SELECT * FROM {table}")),
                              key=repr)
                for table in tables if table not in skip}
    finally:
        conn.close()


def add_recipients(db, datasource, rows, status="active"):
    """Insert recipients straight into the database (imports are another
    part's work): ``rows`` are ``(email, {field name: stored value})``."""
    conn = campaignapi.connect(db)
    try:
        ids = {name.lower(): str(field_id) for field_id, name in conn.execute(
            "SELECT id, name FROM field WHERE datasource = ?", (datasource,))}
        with campaignapi.transaction(conn):
            conn.executemany(
                "INSERT INTO recipient (datasource, email, data, status) VALUES (?, ?, ?, ?)",
                [(datasource, email, json.dumps({ids[k.lower()]: v for k, v in values.items()}),
                  status) for email, values in rows])
    finally:
        conn.close()


def bulk_recipients(db, datasource, count, domain="bulk.example"):
    """Insert ``count`` active recipients into ``datasource`` by SQL (fast)."""
    conn = campaignapi.connect(db)
    try:
        with campaignapi.transaction(conn):
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                "INSERT INTO recipient (datasource, email, created, updated) "
                "SELECT ?, 'r' || i || '@' || ?, '2024-01-01 00:00:00', '2024-01-01 00:00:00' "
                "FROM n", (count, datasource, domain))
    finally:
        conn.close()


# --- records through the API ----------------------------------------------------------------

HTML = "<p>Hi {{first}}</p><p><a href='{{unsubscribe_url}}'>unsubscribe</a></p>"
TEXT = "Hi {{first}}\nUnsubscribe: {{unsubscribe_url}}"


def make_datasource(api, name="list", fields=()):
    """A new datasource of the api's account; its id (int)."""
    return int(api.put("/datasource/0", name=name, fields=list(fields))["id"])


def import_csv(api, ds, text, status=200, uploadtype="csv", encoding="utf-8", name="import",
               originalfile="people.csv"):
    """Import CSV text (as csv, or as base64 of ``text`` encoded in ``encoding``).

    :param api: the ``api`` fixture (or any ``conftest.Api``)
    :param ds: the datasource's id
    :param status: the expected HTTP status
    """
    data = text if uploadtype == "csv" else base64.b64encode(
        text if isinstance(text, bytes) else text.encode(encoding)).decode("ascii")
    return api.put(f"/datasource/{ds}/import/0", status=status, name=name,
                   originalfile=originalfile, __uploadtype__=uploadtype, __uploaddata__=data)


def get_import(api, ds, import_id):
    """The import record ``import_id`` of datasource ``ds``."""
    return api.get(f"/datasource/{ds}/import/{import_id}")["import"]


def recipients(api, ds, **params):
    """Every recipient of the datasource as {email: record}."""
    page = api.get(f"/datasource/{ds}/recipient/all", limit=1000, **params)
    return {record["email"]: record for record in page["recipient"]}


def build_world(api, send=True):
    """One record of every kind for the api's account, all at id 1 when the
    database is fresh: datasource (with a field, recipients, an import, an
    export and an organize record), message, segment, sender profile, template, and a
    sendable campaign with a campaign message and (``send``) a batch."""
    ds = api.put("/datasource/0", name="customers",
                 fields=[{"name": "first", "type": "text"}])["id"]
    import_csv(api, ds, "email,first\nann@example.com,Ann\nbob@example.com,Bob\n",
               name="list", originalfile="list.csv")
    api.get(f"/datasource/{ds}/export/0")
    api.put(f"/datasource/{ds}/organize/0", item=int(ds), folder="top", sortorder=1)
    ids = {"datasource": ds, **make_campaign(api, [int(ds)])}
    ids["template"] = api.put("/template/0", name="layout", html="<div>{{content}}</div>",
                              text="{{content}}\n--\nThe Shop")["id"]
    if send:
        ids["batch"] = api.put(f"/campaign/{ids['campaign']}/send/0",
                               timestamp="2000-01-01 00:00:00")["id"]
    return ids


def make_campaign(api, datasources, **params):
    """A sendable campaign to every recipient of ``datasources``: a sender
    profile, a message, a segment, the campaign and its campaign message.

    :param datasources: the segment's datasource ids (ints)
    :param params: more parameters of the campaign (e.g. ``archiveemail``)
    :returns: the new records' ids, by kind (profile, message, segment, campaign)
    """
    profile = api.put("/accountprofile/0", name="Shop", fromname="The Shop",
                      fromaddress="news@shop.example")["id"]
    message = api.put("/message/0", name="Welcome", subject="Hello {{first}}",
                      html=HTML, text=TEXT)["id"]
    segment = api.put("/segment/0", name="all", datasources=datasources)["id"]
    campaign = api.put("/campaign/0", name="Launch", accountprofile=int(profile), **params)["id"]
    api.put(f"/campaign/{campaign}/message/0", segment=int(segment), message=int(message))
    return {"profile": profile, "message": message, "segment": segment, "campaign": campaign}


def fill(template, values, as_html=False):
    """Merge tags filled as delivery fills them (campaignapi's _Template),
    ``values`` by name without case."""
    # internal: the merge-tag parser itself, for its edge cases (test_messages, test_fuzz)
    return campaignapi._Template(template).fill(
        {str(name).lower(): str(value) for name, value in values.items()}, as_html=as_html)


def reference_fill(template, values, as_html=False):
    """The merge-tag rule written plainly, as an oracle for delivery's faster
    split-and-join: each {{ name }} (without case) becomes its value, escaped
    in html, an unknown name nothing."""
    lowered = {str(name).lower(): str(value) for name, value in values.items()}

    def one(match):
        value = lowered.get(match.group(1).lower(), "")
        return html.escape(value, quote=True) if as_html else value

    return re.sub(r"\{\{\s*([^{}]*?)\s*\}\}", one, template or "")


# --- webhooks --------------------------------------------------------------------------------

class EventReceiver:
    """A webhook receiver on loopback built with the Standard Webhooks library:
    every call is verified with ``secret`` (set it once the webhook is made)
    and kept in ``calls`` as ``{"id", "headers", "body", "payload", "error",
    "status"}``: ``payload`` the verified JSON (None and ``error`` when the
    call does not verify), ``status`` what was answered (None: no answer).

    :param plan: ``plan(call) -> status`` to answer, or ``-> action(handler)``
        that answers (or not) itself; default: 204 to everything.
    """

    def __init__(self, plan=None):
        from signedhelpers import Receiver

        self.secret, self.calls = None, []
        self.plan = plan or (lambda call: 204)
        self.receiver = Receiver(self._respond)
        self.release = self.receiver.release    # set on exit: frees handlers that wait on it

    def _respond(self, handler):
        from signedhelpers import answer
        from standardwebhooks import Webhook, WebhookVerificationError

        headers = dict(handler.headers)
        call = {"id": headers.get("webhook-id"), "headers": headers, "body": handler.body,
                "payload": None, "error": None, "status": None}
        try:
            call["payload"] = Webhook(self.secret).verify(handler.body, headers)
        except WebhookVerificationError as error:
            call["error"] = str(error)
        self.calls.append(call)
        action = self.plan(call)
        if callable(action):
            action(handler)
        else:
            answer(handler, action)
            call["status"] = action

    def url(self, path="/hook"):
        return self.receiver.url(path)

    def acknowledged(self):
        """The verified payloads answered with a 2xx, in arrival order."""
        return [call["payload"] for call in self.calls
                if call["status"] and 200 <= call["status"] < 300 and call["payload"]]

    def __enter__(self):
        self.receiver.__enter__()
        return self

    def __exit__(self, *exc):
        self.receiver.__exit__(*exc)


def make_webhook(api, receiver, **params):
    """A webhook of the api's account calling ``receiver`` (whose secret it
    sets); its id (int)."""
    made = api.put("/webhook/0", url=receiver.url(), **params)
    receiver.secret = made["secret"]
    return int(made["id"])
# --- sign-ups ----------------------------------------------------------------------------------

def make_signup_list(api, name="Newsletter", fields=({"name": "first", "type": "text"},),
                     **settings):
    """A datasource that takes sign-ups, with a sender profile; its id (int).

    :param settings: more datasource settings (doubleoptin, confirmmessage, ...)
    """
    profile = api.put("/accountprofile/0", name="List", fromname="The List",
                      fromaddress="list@shop.example", replyto="help@shop.example")["id"]
    return int(api.put("/datasource/0", name=name, fields=list(fields), signup=1,
                       fromprofile=int(profile), **settings)["id"])


def confirm_path(text):
    """The path of the confirmation link in an email body (``/v1/confirm/...``)."""
    return re.search(r"https?://[^\s\"']*?(/v1/confirm/[A-Za-z0-9_-]+)", text).group(1)
# --- workers as real processes (issue 12: leases, several hosts) -----------------------------

class HttpApi:
    """conftest.Api over real HTTP: ``HttpApi(base_url, secret).put("/datasource/0", ...)``
    (so the record helpers above work against a served process)."""

    def __init__(self, base, secret):
        self.base, self.headers = base.rstrip("/"), {"Authorization": f"Bearer {secret}"}

    def call(self, method, path, params=None, status=200):
        answer, _, body = http(f"{self.base}/v1{path}", method, params, self.headers, timeout=120)
        assert answer == status, (answer, body[:500])
        return json.loads(body)["data"]

    def get(self, path, status=200):
        return self.call("GET", path, None, status)

    def put(self, path, status=200, **params):
        return self.call("PUT", path, params, status)

    def post(self, path, status=200, **params):
        return self.call("POST", path, params, status)


def start_worker(db, smtp, *more, cwd=None):
    """``python campaignapi.py worker --db DB --smtp SMTP`` as a real process
    (its output in a file beside nothing: discarded unless it fails)."""
    import os
    import subprocess
    import sys
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, os.path.join(root, "campaignapi.py"), "worker",
                                "--db", db, "--smtp", smtp, *more], cwd=cwd or root,
                               stdout=log, stderr=subprocess.STDOUT)
    process.log = log
    return process


def stop_process(process, timeout=20):
    """Terminate a process this test started (then kill it); its output."""
    import subprocess

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    process.log.seek(0)
    return process.log.read()


def check_delivered_once(db, sink, addresses, deadline):
    """Wait (until ``deadline``, a time.monotonic()) for the outbox to have
    nothing queued or sending; then every address got exactly one email but
    for the failed ones (at most one: in flight at a kill), none twice."""
    import collections

    wait_for(lambda: scalar(db, "SELECT count(*) FROM outbox WHERE status IN "
                                "('queued', 'sending')") == 0,
             timeout=max(1, deadline - time.monotonic()), what="the outbox to drain",
             interval=0.5)
    received = collections.Counter(rcpts[0] for _, rcpts, _ in list(sink.messages))
    twice = [address for address, count in received.items() if count > 1]
    assert not twice, twice[:10]
    with database(db) as conn:
        failed = [row[0] for row in conn.execute(
            "SELECT to_addr FROM outbox WHERE kind = 'campaign' AND status = 'failed'")]
        sent = conn.execute("SELECT count(*) FROM outbox WHERE kind = 'campaign' "
                            "AND status = 'sent'").fetchone()[0]
    assert len(failed) <= 1, failed
    missing = set(addresses) - set(received) - set(failed)
    assert not missing, sorted(missing)[:10]
    assert sent == len(addresses) - len(failed)
    return received, failed


def spelled(db, name, **slots):
    """The SQL spelling ``name`` (campaignapi._SQL) of ``db``'s engine, filled in."""
    engine = "postgresql" if str(db).startswith("postgresql://") else "sqlite"
    # internal: the engines' own SQL spellings
    return campaignapi._SQL[engine][name].format(**slots)


def open_url_in(html_text):
    """The open URL of a tracked email's html: an <img>, or in a short email a
    CSS background (no image for spam filters to count)."""
    return re.search(r'(?:<img src="|background-image:url\()([^")]+/v1/open/[^")]+)',
                     html_text).group(1)


# --- pages in the browser ----------------------------------------------------------------------

def browse(page, url, headers=None, width=1000):
    """Open ``url`` in the browser tab ``page`` (with ``headers``, at a
    desktop ``width``); the response, checked to be an HTML page."""
    if headers:
        page.set_extra_http_headers(headers)
    page.set_viewport_size({"width": width, "height": 800})
    response = page.goto(url)
    assert response.status == 200 and "text/html" in response.headers["content-type"]
    return response


def screenshot(page, name):
    """Keep a full-page screenshot in tests/artifacts (not committed); its path."""
    import pathlib

    artifacts = pathlib.Path(__file__).parent / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / ".gitignore").write_text("*\n")
    shot = artifacts / name
    page.screenshot(path=str(shot), full_page=True)
    return shot
