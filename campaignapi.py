"""campaignapi: an email-campaign HTTP API that any Python web application can embed.

Recipient lists (datasources), messages, segments and campaigns behind a small
JSON API under ``/v1``, stored in one SQLite file, sent through an SMTP relay.
README.md describes every route and rule; this module is the whole product.

Embedded in another application::

    import bottle, campaignapi

    parent = bottle.Bottle()
    parent.mount("/email/", campaignapi.create_app("campaigns.db"))
    secret = campaignapi.create_key("campaigns.db", "owner@example.com")

On its own, from the command line::

    $ python campaignapi.py --port 8080                 # serve (creates a key on first run)
    $ python campaignapi.py worker --smtp relay.example.com:587 --starttls   # delivery alone
    $ python campaignapi.py key create --email me@example.com --levels read
    $ curl -H "Authorization: Bearer $SECRET" http://127.0.0.1:8080/v1/campaign/all
"""

__version__ = "0.1.0"

#: The public API; everything else (handlers included) is private.
__all__ = [
    "create_app", "main", "DEFAULT_CONFIG",
    "create_key", "list_keys", "revoke_key", "LEVELS",
    "connect", "transaction", "init_db",
    "process_due", "deliver", "deliver_webhooks", "run_worker", "emit", "EVENT_KINDS", "dkim_signer", "enqueue",
    "enqueue_email",
    "apply_bounce", "classify_bounce", "process_bounce_mailbox", "read_bounce_mailbox",
    "verp_address", "read_verp", "message_id_for", "read_message_id", "MailboxError",
    "verify_campaign", "openapi_document", "ROUTES", "Route", "Resource",
    "ApiError", "InvalidJson", "MissingParameter", "InvalidParameter", "UnknownParameter",
    "InvalidIdentifier", "InvalidHost", "Unauthorized", "InsufficientAccess", "NotFound",
    "MethodNotAllowed", "Conflict", "VerificationFailed", "PayloadTooLarge",
    "UnsupportedMediaType", "InvalidData", "TooManyRequests", "IdempotencyKeyReused",
    "sign_token", "read_token", "unsubscribe_token", "read_unsubscribe_token", "suppress",
    "log_to_stderr", "INTEGRITY_ERRORS", "SCHEMA_VERSION", "MAX_ID", "MAX_EXPLICIT_ID",
    "FIELD_TYPES", "RECIPIENT_STATUSES", "LANGUAGES",
    # The record kinds' declarations: their operations are the handlers of ROUTES.
    "ACCOUNTPROFILE", "BATCH", "CAMPAIGN", "DATASOURCE", "EXPORT", "FIELD", "IMPORT", "LINK",
    "MESSAGE", "ORGANIZE", "RECIPIENT", "SEGMENT", "TEMPLATE", "WEBHOOK", "TRANSACTIONAL",
    # Automations (section 17).
    "AUTOMATION", "RUN", "advance_runs", "check_dates", "verify_automation",
]

import argparse
import atexit
import base64
import binascii
import calendar
import codecs
import collections
import concurrent.futures
import contextlib
import csv
import datetime
import email.errors
import email.header
import email.headerregistry
import email.message
import email.policy
import email.utils
import fractions
import functools
import gc
import hashlib
import hmac
import html
import html.parser
import imaplib
import importlib.metadata
import io
import ipaddress
import itertools
import json
import logging
import operator
import os
import pickle
import random
import re
import secrets
import select
import shutil
import signal
import smtplib
import socket
import sqlite3
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import urllib.parse
import weakref

import bottle
import flufl.bounce

_log = logging.getLogger("campaignapi")

#: Configuration accepted by create_app(db, **config), with its defaults.
DEFAULT_CONFIG = {
    # Largest request body accepted, in bytes; larger ones get 413 unread.
    "max_body": 64 * 1024 * 1024,
    # Base URL of the API as the outside world sees it, for links in emails
    # and pages (confirm, unsubscribe, open, click, download...).  Empty: taken
    # from the request that causes them, if allowed_hosts allows its host.
    "public_url": "",
    # Without public_url: the hosts a request's Host (or X-Forwarded-Host) may
    # name for links to be built from it, as Django's ALLOWED_HOSTS: a name,
    # ".example.com" (the domain and its subdomains) or "*" (any host name).
    # Empty: this machine's names only (_LOCAL_HOSTS).  Another host: 400 invalid_host.
    "allowed_hosts": (),
    # Secret for signed tokens; empty: generated once and kept in the database.
    "secret": "",
    # Seconds a verified API key is remembered by the app, saving a query per
    # request.  A key revoked in this process stops at once; one revoked from
    # another process (the CLI) stops within this time.  0: always ask.
    "key_cache_seconds": 1.0,
    # Where template files named by a campaign's defaulttemplate live
    # (NAME.html and an optional NAME.txt).  Empty: only template records.
    "templates_dir": "",
    # VERP: each campaign email's envelope sender is bounces+TOKEN@this domain,
    # so a bounce that comes back later names its email.  Empty: no VERP.
    "bounce_domain": "",
    # Provider callbacks for bounces and complaints; each route answers 404
    # until its setting is given.
    "mailgun_signing_key": "",
    "postmark_credentials": "",       # "user:password" (HTTP basic auth)
    "sendgrid_public_key": "",        # base64 DER or PEM (ECDSA P-256)
    "ses_topic_arns": (),             # the SNS topics accepted
    # Webhook URLs may point at loopback and private addresses (never at
    # cloud metadata addresses).  Off: such URLs are refused.
    "webhook_allow_private": False,
    # Public sign-ups taken from one client address (REMOTE_ADDR) a minute,
    # in each process; more get 429.  0: no limit.
    "signup_rate": 30,
    # callable(kind, payload), called after the transaction that raised an
    # event has committed; an exception in it is logged and changes nothing.
    "on_event": None,
    # Deliverability (section 20).  Per-domain rates: {"gmail.com": "100/m",
    # "*": "20/s"} or ("gmail.com=100/m", ...); the warm-up's daily caps
    # ("50,100,500" or numbers) from warmup_start (YYYY-MM-DD; empty: the day
    # of the first campaign email).  The worker applies them; the API shows them.
    "domain_rates": (),
    "warmup": (),
    "warmup_start": "",
    # Verify's spam check: the SpamAssassin program (spamc or spamassassin;
    # empty: spamc when a spamd answers, else spamassassin, from the PATH)
    # and the score at or above which the check fails.
    "spamassassin": "",
    "spam_threshold": 5.0,
    # GET /metrics (the Prometheus text format; needs prometheus_client, the
    # extra campaignapi[metrics]); with metrics_token it asks for
    # Authorization: Bearer with it.
    "metrics": False,
    "metrics_token": "",
}

SCHEMA_VERSION = 11
LEVELS = ("read", "write", "create", "delete")
FIELD_TYPES = ("text", "integer", "number", "boolean", "date", "datetime", "email")
#: The languages of a datasource's public pages and built-in emails (its ``language``).
LANGUAGES = ("en", "de", "fr", "es", "nl")
#: Only 'active' recipients receive campaigns.
RECIPIENT_STATUSES = ("active", "unconfirmed", "unsubscribed", "bounced", "complained")
_PAGE_DEFAULT, _PAGE_MAX = 100, 1000
MAX_ID = 2**63 - 1
#: The largest id a create may choose (2^53 - 1: every JSON client reads it
#: exactly); creates at id 0 never go past explicit ids far ahead (ID_REACH).
MAX_EXPLICIT_ID = 2**53 - 1


# ---------------------------------------------------------------------------
# Errors: handlers raise these; Service.finish() turns them into envelopes.
# ---------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered to the client as ``{"error": code, "message": ...}``."""

    status = 500
    code = "internal_error"

    def __init__(self, message, **extra):
        super().__init__(message)
        self.message = message
        self.extra = extra
        self.headers = {}

    def data(self):
        return {"error": self.code, "message": self.message, **self.extra}


class InvalidJson(ApiError):
    status, code = 400, "invalid_json"


class MissingParameter(ApiError):
    status, code = 400, "missing_parameter"


class InvalidParameter(ApiError):
    status, code = 400, "invalid_parameter"


class UnknownParameter(ApiError):
    status, code = 400, "unknown_parameter"


class InvalidIdentifier(ApiError):
    status, code = 400, "invalid_identifier"


class InvalidHost(ApiError):
    """A link would be built from a host the operator did not allow (link_base())."""
    status, code = 400, "invalid_host"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"

    def __init__(self, message, **extra):
        super().__init__(message, **extra)
        self.headers = {"WWW-Authenticate": 'Bearer realm="campaignapi"'}


class InsufficientAccess(ApiError):
    status, code = 403, "insufficient_access"


class NotFound(ApiError):
    status, code = 404, "not_found"


class MethodNotAllowed(ApiError):
    status, code = 405, "method_not_allowed"

    def __init__(self, message, allowed):
        super().__init__(message, allowed=allowed)
        self.headers = {"Allow": ", ".join(allowed)}


class Conflict(ApiError):
    status, code = 409, "conflict"


class VerificationFailed(ApiError):
    status, code = 409, "verification_failed"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(ApiError):
    status, code = 415, "unsupported_media_type"


class InvalidData(ApiError):
    status, code = 422, "invalid_data"


class IdempotencyKeyReused(ApiError):
    """An Idempotency-Key sent again with another method, path or body."""
    status, code = 422, "idempotency_key_reused"


class TooManyRequests(ApiError):
    status, code = 429, "rate_limited"

    def __init__(self, message, retry_after):
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


# ---------------------------------------------------------------------------
# Database: the engines (SQLite, PostgreSQL), one connect(), one transaction()
# helper, the SQL spellings that differ, the schema and its migrations.
# ---------------------------------------------------------------------------

_PRAGMAS = (
    ("journal_mode", "WAL"),       # readers never wait for the writer
    ("synchronous", "NORMAL"),     # durable at checkpoints; safe with WAL
    ("foreign_keys", "ON"),
    ("busy_timeout", "30000"),     # writers queue instead of failing 'locked'
)

#: The few SQL spellings that differ between the engines, as format strings
#: with named slots, each used once (so a slot may be ``?``), so the rest is
#: written once:
#: ``conn.sql["contains"].format(haystack="lower(r.email)", needle="?")``.
#: Written once for both instead: ``a IS NOT DISTINCT FROM ?`` (not ``IS ?``),
#: ``INSERT ... ON CONFLICT DO NOTHING`` (not ``INSERT OR IGNORE``),
#: ``count(*) FILTER (WHERE ...)``, ``WITH x AS MATERIALIZED (...)``,
#: ``(1 = 1)`` and ``(1 = 0)`` for a constant WHERE.  JSON stays TEXT on both
#: engines (see _pg_schema); ``key`` is a field id from our own tables.
_SQL = {
    "sqlite": {
        "begin": "BEGIN IMMEDIATE",        # the write lock up front (see transaction())
        "now": "datetime('now')",
        "temp": "temp",                    # the schema of temporary tables
        "nocase": "{expr} COLLATE NOCASE",
        "contains": "instr({haystack}, {needle}) > 0",
        "group_concat": "group_concat({expr}, {sep})",
        # A top-level key of a JSON object: typed (a number compares as one).
        "json_value": "json_extract({json}, '$.\"{key}\"')",
        "json_number": "json_extract({json}, '$.\"{key}\"')",
        # The value typed as the driver gives it (str, int, float; None for null).
        "json_item": "json_extract({json}, '$.\"{key}\"')",
        # json_set with the value given as JSON text: json() keeps its type.
        "json_set": "json_set({json}, '$.\"{key}\"', json({value}))",
        # RFC 7396 merge: a null in the patch removes the key.
        "json_merge": "json_patch({json}, {patch})",
        # A JSON array (text) with one more element, given as JSON text.
        "json_append": "json_insert({json}, '$[#]', json({value}))",
        # The elements of a JSON array (given as text) as a one-column SELECT:
        # ids, or addresses for ``email IN (...)`` (compared NOCASE).
        "json_ids": "SELECT value FROM json_each({array})",
        "json_addresses": "SELECT value FROM json_each({array})",
        # After a SELECT whose rows the transaction will change: SQLite's
        # BEGIN IMMEDIATE already excludes every other writer.
        "for_update": "",
        "for_share": "",
        "skip_locked": "",
        # A text with characters beyond ASCII (SQLite 3.40 lacks octet_length).
        "non_ascii": "length(CAST({expr} AS BLOB)) != length({expr})",
        # The domain of an address (after its first @), lower-cased.
        "address_domain": "lower(substr({expr}, instr({expr}, '@') + 1))",
        "table_exists": "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
        # A lock on two 32-bit numbers until the transaction ends, or false
        # at once when another transaction holds it.  Always true here: BEGIN
        # IMMEDIATE already excludes every other writer.
        "try_xact_lock": "(coalesce({high}, {low}) IS NOT NULL)",
        # The same lock taken by a statement of its own, before the statement
        # that reads what it guards (none here: BEGIN IMMEDIATE took the
        # write lock, and every read after it sees the last commit); and
        # whether this transaction holds it.
        "take_xact_lock": None,
        "holds_xact_lock": "(coalesce({high}, {low}) IS NOT NULL)",
        # The indexes of a table (given as ?) that queries can use, by name;
        # an index made or dropped while the database is in use (the field
        # indexes of segment conditions, see _index_conditioned_fields()).
        "table_indexes": "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?",
        "create_index": "CREATE INDEX IF NOT EXISTS {name} ON {table} ({columns})",
        "drop_index": "DROP INDEX IF EXISTS {name}",
    },
    "postgresql": {
        "begin": "BEGIN",                  # concurrency from row locks, not a database lock
        "now": "to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')",
        "temp": "pg_temp",
        "nocase": "CAST({expr} AS citext)",
        "contains": "strpos({haystack}, {needle}) > 0",
        "group_concat": "string_agg({expr}, {sep})",
        "json_value": "(CAST({json} AS jsonb) ->> '{key}')",
        "json_number": "CAST(jsonb_path_query_first(CAST({json} AS jsonb), "
                       "'$.\"{key}\" ? (@.type() == \"number\")') AS numeric)",
        "json_item": "(CAST({json} AS jsonb) -> '{key}')",   # psycopg loads jsonb
        "json_set": "CAST(jsonb_set(CAST({json} AS jsonb), '{{{key}}}', CAST({value} AS jsonb))"
                    " AS text)",
        # The patches we write are flat objects, so stripping nulls after the
        # merge is RFC 7396's removal.
        "json_merge": "CAST(jsonb_strip_nulls(CAST({json} AS jsonb) || CAST({patch} AS jsonb))"
                      " AS text)",
        "json_append": "CAST(CAST({json} AS jsonb) || jsonb_build_array(CAST({value} AS jsonb))"
                       " AS text)",
        "json_ids": "SELECT CAST(value AS BIGINT) FROM jsonb_array_elements_text(CAST({array} AS jsonb))",
        "json_addresses": "SELECT CAST(value AS citext) "
                          "FROM jsonb_array_elements_text(CAST({array} AS jsonb))",
        # Make a due batch once: the second worker waits, then sees it made.
        "for_update": "FOR UPDATE",
        # Read a row that must not change before the transaction ends (a
        # list closed meanwhile), without stopping those that refer to it.
        "for_share": "FOR SHARE",
        # Claim outbox rows: each worker takes rows no other has locked.
        "skip_locked": "FOR UPDATE SKIP LOCKED",
        "non_ascii": "octet_length({expr}) != length({expr})",
        "address_domain": "lower(split_part({expr}, '@', 2))",
        "table_exists": "SELECT 1 FROM information_schema.tables "
                        "WHERE table_schema = current_schema() AND table_name = ?",
        # The two-number advisory locks: a key space apart from the one-number
        # locks of imports and schema changes.
        "try_xact_lock": "pg_try_advisory_xact_lock({high}, {low})",
        # A statement's snapshot is taken when it starts, before a lock taken
        # in it: a read of what the lock guards must come in a later statement,
        # whose snapshot sees what the lock's last holder committed.  So the
        # lock goes first, alone, and the read asks whether it is held (the
        # two-number advisory locks are objsubid 2, their numbers as oids).
        "take_xact_lock": "SELECT pg_try_advisory_xact_lock({high}, {low})",
        "holds_xact_lock": "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
                           "AND pid = pg_backend_pid() AND granted AND objsubid = 2 "
                           "AND classid = CAST(CAST({high} AS integer) AS oid) "
                           "AND objid = CAST(CAST({low} AS integer) AS oid))",
        # Valid ones only: a CONCURRENTLY build that failed leaves an invalid
        # index, which the next build drops first.
        "table_indexes": "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = "
                         "i.indexrelid JOIN pg_class t ON t.oid = i.indrelid WHERE t.relname = ? "
                         "AND t.relnamespace = CAST(current_schema() AS regnamespace) "
                         "AND i.indisvalid",
        # Writers of the table go on while it is built (outside a transaction).
        "create_index": "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} ({columns})",
        "drop_index": "DROP INDEX CONCURRENTLY IF EXISTS {name}",
    },
}

#: Compact JSON as every answer and stored JSON text is written: one encoder,
#: made once (json.dumps with options builds a new one per call).
_to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

#: What a write that breaks a UNIQUE, FOREIGN KEY, NOT NULL or CHECK rule
#: raises, on either engine: catch ``campaignapi.INTEGRITY_ERRORS`` (looked
#: up when the error happens).  psycopg's class joins when connect() first
#: imports psycopg, so SQLite users never pay for importing it.
INTEGRITY_ERRORS = (sqlite3.IntegrityError,)

#: The ids of a kind come from its sequence: PostgreSQL's identity sequence of
#: the table, SQLite's row in id_sequence.  An id a create chooses (at most
#: MAX_EXPLICIT_ID) that is less than ID_REACH ahead of the sequence's last id
#: becomes the last id; one farther ahead does not move it, and is stepped
#: over once the ids come within ID_REACH of it.  So no explicit id, however
#: large, sends the ids of the creates after it (of every account) out of the
#: range a JSON client reads exactly, and no create at id 0 meets a taken id:
#: the next ID_REACH ids past the last one are always free.  ID_REACH is more
#: than the rows one statement inserts (an import chunk: _CHUNK_ROWS).
_ID_REACH = 2**20


def _id_frontier(conn, table, last):
    """``last`` (an id of ``table``'s sequence) moved past every id less than
    ID_REACH ahead of it, again from there: the ID_REACH ids after the result
    are free.  (_PG_PREAMBLE's campaignapi_ids_past() does the same inside
    PostgreSQL.)"""
    while True:
        top = conn.execute(f"SELECT max(id) FROM {table} WHERE id > ? AND id <= ?",
                           (last, last + _ID_REACH)).fetchone()[0]
        if top is None:
            return last
        last = top


_PG_URL = ("postgresql://", "postgres://")
_PG_INSTALL = "pip install 'campaignapi[postgres]'"


def _connection_class(db):
    """The connection class of ``db`` (see connect()), without connecting."""
    return _PgConnection if str(db).startswith(_PG_URL) else _SqliteConnection


@contextlib.contextmanager
def _opened(db):
    """``db`` as a connection: a path or URL opened here (and closed after),
    or an open connection as it is."""
    if not isinstance(db, str):
        yield db
        return
    conn = connect(db)
    try:
        yield conn
    finally:
        conn.close()


def connect(db):
    """Open a connection to ``db`` with the project's settings.

    Both kinds of connection offer the sqlite3 subset this module uses
    (``execute``, ``executemany``, ``cursor``, ``close``, ``in_transaction``,
    rows by name and position, ``lastrowid`` of an INSERT into a table with an
    ``id``) plus ``engine`` and ``sql`` (its row of :data:`SQL`).  Outside
    transaction() every statement commits on its own.

    :param db: the SQLite file, or a ``postgresql://`` URL (needs psycopg 3:
        ``pip install 'campaignapi[postgres]'``).
    """
    if _connection_class(db) is _PgConnection:
        return _PgConnection(_pg_connect(str(db)))
    conn = sqlite3.connect(db, timeout=30, isolation_level=None, check_same_thread=False,
                           factory=_SqliteConnection)
    try:
        conn.turns, conn.claims = _turns_of(db), _claims_of(db)
        conn.row_factory = sqlite3.Row
        for name, value in _PRAGMAS:
            _pragma(conn, name, value)
    except BaseException:
        conn.close()
        raise
    return conn


def _pragma(conn, name, value, wait=30.0):
    """Set a pragma, waiting while another connection holds the lock it needs:
    SQLite answers a journal-mode change 'database is locked' at once, without
    its busy handler, when processes open a new file together."""
    deadline = time.monotonic() + wait
    while True:
        try:
            conn.execute(f"PRAGMA {name} = {value}")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@contextlib.contextmanager
def transaction(conn, first=None):
    """Run the block as one transaction (a savepoint when already in one).

    On SQLite ``BEGIN IMMEDIATE`` takes the write lock up front, so two
    writers queue on busy_timeout instead of failing halfway with 'database is
    locked'.  On PostgreSQL a plain ``BEGIN``: writers that must not overlap
    lock the rows they change.

    ``first``: ``(sql, params)``, the transaction's first statement (or a
    list of them), sent with its BEGIN (one round trip on PostgreSQL); the
    block gets the (last one's) cursor instead of the connection.  Statements the block leaves in
    ``conn.at_commit`` (``[(sql, params)]``; only in the outermost
    transaction) go with the COMMIT the same way: writes that cannot fail
    for the rows they meet (they were locked or written earlier in it).
    """
    if first is not None and not isinstance(first, list):
        first = [first]
    if conn.in_transaction:
        name = "sp_" + secrets.token_hex(4)
        conn.execute(f"SAVEPOINT {name}")
        try:
            yield conn if first is None else [conn.execute(*f) for f in first][-1]
        except BaseException:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
            raise
        conn.execute(f"RELEASE {name}")
        return
    conn.take_turn()
    try:
        opened = conn.begin_transaction(first)
        try:
            yield conn if first is None else opened
        except BaseException:
            conn.at_commit = ()
            conn.execute("ROLLBACK")
            raise
        conn.commit_transaction()
    finally:
        conn.give_turn()


@contextlib.contextmanager
def _one_statement(conn):
    """For a write that is one statement, atomic by itself: its turn among
    this process's writers (see transaction()) without BEGIN and COMMIT, which
    on PostgreSQL are a round trip each.  Inside a transaction, part of it."""
    if conn.in_transaction:
        yield conn
        return
    conn.take_turn()
    try:
        yield conn
    finally:
        conn.give_turn()


def _next_chunk(conn):
    """Inside transaction(), in a long write made of chunks (an import):
    commit what is done, let this process's writers that came meanwhile have
    their turns, and begin again.  No other writer waits for more than one
    chunk, and what was committed stays if the process dies later."""
    conn.execute("COMMIT")
    conn.give_turn()
    try:
        conn.take_turn()
    finally:   # in a transaction again either way, for transaction() to end
        conn.execute(conn.sql["begin"])


class _WriteTurns:
    """The writers of one SQLite database in this process, in the order they
    came.  SQLite's busy handler retries a waiting writer after sleeps that
    grow to 100 ms, so a writer that commits and begins again at once (an
    import, chunk after chunk) would always win the lock back; here a writer
    waiting in this process gets it first.  A thread takes one turn at a
    time (a second connection of the same thread goes to SQLite's busy
    handler, as before), and waits at most its connection's busy timeout.
    """

    #: A writer that would wait at most this long (seconds; the intake's
    #: quick writes) does not queue while a long write (an import) runs:
    #: it is told at once that the database is locked, and its caller keeps
    #: the write for later.  Queued, each held a server thread for its wait
    #: (100 public writes a second: 5 of 8 threads) and the import gave way.
    QUICK = 1.0

    def __init__(self):
        self.lock, self.queue, self.holder = threading.Lock(), collections.deque(), None
        self.long = 0   # long writes running (imports)

    def take(self, timeout):
        """Take the turn; False when this thread holds it already (nothing taken)."""
        me = threading.get_ident()
        with self.lock:
            if self.holder is None:
                self.holder = me
                return True
            if self.holder == me:
                return False
            if self.long and timeout < self.QUICK:
                raise sqlite3.OperationalError("database is locked (a long write runs)")
            granted = threading.Event()
            self.queue.append((me, granted))
        if granted.wait(timeout):
            return True
        with self.lock:
            if granted.is_set():   # handed over as the wait ended
                return True
            self.queue.remove((me, granted))
        raise sqlite3.OperationalError("database is locked (waited for this process's "
                                       "other writers)")

    def give(self):
        with self.lock:
            if self.queue:
                self.holder, granted = self.queue.popleft()
                granted.set()
            else:
                self.holder = None


#: The write turns of each SQLite database file this process opened.
_write_turns = {}
_write_turns_lock = threading.Lock()


class _ImportClaims:
    """The imports running in this process over one SQLite database file,
    each holding a lock on its byte of ``<db>.imports`` (fcntl's record
    locks, which the system lets go when the process dies): an import still
    'running' whose byte no process holds was interrupted (see
    _fail_interrupted_imports).  Record locks belong to the process, so the
    ids it holds are also kept here (its own locks never stop it), and the
    file stays open for the process's life (closing any descriptor of it
    would let every lock go)."""

    def __init__(self, path):
        self.path, self.lock, self.held, self.fd = path, threading.Lock(), set(), None

    def _lock(self, import_id, mode):
        """fcntl.lockf() of the import's byte; True where it was done."""
        try:
            import fcntl
        except ImportError:   # no record locks (Windows): only this process's own are known
            return mode == "test"
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        command = {"hold": fcntl.LOCK_EX | fcntl.LOCK_NB, "test": fcntl.LOCK_EX | fcntl.LOCK_NB,
                   "free": fcntl.LOCK_UN}[mode]
        try:
            fcntl.lockf(self.fd, command, 1, int(import_id))
        except OSError:
            return False
        return True

    def claim(self, import_id):
        with self.lock:
            self.held.add(import_id)
            if self.path is not None:
                self._lock(import_id, "hold")

    def release(self, import_id):
        with self.lock:
            self.held.discard(import_id)
            if self.path is not None:
                self._lock(import_id, "free")

    def orphaned(self, import_id):
        """Whether no process runs the import ``import_id`` any more."""
        with self.lock:
            if import_id in self.held:
                return False
            if self.path is None or not self._lock(import_id, "test"):
                return self.path is None
            self._lock(import_id, "free")
            return True


_import_claims = {}


def _turns_of(db):
    """The _WriteTurns of the SQLite database ``db`` (one per file)."""
    if db in ("", ":memory:") or str(db).startswith("file:"):
        return _WriteTurns()   # a database of its own connection
    path = os.path.realpath(db)
    with _write_turns_lock:
        return _write_turns.setdefault(path, _WriteTurns())


def _claims_of(db):
    """The _ImportClaims of the SQLite database ``db`` (one per file)."""
    if db in ("", ":memory:") or str(db).startswith("file:"):
        return _ImportClaims(None)
    path = os.path.realpath(db)
    with _write_turns_lock:
        return _import_claims.setdefault(path, _ImportClaims(path + ".imports"))


class _SqliteConnection(sqlite3.Connection):
    """sqlite3's connection with the engine's name, spellings and schema steps."""

    engine = "sqlite"
    sql = _SQL["sqlite"]
    #: A read is a call in this process, where a write waits for the
    #: database's one write lock: look before writing (an Idempotency-Key's
    #: repeat is answered without waiting for the lock).
    cheap_reads = True
    #: Statements to run just before the COMMIT of transaction().
    at_commit = ()

    def begin_transaction(self, first=None):
        """transaction()'s BEGIN, then the statements ``first``
        ``[(sql, params)]``: the last one's cursor."""
        self.execute(self.sql["begin"])
        return None if first is None else self._opening(first)

    def _opening(self, first):
        try:
            return [self.execute(*statement) for statement in first][-1]
        except BaseException:
            self.execute("ROLLBACK")
            raise

    def commit_transaction(self):
        """transaction()'s COMMIT, after the statements of ``at_commit``."""
        last, self.at_commit = self.at_commit, ()
        try:
            for statement in last:
                self.execute(*statement)
        except BaseException:
            self.execute("ROLLBACK")
            raise
        self.execute("COMMIT")
    #: This process's writers of the database (_WriteTurns; connect() sets
    #: it), and how long one waits for its turn (seconds, as busy_timeout).
    turns, turn_wait, _turn_taken = None, 30.0, False

    def take_turn(self):
        """Before BEGIN IMMEDIATE: wait for the writers of this process that came first."""
        if self.turns is not None:
            self._turn_taken = self.turns.take(self.turn_wait)

    def give_turn(self):
        """After COMMIT or ROLLBACK: the next writer of this process goes."""
        if self._turn_taken:
            self._turn_taken = False
            self.turns.give()

    def writers_waiting(self):
        """Whether another writer of this process waits for its turn (a
        long write, an import, commits for it: _Importer.turn())."""
        return self.turns is not None and bool(self.turns.queue)

    @contextlib.contextmanager
    def writing_long(self):
        """Within: this connection writes for long (an import, in chunks):
        quick writers of this process do not wait for it (_WriteTurns.QUICK)."""
        if self.turns is None:
            yield
            return
        with self.turns.lock:
            self.turns.long += 1
        try:
            yield
        finally:
            with self.turns.lock:
                self.turns.long -= 1

    def claim_import(self, import_id):
        """Mark the import as running in this process until release_import()
        (or the process's end): _ImportClaims."""
        self.claims.claim(import_id)

    def release_import(self, import_id):
        self.claims.release(import_id)

    def import_orphaned(self, import_id):
        """Whether the 'running' import ``import_id`` has no process any more."""
        return self.claims.orphaned(import_id)

    def import_writes(self, importer):
        """How an import's chunks reach recipient here: _SqliteImportWrites."""
        return _SqliteImportWrites(importer)

    @staticmethod
    def intake(db, conn, wait):
        """Where public writes that cannot wait are kept: _SqliteIntake."""
        return _SqliteIntake(db, conn, wait)

    @staticmethod
    def export_folder(db):
        """The folder of the export files: beside the database file."""
        return os.path.abspath(db) + "-exports"

    @contextlib.contextmanager
    def reading(self, name):
        """A cursor for one long read (``name`` is for PostgreSQL): sqlite3
        steps through the rows as they are iterated anyway."""
        with contextlib.closing(self.cursor()) as cursor:
            yield cursor

    def run_script(self, script):
        """Run the statements of ``script`` one by one, inside the current
        transaction (sqlite3's executescript() would commit it first)."""
        for statement in _statements(script):
            self.execute(statement)

    def schema_script(self, script):
        return script

    def next_id(self, table):
        """The next id of ``table``'s sequence (it and the ID_REACH - 1 after
        it are free, for the rows of one statement), or None when the table's
        own choice (its largest id + 1) is that id.

        SQLite has no sequences: the last id of each table is kept in
        id_sequence and moved past the ids inserted since (ID_REACH).  Inside
        a transaction, whose write lock keeps the ids for its inserts."""
        row = self.execute("SELECT last FROM id_sequence WHERE name = ?", (table,)).fetchone()
        last = _id_frontier(self, table, row[0] if row else 0)
        self.execute("INSERT INTO id_sequence (name, last) VALUES (?, ?) "
                     "ON CONFLICT (name) DO UPDATE SET last = excluded.last", (table, last))
        top = self.execute(f"SELECT max(id) FROM {table}").fetchone()[0]
        return None if (top or 0) == last else last + 1

    def schema_version(self):
        return self.execute("PRAGMA user_version").fetchone()[0]

    def set_schema_version(self, version):
        self.execute(f"PRAGMA user_version = {int(version)}")

    @contextlib.contextmanager
    def schema_change(self):
        """One transaction for a schema change, foreign keys checked at its end.

        Enforcement is off meanwhile (it cannot change inside a transaction):
        a table rebuild drops the old table, which would otherwise cascade to
        the rows that refer to it (``ON DELETE SET NULL``)."""
        self.execute("PRAGMA foreign_keys = OFF")
        try:
            with transaction(self):
                yield self
                broken = self.execute("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"campaignapi: the schema change breaks foreign keys: "
                                       f"{[tuple(row) for row in broken[:5]]}")
        finally:
            self.execute("PRAGMA foreign_keys = ON")


def _statements(script):
    """The SQL statements of a script, split where SQLite sees one end."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            yield statement.strip()
            statement = ""
    if statement.strip() and not statement.strip().startswith("--"):
        yield statement.strip()


def _rebuild_table(conn, table, create):
    """Give the SQLite table ``table`` a new definition, keeping its rows.

    SQLite's ALTER TABLE cannot change a CHECK, a type or a constraint, so a
    migration step that must calls this inside ``schema_change()`` (the
    procedure of https://sqlite.org/lang_altertable.html#otheralter): the new
    table is made under another name, the columns both have are copied, the old
    table is dropped, the new one renamed, and the old indexes and triggers
    made again.  New columns take their defaults.

    :param conn: a SQLite connection inside ``conn.schema_change()``.
    :param table: the table's name (from our own schema, never request text).
    :param create: the new ``CREATE TABLE [IF NOT EXISTS] <table> (...)`` statement.
    """
    new = f"{table}__new"
    statement, found = re.subn(rf"^\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?{table}\b",
                               f"CREATE TABLE {new}", create, count=1, flags=re.I)
    if not found:
        raise ValueError(f"not a CREATE TABLE statement of {table}: {create[:60]!r}")
    extras = [row[0] for row in conn.execute(
        "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND type IN ('index', 'trigger') "
        "AND sql IS NOT NULL", (table,))]
    conn.execute(statement)
    old_columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    new_columns = {row[1] for row in conn.execute(f"PRAGMA table_info({new})")}
    shared = ", ".join(column for column in old_columns if column in new_columns)
    conn.execute(f"INSERT INTO {new} ({shared}) SELECT {shared} FROM {table}")
    conn.execute(f"DROP TABLE {table}")
    conn.execute(f"ALTER TABLE {new} RENAME TO {table}")
    for sql in extras:
        conn.execute(sql)


# PostgreSQL ------------------------------------------------------------------

def _pg_connect(url):
    try:
        import psycopg
    except ImportError:
        raise RuntimeError(f"campaignapi: a postgresql:// database needs psycopg 3: "
                           f"{_PG_INSTALL}") from None
    global INTEGRITY_ERRORS
    INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg.IntegrityError)
    return psycopg.connect(url, autocommit=True)


class _PgRow:
    """A row as sqlite3.Row offers it: ``row["name"]`` (any case), ``row[0]``,
    slices, iteration, ``keys()``, ``dict(row)``."""

    __slots__ = ("_values", "_names", "_index")

    def __init__(self, values, names, index):
        self._values, self._names, self._index = values, names, index

    def __getitem__(self, key):
        if isinstance(key, str):
            position = self._index.get(key)
            if position is None:
                position = self._index.get(key.lower())
                if position is None:
                    raise IndexError(f"No item with that key: {key!r}")
            return self._values[position]
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __eq__(self, other):
        if isinstance(other, _PgRow):
            return self._names == other._names and self._values == other._values
        return NotImplemented

    __hash__ = None

    def keys(self):
        return list(self._names)

    def __repr__(self):
        return f"<row {dict(zip(self._names, self._values))!r}>"


@functools.lru_cache(maxsize=2048)
def _pg_rows_of(text):
    """psycopg's row factory for the results of the statement ``text``: the
    row maker is made once and kept while the result has the same shape
    (psycopg's ``description`` builds a Column object per column per call,
    and reading every column's name back costs nearly as much: together a
    third of a small query's CPU).  The shape of one statement's result
    changes only with the schema; the number of columns and the last one's
    name and type tell a column added or dropped (a prepared statement's
    result cannot change at all: PostgreSQL refuses to run it)."""
    known = [(None, None)]   # (shape, maker), replaced whole: threads share it

    def factory(cursor):
        result = cursor.pgresult
        if result is None:
            return _pg_row_factory(cursor)
        last = result.nfields - 1
        shape = (last, result.fname(last), result.ftype(last)) if last >= 0 else ()
        entry = known[0]
        if entry[0] != shape:
            entry = known[0] = (shape, _pg_row_factory(cursor))
        return entry[1]
    return factory


def _pg_row_factory(cursor):
    names = tuple(column.name for column in cursor.description or ())
    index = {}
    for position, name in enumerate(names):   # the first of equal names wins, as in sqlite3
        index.setdefault(name, position)
    for position, name in enumerate(names):
        index.setdefault(name.lower(), position)
    # A boolean (EXISTS, a comparison) comes as 1/0, as SQLite gives it.
    flags = [position for position, column in enumerate(cursor.description or ())
             if column.type_code == _PG_BOOL]
    if flags:
        def make(values):
            values = list(values)
            for position in flags:
                if values[position] is not None:
                    values[position] = int(values[position])
            return _PgRow(values, names, index)
        return make
    return lambda values: _PgRow(values, names, index)


_PG_BOOL = 16   # the type oid of boolean


# A statement's tokens that matter to the translation: literals, quoted
# names and comments (copied, '%' doubled), '?' or '?NNN' placeholders, '%'.
_PG_TOKEN = re.compile(r"""'(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/|\?(\d*)|%""",
                       re.S)
_PG_INSERT_VALUES = re.compile(r"\s*INSERT\s+INTO\s+(\w+)\b(?!.*\bRETURNING\b)(?!.*\bSELECT\b)"
                               r".*\bVALUES\b", re.I | re.S)


@functools.lru_cache(maxsize=2048)
def _pg_statement(sql):
    """``(text, order, returning, commit)``: ``sql`` with psycopg's placeholders.

    ``order`` lists, per ``%s``, the index of its value among the sqlite3-style
    parameters (SQLite's numbering: ``?NNN`` is value NNN, a bare ``?`` the one
    after the highest so far), or None when they are already in order.
    ``returning`` says that ``RETURNING id`` was added: a single-row INSERT
    into a table with an ``id`` gives its id as the cursor's lastrowid, as in
    SQLite (psycopg has no lastrowid).  ``commit`` says that it is a COMMIT.
    """
    order = []

    def replace(match):
        token = match[0]
        if token == "%":
            return "%%"
        if token[0] != "?":
            return token.replace("%", "%%")
        order.append(int(match[1]) - 1 if match[1] else max(order, default=-1) + 1)
        return "%s"

    text = _PG_TOKEN.sub(replace, sql)
    insert = _PG_INSERT_VALUES.match(sql)
    returning = bool(insert) and insert[1].lower() in _pg_id_tables()
    if returning:
        text = text.rstrip().rstrip(";") + " RETURNING id"
    return (text, None if order == list(range(len(order))) else tuple(order), returning,
            sql.strip().upper() == "COMMIT")


def _pg_params(params, order):
    # psycopg sends a bool as boolean, which PostgreSQL will not compare with
    # the INTEGER 0/1 flags; SQLite stores it as 1/0, so do the same.
    if order is not None:
        params = [params[index] for index in order]
    return [int(value) if value.__class__ is bool else value for value in params]


class _PgCursor:
    """A psycopg cursor behind the sqlite3 cursor interface."""

    def __init__(self, conn, name=None):
        self.connection = conn
        self.row_factory = _pg_row_factory   # None: plain tuples, as in sqlite3
        self.lastrowid = None
        # A name: a server-side cursor (inside a transaction), rows fetched
        # as iterated rather than all at once.
        self._cursor = conn.raw.cursor(name=name) if name else conn.raw.cursor()

    def _prepare(self, text):
        import psycopg.rows

        self._cursor.row_factory = (_pg_rows_of(text) if self.row_factory is _pg_row_factory
                                    else self.row_factory or psycopg.rows.tuple_row)

    def execute(self, sql, params=()):
        text, order, returning, commit = _pg_statement(sql)
        self._prepare(text)
        self._cursor.execute(text, _pg_params(params, order))
        return self._received(returning, commit)

    def together(self, statements):
        """See _PgConnection._together(): this cursor holds the last's result.
        A statement with values runs as a prepared statement of the session
        (``EXECUTE name (values)``), planned once, as psycopg's own
        statements are after a few runs."""
        import psycopg

        conn = self.connection
        if conn.literal is None:
            conn.literal = psycopg.ClientCursor(conn.raw)
        texts, literal = [], conn.literal
        for sql, params in statements:
            text, order, returning, commit = _pg_statement(sql)
            values = _pg_params(params, order)
            if values:
                name = conn.prepared.get(text)
                if name is None:   # a session's prepared statement outlives a rollback
                    name = f"campaignapi_{len(conn.prepared)}"
                    numbers = itertools.count(1)
                    conn.raw.execute(f"PREPARE {name} AS " + re.sub(
                        "%[%s]", lambda m: "%" if m[0] == "%%" else f"${next(numbers)}", text))
                    conn.prepared[text] = name
                text = f"EXECUTE {name} ({', '.join(['%s'] * len(values))})"
            texts.append(literal.mogrify(text, values))
        # Rows as tuples for the results before the last, read over; the
        # last's rows as execute() makes them, the maker kept by its statement.
        self._cursor.row_factory = psycopg.rows.tuple_row
        self._cursor.execute(";\n".join(texts))   # no parameters: the simple protocol
        for _ in statements[1:]:
            self._cursor.nextset()
        self._prepare(_pg_statement(statements[-1][0])[0])
        return self._received(returning, commit)

    def _received(self, returning, commit):
        if returning:
            rows = self._cursor.fetchall()
            self.lastrowid = rows[-1][0] if rows else None
        elif commit and self._cursor.statusmessage == "ROLLBACK":
            # PostgreSQL ends a transaction in which a statement failed with a
            # rollback, even when asked to commit: never report that as done.
            import psycopg

            raise psycopg.errors.InFailedSqlTransaction(
                "the transaction was rolled back: a statement in it failed "
                "(on PostgreSQL an error inside a transaction needs a savepoint to recover)")
        return self

    def executemany(self, sql, seq_of_params):
        text, order, _, _ = _pg_statement(sql)
        self._prepare(text)
        self._cursor.executemany(text, [_pg_params(params, order) for params in seq_of_params])
        return self

    def fetchone(self):
        return self._cursor.fetchone()

    def fetchmany(self, size=1):
        return self._cursor.fetchmany(size)

    def fetchall(self):
        return self._cursor.fetchall()

    def __iter__(self):
        return iter(self._cursor)

    @property
    def rowcount(self):
        return self._cursor.rowcount

    @property
    def description(self):
        return self._cursor.description

    def close(self):
        self._cursor.close()


class _PgConnection:
    """A psycopg 3 connection (autocommit) behind the sqlite3 interface the
    module uses: ``?`` placeholders, rows like sqlite3.Row, lastrowid."""

    engine = "postgresql"
    sql = _SQL["postgresql"]
    #: Every statement is a round trip to the server: write without looking
    #: first where the write tells what it found.
    cheap_reads = False
    #: Statements sent with the COMMIT of transaction().
    at_commit = ()

    def begin_transaction(self, first=None):
        """transaction()'s BEGIN, and the statements ``first``
        ``[(sql, params)]`` with it in one round trip: the last one's cursor."""
        if first is None:
            self.execute(self.sql["begin"])
            return None
        return self._together([(self.sql["begin"], ()), *first])

    def commit_transaction(self):
        """transaction()'s COMMIT, and the statements of ``at_commit`` before
        it in the same round trip."""
        last, self.at_commit = self.at_commit, ()
        if not last:
            self.execute("COMMIT")
            return
        self._together([*last, ("COMMIT", ())])

    def _together(self, statements):
        """``statements`` ``[(sql, params)]`` as one query of several (the
        simple protocol, its values written in as literals by psycopg), so
        one round trip: the cursor of the last.  One that fails stops those
        after it, and the transaction they are in is rolled back.  (psycopg's
        pipeline mode also sends them together, but took more time than the
        round trips it saved: a wait per statement.)"""
        self._settle(statements[0][0])
        cursor = _PgCursor(self)
        try:
            return cursor.together(statements)
        except BaseException:
            if self.in_transaction:
                self.execute("ROLLBACK")
            raise

    def __init__(self, raw):
        self.raw = raw
        # {statement: name} of the statements _together() prepared, and the
        # client-side cursor that writes their values in.
        self.prepared, self.literal = {}, None
        # A COPY that an import keeps open from chunk to chunk (_CopyStream):
        # the function that ends it, run before the connection does anything
        # else, since nothing else can run while it is open.
        self.copying = None

    #: The advisory lock of a running import: this plus its id (ids are
    #: below 2**53), held by the importing session, which the server lets go
    #: when the session ends (its process died, on any host).
    _IMPORT_LOCK = 1 << 62

    def claim_import(self, import_id):
        """Mark the import as running until release_import(): a session lock."""
        self.execute("SELECT pg_advisory_lock(?)", (self._IMPORT_LOCK + import_id,))

    def release_import(self, import_id):
        self.execute("SELECT pg_advisory_unlock(?)", (self._IMPORT_LOCK + import_id,))

    def import_orphaned(self, import_id):
        """Whether the 'running' import ``import_id`` has no session any more."""
        key = self._IMPORT_LOCK + import_id
        if not self.execute("SELECT pg_try_advisory_lock(?)", (key,)).fetchone()[0]:
            return False
        self.execute("SELECT pg_advisory_unlock(?)", (key,))
        return True

    def take_turn(self):
        """Writers take turns by row locks here: nothing to wait for in this process."""

    def give_turn(self):
        """See take_turn()."""

    def writers_waiting(self):
        """None waits for a long write's lock here (see take_turn())."""
        return False

    def writing_long(self):
        """See writers_waiting()."""
        return contextlib.nullcontext()

    def _settle(self, sql):
        if self.copying is not None:
            self.copying(rollback=sql.lstrip()[:8].upper() == "ROLLBACK")

    def execute(self, sql, params=()):
        self._settle(sql)
        return _PgCursor(self).execute(sql, params)

    def executemany(self, sql, seq_of_params):
        self._settle(sql)
        return _PgCursor(self).executemany(sql, seq_of_params)

    def cursor(self, name=None):
        self._settle("")
        return _PgCursor(self, name)

    @property
    def in_transaction(self):
        return self.raw.info.transaction_status != 0   # psycopg.pq.TransactionStatus.IDLE

    def close(self):
        self.raw.close()

    def run_script(self, script):
        """Run ``script`` (several statements, no parameters) as it is."""
        self._settle(script)
        self.raw.execute(script)

    def schema_script(self, script):
        return _pg_schema(script)

    def import_writes(self, importer):
        """How an import's chunks reach recipient here: _PgImportWrites."""
        return _PgImportWrites(importer)

    @staticmethod
    def intake(db, conn, wait):
        """Where public writes that cannot wait are kept: _PgIntake."""
        return _PgIntake(db, conn, wait)

    @staticmethod
    def export_folder(db):
        """The folder of the export files: files of this host, served by this
        host (see README, PostgreSQL), one folder per database."""
        name = hashlib.sha256(str(db).encode()).hexdigest()[:16]
        return os.path.join(tempfile.gettempdir(), f"campaignapi-{name}-exports")

    @contextlib.contextmanager
    def reading(self, name):
        """A cursor for one long read, its rows fetched as iterated: a
        server-side cursor ``name``, which lives in a (read-only) transaction;
        it closes before the transaction ends."""
        with transaction(self), contextlib.closing(self.cursor(name)) as cursor:
            yield cursor

    def next_id(self, table):
        """None: the identity sequence gives the ids (see _SqliteConnection);
        its trigger keeps the ID_REACH ids after its last one free."""
        return None

    def schema_version(self):
        if self.execute("SELECT to_regclass('campaignapi_schema')").fetchone()[0] is None:
            return 0
        row = self.execute("SELECT version FROM campaignapi_schema").fetchone()
        return row[0] if row else 0

    def set_schema_version(self, version):
        self.execute("INSERT INTO campaignapi_schema (one, version) VALUES (TRUE, ?) "
                     "ON CONFLICT (one) DO UPDATE SET version = excluded.version", (version,))

    @contextlib.contextmanager
    def schema_change(self):
        """One transaction for a schema change; processes that start together
        wait here for each other (a transaction-scoped advisory lock)."""
        with transaction(self):
            self.execute("SELECT pg_advisory_xact_lock(?)", (_PG_SCHEMA_LOCK,))
            self.run_script(_PG_PREAMBLE)
            yield self


_PG_SCHEMA_LOCK = 0x63616d70   # 'camp': the advisory lock key of schema changes

# What every PostgreSQL database of ours has besides schema.sql: citext for
# the NOCASE columns, the version row, the trigger that moves an id sequence
# past the ids close ahead of it (ID_REACH: a create at a chosen id, or the
# ids reaching one chosen far ahead), and the checks of
# the foreign keys that are checked once a statement (see _PG_STATEMENT_KEYS).
# The triggers run once a statement, over its rows (a transition table): an
# import writes a million rows in a few statements, and a trigger or a
# foreign key check per row cost more than the row's insert.
_PG_PREAMBLE = """
CREATE EXTENSION IF NOT EXISTS citext;
CREATE TABLE IF NOT EXISTS campaignapi_schema (
    one     BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    version INTEGER NOT NULL
);
-- The sequence (TG_ARGV[0]) moved past every id less than TG_ARGV[1]
-- (ID_REACH) ahead of its last one, again from there (_id_frontier()).
CREATE OR REPLACE FUNCTION campaignapi_ids_past() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    reach bigint := TG_ARGV[1]::bigint;
    start bigint := coalesce(pg_sequence_last_value(TG_ARGV[0]::regclass), 0);
    last bigint := start;
    top bigint;
BEGIN
    LOOP
        EXECUTE format('SELECT max(id) FROM %I WHERE id > $1 AND id <= $2', TG_TABLE_NAME)
            INTO top USING last, last + reach;
        EXIT WHEN top IS NULL;
        last := top;
    END LOOP;
    -- Forward by nextval() alone, never setval(): each statement here sees
    -- rows committed since start was read, so the sequence may already stand
    -- past last, under ids other sessions hold unseen; a setval() would move
    -- it back under them (a duplicate key for one of them).
    WHILE last > start LOOP
        start := nextval(TG_ARGV[0]::regclass);
    END LOOP;
    RETURN NULL;
END $$;
-- The child's side of a foreign key (TG_ARGV: column, parent table): every
-- value the statement wrote names a parent row, locked FOR KEY SHARE until
-- the transaction ends, as PostgreSQL's own check does.
CREATE OR REPLACE FUNCTION campaignapi_key_present() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    key bigint;
    found bigint;
BEGIN
    FOR key IN EXECUTE format('SELECT DISTINCT %1$I FROM added WHERE %1$I IS NOT NULL',
                              TG_ARGV[0]) LOOP
        EXECUTE format('SELECT 1 FROM %I WHERE id = $1 FOR KEY SHARE', TG_ARGV[1]) USING key;
        GET DIAGNOSTICS found = ROW_COUNT;
        IF found = 0 THEN
            RAISE foreign_key_violation USING
                MESSAGE = format('insert or update on table "%s" violates foreign key '
                                 'constraint "%s_%s_fkey"', TG_TABLE_NAME, TG_TABLE_NAME,
                                 TG_ARGV[0]),
                DETAIL = format('Key (%s)=(%s) is not present in table "%s".', TG_ARGV[0],
                                key, TG_ARGV[1]),
                TABLE = TG_TABLE_NAME, COLUMN = TG_ARGV[0],
                CONSTRAINT = format('%s_%s_fkey', TG_TABLE_NAME, TG_ARGV[0]);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
-- The parent's side (TG_ARGV: child table, column, ON DELETE action): rows
-- deleted (or ids changed) while children name them are refused (NO
-- ACTION), or the children's column is set to NULL (SET NULL, deletes).
CREATE OR REPLACE FUNCTION campaignapi_key_gone() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    gone text := CASE TG_OP WHEN 'DELETE' THEN 'SELECT id FROM removed'
                 ELSE 'SELECT id FROM removed EXCEPT SELECT id FROM added' END;
    key bigint;
BEGIN
    IF TG_OP = 'DELETE' AND TG_ARGV[2] = 'SET NULL' THEN
        EXECUTE format('UPDATE %1$I SET %2$I = NULL WHERE %2$I IN (%3$s)', TG_ARGV[0],
                       TG_ARGV[1], gone);
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT %2$I FROM %1$I WHERE %2$I IN (%3$s) LIMIT 1', TG_ARGV[0],
                   TG_ARGV[1], gone) INTO key;
    IF key IS NOT NULL THEN
        RAISE foreign_key_violation USING
            MESSAGE = format('update or delete on table "%s" violates foreign key constraint '
                             '"%s_%s_fkey" on table "%s"', TG_TABLE_NAME, TG_ARGV[0],
                             TG_ARGV[1], TG_ARGV[0]),
            DETAIL = format('Key (id)=(%s) is still referenced from table "%s".', key,
                            TG_ARGV[0]),
            TABLE = TG_ARGV[0], CONSTRAINT = format('%s_%s_fkey', TG_ARGV[0], TG_ARGV[1]);
    END IF;
    RETURN NULL;
END $$;
"""

#: The foreign keys that PostgreSQL checks once a statement by the triggers
#: above instead of once a row, by table and column: the columns an import
#: writes for every row.  Their REFERENCES clause in schema.sql (parent and
#: ON DELETE action) says what the triggers do.
_PG_STATEMENT_KEYS = {"recipient": ("datasource", "import")}

#: Indexes of schema.sql that PostgreSQL builds with another method.  BRIN:
#: recipient.import grows with the rows (an import appends its recipients
#: together), so block ranges find an import's rows at a fraction of a
#: b-tree's cost per inserted row.
_PG_INDEX_METHODS = {"recipient_import": "brin"}


def _pg_schema(script):
    """schema.sql (or a migration's DDL) as PostgreSQL runs it.

    schema.sql is written once, in SQLite's spelling; these words map:
    ``id INTEGER PRIMARY KEY`` becomes a BIGINT identity column (explicit ids
    still insert; a trigger moves the sequence past those close ahead, see
    ID_REACH), every other
    ``INTEGER`` BIGINT (SQLite's are 64 bits), ``AUTOINCREMENT`` goes (an
    identity never hands out an id twice either), a ``TEXT`` column whose line
    says ``COLLATE NOCASE`` citext (in a database with the C ctype it folds
    ASCII only, like NOCASE), ``WITHOUT ROWID`` goes, ``datetime('now')``
    becomes SQL["postgresql"]["now"], SQL["sqlite"]["non_ascii"] of email
    (a partial index's predicate) its PostgreSQL spelling.  JSON stays TEXT: the stored text is
    the same on both engines and the spellings cast it to jsonb where read.
    The foreign keys of _PG_STATEMENT_KEYS become triggers run once a
    statement, the indexes of _PG_INDEX_METHODS take their method.
    """
    lines, tables, keys, current = [], [], [], None
    for line in script.splitlines():
        line = line.split("--", 1)[0].rstrip()    # no '--' inside the schema's strings
        if "COLLATE NOCASE" in line:
            line = re.sub(r"\bTEXT\b", "CITEXT", line).replace(" COLLATE NOCASE", "")
        table = re.match(r"\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", line, re.I)
        if table:
            current = table[1]
        if current and re.match(r"\s*id\s+INTEGER\s+PRIMARY\s+KEY\b", line):
            line = line.replace("INTEGER PRIMARY KEY",
                                "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
            tables.append(current)
        key = re.match(r"\s*(\w+)\s.*?( REFERENCES (\w+)\(id\)(?: ON DELETE (SET NULL))?)",
                       line)
        if key and key[1] in _PG_STATEMENT_KEYS.get(current, ()):
            line = line.replace(key[2], "")
            keys.append((current, key[1], key[3], key[4] or "NO ACTION"))
        index = re.match(r"\s*CREATE\s+INDEX\s+IF\s+NOT\s+EXISTS\s+(\w+)\s+ON\s+(\w+)", line)
        if index and index[1] in _PG_INDEX_METHODS:
            line = line.replace(f" ON {index[2]}(", f" ON {index[2]} USING "
                                                     f"{_PG_INDEX_METHODS[index[1]]} (")
        line = re.sub(r"\bINTEGER\b", "BIGINT", line)
        line = line.replace(") WITHOUT ROWID;", ");").replace(" AUTOINCREMENT", "")
        line = line.replace("datetime('now')", _SQL["postgresql"]["now"])
        line = line.replace(_SQL["sqlite"]["non_ascii"].format(expr="email"),
                            _SQL["postgresql"]["non_ascii"].format(expr="email"))
        lines.append(line)
    for table in tables:
        lines.append(_pg_statement_trigger(f"{table}_id_past", "INSERT", table,
                                           f"campaignapi_ids_past('{table}_id_seq', "
                                           f"'{_ID_REACH}')"))
    for table, column, parent, action in keys:
        name = f"{table}_{column}_fkey"
        for event in ("INSERT", "UPDATE"):
            lines.append(_pg_statement_trigger(f"{name}_{event.lower()}", event, table,
                                               f"campaignapi_key_present('{column}', '{parent}')"))
        for event in ("DELETE", "UPDATE"):
            lines.append(_pg_statement_trigger(
                f"{name}_parent_{event.lower()}", event, parent,
                f"campaignapi_key_gone('{table}', '{column}', '{action}')"))
    return "\n".join(lines) + "\n"


def _pg_statement_trigger(name, event, table, function):
    """A trigger run once per statement that sees the statement's rows as
    ``added`` (new versions) and ``removed`` (old ones)."""
    tables = {"INSERT": "NEW TABLE AS added", "DELETE": "OLD TABLE AS removed",
              "UPDATE": "OLD TABLE AS removed NEW TABLE AS added"}[event]
    return (f"CREATE OR REPLACE TRIGGER {name} AFTER {event} ON {table} REFERENCING {tables} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function};")


@functools.lru_cache(maxsize=1)
def _pg_id_tables():
    """The tables of schema.sql that have an ``id INTEGER PRIMARY KEY``."""
    with open(_schema_path(), encoding="utf-8") as file:
        return frozenset(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+) \(\s*id\s+INTEGER PRIMARY KEY",
                                    file.read()))


# Schema and migrations --------------------------------------------------------

#: The steps from one schema version to the next, in order: ``(version,
#: step)`` brings a database at ``version - 1`` to ``version``.  A step is SQL
#: in schema.sql's spelling (run on both engines; mapped for PostgreSQL like
#: the schema), a function ``step(conn)``, or a dict of either per engine
#: (``{"sqlite": lambda conn: _rebuild_table(conn, ...), "postgresql": "ALTER
#: TABLE ..."}``).  All steps run in one transaction; then schema.sql runs
#: again, so new tables and indexes need no step.
_MIGRATIONS = (
    # Version 2: sign-ups, statuses 'unconfirmed' and 'complained', templates,
    # tracking, bounces and complaints, webhooks.  New tables come from
    # schema.sql; these are the changes to the tables version 1 has.
    (2, """
ALTER TABLE datasource ADD COLUMN signup INTEGER NOT NULL DEFAULT 0 CHECK (signup IN (0, 1));
ALTER TABLE datasource ADD COLUMN doubleoptin INTEGER NOT NULL DEFAULT 1
    CHECK (doubleoptin IN (0, 1));
ALTER TABLE datasource ADD COLUMN confirmmessage INTEGER;
ALTER TABLE datasource ADD COLUMN welcomemessage INTEGER;
ALTER TABLE datasource ADD COLUMN fromprofile INTEGER;
ALTER TABLE campaign ADD COLUMN tracking INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1));
ALTER TABLE batch ADD COLUMN tracking INTEGER NOT NULL DEFAULT 0 CHECK (tracking IN (0, 1));
"""),
    (2, {
        # New CHECK lists and columns: SQLite rebuilds the table as schema.sql
        # declares it; PostgreSQL swaps the named constraint.
        "sqlite": lambda conn: [_rebuild_table(conn, table, _schema_table(table))
                                for table in ("suppression", "recipient", "outbox")],
        "postgresql": """
ALTER TABLE suppression DROP CONSTRAINT suppression_reason_check;
ALTER TABLE suppression ADD CONSTRAINT suppression_reason_check
    CHECK (reason = 'unsubscribed' OR reason = 'bounced' OR reason = 'complained');
ALTER TABLE recipient DROP CONSTRAINT recipient_status_check;
ALTER TABLE recipient ADD CONSTRAINT recipient_status_check
    CHECK (status = 'active' OR status = 'unconfirmed' OR status = 'unsubscribed'
           OR status = 'bounced' OR status = 'complained');
ALTER TABLE recipient ADD COLUMN confirm_sent TEXT;
ALTER TABLE outbox DROP CONSTRAINT outbox_kind_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_kind_check
    CHECK (kind = 'campaign' OR kind = 'archive' OR kind = 'notification'
           OR kind = 'signup' OR kind = 'test');
ALTER TABLE outbox ADD COLUMN fromname TEXT;
ALTER TABLE outbox ADD COLUMN fromaddress TEXT;
ALTER TABLE outbox ADD COLUMN replyto TEXT;
"""}),
    # Version 3: the intake table (schema.sql); on PostgreSQL the checks an
    # import paid for every row run once a statement (_PG_PREAMBLE): the
    # foreign keys of recipient.datasource and recipient.import and the id
    # trigger leave (schema.sql makes the triggers again), recipient_import
    # becomes a BRIN index.
    (3, {"sqlite": "", "postgresql": """
ALTER TABLE recipient DROP CONSTRAINT IF EXISTS recipient_datasource_fkey;
ALTER TABLE recipient DROP CONSTRAINT IF EXISTS recipient_import_fkey;
DROP INDEX IF EXISTS recipient_import;
DROP FUNCTION IF EXISTS campaignapi_id_past() CASCADE;
"""}),
    # Version 4: the id sequences no longer follow explicit ids far ahead
    # (ID_REACH): SQLite's live in id_sequence (schema.sql), PostgreSQL's
    # trigger changes (_PG_PREAMBLE, its triggers made again by schema.sql),
    # and a sequence that an explicit id sent past MAX_EXPLICIT_ID comes back.
    (4, {"sqlite": "", "postgresql": lambda conn: _pg_sequences_back(conn)}),
    # Version 5: a tracked batch keeps its tracked html (prepared once, not
    # again at delivery); a test send names its campaign and base URL.
    # (On SQLite version 2 rebuilt the outbox as schema.sql has it now.)
    (5, {"sqlite": lambda conn: _sqlite_add_columns(conn, (
        ("batch_message", "tracked TEXT"), ("outbox", "campaign INTEGER"),
        ("outbox", "base_url TEXT"))), "postgresql": """
ALTER TABLE batch_message ADD COLUMN IF NOT EXISTS tracked TEXT;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS campaign INTEGER;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS base_url TEXT;
"""}),
    # Version 6: prepared messages (tables in schema.sql): an outbox email and
    # an event name theirs; the outbox takes the kinds 'automation' and
    # 'transactional' (SQLite rebuilds it as schema.sql declares it).
    (6, {"sqlite": lambda conn: (_rebuild_table(conn, "outbox", _schema_table("outbox")),
                                 _sqlite_add_columns(conn, (("event", "prepared INTEGER"),))),
         "postgresql": """
ALTER TABLE outbox DROP CONSTRAINT outbox_kind_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_kind_check
    CHECK (kind = 'campaign' OR kind = 'archive' OR kind = 'notification'
           OR kind = 'signup' OR kind = 'test' OR kind = 'automation'
           OR kind = 'transactional');
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS prepared INTEGER;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS merge_values TEXT;
ALTER TABLE IF EXISTS event ADD COLUMN IF NOT EXISTS prepared INTEGER;
"""}),
    # Version 7: A/B tests.  The campaign's test settings and a link's
    # variants are new columns; the batch status 'testing' and the outbox
    # status 'waiting' new CHECK lists (SQLite rebuilds batch as schema.sql
    # has it, the outbox was rebuilt by version 6; PostgreSQL swaps the named
    # constraints).
    (7, {"sqlite": lambda conn: (_sqlite_add_columns(conn, (
        ("campaign", "testsize INTEGER NOT NULL DEFAULT 20 CHECK (testsize BETWEEN 10 AND 50)"),
        ("campaign", "testmetric TEXT NOT NULL DEFAULT 'opens' "
                     "CHECK (testmetric IN ('opens', 'clicks'))"),
        ("campaign", "testwait INTEGER NOT NULL DEFAULT 14400 "
                     "CHECK (testwait BETWEEN 60 AND 604800)"),
        ("campaign_message", "variants TEXT NOT NULL DEFAULT '[]'"))), [
            _rebuild_table(conn, "batch", _schema_table("batch"))]),   # outbox: version 6
        "postgresql": """
ALTER TABLE campaign ADD COLUMN IF NOT EXISTS testsize INTEGER NOT NULL DEFAULT 20
    CHECK (testsize BETWEEN 10 AND 50);
ALTER TABLE campaign ADD COLUMN IF NOT EXISTS testmetric TEXT NOT NULL DEFAULT 'opens'
    CHECK (testmetric IN ('opens', 'clicks'));
ALTER TABLE campaign ADD COLUMN IF NOT EXISTS testwait INTEGER NOT NULL DEFAULT 14400
    CHECK (testwait BETWEEN 60 AND 604800);
ALTER TABLE campaign_message ADD COLUMN IF NOT EXISTS variants TEXT NOT NULL DEFAULT '[]';
ALTER TABLE batch DROP CONSTRAINT batch_status_check;
ALTER TABLE batch ADD CONSTRAINT batch_status_check
    CHECK (status IN ('scheduled', 'testing', 'sending', 'sent', 'cancelled'));
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
    CHECK (status = 'queued' OR status = 'sending' OR status = 'sent'
           OR status = 'failed' OR status = 'skipped' OR status = 'waiting');
"""}),
    # Version 8: the outbox's priority (transactional emails go first); the
    # SQLite rebuild of version 6 already made it from schema.sql.
    (8, {"sqlite": lambda conn: _sqlite_add_columns(
        conn, (("outbox", "priority INTEGER NOT NULL DEFAULT 0"),)),
         "postgresql": "ALTER TABLE outbox ADD COLUMN IF NOT EXISTS priority BIGINT NOT NULL "
                       "DEFAULT 0;"}),
    # Version 10: pages people see: a datasource's language, a field's label
    # on the sign-up form, a campaign in the public archive, and the lists
    # each batch made so far mailed (as its outbox rows say).
    (10, {"sqlite": lambda conn: _sqlite_add_columns(conn, (
        ("datasource", "language TEXT NOT NULL DEFAULT 'en' "
                       "CHECK (language IN ('en', 'de', 'fr', 'es', 'nl'))"),
        ("field", "label TEXT NOT NULL DEFAULT ''"),
        ("campaign", "public INTEGER NOT NULL DEFAULT 0 CHECK (public IN (0, 1))"))),
        "postgresql": """
ALTER TABLE datasource ADD COLUMN IF NOT EXISTS language TEXT NOT NULL DEFAULT 'en'
    CHECK (language IN ('en', 'de', 'fr', 'es', 'nl'));
ALTER TABLE field ADD COLUMN IF NOT EXISTS label TEXT NOT NULL DEFAULT '';
ALTER TABLE campaign ADD COLUMN IF NOT EXISTS public INTEGER NOT NULL DEFAULT 0
    CHECK (public IN (0, 1));
"""}),
    (10, lambda conn: (conn.run_script(conn.schema_script(_schema_table("batch_datasource"))),
                       conn.execute(
        "INSERT INTO batch_datasource (datasource, batch) SELECT DISTINCT r.datasource, o.batch "
        "FROM outbox o JOIN recipient r ON r.id = o.recipient JOIN batch b ON b.id = o.batch "
        "WHERE o.kind = 'campaign' ON CONFLICT DO NOTHING"))),
)


def _sqlite_add_columns(conn, columns):
    """Add each ``(table, "name TYPE")`` of ``columns`` the table lacks (a
    table not there yet comes whole from schema.sql)."""
    for table, column in columns:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if have and column.split()[0] not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def _pg_sequences_back(conn):
    """Bring each id sequence that an explicit id sent past MAX_EXPLICIT_ID
    (before version 4) back to the ids below: its last id is where the ids
    from 0 end (_id_frontier)."""
    for table in sorted(_pg_id_tables()):
        sequence = f"{table}_id_seq"
        last = conn.execute("SELECT pg_sequence_last_value(to_regclass(?))",   # NULL: none yet
                            (sequence,)).fetchone()[0]
        if last is not None and last > MAX_EXPLICIT_ID:
            back = _id_frontier(conn, table, 0)
            conn.execute("SELECT setval(CAST(?1 AS regclass), greatest(CAST(?2 AS bigint), 1), "
                         "CAST(?2 AS bigint) > 0)", (sequence, back))


def _schema_table(table):
    """The ``CREATE TABLE`` statement of ``table`` in schema.sql."""
    with open(_schema_path(), encoding="utf-8") as file:
        script = file.read()
    match = re.search(rf"^CREATE TABLE IF NOT EXISTS {table} \(.*?^\)[^;]*;", script,
                      re.M | re.S)
    if match is None:
        raise RuntimeError(f"campaignapi: schema.sql has no table {table}")
    return match[0]


def _schema_path():
    here = os.path.dirname(os.path.abspath(__file__))
    # In a checkout (and an editable install) schema.sql sits beside the
    # module; a wheel installs it as campaignapi.schema.sql beside the module.
    for name in ("schema.sql", "campaignapi.schema.sql"):
        if os.path.exists(os.path.join(here, name)):
            return os.path.join(here, name)
    try:
        installed = importlib.metadata.files("campaignapi") or ()
    except importlib.metadata.PackageNotFoundError:  # a copied module, not installed
        installed = ()
    for file in installed:
        if file.name.endswith("schema.sql"):
            return str(file.locate())
    raise RuntimeError("campaignapi: schema.sql is not installed beside campaignapi.py")


def init_db(db):
    """Make the database at ``db`` current: a new one gets schema.sql, an
    older one the _MIGRATIONS steps after its version, in one transaction.

    An existing database keeps its data.  A database made by a newer version
    is refused.  Processes that start at once take turns.

    :param db: the SQLite file or a ``postgresql://`` URL (see connect()).
    """
    conn = connect(db)
    try:
        if conn.schema_version() == SCHEMA_VERSION:
            return
        with open(_schema_path(), encoding="utf-8") as f:
            script = f.read()
        if conn.engine == "sqlite" and conn.schema_version() == 0:
            # A new database: writes kept for one deleted at this path are not its own.
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{db}.intake{suffix}")
        with conn.schema_change():
            _migrate(conn, script, SCHEMA_VERSION, _MIGRATIONS)
    finally:
        conn.close()


def _migrate(conn, script, target, migrations):
    """Bring ``conn`` (inside its schema_change()) to version ``target``.

    :param script: the schema of version ``target`` (schema.sql's text).
    :param migrations: ``(version, step)`` pairs as in _MIGRATIONS.
    """
    version = conn.schema_version()     # again: another process may have done it
    if version > target:
        raise RuntimeError(f"the database has schema version {version}; "
                           f"this campaignapi knows {target}")
    if version == target:
        return
    if version:   # 0: a new database, made by schema.sql alone
        for number, step in migrations:
            if number > version:
                if isinstance(step, dict):
                    step = step[conn.engine]
                if callable(step):
                    step(conn)
                else:
                    conn.run_script(conn.schema_script(step))
    conn.run_script(conn.schema_script(script))
    conn.set_schema_version(target)


def _now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _today():
    """Today (UTC) as days since 1970-01-01: the expiry of signed links."""
    return (datetime.datetime.now(datetime.timezone.utc).date() - datetime.date(1970, 1, 1)).days


def _shift(moment_text, seconds):
    # fromisoformat: the same text, parsed in C (strptime took 50 us).
    moment = datetime.datetime.fromisoformat(moment_text)
    return (moment + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S")


# An import's writes -----------------------------------------------------------
#
# An import checks its rows in Python and hands them over a chunk at a time
# (_Importer.flush()): ``pending``, {folded address: (address, field keys,
# values)} in upload order.  How a chunk reaches recipient is where the
# engines differ most, so each connection class names its way
# (import_writes()): on SQLite one INSERT ... SELECT from json_each a chunk
# (_SqliteImportWrites); on PostgreSQL COPY, straight into recipient
# (_CopyStream) or through a staging table (_PgImportWrites).  Either way new
# addresses are inserted and known ones updated (their values merged in,
# never their status), each counted once on the importer.

#: Rows read, checked and written per executemany (imports, retypes).
_CHUNK_ROWS = 5000
#: At most this many rows an import commits at once (API.md section 5): no
#: other writer waits for more than that (_Importer.turn()).
_COMMIT_ROWS = 50_000
#: Rows of one statement of an import read by a child (_child_rows): a
#: writer that comes while the import runs waits for one such statement
#: (on SQLite 5,000 rows held the lock for 80-450 ms on two busy cores).
_WRITE_ROWS = 1000

_ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _nocase(address):
    """An address as the recipient table compares it (SQLite NOCASE folds ASCII only)."""
    return address.lower() if address.isascii() else address.translate(_ASCII_FOLD)


def _merged(earlier, later):
    """Two rows ``(address, keys, values)`` of one address from different
    chunks as one that an update applies at once: the later values win (blank
    ones too), the earlier address stays (an update keeps the stored one)."""
    if earlier[1] == later[1]:
        return earlier[0], later[1], later[2]
    values = {**dict(zip(earlier[1], earlier[2])), **dict(zip(later[1], later[2]))}
    return earlier[0], tuple(values), tuple(values.values())


#: COPY's text format: a backslash, tab, newline or carriage return escaped.
_COPY_TEXT = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


_json_string = json.encoder.encode_basestring  # C; keeps non-ASCII as it is, like _to_json


def _data_json(keys, values, *, blank=None):
    """The JSON object text of field values for recipient.data, keyed by the
    field ids ``keys``.  A blank value (None, or only whitespace as
    _convert_value() has it) is left out, or written as ``null`` when
    ``blank="null"`` (json_patch then removes the key).

    Written by hand, each value encoded by the json module, because it runs
    for every imported row: a dict and its encoding cost three times as much
    (and building the JSON in SQL, four).
    """
    members = []
    for key, value in zip(keys, values):
        if value.__class__ is str:
            if value and not value.isspace():
                members.append(f'"{key}":{_json_string(value)}')
                continue
        elif value is not None:
            members.append(f'"{key}":{_to_json(value)}')
            continue
        if blank:
            members.append(f'"{key}":{blank}')
    return "{" + ",".join(members) + "}"


def _data_columns(keyses, rows):
    """The data JSON of rows, as _data_json() has it, column by column:
    ``(parts, blank)``, the texts being ``map("".join, zip(*parts))`` for
    every row but those numbered in ``blank`` (a blank value: _data_json()
    row by row).  ``keyses``: each row's field ids, ``rows``: its values.
    None when the rows name different fields (a json upload).

    Built a column at a time by C (the json module's string encoder, joins of
    the columns with the key text between), because it runs for every
    imported row.
    """
    keys = keyses[0]
    if keyses.count(keys) != len(keyses):
        return None
    parts, blank = [], set()
    for at, (key, column) in enumerate(zip(keys, zip(*rows))):
        if set(map(type, column)) == {str}:
            encode = _json_string
            if "" in column or any(map(str.isspace, column)):
                blank.update(i for i, value in enumerate(column) if not value or value.isspace())
        else:
            encode = _to_json
            blank.update(i for i, value in enumerate(column) if value is None or (
                value.__class__ is str and (not value or value.isspace())))
        parts += [itertools.repeat(f'{"," if at else "{"}"{key}":'), map(encode, column)]
    parts.append(itertools.repeat("}" if keys else "{}"))
    return parts, blank


def _chunk_json(pending):
    """The rows of ``pending`` as flush() writes them on SQLite: one JSON object
    ``{address: data}`` in their order, data as _data_json() has it (built a
    column at a time: _data_columns())."""
    addresses, keyses, rows = zip(*pending.values())
    columns = _data_columns(keyses, rows)
    if columns is None:
        return "{" + ",".join([f"{_json_string(address)}:{_data_json(keys, values)}"
                               for address, keys, values in pending.values()]) + "}"
    parts, blank = columns
    parts[:0] = [map(_json_string, addresses), itertools.repeat(":")]
    if not blank:
        return "{" + ",".join(map("".join, zip(*parts))) + "}"
    texts = list(map("".join, zip(*parts)))
    for i in blank:
        texts[i] = f"{_json_string(addresses[i])}:{_data_json(keyses[i], rows[i])}"
    return "{" + ",".join(texts) + "}"


class _SqliteImportWrites:
    """An import's chunks on SQLite: each one statement (the C of SQLite
    instead of one executemany step per row), in the request's transaction,
    whose write lock keeps every other writer out."""

    def __init__(self, importer):
        self.importer = importer

    #: A chunk as a reading child sends it (_ChildReader): its JSON.
    pack = staticmethod(_chunk_json)

    def unpack(self, chunk, keys):
        """Write a chunk a reading child packed; ``keys``: the upload's fields."""
        blanks = dict.fromkeys(keys)
        self.write(chunk, lambda address, values: _to_json({**blanks, **json.loads(values)}))

    def flush(self, pending):
        self.write(_chunk_json(pending), lambda address, data: _data_json(
            *pending[_nocase(address)][1:], blank="null"))

    def write(self, chunk, patch):
        """A chunk, as _chunk_json() gives it as _chunk_json() gives it: one
        INSERT ... SELECT from json_each for the whole chunk (the C of SQLite
        instead of one executemany step per row), the known addresses left to
        ON CONFLICT and updated with ``patch(address, data)``, the JSON patch
        of their new values (blank ones null)."""
        importer = self.importer
        conn, temp, now = importer.conn, importer.conn.sql["temp"], _now()
        known, touched, updates = set(), [], []
        for recipient_id, address, data, source, seen in conn.execute(
                # CROSS JOIN: SQLite then loops over the chunk, looking each up
                # in the unique index (not over the datasource's recipients).
                "SELECT r.id, s.key, s.value, r.import, t.id IS NOT NULL FROM json_each(?) s "
                "CROSS JOIN recipient r ON r.datasource = ? AND r.email = s.key "
                f"LEFT JOIN {temp}.import_touched t ON t.id = r.id", (chunk, importer.datasource)):
            known.add(address)
            updates.append((now, patch(address, data), recipient_id))
            if source != importer.import_id and not seen:
                touched.append((recipient_id,))
        importer.updated += len(touched)
        conn.executemany(f"INSERT INTO {temp}.import_touched (id) VALUES (?)", touched)
        # The ids: SQLite's own (the largest + 1), or from the sequence's
        # next one where an explicit id stands far ahead (see ID_REACH).
        first = conn.next_id("recipient")
        ids = ("", "") if first is None else ("id, ", f"{first - 1} + row_number() OVER (), ")
        inserted = conn.execute(
            f"INSERT INTO recipient ({ids[0]}datasource, email, import, created, updated, data) "
            f"SELECT {ids[1]}?1, key, ?2, ?3, ?3, value FROM json_each(?4) WHERE 1 "
            "ON CONFLICT DO NOTHING", (importer.datasource, importer.import_id, now, chunk)).rowcount
        importer.inserted += inserted
        conn.executemany("UPDATE recipient SET updated = ?, data = "
                         f"{conn.sql['json_merge'].format(json='data', patch='?')} WHERE id = ?",
                         updates)
        if importer.hears_added and inserted:
            importer.added([address for address in json.loads(chunk) if address not in known])

    def finish(self):
        """Nothing is left open between chunks."""


def _copy_texts(rows):
    """Folded address -> the COPY text of the row's address and of its data,
    for the rows ``{folded: (address, keys, values)}`` (_CopyStream).

    The data built a column at a time (_data_columns()), and each text
    escaped only when the chunk holds a character to escape: per row, the
    Python of this was most of the reading child's CPU (0.8 s of 200,000 rows).
    """
    addresses, keyses, values = zip(*rows.values())
    columns = _data_columns(keyses, values)
    if columns is None:
        data = list(map(_data_json, keyses, values))
    else:
        parts, blank = columns   # bounded: with no field, every part repeats forever
        data = list(itertools.islice(map("".join, zip(*parts)), len(addresses)))
        for i in blank:
            data[i] = _data_json(keyses[i], values[i])
    return dict(zip(rows, zip(_copy_escaped(addresses), _copy_escaped(data))))


def _copy_escaped(texts):
    """``texts`` in COPY's text format (_COPY_TEXT): as they are when none
    holds a character to escape (one search of them all, in C)."""
    joined = "".join(texts)
    if "\\" in joined or "\t" in joined or "\n" in joined or "\r" in joined:
        return [text.translate(_COPY_TEXT) for text in texts]
    return texts


class _PgImportWrites:
    """An import's chunks on PostgreSQL.  Into a datasource that was empty
    when the import began, the rows go straight into recipient by one COPY
    kept open (_CopyStream); else through a staging table (stage())."""

    def __init__(self, importer):
        self.importer = importer
        importer.conn.execute("CREATE TEMP TABLE IF NOT EXISTS import_rows "
                              "(n integer, email citext, data text, patch text, id bigint)")
        self.stream = None   # the _CopyStream, False when staging, None: not known yet

    @staticmethod
    def pack(pending):
        """A chunk as a reading child sends it (_ChildReader): its rows, and
        the COPY text of each row's address and data, made in the child (the
        per-row Python of a COPY held this process's GIL)."""
        return pending, _copy_texts(pending)

    def unpack(self, chunk, keys):
        """Write a chunk a reading child packed."""
        self.flush(*chunk)

    def flush(self, pending, texts=None):
        """``texts``: each row's COPY text, when a reading child made it (pack())."""
        if self.stream is None:   # the first chunk: before this import wrote a recipient
            importer = self.importer
            empty = importer.conn.execute("SELECT NOT EXISTS (SELECT 1 FROM recipient "
                                      "WHERE datasource = ?)", (importer.datasource,)).fetchone()[0]
            self.stream = _CopyStream(self) if empty else False
        if self.stream:
            self.stream.write(pending, texts)
        else:
            self.stage(pending)

    def stage(self, pending):
        """The chunk goes into a temporary table by COPY, then set-based
        statements apply the same rules as _SqliteImportWrites: the new
        addresses are inserted and leave the staging table; the known ones
        left in it are counted and updated."""
        importer = self.importer
        conn, now = importer.conn, _now()
        conn.execute("TRUNCATE pg_temp.import_rows")
        with conn.raw.cursor() as cursor, cursor.copy(
                "COPY pg_temp.import_rows (n, email, data, patch) FROM STDIN") as copy:
            copy.write("".join([
                f"{number}\t{address.translate(_COPY_TEXT)}\t"
                f"{_data_json(keys, values).translate(_COPY_TEXT)}\t"
                f"{_data_json(keys, values, blank='null').translate(_COPY_TEXT)}\n"
                for number, (address, keys, values) in enumerate(pending.values())]))
        added = conn.execute(
            "WITH added AS (INSERT INTO recipient (datasource, email, import, created, updated, "
            "data) SELECT ?, s.email, ?, ?, ?, s.data FROM pg_temp.import_rows s "
            "ORDER BY s.n ON CONFLICT (datasource, email) DO NOTHING RETURNING email) "
            "DELETE FROM pg_temp.import_rows s USING added a WHERE s.email = a.email"
            + (" RETURNING CAST(s.email AS text)" if importer.hears_added else ""),
            (importer.datasource, importer.import_id, now, now))
        inserted = added.rowcount
        importer.inserted += inserted
        if importer.hears_added and inserted:
            importer.added([row[0] for row in added.fetchall()])
        if inserted == len(pending):
            return
        # Each known address's id, by one probe of the unique index a row.  A
        # join on (datasource, email) is planned from recipient's statistics,
        # which know nothing of the rows this import added: with the table
        # analyzed before it, the plan read the whole datasource per chunk
        # (a 1M-row import into a new datasource did not end in 9 minutes).
        conn.execute("UPDATE pg_temp.import_rows s SET id = (SELECT r.id FROM recipient r "
                     "WHERE r.datasource = ? AND r.email = s.email)", (importer.datasource,))
        conn.execute("ANALYZE pg_temp.import_rows")   # a few rows: the joins use the index
        # Known recipients that this import has not updated yet count as updated.
        importer.updated += conn.execute(
            "INSERT INTO pg_temp.import_touched (id) SELECT r.id FROM recipient r "
            "JOIN pg_temp.import_rows s ON s.id = r.id "
            "WHERE r.import IS DISTINCT FROM ? ON CONFLICT DO NOTHING",
            (importer.import_id,)).rowcount
        conn.execute("UPDATE recipient r SET updated = ?, data = "
                     f"{conn.sql['json_merge'].format(json='r.data', patch='s.patch')} "
                     "FROM pg_temp.import_rows s WHERE s.id = r.id", (now,))

    def finish(self):
        """A streamed COPY ends here."""
        if self.stream:
            self.stream.end()


class _CopyStream:
    """The rows of an import into a datasource that was empty when it began,
    written straight into recipient by one COPY that stays open from chunk to
    chunk: the server stores a chunk while the next one is read and checked
    (two cores at work instead of one after the other), and no staging table
    or INSERT ... SELECT stands between.

    Only addresses that are new to the import go this way; a repeat (or what
    a filter of the addresses streamed so far takes for one) waits for the
    end of the segment and then goes through stage(), in order, as an update.
    The datasource may still have gained an address meanwhile (a sign-up):
    each segment runs in a savepoint, and when the COPY ends in a conflict
    the segment is rolled back and its chunks staged instead.

    A segment ends (end()) when it holds SEGMENT_ROWS rows or a chunk of
    repeats, at the import's finish(), and before the connection runs any
    other statement (_PgConnection.copying): making a new field, marking
    erased addresses, or the transaction's COMMIT or ROLLBACK (which drops it).
    """

    #: Rows a segment keeps for a conflict: bounds the memory and the rows
    #: written again, and keeps the savepoints (subtransactions) few.  The
    #: kept rows are parsed (about 500 bytes each in Python): at 50,000 they
    #: were the import's largest holding after the body (a 200,000-row import
    #: grew the process by 3.1x its upload, 2.0x at 20,000), and the segments
    #: of 20,000 took the same time.
    SEGMENT_ROWS = 20_000

    #: The filter of the addresses streamed: 2 bits of 2**26 for each.  No
    #: address is missed; at a million addresses 0.1% of new ones are taken
    #: for repeats (and pay the staging path), at ten million 7%.
    SEEN_BITS = 1 << 26

    def __init__(self, writes):
        self.writes, self.importer, self.conn = writes, writes.importer, writes.importer.conn
        self.seen = bytearray(self.SEEN_BITS // 8)
        self.copy = self.closing = None
        self.chunks, self.repeats, self.rows = [], {}, 0

    def _repeated(self, folded):
        """Whether ``folded`` may have been seen (then or before); marks it seen."""
        seen, mask, code = self.seen, self.SEEN_BITS - 1, hash(folded)
        first, second = code & mask, (code >> 32) & mask
        known = seen[first >> 3] >> (first & 7) & seen[second >> 3] >> (second & 7) & 1
        seen[first >> 3] |= 1 << (first & 7)
        seen[second >> 3] |= 1 << (second & 7)
        return known

    def write(self, pending, texts=None):
        """``texts``: folded address -> the COPY text of the row's address
        and data, when made already (_PgImportWrites.pack())."""
        fresh, repeats = {}, self.repeats
        for folded, row in pending.items():
            if not self._repeated(folded):
                fresh[folded] = row
            elif folded in repeats:   # a repeat of a repeat: merged as add() merges
                repeats[folded] = _merged(repeats[folded], row)
            else:
                repeats[folded] = row
        if fresh:
            if self.copy is None:
                self._begin()
            importer, now = self.importer, _now()
            source = "\\N" if importer.import_id is None else importer.import_id   # \N: NULL
            start, middle = f"{importer.datasource}\t", f"\t{source}\t{now}\t{now}\t"
            if texts is None:
                texts = _copy_texts(fresh)
            self.copy.write("".join([f"{start}{address}{middle}{data}\n"
                                     for address, data in map(texts.__getitem__, fresh)]))
            self.chunks.append(fresh)
            self.rows += len(fresh)
            importer.inserted += len(fresh)  # taken back if the segment is staged instead
        if self.rows >= self.SEGMENT_ROWS or len(repeats) >= _CHUNK_ROWS:
            self.end()

    def _begin(self):
        import psycopg.copy

        self.conn.execute("SAVEPOINT import_stream")
        self.closing = contextlib.ExitStack()
        cursor = self.closing.enter_context(self.conn.raw.cursor())
        # Queued: write() hands the data to a thread that sends it, so the
        # next chunk is read while the server stores this one.
        self.copy = self.closing.enter_context(cursor.copy(
            "COPY recipient (datasource, email, import, created, updated, data) FROM STDIN",
            writer=psycopg.copy.QueuedLibpqWriter(cursor)))
        self.conn.copying = self.end

    def end(self, rollback=False):
        """End the segment: the COPY's rows kept (or, after a conflict, staged
        instead), then the repeats staged.  ``rollback``: the transaction is
        being rolled back, so drop it all."""
        conn, importer = self.conn, self.importer
        conn.copying = None
        chunks, repeats, closing = self.chunks, self.repeats, self.closing
        self.copy = self.closing = None
        self.chunks, self.repeats, self.rows = [], {}, 0
        if rollback:
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.__exit__(RuntimeError, RuntimeError("rolled back"), None)
            return
        if closing is not None:
            import psycopg

            try:
                closing.close()
            except psycopg.errors.UniqueViolation:   # an address came from elsewhere meanwhile
                conn.execute("ROLLBACK TO SAVEPOINT import_stream")
                importer.inserted -= sum(map(len, chunks))
                for chunk in chunks:   # every address of a chunk before its repeats
                    self.writes.stage(chunk)
            else:
                if importer.hears_added:
                    importer.added([address for chunk in chunks
                                    for address, _, _ in chunk.values()])
            conn.execute("RELEASE SAVEPOINT import_stream")
        if repeats:
            self.writes.stage(repeats)


# Kept public writes: the intake's storage --------------------------------------
#
# The public writes that could not wait for their locks (see _Intake) are
# kept where the lock that stopped them does not reach, and applied in the
# order they came.  Each connection class names its place (intake()).

class _SqliteIntake:
    """Kept public writes on SQLite: in a file of their own beside the
    database (``<db>.intake``), which the database's one write lock (a big
    import's) does not reach.  The last id applied is kept in the database,
    in the transaction that applies it, so each is applied once, also when
    the process dies between the two files.

    :param db: the database file.
    :param conn: a function giving this thread's connection to it.
    :param wait: how long applying writes at once waits for the lock (ms).
    """

    def __init__(self, db, conn, wait):
        self.db, self.conn, self.wait = db, conn, wait
        self.path = f"{db}.intake"
        self.local = threading.local()   # this thread's side and quick connections

    def quick(self, conn):
        """The connection for applying a request's writes at once: one of
        this thread whose busy timeout is ``wait``."""
        quick = getattr(self.local, "quick", None)
        if quick is None:
            quick = self.local.quick = connect(self.db)
            quick.execute(f"PRAGMA busy_timeout = {self.wait}")
            quick.turn_wait = self.wait / 1000
        return quick

    def quick_transaction(self, quick):
        """A transaction on quick()'s connection: it waits ``wait`` for the lock."""
        return transaction(quick)

    def kept(self):
        """Whether any writes are kept."""
        if not os.path.exists(self.path):
            return False
        return self._side().execute("SELECT 1 FROM intake LIMIT 1").fetchone() is not None

    def keep(self, conn, rows):
        """Keep ``rows``, ``(kind, payload JSON, created)``, after the others."""
        _keep_intake(self._side(), rows)

    def drain(self, conn, limit, apply):
        """Hand up to ``limit`` kept writes, ``(kind, payload)`` the oldest
        first, to ``apply`` in a transaction of ``conn`` and take them off;
        how many were taken off."""
        side = self._side()
        rows = side.execute("SELECT id, kind, payload FROM intake ORDER BY id LIMIT ?",
                            (limit,)).fetchall()
        if not rows:
            return 0
        with transaction(conn):
            done = self._applied(conn)
            apply([(row["kind"], json.loads(row["payload"])) for row in rows if row["id"] > done])
            conn.execute("INSERT INTO setting (name, value) VALUES ('intake_applied', ?) "
                         "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                         (str(rows[-1]["id"]),))
        with transaction(side):
            side.execute("DELETE FROM intake WHERE id <= ?", (rows[-1]["id"],))
        return len(rows)

    @staticmethod
    def _applied(conn):
        """The id of the last kept write the database applied (0: none)."""
        row = conn.execute("SELECT value FROM setting WHERE name = 'intake_applied'").fetchone()
        return int(row["value"]) if row else 0

    def _side(self):
        """This thread's connection to the side file, made on first use with
        its ids starting after the last one the database applied."""
        side = getattr(self.local, "intake", None)
        if side is None:
            side = connect(self.path)
            try:
                with transaction(side):
                    if side.execute("SELECT 1 FROM sqlite_master WHERE name = 'intake'"
                                    ).fetchone() is None:
                        side.execute(_schema_table("intake"))
                        side.execute("INSERT INTO sqlite_sequence (name, seq) VALUES "
                                     "('intake', ?)", (self._applied(self.conn()),))
            except BaseException:
                side.close()
                raise
            self.local.intake = side
        return side


class _PgIntake:
    """Kept public writes on PostgreSQL: in the intake table, which an
    import's row locks do not reach; one drainer at a time (an advisory
    lock) keeps the order across hosts.  Arguments as _SqliteIntake's."""

    _LOCK = 0x696e7461   # 'inta': the advisory lock of one drainer

    def __init__(self, db, conn, wait):
        self.conn, self.wait = conn, wait

    def quick(self, conn):
        """The request's own connection (see quick_transaction())."""
        return conn

    @contextlib.contextmanager
    def quick_transaction(self, conn):
        """A transaction that waits at most ``wait`` for each lock."""
        with transaction(conn):
            conn.execute(f"SET LOCAL lock_timeout = {self.wait}")
            yield conn

    def kept(self):
        return self.conn().execute("SELECT 1 FROM intake LIMIT 1").fetchone() is not None

    def keep(self, conn, rows):
        _keep_intake(conn, rows)

    def drain(self, conn, limit, apply):
        with transaction(conn):
            if not conn.execute("SELECT pg_try_advisory_xact_lock(?)",
                                (self._LOCK,)).fetchone()[0]:
                return 0
            rows = conn.execute("SELECT id, kind, payload FROM intake ORDER BY id LIMIT ?",
                                (limit,)).fetchall()
            apply([(row["kind"], json.loads(row["payload"])) for row in rows])
            if rows:
                conn.execute("DELETE FROM intake WHERE id IN "
                             f"({conn.sql['json_ids'].format(array='?')})",
                             (_to_json([row["id"] for row in rows]),))
        return len(rows)


def _keep_intake(store, rows):
    with transaction(store):
        store.executemany("INSERT INTO intake (kind, payload, created) VALUES (?, ?, ?)", rows)


# ---------------------------------------------------------------------------
# Signing and tokens: the app secret, the one key derivation from it, and every
# kind of signed thing made with it (tracking, unsubscribe and confirm tokens,
# VERP addresses, Message-IDs, erasure hashes), each made and read here.
# ---------------------------------------------------------------------------

def _stored_secret(conn, create=True):
    """The secret kept in the database, made on first use (unless not ``create``: None)."""
    row = conn.execute("SELECT value FROM setting WHERE name = 'secret'").fetchone()
    if row or not create:
        return row and row["value"]
    with transaction(conn):
        conn.execute("INSERT INTO setting (name, value) VALUES ('secret', ?) "
                     "ON CONFLICT DO NOTHING", (secrets.token_hex(32),))
    return conn.execute("SELECT value FROM setting WHERE name = 'secret'").fetchone()["value"]


def _b64(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text):
    """Bytes of unpadded base64url text; ValueError unless the text is the one
    canonical spelling (b64decode skips stray characters, and the unused low
    bits of the last character would let one token have several spellings)."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


# The key derivation ----------------------------------------------------------

#: An opaque token's purpose ('open', 'click', 'unsubscribe', 'confirm') has a
#: key of its own, HMAC-SHA256(secret, this label + purpose).
_TOKEN_KEY_LABEL = b"campaignapi token key:"
#: The kinds signed before the opaque tokens came, keyed by the secret itself
#: and told apart by the label their message starts with: an unsubscribe token
#: of the first release (it names the address), a VERP address and a
#: Message-ID (one mac for both: they name the same outbox email), an erased
#: address.  Both schemes stay exactly as released, or every link, address and
#: Message-ID already sent would stop working (tests/test_signing.py pins them).
_SECRET_KEYED = {"unsubscribe address": b"unsubscribe:", "verp": b"verp:", "erasure": b""}


@functools.lru_cache(maxsize=32)
def _purpose_key(secret, purpose):
    """The key of ``purpose``, derived from the app secret (str or bytes): one
    key per token purpose, so a click token can never pass as an unsubscribe
    token whatever numbers they hold; the secret itself for _SECRET_KEYED."""
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if purpose in _SECRET_KEYED:
        return secret
    return hmac.digest(secret, _TOKEN_KEY_LABEL + purpose.encode("utf-8"), "sha256")


def _mac(secret, purpose, message):
    """HMAC-SHA256 of ``message`` for ``purpose``: the one MAC of every signed thing."""
    if not isinstance(secret, (str, bytes)):
        secret = bytes(secret)  # a bytearray or memoryview: hashable for the key cache
    return hmac.digest(_purpose_key(secret, purpose),
                       _SECRET_KEYED.get(purpose, b"") + message, "sha256")


# Opaque tokens: open, click, unsubscribe, confirm ----------------------------

#: 96 bits of HMAC-SHA256: unforgeable by guessing, and a short link.
_TOKEN_MAC_BYTES = 12
#: Longer text is refused unread (a token holds a few small numbers).
_TOKEN_MAX_CHARS = 200


def _varints(numbers):
    out = bytearray()
    for number in numbers:
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise ValueError(f"a token holds non-negative integers, not {number!r}")
        while number > 0x7F:
            out.append(number & 0x7F | 0x80)
            number >>= 7
        out.append(number)
    return bytes(out)


def _parse_varints(data):
    """The numbers of ``data``, or None unless each has its shortest spelling."""
    numbers, number, shift = [], 0, 0
    for byte in data:
        number |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
        elif byte == 0 and shift:
            return None  # a needless zero group: a second spelling of a number
        else:
            numbers.append(number)
            number = shift = 0
    return None if shift else tuple(numbers)


def sign_token(secret, purpose, *numbers):
    """A short, opaque, signed token holding ``numbers`` for one ``purpose``.

    The numbers are packed as varints and followed by a truncated
    HMAC-SHA256 under a key of the purpose; the whole is base64url without
    padding (an outbox id and a link index: about 22 characters).  Nothing
    personal goes in: a token names rows, the database knows the rest.  The
    numbers are signed, not encrypted: readable with effort, never changed.

    :param secret: the service secret (str or bytes).
    :param purpose: what the token is for: 'open' (the outbox id), 'click'
        (the outbox id, the link's index), 'unsubscribe' (the campaign, the
        recipient), 'confirm' (the recipient, the last day it works); a token
        read for another purpose is refused.
    :param numbers: non-negative ints (ids, a link index, an expiry day).
    """
    if purpose in _SECRET_KEYED:
        raise ValueError(f"{purpose!r} is not a purpose of opaque tokens")
    payload = _varints(numbers)
    return _b64(payload + _mac(secret, purpose, payload)[:_TOKEN_MAC_BYTES])


def read_token(secret, purpose, token):
    """The numbers of a token that sign_token() made for ``purpose``, or None
    for anything else (forged, altered, spelled differently, another purpose,
    not a string): never an exception, as tokens come from the public.

    :param token: the text from the URL.
    """
    if not isinstance(token, str) or len(token) > _TOKEN_MAX_CHARS or purpose in _SECRET_KEYED:
        return None
    try:
        data = _unb64(token)
    except (ValueError, binascii.Error):
        return None
    payload, mac = data[:-_TOKEN_MAC_BYTES], data[-_TOKEN_MAC_BYTES:]
    if len(mac) != _TOKEN_MAC_BYTES or not hmac.compare_digest(
            mac, _mac(secret, purpose, payload)[:_TOKEN_MAC_BYTES]):
        return None
    return _parse_varints(payload)


# Unsubscribe tokens of the first release: they name the address --------------

def _address_token_mac(secret, payload):
    # 128 bits of HMAC-SHA256 keep the link short and still unforgeable.
    return _mac(secret, "unsubscribe address", payload)[:16]


def unsubscribe_token(secret, account, address, campaign=None):
    """A token naming ``address`` of ``account`` (and the campaign that mailed
    it), signed with ``secret``: base64url(payload) "." base64url(mac)."""
    payload = f"{account}:{campaign or ''}:{address}".encode("utf-8")
    return f"{_b64(payload)}.{_b64(_address_token_mac(secret, payload))}"


def read_unsubscribe_token(secret, token):
    """``(account, address, campaign or None)`` of a token we signed, else None."""
    try:
        payload_text, mac_text = token.split(".")
        payload, mac = _unb64(payload_text), _unb64(mac_text)
        if not hmac.compare_digest(mac, _address_token_mac(secret, payload)):
            return None
        account, campaign, address = payload.decode("utf-8").split(":", 2)
        return int(account), address, int(campaign) if campaign else None
    except (ValueError, binascii.Error):
        return None


# VERP addresses and Message-IDs: they name one outbox email ------------------

# VERP: bounces+{outbox id}-{mac}@domain.  The mac is 80 bits of HMAC-SHA256
# in lower-case base32 (16 characters), so mail systems that fold the case of
# local parts cannot break it, and the address stays far below 64 characters.
_VERP_LOCAL = re.compile(r"bounces\+(0|[1-9][0-9]{0,18})-([a-z2-7]{16})")
_VERP_IN_TEXT = re.compile(r"bounces\+[0-9]{1,19}-[a-z2-7]{16}@[^\s<>\"',;]+", re.IGNORECASE)
_OUR_MESSAGE_ID = re.compile(r"<?(0|[1-9][0-9]{0,18})\.([a-z2-7]{16})@[^<>\s]+>?")


def _verp_mac(secret, outbox_text):
    digest = _mac(secret, "verp", outbox_text.encode("ascii"))
    return base64.b32encode(digest[:10]).decode("ascii").lower()


def verp_address(secret, outbox_id, bounce_domain):
    """The envelope sender of one campaign email: ``bounces+TOKEN@bounce_domain``,
    where TOKEN names the outbox email and is signed with ``secret``.

    :param secret: the service's signing secret (str or bytes).
    :param outbox_id: the id of the outbox row the email is sent from.
    :param bounce_domain: the domain whose mail reaches the bounce mailbox.
    """
    if isinstance(outbox_id, bool) or not isinstance(outbox_id, int) or not 0 <= outbox_id <= MAX_ID:
        raise ValueError(f"an outbox id is an integer from 0 to {MAX_ID}, not {outbox_id!r}")
    return f"bounces+{outbox_id}-{_verp_mac(secret, str(outbox_id))}@{bounce_domain}"


def read_verp(secret, address):
    """The outbox id named by a VERP address that ``secret`` signed, else None.

    :param address: the address as found in a header: with or without angle
        brackets and a display name; the local part in any case.
    """
    if not isinstance(address, str):
        return None
    local = email.utils.parseaddr(address)[1].rpartition("@")[0].lower()
    match = _VERP_LOCAL.fullmatch(local)
    if match is None or int(match[1]) > MAX_ID:
        return None
    if not hmac.compare_digest(match[2], _verp_mac(secret, match[1])):
        return None
    return int(match[1])


def message_id_for(secret, outbox_id, domain):
    """The Message-ID of one outbox email: ``<ID.MAC@domain>``, signed like
    its VERP address, so a report that quotes it names the email without VERP.

    :param domain: the sender's domain.
    """
    return f"<{outbox_id}.{_verp_mac(secret, str(outbox_id))}@{domain}>"


def read_message_id(secret, value):
    """The outbox id a Message-ID made by message_id_for() names, else None."""
    match = _OUR_MESSAGE_ID.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if match is None or int(match[1]) > MAX_ID:
        return None
    return int(match[1]) if hmac.compare_digest(match[2], _verp_mac(secret, match[1])) else None


# Erased addresses ------------------------------------------------------------

def _erasure_hash(secret, address):
    """The one-way form of an erased address: HMAC-SHA256 under the app
    secret of the address lower-cased, so the table alone names nobody."""
    return _mac(secret, "erasure", address.lower().encode("utf-8")).hex()


# ---------------------------------------------------------------------------
# Auth: accounts and API keys.  Plain functions; the pipeline calls them.
# ---------------------------------------------------------------------------

# Addresses ---------------------------------------------------------------

# An address: a local part of dot-separated atoms (no leading, trailing or
# double dot; at most 64 characters), '@', a domain of at least two
# alphanumeric labels.  One regex, as it runs on every row of an import.
_EMAIL_ATOM = r"[^@\s\x00-\x1f\x7f<>()\[\],;:\"\\.]+"
_EMAIL_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_EMAIL_RE = re.compile(rf"(?=[^@]{{1,64}}@)({_EMAIL_ATOM}(?:\.{_EMAIL_ATOM})*)"
                       rf"@({_EMAIL_LABEL}(?:\.{_EMAIL_LABEL})+)")
# An address already in the form _normalize_email() gives (no spaces around,
# the domain in lower case, at most 254 characters): an import checks a whole
# column with it and sends only the others the slow way.
_EMAIL_NORMAL_RE = re.compile(
    rf"(?s:(?=.{{1,254}}\Z))(?=[^@]{{1,64}}@){_EMAIL_ATOM}(?:\.{_EMAIL_ATOM})*"
    r"@[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)+")


def _normalize_email(value):
    """The address trimmed with its domain lower-cased, or None if invalid."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    match = _EMAIL_RE.fullmatch(value) if len(value) <= 254 else None
    return f"{match[1]}@{match[2].lower()}" if match else None


def _hash_secret(secret):
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _parse_levels(levels):
    if isinstance(levels, str):
        levels = [part.strip() for part in levels.split(",") if part.strip()]
    levels = list(dict.fromkeys(levels))
    bad = [level for level in levels if level not in LEVELS]
    if bad or not levels:
        raise ValueError(f"levels must be a non-empty subset of {', '.join(LEVELS)}")
    return levels


def _parse_expiry(expires):
    """A key's expiry as stored: the end of the given day, UTC."""
    if expires is None or expires == "":
        return None
    if isinstance(expires, datetime.datetime):
        return expires.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(expires, datetime.date):
        return expires.strftime("%Y-%m-%d 23:59:59")
    try:
        day = datetime.date.fromisoformat(str(expires))
    except ValueError:
        raise ValueError("expires must be a date, YYYY-MM-DD") from None
    return day.strftime("%Y-%m-%d 23:59:59")


def _account_for(conn, email):
    """The id of the account with this address, created if it is new."""
    address = _normalize_email(email)
    if address is None:
        raise ValueError(f"not a valid email address: {email!r}")
    row = conn.execute("SELECT id FROM account WHERE email = ?", (address,)).fetchone()
    if row:
        return row["id"]
    return conn.execute("INSERT INTO account (email, created) VALUES (?, ?)",
                        (address, _now())).lastrowid


def _issue_key(conn, account, levels=LEVELS, name="", expires=None):
    """Store a new key for ``account`` and return ``(key id, secret)``."""
    levels = _parse_levels(levels)
    secret = "cak_" + secrets.token_urlsafe(32)
    key_id = conn.execute(
        "INSERT INTO apikey (account, name, levels, hash, created, expires) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (account, name, ",".join(levels), _hash_secret(secret), _now(),
         _parse_expiry(expires))).lastrowid
    return key_id, secret


def create_key(db, email, levels=LEVELS, name="", expires=None):
    """Issue an API key and return its secret (shown once; only a hash is kept).

    :param db: the database path, as given to create_app().
    :param email: the account holder's address; the account is created if new.
    :param levels: any of ``read, write, create, delete`` (a list or "read,write").
    :param name: a label for the key.
    :param expires: a date (or "YYYY-MM-DD"); the key works through that day, UTC.
    """
    init_db(db)
    conn = connect(db)
    try:
        with transaction(conn):
            _, secret = _issue_key(conn, _account_for(conn, email), levels, name, expires)
    finally:
        conn.close()
    return secret


def list_keys(db):
    """Every key as a dict (never the secret, which is not stored)."""
    init_db(db)
    conn = connect(db)
    try:
        return [dict(row) for row in conn.execute(
            "SELECT apikey.id, account.email, apikey.name, apikey.levels, apikey.created, "
            "apikey.expires, apikey.revoked FROM apikey JOIN account ON account.id = apikey.account "
            "ORDER BY apikey.id")]
    finally:
        conn.close()


def revoke_key(db, key_id):
    """Revoke key ``key_id``; returns False when there is no such key."""
    global _key_epoch
    init_db(db)
    conn = connect(db)
    try:
        with transaction(conn):
            revoked = conn.execute("UPDATE apikey SET revoked = 1 WHERE id = ?",
                                   (key_id,)).rowcount == 1
    finally:
        conn.close()
    _key_epoch += 1  # every app of this process forgets the keys it remembers
    return revoked


#: Bumped by revoke_key(); the apps' key caches hold only entries of this epoch.
_key_epoch = 0


def _authenticate(conn, header):
    """The key row for an ``Authorization: Bearer`` header, or Unauthorized."""
    scheme, _, secret = (header or "").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("Send your API key as 'Authorization: Bearer <secret>'.")
    key = conn.execute("SELECT id, account, levels, expires, revoked FROM apikey WHERE hash = ?",
                       (_hash_secret(secret),)).fetchone()
    if key is None or key["revoked"] or (key["expires"] and key["expires"] < _now()):
        # One answer for all three, so a stolen secret tells nothing about itself.
        raise Unauthorized("This API key is unknown, revoked or expired.")
    return key


def _require_level(key, level):
    """Refuse with 403 unless ``key`` holds ``level``."""
    if level not in key["levels"].split(","):
        raise InsufficientAccess(f"This operation needs an API key with the '{level}' level.")


# ---------------------------------------------------------------------------
# Request plumbing: parameters, identifiers, the envelope.
# ---------------------------------------------------------------------------

def _as_int(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_ID else None
    if isinstance(value, float):    # 705.0 is the integer 705 in JSON (and JSON Schema)
        return int(value) if value.is_integer() and 0 <= value <= MAX_ID else None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        number = int(value)
        return number if number <= MAX_ID else None
    return None


def _param_str(name, value, multiline):
    if not isinstance(value, str):
        raise InvalidParameter(f"'{name}' must be a string.", field=name)
    if "\x00" in value:
        raise InvalidParameter(f"'{name}' must not contain NUL characters.", field=name)
    if not multiline and ("\r" in value or "\n" in value):
        raise InvalidParameter(f"'{name}' must not contain line breaks.", field=name)
    return value


def _param_int(name, value):
    number = _as_int(value)
    if number is None:
        raise InvalidParameter(f"'{name}' must be a whole number from 0 to {MAX_ID}.", field=name)
    return number


def _param_limit(name, value):
    number = _as_int(value)
    if number is None or not 1 <= number <= _PAGE_MAX:
        raise InvalidParameter(f"'{name}' must be a whole number from 1 to {_PAGE_MAX}.",
                               field=name)
    return number


def _param_flag(name, value):
    if value in ("1", 1, "true") or value is True:
        return 1
    if value in ("0", 0, "false") or value is False:
        return 0
    raise InvalidParameter(f"'{name}' must be '0' or '1'.", field=name, allowed=["0", "1"])


def _param_email(name, value):
    value = _param_str(name, value, False)
    if value.strip() == "":
        return ""
    address = _normalize_email(value)
    if address is None:
        raise InvalidParameter(f"'{name}' is not a valid email address.", field=name)
    return address


def _param_list(name, value):
    if not isinstance(value, list):
        raise InvalidParameter(f"'{name}' must be a JSON array.", field=name)
    return value


def _param_scalar(name, value):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidParameter(f"'{name}' must be a string or a number.", field=name)
    if isinstance(value, str):
        _param_str(name, value, False)
    return value


def _param_ref(name, value):
    # A reference that may be unset: an id, or '' / null / 0 for none.
    if value is None or (value.__class__ is not bool and value in ("", 0, "0")):
        return None
    return _param_int(name, value)


def _param_object(name, value):
    if not isinstance(value, dict):
        raise InvalidParameter(f"'{name}' must be a JSON object.", field=name)
    return value


def _param_data(name, value):
    # An upload: text (csv, base64) or, for json uploads, an array of objects
    # (or that array as a JSON string); the importer reads it further and
    # answers 422 for data it cannot read.
    if not isinstance(value, (str, list, dict)):
        raise InvalidParameter(f"'{name}' must be a string or a JSON array.", field=name)
    return value


def _param_time(name, value):
    # Unix seconds (a number or digits) or a date-time: _parse_timestamp()
    # reads it in the handler, which knows the time now.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidParameter(f"'{name}' must be Unix seconds or a date-time text.", field=name)
    _parse_timestamp(value)
    return value


#: Parameter types of the route table: name -> checker(name, value) -> value.
_PARAM_TYPES = {
    "str": lambda name, value: _param_str(name, value, False),
    "text": lambda name, value: _param_str(name, value, True),
    "int": _param_int,
    "limit": _param_limit,
    "flag": _param_flag,
    "email": _param_email,
    "list": _param_list,
    "object": _param_object,
    "ref": _param_ref,
    "scalar": _param_scalar,
    "data": _param_data,
    "time": _param_time,
}


class _Param:
    """One declared parameter of a route: ``name:type`` with ``!`` if required.

    ``name:type@kind`` declares that the value names a record of that kind
    (a list: each item; a scalar: when it is an id) of the caller's account:
    Route.check_references() answers one the caller does not have -- unknown,
    or another account's -- with the same 404.  ``@kind?``: a record that may
    be made later (verify reports it missing), never looked up at a write;
    whatever reads it filters by the owner, so another account's id reads as
    missing too.
    """

    def __init__(self, spec):
        spec, self.required = (spec[:-1], True) if spec.endswith("!") else (spec, False)
        self.name, _, self.type = spec.partition(":")
        self.type, _, refers = self.type.partition("@")
        self.made_later = refers.endswith("?")
        self.refers = refers.rstrip("?") or None
        self.type = self.type or "str"
        if "|" in self.type:  # a choice: one of the listed strings
            self.choices = self.type.split("|")
        else:
            self.choices = None
            if self.type not in _PARAM_TYPES:
                raise ValueError(f"unknown parameter type in {spec!r}")

    def check(self, value):
        if self.choices is not None:
            if value not in self.choices:
                raise InvalidParameter(
                    f"'{self.name}' must be one of: {', '.join(self.choices)}.",
                    field=self.name, allowed=self.choices)
            return value
        return _PARAM_TYPES[self.type](self.name, value)


#: Every record kind by name (each Resource enters itself; Resource.kinds is
#: this dict): a route's operation, parent and references name their kinds,
#: declared in the record kinds' banners below.
_KINDS = {}

#: Success data of a create: the new record's id.
_ANSWER_ID = {"type": "object", "required": ["id"],
             "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}}}
#: Success data of a change or a delete.
_ANSWER_DONE = {"type": "boolean", "description": "true: done"}


def _records_answer(key, kind):
    """Success data that lists records of ``kind`` under ``key`` for one id as
    for ``all`` (as the original service's ``emt_campaign``); pages add total, limit, offset."""
    return {"type": "object", "required": [key], "properties": {
        key: {"type": "array", "items": {"$ref": f"#/components/schemas/{kind}"}},
        **{name: {"type": "string"} for name in ("total", "limit", "offset")}}}


class Route:
    """One row of the route table.

    ``path`` holds placeholders ``{name}`` (an integer id) or ``{name:sel|sel}``
    listing what the placeholder accepts: ``int``, ``all``, ``import``, or
    ``name`` (any single path segment, e.g. a field name).

    ``summary`` titles the operation in the OpenAPI document; ``answers``
    describes its success data there: a record kind's name, a JSON schema of
    ``data``, or a whole OpenAPI response object (with ``content``) for a
    route that answers something other than the envelope.

    ``changes=True``: the route changes data although it does not run as one
    writing transaction (the document marks it; a GET that writes).
    ``body_rules``: JSON Schema keywords added to the document's body schema
    where parameters depend on each other (``if``/``then``).  Each parameter
    is described once: a record kind's own in its Resource's ``doc``, the
    others in _PARAM_DOCS (tests/test_openapi.py asks for it).

    ``later=True``: a public write (open, click, unsubscribe, sign-up,
    confirm) that must never wait for a lock: the handler runs outside a
    transaction and hands its writes to ``call.later()`` (see _Intake).

    ``big``: the parameters that may be big (an import's upload): a big body
    is then read and parsed by a child process, which keeps them; the
    handler gets the _BodyChild in their place and asks it for the work.

    ``reads_body=False``: the route takes no parameters from the body and
    ignores whatever body comes (an HTML form post, an RFC 8058 one-click
    unsubscribe), instead of answering 415 for a body that is not JSON.

    ``body`` is the OpenAPI requestBody of a route that reads its body itself;
    ``errors`` adds error statuses its handler answers beyond the pipeline's.
    Such a route without parameters is a page a person opens from a link:
    it ignores the query string too (mail programs and link trackers append
    ``utm_*`` and the like), so the page never turns into an error envelope.
    """

    #: The route table the module serves (ROUTES, set where it is declared).
    table = ()

    _PLACEHOLDER = re.compile(r"\{(\w+)(?::([\w|]+))?\}")

    def __init__(self, method, path, level, handler, params=None, writes=None, summary=None,
                 answers=None, reads_body=True, body=None, errors=(), changes=None,
                 body_rules=None, pages=False, later=False, big=()):
        self.method, self.path, self.level, self.handler = method, path, level, handler
        # An operation of a record kind (Resource.get, .create, ...) takes the
        # parameters its kind declares for it and answers that kind.
        kind = getattr(handler, "__self__", None)
        self.kind = kind if any(kind is known for known in _KINDS.values()) else None
        if params is None:
            params = self.kind.params(handler.__name__) if self.kind else ""
        if answers is None and self.kind:
            one = _records_answer if self.kind.one_as_list else lambda *pair: pair
            answers = {"get": one(self.kind.answer, self.kind.schema), "create": _ANSWER_ID}.get(
                handler.__name__, _ANSWER_DONE)
        # For the OpenAPI document only: a one-line title, and what ``data``
        # holds on success (see openapi_document()).
        self.summary, self.answers = summary, answers
        # JSON Schema keywords that tie body parameters together (if/then).
        self.body_rules = body_rules or {}
        self.params = {p.name: p for p in map(_Param, params.split())}
        for param in self.params.values():   # a kind the account owns, not a child kind
            if param.refers and _KINDS[param.refers].parent is not None:
                raise ValueError(f"{param.name} names a {param.refers}, which is no owned kind")
        self.writes = method != "GET" if writes is None else writes
        self.reads_body, self.body, self.errors = reads_body, body, tuple(errors)
        # A route a person opens in a browser (a link of an email, a form):
        # it answers HTML pages, its errors included.
        self.pages = pages
        # A public write: the handler reads and answers, its writes go by
        # call.later() to the intake, so it never waits for a lock.
        self.later = later
        # Parameters that may be big (an import's upload): a big body is read
        # and parsed by a child process, which keeps them (_BodyChild).
        self.big = tuple(big.split()) if isinstance(big, str) else tuple(big)
        # Whether the route changes data, for the document: a GET may, even
        # outside one transaction (an export commits its record itself).
        self.changes = self.writes if changes is None else changes
        self.reads_body = reads_body
        self.ids = {m.group(1): (m.group(2) or "int").split("|")
                    for m in self._PLACEHOLDER.finditer(path)}
        # A create (PUT) makes a record at its last id: one a client chooses
        # is at most MAX_EXPLICIT_ID.
        self.created = list(self.ids)[-1] if method == "PUT" and self.ids else None
        self.rule = "/v1" + self._PLACEHOLDER.sub(r"<\1>", path)
        # What bottle's <name> matches, for telling 405 from 404 ourselves.
        self.pattern = re.compile(re.sub(r"\\\{.*?\\\}", "[^/]+", re.escape("/v1" + path)))
        # A route under /{kind}/{parent_id}/... acts within that record.
        self.parent = _KINDS[path.split("/")[1]] if "parent_id" in self.ids else None

    def run(self, call, ids):
        """Call the handler: with the parent record looked up first (its owner
        checked, and for a writing route refused if deleted), then the records
        the parameters name, then the child id."""
        if self.parent is not None:
            call.parent = self.parent.find(call.conn, call.account, ids["parent_id"],
                                           live=self.writes)
            self.check_references(call)
            return self.handler(call, ids["child_id"])
        self.check_references(call)
        return self.handler(call, *ids.values())

    def check_references(self, call, params=None):
        """Look up every record the parameters (``params``, default the
        call's) name, as its kind's find() does for a path id: a record the
        caller does not have is 404 whether it is unknown or another
        account's, with the same words; on a writing route a deleted one is 409."""
        params = call.params if params is None else params
        for param in self.params.values():
            if param.refers is None or param.made_later or params.get(param.name) is None:
                continue
            kind, value = _KINDS[param.refers], params[param.name]
            items = [(f"{param.name}[{index}]", item) for index, item in enumerate(value)] \
                if param.type == "list" else [(param.name, value)]
            for where, item in items:
                number = _as_int(item.strip() if isinstance(item, str) else item)
                if number is None and param.type == "list":
                    raise InvalidParameter(f"{where} must be a {kind.label} id.", field=param.name)
                if number is None:   # a scalar that is no id: a name its handler reads
                    continue
                try:
                    kind.find(call.conn, call.account, number, live=self.writes)
                except (NotFound, Conflict) as error:
                    error.message = f"'{where}': {error.message}"
                    error.extra["field"] = param.name
                    raise

    def parse_ids(self, raw):
        ids = {}
        for name, allowed in self.ids.items():
            value = raw[name]
            if "name" in allowed:
                ids[name] = value
            elif value in allowed:
                ids[name] = value
            elif "int" in allowed and _as_int(value) is not None and value.isdigit():
                ids[name] = int(value)
                if name == self.created and ids[name] > MAX_EXPLICIT_ID:
                    raise InvalidIdentifier(
                        f"The identifier '{value}' is too large: a create takes an id up to "
                        f"{MAX_EXPLICIT_ID} (2^53 - 1), or 0 for the next free one.", field=name)
            else:
                words = [w for w in allowed if w != "int"]
                allowed_text = "an integer" + "".join(f" or '{w}'" for w in words)
                raise InvalidIdentifier(
                    f"The identifier '{value}' is not valid here: {name} must be {allowed_text}.",
                    field=name)
        return ids


# Where links point -----------------------------------------------------------

#: A host as a request may name it (Django's check): a DNS name or an IP
#: literal, then an optional port.  Nothing else ever goes into a link.
_HOST_NAME = r"[a-z0-9.-]+|\[[a-f0-9]*:[a-f0-9.:]+\]"
_REQUEST_HOST = re.compile(rf"({_HOST_NAME})(?::[0-9]{{1,5}})?")
#: What an empty allowed_hosts allows: this machine's own names (Django's
#: list when DEBUG is on), so that an app in development builds its links.
_LOCAL_HOSTS = (".localhost", "127.0.0.1", "[::1]")


def _checked_hosts(value):
    """The allowed_hosts setting as a tuple of lower-case patterns (one
    string: a list of one); ValueError naming a pattern that is none."""
    patterns = []
    for given in (value,) if isinstance(value, str) else tuple(value or ()):
        pattern = given.strip().lower() if isinstance(given, str) else ""
        if pattern != "*" and not re.fullmatch(_HOST_NAME, pattern.removeprefix(".")):
            raise ValueError(f"allowed_hosts holds host names such as news.example.com, "
                             f".example.com (the domain and its subdomains) or *, not {given!r}")
        patterns.append(pattern)
    return tuple(patterns)


def _host_allowed(name, patterns):
    """Whether the host ``name`` (lower case, no port) matches a pattern."""
    name = name.removesuffix(".")
    return any(pattern in ("*", name) or (pattern.startswith(".") and (
        name.endswith(pattern) or name == pattern[1:])) for pattern in patterns)


def _link_base(environ, config, prefix=""):
    """The root URL (without ``/v1``) of the links this API puts in emails and
    pages: the ``public_url`` setting; without one, the request's scheme and
    host (X-Forwarded-Proto and X-Forwarded-Host first, as a proxy in front
    sets them), its script name and ``prefix``, when ``allowed_hosts`` allows
    that host.  Every link the service builds goes through here.

    :param environ: the request's WSGI environ.
    :param config: the app's settings.
    :param prefix: where a parent Bottle app mounted this one.
    :raises InvalidHost: the request names a host that is not allowed or no
        host at all, or a scheme other than http and https.
    """
    if config["public_url"]:
        return config["public_url"].rstrip("/")
    scheme = (environ.get("HTTP_X_FORWARDED_PROTO") or environ.get("wsgi.url_scheme")
              or "http").strip().lower()
    host = environ.get("HTTP_X_FORWARDED_HOST") or environ.get("HTTP_HOST") or (
        f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}".rstrip(":"))
    host = host.strip().lower()
    found = _REQUEST_HOST.fullmatch(host)
    if scheme not in ("http", "https") or found is None or not _host_allowed(
            found[1], config["allowed_hosts"] or _LOCAL_HOSTS):
        raise InvalidHost(
            f"This server builds no links for {scheme[:20]}://{host[:100]}: the operator "
            "names the hosts links may use in the allowed_hosts setting, or sets public_url.")
    root = "/".join(part for part in (environ.get("SCRIPT_NAME", "").strip("/"),
                                      prefix.strip("/")) if part)
    return f"{scheme}://{host}" + (f"/{root}" if root else "")


class _Call:
    """What a handler gets: the connection, the caller's account, the
    parameters given (already checked), the parent record of a child route,
    and the app's settings.  ``memo`` keeps what a request reads once."""

    __slots__ = ("conn", "account", "params", "service", "response_id", "parent", "memo",
                 "base")

    def __init__(self, conn, account, params, service, response_id, base=None):
        self.conn, self.account, self.params = conn, account, params
        self.service, self.response_id = service, response_id
        self.parent, self.memo = None, {}
        self.base = base   # base_url, given when there is no request (a kept write applied later)

    def get(self, name, default=None):
        return self.params.get(name, default)

    @property
    def events(self):
        """The events raised in this request's transaction (emit()'s
        ``pending``): on_event gets them after the commit."""
        return self.memo.setdefault("events", [])

    def later(self, write, /, **payload):
        """A public route's write (``write`` a key of LATER, ``payload`` its
        JSON arguments), applied by the pipeline after the handler: at once,
        or kept while the lock it needs is held (see _Intake)."""
        self.memo.setdefault("later", []).append((write, payload))

    @property
    def base_url(self):
        """Where this API is reachable from outside, for links in emails and
        pages: Service.link_base(), kept for the rest of the request.
        InvalidHost when the request names a host that is not allowed."""
        if not self.base:
            self.base = self.service.link_base()
        return self.base


def _content_type(environ):
    """The request's media type, lower-cased, without its parameters."""
    return environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()


def _read_body(environ, limit):
    """The request body, refusing one over ``limit`` before reading it."""
    length = environ.get("CONTENT_LENGTH") or ""
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    if length.strip():
        try:
            length = int(length)
        except ValueError:
            raise InvalidJson("The Content-Length header is not a number.") from None
        if length > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        return stream.read(length) if length > 0 else b""
    if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        # Servers that de-chunk (waitress, gunicorn) hand the body over as a
        # stream without a length: read it in pieces up to the limit.
        parts, size = [], 0
        while True:
            part = stream.read(65536)
            if not part:
                return b"".join(parts)
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
            parts.append(part)
    return b""


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

#: A C call on a whole 100 MB upload holds the GIL for 0.1-0.3 s, and every
#: other request of the process waits that long (a sign-up during a big
#: import); the slow steps go a piece at a time, so other threads get turns.
_PIECE = 1 << 20


#: While an import runs, the interpreter hands the GIL over every 0.5 ms
#: instead of every 5: a public write waits for the GIL at each of its
#: statements, and behind the import's Python work each wait was a full
#: interval (during a 1M-row import on PostgreSQL, p50 335 -> 64 ms).
_IMPORT_SWITCH_INTERVAL = 0.0005
_turns = {"running": 0, "saved": None}
_turns_lock = threading.Lock()


@contextlib.contextmanager
def _short_turns():
    """Within: a switch interval of at most _IMPORT_SWITCH_INTERVAL; the one
    the process had comes back when the last import ends."""
    with _turns_lock:
        if not _turns["running"]:
            _turns["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns["saved"], _IMPORT_SWITCH_INTERVAL))
        _turns["running"] += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns["running"] -= 1
            if not _turns["running"]:
                sys.setswitchinterval(_turns["saved"])


def _body_text(body):
    """The body decoded as UTF-8 (BOM or not), strictly, a piece at a time."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    view, end = memoryview(body), len(body)
    return "".join([decoder.decode(view[start:start + _PIECE], start + _PIECE >= end)
                    for start in range(0, end, _PIECE)])


def _has_surrogate_escape(body):
    """Whether the JSON text holds a \\uD800-\\uDFFF escape, looked for a piece
    at a time (an escape across two pieces is found: they overlap)."""
    return any(_SURROGATE_ESCAPE.search(body, start, start + _PIECE + 8)
               for start in range(0, len(body), _PIECE))


def _b64_pieces(data):
    """``base64.b64decode(data, validate=True)`` a piece at a time: strict
    base64 (the alphabet, padding only at the very end) or binascii.Error."""
    step = _PIECE // 4 * 4
    last = len(data) - step
    out = []
    for start in range(0, len(data), step):
        piece = data[start:start + step]
        if start < last and piece.endswith("="):   # padding before the end
            raise binascii.Error("Excess data after padding")
        out.append(binascii.a2b_base64(piece, strict_mode=True))
    return b"".join(out)


def _json_object(body):
    """The parameters of a JSON request body: its object, decoded strictly."""
    try:
        # Decoded here, strictly: json.loads(bytes) would pass encoded
        # surrogates (b"\xed\xa0\x80") through as lone surrogates.
        document = json.loads(_body_text(body))
    except (ValueError, RecursionError):
        raise InvalidJson("The request body is not valid JSON (UTF-8).") from None
    if _has_surrogate_escape(body):
        # A \uD800-\uDFFF escape that is not half of a pair decodes to a
        # lone surrogate, which SQLite and UTF-8 output cannot hold.
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJson("The request body holds a \\u escape that is not a valid "
                              "character (a lone surrogate).") from None
    if not isinstance(document, dict):
        raise InvalidJson("The request body must be a JSON object of parameters.")
    return document


def _open_max():
    """One past the highest file descriptor a process may have."""
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536


#: A JSON body of this many bytes or more, for a route with a big parameter
#: (an import's upload), is read and parsed by a forked child (_BodyChild).
_CHILD_READS_BYTES = 1 << 20

#: How much nicer (lower CPU priority) a _BodyChild is than its server.
_CHILD_NICE = 10

#: Where the request's _BodyChild is kept until the request ends (dispatch()).
_BODY_CHILD = "campaignapi.body_child"


class _BodyChild:
    """A big request body read, parsed and worked on by a forked child, so
    that none of it holds this process's GIL (every other request of the
    process waited for the decode, the parse and the checks of a 75 MB import).

    This process only streams the body from ``wsgi.input`` into a pipe, a
    piece at a time.  The child decodes and parses it as _parse_params()
    would (the same errors) and answers the small parameters; the big ones
    (``route.big``) stay in the child, and stand for themselves in the
    parameters as this object.  The handler then asks the child to work on
    them: call() sends a function of the module and its arguments (pickle),
    the child runs it on its parameters (``state``) and sends back what it
    yields, message by message, while this process goes on (an import
    writes one chunk while the child reads the next).  An error in the child
    is raised here as if raised here.

    The child keeps only its three pipes (a copy of a socket of the app's
    other requests would keep each connection the app closes open until the
    request ends), never touches the database, and ends when this process
    closes it (close(): at the end of the request, on every path) or dies.
    """

    def __init__(self, route, environ, length):
        body_read, body_write = os.pipe()
        command_read, self._command_write = os.pipe()
        self._answer_read, answer_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for low, high in itertools.pairwise(
                    [2, *sorted((body_read, command_read, answer_write)), _open_max()]):
                os.closerange(low + 1, high)
            self._child(route, body_read, command_read, answer_write)   # never returns
        for fd in (body_read, command_read, answer_write):
            os.close(fd)
        self.commands = open(self._command_write, "wb")
        self.answers = open(self._answer_read, "rb", buffering=0)   # select() sees all
        try:
            self._send_body(environ["wsgi.input"], body_write, length)
            self.document = self._answer()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _send_body(stream, fd, length):
        """``length`` bytes of ``stream`` into the child (fewer if it ends first)."""
        with open(fd, "wb", buffering=0) as pipe:
            try:
                while length > 0:
                    piece = stream.read(min(length, _PIECE))
                    if not piece:
                        break
                    length -= len(piece)
                    view = memoryview(piece)
                    while view:
                        view = view[pipe.write(view):]
            except BrokenPipeError:   # the child ended: its answer says why
                pass

    def _child(self, route, body_read, command_read, answer_write):
        """The child: parse the body, answer the small parameters, then run
        what it is sent until this process closes the pipe."""
        status = 1
        try:
            gc.disable()   # it ends with the request: no cycles worth a collection
            # Its work can wait; the requests of the server beside it cannot:
            # on busy cores the scheduler gives them the CPU first.
            with contextlib.suppress(OSError, AttributeError):
                os.nice(_CHILD_NICE)
            with open(answer_write, "wb") as out:
                def answer(*message):   # a frame: its length, then its pickle
                    frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                    out.write(len(frame).to_bytes(8, "little"))
                    out.write(frame)
                    out.flush()

                try:
                    with open(body_read, "rb") as source:
                        body = source.read()
                    state = _json_object(body) if body.strip() else {}
                    del body
                    big = {name: state[name] for name in route.big if name in state}
                    for name, value in big.items():
                        route.params[name].check(value)
                    answer("answer", ({name: value for name, value in state.items()
                                       if name not in big}, list(big)))
                except Exception as error:
                    answer(*self._refusal(error))
                    raise SystemExit from None
                with open(command_read, "rb") as commands:
                    while True:
                        try:
                            function, args = pickle.load(commands)
                        except EOFError:
                            break
                        try:
                            for message in function(state, *args):
                                answer("answer", message)
                            answer("end")
                        except Exception as error:
                            answer(*self._refusal(error))
            status = 0
        finally:
            os._exit(status)

    @staticmethod
    def _refusal(error):
        """The message that raises ``error`` again in the parent (_answer())."""
        if isinstance(error, UnicodeDecodeError):
            return "undecodable", error.encoding, error.reason
        if isinstance(error, ApiError) and type(error) in ApiError.__subclasses__():
            return "refused", type(error).__name__, error.message, error.extra
        return "failed", traceback.format_exc()

    def _read(self, size):
        """``size`` bytes of the child's answers."""
        data = bytearray(size)
        view = memoryview(data)
        while view:
            got = self.answers.readinto(view)
            if not got:
                raise RuntimeError("The process reading the request body ended early.")
            view = view[got:]
        return data

    def _answer(self, idle=None):
        """The child's next message; its error raised here.  ``idle()`` runs
        every few milliseconds while none has come."""
        while idle is not None and not select.select([self.answers], [], [], 0.005)[0]:
            idle()
        kind, *data = pickle.loads(self._read(int.from_bytes(self._read(8), "little")))
        if kind == "answer":
            return data[0]
        if kind == "end":
            raise StopIteration
        if kind == "undecodable":
            raise UnicodeDecodeError(data[0], b"", 0, 0, data[1])
        if kind == "refused":
            refusal = {error.__name__: error for error in ApiError.__subclasses__()}[data[0]]
            raise refusal(data[1], **data[2])
        raise RuntimeError(f"The process reading the request body failed:\n{data[0]}")

    def call(self, function, *args, idle=None):
        """What ``function(state, *args)`` yields in the child, message by
        message; ``idle()`` runs every few milliseconds while waiting."""
        pickle.dump((function, args), self.commands, protocol=pickle.HIGHEST_PROTOCOL)
        self.commands.flush()
        while True:
            try:
                yield self._answer(idle)
            except StopIteration:
                return

    def ask(self, function, *args):
        """The one message ``function(state, *args)`` yields in the child."""
        answers = self.call(function, *args)
        answer = next(answers)
        for _ in answers:   # the end
            pass
        return answer

    def close(self):
        """End and reap the child (it holds nothing this process needs)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = None
            for stream in (self.commands, self.answers):
                with contextlib.suppress(OSError):
                    stream.close()


def _body_child(route, environ, limit):
    """A _BodyChild for a big JSON body of a route with big parameters, or
    None: the body is read here (small, without a length, or no fork)."""
    length = (environ.get("CONTENT_LENGTH") or "").strip()
    if not (route.big and _FORKS and length.isdigit() and environ.get("wsgi.input")
            and _content_type(environ) == "application/json"):
        return None
    if int(length) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    if int(length) < max(_CHILD_READS_BYTES, 1):
        return None
    child = environ[_BODY_CHILD] = _BodyChild(route, environ, int(length))
    return child


#: Whether this system can fork a child (_BodyChild).
_FORKS = hasattr(os, "fork")


def _parse_params(route, environ, limit):
    """Parameters from the query string and the JSON body (body keys win).
    A big body is parsed by a child process: its big parameters are then
    the _BodyChild that holds them."""
    given = {}
    if not route.reads_body and not route.params:
        return given
    try:
        pairs = urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True,
                                       encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InvalidParameter("The query string is not valid UTF-8.") from None
    for name, value in pairs:
        if name in given:
            raise InvalidParameter(f"The parameter '{name}' is given twice.", field=name)
        given[name] = value
    child = _body_child(route, environ, limit) if route.reads_body else None
    body = b"" if child or not route.reads_body else _read_body(environ, limit)
    if child or body.strip():
        content_type = _content_type(environ)
        if content_type != "application/json":
            raise UnsupportedMediaType("Send parameters as JSON with Content-Type: application/json.")
        if child:
            small, big = child.document
            document = dict(small, **dict.fromkeys(big, child))
        else:
            document = _json_object(body)
        del body
        # The body wins, but a bad value in the query string is still refused.
        for name in set(given) & set(document) & set(route.params):
            route.params[name].check(given[name])
        given.update(document)
    unknown = sorted(set(given) - set(route.params))
    if unknown:
        raise UnknownParameter(
            f"Unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}.",
            field=unknown, allowed=sorted(route.params))
    params = {name: value if child is not None and value is child
              else route.params[name].check(value)
              for name, value in given.items()}
    missing = [p.name for p in route.params.values() if p.required and p.name not in params]
    if missing:
        raise MissingParameter(f"Missing required parameter: {', '.join(missing)}.",
                               field=missing)
    return params


def _page(call):
    """``(limit, offset)`` of a listing, checked."""
    return call.get("limit", _PAGE_DEFAULT), call.get("offset", 0)




def _envelope(response_id, success, data):
    return {"responseId": response_id, "version": 1, "success": success, "data": data}


def _accept_items(header):
    """``(value, q)`` of each item of an Accept-style header (Accept,
    Accept-Language), its q 1.0 unless it says otherwise (0 when unreadable)."""
    for item in (header or "").split(",")[:50]:
        value, *options = [part.strip() for part in item.split(";")]
        q = 1.0
        for option in options:
            if option.startswith("q="):
                try:
                    q = float(option[2:])
                except ValueError:
                    q = 0.0
        yield value, q


def _prefers_html(accept):
    """True when the Accept header ranks text/html above JSON (a browser)."""
    if "html" not in (accept or ""):  # API clients: no parsing per request
        return False
    quality = {}
    for media, q in _accept_items(accept):
        quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    html_q = quality.get("text/html", 0.0)
    json_q = max(quality.get("application/json", 0.0), quality.get("application/*", 0.0),
                 quality.get("*/*", 0.0))
    return html_q > json_q


_HTML_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>campaignapi: {title}</title>
<style>body{{font:15px/1.4 system-ui,sans-serif;margin:2em auto;padding:0 1em;max-width:60em;
color:#222}} pre{{background:#f6f8fa;padding:1em;border-radius:6px;white-space:pre-wrap;
overflow-wrap:anywhere}} .false{{color:#b00020}}.true{{color:#137333}} a{{color:#0b57d0}}
li{{margin:.3em 0}}</style></head>
<body><main><h1 class="{success}">{title}</h1>{extra}<pre id="envelope">{body}</pre></main>
</body></html>
"""


def _respond(status, envelope, headers=None, page=None):
    """Answer an envelope: JSON, or a small page for a browser (``page``:
    ``(title, [(href, text)])``, a title and links above the envelope).

    Sets status and headers on bottle's response for this request and returns
    the body (cheaper than building an HTTPResponse for bottle to copy over).
    """
    response = bottle.response
    response.status = status
    for name, value in (headers or {}).items():
        response.set_header(name, value)
    response.set_header("X-Response-Id", envelope["responseId"])
    if _prefers_html(_request_header("Accept")):
        title = "success" if envelope["success"] else envelope["data"].get("error", "error")
        title, links = page or (title, ())
        response.content_type = "text/html; charset=utf-8"
        extra = "<nav><ul>{}</ul></nav>".format("".join(
            f'<li><a href="{html.escape(href)}">{html.escape(text)}</a></li>'
            for href, text in links)) if links else ""
        return _HTML_PAGE.format(
            title=html.escape(title), success=str(envelope["success"]).lower(), extra=extra,
            body=html.escape(json.dumps(envelope, indent=2, ensure_ascii=False)))
    response.content_type = "application/json"
    return _to_json(envelope)


def _request_header(name):
    """A request header as the server gave it (latin-1 text).  Not bottle's
    get_header(), which re-decodes it as UTF-8 and raises on other bytes."""
    return bottle.request.environ.get("HTTP_" + name.upper().replace("-", "_"), "")


def _param_path(environ):
    """Refuse a path that is not UTF-8: bottle decodes it dropping the bad
    bytes, so '/campaign/%FF1' would otherwise reach campaign 1."""
    raw = environ.get("bottle.raw_path", environ.get("PATH_INFO", ""))  # PEP 3333: latin-1
    try:
        raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise NotFound("There is no such route: the path is not valid UTF-8.") from None


def _loggable_path(path, raw_ids):
    """The request path for the log, with token placeholders (download and
    unsubscribe links, which work without a key) blanked: no secrets in logs."""
    for name, value in raw_ids.items():
        if "token" in name and value:
            path = path.replace(value, "***")
    return path


# Idempotency keys --------------------------------------------------------------
#
# A PUT or POST with ``Idempotency-Key: K`` is done once (the IETF draft's
# header, as Stripe keeps it).  The pipeline claims K in the database before
# the handler runs: a row, so every thread, process and host sees it, and of
# two requests with one key exactly one inserts it.  A route that runs as one
# transaction claims K in that transaction, and keeps its 2xx answer on the
# row there too: the claim, the writes and the kept answer commit together or
# not at all, with no commit of their own (on PostgreSQL two round trips more
# than without a key, not five and a commit).  While that transaction is
# open, the claim's transaction lock (try_xact_lock, on the key's hash) tells
# a repeat that the first still runs: 409 at once, never a wait for its row.
# Routes that do not run as one transaction (an import, which commits as it
# goes; the public writes; a bounce report) claim K in a transaction of its
# own first, and keep their answer right after the handler.  A request that
# fails (or answers anything but 2xx) leaves or removes no claim, and the key
# may be used again.

#: An Idempotency-Key: 1 to 255 visible ASCII characters, on these methods.
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_KEYED_METHODS = ("PUT", "POST")
#: Seconds a kept answer is replayed.
_KEY_KEPT = 24 * 3600
#: Seconds after which a claim whose request never ended (its process died)
#: may be taken over by a repeat.  Should the first still run, it cannot keep
#: its answer (the claim's token changed) and rolls back: one effect still.
_KEY_LEASE = 600
#: Seconds a repeat is told to wait (Retry-After) while the first runs.
_KEY_RETRY_AFTER = 1


class _Keyed:
    """A request with an Idempotency-Key: claim() before the handler,
    keep() its answer, or release() the claim when it failed."""

    def __init__(self, scope, key, request):
        self.scope, self.key, self.request = scope, key, request
        self.token = None   # the claim's, once claimed
        self.kept = False

    @classmethod
    def of(cls, method, environ, account, limit):
        """The request's key (None without the header, or on a method that
        takes none).  Reads the body (up to ``limit``) for the request's
        fingerprint, and puts the same bytes back for whoever reads it next."""
        key = environ.get("HTTP_IDEMPOTENCY_KEY")
        if key is None or method not in _KEYED_METHODS:
            return None
        if not _IDEMPOTENCY_KEY.fullmatch(key):
            raise InvalidParameter("The Idempotency-Key header must be 1 to 255 visible ASCII "
                                   "characters (no spaces).", field="Idempotency-Key")
        body = _read_body(environ, limit)
        environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        target = f"{method} {environ.get('PATH_INFO', '')}?{environ.get('QUERY_STRING', '')}\n"
        request = hashlib.sha256(target.encode("utf-8", "backslashreplace") + body).hexdigest()
        scope = f"account:{account}" if account is not None else \
            f"client:{environ.get('REMOTE_ADDR', '')}"
        return cls(scope, key, request)

    def look(self, conn):
        """Before the request's transaction, where reads are cheap (SQLite):
        the kept answer of a repeat (_Kept), 409 while the first runs, 422
        for the key with another request; None when the key is free or
        expired.  So a repeat never waits for the write lock to be answered."""
        if conn.cheap_reads:
            return self._answer(conn.execute(
                "SELECT request, status, answer, created FROM idempotency_key "
                "WHERE scope = ? AND key = ?", (self.scope, self.key)).fetchone())
        return None

    def _answer(self, row):
        """The key's row ``(request, status, answer, created)`` as look()
        answers; None without a live one."""
        if row is None or row[0] is None or row[3] < _shift(
                _now(), -(_KEY_LEASE if row[1] is None else _KEY_KEPT)):
            return None
        if row[0] != self.request:
            raise IdempotencyKeyReused(
                "This Idempotency-Key was used for another request (method, path or "
                "body) in the last 24 hours: send a new key for a new request.",
                field="Idempotency-Key")
        if row[1] is None:
            raise self._running()
        return _Kept(row[1], json.loads(row[2]))

    @staticmethod
    def _running():
        error = Conflict("A request with this Idempotency-Key is still running: ask again "
                         "in a moment for its answer.", field="Idempotency-Key")
        error.headers["Retry-After"] = str(_KEY_RETRY_AFTER)
        return error

    def _lock(self, conn):
        """The key's transaction lock as SQL (try_xact_lock) and its values."""
        digest = hashlib.sha256(f"{self.scope}\n{self.key}".encode()).digest()
        return (conn.sql["try_xact_lock"].format(high="?", low="?"),
                (int.from_bytes(digest[:4], "big", signed=True),
                 int.from_bytes(digest[4:8], "big", signed=True)))

    def looking(self, conn):
        """The first statements ``[(sql, params)]`` of a request that claims
        its key in its own transaction: the key's lock, held until the
        transaction ends, then whether it is held and the key's row (see
        locked()), read after the lock was taken (take_xact_lock)."""
        values = self._lock(conn)[1]
        take, holds = conn.sql["take_xact_lock"], conn.sql["holds_xact_lock"]
        return [*([(take.format(high="?", low="?"), values)] if take else []), (
            f"SELECT {holds.format(high='?', low='?')}, k.request, k.status, k.answer, "
            "k.created FROM (SELECT 1) one LEFT JOIN idempotency_key k ON k.scope = ? "
            "AND k.key = ?", (*values, self.scope, self.key))]

    def locked(self, row):
        """After looking(): None, the handler may run (its keep() writes the
        claim with the answer); a repeat's kept answer, or 409 and 422 as in
        look().  Not locked: another transaction with the key is open."""
        if not row[0]:
            raise self._running()
        return self._answer(row[1:])

    def claim(self, conn):
        """Claim the key for this request in a transaction of its own,
        committed before the handler runs: None, the handler may run; else
        as look()."""
        lock, values = self._lock(conn)
        for _ in range(3):   # a claim removed or taken over meanwhile: look again
            now, token = _now(), secrets.token_hex(16)
            claiming = (
                "INSERT INTO idempotency_key (scope, key, request, token, created) "
                f"SELECT ?, ?, ?, ?, ? WHERE {lock} {self._TAKE_OVER}",
                (self.scope, self.key, self.request, token, now, *values,
                 _shift(now, -_KEY_KEPT), _shift(now, -_KEY_LEASE)))
            with transaction(conn, first=claiming) as claimed:   # one round trip with BEGIN
                pass
            if claimed.rowcount:
                self.token = token
                return None
            # Not claimed: the key's live row, or a transaction that holds
            # its lock (a request with it still runs, its row unseen).
            kept = self._answer(conn.execute(
                "SELECT request, status, answer, created FROM idempotency_key "
                "WHERE scope = ? AND key = ?", (self.scope, self.key)).fetchone())
            if kept is not None:
                return kept
        raise self._running()

    #: A new claim takes over an expired answer or an abandoned claim.
    _TAKE_OVER = ("ON CONFLICT (scope, key) DO UPDATE SET request = excluded.request, "
                  "token = excluded.token, status = excluded.status, answer = excluded.answer, "
                  "created = excluded.created WHERE idempotency_key.created < ? OR "
                  "(idempotency_key.status IS NULL AND idempotency_key.created < ?)")

    def keep(self, conn, outcome, at_commit=False):
        """Keep ``outcome`` on the claim, in the caller's transaction, when
        it is a 2xx answer; False when it is not (release() the claim).
        ``at_commit``: after looking() in this transaction, which holds the
        key's lock: the claim is written here, with the answer, and goes
        with the COMMIT (conn.at_commit)."""
        kept = _Kept.of(outcome)
        if kept is None:
            return False
        if at_commit:
            now = _now()
            conn.at_commit = [*conn.at_commit, (
                "INSERT INTO idempotency_key (scope, key, request, token, status, answer, "
                f"created) VALUES (?, ?, ?, ?, ?, ?, ?) {self._TAKE_OVER}",
                (self.scope, self.key, self.request, secrets.token_hex(16), kept.status,
                 _to_json(kept.answer), now, _shift(now, -_KEY_KEPT), _shift(now, -_KEY_LEASE)))]
        elif not conn.execute(
                "UPDATE idempotency_key SET status = ?, answer = ? "
                "WHERE scope = ? AND key = ? AND token = ?",
                (kept.status, _to_json(kept.answer), self.scope, self.key, self.token)).rowcount:
            raise Conflict("This request ran so long that a repeat with its Idempotency-Key "
                           "took over; nothing was changed.", field="Idempotency-Key")
        self.kept = True
        return True

    def release(self, conn):
        """Remove the claim of a request that failed (if it is still ours)."""
        if self.token is None or self.kept:
            return
        try:
            with transaction(conn):
                conn.execute("DELETE FROM idempotency_key WHERE scope = ? AND key = ? "
                             "AND token = ?", (self.scope, self.key, self.token))
        except Exception:   # the database is gone: the claim ends with its lease
            _log.exception("the claim of Idempotency-Key %r stays until its lease ends",
                           self.key)
        self.token = None


class _Kept:
    """A kept answer: its status and {"data": ...} of an envelope, or
    {"body": ..., "headers": ...} of a page; replayed with Idempotent-Replayed."""

    #: Headers of the answer that are not kept (they are made again).
    _MADE = ("content-length", "content-type", "x-response-id", "set-cookie")

    def __init__(self, status, answer):
        self.status, self.answer = status, answer

    @classmethod
    def of(cls, outcome):
        """The answer to keep, or None for one that is not kept (not 2xx)."""
        if isinstance(outcome, ApiError):
            return None
        if isinstance(outcome, bottle.HTTPResponse):
            if not 200 <= outcome.status_code < 300 or not isinstance(outcome.body, str):
                return None
            return cls(outcome.status_code, {"body": outcome.body, "headers": {
                name: value for name, value in outcome.headerlist
                if name.lower() not in ("content-length", "x-response-id")}})
        return cls(200, {"data": outcome, "headers": {
            name: value for name, value in bottle.response.headerlist
            if name.lower() not in cls._MADE}})

    def replay(self, response_id):
        """The kept answer again, under a new responseId."""
        headers = {**self.answer["headers"], "Idempotent-Replayed": "true"}
        if "body" in self.answer:
            return bottle.HTTPResponse(self.answer["body"], self.status,
                                       {**headers, "X-Response-Id": response_id})
        return _respond(self.status, _envelope(response_id, True, self.answer["data"]), headers)


def _purge_idempotency_keys(db, limit=1000):
    """Delete kept answers and claims older than _KEY_KEPT, at most ``limit``
    per call (the worker runs it).

    :returns: how many were deleted.
    """
    cutoff = _shift(_now(), -_KEY_KEPT)
    conn = connect(db)
    try:
        with transaction(conn):
            return conn.execute(
                "DELETE FROM idempotency_key WHERE (scope, key) IN (SELECT scope, key "
                "FROM idempotency_key WHERE created < ? ORDER BY created LIMIT ?)",
                (cutoff, limit)).rowcount
    finally:
        conn.close()


_response_ids = random.Random(os.urandom(32))


def _new_response_id():
    # Unique, not secret: a seeded generator instead of os.urandom per request,
    # whose system call hands the GIL to another thread and waits to get it back.
    return f"{_response_ids.getrandbits(128):032x}"


class _Service:
    """The state of one app: its database, settings and per-thread connections."""

    def __init__(self, db, config):
        self.db, self.config = db, config
        self.app = None
        self.routes = ()  # the Route rows this app serves
        self._local = threading.local()
        self._secret = None
        self._keys = {}  # Authorization header -> (key row, remembered until, epoch)
        # How /v1/bounce/ses fetches SNS signing certificates, and the hosts
        # they may come from (create_app() gives _fetch_https and _SNS_CERT_HOST;
        # tests point these at a local HTTPS server): the signature is checked
        # either way.
        self.sns_fetch = self.sns_cert_host = None
        self.later = {}   # {name: write} of call.later(); create_app() gives LATER
        self.signup_limit = _ClientLimit()  # public sign-ups per client address
        self.intake = _Intake(self)  # public writes kept while their lock is held
        # observe(method, route, status, seconds) of every answer: GET /metrics's
        # request figures (create_app() sets it with the setting metrics).
        self.observe = None

    def key(self, conn, header):
        """authenticate(), remembering a verified key for key_cache_seconds."""
        remembered = self._keys.get(header)
        if remembered is not None:
            key, until, epoch = remembered
            if until > time.monotonic() and epoch == _key_epoch \
                    and not (key["expires"] and key["expires"] < _now()):
                return key
        key = _authenticate(conn, header)
        if self.config["key_cache_seconds"] > 0:
            if len(self._keys) > 10000:  # bounded: a burst of keys cannot grow it
                self._keys.clear()
            self._keys[header] = (key, time.monotonic() + self.config["key_cache_seconds"],
                                  _key_epoch)
        return key

    def conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.db)
        return conn

    @property
    def secret(self):
        """The key for signed tokens: configured, or made once and stored."""
        if self._secret is None:
            self._secret = self.config["secret"] or _stored_secret(self.conn())
        return self._secret

    def link_base(self):
        """link_base() of the request being answered, under this app's mount prefix."""
        return _link_base(bottle.request.environ, self.config,
                         self.app.config.get("_mount.prefix", "") or "")

    def root(self):
        """GET of the app's root: a redirect to the index (GET /v1/)."""
        try:
            outcome = bottle.HTTPResponse(status=302, headers={
                "Location": self.link_base() + "/v1/"})
        except InvalidHost as error:
            outcome = error
        return self.finish(_new_response_id(), time.perf_counter(), outcome)

    def dispatch(self, route, raw_ids):
        """The request pipeline: every route goes through here."""
        response_id, started = _new_response_id(), time.perf_counter()
        request = bottle.request
        keyed = None
        try:
            _param_path(request.environ)
            conn = self.conn()
            account = None
            if route.level:
                key = self.key(conn, _request_header("Authorization"))
                _require_level(key, route.level)
                account = key["account"]
            ids = route.parse_ids(raw_ids)
            keyed = _Keyed.of(route.method, request.environ, account, self.config["max_body"])
            params = _parse_params(route, request.environ, self.config["max_body"])
            call = _Call(conn, account, params, self, response_id)
            # A key is claimed in the route's own transaction where it runs
            # as one (see _Keyed), else in a transaction of its own first.
            inside = route.writes and not route.later
            kept = keyed and (keyed.look(conn) or (None if inside else keyed.claim(conn)))
            if kept:
                return self.finish(response_id, started, kept, raw_ids)
            if route.later:
                outcome = route.run(call, ids)
                self.intake.take(call)
            elif route.writes:
                with transaction(conn, first=keyed and keyed.looking(conn)) as looked:
                    kept = keyed and keyed.locked(looked.fetchone())
                    if not kept:
                        outcome = route.run(call, ids)
                        if keyed:   # the answer commits with the writes, or neither does
                            keyed.keep(conn, outcome, at_commit=True)
                if kept:
                    return self.finish(response_id, started, kept, raw_ids)
            else:
                outcome = route.run(call, ids)
            if keyed and keyed.token and not keyed.kept:
                with transaction(conn):
                    keyed.keep(conn, outcome)
            if call.memo.get("events") and self.config["on_event"]:
                _run_callbacks(self.config["on_event"], call.memo["events"])
        except ApiError as error:
            outcome = error
        except INTEGRITY_ERRORS:
            outcome = Conflict("The change conflicts with existing data (a duplicate or a "
                               "missing reference).")
        except Exception:
            _log.exception("internal error, responseId %s", response_id)
            outcome = _internal_error(response_id)
        finally:
            child = request.environ.pop(_BODY_CHILD, None)
            if child is not None:
                child.close()
        if keyed is not None:   # a failed request (or one not 2xx) frees its key
            keyed.release(self.conn())
        return self.finish(response_id, started, outcome, raw_ids, "/v1" + route.path)

    def finish(self, response_id, started, outcome, raw_ids=None, path=None):
        """The one exit path: answer ``outcome`` (a handler's data, an ApiError,
        or a ready response such as a download or a page) and log the request
        once, with its responseId; ``path``: the route as declared (metrics)."""
        request = bottle.request
        if isinstance(outcome, bottle.HTTPResponse):
            outcome.set_header("X-Response-Id", response_id)
            status, answer = outcome.status_code, outcome
        elif isinstance(outcome, ApiError):
            status = outcome.status
            answer = _respond(status, _envelope(response_id, False, outcome.data()),
                              outcome.headers)
        elif isinstance(outcome, _Kept):
            status, answer = outcome.status, outcome.replay(response_id)
        else:
            status, answer = 200, _respond(200, _envelope(response_id, True, outcome))
        if _log.isEnabledFor(logging.INFO):  # the arguments cost, even unlogged
            _log.info("%s %s %s %s %.1fms", response_id, request.method,
                     _loggable_path(request.path, raw_ids or {}), status,
                     (time.perf_counter() - started) * 1000)
        if self.observe is not None:   # by the route as declared: a bounded set of labels
            self.observe(request.method, path or "(no route)", status,
                         time.perf_counter() - started)
        return answer

    def unrouted(self):
        """The error for a request that no route takes: 404, or 405 with Allow."""
        request = bottle.request
        path = request.path
        prefix = self.app.config.get("_mount.prefix") or ""
        if prefix and path.startswith(prefix):  # mounted: the parent routes the full path
            path = path[len(prefix) - 1:]
        allowed = sorted({route.method for route in self.routes if route.pattern.fullmatch(path)})
        if not allowed:
            return NotFound(f"There is no route {request.method} {request.path}.")
        return MethodNotAllowed(f"{request.method} is not allowed here; allowed: "
                                f"{', '.join(allowed)}.", allowed)

    def no_route(self, path=""):
        """The catch-all route: our envelope even where bottle's error handler
        is not ours (Bottle.mount merges these routes into the parent app)."""
        return self.finish(_new_response_id(), time.perf_counter(), self.unrouted())

    def bottle_error(self, error):
        """Bottle's own errors as envelopes.  Bottle already copied the
        error's status and headers into the response it will send; finish()
        sets ours over them."""
        response_id = _new_response_id()
        if error.status_code in (404, 405):
            outcome = self.unrouted()
        elif error.status_code == 413:
            outcome = PayloadTooLarge("The request body is too large.")
        elif error.status_code >= 500:
            _log.error("internal error, responseId %s: %s", response_id,
                      error.traceback or error.body)
            outcome = _internal_error(response_id)
        else:
            outcome = InvalidParameter(str(error.body))
        return self.finish(response_id, time.perf_counter(), outcome)


def _internal_error(response_id):
    return ApiError(f"Something went wrong on our side; quote responseId {response_id} when "
                    "reporting it.")


def _parse_timestamp(value, now=None):
    """A send time as UTC 'YYYY-MM-DD HH:MM:SS': Unix seconds, 'YYYY-MM-DD
    HH:MM:SS' (UTC) or ISO 8601 (with an offset; without one it is UTC).  A
    time in the past means now."""
    now = now or _now()
    seconds = _as_int(value)
    try:
        if seconds is not None:
            moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        elif isinstance(value, str):
            moment = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=datetime.timezone.utc)
        else:
            raise ValueError
        stamp = moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):
        raise InvalidParameter(
            "'timestamp' must be Unix seconds, 'YYYY-MM-DD HH:MM:SS' in UTC, or ISO 8601 with "
            "an offset.", field="timestamp") from None
    return max(stamp, now)


def _run_callbacks(on_event, pending):
    """Hand committed events to the embedding application's callback; an
    exception there is logged and changes nothing."""
    for kind, payload in pending:
        try:
            on_event(kind, payload)
        except Exception:
            _log.exception("the on_event callback failed for %s", kind)
    pending.clear()


def _server_address(text, what):
    """``(host, port)`` of ``"host:port"`` ("[::1]:25" for IPv6); ``what`` names it in errors."""
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be given as host:port, not {text!r}")
    return host.strip("[]"), int(port)



# Public writes that never wait ------------------------------------------------
#
# A big import is one transaction: on SQLite it holds the database's one write
# lock for its whole length, on PostgreSQL the rows it wrote.  A person who
# opens, clicks, unsubscribes, signs up or confirms meanwhile must not wait for
# it (nor fail at the 30 s busy timeout).  So those routes read, check and
# answer, and hand their writes to call.later(); the pipeline applies them in
# one short transaction when its locks come within _PUBLIC_WAIT, else keeps
# them in the intake (the engine's place, which the import's locks do not
# reach: _SqliteIntake, _PgIntake) and a thread of the app applies them in
# the order they came as soon as the lock is free.  While any are kept, new
# ones queue behind them: an unsubscribe does not overtake the sign-up
# before it.

#: How long a public write waits for its locks before it is kept for later (ms).
_PUBLIC_WAIT = 50
#: Kept writes applied per transaction.
_INTAKE_CHUNK = 500
#: Opens and clicks held in memory at most (per app) while another thread
#: writes: past it a request writes its own, waiting as before (never dropped).
_HELD_MAX = 10000
#: How long the thread that writes held opens and clicks lets more come before
#: it writes them (s): the most a SIGKILL can lose is what came meanwhile and
#: during that one write (README, "Decisions").
_HELD_INTERVAL = 0.005
#: How long that thread stays when nothing comes (s); the next open starts it again.
_HELD_IDLE = 5.0
#: How long a stop waits for the thread writing at the moment (s).
_HELD_STOP_WAIT = 30.0
#: Apps (their _Intake) of this process: what holds opens and clicks, written
#: out when the process ends normally (atexit) and when a worker stops.
_INTAKES = weakref.WeakSet()
_INTAKES_LOCK = threading.Lock()


def _write_held_all(close=False):
    """Write every app's held opens and clicks now (``close``: and from now on
    at once, as the process ends)."""
    with _INTAKES_LOCK:
        intakes = list(_INTAKES)
    for intake in intakes:
        intake.flush(close=close)


class _Intake:
    """The public writes of one app (its Service): take() applies a
    request's or keeps them; drain() applies kept ones, in order; a thread
    drains while any are kept."""

    def __init__(self, service):
        self.service, self.lock, self.thread = service, threading.Lock(), None
        self.backlog = None   # whether any are kept; None: not looked yet
        # Where they are kept: the engine's place (_SqliteIntake).
        self.store = _connection_class(service.db).intake(service.db, service.conn, _PUBLIC_WAIT)
        # Threads of the app take turns at writing here rather than in the
        # database's busy wait, and the one whose turn it is commits what the
        # others brought meanwhile too (group commit): one transaction for
        # many opens under load.
        self.writer, self.waiting = threading.Lock(), []
        # Opens and clicks that came while another thread was writing, or
        # under load: the request is answered at once and they are written
        # behind it (write_held()), at the latest by the thread
        # "campaignapi-held" (holder); None after close().
        self.held, self.holder, self.wake = [], None, threading.Event()
        with _INTAKES_LOCK:
            if not _INTAKES:
                atexit.register(_write_held_all, close=True)
            _INTAKES.add(self)

    def take(self, call):
        """Apply the request's call.later() writes at once, or keep them."""
        items = call.memo.pop("later", None)
        if not items:
            return
        if all(hasattr(self.service.later[kind], "many") for kind, _ in items) \
                and self._hold(items):
            return
        with self.lock:
            if self.backlog is None:
                self.backlog = self.kept()
            backlog = self.backlog
        if not backlog and self._apply_now(call, items):
            return
        if self.held:
            self.flush()   # the opens and clicks that came before go first
        self._keep(call.conn, items)
        with self.lock:
            self.backlog = True
            self._start()

    def _apply_now(self, call, items):
        """Apply ``items`` in a transaction with those other threads bring
        meanwhile; False when the locks did not come within _PUBLIC_WAIT."""
        mine = [call, items, None]   # the third: True applied, False to keep
        with self.lock:
            self.waiting.append(mine)
        with self.writer:
            if mine[2] is None:
                self.write_held()   # opens and clicks that came before, first
                with self.lock:
                    turn, self.waiting = self.waiting, []
                self._commit(turn)
        return mine[2]

    def _hold(self, items):
        """Opens and clicks (``items``): written now, with any held, when the
        app is quiet (no other thread writing, no thread writing behind);
        else held for the thread that writes them next, and the request is
        answered without waiting for a commit.  Under load the thread
        "campaignapi-held" runs, and every count goes behind: one write per
        _HELD_INTERVAL instead of one per request that finds the writer free.
        False when the app is closed or _HELD_MAX are held: the request
        applies them itself, as any public write."""
        with self.lock:
            if self.held is None or len(self.held) >= _HELD_MAX:
                return False
            self.held.extend(items)
            quiet = self.holder is None or not self.holder.is_alive()
        if quiet and self.writer.acquire(blocking=False):
            try:
                self.write_held()
                return True
            except Exception as error:   # held again: the thread tries again
                _log.warning("held opens and clicks not written yet: %s", error)
            finally:
                self.writer.release()
        self.wake.set()
        with self.lock:
            if self.holder is None or not self.holder.is_alive():
                self.holder = threading.Thread(target=self._write_behind, daemon=True,
                                               name="campaignapi-held")
                self.holder.start()
        return True

    def write_held(self):
        """Under self.writer: write the held opens and clicks in one
        transaction (in the intake, behind any kept writes, when the database
        is busy, as take() does)."""
        with self.lock:
            items, self.held = self.held, ([] if self.held is not None else None)
        if not items:
            return
        call = _Call(self.service.conn(), None, {}, self.service, "held")
        try:
            with self.lock:
                if self.backlog is None:
                    self.backlog = self.kept()
                backlog = self.backlog
            entry = [call, items, None]
            if not backlog:
                self._commit([entry])
            if not entry[2]:
                self._keep(call.conn, items)
                with self.lock:
                    self.backlog = True
                    self._start()
        except Exception:
            with self.lock:   # back in front, for the next turn (nothing is dropped)
                if self.held is None:
                    _log.exception("held opens and clicks could not be written: %s",
                                  _to_json(items))
                else:
                    self.held[:0] = items
            raise

    def _write_behind(self):
        """The thread "campaignapi-held": writes what is held, until nothing
        comes for _HELD_IDLE."""
        failures = 0
        while True:
            if not self.wake.wait(_HELD_IDLE):
                with self.lock:
                    if not self.held:
                        self.holder = None
                        return
            self.wake.clear()
            time.sleep(_HELD_INTERVAL)
            try:
                with self.writer:
                    self.write_held()
                failures = 0
            except Exception as error:   # a lost connection, the intake unwritable
                failures += 1
                _log.warning("held opens and clicks not written yet: %s", error)
                time.sleep(min(0.01 * 2 ** failures, 5.0))
                self.wake.set()

    def flush(self, close=False):
        """Write the held opens and clicks now; ``close``: and from now on
        every one in its request, as before (the app's close(), the end of the
        process)."""
        if not self.writer.acquire(timeout=_HELD_STOP_WAIT):   # a writer stuck: say what is lost
            _log.error("held opens and clicks not written (the app's writer is stuck): %s",
                       _to_json(self.held or []))
            return
        try:
            self.write_held()
            if close:
                with self.lock:
                    self.held = None
        finally:
            self.writer.release()

    def _commit(self, turn):
        conn = self.store.quick(turn[0][0].conn)
        apart = len(turn) > 1 or len(turn[0][1]) > 1
        try:
            with self.store.quick_transaction(conn):
                for entry in turn:
                    call, items, _ = entry
                    read, call.conn = call.conn, conn
                    try:
                        _apply_later(call, items, apart=apart)
                    finally:
                        call.conn = read
            done = True
        except Exception as error:
            for call, _, _ in turn:
                call.memo.pop("events", None)   # rolled back: raised by no one
            done = not _transient(error)
            if done:   # one write alone, failing: logged and left out, as in _apply_later
                _log.exception("a %s could not be applied and is left out: %s",
                              turn[0][1][0][0], _to_json(turn[0][1][0][1]))
        for entry in turn:
            entry[2] = done

    def resume(self):
        """Drain what an earlier run of the app left kept (at start)."""
        with self.lock:
            self.backlog = self.kept()
            if self.backlog:
                self._start()

    def kept(self):
        """Whether any writes are kept."""
        return self.store.kept()

    def drain(self, limit=_INTAKE_CHUNK):
        """Apply up to ``limit`` kept writes, the oldest first, in one
        transaction; waits for the lock as any writer does.

        :returns: how many were taken off the intake.
        """
        conn = self.service.conn()
        call = _Call(conn, None, {}, self.service, "intake")
        taken = self.store.drain(conn, limit, lambda items: _apply_later(call, items))
        if call.memo.get("events") and self.service.config["on_event"]:
            _run_callbacks(self.service.config["on_event"], call.memo["events"])
        return taken

    def _keep(self, conn, items):
        now = _now()
        self.store.keep(conn, [(kind, _to_json(payload), now) for kind, payload in items])

    def _start(self):
        """A draining thread, unless one runs (under self.lock)."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._drain_all, name="campaignapi-intake",
                                           daemon=True)
            self.thread.start()

    def _drain_all(self):
        failures = 0
        while failures < 100:
            try:
                if self.drain():
                    failures = 0
                    continue
                with self.lock:
                    if not self.kept():
                        self.backlog, self.thread = False, None
                        return
                time.sleep(0.1)   # another host drains (PostgreSQL)
            except Exception as error:   # locked past the busy timeout, a lost connection
                failures += 1
                _log.warning("kept public writes not applied yet: %s", error)
                time.sleep(min(0.1 * 2 ** failures, 5.0))
        _log.error("kept public writes: giving up for now; the next public write retries")


def _transient(error):
    """Whether a database error says "later", not "never": lock timeout,
    deadlock, serialization failure (PostgreSQL), a locked database (SQLite)."""
    state = getattr(error, "sqlstate", None) or ""
    return state == "55P03" or state.startswith("40") or (
        isinstance(error, sqlite3.OperationalError) and "locked" in str(error))


def _apply_later(call, items, apart=True):
    """Apply call.later() writes ``(kind, payload)`` in the caller's
    transaction, each in a savepoint (``apart``): one that fails (a bug, a
    row gone) is logged with what it carried and left out, never blocking the
    others.  Waiting is not failing: a lock timeout, a deadlock or a busy
    database ends the transaction, and the writes are tried again."""
    many = getattr(call.service.later[items[0][0]], "many", None) if len(items) > 1 else None
    if apart and many is not None:
        # Writes of one kind in a row that can go together (opens and clicks):
        # one statement for them all (a savepoint each is most of their
        # cost); one by one only when that fails.
        run = next((n for n, (kind, _) in enumerate(items) if kind != items[0][0]), len(items))
        try:
            with transaction(call.conn):
                many(call, [payload for _, payload in items[:run]])
            items = items[run:]
        except Exception as error:
            if _transient(error):
                raise
    for kind, payload in items:
        if not apart:
            call.service.later[kind](call, **payload)
            continue
        raised = len(call.events)
        try:
            with transaction(call.conn):
                call.service.later[kind](call, **payload)
        except Exception as error:
            del call.memo["events"][raised:]   # rolled back: raised by no one
            if _transient(error):
                raise
            _log.exception("a kept %s could not be applied and is left out: %s", kind,
                          _to_json(payload))


class _ClientLimit:
    """At most ``rate`` sign-ups a minute from one client address, counted in
    this process (a fixed one-minute window per address, bounded memory)."""

    def __init__(self):
        self.lock, self.windows = threading.Lock(), {}

    def wait(self, client, rate):
        """0 when the client may go on (and it is counted), else the seconds
        until it may."""
        now = time.monotonic()
        with self.lock:
            if len(self.windows) > 10000:  # a burst of addresses cannot grow it
                self.windows = {key: value for key, value in self.windows.items()
                                if now - value[0] < 60}
                if len(self.windows) > 10000:
                    self.windows.clear()
            start, count = self.windows.get(client, (now, 0))
            if now - start >= 60:
                start, count = now, 0
            if count >= rate:
                return max(1, int(60 - (now - start)) + 1)
            self.windows[client] = (start, count + 1)
            return 0


# ---------------------------------------------------------------------------
# Emails: building every email the service sends (merge tags, templates and
# their files, wrapping, CSS inlining, link tracking, unsubscribe links, MIME)
# and the one enqueue() that queues each in the outbox.
# ---------------------------------------------------------------------------

_MERGE_TAG = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")


def _merge_tags(template):
    """The names of the merge tags in ``template``, lower-cased."""
    return {name.lower() for name in _MERGE_TAG.findall(template or "")}


# Templates: checks, wrapping, template files -----------------------------------

_CONTENT_TAG = "content"


def _content_tags(body):
    return [match for match in _MERGE_TAG.finditer(body or "")
            if match.group(1).lower() == _CONTENT_TAG]


def _check_template(html_body, text_body):
    """Raise ValueError (a sentence for the author) unless each given body of
    a template holds ``{{content}}`` exactly once.

    :param html_body: the template's html, or '' / None when it has none.
    :param text_body: the template's text, or '' / None.
    """
    for part, body in (("html", html_body), ("text", text_body)):
        if body:
            count = len(_content_tags(body))
            if count != 1:
                found = "does not have it" if not count else f"has it {count} times"
                raise ValueError(
                    f"The template's {part} must hold {{{{content}}}} exactly once, where the "
                    f"message goes; it {found}.")


def _wrap_in_template(template_html, template_text, message_html, message_text):
    """The message's bodies inside the template, at its ``{{content}}``.

    A body exists where the message has it (the template is its layout); a
    template without that body leaves it as it is.  Merge tags of both stay
    tags, to be filled per recipient.  Returns ``(html, text)``.

    :param template_html: the template's html ('' or None: none); checked
        with _check_template().
    """
    _check_template(template_html, template_text)

    def wrap(template, content):
        if not content or not template:
            return content or ""
        tag = _content_tags(template)[0]
        return template[:tag.start()] + content + template[tag.end():]

    return wrap(template_html, message_html), wrap(template_text, message_text)


class _TemplateUnusable(Exception):
    """A campaign's defaulttemplate cannot wrap its messages: ``str()`` says
    why and how to fix it; ``check`` names verify's check that reports it."""

    def __init__(self, message, check="template_found"):
        super().__init__(message)
        self.check = check


#: The characters a template file name may not hold (a regular expression's
#: class, shared with the OpenAPI document): control characters, line and
#: paragraph separators, and the bidirectional controls that make a name read
#: otherwise than it is.
_TEMPLATE_NAME_REFUSED = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069"


def _template_file(templates_dir, name, suffix):
    """The path of template file ``name`` + ``suffix`` ('.html' or '.txt') in
    ``templates_dir``; ValueError (a sentence) for a name that is no plain
    file name there: a path separator, '..', a character of
    _TEMPLATE_NAME_REFUSED, or a file (a symlink too) that resolves outside the
    folder."""
    if not templates_dir:
        raise ValueError("This server has no templates folder (the templates_dir setting, "
                         "--templates-dir), so a template file cannot be named; use a template "
                         "id or ''.")
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if name.lower().endswith(".html"):
        name, bare = name[:-len(".html")], name
    else:
        bare = name
    if not name or ".." in bare or any(sep in name for sep in separators) \
            or re.search(f"[{_TEMPLATE_NAME_REFUSED}]", name):
        raise ValueError(f"'{name}' is not a template file name: give NAME of a file NAME.html "
                         "in the templates folder, without a path, '..' or control characters.")
    folder = os.path.realpath(templates_dir)
    path = os.path.realpath(os.path.join(folder, name + suffix))
    if os.path.commonpath([folder, path]) != folder:
        raise ValueError(f"The template file '{name}{suffix}' resolves outside the templates "
                         "folder (a symlink?); only files inside it can be used.")
    return path


def _fetch_template_file(templates_dir, name):
    """``(html, text)`` of template file NAME.html (and NAME.txt, if there),
    read from disk every time: an edited file counts at once."""
    try:
        paths = [_template_file(templates_dir, name, suffix) for suffix in (".html", ".txt")]
    except ValueError as error:
        raise _TemplateUnusable(str(error)) from None
    bodies = []
    for path, required in zip(paths, (True, False)):
        try:
            with open(path, encoding="utf-8") as f:
                bodies.append(f.read())
        except FileNotFoundError:
            if required:
                raise _TemplateUnusable(
                    f"The template file {os.path.basename(path)} does not exist in the templates "
                    "folder: add it, or point the campaign's defaulttemplate at another "
                    "template.") from None
            bodies.append("")
        except (OSError, UnicodeDecodeError) as error:
            reason = "it is not UTF-8 text" if isinstance(error, UnicodeDecodeError) else (
                error.strerror or str(error))
            raise _TemplateUnusable(f"The template file {os.path.basename(path)} cannot be read "
                                   f"({reason}): fix the file.") from None
    return tuple(bodies)


def _campaign_template(conn, account, defaulttemplate, templates_dir):
    """The bodies ``(html, text)`` that wrap a campaign's messages, or None
    when it has no template; _TemplateUnusable when it cannot be used.

    :param defaulttemplate: the campaign's: '', a template id of ``account``,
        or the NAME of a file NAME.html (and NAME.txt) in ``templates_dir``.
    """
    value = (defaulttemplate or "").strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        row = conn.execute("SELECT html, text, deleted FROM template WHERE id = ? AND owner = ?",
                           (_as_int(value), account)).fetchone()
        fix = "create it with PUT /v1/template/{} or point the campaign at another template"
        if row is None:
            raise _TemplateUnusable(f"Template {value} does not exist: " + fix.format(value) + ".")
        if row["deleted"]:
            raise _TemplateUnusable(f"Template {value} is deleted: point the campaign's "
                                   "defaulttemplate at another template, or clear it with ''.")
        where, bodies = f"template {value}", (row["html"], row["text"])
    else:
        where, bodies = f"the template file '{value}'", _fetch_template_file(templates_dir, value)
    if not any(body.strip() for body in bodies):
        raise _TemplateUnusable(f"{where.capitalize()} has no body: it needs html or text with "
                               "{{content}}.", "template_content")
    try:
        _check_template(*bodies)
    except ValueError as error:
        raise _TemplateUnusable(f"{where.capitalize()}: {error}", "template_content") from None
    return bodies


def _param_defaulttemplate(call, value, name="defaulttemplate"):
    """A campaign's ``defaulttemplate`` as stored: '', the id of a live
    template of the caller's, or a file name that stays inside the templates
    folder (the file itself may come later: verify says when it is missing).
    ``name``: the parameter's (a transactional email's ``template``)."""
    if not isinstance(value, str):  # an id may come as a JSON number (705.0 is 705)
        if _as_int(value) is None:
            raise InvalidParameter(f"'{name}' must be '', a template id or a template "
                                   "file name.", field=name)
        value = str(_as_int(value))
    value = value.strip(" ")
    if value.isascii() and value.isdigit():
        number = _as_int(value)
        if number is None:
            raise InvalidParameter(f"'{name}' is not a template id.", field=name)
        return str(number)   # a live template of the caller's: the route found it
    if value:
        if not call.service.config["templates_dir"]:
            raise Conflict("This server has no templates folder (the templates_dir setting, "
                           "--templates-dir), so a template file cannot be named; use a "
                           "template id or ''.", field=name)
        try:
            for suffix in (".html", ".txt"):
                _template_file(call.service.config["templates_dir"], value, suffix)
        except ValueError as error:
            raise InvalidParameter(str(error), field=name) from None
    return value


# CSS inlining ----------------------------------------------------------------

def _inline_css(html_text):
    """The html with the rules of its ``<style>`` blocks moved into style
    attributes (mail clients drop ``<style>``), once per message.

    @media and other at-rules stay in a ``<style>`` block (only a block can
    hold them); ``<link>`` stylesheets stay as written and are not fetched (no
    network while sending).  Merge tags survive, also inside attributes.  A
    document without ``<style>`` comes back as it is; one the inliner cannot
    handle too, with a warning in the log.

    :param html_text: an html document or fragment, merge tags still in it.
    """
    if not html_text or "<style" not in html_text.lower():
        return html_text
    try:
        import css_inline
    except ImportError:
        _log.warning("css-inline is not installed (pip install css-inline); <style> blocks "
                    "are sent as they are")
        return html_text
    try:
        return _css_inliner(css_inline).inline(html_text)
    except Exception as error:  # noqa: BLE001 - any failure: send the html as written
        _log.warning("CSS could not be inlined (%s); the html is sent as written", error)
        return html_text


@functools.lru_cache(maxsize=1)
def _css_inliner(css_inline):
    return css_inline.CSSInliner(keep_at_rules=True, keep_link_tags=True,
                                 load_remote_stylesheets=False)


# Open and click tracking ----------------------------------------------------

#: The merge tags track_html() puts in a message: the open image's URL and
#: each tracked link's URL, filled per recipient by _tracking_values().
_OPEN_URL_TAG = "open_url"
_CLICK_URL_TAG = "click_url_{}"
_PIXEL = ('<img src="{{open_url}}" width="1" height="1" alt="" '
          'style="display:block;width:1px;height:1px;border:0;margin:0;padding:0">')
#: The open signal of a short html: SpamAssassin's HTML_IMAGE_ONLY_* rules
#: score any <img> in an html part shorter than _IMAGE_ONLY_LENGTH bytes (up
#: to 2.8 points for the pixel alone), so there the same URL is a CSS
#: background of an empty 1x1 block instead: no image element, no points.
#: (Mail clients that show no CSS backgrounds, Outlook for Windows among
#: them, report no open for such an email; longer emails keep the <img>.)
_PIXEL_BACKGROUND = ('<div style="background-image:url({{open_url}});width:1px;height:1px;'
                     'font-size:1px;line-height:1px">&nbsp;</div>')
_IMAGE_ONLY_LENGTH = 3200
#: A transparent 1x1 GIF89a (43 bytes), the answer of the open URL.
_GIF_PIXEL = (b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff"
             b"!\xf9\x04\x01\x00\x00\x00\x00"
             b",\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;")
# The parser's own patterns for a start tag's name and attributes (with a
# copy for a Python that renames them): the spans they find are checked
# against the attributes the parser reports, so the two cannot disagree.
_TAG_NAME = getattr(html.parser, "tagfind_tolerant", None) or re.compile(
    r"([a-zA-Z][^\t\n\r\f />\x00]*)(?:\s|/(?!>))*")
_ATTRIBUTE = getattr(html.parser, "attrfind_tolerant", None) or re.compile(
    r"((?<=[\'\"\s/])[^\s/>][^\s/=>]*)(\s*=+\s*(\'[^\']*\'|\"[^\"]*\"|(?![\'\"])[^>\s]*))?"
    r"(?:\s|/(?!>))*")
_URL_SPACE = re.compile(r"[\t\n\r]")  # browsers drop these inside a URL
_URL_AUTHORITY = re.compile(r"(?i)https?://([^/?#\\]*)")


class _LinkFinder(html.parser.HTMLParser):
    """Where the links and the closing body tag are: (line, column) of each
    ``<a href>`` start tag with its source text and href, and of the last
    ``</body>``.  The parser knows comments, <script> and <style>, so a link
    written inside them is not one."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.anchors, self.body_end = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.anchors.append((self.getpos(), self.get_starttag_text(), attrs))

    def handle_endtag(self, tag):
        if tag == "body":
            self.body_end = self.getpos()


class _TextMaker(html.parser.HTMLParser):
    """The text body of an html body: blocks on lines of their own, list items
    as ``- ``, a link as ``text (url)``, an image as its alt text; <head>,
    <style> and <script> left out.  html.parser rather than a converter
    package: html2text is GPL-3.0 (this module is MIT) and inscriptis brings
    lxml and requests and writes links as ``[text](url)``; an email's html is
    simple, and the parser is the one tracking already reads it with."""

    _BLOCKS = frozenset("address article aside blockquote center dd div dl dt footer form h1 h2 "
                        "h3 h4 h5 h6 header hr li main nav ol p pre section table tbody thead "
                        "tfoot tr ul".split())
    _HIDDEN = frozenset(("head", "style", "script", "title", "template"))

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.hidden, self.anchors = [], 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in self._HIDDEN:
            self.hidden += 1
        elif tag == "body":
            self.hidden = 0   # a <head> never closed
        elif tag == "br":
            self.out.append("\n")
        elif tag in self._BLOCKS:
            self.gap(2 if tag in ("p", "h1", "h2", "h3", "table") else 1)
            if tag == "li":
                self.out.append("- ")
        elif tag in ("td", "th"):
            self.out.append(" ")
        elif tag == "img" and attrs.get("alt") and not self.hidden:
            self.out.append(f" {attrs['alt']} ")
        if tag == "a":
            self.anchors.append(((attrs.get("href") or "").strip(), len(self.out)))

    def handle_endtag(self, tag):
        if tag in self._HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in self._BLOCKS:
            self.gap(2 if tag in ("p", "h1", "h2", "h3", "table") else 1)
        if tag == "a" and self.anchors:
            href, start = self.anchors.pop()
            text = " ".join("".join(self.out[start:]).split())
            if href and not href.startswith(("#", "javascript:")) and href != text:
                self.out.append(f" ({href})" if text else href)

    def handle_data(self, data):
        if not self.hidden:
            self.out.append(re.sub(r"\s+", " ", data))

    def gap(self, lines):
        """End the text so far with at least ``lines`` line breaks (blank
        space between them does not count)."""
        tail = "".join(self.out[-8:]).rstrip(" ")
        have = len(tail) - len(tail.rstrip("\n")) if tail.strip() else lines
        self.out.append("\n" * max(0, lines - have))


def _html_text(html_body):
    """A text body made from ``html_body`` (links kept as ``text (url)``,
    merge tags kept as tags): what a message with html and no text sends."""
    maker = _TextMaker()
    maker.feed(html_body or "")
    maker.close()
    lines = [" ".join(line.split()) for line in "".join(maker.out).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _href_span(source, attrs):
    """(start, end) of the first href value in a start tag's ``source``, quotes
    included; None where our reading differs from the parser's ``attrs``."""
    match = _TAG_NAME.match(source, 1)
    if match is None:
        return None
    position, seen, span = match.end(), [], None
    while position < len(source):
        match = _ATTRIBUTE.match(source, position)
        if match is None:
            break
        name, rest, value = match.group(1, 2, 3)
        if not rest:
            value = None
        elif value[:1] in "'\"" and value[:1] == value[-1:] and len(value) > 1:
            value = value[1:-1]
        seen.append((name.lower(), html.unescape(value) if value else value))
        if span is None and name.lower() == "href" and rest:
            span = match.span(3)
        position = match.end()
    return span if seen == list(attrs) else None


def _trackable(url):
    """The link as a browser reads it, when it is one to track, else None.

    Only http(s) URLs whose scheme and host are written out: a merge tag in
    the host would let a recipient's data (a sign-up form is public) choose
    where our click URL redirects."""
    url = _URL_SPACE.sub("", url.strip(" \t\n\r\f"))
    if "unsubscribe_url" in _merge_tags(url):
        return None
    match = _URL_AUTHORITY.match(url)
    if match is None or not match.group(1) or "{" in match.group(1) or "}" in match.group(1):
        return None
    return url


def _track_html(html_template):
    """Prepare a message's html for open and click tracking, once per batch.

    Every ``<a href>`` holding an http(s) URL gets the merge tag
    ``{{click_url_N}}`` (N from 0, in document order) as its value, and an
    open image ``<img src="{{open_url}}">`` goes before ``</body>`` (or at
    the end; in a short html a CSS background carries it, _PIXEL_BACKGROUND).
    The unsubscribe link, mailto:, tel:, anchors and links in
    comments or scripts stay.  Nothing else changes: the edits are made by
    source position, the document is not written out again.

    :param html_template: the html with its merge tags still in it.
    :returns: ``(html, links)``: the new template, and the URLs of the links
        in tag order, entities decoded and merge tags kept, to be stored with
        the batch and resolved at click time by _click_target().
    """
    source = html_template or ""
    finder = _LinkFinder()
    end = len(source)
    try:
        finder.feed(source)
        # What the parser keeps back is an unfinished tag, comment or
        # character reference: the image goes before it, not into it.
        end -= len(finder.rawdata)
        finder.close()
    except Exception:  # noqa: BLE001 - a parser bug must not stop a send
        _log.warning("html of a message could not be parsed for tracking; the links "
                    "found before the error are tracked", exc_info=True)
    line_starts = [0] + [match.end() for match in re.finditer("\n", source)]

    def offset(position):
        return line_starts[position[0] - 1] + position[1]

    edits, links = [], []
    for position, tag_source, attrs in finder.anchors:
        start = offset(position)
        href = next((value for name, value in attrs if name == "href"), None)
        url = _trackable(href) if href else None
        span = _href_span(tag_source, attrs) if url else None
        if span is None or source[start:start + len(tag_source)] != tag_source:
            continue
        tag = "{{" + _CLICK_URL_TAG.format(len(links)) + "}}"
        edits.append((start + span[0], start + span[1], f'"{tag}"'))
        links.append(url)
    if finder.body_end:
        end = min(end, offset(finder.body_end))
    # The filled html is longer than the template: each URL by about 100 bytes.
    short = len(source) + len(_PIXEL) + 100 * (len(links) + 2) < _IMAGE_ONLY_LENGTH
    edits.append((end, end, _PIXEL_BACKGROUND if short else _PIXEL))
    out, done = [], 0
    for begin, stop, text in edits:  # in source order: the pixel is after every link
        out += (source[done:begin], text)
        done = stop
    out.append(source[done:])
    return "".join(out), links


def _tracking_values(secret, base, email_id, link_count):
    """The per-recipient values of the tags track_html() adds.

    :param base: where the API is reachable (public_url or the batch's base_url).
    :param email_id: the outbox row of this email.
    :param link_count: ``len(links)`` of track_html().
    """
    base = base.rstrip("/")
    values = {_OPEN_URL_TAG: f"{base}/v1/open/{sign_token(secret, 'open', email_id)}"}
    for index in range(link_count):
        values[_CLICK_URL_TAG.format(index)] = (
            f"{base}/v1/click/{sign_token(secret, 'click', email_id, index)}")
    return values


def _click_target(url, values):
    """Where a click goes: a stored link (of track_html()) with the clicking
    recipient's merge values, as the browser would have read the untracked
    link (values as they are; spaces, quotes and non-ASCII percent-encoded),
    so a valid Location header.  The host cannot depend on the values:
    track_html() tracks no link with a merge tag before its path.

    :param values: ``{name: str}`` of the recipient, names without case.
    """
    filled = _Template(url).fill({name.lower(): str(value) for name, value in values.items()})
    return urllib.parse.quote(filled, safe="!#$%&'()*+,-./:;=?@[]_~")


def _merge_values(stored, to_addr):
    """The merge values of an email without a recipient row: its outbox
    row's merge_values (JSON, see enqueue()) as text, ``{{email}}`` its address."""
    values = {name: "" if value is None else value if isinstance(value, str) else _to_json(value)
              for name, value in json.loads(stored or "{}").items()}
    return {**values, "email": to_addr}


# Unsubscribe links -----------------------------------------------------------

def _unsubscribe_url(secret, base, account, address, campaign=None):
    """The one-click unsubscribe link of ``address`` for the account's mail.

    :param base: where the API is reachable (public_url or a batch's base_url).
    """
    return f"{base.rstrip('/')}/v1/unsubscribe/{unsubscribe_token(secret, account, address, campaign)}"


def _email_unsubscribe_url(secret, base, *names):
    """The one-click unsubscribe link of an email, opaque.  A campaign's
    names ``(campaign, recipient row)`` (the address, the account and the
    email that carried it are looked up): the same for every email of the
    campaign to that recipient, so a preview shows the link the email will
    carry.  An email of a prepared message names ``(outbox email,)``.

    :param base: where the API is reachable (public_url or a batch's base_url).
    """
    token = sign_token(secret, "unsubscribe", *names)
    return f"{base.rstrip('/')}/v1/unsubscribe/{token}"


# MIME: the fixed part of an email is encoded once by the email package; what
# differs per recipient is joined to it as bytes (building a whole
# EmailMessage costs more than sending it).  ------------------------------------

_POLICY = email.policy.SMTP
_LINE_BREAK = re.compile(r"[\r\n]+")
_LONG_LINE = re.compile(rb"[^\n]{999}")


def _header(name, value):
    """One header line as bytes: encoded (RFC 2047) and folded when needed."""
    value = _LINE_BREAK.sub(" ", str(value)).strip()
    if value.isascii() and (len(name) + len(value) <= 76 or " " not in value):
        return f"{name}: {value}\r\n".encode("ascii")
    return _POLICY.header_factory(name, value).fold(policy=_POLICY).encode("ascii")


def _address_header(name, display_name, address):
    try:
        value = str(email.headerregistry.Address(display_name=display_name, addr_spec=address))
    except (ValueError, IndexError, email.errors.MessageError):
        value = address
    return _header(name, value)


def _mime_part(content, subtype):
    """A text/* part: 7bit when it is short-lined ASCII, else quoted-printable."""
    if "\r" in content:
        content = content.replace("\r\n", "\n").replace("\r", "\n")
    data = content.encode("utf-8")
    if not data.endswith(b"\n"):
        data += b"\n"
    if data.isascii() and not _LONG_LINE.search(data):
        encoding = b"7bit"
    else:
        encoding, data = b"quoted-printable", binascii.b2a_qp(data, istext=True)
    return (b"Content-Type: text/" + subtype + b'; charset="utf-8"\r\n'
            b"Content-Transfer-Encoding: " + encoding + b"\r\n\r\n" + data.replace(b"\n", b"\r\n"))


class _Template:
    """A merge template split once into text and tag names; fill() gives what
    the merge-tag rule asks, at a small cost, for recipient after recipient."""

    def __init__(self, template):
        pieces = _MERGE_TAG.split(template or "")
        self.texts, self.names = pieces[0::2], [name.lower() for name in pieces[1::2]]

    def fill(self, values, *, as_html=False):
        """:param values: ``{lower-case name: str}``."""
        if not self.names:
            return self.texts[0]
        if as_html:
            values = {name: html.escape(values.get(name, ""), quote=True)
                      for name in set(self.names)}
        out = [self.texts[0]]
        for name, text in zip(self.names, self.texts[1:]):
            out += (values.get(name, ""), text)
        return "".join(out)


class _Literal(_Template):
    """Text used as it is (a notification's body: braces are not tags)."""

    def __init__(self, text):
        self.texts, self.names = [text], []


class _Letter:
    """One kind of email (a sender and a message's templates), ready to be
    built for each recipient with build()."""

    def __init__(self, sender, subject, text, html_body="", *, from_name="", reply_to="",
                 list_id=None, templated=True):
        """:param templated: fill merge tags from the values given to build()."""
        self.sender = sender
        self.domain = sender.rpartition("@")[2] or "localhost"
        self.subject = _Template(subject) if templated and _merge_tags(subject) else None
        head = [_address_header("From", from_name, sender)]
        if reply_to:
            head.append(_address_header("Reply-To", "", reply_to))
        if self.subject is None:
            head.append(_header("Subject", subject))
        if list_id:
            head.append(_header("List-Id", list_id))
        head.append(b"MIME-Version: 1.0\r\n")
        self.head = b"".join(head)
        if not text and not html_body:
            text = " "
        wrap = _Template if templated else _Literal
        self.text = wrap(text) if text else None
        self.html = wrap(html_body) if html_body else None
        self.boundary = ("=_" + secrets.token_hex(16)).encode("ascii")

    def build(self, to_addr, values=None, unsubscribe=None, message_id=None):
        """The email to ``to_addr`` as bytes (RFC 5322, CRLF line ends).

        :param values: merge values, ``{name: str}``; names without case.
        :param message_id: the Message-ID (default: a new random one).
        """
        values = {name.lower(): str(value) for name, value in (values or {}).items()}
        message_id = message_id or email.utils.make_msgid(domain=self.domain)
        # A non-ASCII address goes out only over SMTPUTF8, whose headers are UTF-8 (RFC 6532).
        to = _header("To", to_addr) if to_addr.isascii() else f"To: {to_addr}\r\n".encode()
        head = [self.head, to, b"Date: ", email.utils.formatdate(usegmt=True).encode(),
                b"\r\nMessage-ID: ", message_id.encode(), b"\r\n"]
        if self.subject is not None:
            head.append(_header("Subject", self.subject.fill(values)))
        if unsubscribe:
            head.append(_header("List-Unsubscribe", f"<{unsubscribe}>"))
            head.append(b"List-Unsubscribe-Post: List-Unsubscribe=One-Click\r\n")
        parts = []
        if self.text:
            parts.append(_mime_part(self.text.fill(values), b"plain"))
        if self.html:
            parts.append(_mime_part(self.html.fill(values, as_html=True), b"html"))
        if len(parts) == 1:
            return b"".join(head) + parts[0]
        # The CRLF before a boundary belongs to the boundary (RFC 2046), so
        # each part's own last line end is kept by a second one.
        marker = b"--" + self.boundary
        body = b"".join(marker + b"\r\n" + part + b"\r\n" for part in parts) + marker + b"--\r\n"
        return (b"".join(head) + b'Content-Type: multipart/alternative; boundary="' + self.boundary
                + b'"\r\n\r\n' + body)


def _campaign_sender(conn, campaign, message):
    """``{"fromname", "fromaddress", "replyto"}`` of a campaign message: the
    message's own values where set, else the campaign's sender profile's.

    :param campaign: ``{"owner", "accountprofile"}``: a profile of another
        account is no profile, just as one that does not exist.
    """
    profile = conn.execute("SELECT fromname, fromaddress, replyto FROM accountprofile "
                           "WHERE id = ? AND owner = ?",
                           (campaign["accountprofile"], campaign["owner"])).fetchone()
    profile = dict(profile) if profile else {}
    return {name: message[name] or profile.get(name) or ""
            for name in ("fromname", "fromaddress", "replyto")}


def _list_id(scope, number, account):
    """The List-Id of a campaign's (``scope`` 'campaign') or an automation's emails."""
    return f"<{scope}-{number}.{account}.campaignapi>"


def _message_letter(conn, campaign, message, sent, base, mail_from):
    """The Letter of one campaign message, as delivery, preview and test
    sends all build it.

    :param campaign: ``{"id", "owner", "accountprofile"}`` of the campaign.
    :param message: the message row (for its sender).
    :param sent: ``{"subject", "html", "text"}`` as the batch sends them
        (_prepare_message()).
    :param base: where the API is reachable, for unsubscribe links ('' none).
    :param mail_from: the sender when neither message nor profile has one.
    """
    return _campaign_letter(_campaign_sender(conn, campaign, message), sent, campaign["id"],
                            campaign["owner"], base, mail_from)


def _campaign_letter(sender, sent, campaign, account, base, mail_from):
    """The Letter of a campaign's prepared message ``sent`` (``{"subject",
    "html", "text"}``, with ``"tracked", "links"`` when its batch tracks) as
    ``sender`` (``{"fromname", "fromaddress", "replyto"}``, empty:
    ``mail_from``): the campaign's List-Id, its links pointing at ``base``."""
    return _prepared_letter({**sent, **sender, "account": account, "campaign": campaign,
                             "list_id": _list_id("campaign", campaign, account),
                             "base_url": base, "bulk": 1}, mail_from)


def _prepared_letter(prepared, mail_from):
    """The Letter of a prepared message, the one way every campaign-grade
    email is built: a batch's message (_campaign_letter()) or a row of the
    prepared table (_prepared()).

    :param prepared: a mapping with subject, html, text, fromname,
        fromaddress (empty: ``mail_from``), replyto, list_id ('' none),
        base_url (where its links point; '' none: untracked, no unsubscribe
        link), bulk (List-Unsubscribe and {{unsubscribe_url}}), account, and
        optionally campaign (its unsubscribe links name the campaign and the
        recipient; without: the outbox email), tracked (the html of
        _track_html(); None or absent: untracked) and links (how many).
    """
    # A message with html and no text gets a text body made from the html.
    text = prepared["text"] or (_html_text(prepared["html"]) if prepared["html"] else "")
    letter = _Letter(prepared["fromaddress"] or mail_from, prepared["subject"], text,
                    prepared["html"], from_name=prepared["fromname"] or "",
                    reply_to=prepared["replyto"] or "", list_id=prepared["list_id"] or None)
    letter.campaign, letter.account = prepared.get("campaign"), prepared["account"]
    letter.base, letter.bulk = (prepared["base_url"] or "").rstrip("/"), bool(prepared["bulk"])
    letter.links = None  # tracked: how many links the prepared message keeps
    if prepared.get("tracked") is not None and letter.base and prepared["html"]:
        letter.html, letter.links = _Template(prepared["tracked"]), prepared["links"]
    return letter


def _recipient_email(letter, secret, to_addr, values, recipient=None, message_id=None,
                     outbox=None):
    """``(sender, email bytes)`` of a prepared Letter for one recipient: the
    merge ``values`` with the unsubscribe link (bulk mail only).

    :param recipient: the recipient's id: a campaign's link names it and the
        campaign, opaquely, so delivery and preview give the same link.  None
        (a test send): the link names ``to_addr``, the tester, instead.
    :param outbox: the outbox email: the link of a prepared message names it.
    """
    link = None
    if not letter.base or not letter.bulk:
        pass
    elif letter.campaign is None:
        link = outbox is not None and _email_unsubscribe_url(secret, letter.base, outbox)
    elif recipient is not None:
        link = _email_unsubscribe_url(secret, letter.base, letter.campaign, recipient)
    else:
        link = _unsubscribe_url(secret, letter.base, letter.account, to_addr, letter.campaign)
    values["unsubscribe_url"] = link or ""
    return letter.sender, letter.build(to_addr, values, link or None, message_id)


# Preparing a campaign message ---------------------------------------------------

def _prepare_message(message, template):
    """A message as every recipient of a batch gets it, before their merge
    values: ``{"subject", "html", "text"}``, the bodies inside the template
    (see _wrap_in_template()) and the html's ``<style>`` CSS inlined.  Done
    once per message per batch; delivery, preview and test sends start here.

    :param message: the message row; ``template``: ``(html, text)`` or None.
    """
    html_body, text_body = message["html"], message["text"]
    if template:
        html_body, text_body = _wrap_in_template(*template, html_body, text_body)
    return {"subject": message["subject"], "html": _inline_css(html_body), "text": text_body}


def _prepared(conn, account, scope, message, sender, *, template=None, tracking=False,
              base_url="", list_id="", bulk=True):
    """The prepared message (its id) that emails of ``scope`` outside a batch
    are built from at delivery: found when one with the same inputs exists,
    else made once, in the caller's transaction, as a batch prepares its
    messages: _prepare_message(), and with ``tracking`` _track_html() with
    its links kept in prepared_link (a click token resolves the URL there).
    Queue its emails with enqueue(..., prepared=id); their events name it.

    :param scope: what its statistics count under ('automation:A:S', ...).
    :param message: the message row (subject, html, text, id).
    :param sender: ``{"fromname", "fromaddress", "replyto"}`` (_campaign_sender()).
    :param template: ``(html, text)`` that wraps the message, or None.
    :param base_url: where its links point ('' the worker's public_url).
    :param list_id: its List-Id header ('' none; see _list_id()).
    :param bulk: bulk mail: List-Unsubscribe and {{unsubscribe_url}}.
    """
    options = {"template": template, "tracking": tracking, "base_url": base_url,
               "list_id": list_id, "bulk": bulk}
    digest = _prepared_digest(message, sender, **options)
    row = conn.execute("SELECT id FROM prepared WHERE scope = ? AND digest = ?",
                       (scope, digest)).fetchone()
    if row is not None:
        return row[0]
    content, links = _prepared_content(message, sender, **options)
    row = conn.execute(
        "INSERT INTO prepared (account, scope, digest, message, subject, html, text, tracked, "
        "fromname, fromaddress, replyto, list_id, base_url, bulk, created) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (scope, digest) DO NOTHING RETURNING id",
        (account, scope, digest, message["id"], *(content[name] for name in _PREPARED_COLUMNS),
         _now())).fetchone()
    if row is None:   # another transaction made it meanwhile
        return conn.execute("SELECT id FROM prepared WHERE scope = ? AND digest = ?",
                            (scope, digest)).fetchone()[0]
    conn.executemany("INSERT INTO prepared_link (prepared, link, url) VALUES (?, ?, ?)",
                     [(row[0], index, url) for index, url in enumerate(links)])
    return row[0]


#: The columns of a prepared message that _prepared_content() gives, in the
#: order _prepared() writes them.
_PREPARED_COLUMNS = ("subject", "html", "text", "tracked", "fromname", "fromaddress", "replyto",
                     "list_id", "base_url", "bulk")


def _prepared_digest(message, sender, *, template, tracking, base_url, list_id, bulk):
    """What names a prepared message's inputs (_prepared()'s arguments)."""
    inputs = [message["id"], message["subject"], message["html"], message["text"],
              template and list(template), [sender.get(name) or "" for name in (
                  "fromname", "fromaddress", "replyto")], bool(tracking), base_url or "",
              list_id or "", bool(bulk)]
    return hashlib.sha256(_to_json(inputs).encode("utf-8")).hexdigest()


def _prepared_content(message, sender, *, template, tracking, base_url, list_id, bulk):
    """``(columns, links)`` of the prepared message of _prepared()'s arguments,
    written nowhere: its _PREPARED_COLUMNS (what _prepared_letter() reads)
    and the URLs of its tracked links.  An automation's verify builds its
    samples from these too."""
    sent = _prepare_message(message, template)
    tracked, links = _track_html(sent["html"]) if tracking and sent["html"] else (None, [])
    return {**sent, "tracked": tracked, **{name: sender.get(name) or "" for name in (
        "fromname", "fromaddress", "replyto")}, "list_id": list_id or "",
        "base_url": base_url or "", "bulk": int(bool(bulk))}, links


# The outbox ------------------------------------------------------------------

def enqueue(conn, account, kind, to_addr=None, *, subject=None, body=None, html=None,
            sender=None, batch=None, message=None, recipient=None, campaign=None,
            base_url=None, recipients=None, now=None, prepared=None, merge_values=None,
            priority=None, status=None):
    """Queue an email in the outbox, in the caller's transaction: the one way
    every email of the service is sent (campaign emails, test sends, archive
    copies, notifications, sign-up emails); the worker delivers it.

    A campaign email carries no content: delivery renders it from its batch's
    prepared message (see _archive_message()); so does an email of a
    prepared message (an automation's, a transactional one: see _prepared()),
    from that message, with its recipient row's merge values or, with no
    recipient row, ``merge_values``.  A test send carries its
    prepared message with the merge tags still in it, filled at delivery by
    the same code.  Other mail carries its ready subject and bodies.

    :param kind: 'campaign', 'test', 'archive', 'notification', 'signup',
        'automation' or 'transactional'.
    :param to_addr: the address; none with ``recipients`` (each one's own).
    :param subject: the subject; ``body`` the plain text, ``html`` an
        optional HTML alternative.
    :param sender: ``{"fromname", "fromaddress", "replyto"}`` to send as (a
        sender profile's); None: the campaign's (a campaign email) or the
        worker's mail_from.
    :param batch: a campaign email's batch; ``message`` the message it sends
        (also a test send's).
    :param recipient: the recipient row whose merge values fill the email.
    :param campaign: the campaign a test send belongs to: it carries that
        campaign's List-Id and unsubscribe link, without a batch.
    :param base_url: where the email's links point; None: the worker's public_url.
    :param recipients: ``(where, params)``, SQL on ``recipient r``: one email
        to each such recipient not suppressed for the account, in one
        statement however many they are (a batch's segment), in address
        order; an address already queued for ``batch`` is skipped.
    :param now: the time it is queued and due ('YYYY-MM-DD HH:MM:SS' UTC).
    :param prepared: the prepared message (_prepared()) it is built from.
    :param merge_values: ``{name: value}`` (JSON values) that fill an email of a
        prepared message without a recipient row; ``{{email}}`` is ``to_addr``.
    :param priority: 1: delivered before every due row of a lower one (a
        transactional email); default 0.
    :param status: 'waiting' for campaign emails that wait for an A/B test's
        winner (see _make_batch()); None: queued.
    :returns: the outbox row's id; with ``recipients`` the number queued.
    """
    sender, now = sender or {}, now or _now()
    if merge_values is not None:
        merge_values = _to_json(merge_values)
    fields = {"account": account, "kind": kind, "batch": batch, "message": message,
              "campaign": campaign, "prepared": prepared, "merge_values": merge_values,
              "base_url": base_url, "subject": subject, "body": body,
              "html": html, "fromname": sender.get("fromname"),
              "fromaddress": sender.get("fromaddress") or None,
              "replyto": sender.get("replyto"), "created": now, "next_try": now,
              "priority": priority, "status": status}
    # Only the values given: an untyped NULL in a SELECT list is text on PostgreSQL.
    fields = {name: value for name, value in fields.items() if value is not None}
    marks = ", ".join("?" for _ in fields)
    head = f"INSERT INTO outbox ({', '.join(fields)}, recipient, to_addr) "
    if recipients is None:
        return conn.execute(head + f"VALUES ({marks}, ?, ?)",
                            (*fields.values(), recipient, to_addr)).lastrowid
    where, params = recipients
    # In address order (NOCASE, as the outbox's indexes on to_addr are):
    # those indexes then grow at their end instead of at random pages,
    # which past the page cache cost a page read per row.
    return conn.execute(
        head + f"SELECT {marks}, r.id, r.email FROM recipient r WHERE {where} "
        "AND NOT EXISTS (SELECT 1 FROM suppression s WHERE s.account = ? AND s.email = r.email) "
        "ORDER BY r.email ON CONFLICT DO NOTHING",
        (*fields.values(), *params, account)).rowcount


def enqueue_email(conn, account, to_addr, subject, body, kind="notification", html=None,
                  sender=None):
    """Queue a ready-made email (a notification, an archive copy) in the
    outbox: enqueue() with its content.  Returns the outbox row id.

    :param body: the plain-text body; ``html`` an optional HTML alternative.
    :param sender: ``{"fromname", "fromaddress", "replyto"}`` to send as (a
        sender profile's); None: the worker's mail_from.
    """
    return enqueue(conn, account, kind, to_addr, subject=subject, body=body, html=html,
                   sender=sender)


def _account_email(conn, account):
    """The account holder's address, where notifications go."""
    return conn.execute("SELECT email FROM account WHERE id = ?", (account,)).fetchone()["email"]


def _default_mail_from():
    """The sender of notifications and archive copies unless one is configured."""
    return f"campaignapi@{socket.gethostname() or 'localhost'}"


# ---------------------------------------------------------------------------
# Domain writes: recording an event, suppressing an address, applying a
# bounce.  Each writes in the caller's transaction; every route, page, worker
# step and inbound source that makes one of these changes comes here.
# ---------------------------------------------------------------------------

# Events: raised in the transaction of the change that causes them, stored for
# the account's webhooks (the worker delivers them), handed to the internal
# subscribers in that transaction, and to the on_event callback once it has
# committed.  ----------------------------------------------------------------

#: Every kind of event, in the order a recipient's or a campaign's life runs.
EVENT_KINDS = ("recipient.subscribed", "recipient.confirmed", "recipient.unsubscribed",
               "recipient.bounced", "recipient.complained", "import.finished",
               "export.finished", "batch.started", "batch.sent",
               "automation.started", "automation.finished")


def _iso_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace(
        "+00:00", "Z")


#: The module's own reactions to events: kind -> handlers, each called as
#: ``handler(conn, account, payload, pending)`` by emit(), inside the
#: transaction of the change (see _subscribe()).
_SUBSCRIBERS = {kind: [] for kind in EVENT_KINDS}


def _subscribe(kind, handler):
    """Have emit() call ``handler(conn, account, payload, pending)`` for each
    event ``kind``, in the transaction of the change that raises it, after
    the event is stored for webhooks and queued for on_event.  What the
    handler writes commits or rolls back with that change; an exception it
    raises fails the change (the request answers an error, the worker's
    round is retried).  ``pending`` is the caller's on_event list, for
    the events the handler raises in turn (None when nobody listens).

    For the module's own code (an automation that starts when a recipient is
    confirmed): declare it next to the handler, at the top level of its banner.

    :returns: ``handler``.
    """
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    _SUBSCRIBERS[kind].append(handler)
    return handler


def emit(conn, account, kind, data, pending=None, *, webhooks=None):
    """Raise event ``kind`` of ``account`` inside the current transaction.

    The payload ``{"type", "timestamp", "data"}`` is stored once, with one
    delivery for each enabled webhook of the account that wants the kind, so
    it is sent if and only if the transaction commits.  ``pending`` (a list)
    collects ``(kind, payload)`` for the on_event callback, which the caller
    runs after its commit.  Then the internal subscribers of the kind (see
    _subscribe()) are called, in the same transaction.

    :param data: the record, or the ids, the event is about (JSON values).
    :param webhooks: the ids of the webhooks that want it (_webhooks_wanting()),
        when the caller raises many at once; default: looked up.
    :returns: the payload.
    """
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    payload = {"type": kind, "timestamp": _iso_now(), "data": data}
    if webhooks is None:
        webhooks = _webhooks_wanting(conn, account, kind)
    if webhooks:
        now = _now()
        event_id = conn.execute(
            "INSERT INTO hook_event (account, kind, payload, created) VALUES (?, ?, ?, ?)",
            (account, kind, _to_json(payload), now)).lastrowid
        conn.executemany("INSERT INTO hook_delivery (webhook, event, next_try, created) "
                         "VALUES (?, ?, ?, ?)", [(webhook, event_id, now, now)
                                                 for webhook in webhooks])
    if pending is not None:
        pending.append((kind, payload))
    for handler in _SUBSCRIBERS[kind]:
        handler(conn, account, payload, pending)
    return payload


def _webhooks_wanting(conn, account, kind):
    """The ids of the account's enabled webhooks that get events ``kind``."""
    return [row["id"] for row in conn.execute(
        "SELECT id, events FROM webhook WHERE owner = ? AND enabled = 1 AND deleted = 0",
        (account,)) if kind in json.loads(row["events"]) or row["events"] == "[]"]


# Suppressing an address: the one way an address stops getting the account's
# campaigns (unsubscribe, bounce, complaint) ---------------------------------

#: Why an address is suppressed, weakest first: a stronger reason replaces a
#: weaker one (a complaint outranks an unsubscribe, which outranks a bounce),
#: never the other way round.  Each also names its statistics event.
_SUPPRESSIONS = {"bounced": "bounce", "unsubscribed": "unsubscribe", "complained": "complaint"}
#: An event's prepared message: its email's (SQL, the outbox id a parameter),
#: so the statistics of a prepared message count what its emails caused.
_EMAIL_PREPARED = "(SELECT prepared FROM outbox WHERE id = ?)"
_RANK = "CASE {} WHEN 'bounced' THEN 1 WHEN 'unsubscribed' THEN 2 ELSE 3 END"


def suppress(conn, account, address, reason, campaign=None, *, batch=None, outbox=None,
             pending=None):
    """Stop the account's campaigns reaching ``address``, in the caller's
    transaction: the suppression row, the status of every recipient row of the
    account with that address, the event counted in the statistics of the
    batch that caused it, and the ``recipient.<reason>`` event (see emit()).
    Nothing is recorded when a stronger reason is already there.

    :param reason: a key of _SUPPRESSIONS: 'bounced', 'unsubscribed' or 'complained'.
    :param campaign, batch, outbox: what the address was mailed by, when known.
    :param pending: the on_event list of the caller (see emit()).
    :returns: True when the address's state changed.
    """
    now = _now()
    changed = conn.execute(
        "INSERT INTO suppression (account, email, reason, campaign, created) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (account, email) DO UPDATE SET reason = excluded.reason, "
        "campaign = excluded.campaign, created = excluded.created "
        f"WHERE {_RANK.format('excluded.reason')} > {_RANK.format('suppression.reason')}",
        (account, address, reason, campaign, now)).rowcount
    weaker = list(_SUPPRESSIONS)[:list(_SUPPRESSIONS).index(reason)]
    marks = ", ".join("?" for _ in weaker)
    conn.execute(
        "UPDATE recipient SET status = ?, updated = ? WHERE email = ? "
        f"AND status IN ('active', 'unconfirmed'{', ' + marks if weaker else ''}) "
        "AND datasource IN (SELECT id FROM datasource WHERE owner = ?)",
        (reason, now, address, *weaker, account))
    if not changed:
        return False
    conn.execute("INSERT INTO event (account, kind, campaign, batch, outbox, email, created, "
                 f"prepared) VALUES (?, ?, ?, ?, ?, ?, ?, {_EMAIL_PREPARED})",
                 (account, _SUPPRESSIONS[reason], campaign, batch, outbox, address, now, outbox))
    emit(conn, account, f"recipient.{reason}",
         {"email": address, "campaign": campaign and str(campaign),
          "batch": batch and str(batch)}, pending)
    return True


# Applying a bounce: the rules, the one place every source ends -------------

#: The kinds of report apply_bounce() takes: classify_bounce() answers one of
#: them in "type", the provider callbacks map their events to them.
_BOUNCE_TYPES = ("hard", "soft", "complaint", "none")
#: A soft bounce suppresses the address when the latest this many emails the
#: account sent to it all soft-bounced.
_SOFT_BOUNCE_LIMIT = 3
#: A report known only by its address applies to the accounts that mailed
#: that address within this many days.
_BOUNCE_WINDOW_DAYS = 30


def _bounce_targets(conn, report, account, secret):
    """``[(account, address, outbox row or None)]`` a report applies to."""
    outbox = report.get("outbox")
    if outbox is None and secret and report.get("message_id"):
        outbox = read_message_id(secret, report["message_id"])
    if outbox is not None:
        row = conn.execute("SELECT id, account, batch, to_addr FROM outbox WHERE id = ?",
                           (outbox,)).fetchone()
        if row is not None:
            return [(row["account"], row["to_addr"], row)]
    address = _normalize_email(report.get("email"))
    if address is None:
        return []
    if account is not None:
        return [(account, address, _latest_email(conn, account, address, report.get("campaign")))]
    since = _shift(_now(), -_BOUNCE_WINDOW_DAYS * 86400)
    accounts = [row[0] for row in conn.execute(
        "SELECT DISTINCT account FROM outbox WHERE to_addr = ? AND created >= ? ORDER BY account",
        (address, since))]
    return [(each, address, _latest_email(conn, each, address)) for each in accounts]


def _latest_email(conn, account, address, campaign=None):
    """The latest email the account sent to ``address`` (of ``campaign``):
    the one a report that names no email is about, nearly always."""
    where = "" if campaign is None else " AND batch IN (SELECT id FROM batch WHERE campaign = ?)"
    return conn.execute(
        "SELECT id, account, batch, to_addr FROM outbox WHERE account = ? AND to_addr = ? "
        f"AND status = 'sent'{where} ORDER BY id DESC LIMIT 1",
        (account, address) + (() if campaign is None else (campaign,))).fetchone()


def _soft_bounce_run(conn, account, address):
    """How many soft bounces in a row the address has: the latest emails the
    account sent to it that each soft-bounced, up to the first that did not
    (a delivery); soft bounces that name no email (none was sent) count too
    when every email sent since soft-bounced."""
    # Sent emails, and those given up on after temporary failures (soft at SMTP time).
    emails = conn.execute(
        "SELECT soft FROM (SELECT o.id, o.status, EXISTS (SELECT 1 FROM event e "
        "WHERE e.outbox = o.id AND e.kind = 'softbounce') AS soft FROM outbox o "
        "WHERE o.account = ? AND o.to_addr = ?) AS emails WHERE status = 'sent' OR soft "
        "ORDER BY id DESC LIMIT ?", (account, address, _SOFT_BOUNCE_LIMIT)).fetchall()
    run = 0
    for (soft,) in emails:
        if not soft:
            return run
        run += 1
    return run + conn.execute(
        "SELECT count(*) FROM event WHERE account = ? AND email = ? AND kind = 'softbounce' "
        "AND outbox IS NULL", (account, address)).fetchone()[0]


def _soft_bounce(conn, account, address, campaign, batch, outbox, pending):
    """Count a soft bounce (once per email); the _SOFT_BOUNCE_LIMIT-th in a row bounces."""
    if not conn.execute(
            "INSERT INTO event (account, kind, campaign, batch, outbox, email, created, prepared) "
            f"VALUES (?, 'softbounce', ?, ?, ?, ?, ?, {_EMAIL_PREPARED}) ON CONFLICT DO NOTHING",
            (account, campaign, batch, outbox, address, _now(), outbox)).rowcount:
        return   # a second report of the same email (event_softbounce_once)
    if _soft_bounce_run(conn, account, address) >= _SOFT_BOUNCE_LIMIT:
        suppress(conn, account, address, "bounced", campaign, batch=batch, outbox=outbox,
                 pending=pending)


def apply_bounce(conn, report, *, account=None, secret=None, pending=None):
    """Apply one bounce or complaint, in the caller's transaction; every
    source (SMTP replies aside) ends here: POST /v1/bounce, the bounce
    mailbox, the provider callbacks.

    A hard bounce suppresses the address ('bounced') for the account; a
    complaint suppresses it ('complained'); a soft bounce is counted once per
    email and the _SOFT_BOUNCE_LIMIT-th in a row bounces it.  Each counts in
    the statistics of the batch of the email it is about.

    Which account and email: the outbox email the report names (VERP, else
    our signed Message-ID) decides both; else the address within
    ``account``; else every account that mailed the address in the last
    _BOUNCE_WINDOW_DAYS days.  Without a named email, the latest email the
    account sent to the address is taken as the one it is about.

    :param report: ``{"type": hard|soft|complaint|none, "email", "outbox",
        "message_id", "campaign"}`` (classify_bounce()'s, or a provider event);
        missing keys are None.
    :param account: the account of the caller (the JSON route's key).
    :param secret: the signing secret, to read our Message-IDs.
    :param pending: the on_event list of the caller (see emit()).
    :returns: ``{"type", "email", "campaign", "batch"}`` (strings or None) of
        the first account it applied to; type 'none' changes nothing.
    """
    kind = report.get("type")
    answer = {"type": kind if kind in _BOUNCE_TYPES else "none",
              "email": _normalize_email(report.get("email")), "campaign": None, "batch": None}
    if answer["type"] == "none":
        return answer
    for index, (owner, address, email) in enumerate(_bounce_targets(conn, report, account, secret)):
        batch = email["batch"] if email is not None else None
        campaign = report.get("campaign")
        if batch is not None:
            campaign = conn.execute("SELECT campaign FROM batch WHERE id = ?",
                                    (batch,)).fetchone()[0]
        outbox = email["id"] if email is not None else None
        if kind == "soft":
            _soft_bounce(conn, owner, address, campaign, batch, outbox, pending)
        else:
            suppress(conn, owner, address, "bounced" if kind == "hard" else "complained",
                     campaign, batch=batch, outbox=outbox, pending=pending)
        if index == 0:
            answer.update(email=address, campaign=campaign and str(campaign),
                          batch=batch and str(batch))
    return answer


# ---------------------------------------------------------------------------
# Record kinds: each kind is a declaration; the generic operations serve it.
# ---------------------------------------------------------------------------

def _insert_record(conn, table, record_id, values):
    """Insert a row at ``record_id`` (0: the next id) and return its id.

    A positive free id is taken as given, so a client can retry a create;
    the ids of later creates at 0 follow the rule of ID_REACH.
    """
    chosen = record_id or conn.next_id(table)   # None: the sequence's next id
    if chosen:
        values = {"id": chosen, **values}
    columns = ", ".join(values)
    marks = ", ".join("?" for _ in values)
    # ON CONFLICT: a create at the id by another transaction that commits
    # first (waited for on PostgreSQL) makes it taken, never an error; a
    # create at 0 that meets one then takes the sequence's next id.
    for _ in range(10):
        cursor = conn.execute(f"INSERT INTO {table} ({columns}) VALUES ({marks}) "
                              "ON CONFLICT (id) DO NOTHING", tuple(values.values()))
        if cursor.rowcount:
            return cursor.lastrowid
        if chosen:
            break
    raise Conflict(f"The id {chosen} is taken; create at id 0 to get a new one." if chosen
                   else "The next ids were all taken meanwhile; try again.")


def _update_record(conn, table, record_id, values):
    """Set ``values`` (column -> value) on row ``record_id``; nothing if empty."""
    if values:
        assignments = ", ".join(f"{column} = ?" for column in values)
        conn.execute(f"UPDATE {table} SET {assignments} WHERE id = ?",
                     (*values.values(), record_id))


def _columns(call, names):
    """The given parameters among ``names``, as column -> value."""
    return {name: call.params[name] for name in names if name in call.params}


def _same_id(call, name, value):
    """Refuse when the body's ``name`` does not repeat the id ``value``: a
    conflict (409) between the request's two ids, not a malformed request."""
    if call.get(name) != value:
        raise Conflict(f"'{name}' must equal the id in the path ({value}).", field=name)


# How a record reads in the OpenAPI document: a kind declares its
# ``fields`` with these.

_STRING_OR_NULL = {"type": ["string", "null"]}
_FLAG_ANSWER = {"type": "string", "enum": ["0", "1"]}
_ID_LIST = {"type": "array", "items": {"type": "string"}}


def _record_schema(names, /, **special):
    """A record as the API answers it: every field of ``names`` present,
    each a string or null unless ``special`` gives its schema."""
    names = names.split()
    return {"type": "object", "required": names,
            "properties": {name: special.get(name, _STRING_OR_NULL) for name in names}}


class Resource:
    """A kind of record, declared once.  Its Get, Create, Change and Delete
    are the methods below, used as route handlers; a handler is written by
    hand only for what is not record CRUD.

    :param name: the kind: the answer's key and its word in the route table.
    :param table: its table (a fixed name, never request text).
    :param shape: ``shape(call, row) -> record``: a row as the API's record.
    :param columns: the columns Create and Change take, as route parameters
        (``"name:type ..."``); ``required``: those Create needs.
    :param extra: ``{operation: "name:type ..."}``, further parameters of an
        operation that are not columns (``values`` and the hooks read them).
    :param values: ``values(call, row) -> {column: value}`` from the checked
        parameters, refusing what does not fit (``row``: the stored record on
        Change, None on Create); default: the columns given.
    :param parent: the kind this one lives under, ``parent_key`` the column
        naming it; the pipeline looks the parent up (and checks its owner)
        once and hands it over as ``call.parent``.  Without a parent the
        record has an ``owner`` account.
    :param parent_param: a Create parameter that must repeat the parent's id.
    :param single: at most one record per parent: Change finds it by the parent.
    :param repeat: ``{operation: "param"}``: a body parameter that must repeat
        the record's id ("param!" when it is required).
    :param select, source, order: how a record is read: the columns, the FROM
        clause (with joins), the listing's order.
    :param selectors: ``{word: SQL}``: path words besides ``all`` that list a
        subset; ``filters``: ``{"param:type": SQL with one ?}``, listing filters.
    :param after_create, after_change: ``hook(call, id)``, and ``on_delete``:
        ``hook(call, row)`` before the row goes; all in the request's transaction.
        A dict that after_create returns joins Create's answer (a secret shown once).
    :param soft_delete: Delete sets ``deleted`` (the record stays) instead of
        removing the row; ``stamped``: the table has ``created``.
    :param answer: the answer's key (default ``name``); ``one_as_list``: one
        record is answered as a list of one (as the original service's ``emt_campaign``).
    :param schema: the name of the record's OpenAPI schema (default ``name``);
        ``fields``: that schema, the record as the API answers it
        (``_record_schema()``: every field present, each a string or null
        unless given otherwise).
    :param doc: ``{parameter: (description, example[, schema keywords])}``:
        what the kind's own parameters mean, for the OpenAPI document (a
        list's ``items``, say).  Names that several kinds or other routes
        share (``name``, ``id``, paging) are described in _PARAM_DOCS.
    """

    #: Every kind by name: a child route's path names its parent's kind.
    kinds = _KINDS

    def __init__(self, name, table, shape, *, columns="", required="", extra=None, values=None,
                 parent=None, parent_key=None, parent_param=None, single=False, repeat=None,
                 select="*", source=None, order="id", selectors=None, filters=None,
                 after_create=None, after_change=None, on_delete=None, soft_delete=None,
                 stamped=True, label=None, answer=None, one_as_list=False, by_name=False,
                 schema=None, fields=None, doc=None):
        self.name, self.table, self.shape = name, table, shape
        self.columns, self.required, self.extra = columns.split(), required.split(), extra or {}
        self.column_names = [spec.partition(":")[0] for spec in self.columns]
        self.values = values or (lambda call, row: _columns(call, self.column_names))
        self.parent, self.parent_key, self.parent_param = parent, parent_key, parent_param
        self.single, self.repeat = single, repeat or {}
        self.select, self.source, self.order = select, source or table, order
        self.selectors, self.filters = selectors or {}, filters or {}
        self.after_create, self.after_change, self.on_delete = after_create, after_change, on_delete
        self.soft_delete = parent is None if soft_delete is None else soft_delete
        self.stamped, self.by_name = stamped, by_name
        self.label = label or name
        self.answer, self.one_as_list, self.schema = answer or name, one_as_list, schema or name
        self.fields, self.doc = fields, doc or {}
        # Owned records are found by (id, owner), child records by (id, parent).
        self.scope_column = f"{table}.{parent_key}" if parent else f"{table}.owner"
        Resource.kinds[name] = self

    # Parameters of each operation, for the route table.

    def params(self, operation):
        """The route parameters of ``operation`` (get, create, change, delete)."""
        if operation == "get":
            return " ".join(["limit:limit offset:int", *self.filters])
        specs = []
        if operation == "create" and self.parent_param:
            specs.append(f"{self.parent_param}:int!")
        repeat = self.repeat.get(operation)
        if repeat:
            specs.append(f"{repeat.rstrip('!')}:int" + ("!" if repeat.endswith("!") else ""))
        if operation in ("create", "change"):
            specs += [spec + "!" if operation == "create" and spec.partition(":")[0]
                      in self.required else spec for spec in self.columns]
        specs += self.extra.get(operation, "").split()
        return " ".join(specs)

    # The one lookup-or-404 path.

    def find(self, conn, scope, record_id, *, live=False):
        """The row ``record_id`` within ``scope`` (the owning account, or the
        parent's id for a child kind), else 404; with ``live``, a soft-deleted
        record is 409 (it cannot be changed or used any more).

        A kind found ``by_name`` also takes a name (without case) for an id.
        """
        where = f"{self.table}.id = ? AND {self.scope_column} = ?"
        row = None
        if not self.by_name or (record_id.isascii() and record_id.isdigit()):
            row = conn.execute(f"SELECT {self.select} FROM {self.source} WHERE {where}",
                               (_as_int(record_id) if self.by_name else record_id,
                                scope)).fetchone()
        if row is None and self.by_name:
            row = conn.execute(f"SELECT {self.select} FROM {self.source} WHERE "
                               f"{self.table}.name = ? AND {self.scope_column} = ?",
                               (record_id, scope)).fetchone()
        if row is None:
            shown = f"'{record_id}'" if self.by_name else record_id
            within = f" in {self.parent.label} {scope}" if self.parent else ""
            raise NotFound(f"There is no {self.label} {shown}{within}.")
        if live and self.soft_delete and row["deleted"]:
            raise Conflict(f"{self.label.capitalize()} {record_id} is deleted.")
        return row

    def _scope(self, call):
        return call.account if self.parent is None else call.parent["id"]

    def _find_one(self, call, record_id, operation):
        """The record an operation acts on; its id repeated where declared."""
        if self.single:  # one per parent: found by the parent, whatever the path says
            row = call.conn.execute(f"SELECT {self.select} FROM {self.source} "
                                    f"WHERE {self.scope_column} = ?", (call.parent["id"],)).fetchone()
            if row is None:
                raise NotFound(f"{self.parent.label.capitalize()} {call.parent['id']} has no "
                               f"{self.label}; create one with PUT.")
        else:
            row = self.find(call.conn, self._scope(call), record_id, live=True)
        repeat = self.repeat.get(operation, "").rstrip("!")
        if repeat and (repeat in call.params or self.repeat[operation].endswith("!")):
            _same_id(call, repeat, row["id"])
        return row

    # The four operations.

    def get(self, call, id):
        """One record, or a page of them for ``all`` (or a selector word)."""
        if id == "all" or id in self.selectors:
            return self.page(call, self.selectors.get(id))
        record = self.shape(call, self.find(call.conn, self._scope(call), id))
        return {self.answer: [record] if self.one_as_list else record}

    def page(self, call, where=None):
        """One page of the records in scope (not deleted), filtered by the
        listing's parameters: ``{answer: [...], total, limit, offset}``."""
        limit, offset = _page(call)
        conditions, args = [f"{self.scope_column} = ?"], [self._scope(call)]
        if self.soft_delete:
            conditions.append(f"{self.table}.deleted = 0")
        if where:
            conditions.append(where)
        for spec, condition in self.filters.items():
            name = spec.partition(":")[0]
            if name in call.params:
                conditions.append(condition)
                args.append(call.params[name])
        where = " AND ".join(conditions)
        total = call.conn.execute(f"SELECT count(*) FROM {self.source} WHERE {where}",
                                  args).fetchone()[0]
        rows = call.conn.execute(f"SELECT {self.select} FROM {self.source} WHERE {where} "
                                 f"ORDER BY {self.order} LIMIT ? OFFSET ?",
                                 (*args, limit, offset)).fetchall()
        return {self.answer: [self.shape(call, row) for row in rows], "total": str(total),
                "limit": str(limit), "offset": str(offset)}

    def create(self, call, id):
        """A new record at ``id`` (0: the next id); answers its id."""
        values = {}
        if self.parent is None:
            values["owner"] = call.account
        else:
            if self.parent_param and call.params[self.parent_param] != call.parent["id"]:
                raise Conflict(f"'{self.parent_param}' must be the {self.parent.label} "
                                       f"in the path ({call.parent['id']}).",
                                       field=self.parent_param)
            values[self.parent_key] = call.parent["id"]
        if self.stamped:
            values["created"] = _now()
        values.update(self.values(call, None))
        new_id = _insert_record(call.conn, self.table, id, values)
        answer = {"id": str(new_id)}
        if self.after_create:
            answer.update(self.after_create(call, new_id) or {})
        return answer

    def change(self, call, id):
        row = self._find_one(call, id, "change")
        _update_record(call.conn, self.table, row["id"], self.values(call, row))
        if self.after_change:
            self.after_change(call, row["id"])
        return True

    def delete(self, call, id):
        row = self._find_one(call, id, "delete")
        if self.on_delete:
            self.on_delete(call, row)
        if self.soft_delete:
            call.conn.execute(f"UPDATE {self.table} SET deleted = 1 WHERE id = ?", (row["id"],))
        else:
            call.conn.execute(f"DELETE FROM {self.table} WHERE id = ?", (row["id"],))
        return True


# ---------------------------------------------------------------------------
# Messages and sender profiles
# ---------------------------------------------------------------------------

#: Values that end up in mail headers; the ``str``/``email`` parameter types
#: refuse line breaks, verify checks stored rows once more.
_HEADER_COLUMNS = ("name", "subject", "fromname", "fromaddress", "replyto")


def _plain_record(call, row):
    """The record of a table whose record is its columns, as strings."""
    return {name: row[name] if isinstance(row[name], str) or row[name] is None else str(row[name])
            for name in row.keys()}


#: Every column is optional: verify says what a message still lacks before
#: it can be sent.
MESSAGE = Resource("message", "message", _plain_record,
                   columns="name:str subject:str fromname:str fromaddress:email replyto:email "
                           "html:text text:text", repeat={"delete": "id"},
                   fields=_record_schema(
                       "id owner name subject fromname fromaddress replyto html text created "
                       "deleted", deleted=_FLAG_ANSWER),
                   doc={
                       "subject": ("The email's subject line; may hold merge tags such as "
                                   "{{city}}.", "News for {{city}}"),
                       "html": ("The HTML body; merge tags {{field}} are filled per recipient.",
                                "<p>Hello from {{city}}</p>"),
                       "text": ("The plain-text body; merge tags {{field}} are filled per "
                                "recipient.", "Hello from {{city}}")})
ACCOUNTPROFILE = Resource("accountprofile", "accountprofile", _plain_record,
                          columns="name:str fromname:str fromaddress:email replyto:email",
                          repeat={"delete": "id"}, label="sender profile",
                          fields=_record_schema("id owner name fromname fromaddress replyto"))


# ---------------------------------------------------------------------------
# Datasources
# ---------------------------------------------------------------------------

def _datasource_record(call, row):
    fields = [{"id": str(f["id"]), "name": f["name"], "type": f["type"], "label": f["label"]}
              for f in call.conn.execute("SELECT id, name, type, label FROM field "
                                         "WHERE datasource = ? ORDER BY id", (row["id"],))]
    recipients = call.conn.execute("SELECT count(*) FROM recipient WHERE datasource = ? "
                                   "AND status = 'active'", (row["id"],)).fetchone()[0]
    return {"id": str(row["id"]), "owner": str(row["owner"]), "name": row["name"],
            "description": row["description"], "origin": row["origin"], "fields": fields,
            "recipients": str(recipients), "created": row["created"],
            "deleted": str(row["deleted"]), "signup": str(row["signup"]),
            "doubleoptin": str(row["doubleoptin"]),
            **{name: None if row[name] is None else str(row[name]) for name in _SIGNUP_REFS},
            "language": row["language"]}


#: The sign-up settings that name another record of the account.
_SIGNUP_REFS = ("confirmmessage", "welcomemessage", "fromprofile")


def _datasource_values(call, row):
    """The columns of a datasource create or change, with the sign-up
    settings checked (the route has found their messages and profile among
    the account's live records): a confirmation message carries
    {{_confirm_url}} in each body it has, and sign-ups need a sender profile."""
    # Bad fields are refused before the row is written: on PostgreSQL an id
    # taken by a rolled-back insert is not given again.
    _checked_fields(call.get("fields", []))
    values = _columns(call, DATASOURCE.column_names)
    if values.get("confirmmessage") is not None:
        record = MESSAGE.find(call.conn, call.account, values["confirmmessage"])
        bodies = [record[body] for body in ("html", "text") if record[body].strip()]
        if not bodies or any("confirm_url" not in _merge_tags(body) for body in bodies):
            raise Conflict(
                f"Message {values['confirmmessage']} cannot be the confirmation email: each of "
                "its bodies must carry the merge tag {{confirm_url}}.", field="confirmmessage")
    merged = {**(dict(row) if row else {}), **values}
    if merged.get("signup") and merged.get("fromprofile") is None:
        raise Conflict("A datasource takes sign-ups only with a sender profile for its "
                       "emails: set 'fromprofile' too.", field="signup")
    return values


def _checked_fields(fields):
    """A create/change ``fields`` list as ``[(name, type, label or None)]``,
    refusing bad ones."""
    checked = {}
    for index, item in enumerate(fields):
        if not isinstance(item, dict) or set(item) - {"name", "type", "label"} \
                or "name" not in item:
            raise InvalidParameter(f"fields[{index}] must be an object with 'name', 'type' and "
                                   "an optional 'label'.", field="fields")
        label = item.get("label")
        if "label" in item and not (isinstance(label, str) and len(label) <= 200
                                    and not any(c in label for c in "\r\n\x00")):
            raise InvalidParameter(f"fields[{index}].label must be one line of at most 200 "
                                   "characters.", field="fields")
        name = item["name"]
        kind = item.get("type", "text")
        if not _valid_field_name(name):
            raise InvalidParameter(f"fields[{index}].name must be a non-empty single-line name "
                                   "without braces.", field="fields")
        if kind not in FIELD_TYPES:
            raise InvalidParameter(f"fields[{index}].type must be one of {', '.join(FIELD_TYPES)}.",
                                   field="fields", allowed=list(FIELD_TYPES))
        name = name.strip()
        if name.lower() == "email" and kind != "email":
            raise InvalidParameter("The field 'email' always exists, with type email.",
                                   field="fields")
        checked[name.lower()] = (name, kind, label and label.strip())
    return list(checked.values())


def _valid_field_name(name):
    """A field name is one non-empty line without braces (they mark merge tags)."""
    return isinstance(name, str) and bool(name.strip()) and len(name) <= 200 \
        and not any(c in name for c in "\r\n\x00{}")


def _add_fields(call, datasource):
    """Add the ``fields`` given that the datasource lacks (a new one gets
    ``email`` first); a known name must keep its type, and takes the label
    given (a label left out stays as it is)."""
    fields = _checked_fields(call.get("fields", []))
    existing = {row["name"].lower(): row["type"] for row in call.conn.execute(
        "SELECT name, type FROM field WHERE datasource = ?", (datasource,))}
    if not existing:
        fields = [("email", "email", None)] + fields
    for name, kind, label in fields:
        if name.lower() not in existing:
            call.conn.execute("INSERT INTO field (datasource, name, type, label) "
                              "VALUES (?, ?, ?, ?)", (datasource, name, kind, label or ""))
            existing[name.lower()] = kind  # 'fields' may list 'email' itself
        elif existing[name.lower()] != kind:
            raise Conflict(f"The field '{name}' exists with type {existing[name.lower()]}; "
                           "change its type with the modify operation.", field="fields")
        elif label is not None:
            call.conn.execute("UPDATE field SET label = ? WHERE datasource = ? AND name = ?",
                              (label, datasource, name))


#: A field's type, as records answer it.
_FIELD_TYPE = {"type": "string", "enum": list(FIELD_TYPES)}

DATASOURCE = Resource(
    "datasource", "datasource", _datasource_record,
    columns="name:str description:text origin:import|signup|api signup:flag doubleoptin:flag "
            "confirmmessage:ref@message welcomemessage:ref@message fromprofile:ref@accountprofile "
            "language:" + "|".join(LANGUAGES),
    required="name",
    extra={"create": "fields:list", "change": "fields:list"}, repeat={"delete": "id!"},
    selectors={"import": "origin = 'import'"}, values=_datasource_values,
    after_create=_add_fields, after_change=_add_fields,
    fields=_record_schema(
        "id owner name description origin fields recipients created deleted signup doubleoptin "
        "confirmmessage welcomemessage fromprofile language",
        language={"type": "string", "enum": list(LANGUAGES)},
        origin={"type": "string", "enum": ["import", "signup", "api"]}, deleted=_FLAG_ANSWER,
        signup=_FLAG_ANSWER, doubleoptin=_FLAG_ANSWER,
        fields={"type": "array", "items": {"$ref": "#/components/schemas/field"}}),
    doc={
        "origin": ("Where the datasource's recipients come from.", "import"),
        "fields": ("Fields to add, each {name, type, label}; the email field always exists. "
                   "A field that exists keeps its type and takes the label given (shown on "
                   "the sign-up form instead of its name).",
                   [{"name": "city", "type": "text", "label": "Your city"}],
                   {"items": {"type": "object", "required": ["name"],
                              "additionalProperties": False, "properties": {
                                  "name": {"type": "string", "pattern":
                                           "^[^{}\\r\\n\\x00]*[^{}\\s\\x00][^{}\\r\\n\\x00]*$",
                                           "maxLength": 200},
                                  "type": {**_FIELD_TYPE, "default": "text"},
                                  "label": {"type": "string", "maxLength": 200,
                                            "pattern": "^[^\\r\\n\\x00]*$"}}}}),
        "signup": ("1: the datasource takes public sign-ups (needs a fromprofile).", "0"),
        "doubleoptin": ("1: a sign-up stays unconfirmed until the link in its confirmation email "
                        "is followed (the default).", "1"),
        "confirmmessage": ("The message of the confirmation email; it must carry "
                           "{{confirm_url}}. Empty: a built-in plain email.", ""),
        "welcomemessage": ("The message sent once a sign-up is active. Empty: none.", ""),
        "fromprofile": ("The sender profile that confirmation and welcome emails go out as.",
                        1),
        "language": ("The language of the sign-up form, the confirm, unsubscribe and "
                     "preference pages and the built-in confirmation email: "
                     + ", ".join(LANGUAGES) + " (default en).", "en")})


_DATETIME_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M")
_TRUE, _FALSE = {"1", "true", "yes", "y", "t", "on"}, {"0", "false", "no", "n", "f", "off"}


def _convert_value(kind, value):
    """A field value as stored for a field of type ``kind`` (ValueError if it
    cannot be).  Empty stays None, so a blank cell never fails a type."""
    if value is None:
        return None
    if isinstance(value, bool):
        value = "1" if value else "0"
    text = str(value).strip()
    if text == "":
        return None
    if "\x00" in text:   # refused by every text parameter, and by PostgreSQL's jsonb
        raise ValueError("a NUL character is not allowed")
    if kind == "text":
        return str(value)
    if kind == "integer":
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
            return int(value)  # 12.0 from JSON; not 1e300, which SQLite cannot hold
        if re.fullmatch(r"[+-]?\d{1,18}", text):
            return int(text)
        raise ValueError(f"'{text}' is not a whole number")
    if kind == "number":
        try:
            number = float(text.replace(",", ".") if text.count(",") == 1 and "." not in text
                           else text)
        except ValueError:
            raise ValueError(f"'{text}' is not a number") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(f"'{text}' is not a finite number")
        return number
    if kind == "boolean":
        if text.lower() in _TRUE:
            return 1
        if text.lower() in _FALSE:
            return 0
        raise ValueError(f"'{text}' is not a yes/no value (1/0, true/false, yes/no)")
    if kind == "date":
        try:
            return datetime.date.fromisoformat(text).isoformat()
        except ValueError:
            raise ValueError(f"'{text}' is not a date (YYYY-MM-DD)") from None
    if kind == "datetime":
        for pattern in _DATETIME_FORMATS:
            try:
                return datetime.datetime.strptime(text, pattern).strftime("%Y-%m-%d %H:%M:%S")
            except ValueError:
                pass
        raise ValueError(f"'{text}' is not a date and time (YYYY-MM-DD HH:MM:SS)")
    if kind == "email":
        address = _normalize_email(text)
        if address is None:
            raise ValueError(f"'{text}' is not a valid email address")
        return address
    raise ValueError(f"unknown field type {kind}")


def _display_value(value):
    """A stored field value as the API answers it (and merge tags insert it)."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _datasource_fields(conn, datasource):
    """``{lower-case name: (field id, name, type)}`` of one datasource."""
    return {row["name"].lower(): (row["id"], row["name"], row["type"]) for row in conn.execute(
        "SELECT id, name, type FROM field WHERE datasource = ?", (datasource,))}


def _recipient_values(fields, row):
    """``{field name: display string}`` of a recipient row, email included.

    :param fields: the datasource's fields, as datasource_fields() gives them.
    """
    data = json.loads(row["data"])
    values = {name: _display_value(data.get(str(field_id)))
              for field_id, name, _ in fields.values()}
    values["email"] = row["email"]
    return values


# ---------------------------------------------------------------------------
# Recipients, field changes, imports, exports, organize
# ---------------------------------------------------------------------------

#: How many failing rows an import record or a 422 answer lists.
_ROWS_REPORTED = 100
#: How long an export's download link works.
_EXPORT_LIFETIME = datetime.timedelta(days=7)
#: Header names of the email column, compared without case, spaces, '-' or '_'.
_EMAIL_COLUMNS = {"email", "emailaddress"}


# Recipients -----------------------------------------------------------------

def _request_fields(call):
    """The fields of the request's datasource (``call.parent``), read once per request."""
    fields = call.memo.get("fields")
    if fields is None:
        fields = call.memo["fields"] = _datasource_fields(call.conn, call.parent["id"])
    return fields


def _recipient_record(call, row):
    data = json.loads(row["data"])
    values = {}
    for field_id, name, _ in _request_fields(call).values():
        value = data.get(str(field_id))
        values[name] = None if value is None else _display_value(value)
    values["email"] = row["email"]
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "email": row["email"],
            "fields": values, "status": row["status"], "created": row["created"],
            "updated": row["updated"]}


def _blocked_status(conn, secret, account, address):
    """What keeps ``address`` from the account's mail: the suppression reason,
    'unsubscribed' for an erased address, or None.  A new recipient with such
    an address is stored with that status, mailable only after it confirms."""
    row = conn.execute("SELECT reason FROM suppression WHERE account = ? AND email = ?",
                       (account, address)).fetchone()
    if row is not None:
        return row["reason"]
    if conn.execute("SELECT 1 FROM erasure WHERE account = ? AND hash = ?",
                    (account, _erasure_hash(secret, address))).fetchone():
        return "unsubscribed"
    return None


def _typed_fields(call, given, fields=None, datasource=None, param="fields"):
    """A ``fields`` object ``{name: value}`` as ``{field id: stored value}``,
    by the datasource's field names and types; 'email' is a column, not here.

    :param fields, datasource: the datasource's fields (_datasource_fields())
        and id; default the request's (``call.parent``).
    :param param: the parameter that holds them, for the error.
    """
    if fields is None:
        fields, datasource = _request_fields(call), call.parent["id"]
    data = {}
    for name, value in given.items():
        field = fields.get(str(name).lower())
        if field is None or field[1].lower() == "email":
            raise InvalidParameter(f"'{param}' names '{str(name)[:100]}', which is not a field of "
                                   f"datasource {datasource} (the address is 'email').",
                                   field=param, allowed=sorted(
                                       f[1] for f in fields.values() if f[1].lower() != "email"))
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise InvalidParameter(f"{param}['{field[1]}'] must be a string, a number or null.",
                                   field=param)
        try:
            data[str(field[0])] = _convert_value(field[2], value)
        except ValueError as error:
            raise InvalidParameter(f"{param}['{field[1]}']: {error}.", field=param) from None
    return data


def _recipient_write_values(call, row):
    """Create and change of one recipient: the address (unique in the
    datasource), typed field values, and the status rules: a blocked
    address is stored as blocked; nothing makes an unsubscribed, bounced or
    complained recipient active or unconfirmed again but its own confirmation."""
    values = {"updated": _now()}
    address = call.get("email", row["email"] if row else "")
    if not address:
        raise InvalidParameter("'email' must be an email address.", field="email")
    if address != (row["email"] if row else None):
        taken = call.conn.execute("SELECT id FROM recipient WHERE datasource = ? AND email = ?",
                                  (call.parent["id"], address)).fetchone()
        if taken and (row is None or taken["id"] != row["id"]):
            raise Conflict(f"Datasource {call.parent['id']} already has {address} "
                           f"(recipient {taken['id']}).", field="email")
        values["email"] = address
    if "fields" in call.params:
        data = {**(json.loads(row["data"]) if row else {}),
                **_typed_fields(call, call.params["fields"])}
        values["data"] = _to_json({key: value for key, value in data.items() if value is not None})
    status = call.get("status", row["status"] if row else "active")
    if row is not None and row["status"] in _SUPPRESSIONS and status in ("active", "unconfirmed"):
        raise Conflict(f"Recipient {row['id']} is {row['status']}: only the person can come back, "
                       "by confirming a new sign-up.", field="status")
    if status != "unsubscribed":  # that one goes through suppress(), after the change
        blocked = None
        if "email" in values and status in ("active", "unconfirmed"):
            blocked = _blocked_status(call.conn, call.service.secret, call.account, address)
        values["status"] = blocked or status
        # Made active by the API: confirmed (_recipient_changed raises it).
        call.memo["confirmed"] = row is not None and row["status"] == "unconfirmed" \
            and values["status"] == "active"
    return values


def _erased_marker(call, datasource):
    """For an import into ``datasource``: None when the account has erased no
    address (the usual case: the import pays nothing), else a function that
    stores the new recipients whose address was erased as 'unsubscribed'."""
    if not call.conn.execute("SELECT 1 FROM erasure WHERE account = ? LIMIT 1",
                             (call.account,)).fetchone():
        return None
    secret, account = call.service.secret, call.account

    def mark(conn, addresses):
        conn.executemany(
            "UPDATE recipient SET status = 'unsubscribed' WHERE datasource = ? AND email = ? "
            "AND EXISTS (SELECT 1 FROM erasure WHERE account = ? AND hash = ?)",
            [(datasource, address, account, _erasure_hash(secret, address))
             for address in addresses])

    return mark


def _recipient_event(call, recipient_id):
    row = RECIPIENT.find(call.conn, call.parent["id"], recipient_id)
    emit(call.conn, call.account, "recipient.subscribed",
         {"id": str(row["id"]), "datasource": str(row["datasource"]), "email": row["email"],
          "status": row["status"]}, call.events)


def _recipient_changed(call, recipient_id):
    if call.get("status") == "unsubscribed":
        row = RECIPIENT.find(call.conn, call.parent["id"], recipient_id)
        suppress(call.conn, call.account, row["email"], "unsubscribed",
                 pending=call.events)
    elif call.memo.get("confirmed"):
        row = RECIPIENT.find(call.conn, call.parent["id"], recipient_id)
        emit(call.conn, call.account, "recipient.confirmed",
             {"id": str(row["id"]), "datasource": str(row["datasource"]), "email": row["email"]},
             call.events)


def _erase_recipient(call, row):
    """Before the row goes: keep the address only as its hash (so an import or
    a sign-up of it is never mailed without a new confirmation), and take the
    clear address out of what the account keeps besides: its suppression row,
    its statistics events and its emails in the outbox (the queued ones are
    not sent).  The account's other lists keep their rows of the address, each
    erased by its own delete, but they stop receiving mail now."""
    account, address = call.account, row["email"]
    digest = _erasure_hash(call.service.secret, address)
    now = _now()
    call.conn.execute("INSERT INTO erasure (account, hash, created) VALUES (?, ?, ?) "
                      "ON CONFLICT DO NOTHING", (account, digest, now))
    call.conn.execute("DELETE FROM suppression WHERE account = ? AND email = ?", (account, address))
    call.conn.execute("UPDATE event SET email = NULL WHERE account = ? AND email = ?",
                      (account, address))
    call.conn.execute(
        "UPDATE outbox SET to_addr = ?, status = CASE WHEN status IN ('queued', 'waiting') "
        "THEN 'skipped' "
        "ELSE status END WHERE account = ? AND to_addr = ?",
        (f"erased-{digest[:24]}@erased.invalid", account, address))
    # Not suppress(): it would write the address down again, in clear.
    call.conn.execute(
        "UPDATE recipient SET status = 'unsubscribed', updated = ? WHERE email = ? AND id != ? "
        "AND status IN ('active', 'unconfirmed') "
        "AND datasource IN (SELECT id FROM datasource WHERE owner = ?)",
        (now, address, row["id"], account))


#: One recipient: created, changed and erased by the application (the
#: public sign-up is in the banner "Public pages").
RECIPIENT = Resource("recipient", "recipient", _recipient_record,
                     parent=DATASOURCE, parent_key="datasource",
                     columns="email:email", required="email",
                     extra={"create": "fields:object status:active|unconfirmed",
                            "change": "fields:object status:active|unconfirmed|unsubscribed"},
                     values=_recipient_write_values, after_create=_recipient_event,
                     after_change=_recipient_changed, on_delete=_erase_recipient,
                     filters={"status:" + "|".join(RECIPIENT_STATUSES): "status = ?",
                              "email:str": "email = ?"},
                     fields=_record_schema(
                         "id datasource email fields status created updated",
                         fields={"type": "object", "additionalProperties": _STRING_OR_NULL,
                                 "description": "field name -> value (as text)"},
                         status={"type": "string", "enum": list(RECIPIENT_STATUSES)}),
                     doc={
                         "fields": ("The recipient's values by field name (fields the "
                                    "datasource has), each typed by its field's type.",
                                    {"city": "Oslo"}),
                         "status": ("A recipient's status. On a listing: only recipients with "
                                    "it. On create: active or unconfirmed. On change: "
                                    "unsubscribed (never back to active once unsubscribed, "
                                    "bounced or complained).", "active"),
                         "email": ("An address. On a listing: only the recipient with it "
                                   "(without case). On create and change: the recipient's "
                                   "address.", "ann@example.com", {"not": {"pattern": "^\\s*$"}})})


# Field changes --------------------------------------------------------------

def _field_record(call, row):
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "name": row["name"],
            "type": row["type"], "label": row["label"]}


#: A datasource's field, named in paths by its id or its name (without case).
FIELD = Resource("field", "field", _field_record, parent=DATASOURCE, parent_key="datasource",
                 by_name=True,
                 fields=_record_schema("id name type label", id={"type": "string"},
                                       name={"type": "string"}, type=_FIELD_TYPE))


def _field_modify(call, child_id):
    """Rename a field and/or change its type (the spec's GET modify)."""
    datasource = call.parent["id"]
    field = FIELD.find(call.conn, datasource, child_id)
    name, kind = call.params["new"].strip(), call.params["type"]
    if field["name"].lower() == "email" and (name.lower() != "email" or kind != "email"):
        raise Conflict("The email field cannot be renamed or retyped.", field="new")
    if not _valid_field_name(name):
        raise InvalidParameter("'new' must be a non-empty single-line name without braces, "
                               "at most 200 characters.", field="new")
    taken = call.conn.execute("SELECT 1 FROM field WHERE datasource = ? AND name = ? AND id != ?",
                              (datasource, name, field["id"])).fetchone()
    if taken:
        raise Conflict(f"Datasource {datasource} already has a field named '{name}'.", field="new")
    if kind != field["type"]:
        _retype(call.conn, datasource, field, kind)
    _update_record(call.conn, "field", field["id"], {"name": name, "type": kind})
    return {"field": _field_record(call, FIELD.find(call.conn, datasource, str(field["id"])))}


def _retype(conn, datasource, field, kind):
    """Convert every stored value of ``field`` to ``kind``, chunk by chunk.

    On the first failure writing stops; the scan goes on to name up to
    _ROWS_REPORTED failing rows, then InvalidData rolls the request back, so
    the data stays as it was.
    """
    spell = {"json": "data", "key": int(field["id"])}
    failures, last_id = [], 0
    while len(failures) < _ROWS_REPORTED:
        rows = conn.execute(
            f"SELECT id, email, {conn.sql['json_item'].format(**spell)} AS value FROM recipient "
            f"WHERE datasource = ? AND id > ? AND {conn.sql['json_value'].format(**spell)} "
            "IS NOT NULL ORDER BY id LIMIT ?", (datasource, last_id, _CHUNK_ROWS)).fetchall()
        if not rows:
            break
        last_id = rows[-1]["id"]
        updates = []
        for row in rows:
            try:
                updates.append((_to_json(_convert_value(kind, _display_value(row["value"]))),
                                row["id"]))
            except ValueError as error:
                failures.append({"recipient": str(row["id"]), "email": row["email"],
                                 "value": _display_value(row["value"]), "error": str(error)})
                if len(failures) >= _ROWS_REPORTED:
                    break
        if not failures:
            conn.executemany(f"UPDATE recipient SET data = "
                             f"{conn.sql['json_set'].format(**spell, value='?')} WHERE id = ?",
                             updates)
    if failures:
        raise InvalidData(f"The field '{field['name']}' cannot become {kind}: some stored values "
                          "do not convert (the first are listed); nothing was changed.",
                          rows=failures)


# Imports --------------------------------------------------------------------

def _import_record(call, row):
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "name": row["name"],
            "originalfile": row["originalfile"], "uploadtype": row["uploadtype"],
            "status": row["status"], "rows": str(row["rows"]), "inserted": str(row["inserted"]),
            "updated": str(row["updated"]), "skipped": str(row["skipped"]),
            "errors": json.loads(row["errors"]), "created": row["created"],
            "finished": row["finished"]}


class _Importer:
    """Typed rows in, recipients out: checks each row, keeps the chunk being
    built, writes it in one statement per chunk and keeps the figures."""

    def __init__(self, conn, datasource, import_id):
        self.conn, self.datasource, self.import_id = conn, datasource, import_id
        self.fields = _datasource_fields(conn, datasource)
        self.names = {}                   # field key -> name, for messages
        self.pending = {}                 # folded address -> (address, keys, values)
        self.rows = self.inserted = self.updated = self.skipped = 0
        self.errors = []
        # For an account with erased addresses: marks the new recipients that
        # are erased ones (see _erased_marker); None keeps imports as fast.
        self.erased = None
        # Rows written since the last commit; None: one transaction, the
        # caller's (else commit() is called before a chunk would take the
        # transaction past _COMMIT_ROWS rows).
        self.since, self.commit = None, None
        self.committed = False   # whether a commit kept some of the rows
        self.counted = (0, 0)    # rows and skipped up to the last chunk written
        # New fields: placeholder key -> name until a stored row has them,
        # then placeholder -> field id; and the last keys translated (a CSV
        # passes one tuple for every row, a JSON upload one per shape).
        self.unmade, self.made, self.last_keys = {}, {}, (None, None)
        # Existing recipients this import already updated: a repeated row
        # in a later chunk must not count again.
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS import_touched (id INTEGER PRIMARY KEY)")
        conn.execute(f"DELETE FROM {conn.sql['temp']}.import_touched")
        # How the chunks reach recipient: the engine's way (_SqliteImportWrites).
        self.writes = conn.import_writes(self)

    @classmethod
    def reading(cls, names, errors):
        """An importer that checks rows without a database, in a reading
        child (_child_rows): its flush() is set to send the chunks."""
        importer = cls.__new__(cls)
        importer.names, importer.errors, importer.pending = names, errors, {}
        importer.rows = importer.skipped = 0
        importer.unmade, importer.made, importer.last_keys = {}, {}, (None, None)
        return importer

    def report(self, number, error):
        if len(self.errors) < _ROWS_REPORTED:
            self.errors.append({"row": str(number), "error": error})

    def skip(self, number, error):
        self.skipped += 1
        self.report(number, error)

    def column(self, name):
        """A column of the upload as ``(field key, type)``; an unknown name
        becomes a new text field.  None for a column to leave out."""
        label = name.strip() if isinstance(name, str) else ""
        if not label:
            return None
        field = self.fields.get(label.lower())
        if field is None:
            if not _valid_field_name(label):
                self.report(1, f"column '{label[:50]}' left out: a field name is one line "
                               "without braces, at most 200 characters")
                return None
            # Made when the first row that has it is stored (add()): a column
            # of skipped rows alone (a typo'd key) leaves no field behind.
            field = self.fields[label.lower()] = (f"new:{label.lower()}", label, "text")
            self.unmade[field[0]] = label
        self.names[str(field[0])] = field[1]
        return str(field[0]), field[2]

    def _made(self, keys):
        """``keys`` with the new fields among them made now, as field ids."""
        for key in keys:
            label = self.unmade.pop(key, None)
            if label is not None:
                field_id = self.conn.execute(
                    "INSERT INTO field (datasource, name, type) VALUES (?, ?, 'text')",
                    (self.datasource, label)).lastrowid
                self.fields[label.lower()] = (field_id, label, "text")
                self.names[str(field_id)] = label
                self.made[key] = str(field_id)
        return tuple([self.made.get(key, key) for key in keys])

    def stored_keys(self, keys):
        """``keys`` as a stored row has them: new fields among them are made now."""
        if self.made or self.unmade:
            if keys is not self.last_keys[0]:
                self.last_keys = (keys, self._made(keys))
            return self.last_keys[1]
        return keys

    def convert(self, number, keys, kinds, raws):
        """The raw values typed for their fields, or None (the row is skipped)."""
        try:
            return tuple([_convert_value(kind, raw) for kind, raw in zip(kinds, raws)])
        except ValueError:
            pass
        for key, kind, raw in zip(keys, kinds, raws):  # only for the message
            try:
                _convert_value(kind, raw)
            except ValueError as error:
                self.skip(number, f"{self.names.get(key, key)}: {error}")
                return None

    def add(self, number, email, keys, values):
        """One row: its email cell and the values of the fields ``keys``
        (text may still be blank: flush() stores that as no value)."""
        self.rows += 1
        address = _normalize_email(email)
        if address is None:
            text = email.strip() if isinstance(email, str) else ""
            return self.skip(number, f"'{text[:100]}' is not a valid email address" if text
                             else "no email address")
        keys = self.stored_keys(keys)
        folded = _nocase(address)
        row, earlier = (address, keys, values), self.pending.get(folded)
        if earlier is not None:   # a repeat in the chunk: merged, its own spelling kept
            row = (address, *_merged(earlier, row)[1:])
        self.pending[folded] = row
        if len(self.pending) >= _CHUNK_ROWS:
            self.flush()

    def flush(self):
        """Write the chunk: new addresses inserted, known ones updated (their
        values merged in, never their status), each counted once."""
        pending, self.pending = self.pending, {}
        if pending:
            self.turn(len(pending))
            self.counted = (self.rows, self.skipped)
            self.writes.flush(pending)

    def turn(self, rows):
        """Before writing ``rows`` rows: when they would take the transaction
        past _COMMIT_ROWS, or a writer of this process waits for its turn,
        commit what is written first (commit())."""
        if self.since is None:
            return
        if self.since and (self.since + rows > _COMMIT_ROWS or self.conn.writers_waiting()):
            self._commit()
        self.since += rows

    def give_way(self):
        """While the import waits for its next rows (the reading child):
        a writer of this process waiting for its turn has it now, with the
        rows written so far committed, instead of after a whole chunk of
        _COMMIT_ROWS (the import held the lock while it waited)."""
        if self.since and self.conn.writers_waiting():
            self._commit()

    def _commit(self):
        self.writes.finish()   # the figures final for what is written
        self.committed = True     # (at worst nothing was: then no record is failed)
        self.commit(self)
        self.since = 0

    @property
    def hears_added(self):
        """Whether added() wants the new addresses (building the list costs)."""
        return self.erased is not None

    def added(self, addresses):
        """The addresses this import has just inserted (new recipients), in
        the transaction of their chunk: the one place where an import reacts
        to new recipients (an erased address is stored unsubscribed)."""
        if self.erased is not None:
            self.erased(self.conn, addresses)

    def finish(self):
        """The last flush: after it every row is written and the figures are
        final (on PostgreSQL a streamed COPY ends here)."""
        self.flush()
        self.writes.finish()

def _picker(indexes):
    """A function of a row (list of cells) giving the cells at ``indexes`` as a tuple."""
    if len(indexes) == 1:
        index = indexes[0]
        return lambda cells: (cells[index],)
    return operator.itemgetter(*indexes) if indexes else (lambda cells: ())


def _is_email_column(name):
    return isinstance(name, str) and re.sub(r"[\s_-]", "", name).lower() in _EMAIL_COLUMNS


def _upload_bytes(upload_type, data):
    """The CSV file of a csv or base64 upload, as bytes."""
    if not isinstance(data, str):
        raise InvalidParameter(f"'__uploaddata__' must be a string for {upload_type} uploads.",
                               field="__uploaddata__")
    if upload_type == "csv":
        return data.encode("utf-8", "replace")
    if data.startswith("data:") and "," in data[:200]:  # a data: URL
        data = data[data.index(",") + 1:]
    try:
        return _b64_pieces(data)
    except (binascii.Error, ValueError):
        pass
    # Line-wrapped (MIME), URL-safe or unpadded base64; only now worth a copy.
    data = "".join(data.split()).translate(str.maketrans("-_", "+/"))
    try:
        return _b64_pieces(data + "=" * (-len(data) % 4))
    except (binascii.Error, ValueError):
        raise InvalidData("'__uploaddata__' is not valid base64; nothing was imported.",
                          field="__uploaddata__") from None


def _text_encoding(raw):
    """UTF-8 (BOM or not) when the bytes are valid UTF-8, UTF-16 with its BOM,
    else Latin-1.  Checked in pieces, keeping none of the decoded text."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    if raw.isascii():
        return "utf-8-sig"
    decoder, view, step = codecs.getincrementaldecoder("utf-8")(), memoryview(raw), 1 << 20
    try:
        for start in range(0, len(raw), step):
            decoder.decode(view[start:start + step])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "latin-1"
    return "utf-8-sig"


def _sniff_delimiter(line):
    """The most frequent of , ; tab outside quotes in the header line."""
    counts, quoted = {",": 0, ";": 0, "\t": 0}, False
    for char in line:
        if char == '"':
            quoted = not quoted
        elif not quoted and char in counts:
            counts[char] += 1
    best = max(counts, key=counts.get)
    return best if counts[best] else ","


#: Bytes of a quote-free CSV file decoded and split at a time (ends on a line end).
_BLOCK_BYTES = 1 << 18


def _csv_delimiter(first, next_line):
    """The delimiter and the header line: Excel's "sep=;" line if ``first`` is
    one (the header is the line after), else the most frequent in ``first``."""
    if first.strip().lower().startswith("sep=") and len(first.strip()) == 5:
        return first.strip()[4], next_line()
    return _sniff_delimiter(first), first


def _csv_records(raw):
    """The header of a CSV file (a list of cells, or None) and the records
    after it in batches of at most _CHUNK_ROWS, each a list of cells or, for
    an unreadable record, its csv.Error.  Decoded lazily, a block at a time:
    the decoded text of a large upload is never whole in memory."""
    encoding = _text_encoding(raw)
    if b'"' in raw or b"\x00" in raw or encoding == "utf-16":
        stream = io.TextIOWrapper(io.BytesIO(raw), encoding=encoding, newline="")
        line = stream.readline()
        delimiter, first = _csv_delimiter(line, stream.readline)
        records = _quoted_records(itertools.chain([first], stream), delimiter,
                                  1 if first is line else 2)
        return next(records, None), _batches(records)
    lines = itertools.chain.from_iterable(_unquoted_lines(raw, encoding))
    delimiter, first = _csv_delimiter(next(lines, ""), lambda: next(lines, ""))
    return first.split(delimiter), _split_batches(lines, delimiter)


def _batches(records):
    """``records`` in lists of at most _CHUNK_ROWS."""
    while batch := list(itertools.islice(records, _CHUNK_ROWS)):
        yield batch


#: Read after the last line of a CSV file with quotes: found inside a field,
#: it says that a quote opened there never closed.  (Unicode noncharacters,
#: which no text exchanged is to hold.)
_CSV_END = "\ufdd0\ufdd1end of the upload\ufdd2"


def _quoted_records(lines, delimiter, number=1):
    """csv.reader's records of the CSV ``lines`` (the header first, on line
    ``number``), each a list of cells or, for one that cannot be read, its
    csv.Error.

    A quoted field may hold line ends, but a record over several lines is
    kept only where its quotes close and it has the header's width, and no
    line inside it reads as a row by itself (the header's width and an
    address in the email column): an unclosed quote reads the rest of the
    file into one field, a stray one the rows up to the next quote.  Such a
    record is an error naming its lines, its first line is left out, and
    the lines after it are read again as rows of their own."""
    source, again, taken = itertools.chain(lines, [_CSV_END]), [], []   # again: next one last

    def feed():   # made anew for lines to read again: one that ended stays so
        while True:
            line = again.pop() if again else next(source, None)
            if line is None:
                return
            taken.append(line)
            yield line

    reader, width, email_at = csv.reader(feed(), delimiter=delimiter), None, None
    while True:
        taken.clear()
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:   # the reader goes on with the next record
            number += len(taken)
            yield error
            continue
        if cells == [_CSV_END]:
            return
        if width is None:
            cells[-1] = cells[-1].replace(_CSV_END, "")
            width = len(cells)
            email_at = next((i for i, name in enumerate(cells) if _is_email_column(name)), 0)
        elif len(taken) > 1:
            problem = _spanning_problem(cells, taken, delimiter, width, email_at, number)
            if problem:
                ends = number + len(taken) - 1 - (taken[-1] is _CSV_END)
                lines_read = f"lines {number}-{ends}" if ends > number else f"line {number}"
                yield csv.Error(f"{lines_read}: {problem}; line {number} is left out, and the "
                                f"lines after it are read as rows")
                again.extend(reversed(taken[1:]))
                reader = csv.reader(feed(), delimiter=delimiter)
                number += 1
                continue
        number += len(taken)
        yield cells


def _spanning_problem(cells, taken, delimiter, width, email_at, number):
    """What is wrong with the record ``cells`` read from the lines ``taken``
    (several, from line ``number``), or None (see _quoted_records)."""
    if _CSV_END in cells[-1]:
        return f"the quote opened on line {number} is never closed"
    if len(cells) != width:
        return (f"a quoted field over them ends in a row of {len(cells)} columns, not the "
                f"header's {width}")
    for at, line in enumerate(taken[1:], start=number + 1):
        row = next(csv.reader([line], delimiter=delimiter), [])
        if len(row) == width and _normalize_email(row[email_at]):
            return f"a quoted field over them holds line {at}, which reads as a row"
    return None


def _reader_batches(reader):
    batch = []
    while True:
        try:
            for cells in reader:
                batch.append(cells)
                if len(batch) >= _CHUNK_ROWS:
                    yield batch
                    batch = []
            break
        except csv.Error as error:  # the reader goes on with the next record
            batch.append(error)
    if batch:
        yield batch


def _unquoted_lines(raw, encoding):
    """The lines of CSV text without a quote, in lists a block at a time.
    Without quotes a record is a line, and lines end as the csv module (on
    a text stream with newline="") has them: at CR LF, CR or LF."""
    start = 0
    while start < len(raw):
        end = raw.find(b"\n", start + _BLOCK_BYTES) + 1 or len(raw)
        text = raw[start:end].decode(encoding if start == 0 or encoding != "utf-8-sig"
                                     else "utf-8")
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        if not lines[-1]:
            lines.pop()  # what follows the last line end
        yield lines
        start = end


def _split_batches(lines, delimiter):
    """Batches of the records of quote-free ``lines``: each line split at the
    delimiter, as csv.reader would, unless a line is longer than its field
    limit; then csv.reader says which record it refuses, and why."""
    limit = csv.field_size_limit()
    while batch := list(itertools.islice(lines, _CHUNK_ROWS)):
        if max(map(len, batch)) > limit:
            yield next(_reader_batches(csv.reader(batch, delimiter=delimiter)))
        else:
            yield list(map(str.split, batch, itertools.repeat(delimiter)))


class _CsvLayout:
    """What the header of a CSV upload says: where the email column is, the
    field of each other column (text cells go to SQL as they are, typed ones
    are converted), and the width that short rows are padded to."""

    def __init__(self, importer, header, nul, columns=None):
        """``columns``: what importer.column() gave for each named column
        (a reading child's importer has no database to ask)."""
        if not header or not any(cell.strip() for cell in header):
            raise InvalidData("The upload has no header row; nothing was imported.",
                              field="__uploaddata__")
        self.email_at = next((i for i, name in enumerate(header) if _is_email_column(name)),
                             None)
        if self.email_at is None:
            raise InvalidData("The upload has no email column (named email, e-mail or "
                              "emailaddress); nothing was imported.", field="__uploaddata__")
        if columns is None:
            columns = [(i, importer.column(name)) for i, name in enumerate(header)
                       if i != self.email_at]
        self.header, self.columns = header, columns
        columns = [(i, column) for i, column in columns if column]
        text = [(i, key) for i, (key, kind) in columns if kind == "text"]
        typed = [(i, key, kind) for i, (key, kind) in columns if kind != "text"]
        self.text_cells = _picker([i for i, _ in text])
        self.typed_cells = _picker([i for i, _, _ in typed])
        self.typed = [(i, kind) for i, _, kind in typed]
        self.typed_keys, self.kinds = tuple(key for _, key, _ in typed), [k for _, _, k in typed]
        self.keys = tuple(key for _, key in text) + self.typed_keys
        self.width = len(header)
        self.nul = nul   # rare (and in every UTF-16 file): only then look at each row


def _csv_row(importer, layout, number, cells):
    """One record of a CSV upload, row ``number``, into the importer."""
    if cells.__class__ is csv.Error:
        importer.rows += 1
        return importer.skip(number, f"unreadable row: {cells}")
    if not any(cells):
        return  # a blank line
    if len(cells) < layout.width:
        cells += [""] * (layout.width - len(cells))
    values = layout.text_cells(cells)
    if layout.nul and any("\x00" in cell for cell in values):
        importer.rows += 1
        return importer.skip(number, "a NUL character is not allowed")
    if layout.typed:
        converted = importer.convert(number, layout.typed_keys, layout.kinds,
                                     layout.typed_cells(cells))
        if converted is None:
            importer.rows += 1
            return
        values += converted
    importer.add(number, cells[layout.email_at], layout.keys, values)


def _csv_batch(importer, layout, number, records):
    """The records after row ``number`` into the importer, as _csv_row() would
    take them one by one (the same rows, figures, messages and row numbers),
    but a column at a time where it can: the addresses checked by one regex
    (those already normal are stored as they are), the typed columns
    converted whole.  The other rows (blank, unreadable, short, an address to
    normalize or refuse) go through _csv_row() in their place.  Gives the
    number of the last row."""
    if layout.nul or any(map(_IS_CSV_ERROR, records)) or min(map(len, records)) < layout.width:
        for cells in records:
            number += 1
            _csv_row(importer, layout, number, cells)
        return number
    values = list(map(layout.text_cells, records))
    if layout.typed:
        try:
            columns = [list(map(_convert_value, itertools.repeat(kind),
                                map(operator.itemgetter(i), records)))
                       for i, kind in layout.typed]
        except ValueError:  # _csv_row() names the row and the field
            for cells in records:
                number += 1
                _csv_row(importer, layout, number, cells)
            return number
        values = list(map(operator.add, values, zip(*columns)))
    emails = list(map(operator.itemgetter(layout.email_at), records))
    folded = list(map(str.lower if all(map(str.isascii, emails)) else _nocase, emails))
    others = itertools.compress(itertools.count(),
                                map(operator.not_, map(_EMAIL_NORMAL_RE.fullmatch, emails)))
    start = 0
    for at in itertools.chain(others, [len(records)]):
        if at > start:  # rows start .. at-1 are whole, with normal addresses
            keys = importer.stored_keys(layout.keys)
            importer.rows += at - start
            importer.pending.update(zip(folded[start:at], zip(
                emails[start:at], itertools.repeat(keys), values[start:at])))
        if at < len(records):
            _csv_row(importer, layout, number + 1 + at, records[at])
        start = at + 1
    if len(importer.pending) >= _CHUNK_ROWS:
        importer.flush()
    return number + len(records)


_IS_CSV_ERROR = csv.Error.__instancecheck__


def _import_csv(importer, upload):
    """Read a CSV file lazily, a batch of records at a time, into the importer.
    ``upload``: its bytes, or the _BodyChild that holds them and has read
    their header (_child_csv): then the child reads it (_ChildReader)."""
    if isinstance(upload, _BodyChild):
        header, nul = upload.csv
        return _ChildReader(importer, _CsvLayout(importer, header, nul)).run(upload)
    header, batches = _csv_records(upload)
    layout = _CsvLayout(importer, header, nul=b"\x00" in upload)
    number = 1
    for records in batches:
        number = _csv_batch(importer, layout, number, records)


def _refuse_binary(raw):
    """Refuse an upload that is no text: a ZIP file (a spreadsheet), or NUL
    bytes throughout.  A stray NUL in one cell is that row's problem (skipped)."""
    sample = raw[:4096]
    if not raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) and (
            raw.startswith(b"PK\x03\x04") or sample.count(b"\x00") > max(1, len(sample) // 100)):
        kind = " (a ZIP file, such as an Excel .xlsx: save it as CSV)" \
            if raw.startswith(b"PK\x03\x04") else ""
        raise InvalidData(f"The upload is not CSV text{kind}; nothing was imported.",
                          field="__uploaddata__")


def _child_csv(state, upload_type):
    """In a _BodyChild: the upload as CSV bytes, checked as _import_create()
    checks them; yields its header and whether it holds a NUL byte, and
    keeps its batches of records for _child_rows()."""
    raw = _upload_bytes(upload_type, state.pop("__uploaddata__"))
    _refuse_binary(raw)
    header, state["batches"] = _csv_records(raw)
    yield header, b"\x00" in raw


def _child_upload(state):
    """In a _BodyChild: the upload as it is (a json upload)."""
    yield state.pop("__uploaddata__")


class _ChildReader:
    """A large CSV upload, read by two processes at once: the request's
    _BodyChild, which parsed the body, parses and checks the records and
    packs each chunk (the Python half of an import, which the GIL would keep
    from overlapping with anything in this process), while this one writes
    the chunk before it (the database's half), in the request's transaction.

    The child never touches the database: its importer sends each chunk
    down the pipe, packed by the engine's writes (``pack``: on SQLite the
    chunk's JSON), instead of writing it.  The new fields of the columns are
    made before the child reads, so that it names them by id (renaming them
    in each chunk cost the writer a second per million rows), and removed
    again if no row was stored, as add() would not have made them.  Last the
    child sends the figures and the row errors, or the exception that stopped
    it, raised here as if read here.
    """

    def __init__(self, importer, layout):
        self.importer, self.layout = importer, layout

    def run(self, child):
        importer, layout = self.importer, self.layout
        made = [label for key, label in importer.unmade.items() if key in layout.keys]
        layout.keys = importer.stored_keys(layout.keys)
        self.stored = False
        spec = (layout.header, layout.nul, layout.columns, layout.keys, importer.names,
                importer.errors, type(importer.writes).pack)
        for message in child.call(_child_rows, spec, idle=importer.give_way):
            self._receive(*message)
        if made and not self.stored:
            importer.conn.executemany("DELETE FROM field WHERE datasource = ? AND name = ?",
                                      [(importer.datasource, label) for label in made])

    def _receive(self, kind, *data):
        """One message of the child."""
        importer = self.importer
        if kind == "chunk":
            chunk, rows, *figures = data
            importer.turn(rows)   # a commit counts the rows before this chunk
            importer.rows, importer.skipped, importer.errors = figures
            importer.counted = (importer.rows, importer.skipped)
            self.stored = True
            importer.writes.unpack(chunk, self.layout.keys)
        else:   # "done"
            importer.rows, importer.skipped, importer.errors = data


def _child_rows(state, spec):
    """In a _BodyChild: the records of the upload (_child_csv) checked by an
    importer of the same columns, yielding each chunk packed (``pack``) with
    the figures so far, then the last figures (see _ChildReader)."""
    header, nul, columns, keys, names, errors, pack = spec
    importer = _Importer.reading(names, errors)
    layout = _CsvLayout(importer, header, nul, columns)
    layout.keys, chunks, sent = keys, [], [0, 0, 0]   # sent: rows, skipped, errors

    def send():
        """The chunk in statements of _WRITE_ROWS rows; the figures of the
        chunk's read rows (and its errors) go with its last one, those
        before it count the rows written so far (a commit between two of
        them stores figures that agree with the rows stored)."""
        pending, importer.pending = importer.pending, {}
        items = list(pending.items())
        for start in range(0, len(items), _WRITE_ROWS):
            piece = dict(items[start:start + _WRITE_ROWS])
            figures = (importer.rows, importer.skipped, importer.errors) \
                if start + _WRITE_ROWS >= len(items) else \
                (sent[0] + start + len(piece), sent[1], importer.errors[:sent[2]])
            chunks.append(("chunk", pack(piece), len(piece), *figures))
        sent[:] = importer.rows, importer.skipped, len(importer.errors)

    importer.flush = send
    number = 1
    for records in state.pop("batches"):
        number = _csv_batch(importer, layout, number, records)
        yield from chunks
        chunks.clear()
    send()
    yield from chunks
    yield "done", importer.rows, importer.skipped, importer.errors


def _import_json(importer, data):
    """Rows of a json upload: an array of objects, keys naming the fields."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError):
            raise InvalidData("'__uploaddata__' is not a JSON array; nothing was imported.",
                              field="__uploaddata__") from None
    if not isinstance(data, list):
        raise InvalidData("A json upload is an array of objects; nothing was imported.",
                          field="__uploaddata__")
    columns, shapes = {}, {}
    for number, item in enumerate(data, 1):
        if not isinstance(item, dict):
            importer.rows += 1
            importer.skip(number, "not an object")
            continue
        email, keys, kinds, raws = None, [], [], []
        for name, value in item.items():
            if _is_email_column(name):
                email = value if email is None else email
                continue
            if name not in columns:
                columns[name] = importer.column(name)
            if columns[name] is None:
                continue
            if isinstance(value, (dict, list)):
                importer.rows += 1
                importer.skip(number, f"the value of '{name}' is not a single value")
                break
            keys.append(columns[name][0])
            kinds.append(columns[name][1])
            raws.append(value)
        else:
            keys = shapes.setdefault(tuple(keys), tuple(keys))
            values = importer.convert(number, keys, kinds, raws)
            if values is None:
                importer.rows += 1
            else:
                importer.add(number, email, keys, values)


@_short_turns()
def _import_create(call, child_id):
    """Import a CSV file or an array of objects into the datasource in chunks,
    each committed with the figures so far (status 'running'); the last one
    finishes the record and mails the figures to the account.  Until the
    first commit nothing is written; an error after it leaves the import
    'failed' with what it stored (importing again completes it)."""
    call.base_url  # noqa: B018  (the email links the record: a refused host reads nothing)
    upload_type = call.params["__uploadtype__"]
    # Popped, so that once read it is garbage: the upload is the big thing.
    data = call.params.pop("__uploaddata__")
    if isinstance(data, _BodyChild):   # a big body: the child that parsed it reads it
        raw, data = data, None
        if upload_type == "json":
            data = raw.ask(_child_upload)
            raw = None
        else:
            try:
                raw.csv = raw.ask(_child_csv, upload_type)
            except UnicodeDecodeError:
                raise InvalidData("The upload is not readable text (UTF-8, UTF-16 or "
                                  "Latin-1); nothing was imported.",
                                  field="__uploaddata__") from None
    elif upload_type == "json":
        raw = None
    else:
        raw, data = _upload_bytes(upload_type, data), None
        _refuse_binary(raw)
    conn, importer, import_id = call.conn, None, None
    try:
        with conn.writing_long(), transaction(conn):
            # Again in the transaction: the route is no one transaction, so
            # the pipeline's look-up did not refuse a deleted datasource.
            datasource = DATASOURCE.find(conn, call.account, call.parent["id"], live=True)
            import_id = _insert_record(conn, "import", child_id, {
                "datasource": datasource["id"], "name": call.params["name"],
                "originalfile": call.params["originalfile"], "uploadtype": upload_type,
                "status": "running", "created": _now()})
            conn.claim_import(import_id)   # released below; a dead process's: failed at start
            importer = _Importer(conn, datasource["id"], import_id)
            importer.erased = _erased_marker(call, datasource["id"])
            importer.since, importer.commit = 0, _commit_import
            try:
                if raw is None:
                    _import_json(importer, data)
                else:
                    _import_csv(importer, raw)
            except UnicodeDecodeError:
                raise InvalidData("The upload is not readable text (UTF-8, UTF-16 or Latin-1); "
                                  "nothing was imported.", field="__uploaddata__") from None
            importer.finish()
            _update_record(conn, "import", import_id, {
                "status": "finished", "rows": importer.rows, "inserted": importer.inserted,
                "updated": importer.updated, "skipped": importer.skipped,
                "errors": _to_json(importer.errors), "finished": _now()})
            conn.execute(f"DELETE FROM {conn.sql['temp']}.import_touched")
            row = conn.execute("SELECT * FROM import WHERE id = ?", (import_id,)).fetchone()
            emit(conn, call.account, "import.finished", _import_record(call, row), call.events)
            _notify_import(call, datasource, row)
    except BaseException:
        if importer is not None and importer.committed:   # what it stored stays
            try:
                with transaction(conn):
                    _fail_imports(conn, [import_id])
            except Exception:   # (a lost connection) the next start marks it
                _log.exception("import %s stopped and could not be marked failed", import_id)
        raise
    finally:
        if import_id is not None:
            try:
                conn.release_import(import_id)
            except Exception:   # a lost PostgreSQL session let its lock go already
                _log.exception("import %s: its running mark could not be taken off", import_id)
    return {"id": str(import_id)}


def _commit_import(importer):
    """Commit an import's chunks so far with their figures (status still
    'running'), and go on in a new transaction (_next_chunk)."""
    rows, skipped = importer.counted
    _update_record(importer.conn, "import", importer.import_id, {
        "rows": rows, "inserted": importer.inserted, "updated": importer.updated,
        "skipped": skipped, "errors": _to_json(importer.errors)})
    _next_chunk(importer.conn)


def _fail_imports(conn, import_ids):
    """Mark running imports 'failed', keeping the rows and figures they committed."""
    conn.executemany("UPDATE import SET status = 'failed', finished = ? "
                     "WHERE id = ? AND status = 'running'",
                     [(_now(), import_id) for import_id in import_ids])


def _fail_interrupted_imports(conn):
    """At start: the imports still 'running' that no process runs any more
    (it died halfway) become 'failed'; their stored rows stay."""
    gone = [row[0] for row in conn.execute("SELECT id FROM import WHERE status = 'running'")
            if conn.import_orphaned(row[0])]
    if gone:
        with transaction(conn):
            _fail_imports(conn, gone)


def _notify_import(call, datasource, row):
    title = row["name"] or row["originalfile"] or f"import {row['id']}"
    lines = [f'Your import "{title}" into the datasource "{datasource["name"]}" '
             f'(id {datasource["id"]}) has finished.', "",
             f"Rows read:          {row['rows']}",
             f"New recipients:     {row['inserted']}",
             f"Updated recipients: {row['updated']}",
             f"Rows skipped:       {row['skipped']}"]
    errors = json.loads(row["errors"])
    if errors:
        lines += ["", "Problems (the first of them):"]
        lines += [f"  row {error['row']}: {error['error']}" for error in errors[:20]]
    lines += ["", f"Import record: {call.base_url}/v1/datasource/{datasource['id']}"
                  f"/import/{row['id']}"]
    enqueue_email(call.conn, call.account, _account_email(call.conn, call.account),
                  f'Import "{title}" finished: {row["inserted"]} new, {row["updated"]} updated, '
                  f'{row["skipped"]} skipped', "\n".join(lines) + "\n")


def _remove_imported(call, row):
    """Deleting an import removes the recipients that it inserted; one that
    is still running cannot go yet."""
    if row["status"] == "running" and not call.conn.import_orphaned(row["id"]):
        raise Conflict(f"Import {row['id']} is still running: delete it once it has ended.")
    call.conn.execute("DELETE FROM recipient WHERE import = ?", (row["id"],))


#: Create is _import_create(): an import is made by reading its upload.
IMPORT = Resource("import", "import", _import_record, parent=DATASOURCE, parent_key="datasource",
                  columns="name:str originalfile:str", repeat={"change": "id!", "delete": "id!"},
                  on_delete=_remove_imported,
                  fields=_record_schema(
                      "id datasource name originalfile uploadtype status rows inserted updated "
                      "skipped errors created finished",
                      errors={"type": "array", "items": {
                          "type": "object", "required": ["row", "error"],
                          "properties": {"row": {"type": "string"},
                                         "error": {"type": "string"}}}}))


# Exports --------------------------------------------------------------------

def _export_record(call, row):
    live = row["status"] == "finished" and row["expires"] > _now()
    return {"id": str(row["id"]), "datasource": str(row["datasource"]), "status": row["status"],
            "rows": str(row["rows"]),
            "url": f"{call.base_url}/v1/download/{row['token']}" if live else None,
            "expires": row["expires"], "created": row["created"], "finished": row["finished"]}


EXPORT = Resource("export", "export", _export_record, parent=DATASOURCE, parent_key="datasource",
                  fields=_record_schema("id datasource status rows url expires created finished"))


def _export_get(call, child_id):
    """Id 0: export the datasource now; a positive id: an earlier export."""
    # The record holds its download link: a host that gets no links is
    # refused before the export, which is not one transaction, is made.
    call.base_url  # noqa: B018
    if child_id == 0:
        return {"export": _export_record(call, _run_export(call))}
    return EXPORT.get(call, child_id)


def _export_folder(db):
    """Where the export files of the database ``db`` go (its engine says)."""
    return _connection_class(db).export_folder(db)


def _run_export(call):
    """Write the active recipients to a CSV file beside the database.

    Not one transaction on purpose: the file is written from one read
    statement (a consistent snapshot under WAL) without holding the write
    lock, so a long export never blocks imports or sending.  If it fails,
    the record and the file are removed again.
    """
    conn, folder = call.conn, _export_folder(call.service.db)
    datasource_id = call.parent["id"]
    with transaction(conn):
        # Looked up again inside the transaction: a GET, so the pipeline's
        # look-up did not refuse a deleted datasource.
        datasource = DATASOURCE.find(conn, call.account, datasource_id, live=True)
        _purge_exports(conn)
        expires = (datetime.datetime.now(datetime.timezone.utc) + _EXPORT_LIFETIME)
        export_id = conn.execute(
            "INSERT INTO export (datasource, status, token, expires, created) "
            "VALUES (?, 'running', ?, ?, ?)",
            (datasource_id, secrets.token_urlsafe(32), expires.strftime("%Y-%m-%d %H:%M:%S"),
             _now())).lastrowid
    path = os.path.join(folder, f"{export_id}-{secrets.token_hex(8)}.csv")
    try:
        os.makedirs(folder, exist_ok=True)
        rows = _write_export(conn, datasource_id, path)
        with transaction(conn):
            conn.execute("UPDATE export SET status = 'finished', rows = ?, path = ?, finished = ? "
                         "WHERE id = ?", (rows, path, _now(), export_id))
            row = conn.execute("SELECT * FROM export WHERE id = ?", (export_id,)).fetchone()
            _notify_export(call, datasource, row)
            emit(call.conn, call.account, "export.finished", _export_record(call, row),
                 call.events)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        with transaction(conn):
            conn.execute("DELETE FROM export WHERE id = ?", (export_id,))
        raise
    return row


#: What a text cell may not start with as typed: a spreadsheet would read
#: it as a formula (OWASP, "CSV Injection").  Such a cell gets a leading '.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _spreadsheet_text(text):
    """A text cell of a file for people: ``'`` before a formula's first sign."""
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def _spreadsheet_value(value):
    """A text or email field's cell (numbers, dates and flags print as _display_value())."""
    return _spreadsheet_text(_display_value(value))


def _write_export(conn, datasource_id, path):
    """Stream the datasource's active recipients into ``path``; the row count."""
    # Every field but the email column itself: another field of type email
    # is a column of its own.
    fields = sorted(field for name, field in _datasource_fields(conn, datasource_id).items()
                    if name != "email")
    cells = [_spreadsheet_text] + [_spreadsheet_value if kind in ("text", "email")
                                   else _display_value for _, _, kind in fields]
    # Field ids are integers from our own table, never request text.
    columns = "".join(", " + conn.sql["json_item"].format(json="data", key=int(field_id))
                      for field_id, _, _ in fields)
    count = 0
    partial = path + ".part"
    try:
        with conn.reading("export") as cursor, \
                open(partial, "w", newline="", encoding="utf-8") as file:
            cursor.row_factory = None
            writer = csv.writer(file)
            writer.writerow(["email"] + [name for _, name, _ in fields])
            for row in cursor.execute(f"SELECT email{columns} FROM recipient WHERE datasource = ? "
                                      "AND status = 'active' ORDER BY id", (datasource_id,)):
                writer.writerow([cell(value) for cell, value in zip(cells, row)])
                count += 1
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(partial)
    return count


def _purge_exports(conn):
    """Remove the files of expired exports (their records stay)."""
    for row in conn.execute("SELECT id, path FROM export WHERE expires <= ? AND path IS NOT NULL",
                            (_now(),)).fetchall():
        with contextlib.suppress(OSError):
            os.remove(row["path"])
        conn.execute("UPDATE export SET path = NULL WHERE id = ?", (row["id"],))


def _notify_export(call, datasource, row):
    url = f"{call.base_url}/v1/download/{row['token']}"
    body = (f'The export of the datasource "{datasource["name"]}" (id {datasource["id"]}) is '
            f"ready: {row['rows']} recipients.\n\nDownload it (CSV) until {row['expires']} UTC:\n"
            f"{url}\n\nAnyone with this link can download the file; do not forward it.\n")
    enqueue_email(call.conn, call.account, _account_email(call.conn, call.account),
                  f'Export of "{datasource["name"]}" is ready', body)


def _download(call, token):
    """The CSV of an export, to anyone holding its link, until it expires."""
    # A token is URL-safe base64 (PostgreSQL refuses a NUL in any text).
    row = call.conn.execute("SELECT * FROM export WHERE token = ?", (token,)).fetchone() \
        if re.fullmatch(r"[A-Za-z0-9_-]{1,100}", token) else None
    if row is None or row["status"] != "finished" or row["expires"] <= _now() \
            or not row["path"] or not os.path.isfile(row["path"]):
        raise NotFound("This download link is unknown or has expired; start a new export.")
    return bottle.static_file(os.path.basename(row["path"]), root=os.path.dirname(row["path"]),
                              mimetype="text/csv",
                              download=f"datasource-{row['datasource']}-export-{row['id']}.csv")


# Organize -------------------------------------------------------------------

def _organize_record(call, row):
    return {"id": str(row["id"]), "item": str(row["item"]), "folder": row["folder"],
            "sortorder": str(row["sortorder"])}


def _organize_values(call, row):
    if row is None:
        existing = call.conn.execute("SELECT id FROM organize WHERE item = ?",
                                     (call.parent["id"],)).fetchone()
        if existing:
            raise Conflict(f"Datasource {call.parent['id']} already has organize record "
                           f"{existing['id']}; change it with POST.")
    return _columns(call, ("folder", "sortorder"))


#: Spec rule 4: on Change the datasource names its one organize record, and
#: ``id`` repeats that record's id.
ORGANIZE = Resource("organize", "organize", _organize_record, parent=DATASOURCE, parent_key="item",
                    columns="folder:str sortorder:int", required="folder sortorder",
                    parent_param="item", single=True, repeat={"change": "id!"},
                    values=_organize_values, stamped=False, label="organize record",
                    fields=_record_schema("id item folder sortorder"),
                    doc={
                        "item": ("The id of the record to place in a folder.", 1),
                        "folder": ("The folder's name.", "Customers"),
                        "sortorder": ("The position within the folder.", 1)})


# ---------------------------------------------------------------------------
# Templates: records and files that wrap a campaign's messages
# ---------------------------------------------------------------------------

def _template_values(call, row):
    """A template's columns, its bodies checked: each given body holds
    {{content}} once, and at least one body is given."""
    values = _columns(call, TEMPLATE.column_names)
    bodies = {part: values.get(part, row[part] if row else "") for part in ("html", "text")}
    if row is None or "html" in values or "text" in values:
        if not any(body.strip() for body in bodies.values()):
            raise InvalidParameter("A template needs an html or a text body (or both) holding "
                                   "{{content}}, where the message goes.", field="html")
        for part, body in bodies.items():
            try:
                _check_template(*((body, None) if part == "html" else (None, body)))
            except ValueError as error:
                raise InvalidParameter(str(error), field=part) from None
    return values


#: What a template's html and text must be, for the OpenAPI document: '' or
#: holding {{content}} exactly once (as _check_template() requires).
_CONTENT_TAG_PATTERN = r"\{\{\s*[cC][oO][nN][tT][eE][nN][tT]\s*\}\}"
_CONTENT_ONCE = {"allOf": [{"pattern": r"^$|^(?![\s\S]*" + _CONTENT_TAG_PATTERN + r"[\s\S]*" + _CONTENT_TAG_PATTERN
                                       + r")[\s\S]*" + _CONTENT_TAG_PATTERN + r"[\s\S]*$"}]}

TEMPLATE = Resource("template", "template", _plain_record, columns="name:str html:text text:text",
                    values=_template_values, repeat={"delete": "id"},
                    fields=_record_schema("id owner name html text created deleted",
                                          deleted=_FLAG_ANSWER),
                    doc={
                        "html": ("The template's HTML, holding {{content}} once, where the "
                                 "message goes; '' for none.",
                                 "<html><body>{{content}}</body></html>", _CONTENT_ONCE),
                        "text": ("The template's plain text, holding {{content}} once, where the "
                                 "message goes; '' for none.", "{{content}}\n-- \nExample Shop",
                                 _CONTENT_ONCE)})


# ---------------------------------------------------------------------------
# Segments
# ---------------------------------------------------------------------------

_SEGMENT_OPS = ("eq", "ne", "contains", "startswith", "gt", "lt", "empty", "notempty")


#: The ops whose condition on a field an index of the field serves (see
#: _index_conditioned_fields()): they compare _field_columns()' ``compared``.
_INDEXED_OPS = ("eq", "gt", "lt")


def _field_columns(conn, field_id, kind, json="r.data"):
    """``(column, compared)``: SQL for a field's value in the JSON ``json`` of
    a recipient: as text (on PostgreSQL), and as eq, ne, gt and lt compare it
    (lower-cased text; a number for numbers and yes/no).  A field's index
    indexes ``compared`` of ``json="data"``, which is the same expression."""
    column = conn.sql["json_value"].format(json=json, key=int(field_id))
    if kind in ("integer", "number", "boolean"):
        return column, conn.sql["json_number"].format(json=json, key=int(field_id))
    return column, f"lower({column})" if kind in ("text", "email") else column


def _condition_sql(conn, column, kind, op, value, compared=None):
    """SQL for one condition on one column expression, and its parameters.

    ``column`` is SQL we build from field ids, never request text, giving the
    value as text on PostgreSQL; ``compared`` (default: ``column``, lower-cased
    for text) is what eq, ne, gt and lt compare (see _field_columns()).  The
    value is always a parameter, converted to the field's type so comparisons
    are typed.  eq is ``=`` (not IS NOT DISTINCT FROM, which PostgreSQL's
    indexes cannot serve): a segment's WHERE never negates a condition, so a
    NULL there excludes the row as false does.
    """
    if op == "empty":
        return f"({column} IS NULL OR {column} = '')", ()
    if op == "notempty":
        return f"({column} IS NOT NULL AND {column} != '')", ()
    if op in ("contains", "startswith"):
        needle = str(value).lower()
        if op == "contains":
            return conn.sql["contains"].format(haystack=f"lower({column})", needle="?"), (needle,)
        return f"substr(lower({column}), 1, ?) = ?", (len(needle), needle)
    try:
        typed = _convert_value(kind if kind != "email" else "text", value)
    except ValueError:
        # Checked when stored, but the field has been retyped since: no value
        # of its new type equals this one (so only 'ne' holds), none is above
        # or below it.  Never an error: sizes, verify and sending must go on.
        return ("(1 = 1)" if op == "ne" else "(1 = 0)"), ()
    if compared is None:
        compared = f"lower({column})" if kind in ("text", "email") else column
    if kind in ("text", "email") and typed is not None:
        typed = str(typed).lower()
    if op == "eq":
        return f"{compared} {'IS NOT DISTINCT FROM' if typed is None else '='} ?", (typed,)
    if op == "ne":
        return f"{compared} IS DISTINCT FROM ?", (typed,)
    return f"{compared} {'>' if op == 'gt' else '<'} ?", (typed,)


def _segment_filter(conn, datasources, match, conditions):
    """``(sql, params)``: a WHERE clause over ``recipient r`` that selects the
    active recipients of a segment.  Counting and sending both use it, so the
    size a client sees is the audience that is sent to.

    In a datasource that lacks a condition's field, every recipient's value
    is taken as blank: ``empty`` and ``ne`` hold, every other op fails, just as
    for a recipient without a value.  A value that no longer fits its field's
    type (the field was retyped) equals no value.
    """
    if not datasources:
        return "(1 = 0)", ()
    parts, params = [], []
    for datasource in datasources:
        fields = _datasource_fields(conn, datasource)
        tests, test_params = [], []
        for condition in conditions:
            name, op, value = condition["field"].lower(), condition["op"], condition.get("value")
            if name == "email":
                sql, args = _condition_sql(conn, "r.email", "email", op, value)
            elif name in fields:
                field_id, _, kind = fields[name]
                column, compared = _field_columns(conn, field_id, kind)
                sql, args = _condition_sql(conn, column, kind, op, value, compared)
            else:
                sql, args = ("(1 = 1)", ()) if op in ("empty", "ne") else ("(1 = 0)", ())
            tests.append(sql)
            test_params.extend(args)
        joiner = " AND " if match == "all" else " OR "
        test = joiner.join(tests) if tests else "(1 = 1)"
        parts.append(f"(r.datasource = ? AND ({test}))")
        params.extend([datasource, *test_params])
    return f"r.status = 'active' AND ({' OR '.join(parts)})", tuple(params)


def _checked_datasources(given):
    """Segment ``datasources`` as a list of ids, each once (the route has
    found them among the account's live datasources)."""
    ids = []
    for datasource in map(_as_int, given):
        if datasource not in ids:
            ids.append(datasource)
    return ids


def _checked_conditions(conn, datasources, given):
    """Segment ``conditions`` as stored: ``[{field, op, value}]``, each naming
    a field of the segment's datasources with a value its type takes."""
    fields = [_datasource_fields(conn, datasource) for datasource in datasources]
    checked = []
    for index, item in enumerate(given):
        where = f"conditions[{index}]"
        if not isinstance(item, dict) or set(item) - {"field", "op", "value"} \
                or not isinstance(item.get("field"), str) or not item["field"].strip():
            raise InvalidParameter(f"{where} must be an object with 'field', 'op' and 'value'.",
                                   field="conditions")
        name, op, value = item["field"].strip(), item.get("op"), item.get("value")
        if op not in _SEGMENT_OPS:
            raise InvalidParameter(f"{where}.op must be one of {', '.join(_SEGMENT_OPS)}.",
                                   field="conditions", allowed=list(_SEGMENT_OPS))
        kinds = {"email"} if name.lower() == "email" else {
            known[name.lower()][2] for known in fields if name.lower() in known}
        if not kinds:
            # 409, as for every refusal that depends on stored records.
            raise Conflict(f"{where}: no datasource of this segment has a field "
                                   f"'{name}'.", field="conditions")
        if op in ("empty", "notempty"):
            checked.append({"field": name, "op": op, "value": None})
            continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
            value = int(value)  # 5.0 is 5; str(1e300) would be '1e+300'
        if not isinstance(value, (str, int, float)) or str(value).strip() == "" \
                or any(c in str(value) for c in "\r\n\x00"):
            raise InvalidParameter(f"{where}.value must be a non-empty single-line string or "
                                   f"number (use op 'empty' to match blank values).",
                                   field="conditions")
        if op not in ("contains", "startswith"):
            for kind in sorted(kinds - {"email", "text"}):
                try:
                    _convert_value(kind, str(value))  # as it is stored and used
                except ValueError as error:
                    raise Conflict(f"{where}.value does not fit the {kind} field "
                                           f"'{name}': {error}.", field="conditions") from None
        checked.append({"field": name, "op": op, "value": str(value)})
    return checked


def _segment_values(call, row):
    values = _columns(call, ("name", "match"))
    if "datasources" in call.params:
        datasources = _checked_datasources(call.params["datasources"])
    else:
        datasources = json.loads(row["datasources"]) if row else []
    if row is None or "datasources" in call.params or "conditions" in call.params:
        # Conditions are checked against the datasources they will apply to,
        # so changing either re-checks both.
        stored = json.loads(row["conditions"]) if row else []
        values["datasources"] = json.dumps(datasources)
        values["conditions"] = json.dumps(
            _checked_conditions(call.conn, datasources, call.get("conditions", stored)))
    return values


def _live_datasources(conn, segment):
    """The ids of a segment row's datasources that are not deleted (and are
    its account's), in order."""
    return [row[0] for row in conn.execute(
        "SELECT id FROM datasource WHERE deleted = 0 AND owner = ? AND id IN "
        f"({conn.sql['json_ids'].format(array='?')}) ORDER BY id",
        (segment["owner"], segment["datasources"]))]


def _segment_query(conn, segment, live=None):
    """``(where, params)`` over ``recipient r`` for a segment row: its active
    recipients, in its live datasources (``live``: _live_datasources(), if
    known already)."""
    live = _live_datasources(conn, segment) if live is None else live
    return _segment_filter(conn, live, segment["match"], json.loads(segment["conditions"]))


def _segment_members(conn, segment):
    """_segment_query() for a statement that reads the recipients in address
    order (a batch's queueing): with conditions, the ids chosen first in a
    subquery, so its conditions can read their fields' indexes, where the
    address order alone made SQLite walk the whole datasource (at 10M rows,
    after the first segment's queueing had filled the WAL: 10 s and more
    for a segment of an eighth of them)."""
    where, params = _segment_query(conn, segment)
    if json.loads(segment["conditions"]):
        where = f"r.id IN (SELECT r.id FROM recipient r WHERE {where})"
    return where, params


def _segment_size(conn, segment):
    """How many addresses a segment reaches: one address in two of its
    datasources counts once.  Counted by the database, never loaded into
    Python; within one datasource an address is unique already (the unique
    index folds case like lower() does), so there a plain count(*) serves."""
    where, params = _segment_query(conn, segment)
    many = len(json.loads(segment["datasources"])) > 1
    return conn.execute(f"SELECT {'count(DISTINCT lower(r.email))' if many else 'count(*)'} "
                        f"FROM recipient r WHERE {where}", params).fetchone()[0]


#: The name of a field's index: the field and its type (a retyped field's
#: values compare otherwise, so its index is another).
_FIELD_INDEX = "recipient_field_{field}_{kind}"


def _wanted_field_indexes(conn):
    """``{index name: columns}``: an index for each field that a condition of
    a live segment compares with eq, gt or lt, in each live datasource of the
    segment that has the field."""
    wanted = {}
    for datasources, conditions in conn.execute(
            "SELECT datasources, conditions FROM segment WHERE deleted = 0 "
            "AND conditions != '[]'").fetchall():
        # A condition on 'email' compares the address column, never a field.
        names = {condition["field"].lower() for condition in json.loads(conditions)
                 if condition["op"] in _INDEXED_OPS} - {"email"}
        if not names:
            continue
        ids, texts = conn.sql["json_ids"], conn.sql["json_addresses"]
        for field_id, kind in conn.execute(
                "SELECT f.id, f.type FROM field f JOIN datasource d ON d.id = f.datasource "
                f"WHERE d.deleted = 0 AND f.datasource IN ({ids.format(array='?')}) "
                f"AND f.name IN ({texts.format(array='?')})",
                (datasources, json.dumps(sorted(names)))).fetchall():
            _, compared = _field_columns(conn, field_id, kind, json="data")
            # With the datasource and status a segment's WHERE has, a count is
            # read from the index alone.  The value before the status: so a
            # query on (datasource, status) alone takes the indexes made for
            # it (recipient_status, recipient_non_ascii), never this one.
            wanted[_FIELD_INDEX.format(field=int(field_id), kind=kind)] = \
                f"datasource, ({compared}), status"
    return wanted


def _index_conditioned_fields(db, limit=1):
    """Make the index of a field that a segment's condition compares (eq,
    gt, lt), and drop those no live segment needs, at most ``limit`` makes
    per call: the worker runs it (a segment's size, verify, structure and
    sending then read the rows of the value, not every row's JSON).  Until it
    has run, the conditions are the same, only slower.  SQLite writes wait
    while an index is made (2–4 s for a million recipients, 18–27 s for ten
    million, on two busy cores); PostgreSQL makes it CONCURRENTLY (two
    workers that make the same one at once: one fails, logged, and the next
    round finds it made).

    :returns: how many indexes were made or dropped.
    """
    conn = connect(db)
    try:
        wanted = _wanted_field_indexes(conn)
        prefix = _FIELD_INDEX.split("{", 1)[0]
        present = {row[0] for row in conn.execute(conn.sql["table_indexes"], ("recipient",))
                   if row[0].startswith(prefix)}
        changed = 0
        for name in sorted(present - set(wanted)):
            conn.execute(conn.sql["drop_index"].format(name=name))
            changed += 1
        for name in sorted(set(wanted) - present)[:limit]:
            # Dropped first: an invalid one a failed build left (PostgreSQL).
            conn.execute(conn.sql["drop_index"].format(name=name))
            conn.execute(conn.sql["create_index"].format(name=name, table="recipient",
                                                         columns=wanted[name]))
            changed += 1
        return changed
    finally:
        conn.close()


def _segment_record(call, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]), "name": row["name"],
            "datasources": [str(d) for d in json.loads(row["datasources"])],
            "match": row["match"], "conditions": json.loads(row["conditions"]),
            "size": str(_segment_size(call.conn, row)), "created": row["created"],
            "deleted": str(row["deleted"])}


#: A condition as a segment answers it.
_CONDITION = {"type": "object", "required": ["field", "op"], "properties": {
    "field": {"type": "string", "description": "a field name of the segment's datasources"},
    "op": {"type": "string", "enum": list(_SEGMENT_OPS)},
    "value": {"type": ["string", "null"],
              "description": "what the field is compared with (null for empty and notempty)"}}}

#: A condition as a create or change takes it: with a value, or (empty,
#: notempty) without one.
_CONDITION_WITH_VALUE = {
    "type": "object", "required": ["field", "op", "value"], "additionalProperties": False,
    "properties": {
        "field": {"type": "string", "pattern": "\\S"},
        "op": {"type": "string", "enum": [op for op in _SEGMENT_OPS
                                          if op not in ("empty", "notempty")]},
        "value": {"anyOf": [{"type": "string",
                             "pattern": "^[^\\r\\n\\x00]*[^\\s\\x00][^\\r\\n\\x00]*$"},
                            {"type": "number"}, {"type": "boolean"}]}}}
_CONDITION_WITHOUT_VALUE = {
    "type": "object", "required": ["field", "op"], "additionalProperties": False,
    "properties": {"field": {"type": "string", "pattern": "\\S"},
                   "op": {"type": "string", "enum": ["empty", "notempty"]},
                   "value": {"description": "ignored"}}}

SEGMENT = Resource("segment", "segment", _segment_record,
                   columns="name:str datasources:list@datasource match:all|any conditions:list",
                   values=_segment_values, repeat={"delete": "id"},
                   fields=_record_schema(
                       "id owner name datasources match conditions size created deleted",
                       datasources=_ID_LIST, match={"type": "string", "enum": ["all", "any"]},
                       deleted=_FLAG_ANSWER, conditions={"type": "array", "items": _CONDITION}),
                   doc={
                       "datasources": ("The ids of the datasources whose recipients the segment "
                                       "selects.", [1], {"items": {"anyOf": [
                                           {"type": "integer", "minimum": 0, "maximum": MAX_ID},
                                           {"type": "string", "pattern": "^[0-9]{1,18}$"}]}}),
                       "match": ("all: a recipient must meet every condition; any: at least one.",
                                 "all"),
                       "conditions": ("Conditions on field values; none selects every active "
                                      "recipient.", [{"field": "city", "op": "eq", "value": "Oslo"}],
                                      {"items": {"anyOf": [_CONDITION_WITH_VALUE,
                                                           _CONDITION_WITHOUT_VALUE]}})})


# ---------------------------------------------------------------------------
# Campaigns
# ---------------------------------------------------------------------------

def _campaign_record(call, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]),
            "accountprofile": str(row["accountprofile"]), "name": row["name"],
            "description": row["description"], "enabled": str(row["enabled"]),
            "scheduled": str(row["scheduled"]), "archiveemail": row["archiveemail"],
            "defaulttemplate": row["defaulttemplate"], "created": row["created"],
            "deleted": str(row["deleted"]), "thumbnail": row["thumbnail"],
            "archiveid": str(row["id"]), "tracking": str(row["tracking"]),
            "public": str(row["public"]),
            **{name: str(row[name]) for name in _TEST_SETTINGS}}


#: A/B test settings of a campaign (section 18): ``(low, high)`` of each
#: number; testmetric is a choice of the route table.
_TEST_SETTINGS = {"testsize": (10, 50), "testmetric": None, "testwait": (60, 604800)}


def _campaign_values(call, row):
    if call.get("scheduled") == 1:
        raise InvalidParameter("A campaign is scheduled by sending it (PUT /campaign/{id}/send/0); "
                               "'scheduled' only takes '0', to cancel.", field="scheduled")
    values = _columns(call, CAMPAIGN.column_names)
    for name, (low, high) in ((n, r) for n, r in _TEST_SETTINGS.items() if r and n in values):
        if not low <= values[name] <= high:
            raise InvalidParameter(f"'{name}' must be a whole number from {low} to {high}.",
                                   field=name)
    if "defaulttemplate" in values:
        values["defaulttemplate"] = _param_defaulttemplate(call, values["defaulttemplate"])
    for name in ("archiveemail", "thumbnail"):
        if values.get(name) == "":
            values[name] = None
    return values


def _cancel_batches(conn, campaign_id):
    """Cancel the campaign's batches that have not started sending, and the
    rest of those testing: recipients waiting for a winner are not mailed
    (the test's own emails go on)."""
    conn.execute("UPDATE batch SET status = 'cancelled', finished = ? "
                 "WHERE campaign = ? AND status IN ('scheduled', 'testing')", (_now(), campaign_id))
    conn.execute("UPDATE outbox SET status = 'skipped', error = 'the batch was cancelled during "
                 "its A/B test' WHERE status = 'waiting' AND batch IN (SELECT id FROM batch "
                 "WHERE campaign = ? AND status = 'cancelled')", (campaign_id,))


def _cancel_if_unscheduled(call, campaign_id):
    if call.get("scheduled") == 0:
        _cancel_batches(call.conn, campaign_id)


#: ``scheduled`` is derived, not stored: 1 while the campaign has a batch
#: waiting for its time (read in the same statement as the record).
#: A template as a parameter names it (a campaign's defaulttemplate, a
#: transactional email's template): an id, or a file name that stays in the folder.
_TEMPLATE_VALUE = {"anyOf": [
    {"type": "integer", "minimum": 0, "maximum": MAX_ID},
    {"type": "string", "pattern": "^(?!.*[.][.])(?! *[0-9]{19,} *$)"
     "(?! *[.][hH][tT][mM][lL] *$)[^/\\\\" + _TEMPLATE_NAME_REFUSED + "]*$"}]}


CAMPAIGN = Resource(
    "campaign", "campaign", _campaign_record,
    columns="name:str accountprofile:int@accountprofile? description:text enabled:flag "
            "archiveemail:email defaulttemplate:scalar@template thumbnail:str tracking:flag "
            "testsize:int testmetric:opens|clicks testwait:int public:flag",
    required="name accountprofile",
    extra={"change": "scheduled:flag"}, values=_campaign_values,
    select="*, EXISTS (SELECT 1 FROM batch WHERE batch.campaign = campaign.id "
           "AND batch.status = 'scheduled') AS scheduled",
    after_change=_cancel_if_unscheduled,
    on_delete=lambda call, row: _cancel_batches(call.conn, row["id"]),
    answer="emt_campaign", one_as_list=True,
    fields=_record_schema(
        "id owner accountprofile name description enabled scheduled archiveemail "
        "defaulttemplate created deleted thumbnail archiveid tracking testsize testmetric testwait public",
        enabled=_FLAG_ANSWER, scheduled=_FLAG_ANSWER, deleted=_FLAG_ANSWER,
        tracking=_FLAG_ANSWER, public=_FLAG_ANSWER,
        testmetric={"type": "string", "enum": ["opens", "clicks"]}),
    doc={
        "accountprofile": ("The id of the sender profile the campaign sends with.", 1),
        "enabled": ("1 when the campaign may send.", "1"),
        "scheduled": ("Only 0: cancels the planned send (a campaign is scheduled by sending it).",
                      "0", {"anyOf": [{"type": "string", "enum": ["0", "false"]},
                                      {"type": "integer", "enum": [0]},
                                      {"type": "boolean", "enum": [False]}]}),
        "archiveemail": ("An address that gets a copy of every batch ('' for none).",
                         "archive@example.com"),
        "defaulttemplate": ("The template the campaign's messages are wrapped in: '' (none), a "
                            "template id, or the name NAME of a file NAME.html (and NAME.txt) in "
                            "the server's templates folder ('NAME.html' is NAME too). A text of "
                            "digits is an id. Surrounding spaces are trimmed.", "",
                            _TEMPLATE_VALUE),
        "thumbnail": ("A URL of a picture of the campaign, for people.",
                      "https://example.com/thumb.png"),
        "tracking": ("1: links and opens of the campaign's emails are counted (off by default).",
                     "0"),
        "testsize": ("A/B tests: the percentage of each tested segment's recipients who get the "
                     "test, 10 to 50.", "20", {"anyOf": [
                         {"type": "integer", "minimum": 10, "maximum": 50},
                         {"type": "string", "pattern": "^([1-4][0-9]|50)$"}]}),
        "testmetric": ("A/B tests: what chooses the winner, unique opens or unique clicks over "
                       "emails sent.", "opens"),
        "testwait": ("A/B tests: seconds from the start of the test to the choice, 60 to "
                     "604800.", "14400", {"anyOf": [
                         {"type": "integer", "minimum": 60, "maximum": 604800},
                         {"type": "string", "pattern": "^([6-9][0-9]|[1-9][0-9]{2,4}|[1-5][0-9]{5}"
                                                       "|60[0-3][0-9]{3}|604[0-7][0-9]{2}|604800)$"}
                     ]}),
        "public": ("1: the campaign's sent batches are in the public archive of each sign-up "
                   "datasource they mailed (/archive/{datasource}), and its feed.", "0")})


# ---------------------------------------------------------------------------
# Campaign messages, structure, verify
# ---------------------------------------------------------------------------

def _link_record(call, row):
    return {"id": str(row["id"]), "campaign": str(row["campaign"]),
            "segment": str(row["segment"]), "message": str(row["message"]),
            "priority": str(row["priority"]), "subject": row["subject"], "name": row["name"],
            "variants": [str(variant) for variant in json.loads(row["variants"])]}


def _link_values(call, row):
    """The checked ``segment``, ``message``, ``priority`` of a link (the route
    has found the segment and message among the account's live records); a
    duplicate link is 409."""
    campaign_id = call.parent["id"]
    values = _columns(call, LINK.column_names)
    segment = values.get("segment", row and row["segment"])
    message = values.get("message", row and row["message"])
    duplicate = call.conn.execute(
        "SELECT id FROM campaign_message WHERE campaign = ? AND segment = ? AND message = ? "
        "AND id != ?", (campaign_id, segment, message, row["id"] if row else 0)).fetchone()
    if duplicate:
        raise Conflict(f"Campaign {campaign_id} already sends message {message} to segment "
                       f"{segment} (campaign message {duplicate['id']}).")
    if "variants" in values:
        variants = [_as_int(variant) for variant in values["variants"]]
        if len(variants) > 4 or len(set(variants)) < len(variants) or message in variants:
            raise InvalidParameter("'variants' must list 0 to 4 other messages (ids), each once "
                                   "and none the link's own message.", field="variants")
        values["variants"] = json.dumps(variants)
    elif "message" in values and row and message in json.loads(row["variants"]):
        raise InvalidParameter("'message' is one of the link's variants: change variants too.",
                               field="message")
    return values


#: A campaign message links a message to a segment.  The sending order:
#: lower priority numbers first, then the order of linking.  A link counts
#: only while its message and segment are its campaign's account's, so no
#: listing, structure, verify, preview or send reads another account's
#: record through one (the route refuses such a link to begin with).
LINK = Resource(
    "campaign message", "campaign_message", _link_record, parent=CAMPAIGN, parent_key="campaign",
    columns="segment:int@segment message:int@message priority:int variants:list@message",
    required="segment message",
    repeat={"change": "segmentmessageid!", "delete": "segmentmessagehack!"}, values=_link_values,
    select="campaign_message.*, message.subject, message.name",
    source="campaign_message JOIN campaign ON campaign.id = campaign_message.campaign "
           "JOIN message ON message.id = campaign_message.message AND message.owner = campaign.owner "
           "JOIN segment ON segment.id = campaign_message.segment AND segment.owner = campaign.owner",
    order="campaign_message.priority, campaign_message.id",
    stamped=False, answer="message", schema="campaignmessage",
    fields=_record_schema("id campaign segment message priority subject name variants",
                          variants=_ID_LIST),
    doc={
        "segment": ("The id of the segment that gets the message.", 1),
        "message": ("The id of the message to send.", 1),
        "priority": ("Lower goes first: an address in two segments of the campaign gets only "
                     "the message of the segment with the lower priority.", 1),
        "variants": ("A/B tests: 1 to 4 other message ids tested against the message on this "
                     "segment ([] for none); see the campaign's testsize, testmetric, testwait.",
                     [2], {"maxItems": 4, "items": {"anyOf": [
                         {"type": "integer", "minimum": 0, "maximum": MAX_ID},
                         {"type": "string", "pattern": "^[0-9]{1,18}$"}]}}),
        "segmentmessageid": ("The campaign message's id again, as in the path.", 1),
        "segmentmessagehack": ("The campaign message's id again, as in the path.", 1)})


def _campaign_links(conn, campaign_id):
    """The campaign's message links (with the message's subject and name) in
    sending order."""
    return conn.execute(f"SELECT {LINK.select} FROM {LINK.source} "
                        f"WHERE campaign_message.campaign = ? ORDER BY {LINK.order}",
                        (campaign_id,)).fetchall()


def _versions(link):
    """The messages a link sends: its own, then its variants (an A/B test
    when there are any)."""
    return [link["message"], *json.loads(link["variants"])]


def _whole_campaign(campaign_id, child_id, what):
    """Structure and verify describe the whole campaign: ``{child_id}`` is 0
    or the campaign's own id."""
    if child_id not in (0, campaign_id):
        raise NotFound(f"Campaign {campaign_id} has one {what}, at "
                       f"/campaign/{campaign_id}/{what}/0.")


def _rows_by_id(conn, table, ids, owner):
    """``{id: row}`` of ``table`` (a fixed name) for the given ids that
    ``owner`` (an account) has."""
    return {row["id"]: row for row in conn.execute(
        f"SELECT * FROM {table} WHERE id IN ({conn.sql['json_ids'].format(array='?')}) "
        "AND owner = ?", (json.dumps(sorted(set(ids))), owner))}


#: Up to this many segments of one datasource, their overlaps are counted a
#: pair at a time (_segment_pairs()); more, or of several datasources: all
#: at once by address (_segment_overlaps()).
_PAIRWISE_SEGMENTS = 4


def _segment_pairs(conn, segments, live):
    """_segment_overlaps() of segments that all select from the one datasource
    ``live``, where an address is one row (its unique index folds case):
    a ``count(*)`` of each segment's WHERE and of each pair's WHEREs joined
    by AND.  Each count can read the indexes of its conditions' fields,
    where sorting every address of the segments (the general way) took 25 s
    at ten million recipients, x21 from one million (the sort spills)."""
    wheres = [_segment_query(conn, segment, live) for segment in segments]
    counts = {}
    for first, (where, params) in enumerate(wheres):
        for second in range(first, len(segments)):
            other, more = wheres[second] if second != first else ("(1 = 1)", ())
            shared = conn.execute(f"SELECT count(*) FROM recipient r WHERE {where} AND {other}",
                                  (*params, *more)).fetchone()[0]
            a, b = segments[first]["id"], segments[second]["id"]
            counts[a, b] = counts[b, a] = shared
    return counts


def _segment_overlaps(conn, segments):
    """``{(a, b): addresses in both}`` for every pair of the given segment rows,
    ``(a, a)`` being a segment's size; one SQL statement over the recipients
    (a few segments of one datasource: _segment_pairs()).

    Each address gets the set of segments it is in as a bit mask (62 segments
    to a column; a segment's bit is a power of two no other segment of its
    column has, so the sum of the distinct bits is their union); the statement
    counts the addresses of each distinct mask, and the pairs are summed from
    those few rows here.  That grows like the recipients (a sort), where
    joining the addresses with themselves grew like their square.
    """
    if not segments:
        return {}
    if len(segments) == 1:
        return {(segments[0]["id"],) * 2: _segment_size(conn, segments[0])}
    lives = [_live_datasources(conn, segment) for segment in segments]
    if len(segments) <= _PAIRWISE_SEGMENTS and all(
            len(live) == 1 and live == lives[0] for live in lives):
        return _segment_pairs(conn, segments, lives[0])
    words = range((len(segments) + 61) // 62)
    parts, params = [], []
    for index, segment in enumerate(segments):
        where, args = _segment_query(conn, segment, lives[index])
        masks = ", ".join(f"{1 << index % 62 if word == index // 62 else 0} AS m{word}"
                          for word in words)
        parts.append(f"SELECT {masks}, lower(r.email) AS address FROM recipient r WHERE {where}")
        params.extend(args)
    columns = ", ".join(f"m{word}" for word in words)
    sums = ", ".join(f"sum(DISTINCT m{word}) AS m{word}" for word in words)
    sql = (f"SELECT {columns}, count(*) FROM (SELECT {sums} FROM ({' UNION ALL '.join(parts)}) m "
           f"GROUP BY address) a GROUP BY {columns}")
    counts = {}
    for *masks, shared in conn.execute(sql, params):
        mask = sum(int(value) << 62 * word for word, value in enumerate(masks))
        inside = [segment["id"] for index, segment in enumerate(segments) if mask >> index & 1]
        for position, a in enumerate(inside):
            for b in inside[position:]:
                counts[a, b] = counts[b, a] = counts.get((a, b), 0) + shared
    return counts


def _campaign_structure(conn, account, campaign_id):
    """The structure record: the campaign's segments in sending order with
    their messages, sizes and the addresses each shares with the others.

    An address in several segments receives only the message of the first.
    """
    CAMPAIGN.find(conn, account, campaign_id)
    entries = {}
    for link in _campaign_links(conn, campaign_id):
        entry = entries.setdefault(link["segment"], {
            "segment": str(link["segment"]), "priority": str(link["priority"]), "messages": []})
        entry["messages"].append(str(link["message"]))
    rows = _rows_by_id(conn, "segment", entries, account)
    counts = _segment_overlaps(conn, [rows[segment] for segment in entries])
    segments = []
    for segment, entry in entries.items():
        overlap = [{"segment": str(other), "shared": str(counts.get((segment, other), 0))}
                   for other in entries if other != segment]
        segments.append({"segment": entry["segment"], "name": rows[segment]["name"],
                         "priority": entry["priority"], "messages": entry["messages"],
                         "size": str(counts.get((segment, segment), 0)), "overlap": overlap})
    return {"id": str(campaign_id), "campaign": str(campaign_id), "segments": segments}


def _campaign_structure_get(call, child_id):
    _whole_campaign(call.parent["id"], child_id, "structure")
    return {"structure": _campaign_structure(call.conn, call.account, call.parent["id"])}


def _campaign_verify_get(call, child_id):
    _whole_campaign(call.parent["id"], child_id, "verify")
    return {"verify": verify_campaign(call.conn, call.account, call.parent["id"],
                                      call.service.config["templates_dir"],
                                      settings=_verify_settings(call))}


def _verify_settings(call):
    """verify_campaign()'s and verify_automation()'s ``settings`` for a request
    (links=1 asks for the links check)."""
    return {**call.service.config, "secret": call.service.secret,
            "links": bool(call.get("links"))}


def _label(kind, row):
    return f"{kind} {row['id']} ('{row['name']}')" if row["name"] else f"{kind} {row['id']}"


class _Campaign:
    """What verify's checks look at: the campaign, its sender profile, its
    links, and the messages and segments they name (by id)."""

    #: What the checks' messages call it, and where it is changed.
    kind = "campaign"

    def __init__(self, conn, account, campaign_id, templates_dir="", settings=None):
        self.conn, self.id, self.settings = conn, campaign_id, settings or {}
        self.path = f"/v1/campaign/{campaign_id}"
        self.row = CAMPAIGN.find(conn, account, campaign_id)
        self.read_sender(account, templates_dir)
        self.links = _campaign_links(conn, campaign_id)
        self.messages = _rows_by_id(conn, "message", [
            message for link in self.links for message in _versions(link)], account)
        self.segments = _rows_by_id(conn, "segment", [link["segment"] for link in self.links],
                                    account)

    def report(self, checks):
        """The verify record of ``checks`` (``(name, check)`` pairs) on this:
        ``{id, <kind>, passed, checks, verified}``."""
        listed = []
        for name, check in checks:
            problems, passed_message = check(self)
            listed.append({"check": name, "passed": "0" if problems else "1",
                           "message": " ".join(problems) if problems else passed_message})
        passed = all(item["passed"] == "1" for item in listed)
        return {"id": str(self.id), self.kind: str(self.id), "passed": "1" if passed else "0",
                "checks": listed, "verified": _now()}

    def read_sender(self, account, templates_dir):
        """The template and the sender profile that ``self.row`` names."""
        conn, self.template, self.template_problem = self.conn, None, None
        try:
            self.template = _campaign_template(conn, account, self.row["defaulttemplate"],
                                              templates_dir)
        except _TemplateUnusable as problem:
            self.template_problem = problem
        self.profile_id = self.row["accountprofile"]
        self.profile_row = conn.execute("SELECT * FROM accountprofile WHERE id = ? AND owner = ?",
                                        (self.profile_id, account)).fetchone()
        self.profile = None if self.profile_row is None or self.profile_row["deleted"] \
            else self.profile_row
        self.profile_address = self.profile is not None and _normalize_email(
            self.profile["fromaddress"])

    def bodies(self, message):
        """``{"html", "text"}`` of a message as it is sent: inside the template
        (when it has a usable one), merge tags still tags."""
        html_body, text_body = message["html"], message["text"]
        if self.template:
            html_body, text_body = _wrap_in_template(*self.template, html_body, text_body)
        return {"html": html_body, "text": text_body}

    def senders(self):
        """``(kind, row, fix path)`` of every row whose header values are sent."""
        senders = [("message", m, f"/v1/message/{m['id']}") for m in self.messages.values()]
        if self.profile is not None:
            senders.append(("sender profile", self.profile,
                            f"/v1/accountprofile/{self.profile_id}"))
        return senders


#: Verify's checks, in the order the record lists them: ``(name, check)``,
#: each check giving ``(problems, message when it passes)`` for a _Campaign.
_VERIFY_CHECKS = []


def _verify_check(name):
    def register(check):
        _VERIFY_CHECKS.append((name, check))
        return check
    return register


@_verify_check("campaign_enabled")
def _verify_enabled(c):
    return [] if c.row["enabled"] else [
        f"Campaign {c.id} is disabled: enable it with POST /v1/campaign/{c.id} and enabled '1'."
    ], f"Campaign {c.id} is enabled."


@_verify_check("campaign_not_deleted")
def _verify_not_deleted(c):
    return [] if not c.row["deleted"] else [
        f"Campaign {c.id} is deleted and cannot be sent any more: create a new campaign."
    ], f"Campaign {c.id} is not deleted."


@_verify_check("sender_profile")
def _verify_profile(c):
    pid = c.profile_id
    other = f"point the {c.kind} at another one with POST {c.path} and accountprofile"
    if c.profile is not None:
        problems = []
    elif c.profile_row is not None:
        problems = [f"Sender profile {pid} is deleted: {other}."]
    else:
        problems = [f"Sender profile {pid} does not exist: create it with "
                    f"PUT /v1/accountprofile/{pid} (fromname, fromaddress) or {other}."]
    return problems, f"Sender profile {pid} exists."


@_verify_check("sender_address")
def _verify_profile_address(c):
    pid = c.profile_id
    return [] if c.profile_address else [
        f"Sender profile {pid} has no valid from address: set fromaddress with "
        f"POST /v1/accountprofile/{pid}." if c.profile is not None else
        f"There is no sender profile {pid} to send as: the campaign needs one with a valid "
        "fromaddress (see sender_profile)."], f"Sender profile {pid} sends as {c.profile_address}."


@_verify_check("campaign_messages")
def _verify_links(c):
    return [] if c.links else [
        f"Campaign {c.id} has no messages: link a message to a segment with "
        f"PUT /v1/campaign/{c.id}/message/0 (segment, message)."
    ], f"Campaign {c.id} has {len(c.links)} campaign message(s)."


@_verify_check("links_in_use")
def _verify_links_in_use(c):
    return [
        f"{_label(kind, row).capitalize()} is deleted: remove campaign message {link['id']} "
        f"(DELETE /v1/campaign/{c.id}/message/{link['id']}) or link another {kind} instead."
        for link in c.links
        for kind, row in (*(("message", c.messages[m]) for m in _versions(link)),
                          ("segment", c.segments[link["segment"]]))
        if row["deleted"]], "No linked message, variant or segment is deleted."


@_verify_check("message_subject")
def _verify_subjects(c):
    return [f"{_label('message', m).capitalize()} has no subject: set subject with "
            f"POST /v1/message/{m['id']}." for m in c.messages.values() if not m["subject"].strip()
            ], "Every message has a subject."


@_verify_check("message_from")
def _verify_from(c):
    return [
        f"{_label('message', m).capitalize()} has no valid from address: set fromaddress on "
        f"the message (POST /v1/message/{m['id']}) or on sender profile {c.profile_id}."
        for m in c.messages.values()
        if not (_normalize_email(m["fromaddress"]) if m["fromaddress"] else c.profile_address)
    ], "Every message has a valid from address (its own or the sender profile's)."


@_verify_check("message_body")
def _verify_bodies(c):
    return [f"{_label('message', m).capitalize()} has no body: set html and/or text with "
            f"POST /v1/message/{m['id']}." for m in c.messages.values()
            if not (m["html"].strip() or m["text"].strip())], "Every message has a body."


@_verify_check("template_found")
def _verify_template_found(c):
    problem = c.template_problem
    return [str(problem)] if problem and problem.check == "template_found" else [], (
        f"The template '{c.row['defaulttemplate']}' is there." if c.row["defaulttemplate"]
        else f"The {c.kind} has no template (defaulttemplate '').")


@_verify_check("template_content")
def _verify_template_content(c):
    problem = c.template_problem
    if not c.row["defaulttemplate"]:
        passed = f"The {c.kind} has no template (defaulttemplate '')."
    elif problem:
        passed = "The template's content could not be checked (see template_found)."
    else:
        passed = "The template holds {{content}} once in each body it has."
    return [str(problem)] if problem and problem.check == "template_content" else [], passed


@_verify_check("unsubscribe_link")
def _verify_unsubscribe_links(c):
    # In the message or in its template: the link usually lives in the footer.
    return [
        f"The {part} body of {_label('message', m)} has no {{{{unsubscribe_url}}}} merge tag "
        f"(nor does its template): add an unsubscribe link to it, e.g. {example}."
        for m in c.messages.values() for sent in [c.bodies(m)]
        for part, example in (("html", '<a href="{{unsubscribe_url}}">Unsubscribe</a>'),
                              ("text", "'Unsubscribe: {{unsubscribe_url}}'"))
        if (m[part].strip() or not (m["html"].strip() or m["text"].strip()))
        and "unsubscribe_url" not in _merge_tags(sent[part])
    ], "Every message body carries {{unsubscribe_url}}."


@_verify_check("merge_tags")
def _verify_merge_tags(c):
    """Merge tags that a message uses and the datasources of a segment it is
    sent to lack as fields."""
    problems = []
    for link, version in ((link, version) for link in c.links for version in _versions(link)):
        message, segment = c.messages[version], c.segments[link["segment"]]
        known = {"email", "unsubscribe_url"}
        for datasource in _rows_by_id(c.conn, "datasource", json.loads(segment["datasources"]),
                                      segment["owner"]):
            known.update(_datasource_fields(c.conn, datasource))
        unknown = sorted(set().union(_merge_tags(message["subject"]), *map(
            _merge_tags, c.bodies(message).values())) - known)
        if unknown:
            tags = ", ".join(f"{{{{{tag}}}}}" for tag in unknown)
            problems.append(
                f"{_label('message', message).capitalize()} uses {tags}, which no datasource of "
                f"{_label('segment', segment)} has as a field: add the field to the datasource "
                f"or correct the tag (POST /v1/message/{message['id']}).")
    return problems, ("Every merge tag names email, unsubscribe_url or a field of the segment's "
                      "datasources.")


@_verify_check("variants")
def _verify_variants(c):
    """A/B tests: the metric needs tracking, and each version is counted by
    its emails, so it is sent by its link alone."""
    tested = [link for link in c.links if len(_versions(link)) > 1]
    problems = [] if not tested or c.row["tracking"] else [
        f"Campaign {c.id} tests variants, whose winner is chosen by opens or clicks: turn "
        f"tracking on with POST /v1/campaign/{c.id} and tracking '1'."]
    for link in tested:
        for other in c.links:
            shared = sorted(set(_versions(link)) & set(_versions(other)))
            if other["id"] != link["id"] and shared and (
                    other["id"] > link["id"] or other not in tested):
                problems.append(
                    f"Message {shared[0]} is tested by campaign message {link['id']} and sent "
                    f"by campaign message {other['id']} too: a tested version belongs to one "
                    f"link (change one with POST /v1/campaign/{c.id}/message/{other['id']}).")
    return problems, (f"{len(tested)} campaign message(s) test variants, with tracking on."
                      if tested else "No campaign message tests variants.")


@_verify_check("segment_recipients")
def _verify_segment_sizes(c):
    sizes = {s["id"]: _segment_size(c.conn, s) for s in c.segments.values()}
    return [f"{_label('segment', s).capitalize()} has no active recipients: import recipients "
            "into its datasources or loosen its conditions." for s in c.segments.values()
            if not sizes[s["id"]]], "Every segment has active recipients (" + ", ".join(
                f"segment {s}: {n}" for s, n in sizes.items()) + ")."


@_verify_check("segment_definition")
def _verify_segment_definitions(c):
    problems = []
    for segment in c.segments.values():
        label = _label("segment", segment).capitalize()
        fix = f"POST /v1/segment/{segment['id']}"
        datasources = json.loads(segment["datasources"])
        if not datasources:
            problems.append(f"{label} has no datasources: set datasources with {fix}.")
            continue
        fields = set()
        for row in _rows_by_id(c.conn, "datasource", datasources, segment["owner"]).values():
            if row["deleted"]:
                problems.append(f"{label} uses datasource {row['id']}, which is deleted: "
                                f"set its datasources again with {fix}.")
            else:
                fields.update(_datasource_fields(c.conn, row["id"]))
        for condition in json.loads(segment["conditions"]):
            name = condition["field"]
            if name.lower() != "email" and name.lower() not in fields:
                problems.append(f"{label} has a condition on the field '{name}', which none of "
                                f"its datasources has (renamed or removed?): correct its "
                                f"conditions with {fix}.")
    return problems, "Every segment uses live datasources and fields that exist."


def _non_ascii_sql(conn, segment):
    """``(sql, params)``: how many addresses of a segment have characters
    beyond ASCII, and the least of them.  The few such rows first, from their
    partial index (recipient_non_ascii): given the segment's WHERE at once,
    the planner may take the index of a field its condition compares and read
    every row of that value."""
    where, params = _segment_query(conn, segment)
    return ("WITH odd AS MATERIALIZED (SELECT id FROM recipient WHERE status = 'active' AND "
            f"datasource IN ({conn.sql['json_ids'].format(array='?')}) AND "
            f"{conn.sql['non_ascii'].format(expr='email')}) "
            "SELECT count(DISTINCT lower(r.email)), min(r.email) FROM recipient r "
            f"WHERE r.id IN (SELECT id FROM odd) AND {where}", (segment["datasources"], *params))


@_verify_check("non_ascii_addresses")
def _verify_non_ascii(c):
    """A warning, never a failure: whether such an address can be sent
    depends on the relay (SMTPUTF8), which is known only when sending."""
    notes = []
    for segment in c.segments.values():
        count, example = c.conn.execute(*_non_ascii_sql(c.conn, segment)).fetchone()
        if count:
            notes.append(f"{_label('segment', segment).capitalize()} holds {count} address(es) "
                         f"with non-ASCII characters (such as {example}).")
    if not notes:
        return [], "No segment holds an address with non-ASCII characters."
    return [], ("Warning: " + " ".join(notes) + " They are sent only when the SMTP relay offers "
                "SMTPUTF8; otherwise each fails, counted in the batch's failed figure.")


@_verify_check("archive_email")
def _verify_archive_email(c):
    archive = c.row["archiveemail"]
    return [] if not archive or _normalize_email(archive) else [
        f"The archive address '{archive}' of campaign {c.id} is not a valid email address: "
        f"correct it, or clear it with archiveemail '', with POST /v1/campaign/{c.id}."
    ], "The archive address is empty or valid."


@_verify_check("reply_to")
def _verify_reply_to(c):
    return [f"The replyto '{row['replyto']}' of {_label(kind, row)} is not a valid email "
            f"address: correct it with POST {path}." for kind, row, path in c.senders()
            if row["replyto"] and not _normalize_email(row["replyto"])
            ], "Every reply-to address is empty or valid."


@_verify_check("header_line_breaks")
def _verify_header_line_breaks(c):
    return [f"The {column} of {_label(kind, row)} holds a line break, which would break the "
            f"email's headers: set it again on one line with POST {path}."
            for kind, row, path in c.senders() for column in _HEADER_COLUMNS
            if column in row.keys() and ("\r" in row[column] or "\n" in row[column])
            ], "No header value holds a line break."


def verify_campaign(conn, account, campaign_id, templates_dir="", *, settings=None):
    """Check whether campaign ``campaign_id`` can be sent; the verify record.

    Every check of _VERIFY_CHECKS is always listed, with ``passed`` '1' or '0'
    and a message that says what to fix and how.  Sending refuses a campaign
    whose record says ``passed: '0'`` (409 verification_failed, with the checks).

    :param conn: a connection (see connect()).
    :param account: the id of the account that owns the campaign (404 if not).
    :param campaign_id: the campaign to check.
    :param templates_dir: where template files named by defaulttemplate are.
    :param settings: what the deliverability checks (size, links, spam) use:
        ``public_url`` and ``secret`` (the links of the emails they build),
        ``links`` (check every link), ``webhook_allow_private``,
        ``spamassassin``, ``spam_threshold``; None: their defaults.
    """
    return _Campaign(conn, account, campaign_id, templates_dir, settings).report(_VERIFY_CHECKS)



# ---------------------------------------------------------------------------
# The archive page: a campaign's or a batch's figures as people see them
# (an archive record asked for by a browser), with the timeline's chart
# ---------------------------------------------------------------------------

_FIGURES = (("recipients", "Recipients"), ("sent", "Sent"), ("failed", "Failed"),
            ("bounced", "Bounced"), ("complained", "Complaints"),
            ("unsubscribed", "Unsubscribed"), ("opened", "Opened (people)"),
            ("opens", "Opens"), ("clicked", "Clicked (people)"), ("clicks", "Clicks"))
#: Beyond this many hours the chart shows days.
_CHART_HOURS = 24 * 31
_ARCHIVE_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body{{font:16px/1.5 system-ui,sans-serif;max-width:60em;margin:0 auto;padding:1em;color:#1f2328}}
h1{{font-size:1.5em;margin:.2em 0 .8em}} h2{{font-size:1.15em;margin:1.6em 0 .5em}}
.figures{{display:grid;grid-template-columns:repeat(auto-fill,minmax(9em,1fr));gap:.6em;margin:0}}
.figures div{{background:#f6f8fa;border-radius:8px;padding:.6em .8em}}
.figures dt{{font-size:.85em;color:#57606a}} .figures dd{{margin:0;font-size:1.5em;font-weight:600}}
figure{{margin:0}} svg{{width:100%;height:auto;display:block}}
@media (max-width:40em){{.chart svg{{font-size:24px}} .chart .alt{{display:none}}}}
.legend{{font-size:.9em;color:#57606a}} .key{{display:inline-block;width:.8em;height:.8em;margin:0 .3em 0 1em;border-radius:2px}}
table{{border-collapse:collapse;width:100%;font-size:.95em}}
th,td{{text-align:left;padding:.35em .5em;border-bottom:1px solid #d0d7de}} td.n,th.n{{text-align:right}}
td.url{{word-break:break-all}} details{{margin-top:.8em}}
caption{{text-align:left;font-weight:600;margin:.8em 0 .3em}} tr.winner{{background:#dafbe1}}
.tests{{overflow-x:auto}} .tests table{{font-size:.85em}} .tests th,.tests td{{padding:.35em .25em}}
.tests td{{overflow-wrap:anywhere}} .tests .n{{white-space:nowrap}}
</style></head>
<body><main>
<h1>{title}</h1>
<dl class="figures">{figures}</dl>
<h2 id="chart-title">Opens and clicks per {unit}</h2>
{chart}
<h2>Links</h2>
{links}
{tests}
</main></body></html>
"""


def _count(value):
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _timeline_buckets(timeline):
    """[(label, opens, clicks)] per hour from the first to the last hour of
    ``timeline``, hours without events included (a gap is news too); per day
    when that would be more than a month of hours.  Returns (unit, buckets)."""
    counts = {}
    for point in timeline or ():
        try:
            hour = datetime.datetime.strptime(str(point.get("hour"))[:13], "%Y-%m-%d %H")
        except (AttributeError, ValueError):
            continue
        opens, clicks = counts.get(hour, (0, 0))
        counts[hour] = (opens + _count(point.get("opens")), clicks + _count(point.get("clicks")))
    if not counts:
        return "hour", []
    first, last = min(counts), max(counts)
    hours = int((last - first).total_seconds() // 3600) + 1
    if hours <= _CHART_HOURS:
        moments = (first + datetime.timedelta(hours=n) for n in range(hours))
        return "hour", [(moment.strftime("%Y-%m-%d %H:00"), *counts.get(moment, (0, 0)))
                        for moment in moments]
    days = {}
    for hour, (opens, clicks) in counts.items():
        total = days.setdefault(hour.date(), [0, 0])
        total[0] += opens
        total[1] += clicks
    day, buckets = first.date(), []
    while day <= last.date():
        buckets.append((day.isoformat(), *days.get(day, (0, 0))))
        day += datetime.timedelta(days=1)
    return "day", buckets


def _chart(unit, buckets):
    if not buckets:
        return '<p>No opens or clicks yet.</p>'
    width, height, left, bottom, top = 720, 240, 64, 34, 20
    plot_width, plot_height = width - left - 8, height - bottom - top
    peak = max(max(opens, clicks) for _, opens, clicks in buckets) or 1
    step = plot_width / len(buckets)
    bar = min(max(step * 0.4, 0.5), 40)   # a few buckets: bars, not walls

    def y(value):
        return top + plot_height - plot_height * value / peak

    label_every = max(1, round(len(buckets) / 6))
    parts = [
        # On a phone the chart is as wide as the screen: its words are drawn
        # larger (the CSS) and every other time label is left out.
        f'<figure><div class="chart">'
        f'<svg viewBox="0 0 {width} {height}" role="img" aria-labelledby="chart-title '
        f'chart-desc" xmlns="http://www.w3.org/2000/svg" font-size="11" '
        f'font-family="system-ui,sans-serif">',
        f'<desc id="chart-desc">Bars per {unit}: opens in blue, clicks in orange; highest '
        f'{peak}. The table below the chart holds the same numbers.</desc>',
        f'<line x1="{left}" y1="{top + plot_height}" x2="{width - 8}" y2="{top + plot_height}" '
        f'stroke="#8c959f"/>',
        f'<line x1="{left}" y1="{top}" x2="{width - 8}" y2="{top}" stroke="#d0d7de" '
        f'stroke-dasharray="3 3"/>',
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end" fill="#57606a">{peak}</text>',
        f'<text x="{left - 6}" y="{top + plot_height + 4}" text-anchor="end" '
        f'fill="#57606a">0</text>']
    for index, (label, opens, clicks) in enumerate(buckets):
        x = left + index * step + (step - 2 * bar) / 2
        label = html.escape(label)
        parts.append(
            f'<g class="bucket" data-label="{label}" data-opens="{opens}" data-clicks="{clicks}">'
            f'<title>{label}: {opens} opens, {clicks} clicks</title>'
            f'<rect class="opens" x="{x:.1f}" y="{y(opens):.1f}" width="{bar:.1f}" '
            f'height="{y(0) - y(opens):.1f}" fill="#2f81f7"/>'
            f'<rect class="clicks" x="{x + bar:.1f}" y="{y(clicks):.1f}" width="{bar:.1f}" '
            f'height="{y(0) - y(clicks):.1f}" fill="#d4700a"/>')
        if index % label_every == 0:
            text = label[5:] if unit == "hour" else label  # the year is in the table
            alt = ' class="alt"' if index // label_every % 2 else ""
            parts.append(f'<text{alt} x="{left + (index + 0.5) * step:.1f}" y="{height - 6}" '
                         f'text-anchor="middle" fill="#57606a">{text}</text>')
        parts.append("</g>")
    parts.append('</svg></div><figcaption class="legend"><span class="key" style="background:#2f81f7">'
                 '</span>opens<span class="key" style="background:#d4700a"></span>clicks'
                 '</figcaption></figure>')
    rows = "".join(f'<tr><td>{html.escape(label)}</td><td class="n">{opens}</td>'
                   f'<td class="n">{clicks}</td></tr>' for label, opens, clicks in buckets)
    parts.append(f'<details><summary>The numbers per {unit}</summary><table><thead><tr>'
                 f'<th scope="col">{unit.capitalize()} (UTC)</th><th class="n" scope="col">Opens'
                 f'</th><th class="n" scope="col">Clicks</th></tr></thead><tbody>{rows}'
                 f'</tbody></table></details>')
    return "".join(parts)


def _archive_page(archive_record, title):
    """An archive (or batch archive) with its statistics as a page for a
    person: the figures, a chart of opens and clicks over time (inline SVG,
    nothing loaded from elsewhere) and the links with their clicks.

    :param archive_record: the archive record (counts as
        strings; ``links`` [{url, clicks, clicked}]; ``timeline`` [{hour,
        opens, clicks}]).  Every value is escaped.
    :param title: the page's heading, plain text.
    """
    record = archive_record or {}
    figures = "".join(
        f'<div><dt>{label}</dt><dd data-figure="{name}">{html.escape(str(record.get(name, "0")))}'
        f'</dd></div>' for name, label in _FIGURES)
    rows = "".join(
        f'<tr><td class="url">{html.escape(str(link.get("url", "")))}</td>'
        f'<td class="n">{html.escape(str(link.get("clicks", "0")))}</td>'
        f'<td class="n">{html.escape(str(link.get("clicked", "0")))}</td></tr>'
        for link in record.get("links") or () if isinstance(link, dict))
    link_table = ('<table><thead><tr><th scope="col">Link</th><th class="n" scope="col">Clicks'
                  '</th><th class="n" scope="col">People</th></tr></thead>'
                  f'<tbody>{rows}</tbody></table>') if rows else "<p>No tracked links.</p>"
    unit, buckets = _timeline_buckets(record.get("timeline"))
    return _ARCHIVE_PAGE.format(title=html.escape(str(title)), figures=figures, unit=unit,
                                chart=_chart(unit, buckets), links=link_table,
                                tests=_tests_section(record))


def _tests_section(record):
    """The A/B tests of the archive's batches as tables: each version's
    subject and figures, the winner marked.  Every value is escaped; parts
    that are not as the records make them are left out."""
    def text(value):
        return html.escape(str(value if value is not None else ""))

    def listed(value):
        return [item for item in value if isinstance(item, dict)] \
            if isinstance(value, list) else []

    parts = []
    for batch in listed(record.get("batches")):
        for item in listed(batch.get("tests")):
            test = item.get("test") if isinstance(item.get("test"), dict) else {}
            winner = test.get("winner") or None
            rows = "".join(
                f'<tr{" class=winner" if v.get("message") == winner else ""}>'
                f'<td>{text(v.get("subject"))}'
                f'{" <strong>(winner)</strong>" if v.get("message") == winner else ""}</td>'
                + "".join(f'<td class="n">{text(v.get(name))}</td>'
                          for name in ("sent", "opened", "clicked", "rate")) + "</tr>"
                for v in listed(test.get("versions")))
            chosen = (f"chosen {'by hand' if test.get('decided') == 'manual' else 'automatically'}"
                      f" at {text(test.get('decidedat'))}" if test.get("decided")
                      else "testing, no winner yet")
            parts.append(
                f'<table data-test="{text(item.get("link"))}"><caption>Batch '
                f'{text(batch.get("id"))}, campaign message {text(item.get("link"))}: '
                f'{chosen}</caption><thead><tr><th scope="col">Version (subject)</th>'
                '<th class="n" scope="col">Sent</th><th class="n" scope="col">Opened</th>'
                '<th class="n" scope="col">Clicked</th><th class="n" scope="col">Rate</th></tr>'
                f'</thead><tbody>{rows}</tbody></table>')
    return '<section class="tests"><h2>A/B tests</h2>' + "".join(parts) + "</section>" \
        if parts else ""


# ---------------------------------------------------------------------------
# Sending: batches, process_due, archives
# ---------------------------------------------------------------------------

def _campaign_send(call, child_id):
    parent_id = call.parent["id"]
    if "test" in call.params:
        return _test_send(call, child_id, call.params["test"])
    if "timestamp" not in call.params:
        raise MissingParameter("Missing required parameter: timestamp (or test, a list of "
                               "addresses, for a test send).", field=["timestamp"])
    when = _parse_timestamp(call.get("timestamp"))
    _verified(call, parent_id)
    batch = _insert_record(call.conn, "batch", child_id, {
        "campaign": parent_id, "timestamp": when, "status": "scheduled",
        "base_url": call.base_url, "created": _now()})
    return {"id": str(batch)}


def _campaign_winner(call, child_id):
    """Choose the winner of a link's A/B test in batch ``child_id`` by hand,
    before the worker does: it is queued for the recipients who wait."""
    campaign_id, link, message = call.parent["id"], call.get("link"), call.get("message")
    batch = call.conn.execute("SELECT * FROM batch WHERE id = ? AND campaign = ?",
                              (child_id, campaign_id)).fetchone()
    if batch is None:
        raise NotFound(f"Campaign {campaign_id} has no batch {child_id}.")
    test = call.conn.execute("SELECT * FROM batch_test WHERE batch = ? AND link = ?",
                             (child_id, link)).fetchone()
    if test is None:
        raise NotFound(f"Batch {child_id} tests no campaign message {link}.", field="link")
    if test["decided"]:
        raise Conflict(f"The winner of campaign message {link} in batch {child_id} was chosen "
                       f"already ({test['decided']}, {test['decidedat']}): message "
                       f"{test['winner']}.")
    if batch["status"] != "testing":
        raise Conflict(f"Batch {child_id} is {batch['status']}, not testing: no winner to choose.")
    if message not in json.loads(test["versions"]):
        raise Conflict(f"Message {message} is not a version of campaign message {link} in batch "
                       f"{child_id} (versions: {', '.join(map(str, json.loads(test['versions'])))}).",
                       field="message")
    if not _choose_winner(call.conn, child_id, link, _now(), message):
        raise Conflict(f"The winner of campaign message {link} in batch {child_id} was chosen "
                       "meanwhile, or the batch was cancelled.")
    return True


def _verified(call, campaign_id, only=None):
    """Refuse (409 verification_failed, with the checks) a campaign that fails
    verify; ``only``: the names of the checks that count."""
    _refuse_failing(verify_campaign(call.conn, call.account, campaign_id,
                                    call.service.config["templates_dir"],
                                    settings=_verify_settings(call)),
                    f"Campaign {campaign_id}", only)


def _refuse_failing(report, what, only=None):
    """409 verification_failed, with the checks, unless ``report`` (a verify
    record) passes; ``only``: the names of the checks that count."""
    failing = [check for check in report["checks"] if check["passed"] != "1"
               and (only is None or check["check"] in only)]
    if failing:
        raise VerificationFailed(
            f"{what} fails verification: " + " ".join(
                check["message"] for check in failing), checks=report["checks"])


def process_due(db, now=None, on_event=None, *, templates_dir=""):
    """Make every batch that is due: queue one email per address in the outbox.

    Recipients are resolved in SQL: the campaign's segments in priority order,
    one email per address across segments and datasources (the outbox's unique
    (batch, address) index keeps the first), unsubscribed and bounced
    addresses skipped; the links with variants start their A/B test (see
    _make_batch()), and tests whose time has come get their winner
    (_choose_winner()).  Each batch is made in one transaction, so a crash
    leaves it to be made again whole, and the unique index means a second run
    never queues an address twice.  Also marks sending batches whose emails
    are all delivered as sent.  Raises ``batch.started`` and ``batch.sent``
    in the transactions that make and finish a batch.

    :param db: the database path (or an open connection).
    :param now: the current time, 'YYYY-MM-DD HH:MM:SS' UTC (tests pass it).
    :param on_event: the application's callback ``on_event(kind, payload)``,
        called after each of those transactions has committed (see emit()).
    :param templates_dir: where template files named by defaulttemplate are.
    :returns: the number of batches made.
    """
    pending = [] if on_event else None
    with _opened(db) as conn:
        now = now or _now()
        made = 0
        while True:
            batch = conn.execute("SELECT * FROM batch WHERE status = 'scheduled' AND timestamp <= ? "
                                 "ORDER BY timestamp, id LIMIT 1", (now,)).fetchone()
            if batch is None:
                break
            with transaction(conn):
                # Looked at before the write lock: another process may have
                # made or cancelled it since.  Only a batch still scheduled is made
                # (on PostgreSQL the row lock makes another maker wait, then skip it).
                batch = conn.execute("SELECT * FROM batch WHERE id = ? AND status = 'scheduled' "
                                     f"{conn.sql['for_update']}", (batch["id"],)).fetchone()
                if batch is not None:
                    _make_batch(conn, batch, now, pending, templates_dir)
                    made += 1
            if pending:
                _run_callbacks(on_event, pending)
        for test in conn.execute(
                "SELECT t.batch, t.link FROM batch_test t JOIN batch b ON b.id = t.batch "
                "WHERE t.decided = '' AND t.due <= ? AND b.status = 'testing' ORDER BY t.due",
                (now,)).fetchall():
            with transaction(conn):   # one choice a transaction; a second maker skips it
                _choose_winner(conn, test["batch"], test["link"], now)
        # The worker calls this every second: take the write lock only when
        # some batch is still sending.
        if conn.execute("SELECT 1 FROM batch WHERE status = 'sending' LIMIT 1").fetchone():
            with transaction(conn):
                for batch in conn.execute(
                        "UPDATE batch SET status = 'sent', finished = ? WHERE status = 'sending' "
                        "AND NOT EXISTS (SELECT 1 FROM outbox WHERE outbox.batch = batch.id "
                        "AND outbox.status IN ('queued', 'sending')) RETURNING *",
                        (now,)).fetchall():
                    _batch_event(conn, batch, "batch.sent", pending)
            if pending:
                _run_callbacks(on_event, pending)
        return made


def _batch_event(conn, batch, kind, pending):
    """Raise ``kind`` for the batch row, with its record (without messages)."""
    owner = conn.execute("SELECT owner FROM campaign WHERE id = ?",
                         (batch["campaign"],)).fetchone()[0]
    emit(conn, owner, kind, _batch_record(conn, batch, with_messages=False), pending)


def _make_batch(conn, batch, now, pending=None, templates_dir=""):
    campaign = conn.execute("SELECT * FROM campaign WHERE id = ?", (batch["campaign"],)).fetchone()
    account = campaign["owner"]
    why = "campaign %s is deleted or disabled" if campaign["deleted"] or not campaign["enabled"] \
        else None
    template = None
    if why is None:
        try:  # read once for the whole batch
            template = _campaign_template(conn, account, campaign["defaulttemplate"],
                                         templates_dir)
        except _TemplateUnusable as problem:
            why = "campaign %s cannot use its template: " + str(problem).replace("%", "%%")
    if why is not None:
        conn.execute("UPDATE batch SET status = 'cancelled', finished = ? WHERE id = ?",
                     (now, batch["id"]))
        _log.warning("batch %s cancelled: " + why, batch["id"], campaign["id"])
        return
    tests = []
    drawn = set()   # the datasources of its segments, for their public archives
    for link in _campaign_links(conn, campaign["id"]):
        segment = conn.execute("SELECT * FROM segment WHERE id = ? AND owner = ?",
                               (link["segment"], account)).fetchone()
        drawn.update(int(datasource) for datasource in json.loads(segment["datasources"]))
        versions = _versions(link)
        # A tested link's recipients all wait at first (after priority and
        # one email an address, like any link's); _start_test() picks the test.
        enqueue(conn, account, "campaign", batch=batch["id"], message=link["message"],
                recipients=_segment_members(conn, segment), now=now,
                status="waiting" if len(versions) > 1 else None)
        for version in versions:
            _archive_message(conn, campaign, batch, version, template)
        if len(versions) > 1:
            tests.append((link["id"], versions))
    conn.executemany("INSERT INTO batch_datasource (datasource, batch) VALUES (?, ?) "
                     "ON CONFLICT DO NOTHING", [(ds, batch["id"]) for ds in sorted(drawn)])
    if campaign["tracking"]:
        _store_links(conn, batch["id"])
    queued = conn.execute("SELECT count(*) FROM outbox WHERE batch = ? AND kind = 'campaign'",
                          (batch["id"],)).fetchone()[0]
    conn.execute("UPDATE batch SET status = ?, recipients = ?, tracking = ? WHERE id = ?",
                 ("testing" if tests else "sending", queued, campaign["tracking"], batch["id"]))
    for link_id, versions in tests:
        _start_test(conn, campaign, batch["id"], link_id, versions, now)
    _batch_event(conn, conn.execute("SELECT * FROM batch WHERE id = ?", (batch["id"],)).fetchone(),
                 "batch.started", pending)
    _log.info("batch %s of campaign %s: %s emails queued", batch["id"], campaign["id"], queued)


# A/B tests (section 18) ---------------------------------------------------------

#: The stable hash of (batch, recipient) that orders a tested link's
#: recipients: the same on both engines and in every run, so a worker that
#: makes the batch again after a crash makes the same split.  x mixes the two
#: ids below 2**31 - 1, x * x (under 2**62) scatters neighbouring ids.
_TEST_HASH = ("((outbox.recipient % 2147483647 * 48271 + {batch} % 2147483647 * 69621 + 1) "
              "% 2147483647 * ((outbox.recipient % 2147483647 * 48271 + {batch} % 2147483647 "
              "* 69621 + 1) % 2147483647) % 2147483647)")


def _start_test(conn, campaign, batch_id, link_id, versions, now):
    """Start the test of one link, whose recipients wait (outbox status
    'waiting', the link's message): ``testsize`` percent of them (rounded,
    half up), first by _TEST_HASH, are queued, shared among the versions in
    turn (their counts differ by one at most); the rest wait for the winner.
    With nobody in the share the link's own message goes to everyone now."""
    waiting = conn.execute("SELECT count(*) FROM outbox WHERE batch = ? AND status = 'waiting' "
                           "AND message = ?", (batch_id, versions[0])).fetchone()[0]
    share = (waiting * campaign["testsize"] + 50) // 100
    conn.execute("INSERT INTO batch_test (batch, link, versions, metric, due) "
                 "VALUES (?, ?, ?, ?, ?)", (batch_id, link_id, json.dumps(versions),
                                            campaign["testmetric"],
                                            _shift(now, campaign["testwait"])))
    if not share:
        _choose_winner(conn, batch_id, link_id, now, versions[0], "auto")
        return
    cases = " ".join(f"WHEN {index} THEN {int(message)}" for index, message in enumerate(versions))
    conn.execute(
        f"UPDATE outbox SET status = 'queued', message = CASE t.turn % {len(versions)} {cases} "
        "END FROM (SELECT id, row_number() OVER (ORDER BY "
        f"{_TEST_HASH.format(batch=int(batch_id))}, id) - 1 AS turn FROM outbox "
        "WHERE batch = ? AND status = 'waiting' AND message = ?) t "
        "WHERE outbox.id = t.id AND t.turn < ?", (batch_id, versions[0], share))


def _test_figures(conn, batch_id, versions, metric):
    """The versions of a test as the batch archive shows them: ``[{message,
    sent, opened, clicked, rate}]`` (rate: unique opens, or unique clicks,
    over emails sent; a click counts as an open, as in 'opened'), read from
    the outbox and the event table."""
    marks = ", ".join("?" * len(versions))
    sent = dict(conn.execute(
        f"SELECT message, count(*) FROM outbox WHERE batch = ? AND status = 'sent' "
        f"AND message IN ({marks}) GROUP BY message", (batch_id, *versions)).fetchall())
    events = {row[0]: row[1:] for row in conn.execute(
        "SELECT o.message, count(DISTINCT e.outbox), count(DISTINCT e.outbox) FILTER "
        "(WHERE e.kind = 'click') FROM event e JOIN outbox o ON o.id = e.outbox "
        "WHERE e.batch = ? AND e.kind IN ('open', 'click') GROUP BY o.message", (batch_id,))}
    figures = []
    for message in versions:
        opened, clicked = events.get(message, (0, 0))
        count = sent.get(message, 0)
        rate = fractions.Fraction(opened if metric == "opens" else clicked, count or 1)
        figures.append({"message": message, "sent": count, "opened": opened,
                        "clicked": clicked, "rate": rate})
    return figures


def _choose_winner(conn, batch_id, link_id, now, winner=None, how="manual"):
    """Inside a transaction: choose the winner of a link's test (by hand:
    ``winner``; else the highest rate, a tie to the earlier version) and
    queue it for the recipients who wait; the batch sends on when its last
    test is chosen.  Returns False when the choice was made already (by
    another worker, or by hand) or the batch no longer tests (cancelled).
    Locks the batch's row first, as making and cancelling it do."""
    batch = conn.execute(f"SELECT status FROM batch WHERE id = ? {conn.sql['for_update']}",
                         (batch_id,)).fetchone()
    if batch is None or batch["status"] != "testing":
        return False
    test = conn.execute("SELECT * FROM batch_test WHERE batch = ? AND link = ? AND decided = '' "
                        f"{conn.sql['for_update']}", (batch_id, link_id)).fetchone()
    if test is None:
        return False
    versions = json.loads(test["versions"])
    figures = _test_figures(conn, batch_id, versions, test["metric"])
    if winner is None:
        how = "auto"   # max() keeps the first of equal rates
        winner = max(figures, key=lambda version: version["rate"])["message"]
    result = [{**version, "rate": _version_rate_text(version["rate"])} for version in figures]
    conn.execute("UPDATE batch_test SET winner = ?, decided = ?, decidedat = ?, result = ? "
                 "WHERE batch = ? AND link = ?",
                 (winner, how, now, json.dumps(result), batch_id, link_id))
    conn.execute("UPDATE outbox SET status = 'queued', message = ?, next_try = ? "
                 "WHERE batch = ? AND status = 'waiting' AND message = ?",
                 (winner, now, batch_id, versions[0]))
    conn.execute("UPDATE batch SET status = 'sending' WHERE id = ? AND status = 'testing' "
                 "AND NOT EXISTS (SELECT 1 FROM batch_test WHERE batch = ? AND decided = '')",
                 (batch_id, batch_id))
    _log.info("batch %s, campaign message %s: message %s wins (%s)", batch_id, link_id, winner,
              how)
    return True


def _version_rate_text(rate):
    return f"{float(rate):.4f}"


def _batch_tests(conn, batch_id):
    """The batch archive's ``tests``: per tested link ``{link, test {versions
    [{message, subject, sent, opened, clicked, rate}], winner, decided,
    decidedat}}``; the figures live until the choice, then as they were at it."""
    tests = []
    for test in conn.execute("SELECT * FROM batch_test WHERE batch = ? ORDER BY link",
                             (batch_id,)).fetchall():
        versions = json.loads(test["versions"])
        figures = json.loads(test["result"]) if test["result"] else [
            {**version, "rate": _version_rate_text(version["rate"])}
            for version in _test_figures(conn, batch_id, versions, test["metric"])]
        subjects = dict(conn.execute(
            "SELECT message, subject FROM batch_message WHERE batch = ?", (batch_id,)).fetchall())
        tests.append({"link": str(test["link"]), "test": {
            "versions": [{"message": str(version["message"]),
                          "subject": subjects.get(version["message"], ""),
                          **{name: str(version[name]) for name in ("sent", "opened", "clicked")},
                          "rate": version["rate"]} for version in figures],
            "winner": str(test["winner"] or ""), "decided": test["decided"],
            "decidedat": test["decidedat"] or ""}})
    return tests


def _archive_message(conn, campaign, batch, message_id, template=None):
    """Keep the message as this batch sends it (in its template, CSS
    inlined), and mail a copy to archiveemail.  Delivery builds every email
    of the batch from this copy.

    Per-recipient merge tags stay visible as tags: the archive shows what
    every recipient got, not one recipient's data."""
    message = conn.execute("SELECT * FROM message WHERE id = ? AND owner = ?",
                           (message_id, campaign["owner"])).fetchone()
    if conn.execute("SELECT 1 FROM batch_message WHERE batch = ? AND message = ?",
                    (batch["id"], message_id)).fetchone():
        return  # linked to two segments: prepared once
    sent = _prepare_message(message, template)
    conn.execute("INSERT INTO batch_message (batch, message, subject, html, text) "
                 "VALUES (?, ?, ?, ?, ?)",
                 (batch["id"], message_id, sent["subject"], sent["html"], sent["text"]))
    if campaign["archiveemail"]:
        enqueue_email(conn, campaign["owner"], campaign["archiveemail"],
                      f"[archive] {sent['subject']}", sent["text"], kind="archive",
                      html=sent["html"])


def _store_links(conn, batch_id):
    """Prepare each message of a tracked batch for tracking, once: its html
    as the batch sends it rewritten by track_html() and kept with the batch
    (delivery fills only the recipient's values and tokens into it), and its
    links kept by index: a click token names (email, index) and redirects
    only to the URL kept here."""
    for message in conn.execute("SELECT message, html FROM batch_message WHERE batch = ?",
                                (batch_id,)).fetchall():
        tracked, links = _track_html(message["html"])
        conn.execute("UPDATE batch_message SET tracked = ? WHERE batch = ? AND message = ?",
                     (tracked, batch_id, message["message"]))
        conn.executemany(
            "INSERT INTO batch_link (batch, message, link, url) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            [(batch_id, message["message"], index, url) for index, url in enumerate(links)])


#: The statistics of an archive and a batch archive that are counts, in the
#: order the records show them (links and timeline follow).
_STATISTICS = ("recipients", "sent", "failed", "bounced", "complained", "unsubscribed", "opened",
              "opens", "clicked", "clicks")


def _event_figures(conn, where, args):
    """The counts of the statistics events ``where`` (SQL on ``event``): one
    statement.  'opened' counts the emails opened or clicked (a click is an
    open whose image was blocked), 'clicked' the emails clicked; the others
    count events.  Every event of an email names its batch, so per batch an
    email is a recipient."""
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE kind = 'bounce'), count(*) FILTER (WHERE kind = 'complaint'), "
        "count(*) FILTER (WHERE kind = 'unsubscribe'), "
        "count(DISTINCT outbox) FILTER (WHERE kind = 'open' OR kind = 'click'), "
        "count(*) FILTER (WHERE kind = 'open'), count(DISTINCT outbox) FILTER (WHERE kind = 'click'), "
        f"count(*) FILTER (WHERE kind = 'click') FROM event WHERE {where}", args).fetchone()
    return dict(zip(_STATISTICS[3:], row))


def _batch_statistics(conn, batch):
    """The statistics of one batch as numbers: a few statements, each read
    from one index (outbox_batch, event_batch) however many emails it sent."""
    # Only campaign emails name a batch, so (batch, status) is all it reads.
    queued, sent, failed = conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE status = 'sent'), "
        "count(*) FILTER (WHERE status = 'failed') FROM outbox WHERE batch = ?",
        (batch["id"],)).fetchone()
    figures = {"recipients": batch["recipients"], "queued": queued, "sent": sent,
               "failed": failed, **_event_figures(conn, "batch = ?", (batch["id"],))}
    # Every link of the batch, clicked or not; one URL in two messages is one link.
    links = {row["url"]: [0, 0] for row in conn.execute(
        "SELECT url FROM batch_link WHERE batch = ? ORDER BY message, link", (batch["id"],))}
    for url, clicks, clicked in conn.execute(
            "SELECT l.url, count(*), count(DISTINCT e.outbox) FROM event e "
            "JOIN outbox o ON o.id = e.outbox JOIN batch_link l ON l.batch = e.batch "
            "AND l.message = o.message AND l.link = e.link "
            "WHERE e.batch = ? AND e.kind = 'click' GROUP BY l.url", (batch["id"],)):
        links[url] = [clicks, clicked]
    figures["links"] = links
    figures["timeline"] = _event_timeline(conn, "batch = ?", (batch["id"],))
    return figures


def _event_timeline(conn, where, args):
    """``{'YYYY-MM-DD HH': [opens, clicks]}`` of the events ``where`` selects."""
    return {row[0]: [row[1], row[2]] for row in conn.execute(
        "SELECT substr(created, 1, 13), count(*) FILTER (WHERE kind = 'open'), "
        f"count(*) FILTER (WHERE kind = 'click') FROM event WHERE {where} "
        "AND kind IN ('open', 'click') GROUP BY substr(created, 1, 13)", args)}


def _statistics_record(figures):
    """Statistics as the records answer them: every count a string, links
    [{url, clicks, clicked}] most clicked first, timeline [{hour, opens,
    clicks}] by hour."""
    record = {name: str(figures[name]) for name in _STATISTICS}
    record["links"] = [{"url": url, "clicks": str(clicks), "clicked": str(clicked)}
                       for url, (clicks, clicked) in sorted(
                           figures["links"].items(), key=lambda item: -item[1][0])]
    record["timeline"] = [{"hour": f"{hour}:00:00", "opens": str(opens), "clicks": str(clicks)}
                          for hour, (opens, clicks) in sorted(figures["timeline"].items())]
    return record


def _batch_record(conn, batch, with_messages=True, figures=None):
    figures = figures or _batch_statistics(conn, batch)
    record = {"id": str(batch["id"]), "campaign": str(batch["campaign"]),
              "timestamp": batch["timestamp"], "status": batch["status"],
              "queued": str(figures["queued"]), **_statistics_record(figures),
              "created": batch["created"], "finished": batch["finished"],
              "tests": _batch_tests(conn, batch["id"])}
    if with_messages:
        record["messages"] = [
            {"message": str(m["message"]), "subject": m["subject"], "html": m["html"],
             "text": m["text"]} for m in conn.execute(
                "SELECT * FROM batch_message WHERE batch = ? ORDER BY message", (batch["id"],))]
    return record


# A batch's record as the API answers it (the archive's is made of these too).
_COUNT = {"type": "string", "pattern": "^[0-9]+$"}
#: The statistics of an archive and a batch archive (_statistics_record()).
_STATISTICS_SCHEMAS = {
    **dict.fromkeys(_STATISTICS, _COUNT),
    "links": {"type": "array", "items": {
        "type": "object", "required": ["url", "clicks", "clicked"],
        "properties": {"url": {"type": "string"}, "clicks": _COUNT, "clicked": _COUNT}}},
    "timeline": {"type": "array", "items": {
        "type": "object", "required": ["hour", "opens", "clicks"],
        "properties": {"hour": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2} "
                                                            "[0-9]{2}:00:00$"},
                       "opens": _COUNT, "clicks": _COUNT}}}}
_TEST_VERSION = _record_schema("message subject sent opened clicked rate",
                               sent=_COUNT, opened=_COUNT, clicked=_COUNT,
                               rate={"type": "string", "pattern": "^[0-9]+[.][0-9]{4}$"})
_BATCH_SCHEMA = _record_schema(
    "id campaign timestamp status queued " + " ".join(_STATISTICS) + " links timeline "
    "created finished tests",
    status={"type": "string", "enum": ["scheduled", "testing", "sending", "sent", "cancelled"]},
    tests={"type": "array", "items": {
        "type": "object", "required": ["link", "test"], "properties": {
            "link": {"type": "string"},
            "test": _record_schema("versions winner decided decidedat",
                                   versions={"type": "array", "items": _TEST_VERSION},
                                   decided={"type": "string", "enum": ["", "auto", "manual"]})}}},
    **_STATISTICS_SCHEMAS)

#: How long a report link (an archive's or batch archive's reporturl) shows
#: its statistics page without a key.
_REPORT_DAYS = 30
#: The record of a batch as the archives answer it: with its report link.
_REPORTED_BATCH = {**_BATCH_SCHEMA, "required": [*_BATCH_SCHEMA["required"], "reporturl"],
                   "properties": {**_BATCH_SCHEMA["properties"],
                                  "reporturl": {"type": "string", "format": "uri"}}}


def _report_url(call, campaign, batch=0):
    """The signed, read-only link to the statistics page of a campaign (batch
    0) or of one of its batches, for a person without a key (GET
    /v1/report/{token}): it works for _REPORT_DAYS days."""
    token = sign_token(call.service.secret, "report", campaign, batch, _today() + _REPORT_DAYS)
    return f"{call.base_url}/v1/report/{token}"


BATCH = Resource("batcharchive", "batch", lambda call, row: {
                     **_batch_record(call.conn, row),
                     "reporturl": _report_url(call, row["campaign"], row["id"])},
                 parent=CAMPAIGN, parent_key="campaign", label="batch",
                 fields={**_REPORTED_BATCH,
                         "required": [*_REPORTED_BATCH["required"], "messages"],
                         "properties": {**_REPORTED_BATCH["properties"], "messages": {
                             "type": "array",
                             "items": _record_schema("message subject html text")}}})


def _archive_get(call, child_id):
    """The campaign's archive: its batches and the statistics of them all,
    each with its report link (a page with a chart for a browser)."""
    # A campaign has one archive, whose id (archiveid) is the campaign's.
    parent_id = call.parent["id"]
    if child_id not in (0, parent_id):
        raise NotFound(f"Campaign {parent_id} has no archive {child_id}; its archiveid is "
                       f"{parent_id}.")
    if _prefers_html(_request_header("Accept")):
        return _statistics_page(_campaign_archive(call.conn, parent_id),
                                f"{call.parent['name']}: what happened")
    record = _campaign_archive(call.conn, parent_id)
    for batch in record["batches"]:
        batch["reporturl"] = _report_url(call, parent_id, int(batch["id"]))
    return {"archive": {**record, "reporturl": _report_url(call, parent_id)}}


def _statistics_page(record, title):
    """An archive or batch archive record as the page with its chart."""
    return bottle.HTTPResponse(_archive_page(record, title), 200, {
        "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store"})


def _campaign_archive(conn, parent_id):
    """The archive record of campaign ``parent_id`` (without links)."""
    # Per batch, then summed: an email belongs to one batch.  Events of the
    # campaign outside its batches (an unsubscribe by a first-release link)
    # count for the whole campaign only.
    total = {name: 0 for name in _STATISTICS}
    total.update(links={}, timeline={})
    batches = []
    for row in conn.execute("SELECT * FROM batch WHERE campaign = ? ORDER BY id",
                            (parent_id,)).fetchall():
        figures = _batch_statistics(conn, row)
        batches.append(_batch_record(conn, row, with_messages=False, figures=figures))
        for name in _STATISTICS:
            total[name] += figures[name]
        for key in ("links", "timeline"):
            for name, pair in figures[key].items():
                total[key][name] = [a + b for a, b in zip(total[key].get(name, (0, 0)), pair)]
    for name, count in _event_figures(conn, "campaign = ? AND batch IS NULL",
                                      (parent_id,)).items():
        total[name] += count
    return {"id": str(parent_id), "campaign": str(parent_id), "batches": batches,
            **_statistics_record(total)}


# Preview and test sends: an email built by delivery's own code -----------------

#: A test send goes to at most this many addresses.
_MAX_TEST_ADDRESSES = 10
#: The checks of verify that a test send must pass: those about the email
#: itself.  Those about its audience (recipients, merge-tag fields, the
#: unsubscribe link, an enabled campaign) are left to the real send.
_TEST_SEND_CHECKS = ("campaign_messages", "links_in_use", "message_subject", "message_from",
                    "message_body", "template_found", "template_content", "reply_to",
                    "header_line_breaks")


def _segment_recipient(conn, segment, wanted=None):
    """A recipient row of the segment that a send would mail (active, not
    suppressed): ``wanted`` (an id or an address), else the one with the
    lowest id; None when there is none."""
    where, params = _segment_query(conn, segment)
    sql = (f"SELECT r.* FROM recipient r WHERE {where} AND NOT EXISTS (SELECT 1 FROM "
           "suppression s WHERE s.account = ? AND s.email = r.email)")
    args = [*params, segment["owner"]]
    if wanted is not None:
        number = _as_int(wanted)
        sql += " AND r.id = ?" if number is not None else " AND r.email = ?"
        args.append(number if number is not None else str(wanted).strip())
    return conn.execute(sql + " ORDER BY r.id LIMIT 1", args).fetchone()


def _usable_template(call):
    """The campaign's template bodies (or None); 409 when it cannot be used."""
    try:
        return _campaign_template(call.conn, call.account, call.parent["defaulttemplate"],
                                 call.service.config["templates_dir"])
    except _TemplateUnusable as problem:
        raise Conflict(str(problem)) from None


def _link_letter(call, link, template):
    """``(message row, Letter)`` of a campaign message, prepared as a batch
    made now would send it."""
    message = MESSAGE.find(call.conn, call.account, link["message"])
    return message, _message_letter(call.conn, call.parent, message,
                                   _prepare_message(message, template), call.base_url,
                                   _default_mail_from())


def _built_email(call, letter, recipient, to_addr):
    """The email of ``letter`` to ``to_addr`` with the merge values of
    ``recipient`` (a row; None: blank fields, {{email}} the address), as
    delivery builds it, parsed: ``{subject, html, text, headers}``."""
    values = {"email": to_addr} if recipient is None else _recipient_values(
        _datasource_fields(call.conn, recipient["datasource"]), recipient)
    # The recipient's own link when the email is theirs; a tester's names the tester.
    own = recipient is not None and recipient["email"] == to_addr
    _, raw = _recipient_email(letter, call.service.secret, to_addr, values,
                             recipient["id"] if own else None)
    # Line ends as a mail client reads them (SMTP's CRLF as LF).
    parsed = email.message_from_bytes(raw.replace(b"\r\n", b"\n"), policy=email.policy.default)
    bodies = {}
    for part in ("html", "plain"):
        body = parsed.get_body((part,))
        bodies[part] = body.get_content() if body is not None else ""
    return {"subject": str(parsed["Subject"] or ""), "html": bodies["html"],
            "text": bodies["plain"],
            "headers": {name: str(value) for name, value in parsed.items()}}


def _campaign_preview(call, child_id):
    campaign = call.parent
    link = LINK.find(call.conn, campaign["id"], child_id)
    segment = SEGMENT.find(call.conn, call.account, link["segment"])
    wanted = call.get("recipient")
    recipient = _segment_recipient(call.conn, segment, wanted)
    if recipient is None and wanted is not None:
        raise NotFound(f"There is no recipient '{wanted}' among those segment {segment['id']} "
                       "sends to (active and not suppressed).")
    if recipient is None:
        raise Conflict(f"Segment {segment['id']} has no active recipients to preview the email "
                       "for: import recipients into its datasources or loosen its conditions.")
    _, letter = _link_letter(call, link, _usable_template(call))
    built = _built_email(call, letter, recipient, recipient["email"])
    return {"preview": {"campaign": str(campaign["id"]), "link": str(link["id"]),
                        "recipient": str(recipient["id"]), **built}}


def _test_send(call, child_id, addresses):
    """Each campaign message (each version of a tested one) once to each
    address, now: prepared as a batch
    would send it and queued as kind 'test' (no batch), to be rendered at
    delivery with the merge values of its segment's first recipient."""
    if child_id != 0:   # as structure and verify: one place, at 0 (API.md section 11)
        raise NotFound("A test send makes no batch, so it has no id of its own: send it at "
                       f"/campaign/{call.parent['id']}/send/0.")
    if "timestamp" in call.params:
        raise InvalidParameter("A test send goes now: give 'test' or 'timestamp', not both.",
                               field="timestamp")
    if not 1 <= len(addresses) <= _MAX_TEST_ADDRESSES:
        raise InvalidParameter(f"'test' must list 1 to {_MAX_TEST_ADDRESSES} email addresses.",
                               field="test")
    checked = {}
    for index, address in enumerate(addresses):
        normal = _normalize_email(address)
        if normal is None:
            raise InvalidParameter(f"test[{index}] is not a valid email address.", field="test")
        checked.setdefault(normal.lower(), normal)
    campaign = call.parent
    _verified(call, campaign["id"], _TEST_SEND_CHECKS)
    template = _usable_template(call)
    for link, version in ((link, version) for link in _campaign_links(call.conn, campaign["id"])
                          for version in _versions(link)):
        segment = SEGMENT.find(call.conn, call.account, link["segment"])
        recipient = _segment_recipient(call.conn, segment)
        message = MESSAGE.find(call.conn, call.account, version)
        sent = _prepare_message(message, template)
        sender = _campaign_sender(call.conn, campaign, message)
        for address in checked.values():
            enqueue(call.conn, campaign["owner"], "test", address,
                    subject="[Test] " + sent["subject"], body=sent["text"],
                    html=sent["html"] or None, sender=sender, message=message["id"],
                    recipient=recipient["id"] if recipient else None, campaign=campaign["id"],
                    base_url=call.base_url)
    return {"id": "0"}


# ---------------------------------------------------------------------------
# Transactional email: one message to one address, now, before campaign mail
# ---------------------------------------------------------------------------

#: A transactional email's status, from its outbox email ('skipped' cannot
#: happen to one; 'bounced' when a bounce came for it, at once or later).
_TRANSACTIONAL_STATUS = (
    "CASE WHEN EXISTS (SELECT 1 FROM event e WHERE e.prepared = o.prepared AND e.kind = 'bounce' "
    "AND e.outbox = o.id) THEN 'bounced' WHEN o.status = 'skipped' THEN 'failed' "
    "ELSE o.status END")
#: When it was first opened or clicked ({kind}: 'open' or 'click').
_TRANSACTIONAL_FIRST = ("(SELECT min(e.created) FROM event e WHERE e.prepared = o.prepared "
                        "AND e.kind = '{kind}' AND e.outbox = o.id)")
_TRANSACTIONAL_STATUSES = ("queued", "sending", "sent", "failed", "bounced")


def _transactional_record(call, row):
    return {"id": str(row["id"]), "to": row["to_addr"], "message": str(row["message"]),
            "status": row["status"], "error": row["error"], "created": row["created"],
            "sent": row["sent"], "opened": row["opened"], "clicked": row["clicked"]}


def _transactional_values(call, row):
    """The checks of a transactional email before its record is written:
    ``to`` is no address the account knows as bounced or complained (it
    reaches those that unsubscribed from campaigns: it is not bulk mail), the
    message can be sent, the template wraps it."""
    conn, account, to = call.conn, call.account, call.params["to"]
    if not to:
        raise InvalidParameter("'to' is the address to send the email to.", field="to")
    known = conn.execute("SELECT reason FROM suppression WHERE account = ? AND email = ? "
                         "AND reason <> 'unsubscribed'", (account, to)).fetchone()
    if known is not None:
        raise Conflict(f"{to} {known['reason']}: this account sends it nothing any more, so "
                       "nothing was sent.", field="to")
    message = MESSAGE.find(conn, account, call.params["message"], live=True)
    if not (message["subject"] or "").strip() or not (message["html"] or message["text"]):
        raise Conflict(f"Message {message['id']} needs a subject and a body (html or text) "
                       "before it can be sent.", field="message")
    template = None
    if call.get("template") not in (None, ""):
        try:
            template = _campaign_template(
                conn, account, _param_defaulttemplate(call, call.params["template"], "template"),
                call.service.config["templates_dir"])
        except _TemplateUnusable as problem:
            raise Conflict(str(problem), field="template") from None
    call.memo["transactional"] = message, template
    return {"to_addr": to, "message": message["id"]}


def _transactional_send(call, record_id):
    """Queue the email, first in line: built at delivery from a prepared
    message that is not bulk mail (no List-Unsubscribe), filled from ``data``."""
    message, template = call.memo.pop("transactional")
    account, tracking = call.account, bool(call.get("tracking", 0))
    sender = _campaign_sender(call.conn, {"owner": account,
                                          "accountprofile": call.get("accountprofile")}, message)
    prepared = _prepared(call.conn, account, f"transactional:{message['id']}", message, sender,
                         template=template, tracking=tracking,
                         base_url=call.base_url if tracking else "", bulk=False)
    outbox = enqueue(call.conn, account, "transactional", call.params["to"],
                     message=message["id"], prepared=prepared,
                     merge_values=call.get("data", {}), priority=1)
    call.conn.execute("UPDATE transactional SET outbox = ? WHERE id = ?", (outbox, record_id))


TRANSACTIONAL = Resource(
    "transactional", "transactional", _transactional_record, soft_delete=False,
    extra={"create": "to:email! message:int@message! data:object "
                     "accountprofile:int@accountprofile template:scalar@template tracking:flag"},
    values=_transactional_values, after_create=_transactional_send,
    source="transactional JOIN outbox o ON o.id = transactional.outbox",
    select="transactional.id, transactional.to_addr, transactional.message, "
           f"transactional.created, o.error, o.sent, {_TRANSACTIONAL_STATUS} AS status, "
           f"{_TRANSACTIONAL_FIRST.format(kind='open')} AS opened, "
           f"{_TRANSACTIONAL_FIRST.format(kind='click')} AS clicked",
    order="transactional.id",
    filters={"to:email": "transactional.to_addr = ?",
             "status:" + "|".join(_TRANSACTIONAL_STATUSES): f"{_TRANSACTIONAL_STATUS} = ?"},
    label="transactional email",
    fields=_record_schema("id to message status error created sent opened clicked",
                          status={"type": "string", "enum": list(_TRANSACTIONAL_STATUSES)}),
    doc={"to": ("The address the email goes to (a listing: only the emails to it).",
                "ann@example.com", {"not": {"pattern": "^\\s*$"}}),
         "status": ("Only the emails in this state.", "sent"),
         "message": ("The message whose subject and bodies the email is.", 1),
         "data": ("Merge values: {{name}} takes data.name; {{email}} is 'to'.",
                  {"name": "Ann", "reset_url": "https://shop.example/reset/abc"}),
         "accountprofile": ("The sender profile, for what the message itself does not set "
                            "(fromname, fromaddress, replyto).", 1),
         "template": ("A template id, or the name NAME of a file NAME.html (and NAME.txt) in "
                      "the server's templates folder, that wraps the message ('' none).", "",
                      _TEMPLATE_VALUE),
         "tracking": ("1: count opens and clicks (its links go through this API); default 0.",
                      "0")})


# ---------------------------------------------------------------------------
# Automations: a sequence of steps that each recipient walks on their own
# (a run); its emails are prepared messages (_prepared()), its runs advance
# in the worker (advance_runs(), _WORKER_STEPS), its triggers are internal
# event subscribers, a date checked hourly, and the API.
# ---------------------------------------------------------------------------

_MAX_STEPS = 50
_MAX_WAIT = 366 * 86400
_WAIT_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TRIGGER_TYPES = ("subscribed", "date", "api")
_RUN_STATUSES = ("waiting", "finished", "stopped", "cancelled")
#: The date trigger is evaluated at least this often (seconds), and at once
#: when the automation is enabled.
_DATE_CHECK_EVERY = 3600
#: Runs one transaction of advance_runs() moves on by a step.
_RUN_CHUNK = 10_000


def _step_kind(step):
    return next(iter(step))


def _wait_seconds(value, where):
    """A wait step's duration in seconds: a number, or digits and s/m/h/d."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) \
        else ""
    match = re.fullmatch(r"([0-9]{1,9})([smhd]?)", text)
    if match is None:
        raise InvalidParameter(f"{where}: a wait is seconds as a number, or digits followed by "
                               "s, m, h or d ('3d').", field="steps")
    seconds = int(match[1]) * _WAIT_UNITS[match[2] or "s"]
    if seconds > _MAX_WAIT:
        raise InvalidParameter(f"{where}: a wait is at most 366 days.", field="steps")
    return seconds


def _checked_condition(call, datasource, condition, index, where, depth=0):
    """A continue_if condition as stored: a segment condition on the
    datasource's fields, opened/clicked of an earlier send step, not/all/any."""
    if not isinstance(condition, dict) or len(condition) != 1 and not (
            set(condition) <= {"field", "op", "value"}) or depth > 8:
        raise InvalidParameter(f"{where} must be a condition: {{field, op, value}}, "
                               "{opened: STEP}, {clicked: STEP}, {not: C}, {all: [C]} or "
                               "{any: [C]}.", field="steps")
    word = next(iter(condition)) if len(condition) == 1 else None
    if word in ("opened", "clicked"):
        step = _as_int(condition[word]) if not isinstance(condition[word], bool) else None
        if step is None:
            raise InvalidParameter(f"{where}.{word} must be the index of a send step.",
                                   field="steps")
        if step >= index or _step_kind(call.memo["steps"][step]) != "send":
            raise Conflict(f"{where}: '{word}' names step {condition[word]}, which is not a send "
                           f"step before step {index}.", field="steps")
        return {word: step}
    if word == "not":
        return {"not": _checked_condition(call, datasource, condition["not"], index,
                                          f"{where}.not", depth + 1)}
    if word in ("all", "any"):
        items = condition[word]
        if not isinstance(items, list) or not items:
            raise InvalidParameter(f"{where}.{word} must be a non-empty list of conditions.",
                                   field="steps")
        return {word: [_checked_condition(call, datasource, item, index, f"{where}.{word}[{n}]",
                                          depth + 1) for n, item in enumerate(items)]}
    try:
        return _checked_conditions(call.conn, [datasource], [condition])[0]
    except ApiError as error:
        error.message = f"{where}: " + error.message.replace("conditions[0]", "the condition")
        error.extra["field"] = "steps"
        raise


def _checked_steps(call, datasource, given):
    """``steps`` as stored: each exactly one of send (a live message of the
    account), wait (seconds), continue_if (a checked condition) and update
    (typed field values of the datasource)."""
    if not 1 <= len(given) <= _MAX_STEPS:
        raise InvalidParameter(f"'steps' must list 1 to {_MAX_STEPS} steps.", field="steps")
    call.memo["steps"] = steps = []
    fields = _datasource_fields(call.conn, datasource)
    for index, step in enumerate(given):
        where = f"steps[{index}]"
        kind = next(iter(step)) if isinstance(step, dict) and len(step) == 1 else None
        if kind == "send":
            number = _as_int(step["send"]) if not isinstance(step["send"], bool) else None
            if number is None:
                raise InvalidParameter(f"{where}.send must be a message id.", field="steps")
            try:
                MESSAGE.find(call.conn, call.account, number, live=True)
            except (NotFound, Conflict) as error:
                error.message = f"'{where}.send': {error.message}"
                error.extra["field"] = "steps"
                raise
            steps.append({"send": number})
        elif kind == "wait":
            steps.append({"wait": _wait_seconds(step["wait"], where)})
        elif kind == "continue_if":
            steps.append({"continue_if": None})    # its own index may not be named
            steps[-1] = {"continue_if": _checked_condition(
                call, datasource, step["continue_if"], index, f"{where}.continue_if")}
        elif kind == "update":
            if not isinstance(step["update"], dict) or not step["update"]:
                raise InvalidParameter(f"{where}.update must be an object of field values.",
                                       field="steps")
            data = _typed_fields(call, step["update"], fields, datasource, "steps")
            names = {str(field_id): name for field_id, name, _ in fields.values()}
            steps.append({"update": {names[key]: value for key, value in data.items()}})
        else:
            raise InvalidParameter(f"{where} must be an object with exactly one of send, wait, "
                                   "continue_if and update.", field="steps")
    return steps


def _checked_trigger(call, datasource, trigger):
    """``trigger`` as stored (JSON text, "type" first): subscribed, api, or
    date with a field of type date, days and yearly."""
    kind = trigger.get("type")
    extra = set(trigger) - ({"type", "field", "days", "yearly"} if kind == "date" else {"type"})
    if kind not in _TRIGGER_TYPES or extra:
        raise InvalidParameter("'trigger' must be {\"type\": \"subscribed\"}, {\"type\": \"api\"} "
                               "or {\"type\": \"date\", \"field\", \"days\", \"yearly\"}.",
                               field="trigger", allowed=list(_TRIGGER_TYPES))
    if kind != "date":
        return _to_json({"type": kind})
    name = trigger.get("field")
    if not isinstance(name, str) or not name.strip():
        raise InvalidParameter("'trigger.field' must name a field of type date.",
                               field="trigger")
    field = _datasource_fields(call.conn, datasource).get(name.lower())
    if field is None or field[2] != "date":
        raise Conflict(f"The date trigger's field '{name}' is not a field of type date of "
                       f"datasource {datasource}.", field="trigger")
    days = trigger.get("days", 0)
    if isinstance(days, bool) or not isinstance(days, (int, str)) or \
            not re.fullmatch(r"-?[0-9]{1,4}", str(days).strip()):
        raise InvalidParameter("'trigger.days' must be a whole number of days (may be negative).",
                               field="trigger")
    yearly = _param_flag("trigger.yearly", trigger.get("yearly", "0"))
    return _to_json({"type": "date", "field": field[1], "days": int(str(days).strip()),
                     "yearly": str(yearly)})


def _automation_values(call, row):
    values = _columns(call, ("name", "accountprofile", "tracking"))
    datasource = call.params.get("datasource", row and row["datasource"])
    if "datasource" in call.params:
        values["datasource"] = datasource
    if "defaulttemplate" in call.params:
        values["defaulttemplate"] = _param_defaulttemplate(call, call.params["defaulttemplate"])
    if "trigger" in call.params or "datasource" in call.params:
        trigger = call.params["trigger"] if "trigger" in call.params else json.loads(
            row["trigger"])
        values["trigger"] = _checked_trigger(call, datasource, trigger)
    if "steps" in call.params or "datasource" in call.params:
        steps = call.params["steps"] if "steps" in call.params else json.loads(row["steps"])
        values["steps"] = _to_json(_checked_steps(call, datasource, steps))
    if "enabled" in call.params:
        values["enabled"] = call.params["enabled"]
    # Where its links point: as the latest write said (a batch keeps its sender's).
    values["base_url"] = call.base_url
    call.memo["was"] = dict(row) if row is not None else None
    return values


def _automation_written(call, automation_id):
    """After a create or change, in its transaction: enabling verifies (409
    verification_failed) and evaluates a date trigger at once; pausing holds
    the runs and enabling resumes them; waiting runs past the end of new
    steps finish."""
    row = AUTOMATION.find(call.conn, call.account, automation_id)
    was = call.memo.get("was") or {"enabled": 0, "steps": "[]"}
    now = _now()
    if row["enabled"] and not was["enabled"]:
        # Size and spam, as a campaign's send; links only when verify asks.
        _refuse_failing(verify_automation(call.conn, call.account, automation_id,
                                          call.service.config["templates_dir"],
                                          settings={**_verify_settings(call), "links": False}),
                        f"Automation {automation_id}")
    if row["enabled"] != was["enabled"]:
        call.conn.execute("UPDATE automation_run SET paused = ? WHERE automation = ? "
                          "AND status = 'waiting'", (1 - row["enabled"], automation_id))
    if row["steps"] != was["steps"]:
        _end_runs(call.conn, row, "finished", "the steps end here", now, _listened(call),
                  f"step >= {len(json.loads(row['steps']))}")
    if row["enabled"] and not was["enabled"] and row["trigger"].startswith('{"type":"date"'):
        _date_entries(call.conn, row, now, _listened(call))


def _automation_deleted(call, row):
    _end_runs(call.conn, row, "cancelled", "the automation was deleted", _now(),
              _listened(call))


def _automation_record(call, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]), "name": row["name"],
            "datasource": str(row["datasource"]), "trigger": json.loads(row["trigger"]),
            "steps": json.loads(row["steps"]), "accountprofile": str(row["accountprofile"]),
            "defaulttemplate": row["defaulttemplate"], "tracking": str(row["tracking"]),
            "enabled": str(row["enabled"]), "running": str(row["running"]),
            "finished": str(row["finished"]), "created": row["created"],
            "deleted": str(row["deleted"])}


_STEP_SCHEMA = {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
    "send": {}, "wait": {}, "continue_if": {"type": "object"}, "update": {"type": "object"}}}
_TRIGGER_SCHEMA = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": list(_TRIGGER_TYPES)}, "field": {"type": "string"},
    "days": {}, "yearly": {}}}

AUTOMATION = Resource(
    "automation", "automation", _automation_record,
    columns="name:str datasource:int@datasource trigger:object steps:list "
            "accountprofile:int@accountprofile defaulttemplate:scalar@template tracking:flag "
            "enabled:flag",
    required="name datasource trigger steps accountprofile", values=_automation_values,
    after_create=_automation_written, after_change=_automation_written,
    on_delete=_automation_deleted,
    select="*, (SELECT count(*) FROM automation_run r WHERE r.automation = automation.id "
           "AND r.status = 'waiting') AS running, (SELECT count(*) FROM automation_run r "
           "WHERE r.automation = automation.id AND r.status = 'finished') AS finished",
    fields=_record_schema(
        "id owner name datasource trigger steps accountprofile defaulttemplate tracking "
        "enabled running finished created deleted",
        trigger=_TRIGGER_SCHEMA, steps={"type": "array", "items": _STEP_SCHEMA},
        tracking=_FLAG_ANSWER, enabled=_FLAG_ANSWER, deleted=_FLAG_ANSWER,
        running=_COUNT, finished=_COUNT),
    doc={
        "datasource": ("The datasource whose recipients walk the automation.", 1),
        "trigger": ("What starts a run: {\"type\": \"subscribed\"} (a recipient becomes active), "
                    "{\"type\": \"date\", \"field\": NAME, \"days\": N, \"yearly\": \"0\"|\"1\"} "
                    "or {\"type\": \"api\"} (started by hand only).", {"type": "subscribed"},
                    _TRIGGER_SCHEMA),
        "steps": ("1 to 50 steps, each one of {\"send\": MESSAGE}, {\"wait\": \"3d\"}, "
                  "{\"continue_if\": CONDITION}, {\"update\": {FIELD: VALUE}}.",
                  [{"send": 1}, {"wait": "3d"}, {"send": 2}],
                  {"minItems": 1, "maxItems": _MAX_STEPS, "items": _STEP_SCHEMA}),
        "accountprofile": ("The id of the sender profile its emails are sent as.", 1),
        "defaulttemplate": ("The template its messages are wrapped in: '', a template id or a "
                            "template file name (as a campaign's).", ""),
        "tracking": ("1: opens and clicks of its emails are counted (off by default).", "0"),
        "enabled": ("1: runs start and advance (verify runs first); 0: paused.", "0")})


# Runs ----------------------------------------------------------------------------

def _run_record(call, row):
    return {"id": str(row["id"]), "automation": str(row["automation"]),
            "recipient": str(row["recipient"]), "step": str(row["step"]),
            "status": row["status"], "due": row["due"], "started": row["started"],
            "finished": row["finished"], "history": json.loads(row["history"])}


RUN = Resource(
    "run", "automation_run", _run_record, parent=AUTOMATION, parent_key="automation",
    soft_delete=False, stamped=False,
    filters={"status:" + "|".join(_RUN_STATUSES): "automation_run.status = ?",
             "recipient:int": "automation_run.recipient = ?"},
    fields=_record_schema(
        "id automation recipient step status due started finished history",
        status={"type": "string", "enum": list(_RUN_STATUSES)},
        history={"type": "array", "items": _record_schema("step at outcome")}),
    doc={"status": ("Only the runs with this status.", "waiting"),
         "recipient": ("A recipient id of the automation's datasource: who walks the run "
                       "a start makes; on a listing, only that recipient's runs.", 1)})


def _run_get(call, child_id):
    """RUN.get, the ``recipient`` filter looked up first: a recipient of the
    automation's datasource, else 404 as any reference."""
    if "recipient" in call.params:
        RECIPIENT.find(call.conn, call.parent["datasource"], call.params["recipient"])
    return RUN.get(call, child_id)


def _ids_sql(conn):
    return conn.sql["json_ids"].format(array="?")


def _history_entry(step, now, outcome):
    return _to_json({"step": str(step), "at": now, "outcome": outcome})


def _run_events(conn, account, kind, run_ids, pending):
    """``automation.<kind>`` for each run (payload: the run), built only
    when someone hears it: a webhook, the on_event list ``pending``, a
    subscriber (a set of runs is raised at once, maybe a million)."""
    kind = f"automation.{kind}"
    webhooks = _webhooks_wanting(conn, account, kind) if run_ids else []
    if webhooks or (run_ids and (pending is not None or _SUBSCRIBERS[kind])):
        for row in conn.execute(f"SELECT * FROM automation_run WHERE id IN ({_ids_sql(conn)}) "
                                "ORDER BY id", (_to_json(sorted(run_ids)),)).fetchall():
            emit(conn, account, kind, _run_record(None, row), pending, webhooks=webhooks)


def _listened(call):
    """The request's on_event list when the app has a callback, else None:
    for the events of a set of runs, built only when someone hears them."""
    return call.events if call.service.config["on_event"] else None


def _end_runs(conn, automation, status, outcome, now, pending, where="1 = 1", params=()):
    """End the automation's waiting runs that ``where`` (SQL on
    automation_run) selects as ``status``, with ``outcome`` in their history,
    and raise automation.finished for each (payload: the run)."""
    selected = f"automation = ? AND status = 'waiting' AND ({where})"
    ended = []
    for (step,) in conn.execute(f"SELECT DISTINCT step FROM automation_run WHERE {selected}",
                                (automation["id"], *params)).fetchall():
        ended += [row[0] for row in conn.execute(
            "UPDATE automation_run SET status = ?, due = NULL, finished = ?, "
            f"history = {conn.sql['json_append'].format(json='history', value='?')} "
            f"WHERE {selected} AND step = ? RETURNING id",
            (status, now, _history_entry(step, now, outcome), automation["id"], *params, step))]
    _run_events(conn, automation["owner"], "finished", ended, pending)
    return ended


def _start_runs(conn, automation, origin, where, params, now, pending):
    """Start a run of ``automation`` (a row) for each active recipient of its
    datasource that ``where`` (SQL on ``recipient r``) selects, unless it has
    a waiting run of it, or one of the same ``origin``; one statement.
    Raises automation.started for each (the ids are read back only for
    that).  Returns how many started."""
    kind, account = "automation.started", automation["owner"]
    heard = pending is not None or _SUBSCRIBERS[kind] or _webhooks_wanting(conn, account, kind)
    cursor = conn.execute(
        "INSERT INTO automation_run (automation, recipient, step, status, due, paused, origin, "
        "started, history) SELECT ?, r.id, 0, 'waiting', ?, 0, ?, ?, '[]' FROM recipient r "
        f"WHERE r.datasource = ? AND r.status = 'active' AND ({where}) "
        f"ON CONFLICT DO NOTHING{' RETURNING id' if heard else ''}",
        (automation["id"], now, origin, now, automation["datasource"], *params))
    if not heard:
        return cursor.rowcount
    started = [row[0] for row in cursor.fetchall()]
    _run_events(conn, account, "started", started, pending)
    return len(started)


def _run_start(call, child_id):
    """PUT /automation/{a}/run/0: a run for one recipient, by hand."""
    automation = call.parent
    if child_id != 0:
        raise Conflict("Runs are numbered by the service: start one at run/0.")
    if not automation["enabled"]:
        raise Conflict(f"Automation {automation['id']} is not enabled: enable it first.")
    recipient = RECIPIENT.find(call.conn, automation["datasource"], call.params["recipient"])
    if recipient["status"] != "active":
        raise Conflict(f"Recipient {recipient['id']} is {recipient['status']}: only active "
                       "recipients walk an automation.", field="recipient")
    if not _start_runs(call.conn, automation, None, "r.id = ?", (recipient["id"],), _now(),
                       call.events):
        raise Conflict(f"Recipient {recipient['id']} already has a waiting run of automation "
                       f"{automation['id']}.", field="recipient")
    return {"id": str(call.conn.execute(
        "SELECT id FROM automation_run WHERE automation = ? AND recipient = ? "
        "AND status = 'waiting'", (automation["id"], recipient["id"])).fetchone()[0])}


def _run_cancel(call, child_id):
    """DELETE /automation/{a}/run/{id}: cancel a waiting run."""
    run = RUN.find(call.conn, call.parent["id"], child_id)
    if run["status"] != "waiting":
        raise Conflict(f"Run {run['id']} is {run['status']}: only a waiting run is cancelled.")
    _end_runs(call.conn, call.parent, "cancelled", "cancelled by hand", _now(), call.events,
              "id = ?", (run["id"],))
    return True


# Triggers: internal subscribers (a recipient becomes active), a date --------------

def _subscribed_entries(conn, account, where, params, pending):
    """Runs of the account's enabled automations with a subscribed trigger on
    the datasource of the recipients ``where`` selects."""
    for automation in conn.execute(
            "SELECT * FROM automation WHERE owner = ? AND enabled = 1 AND deleted = 0 "
            "AND trigger = ?", (account, _to_json({"type": "subscribed"}))).fetchall():
        _start_runs(conn, automation, "subscribed", where, params, _now(), pending)


def _on_recipient_active(conn, account, payload, pending):
    if payload["data"].get("status", "active") == "active":
        _subscribed_entries(conn, account, "r.id = ?", (int(payload["data"]["id"]),), pending)


def _on_import(conn, account, payload, pending):
    # The addresses the import inserted (recipient.import): new ones only.
    _subscribed_entries(conn, account, "r.import = ?", (int(payload["data"]["id"]),), pending)


_subscribe("recipient.subscribed", _on_recipient_active)
_subscribe("recipient.confirmed", _on_recipient_active)
_subscribe("import.finished", _on_import)


def _date_entries(conn, automation, now, pending):
    """A date trigger's runs of today (UTC): the recipients whose date field
    plus ``days`` is today (with ``yearly``: today's month and day; 29
    February counts on 28 February in other years); once per recipient a
    day (a year with yearly)."""
    trigger = json.loads(automation["trigger"])
    field = _datasource_fields(conn, automation["datasource"]).get(trigger["field"].lower())
    conn.execute("UPDATE automation SET checked = ? WHERE id = ?", (now, automation["id"]))
    if field is None or field[2] != "date":
        return 0
    value = conn.sql["json_value"].format(json="r.data", key=int(field[0]))
    today = datetime.date.fromisoformat(now[:10])
    target = today - datetime.timedelta(days=trigger["days"])
    if trigger["yearly"] != "1":
        return _start_runs(conn, automation, f"date:{today}", f"{value} = ?",
                           (target.isoformat(),), now, pending)
    days = [target.strftime("%m-%d")]
    if days == ["02-28"] and not calendar.isleap(target.year):
        days.append("02-29")
    marks = ", ".join("?" for _ in days)
    return _start_runs(conn, automation, f"date:{today.year}",
                       f"substr({value}, 6, 5) IN ({marks})", days, now, pending)


def check_dates(db, now=None, on_event=None):
    """Evaluate the date trigger of every enabled automation whose last look
    is an hour old (or of another day): the worker's hourly step.

    :returns: the number of runs started.
    """
    pending = [] if on_event else None
    with _opened(db) as conn:
        now = now or _now()
        started = 0
        for automation in conn.execute(
                "SELECT * FROM automation WHERE enabled = 1 AND deleted = 0 "
                "AND trigger LIKE '{\"type\":\"date\"%' AND (checked IS NULL OR checked < ? "
                "OR substr(checked, 1, 10) != ?)",
                (_shift(now, -_DATE_CHECK_EVERY), now[:10])).fetchall():
            with transaction(conn):
                row = conn.execute("SELECT * FROM automation WHERE id = ? AND enabled = 1 "
                                   f"AND deleted = 0 {conn.sql['for_update']}",
                                   (automation["id"],)).fetchone()
                if row is not None:
                    started += _date_entries(conn, row, now, pending)
            if pending:
                _run_callbacks(on_event, pending)
        return started


# Advancing runs: set-based, a step of many runs at once ---------------------------

def _run_condition_sql(conn, automation, condition):
    """``(sql, params)`` of a continue_if condition over ``automation_run``
    (the run) and, in a field condition, its recipient."""
    word = next(iter(condition)) if len(condition) == 1 else None
    if word in ("opened", "clicked"):
        kinds = "('open', 'click')" if word == "opened" else "('click')"
        return ("(SELECT 1 FROM outbox o JOIN event e ON e.prepared = o.prepared "
                "AND e.outbox = o.id WHERE o.recipient = automation_run.recipient "
                "AND o.prepared IN (SELECT id FROM prepared WHERE scope = ?) "
                f"AND o.created >= automation_run.started AND e.kind IN {kinds} LIMIT 1) "
                "IS NOT NULL", (f"automation:{automation['id']}:{condition[word]}",))
    if word == "not":
        sql, params = _run_condition_sql(conn, automation, condition["not"])
        return f"NOT ({sql})", params
    if word in ("all", "any"):
        parts = [_run_condition_sql(conn, automation, item) for item in condition[word]]
        joiner = " AND " if word == "all" else " OR "
        return joiner.join(f"({sql})" for sql, _ in parts), tuple(
            param for _, params in parts for param in params)
    where, params = _segment_filter(conn, [automation["datasource"]], "all", [condition])
    return (f"(SELECT 1 FROM recipient r WHERE r.id = automation_run.recipient AND {where}) "
            "IS NOT NULL", params)


def _advance(conn, run_ids, steps, index, now, outcome=None):
    """Move runs past step ``index`` (its ``outcome`` in their history), and
    past the wait steps that follow it (or that it is): a wait counts from
    now, when the step before it ran, so it needs no round of its own."""
    entries, due, following = [], now, index
    if _step_kind(steps[index]) != "wait":
        entries.append(_history_entry(index, now, outcome))
        following += 1
    while following < len(steps) and _step_kind(steps[following]) == "wait":
        due = _shift(due, steps[following]["wait"])
        entries.append(_history_entry(following, now, "waited"))
        following += 1
    history = "history"
    for _ in entries:
        history = conn.sql["json_append"].format(json=history, value="?")
    conn.execute(f"UPDATE automation_run SET step = ?, due = ?, history = {history} "
                 f"WHERE id IN ({_ids_sql(conn)})",
                 (following, due, *entries, _to_json(run_ids)))


def _send_step(conn, automation, index, message_id, run_ids, now, templates_dir):
    """Queue the send step's email for each run, from the step's prepared
    message; the outcome, or the reason none can be sent."""
    account = automation["owner"]
    message = conn.execute("SELECT * FROM message WHERE id = ? AND owner = ? AND deleted = 0",
                           (message_id, account)).fetchone()
    if message is None:
        return f"message {message_id} is deleted"
    try:
        template = _campaign_template(conn, account, automation["defaulttemplate"], templates_dir)
    except _TemplateUnusable as problem:
        return f"the template cannot be used: {problem}"
    sender = _campaign_sender(conn, automation, message)
    prepared = _prepared(conn, account, f"automation:{automation['id']}:{index}", message,
                         sender, template=template, tracking=automation["tracking"],
                         base_url=automation["base_url"],
                         list_id=_list_id("automation", automation["id"], account))
    enqueue(conn, account, "automation", prepared=prepared, now=now, recipients=(
        f"r.status = 'active' AND r.id IN (SELECT recipient FROM automation_run "
        f"WHERE id IN ({_ids_sql(conn)}))",
        (_to_json(run_ids),)))
    return None


def _run_step(conn, automation, index, run_ids, now, pending, templates_dir):
    """One step of the automation for the given waiting runs (all at step
    ``index``), in the caller's transaction."""
    ids = _to_json(run_ids)
    if conn.execute("SELECT deleted FROM datasource WHERE id = ?",
                    (automation["datasource"],)).fetchone()[0]:   # its recipients get no mail
        _end_runs(conn, automation, "stopped", "the datasource is deleted", now, pending,
                  f"id IN ({_ids_sql(conn)})", (ids,))
        return
    # A recipient who left (or was erased) is never mailed: the run stops.
    # (A scalar subquery: the recipient is found by its id whatever the
    # planner believes of the tables' sizes; a NOT EXISTS became a join
    # that scanned the list once per run on PostgreSQL's fresh statistics.)
    left = set(_end_runs(conn, automation, "stopped", "the recipient is no longer active", now,
                         pending, f"id IN ({_ids_sql(conn)}) AND (SELECT r.status FROM recipient "
                         "r WHERE r.id = automation_run.recipient AND r.datasource = ?) "
                         "IS DISTINCT FROM 'active'", (ids, automation["datasource"])))
    steps = json.loads(automation["steps"])
    if index >= len(steps):
        _end_runs(conn, automation, "finished", "the steps end here", now, pending,
                  f"id IN ({_ids_sql(conn)})", (ids,))
        return
    live = [run for run in run_ids if run not in left]
    if not live:
        return
    step = steps[index]
    kind = _step_kind(step)
    if kind == "send":
        problem = _send_step(conn, automation, index, step["send"], live, now, templates_dir)
        if problem:
            _end_runs(conn, automation, "stopped", problem, now, pending,
                      f"id IN ({_ids_sql(conn)})", (_to_json(live),))
            return
        _advance(conn, live, steps, index, now, "sent")
    elif kind == "wait":   # the first step, or the steps were changed: a wait of its own
        _advance(conn, live, steps, index, now)
    elif kind == "continue_if":
        sql, params = _run_condition_sql(conn, automation, step["continue_if"])
        _end_runs(conn, automation, "stopped", "the condition does not hold", now, pending,
                  f"id IN ({_ids_sql(conn)}) AND NOT ({sql})", (_to_json(live), *params))
        kept = [row[0] for row in conn.execute(
            f"SELECT id FROM automation_run WHERE id IN ({_ids_sql(conn)}) "
            "AND status = 'waiting'", (_to_json(live),))]
        if kept:
            _advance(conn, kept, steps, index, now, "the condition holds")
    else:   # update
        fields = _datasource_fields(conn, automation["datasource"])
        patch = {str(fields[name.lower()][0]): value for name, value in step["update"].items()
                 if name.lower() in fields}
        conn.execute(
            f"UPDATE recipient SET data = {conn.sql['json_merge'].format(json='data', patch='?')},"
            " updated = ? WHERE id IN (SELECT recipient FROM automation_run "
            f"WHERE id IN ({_ids_sql(conn)}))", (_to_json(patch), now, _to_json(live)))
        _advance(conn, live, steps, index, now, "updated")


#: The runs due at a time (a parameter), the first so many (another): read
#: from the index automation_run_due alone, so runs not due cost nothing.
_DUE_RUNS = ("SELECT id, automation, step FROM automation_run WHERE status = 'waiting' "
             "AND paused = 0 AND due <= ? ORDER BY due LIMIT ?")


def advance_runs(db, now=None, on_event=None, *, templates_dir="", chunk=_RUN_CHUNK,
                 rounds=100):
    """Move every due run of an enabled automation on by its steps: the
    worker's step for automations.  A round claims up to ``chunk`` due runs
    (on PostgreSQL rows no other worker has locked) and runs their next
    step set-based, per automation and step, in one transaction: the email
    of a send step is queued in the transaction that moves the run past it,
    so a crash or a second worker never queues it twice.  Steps that need no
    waiting follow in the next rounds at once.

    :param now: the current time, 'YYYY-MM-DD HH:MM:SS' UTC (tests pass it).
    :param rounds: at most this many rounds a call (the worker calls again).
    :returns: how many run steps were taken.
    """
    pending, due = ([] if on_event else None), _DUE_RUNS
    with _opened(db) as conn:
        now = now or _now()
        done = 0
        # Read first: the idle tick reads one index entry, nothing else.
        if conn.execute(due, (now, 1)).fetchone() is None:
            return 0
        for _ in range(rounds):
            with transaction(conn):
                runs = conn.execute(f"{due} {conn.sql['skip_locked']}", (now, chunk)).fetchall()
                groups = {}
                for run in runs:
                    groups.setdefault((run["automation"], run["step"]), []).append(run["id"])
                for (automation_id, index), run_ids in sorted(groups.items()):
                    automation = conn.execute("SELECT * FROM automation WHERE id = ?",
                                              (automation_id,)).fetchone()
                    _run_step(conn, automation, index, run_ids, now, pending, templates_dir)
            if pending:
                _run_callbacks(on_event, pending)
            done += len(runs)
            if len(runs) < chunk and not conn.execute(due, (now, 1)).fetchone():
                break
        return done


# Verify, statistics ---------------------------------------------------------------

class _Automation(_Campaign):
    """What verify's checks look at for an automation: its sender profile,
    template and the messages of its send steps, as a campaign's."""

    kind = "automation"

    def __init__(self, conn, account, automation_id, templates_dir="", settings=None):
        # a campaign's, without campaign messages (links) and segments
        self.conn, self.id, self.settings = conn, automation_id, settings or {}
        self.path = f"/v1/automation/{automation_id}"
        self.row = AUTOMATION.find(conn, account, automation_id)
        self.read_sender(account, templates_dir)
        self.steps = json.loads(self.row["steps"])
        self.messages = _rows_by_id(conn, "message", [step["send"] for step in self.steps
                                                      if "send" in step], account)
        self.datasource = conn.execute("SELECT * FROM datasource WHERE id = ? AND owner = ?",
                                       (self.row["datasource"], account)).fetchone()


def _verify_automation_messages(c):
    missing = [step["send"] for step in c.steps if "send" in step
               and (step["send"] not in c.messages or c.messages[step["send"]]["deleted"])]
    return [f"Message {m} of a send step is deleted: change the automation's steps with "
            f"POST {c.path}." for m in missing], "Every send step's message is there."


def _verify_automation_datasource(c):
    return [] if c.datasource is not None and not c.datasource["deleted"] else [
        f"Datasource {c.row['datasource']} is deleted: point the automation at another with "
        f"POST {c.path}."], f"Datasource {c.row['datasource']} is there."


def _verify_automation_merge_tags(c):
    known = {"email", "unsubscribe_url", *_datasource_fields(c.conn, c.row["datasource"])}
    problems = []
    for message in c.messages.values():
        unknown = sorted(set().union(_merge_tags(message["subject"]), *map(
            _merge_tags, c.bodies(message).values())) - known)
        if unknown:
            problems.append(
                f"{_label('message', message).capitalize()} uses "
                f"{', '.join(f'{{{{{tag}}}}}' for tag in unknown)}, which datasource "
                f"{c.row['datasource']} has no field for: add the field or correct the tag "
                f"(POST /v1/message/{message['id']}).")
    return problems, "Every merge tag names email, unsubscribe_url or a field of the datasource."


def _verify_automation_trigger(c):
    trigger = json.loads(c.row["trigger"])
    if trigger["type"] != "date":
        return [], f"The trigger is '{trigger['type']}'."
    field = _datasource_fields(c.conn, c.row["datasource"]).get(trigger["field"].lower())
    return [] if field is not None and field[2] == "date" else [
        f"The date trigger's field '{trigger['field']}' is no longer a field of type date of "
        f"datasource {c.row['datasource']}: change the trigger with POST {c.path}."
    ], f"The date trigger's field '{trigger['field']}' has type date."


#: Verify of an automation: its own checks, then the campaign checks that
#: concern one email (they read the same attributes), then the
#: deliverability checks (size, links, spam: added where they are defined).
_AUTOMATION_CHECKS = [
    ("automation_datasource", _verify_automation_datasource),
    ("automation_messages", _verify_automation_messages),
    ("trigger_field", _verify_automation_trigger),
    ("sender_profile", _verify_profile), ("sender_address", _verify_profile_address),
    ("message_subject", _verify_subjects), ("message_from", _verify_from),
    ("message_body", _verify_bodies), ("template_found", _verify_template_found),
    ("template_content", _verify_template_content),
    ("unsubscribe_link", _verify_unsubscribe_links),
    ("merge_tags", _verify_automation_merge_tags), ("reply_to", _verify_reply_to),
    ("header_line_breaks", _verify_header_line_breaks)]


def verify_automation(conn, account, automation_id, templates_dir="", *, settings=None):
    """Check whether automation ``automation_id`` can be enabled; the verify
    record ``{id, automation, passed, checks, verified}`` (as a campaign's).

    :param account: the account that owns it (404 if not).
    :param templates_dir: where template files named by defaulttemplate are.
    :param settings: what the deliverability checks use, as verify_campaign()'s.
    """
    return _Automation(conn, account, automation_id, templates_dir,
                       settings).report(_AUTOMATION_CHECKS)


def _automation_verify_get(call, child_id):
    if child_id not in (0, call.parent["id"]):
        raise NotFound(f"Automation {call.parent['id']} has one verify, at "
                       f"/automation/{call.parent['id']}/verify/0.")
    return {"verify": verify_automation(call.conn, call.account, call.parent["id"],
                                        call.service.config["templates_dir"],
                                        settings=_verify_settings(call))}


#: The figures of each step in an automation's statistics.
_STEP_FIGURES = ("sent", "failed", "bounced", "complained", "unsubscribed", "opened", "clicked")


def _automation_statistics(conn, automation):
    """The statistics record: its runs by status, and per step the figures of
    the emails of its send steps (their prepared messages', all versions)."""
    runs = dict(conn.execute("SELECT status, count(*) FROM automation_run WHERE automation = ? "
                             "GROUP BY status", (automation["id"],)).fetchall())
    steps = []
    for index, step in enumerate(json.loads(automation["steps"])):
        figures = dict.fromkeys(_STEP_FIGURES, 0)
        if "send" in step:
            scope = ("prepared IN (SELECT id FROM prepared WHERE account = ? AND scope = ?)",
                     (automation["owner"], f"automation:{automation['id']}:{index}"))
            sent, failed = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'sent'), count(*) FILTER (WHERE status = "
                f"'failed') FROM outbox WHERE {scope[0]}", scope[1]).fetchone()
            figures.update({name: count for name, count in _event_figures(
                conn, scope[0], scope[1]).items() if name in figures}, sent=sent, failed=failed)
        steps.append({"step": str(index), "kind": _step_kind(step),
                      **{name: str(value) for name, value in figures.items()}})
    return {"id": str(automation["id"]), "automation": str(automation["id"]),
            **{status: str(runs.get(status, 0)) for status in ("finished", "stopped",
                                                               "cancelled")},
            "running": str(runs.get("waiting", 0)), "steps": steps}


def _automation_page(conn, automation, record, title):
    """The statistics as a page for a person: the archive page (the figures
    of all its emails, their opens and clicks over time, its links), and a
    table of the steps."""
    scope = ("prepared IN (SELECT id FROM prepared WHERE account = ? AND scope LIKE ?)",
             (automation["owner"], f"automation:{automation['id']}:%"))
    totals = {name: sum(int(step[name]) for step in record["steps"]) for name in _STEP_FIGURES}
    links = [{"url": url, "clicks": clicks, "clicked": clicked} for url, clicks, clicked in
             conn.execute(
                 "SELECT l.url, count(e.outbox), count(DISTINCT e.outbox) FROM prepared_link l "
                 "LEFT JOIN event e ON e.prepared = l.prepared AND e.link = l.link "
                 f"AND e.kind = 'click' WHERE l.{scope[0]} GROUP BY l.url ORDER BY 2 DESC, 1",
                 scope[1])]
    timeline = [{"hour": hour, "opens": opens, "clicks": clicks}
                for hour, (opens, clicks) in _event_timeline(conn, *scope).items()]
    page = _archive_page({**_event_figures(conn, *scope), **totals, "links": links,
                          "timeline": timeline, "recipients": str(sum(int(record[name]) for name in (
                              "running", "finished", "stopped", "cancelled")))}, title)
    head = "".join(f'<th class="n" scope="col">{name.capitalize()}</th>' for name in _STEP_FIGURES)
    rows = "".join(
        f'<tr><td>{html.escape(step["step"])}</td><td>{html.escape(step["kind"])}</td>'
        + "".join(f'<td class="n" data-step="{html.escape(step["step"])}" data-figure="{name}">'
                  f'{html.escape(step[name])}</td>' for name in _STEP_FIGURES) + "</tr>"
        for step in record["steps"])
    runs = ", ".join(f"{record[name]} {name}" for name in ("running", "finished", "stopped",
                                                           "cancelled"))
    table = (f'<h2>Steps</h2><p class="runs">Runs: {html.escape(runs)}.</p><table><thead><tr>'
             f'<th scope="col">Step</th><th scope="col">Kind</th>{head}</tr></thead>'
             f'<tbody>{rows}</tbody></table>')
    return page.replace("</main>", table + "</main>", 1)


def _automation_archive_get(call, child_id):
    if child_id not in (0, call.parent["id"]):
        raise NotFound(f"Automation {call.parent['id']} has one archive, at "
                       f"/automation/{call.parent['id']}/archive/0.")
    record = _automation_statistics(call.conn, call.parent)
    if _prefers_html(_request_header("Accept")):
        return bottle.HTTPResponse(
            _automation_page(call.conn, call.parent, record,
                             f"{call.parent['name']}: what happened"), 200,
            {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store"})
    return {"archive": record}


# ---------------------------------------------------------------------------
# Public pages: the words of every page in each language, unsubscribe and the
# preference centre, sign-up and confirm, the public archive, report links
# (signed tokens, not stored; no key needed)
# ---------------------------------------------------------------------------



#: Every word of the pages people see (unsubscribe and preferences, sign-up,
#: confirm, the public archive, their error pages) and of the built-in
#: confirmation email, in every language of LANGUAGES: key -> {language: text}.
#: ``{name}``-style holes take values; tests/test_pages.py checks that every
#: language has every key with the same holes.
_STRINGS = {
    "bad_link_title": {
        "en": "This link does not work", "de": "Dieser Link funktioniert nicht",
        "fr": "Ce lien ne fonctionne pas", "es": "Este enlace no funciona",
        "nl": "Deze link werkt niet"},
    "bad_link": {
        "en": "This link is not valid: it may be cut short or changed. Copy the whole link from "
              "the email into the address bar, or use the link of a newer email.",
        "de": "Dieser Link ist ungültig: Er wurde vielleicht gekürzt oder verändert. Kopieren Sie "
              "den ganzen Link aus der E-Mail in die Adresszeile oder nutzen Sie den Link einer "
              "neueren E-Mail.",
        "fr": "Ce lien n'est pas valide : il a peut-être été coupé ou modifié. Copiez le lien "
              "entier de l'e-mail dans la barre d'adresse, ou utilisez le lien d'un e-mail plus "
              "récent.",
        "es": "Este enlace no es válido: puede estar cortado o modificado. Copie el enlace "
              "completo del correo en la barra de direcciones o use el enlace de un correo más "
              "reciente.",
        "nl": "Deze link is ongeldig: hij is misschien ingekort of gewijzigd. Kopieer de hele link "
              "uit de e-mail naar de adresbalk, of gebruik de link uit een nieuwere e-mail."},
    # Unsubscribe and the preference centre
    "unsubscribe_title": {"en": "Unsubscribe", "de": "Abmelden", "fr": "Se désabonner",
                          "es": "Darse de baja", "nl": "Afmelden"},
    "unsubscribe_ask": {
        "en": "Stop sending emails to {address}?", "de": "Keine E-Mails mehr an {address} senden?",
        "fr": "Ne plus envoyer d'e-mails à {address} ?",
        "es": "¿Dejar de enviar correos a {address}?",
        "nl": "Geen e-mails meer sturen naar {address}?"},
    "unsubscribe_all": {
        "en": "Unsubscribe from all emails", "de": "Von allen E-Mails abmelden",
        "fr": "Se désabonner de tous les e-mails", "es": "Darse de baja de todos los correos",
        "nl": "Afmelden voor alle e-mails"},
    "unsubscribed_title": {"en": "Unsubscribed", "de": "Abgemeldet", "fr": "Désabonnement fait",
                           "es": "Baja hecha", "nl": "Afgemeld"},
    "unsubscribed": {
        "en": "{address} will receive no more of these emails.",
        "de": "{address} erhält keine dieser E-Mails mehr.",
        "fr": "{address} ne recevra plus ces e-mails.",
        "es": "{address} no recibirá más estos correos.",
        "nl": "{address} ontvangt deze e-mails niet meer."},
    "already_title": {"en": "Already unsubscribed", "de": "Bereits abgemeldet",
                      "fr": "Déjà désabonné", "es": "Ya se dio de baja", "nl": "Al afgemeld"},
    "already": {
        "en": "{address} will receive no more of these emails since an earlier visit: nothing "
              "more to do.",
        "de": "{address} erhält seit einem früheren Besuch keine dieser E-Mails mehr: Es ist "
              "nichts mehr zu tun.",
        "fr": "{address} ne reçoit plus ces e-mails depuis une visite précédente : il n'y a plus "
              "rien à faire.",
        "es": "{address} ya no recibe estos correos desde una visita anterior: no hay nada más "
              "que hacer.",
        "nl": "{address} ontvangt deze e-mails sinds een eerder bezoek niet meer: u hoeft niets "
              "meer te doen."},
    "lists_title": {"en": "Your lists", "de": "Ihre Listen", "fr": "Vos listes",
                    "es": "Sus listas", "nl": "Uw lijsten"},
    "lists_intro": {
        "en": "Or leave one list and stay on the others:",
        "de": "Oder verlassen Sie eine Liste und bleiben Sie auf den anderen:",
        "fr": "Ou quittez une liste et restez sur les autres :",
        "es": "O salga de una lista y siga en las demás:",
        "nl": "Of verlaat één lijst en blijf op de andere:"},
    "leave": {"en": "Leave this list", "de": "Diese Liste verlassen", "fr": "Quitter cette liste",
              "es": "Salir de esta lista", "nl": "Deze lijst verlaten"},
    "left": {"en": "You left {name}.", "de": "Sie haben {name} verlassen.",
             "fr": "Vous avez quitté {name}.", "es": "Ha salido de {name}.",
             "nl": "U hebt {name} verlaten."},
    "status_active": {"en": "Subscribed", "de": "Abonniert", "fr": "Abonné", "es": "Suscrito",
                      "nl": "Ingeschreven"},
    "status_unconfirmed": {"en": "Not confirmed yet", "de": "Noch nicht bestätigt",
                           "fr": "Pas encore confirmé", "es": "Aún sin confirmar",
                           "nl": "Nog niet bevestigd"},
    "status_unsubscribed": {"en": "Left", "de": "Verlassen", "fr": "Quittée", "es": "Abandonada",
                            "nl": "Verlaten"},
    "status_bounced": {"en": "Emails do not arrive", "de": "E-Mails kommen nicht an",
                       "fr": "Les e-mails n'arrivent pas", "es": "Los correos no llegan",
                       "nl": "E-mails komen niet aan"},
    "status_complained": {"en": "Reported as spam", "de": "Als Spam gemeldet",
                          "fr": "Signalé comme spam", "es": "Marcado como spam",
                          "nl": "Als spam gemeld"},
    # The sign-up form
    "form_gone_title": {
        "en": "Sign-up form not found", "de": "Anmeldeformular nicht gefunden",
        "fr": "Formulaire d'inscription introuvable",
        "es": "Formulario de suscripción no encontrado", "nl": "Aanmeldformulier niet gevonden"},
    "form_gone": {
        "en": "This sign-up form does not exist, or the list no longer takes sign-ups.",
        "de": "Dieses Anmeldeformular gibt es nicht, oder die Liste nimmt keine Anmeldungen mehr "
              "an.",
        "fr": "Ce formulaire d'inscription n'existe pas, ou la liste n'accepte plus "
              "d'inscriptions.",
        "es": "Este formulario de suscripción no existe, o la lista ya no acepta suscripciones.",
        "nl": "Dit aanmeldformulier bestaat niet, of de lijst neemt geen aanmeldingen meer aan."},
    "subscribe_title": {"en": "Subscribe to {name}", "de": "{name} abonnieren",
                        "fr": "S'abonner à {name}", "es": "Suscribirse a {name}",
                        "nl": "Abonneren op {name}"},
    "email_label": {"en": "Email address", "de": "E-Mail-Adresse", "fr": "Adresse e-mail",
                    "es": "Correo electrónico", "nl": "E-mailadres"},
    "optional": {"en": "(optional)", "de": "(optional)", "fr": "(facultatif)",
                 "es": "(opcional)", "nl": "(optioneel)"},
    "honeypot": {"en": "Leave this empty", "de": "Dieses Feld leer lassen",
                 "fr": "Laissez ce champ vide", "es": "Deje esto vacío", "nl": "Laat dit leeg"},
    "subscribe": {"en": "Subscribe", "de": "Abonnieren", "fr": "S'abonner",
                  "es": "Suscribirse", "nl": "Abonneren"},
    "wait_title": {"en": "Please wait a minute", "de": "Bitte warten Sie eine Minute",
                   "fr": "Veuillez patienter une minute", "es": "Espere un minuto, por favor",
                   "nl": "Wacht even een minuut"},
    "too_many": {
        "en": "Too many sign-ups from your network; try again in a minute.",
        "de": "Zu viele Anmeldungen aus Ihrem Netz; versuchen Sie es in einer Minute wieder.",
        "fr": "Trop d'inscriptions depuis votre réseau ; réessayez dans une minute.",
        "es": "Demasiadas suscripciones desde su red; inténtelo de nuevo en un minuto.",
        "nl": "Te veel aanmeldingen vanaf uw netwerk; probeer het over een minuut opnieuw."},
    "email_missing": {"en": "Give an email address.", "de": "Geben Sie eine E-Mail-Adresse an.",
                      "fr": "Indiquez une adresse e-mail.",
                      "es": "Indique una dirección de correo.", "nl": "Vul een e-mailadres in."},
    "email_invalid": {
        "en": "This is not a valid email address.", "de": "Das ist keine gültige E-Mail-Adresse.",
        "fr": "Cette adresse e-mail n'est pas valide.",
        "es": "Esta dirección de correo no es válida.", "nl": "Dit is geen geldig e-mailadres."},
    "field_invalid": {
        "en": "Check {label}: this value cannot be used.",
        "de": "Prüfen Sie {label}: Dieser Wert ist nicht möglich.",
        "fr": "Vérifiez {label} : cette valeur n'est pas acceptée.",
        "es": "Revise {label}: este valor no es válido.",
        "nl": "Controleer {label}: deze waarde kan niet worden gebruikt."},
    "form_invalid": {
        "en": "The form could not be read; please fill it in again.",
        "de": "Das Formular konnte nicht gelesen werden; bitte füllen Sie es erneut aus.",
        "fr": "Le formulaire n'a pas pu être lu ; veuillez le remplir à nouveau.",
        "es": "No se pudo leer el formulario; rellénelo de nuevo.",
        "nl": "Het formulier kon niet worden gelezen; vul het opnieuw in."},
    "pending_title": {
        "en": "Almost done: check your email", "de": "Fast geschafft: Sehen Sie in Ihre E-Mails",
        "fr": "Presque terminé : consultez vos e-mails", "es": "Casi listo: revise su correo",
        "nl": "Bijna klaar: kijk in uw e-mail"},
    "pending": {
        "en": "To finish subscribing to {name}, open the link in the email we just sent you.",
        "de": "Um das Abonnement von {name} abzuschließen, öffnen Sie den Link in der E-Mail, "
              "die wir Ihnen gerade geschickt haben.",
        "fr": "Pour terminer votre inscription à {name}, ouvrez le lien de l'e-mail que nous "
              "venons de vous envoyer.",
        "es": "Para terminar su suscripción a {name}, abra el enlace del correo que le acabamos "
              "de enviar.",
        "nl": "Open de link in de e-mail die we u net hebben gestuurd om uw aanmelding voor "
              "{name} af te ronden."},
    "pending_help": {
        "en": "No email after a few minutes? Look in your spam folder, or check the address and "
              "sign up again. Nothing is sent to you until you confirm.",
        "de": "Nach ein paar Minuten keine E-Mail? Sehen Sie im Spam-Ordner nach, oder prüfen "
              "Sie die Adresse und melden Sie sich noch einmal an. Bis Sie bestätigen, schicken "
              "wir Ihnen nichts.",
        "fr": "Pas d'e-mail après quelques minutes ? Regardez dans vos indésirables, ou vérifiez "
              "l'adresse et inscrivez-vous à nouveau. Rien ne vous est envoyé avant votre "
              "confirmation.",
        "es": "¿Ningún correo tras unos minutos? Mire en la carpeta de spam, o revise la "
              "dirección y suscríbase de nuevo. No le enviamos nada hasta que confirme.",
        "nl": "Na een paar minuten geen e-mail? Kijk in uw spammap, of controleer het adres en "
              "meld u opnieuw aan. U krijgt niets tot u bevestigt."},
    "subscribed_title": {"en": "You are subscribed", "de": "Sie sind angemeldet",
                         "fr": "Vous êtes abonné", "es": "Está suscrito",
                         "nl": "U bent ingeschreven"},
    "thanks": {"en": "Thank you: you are on the list {name}.",
               "de": "Danke: Sie stehen auf der Liste {name}.",
               "fr": "Merci : vous êtes inscrit à la liste {name}.",
               "es": "Gracias: está en la lista {name}.",
               "nl": "Bedankt: u staat op de lijst {name}."},
    "every_email": {
        "en": "Every email we send has a link to unsubscribe.",
        "de": "Jede E-Mail, die wir senden, hat einen Link zum Abmelden.",
        "fr": "Chaque e-mail que nous envoyons contient un lien de désabonnement.",
        "es": "Cada correo que enviamos tiene un enlace para darse de baja.",
        "nl": "Elke e-mail die we sturen heeft een link om u af te melden."},
    # Confirming a sign-up
    "confirm_invalid_title": {"en": "This link is not valid", "de": "Dieser Link ist ungültig",
                              "fr": "Ce lien n'est pas valide", "es": "Este enlace no es válido",
                              "nl": "Deze link is ongeldig"},
    "confirm_invalid": {
        "en": "This confirmation link is not valid. Copy the whole link from the email, or sign "
              "up again to get a new one.",
        "de": "Dieser Bestätigungslink ist ungültig. Kopieren Sie den ganzen Link aus der E-Mail, "
              "oder melden Sie sich erneut an, um einen neuen zu erhalten.",
        "fr": "Ce lien de confirmation n'est pas valide. Copiez le lien entier de l'e-mail, ou "
              "inscrivez-vous à nouveau pour en recevoir un nouveau.",
        "es": "Este enlace de confirmación no es válido. Copie el enlace completo del correo, o "
              "suscríbase de nuevo para recibir uno nuevo.",
        "nl": "Deze bevestigingslink is ongeldig. Kopieer de hele link uit de e-mail, of meld u "
              "opnieuw aan voor een nieuwe."},
    "expired_title": {"en": "This link has expired", "de": "Dieser Link ist abgelaufen",
                      "fr": "Ce lien a expiré", "es": "Este enlace ha caducado",
                      "nl": "Deze link is verlopen"},
    "expired": {
        "en": "Confirmation links work for {days} days, and this one is older or no longer "
              "needed. Sign up again to get a new one.",
        "de": "Bestätigungslinks gelten {days} Tage, und dieser ist älter oder wird nicht mehr "
              "gebraucht. Melden Sie sich erneut an, um einen neuen zu erhalten.",
        "fr": "Les liens de confirmation valent {days} jours, et celui-ci est plus ancien ou "
              "n'est plus utile. Inscrivez-vous à nouveau pour en recevoir un nouveau.",
        "es": "Los enlaces de confirmación valen {days} días, y este es más antiguo o ya no hace "
              "falta. Suscríbase de nuevo para recibir uno nuevo.",
        "nl": "Bevestigingslinks werken {days} dagen, en deze is ouder of niet meer nodig. Meld "
              "u opnieuw aan voor een nieuwe."},
    "confirmed_already": {
        "en": "Your subscription to {name} is confirmed. There is nothing more to do.",
        "de": "Ihr Abonnement von {name} ist bestätigt. Es ist nichts mehr zu tun.",
        "fr": "Votre inscription à {name} est confirmée. Il n'y a plus rien à faire.",
        "es": "Su suscripción a {name} está confirmada. No hay nada más que hacer.",
        "nl": "Uw aanmelding voor {name} is bevestigd. U hoeft niets meer te doen."},
    "used_title": {"en": "This link is no longer valid", "de": "Dieser Link ist nicht mehr gültig",
                   "fr": "Ce lien n'est plus valide", "es": "Este enlace ya no es válido",
                   "nl": "Deze link is niet meer geldig"},
    "used": {
        "en": "This confirmation link has been used already. To subscribe again, use the sign-up "
              "form once more.",
        "de": "Dieser Bestätigungslink wurde bereits benutzt. Um sich erneut anzumelden, nutzen "
              "Sie noch einmal das Anmeldeformular.",
        "fr": "Ce lien de confirmation a déjà été utilisé. Pour vous réinscrire, utilisez à "
              "nouveau le formulaire d'inscription.",
        "es": "Este enlace de confirmación ya se ha usado. Para suscribirse de nuevo, use otra "
              "vez el formulario de suscripción.",
        "nl": "Deze bevestigingslink is al gebruikt. Gebruik het aanmeldformulier opnieuw om u "
              "weer aan te melden."},
    "confirm_title": {"en": "Confirm your subscription", "de": "Bestätigen Sie Ihr Abonnement",
                      "fr": "Confirmez votre inscription", "es": "Confirme su suscripción",
                      "nl": "Bevestig uw aanmelding"},
    "confirm_ask": {
        "en": "Please confirm that you want to receive the emails of {name}.",
        "de": "Bitte bestätigen Sie, dass Sie die E-Mails von {name} erhalten möchten.",
        "fr": "Veuillez confirmer que vous souhaitez recevoir les e-mails de {name}.",
        "es": "Confirme que desea recibir los correos de {name}.",
        "nl": "Bevestig dat u de e-mails van {name} wilt ontvangen."},
    "confirm_button": {"en": "Yes, subscribe me", "de": "Ja, anmelden",
                       "fr": "Oui, inscrivez-moi", "es": "Sí, suscribirme",
                       "nl": "Ja, schrijf me in"},
    "confirmed_title": {"en": "Subscription confirmed", "de": "Abonnement bestätigt",
                        "fr": "Inscription confirmée", "es": "Suscripción confirmada",
                        "nl": "Aanmelding bevestigd"},
    # The built-in confirmation email
    "mail_subject": {"en": "Confirm your subscription to {name}",
                     "de": "Bestätigen Sie Ihr Abonnement von {name}",
                     "fr": "Confirmez votre inscription à {name}",
                     "es": "Confirme su suscripción a {name}",
                     "nl": "Bevestig uw aanmelding voor {name}"},
    "mail_hello": {"en": "Hello,", "de": "Hallo,", "fr": "Bonjour,", "es": "Hola:",
                   "nl": "Hallo,"},
    "mail_asked": {
        "en": "someone, hopefully you, asked to receive the emails of {name} at this address.",
        "de": "jemand, hoffentlich Sie, möchte die E-Mails von {name} an diese Adresse erhalten.",
        "fr": "quelqu'un, vous sans doute, a demandé à recevoir les e-mails de {name} à cette "
              "adresse.",
        "es": "alguien, esperamos que usted, pidió recibir los correos de {name} en esta "
              "dirección.",
        "nl": "iemand, hopelijk u, heeft gevraagd de e-mails van {name} op dit adres te "
              "ontvangen."},
    "mail_open": {
        "en": "To confirm, open this link and press the button:",
        "de": "Zum Bestätigen öffnen Sie diesen Link und drücken Sie den Knopf:",
        "fr": "Pour confirmer, ouvrez ce lien et appuyez sur le bouton :",
        "es": "Para confirmar, abra este enlace y pulse el botón:",
        "nl": "Open deze link en druk op de knop om te bevestigen:"},
    "mail_note": {
        "en": "The link works for {days} days. If you did not ask for this, ignore this email: "
              "nothing more will be sent to you.",
        "de": "Der Link gilt {days} Tage. Wenn Sie das nicht wollten, ignorieren Sie diese "
              "E-Mail: Wir schicken Ihnen nichts weiter.",
        "fr": "Le lien est valable {days} jours. Si vous n'avez rien demandé, ignorez cet "
              "e-mail : rien d'autre ne vous sera envoyé.",
        "es": "El enlace vale {days} días. Si usted no lo pidió, ignore este correo: no se le "
              "enviará nada más.",
        "nl": "De link werkt {days} dagen. Hebt u hier niet om gevraagd, negeer deze e-mail dan: "
              "u krijgt verder niets."},
    # The public archive
    "archive_title": {"en": "Archive of {name}", "de": "Archiv von {name}",
                      "fr": "Archives de {name}", "es": "Archivo de {name}",
                      "nl": "Archief van {name}"},
    "archive_gone_title": {"en": "No archive here", "de": "Hier gibt es kein Archiv",
                           "fr": "Pas d'archives ici", "es": "Aquí no hay archivo",
                           "nl": "Hier is geen archief"},
    "archive_gone": {
        "en": "This list has no public archive, or the email is not in it.",
        "de": "Diese Liste hat kein öffentliches Archiv, oder die E-Mail ist nicht darin.",
        "fr": "Cette liste n'a pas d'archives publiques, ou l'e-mail n'y figure pas.",
        "es": "Esta lista no tiene archivo público, o el correo no está en él.",
        "nl": "Deze lijst heeft geen openbaar archief, of de e-mail staat er niet in."},
    "archive_sent": {"en": "Sent {date}", "de": "Gesendet am {date}", "fr": "Envoyé le {date}",
                     "es": "Enviado el {date}", "nl": "Verzonden op {date}"},
    "archive_feed": {"en": "Feed (Atom)", "de": "Feed (Atom)", "fr": "Flux (Atom)",
                     "es": "Canal (Atom)", "nl": "Feed (Atom)"},
    "archive_all": {"en": "All emails of {name}", "de": "Alle E-Mails von {name}",
                    "fr": "Tous les e-mails de {name}", "es": "Todos los correos de {name}",
                    "nl": "Alle e-mails van {name}"},
    "report_expired": {
        "en": "Report links work for {days} days, and this one is older. Ask whoever sent it "
              "for a new one.",
        "de": "Berichtslinks gelten {days} Tage, und dieser ist älter. Bitten Sie den Absender "
              "um einen neuen.",
        "fr": "Les liens de rapport valent {days} jours, et celui-ci est plus ancien. Demandez-en "
              "un nouveau à la personne qui vous l'a envoyé.",
        "es": "Los enlaces de informe valen {days} días, y este es más antiguo. Pida uno nuevo a "
              "quien se lo envió.",
        "nl": "Rapportlinks werken {days} dagen, en deze is ouder. Vraag de afzender om een "
              "nieuwe."},
    "archive_email": {"en": "The email", "de": "Die E-Mail", "fr": "L'e-mail", "es": "El correo",
                      "nl": "De e-mail"},
}


#: Every page a person opens from an email, a form or a shared link (unsubscribe
#: and preferences, sign-up, confirm, the public archive, a bad link): one small,
#: readable shell in the language of its list, as wide as a phone allows.
_PERSON_PAGE = """<!doctype html>
<html lang="{lang}"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>{head}
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:32em;margin:3em auto;padding:0 1em;
color:#222;overflow-wrap:anywhere}} body.wide{{max-width:48em;margin-top:1.5em}}
button{{font:inherit;padding:.5em 1.2em;cursor:pointer}} a{{color:#0b57d0}}
label{{display:block;font-weight:600;margin-bottom:.2em}}small{{font-weight:normal;color:#555}}
input:not([type=checkbox]){{font:inherit;width:100%;box-sizing:border-box;padding:.45em;
border:1px solid #767676;border-radius:4px}}.check label{{display:inline;font-weight:normal}}
.error{{color:#b00020;font-weight:600}} .notice{{background:#e6f4ea;padding:.5em .8em;border-radius:4px}}
.lists{{list-style:none;padding:0}} .lists li{{border-top:1px solid #d0d7de;padding:.6em 0;
display:flex;flex-wrap:wrap;gap:.3em 1em;align-items:center;justify-content:space-between}}
.lists form{{margin:0}} .status{{color:#555}} .sent{{color:#555;font-size:.9em}}
.archive{{list-style:none;padding:0}} .archive li{{border-top:1px solid #d0d7de;padding:.6em 0}}
.archive .sent{{display:block}}
iframe{{width:100%;height:70vh;min-height:20em;border:1px solid #d0d7de;border-radius:4px;
box-sizing:border-box}} h1{{line-height:1.2}} h2{{font-size:1.15em;margin-top:1.5em}}
.trap{{position:absolute;left:-10000px;width:1px;height:1px;overflow:hidden}}</style></head>
<body class="{width}"><main><h1>{title}</h1>{body}</main></body></html>
"""


class _Words:
    """The words of the public pages and the built-in emails in one language
    of LANGUAGES (another: English): ``words(key, **values)`` is plain text,
    ``words.html(key, **markup)`` HTML, its values markup already."""

    def __init__(self, language):
        self.lang = language if language in LANGUAGES else "en"

    def __call__(self, key, **values):
        return _STRINGS[key][self.lang].format(**values)

    def html(self, key, **markup):
        return html.escape(_STRINGS[key][self.lang], quote=False).format(**markup)


def _browser_words():
    """The words of a page whose list is unknown (a garbled link): the first of
    LANGUAGES the browser's Accept-Language asks for, else English."""
    asked = sorted(((q, tag.split("-")[0].lower()) for tag, q in
                    _accept_items(_request_header("Accept-Language"))), reverse=True)
    return _Words(next((lang for q, lang in asked if q > 0 and lang in LANGUAGES), "en"))


def _page_response(title, body, status=200, words=None, wide=False, head=""):
    return bottle.HTTPResponse(
        _PERSON_PAGE.format(title=html.escape(title), body=body, head=head,
                            lang=words.lang if words else "en", width="wide" if wide else ""),
        status=status, headers={"Content-Type": "text/html; charset=utf-8",
                                "Cache-Control": "no-store", "X-Robots-Tag": "noindex"})


def _bad_link_page(words):
    """The page for a link of an email that is garbled, forged or no longer
    known: a person followed it, so a page, not the API's envelope."""
    return _page_response(words("bad_link_title"), f"<p>{words.html('bad_link')}</p>", 404,
                          words)


#: A tracked email: a campaign's (its batch's links) or one of a prepared
#: message (the prepared message's links).
_CAMPAIGN_EMAIL = (
    "SELECT o.id AS outbox, o.account, o.to_addr AS email, o.batch, o.message, o.recipient, "
    "o.prepared, o.merge_values, b.campaign{} FROM outbox o LEFT JOIN batch b ON b.id = o.batch{} "
    "WHERE o.id = ? AND (o.kind = 'campaign' OR o.prepared IS NOT NULL)")


def _campaign_email(conn, secret, purpose, token, size=1):
    """The tracked email (a campaign's, or one of a prepared message) a token
    of ``purpose`` names (its first number), as ``(row, numbers)``: the row
    has outbox, account, email, batch, message, recipient, prepared and
    campaign, and for a click token (two numbers: the email, the link's
    index) the link's stored ``url``.  ``(None, None)`` for a token that is
    not ours or names nothing we sent (never an exception: tokens come from
    the public).  One statement."""
    numbers = read_token(secret, purpose, token)
    if numbers is None or len(numbers) != size:
        return None, None
    numbers = [min(number, MAX_ID) for number in numbers]   # beyond any id: none found
    if size == 2:
        row = conn.execute(_CAMPAIGN_EMAIL.format(
            ", coalesce(l.url, p.url) AS url",
            " LEFT JOIN batch_link l ON l.batch = o.batch AND l.message = o.message "
            "AND l.link = ? LEFT JOIN prepared_link p ON p.prepared = o.prepared AND p.link = ?")
            + " AND coalesce(l.url, p.url) IS NOT NULL",
            (numbers[1], numbers[1], numbers[0])).fetchone()
    else:
        row = conn.execute(_CAMPAIGN_EMAIL.format("", ""), numbers).fetchone()
    return (row, numbers) if row is not None else (None, None)


def _record_event(conn, kind, email, link=None, created=None):
    """Count an open or a click of a campaign email (a row of
    _campaign_email(), or its dict) in the statistics: one INSERT.

    :param created: when it happened (default: now); a kept count is
        written later with the time it came.
    """
    conn.execute(
        "INSERT INTO event (account, kind, campaign, batch, outbox, email, link, created, "
        f"prepared) VALUES (?, ?, ?, ?, ?, ?, ?, ?, {_EMAIL_PREPARED})",
        (email["account"], kind, email["campaign"], email["batch"], email["outbox"],
         email["email"], link, created or _now(), email["outbox"]))


#: An open or a click of the tracked email ``outbox`` (as _campaign_email()
#: finds it), written with what the email's row says when it is written:
#: nothing for an id that names no tracked email.  Parameters: kind, link,
#: created, outbox.
_COUNT_OF_OUTBOX = (
    "INSERT INTO event (account, kind, campaign, batch, outbox, email, link, created, prepared) "
    "SELECT o.account, ?, b.campaign, o.batch, o.id, o.to_addr, CAST(? AS INTEGER), ?, "
    "o.prepared FROM outbox o LEFT JOIN batch b ON b.id = o.batch "
    "WHERE o.id = ? AND (o.kind = 'campaign' OR o.prepared IS NOT NULL)")


def _count_later(call, kind, outbox, link=None):
    """call.later() of an open or a click of the email ``outbox`` (an id a
    signed token gave): the request reads nothing for it; its write finds
    the email (_apply_count())."""
    call.later("count", kind=kind, outbox=outbox, link=link, created=_now())


def _apply_count(call, kind, outbox, link, created):
    """An open or a click kept by call.later() (_count_later())."""
    _apply_counts(call, [{"kind": kind, "outbox": outbox, "link": link, "created": created}])


def _apply_counts(call, counts):
    """Many of _apply_count() in one statement (opens and clicks are written
    behind their answers, many at a time: see _Intake)."""
    call.conn.executemany(_COUNT_OF_OUTBOX, [(count["kind"], count["link"], count["created"],
                                    count["outbox"]) for count in counts])


_apply_count.many = _apply_counts


def _unsubscribe_subject(call, token):
    """``(account, address, campaign, batch, outbox, language)`` of an
    unsubscribe link, or None: an opaque link names one email (``language``
    is its recipient's list's); a link of the first release (base64 payload
    "." mac) names the address and keeps working (``language`` None)."""
    if "." in token:
        subject = read_unsubscribe_token(call.service.secret, token)
        return subject and (*subject, None, None, None)
    numbers = read_token(call.service.secret, "unsubscribe", token)
    if numbers is not None and len(numbers) == 1:   # an email of a prepared message
        row = call.conn.execute(
            "SELECT o.account, o.to_addr, d.language FROM outbox o LEFT JOIN recipient r "
            "ON r.id = o.recipient LEFT JOIN datasource d ON d.id = r.datasource "
            "WHERE o.id = ? AND o.prepared IS NOT NULL", (min(numbers[0], MAX_ID),)).fetchone()
        return row and (row["account"], row["to_addr"], None, None, numbers[0], row["language"])
    if numbers is None or len(numbers) != 2:
        return None
    campaign, recipient = (min(number, MAX_ID) for number in numbers)
    row = call.conn.execute(
        "SELECT r.email, d.owner, d.language FROM recipient r JOIN datasource d "
        "ON d.id = r.datasource JOIN campaign c ON c.owner = d.owner AND c.id = ? WHERE r.id = ?",
        (campaign, recipient)).fetchone()
    if row is None:  # erased since, or never ours
        return None
    # The campaign's latest email to the address: the batch the statistics count it in.
    sent = call.conn.execute(
        "SELECT id, batch FROM outbox WHERE kind = 'campaign' AND to_addr = ? "
        "AND batch IN (SELECT id FROM batch WHERE campaign = ?) ORDER BY id DESC LIMIT 1",
        (row["email"], campaign)).fetchone()
    return (row["owner"], row["email"], campaign, sent and sent["batch"], sent and sent["id"],
            row["language"])


def _preference_lists(conn, account, address):
    """The preference centre's lists: each live datasource of ``account``
    that takes sign-ups and holds ``address`` (id, name, language, the
    recipient's status), by id."""
    return conn.execute(
        "SELECT d.id, d.name, d.language, r.status FROM datasource d JOIN recipient r "
        "ON r.datasource = d.id WHERE d.owner = ? AND d.signup = 1 AND d.deleted = 0 "
        "AND r.email = ? ORDER BY d.id", (account, address)).fetchall()


def _subject_words(language, lists):
    """The words of an unsubscribe link's pages: its recipient's list's
    language; for a link of the first release the first list that holds
    the address, else the browser's."""
    language = language or (lists[0]["language"] if lists else None)
    return _Words(language) if language else _browser_words()


def _unsubscribe_page(call, token, leave=None):
    """The page of an unsubscribe link: leave everything (the one-click
    POST), or, in the preference centre below, one list at a time.
    ``leave`` (a POST to {token}/{datasource}): that list is left (applied
    by _apply_leave) and the page says so.  A GET never changes anything:
    mail scanners and link previews fetch links."""
    subject = _unsubscribe_subject(call, token)
    if subject is None:
        return _bad_link_page(_browser_words())
    account, address, language = subject[0], subject[1], subject[5]
    lists = _preference_lists(call.conn, account, address)
    words = _subject_words(language, lists)
    here = "" if leave is None else "../"   # the forms' paths, relative to this page's
    left = None
    if leave is not None:
        left = next((row for row in lists if str(row["id"]) == leave), None)
        if left is None:
            return _bad_link_page(words)
        call.later("leave", account=account, address=address, datasource=left["id"])
    # After a leave this page answers at {token}/{datasource}: the buttons go back.
    back = f' action="../{html.escape(token)}"' if leave is not None else ""
    who = f"<strong>{html.escape(address)}</strong>"
    if call.conn.execute("SELECT 1 FROM suppression WHERE account = ? AND email = ? "
                         "AND reason IN ('unsubscribed', 'complained')",
                         (account, address)).fetchone():
        title, body = words("already_title"), f"<p>{words.html('already', address=who)}</p>"
    else:
        title = words("unsubscribe_title")
        body = (f"<p>{words.html('unsubscribe_ask', address=who)}</p>"
                f'<form method="post"{back}>'
                '<input type="hidden" name="List-Unsubscribe" value="One-Click">'
                f'<button type="submit">{words.html("unsubscribe_all")}</button></form>')
    return _page_response(title, body + _list_choices(words, here + html.escape(token), lists,
                                                      left), words=words)


def _list_choices(words, action, lists, left=None):
    """The preference centre: each list with its status, and a button to
    leave it while the address is on it; ``left`` the row just left."""
    if not lists:
        return ""
    items = []
    for row in lists:
        status = "unsubscribed" if left is not None and row["id"] == left["id"] \
            else row["status"]
        button = (f'<form method="post" action="{action}/{row["id"]}"><button type="submit" '
                  f'aria-describedby="list{row["id"]}">{words.html("leave")}</button></form>'
                  if status in ("active", "unconfirmed") else "")
        items.append(f'<li><span><strong id="list{row["id"]}">{html.escape(row["name"])}'
                     f'</strong> <span class="status">{words.html("status_" + status)}</span>'
                     f'</span>{button}</li>')
    notice = (f'<p class="notice" role="status">{words.html("left", name=html.escape(left["name"]))}'
              "</p>" if left is not None else "")
    return (f'<h2>{words.html("lists_title")}</h2>{notice}<p>{words.html("lists_intro")}</p>'
            f'<ul class="lists">{"".join(items)}</ul>')


def _leave_post(call, token, ds):
    """Leave one list of the preference centre (the page's per-list button)."""
    return _unsubscribe_page(call, token, leave=ds)


def _unsubscribe_post(call, token):
    # RFC 8058 one-click, and the page's button to leave everything: both at once.
    subject = _unsubscribe_subject(call, token)
    if subject is None:
        return _bad_link_page(_browser_words())
    account, address, campaign, batch, outbox, language = subject
    call.later("unsubscribe", account=account, address=address, campaign=campaign, batch=batch,
               outbox=outbox)
    words = _subject_words(language, () if language else _preference_lists(
        call.conn, account, address))
    return _page_response(words("unsubscribed_title"), (
        f"<p>{words.html('unsubscribed', address=f'<strong>{html.escape(address)}</strong>')}"
        "</p>"), words=words)


def _apply_unsubscribe(call, account, address, campaign, batch, outbox):
    suppress(call.conn, account, address, "unsubscribed", campaign, batch=batch, outbox=outbox,
             pending=call.events)


def _apply_leave(call, account, address, datasource):
    """Leave one list (kept by call.later()): only that list's recipient
    becomes unsubscribed; the address stays on the account's other lists and
    off its suppression list, so their campaigns still reach it."""
    if call.conn.execute(
            "UPDATE recipient SET status = 'unsubscribed', updated = ? WHERE datasource = ? "
            "AND email = ? AND status IN ('active', 'unconfirmed') "
            "AND datasource IN (SELECT id FROM datasource WHERE owner = ?)",
            (_now(), datasource, address, account)).rowcount:
        emit(call.conn, account, "recipient.unsubscribed",
             {"email": address, "campaign": None, "batch": None,
              "datasource": str(datasource)}, call.events)


# Open and click ----------------------------------------------------------------

def _read_by_a_person():
    # HEAD (Bottle answers it with the GET route) is a link checker asking
    # whether the link works: nobody opened or clicked anything.
    return bottle.request.method == "GET"


def _open(call, token):
    """The open image.  Every token gets the same GIF (a broken image would
    show in the email, and the answer tells nothing about the token); only a
    valid one counts an open.  Nothing is read here: the signature is the
    check, and the count finds the email when it is written (_COUNT_OF_OUTBOX)."""
    numbers = read_token(call.service.secret, "open", token)
    if numbers is not None and len(numbers) == 1 and _read_by_a_person():
        _count_later(call, "open", min(numbers[0], MAX_ID))   # beyond any id: none found
    return bottle.HTTPResponse(_GIF_PIXEL, 200, {
        "Content-Type": "image/gif", "Cache-Control": "no-store, max-age=0",
        "X-Robots-Tag": "noindex"})


def _click(call, token):
    """A tracked link: 302 to the URL stored for that link of that email's
    batch, filled with the recipient's merge values; a click counted.
    Anything else (forged, altered, unknown) is a 404 page: never a redirect
    to a URL the request chose."""
    email, numbers = _campaign_email(call.conn, call.service.secret, "click", token, size=2)
    if email is None:
        return _bad_link_page(_browser_words())
    values = {}
    if "{" in email["url"] and email["recipient"] is None and email["prepared"] is not None:
        values = _merge_values(email["merge_values"], email["email"])
    elif "{" in email["url"]:  # merge tags: the recipient's values now (none when erased)
        recipient = call.conn.execute("SELECT * FROM recipient WHERE id = ?",
                                      (email["recipient"],)).fetchone()
        if recipient is not None:
            values = _recipient_values(_datasource_fields(call.conn, recipient["datasource"]),
                                      recipient)
    target = _click_target(email["url"], values)
    if _read_by_a_person():
        _count_later(call, "click", email["outbox"], numbers[1])
    return bottle.HTTPResponse(status=302, headers={
        "Location": target, "Cache-Control": "no-store", "X-Robots-Tag": "noindex",
        "Referrer-Policy": "no-referrer"})


# Sign-ups and their confirmation ---------------------------------------------

#: How long a confirmation link works, and an unconfirmed sign-up waits.
_CONFIRM_DAYS = 7
#: At most one confirmation email per recipient within this time.
_CONFIRM_EVERY = datetime.timedelta(minutes=10)
#: The form's hidden trap: people leave it empty, form-filling bots do not.
_HONEYPOT = "_website"
#: A sign-up is a few short values: larger bodies are refused unread.
_SIGNUP_MAX_BODY = 64 * 1024
#: HTML input types of the field types on the sign-up form.
_INPUT_TYPES = {"text": 'type="text"', "integer": 'type="number" step="1"',
                "number": 'type="number" step="any"', "boolean": 'type="checkbox" value="1"',
                "date": 'type="date"', "datetime": 'type="datetime-local"',
                "email": 'type="email"'}


def _confirm_url(secret, base, recipient_id):
    """The link of a confirmation email: names the recipient by id (signed,
    no address), valid for _CONFIRM_DAYS."""
    token = sign_token(secret, "confirm", recipient_id, _today() + _CONFIRM_DAYS)
    return f"{base.rstrip('/')}/v1/confirm/{token}"


def _signup_list(call, ds):
    """The live datasource ``ds`` (path text) that takes sign-ups, else None."""
    datasource = _as_int(ds) if ds.isdigit() else None
    if datasource is None:
        return None
    return call.conn.execute("SELECT * FROM datasource WHERE id = ? AND deleted = 0 "
                             "AND signup = 1", (datasource,)).fetchone()


def _list_page(words, title, body, status=200, cors=False):
    response = _page_response(title, body, status, words)
    if cors:
        response.set_header("Access-Control-Allow-Origin", "*")
    return response


def _form_gone(status=404, cors=False):
    words = _browser_words()   # no list, so no language of its own
    return _list_page(words, words("form_gone_title"), f"<p>{words.html('form_gone')}</p>",
                      status, cors)


def _signup_form(call, ds, values=None, error=None, status=200):
    """The sign-up form of a datasource in its language: the address and its
    fields, each with its label (else its name); plain HTML that works
    without JavaScript.  After a refusal: what was typed, the ``error``
    (ApiError) above, and the field it names marked."""
    datasource = _signup_list(call, ds)
    if datasource is None:
        return _form_gone()
    words, values = _Words(datasource["language"]), values or {}
    fields = call.conn.execute("SELECT id, name, type, label FROM field WHERE datasource = ? "
                               "ORDER BY id", (datasource["id"],)).fetchall()
    labels = {name.lower(): label or name for _, name, _, label in fields}
    labels["email"] = next((label for _, name, _, label in fields
                            if name.lower() == "email" and label), words("email_label"))
    rows = []
    for field_id, name, kind, _ in fields:
        is_email = name.lower() == "email"
        key = "email" if is_email else name
        label = labels[name.lower()]
        given = values.get(key)
        value = "" if given is None or kind == "boolean" else f' value="{html.escape(str(given))}"'
        checked = " checked" if kind == "boolean" and given not in (None, "", "0") else ""
        extra = ' required autocomplete="email"' if is_email else ""
        if error and error.extra.get("field") == key:
            extra += ' aria-invalid="true" aria-describedby="form-error"'
        control = (f'<input id="f{field_id}" name="{html.escape(key)}" '
                   f'{_INPUT_TYPES[kind]}{value}{checked}{extra}>')
        if kind == "boolean":
            rows.append(f'<p class="check">{control} <label for="f{field_id}">'
                        f'{html.escape(label)}</label></p>')
        else:
            optional = "" if is_email else f" <small>{words.html('optional')}</small>"
            rows.append(f'<p><label for="f{field_id}">{html.escape(label)}{optional}</label>'
                        f'{control}</p>')
        if is_email:  # the address first, whatever the field order
            rows.insert(0, rows.pop())
    alert = (f'<p class="error" id="form-error" role="alert">'
             f'{html.escape(_form_error(words, error, labels))}</p>' if error else "")
    description = (f"<p>{html.escape(datasource['description'])}</p>"
                   if datasource["description"].strip() else "")
    body = (f"{description}{alert}<form method=\"post\" accept-charset=\"utf-8\">{''.join(rows)}"
            f'<p class="trap" aria-hidden="true"><label for="hp">{words.html("honeypot")}</label>'
            f'<input id="hp" name="{_HONEYPOT}" type="text" tabindex="-1" autocomplete="off"></p>'
            f'<p><button type="submit">{words.html("subscribe")}</button></p></form>')
    return _list_page(words, words("subscribe_title", name=datasource["name"]), body, status)


def _form_error(words, error, labels):
    """The sentence above a refused sign-up form: in English the API's own
    (it names the value at fault); in another language the same point
    without the value: the address is missing or wrong, or which field to
    check, or that the form could not be read."""
    field = error.extra.get("field")
    if words.lang == "en":
        return error.message
    if field == "email":
        return words("email_missing" if isinstance(error, MissingParameter) else "email_invalid")
    if isinstance(field, str) and field.lower() in labels:
        return words("field_invalid", label=labels[field.lower()])
    return words("form_invalid")


def _signup_as_page(environ):
    """Whether a sign-up is answered with a page: a form post, or a browser
    that sent no JSON; JSON clients get the envelope."""
    content_type = _content_type(environ)
    return content_type == "application/x-www-form-urlencoded" or (
        content_type != "application/json" and _prefers_html(_request_header("Accept")))


def _signup_body(environ):
    """The values of a sign-up, ``{name: value}``: from a form post or a
    JSON object."""
    content_type = _content_type(environ)
    body = _read_body(environ, _SIGNUP_MAX_BODY)
    if not body.strip():
        return {}
    if content_type == "application/x-www-form-urlencoded":
        try:
            pairs = urllib.parse.parse_qsl(body.decode("latin-1"), keep_blank_values=True,
                                           encoding="utf-8", errors="strict")
        except UnicodeDecodeError:
            raise InvalidParameter("The form is not valid UTF-8.") from None
        given = {}
        for name, value in pairs:
            if name in given:
                raise InvalidParameter(f"'{name[:100]}' is given twice.", field=name)
            given[name] = value
        return given
    if content_type != "application/json":
        raise UnsupportedMediaType("Send a sign-up as a form (application/x-www-form-urlencoded) "
                                   "or as JSON.")
    try:
        given = json.loads(body.decode("utf-8-sig"))
        _to_json(given).encode("utf-8")  # refuses lone surrogates
    except (ValueError, RecursionError, UnicodeEncodeError):
        raise InvalidJson("The request body is not valid JSON (UTF-8).") from None
    if not isinstance(given, dict):
        raise InvalidJson("The request body must be a JSON object of sign-up values.")
    return given


def _signup_values(call, datasource, given):
    """The address and ``{field id: value}`` of a sign-up, checked: unknown
    names are refused (a typo must not lose what a person typed)."""
    fields = _datasource_fields(call.conn, datasource["id"])
    unknown = sorted(name for name in given if name != _HONEYPOT and (
        name.lower() not in fields or name.lower() == "email" and name != "email"))
    if unknown:
        raise UnknownParameter(f"Unknown field{'s' if len(unknown) > 1 else ''}: "
                               f"{', '.join(name[:100] for name in unknown)}.", field=unknown,
                               allowed=sorted(f[1] if f[1].lower() != "email" else "email"
                                              for f in fields.values()))
    for name, value in given.items():
        if value is not None and (not isinstance(value, (str, int, float, bool))
                                  or "\x00" in str(value)):
            raise InvalidParameter(f"'{name[:100]}' must be a string or a number.", field=name)
    if "email" not in given or given["email"] in (None, ""):
        raise MissingParameter("Give an email address.", field="email")
    address = _normalize_email(given["email"])
    if address is None:
        raise InvalidParameter("This is not a valid email address.", field="email")
    data = {}
    for name, value in given.items():
        if name in ("email", _HONEYPOT):
            continue
        field_id, label, kind = fields[name.lower()]
        try:
            converted = _convert_value(kind, value)
        except ValueError as error:
            raise InvalidParameter(f"{label}: {error}.", field=name) from None
        if converted is not None:
            data[str(field_id)] = converted
    return address, data


def _signup_post(call, ds):
    """A public sign-up.  The answer is the same for a new, an active, an
    unconfirmed or a suppressed address, and for a filled honeypot."""
    bottle.response.set_header("Access-Control-Allow-Origin", "*")
    datasource = _signup_list(call, ds)
    given, as_page = {}, _signup_as_page(bottle.request.environ)
    try:
        given = _signup_body(bottle.request.environ)
        if datasource is None:
            raise NotFound(f"There is no sign-up form at datasource {ds[:30]}.")
        rate = call.service.config["signup_rate"]
        if rate:
            wait = call.service.signup_limit.wait(bottle.request.environ.get("REMOTE_ADDR", ""),
                                                  rate)
            if wait:
                raise TooManyRequests("Too many sign-ups from your network; try again in a "
                                      "minute.", wait)
        address, data = _signup_values(call, datasource, given)
        if not str(given.get(_HONEYPOT) or "").strip():
            call.later("signup", datasource=datasource["id"], address=address, data=data,
                       base=call.base_url)
    except ApiError as error:
        if not as_page:
            raise
        if datasource is None:
            return _form_gone(error.status, cors=True)
        words = _Words(datasource["language"])
        if isinstance(error, TooManyRequests):
            page = _list_page(words, words("wait_title"), f"<p>{words.html('too_many')}</p>",
                              429, cors=True)
            page.set_header("Retry-After", str(error.headers["Retry-After"]))
            return page
        # The form again, with what was typed and what to fix.
        page = _signup_form(call, ds, {k: v for k, v in given.items() if isinstance(k, str)},
                            error, error.status)
        page.set_header("Access-Control-Allow-Origin", "*")
        return page
    status = "pending" if datasource["doubleoptin"] else "subscribed"
    if not as_page:
        return {"status": status}
    words, name = _Words(datasource["language"]), html.escape(datasource["name"])
    if status == "pending":
        return _list_page(words, words("pending_title"), (
            f"<p>{words.html('pending', name=f'<strong>{name}</strong>')}</p>"
            f"<p>{words.html('pending_help')}</p>"), cors=True)
    return _list_page(words, words("subscribed_title"), _thanks(words, name), cors=True)


def _thanks(words, name):
    """The page text of a subscription that is done: ``name`` the list's, escaped."""
    return (f"<p>{words.html('thanks', name=f'<strong>{name}</strong>')}</p>"
            f"<p>{words.html('every_email')}</p>")


def _subscribe_options(call, ds):
    """The CORS preflight of a cross-origin JSON sign-up."""
    return bottle.HTTPResponse("", status=200, headers={
        "Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "POST, OPTIONS",
        "Access-Control-Allow-Headers": "Content-Type", "Access-Control-Max-Age": "86400"})


def _apply_signup(call, datasource, address, data, base):
    """A sign-up kept by call.later(): to the list if it still takes them."""
    row = call.conn.execute("SELECT * FROM datasource WHERE id = ? AND deleted = 0 "
                            f"AND signup = 1 {call.conn.sql['for_share']}",
                            (datasource,)).fetchone()
    if row is not None:
        call.base = base
        _sign_up(call, row, address, data)


def _sign_up(call, datasource, address, data):
    """Store one sign-up (in the caller's transaction) and queue its email.

    A new address is stored unconfirmed with double opt-in, else active; one
    the account suppressed or erased is stored as blocked.  A known address
    keeps its status and values: with double opt-in a recipient that is not
    active gets a confirmation email (at most one per _CONFIRM_EVERY), which
    is the only way back for a blocked one; without, an unconfirmed one
    becomes active and a blocked one stays as it is.
    """
    conn, now, account = call.conn, _now(), datasource["owner"]
    status = _blocked_status(conn, call.service.secret, account, address) or (
        "unconfirmed" if datasource["doubleoptin"] else "active")
    # DO NOTHING: the same address signed up twice at once is stored once,
    # and the second finds it like any known address (never a 409).
    first = conn.next_id("recipient")   # None: the sequence's next id (see ID_REACH)
    ids = ("", "", ()) if first is None else ("id, ", "?, ", (first,))
    stored = conn.execute(
        f"INSERT INTO recipient ({ids[0]}datasource, email, data, status, created, updated) "
        f"VALUES ({ids[1]}?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (*ids[2], datasource["id"], address, _to_json(data), status, now, now)).rowcount
    row = conn.execute("SELECT * FROM recipient WHERE datasource = ? AND email = ?",
                       (datasource["id"], address)).fetchone()
    if stored:
        emit(call.conn, account, "recipient.subscribed",
             {"id": str(row["id"]), "datasource": str(datasource["id"]), "email": address,
              "status": status}, call.events)
        if status == "active":
            _queue_welcome(call, datasource, row)
    elif row["status"] == "unconfirmed" and not datasource["doubleoptin"]:
        conn.execute("UPDATE recipient SET status = 'active', confirm_sent = NULL, updated = ? "
                     "WHERE id = ?", (now, row["id"]))
        # Double opt-in was turned off meanwhile: signing up again confirms.
        emit(call.conn, account, "recipient.confirmed",
             {"id": str(row["id"]), "datasource": str(datasource["id"]), "email": address},
             call.events)
        _queue_welcome(call, datasource, row)
        return
    if row["status"] == "active" or not datasource["doubleoptin"]:
        return
    last = row["confirm_sent"]
    if last and last > (datetime.datetime.now(datetime.timezone.utc) - _CONFIRM_EVERY).strftime(
            "%Y-%m-%d %H:%M:%S"):
        return
    conn.execute("UPDATE recipient SET confirm_sent = ?, updated = ? WHERE id = ?",
                 (now, now, row["id"]))
    link = _confirm_url(call.service.secret, call.base_url, row["id"])
    message = _list_message(conn, datasource, "confirmmessage")
    if message is not None and all("confirm_url" in _merge_tags(message[body])
                                   for body in ("html", "text") if message[body].strip()):
        _queue_list_email(call, datasource, row, message, confirm=link)
        return
    # The built-in confirmation email, in the list's language.
    words, name = _Words(datasource["language"]), datasource["name"]
    name_html = html.escape(name)
    _queue_list_email(call, datasource, row, {
        "subject": words("mail_subject", name=name),
        "text": (f"{words('mail_hello')}\n\n{words('mail_asked', name=chr(34) + name + chr(34))}"
                 f"\n\n{words('mail_open')}\n{{{{confirm_url}}}}\n\n"
                 f"{words('mail_note', days=_CONFIRM_DAYS)}\n"),
        "html": (f"<p>{words.html('mail_hello')}</p><p>"
                 f"{words.html('mail_asked', name=f'<strong>{name_html}</strong>')}</p>"
                 f'<p><a href="{{{{confirm_url}}}}">{words.html("confirm_title")}</a></p>'
                 f"<p>{words.html('mail_note', days=_CONFIRM_DAYS)}</p>"),
        "fromname": "", "fromaddress": "", "replyto": ""}, confirm=link)


def _list_message(conn, datasource, setting):
    """The live message a datasource names in ``setting``, or None."""
    if datasource[setting] is None:
        return None
    return conn.execute("SELECT * FROM message WHERE id = ? AND owner = ? AND deleted = 0",
                        (datasource[setting], datasource["owner"])).fetchone()


def _queue_welcome(call, datasource, recipient):
    message = _list_message(call.conn, datasource, "welcomemessage")
    if message is not None:
        _queue_list_email(call, datasource, recipient, message)


def _queue_list_email(call, datasource, recipient, message, confirm=""):
    """Queue a sign-up's email (``message``: a message row or the same keys),
    rendered now for ``recipient`` and sent as the datasource's profile (the
    message's own sender wins where set, as for campaigns)."""
    conn, account = call.conn, datasource["owner"]
    profile = conn.execute("SELECT fromname, fromaddress, replyto FROM accountprofile "
                           "WHERE id = ? AND owner = ?", (datasource["fromprofile"], account)
                           ).fetchone()
    sender = {name: message[name] or (profile[name] if profile else "") or None
              for name in ("fromname", "fromaddress", "replyto")}
    values = {name.lower(): value for name, value in _recipient_values(
        _datasource_fields(conn, datasource["id"]), recipient).items()}
    values["confirm_url"] = confirm
    values["unsubscribe_url"] = _unsubscribe_url(call.service.secret, call.base_url, account,
                                                recipient["email"])
    enqueue(conn, account, "signup", recipient["email"], recipient=recipient["id"],
            subject=_Template(message["subject"]).fill(values) or "(no subject)",
            body=_Template(message["text"]).fill(values) if message["text"] else "",
            html=_Template(message["html"]).fill(values, as_html=True) or None, sender=sender)


_CONFIRM_ROW = ("SELECT r.*, d.name AS list_name, d.owner, d.welcomemessage, d.fromprofile, "
                "d.language FROM recipient r JOIN datasource d ON d.id = r.datasource "
                "WHERE r.id = ? AND d.deleted = 0")


def _confirm_subject(call, token):
    """``(recipient row with its list, words, None)`` for a token that can
    confirm, else ``(None, words, page)``: the page saying why not, in the
    list's language (the browser's when the list is unknown)."""
    numbers = read_token(call.service.secret, "confirm", token)
    row = None
    if numbers is not None and len(numbers) == 2:
        row = call.conn.execute(_CONFIRM_ROW, (numbers[0],)).fetchone()
    words = _Words(row["language"]) if row is not None else _browser_words()
    if numbers is None or len(numbers) != 2:
        title, text, status = "confirm_invalid_title", words.html("confirm_invalid"), 404
    elif numbers[1] < _today() or row is None:
        title, status = "expired_title", 404
        text = words.html("expired", days=_CONFIRM_DAYS)
    elif row["status"] == "active":
        title, status = "subscribed_title", 200
        text = words.html("confirmed_already",
                          name=f"<strong>{html.escape(row['list_name'])}</strong>")
    elif row["confirm_sent"] is None:
        title, text, status = "used_title", words.html("used"), 404
    else:
        return row, words, None
    return None, words, _list_page(words, words(title), f"<p>{text}</p>", status)


def _confirm_page(call, token):
    # GET never confirms: mail scanners and link previews open links.
    row, words, page = _confirm_subject(call, token)
    if page is not None:
        return page
    name = f"<strong>{html.escape(row['list_name'])}</strong>"
    return _list_page(words, words("confirm_title"), (
        f"<p>{words.html('confirm_ask', name=name)}</p>"
        f'<form method="post"><button type="submit">{words.html("confirm_button")}</button>'
        "</form>"))


def _confirm_post(call, token):
    """Confirm (applied by _apply_confirm)."""
    row, words, page = _confirm_subject(call, token)
    if page is not None:
        return page
    call.later("confirm", recipient=row["id"], base=call.base_url)
    return _list_page(words, words("confirmed_title"),
                      _thanks(words, html.escape(row["list_name"])))


def _apply_confirm(call, recipient, base):
    """Confirm: the recipient becomes active, the account's suppression and
    erasure of the address are lifted (the person asked anew), the welcome
    message goes once.  A second confirm finds it active and changes nothing."""
    row = call.conn.execute(_CONFIRM_ROW, (recipient,)).fetchone()
    if row is None or row["status"] == "active" or row["confirm_sent"] is None:
        return
    call.base = base
    conn, account = call.conn, row["owner"]
    conn.execute("UPDATE recipient SET status = 'active', confirm_sent = NULL, updated = ? "
                 "WHERE id = ?", (_now(), row["id"]))
    conn.execute("DELETE FROM suppression WHERE account = ? AND email = ?",
                 (account, row["email"]))
    conn.execute("DELETE FROM erasure WHERE account = ? AND hash = ?",
                 (account, _erasure_hash(call.service.secret, row["email"])))
    emit(call.conn, account, "recipient.confirmed",
         {"id": str(row["id"]), "datasource": str(row["datasource"]), "email": row["email"]},
         call.events)
    datasource = conn.execute("SELECT * FROM datasource WHERE id = ?",
                              (row["datasource"],)).fetchone()
    _queue_welcome(call, datasource, row)


# The public archive and report links -----------------------------------------

#: How many batches a public archive page and its feed show, newest first.
_ARCHIVE_SHOWN = 50
#: The public archive of a datasource: the sent batches of its owner's public,
#: live campaigns that mailed it (their segments drew from it: batch_datasource,
#: read by its key however big the batches), newest first.
_PUBLIC_BATCHES = (
    "SELECT b.id, coalesce(b.finished, b.timestamp) AS sent, c.name AS campaign_name "
    "FROM batch_datasource d JOIN batch b ON b.id = d.batch JOIN campaign c ON c.id = b.campaign "
    "WHERE d.datasource = ? AND c.owner = ? AND c.public = 1 AND c.deleted = 0 "
    "AND b.status = 'sent' {} ORDER BY sent DESC, b.id DESC LIMIT ?")
#: A link whose address was a merge tag (the unsubscribe link, a confirm
#: link): emptied in the archive, so the link goes and its words stay.
_EMPTIED_LINK = re.compile(r"""<a\b[^>]*?\bhref\s*=\s*(?:""|'')[^>]*>(.*?)</a\s*>""",
                           re.IGNORECASE | re.DOTALL)
#: Characters XML 1.0 cannot hold, left out of the feed.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _archive_batches(call, ds, batch=None):
    """``(datasource, words, batches)`` of the public archive of datasource
    ``ds`` (``batch``: that one only): its batch rows (id, sent,
    campaign_name) newest first, each with ``messages`` as the archive shows
    them; ``batches`` is empty for a datasource that does not take sign-ups
    or has no such batch."""
    datasource = _signup_list(call, str(ds))
    if datasource is None:
        return None, _browser_words(), []
    only = (batch,) if batch is not None else ()
    rows = call.conn.execute(_PUBLIC_BATCHES.format("AND b.id = ?" if only else ""), (
        datasource["id"], datasource["owner"], *only, _ARCHIVE_SHOWN)).fetchall()
    messages = {}
    for row in call.conn.execute("SELECT * FROM batch_message WHERE batch IN ({}) ORDER BY "
                                 "batch, message".format(", ".join("?" for _ in rows) or "NULL"),
                                 [row["id"] for row in rows]):
        messages.setdefault(row["batch"], []).append(_as_archived(row))
    batches = [{**dict(row), "messages": messages.get(row["id"], [])} for row in rows]
    return datasource, _Words(datasource["language"]), batches


def _as_archived(message):
    """A batch's message as the public archive shows it (``{subject, html,
    text}``): every merge value empty, so no unsubscribe link, no address and
    no value of a recipient; the html before tracking, so no tracked link
    and no open image."""
    html_body = _Template(message["html"]).fill({}, as_html=True)
    return {"subject": _Template(message["subject"]).fill({}) or "(no subject)",
            "html": _EMPTIED_LINK.sub(r"\1", html_body),
            "text": _Template(message["text"]).fill({})}


def _archive_gone(words):
    return _page_response(words("archive_gone_title"), f"<p>{words.html('archive_gone')}</p>",
                          404, words)


def _archive_list(call, ds):
    """The public archive page of a datasource: its sent emails, newest first."""
    datasource, words, batches = _archive_batches(call, ds)
    if not batches:
        return _archive_gone(words)
    name = html.escape(datasource["name"])
    items = "".join(
        f'<li><a href="{ds}/{batch["id"]}">{html.escape(batch["messages"][0]["subject"] if batch["messages"] else batch["campaign_name"])}'
        f'</a> <span class="sent">{words.html("archive_sent", date=batch["sent"][:10])}</span>'
        "</li>" for batch in batches)
    return _page_response(words("archive_title", name=datasource["name"]), (
        f'<ul class="archive">{items}</ul><p><a href="../subscribe/{ds}">{words.html("subscribe_title", name=name)}'
        f'</a> · <a href="{ds}/feed" type="application/atom+xml">{words.html("archive_feed")}'
        "</a></p>"), words=words, wide=True, head=(   # where feed readers look for it
            f'<link rel="alternate" type="application/atom+xml" href="{ds}/feed">'))


def _archive_batch(call, ds, batch):
    """One email of the public archive, as it was sent (merge values empty),
    in a sandboxed frame: its html runs no script and reaches nothing here."""
    datasource, words, batches = _archive_batches(call, ds, batch)
    if not batches:
        return _archive_gone(words)
    parts = []
    for index, message in enumerate(batches[0]["messages"]):
        if index:
            parts.append(f"<h2>{html.escape(message['subject'])}</h2>")
        if message["html"].strip():
            parts.append(f'<iframe sandbox="" referrerpolicy="no-referrer" title="'
                         f'{words.html("archive_email")}: {html.escape(message["subject"])}" '
                         f'srcdoc="{html.escape(message["html"], quote=True)}"></iframe>')
        else:
            parts.append(f'<pre style="white-space:pre-wrap">{html.escape(message["text"])}</pre>')
    first = batches[0]["messages"][0]["subject"] if batches[0]["messages"] else \
        batches[0]["campaign_name"]
    name = html.escape(datasource["name"])
    return _page_response(first, (
        f'<p class="sent">{words.html("archive_sent", date=batches[0]["sent"][:10])}</p>'
        + "".join(parts) + f'<p><a href="../{ds}">{words.html("archive_all", name=name)}</a> · '
        f'<a href="../../subscribe/{ds}">{words.html("subscribe_title", name=name)}</a></p>'),
        words=words, wide=True)


def _atom_time(moment):
    return moment.replace(" ", "T") + "Z"


def _archive_feed(call, ds):
    """The public archive as an Atom feed (RFC 4287): an entry per email,
    its html as the content; absolute links, from the public URL."""
    datasource, words, batches = _archive_batches(call, ds)
    if not batches:
        return _archive_gone(words)

    def text(value):
        return html.escape(_NOT_XML.sub("", value), quote=True)

    base = f"{call.base_url}/v1/archive/{ds}"
    entries = []
    for batch in batches:
        messages = batch["messages"]
        content = "<hr>".join(message["html"] if message["html"].strip()
                              else f"<pre>{html.escape(message['text'])}</pre>"
                              for message in messages)
        entries.append(
            f"<entry><id>{text(base)}/{batch['id']}</id>"
            f"<title>{text(messages[0]['subject'] if messages else batch['campaign_name'])}</title>"
            f"<updated>{_atom_time(batch['sent'])}</updated>"
            f'<link rel="alternate" type="text/html" href="{text(base)}/{batch["id"]}"/>'
            f'<content type="html">{text(content)}</content></entry>')
    feed = (f'<?xml version="1.0" encoding="utf-8"?>\n<feed xmlns="http://www.w3.org/2005/Atom" '
            f'xml:lang="{words.lang}"><id>{text(base)}</id>'
            f"<title>{text(words('archive_title', name=datasource['name']))}</title>"
            f"<updated>{_atom_time(batches[0]['sent'])}</updated>"
            f'<link rel="self" type="application/atom+xml" href="{text(base)}/feed"/>'
            f'<link rel="alternate" type="text/html" href="{text(base)}"/>'
            f"<author><name>{text(datasource['name'])}</name></author>{''.join(entries)}</feed>\n")
    return bottle.HTTPResponse(feed, 200, {"Content-Type": "application/atom+xml; charset=utf-8",
                                           "Cache-Control": "max-age=300"})


def _report_page(call, token):
    """The statistics page of a report link (reporturl): a campaign's (its
    token's batch 0) or one batch's, for a person without a key, read-only,
    while the link is valid."""
    numbers = read_token(call.service.secret, "report", token)
    words = _browser_words()
    if numbers is None or len(numbers) != 3:
        return _bad_link_page(words)
    campaign, batch, expires = (min(number, MAX_ID) for number in numbers)
    if expires < _today():
        return _page_response(words("expired_title"), (
            f"<p>{words.html('report_expired', days=_REPORT_DAYS)}</p>"), 404, words)
    row = call.conn.execute("SELECT * FROM campaign WHERE id = ?", (campaign,)).fetchone()
    if batch:
        found = call.conn.execute("SELECT * FROM batch WHERE id = ? AND campaign = ?",
                                  (batch, campaign)).fetchone()
        record = found and _batch_record(call.conn, found, with_messages=False)
        title = row and f"{row['name']}, batch {batch}: what happened"
    else:
        record = row and _campaign_archive(call.conn, campaign)
        title = row and f"{row['name']}: what happened"
    if not record:
        return _bad_link_page(words)
    page = _statistics_page(record, title)
    page.set_header("X-Robots-Tag", "noindex")
    page.set_header("Referrer-Policy", "no-referrer")   # the link is the key: keep it here
    return page


#: What the public routes hand to call.later(), by kind: each function
#: applies one write, its payload as keyword arguments, in the caller's
#: transaction (see _Intake).  One with ``many`` (opens and clicks) applies
#: a run of its kind at once, and may be written behind its answer.
_LATER = {
    "count": _apply_count,
    # An open or a click as an earlier release kept it (the email's row with it).
    "event": lambda call, kind, email, link, created:
        _record_event(call.conn, kind, email, link, created),
    "unsubscribe": _apply_unsubscribe,
    "leave": _apply_leave,
    "signup": _apply_signup,
    "confirm": _apply_confirm,
}


def _remove_unconfirmed(db, limit=1000):
    """Delete sign-ups left unconfirmed for _CONFIRM_DAYS (since their last
    sign-up), at most ``limit`` per call: the worker runs it with its batches.

    :returns: how many were removed.
    """
    cutoff = (datetime.datetime.now(datetime.timezone.utc)
              - datetime.timedelta(days=_CONFIRM_DAYS)).strftime("%Y-%m-%d %H:%M:%S")
    conn = connect(db)
    try:
        with transaction(conn):
            return conn.execute(
                "DELETE FROM recipient WHERE id IN (SELECT id FROM recipient "
                "WHERE status = 'unconfirmed' AND updated < ? ORDER BY updated LIMIT ?)",
                (cutoff, limit)).rowcount
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Outgoing HTTP: signing what we post, the addresses we may call, a small
# HTTP/1.1 client (webhook deliveries, the verify links check, SNS certificates)
# ---------------------------------------------------------------------------
#
# Events are signed by the Standard Webhooks convention and posted only to
# public addresses (server-side request forgery), to the address that was
# checked (no second DNS lookup: rebinding), within one time bound, never
# following redirects.  (The providers' callbacks that come in are Inbound
# mail's.)
#
# The Standard Webhooks signature is one HMAC, written here by hand: the
# reference library's sign() takes text rather than the body's bytes and
# turns a non-UTC datetime into a wrong timestamp (standard-webhooks #251, fix
# still open), so it serves the tests as the receiver instead.

# Instance-metadata services: refused even when private addresses are allowed,
# since no webhook receiver lives there and they hand out cloud credentials.
_METADATA_ADDRESSES = frozenset(map(ipaddress.ip_address, (
    "169.254.169.254",    # AWS, GCP, Azure, OpenStack, Oracle
    "169.254.170.2",      # AWS ECS task metadata
    "169.254.170.23",     # AWS EKS pod identity
    "100.100.100.200",    # Alibaba Cloud
    "192.0.0.192",        # Oracle Cloud (classic)
    "fd00:ec2::254",      # AWS over IPv6
    "fd00:ec2::23",       # AWS EKS pod identity over IPv6
)))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")


class _ProviderAuthError(Exception):
    """A provider callback that is not authentic: unsigned, forged, altered
    or replayed too late.  The route answers it with 401."""


def _new_webhook_secret():
    """A new webhook signing secret: ``whsec_`` and the base64 of 32 random
    bytes, the form Standard Webhooks libraries read."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def _webhook_key(secret):
    text = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("A webhook secret is 'whsec_' and base64 text.") from None
    if not key:
        raise ValueError("A webhook secret may not be empty.")
    return key


def _sign_webhook(secret, msg_id, timestamp, body):
    """The Standard Webhooks headers for one delivery.

    :param secret: the webhook's secret (``whsec_...``, from _new_webhook_secret()).
    :param msg_id: the event's id, the same on every retry (receivers dedupe by it).
    :param timestamp: seconds since the epoch (int), or a timezone-aware datetime.
    :param body: the exact bytes that will be posted.
    :returns: ``{"webhook-id", "webhook-timestamp", "webhook-signature"}``,
        the signature ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``.
    """
    if isinstance(timestamp, datetime.datetime):
        if timestamp.tzinfo is None:
            raise ValueError("The webhook timestamp must be timezone-aware.")
        timestamp = timestamp.timestamp()
    msg_id = str(msg_id)
    if not msg_id or re.search(r"[\x00-\x20\x7f]", msg_id):
        raise ValueError("A webhook message id is non-empty and has no spaces or control characters.")
    body = _as_bytes(body)
    seconds = str(int(timestamp))
    digest = hmac.new(_webhook_key(secret), f"{msg_id}.{seconds}.".encode() + body,
                      hashlib.sha256).digest()
    return {"webhook-id": msg_id, "webhook-timestamp": seconds,
            "webhook-signature": "v1," + base64.b64encode(digest).decode("ascii")}


def _as_bytes(body):
    if isinstance(body, str):
        return body.encode("utf-8")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"a body is bytes, not {type(body).__name__}")
    return bytes(body)


# Addresses and URLs -----------------------------------------------------------

def _address_problem(ip, allow_private):
    """Why a webhook may not call ``ip`` (a phrase), or None when it may."""
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            problem = _address_problem(embedded, allow_private)
            return problem and f"{problem} ({embedded} in an IPv6 form)"
    if ip in _METADATA_ADDRESSES:
        return "a cloud metadata address"
    if allow_private:
        return None
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.version == 6 and ip in _UNIQUE_LOCAL:
        return "a unique-local address"
    if ip.version == 6 and (ip in _SITE_LOCAL or ip in _LOCAL_NAT64):
        return "a private address"
    if ip.version == 6 and ip in _IPV4_COMPATIBLE:
        return "a reserved address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private or (ip.version == 4 and ip in _SHARED_ADDRESS_SPACE):
        return "a private address"
    if not ip.is_global:
        return "a reserved address"
    return None


def _remaining(deadline):
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the time allowed ran out")
    return left


def _http_target(url):
    """(scheme, host, port, request target, Host header) of an http(s) URL,
    or ValueError with a sentence the person who typed it can act on."""
    if not isinstance(url, str) or not url:
        raise ValueError("The URL must be text such as https://example.com/hook.")
    if len(url) > 2048:
        raise ValueError("The URL is longer than 2048 characters.")
    if re.search(r"[\x00-\x20\x7f]", url):
        raise ValueError("The URL must not contain spaces or control characters.")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:   # an unclosed [ of an IPv6 address
        raise ValueError("The URL's host or port is not valid.") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("The URL must start with http:// or https://.")
    if "@" in parts.netloc:
        raise ValueError("The URL must not contain a user name or password.")
    try:
        port = parts.port
        host = (parts.hostname or "").rstrip(".")
        host = host.encode("idna").decode("ascii") if host else ""
    except (ValueError, UnicodeError):
        raise ValueError("The URL's host or port is not valid.") from None
    if not host:
        raise ValueError("The URL must name a host, as in https://example.com/hook.")
    if "%" in host:   # [fe80::1%25eth0] (RFC 6874), and no DNS name has one
        raise ValueError("The URL's host must not contain '%': an IPv6 zone such as %25eth0 "
                         "names a network interface of the sender, not the receiver.")
    scheme = parts.scheme.lower()
    default = 443 if scheme == "https" else 80
    if port == 0:
        raise ValueError("The URL's port must be between 1 and 65535.")
    port = port or default
    # Non-ASCII in the path or query is sent percent-encoded, as browsers do.
    target = urllib.parse.quote(parts.path or "/", safe="/%!$&'()*+,;=:@-._~")
    if parts.query:
        target += "?" + urllib.parse.quote(parts.query, safe="/%!$&'()*+,;=:@-._~?")
    shown = f"[{host}]" if ":" in host else host
    return scheme, host, port, target, shown if port == default else f"{shown}:{port}"


def _resolve(host, port, deadline):
    """getaddrinfo() within the deadline (it has no timeout of its own)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:   # no DNS: an address that cannot be used is the URL's fault
        try:
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            raise ValueError(f"The URL's address {host} cannot be used ({error}).") from None
    answer = {}

    def look_up():
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            answer["error"] = error

    thread = threading.Thread(target=look_up, name="campaignapi-dns", daemon=True)
    thread.start()
    thread.join(_remaining(deadline))
    if thread.is_alive():
        raise TimeoutError(f"the host {host} did not resolve in time")
    if "error" in answer:
        raise _UnresolvedHost(f"The URL's host {host} cannot be resolved ({answer['error']}).")
    return answer["infos"]


def _checked_addresses(host, port, allow_private, deadline):
    """The (family, sockaddr) pairs ``host`` resolves to, all of them allowed,
    else ValueError naming the first refused address."""
    seen, addresses = set(), []
    for family, _type, _proto, _name, sockaddr in _resolve(host, port, deadline):
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        problem = _address_problem(ip, allow_private)
        if problem:
            hint = ("" if allow_private or "metadata" in problem else
                    " (the setting webhook_allow_private allows loopback and private ones)")
            where = f"address {ip} is" if host == str(ip) else f"host {host} resolves to {ip},"
            raise ValueError(f"The URL's {where} {problem}; webhooks call only public"
                             f" addresses{hint}.")
        if sockaddr not in seen:
            seen.add(sockaddr)
            addresses.append((family, sockaddr))
    if not addresses:
        raise ValueError(f"The URL's host {host} has no address.")
    return addresses


class _UnresolvedHost(ValueError):
    """A webhook URL whose host does not resolve (now: DNS may change)."""


def _check_webhook_url(url, allow_private=False, timeout=10.0):
    """Check a webhook URL before storing it: http or https, a host, no user
    name or password, and every address the host resolves to public.

    :param url: the URL as given.
    :param allow_private: the setting ``webhook_allow_private``: loopback and
        private addresses allowed (cloud metadata addresses never are).
    :param timeout: seconds the DNS lookup may take.
    :returns: the addresses the host resolves to, as text.
    :raises ValueError: with a sentence saying what to change.
    """
    _scheme, host, port, _target, _host_header = _http_target(url)
    try:
        addresses = _checked_addresses(host, port, allow_private, time.monotonic() + timeout)
    except TimeoutError:
        raise _UnresolvedHost(f"The URL's host {host} did not resolve within {timeout:g} "
                             "seconds.") from None
    return [sockaddr[0] for _family, sockaddr in addresses]


# A small HTTP/1.1 client ------------------------------------------------------
# Written on sockets rather than http.client because the checked address must
# be the one connected to (http.client looks the name up again), and because
# every read must share one deadline (a socket timeout restarts on each byte a
# slow receiver drips).

def _connect(addresses, deadline):
    error = None
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError as failure:
            sock.close()
            error = failure
            if isinstance(failure, TimeoutError):
                break
    raise error


def _send_all(sock, data, deadline):
    view = memoryview(data)
    while view:
        sock.settimeout(_remaining(deadline))
        sent = sock.send(view[:65536])
        view = view[sent:]


def _recv(sock, deadline, size):
    sock.settimeout(_remaining(deadline))
    return sock.recv(min(size, 65536))


def _read_head(sock, deadline, limit):
    """(status, headers, bytes after the head) of the final answer; interim
    1xx answers are skipped."""
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) >= limit:
                raise ValueError(f"the answer's headers are longer than {limit} bytes")
            chunk = _recv(sock, deadline, limit - len(data))
            if not chunk:
                raise ConnectionError("the receiver closed the connection without an answer")
            data += chunk
            continue
        lines = data[:end].decode("latin-1").split("\r\n")
        match = re.fullmatch(r"HTTP/1\.[01] ([1-5][0-9][0-9])(?: .*)?", lines[0])
        if not match:
            raise ValueError("the receiver did not answer in HTTP/1.x")
        status, data = int(match.group(1)), data[end + 4:]
        if 100 <= status < 200 and status != 101:
            continue
        headers = {}
        for line in lines[1:]:
            name, _colon, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers, data


def _dechunk(data):
    """(body, complete) of a chunked transfer coding read so far."""
    body, position = b"", 0
    while True:
        end = data.find(b"\r\n", position)
        if end < 0:
            return body, False
        try:
            size = int(data[position:end].split(b";")[0], 16)
        except ValueError:
            raise ValueError("the answer's chunked body is malformed") from None
        if size == 0:
            return body, True
        start = end + 2
        if len(data) < start + size + 2:
            return body + data[start:start + size], False
        body += data[start:start + size]
        position = start + size + 2


def _read_http_body(sock, deadline, headers, data, limit):
    """The body, read up to ``limit`` bytes; ValueError when longer."""
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = headers.get("content-length", "")
    length = int(length) if length.isdigit() and not chunked else None
    if length is not None and length > limit:
        raise ValueError(f"the answer is longer than {limit} bytes")
    while True:
        if chunked and _dechunk(data)[1] or length is not None and len(data) >= length:
            break
        if len(data) > limit:
            raise ValueError(f"the answer is longer than {limit} bytes")
        chunk = _recv(sock, deadline, limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return _dechunk(data)[0] if chunked else data[:length]


def _http_exchange(method, url, headers, body, *, allow_private, timeout, max_response,
                   context, read_body):
    """One request to the checked address of ``url``: (status, body), or
    without ``read_body`` (status, the answer's headers by lower-case name)."""
    deadline = time.monotonic() + timeout
    scheme, host, port, target, host_header = _http_target(url)
    sock = _connect(_checked_addresses(host, port, allow_private, deadline), deadline)
    try:
        if scheme == "https":
            sock.settimeout(_remaining(deadline))   # the handshake as a whole
            sock = (context or ssl.create_default_context()).wrap_socket(
                sock, server_hostname=host)
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host_header}",
                 f"User-Agent: campaignapi/{__version__}", "Connection: close",
                 f"Content-Length: {len(body)}"]
        for name, value in headers.items():
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) or \
                    re.search(r"[\x00-\x1f\x7f]", str(value)):
                raise ValueError(f"the header {name!r} cannot be sent")
            lines.append(f"{name}: {value}")
        _send_all(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body, deadline)
        status, answer_headers, rest = _read_head(sock, deadline, max_response)
        if not read_body:
            return status, answer_headers
        return status, _read_http_body(sock, deadline, answer_headers, rest, max_response)
    finally:
        sock.close()


def _exchange_failure(error, timeout):
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"the TLS certificate was refused: {error.verify_message}"
    if isinstance(error, TimeoutError):   # socket.timeout too
        return f"no answer within {timeout:g} seconds"
    text = str(error) or type(error).__name__
    return text[0].lower() + text[1:].rstrip(".")


def _post_webhook(url, headers, body, *, allow_private=False, timeout=10.0,
                 max_response=65536, context=None):
    """POST one signed event to a webhook receiver.

    The host is resolved once, every address checked (_check_webhook_url()'s
    rules), and the checked address itself is connected to, with the URL's
    host name in the Host header and, for https, in SNI and the certificate
    check.  Redirects are not followed (a 3xx is a failure), at most
    ``max_response`` bytes of the answer are read, and the whole exchange,
    DNS included, ends within ``timeout`` seconds.

    :param url: the webhook's URL.
    :param headers: extra headers, usually _sign_webhook()'s; Content-Type
        defaults to application/json.
    :param body: the bytes to post.
    :param allow_private: the setting ``webhook_allow_private``.
    :param timeout: seconds the whole exchange may take.
    :param max_response: bytes of the answer read at most.
    :param context: the ssl.SSLContext for https (default: the system's CAs).
    :returns: ``(status, None)`` on a 2xx answer, else ``(status or None,
        error)`` with a phrase for the webhook's record; it never raises for
        anything the receiver or the network does.
    """
    if not any(name.lower() == "content-type" for name in headers):
        headers = {"Content-Type": "application/json", **headers}
    try:
        status, _ = _http_exchange("POST", url, headers, _as_bytes(body),
                                   allow_private=allow_private,
                                   timeout=timeout, max_response=max_response,
                                   context=context, read_body=False)
    except (OSError, ValueError) as error:   # refusals, DNS, TLS, timeouts, bad answers
        return None, _exchange_failure(error, timeout)
    if 200 <= status < 300:
        return status, None
    if 300 <= status < 400:
        return status, f"the receiver answered {status}, a redirect, which is not followed"
    return status, f"the receiver answered {status}"


def _fetch_https(url, *, context=None, allow_private=False, timeout=10.0, max_bytes=65536):
    """GET an https URL's body, with _post_webhook()'s guards (checked address,
    one deadline, no redirects, bounded size).  The default ``fetch`` of
    _parse_sns_callback() for signing certificates and subscription confirmations.

    :param url: an https URL.
    :param context: the ssl.SSLContext (default: the system's CAs).
    :param allow_private: allow loopback and private addresses (tests).
    :param timeout: seconds the whole exchange may take.
    :param max_bytes: the longest body accepted.
    :returns: the body, after a 200 answer.
    :raises OSError or ValueError: on any failure.
    """
    if not url.lower().startswith("https://"):
        raise ValueError("only https URLs are fetched")
    status, body = _http_exchange("GET", url, {}, b"", allow_private=allow_private,
                                  timeout=timeout, max_response=max_bytes,
                                  context=context, read_body=True)
    if status != 200:
        raise ValueError(f"{url} answered {status}")
    return body


# Verify's deliverability checks: size, links, spam ------------------------------
#
# Each looks at emails as a recipient gets them: samples ``(label, raw email,
# key)``, ``key`` naming the content (the score of the same content is kept).
# A campaign's verify builds its samples with _campaign_samples(), an
# automation's with _automation_samples() (each sent as its kind sends it);
# both call the same _size_check(), _links_check() and _spam_check(), each
# giving ``(problems, passed message)``.

#: Gmail clips an email whose html is larger than this many bytes.
_CLIP_SIZE = 102 * 1024
#: The links check: seconds per link, redirects followed, links checked at
#: once, and at most so many distinct links a verify.
_LINK_TIMEOUT, _LINK_REDIRECTS, _LINK_WORKERS, _LINK_MAX = 5.0, 5, 8, 200
#: Seconds a SpamAssassin run may take; scores kept by content (in the process).
_SPAM_TIMEOUT = 120
_SPAM_SCORES = collections.OrderedDict()
_SPAM_KEPT = 256
_SPAMD_LOOK = {}   # spamc path -> (monotonic time, spamd answered) of the last look


def _sample_parts(raw):
    """``(html, text)`` of a raw email, decoded ('' where a part is missing)."""
    parsed = email.message_from_bytes(raw, policy=email.policy.default)
    parts = []
    for kind in ("html", "plain"):
        body = parsed.get_body((kind,))
        parts.append(body.get_content() if body is not None else "")
    return parts


def _verify_samples(c):
    """The samples of a verified campaign or automation (built once a
    verify): each live message as delivery builds it, in its template with
    the CSS inlined and tracking when it has it on, for a recipient it would
    mail (blank values when there is none), its links pointing at
    ``public_url`` (an automation's at its own base_url when it has one).
    ``c.link_targets``: where its tracked links lead (the links check asks
    them: the emails' own links are the service's click links)."""
    if getattr(c, "samples", None) is None:
        base = (c.row["base_url"] if c.kind == "automation" and c.row["base_url"] else
                c.settings.get("public_url") or "https://campaignapi.invalid").rstrip("/")
        secret = c.settings.get("secret") or "verify"
        c.samples, c.own_links, c.link_targets = [], base, set()
        for message, build in _SAMPLES[c.kind](c, base):
            try:
                label, built, key = build()
                raw, targets = _letter_sample(c.conn, built, secret)
                c.samples.append((label, raw, key))
                c.link_targets.update(targets)
            except Exception:  # noqa: BLE001 - verify's other checks say what is wrong with it
                _log.warning("verify: message %s of %s %s could not be built",
                             message["id"], c.kind, c.id, exc_info=True)
    return c.samples


def _campaign_samples(c, base):
    """``(message, build)`` of each live message of a verified campaign
    (_Campaign), ``build()`` giving ``(label, (Letter, recipient, tracked
    links), key)``: as a batch builds it, for the first recipient of its segment."""
    campaign = {"id": c.id, "owner": c.row["owner"], "accountprofile": c.row["accountprofile"]}
    seen = set()
    for link in c.links:
        message, segment = c.messages[link["message"]], c.segments[link["segment"]]
        if message["deleted"] or message["id"] in seen:
            continue
        seen.add(message["id"])
        yield message, functools.partial(_message_sample, c, campaign, message, segment, base)


def _message_sample(c, campaign, message, segment, base):
    """One message of a verified campaign (_campaign_samples())."""
    sent = _prepare_message(message, c.template)
    letter, links = _message_letter(c.conn, campaign, message, sent, base,
                                    _default_mail_from()), []
    if c.row["tracking"] and sent["html"]:
        tracked, links = _track_html(sent["html"])
        letter.html, letter.links = _Template(tracked), len(links)
    key = hashlib.sha256(_to_json([sent, _campaign_sender(c.conn, campaign, message),
                                   c.row["tracking"]]).encode()).hexdigest()
    recipient = None if segment["deleted"] else _segment_recipient(c.conn, segment)
    return _label("message", message), (letter, recipient, links), key


def _automation_samples(c, base):
    """``(message, build)`` of each live message of a verified automation's
    send steps (_Automation), as _send_step() prepares it (_prepared_content():
    its sender profile, template, tracking and List-Id), for the first active
    recipient of its datasource."""
    account = c.row["owner"]
    options = {"template": c.template, "tracking": c.row["tracking"], "base_url": base,
               "list_id": _list_id("automation", c.id, account), "bulk": True}
    seen = set()
    for step in c.steps:
        message = c.messages.get(step.get("send"))
        if message is None or message["deleted"] or message["id"] in seen:
            continue
        seen.add(message["id"])

        def build(message=message):
            sender = _campaign_sender(c.conn, c.row, message)
            content, links = _prepared_content(message, sender, **options)
            letter = _prepared_letter({**content, "account": account, "links": len(links)},
                                      _default_mail_from())
            recipient = None if c.datasource is None or c.datasource["deleted"] else \
                _segment_recipient(c.conn, {"owner": account, "match": "all", "conditions": "[]",
                                            "datasources": _to_json([c.datasource["id"]])})
            return (_label("message", message), (letter, recipient, links),
                    _prepared_digest(message, sender, **options))
        yield message, build


#: How the samples of each kind verify checks are built (_verify_samples()).
_SAMPLES = {"campaign": _campaign_samples, "automation": _automation_samples}


def _letter_sample(conn, built, secret):
    """``(raw email, where its tracked links lead)`` of a sample's ``(Letter,
    recipient row or None, tracked links)``, as delivery builds it for the
    recipient (blank values and a placeholder address without one): merge
    values, tracking and unsubscribe links that name a first email, a
    signed Message-ID; the targets as a click finds them (_click_target())."""
    letter, recipient, links = built
    values = {"email": "recipient@example.com"} if recipient is None else _recipient_values(
        _datasource_fields(conn, recipient["datasource"]), recipient)
    targets = [_click_target(url, values) for url in links]
    if letter.links is not None:
        values.update(_tracking_values(secret, letter.base, 0, letter.links))
    to_addr = recipient["email"] if recipient else "recipient@example.com"
    _, raw = _recipient_email(letter, secret, to_addr, values,
                              recipient["id"] if recipient else None,
                              message_id=message_id_for(secret, 0, letter.domain), outbox=0)
    return raw, targets


def _size_check(samples):
    sizes = [(label, len(_sample_parts(raw)[0].encode("utf-8"))) for label, raw, _ in samples]
    return [f"The html of {label} is {size / 1024:.0f} KB as sent (template, inlined CSS and "
            "tracking included): Gmail clips an email past 102 KB and hides the rest, the "
            "unsubscribe link too; shorten it or move content to a web page."
            for label, size in sizes if size >= _CLIP_SIZE], (
        "Every message's html is under 102 KB as sent" + (" (" + ", ".join(
            f"{label}: {size / 1024:.1f} KB" for label, size in sizes) + ")." if sizes else "."))


def _sample_links(raw, own):
    """The distinct http(s) links of an email, but those to ``own`` (the
    service's: unsubscribe, open, click)."""
    html_body, text_body = _sample_parts(raw)
    finder = _LinkFinder()
    finder.feed(html_body)
    finder.close()
    urls = [value for _, _, attrs in finder.anchors for name, value in attrs
            if name == "href" and value]
    urls += re.findall(r"https?://[^\s<>\"')]+", text_body)
    return _checked_links(urls, own)


def _checked_links(urls, own):
    """The distinct http(s) URLs of ``urls`` but those to ``own``."""
    return {url.strip() for url in urls if url.strip().lower().startswith(("http://", "https://"))
            and not url.strip().startswith(own + "/")}


def _link_answer(url, allow_private):
    """None when ``url`` answers with a status under 400 within
    _LINK_TIMEOUT seconds (HEAD, then GET where HEAD is not allowed; at most
    _LINK_REDIRECTS redirects, each to an address the webhooks' rules allow),
    else what went wrong."""
    deadline, method, redirects = time.monotonic() + _LINK_TIMEOUT, "HEAD", 0
    while True:
        try:
            status, headers = _http_exchange(
                method, url, {}, b"", allow_private=allow_private, timeout=_remaining(deadline),
                max_response=65536, context=None, read_body=False)
        except (OSError, ValueError) as error:
            return _exchange_failure(error, _LINK_TIMEOUT)
        if method == "HEAD" and status in (405, 501):
            method = "GET"
        elif status in (301, 302, 303, 307, 308) and headers.get("location"):
            redirects += 1
            if redirects > _LINK_REDIRECTS:
                return f"redirects more than {_LINK_REDIRECTS} times"
            url = urllib.parse.urljoin(url, headers["location"])
        else:
            return None if status < 400 else f"answered {status}"


def _links_check(samples, settings, own="", targets=()):
    """Every distinct link of the samples and where their tracked links lead
    (``targets``), _LINK_WORKERS at a time."""
    if not settings.get("links"):
        return [], "Links were not checked: verify with links=1 checks every link of every message."
    urls = sorted(set().union(_checked_links(targets, own),
                              *(_sample_links(raw, own) for _, raw, _ in samples)))
    checked = urls[:_LINK_MAX]
    allow = bool(settings.get("webhook_allow_private"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=_LINK_WORKERS) as pool:
        answers = dict(zip(checked, pool.map(lambda url: _link_answer(url, allow), checked)))
    failing = [f"{url} ({answer})" for url, answer in answers.items() if answer]
    beyond = f" (the first {_LINK_MAX} of {len(urls)})" if len(urls) > _LINK_MAX else ""
    return [f"These links do not answer with a status under 400 within "
            f"{_LINK_TIMEOUT:g} seconds: {', '.join(failing)}; correct them in the messages."
            ] if failing else [], f"Every link answers ({len(checked)} checked{beyond})."


def _spam_program(setting):
    """``(kind, path)`` of the SpamAssassin to score with: the setting
    ``spamassassin`` (spamc or spamassassin), else spamc when a spamd
    answers, else spamassassin (offline rules); None when there is none."""
    if setting:
        return ("spamc" if os.path.basename(setting).startswith("spamc") else "spamassassin",
                setting)
    spamc = shutil.which("spamc")
    if spamc:
        looked = _SPAMD_LOOK.get(spamc)
        if looked is None or time.monotonic() - looked[0] > 60:
            try:
                answered = subprocess.run([spamc, "--connect-retries=1", "-K"],
                                          capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                answered = False
            looked = _SPAMD_LOOK[spamc] = (time.monotonic(), answered)
        if looked[1]:
            return "spamc", spamc
    spamassassin = shutil.which("spamassassin")
    return ("spamassassin", spamassassin) if spamassassin else None


def _spam_rules(report):
    """``{rule: points}`` of a SpamAssassin report's table."""
    table = report[report.find("Content analysis details"):] if \
        "Content analysis details" in report else report
    return {name: float(points) for points, name in re.findall(
        r"(?m)^\s*(-?\d+(?:\.\d+)?)\s+([A-Z][A-Z0-9_]+)\s", table)}


def _spam_scores(program, raws):
    """``[(score, {rule: points})]`` of raw emails: spamc one by one (spamd
    is quick), spamassassin in one run over an mbox (its start is the slow
    part), offline (-L)."""
    kind, path = program
    if kind == "spamc":
        scores = []
        for raw in raws:
            done = subprocess.run([path, "--connect-retries=1", "-R"], input=raw,
                                  capture_output=True, timeout=_SPAM_TIMEOUT)
            report = done.stdout.decode("utf-8", "replace")
            first = re.match(r"\s*(-?[\d.]+)/", report)
            if first is None:
                raise OSError(f"spamc answered no score: {done.stderr.decode(errors='replace')}")
            scores.append((float(first.group(1)), _spam_rules(report)))
        return scores
    mbox = b"".join(b"From MAILER-DAEMON Thu Jan  1 00:00:00 2026\n" + re.sub(
        rb"(?m)^(>*From )", rb">\1", raw.replace(b"\r\n", b"\n")) + b"\n" for raw in raws)
    done = subprocess.run([path, "-t", "-L", "--mbox"], input=mbox, capture_output=True,
                          timeout=_SPAM_TIMEOUT)
    reports = [report for report in re.split(r"(?m)^From MAILER-DAEMON .*\n", done.stdout.decode(
        "utf-8", "replace")) if report.strip()]
    scores = []
    for report in reports:
        status = " ".join(re.findall(r"(?m)^X-Spam-Status:(.*(?:\n[ \t].*)*)", report)[:1])
        score = re.search(r"score=(-?[\d.]+)", status)
        if score is not None:
            scores.append((float(score.group(1)), _spam_rules(report)))
    if len(scores) != len(raws):
        raise OSError(f"spamassassin scored {len(scores)} of {len(raws)} emails: "
                      f"{done.stderr.decode(errors='replace')[-300:]}")
    return scores


def _spam_check(samples, settings):
    """Each sample scored by SpamAssassin; fails at or above ``spam_threshold``."""
    program = _spam_program(settings.get("spamassassin"))
    if program is None:
        return [], ("Skipped: SpamAssassin is not installed (spamassassin or spamc on the PATH, "
                    "or the setting spamassassin), so the emails were not scored.")
    threshold = float(settings.get("spam_threshold") or 5.0)
    unknown = [sample for sample in samples if (program, sample[2]) not in _SPAM_SCORES]
    if unknown:
        try:
            scores = _spam_scores(program, [raw for _, raw, _ in unknown])
        except (OSError, subprocess.SubprocessError) as error:
            return [f"SpamAssassin ({program[1]}) could not score the emails: {error}"], ""
        for (_, _, key), score in zip(unknown, scores):
            _SPAM_SCORES[program, key] = score
            while len(_SPAM_SCORES) > _SPAM_KEPT:
                _SPAM_SCORES.popitem(last=False)
    said, problems = [], []
    for label, _, key in samples:
        score, rules = _SPAM_SCORES[program, key]
        hits = ", ".join(f"{name} {points:g}" for name, points in sorted(
            rules.items(), key=lambda item: -abs(item[1]))) or "none"
        text = f"{label} scores {score:g} (rules: {hits})"
        (problems if score >= threshold else said).append(text)
    if problems:
        return [f"SpamAssassin scores at or above {threshold:g}: {'; '.join(problems)}. "
                "Change what the rules point at, e.g. more text beside images, fewer "
                "shouting words, a text body."], ""
    return [], (f"SpamAssassin ({os.path.basename(program[1])}) scores every message under "
                f"{threshold:g}: " + "; ".join(said) + ".")


@_verify_check("size")
def _verify_size(c):
    return _size_check(_verify_samples(c))


@_verify_check("links")
def _verify_links_answer(c):
    samples = _verify_samples(c)
    return _links_check(samples, c.settings, c.own_links, c.link_targets)


@_verify_check("spam")
def _verify_spam(c):
    return _spam_check(_verify_samples(c), c.settings)


# An automation's verify checks its send steps' emails the same way.
_AUTOMATION_CHECKS.extend((("size", _verify_size), ("links", _verify_links_answer),
                           ("spam", _verify_spam)))


# ---------------------------------------------------------------------------
# Inbound mail: reading bounces and complaints (raw messages, the providers'
# callbacks), the bounce mailbox
# ---------------------------------------------------------------------------

# Provider callbacks -----------------------------------------------------------
#
# The four providers' bounce and complaint callbacks, each authenticated the
# provider's way, each read into the same small event dicts ``{"email",
# "type", "reason", "message_id"}``.  RSA (SNS) and ECDSA (SendGrid) need
# ``cryptography``, imported only when those two run.

#: Seconds a signed provider callback stays acceptable (Mailgun, SendGrid);
#: older ones are replays.
_PROVIDER_MAX_AGE = 15 * 60
#: SNS retries an HTTP delivery for at most an hour, so its messages may be
#: that old, plus the same margin for clocks.
_SNS_MAX_AGE = 3600 + _PROVIDER_MAX_AGE
#: Where an SNS signing certificate or subscription URL may live (host[:port]).
_SNS_CERT_HOST = r"sns\.[a-z0-9-]+\.amazonaws\.com(?:\.cn)?"


def _crypto():
    """The parts of ``cryptography`` that SNS and SendGrid verification use."""
    try:
        from cryptography import exceptions, x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
    except ImportError:
        raise RuntimeError("Verifying SES and SendGrid callbacks needs the cryptography"
                           " package: pip install 'campaignapi[providers]'.") from None
    return types.SimpleNamespace(InvalidSignature=exceptions.InvalidSignature, x509=x509,
                                 hashes=hashes, serialization=serialization, ec=ec,
                                 padding=padding, rsa=rsa)


class _NotJson(ValueError):
    """A provider call whose body (or a part of it) is not JSON."""


def _json_body(body, what="The body"):
    try:
        return json.loads(body)
    except (ValueError, RecursionError, TypeError):   # also bad UTF-8 and deep nesting
        raise _NotJson(f"{what} is not JSON.") from None


def _text(value, what, required=True):
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{what} is missing or not text.")
    return value.strip()


def _event(email, kind, reason, message_id):
    return {"email": _text(email, "The recipient's address"), "type": kind,
            "reason": reason if isinstance(reason, str) else "",
            "message_id": message_id if isinstance(message_id, str) and message_id else None}


def _fresh(seconds, max_age, what):
    """_ProviderAuthError unless ``seconds`` (epoch) is within ``max_age`` of now."""
    if abs(time.time() - seconds) > max_age:
        raise _ProviderAuthError(f"The {what} is more than {max_age // 60} minutes from now:"
                                " a replay, or a clock that is wrong.")


def _is_seconds(text):
    """Whether ``text`` is a plausible epoch time in whole seconds."""
    return isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 12


def _mapping(value, what):
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object.")
    return value


# Amazon SES through SNS -------------------------------------------------------

_SNS_SIGNED_FIELDS = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                 "TopicArn", "Type"),
    "UnsubscribeConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                "TopicArn", "Type"),
}
_SNS_CERTS = {}     # certificate URL -> public key; AWS rotates by URL
_SNS_CERTS_LOCK = threading.Lock()


def _sns_url(url, pattern, what):
    try:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    except ValueError:
        parts = None
    if parts is None or parts.scheme != "https" or "@" in parts.netloc or \
            not re.fullmatch(pattern, parts.netloc):
        raise _ProviderAuthError(f"The {what} {url!r} is not an https URL of Amazon SNS.")
    return url


def _sns_key(url, fetch):
    with _SNS_CERTS_LOCK:
        key = _SNS_CERTS.get(url)
    if key is not None:
        return key
    crypto = _crypto()
    try:
        key = crypto.x509.load_pem_x509_certificate(fetch(url)).public_key()
    except Exception as error:  # noqa: BLE001 -- fetch is the caller's; any failure: unverifiable
        raise _ProviderAuthError(f"The SNS signing certificate could not be read: {error}") from None
    if not isinstance(key, crypto.rsa.RSAPublicKey):
        raise _ProviderAuthError("The SNS signing certificate has no RSA key.")
    with _SNS_CERTS_LOCK:
        if len(_SNS_CERTS) >= 64:
            _SNS_CERTS.pop(next(iter(_SNS_CERTS)))
        _SNS_CERTS[url] = key
    return key


def _sns_verify(message, fetch, pattern):
    signature, version = message.get("Signature"), message.get("SignatureVersion")
    cert_url = message.get("SigningCertURL")
    if not (isinstance(signature, str) and signature and cert_url):
        raise _ProviderAuthError("The SNS message is not signed.")
    if version not in ("1", "2"):
        raise _ProviderAuthError(f"The SNS SignatureVersion {version!r} is not known (1 or 2).")
    try:
        signature = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise _ProviderAuthError("The SNS signature is not base64.") from None
    canonical = "".join(f"{name}\n{message[name]}\n" for name in _SNS_SIGNED_FIELDS[message["Type"]]
                        if message.get(name) is not None)
    key = _sns_key(_sns_url(cert_url, pattern, "SigningCertURL"), fetch)
    crypto = _crypto()
    digest = crypto.hashes.SHA1() if version == "1" else crypto.hashes.SHA256()
    try:
        key.verify(signature, canonical.encode("utf-8"), crypto.padding.PKCS1v15(), digest)
    except crypto.InvalidSignature:
        raise _ProviderAuthError("The SNS signature does not match the message.") from None


def _ses_events(notification):
    """The events of one SES notification (notification or event publishing)."""
    kind = notification.get("notificationType") or notification.get("eventType")
    mail = notification.get("mail")
    message_id = mail.get("messageId") if isinstance(mail, dict) else None
    events = []
    if kind == "Bounce":
        bounce = _mapping(notification.get("bounce"), "The SES bounce")
        hard = bounce.get("bounceType") == "Permanent"
        recipients = bounce.get("bouncedRecipients")
        if not isinstance(recipients, list):
            raise ValueError("The SES bounce lists no bouncedRecipients.")
        for recipient in recipients:
            recipient = _mapping(recipient, "An SES bounced recipient")
            reason = recipient.get("diagnosticCode") or bounce.get("bounceSubType")
            events.append(_event(recipient.get("emailAddress"), "hard" if hard else "soft",
                                 reason, message_id))
    elif kind == "Complaint":
        complaint = _mapping(notification.get("complaint"), "The SES complaint")
        recipients = complaint.get("complainedRecipients")
        if not isinstance(recipients, list):
            raise ValueError("The SES complaint lists no complainedRecipients.")
        for recipient in recipients:
            recipient = _mapping(recipient, "An SES complained recipient")
            events.append(_event(recipient.get("emailAddress"), "complaint",
                                 complaint.get("complaintFeedbackType") or "complaint",
                                 message_id))
    return events


def _parse_sns_callback(body, *, topic_arns, fetch=_fetch_https, cert_url_pattern=_SNS_CERT_HOST):
    """Read an Amazon SNS delivery to ``/v1/bounce/ses``: SES bounce and
    complaint notifications, and subscription confirmations (confirmed here by
    fetching their SubscribeURL).

    The signature (SignatureVersion 1, SHA1withRSA, or 2, SHA256withRSA, over
    the documented canonical string) is always checked, against the
    certificate at SigningCertURL, which must be https on a host matching
    ``cert_url_pattern``; certificates are cached by URL.

    :param body: the request body, bytes.
    :param topic_arns: the SNS topics accepted (setting ``ses_topic_arns``).
    :param fetch: ``fetch(url) -> bytes`` for certificates and SubscribeURLs.
    :param cert_url_pattern: a regular expression the URLs' host[:port] must
        match entirely (default: ``sns.<region>.amazonaws.com``).
    :returns: a list of ``{"email", "type", "reason", "message_id"}``.
    :raises _ProviderAuthError: unsigned, forged, altered, from another topic, too old.
    :raises ValueError: not JSON or not shaped like SNS and SES messages, or a
        confirmation that could not be fetched.
    """
    if isinstance(topic_arns, str):   # one ARN, not the letters of one
        topic_arns = (topic_arns,)
    message = _mapping(_json_body(body), "The SNS message")
    kind = message.get("Type")
    if not isinstance(kind, str) or kind not in _SNS_SIGNED_FIELDS:
        raise ValueError(f"The SNS message Type {kind!r} is not known.")
    for name in _SNS_SIGNED_FIELDS[kind]:
        _text(message.get(name), f"The SNS field {name}", required=name != "Subject")
    if message["TopicArn"] not in topic_arns:
        raise _ProviderAuthError(f"The SNS topic {message['TopicArn']} is not one accepted here.")
    _sns_verify(message, fetch, cert_url_pattern)
    try:
        sent = datetime.datetime.fromisoformat(message["Timestamp"])
        seconds = sent.timestamp() if sent.tzinfo else None
    except ValueError:
        seconds = None
    if seconds is None:
        raise ValueError("The SNS Timestamp is not an ISO 8601 time with its zone.")
    _fresh(seconds, _SNS_MAX_AGE, "SNS message's Timestamp")
    if kind == "SubscriptionConfirmation":
        url = _sns_url(message["SubscribeURL"], cert_url_pattern, "SubscribeURL")
        try:
            fetch(url)
        except Exception as error:  # noqa: BLE001 -- fetch is the caller's; 400 makes SNS retry
            raise ValueError(f"The SNS subscription could not be confirmed: {error}") from None
        return []
    if kind == "UnsubscribeConfirmation":
        return []
    notification = _json_body(message["Message"], "The SNS Message")
    return _ses_events(_mapping(notification, "The SES notification"))


# Mailgun ---------------------------------------------------------------------

def _parse_mailgun_callback(body, signing_key):
    """Read a Mailgun webhook call (JSON) to ``/v1/bounce/mailgun``.

    :param body: the request body, bytes.
    :param signing_key: the account's HTTP webhook signing key.
    :returns: a list of events: ``failed`` permanent (hard), temporary (soft),
        ``complained``; other events give an empty list.
    :raises _ProviderAuthError: signature missing or wrong, or older than
        _PROVIDER_MAX_AGE.
    :raises ValueError: not JSON or not shaped like a Mailgun webhook.
    """
    if not signing_key:
        raise _ProviderAuthError("No Mailgun signing key is configured.")
    call = _mapping(_json_body(body), "The Mailgun call")
    signed = call.get("signature")
    if not isinstance(signed, dict):
        raise _ProviderAuthError("The Mailgun call is not signed.")
    timestamp, token, signature = (signed.get(name) for name in ("timestamp", "token", "signature"))
    if isinstance(timestamp, int) and not isinstance(timestamp, bool):
        timestamp = str(timestamp)
    if not all(isinstance(v, str) and v for v in (timestamp, token, signature)) or \
            not _is_seconds(timestamp):
        raise _ProviderAuthError("The Mailgun signature needs a timestamp, token and signature.")
    expected = hmac.new(signing_key.encode("utf-8"), (timestamp + token).encode("utf-8"),
                        hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), signature.lower().encode("utf-8")):
        raise _ProviderAuthError("The Mailgun signature does not match.")
    _fresh(int(timestamp), _PROVIDER_MAX_AGE, "Mailgun signature's timestamp")
    data = _mapping(call.get("event-data"), "The Mailgun event-data")
    event, severity = data.get("event"), data.get("severity")
    message = data.get("message")
    headers = message.get("headers") if isinstance(message, dict) else None
    message_id = headers.get("message-id") if isinstance(headers, dict) else None
    if event == "failed" and severity in ("permanent", "temporary"):
        status = data.get("delivery-status")
        status = status if isinstance(status, dict) else {}
        reason = status.get("description") or status.get("message") or data.get("reason")
        return [_event(data.get("recipient"), "hard" if severity == "permanent" else "soft",
                       reason, message_id)]
    if event == "complained":
        return [_event(data.get("recipient"), "complaint", "complaint", message_id)]
    return []


# Postmark --------------------------------------------------------------------

# Postmark's bounce Types (its API's BounceType list) that say something about
# the address; the others (AutoResponder, Subscribe, OpenRelayTest, DMARCPolicy,
# SpamNotification, ...) are not about the recipient and are ignored.
_POSTMARK_HARD = frozenset({"HardBounce", "BadEmailAddress", "ManuallyDeactivated"})
_POSTMARK_SOFT = frozenset({"SoftBounce", "Transient", "DnsError", "Blocked", "Unknown"})


def _parse_postmark_callback(body, authorization_header, credentials):
    """Read a Postmark bounce or spam complaint webhook to ``/v1/bounce/postmark``.

    :param body: the request body, bytes.
    :param authorization_header: the request's Authorization header (or None).
    :param credentials: ``user:password`` configured on both sides (setting
        ``postmark_credentials``), checked in constant time.
    :returns: a list of at most one event.
    :raises _ProviderAuthError: no or wrong basic credentials.
    :raises ValueError: not JSON or not shaped like a Postmark webhook.
    """
    if not credentials:
        raise _ProviderAuthError("No Postmark credentials are configured.")
    scheme, _space, encoded = (authorization_header or "").strip().partition(" ")
    try:
        given = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        given = b""
    if scheme.lower() != "basic" or not given:
        raise _ProviderAuthError("The Postmark call has no basic credentials.")
    if not hmac.compare_digest(given, credentials.encode("utf-8")):
        raise _ProviderAuthError("The Postmark credentials are wrong.")
    record = _mapping(_json_body(body), "The Postmark call")
    record_type, kind = record.get("RecordType"), record.get("Type")
    kind = kind if isinstance(kind, str) else None
    reason = record.get("Description") or record.get("Details") or kind
    if record_type == "SpamComplaint" or (record_type == "Bounce" and kind == "SpamComplaint"):
        return [_event(record.get("Email"), "complaint", reason, record.get("MessageID"))]
    if record_type == "Bounce" and kind in _POSTMARK_HARD | _POSTMARK_SOFT:
        return [_event(record.get("Email"), "hard" if kind in _POSTMARK_HARD else "soft",
                       reason, record.get("MessageID"))]
    return []


# SendGrid --------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _load_sendgrid_public_key(text):
    """The SendGrid event webhook verification key, as cryptography's key.

    :param text: base64 DER (as SendGrid shows it) or PEM.
    :raises ValueError: not a P-256 public key (check the setting at start).
    """
    crypto = _crypto()
    try:
        if "BEGIN PUBLIC KEY" in text:
            key = crypto.serialization.load_pem_public_key(text.encode("ascii"))
        else:
            key = crypto.serialization.load_der_public_key(
                base64.b64decode("".join(text.split()), validate=True))
    except (ValueError, TypeError, binascii.Error, UnicodeError):
        raise ValueError("The SendGrid public key is not base64 DER or PEM.") from None
    if not isinstance(key, crypto.ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ValueError("The SendGrid public key is not an ECDSA P-256 key.")
    return key


def _parse_sendgrid_callback(body, signature_header, timestamp_header, public_key):
    """Read a signed SendGrid event webhook call to ``/v1/bounce/sendgrid``.

    :param body: the request body, bytes, exactly as received.
    :param signature_header: X-Twilio-Email-Event-Webhook-Signature (base64
        DER ECDSA P-256 / SHA-256 over timestamp + body).
    :param timestamp_header: X-Twilio-Email-Event-Webhook-Timestamp.
    :param public_key: the verification key, text (base64 DER or PEM) or the
        object from _load_sendgrid_public_key().
    :returns: events for ``bounce`` (type bounce: hard, blocked: soft),
        ``dropped`` (Bounced Address: hard, Spam Reporting Address: complaint)
        and ``spamreport``; others are ignored.
    :raises _ProviderAuthError: unsigned, forged, or older than _PROVIDER_MAX_AGE.
    :raises ValueError: not JSON or not shaped like SendGrid events.
    """
    key = _load_sendgrid_public_key(public_key) if isinstance(public_key, str) else public_key
    if not signature_header or not timestamp_header:
        raise _ProviderAuthError("The SendGrid call is not signed.")
    if not _is_seconds(timestamp_header):
        raise _ProviderAuthError("The SendGrid timestamp is not a number.")
    try:
        signature = base64.b64decode(signature_header.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _ProviderAuthError("The SendGrid signature is not base64.") from None
    crypto = _crypto()
    try:
        key.verify(signature, timestamp_header.encode("ascii") + _as_bytes(body),
                   crypto.ec.ECDSA(crypto.hashes.SHA256()))
    except crypto.InvalidSignature:
        raise _ProviderAuthError("The SendGrid signature does not match.") from None
    _fresh(int(timestamp_header), _PROVIDER_MAX_AGE, "SendGrid timestamp")
    calls = _json_body(body)
    if not isinstance(calls, list):
        raise ValueError("The SendGrid call is not a JSON array of events.")
    found = []
    for item in calls:
        item = _mapping(item, "A SendGrid event")
        event, reason = item.get("event"), item.get("reason")
        message_id = item.get("smtp-id") or item.get("sg_message_id")
        if event == "bounce":
            kind = "soft" if item.get("type") == "blocked" else "hard"
        elif event == "dropped" and reason == "Bounced Address":
            kind = "hard"
        elif event == "spamreport" or (event == "dropped" and reason == "Spam Reporting Address"):
            kind, reason = "complaint", reason or "spamreport"
        else:
            continue
        found.append(_event(item.get("email"), kind, reason, message_id))
    return found



#: Bytes of a bounce that are read; the rest, nearly always the tail of the
#: returned original (whose headers come first), is cut so that a huge
#: message cannot hold a worker: flufl.bounce's heuristics read every line.
_BOUNCE_MAX_BYTES = 128 * 1024
#: flufl.bounce's heuristics (forty patterns, each over every line) read only
#: this head of a message: the notice of a plain-text bounce comes first.
_BOUNCE_SCAN_BYTES = 16 * 1024
#: More multipart containers, or more lines that could delimit parts, than any
#: bounce has: such a message is taken as none unread, since the email
#: parser's cost grows with nesting depth times lines (seconds for 100 KB).
_BOUNCE_MAX_CONTAINERS, _BOUNCE_MAX_DELIMITERS = 20, 300
#: A bounce mailbox run reads at most this many messages, each at most this big.
_MAILBOX_MAX_MESSAGES, _MAILBOX_MAX_BYTES = 1000, 10 * 1024 * 1024

# Headers of a bounce that carry the address it was sent to (the VERP address
# when it came back to our envelope sender), most specific first.
_ENVELOPE_HEADERS = ("Delivered-To", "X-Original-To", "Envelope-To", "X-Envelope-To", "To",
                     "Return-Path")
# Fields of DSN and ARF reports, and headers of the returned original, that
# carry our envelope sender.
_SENDER_FIELDS = ("Original-Mail-From", "X-Postfix-Sender", "Return-Path")
_DAEMON_SENDERS = {"mailer-daemon", "postmaster", "mail-daemon", "mailerdaemon", "mdaemon"}
_AUTO_REPLY_SUBJECT = re.compile(
    r"\s*(auto(matic)?[ -]?(reply|response|answer|antwort)\b|auto:|autoreply|out of (the )?office"
    r"|away from (my )?(e-?mail|mail|the office|office)|on vacation|vacation\b|abwesenheit"
    r"|r[ée]ponse automatique|absence\b)", re.IGNORECASE)
_BOUNCE_SUBJECT = re.compile(
    r"undeliver|undelivered|not delivered|could not be delivered|delivery (status|failure|failed"
    r"|problem|notification)|returned mail|failure notice|mail delivery failed|non[- ]?delivery",
    re.IGNORECASE)
_STATUS_CODE = re.compile(r"(?<![\d.])([245])\.\d{1,3}\.\d{1,3}(?![\d.])")
_SMTP_REPLY = re.compile(r"(?<![\d.])[45][0-9][0-9][ -]")
_COPY_SEPARATOR = re.compile(
    r"^[ \t]*-{2,}.*(copy of|original message|returned message|message follows|returned mail)",
    re.IGNORECASE | re.MULTILINE)


def _mail_text(value):
    """A header value as text: encoded words decoded, whitespace folded."""
    if value is None:
        return ""
    try:
        value = str(email.header.make_header(email.header.decode_header(str(value))))
    except (email.errors.HeaderParseError, LookupError, UnicodeError, ValueError):
        value = str(value)
    return " ".join(value.split())


def _short(text, limit=200):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _report_address(value):
    """The address of a report field such as ``rfc822; user@example.com`` or
    ``<user@example.com>``, normalized, else None."""
    value = _mail_text(value)
    if re.match(r"[A-Za-z0-9-]+\s*;", value):
        value = value.split(";", 1)[1]
    return _normalize_email(email.utils.parseaddr(value.strip())[1] or value.strip().strip("<>"))


def _message_id(value):
    """A Message-ID in its ``<id>`` spelling, else None."""
    value = _mail_text(value)
    match = re.search(r"<([^<>\s]+)>", value)
    if match:
        return f"<{match[1]}>"
    return f"<{value}>" if value and "@" in value and " " not in value else None


def _parts(msg):
    """The message and its MIME parts, not descending into enclosed messages
    (the returned original of a bounce is its content, not part of the report)."""
    stack = [msg]
    while stack:
        part = stack.pop()
        yield part
        if part.is_multipart() and part.get_content_maintype() == "multipart":
            stack.extend(reversed(part.get_payload()))


def _field_blocks(part):
    """The header blocks of a message/delivery-status or feedback-report part."""
    payload = part.get_payload()
    if not isinstance(payload, list):
        # A report the parser left as text (an unusual transfer encoding).
        return _split_blocks(part.get_payload(decode=True) or b"")
    blocks = [block for block in payload if isinstance(block, email.message.Message)]
    # The parser splits only message/delivery-status into blocks; it reads
    # message/global-delivery-status (RFC 6533) as one message whose body
    # holds the blocks after the first.
    if len(blocks) == 1 and isinstance(blocks[0].get_payload(), str):
        blocks += _split_blocks(blocks[0].get_payload().encode("utf-8", "surrogateescape"))
    return blocks


def _split_blocks(text):
    """Header blocks separated by blank lines, as Messages."""
    return [email.message_from_bytes(block)
            for block in re.split(rb"\r?\n[ \t]*\r?\n", text) if block.strip()]


def _returned_message(msg):
    """The original message a bounce or complaint returns (its headers at
    least), as a Message, else None."""
    for part in _parts(msg):
        kind = part.get_content_type()
        if kind in ("message/rfc822", "message/global") and part.is_multipart():
            return part.get_payload(0)
        if kind in ("text/rfc822-headers", "message/rfc822-headers", "message/global-headers",
                    "message/rfc822", "message/global"):
            return email.message_from_bytes(part.get_payload(decode=True) or b"")
    # Plain-text bounces (qmail, Exim, Yahoo) append the original after a line
    # such as "--- Below this line is a copy of the message."
    for part in _parts(msg):
        if part.get_content_type() != "text/plain":
            continue
        text = (part.get_payload(decode=True) or b"").decode("utf-8", "replace")
        separator = _COPY_SEPARATOR.search(text)
        if separator:
            original = email.message_from_string(
                text[separator.end():].split("\n", 1)[-1].lstrip("\r\n"))
            if original.keys():
                return original
    return None


def _find_verp(secret, msg, blocks, original):
    """The outbox id of the first valid VERP address where our envelope sender
    can appear: the bounce's own headers, the report's fields, the original's."""
    values = [value for name in _ENVELOPE_HEADERS for value in msg.get_all(name, [])]
    values += [block.get(name) for block in blocks for name in _SENDER_FIELDS]
    if original is not None:
        values += original.get_all("Return-Path", [])
    for value in values:
        for candidate in _VERP_IN_TEXT.findall(_mail_text(value)):
            outbox = read_verp(secret, candidate)
            if outbox is not None:
                return outbox
    return None


def _original_recipient(original):
    if original is None:
        return None
    for name in ("X-HmXmrOriginalRecipient", "To"):
        for _, address in email.utils.getaddresses([_mail_text(v) for v in original.get_all(name, [])]):
            if _normalize_email(address):
                return _normalize_email(address)
    return None


def _feedback_report(msg, original):
    """(type, email, reason) of an RFC 5965 ARF report, else None."""
    for part in _parts(msg):
        if part.get_content_type() != "message/feedback-report":
            continue
        fields = email.message.Message()
        for block in _field_blocks(part):
            for name, value in block.items():
                fields[name] = value
        feedback = _mail_text(fields.get("Feedback-Type")).lower() or "unknown"
        if feedback not in ("abuse", "fraud"):
            return "none", None, f"feedback report of type {feedback}, not a complaint"
        address = (_report_address(fields.get("Original-Rcpt-To"))
                   or _report_address(fields.get("Removal-Recipient"))
                   or _original_recipient(original))
        agent = _mail_text(fields.get("User-Agent"))
        return "complaint", address, _short(f"{feedback} report" + (f" by {agent}" if agent else ""))
    return None


def _joined_reply(text):
    """A multi-line SMTP reply as one: '550-5.1.1 a 550-5.1.1 b' -> '550 5.1.1 a b'."""
    reply = re.match(r"([45][0-9][0-9])[ -]([245]\.[0-9]{1,3}\.[0-9]{1,3} )?", text)
    if reply is None:
        return text
    continuation = re.compile(rf"\s{reply[1]}[ -]{re.escape(reply[2] or '')}")
    return f"{reply[1]} {reply[2] or ''}" + continuation.sub(" ", text[reply.end():])


def _delivery_status(blocks):
    """(type, email, reason) of the recipients an RFC 3464 report says failed
    or were delayed (a hard failure first), else None."""
    found, delivered = [], False
    for block in blocks:
        action = _mail_text(block.get("Action")).lower()
        if action.startswith(("failed", "failure", "error")):
            failed = True
        elif action.startswith("delayed"):
            failed = False
        else:
            delivered = delivered or action.startswith(("delivered", "relayed", "expanded"))
            continue
        status = _STATUS_CODE.search(_mail_text(block.get("Status")))
        klass = status[1] if status else ("5" if failed else "4")
        kind = {"5": "hard", "4": "soft"}.get(klass, "hard" if failed else "soft")
        address = (_report_address(block.get("Original-Recipient"))
                   or _report_address(block.get("Final-Recipient")))
        diagnostic = _mail_text(block.get("Diagnostic-Code"))
        if re.match(r"[A-Za-z0-9-]+\s*;", diagnostic):
            diagnostic = _joined_reply(diagnostic.split(";", 1)[1].strip())
        reason = diagnostic or (f"status {status[0]}" if status else f"action {action or 'failed'}")
        found.append((kind, address, _short(reason)))
    if found:
        return next((item for item in found if item[0] == "hard"), found[0])
    if delivered:
        return "none", None, "a delivery report of a successful delivery"
    return None


def _sender_is_daemon(msg):
    sender = email.utils.parseaddr(_mail_text(msg.get("From")))[1]
    return sender.partition("@")[0].lower() in _DAEMON_SENDERS


def _auto_reply(msg):
    """(type, email, reason) 'none' for an automatic answer by a person's
    mailbox (vacation, out-of-office, autoresponders), else None."""
    if _sender_is_daemon(msg) or msg.get("X-Failed-Recipients"):
        return None
    auto_submitted = _mail_text(msg.get("Auto-Submitted")).lower()
    precedence = _mail_text(msg.get("Precedence") or msg.get("X-Precedence")).lower()
    if ((auto_submitted and not auto_submitted.startswith("no"))
            or any(msg.get(name) for name in ("X-Autoreply", "X-Autorespond", "X-Autoresponder"))
            or precedence.startswith("auto_reply")
            or _AUTO_REPLY_SUBJECT.match(_mail_text(msg.get("Subject")))):
        return "none", None, "an automatic reply (vacation or out of office), not a bounce"
    return None


def _body_reason(msg):
    """The first body line that quotes an SMTP reply or a status code."""
    for part in _parts(msg):
        if part.get_content_maintype() != "text":
            continue
        text = (part.get_payload(decode=True) or b"").decode("utf-8", "replace")
        for line in text.splitlines():
            if _STATUS_CODE.search(line) or _SMTP_REPLY.match(line.strip()):
                return _short(line)
    return None


def _detected_failures(msg, original):
    """(type, email, reason) from GNU Mailman's flufl.bounce detectors, else None."""
    # flufl.bounce 6.0's Yale detector raises IndexError on a message without
    # a From address, which would keep the detectors after it from running.
    if not any(address for _, address in email.utils.getaddresses([_mail_text(msg.get("From"))])):
        return None
    try:
        temporary, permanent = flufl.bounce.all_failures(msg)
    except Exception:  # a detector's bug must not hide the VERP fallback
        _log.debug("flufl.bounce failed on a message", exc_info=True)
        return None
    addresses = permanent or temporary
    if not addresses:
        return None
    decoded = sorted(filter(None, (_normalize_email(a.decode("ascii", "replace")) for a in addresses)))
    expected = _original_recipient(original)
    address = expected if expected in decoded else (decoded[0] if decoded else None)
    kind = "hard" if permanent else "soft"
    return kind, address, _body_reason(msg) or f"{'permanent' if permanent else 'temporary'} failure"


def _verp_bounce(msg):
    """(type, email, reason) of a message at a VERP address that no parser
    understood but that says it is a delivery failure, else None."""
    subject = _mail_text(msg.get("Subject"))
    # Bounces are sent with the null envelope sender (RFC 5321 section 4.5.5).
    null_sender = msg.get("Return-Path") is not None and _mail_text(msg.get("Return-Path")) in ("<>", "")
    if not (_sender_is_daemon(msg) or null_sender or _BOUNCE_SUBJECT.search(subject)):
        return None
    reason = _body_reason(msg)
    status = _STATUS_CODE.search(reason or "")
    kind = "soft" if status and status[1] == "4" else "hard"
    return kind, None, reason or _short(subject or "a delivery failure at the VERP address")


_UNREADABLE = "the message could not be read"


def _no_bounce(reason):
    return {"type": "none", "email": None, "outbox": None, "message_id": None, "reason": reason}


def _classify(raw, secret):
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    raw = bytes(raw[:_BOUNCE_MAX_BYTES])
    if (raw.lower().count(b"multipart/") > _BOUNCE_MAX_CONTAINERS
            or raw.count(b"\n--") + raw.count(b"\r--") > _BOUNCE_MAX_DELIMITERS):
        return _no_bounce("more MIME parts than a bounce has")
    # The compat32 policy, as flufl.bounce expects; it never raises on bad headers.
    msg = email.message_from_bytes(raw)
    # flufl.bounce's detectors call str methods on headers, which compat32
    # gives as Header objects when they hold 8-bit bytes: they read text.
    head = email.message_from_string(raw[:_BOUNCE_SCAN_BYTES].decode("utf-8", "replace"))
    original = _returned_message(msg)
    blocks = [block for part in _parts(msg)
              if part.get_content_type() in ("message/delivery-status", "message/global-delivery-status",
                                             "message/feedback-report")
              for block in _field_blocks(part)]
    outbox = _find_verp(secret, msg, blocks, original) if secret else None
    found = (_feedback_report(msg, original) or _delivery_status(blocks) or _auto_reply(msg)
             or _detected_failures(head, original) or (outbox is not None and _verp_bounce(msg))
             or ("none", None, "not a bounce or a complaint"))
    kind, address, reason = found
    if address is None and kind != "none":
        address = _original_recipient(original)
    # The original's Message-ID, else where reports and replies repeat it.
    message_id = _message_id(original.get("Message-ID")) if original is not None else None
    for value in [block.get("X-Original-Message-ID") for block in blocks] + [msg.get("In-Reply-To")]:
        message_id = message_id or _message_id(value)
    return {"type": kind, "email": address, "outbox": outbox, "message_id": message_id,
            "reason": reason}


def classify_bounce(raw, secret=None):
    """What a bounce or complaint email says, as a dict:

    ``type`` 'hard' (a 5.x.x failure), 'soft' (4.x.x: delayed, or given up on
    a temporary failure), 'complaint' (an ARF abuse or fraud report) or 'none'
    (anything else: auto-replies, out-of-office, delivery successes, human
    mail, unreadable bytes); ``email`` the recipient the report names
    (Original-Recipient, else Final-Recipient; for complaints Original-Rcpt-To,
    else the returned message's headers) or None; ``outbox`` the outbox id of
    a VERP address signed with ``secret`` or None (when set, it is the better
    answer to "who": the report's address may be a forwarding target);
    ``message_id`` the original's Message-ID (from the returned message, else
    the report, else In-Reply-To) or None; ``reason`` a short text.  Never
    raises: any bytes give an answer.

    :param raw: the whole message as bytes (str is taken as UTF-8).
    :param secret: the service's signing secret, to read VERP addresses.
    """
    try:
        return _classify(raw, secret)
    except Exception:  # a message no parser can read is no bounce
        _log.warning("a bounce message could not be read; taken as no bounce", exc_info=True)
        return _no_bounce(_UNREADABLE)


class MailboxError(Exception):
    """The bounce mailbox could not be reached, logged in to or opened."""


def _imap_connect(host, port, use_ssl, timeout, ssl_context):
    if use_ssl:
        return imaplib.IMAP4_SSL(host, port, ssl_context=ssl_context or ssl.create_default_context(),
                                 timeout=timeout)
    return imaplib.IMAP4(host, port, timeout=timeout)


def _imap_ok(response, what):
    status, data = response
    if status != "OK":
        detail = b" ".join(item for item in data if isinstance(item, bytes)).decode("utf-8", "replace")
        raise MailboxError(f"IMAP {what} failed: {detail or status}")
    return data


def _imap_fetch(imap, uid, item):
    """``(response line, literal or None)`` of one FETCH item of message ``uid``."""
    data = _imap_ok(imap.uid("FETCH", uid, f"({item})"), f"fetch of message {uid.decode()}")
    for entry in data:
        if isinstance(entry, tuple):
            return entry[0], entry[1]
    return b" ".join(entry for entry in data if isinstance(entry, bytes)), None


def _imap_quote(folder):
    """A folder name as an IMAP quoted string (ASCII names; MailboxError else)."""
    if not folder or not folder.isascii() or any(c in folder for c in "\r\n\0"):
        raise MailboxError(f"the folder name {folder!r} is not a plain ASCII IMAP name")
    return '"' + folder.replace("\\", "\\\\").replace('"', '\\"') + '"'


def read_bounce_mailbox(host, port, user, password, *, folder="INBOX", ssl=False, handle,
                        timeout=30, ssl_context=None, max_messages=_MAILBOX_MAX_MESSAGES,
                        max_bytes=_MAILBOX_MAX_BYTES):
    """Read a bounce mailbox over IMAP: every message is passed to
    ``handle(raw_bytes)``; those it returns True for are deleted (flagged
    ``\\Deleted``, expunged at the end), the others are left and logged.

    Raises MailboxError when the server cannot be reached, refuses the login
    or has no such folder.  Returns ``{"processed": n, "left": n}``, where
    ``left`` counts the messages that stay in the folder.

    :param handle: a callable given the raw message; True when processed.  An
        exception it raises leaves the message and is logged.
    :param ssl: IMAPS (TLS from the start) instead of plain IMAP.
    :param timeout: seconds any one network operation may take.
    :param ssl_context: for IMAPS; default: the system's trusted CAs.
    :param max_messages: at most this many messages are read in one run.
    :param max_bytes: larger messages are left in the mailbox unread.
    """
    try:
        imap = _imap_connect(host, port, ssl, timeout, ssl_context)
    except (OSError, imaplib.IMAP4.error) as exc:
        raise MailboxError(f"cannot reach the IMAP server {host}:{port}: {exc}") from exc
    processed = left = 0
    try:
        try:
            imap.login(user, password)
        except (imaplib.IMAP4.error, UnicodeError) as exc:   # IMAP LOGIN takes ASCII only
            raise MailboxError(f"the IMAP server {host}:{port} refused the login of {user!r}: "
                               f"{exc}") from exc
        _imap_ok(imap.select(_imap_quote(folder)), f"select of folder {folder!r}")
        uids = _imap_ok(imap.uid("SEARCH", None, "UNDELETED"), "search")[0].split()
        left = max(0, len(uids) - max_messages)
        for uid in uids[:max_messages]:
            if _handle_one(imap, uid, handle, max_bytes):
                _imap_ok(imap.uid("STORE", uid, "+FLAGS.SILENT", r"(\Deleted)"),
                         f"deletion of message {uid.decode()}")
                processed += 1
            else:
                left += 1
        # Also removes what a run that failed before its end had flagged.
        _imap_ok(imap.expunge(), "expunge")
        imap.close()
    except (OSError, imaplib.IMAP4.error) as exc:
        raise MailboxError(f"the IMAP session with {host}:{port} failed: {exc}") from exc
    finally:
        with contextlib.suppress(OSError, imaplib.IMAP4.error):
            imap.logout()
    _log.info("bounce mailbox %s@%s:%s/%s: %d processed, %d left", user, host, port, folder,
             processed, left)
    return {"processed": processed, "left": left}


def _handle_one(imap, uid, handle, max_bytes):
    """Whether ``handle`` processed the message with ``uid``."""
    match = re.search(rb"RFC822\.SIZE (\d+)", _imap_fetch(imap, uid, "RFC822.SIZE")[0])
    if match and int(match[1]) > max_bytes:
        _log.warning("bounce mailbox: message %s is %s bytes, more than %d; left unread",
                    uid.decode(), match[1].decode(), max_bytes)
        return False
    raw = _imap_fetch(imap, uid, "BODY.PEEK[]")[1]
    if raw is None:
        _log.warning("bounce mailbox: message %s has no body; left", uid.decode())
        return False
    try:
        done = handle(raw)
    except Exception:  # one bad message must not stop the run
        _log.exception("bounce mailbox: message %s could not be handled; left", uid.decode())
        return False
    if not done:
        _log.warning("bounce mailbox: message %s was not understood; left", uid.decode())
    return bool(done)


# The bounce routes' and the mailbox's limits; our Message-IDs ---------------

#: The largest body the bounce routes read: far above any bounce of ours
#: (only the head of a message is read anyway); larger ones are 413 unread.
_BOUNCE_MAX_BODY = 2 * 1024 * 1024
#: Seconds between two reads of the bounce mailbox by the worker.
_MAILBOX_INTERVAL = 60


# The bounce mailbox, read by the command and the worker -----------------------

def process_bounce_mailbox(db, imap, user, password, *, folder="INBOX", ssl=False, secret=None,
                           timeout=30, ssl_context=None):
    """Read the bounce mailbox once: each message is classified and applied
    (apply_bounce()) in a transaction of its own, then deleted; a message
    that is no bounce is deleted too, after a log line (the mailbox is the
    envelope sender's, where nobody reads); one that cannot be read at all,
    or whose transaction fails, is left and logged.

    :param db: the database path or URL.
    :param imap: ``"host:port"`` of the IMAP server.
    :param secret: the signing secret; default the one stored in the database.
    :returns: ``{"processed": n, "left": n}``.
    :raises MailboxError: the server cannot be reached, refuses the login or
        has no such folder.
    """
    host, port = _server_address(imap, "the IMAP server")
    conn = connect(db)
    try:
        # No stored secret yet: nothing was signed, so no report can name an email.
        secret = secret or _stored_secret(conn, create=False)

        def handle(raw):
            report = classify_bounce(raw, secret)
            if report["reason"] == _UNREADABLE:
                return False
            with transaction(conn):
                answer = apply_bounce(conn, report, secret=secret)
            _log.info("bounce mailbox: %s for %s (%s)", answer["type"],
                     answer["email"] or "no known address", report["reason"])
            return True

        return read_bounce_mailbox(host, port, user, password, folder=folder, ssl=ssl,
                                   handle=handle, timeout=timeout, ssl_context=ssl_context)
    finally:
        conn.close()


# The bounce routes -------------------------------------------------------------

#: POST /v1/bounce with JSON: the parameters, checked as the pipeline checks any.
_BOUNCE_PARAMS = "email:email type:hard|soft|complaint campaign:int@campaign reason:text"
_BOUNCE_JSON = Route("POST", "/bounce", "write", None, "email:email! type:hard|soft|complaint! "
                     "campaign:int@campaign reason:text", writes=False)
_RAW_TYPES = ("message/rfc822", "message/global")


def _bounce_body(call):
    """The raw body of a bounce route, refused (413) over the bounce limit unread."""
    return _read_body(bottle.request.environ, min(call.service.config["max_body"], _BOUNCE_MAX_BODY))


def _bounce_post(call):
    environ, secret = bottle.request.environ, call.service.secret
    if _content_type(bottle.request.environ) in _RAW_TYPES:
        if call.params:
            raise InvalidParameter("A raw message comes alone, without parameters.",
                                   field=sorted(call.params))
        raw = _bounce_body(call)
        if not raw.strip():
            raise MissingParameter("The body is empty: send the whole bounce or feedback email.")
        report = classify_bounce(raw, secret)
    else:
        params = _parse_params(_BOUNCE_JSON, environ, call.service.config["max_body"])
        if not params["email"]:
            raise InvalidParameter("'email' is the address that bounced or complained.",
                                   field="email")
        _BOUNCE_JSON.check_references(call, params)
        report = {"type": params["type"], "email": params["email"],
                  "campaign": params.get("campaign")}
    with transaction(call.conn):
        answer = apply_bounce(call.conn, report, account=call.account, secret=secret,
                              pending=call.events)
    return {"bounce": answer}


def _provider_callback(call, setting, read):
    """A provider route: 404 without its setting; read and authenticate the
    call with ``read(body)``, then apply its events in one transaction."""
    if not call.service.config[setting]:
        raise NotFound(f"This route is off: the setting {setting} is not given.")
    body, secret = _bounce_body(call), call.service.secret
    try:
        events = read(body)
    except _ProviderAuthError as error:
        raise Unauthorized(str(error)) from None
    except _NotJson as error:
        raise InvalidJson(str(error)) from None
    except ValueError as error:
        raise InvalidParameter(str(error)) from None
    with transaction(call.conn):
        for event in events:
            apply_bounce(call.conn, event, secret=secret,
                         pending=call.events)
    return {"received": str(len(events))}


def _bounce_ses(call):
    service = call.service
    return _provider_callback(call, "ses_topic_arns", lambda body: _parse_sns_callback(
        body, topic_arns=service.config["ses_topic_arns"], fetch=service.sns_fetch,
        cert_url_pattern=service.sns_cert_host))


def _bounce_mailgun(call):
    return _provider_callback(call, "mailgun_signing_key", lambda body: _parse_mailgun_callback(
        body, call.service.config["mailgun_signing_key"]))


def _bounce_postmark(call):
    return _provider_callback(call, "postmark_credentials", lambda body: _parse_postmark_callback(
        body, _request_header("Authorization"), call.service.config["postmark_credentials"]))


def _bounce_sendgrid(call):
    return _provider_callback(call, "sendgrid_public_key", lambda body: _parse_sendgrid_callback(
        body, _request_header("X-Twilio-Email-Event-Webhook-Signature"),
        _request_header("X-Twilio-Email-Event-Webhook-Timestamp"),
        call.service.config["sendgrid_public_key"]))


# ---------------------------------------------------------------------------
# Delivery: MIME, SMTP, DKIM, unsubscribe
# ---------------------------------------------------------------------------

#: A claim is a lease: a live worker renews it (claimed_at) every _CLAIM_RENEW
#: seconds while it works, and confirms it before each SMTP attempt; one not
#: renewed for _STALE_CLAIM belongs to a worker that died, and its rows go back
#: to the queue (the one in flight is failed).
_STALE_CLAIM = datetime.timedelta(seconds=30)
_CLAIM_RENEW = 5
_INTERRUPTED = ("the worker stopped during the SMTP attempt, so the email may have arrived; "
                "not sent again, so that it cannot arrive twice")
#: Retry after a 4xx reply: _RETRY_BASE * 2**attempts seconds, at most _RETRY_CAP.
_RETRY_BASE, _RETRY_CAP = 30, 3600
#: Seconds before rows are tried again after the SMTP server could not be reached.
_CONNECTION_RETRY = 30
_MAX_ATTEMPTS = 8
#: Seconds between progress lines in the log while a delivery runs.
_PROGRESS_INTERVAL = 10


def _time_text(moment):
    """A time as stored ('YYYY-MM-DD HH:MM:SS' UTC) from a datetime or that text."""
    if moment is None:
        return _now()
    if isinstance(moment, datetime.datetime):
        if moment.tzinfo is not None:
            moment = moment.astimezone(datetime.timezone.utc)
        return moment.strftime("%Y-%m-%d %H:%M:%S")
    return str(moment)


def dkim_signer(domain, selector, private_key):
    """A function that prepends a DKIM-Signature to an email (needs dkimpy).

    :param private_key: the RSA private key, PEM bytes.
    """
    import dkim  # optional dependency: pip install campaignapi[dkim]

    domain, selector = domain.encode("ascii"), selector.encode("ascii")
    # RFC 8058: the one-click header must be covered by the signature.
    headers = list(dkim.DKIM.SHOULD) + [b"list-unsubscribe-post"]

    def sign(message):
        return dkim.sign(message, selector, domain, private_key, include_headers=headers,
                         canonicalize=(b"relaxed", b"relaxed")) + message

    return sign


# SMTP delivery ---------------------------------------------------------------

class _RateLimit:
    """A global pace for all connections: at most ``rate`` emails a second."""

    def __init__(self, rate):
        self.interval = 1.0 / rate if rate else 0.0
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def wait(self, stop):
        if not self.interval:
            return
        with self.lock:
            now = time.monotonic()
            slot = max(now, self.next)
            self.next = slot + self.interval
        if slot > now:
            stop.wait(slot - now)


# Per-domain rates and the warm-up ----------------------------------------------
#
# Shared through the database, so every worker of several hosts counts the
# same emails: a claim admits, in its own transaction, what each receiving
# domain's rate and the day's warm-up cap allow now; the other claimed rows go
# back to the queue due when their window ends, and the claims that follow
# skip a domain whose window is full (no head-of-line blocking: other domains
# go on).  Windows are fixed ones of the rate's unit, aligned to the clock.

_RATE_UNITS = {"s": 1, "m": 60, "h": 3600}
#: Seconds without a "slow down" deferral after which a halved rate rises by
#: a tenth of the configured one (again each such period).
_QUIET = 600
#: A deferral that says "slow down" (section 20): 421, 450 to 452 (and SES's
#: 454) or an enhanced 4.7.x status, mentioning rate, throttling or too many
#: connections or messages.
_SLOW_DOWN = re.compile(r"\brate|throttl|too many (?:concurrent )?(?:connections|messages|mails?"
                        r"|sessions)", re.IGNORECASE)
#: At most so many full domains are left out of a claim by name.
_SKIPPED_DOMAINS = 200
_BULK_KINDS = ("campaign", "automation")          # held by the warm-up's daily cap
_WARMUP_KINDS = _BULK_KINDS + ("transactional",)  # counted toward it


def _rate_domain(address):
    """The receiving domain of an address after the alias table: one
    receiver's domains count as one (googlemail.com is gmail.com; hotmail.*,
    outlook.*, live.* and msn.com are outlook.com)."""
    domain = address.rpartition("@")[2].lower()
    if domain == "googlemail.com":
        return "gmail.com"
    if domain == "msn.com" or "." in domain and domain.partition(".")[0] in (
            "hotmail", "outlook", "live"):
        return "outlook.com"
    return domain


def _domain_patterns(domain):
    """LIKE patterns of the addresses of a domain (_rate_domain()); the
    outbox's to_addr compares without case on both engines.  A domain holds
    no ``%``; a ``_`` matching any one character only skips a little more."""
    return {"gmail.com": ["%@gmail.com", "%@googlemail.com"],
            "outlook.com": ["%@hotmail.%", "%@outlook.%", "%@live.%", "%@msn.com"]
            }.get(domain, ["%@" + domain])


def _slows_down(code, reply):
    return (code in (421, 450, 451, 452, 454) or reply.startswith("4.7.")) \
        and bool(_SLOW_DOWN.search(reply))


def _parse_domain_rates(value):
    """``{domain: (emails, unit seconds)}`` of the setting ``domain_rates``:
    ``{"gmail.com": "100/m", "*": "20/s"}`` or strings ``"DOMAIN=N/UNIT"``
    (what ``--domain-rate`` gives); ValueError when one cannot be read."""
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = [str(item).partition("=")[::2] for item in
                 ((value,) if isinstance(value, str) else value or ())]
    rates = {}
    for domain, rate in items:
        domain = str(domain).strip().lower()
        match = re.fullmatch(r"\s*(\d{1,9}(?:\.\d{1,6})?)\s*/\s*([smh])\s*", str(rate))
        if not (match and float(match[1]) >= 1 and (domain == "*" or re.fullmatch(
                rf"{_EMAIL_LABEL}(?:\.{_EMAIL_LABEL})+", domain))):
            raise ValueError(f"domain_rates takes DOMAIN=N/UNIT (N at least 1, UNIT s, m or h, "
                             f"DOMAIN a domain name or * for the others), such as "
                             f"gmail.com=100/m, not {domain}={rate}")
        rates["*" if domain == "*" else _rate_domain("@" + domain)] = (
            float(match[1]), _RATE_UNITS[match[2]])
    return rates


def _parse_warmup(caps, start):
    """``(caps, start date or None)`` of the settings ``warmup`` ("50,100,...",
    or numbers) and ``warmup_start`` ("YYYY-MM-DD" or empty); ValueError."""
    items = caps.split(",") if isinstance(caps, str) else list(caps or ())
    try:
        caps = tuple(int(str(cap).strip()) for cap in items if str(cap).strip())
        start = datetime.date.fromisoformat(start) if start else None
    except ValueError:
        caps = None
    if caps is None or any(cap < 1 for cap in caps):
        raise ValueError("warmup takes daily caps such as 50,100,500 (whole numbers from 1) and "
                         "warmup_start a date YYYY-MM-DD")
    return caps, start


def _day_text(now):
    """The UTC day of Unix time ``now``, YYYY-MM-DD."""
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date().isoformat()


def _domain_rate_text(rate, unit):
    letter = next(name for name, seconds in _RATE_UNITS.items() if seconds == unit)
    return f"{round(rate, 2):g}/{letter}"


def _paced_rate(pace, configured, now):
    """``(rate now, raised)`` of a domain_pace row: halved rates rise by a
    tenth of ``configured`` for each _QUIET seconds without a slow-down."""
    rate = min(configured, pace["rate"] if pace["rate"] is not None else configured)
    raised, quiet = pace["raised"], max(pace["slowed"], pace["raised"])
    if rate < configured and now - quiet >= _QUIET:
        steps = (now - quiet) // _QUIET
        rate, raised = min(configured, rate + steps * configured / 10), quiet + steps * _QUIET
    return rate, raised


class _Pace:
    """The settings ``domain_rates``, ``warmup`` and ``warmup_start`` as one
    deliver() applies them in its claims."""

    def __init__(self, domain_rates=None, warmup=(), warmup_start=""):
        self.rates = _parse_domain_rates(domain_rates)
        self.caps, self.start = _parse_warmup(warmup, warmup_start)

    def rule(self, domain):
        return self.rates.get(domain) or self.rates.get("*")

    def skipped(self, conn, now):
        """``(SQL, params)`` to add to the claim's WHERE: not the addresses of
        a domain whose window is full."""
        if not self.rates:
            return "", ()
        # The longest held first, a bounded number (a statement's parameters
        # are limited): a full domain beyond them is claimed and put back.
        patterns = [pattern for (domain,) in conn.execute(
            "SELECT domain FROM domain_pace WHERE full_until > ? ORDER BY full_until DESC "
            "LIMIT ?", (now, _SKIPPED_DOMAINS)) if self.rule(domain)
            for pattern in _domain_patterns(domain)]
        if not patterns:
            return "", ()
        return "AND NOT (" + " OR ".join("to_addr LIKE ?" for _ in patterns) + ") ", patterns

    def warmup(self, conn, now, lock=True):
        """``(day number from 1 or None, cap or None, sent today)``; with
        ``lock``, today's row is made and locked until the transaction ends."""
        today = datetime.date.fromisoformat(_day_text(now))
        if lock:
            conn.execute("INSERT INTO send_day (day) VALUES (?) ON CONFLICT DO NOTHING",
                         (today.isoformat(),))
            conn.execute("UPDATE send_day SET sent = sent WHERE day = ?", (today.isoformat(),))
        sent = conn.execute("SELECT coalesce(sum(sent), 0) FROM send_day WHERE day = ?",
                            (today.isoformat(),)).fetchone()[0]
        if not self.caps:
            return None, None, sent
        start = self.start or datetime.date.fromisoformat(conn.execute(
            "SELECT coalesce(min(day), ?) FROM send_day WHERE bulk > 0",
            (today.isoformat(),)).fetchone()[0])
        day = max(0, (today - start).days)
        return day + 1, self.caps[day] if day < len(self.caps) else None, sent

    def admit(self, conn, rows, now):
        """Inside the claim's transaction: the claimed rows that go now; the
        others are queued again, due when their domain's window ends or (over
        the warm-up's cap) at the next UTC day."""
        waiting = {}
        counted = [row for row in rows if row["kind"] in _WARMUP_KINDS]
        if counted:
            _, cap, sent = self.warmup(conn, now)
            tomorrow = (now // 86400 + 1) * 86400
            for row in counted:
                if row["kind"] in _BULK_KINDS and cap is not None and sent >= cap:
                    waiting[row["id"]] = tomorrow
                else:
                    sent += 1   # admitted, unless its domain's rate holds it below
        groups = {}
        for row in rows:
            domain = _rate_domain(row["to_addr"])
            if row["id"] not in waiting and self.rule(domain):
                groups.setdefault(domain, []).append(row)
        for domain in sorted(groups):   # the same lock order in every worker
            configured, unit = self.rule(domain)
            conn.execute("INSERT INTO domain_pace (domain) VALUES (?) ON CONFLICT DO NOTHING",
                         (domain,))
            conn.execute("UPDATE domain_pace SET configured = ?, unit = ? WHERE domain = ?",
                         (configured, unit, domain))
            pace = conn.execute("SELECT * FROM domain_pace WHERE domain = ?", (domain,)).fetchone()
            rate, raised = _paced_rate(pace, configured, now)
            window = now - now % unit
            used = pace["used"] if pace["win"] == window else 0
            room = max(0, int(rate) - used)
            for row in groups[domain][room:]:
                waiting[row["id"]] = window + unit
            used += min(room, len(groups[domain]))
            conn.execute("UPDATE domain_pace SET rate = ?, raised = ?, win = ?, used = ?, "
                         "full_until = ? WHERE domain = ?",
                         (rate, raised, window, used, window + unit if used >= int(rate) else 0,
                          domain))
        going = [row for row in rows if row["id"] not in waiting]
        if counted:
            conn.execute("UPDATE send_day SET sent = sent + ?, bulk = bulk + ? WHERE day = ?", (
                sum(row["kind"] in _WARMUP_KINDS for row in going),
                sum(row["kind"] in _BULK_KINDS for row in going),
                _day_text(now)))
        if waiting:
            conn.executemany(
                "UPDATE outbox SET status = 'queued', claimed_by = NULL, claimed_at = NULL, "
                "next_try = ? WHERE id = ?",
                [(_time_text(datetime.datetime.fromtimestamp(due, datetime.timezone.utc)), id_)
                 for id_, due in waiting.items()])
        return going


def _tally_domains(conn, tally, rates, now):
    """Inside a transaction: the emails sent and deferred per domain
    (``tally``: ``{domain: [sent, deferred, slowed]}``); a "slow down"
    deferral halves the domain's rate (at most once a window of its unit, a
    minute at most: the emails in flight went at the old rate), never below
    one email a unit."""
    minute = now // 60
    for domain in sorted(tally):
        sent, deferred, slowed = tally[domain]
        conn.execute("INSERT INTO domain_pace (domain, sent, deferred) VALUES (?, ?, ?) "
                     "ON CONFLICT (domain) DO UPDATE SET sent = domain_pace.sent + excluded.sent, "
                     "deferred = domain_pace.deferred + excluded.deferred",
                     (domain, sent, deferred))
        conn.execute("INSERT INTO domain_minute (domain, minute, sent, deferred) VALUES (?, ?, ?, ?) "
                     "ON CONFLICT (domain, minute) DO UPDATE SET "
                     "sent = domain_minute.sent + excluded.sent, "
                     "deferred = domain_minute.deferred + excluded.deferred",
                     (domain, minute, sent, deferred))
        rule = rates.get(domain) or rates.get("*")
        if slowed and rule:
            pace = conn.execute("SELECT * FROM domain_pace WHERE domain = ?", (domain,)).fetchone()
            rate, _ = _paced_rate(pace, rule[0], now)
            halve = now - pace["halved"] >= min(rule[1], 60)
            conn.execute("UPDATE domain_pace SET slowed = ?, halved = ?, rate = ?, raised = 0 "
                         "WHERE domain = ?", (now, now if halve else pace["halved"],
                                              max(1.0, rate / 2) if halve else rate, domain))
    conn.execute("DELETE FROM domain_minute WHERE minute < ?", (minute - 120,))
    tally.clear()


def _uncount_day(conn, unsent, now):
    """Inside a transaction: the warm-up counts emails sent, so those it
    admitted that did not go (deferred, failed, skipped, not tried) come off
    today's figures; ``unsent``: [others, bulk], emptied."""
    conn.execute("UPDATE send_day SET sent = CASE WHEN sent > ? THEN sent - ? ELSE 0 END, "
                 "bulk = CASE WHEN bulk > ? THEN bulk - ? ELSE 0 END WHERE day = ?",
                 (sum(unsent), sum(unsent), unsent[1], unsent[1], _day_text(now)))
    unsent[:] = [0, 0]


def _deliverability(conn, config):
    """The deliverability record: the service's per-domain rates, their last
    hour, what waits for each, and the warm-up's day."""
    pace, now = _Pace(config["domain_rates"], config["warmup"], config["warmup_start"]), \
        int(time.time())
    paces = {row["domain"]: row for row in conn.execute("SELECT * FROM domain_pace")}
    hour = {domain: (sent, deferred) for domain, sent, deferred in conn.execute(
        "SELECT domain, sum(sent), sum(deferred) FROM domain_minute WHERE minute > ? "
        "GROUP BY domain", (now // 60 - 60,))}
    queued = {}
    for domain, count in conn.execute(
            f"SELECT {conn.sql['address_domain'].format(expr='to_addr')} AS d, count(*) "
            "FROM outbox WHERE status = 'queued' GROUP BY d"):
        queued[_rate_domain("@" + domain)] = queued.get(_rate_domain("@" + domain), 0) + count
    domains = []
    for domain in sorted({d for d in pace.rates if d != "*"} | set(hour) | set(queued) | {
            d for d, row in paces.items() if row["rate"] is not None and row["configured"]
            and row["rate"] < row["configured"]}):
        rule, row = pace.rule(domain), paces.get(domain)
        rate = rule and (_paced_rate(row, rule[0], now)[0] if row else rule[0])
        sent, deferred = hour.get(domain, (0, 0))
        domains.append({"domain": domain, "rate": rule and _domain_rate_text(rate, rule[1]),
                        "configured": rule and _domain_rate_text(*rule), "sent_hour": str(sent),
                        "deferred_hour": str(deferred), "queued": str(queued.get(domain, 0))})
    day, cap, sent = pace.warmup(conn, now, lock=False)
    return {"id": "0", "domains": domains, "warmup": {
        "day": day and str(day), "cap": cap and str(cap), "sent_today": str(sent)}}


def _deliverability_get(call, record_id):
    if record_id != 0:
        raise NotFound("There is one deliverability record, the service's: "
                       "GET /v1/deliverability/0.")
    return {"deliverability": _deliverability(call.conn, call.service.config)}


_COUNTS = ("sent", "retried", "failed", "bounced", "skipped", "requeued")


class _Unreachable(Exception):
    """The SMTP server cannot be reached or dropped the connection."""


def _mail_commands(sender, recipient):
    """The commands that open a mail transaction, and the replies each must
    get; the command encoding (a non-ASCII address needs SMTPUTF8, RFC 6531:
    the caller checked the server offers it)."""
    utf8 = not (sender.isascii() and recipient.isascii())
    return ((f"MAIL FROM:<{sender}>" + (" SMTPUTF8" if utf8 else ""), f"RCPT TO:<{recipient}>",
             "DATA"), ((250,), (250, 251), (354,)), "utf-8" if utf8 else "ascii")


def _offered(sender, recipient):
    """The commands that open a mail transaction (MAIL, RCPT, DATA), as the
    bytes of one write that does not wait for their replies:
    _transact(..., offered=True) reads them.  For a server that offers
    PIPELINING, which reads them while the sender does other work (records
    the attempt).  Until the message's final dot nothing is delivered: a
    sender that must not send after all closes the connection."""
    commands, _, encoding = _mail_commands(sender, recipient)
    return "".join(command + "\r\n" for command in commands).encode(encoding)


def _transact(smtp, sender, recipient, data, offered=False, then=b""):
    """One mail transaction on an open connection: None when the email is
    accepted, else the refusing ``(code, reply)``.

    The exchange of smtplib's sendmail(), without what it repeats for every
    email: parsing both addresses again (ours are checked) and dot-stuffing
    with a regular expression (our line ends are all CRLF).  A server that
    offers PIPELINING (RFC 2920; every common relay does) gets MAIL, RCPT and
    DATA in one write: two round trips an email instead of four, and a
    sender mostly waits on round trips.  ``offered``: they were written
    already (_offered()); only their replies are read here.  ``then``: the
    next email's commands (_offered()), written with this message's final
    dot, so that an email takes one round trip (RFC 2920 lets DATA's
    content and the commands after it share a write); they go only when the
    message does, and the result says whether they went.

    Returns ``(None or (code, reply), whether then was written)``.
    """
    commands, expected, smtp.command_encoding = _mail_commands(sender, recipient)
    replies = []
    if offered or smtp.does_esmtp and smtp.has_extn("pipelining"):
        if not offered:
            smtp.send(_offered(sender, recipient))
        for _ in commands:
            replies.append(smtp.getreply())
            if replies[-1][0] == 421:  # the server hangs up: no more replies
                break
    else:
        for command, ok in zip(commands, expected):
            replies.append(smtp.docmd(command))
            if replies[-1][0] not in ok:
                break
    code, reply = next((answer for answer, ok in zip(replies, expected) if answer[0] not in ok),
                       (354, b""))
    if code == 354:
        smtp.send(data.replace(b"\n.", b"\n..") + b".\r\n" + then)
        code, reply = smtp.getreply()
        # After the final dot the transaction is over either way.
        return (None if code == 250 else (code, reply)), bool(then)
    if replies[-1][0] == 354:  # pipelined DATA went through after a refusal: end it empty
        smtp.send(b".\r\n")
        smtp.getreply()
    if code != 421:  # 421: the server is closing; nothing to reset
        smtp.docmd("RSET")
    return (code, reply), False


class _Courier:
    """One SMTP connection with its own database connection: claims rows of
    the outbox, sends them, records what happened."""

    def __init__(self, run):
        self.run = run
        self.conn = connect(run.db)
        self.smtp = None
        self.looked = time.monotonic()   # when it last looked for dead workers' leases
        self.letters, self.fields = {}, {}  # per (batch, message) and per datasource
        self.tally = {}   # per domain: [sent, deferred, slowed] not yet written
        self.unsent = [0, 0]   # emails the warm-up counted that did not go: [other, bulk]
        self.offered = None   # the outbox id whose commands are written, replies unread

    # The database side.

    def claim(self, first=False):
        """Claim the next chunk of due rows, those of the highest priority
        first (the index outbox_claim gives them in that order); of those,
        the ones the domains' rates and the warm-up admit now (a chunk they
        all wait out is followed by another, a few times at most).
        ``first``: only rows of a priority above 0 (a transactional email),
        looked for by a read before any lock is taken."""
        for _ in range(8):
            rows, claimed = self.claim_chunk(first)
            if rows or not claimed:
                return rows
        return []

    def claim_chunk(self, first):
        due = self.run.now or _now()
        priority = "AND priority > 0 " if first else ""
        if first and not self.conn.execute(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'queued' AND priority > 0 "
                "AND next_try <= ?)", (due,)).fetchone()[0]:
            return [], 0
        with transaction(self.conn):
            if time.monotonic() - self.looked >= _CLAIM_RENEW:
                # While busy, also hand a dead worker's rows back to the queue.
                self.looked = time.monotonic()
                _take_back(self.conn, _time_text(self.run.now) if self.run.now else _now(),
                           self.run.stale_claim)
            # On PostgreSQL each worker takes rows no other has locked.
            # Not those of a domain whose rate's window is full (_Pace).
            clock = int(time.time())
            skip, skipped = self.run.pace.skipped(self.conn, clock)
            rows = self.conn.execute(
                "UPDATE outbox SET status = 'sending', claimed_by = ?, claimed_at = ?, "
                "sent = NULL "
                f"WHERE id IN (SELECT id FROM outbox WHERE status = 'queued' {priority}"
                f"AND next_try <= ? {skip}ORDER BY priority DESC, next_try LIMIT ? "
                f"{self.conn.sql['skip_locked']}) AND status = 'queued' "
                "RETURNING id, account, kind, batch, message, recipient, to_addr, subject, body, "
                "html, attempts, fromname, fromaddress, replyto, campaign, base_url, prepared, "
                "merge_values, priority, next_try",
                (self.run.worker_id, _now(), due, *skipped, self.run.chunk)).fetchall()
            claimed = len(rows)
            # RETURNING keeps no order, and rows of one priority and next_try
            # come as they lie in the table (on PostgreSQL, anywhere in a table
            # whose rows were deleted or updated): in the claim's order, the
            # oldest first among equals, so that a domain's rate and the
            # warm-up admit the highest priority, longest due, oldest rows,
            # and the higher priority is sent first.
            rows = sorted(rows, key=lambda row: (-row["priority"], row["next_try"], row["id"]))
            if rows:
                rows = self.run.pace.admit(self.conn, rows, clock)
        return rows, claimed

    def recipients(self, rows):
        ids = [row["recipient"] for row in rows if row["recipient"] is not None and (
            row["kind"] in ("campaign", "test") or row["prepared"] is not None)]
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        return {r["id"]: r for r in self.conn.execute(
            "SELECT r.id, r.datasource, r.email, r.data, r.status, s.reason AS suppressed "
            "FROM recipient r JOIN datasource d ON d.id = r.datasource "
            "LEFT JOIN suppression s ON s.account = d.owner AND s.email = r.email "
            f"WHERE r.id IN ({marks})", ids)}

    def record(self, results, bounces, attempting=None, accepted=(), fresh=()):
        """Write the outcomes so far (and empty the lists); with ``attempting``,
        in the same transaction mark that row's SMTP attempt as under way.

        Called before every SMTP attempt, so an email the server accepted is
        never more than one attempt away from being recorded: a worker
        killed mid-chunk leaves only its one attempting row in doubt.

        The emails the server accepted (``accepted``, outcomes as
        ``results``) are written in a group, at the chunk's end or every
        _SENT_GROUP: a status changes the rows of three indexes, a cost per
        email that was most of a commit's.  Until then each is marked with
        its ``sent`` time alone (``fresh``: those not marked yet), a column no
        index holds, so the row stays 'sending' but is known sent: a worker
        that dies leaves it sent (_take_back()), never in doubt or queued.

        Returns False when the ``attempting`` row is no longer this worker's
        (its lease ran out and another took it back): it must not be sent."""
        worker, mine = self.run.worker_id, True
        pending = [] if self.run.on_event else None
        grouped = attempting is None or len(accepted) >= _SENT_GROUP
        written = [*results, *(accepted if grouped else ())]
        uncounted = any(self.unsent) and attempting is None
        tallied = bool(self.tally) and (attempting is None or any(t[2] for t in
                                                                  self.tally.values()))
        # The attempt alone (the common case) is one statement, atomic by itself.
        alone = not (written or bounces or uncounted or tallied)
        with (_one_statement if alone else transaction)(self.conn):
            if written:
                self.conn.executemany(
                    "UPDATE outbox SET status = ?, attempts = ?, next_try = coalesce(?, next_try), "
                    "error = ?, sent = ?, claimed_by = NULL, claimed_at = NULL, "
                    "attempt_started = NULL WHERE id = ? AND claimed_by = ?",
                    [(*result, worker) for result in written])
            for report in bounces:
                apply_bounce(self.conn, report, pending=pending)
            # The day's row before the domains' rows, as a claim locks them (no deadlock).
            if uncounted:
                _uncount_day(self.conn, self.unsent, int(time.time()))
            if tallied:
                _tally_domains(self.conn, self.tally, self.run.pace.rates, int(time.time()))
            if attempting is not None:
                # One statement: this attempt, and the sent time of those accepted since.
                marks = [] if grouped else [(result[5], result[4]) for result in fresh]
                mine = attempting in {row[0] for row in self.conn.execute(
                    "UPDATE outbox SET attempt_started = CASE WHEN id = ? THEN ? END"
                    + (f", sent = CASE id{' WHEN ? THEN ?' * len(marks)} ELSE sent END"
                       if marks else "")
                    + f" WHERE id IN ({', '.join('?' * (len(marks) + 1))}) "
                    "AND status = 'sending' AND claimed_by = ? RETURNING id",
                    (attempting, _now(), *(value for mark in marks for value in mark),
                     attempting, *(mark[0] for mark in marks), worker))}
        for done in (results, bounces, fresh, *((accepted,) if grouped else ())):
            if done:
                done.clear()
        if pending:
            _run_callbacks(self.run.on_event, pending)
        return mine

    # Building the emails.

    def campaign_letter(self, batch_id, message_id):
        key = (batch_id, message_id)
        letter = self.letters.get(key)
        if letter is None:
            batch = self.conn.execute(
                "SELECT b.base_url, b.tracking, c.id AS campaign, c.owner, c.accountprofile "
                "FROM batch b JOIN campaign c ON c.id = b.campaign WHERE b.id = ?",
                (batch_id,)).fetchone()
            message = None if batch is None else self.conn.execute(
                "SELECT * FROM message WHERE id = ? AND owner = ?",
                (message_id, batch["owner"])).fetchone()
            if batch is None or message is None:
                raise LookupError(f"batch {batch_id} or message {message_id} (of the campaign's "
                                  "account) does not exist")
            # The content as the batch archived it when it was made, so an edit
            # of the message after the send changes no email still queued.
            sent_as = self.conn.execute(
                "SELECT subject, html, text, tracked, (SELECT count(*) FROM batch_link l "
                "WHERE l.batch = m.batch AND l.message = m.message) AS links "
                "FROM batch_message m WHERE batch = ? AND message = ?",
                (batch_id, message_id)).fetchone()
            sent_as = dict(sent_as) if sent_as else {
                **{name: message[name] for name in ("subject", "html", "text")}, "tracked": None}
            if not batch["tracking"]:
                sent_as["tracked"] = None
            elif sent_as["tracked"] is None and sent_as["html"]:
                # a batch made before version 5 kept only its links
                sent_as["tracked"], links = _track_html(sent_as["html"])
                sent_as["links"] = len(links)
            campaign = {"id": batch["campaign"], "owner": batch["owner"],
                        "accountprofile": batch["accountprofile"]}
            letter = _message_letter(self.conn, campaign, message, sent_as,
                                    batch["base_url"] or self.run.public_url, self.run.mail_from)
            self.letters[key] = letter
        return letter

    def prepared_letter(self, prepared_id):
        """The Letter of a prepared message (_prepared()): built as a batch's."""
        key = ("prepared", prepared_id)
        letter = self.letters.get(key)
        if letter is None:
            row = self.conn.execute(
                "SELECT p.*, (SELECT count(*) FROM prepared_link l WHERE l.prepared = p.id) "
                "AS links FROM prepared p WHERE p.id = ?", (prepared_id,)).fetchone()
            if row is None:
                raise LookupError(f"prepared message {prepared_id} does not exist")
            row = dict(row)
            row["base_url"] = row["base_url"] or self.run.public_url
            letter = self.letters[key] = _prepared_letter(row, self.run.mail_from)
        return letter

    def datasource_fields(self, datasource):
        fields = self.fields.get(datasource)
        if fields is None:
            fields = self.fields[datasource] = _datasource_fields(self.conn, datasource)
        return fields

    def build(self, row, recipients):
        """``(sender, email bytes)``, or None when the row must not be sent.

        A campaign email and an email of a prepared message are built the
        same way: the prepared Letter, the recipient's merge values (of the
        row's recipient, who must still be active and not suppressed, else
        of its merge_values), tracking tokens and the unsubscribe link that
        name this outbox email, its signed Message-ID and VERP sender."""
        if row["kind"] == "test":
            return self.build_test(row, recipients.get(row["recipient"]))
        if row["kind"] != "campaign" and row["prepared"] is None:
            # Ready-made: its sender, if any, is on the row (a sign-up's emails
            # go as the datasource's sender profile, a test send's as the campaign's).
            letter = _Letter(row["fromaddress"] or self.run.mail_from, row["subject"] or "",
                            row["body"] or "", row["html"] or "", from_name=row["fromname"] or "",
                            reply_to=row["replyto"] or "", templated=False)
            return letter.sender, letter.build(row["to_addr"])
        if row["prepared"] is not None:
            letter = self.prepared_letter(row["prepared"])
        else:
            letter = self.campaign_letter(row["batch"], row["message"])
        if row["recipient"] is None and row["prepared"] is not None:
            values = _merge_values(row["merge_values"], row["to_addr"])
        else:
            recipient = recipients.get(row["recipient"])
            if recipient is None or recipient["status"] != "active" or recipient["suppressed"]:
                return None
            values = _recipient_values(self.datasource_fields(recipient["datasource"]),
                                       recipient)
        if letter.links is not None:
            values.update(_tracking_values(self.run.secret, letter.base, row["id"], letter.links))
        # Signed with the outbox id, so that a bounce or complaint that comes
        # back later names this email: in the envelope sender (VERP, with a
        # bounce domain) and in the Message-ID that reports quote.
        sender, data = _recipient_email(
            letter, self.run.secret, row["to_addr"], values, row["recipient"],
            message_id=message_id_for(self.run.secret, row["id"], letter.domain), outbox=row["id"])
        if self.run.bounce_domain:
            sender = verp_address(self.run.secret, row["id"], self.run.bounce_domain)
        return sender, data

    def build_test(self, row, recipient):
        """A test send: its prepared message as its campaign sends it, with the
        merge values of ``recipient`` (None: blank fields, {{email}} the
        address).  The recipient's own unsubscribe link when the email goes
        to them; a tester's names the tester."""
        sent = {"subject": row["subject"] or "", "text": row["body"] or "",
                "html": row["html"] or ""}
        sender = {name: row[name] for name in ("fromname", "fromaddress", "replyto")}
        letter = _campaign_letter(sender, sent, row["campaign"], row["account"],
                                  row["base_url"] or self.run.public_url, self.run.mail_from)
        values = {"email": row["to_addr"]} if recipient is None else _recipient_values(
            self.datasource_fields(recipient["datasource"]), recipient)
        own = recipient is not None and recipient["email"] == row["to_addr"]
        return _recipient_email(letter, self.run.secret, row["to_addr"], values,
                               recipient["id"] if own else None)

    # The SMTP side.

    def connect(self):
        run = self.run
        try:
            smtp = smtplib.SMTP(run.host, run.port, timeout=run.timeout)
            try:
                smtp.ehlo()
                if run.starttls:
                    smtp.starttls(context=ssl.create_default_context())
                    smtp.ehlo()
                if run.username:
                    smtp.login(run.username, run.password or "")
            except BaseException:
                smtp.close()
                raise
        except (OSError, smtplib.SMTPException) as error:
            raise _Unreachable(f"cannot reach SMTP server {run.host}:{run.port}: {error}") from None
        self.smtp = smtp

    def hang_up(self, polite=True):
        """Close the connection; an email whose commands are written is not
        sent (no QUIT: the server reads it as the message's text)."""
        if self.smtp is not None:
            try:
                self.smtp.quit() if polite and self.offered is None else self.smtp.close()
            except (OSError, smtplib.SMTPException):
                self.smtp.close()
            self.smtp, self.offered = None, None

    def offers_utf8(self):
        """Whether the relay takes non-ASCII addresses (SMTPUTF8, RFC 6531)."""
        if self.smtp is None:
            self.connect()
        return self.smtp.has_extn("smtputf8")

    def pipelines(self):
        """Whether the relay takes commands ahead of their replies (PIPELINING)."""
        if self.smtp is None:
            self.connect()
        return self.smtp.does_esmtp and self.smtp.has_extn("pipelining")

    def offer(self, row_id, sender, to_addr):
        """Write the commands of outbox ``row_id``'s email ahead of send(),
        when the relay pipelines (_offered()): it reads them while the
        attempt is recorded.  _Unreachable when the connection is lost."""
        if self.offered == row_id or not self.pipelines():
            return
        try:
            self.smtp.send(_offered(sender, to_addr))
        except (OSError, smtplib.SMTPException) as error:
            self.hang_up(polite=False)
            raise _Unreachable(f"SMTP connection lost: {error}") from None
        self.offered = row_id

    def ahead(self, rows, recipients, ready):
        """The chunk's next email built now (into ``ready``), so that its
        commands go with this email's final dot: ``(outbox id, sender,
        to_addr)``, or None: no next row, a rate to keep (the pacer waits
        before each email), a relay that does not pipeline, or an email the
        normal way handles in its turn (it fails or is skipped)."""
        if not rows or self.run.rate or not self.pipelines():
            return None
        row = rows[0]
        try:
            built = self.build(row, recipients)
        except Exception:   # built again in its turn, and failed there with the reason
            return None
        if built is None or not (built[0].isascii() and row["to_addr"].isascii()):
            return None
        sender, data = built
        ready[row["id"]] = sender, self.run.sign(data) if self.run.sign else data
        return row["id"], sender, row["to_addr"]

    def send(self, row_id, sender, to_addr, data, then=None):
        """None when accepted, else ``(code, reply text)``; _Unreachable when
        the connection is lost.  ``then``: ``(row id, sender, to_addr)`` of
        the next email, whose commands go with this message's final dot."""
        if self.smtp is None:
            self.connect()
        offered, self.offered = self.offered == row_id, None
        ahead = b"" if then is None else _offered(*then[1:])
        try:
            answer, went = _transact(self.smtp, sender, to_addr, data, offered, ahead)
        except (OSError, smtplib.SMTPException) as error:
            self.hang_up(polite=False)
            raise _Unreachable(f"SMTP connection lost: {error}") from None
        if went:
            self.offered = then[0]
        if answer is None:
            return None
        code, reply = answer
        reply = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
        if code == 530:  # a configuration problem, not this email's: keep the queue
            self.hang_up(polite=False)
            raise _Unreachable(f"the SMTP server wants a login: {code} {reply}")
        if code == 421:  # the server is closing this connection
            self.hang_up(polite=False)
        return code, reply

    # One connection's share of the run.

    def deliver(self):
        run = self.run
        try:
            while not run.stop.is_set():
                rows = self.claim()
                if not rows or self.deliver_chunk(rows):
                    return  # done, or the server is unreachable: leave the rest queued
        finally:
            self.hang_up()
            self.conn.close()

    def deliver_chunk(self, rows):
        """Send claimed rows one by one; each outcome is written before the
        next SMTP attempt.  Returns the error when the server is unreachable."""
        run, results, bounces = self.run, [], []
        counts = dict.fromkeys(_COUNTS, 0)
        recipients = self.recipients(rows)
        unreachable = None
        ready = {}   # outbox id -> (sender, email bytes) of the next email, built ahead
        accepted, fresh = [], []   # sent, their status not written yet (record())

        def outcome(row, counted, status, attempts, next_try=None, error=None, sent=None):
            result = (status, attempts, next_try, error, sent, row["id"])
            for written in (accepted, fresh) if counted == "sent" else (results,):
                written.append(result)
            counts[counted] += 1
            if counted != "sent" and row["kind"] in _WARMUP_KINDS:   # admitted, not sent
                self.unsent[row["kind"] in _BULK_KINDS] += 1

        rows, looked = collections.deque(rows), time.monotonic()
        while rows:
            if time.monotonic() - looked >= _PRIORITY_LOOK and not unreachable:
                # A transactional email queued meanwhile goes before the rest
                # of the chunk (which may be a minute's work under a rate).
                looked, first = time.monotonic(), self.claim(first=True)
                recipients.update(self.recipients(first))
                # After the email whose commands are on the wire already.
                offered = [rows.popleft()] if rows and rows[0]["id"] == self.offered else []
                rows.extendleft(reversed(offered + first))
            row = rows.popleft()
            attempts = row["attempts"] + 1
            if unreachable or run.stop.is_set():
                # Not tried: back to the queue as it was (later if the server is down).
                outcome(row, "requeued", "queued", row["attempts"],
                        unreachable and _shift(_now(), _CONNECTION_RETRY), unreachable)
                continue
            built = ready.pop(row["id"], None)
            if built is None:
                try:
                    built = self.build(row, recipients)
                except Exception as error:  # bad data in this row must not stop the others
                    _log.exception("outbox %s cannot be built", row["id"])
                    outcome(row, "failed", "failed", attempts,
                            error=f"cannot build the email: {error}")
                    continue
                if built is None:
                    outcome(row, "skipped", "skipped", row["attempts"],
                            error="the recipient unsubscribed, bounced or was removed")
                    continue
                built = built[0], run.sign(built[1]) if run.sign else built[1]
            sender, data = built
            run.pacer.wait(run.stop)
            try:
                if not (sender.isascii() and row["to_addr"].isascii()) and not self.offers_utf8():
                    outcome(row, "failed", "failed", attempts, error="the address has non-ASCII "
                            "characters, and the SMTP relay does not offer SMTPUTF8 to carry them")
                    continue
                # The commands go out before the attempt is recorded (unless
                # they went with the email before), and the next email is
                # built: the relay reads them meanwhile.  Nothing is delivered
                # before the message's final dot, which goes after the record.
                self.offer(row["id"], sender, row["to_addr"])
                then = self.ahead(rows, recipients, ready)
                try:
                    mine = self.record(results, bounces, row["id"], accepted, fresh)
                except BaseException:
                    self.hang_up(polite=False)   # ends an offered transaction unsent
                    raise
                if not mine:
                    if self.offered is not None:
                        self.hang_up(polite=False)
                    _log.warning("outbox %s: this worker's claim ran out and was taken back; "
                                "left to the others", row["id"])
                    continue
                reply = self.send(row["id"], sender, row["to_addr"], data, then)
            except _Unreachable as error:
                unreachable = str(error)
                outcome(row, "requeued", "queued", row["attempts"],
                        _shift(_now(), _CONNECTION_RETRY), unreachable)
                continue
            tally = self.tally.setdefault(_rate_domain(row["to_addr"]), [0, 0, False])
            if reply is None:
                tally[0] += 1
                outcome(row, "sent", "sent", attempts, sent=_now())
                continue
            code, text = reply
            error = f"{code} {text}"
            if 400 <= code < 500:   # a deferral; "slow down" halves the domain's rate
                tally[1] += 1
                tally[2] = tally[2] or _slows_down(code, text)
            if 400 <= code < 500 and attempts < run.max_attempts:
                delay = min(_RETRY_BASE * 2 ** row["attempts"], _RETRY_CAP)
                outcome(row, "retried", "queued", attempts, _shift(_now(), delay), error)
                continue
            outcome(row, "failed", "failed", attempts, error=error)
            tracked = row["kind"] == "campaign" or row["prepared"] is not None
            if tracked and code >= 500 and text.startswith("5.1."):
                # A hard bounce: the mailbox does not exist.
                bounces.append({"type": "hard", "outbox": row["id"]})
                counts["bounced"] += 1
            elif tracked and code < 500:
                # Given up on a temporary failure: a soft bounce of this email.
                bounces.append({"type": "soft", "outbox": row["id"]})
        self.record(results, bounces, None, accepted, fresh)
        run.add(counts, unreachable)
        return unreachable


#: Seconds between a courier's looks, within a chunk, for rows of a higher
#: priority (transactional emails) queued since it claimed the chunk.
_PRIORITY_LOOK = 0.2
#: Sent emails whose status a courier writes at once (see _Courier.record()).
_SENT_GROUP = 100


def _take_back(conn, now, stale_claim):
    """Inside a transaction: the rows of leases not renewed since ``now -
    stale_claim`` (dead workers) go back to the queue, except one the server
    accepted (marked with its sent time, _Courier.record()): it is sent; and
    one whose SMTP attempt had started: it may have arrived, so it is failed
    (at most once)."""
    stale = (datetime.datetime.strptime(now, "%Y-%m-%d %H:%M:%S") - stale_claim
             ).strftime("%Y-%m-%d %H:%M:%S")
    conn.execute("UPDATE outbox SET status = 'sent', attempts = attempts + 1, error = NULL, "
                 "claimed_by = NULL, claimed_at = NULL, attempt_started = NULL "
                 "WHERE status = 'sending' AND claimed_at < ? AND sent IS NOT NULL", (stale,))
    conn.execute("UPDATE outbox SET status = 'failed', error = ?, claimed_by = NULL, "
                 "claimed_at = NULL, attempt_started = NULL WHERE status = 'sending' "
                 "AND claimed_at < ? AND attempt_started IS NOT NULL", (_INTERRUPTED, stale))
    conn.execute("UPDATE outbox SET status = 'queued', claimed_by = NULL, "
                 "claimed_at = NULL WHERE status = 'sending' AND claimed_at < ?", (stale,))


def _smtp_address(smtp):
    """``(host, port)`` of a ``"host:port"`` setting ("[::1]:25" for IPv6)."""
    return _server_address(smtp, "the SMTP server")


class _Run:
    """What the connections of one deliver() call share."""

    def __init__(self, db, address, *, starttls, username, password, rate, chunk, worker_id,
                 sign, public_url, mail_from, secret, max_attempts, timeout, now, stop,
                 on_event=None, bounce_domain="", stale_claim=_STALE_CLAIM, pace=None):
        self.db = db
        self.pace = pace or _Pace()
        self.host, self.port = address
        self.starttls, self.username, self.password = starttls, username, password
        self.rate, self.chunk, self.worker_id, self.sign = rate, chunk, worker_id, sign
        self.public_url, self.mail_from, self.secret = public_url, mail_from, secret
        self.max_attempts, self.timeout, self.now, self.stop = max_attempts, timeout, now, stop
        self.on_event = on_event
        self.bounce_domain = bounce_domain
        self.stale_claim = stale_claim
        self.pacer = _RateLimit(rate)
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(_COUNTS, 0)
        self.error = None
        self.reported = dict(self.counts)
        self.next_report = time.monotonic() + _PROGRESS_INTERVAL

    def add(self, counts, error):
        with self.lock:
            for name, value in counts.items():
                self.counts[name] += value
            self.error = error or self.error
            if time.monotonic() >= self.next_report:
                self.report()

    def report(self):
        """Log progress of a long delivery: what this interval did, and the totals."""
        done = {name: self.counts[name] - self.reported[name] for name in self.counts}
        self.reported, self.next_report = dict(self.counts), time.monotonic() + _PROGRESS_INTERVAL
        conn = connect(self.db)
        try:
            queued = conn.execute("SELECT count(*) FROM outbox WHERE status IN "
                                  "('queued', 'sending')").fetchone()[0]
        finally:
            conn.close()
        _log.info("delivery progress: %s sent, %s failed, %s retried in the last %ss; "
                 "%s sent and %s failed in all; %s still queued", done["sent"], done["failed"],
                 done["retried"], _PROGRESS_INTERVAL, self.counts["sent"], self.counts["failed"],
                 queued)


def deliver(db, smtp="localhost:25", *, starttls=False, username=None, password=None,
            connections=1, rate=None, batch_size=100, worker_id=None, dkim=None, public_url="",
            mail_from=None, secret=None, max_attempts=_MAX_ATTEMPTS, timeout=60, now=None,
            stop=None, stale_claim=_STALE_CLAIM, on_event=None, bounce_domain="",
            domain_rates=None, warmup=(), warmup_start=""):
    """Send the outbox rows that are due over SMTP; returns counts.

    Each row is claimed in a short transaction before it is sent, so workers
    running side by side never send the same row; a claim is a lease the
    worker renews as it goes, and one not renewed for ``stale_claim`` (a
    worker that died) is taken back.  Each outcome is
    written before the next SMTP attempt starts, so of a dead worker's rows
    only the one it was sending is in doubt: that one is failed, never sent
    twice; the others are queued again.  A 4xx reply queues the
    row again with backoff until ``max_attempts``; a 5xx reply fails it, and
    a ``5.1.x`` reply to a campaign email marks the address bounced for the
    account; a campaign email given up on after 4xx replies is a soft bounce
    (apply_bounce()).  Campaign emails are rendered here, from the message and the
    recipient; notifications carry their own subject and body.

    :param db: the database path.
    :param smtp: ``"host:port"`` of the relay.
    :param starttls: upgrade the connection with STARTTLS (certificate checked).
    :param username: log in with this user (and ``password``).
    :param connections: parallel SMTP connections (threads), each reused.
    :param rate: at most this many emails a second over all connections; None: no limit.
    :param batch_size: rows claimed at a time by one connection.
    :param worker_id: names this worker in the claims; default host:pid.
    :param dkim: ``(domain, selector, private key PEM bytes)`` to sign with, or None.
    :param public_url: base of unsubscribe links when a batch has no base_url.
    :param mail_from: sender of notifications; default campaignapi@<hostname>.
    :param secret: the token secret; default the one stored in the database.
    :param now: deliver what is due at this time (a datetime or stored text); default: now.
    :param stop: a threading.Event; when set, unsent claimed rows go back to the queue.
    :param stale_claim: how long a lease must go unrenewed (a timedelta) before it
        counts as a dead worker's (live workers renew every _CLAIM_RENEW seconds).
    :param on_event: called with the ``recipient.bounced`` events of hard
        bounces after their commit (see emit()).
    :param bounce_domain: the setting ``bounce_domain``: campaign emails get the
        VERP envelope sender ``bounces+TOKEN@bounce_domain``.
    :param domain_rates: the setting ``domain_rates``: at most so many emails
        an interval to each receiving domain, counted with every worker of
        the database (see _Pace); ``warmup`` and ``warmup_start`` the daily caps.
    :returns: ``{"sent", "retried", "failed", "bounced", "skipped", "requeued": n, "error": str|None}``.
    """
    address = _smtp_address(smtp)
    pace = _Pace(domain_rates, warmup, warmup_start)
    conn = connect(db)
    try:
        if secret is None:
            secret = _stored_secret(conn)
        cutoff = _time_text(now) if now is not None else _now()
        stale = (datetime.datetime.strptime(cutoff, "%Y-%m-%d %H:%M:%S") - stale_claim
                 ).strftime("%Y-%m-%d %H:%M:%S")
        # Read first: an idle worker looks every second and should not take
        # the write lock each time.
        due, dead = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'queued' AND next_try <= ?), "
            "EXISTS (SELECT 1 FROM outbox WHERE status = 'sending' AND claimed_at < ?)",
            (cutoff, stale)).fetchone()
        if dead:
            with transaction(conn):
                _take_back(conn, cutoff, stale_claim)
    finally:
        conn.close()
    if not (due or dead):
        return {**dict.fromkeys(_COUNTS, 0), "error": None}
    # A lease is renewed as the chunk goes; still, claim about a minute's work.
    chunk = batch_size if not rate else max(1, min(batch_size, int(rate * 60 / connections)))
    run = _Run(
        db, address, starttls=starttls, username=username, password=password, rate=rate,
        chunk=chunk, worker_id=worker_id or f"{socket.gethostname()}:{os.getpid()}",
        sign=dkim_signer(*dkim) if dkim else None, public_url=public_url or "",
        mail_from=mail_from or _default_mail_from(), secret=secret, max_attempts=max_attempts,
        timeout=timeout, now=_time_text(now) if now is not None else None,
        stop=stop or threading.Event(), on_event=on_event, bounce_domain=bounce_domain,
        stale_claim=stale_claim, pace=pace)
    couriers = [_Courier(run) for _ in range(max(1, connections))]
    done = threading.Event()
    threading.Thread(target=_renew_leases, args=(run, done), daemon=True,
                     name="campaignapi-lease").start()
    try:
        _run_couriers(couriers)
    finally:
        done.set()
    return {**run.counts, "error": run.error}


def _renew_leases(run, done):
    """Every _CLAIM_RENEW seconds until ``done``: this worker's claims are
    renewed (one UPDATE over the few rows being sent).  A row a courier is
    writing at that moment is skipped, not waited for (on PostgreSQL waiting
    would deadlock with the courier's own transaction); it is renewed next time."""
    conn = None
    while not done.wait(_CLAIM_RENEW):
        try:
            conn = conn or connect(run.db)
            conn.execute("UPDATE outbox SET claimed_at = ? WHERE id IN (SELECT id FROM outbox "
                         "WHERE status = 'sending' AND claimed_by = ? "
                         f"{conn.sql['skip_locked']})", (_now(), run.worker_id))
        except Exception as error:   # a lost lease is refused before sending anyway
            _log.warning("renewing this worker's claims failed: %s", error)
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            conn = None
    if conn is not None:
        conn.close()


def _run_couriers(couriers):
    if len(couriers) == 1:
        couriers[0].deliver()
    else:
        failures = []

        def work(courier):
            try:
                courier.deliver()
            except BaseException as error:  # re-raised below, in the caller's thread
                failures.append(error)

        threads = [threading.Thread(target=work, args=(c,), name=f"campaignapi-smtp-{i}")
                   for i, c in enumerate(couriers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]


# ---------------------------------------------------------------------------
# Webhooks: the record kind, and the worker's delivery of stored events
# ---------------------------------------------------------------------------
#
# emit() stores each event with one hook_delivery row per webhook that wants
# it.  The worker posts them: only the oldest pending delivery of a webhook
# is ever claimed (in order per webhook), claims are leases (a dead worker's
# come back after _HOOK_LEASE), and every try of one delivery sends the same
# webhook-id and body, signed afresh with the time of the try.

#: Seconds one POST may take, DNS and connecting included.
_HOOK_TIMEOUT = 10.0
#: A claim older than this is a dead worker's: the delivery is taken back.
#: Much longer than a live worker holds one (one round of posts, _HOOK_TIMEOUT).
_HOOK_LEASE = datetime.timedelta(seconds=60)
#: After a failed try: again _HOOK_RETRY_BASE * 2**(tries - 1) seconds later,
#: at most _HOOK_RETRY_CAP apart, until _HOOK_GIVE_UP after the event; then failed.
_HOOK_RETRY_BASE, _HOOK_RETRY_CAP = 30, 3600
_HOOK_GIVE_UP = datetime.timedelta(hours=24)
#: Deliveries posted at once (to different webhooks) by one deliver_webhooks().
_HOOK_CONNECTIONS = 8

_HOOK_COUNTS = ("delivered", "retried", "failed")


def _webhook_record(call, row):
    return {"id": str(row["id"]), "owner": str(row["owner"]), "url": row["url"],
            "events": json.loads(row["events"]), "enabled": str(row["enabled"]),
            "lastattempt": row["lastattempt"], "lasterror": row["lasterror"],
            "failures": str(row["failures"]), "created": row["created"],
            "deleted": str(row["deleted"])}


def _webhook_values(call, row):
    """The columns of a create or change; a new webhook gets its secret."""
    values = _columns(call, ("enabled",))
    if "url" in call.params:
        # The DNS lookup runs in the request's transaction: bounded, and short.
        try:
            _check_webhook_url(call.params["url"], timeout=5.0,
                              allow_private=call.service.config["webhook_allow_private"])
        except _UnresolvedHost as error:   # the request may be right; the DNS says no
            raise Conflict(str(error), field="url") from None
        except ValueError as error:
            raise InvalidParameter(str(error), field="url") from None
        values["url"] = call.params["url"]
    if "events" in call.params:
        events = call.params["events"]
        unknown = [kind for kind in events if kind not in EVENT_KINDS]
        if unknown:
            raise InvalidParameter(
                f"'events' lists kinds that do not exist: {_to_json(unknown[:5])[1:-1]}; "
                f"leave it empty for every kind.", field="events", allowed=list(EVENT_KINDS))
        values["events"] = _to_json(list(dict.fromkeys(events)))
    if row is None:
        values["secret"] = _new_webhook_secret()
    return values


def _webhook_secret(call, webhook_id):
    # Create answers the signing secret, once; no record ever shows it again.
    return {"secret": call.conn.execute("SELECT secret FROM webhook WHERE id = ?",
                                        (webhook_id,)).fetchone()[0]}


def _abandon_deliveries(call, row):
    """A deleted webhook is called no more: its pending deliveries fail."""
    call.conn.execute(
        "UPDATE hook_delivery SET status = 'failed', error = 'the webhook was deleted', "
        "finished = ?, claimed_by = NULL, claimed_at = NULL "
        "WHERE webhook = ? AND status = 'pending'", (_now(), row["id"]))


def _any_case(text):
    """A regular expression that matches ``text`` in any ASCII case (JSON
    Schema patterns take no flags)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in text)


_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#: The IPv4 literals that _address_problem() refuses without
#: webhook_allow_private, by their leading octets (tests/test_openapi.py
#: checks each against it).
_PRIVATE_IPV4 = (("0",), ("10",), ("127",), ("169", "254"), ("172", "(1[6-9]|2[0-9]|3[01])"),
                 ("192", "168"), ("100", "(6[4-9]|[7-9][0-9]|1[01][0-9]|12[0-7])"),
                 ("(22[4-9]|2[3-5][0-9])",), ("192", "0", "2"), ("198", "1[89]"),
                 ("198", "51", "100"), ("203", "0", "113"))
#: ... and the IPv6 ones: ::, ::1, and fc00::/7, fe80::/10, fec0::/10, ff00::/8.
_PRIVATE_IPV6 = r"::1?|[fF][c-fC-F][0-9a-fA-F]{2}:[^\]]*"


def _webhook_url_schema(allow_private=False):
    """The JSON schema of a webhook's ``url`` as the server takes it: http or
    https, a host, no user name; and, under ``not``, the URLs whose host is
    itself an address a webhook may not call (a literal address, or
    localhost).  A name that resolves to such an address is refused the same
    way, but only DNS knows which names do.

    :param allow_private: the setting ``webhook_allow_private``: only the
        cloud metadata addresses are refused.
    """
    hosts = [re.escape(str(ip)) + r"\.?" if ip.version == 4 else r"\[" + _any_case(str(ip)) + r"\]"
             for ip in sorted(_METADATA_ADDRESSES, key=str)]
    if not allow_private:
        hosts += [_any_case("localhost") + r"\.?", r"\[(" + _PRIVATE_IPV6 + r")\]"]
        hosts += [r"\.".join([*octets, *[_OCTET] * (4 - len(octets))]) + r"\.?"
                  for octets in _PRIVATE_IPV4]
    return {"format": "uri", "pattern": "^[hH][tT][tT][pP][sS]?://[^/?#@\\s]+([/?#][^\\s]*)?$",
            "not": {"pattern": "^[hH][tT][tT][pP][sS]?://(" + "|".join(hosts)
                               + ")(:[0-9]*)?([/?#]|$)"}}


WEBHOOK = Resource(
    "webhook", "webhook", _webhook_record, columns="url:str events:list enabled:flag",
    required="url", values=_webhook_values, after_create=_webhook_secret,
    on_delete=_abandon_deliveries,
    select="id, owner, url, events, enabled, lastattempt, lasterror, failures, created, deleted",
    fields=_record_schema(
        "id owner url events enabled lastattempt lasterror failures created deleted",
        events={"type": "array", "items": {"type": "string", "enum": list(EVENT_KINDS)},
                "description": "the kinds it gets; empty: every kind"},
        enabled=_FLAG_ANSWER, deleted=_FLAG_ANSWER),
    doc={
        "url": ("Where events are POSTed: http or https. A URL whose host is, or resolves to, a "
                "loopback, private, link-local or reserved address is refused (400) unless the "
                "setting webhook_allow_private allows them, and a cloud metadata address always "
                "is; the schema's 'not' names the literal ones. A host that does not resolve is "
                "409.", "https://hooks.example.com/campaigns", _webhook_url_schema()),
        "events": ("The event kinds the webhook gets; empty: every kind.",
                   ["recipient.unsubscribed"], {"items": {"type": "string",
                                                          "enum": list(EVENT_KINDS)}}),
        "enabled": ("1: events are sent; 0: they wait (paused).", "1")})


def deliver_webhooks(db, *, allow_private=False, timeout=_HOOK_TIMEOUT, lease=_HOOK_LEASE,
                     connections=_HOOK_CONNECTIONS, now=None, worker_id=None, stop=None):
    """Post the stored events that are due to their webhooks; returns counts.

    Only the oldest pending delivery of each enabled webhook is claimed, so a
    webhook gets its events in the order they were raised, one at a time;
    those of different webhooks go out in parallel.  A claim is a lease: one
    older than ``lease`` belongs to a worker that died and is taken back (its
    post may have arrived: delivery is at least once, and receivers tell a
    repeat by its ``webhook-id``).  A 2xx answer delivers; anything else
    (another status, a redirect, no answer in time, a refused address) is
    tried again with the same id and body, 30 seconds later, doubling up to an
    hour apart, until 24 hours after the event; then the delivery fails and
    counts in the webhook's ``failures``.  Every try sets the webhook's
    ``lastattempt`` and ``lasterror``.

    :param db: the database path.
    :param allow_private: the setting ``webhook_allow_private``.
    :param timeout: seconds one post may take (less than ``lease``).
    :param lease: how old a claim must be (a timedelta) to count as a dead worker's.
    :param connections: deliveries posted at once (to different webhooks).
    :param now: deliver what is due at this time (a datetime or stored text),
        and count the retry schedule from it; default: now.
    :param worker_id: names this worker in its claims; default host:pid:random.
    :param stop: a threading.Event; when set, no further round is claimed.
    :returns: ``{"delivered", "retried", "failed": n}``.
    """
    if timeout >= lease.total_seconds():
        raise ValueError("the lease must be longer than the timeout of one post")
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    counts = dict.fromkeys(_HOOK_COUNTS, 0)
    conn = connect(db)
    try:
        with concurrent.futures.ThreadPoolExecutor(
                max(1, connections), thread_name_prefix="campaignapi-webhook") as pool:
            while not (stop and stop.is_set()):
                attempted = _time_text(now)
                rows = _claim_deliveries(conn, worker_id, attempted, lease, max(1, connections))
                if not rows:
                    break
                answers = pool.map(lambda row: _post_event(row, allow_private, timeout), rows)
                _record_deliveries(conn, worker_id, attempted, zip(rows, answers), counts)
    finally:
        conn.close()
    return counts


def _claim_deliveries(conn, worker_id, due, lease, limit):
    """Claim up to ``limit`` due deliveries, each the oldest pending one of
    its webhook, with what posting them needs."""
    stale = (datetime.datetime.now(datetime.timezone.utc) - lease).strftime("%Y-%m-%d %H:%M:%S")
    claimable = (
        "SELECT d.id FROM hook_delivery d WHERE d.status = 'pending' AND d.next_try <= ? "
        "AND (d.claimed_at IS NULL OR d.claimed_at < ?) "
        "AND d.id = (SELECT min(e.id) FROM hook_delivery e "
        "            WHERE e.webhook = d.webhook AND e.status = 'pending') "
        "AND EXISTS (SELECT 1 FROM webhook w WHERE w.id = d.webhook "
        "            AND w.enabled = 1 AND w.deleted = 0) "
        "ORDER BY d.next_try, d.id LIMIT ?")
    # Read first: an idle worker looks every second and should not take the
    # write lock each time.
    if not conn.execute(claimable, (due, stale, 1)).fetchone():
        return []
    with transaction(conn):
        ids = [row[0] for row in conn.execute(f"{claimable} {conn.sql['skip_locked']}",
                                              (due, stale, limit)).fetchall()]
        if not ids:
            return []
        marks = ", ".join("?" for _ in ids)
        conn.execute(f"UPDATE hook_delivery SET claimed_by = ?, claimed_at = ? "
                     f"WHERE id IN ({marks})", (worker_id, _now(), *ids))
        return conn.execute(
            "SELECT d.id, d.attempts, d.created, d.event, e.payload, w.id AS webhook, w.url, "
            "w.secret FROM hook_delivery d JOIN hook_event e ON e.id = d.event "
            f"JOIN webhook w ON w.id = d.webhook WHERE d.id IN ({marks}) ORDER BY d.id",
            ids).fetchall()


def _post_event(row, allow_private, timeout):
    """One try: ``(status, error)`` as _post_webhook() answers."""
    body = row["payload"].encode("utf-8")
    try:
        headers = _sign_webhook(row["secret"], f"msg_{row['event']}", time.time(), body)
    except ValueError as error:    # a secret written into the database by hand
        return None, str(error)
    return _post_webhook(row["url"], headers, body, allow_private=allow_private, timeout=timeout)


def _record_deliveries(conn, worker_id, attempted, outcomes, counts):
    """Write the tries of one round: the deliveries and their webhooks."""
    with transaction(conn):
        for row, (_status, error) in outcomes:
            tries = row["attempts"] + 1
            deadline = _shift(row["created"], _HOOK_GIVE_UP.total_seconds())
            next_try = None
            if error is None:
                state = counted = "delivered"
            elif attempted >= deadline:
                state = counted = "failed"
            else:
                state, counted = "pending", "retried"
                delay = min(_HOOK_RETRY_BASE * 2 ** (tries - 1), _HOOK_RETRY_CAP)
                next_try = min(_shift(attempted, delay), deadline)
            # Only while the claim is still ours: a webhook deleted meanwhile
            # failed the delivery already.
            changed = conn.execute(
                "UPDATE hook_delivery SET status = ?, attempts = ?, "
                "next_try = coalesce(?, next_try), error = ?, finished = ?, claimed_by = NULL, "
                "claimed_at = NULL WHERE id = ? AND claimed_by = ? AND status = 'pending'",
                (state, tries, next_try, error, None if state == "pending" else attempted,
                 row["id"], worker_id)).rowcount
            if changed:
                conn.execute("UPDATE webhook SET lastattempt = ?, lasterror = ?, "
                             "failures = failures + ? WHERE id = ?",
                             (attempted, error, int(state == "failed"), row["webhook"]))
                counts[counted] += 1


# ---------------------------------------------------------------------------
# The worker: every kind of due work is one step in _WORKER_STEPS; each thread
# of the worker runs its steps again at once while they find work, else after
# its interval.
# ---------------------------------------------------------------------------

class _Worker:
    """The settings one run_worker() runs its steps with (see there)."""

    def __init__(self, db, stop_event, smtp, interval, on_event, webhook_allow_private,
                 templates_dir, bounce_mailbox, delivery):
        self.db, self.stop_event, self.smtp, self.interval = db, stop_event, smtp, interval
        self.on_event, self.webhook_allow_private = on_event, webhook_allow_private
        self.templates_dir, self.bounce_mailbox, self.delivery = \
            templates_dir, bounce_mailbox, delivery
        self.look = None   # the delivery thread's connection for outbox_due()

    def outbox_due(self):
        """Whether deliver() has work: a row due, or a claim a dead worker
        left.  One read on a connection the delivery thread keeps, so it may
        look every _PRIORITY_LOOK seconds (a transactional email waits no
        longer) at little cost."""
        stale = (datetime.datetime.now(datetime.timezone.utc)
                 - self.delivery.get("stale_claim", _STALE_CLAIM)).strftime("%Y-%m-%d %H:%M:%S")
        try:
            self.look = self.look or connect(self.db)
            return bool(self.look.execute(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE status = 'queued' AND next_try <= ?) "
                "OR EXISTS (SELECT 1 FROM outbox WHERE status = 'sending' AND claimed_at < ?)",
                (_now(), stale)).fetchone()[0])
        except Exception:   # a lost connection: deliver() looks (and reports) itself
            with contextlib.suppress(Exception):
                self.look.close()
            self.look = None
            return True


def _make_due_batches(worker):
    return process_due(worker.db, on_event=worker.on_event,
                       templates_dir=worker.templates_dir) > 0


def _purge_unconfirmed(worker):
    # A bounded delete per round.
    return _remove_unconfirmed(worker.db) > 0


def _purge_keys(worker):
    return _purge_idempotency_keys(worker.db) > 0


def _deliver_events(worker):
    counts = deliver_webhooks(worker.db, allow_private=worker.webhook_allow_private,
                              stop=worker.stop_event)
    if any(counts.values()):
        _log.info("webhooks: %s", ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    return any(counts.values())


def _deliver_outbox(worker):
    if not worker.outbox_due():
        return False
    counts = deliver(worker.db, worker.smtp, stop=worker.stop_event, on_event=worker.on_event,
                     **worker.delivery)
    if any(counts[name] for name in ("sent", "retried", "failed", "skipped")):
        _log.info("delivered: %s", ", ".join(f"{v} {k}" for k, v in counts.items()
                                            if v and k != "error"))
    if counts["error"]:
        raise ConnectionError(counts["error"])
    return counts["sent"] + counts["failed"] + counts["retried"] > 0


#: Seconds between the worker's looks for field indexes to make or drop.
_INDEX_INTERVAL = 10


def _index_fields(worker):
    return _index_conditioned_fields(worker.db) > 0


def _advance_automations(worker):
    return advance_runs(worker.db, on_event=worker.on_event,
                        templates_dir=worker.templates_dir) > 0


def _automation_dates(worker):
    return check_dates(worker.db, on_event=worker.on_event) > 0


def _fetch_bounces(worker):
    try:
        process_bounce_mailbox(worker.db, **worker.bounce_mailbox)
    except MailboxError as error:   # a line, not a traceback, each minute it lasts
        _log.warning("bounce mailbox: %s", error)
    return False


class _Step:
    """One kind of due work of the worker.

    :param thread: the worker thread that runs it (named ``campaignapi-<thread>``):
        the steps of one thread run in list order each round, and the round
        found work when one of them did.
    :param run: ``run(worker)`` does one round of the work; true when it found some.
    :param needs: the run_worker() setting without which the step is left out.
    :param every: seconds between rounds when idle; None: the worker's
        interval.  The first step of a thread sets it for the thread.
    """

    def __init__(self, thread, run, needs=None, every=None):
        self.thread, self.run, self.needs, self.every = thread, run, needs, every


#: The worker's due work: a new kind of due work is one more entry.  Threads
#: start in the order they first appear.
_WORKER_STEPS = (
    _Step("batches", _make_due_batches),
    _Step("batches", _purge_unconfirmed),   # sign-ups never confirmed expire
    _Step("batches", _purge_keys),   # Idempotency-Key answers expire after 24 hours
    _Step("webhooks", _deliver_events),
    # Indexes of the fields segment conditions compare: made (one a round)
    # and dropped in a thread of their own, as making one takes a while.
    _Step("indexes", _index_fields, every=_INDEX_INTERVAL),
    _Step("delivery", _deliver_outbox, needs="smtp", every=_PRIORITY_LOOK),
    _Step("bounces", _fetch_bounces, needs="bounce_mailbox", every=_MAILBOX_INTERVAL),
    _Step("automations", _advance_automations),
    _Step("automations", _automation_dates),   # evaluated hourly; at once when enabled
)


def _repeat(stop, interval, step, name):
    """Run ``step()`` until ``stop`` is set: again at once while it reports
    work, else after ``interval`` seconds (longer after failures)."""
    failures = 0
    while not stop.is_set():
        try:
            busy = step()
            failures = 0
        except Exception as error:
            failures += 1
            busy = False
            if isinstance(error, OSError):
                _log.warning("%s: %s", name, error)
            else:
                _log.exception("%s failed", name)
        if not busy:
            stop.wait(min(interval * 2 ** min(failures, 6), 60.0))


def _one_round(worker, steps):
    """A thread's round: every step runs (none is skipped because an earlier
    one found work); true when one of them found work."""
    return any([step.run(worker) for step in steps])


def run_worker(db, stop_event, smtp=None, *, interval=1.0, on_event=None,
               webhook_allow_private=False, templates_dir="", bounce_mailbox=None, **delivery):
    """The background work, until ``stop_event`` is set: the steps of
    _WORKER_STEPS, each thread of them on its own: make due batches
    (process_due) and expire unconfirmed sign-ups, post stored events to
    webhooks (deliver_webhooks) and, when ``smtp`` is given, deliver the
    outbox (deliver() with ``delivery`` options).  Without SMTP the outbox
    fills and waits.

    :param interval: seconds between looks for due work when idle.
    :param on_event: the application's callback for the events the worker
        raises (batch.started, batch.sent, recipient.bounced), called after
        their commit.  Only a worker thread in the application's own process
        can call it: a worker started as its own process (``campaignapi.py
        worker``) has no callback, and services learn of those events by webhook.
    :param webhook_allow_private: the setting of that name.
    :param templates_dir: where template files named by defaulttemplate are.
    :param bounce_mailbox: process_bounce_mailbox() keyword arguments
        (``imap``, ``user``, ``password``, ...): the mailbox is read every
        _MAILBOX_INTERVAL seconds.
    """
    conn = connect(db)
    try:
        _fail_interrupted_imports(conn)   # a start: imports a process died in
    finally:
        conn.close()
    worker = _Worker(db, stop_event, smtp, interval, on_event, webhook_allow_private,
                     templates_dir, bounce_mailbox, delivery)
    lanes = {}   # thread name -> its steps, in the order of _WORKER_STEPS
    for step in _WORKER_STEPS:
        if step.needs is None or getattr(worker, step.needs):
            lanes.setdefault(step.thread, []).append(step)
    threads = [threading.Thread(
        target=_repeat, args=(stop_event, steps[0].every or interval,
                              functools.partial(_one_round, worker, steps), name),
        name=f"campaignapi-{name}", daemon=True) for name, steps in lanes.items()]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(0.5)
    if worker.look is not None:
        worker.look.close()
    _write_held_all()   # opens and clicks an app of this process holds: stored as it stops


# ---------------------------------------------------------------------------
# OpenAPI
# ---------------------------------------------------------------------------

_DIGITS = {"type": "string", "pattern": "^[0-9]+$"}



#: The records that the operations which are not CRUD answer, as JSON
#: schemas by name (a record kind's schema is its Resource's ``fields``).
_RECORD_SCHEMAS = {
    "preview": _record_schema(
        "campaign link recipient subject html text headers",
        headers={"type": "object", "additionalProperties": {"type": "string"}}),
    "structure": _record_schema(
        "id campaign segments",
        segments={"type": "array", "items": {"type": "object", "properties": {
            "segment": {"type": "string"}, "name": _STRING_OR_NULL,
            "priority": {"type": "string"}, "messages": _ID_LIST,
            "size": {"type": "string"},
            "overlap": {"type": "array", "items": {"type": "object", "properties": {
                "segment": {"type": "string"}, "shared": {"type": "string"}}}}}}}),
    "verify": _record_schema(
        "id campaign passed checks verified", passed=_FLAG_ANSWER,
        checks={"type": "array", "items": {"$ref": "#/components/schemas/check"}}),
    "deliverability": _record_schema(
        "id domains warmup", domains={"type": "array", "items": _record_schema(
            "domain rate configured sent_hour deferred_hour queued")},
        warmup=_record_schema("day cap sent_today")),
    "check": _record_schema("check passed message", check={"type": "string"},
                            passed=_FLAG_ANSWER, message={"type": "string"}),
    "archive": _record_schema("id campaign batches " + " ".join(_STATISTICS)
                              + " links timeline reporturl",
                              batches={"type": "array", "items": _REPORTED_BATCH},
                              reporturl={"type": "string", "format": "uri"},
                              **_STATISTICS_SCHEMAS),
    "automationverify": _record_schema(
        "id automation passed checks verified", passed=_FLAG_ANSWER,
        checks={"type": "array", "items": {"$ref": "#/components/schemas/check"}}),
    "automationarchive": _record_schema(
        "id automation running finished stopped cancelled steps",
        **dict.fromkeys(("running", "finished", "stopped", "cancelled"), _COUNT),
        steps={"type": "array", "items": _record_schema(
            "step kind " + " ".join(_STEP_FIGURES), **dict.fromkeys(_STEP_FIGURES, _COUNT))}),
}

#: Success data of a webhook's create: its id and its signing secret, shown once.
_ANSWER_WEBHOOK = {"type": "object", "required": ["id", "secret"],
                   "properties": {**_ANSWER_ID["properties"],
                                  "secret": {"type": "string", "pattern": "^whsec_"}}}


def _record_schemas():
    """Every record's JSON schema by name: each kind's, and _RECORD_SCHEMAS."""
    return {**{kind.schema: kind.fields for kind in Resource.kinds.values() if kind.fields},
            **_RECORD_SCHEMAS}


_OPENAPI_VERBS = {"GET": "Get", "PUT": "Create", "POST": "Change", "DELETE": "Delete"}


#: What the parameter names mean that are no one record kind's (a kind's own
#: are in its Resource's ``doc``): those that several kinds share, paging,
#: and the parameters of the operations that are not CRUD; so a route added
#: to the table is described by the names it uses.  name -> (description,
#: example[, what the schema of its type needs besides, e.g. a list's
#: items]).  A name used with two meanings reads "word.name" first (the
#: route's last path word).
_PARAM_DOCS = {
    "limit": ("How many records a page holds, 1 to 1000 (default 100).", 50),
    "links": ("'1': also check that every link of every message answers (HEAD, then GET; "
              "under 400 within 5 seconds, at most 5 redirects).", "1"),
    "offset": ("How many records to skip before the page (default 0).", 0),
    "id": ("The record's id again, as in the path: a guard against deleting or "
           "changing the wrong record.", 1),
    "name": ("A name for people, shown in lists; one line.", "Spring newsletter"),
    "description": ("Free text about the record.", "Readers who signed up at the shop"),
    "new": ("The field's name after the change (may be its current name).", "town"),
    "type": ("The field's type after the change; stored values are converted, and "
             "the change is refused (422) when one does not convert.", "text"),
    "originalfile": ("The uploaded file's name, for people.", "people.csv"),
    "__uploadtype__": ("How __uploaddata__ is sent: csv (the CSV text), base64 (the CSV "
                       "file's bytes in base64) or json (an array of objects).", "csv"),
    "__uploaddata__": ("The upload: CSV text with a header row naming an email column "
                       "(email, e-mail or emailaddress); its base64; or an array of objects.",
                       "email,city\nann@example.com,Oslo\n"),
    "fromname": ("The sender's name shown to recipients.", "Example Shop"),
    "fromaddress": ("The sender's address ('' for none).", "news@example.com"),
    "replyto": ("Where replies go ('' for none).", "help@example.com"),
    "timestamp": ("When to send: Unix seconds or an RFC 3339 date-time (a time in the past "
                  "means now); 'YYYY-MM-DD HH:MM:SS' is taken as UTC.", 0),
    "test": ("A test send instead of a batch: 1 to 10 addresses that each get every campaign "
             "message now, subject prefixed [Test], rendered for the segment's first recipient. "
             "Only at send/0 (a test send makes no batch; another id answers 404), and "
             "without timestamp.",
             ["me@example.com"], {"items": {"type": "string", "format": "email"},
                                  "minItems": 1, "maxItems": 10}),
    "recipient": ("The recipient the preview is for: an id or an address of the segment "
                  "(default: its first recipient).", "ann@example.com"),
    "bounce.email": ("The address that bounced or complained.", "ann@example.com",
                     {"not": {"pattern": "^\\s*$"}}),
    "bounce.type": ("hard (the address does not exist), soft (a temporary failure; the third "
                    "in a row counts as hard) or complaint (marked as spam).", "hard"),
    "bounce.campaign": ("The campaign that mailed the address, when known.", 1),
    "bounce.reason": ("Why, in words (kept in the log only).", "550 5.1.1 no such user"),
    "winner.link": ("The campaign message (link) whose A/B test is chosen.", 1),
    "winner.message": ("The winner: the link's message or one of its variants.", 2),
}


def _param_doc(route, name):
    """(description, example, extra schema) of a parameter of ``route``: its
    record kind's (or that of the kind its path ends with), else _PARAM_DOCS'."""
    word = [word for word in route.path.split("/") if word and "{" not in word][-1]
    kind = route.kind or Resource.kinds.get(word)   # a hand-written route of a kind's word
    doc = (kind.doc.get(name) if kind else None) \
        or _PARAM_DOCS.get(f"{word}.{name}") or _PARAM_DOCS.get(name)
    if doc is None:     # tests/test_openapi.py asks for one; the document still serves
        return "", None, {}
    description, example, *extra = doc
    return description, example, (extra or [{}])[0]


_INTEGER = {"type": "integer", "minimum": 0, "maximum": MAX_ID}
_FLAG_WORDS = ["0", "1", "true", "false"]
# An address as the server takes it (_param_email): surrounding blanks are
# trimmed, and blank means none.
_EMAIL_PATTERN = (r"^[^\S\r\n]*(?:(?=[^@]{1,64}@)(?=[^\s]{1,254}[^\S\r\n]*$)"
                  + _EMAIL_ATOM + r"(?:\." + _EMAIL_ATOM + r")*@"
                  + _EMAIL_LABEL + r"(?:\." + _EMAIL_LABEL + r")+)?[^\S\r\n]*$")

#: The schema of each parameter type: (in the query string, in a JSON body).
_PARAM_SCHEMAS = {
    "str": ({"type": "string", "pattern": "^[^\\r\\n\\x00]*$"},) * 2,
    "text": ({"type": "string", "pattern": "^[^\\x00]*$"},) * 2,
    "int": (_INTEGER, {"anyOf": [_INTEGER, {"type": "string", "pattern": "^[0-9]{1,18}$"}]}),
    "limit": ({"type": "integer", "minimum": 1, "maximum": _PAGE_MAX},
              {"anyOf": [{"type": "integer", "minimum": 1, "maximum": _PAGE_MAX},
                         {"type": "string", "pattern": "^0*([1-9][0-9]{0,2}|1000)$"}]}),
    "flag": ({"type": "string", "enum": _FLAG_WORDS},
             {"anyOf": [{"type": "boolean"}, {"type": "string", "enum": _FLAG_WORDS},
                        {"type": "integer", "enum": [0, 1]}]}),
    "email": ({"type": "string", "pattern": _EMAIL_PATTERN},) * 2,
    "list": ({"type": "array"},) * 2,
    "data": ({"type": "string"}, {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "object", "additionalProperties": True}}]}),
    "scalar": ({"type": "string", "pattern": "^[^\\r\\n\\x00]*$"},
               {"anyOf": [{"type": "string", "pattern": "^[^\\r\\n\\x00]*$"},
                          {"type": "number"}]}),
    "object": ({"type": "string"}, {"type": "object"}),
    "ref": ({"type": "string", "pattern": "^[0-9]{0,18}$"},
            {"anyOf": [_INTEGER, {"type": "string", "pattern": "^[0-9]{0,18}$"},
                       {"type": "null"}], "description": "an id, or '', null or 0 for none"}),
    "time": ({"type": "string"}, {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 253402300799},
        {"type": "string", "pattern": "^[0-9]{1,11}$"},
        {"type": "string", "format": "date-time"}]}),
}


def _param_schema(route, param, in_query, allow_private=False):
    description, example, extra = _param_doc(route, param.name)
    if param.name == "url" and allow_private:   # what a webhook may call is a setting
        extra = {**extra, **_webhook_url_schema(allow_private)}
    if param.choices is not None:
        schema = {"type": "string", "enum": list(param.choices)}
    else:
        schema = dict(_PARAM_SCHEMAS[param.type][0 if in_query else 1])
    return {**schema, **extra, **({"description": description} if description else {})}, example


def _id_parameter(name, allowed, creates=False):
    """A path placeholder as an OpenAPI parameter: what its segment accepts
    (``creates``: the id a create makes its record at, MAX_EXPLICIT_ID at most)."""
    if "name" in allowed:
        schema, text, example = {"type": "string", "minLength": 1}, "an id or a name", "city"
    else:
        words = [word for word in allowed if word != "int"]
        digits = "[0-9]{1,15}" if creates else "[0-9]{1,18}"   # 10^15 - 1 < MAX_EXPLICIT_ID
        choices = ([digits] if "int" in allowed else []) + [re.escape(w) for w in words]
        schema = {"type": "string", "pattern": "^(" + "|".join(choices) + ")$"}
        integer = (f"an integer id up to {MAX_EXPLICIT_ID}, or 0 for the next free id" if creates
                   else "an integer id")
        text = " or ".join(([integer] if "int" in allowed else [])
                           + [f"'{word}'" for word in words])
        example = "1" if "int" in allowed else words[0]
    return {"name": name, "in": "path", "required": True, "schema": schema,
            "description": text, "example": example}


def _error_codes():
    """``{status: [codes]}`` of every ApiError class."""
    codes, classes = {}, [ApiError]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        codes.setdefault(cls.status, set()).add(cls.code)
    return {status: sorted(found) for status, found in sorted(codes.items())}


def _route_statuses(route):
    """The error statuses a route can answer, from what the pipeline does for it."""
    statuses = {400, 413, 415, 500}     # parameters and body are read on every route
    if route.method in _KEYED_METHODS:
        statuses |= {409, 422}          # a key still running, or used for another request
    if route.level:
        statuses |= {401, 403}
    if route.ids:
        statuses.add(404)
    if route.writes or route.changes:
        statuses |= {409, 422}
    if route.handler is _signup_post:
        statuses.add(429)           # the sign-ups of one client a minute
    return sorted(statuses | set(route.errors))


def _success_data(route):
    """The JSON schema of ``data`` when ``route`` succeeds."""
    answers, schemas = route.answers, _record_schemas()
    literal = [part for part in route.path.split("/") if part and not part.startswith("{")]
    if answers is None and route.method == "GET" and literal and literal[-1] in schemas:
        answers = literal[-1]       # GET /.../{kind}/{id} answers that kind's records
    if isinstance(answers, dict):
        return answers
    # (key, kind) where the answer's key is not the kind's schema name
    # (campaign messages answer under "message").
    key, answers = answers if isinstance(answers, tuple) else (answers, answers)
    if answers not in schemas:
        # tests/test_openapi.py asks every route of ROUTES to say (answers=).
        return {"description": "Not described yet."}
    record = {"$ref": f"#/components/schemas/{answers}"}
    one = {"type": "object", "required": [key], "properties": {key: record}}
    if not any(set(allowed) - {"int", "name"} for allowed in route.ids.values()):
        return one
    page = _records_answer(key, answers)
    page["required"] = [key, "total", "limit", "offset"]
    return {"oneOf": [one, page]}


def _envelope_schema(success, data):
    return {"type": "object", "required": ["responseId", "version", "success", "data"],
            "properties": {"responseId": {"type": "string"},
                           "version": {"type": "integer", "enum": [1]},
                           "success": {"type": "boolean", "enum": [success]}, "data": data}}


def _operation(route, allow_private=False):
    levels = f"an API key with the '{route.level}' level" if route.level else "no API key"
    literal = [part for part in route.path.split("/") if part and not part.startswith("{")]
    verb = _OPENAPI_VERBS.get(route.method, route.method)
    in_query = route.method in ("GET", "DELETE")
    notes = [f"Needs {levels}."]
    if route.changes and route.method == "GET":
        notes.append("This GET changes data (as the original service did): do not prefetch it.")
    parameters = [_id_parameter(name, allowed, name == route.created)
                  for name, allowed in route.ids.items()]
    body, example = {}, {}
    for param in route.params.values():
        schema, example[param.name] = _param_schema(route, param, in_query, allow_private)
        if in_query:
            parameters.append({"name": param.name, "in": "query", "required": param.required,
                               "schema": schema, **({"example": example[param.name]}
                                                    if example[param.name] is not None else {})})
        else:
            body[param.name] = schema
    operation = {
        "operationId": re.sub(r"\W+", "_", "_".join([verb, *(literal or ["index"])])).lower(),
        "summary": route.summary or f"{verb} {' '.join(literal)}",
        "tags": literal[:1] or ["index"],
        "description": " ".join(notes),
        "x-access-level": route.level,
        "x-changes-data": route.changes,
        "security": [{"bearer": []}] if route.level else [],
        "parameters": parameters,
    }
    if route.body:   # a route that reads its own body describes it
        operation["requestBody"] = route.body
    elif body:
        required = [p.name for p in route.params.values() if p.required]
        schema = {"type": "object", "additionalProperties": False, "properties": body,
                  **route.body_rules}
        if required:
            schema["required"] = required
        operation["requestBody"] = {
            "required": bool(required or route.body_rules),
            "content": {"application/json": {"schema": schema, "example": example}}}
    if route.body and not route.params:
        operation["description"] += (" The values come in the body only, as the request "
                                     "body describes; unknown ones are refused.")
    elif not route.reads_body and not route.params:
        operation["description"] += (" Opened from a link: it takes no parameters and "
                                     "ignores the query string.")
    answered = "200"
    if isinstance(route.answers, dict) and ("content" in route.answers
                                            or "status" in route.answers):
        success = {name: value for name, value in route.answers.items() if name != "status"}
        answered = str(route.answers.get("status", 200))
    else:
        success = {"description": "Success: the envelope with the operation's data.",
                   "content": {"application/json": {"schema": _envelope_schema(
                       True, _success_data(route))}}}
    errors = {str(status): {"$ref": f"#/components/responses/{status}"}
              for status in _route_statuses(route)}
    if route.pages:   # a person gets a page, a JSON client the envelope
        success = {**success, "content": {**success.get("content", {}), **_PAGE_CONTENT}} \
            if "content" in success else success
        errors = {status: {"description": f"{bottle.HTTP_CODES.get(int(status), 'Error')}: "
                           "a page saying what is wrong (the envelope for a JSON client).",
                           "content": {**_PAGE_CONTENT, "application/json": {"schema": {
                               "$ref": f"#/components/schemas/error{status}"}}}}
                  for status in errors}
    if route.method in _KEYED_METHODS:
        operation["parameters"].append(_IDEMPOTENCY_HEADER)
        success = {**success, "headers": {**success.get("headers", {}), **_REPLAYED_HEADER}}
    operation["responses"] = {answered: success, **errors}
    return operation


_PAGE_CONTENT = {"text/html": {"schema": {"type": "string"}}}

#: The Idempotency-Key header as the document shows it.
_IDEMPOTENCY_HEADER = {
    "name": "Idempotency-Key", "in": "header", "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
    "description": "Do this request once (1 to 255 visible ASCII characters, e.g. a UUID): a "
                   "repeat with the same key, method, path and body within 24 hours gets the "
                   "first answer again (header Idempotent-Replayed: true) and changes nothing; "
                   "the key with another request is 422 idempotency_key_reused; a repeat while "
                   "the first still runs is 409 with Retry-After. Only 2xx answers are kept, so "
                   "a request that failed may be sent again with its key.",
    "example": "6c0b0a5e-reset-ann"}
_REPLAYED_HEADER = {"Idempotent-Replayed": {
    "description": "true: the answer kept for this request's Idempotency-Key, sent again.",
    "schema": {"type": "string", "enum": ["true"]}}}


#: The data of every error: a code, a sentence, and where it helps more.
_ERROR_SCHEMA = {"type": "object", "required": ["error", "message"], "properties": {
    "error": {"type": "string", "description": "the error code"},
    "message": {"type": "string", "description": "one sentence a person can act on"},
    "field": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
              "description": "the parameter (or the parameters) at fault"},
    "allowed": {"type": "array", "items": {"type": "string"},
                "description": "the values or parameters allowed"},
    "checks": {"type": "array", "items": {"$ref": "#/components/schemas/check"},
               "description": "verify's checks, on verification_failed"},
    "rows": {"type": "array", "items": {"type": "object", "additionalProperties": True},
             "description": "the first rows that fail, on invalid_data"}}}


def openapi_document(routes=None, base_url=None, allow_private=False):
    """The OpenAPI 3.1 document of the API, as a dict.

    Made from the route table (the one create_app() serves), so it lists every
    route with its placeholders, parameters, level and answers, and cannot
    drift from what the app does.

    :param routes: the route table; ROUTES (Route.table) when None.
    :param base_url: the API's root URL (without ``/v1``) for ``servers``.
    :param allow_private: the app's setting ``webhook_allow_private`` (it
        decides which webhook URLs are taken).
    """
    routes = Route.table if routes is None else routes
    paths, used = {}, set()
    for route in routes:
        path = "/v1" + Route._PLACEHOLDER.sub(r"{\1}", route.path)
        operation = _operation(route, allow_private)
        if operation["operationId"] in used:   # /archive/{ds} and /archive/{ds}/{batch}
            operation["operationId"] += "_" + list(route.ids)[-1].lower()
        used.add(operation["operationId"])
        paths.setdefault(path, {})[route.method.lower()] = operation
    responses, errors = {}, {}
    for status, codes in _error_codes().items():
        name = f"error{status}"
        errors[name] = _envelope_schema(False, {**_ERROR_SCHEMA, "properties": {
            **_ERROR_SCHEMA["properties"], "error": {"type": "string", "enum": codes}}})
        responses[str(status)] = {
            "description": f"{bottle.HTTP_CODES.get(status, 'Error')}: {', '.join(codes)}.",
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
    responses["401"]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    responses["405"]["headers"] = {"Allow": {"schema": {"type": "string"}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "campaignapi", "version": __version__,
                 "description": __doc__.split("\n\n")[1].replace("\n", " ") + " " + _OPENAPI_RULES},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "An API key's secret."}},
            "schemas": {"error": _ERROR_SCHEMA, **errors, **_record_schemas()},
            "responses": responses,
        },
        "security": [{"bearer": []}],
    }
    if base_url is not None:
        document["servers"] = [{"url": base_url or "/"}]
    return document


#: The rules every operation shares, at the head of the document.
_OPENAPI_RULES = (
    "Every answer is the envelope {responseId, version, success, data}; the same responseId "
    "is the X-Response-Id header. An error has success false, a real HTTP status, and data "
    "{error, message} with field, allowed, checks or rows where they help. Parameters: GET "
    "and DELETE take them in the query string, PUT and POST in a JSON object body "
    "(Content-Type: application/json); either place is accepted on every method (the body "
    "wins; each value given is checked). Unknown parameters are refused. A number or id may "
    "be a JSON number or a string of digits, a flag 0/1, '0'/'1', 'true'/'false' or a JSON "
    "boolean. Records answer every value as a string (or null). Ids are integers; create "
    "with PUT at id 0 for the next free id, or at a free id of your choice (a safe retry). "
    "A method that a path lacks answers 405 with an Allow header. A browser (Accept "
    "preferring text/html) gets the envelope in a small HTML page.")


def _openapi_get(call):
    """The OpenAPI document itself (not in an envelope, so tools can read it)."""
    service = call.service
    if getattr(service, "openapi", None) is None:   # made once per app
        service.openapi = openapi_document(
            service.routes, allow_private=service.config["webhook_allow_private"])
    document = {**service.openapi, "servers": [{"url": call.base_url or "/"}]}
    return bottle.HTTPResponse(json.dumps(document, ensure_ascii=False), 200, {
        "Content-Type": "application/json", "Access-Control-Allow-Origin": "*"})


_OPENAPI_ANSWER = {"description": "The OpenAPI 3.1 document of this API (no envelope).",
                   "content": {"application/json": {"schema": {
                       "type": "object", "additionalProperties": True}}}}
_FIELD_ANSWER = {"type": "object", "required": ["field"],
                 "properties": {"field": {"$ref": "#/components/schemas/field"}}}
#: An upload is text unless its type is json.
_TEXT_UNLESS_JSON = {
    "if": {"properties": {"__uploadtype__": {"enum": ["csv", "base64"]}}},
    "then": {"properties": {"__uploaddata__": {"type": "string"}}}}
#: A page a person reads (sign-up form, confirm page, unsubscribe); errors are pages too.
_PAGE_ANSWER = {"description": "An HTML page for the recipient.",
                "content": {"text/html": {"schema": {"type": "string"}}}}
#: A sign-up's answer: the same for every address (it reveals no one).
_SIGNUP_ANSWER = {"type": "object", "required": ["status"],
                  "properties": {"status": {"type": "string", "enum": ["pending", "subscribed"]}}}
_SIGNUP_BODY = {"type": "object", "required": ["email"],
                "properties": {"email": {"type": "string", "format": "email",
                                         "description": "The address that signs up."},
                               _HONEYPOT: {"type": "string", "maxLength": 0,
                                          "description": "the honeypot: leave it empty"}},
                "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
                "description": "'email' and the datasource's fields by name; other names "
                               "are refused."}
#: Bodies of the routes that read their own (the pipeline's are made from
#: the route's parameters).
_SIGNUP_EXAMPLE = {"email": "ann@example.com", _HONEYPOT: ""}
_SIGNUP_REQUEST = {"required": True, "content": {
    "application/x-www-form-urlencoded": {"schema": _SIGNUP_BODY, "example": _SIGNUP_EXAMPLE},
    "application/json": {"schema": _SIGNUP_BODY, "example": _SIGNUP_EXAMPLE}}}


def _index(call):
    """What this API is and where to start: the version, the OpenAPI document
    and a collection for every kind the route table lists (GET
    /{kind}/all), as references relative to the index's own URL (``/v1/``),
    so they hold under any mount prefix or proxy.  A browser gets them as
    links above the envelope."""
    collections = {kind: f"{kind}/all" for kind in _collections(call.service.routes)}
    data = {"name": "campaignapi", "version": __version__, "openapi": "openapi.json",
            "collections": collections}
    if not _prefers_html(_request_header("Accept")):
        return data
    links = [("openapi.json", "The OpenAPI document (openapi.json)"),
             *((href, f"{kind}: every record (needs a key)") for kind, href in collections.items())]
    return bottle.HTTPResponse(_respond(200, _envelope(call.response_id, True, data),
                                        page=(f"campaignapi {__version__}", links)),
                               200, {"Content-Type": "text/html; charset=utf-8"})


_COLLECTION = re.compile(r"/(\w+)/\{id:[\w|]*\ball\b[\w|]*\}")


def _collections(routes):
    """The kinds ``routes`` serve a listing of (GET /{kind}/{id:...all...}), in table order."""
    found = (_COLLECTION.fullmatch(route.path) for route in routes if route.method == "GET")
    return list(dict.fromkeys(match[1] for match in found if match))


#: The collections every API has (others come with the route table).
_INDEX_COLLECTIONS = ("datasource", "message", "segment", "accountprofile", "template",
                      "campaign", "webhook")
_URI_REFERENCE = {"type": "string", "format": "uri-reference"}
_INDEX_ANSWER = {"type": "object", "required": ["name", "version", "openapi", "collections"],
                 "properties": {
                     "name": {"type": "string"}, "version": {"type": "string"},
                     "openapi": _URI_REFERENCE,
                     "collections": {"type": "object", "required": list(_INDEX_COLLECTIONS),
                                     "additionalProperties": _URI_REFERENCE}}}


# ---------------------------------------------------------------------------
# The route table and create_app()
# ---------------------------------------------------------------------------

# What the bounce routes take and answer, for the OpenAPI document.
_BOUNCE_ANSWER = {"type": "object", "required": ["bounce"], "properties": {"bounce": {
    "type": "object", "required": ["type", "email", "campaign", "batch"],
    "properties": {"type": {"enum": list(_BOUNCE_TYPES)}, "email": {"type": ["string", "null"]},
                   "campaign": {"type": ["string", "null"]},
                   "batch": {"type": ["string", "null"]}}}}}
_RECEIVED_ANSWER = {"type": "object", "required": ["received"],
                    "properties": {"received": {"type": "string", "pattern": "^[0-9]+$"}}}
_RAW_MESSAGE = {"schema": {"type": "string", "format": "binary"}}
#: A raw bounce or feedback email, or the JSON form (described as the
#: pipeline describes any route's parameters).
_BOUNCE_REQUEST = {"required": True, "description": "A whole bounce or feedback email, or the "
                   "parameters as JSON (they may come in the query string instead).",
                   "content": {"message/rfc822": _RAW_MESSAGE, "application/json": _operation(
                       _BOUNCE_JSON)["requestBody"]["content"]["application/json"]}}


def _provider_route(name, handler, summary, what):
    """The route of a provider's callback: public, its body read by the handler."""
    return Route("POST", f"/bounce/{name}", None, handler, reads_body=False, writes=False,
                 summary=summary, answers=_RECEIVED_ANSWER, errors=(401, 404), body={
                     "required": True, "description": what, "content": {"application/json": {
                         "schema": {"oneOf": [
                             {"type": "object", "additionalProperties": True},
                             {"type": "array", "items": {"type": "object",
                                                         "additionalProperties": True}}]}}}})


#: Every route of the API, one line each: (method, path, level, handler[, parameters]).
#: A record kind's operation (DATASOURCE.get, .create, .change, .delete) takes
#: the parameters its kind declares; other handlers list theirs here.  A path
#: placeholder is an integer id unless it lists what it takes ({id:int|all}).
ROUTES = [
    # Datasources and what lives in them
    Route("GET",    "/datasource/{id:int|all|import}", "read", DATASOURCE.get,
          summary="Get datasource (one, all, or the imported ones)"),
    Route("PUT",    "/datasource/{id}", "create", DATASOURCE.create, summary="Create datasource"),
    Route("POST",   "/datasource/{id}", "write",  DATASOURCE.change, summary="Change datasource"),
    Route("DELETE", "/datasource/{id}", "delete", DATASOURCE.delete, summary="Delete datasource"),
    Route("GET",    "/datasource/{parent_id}/recipient/{child_id:int|all}", "read", RECIPIENT.get),
    Route("PUT",    "/datasource/{parent_id}/recipient/{child_id}", "create", RECIPIENT.create),
    Route("POST",   "/datasource/{parent_id}/recipient/{child_id}", "write", RECIPIENT.change),
    Route("DELETE", "/datasource/{parent_id}/recipient/{child_id}", "delete", RECIPIENT.delete,
          summary="Delete (erase) recipient"),
    Route("GET",    "/datasource/{parent_id}/modify/{child_id:name}", "write", _field_modify,
          "new:str! type:" + "|".join(FIELD_TYPES) + "!", writes=True,
          summary="Rename or retype a field", answers=_FIELD_ANSWER),
    Route("GET",    "/datasource/{parent_id}/import/{child_id:int|all}", "read", IMPORT.get),
    # Not one transaction: _import_create() commits in chunks (API.md section 5).
    Route("PUT",    "/datasource/{parent_id}/import/{child_id}", "create", _import_create,
          "name:str! originalfile:str! __uploadtype__:csv|base64|json! __uploaddata__:data!",
          writes=False, changes=True,
          summary="Import recipients", answers=_ANSWER_ID, body_rules=_TEXT_UNLESS_JSON,
          big="__uploaddata__"),
    Route("POST",   "/datasource/{parent_id}/import/{child_id}", "write", IMPORT.change),
    Route("DELETE", "/datasource/{parent_id}/import/{child_id}", "delete", IMPORT.delete),
    # Not one transaction: _run_export() commits its record around the file.
    Route("GET",    "/datasource/{parent_id}/export/{child_id}", "read", _export_get, "",
          changes=True, summary="Export recipients (0: a new export) or get an export"),
    Route("GET",    "/datasource/{parent_id}/organize/{child_id:int|all}", "read", ORGANIZE.get),
    Route("PUT",    "/datasource/{parent_id}/organize/{child_id}", "create", ORGANIZE.create),
    Route("POST",   "/datasource/{parent_id}/organize/{child_id}", "write", ORGANIZE.change),

    # Messages, segments, sender profiles
    Route("GET",    "/message/{id:int|all}", "read", MESSAGE.get),
    Route("PUT",    "/message/{id}", "create", MESSAGE.create),
    Route("POST",   "/message/{id}", "write",  MESSAGE.change),
    Route("DELETE", "/message/{id}", "delete", MESSAGE.delete),
    Route("GET",    "/segment/{id:int|all}", "read", SEGMENT.get),
    Route("PUT",    "/segment/{id}", "create", SEGMENT.create),
    Route("POST",   "/segment/{id}", "write",  SEGMENT.change),
    Route("DELETE", "/segment/{id}", "delete", SEGMENT.delete),
    Route("GET",    "/accountprofile/{id:int|all}", "read", ACCOUNTPROFILE.get),
    Route("PUT",    "/accountprofile/{id}", "create", ACCOUNTPROFILE.create),
    Route("POST",   "/accountprofile/{id}", "write",  ACCOUNTPROFILE.change),
    Route("DELETE", "/accountprofile/{id}", "delete", ACCOUNTPROFILE.delete),
    Route("GET",    "/template/{id:int|all}", "read", TEMPLATE.get),
    Route("PUT",    "/template/{id}", "create", TEMPLATE.create,
          body_rules={"anyOf": [{"required": ["html"], "properties": {"html": {"minLength": 1}}},
                                {"required": ["text"], "properties": {"text": {"minLength": 1}}}]}),
    Route("POST",   "/template/{id}", "write",  TEMPLATE.change),
    Route("DELETE", "/template/{id}", "delete", TEMPLATE.delete),

    # Campaigns, their messages, structure, verify, sending, archives
    Route("GET",    "/campaign/{id:int|all}", "read", CAMPAIGN.get,
          summary="Get campaign (one or all)"),
    Route("PUT",    "/campaign/{id}", "create", CAMPAIGN.create, summary="Create campaign"),
    Route("POST",   "/campaign/{id}", "write",  CAMPAIGN.change, summary="Change campaign"),
    Route("DELETE", "/campaign/{id}", "delete", CAMPAIGN.delete, summary="Delete campaign"),
    Route("GET",    "/campaign/{parent_id}/message/{child_id:int|all}", "read", LINK.get),
    Route("PUT",    "/campaign/{parent_id}/message/{child_id}", "create", LINK.create),
    Route("POST",   "/campaign/{parent_id}/message/{child_id}", "write", LINK.change),
    Route("DELETE", "/campaign/{parent_id}/message/{child_id}", "write", LINK.delete),
    Route("GET",    "/campaign/{parent_id}/structure/{child_id}", "read", _campaign_structure_get),
    Route("GET",    "/campaign/{parent_id}/verify/{child_id}", "read", _campaign_verify_get,
          "links:flag"),
    Route("GET",    "/campaign/{parent_id}/preview/{child_id}", "read", _campaign_preview,
          "recipient:scalar", summary="Preview a campaign message as a recipient gets it",
          answers="preview", errors=(409,)),   # 409: no recipient, or an unusable template
    # timestamp is required unless test is given (a test send goes now).
    Route("PUT",    "/campaign/{parent_id}/send/{child_id}", "create", _campaign_send,
          "timestamp:time test:list", summary="Send the campaign (a new batch), or a test send",
          answers=_ANSWER_ID, body_rules={"oneOf": [{"required": ["timestamp"]},
                                                   {"required": ["test"]}]}),
    Route("GET",    "/campaign/{parent_id}/batcharchive/{child_id:int|all}", "read", BATCH.get),
    Route("POST",   "/campaign/{parent_id}/winner/{child_id}", "write", _campaign_winner,
          "link:int! message:int@message!", summary="Choose the winner of an A/B test by hand",
          answers=_ANSWER_DONE, errors=(409,)),
    Route("GET",    "/campaign/{parent_id}/archive/{child_id}", "read", _archive_get),

    # Transactional email: one message to one address now, before campaign mail
    Route("GET",    "/transactional/{id:int|all}", "read", TRANSACTIONAL.get),
    Route("PUT",    "/transactional/{id}", "create", TRANSACTIONAL.create,
          summary="Send a transactional email"),
    # Automations: steps each recipient walks in a run; verify, statistics
    Route("GET",    "/automation/{id:int|all}", "read", AUTOMATION.get),
    Route("PUT",    "/automation/{id}", "create", AUTOMATION.create),
    Route("POST",   "/automation/{id}", "write",  AUTOMATION.change),
    Route("DELETE", "/automation/{id}", "delete", AUTOMATION.delete),
    Route("GET",    "/automation/{parent_id}/run/{child_id:int|all}", "read", _run_get,
          RUN.params("get"), summary="Get run (one or all)", answers=("run", "run")),
    Route("PUT",    "/automation/{parent_id}/run/{child_id}", "create", _run_start,
          "recipient:int!", summary="Start a run for one recipient by hand", answers=_ANSWER_ID),
    Route("DELETE", "/automation/{parent_id}/run/{child_id}", "delete", _run_cancel, "",
          summary="Cancel a waiting run", answers=_ANSWER_DONE),
    Route("GET",    "/automation/{parent_id}/verify/{child_id}", "read", _automation_verify_get,
          "links:flag", answers=("verify", "automationverify")),
    Route("GET",    "/automation/{parent_id}/archive/{child_id}", "read",
          _automation_archive_get, summary="An automation's statistics",
          answers=("archive", "automationarchive")),

    # Webhooks: stored events posted to services elsewhere, signed
    Route("GET",    "/webhook/{id:int|all}", "read", WEBHOOK.get),
    Route("GET",    "/deliverability/{id}", "read", _deliverability_get, answers="deliverability",
          summary="The service's per-domain rates, their last hour and the warm-up's day"),
    Route("PUT",    "/webhook/{id}", "create", WEBHOOK.create, answers=_ANSWER_WEBHOOK,
          summary="Create webhook (answers its signing secret, once)"),
    Route("POST",   "/webhook/{id}", "write",  WEBHOOK.change),
    Route("DELETE", "/webhook/{id}", "delete", WEBHOOK.delete),

    # Public routes (no key): the index, the OpenAPI document, downloads, unsubscribe
    Route("GET",    "/", None, _index, "", summary="The index of this API",
          answers=_INDEX_ANSWER),
    Route("GET",    "/openapi.json", None, _openapi_get,
          summary="The OpenAPI document of this API", answers=_OPENAPI_ANSWER),
    Route("GET",    "/download/{token:name}", None, _download,
          summary="Download an export's CSV (the link from the export record)",
          answers={"description": "The export as a CSV attachment.",
                   "content": {"text/csv": {"schema": {"type": "string"}}}}),
    Route("GET",    "/unsubscribe/{token:name}", None, _unsubscribe_page, reads_body=False, pages=True,
          summary="The unsubscribe page of a recipient's link", answers=_PAGE_ANSWER),
    Route("POST",   "/unsubscribe/{token:name}", None, _unsubscribe_post, reads_body=False, later=True, pages=True,
          summary="Unsubscribe (the page's button, or RFC 8058 one-click)", answers=_PAGE_ANSWER),
    Route("GET",    "/open/{token:name}", None, _open, reads_body=False, later=True,
          summary="The open image of a tracked email (the same GIF for every token)",
          answers={"description": "A transparent 1x1 GIF, not cached.",
                   "content": {"image/gif": {"schema": {"type": "string"}}}}),
    Route("GET",    "/click/{token:name}", None, _click, reads_body=False, later=True, pages=True,
          summary="A tracked link of an email: redirects to the link's URL",
          answers={"status": 302, "description": "To the URL stored for the link.",
                   "headers": {"Location": {"schema": {"type": "string"}}}}),

    # Bounces and complaints: reported with a key, or by a provider (signed its way)
    Route("POST",   "/bounce", "write", _bounce_post, _BOUNCE_PARAMS, reads_body=False,
          writes=False, summary="Report a bounce or complaint: a raw email, or JSON",
          answers=_BOUNCE_ANSWER, body=_BOUNCE_REQUEST, errors=(404,)),
    _provider_route("ses", _bounce_ses, "Amazon SES bounces and complaints through SNS",
                    "An SNS message (signed)."),
    _provider_route("mailgun", _bounce_mailgun, "Mailgun bounces and complaints",
                    "A Mailgun webhook call (signed)."),
    _provider_route("postmark", _bounce_postmark, "Postmark bounces and spam complaints",
                    "A Postmark webhook call (basic auth)."),
    _provider_route("sendgrid", _bounce_sendgrid, "SendGrid bounces and spam reports",
                    "SendGrid's signed event webhook call."),
    Route("GET",    "/subscribe/{id:name}", None, _signup_form, reads_body=False, pages=True,
          summary="The sign-up form of a datasource (an HTML page)", answers=_PAGE_ANSWER),
    Route("POST",   "/subscribe/{id:name}", None, _signup_post, reads_body=False, later=True, pages=True,
          summary="Sign up to a datasource (a form post or JSON)", answers=_SIGNUP_ANSWER,
          body=_SIGNUP_REQUEST),
    Route("OPTIONS", "/subscribe/{id:name}", None, _subscribe_options, reads_body=False,
          writes=False, summary="CORS preflight of a cross-origin sign-up",
          answers={"description": "An empty answer with the CORS headers.", "content": {}}),
    # Pages people see without a key: the preference centre's per-list leave,
    # the public archive and its feed, report links (API.md section 21)
    Route("POST",   "/unsubscribe/{token:name}/{ds:name}", None, _leave_post, reads_body=False,
          later=True, pages=True, answers=_PAGE_ANSWER,
          summary="Leave one list of the preference centre (the unsubscribe page's button)"),
    Route("GET",    "/archive/{ds}", None, _archive_list, reads_body=False, pages=True,
          summary="The public archive of a sign-up datasource (an HTML page)",
          answers=_PAGE_ANSWER),
    Route("GET",    "/archive/{ds}/feed", None, _archive_feed, reads_body=False, pages=True,
          summary="The public archive as an Atom feed", answers={
              "description": "An Atom feed (RFC 4287): an entry per email.",
              "content": {"application/atom+xml": {"schema": {"type": "string"}}}}),
    Route("GET",    "/archive/{ds}/{batch}", None, _archive_batch, reads_body=False, pages=True,
          summary="One email of the public archive, as sent (an HTML page)",
          answers=_PAGE_ANSWER),
    Route("GET",    "/report/{token:name}", None, _report_page, reads_body=False, pages=True,
          summary="The statistics page of a report link (reporturl), without a key",
          answers=_PAGE_ANSWER),
    Route("GET",    "/confirm/{token:name}", None, _confirm_page, reads_body=False, pages=True,
          summary="The page of a confirmation link, with its confirm button",
          answers=_PAGE_ANSWER),
    Route("POST",   "/confirm/{token:name}", None, _confirm_post, reads_body=False, later=True, pages=True,
          summary="Confirm a sign-up (the page's button)", answers=_PAGE_ANSWER),
]
#: What openapi_document() describes when it is given no routes.
Route.table = ROUTES


# GET /metrics ------------------------------------------------------------------
#
# The Prometheus text format, made by prometheus_client (the extra
# campaignapi[metrics]): its exposition and label escaping are the format's
# reference, and its parser is what the tests read the answer with.  Figures
# that live in the database are read from it at each scrape, so every process
# of several hosts answers the same totals; the request figures are this
# process's own, as Prometheus expects of each target.

class _DatabaseFigures:
    """A prometheus_client collector: the database's figures at each scrape."""

    def __init__(self, db, metrics):
        self.db, self.metrics = db, metrics

    def collect(self):
        gauge, counter = self.metrics.GaugeMetricFamily, self.metrics.CounterMetricFamily
        conn = connect(self.db)
        try:
            def family(kind, name, text, labels, sql, args=()):
                made = kind(name, text, labels=labels)
                for *values, count in conn.execute(sql, args):
                    made.add_metric([str(value) for value in values], count)
                return made

            yield family(gauge, "campaignapi_emails", "Emails in the outbox by kind and status.",
                         ["kind", "status"],
                         "SELECT kind, status, count(*) FROM outbox GROUP BY kind, status")
            yield family(gauge, "campaignapi_outbox_queued",
                         "Outbox emails not yet sent: due, waiting (a retry, a domain's rate, "
                         "the warm-up) or being sent.", ["status"],
                         "SELECT CASE WHEN status = 'sending' THEN 'sending' WHEN next_try <= ? "
                         "THEN 'due' ELSE 'waiting' END AS s, count(*) FROM outbox "
                         "WHERE status IN ('queued', 'sending') GROUP BY s", (_now(),))
            yield family(gauge, "campaignapi_batches", "Batches by status.", ["status"],
                         "SELECT status, count(*) FROM batch GROUP BY status")
            runs = gauge("campaignapi_runs", "Automation runs by status.", labels=["status"])
            if conn.execute(conn.sql["table_exists"], ("run",)).fetchone():
                for status, count in conn.execute(
                        "SELECT status, count(*) FROM run GROUP BY status"):
                    runs.add_metric([status], count)
            yield runs
            yield family(counter, "campaignapi_deferrals", "SMTP deferrals (4xx) by domain.",
                         ["domain"], "SELECT domain, deferred FROM domain_pace WHERE deferred > 0")
            yield family(gauge, "campaignapi_domain_rate",
                         "Each rated domain's rate now, emails a second.", ["domain"],
                         "SELECT domain, coalesce(rate, configured) / unit FROM domain_pace "
                         "WHERE configured IS NOT NULL")
            yield family(gauge, "campaignapi_webhook_deliveries",
                         "Webhook deliveries by outcome.", ["outcome"],
                         "SELECT status, count(*) FROM hook_delivery GROUP BY status")
            yield family(gauge, "campaignapi_imports", "Imports by status.", ["status"],
                         "SELECT status, count(*) FROM import GROUP BY status")
        finally:
            conn.close()


def _metrics_library():
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise ValueError("the setting metrics needs prometheus_client: "
                         "pip install 'campaignapi[metrics]'") from None
    return prometheus_client


def _metrics_route(service):
    """The handler of GET /metrics for ``service``; sets its observe()."""
    metrics = _metrics_library()
    registry = metrics.CollectorRegistry()
    requests = metrics.Counter("campaignapi_http_requests", "HTTP requests answered, by route "
                               "and status.", ["method", "route", "status"], registry=registry)
    seconds = metrics.Histogram("campaignapi_http_request_duration_seconds",
                                "Time to answer an HTTP request, by route.", ["method", "route"],
                                registry=registry)
    registry.register(_DatabaseFigures(service.db, metrics.core))

    def observe(method, route, status, elapsed):
        requests.labels(method, route, str(status)).inc()
        seconds.labels(method, route).observe(elapsed)

    service.observe = observe
    token = service.config["metrics_token"]

    def answer():
        started = time.perf_counter()
        given = _request_header("Authorization") or ""
        if token and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            outcome = Unauthorized("GET /metrics needs Authorization: Bearer with the "
                                   "metrics token.")
        else:
            outcome = bottle.HTTPResponse(metrics.generate_latest(registry), 200,
                                          {"Content-Type": metrics.CONTENT_TYPE_LATEST})
        return service.finish(_new_response_id(), started, outcome, path="/metrics")

    return answer


def _checked_bounce_settings(config):
    """The settings of the bounce routes checked (ValueError naming the one at
    fault), so a wrong one fails at start rather than on a provider's call."""
    domain = config["bounce_domain"]
    if domain and not re.fullmatch(rf"{_EMAIL_LABEL}(?:\.{_EMAIL_LABEL})+", domain):
        raise ValueError(f"bounce_domain must be a domain name such as bounces.example.com, "
                         f"not {domain!r}")
    credentials = config["postmark_credentials"]
    if credentials and ":" not in credentials:
        raise ValueError("postmark_credentials must be USER:PASSWORD")
    if config["sendgrid_public_key"]:
        _load_sendgrid_public_key(config["sendgrid_public_key"])
    arns = config["ses_topic_arns"]
    arns = (arns,) if isinstance(arns, str) else tuple(arns or ())
    for arn in arns:
        if not isinstance(arn, str) or not re.fullmatch(r"arn:[\w.-]+:sns:[\w-]+:\d{12}:[\w-]{1,256}",
                                                        arn):
            raise ValueError(f"ses_topic_arns must be SNS topic ARNs such as "
                             f"arn:aws:sns:us-east-1:123456789012:bounces, not {arn!r}")
    return {**config, "ses_topic_arns": arns}


class _Closing:
    """The Bottle plugin that makes the app's ``close()`` write what it
    holds (opens and clicks written behind their answers) and write every
    later one at once.  It changes no route."""

    api, name = 2, "campaignapi-close"

    def __init__(self, service):
        self.service = service

    def apply(self, callback, route):
        return callback

    def close(self):
        self.service.intake.flush(close=True)


def create_app(db="campaignapi.db", **config):
    """Build the API as a Bottle app (a WSGI callable) over the database ``db``.

    :param db: path of the SQLite file; created with the schema if new.
    :param config: any key of DEFAULT_CONFIG (max_body, public_url, secret).
    :raises ValueError: a bounce setting that cannot work (bounce_domain,
        postmark_credentials, sendgrid_public_key, ses_topic_arns), an
        allowed_hosts pattern that is no host name, or domain_rates, warmup or
        warmup_start that cannot be read.
    """
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"create_app() got unknown settings: {', '.join(sorted(unknown))}")
    config = _checked_bounce_settings({**DEFAULT_CONFIG, **config})
    config["allowed_hosts"] = _checked_hosts(config["allowed_hosts"])
    _Pace(config["domain_rates"], config["warmup"], config["warmup_start"])   # ValueError
    if not isinstance(config["spam_threshold"], (int, float)) or isinstance(
            config["spam_threshold"], bool):
        raise ValueError("spam_threshold must be a number, such as 5.0")
    init_db(db)
    service = _Service(db, config)
    service.sns_fetch, service.sns_cert_host = _fetch_https, _SNS_CERT_HOST
    service.later = _LATER   # the public writes the pipeline may apply later
    app = service.app = bottle.Bottle(catchall=True)
    app.config["campaignapi.service"] = service
    app.default_error_handler = service.bottle_error
    app.install(_Closing(service))   # app.close(): held opens and clicks written
    service.routes = list(ROUTES)
    for route in service.routes:
        app.route(route.rule, route.method,
                  callback=lambda _route=route, **ids: service.dispatch(_route, ids),
                  name=f"{route.method} {route.path}")
    # The root sends people and tools to the index.
    app.route("/", "GET", callback=service.root, name="root")
    if config["metrics"]:   # not an API route of /v1: Prometheus text, not the envelope
        app.route("/metrics", "GET", callback=_metrics_route(service), name="metrics")
    # Last, so that every real route matches first.
    for rule in ("/", "/<path:path>"):
        app.route(rule, "ANY", callback=service.no_route, name=f"no route {rule}")
    # The secret now, not on first use: a public write applies on a second
    # connection, and made then it would wait for the lock that one holds.
    service.secret  # noqa: B018
    service.intake.resume()   # public writes an earlier run kept, applied now
    _fail_interrupted_imports(service.conn())   # imports a process died in
    return app


# ---------------------------------------------------------------------------
# Logging when embedded
# ---------------------------------------------------------------------------

#: The format of the lines that log_to_stderr() and the command line write.
_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class _StderrHandler(logging.StreamHandler):
    """The handler of log_to_stderr(); its class tells a second call it is there."""


def log_to_stderr(level=logging.INFO):
    """Write the ``campaignapi`` log to stderr: one line per request (responseId,
    method, path, status, time), batch and delivery progress, the traceback of
    every 500.

    For an embedded app (gunicorn, waitress-serve, a server of your own): nothing
    configures logging there, and importing this module must not either.  Only the
    ``campaignapi`` logger changes: it gets ``level`` and one handler (a second call
    only sets the level).  The root logger and other libraries' loggers are left
    alone.  An application that configures logging itself needs only the level:
    ``logging.getLogger("campaignapi").setLevel(logging.INFO)``.

    :param level: the lowest level written; ``logging.INFO`` includes the request lines.
    :returns: the handler, e.g. to give it another formatter.
    """
    logger = logging.getLogger("campaignapi")
    logger.setLevel(level)
    for handler in logger.handlers:
        if isinstance(handler, _StderrHandler):
            return handler
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logger.addHandler(handler)
    return handler


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

class _Refused(Exception):
    """A start-up or argument failure: main() prints it as one line on stderr
    and exits with status 2.  Raised before anything is created or changed."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and status 2, like every refusal."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} "
                     f"(see {self.prog} --help)\n")


def _argument_type(check):
    """An argparse ``type`` from ``check(text) -> value``: the ValueError it
    raises becomes the usage error of the option."""
    def convert(text):
        try:
            return check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert


def _whole_number(low, high):
    def check(text):
        try:
            value = int(text) if text.isascii() else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise ValueError(f"must be a whole number from {low} to {high}, not {text!r}")
        return value
    return _argument_type(check)


@_argument_type
def _rate(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):  # NaN fails the comparison too
        raise ValueError(f"must be a number of emails a second above 0, not {text!r}")
    return value


@_argument_type
def _http_url(text):
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.query or parts.fragment or any(c.isspace() or not c.isprintable()
                                                    for c in text)):
        raise ValueError("must be an http:// or https:// URL without a query, such as "
                         f"https://mail.example.com or https://example.com/email, not {text!r}")
    return text.rstrip("/")


@_argument_type
def _address(text):
    address = _normalize_email(text)
    if address is None:
        raise ValueError(f"not a valid email address: {text!r}")
    return address


@_argument_type
def _folder(text):
    if not os.path.isdir(text):
        raise ValueError(f"{text!r} is not a directory")
    return os.path.abspath(text)


@_argument_type
def _smtp(text):
    _smtp_address(text)
    return text


@_argument_type
def _imap(text):
    _server_address(text, "the IMAP server")
    return text


@_argument_type
def _allowed_host(text):
    return _checked_hosts(text)[0]


@_argument_type
def _threshold(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or value != value or abs(value) == float("inf"):
        raise ValueError(f"must be a number such as 5.0, not {text!r}")
    return value


@_argument_type
def _domain_rate(text):
    _parse_domain_rates([text])
    return text


@_argument_type
def _warmup(text):
    return _parse_warmup(text, "")[0]


@_argument_type
def _warmup_start(text):
    _parse_warmup((), text)
    return text


@_argument_type
def _domain(text):
    _checked_bounce_settings({**DEFAULT_CONFIG, "bounce_domain": text})
    return text.lower()


@_argument_type
def _levels(text):
    return ",".join(_parse_levels(text))


@_argument_type
def _expiry(text):
    try:
        day = datetime.date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"must be a date, YYYY-MM-DD, not {text!r}") from None
    if day < datetime.datetime.now(datetime.timezone.utc).date():
        raise ValueError(f"{text} is in the past: the key would never work (the key works "
                         "through the day given, UTC)")
    return text


def _read_schema_version(path):
    """The schema version of the existing file ``path``, read without changing it."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as error:
        raise _Refused(f"--db {path} is not a database campaignapi can open ({error})") from None
    if version > SCHEMA_VERSION:
        raise _Refused(f"--db {path} was made by a newer campaignapi (schema version {version}; "
                       f"this one knows {SCHEMA_VERSION}): upgrade campaignapi to use it")
    if version == 0 and tables:
        raise _Refused(f"--db {path} holds another application's tables, not campaignapi's")
    return version


def _cli_check_database(path, *, must_exist):
    """Refuse ``--db`` before anything is created or changed: a directory, a
    missing or unwritable directory, a file that is not a campaignapi database or
    that a newer version made; with ``must_exist``, a path without a database
    (a typo must not start a worker on a new, empty file).  A ``postgresql://``
    URL is checked by connecting: the server must answer, the database exist."""
    if str(path).startswith(_PG_URL):
        return _cli_check_pg_database(path, must_exist)
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _Refused(f"--db {path} is a directory, not a database file")
    if os.path.exists(path):
        _read_schema_version(path)
        if not os.access(path, os.R_OK | os.W_OK):
            raise _Refused(f"--db {path}: no permission to read and write it")
    elif must_exist:
        raise _Refused(f"--db {path}: there is no database there (serve or key create makes "
                       "one; check the path)")
    elif not os.path.isdir(where):
        missing = "is not a directory" if os.path.exists(where) else "does not exist"
        raise _Refused(f"--db {path}: the directory {where} {missing}")
    try:
        # SQLite creates files beside the database (its journal, the WAL): try
        # it, leaving nothing behind.
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        raise _Refused(f"--db {path}: cannot create files in {where} "
                       f"({error.strerror or error})") from None


def _cli_check_pg_database(url, must_exist):
    """The checks of _cli_check_database() for a PostgreSQL database, read-only."""
    shown = re.sub(r"//[^@/]*@", "//", url)   # never print a password
    try:
        conn = connect(url)
    except RuntimeError as error:
        raise _Refused(str(error)) from None
    except Exception as error:   # psycopg.OperationalError: not imported here
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _Refused(f"--db {shown}: cannot connect ({reason})") from None
    try:
        version = conn.schema_version()
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = "
                              "current_schema()").fetchone()[0]
    finally:
        conn.close()
    if version > SCHEMA_VERSION:
        raise _Refused(f"--db {shown} was made by a newer campaignapi (schema version {version}; "
                       f"this one knows {SCHEMA_VERSION}): upgrade campaignapi to use it")
    if version == 0 and tables:
        raise _Refused(f"--db {shown} holds another application's tables, not campaignapi's")
    if version == 0 and must_exist:
        raise _Refused(f"--db {shown}: there is no campaignapi database there (serve or key "
                       "create makes one; check the URL)")
    return version


@contextlib.contextmanager
def _database_errors(path):
    """What is left after _cli_check_database() (a race, a full disk) as one line."""
    try:
        yield
    except (sqlite3.Error, OSError, RuntimeError) as error:
        raise _Refused(f"--db {path}: {error}") from None
    except Exception as error:
        if not type(error).__module__.startswith("psycopg"):
            raise
        shown = re.sub(r"//[^@/]*@", "//", str(path))
        raise _Refused(f"--db {shown}: {str(error).strip().splitlines()[0]}") from None


def _url_host(host):
    return f"[{host}]" if ":" in host else host


def _claim_port(host, port):
    """Bind ``host:port`` as waitress will (every address of the name,
    SO_REUSEADDR, IPv6 sockets IPv6 only), so that a port in use is refused
    before anything is created or printed.  Answers ``(sockets, port)``, the port
    being the one found when ``port`` is 0; the caller closes the sockets just
    before waitress binds (waitress.serve takes a host and port)."""
    try:
        found = socket.getaddrinfo(None if host == "*" else host, port, socket.AF_UNSPEC,
                                   socket.SOCK_STREAM, socket.IPPROTO_TCP, socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        raise _Refused(f"--host {host}: {getattr(error, 'strerror', None) or error}") from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            if sockets:  # port 0: every address gets the port the first one found
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise _Refused(f"cannot listen on {_url_host(host)}:{port}: "
                       f"{error.strerror or error} (another server there? try another --port)"
                       ) from None
    return sockets, sockets[0].getsockname()[1]


def _new_account_key(db, email):
    """The secret of a first key when the database has no account yet, else None."""
    init_db(db)
    conn = connect(db)
    try:
        if conn.execute("SELECT count(*) FROM account").fetchone()[0]:
            return None
    finally:
        conn.close()
    return create_key(db, email, name="first key")


def _cmd_serve(args):
    options = _worker_options(args)
    if args.metrics:
        try:
            _metrics_library()
        except ValueError as error:
            raise _Refused(f"--metrics: {error}") from None
    _cli_check_database(args.db, must_exist=False)
    sockets, port = _claim_port(args.host, args.port)
    try:
        options["public_url"] = args.public_url or f"http://{_url_host(args.host)}:{port}"
        # --allowed-host without --public-url: links follow the request's host.
        public_url = "" if args.allowed_host and not args.public_url else options["public_url"]
        with _database_errors(args.db):
            secret = _new_account_key(args.db, args.email)
            pace = {name: options[name] for name in ("domain_rates", "warmup", "warmup_start")}
            app = create_app(args.db, public_url=public_url, max_body=args.max_body, **pace,
                             spamassassin=args.spamassassin, spam_threshold=args.spam_threshold,
                             metrics=args.metrics, metrics_token=args.metrics_token,
                             allowed_hosts=tuple(args.allowed_host or ()),
                             webhook_allow_private=args.webhook_allow_private,
                             templates_dir=args.templates_dir or "", signup_rate=args.signup_rate,
                             **_bounce_settings(args))
    finally:
        for sock in sockets:
            sock.close()
    if secret:
        print(f"New database {args.db}: account {args.email} with a full-access API key.")
        print("Keep this secret; it is shown only once:")
        print(secret)
    print(f"campaignapi {__version__} serving {args.db} on "
          f"http://{_url_host(args.host)}:{port}/v1/", flush=True)
    import waitress
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(args.db, stop), kwargs=options,
                              name="campaignapi-worker", daemon=True)
    worker.start()
    _stop_on_sigterm(lambda: _raise(KeyboardInterrupt))
    try:
        # waitress buffers a whole body before the app sees the request, so its
        # own limit is set to ours: a body over it is refused from its
        # Content-Length, unread (waitress refuses at >=, hence the + 1).
        waitress.serve(app, host=args.host, port=port, threads=args.threads,
                       ident="campaignapi", max_request_body_size=args.max_body + 1,
                       **_connection_settings(args.connection_limit, args.channel_timeout,
                                              listeners=len(sockets)))
    except KeyboardInterrupt:
        pass
    except OSError as error:  # only if another process took the port since _claim_port
        raise _Refused(f"cannot listen on {_url_host(args.host)}:{port}: "
                       f"{error.strerror or error}") from None
    finally:
        app.close()   # the opens and clicks answered and still held, written now
        stop.set()
        worker.join(timeout=60)


def _connection_settings(limit, timeout, listeners):
    """waitress's settings of client connections from serve's options.

    waitress counts its listening sockets and its wake-up pipe among the
    connections it holds, so they are added: ``--connection-limit N`` holds N
    clients.  It looks for idle connections every ``cleanup_interval``
    seconds (30 by default, longer than a short timeout), so here every half
    timeout: an idle connection is closed 1 to 1.5 timeouts after its last
    byte.  poll() rather than select(), which fails past file descriptor 1023.
    """
    return {"connection_limit": limit + listeners + 1, "channel_timeout": timeout,
            "cleanup_interval": max(1, min(30, timeout // 2)), "asyncore_use_poll": True}


def _raise(error):
    raise error


def _stop_on_sigterm(action):
    """SIGTERM (a service manager stopping us) ends the process like Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: action())


def _bounce_settings(args):
    """create_app() settings of the bounce routes from serve's options."""
    settings = {"bounce_domain": args.bounce_domain or "",
                "mailgun_signing_key": args.mailgun_signing_key or "",
                "postmark_credentials": args.postmark_credentials or "",
                "sendgrid_public_key": args.sendgrid_public_key or "",
                "ses_topic_arns": tuple(args.ses_topic_arn or ())}
    for name, value in settings.items():
        try:
            _checked_bounce_settings({**DEFAULT_CONFIG, name: value})
        except ValueError as error:
            option = "--ses-topic-arn" if name == "ses_topic_arns" else "--" + name.replace("_", "-")
            raise _Refused(f"{option}: {error}") from None
    return settings


def _cmd_bounces(args):
    options = _mailbox_options(args)
    _cli_check_database(args.db, must_exist=True)
    with _database_errors(args.db):
        init_db(args.db)
        try:
            counts = process_bounce_mailbox(args.db, **options)
        except MailboxError as error:
            raise _Refused(str(error)) from None
    print(f"{counts['processed']} processed and deleted, {counts['left']} left in "
          f"{options['folder']}")


def _cmd_worker(args):
    options = _worker_options(args)
    _cli_check_database(args.db, must_exist=True)
    with _database_errors(args.db):
        init_db(args.db)
    stop = threading.Event()
    _stop_on_sigterm(stop.set)
    print(f"campaignapi {__version__} worker on {args.db}, "
          + (f"delivering through {args.smtp}" if args.smtp else "no --smtp: the outbox fills")
          + (f", reading the bounce mailbox at {args.imap} every minute" if args.imap else ""),
          flush=True)
    try:
        run_worker(args.db, stop, **options)
    except KeyboardInterrupt:
        stop.set()


def _add_mailbox_options(parser, required=False):
    group = parser.add_argument_group(
        "the bounce mailbox" + ("" if required else ", read every minute (default: none)"))
    group.add_argument("--imap", required=required, default=None, type=_imap, metavar="HOST:PORT",
                       help="the IMAP server of the mailbox bounces arrive in, e.g. "
                            "imap.example.com:993 with --ssl")
    group.add_argument("--user", default=None, metavar="NAME", help="the mailbox's login")
    group.add_argument("--password", default=os.environ.get("CAMPAIGNAPI_IMAP_PASSWORD"),
                       metavar="PASSWORD", help="default: $CAMPAIGNAPI_IMAP_PASSWORD")
    group.add_argument("--folder", default="INBOX", help="default: %(default)s")
    group.add_argument("--ssl", action="store_true",
                       help="IMAPS, TLS from the start, certificate checked (default: plain)")


def _mailbox_options(args):
    """process_bounce_mailbox() keyword arguments, or None without --imap."""
    if not args.imap:
        if args.user or args.ssl or args.folder != "INBOX":
            raise _Refused("--user, --folder and --ssl are options of the bounce mailbox: "
                           "give --imap HOST:PORT too")
        return None
    if not args.user or args.password is None:
        raise _Refused("the bounce mailbox needs --user and --password (or "
                       "$CAMPAIGNAPI_IMAP_PASSWORD) with --imap")
    try:
        _imap_quote(args.folder)
    except MailboxError as error:
        raise _Refused(f"--folder: {error}") from None
    return {"imap": args.imap, "user": args.user, "password": args.password,
            "folder": args.folder, "ssl": args.ssl}


def _add_delivery_options(parser):
    group = parser.add_argument_group("delivery (without --smtp the outbox fills and waits)")
    group.add_argument("--smtp", default=None, type=_smtp, metavar="HOST:PORT",
                       help="the SMTP relay, e.g. 127.0.0.1:25 or [::1]:587 (default: none)")
    group.add_argument("--starttls", action="store_true",
                       help="upgrade the SMTP connection with STARTTLS (default: off)")
    group.add_argument("--smtp-user", default=None, metavar="NAME",
                       help="SMTP login (default: none, no login)")
    group.add_argument("--smtp-password", default=os.environ.get("CAMPAIGNAPI_SMTP_PASSWORD"),
                       metavar="PASSWORD", help="default: $CAMPAIGNAPI_SMTP_PASSWORD")
    group.add_argument("--connections", type=_whole_number(1, 1000), default=1, metavar="N",
                       help="parallel SMTP connections, 1 to 1000 (default: %(default)s)")
    group.add_argument("--rate", type=_rate, default=None, metavar="R",
                       help="at most R emails a second over all connections, e.g. 50 or 0.5 "
                            "(default: no limit)")
    group.add_argument("--mail-from", default=None, type=_address, metavar="ADDR",
                       help="sender of notifications and archive copies "
                            "(default: campaignapi@HOSTNAME)")
    group.add_argument("--dkim-domain", default=None, metavar="DOMAIN",
                       help="sign every email with DKIM as this domain; needs --dkim-selector "
                            "and --dkim-key (default: no signing)")
    group.add_argument("--dkim-selector", default=None, metavar="SELECTOR",
                       help="the public key is published at SELECTOR._domainkey.DOMAIN")
    group.add_argument("--dkim-key", default=None, metavar="PATH",
                       help="the RSA private key, PEM")
    parser.add_argument("--webhook-allow-private", action="store_true",
                        help="webhook URLs may point at loopback and private addresses "
                             "(never at cloud metadata ones) (default: off)")
    parser.add_argument("--templates-dir", default=None, type=_folder, metavar="DIR",
                        help="where template files named by a campaign's defaulttemplate live "
                             "(NAME.html, NAME.txt) (default: none, template records only)")
    group.add_argument("--domain-rate", action="append", default=None, type=_domain_rate,
                       metavar="DOMAIN=N/UNIT",
                       help="at most N emails a second, minute or hour (UNIT s, m or h) to the "
                            "addresses of DOMAIN (* for every other domain), counted with every "
                            "worker of the database; repeatable (default: no limit)")
    group.add_argument("--warmup", default=None, type=_warmup, metavar="N,N,...",
                       help="daily caps of campaign and automation emails, day by day from "
                            "--warmup-start (default: none)")
    group.add_argument("--warmup-start", default=None, type=_warmup_start, metavar="YYYY-MM-DD",
                       help="the first day of --warmup (default: the day of the first campaign "
                            "email)")
    group.add_argument("--bounce-domain", default=None, type=_domain, metavar="DOMAIN",
                       help="VERP: each campaign email's envelope sender is bounces+TOKEN@DOMAIN, "
                            "so a later bounce names its email (default: none)")


#: What a DKIM key must be able to sign at start-up (so a bad key fails there).
_DKIM_PROBE = b"From: probe@example.com\r\nSubject: probe\r\n\r\nprobe\r\n"


def _dkim_settings(domain, selector, path):
    """``(domain, selector, key)`` for deliver(), once a probe email is signed."""
    try:
        with open(path, "rb") as f:
            key = f.read()
    except OSError as error:
        raise _Refused(f"--dkim-key {path}: {error.strerror or error}") from None
    try:
        import dkim
    except ImportError:
        raise _Refused("DKIM signing needs dkimpy: pip install 'campaignapi[dkim]'") from None
    try:
        dkim_signer(domain, selector, key)(_DKIM_PROBE)
    except (ValueError, dkim.DKIMException) as error:
        raise _Refused(f"--dkim-key {path} cannot sign for {domain!r} with selector "
                       f"{selector!r}: {error or type(error).__name__}") from None
    return domain, selector, key


def _worker_options(args):
    """run_worker() keyword arguments from the command line."""
    dkim = None
    given = [args.dkim_domain, args.dkim_selector, args.dkim_key]
    if any(given):
        if not all(given):
            raise _Refused("DKIM needs --dkim-domain, --dkim-selector and --dkim-key together")
        dkim = _dkim_settings(*given)
    return {"smtp": args.smtp, "starttls": args.starttls, "username": args.smtp_user,
            "password": args.smtp_password, "connections": args.connections, "rate": args.rate,
            "mail_from": args.mail_from, "dkim": dkim, "public_url": args.public_url or "",
            "webhook_allow_private": args.webhook_allow_private,
            "templates_dir": args.templates_dir or "",
            "bounce_domain": args.bounce_domain or "", "bounce_mailbox": _mailbox_options(args),
            **_pace_settings(args)}


def _pace_settings(args):
    """The deliverability settings of the command line (serve and worker)."""
    return {"domain_rates": tuple(args.domain_rate or ()), "warmup": args.warmup or (),
            "warmup_start": args.warmup_start or ""}


def _cmd_key(args):
    _cli_check_database(args.db, must_exist=args.action != "create")
    with _database_errors(args.db):
        if args.action == "create":
            secret = create_key(args.db, args.email, args.levels, args.name, args.expires)
        elif args.action == "list":
            keys = list_keys(args.db)
        elif not revoke_key(args.db, args.id):
            raise _Refused(f"there is no key {args.id} in {args.db} (key list shows the ids)")
    if args.action == "create":
        print(f"Key for {args.email} ({args.levels}); the secret is shown only once:")
        print(secret)
    elif args.action == "list":
        for key in keys:
            state = "revoked" if key["revoked"] else f"expires {key['expires'] or 'never'}"
            print(f"{key['id']}\t{key['email']}\t{key['levels']}\t{key['name']}\t{state}")
    else:
        print(f"Key {args.id} revoked.")


def main(argv=None):
    """The command line: ``serve`` (the default), ``worker``, ``key create|list|revoke``.

    Every start-up and argument failure is one line on stderr and exit status 2,
    before anything is created.

    :param argv: the arguments (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "worker", "key", "bounces", "-h", "--help",
                                   "--version"):
        argv.insert(0, "serve")
    parser = _ArgumentParser(prog="campaignapi", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the API (the default command)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 or :: for every interface "
                            "(default: %(default)s)")
    serve.add_argument("--port", type=_whole_number(0, 65535), default=8080,
                       help="TCP port; 0 takes a free one (default: %(default)s)")
    serve.add_argument("--db", default="campaignapi.db", metavar="PATH",
                       help="the SQLite file or a postgresql:// URL; a new one gets the schema, "
                            "an account and a key (default: %(default)s)")
    serve.add_argument("--public-url", default=None, type=_http_url, metavar="URL",
                       help="base URL of the API as the outside world sees it, for links in "
                            "emails (default: http://HOST:PORT)")
    serve.add_argument("--allowed-host", action="append", default=None, type=_allowed_host,
                       metavar="HOST",
                       help="without --public-url: links are built from a request's Host (or "
                            "X-Forwarded-Host) when it is this host; .example.com: the domain "
                            "and its subdomains, *: any; others get 400 invalid_host; "
                            "repeatable (default: none, links use http://HOST:PORT)")
    serve.add_argument("--threads", type=_whole_number(1, 1000), default=8, metavar="N",
                       help="waitress threads answering requests, 1 to 1000 "
                            "(default: %(default)s)")
    serve.add_argument("--max-body", type=_whole_number(1, 2**40), metavar="BYTES",
                       default=DEFAULT_CONFIG["max_body"],
                       help="largest request body; waitress answers a larger one with a "
                            "plain-text 413 before reading it (default: %(default)s, 64 MiB)")
    # waitress holds 100 connections for 120 s: a hundred clients that send
    # half a request and wait shut everyone else out (README, Deployment).
    serve.add_argument("--connection-limit", type=_whole_number(1, 100000), metavar="N",
                       default=500,
                       help="client connections held at once, more wait to be accepted; each "
                            "is a file descriptor, so keep it under ulimit -n "
                            "(default: %(default)s)")
    serve.add_argument("--channel-timeout", type=_whole_number(1, 86400), metavar="SECONDS",
                       default=30,
                       help="a connection that has sent nothing for this long, halfway through "
                            "a request too, is closed unless it awaits its answer "
                            "(default: %(default)s)")
    serve.add_argument("--signup-rate", type=_whole_number(0, 10**6), metavar="N",
                       default=DEFAULT_CONFIG["signup_rate"],
                       help="public sign-ups taken from one client address a minute; 0: no "
                            "limit (default: %(default)s)")
    # A reserved domain (RFC 2606): notifications go nowhere until the holder
    # starts the first time with --email, which is what a real install does.
    serve.add_argument("--email", default="admin@example.com", type=_address, metavar="ADDR",
                       help="account address used when the database is new, where import "
                            "and export notifications go (default: %(default)s)")
    _add_delivery_options(serve)
    _add_mailbox_options(serve)
    checks = serve.add_argument_group("deliverability: verify's spam check, GET /metrics")
    checks.add_argument("--spamassassin", default="", metavar="PATH",
                        help="the SpamAssassin program verify scores emails with, spamc or "
                             "spamassassin (default: spamc when a spamd answers, else "
                             "spamassassin, from the PATH; none: the check is skipped)")
    checks.add_argument("--spam-threshold", type=_threshold, metavar="SCORE",
                        default=DEFAULT_CONFIG["spam_threshold"],
                        help="verify's spam check fails at or above this score "
                             "(default: %(default)s)")
    checks.add_argument("--metrics", action="store_true",
                        help="serve GET /metrics in the Prometheus text format (needs "
                             "campaignapi[metrics]) (default: off)")
    checks.add_argument("--metrics-token", default=os.environ.get("CAMPAIGNAPI_METRICS_TOKEN", ""),
                        metavar="TOKEN", help="GET /metrics asks for Authorization: Bearer "
                                              "TOKEN (default: $CAMPAIGNAPI_METRICS_TOKEN; "
                                              "none: no key)")
    providers = serve.add_argument_group("provider callbacks of bounces and complaints "
                                         "(each route answers 404 until its option is given)")
    providers.add_argument("--mailgun-signing-key", default=None, metavar="KEY",
                           help="enables /v1/bounce/mailgun")
    providers.add_argument("--postmark-credentials", default=None, metavar="USER:PASSWORD",
                           help="enables /v1/bounce/postmark (HTTP basic auth)")
    providers.add_argument("--sendgrid-public-key", default=None, metavar="KEY",
                           help="base64 DER or PEM; enables /v1/bounce/sendgrid")
    providers.add_argument("--ses-topic-arn", action="append", default=None, metavar="ARN",
                           help="an SNS topic accepted at /v1/bounce/ses; repeatable")
    serve.set_defaults(func=_cmd_serve)

    worker = commands.add_parser("worker", help="make due batches and deliver the outbox, alone")
    worker.add_argument("--db", default="campaignapi.db", metavar="PATH",
                        help="the SQLite file or a postgresql:// URL; it must exist "
                             "(default: %(default)s)")
    worker.add_argument("--public-url", default=None, type=_http_url, metavar="URL",
                        help="base URL of unsubscribe links when a batch has none "
                             "(default: none)")
    _add_delivery_options(worker)
    _add_mailbox_options(worker)
    worker.set_defaults(func=_cmd_worker)

    bounces = commands.add_parser("bounces", help="read the bounce mailbox once: apply and "
                                                   "delete each bounce and complaint")
    bounces.add_argument("--db", default="campaignapi.db", metavar="PATH",
                         help="the database; it must exist (default: %(default)s)")
    _add_mailbox_options(bounces, required=True)
    bounces.set_defaults(func=_cmd_bounces)

    key = commands.add_parser("key", help="issue, list and revoke API keys")
    actions = key.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="issue a key; prints the secret last")
    create.add_argument("--email", required=True, type=_address, metavar="ADDR",
                        help="the account holder's address; a new one makes the account")
    create.add_argument("--levels", default=",".join(LEVELS), type=_levels,
                        help="any of read,write,create,delete (default: %(default)s)")
    create.add_argument("--name", default="", help="a label for the key (default: none)")
    create.add_argument("--expires", default=None, type=_expiry, metavar="YYYY-MM-DD",
                        help="the last day the key works, UTC; today or later "
                             "(default: never)")
    listing = actions.add_parser("list", help="list keys (never their secrets)")
    revoke = actions.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("id", type=_whole_number(1, MAX_ID), help="the id that key list shows")
    create.add_argument("--db", default="campaignapi.db", metavar="PATH",
                        help="the database; created if missing (default: %(default)s)")
    for sub in (listing, revoke):
        sub.add_argument("--db", default="campaignapi.db", metavar="PATH",
                         help="the database; it must exist (default: %(default)s)")
    key.set_defaults(func=_cmd_key)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    # flufl.bounce logs each detector's guess at INFO: noise on every bounce.
    logging.getLogger("flufl.bounce").setLevel(logging.WARNING)
    try:
        args.func(args)
    except _Refused as refusal:
        command = " ".join(filter(None, (args.command, getattr(args, "action", None))))
        print(f"campaignapi {command}: error: {' '.join(str(refusal).split())}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
